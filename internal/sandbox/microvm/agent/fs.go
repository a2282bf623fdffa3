package agent

import (
	"errors"
	"fmt"
	"io"
	"os"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/files"
)

// The files API inside the guest: the same package the edge uses on a
// container's rootfs (files, confined with openat2), here on the
// sandbox's root as the guest sees it. Errors travel as errdefs codes
// and are rebuilt on the host.

// fs runs m's file operation; its data and answer go out on c.
func (s *Server) fs(c *conn, m Msg) {
	s.mu.Lock()
	root, upper, upperFS := s.files, s.upper, s.upperFS
	s.mu.Unlock()
	fail := func(err error) {
		c.send(Msg{ID: m.ID, Op: "exit", Error: err.Error(), Kind: errdefs.Code(err)})
	}
	if m.FS.Method == "diff_out" {
		root = upper
	}
	if root == nil {
		fail(errdefs.Precondition("the sandbox is not set up"))
		return
	}
	q := *m.FS
	var owner *files.Owner
	if q.Owner != "" {
		cred, _, err := resolveUser(Root, q.Owner, nil)
		if err != nil {
			fail(errdefs.Invalid("owner %q: %v", q.Owner, err))
			return
		}
		owner = &files.Owner{UID: int(cred.Uid), GID: int(cred.Gid)}
	}
	done := func(res FSResult) { c.send(Msg{ID: m.ID, Op: "exit", FSResult: &res}) }
	out := &chunkWriter{c: c, id: m.ID}
	switch q.Method {
	case "read":
		rc, fe, err := root.ReadFile(q.Path)
		if err != nil {
			fail(err)
			return
		}
		go func() {
			defer rc.Close()
			c.send(Msg{ID: m.ID, Op: "started", FSResult: &FSResult{Entry: &fe}})
			if _, err := io.Copy(out, rc); err != nil {
				fail(err)
				return
			}
			done(FSResult{})
		}()
	case "tar_out":
		go func() {
			c.send(Msg{ID: m.ID, Op: "started"})
			if err := root.WriteTar(q.Path, out); err != nil {
				fail(err)
				return
			}
			done(FSResult{})
		}()
	case "diff_out":
		// The writable layer, frozen while it is read: the sandbox's
		// writes wait, so the layer is one moment's.
		go func() {
			thaw, err := freezeFS(upperFS)
			if err != nil {
				fail(err)
				return
			}
			defer thaw()
			c.send(Msg{ID: m.ID, Op: "started"})
			if err := root.WriteDiffTar("/", out); err != nil {
				fail(err)
				return
			}
			done(FSResult{})
		}()
	case "write", "tar_in":
		// The data comes as stdin, queued like a process's and read
		// from a pipe; an upload the host gives up on (stdin_abort, or
		// its connection going) fails the call instead of ending it.
		pr, pw := io.Pipe()
		p := &proc{wake: make(chan struct{}, 1)}
		s.mu.Lock()
		s.procs[m.ID] = p
		s.mu.Unlock()
		go p.feed(pw)
		go func() {
			defer func() {
				pr.Close()
				p.input(true, nil)
				s.mu.Lock()
				delete(s.procs, m.ID)
				s.mu.Unlock()
			}()
			if q.Method == "write" {
				_, err := root.WriteFile(q.Path, pr, os.FileMode(q.Mode), q.MaxBytes, owner)
				if err != nil {
					fail(err)
					return
				}
				fe, err := root.Stat(q.Path)
				if err != nil {
					fail(err)
					return
				}
				done(FSResult{Entry: &fe})
				return
			}
			tr, err := root.ExtractTar(q.Path, pr, files.TarOptions{MaxBytes: q.MaxBytes, MaxFiles: q.MaxFiles, Owner: owner})
			if err != nil {
				fail(err)
				return
			}
			done(FSResult{Tar: &tr})
		}()
	case "stat":
		fe, err := root.Stat(q.Path)
		if err != nil {
			fail(err)
			return
		}
		done(FSResult{Entry: &fe})
	case "list":
		ents, err := root.List(q.Path, q.Depth)
		if err != nil {
			fail(err)
			return
		}
		done(FSResult{Entries: ents})
	case "remove":
		if err := root.Remove(q.Path, q.Recursive); err != nil {
			fail(err)
			return
		}
		done(FSResult{})
	case "mkdir":
		fe, err := root.Mkdir(q.Path, owner)
		if err != nil {
			fail(err)
			return
		}
		done(FSResult{Entry: &fe})
	case "rename":
		fe, err := root.Rename(q.Path, q.Dest)
		if err != nil {
			fail(err)
			return
		}
		done(FSResult{Entry: &fe})
	case "watch":
		c.wmu.Lock()
		n := len(c.watches)
		c.wmu.Unlock()
		if n >= MaxWatches {
			fail(errdefs.Exhausted("the agent has %d directory watches on this connection, the most it keeps", n))
			return
		}
		// The first scan can take a while: not on the reader.
		go func() {
			w, err := root.Watch(q.Path, q.Depth, q.MaxFiles)
			if err != nil {
				fail(err)
				return
			}
			c.wmu.Lock()
			n := len(c.watches)
			if n < MaxWatches {
				c.watches[m.ID] = &watch{w: w}
			}
			c.wmu.Unlock()
			if n >= MaxWatches {
				fail(errdefs.Exhausted("the agent has %d directory watches on this connection, the most it keeps", n))
				return
			}
			done(FSResult{Watch: m.ID})
		}()
	case "watch_poll":
		c.wmu.Lock()
		w := c.watches[q.Watch]
		c.wmu.Unlock()
		if w == nil {
			fail(errdefs.NotFound("no directory watch %d", q.Watch))
			return
		}
		go func() {
			w.mu.Lock()
			evs, err := w.w.Poll()
			w.mu.Unlock()
			if err != nil {
				fail(err)
				return
			}
			done(FSResult{Events: evs})
		}()
	case "watch_stop":
		c.wmu.Lock()
		delete(c.watches, q.Watch)
		c.wmu.Unlock()
		done(FSResult{})
	default:
		fail(errdefs.Invalid("unknown file method %q", q.Method))
	}
}

// watch is a directory watch a connection started; its polls take turns.
type watch struct {
	mu sync.Mutex
	w  *files.Watch
}

// chunkWriter sends what is written to it as "stdout" messages of at most
// ChunkSize.
type chunkWriter struct {
	c  *conn
	id uint64
}

func (w *chunkWriter) Write(p []byte) (int, error) {
	n := len(p)
	for len(p) > 0 {
		k := min(len(p), ChunkSize)
		if !w.c.sendData(w.id, "stdout", append([]byte(nil), p[:k]...)) {
			return 0, errors.New("the host gave up on the operation")
		}
		p = p[k:]
	}
	if w.c.failed() {
		return 0, errors.New("the host's connection is gone")
	}
	return n, nil
}

// FIFREEZE and FITHAW (linux/fs.h: _IOWR('X', 119, int), _IOWR('X', 120, int)).
const (
	fiFreeze = 0xc0045877
	fiThaw   = 0xc0045878
)

// freezeFS freezes the filesystem mounted at dir (writes to it wait,
// its dirty data is on disk) and returns what thaws it; "" freezes
// nothing.
func freezeFS(dir string) (thaw func(), err error) {
	if dir == "" {
		return func() {}, nil
	}
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("freezing the writable disk: %w", err)
	}
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), fiFreeze, 0); e != 0 {
		unix.Close(fd)
		if e == unix.EBUSY {
			return nil, errdefs.Precondition("the writable disk is frozen already (another snapshot is under way)")
		}
		return nil, fmt.Errorf("freezing the writable disk: %w", e)
	}
	return func() {
		unix.Syscall(unix.SYS_IOCTL, uintptr(fd), fiThaw, 0)
		unix.Close(fd)
	}, nil
}

// openFiles opens the sandbox's root for the file service.
func openFiles(root string) (*files.Root, error) {
	r, err := files.Open(root)
	if err != nil {
		return nil, fmt.Errorf("opening the sandbox's root for files: %w", err)
	}
	return r, nil
}

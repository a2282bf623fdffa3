package edge

import (
	"context"
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/files"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// The files API acts on a running sandbox's rootfs from the host side,
// confined to it by package files, or, for a sandbox whose files the node
// cannot reach (a VM), through its backend's own service of them
// (sandbox.FileServer). Each call marks the sandbox active and goes in the
// command log (a read when the file is opened; its contents never).

// withFiles runs fn on the files of a running sandbox and records the
// call as kind with req; fn fills in the result summary.
func (e *Edge) withFiles(ctx context.Context, id, kind string, req api.LogRequest, fn func(f sandbox.Files, res *api.LogResult) error) error {
	return e.filesCall(ctx, id, kind, req, false, nil, fn)
}

// transfer is withFiles for a call that moves a file's bytes: once the
// sandbox is found it takes one of the node's streams (--max-streams),
// given back when fn returns or, with hold, handed to *hold for the
// caller to give back once the bytes have gone (when fn succeeded).
func (e *Edge) transfer(ctx context.Context, id, kind string, req api.LogRequest, hold *func(), fn func(f sandbox.Files, res *api.LogResult) error) error {
	return e.filesCall(ctx, id, kind, req, true, hold, fn)
}

func (e *Edge) filesCall(ctx context.Context, id, kind string, req api.LogRequest, stream bool, hold *func(), fn func(f sandbox.Files, res *api.LogResult) error) error {
	s, done, err := e.begin(ctx, id)
	if err != nil {
		return err
	}
	defer done()
	release := func() {}
	if stream {
		var ok bool
		if release, ok = e.streams.take(); !ok {
			return e.streamsFull()
		}
	}
	handed := false
	defer func() {
		if !handed {
			release()
		}
	}()
	start := time.Now()
	var res api.LogResult
	f, err := e.filesOf(ctx, s)
	if err == nil {
		err = fn(f, &res)
	}
	e.record(s, kind, start, req, res, err)
	if hold != nil && err == nil {
		*hold, handed = release, true
	}
	return err
}

// filesOf returns sandbox s's files: its backend's service of them where
// the node cannot reach them, else the host-side confined root.
func (e *Edge) filesOf(ctx context.Context, s *sbx) (sandbox.Files, error) {
	s.mu.Lock()
	images, id := s.rec.Images, s.rec.Sandbox.ID
	s.mu.Unlock()
	if images {
		if fs, ok := e.backendOf(s).(sandbox.FileServer); ok {
			return fs.Files(ctx, id)
		}
	}
	r, err := e.root(s)
	if err != nil {
		return nil, err
	}
	return localFiles{r}, nil
}

// localFiles is sandbox.Files on the host's confined view of a rootfs.
type localFiles struct{ r *files.Root }

func (l localFiles) ReadFile(_ context.Context, path string) (io.ReadCloser, api.FileEntry, error) {
	return l.r.ReadFile(path)
}

func (l localFiles) WriteFile(_ context.Context, path string, data io.Reader, mode os.FileMode, maxBytes int64, owner string) (api.FileEntry, error) {
	o, err := fileOwner(l.r, owner)
	if err != nil {
		return api.FileEntry{}, err
	}
	if _, err := l.r.WriteFile(path, data, mode, maxBytes, o); err != nil {
		return api.FileEntry{}, err
	}
	return l.r.Stat(path)
}

func (l localFiles) Stat(_ context.Context, path string) (api.FileEntry, error) {
	return l.r.Stat(path)
}

func (l localFiles) List(_ context.Context, path string, depth int) ([]api.FileEntry, error) {
	return l.r.List(path, depth)
}

func (l localFiles) Remove(_ context.Context, path string, recursive bool) error {
	return l.r.Remove(path, recursive)
}

func (l localFiles) Mkdir(_ context.Context, path, owner string) (api.FileEntry, error) {
	o, err := fileOwner(l.r, owner)
	if err != nil {
		return api.FileEntry{}, err
	}
	return l.r.Mkdir(path, o)
}

func (l localFiles) Rename(_ context.Context, src, dst string) (api.FileEntry, error) {
	return l.r.Rename(src, dst)
}

func (l localFiles) Watch(_ context.Context, path string, depth, maxEntries int) (sandbox.Watcher, error) {
	w, err := l.r.Watch(path, depth, maxEntries)
	if err != nil {
		return nil, err
	}
	return localWatch{w}, nil
}

// localWatch is sandbox.Watcher on files.Watch.
type localWatch struct{ w *files.Watch }

func (l localWatch) Poll(context.Context) ([]api.FileEvent, error) { return l.w.Poll() }
func (l localWatch) Close()                                        {}

func (l localFiles) WriteTar(_ context.Context, path string, w io.Writer) error {
	return l.r.WriteTar(path, w)
}

func (l localFiles) ExtractTar(_ context.Context, path string, rd io.Reader, maxBytes int64, maxFiles int, owner string) (api.TarResult, error) {
	o, err := fileOwner(l.r, owner)
	if err != nil {
		return api.TarResult{}, err
	}
	return l.r.ExtractTar(path, rd, files.TarOptions{MaxBytes: maxBytes, MaxFiles: maxFiles, Owner: o})
}

// ReadFile opens a file for reading. Until the reader is closed it holds
// one of the node's streams (--max-streams), as a download does.
func (e *Edge) ReadFile(ctx context.Context, id, path string) (io.ReadCloser, api.FileEntry, error) {
	var rc io.ReadCloser
	var fe api.FileEntry
	var release func()
	err := e.transfer(ctx, id, api.LogFilesRead, api.LogRequest{Path: path}, &release, func(f sandbox.Files, res *api.LogResult) (err error) {
		rc, fe, err = f.ReadFile(ctx, path)
		if err == nil {
			res.Size = &fe.Size
		}
		return err
	})
	if err != nil {
		return nil, fe, err
	}
	return &releasingReader{ReadCloser: rc, release: release}, fe, nil
}

// releasingReader gives its stream back when closed (once).
type releasingReader struct {
	io.ReadCloser
	release func()
	once    sync.Once
}

func (r *releasingReader) Close() error {
	err := r.ReadCloser.Close()
	r.once.Do(r.release)
	return err
}

// fileOwner resolves the owner a file call names, a user of the sandbox
// (NAME, UID, NAME:GROUP or UID:GID, as Exec's user, from its own
// /etc/passwd and /etc/group), to the host IDs what the call creates
// gets (shifted in a user namespace: files.Root.HostOwner). "" is nil:
// the root's own owner, as before owners could be named. An owner the
// sandbox does not have is invalid, before anything is written.
func fileOwner(r *files.Root, owner string) (*files.Owner, error) {
	if owner == "" {
		return nil, nil
	}
	if err := sandbox.ValidateUser(owner); err != nil {
		return nil, err
	}
	u, err := resolveUser(rootFiles(r), owner)
	if err != nil {
		return nil, err
	}
	o, err := r.HostOwner(u.uid, u.gid)
	if err != nil {
		return nil, fmt.Errorf("owner %q: %w", owner, err)
	}
	return &o, nil
}

// validOwner checks the syntax of a file call's owner ("" is none).
func validOwner(owner string) error {
	if owner == "" {
		return nil
	}
	return sandbox.ValidateUser(owner)
}

// WriteFile writes a file (parents created), bounded by MaxUploadBytes;
// the file and the parents it creates belong to owner (fileOwner).
func (e *Edge) WriteFile(ctx context.Context, id, path string, data io.Reader, mode os.FileMode, owner string) (api.FileEntry, error) {
	var fe api.FileEntry
	if err := e.checkDiskFloor(); err != nil {
		return fe, err
	}
	err := e.transfer(ctx, id, api.LogFilesWrite, api.LogRequest{Path: path, Mode: modeString(mode), User: owner}, nil, func(f sandbox.Files, res *api.LogResult) (err error) {
		if err := validOwner(owner); err != nil {
			return err
		}
		if fe, err = f.WriteFile(ctx, path, data, mode, e.cfg.MaxUploadBytes, owner); err == nil {
			res.Size = &fe.Size
		}
		return err
	})
	return fe, err
}

// StatFile describes one path (symlinks not followed).
func (e *Edge) StatFile(ctx context.Context, id, path string) (api.FileEntry, error) {
	var fe api.FileEntry
	err := e.withFiles(ctx, id, api.LogFilesStat, api.LogRequest{Path: path}, func(f sandbox.Files, res *api.LogResult) (err error) {
		if fe, err = f.Stat(ctx, path); err == nil {
			res.Type, res.Size = fe.Type, &fe.Size
		}
		return err
	})
	return fe, err
}

// ListFiles lists a directory to depth levels.
func (e *Edge) ListFiles(ctx context.Context, id, path string, depth int) ([]api.FileEntry, error) {
	var out []api.FileEntry
	err := e.withFiles(ctx, id, api.LogFilesList, api.LogRequest{Path: path, Depth: depth}, func(f sandbox.Files, res *api.LogResult) (err error) {
		if out, err = f.List(ctx, path, depth); err == nil {
			n := len(out)
			res.Entries = &n
		}
		return err
	})
	return out, err
}

// RemoveFile removes a path.
func (e *Edge) RemoveFile(ctx context.Context, id, path string, recursive bool) error {
	return e.withFiles(ctx, id, api.LogFilesRemove, api.LogRequest{Path: path, Recursive: recursive}, func(f sandbox.Files, _ *api.LogResult) error {
		return f.Remove(ctx, path, recursive)
	})
}

// WriteTar streams a tar of path to w, holding one of the node's streams.
func (e *Edge) WriteTar(ctx context.Context, id, path string, w io.Writer) error {
	return e.transfer(ctx, id, api.LogFilesTarOut, api.LogRequest{Path: path}, nil, func(f sandbox.Files, res *api.LogResult) error {
		cw := &countWriter{w: w}
		err := f.WriteTar(ctx, path, cw)
		res.Bytes = &cw.n
		return err
	})
}

// ExtractTar extracts a tar (or gzip'd tar) into path, bounded by
// MaxUploadBytes. Device nodes are refused and ownership is not taken from
// the archive: uploads come from API callers, not layer builders. What it
// creates belongs to owner (fileOwner).
func (e *Edge) ExtractTar(ctx context.Context, id, path string, rd io.Reader, owner string) (api.TarResult, error) {
	var tr api.TarResult
	if err := e.checkDiskFloor(); err != nil {
		return tr, err
	}
	err := e.transfer(ctx, id, api.LogFilesTarIn, api.LogRequest{Path: path, User: owner}, nil, func(f sandbox.Files, res *api.LogResult) (err error) {
		if err := validOwner(owner); err != nil {
			return err
		}
		tr, err = f.ExtractTar(ctx, path, rd, e.cfg.MaxUploadBytes, 1<<20, owner)
		if err == nil {
			res.Files, res.Bytes = &tr.Files, &tr.Bytes
		}
		return err
	})
	return tr, err
}

// MakeDir creates a directory and its missing parents, which belong to
// owner (fileOwner); one already there is already_exists.
func (e *Edge) MakeDir(ctx context.Context, id, path, owner string) (api.FileEntry, error) {
	var fe api.FileEntry
	err := e.withFiles(ctx, id, api.LogFilesMkdir, api.LogRequest{Path: path, User: owner}, func(f sandbox.Files, res *api.LogResult) (err error) {
		if err := validOwner(owner); err != nil {
			return err
		}
		if fe, err = f.Mkdir(ctx, path, owner); err == nil {
			res.Type = fe.Type
		}
		return err
	})
	return fe, err
}

// MoveFile renames src to dst inside the sandbox, creating dst's missing
// parents.
func (e *Edge) MoveFile(ctx context.Context, id, src, dst string) (api.FileEntry, error) {
	var fe api.FileEntry
	err := e.withFiles(ctx, id, api.LogFilesMove, api.LogRequest{Path: src, Dest: dst}, func(f sandbox.Files, res *api.LogResult) (err error) {
		if fe, err = f.Rename(ctx, src, dst); err == nil {
			res.Type, res.Size = fe.Type, &fe.Size
		}
		return err
	})
	return fe, err
}

// Directory watches (WatchDir) poll: every watchInterval the watched tree
// is scanned through the confined root and compared with the last scan
// (files.Watch), on the host or, for a VM, by its agent (sandbox.Files). An inotify watch from the host would be cheaper, but it
// does not see what a sandbox writes through a mount of its own namespace
// (a private rootfs) or inside a microVM's disk; a scan sees every backend
// alike. The cost is bounded: at most watchMaxEntries names per watch,
// watchMaxDepth levels for a recursive one, maxWatches per sandbox.
const (
	watchInterval   = 200 * time.Millisecond
	watchMaxEntries = 10000
	watchMaxDepth   = 32
	maxWatches      = 16
)

// WatchDir reports the changes below the directory path to emit, after a
// first start event, until ctx ends. A watch is not an operation in
// flight once it has started: it does not keep an idle sandbox from its
// idle timeout, and it ends (unavailable) when the sandbox stops running.
// It goes in the command log once, when it ends, with the number of
// changes it reported.
func (e *Edge) WatchDir(ctx context.Context, id, path string, recursive bool, emit func(api.FileEvent) error) error {
	s, done, err := e.begin(ctx, id)
	if err != nil {
		return err
	}
	start := time.Now()
	req := api.LogRequest{Path: path, Recursive: recursive}
	w, err := e.startWatch(ctx, s, path, recursive)
	done()
	if err != nil {
		e.record(s, api.LogFilesWatch, start, req, api.LogResult{}, err)
		return err
	}
	defer func() {
		w.Close()
		s.mu.Lock()
		s.watches--
		s.mu.Unlock()
	}()
	n := 0
	err = e.runWatch(ctx, s, id, w, emit, &n)
	logged := err
	if ctx.Err() != nil {
		logged = nil // the caller ended it: the normal end of a watch
	}
	e.record(s, api.LogFilesWatch, start, req, api.LogResult{Entries: &n}, logged)
	return err
}

// startWatch counts a new watch of s and takes its first scan.
func (e *Edge) startWatch(ctx context.Context, s *sbx, path string, recursive bool) (sandbox.Watcher, error) {
	s.mu.Lock()
	if s.watches >= maxWatches {
		s.mu.Unlock()
		return nil, errdefs.Exhausted("sandbox %s already has %d directory watches, the most it may have; stop one first", s.rec.Sandbox.ID, maxWatches)
	}
	s.watches++
	s.mu.Unlock()
	depth := 1
	if recursive {
		depth = watchMaxDepth
	}
	f, err := e.filesOf(ctx, s)
	var w sandbox.Watcher
	if err == nil {
		w, err = f.Watch(ctx, path, depth, watchMaxEntries)
	}
	if err != nil {
		s.mu.Lock()
		s.watches--
		s.mu.Unlock()
		return nil, err
	}
	return w, nil
}

// runWatch emits the start event, then polls w until ctx ends or the
// sandbox stops running; n counts the changes emitted.
func (e *Edge) runWatch(ctx context.Context, s *sbx, id string, w sandbox.Watcher, emit func(api.FileEvent) error, n *int) error {
	if err := emit(api.FileEvent{Type: api.FileEventStart}); err != nil {
		return err
	}
	t := time.NewTicker(watchInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
		if err := stillRunning(s, id); err != nil {
			return err
		}
		evs, err := w.Poll(ctx)
		if err != nil {
			// A root closed under the scan means the sandbox stopped.
			if serr := stillRunning(s, id); serr != nil {
				return serr
			}
			return err
		}
		for _, ev := range evs {
			if err := emit(ev); err != nil {
				return err
			}
			*n++
		}
	}
}

// stillRunning fails with unavailable once s is no longer running.
func stillRunning(s *sbx, id string) error {
	s.mu.Lock()
	state, going := s.rec.Sandbox.State, s.going
	s.mu.Unlock()
	if state != api.StateRunning || going {
		return errdefs.Unavailable("sandbox %s is no longer running (%s): the watch ended", id, state)
	}
	return nil
}

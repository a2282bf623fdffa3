package agent

import (
	"context"
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// Files is the sandbox's files served by its agent (the files API of a
// VM): the methods of the edge's files API, each a "fs" request.
type Files struct{ C *Client }

// fsErr rebuilds an error the agent classified.
func fsErr(m Msg) error {
	if m.Error == "" {
		return nil
	}
	if m.Kind == "" || m.Kind == "internal" {
		return fmt.Errorf("the agent: %s", m.Error)
	}
	return errdefs.FromCode(m.Kind, m.Error)
}

// call runs one file operation: in is sent as its data, what it streams
// goes to out (written by the call's deliverer, see Client.Exec); it
// returns the answer.
func (f Files) call(ctx context.Context, q FSRequest, in io.Reader, out io.Writer) (FSResult, error) {
	c := f.C
	done := make(chan Msg, 1)
	cl := &call{reply: make(chan Msg, 1), stdout: out, onExit: func(m Msg) { done <- m }}
	m := Msg{Op: "fs", FS: &q}
	if err := c.register(&m, cl); err != nil {
		return FSResult{}, err
	}
	defer c.forget(m.ID)
	if err := c.send(ctx, m); err != nil {
		return FSResult{}, err
	}
	if in != nil {
		go c.pump(m.ID, in)
	}
	select {
	case r := <-done:
		if err := fsErr(r); err != nil {
			return FSResult{}, err
		}
		if r.FSResult == nil {
			return FSResult{}, nil
		}
		return *r.FSResult, nil
	case <-c.done:
		cl.dq.settle() // nothing is written to out after
		return FSResult{}, c.gone()
	case <-ctx.Done():
		// The agent stops the operation (a stream it sends, e.g. a
		// snapshot's, with its disk frozen meanwhile, ends).
		go c.send(context.Background(), Msg{Op: "kill", Of: m.ID})
		c.forget(m.ID)
		cl.dq.settle() // nothing is written to out after
		return FSResult{}, ctx.Err()
	}
}

func entry(r FSResult) api.FileEntry {
	if r.Entry == nil {
		return api.FileEntry{}
	}
	return *r.Entry
}

// ReadFile opens path; its data streams as the returned reader is read
// (a reader that stops holds up this call alone).
func (f Files) ReadFile(ctx context.Context, path string) (io.ReadCloser, api.FileEntry, error) {
	c := f.C
	pr, pw := io.Pipe()
	started := make(chan Msg, 1)
	cl := &call{reply: started, stdout: pw, onExit: func(m Msg) {
		if err := fsErr(m); err != nil {
			pw.CloseWithError(err)
			select {
			case started <- m: // a failure before any data
			default:
			}
			return
		}
		pw.Close()
	}}
	m := Msg{Op: "fs", FS: &FSRequest{Method: "read", Path: path}}
	if err := c.register(&m, cl); err != nil {
		return nil, api.FileEntry{}, err
	}
	if err := c.send(ctx, m); err != nil {
		c.forget(m.ID)
		return nil, api.FileEntry{}, err
	}
	stop := func() {
		c.forget(m.ID)
		go c.send(context.Background(), Msg{Op: "kill", Of: m.ID})
	}
	go func() {
		select {
		case <-c.done: // a reader does not wait for a connection that is gone
			cl.dq.settle()
			pw.CloseWithError(c.gone())
		case <-cl.dq.delivered:
		}
	}()
	select {
	case r := <-started:
		if err := fsErr(r); err != nil {
			c.forget(m.ID)
			return nil, api.FileEntry{}, err
		}
		if r.Op != "started" || r.FSResult == nil {
			stop()
			pr.Close()
			return nil, api.FileEntry{}, fmt.Errorf("%w: the agent answered %q to a read", ErrGone, r.Op)
		}
		// Closed before its end, the read stops in the guest too.
		return &readStream{PipeReader: pr, stop: stop}, entry(*r.FSResult), nil
	case <-c.done:
		return nil, api.FileEntry{}, c.gone()
	case <-ctx.Done():
		stop()
		pr.Close()
		return nil, api.FileEntry{}, ctx.Err()
	}
}

// readStream is a file's data as ReadFile returns it.
type readStream struct {
	*io.PipeReader
	stop func()
	once sync.Once
}

func (r *readStream) Close() error {
	r.once.Do(r.stop)
	return r.PipeReader.Close()
}

// WriteFile writes path from data (at most maxBytes; parents made),
// owned by owner.
func (f Files) WriteFile(ctx context.Context, path string, data io.Reader, mode os.FileMode, maxBytes int64, owner string) (api.FileEntry, error) {
	r, err := f.call(ctx, FSRequest{Method: "write", Path: path, Mode: uint32(mode), MaxBytes: maxBytes, Owner: owner}, data, nil)
	return entry(r), err
}

// Stat describes path.
func (f Files) Stat(ctx context.Context, path string) (api.FileEntry, error) {
	r, err := f.call(ctx, FSRequest{Method: "stat", Path: path}, nil, nil)
	return entry(r), err
}

// List lists a directory to depth levels.
func (f Files) List(ctx context.Context, path string, depth int) ([]api.FileEntry, error) {
	r, err := f.call(ctx, FSRequest{Method: "list", Path: path, Depth: depth}, nil, nil)
	return r.Entries, err
}

// Remove removes path.
func (f Files) Remove(ctx context.Context, path string, recursive bool) error {
	_, err := f.call(ctx, FSRequest{Method: "remove", Path: path, Recursive: recursive}, nil, nil)
	return err
}

// Mkdir makes a directory and its parents, owned by owner.
func (f Files) Mkdir(ctx context.Context, path, owner string) (api.FileEntry, error) {
	r, err := f.call(ctx, FSRequest{Method: "mkdir", Path: path, Owner: owner}, nil, nil)
	return entry(r), err
}

// Rename moves src to dst.
func (f Files) Rename(ctx context.Context, src, dst string) (api.FileEntry, error) {
	r, err := f.call(ctx, FSRequest{Method: "rename", Path: src, Dest: dst}, nil, nil)
	return entry(r), err
}

// WriteTar writes a tar of path to w.
func (f Files) WriteTar(ctx context.Context, path string, w io.Writer) error {
	_, err := f.call(ctx, FSRequest{Method: "tar_out", Path: path}, nil, w)
	return err
}

// Watch starts a directory watch in the guest (see FSRequest's watch).
func (f Files) Watch(ctx context.Context, path string, depth, maxEntries int) (sandbox.Watcher, error) {
	r, err := f.call(ctx, FSRequest{Method: "watch", Path: path, Depth: depth, MaxFiles: maxEntries}, nil, nil)
	if err != nil {
		return nil, err
	}
	if r.Watch == 0 {
		return nil, fmt.Errorf("the agent: a watch without an id")
	}
	return &Watch{c: f.C, id: r.Watch}, nil
}

// Watch is a directory watch the agent keeps.
type Watch struct {
	c  *Client
	id uint64
}

// Poll returns the changes since the last poll.
func (w *Watch) Poll(ctx context.Context) ([]api.FileEvent, error) {
	r, err := (Files{C: w.c}).call(ctx, FSRequest{Method: "watch_poll", Watch: w.id}, nil, nil)
	return r.Events, err
}

// Close ends the watch in the agent (which ends it anyway with the
// connection).
func (w *Watch) Close() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, _ = (Files{C: w.c}).call(ctx, FSRequest{Method: "watch_stop", Watch: w.id}, nil, nil)
}

// WriteDiff writes the sandbox's writable layer to w as a tar (see
// FSRequest's diff_out). Root in the VM controls what it holds: the
// reader must take it as files.TarOptions.Diff does.
func (f Files) WriteDiff(ctx context.Context, w io.Writer) error {
	_, err := f.call(ctx, FSRequest{Method: "diff_out", Path: "/"}, nil, w)
	return err
}

// ExtractTar extracts a tar (or gzip'd tar) into path.
func (f Files) ExtractTar(ctx context.Context, path string, rd io.Reader, maxBytes int64, maxFiles int, owner string) (api.TarResult, error) {
	r, err := f.call(ctx, FSRequest{Method: "tar_in", Path: path, MaxBytes: maxBytes, MaxFiles: maxFiles, Owner: owner}, rd, nil)
	if r.Tar == nil {
		return api.TarResult{}, err
	}
	return *r.Tar, err
}

package edge

import (
	"context"
	"io"
	"os"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/files"
)

// The files API acts on a running sandbox's rootfs from the host side,
// confined to it by package files. Each call marks the sandbox active and
// goes in the command log (a read when the file is opened; its contents
// never).

// withRoot runs fn on the confined root of a running sandbox and records
// the call as kind with req; fn fills in the result summary.
func (e *Edge) withRoot(ctx context.Context, id, kind string, req api.LogRequest, fn func(r *files.Root, res *api.LogResult) error) error {
	s, done, err := e.begin(ctx, id)
	if err != nil {
		return err
	}
	defer done()
	start := time.Now()
	var res api.LogResult
	r, err := e.root(s)
	if err == nil {
		err = fn(r, &res)
	}
	e.record(s, kind, start, req, res, err)
	return err
}

// ReadFile opens a file for reading.
func (e *Edge) ReadFile(ctx context.Context, id, path string) (io.ReadCloser, api.FileEntry, error) {
	var rc io.ReadCloser
	var fe api.FileEntry
	err := e.withRoot(ctx, id, api.LogFilesRead, api.LogRequest{Path: path}, func(r *files.Root, res *api.LogResult) (err error) {
		rc, fe, err = r.ReadFile(path)
		if err == nil {
			res.Size = &fe.Size
		}
		return err
	})
	return rc, fe, err
}

// WriteFile writes a file (parents created), bounded by MaxUploadBytes.
func (e *Edge) WriteFile(ctx context.Context, id, path string, data io.Reader, mode os.FileMode) (api.FileEntry, error) {
	var fe api.FileEntry
	if err := e.checkDiskFloor(); err != nil {
		return fe, err
	}
	err := e.withRoot(ctx, id, api.LogFilesWrite, api.LogRequest{Path: path, Mode: modeString(mode)}, func(r *files.Root, res *api.LogResult) error {
		if _, err := r.WriteFile(path, data, mode, e.cfg.MaxUploadBytes); err != nil {
			return err
		}
		var err error
		if fe, err = r.Stat(path); err == nil {
			res.Size = &fe.Size
		}
		return err
	})
	return fe, err
}

// StatFile describes one path (symlinks not followed).
func (e *Edge) StatFile(ctx context.Context, id, path string) (api.FileEntry, error) {
	var fe api.FileEntry
	err := e.withRoot(ctx, id, api.LogFilesStat, api.LogRequest{Path: path}, func(r *files.Root, res *api.LogResult) (err error) {
		if fe, err = r.Stat(path); err == nil {
			res.Type, res.Size = fe.Type, &fe.Size
		}
		return err
	})
	return fe, err
}

// ListFiles lists a directory to depth levels.
func (e *Edge) ListFiles(ctx context.Context, id, path string, depth int) ([]api.FileEntry, error) {
	var out []api.FileEntry
	err := e.withRoot(ctx, id, api.LogFilesList, api.LogRequest{Path: path, Depth: depth}, func(r *files.Root, res *api.LogResult) (err error) {
		if out, err = r.List(path, depth); err == nil {
			n := len(out)
			res.Entries = &n
		}
		return err
	})
	return out, err
}

// RemoveFile removes a path.
func (e *Edge) RemoveFile(ctx context.Context, id, path string, recursive bool) error {
	return e.withRoot(ctx, id, api.LogFilesRemove, api.LogRequest{Path: path, Recursive: recursive}, func(r *files.Root, _ *api.LogResult) error {
		return r.Remove(path, recursive)
	})
}

// WriteTar streams a tar of path to w.
func (e *Edge) WriteTar(ctx context.Context, id, path string, w io.Writer) error {
	return e.withRoot(ctx, id, api.LogFilesTarOut, api.LogRequest{Path: path}, func(r *files.Root, res *api.LogResult) error {
		cw := &countWriter{w: w}
		err := r.WriteTar(path, cw)
		res.Bytes = &cw.n
		return err
	})
}

// ExtractTar extracts a tar (or gzip'd tar) into path, bounded by
// MaxUploadBytes. Device nodes are refused and ownership is not taken from
// the archive: uploads come from API callers, not layer builders.
func (e *Edge) ExtractTar(ctx context.Context, id, path string, rd io.Reader) (api.TarResult, error) {
	var tr api.TarResult
	if err := e.checkDiskFloor(); err != nil {
		return tr, err
	}
	err := e.withRoot(ctx, id, api.LogFilesTarIn, api.LogRequest{Path: path}, func(r *files.Root, res *api.LogResult) (err error) {
		tr, err = r.ExtractTar(path, rd, files.TarOptions{MaxBytes: e.cfg.MaxUploadBytes, MaxFiles: 1 << 20})
		if err == nil {
			res.Files, res.Bytes = &tr.Files, &tr.Bytes
		}
		return err
	})
	return tr, err
}

package edge

import (
	"context"
	"io"
	"os"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/files"
)

// The files API acts on a running sandbox's rootfs from the host side,
// confined to it by package files. Each call marks the sandbox active.

// withRoot runs fn on the confined root of a running sandbox.
func (e *Edge) withRoot(id string, fn func(r *files.Root) error) error {
	s, done, err := e.begin(id)
	if err != nil {
		return err
	}
	defer done()
	r, err := e.root(s)
	if err != nil {
		return err
	}
	return fn(r)
}

// ReadFile opens a file for reading.
func (e *Edge) ReadFile(ctx context.Context, id, path string) (io.ReadCloser, api.FileEntry, error) {
	var rc io.ReadCloser
	var fe api.FileEntry
	err := e.withRoot(id, func(r *files.Root) (err error) {
		rc, fe, err = r.ReadFile(path)
		return err
	})
	return rc, fe, err
}

// WriteFile writes a file (parents created), bounded by MaxUploadBytes.
func (e *Edge) WriteFile(ctx context.Context, id, path string, data io.Reader, mode os.FileMode) (api.FileEntry, error) {
	var fe api.FileEntry
	err := e.withRoot(id, func(r *files.Root) error {
		if _, err := r.WriteFile(path, data, mode, e.cfg.MaxUploadBytes); err != nil {
			return err
		}
		var err error
		fe, err = r.Stat(path)
		return err
	})
	return fe, err
}

// StatFile describes one path (symlinks not followed).
func (e *Edge) StatFile(ctx context.Context, id, path string) (api.FileEntry, error) {
	var fe api.FileEntry
	err := e.withRoot(id, func(r *files.Root) (err error) {
		fe, err = r.Stat(path)
		return err
	})
	return fe, err
}

// ListFiles lists a directory to depth levels.
func (e *Edge) ListFiles(ctx context.Context, id, path string, depth int) ([]api.FileEntry, error) {
	var out []api.FileEntry
	err := e.withRoot(id, func(r *files.Root) (err error) {
		out, err = r.List(path, depth)
		return err
	})
	return out, err
}

// RemoveFile removes a path.
func (e *Edge) RemoveFile(ctx context.Context, id, path string, recursive bool) error {
	return e.withRoot(id, func(r *files.Root) error { return r.Remove(path, recursive) })
}

// WriteTar streams a tar of path to w.
func (e *Edge) WriteTar(ctx context.Context, id, path string, w io.Writer) error {
	return e.withRoot(id, func(r *files.Root) error { return r.WriteTar(path, w) })
}

// ExtractTar extracts a tar (or gzip'd tar) into path, bounded by
// MaxUploadBytes. Device nodes are refused and ownership is not taken from
// the archive: uploads come from API callers, not layer builders.
func (e *Edge) ExtractTar(ctx context.Context, id, path string, rd io.Reader) (api.TarResult, error) {
	var res api.TarResult
	err := e.withRoot(id, func(r *files.Root) (err error) {
		res, err = r.ExtractTar(path, rd, files.TarOptions{MaxBytes: e.cfg.MaxUploadBytes, MaxFiles: 1 << 20})
		return err
	})
	return res, err
}

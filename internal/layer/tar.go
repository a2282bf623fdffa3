package layer

import (
	"context"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/cleanup"
	"github.com/dsecproject/dsec/internal/files"
)

// BuildFromTar extracts the tar (or gzip'd tar) r into a fresh staging
// directory and seals it into an image registered as ref. Entries keep
// their owners, setuid bits, xattrs and device nodes, so only trusted
// builders may call it; names that would escape the tree are refused by
// files.ExtractTar with errdefs.ErrInvalid. On any error nothing is left in
// the staging area and the catalog is unchanged.
func (s *Store) BuildFromTar(ctx context.Context, ref Ref, r io.Reader, opts BuildOptions, progress io.Writer) (api.Layer, error) {
	if err := s.mayPublish(); err != nil {
		return api.Layer{}, err
	}
	if err := checkBuild(ref, opts); err != nil {
		return api.Layer{}, err
	}
	if err := s.checkFree(ref, opts); err != nil {
		return api.Layer{}, err
	}
	if opts.MaxBytes == 0 {
		opts.MaxBytes = DefaultMaxBytes
	}
	if opts.MaxFiles == 0 {
		opts.MaxFiles = DefaultMaxFiles
	}
	var cl cleanup.Stack
	defer cl.Run() // staging is temporary: undone on success too

	// The staging dir becomes the image's root directory, so it gets a
	// root directory's mode; the 0700 staging parent keeps others out.
	stage, err := os.MkdirTemp(s.stagingDir(), "build-")
	if err != nil {
		return api.Layer{}, fmt.Errorf("building layer %s: %w", ref, err)
	}
	cl.Add(func() { os.RemoveAll(stage) })
	if err := os.Chmod(stage, 0o755); err != nil {
		return api.Layer{}, fmt.Errorf("building layer %s: %w", ref, err)
	}

	// Directories the archive does not date are stamped by the kernel's
	// coarse clock during extraction, which can lag time.Now() by a tick;
	// the fresh staging dir's own mtime is a floor on the same clock.
	fi, err := os.Stat(stage)
	if err != nil {
		return api.Layer{}, fmt.Errorf("building layer %s: %w", ref, err)
	}
	extractStart := fi.ModTime()

	start := time.Now()
	root, err := files.Open(stage)
	if err != nil {
		return api.Layer{}, fmt.Errorf("building layer %s: %w", ref, err)
	}
	in := &progressReader{ctx: ctx, r: r, w: progress, every: 256 << 20}
	res, err := root.ExtractTar("/", in, files.TarOptions{
		MaxBytes:      opts.MaxBytes,
		MaxFiles:      opts.MaxFiles,
		PreserveOwner: true,
		AllowDevices:  true,
	})
	root.Close()
	if err != nil {
		if ctx.Err() != nil {
			return api.Layer{}, fmt.Errorf("building layer %s: %w", ref, ctx.Err())
		}
		return api.Layer{}, fmt.Errorf("building layer %s: %w", ref, err)
	}
	printf(progress, "extracted %d entries, %s in files (%s read) in %s\n",
		res.Files, humanBytes(res.Bytes), humanBytes(in.n), time.Since(start).Round(time.Millisecond))

	if err := settleMTimes(stage, extractStart); err != nil {
		return api.Layer{}, fmt.Errorf("building layer %s: %w", ref, err)
	}
	return s.build(ctx, ref, stage, opts, progress, &cl)
}

// settleMTimes gives every entry that the tar did not date (the root and
// implicitly created parents, all stamped during extraction) the fixed
// unknownMTime, so that the same tar always yields the same image.
func settleMTimes(root string, since time.Time) error {
	ts := []unix.Timespec{unix.NsecToTimespec(unknownMTime.UnixNano()), unix.NsecToTimespec(unknownMTime.UnixNano())}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() {
			return nil // only directories are created without a header
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		if fi.ModTime().Before(since) {
			return nil
		}
		return unix.UtimesNanoAt(unix.AT_FDCWD, p, ts, unix.AT_SYMLINK_NOFOLLOW)
	})
	if err != nil {
		return fmt.Errorf("settling mtimes: %w", err)
	}
	return nil
}

// progressReader stops the extraction when ctx is done and prints a line
// every `every` bytes read.
type progressReader struct {
	ctx   context.Context
	r     io.Reader
	w     io.Writer
	every int64
	n     int64
	next  int64
}

func (p *progressReader) Read(b []byte) (int, error) {
	if err := p.ctx.Err(); err != nil {
		return 0, err
	}
	n, err := p.r.Read(b)
	p.n += int64(n)
	if p.w != nil && p.n >= p.next+p.every {
		p.next = p.n - p.n%p.every
		printf(p.w, "received %s\n", humanBytes(p.n))
	}
	return n, err
}

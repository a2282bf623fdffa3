package edge

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/layer"
	"github.com/dsecproject/dsec/internal/sandbox"
	"github.com/dsecproject/dsec/internal/sandbox/fake"
)

// exportingBackend is the fake backend with a writable layer it exports
// as the tar export writes: what a VM's agent (which root in the VM
// controls) could send.
type exportingBackend struct {
	*fake.Backend
	export func(w io.Writer) error
}

func (b exportingBackend) ExportDiff(ctx context.Context, id string, w io.Writer) error {
	return b.export(w)
}

var _ sandbox.DiffExporter = exportingBackend{}

// treeBuilder records the tree it is asked to seal, instead of sealing it.
type treeBuilder struct {
	tree             map[string]unix.Stat_t
	opaque, redirect bool // what opq carries
	calls            int
}

func (b *treeBuilder) BuildFromDir(ctx context.Context, ref layer.Ref, dir string, opts layer.BuildOptions, progress io.Writer) (api.Layer, error) {
	b.calls++
	b.tree = map[string]unix.Stat_t{}
	err := filepath.Walk(dir, func(p string, _ os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		b.tree[rel] = st
		return nil
	})
	buf := make([]byte, 16)
	_, oerr := unix.Lgetxattr(filepath.Join(dir, "opq"), "trusted.overlay.opaque", buf)
	_, rerr := unix.Lgetxattr(filepath.Join(dir, "opq"), "trusted.overlay.redirect", buf)
	b.opaque, b.redirect = oerr == nil, rerr == nil
	return api.Layer{Ref: ref.String(), Digest: "sha256:" + strings.Repeat("f", 64)}, err
}

func (b *treeBuilder) Stage(ctx context.Context, ref layer.Ref, dir string, opts layer.BuildOptions, progress io.Writer) (api.Layer, layer.Staged, error) {
	l, err := b.BuildFromDir(ctx, ref, dir, opts, progress)
	return l, layer.Staged{Digest: l.Digest}, err
}

func diffTar(t *testing.T, hdrs ...*tar.Header) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, h := range hdrs {
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Size > 0 {
			tw.Write(bytes.Repeat([]byte("d"), int(h.Size)))
		}
	}
	tw.Close()
	return buf.Bytes()
}

// TestSnapshotOfAnExportedDiff: a backend whose writable layer the node
// cannot read hands it out as a tar, which the edge unpacks as untrusted
// into a stage and seals; what a hostile exporter sends (devices, names
// out of the tree, junk after the archive's end that it never stops
// sending, a failure half-way) fails the snapshot or is ignored, and
// leaves no stage behind.
func TestSnapshotOfAnExportedDiff(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the diff keeps owners and whiteouts (device nodes)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	src := &testImages{dir: t.TempDir()}
	state := t.TempDir()
	var export func(w io.Writer) error
	be := exportingBackend{Backend: fake.New("container"), export: func(w io.Writer) error { return export(w) }}
	lb := &treeBuilder{}
	e, err := New(Config{Name: "n1", StateDir: state, Policy: sandbox.DefaultPolicy()}, Deps{Backend: be, Blobs: src, Layers: lb})
	if err != nil {
		t.Fatal(err)
	}
	if err := e.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	sb, err := e.Create(ctx, edgeapi.CreateRequest{Spec: api.SandboxSpec{Base: "base/x:1"}, Digests: src.digests(t, 1)})
	if err != nil {
		t.Fatal(err)
	}
	snap := func() error {
		_, err := e.Snapshot(ctx, sb.ID, edgeapi.SnapshotOptions{Request: api.SnapshotRequest{Ref: "snapshot/s:1", Exclude: []string{"/tmp"}}})
		return err
	}
	stages := func() []string { return entries(t, filepath.Join(state, "snapstage")) }

	good := diffTar(t,
		&tar.Header{Typeflag: tar.TypeDir, Name: "./", Mode: 0o755},
		&tar.Header{Typeflag: tar.TypeDir, Name: "etc/", Mode: 0o755},
		&tar.Header{Typeflag: tar.TypeChar, Name: "etc/gone", Mode: 0},
		&tar.Header{Typeflag: tar.TypeReg, Name: "etc/new", Mode: 0o4755, Uid: 1000, Gid: 1000, Size: 3},
		&tar.Header{Typeflag: tar.TypeDir, Name: "tmp/", Mode: 0o1777},
		&tar.Header{Typeflag: tar.TypeReg, Name: "tmp/scratch", Mode: 0o644, Size: 1},
		&tar.Header{Typeflag: tar.TypeDir, Name: "opq/", Mode: 0o755, PAXRecords: map[string]string{
			"SCHILY.xattr.trusted.overlay.opaque":   "y",
			"SCHILY.xattr.trusted.overlay.redirect": "/etc",
		}},
	)
	export = func(w io.Writer) error { _, err := w.Write(good); return err }
	if err := snap(); err != nil {
		t.Fatal(err)
	}
	if st, ok := lb.tree["etc/gone"]; !ok || st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != 0 {
		t.Errorf("whiteout: %+v %v", st, ok)
	}
	if st := lb.tree["etc/new"]; st.Mode&07777 != 04755 || st.Uid != 1000 {
		t.Errorf("etc/new: mode %o uid %d", st.Mode&07777, st.Uid)
	}
	if _, ok := lb.tree["tmp/scratch"]; !ok {
		// Excludes are the builder's to apply, and recorded with it.
		t.Errorf("the stage lost tmp/scratch: %v", lb.tree)
	}
	if !lb.opaque || lb.redirect {
		t.Errorf("opq: opaque %v (want true), redirect %v (want false)", lb.opaque, lb.redirect)
	}
	if len(stages()) != 0 {
		t.Errorf("stages left: %v", stages())
	}

	for _, tc := range []struct {
		name   string
		export func(w io.Writer) error
		want   error
	}{
		{"a device", func(w io.Writer) error {
			_, err := w.Write(diffTar(t, &tar.Header{Typeflag: tar.TypeBlock, Name: "sda", Devmajor: 8}))
			return err
		}, errdefs.ErrInvalid},
		{"a name out of the tree", func(w io.Writer) error {
			_, err := w.Write(diffTar(t, &tar.Header{Typeflag: tar.TypeReg, Name: "../../../x", Size: 1}))
			return err
		}, errdefs.ErrInvalid},
		{"cut short", func(w io.Writer) error {
			w.Write(good[:1024])
			return errors.New("the agent is gone")
		}, nil},
		{"endless junk after the end", func(w io.Writer) error {
			if _, err := w.Write(good); err != nil {
				return err
			}
			for {
				if _, err := w.Write(bytes.Repeat([]byte{'j'}, 4096)); err != nil {
					return err
				}
			}
		}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lb.calls = 0
			export = tc.export
			done := make(chan error, 1)
			go func() { done <- snap() }()
			select {
			case err := <-done:
				if tc.want != nil && !errors.Is(err, tc.want) {
					t.Fatalf("got %v, want %v", err, tc.want)
				}
				if tc.name == "endless junk after the end" {
					if err == nil || lb.calls != 0 {
						t.Fatalf("junk after the archive: %v, %d builds", err, lb.calls)
					}
				} else if err == nil || lb.calls != 0 {
					t.Fatalf("got %v after %d builds, want a failure and none", err, lb.calls)
				}
			case <-time.After(20 * time.Second):
				t.Fatal("the snapshot hangs")
			}
			if len(stages()) != 0 {
				t.Errorf("stages left: %v", stages())
			}
		})
	}
	if got, err := e.Get(ctx, sb.ID); err != nil || got.State != api.StateRunning {
		t.Fatalf("after the snapshots: %+v %v", got, err)
	}
}

package layer

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/cleanup"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// Staged names an image a node's store (NewNodeStore) sealed and left in
// its staging directory for another process to publish (Store.Adopt). In
// a cluster, an edge stages the snapshots it packs and the apiserver that
// asked publishes them: edges then write neither the catalog nor the
// blob directory, so a node whose host is subverted cannot change what a
// ref means, or what a digest holds, for the other nodes.
type Staged struct {
	// Instance is the staging directory's name (the staging process's),
	// Name the image's file in it.
	Instance string `json:"instance"`
	Name     string `json:"name"`
	Digest   string `json:"digest"`
	Size     int64  `json:"size"`
}

// The names a Staged may carry: what claimStaging and seal make.
var (
	stagedInstanceRE = regexp.MustCompile(`^[0-9a-f]{12}$`)
	stagedNameRE     = regexp.MustCompile(`^image-[0-9]{1,20}\.erofs$`)
)

// stagedKeep is how long a staged image waits for its adopter: it opens
// the image as soon as the stager answers, so one older than this was
// left by an adopter that died or a caller that went away.
const stagedKeep = 10 * time.Minute

// Stage seals the tree at dir as BuildFromDir does, but publishes
// nothing: the image stays in this process's staging directory and the
// layer it would be is returned with where it is. The caller hands both to
// the process that publishes it (Store.Adopt), which removes the image.
// Images staged before and not adopted within stagedKeep are removed
// here, and all of them when this process's staging directory goes.
func (s *Store) Stage(ctx context.Context, ref Ref, dir string, opts BuildOptions, progress io.Writer) (api.Layer, Staged, error) {
	if s.stageRoot != outboxRoot {
		return api.Layer{}, Staged{}, errdefs.Precondition("staging layer %s: only a node's store stages layers (this one publishes them)", ref)
	}
	if err := checkBuild(ref, opts); err != nil {
		return api.Layer{}, Staged{}, err
	}
	if len(opts.Lowers) > 0 || opts.Replace || opts.MayReplace != nil {
		return api.Layer{}, Staged{}, errdefs.Invalid("staging layer %s: lower layers and replacing are for builds that publish", ref)
	}
	if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
		return api.Layer{}, Staged{}, errdefs.Invalid("staging layer %s: %s is not a directory (%v)", ref, dir, err)
	}
	if err := s.checkFree(ref, opts); err != nil {
		return api.Layer{}, Staged{}, err
	}
	s.dropUnadopted()
	var cl cleanup.Stack
	defer cl.Run()
	tmpPath, digest, size, err := s.seal(ctx, "staging layer "+ref.String(), dir, opts, progress, &cl)
	if err != nil {
		return api.Layer{}, Staged{}, err
	}
	if err := ctx.Err(); err != nil {
		return api.Layer{}, Staged{}, fmt.Errorf("staging layer %s: %w", ref, err) // nobody to adopt it
	}
	cl.Release() // the adopter removes it
	l := api.Layer{Digest: digest, Ref: ref.String(), Kind: ref.Kind, SizeBytes: size, CreatedAt: time.Now().UTC(),
		Snapshot: opts.Snapshot, Image: opts.Image, Project: opts.Project}
	s.log.Info("layer staged", "ref", l.Ref, "digest", digest, "size_bytes", size)
	return l, Staged{Instance: s.instance, Name: filepath.Base(tmpPath), Digest: digest, Size: size}, nil
}

// dropUnadopted removes this process's staged images older than
// stagedKeep.
func (s *Store) dropUnadopted() {
	es, err := os.ReadDir(s.stagingDir())
	if err != nil {
		return
	}
	for _, e := range es {
		if !stagedNameRE.MatchString(e.Name()) {
			continue
		}
		if fi, err := e.Info(); err == nil && time.Since(fi.ModTime()) > stagedKeep {
			if os.Remove(filepath.Join(s.stagingDir(), e.Name())) == nil {
				s.log.Warn("removed a staged layer nobody adopted", "file", e.Name(), "size_bytes", fi.Size())
			}
		}
	}
}

// Adopt publishes l, whose image a node's store staged (st), as a build
// publishes: under a new ref, never over one. The stager is not trusted:
// the image is looked up in its directory under outbox/ without
// following any link, must be a regular file with one name and st.Size
// bytes, and is copied into this process's own staging directory while
// hashed, so that what is published is what was hashed, whatever the
// stager writes afterwards. Its digest must be st.Digest and l's. Once
// opened, the staged image is removed, whether it is then adopted or
// refused. What the stager got wrong is an error of no class (an
// internal one): the caller did nothing wrong.
func (s *Store) Adopt(ctx context.Context, st Staged, l api.Layer) (api.Layer, error) {
	ref, err := ParseRef(l.Ref)
	if err != nil {
		return api.Layer{}, err
	}
	what := "publishing layer " + ref.String()
	if err := s.mayPublish(); err != nil {
		return api.Layer{}, err
	}
	switch {
	case !stagedInstanceRE.MatchString(st.Instance) || !stagedNameRE.MatchString(st.Name):
		return api.Layer{}, fmt.Errorf("%s: the staged image %q in %q is not a staged image's name", what, st.Name, st.Instance)
	case !IsDigest(st.Digest) || st.Digest != l.Digest || st.Size <= 0 || st.Size != l.SizeBytes:
		return api.Layer{}, fmt.Errorf("%s: the staged image (%q, %d bytes) is not the layer's (%q, %d bytes)", what, st.Digest, st.Size, l.Digest, l.SizeBytes)
	case len(l.Lowers) > 0 || l.Remote != nil:
		return api.Layer{}, fmt.Errorf("%s: a staged layer has neither lower layers nor a remote source", what)
	}
	if err := checkBuild(ref, BuildOptions{Snapshot: l.Snapshot, Image: l.Image}); err != nil {
		return api.Layer{}, err
	}
	l.Ref, l.Kind = ref.String(), ref.Kind

	var cl cleanup.Stack
	defer cl.Run()
	tmpPath, err := s.copyStaged(ctx, st)
	if tmpPath != "" {
		cl.Add(func() { os.Remove(tmpPath) })
	}
	if err != nil {
		return api.Layer{}, fmt.Errorf("%s: %w", what, err)
	}
	deduped, err := s.publish(tmpPath, l, false, nil)
	if err != nil {
		return api.Layer{}, err
	}
	s.log.Info("staged layer published", "ref", l.Ref, "digest", l.Digest, "size_bytes", l.SizeBytes,
		"staged_by", st.Instance, "deduplicated", deduped)
	return l, nil
}

// copyStaged copies st's image into this process's staging directory,
// checking its size and digest on the way, removes st's image, and
// returns the copy's path ("" if none was made).
func (s *Store) copyStaged(ctx context.Context, st Staged) (string, error) {
	root, err := unix.Open(s.dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", err
	}
	defer unix.Close(root)
	beneath := uint64(unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV)
	dirfd, err := unix.Openat2(root, filepath.Join(outboxRoot, st.Instance), &unix.OpenHow{
		Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC, Resolve: beneath})
	if err != nil {
		return "", fmt.Errorf("the staging directory %s: %w", st.Instance, err)
	}
	defer unix.Close(dirfd)
	// A path descriptor first: opening a device node or a FIFO for
	// reading would run its driver (or wait for a writer) before the
	// file's type could be checked.
	pfd, err := unix.Openat2(dirfd, st.Name, &unix.OpenHow{
		Flags: unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC, Resolve: beneath})
	if err != nil {
		return "", fmt.Errorf("the staged image %s/%s: %w", st.Instance, st.Name, err)
	}
	defer unix.Close(pfd)
	var fst unix.Stat_t
	err = unix.Fstat(pfd, &fst)
	// Whatever it is, it has served: it goes (unlinkat follows no link,
	// and the descriptor keeps a regular file readable).
	_ = unix.Unlinkat(dirfd, st.Name, 0)
	if err != nil {
		return "", err
	}
	// One name (counted before the unlink): not a hard link to a file
	// the stager did not make.
	if fst.Mode&unix.S_IFMT != unix.S_IFREG || fst.Nlink > 1 || fst.Size != st.Size {
		return "", fmt.Errorf("the staged image %s/%s is not a regular file of %d bytes with one name", st.Instance, st.Name, st.Size)
	}
	// The same file, for reading (through the path descriptor: no
	// second lookup of the name).
	src, err := os.OpenFile(fmt.Sprintf("/proc/self/fd/%d", pfd), os.O_RDONLY, 0)
	if err != nil {
		return "", err
	}
	defer src.Close()
	dst, err := os.CreateTemp(s.stagingDir(), "adopt-*.erofs")
	if err != nil {
		return "", err
	}
	tmpPath := dst.Name()
	h := sha256.New()
	n, err := io.Copy(io.MultiWriter(dst, h), io.LimitReader(ctxReader{ctx, src}, st.Size+1))
	if err == nil {
		err = dst.Sync()
	}
	if cerr := dst.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return tmpPath, fmt.Errorf("copying the staged image: %w", err)
	}
	if digest := "sha256:" + hex.EncodeToString(h.Sum(nil)); n != st.Size || digest != st.Digest {
		return tmpPath, fmt.Errorf("the staged image %s/%s does not hold the bytes its stager says (digest %s, %d bytes)", st.Instance, st.Name, st.Digest, st.Size)
	}
	return tmpPath, nil
}

// ctxReader stops a long copy when ctx ends.
type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}

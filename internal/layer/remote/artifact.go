package remote

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/image"
	"github.com/dsecproject/dsec/internal/layer"
)

// Media types of a layer artifact. The manifest is an ordinary OCI image
// manifest with an artifactType, so any OCI registry stores it: its
// config is the layer's description and its two blobs are the EROFS
// image and the chunk index (a separate blob, so an edge reads the index
// without touching the image).
const (
	ArtifactType   = "application/vnd.dsec.layer.v1"
	ConfigType     = "application/vnd.dsec.layer.config.v1+json"
	ImageType      = "application/vnd.dsec.layer.erofs.v1"
	IndexType      = "application/vnd.dsec.layer.chunks.v1"
	MetaType       = "application/vnd.dsec.layer.metadata.v1"
	manifestType   = "application/vnd.oci.image.manifest.v1+json"
	chunkSizeAnnot = "dev.dsec.chunk-size"
)

// Scheme prefixes a layer source.
const Scheme = "oci://"

type descriptor struct {
	MediaType   string            `json:"mediaType"`
	Digest      string            `json:"digest"`
	Size        int64             `json:"size"`
	Annotations map[string]string `json:"annotations,omitempty"`
}

type manifest struct {
	SchemaVersion int          `json:"schemaVersion"`
	MediaType     string       `json:"mediaType"`
	ArtifactType  string       `json:"artifactType,omitempty"`
	Config        descriptor   `json:"config"`
	Layers        []descriptor `json:"layers"`
}

// config describes the layer in the artifact, so that adding it back
// restores what the catalog knew (an image's env, workdir and user).
type config struct {
	Ref       string           `json:"ref"`
	Kind      string           `json:"kind"`
	SizeBytes int64            `json:"size_bytes"`
	CreatedAt time.Time        `json:"created_at"`
	Image     *api.ImageConfig `json:"image,omitempty"`
}

// ParseSource parses oci://HOST/REPO:TAG (or @sha256:...) into a
// registry reference.
func ParseSource(s string) (image.Reference, error) {
	rest, ok := strings.CutPrefix(s, Scheme)
	if !ok {
		return image.Reference{}, errdefs.Invalid("layer source %q: want %sHOST/REPO:TAG", s, Scheme)
	}
	r, err := image.ParseReference(rest)
	if err != nil {
		return image.Reference{}, fmt.Errorf("layer source %q: %w", s, err)
	}
	if first, _, _ := strings.Cut(rest, "/"); r.Registry != first {
		return image.Reference{}, errdefs.Invalid("layer source %q: name the registry host (%sHOST[:PORT]/REPO:TAG)", s, Scheme)
	}
	return r, nil
}

// PushOptions tune Push.
type PushOptions struct {
	Insecure  bool
	ChunkSize int // 0: DefaultChunkSize
	Progress  io.Writer
	Repo      image.RepoOptions
}

// Push stores the layer ref of st at target (oci://HOST/REPO:TAG) as an
// artifact: the image, its chunk index and config as blobs (skipping
// those the registry has), then the manifest under the tag.
func Push(ctx context.Context, st *layer.Store, ref, target string, opts PushOptions) (api.LayerPushResult, error) {
	tref, err := ParseSource(target)
	if err != nil {
		return api.LayerPushResult{}, err
	}
	if tref.Tag == "" || tref.Digest != "" {
		return api.LayerPushResult{}, errdefs.Invalid("push target %q: name a tag, not a digest", target)
	}
	l, err := st.Resolve(ref)
	if err != nil {
		return api.LayerPushResult{}, err
	}
	path, release, err := st.Open(ctx, l.Digest)
	if err != nil {
		if l.Remote != nil {
			return api.LayerPushResult{}, errdefs.Precondition("layer %s is read from %s and has no image here to push", l.Ref, l.Remote.Source)
		}
		return api.LayerPushResult{}, err
	}
	defer release()
	chunk := opts.ChunkSize
	if chunk == 0 {
		chunk = DefaultChunkSize
	}
	f, err := os.Open(path)
	if err != nil {
		return api.LayerPushResult{}, fmt.Errorf("opening layer image: %w", err)
	}
	ix, err := BuildIndex(f, l.SizeBytes, chunk)
	var meta []byte
	if err == nil {
		var merr error
		if meta, merr = BuildMetaPack(f, l.SizeBytes); merr != nil {
			// The pack only saves fetches: push without it.
			printf(opts.Progress, "no metadata pack: %v\n", merr)
			meta = nil
		}
	}
	f.Close()
	if err != nil {
		return api.LayerPushResult{}, err
	}
	ixBytes, _ := ix.MarshalBinary()
	cfgBytes, err := json.Marshal(config{Ref: l.Ref, Kind: l.Kind, SizeBytes: l.SizeBytes, CreatedAt: l.CreatedAt, Image: l.Image})
	if err != nil {
		return api.LayerPushResult{}, fmt.Errorf("encoding layer config: %w", err)
	}
	ro := opts.Repo
	ro.Insecure = ro.Insecure || opts.Insecure
	repo, err := image.OpenRepo(tref, ro)
	if err != nil {
		return api.LayerPushResult{}, err
	}
	m := manifest{
		SchemaVersion: 2, MediaType: manifestType, ArtifactType: ArtifactType,
		Config: descriptor{MediaType: ConfigType, Digest: digestOf(cfgBytes), Size: int64(len(cfgBytes))},
		Layers: []descriptor{
			{MediaType: ImageType, Digest: l.Digest, Size: l.SizeBytes},
			{MediaType: IndexType, Digest: digestOf(ixBytes), Size: int64(len(ixBytes)),
				Annotations: map[string]string{chunkSizeAnnot: strconv.Itoa(chunk)}},
		},
	}
	small := map[string][]byte{m.Config.Digest: cfgBytes, m.Layers[1].Digest: ixBytes}
	if meta != nil {
		md := descriptor{MediaType: MetaType, Digest: digestOf(meta), Size: int64(len(meta))}
		m.Layers = append(m.Layers, md)
		small[md.Digest] = meta
	}
	res := api.LayerPushResult{Ref: l.Ref, Target: target, SizeBytes: l.SizeBytes}
	for _, d := range append(append([]descriptor(nil), m.Layers...), m.Config) {
		open := func() (io.ReadCloser, error) {
			if b, ok := small[d.Digest]; ok {
				return io.NopCloser(bytes.NewReader(b)), nil
			}
			return os.Open(path)
		}
		printf(opts.Progress, "%s: pushing %s (%s)\n", short(d.Digest), d.MediaType, layer.HumanBytes(d.Size))
		sent, err := repo.PushBlob(ctx, d.Digest, d.Size, open)
		if err != nil {
			return api.LayerPushResult{}, fmt.Errorf("pushing %s to %s: %w", l.Ref, repo, err)
		}
		if sent {
			res.Uploaded++
		} else {
			printf(opts.Progress, "%s: already in %s\n", short(d.Digest), repo)
		}
	}
	mb, err := json.Marshal(m)
	if err != nil {
		return api.LayerPushResult{}, fmt.Errorf("encoding manifest: %w", err)
	}
	if res.Manifest, err = repo.PushManifest(ctx, tref.Tag, manifestType, mb); err != nil {
		return api.LayerPushResult{}, fmt.Errorf("pushing %s to %s: %w", l.Ref, repo, err)
	}
	printf(opts.Progress, "pushed %s as %s (%s)\n", l.Ref, target, res.Manifest)
	return res, nil
}

// AddOptions tune Add.
type AddOptions struct {
	Insecure bool
	// Pull is api.PullLazy (default) or api.PullFull.
	Pull string
	// Replace and MayReplace as for layer builds; Project is recorded.
	Replace    bool
	MayReplace func(api.Layer) error
	Project    string
	Repo       image.RepoOptions
}

// Add registers ref as the layer artifact at source without copying its
// image: it reads the manifest, the config and the chunk index, checks
// that they agree and that the registry serves the image by byte range
// (the first chunk is fetched and verified), and records the layer with
// its source in the catalog.
func Add(ctx context.Context, st *layer.Store, ref, source string, opts AddOptions) (api.Layer, error) {
	r, err := layer.ParseRef(ref)
	if err != nil {
		return api.Layer{}, err
	}
	switch opts.Pull {
	case "":
		opts.Pull = api.PullLazy
	case api.PullLazy, api.PullFull:
	default:
		return api.Layer{}, errdefs.Invalid("pull %q: want %s or %s", opts.Pull, api.PullLazy, api.PullFull)
	}
	sref, err := ParseSource(source)
	if err != nil {
		return api.Layer{}, err
	}
	ro := opts.Repo
	ro.Insecure = ro.Insecure || opts.Insecure
	repo, err := image.OpenRepo(sref, ro)
	if err != nil {
		return api.Layer{}, err
	}
	what := sref.Tag
	if sref.Digest != "" {
		what = sref.Digest
	}
	a, err := readArtifact(ctx, repo, what)
	if err != nil {
		return api.Layer{}, fmt.Errorf("adding %s from %s: %w", r, source, err)
	}
	if a.cfg.Kind != "" && a.cfg.Kind != r.Kind {
		return api.Layer{}, errdefs.Invalid("%s holds a %s layer; it cannot be added as %s", source, a.cfg.Kind, r)
	}
	// The image's digest is the artifact's word for it: nothing reads the
	// whole image here. Its chunks are checked against the index, so one
	// digest must not stand for two indexes (two contents) on the nodes,
	// which read a layer by digest.
	if prev, err := st.Get(a.image.Digest); err == nil && prev.Remote != nil && (prev.Remote.Index != a.index.Digest || prev.Remote.Meta != a.meta.Digest) {
		return api.Layer{}, errdefs.AlreadyExists("image %s is already in the catalog as %s from %s with another chunk index or metadata pack; add that source, or push the layer again",
			a.image.Digest, prev.Ref, prev.Remote.Source)
	}
	l := api.Layer{
		Digest: a.image.Digest, Ref: r.String(), Kind: r.Kind, SizeBytes: a.image.Size,
		CreatedAt: time.Now().UTC(), Image: a.cfg.Image, Project: opts.Project,
		Remote: &api.LayerRemote{Source: source, Manifest: a.digest, Index: a.index.Digest, IndexSize: a.index.Size,
			ChunkSize: a.ix.ChunkSize, Insecure: opts.Insecure, Pull: opts.Pull, Meta: a.meta.Digest, MetaSize: a.meta.Size},
	}
	return st.AddRemote(l, layer.BuildOptions{Replace: opts.Replace, MayReplace: opts.MayReplace})
}

type artifact struct {
	digest             string
	cfg                config
	image, index, meta descriptor
	ix                 *Index
}

// readArtifact reads and checks a layer artifact's manifest, config and
// index, and the first chunk of its image.
func readArtifact(ctx context.Context, repo *image.Repo, tagOrDigest string) (*artifact, error) {
	body, mt, digest, err := repo.Manifest(ctx, tagOrDigest)
	if err != nil {
		return nil, err
	}
	var m manifest
	if err := json.Unmarshal(body, &m); err != nil {
		return nil, errdefs.Invalid("manifest %s: %v", digest, err)
	}
	if mt != manifestType && m.MediaType != manifestType {
		return nil, errdefs.Invalid("%s is a %s, not a dsec layer artifact", tagOrDigest, mt)
	}
	if m.ArtifactType != ArtifactType && m.Config.MediaType != ConfigType {
		return nil, errdefs.Invalid("%s is not a dsec layer artifact (artifact type %q; push one with dsec layer push)", tagOrDigest, m.ArtifactType)
	}
	a := &artifact{digest: digest}
	for _, d := range m.Layers {
		switch d.MediaType {
		case ImageType:
			a.image = d
		case IndexType:
			a.index = d
		case MetaType:
			a.meta = d
		}
	}
	if a.meta.Digest != "" && (!layer.IsDigest(a.meta.Digest) || a.meta.Size <= 0 || a.meta.Size > metaBound(a.image.Size)) {
		return nil, errdefs.Invalid("manifest %s: bad metadata pack descriptor", digest)
	}
	if a.image.Digest == "" || a.index.Digest == "" || !layer.IsDigest(a.image.Digest) || !layer.IsDigest(a.index.Digest) {
		return nil, errdefs.Invalid("manifest %s lacks the image or the chunk index", digest)
	}
	if m.Config.MediaType == ConfigType {
		cb, err := repo.Blob(ctx, m.Config.Digest, m.Config.Size, 1<<20)
		if err != nil {
			return nil, fmt.Errorf("reading layer config: %w", err)
		}
		if err := json.Unmarshal(cb, &a.cfg); err != nil {
			return nil, errdefs.Invalid("layer config: %v", err)
		}
	}
	ib, err := repo.Blob(ctx, a.index.Digest, a.index.Size, maxIndexBytes)
	if err != nil {
		return nil, fmt.Errorf("reading chunk index: %w", err)
	}
	if a.ix, err = UnmarshalIndex(ib); err != nil {
		return nil, err
	}
	if a.ix.Size != a.image.Size {
		return nil, errdefs.Invalid("chunk index covers %d bytes; the image has %d", a.ix.Size, a.image.Size)
	}
	if a.ix.Chunks() > 0 {
		rc, err := repo.BlobRange(ctx, a.image.Digest, 0, int64(a.ix.ChunkLen(0)))
		if err != nil {
			return nil, fmt.Errorf("reading the image's first chunk: %w", err)
		}
		first, err := io.ReadAll(io.LimitReader(rc, int64(a.ix.ChunkLen(0))+1))
		rc.Close()
		if err != nil {
			return nil, errdefs.Unavailable("reading the image's first chunk: %v", err)
		}
		if err := a.ix.Check(0, first); err != nil {
			return nil, fmt.Errorf("the registry's image does not match its index: %w", err)
		}
		if a.meta.Digest != "" {
			if err := checkMetaPack(ctx, repo, a, first); err != nil {
				return nil, err
			}
		}
	}
	return a, nil
}

// checkMetaPack reads the artifact's metadata pack and checks it: its
// digest, its encoding, and, where it holds bytes of the first chunk
// (verified against the index), that they are the same. Nodes trust the
// pack as they trust the index: by the digest the manifest gives, one per
// image digest in a catalog.
func checkMetaPack(ctx context.Context, repo *image.Repo, a *artifact, first []byte) error {
	dir, err := os.MkdirTemp("", "dsec-meta-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	p := filepath.Join(dir, "pack")
	if err := fetchMetaPack(ctx, repo, a.meta.Digest, a.meta.Size, a.image.Size, p); err != nil {
		return fmt.Errorf("reading the metadata pack: %w", err)
	}
	m, err := openMetaPack(p, a.meta.Digest, a.image.Size)
	if err != nil {
		return err
	}
	defer m.Close()
	for _, x := range m.ranges {
		if x.Off >= int64(len(first)) {
			break
		}
		n := min(x.Len, int64(len(first))-x.Off)
		p := make([]byte, n)
		if !m.ReadAt(p, x.Off, a.image.Size) || !bytes.Equal(p, first[x.Off:x.Off+n]) {
			return errdefs.Invalid("the metadata pack does not match the image at %d", x.Off)
		}
	}
	return nil
}

func digestOf(b []byte) string {
	s := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(s[:])
}

func short(d string) string {
	h := strings.TrimPrefix(d, "sha256:")
	return h[:min(12, len(h))]
}

func printf(w io.Writer, format string, args ...any) {
	if w != nil {
		fmt.Fprintf(w, format, args...)
	}
}

// Reindex stores, under target's tag in the same repository, the artifact
// at source with a chunk index of another chunk size: the image and the
// config are the same blobs (not sent again); the image is read once
// from the registry to index it. It returns the new manifest's digest.
func Reindex(ctx context.Context, source, target string, chunkSize int, opts image.RepoOptions) (string, error) {
	repo, what, m, tag, err := retarget(ctx, source, target, opts)
	if err != nil {
		return "", fmt.Errorf("reindex: %w", err)
	}
	if _, err := readArtifact(ctx, repo, what); err != nil {
		return "", err
	}
	var img descriptor
	var kept []descriptor // the metadata pack: the same for any chunk size
	for _, d := range m.Layers {
		switch d.MediaType {
		case ImageType:
			img = d
		case MetaType:
			kept = append(kept, d)
		}
	}
	rc, err := repo.BlobRange(ctx, img.Digest, 0, img.Size)
	if err != nil {
		return "", err
	}
	h := sha256.New()
	ix, err := BuildIndex(io.TeeReader(rc, h), img.Size, chunkSize)
	rc.Close()
	if err != nil {
		return "", err
	}
	if got := "sha256:" + hex.EncodeToString(h.Sum(nil)); got != img.Digest {
		return "", errdefs.Invalid("reindex: the registry's image has digest %s, not %s", got, img.Digest)
	}
	ixBytes, _ := ix.MarshalBinary()
	ixDesc := descriptor{MediaType: IndexType, Digest: digestOf(ixBytes), Size: int64(len(ixBytes)),
		Annotations: map[string]string{chunkSizeAnnot: strconv.Itoa(chunkSize)}}
	if _, err := repo.PushBlob(ctx, ixDesc.Digest, ixDesc.Size, func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(ixBytes)), nil
	}); err != nil {
		return "", err
	}
	m.Layers = append([]descriptor{img, ixDesc}, kept...)
	mb, err := json.Marshal(m)
	if err != nil {
		return "", err
	}
	return repo.PushManifest(ctx, tag, manifestType, mb)
}

// WithoutMeta stores, under target's tag in the same repository, the
// artifact at source without its metadata pack (the blobs are the same;
// only a manifest is pushed): what nodes read when an artifact has none.
// For measuring what the pack saves. It returns the new manifest's digest.
func WithoutMeta(ctx context.Context, source, target string, opts image.RepoOptions) (string, error) {
	repo, _, m, tag, err := retarget(ctx, source, target, opts)
	if err != nil {
		return "", err
	}
	kept := m.Layers[:0]
	for _, d := range m.Layers {
		if d.MediaType != MetaType {
			kept = append(kept, d)
		}
	}
	m.Layers = kept
	mb, err := json.Marshal(m)
	if err != nil {
		return "", err
	}
	return repo.PushManifest(ctx, tag, manifestType, mb)
}

// retarget opens the repository of source and reads its manifest, for a
// new manifest of the same blobs under target's tag, which must be in the
// same repository: the repository, what names the source (its tag or
// digest), its manifest, and the target tag.
func retarget(ctx context.Context, source, target string, opts image.RepoOptions) (repo *image.Repo, what string, m manifest, tag string, err error) {
	sref, err := ParseSource(source)
	if err != nil {
		return nil, "", m, "", err
	}
	tref, err := ParseSource(target)
	if err != nil {
		return nil, "", m, "", err
	}
	if tref.Registry != sref.Registry || tref.Repository != sref.Repository || tref.Tag == "" {
		return nil, "", m, "", errdefs.Invalid("%s must name a tag in the repository of %s", target, source)
	}
	if repo, err = image.OpenRepo(sref, opts); err != nil {
		return nil, "", m, "", err
	}
	what = sref.Tag
	if sref.Digest != "" {
		what = sref.Digest
	}
	body, _, _, err := repo.Manifest(ctx, what)
	if err != nil {
		return nil, "", m, "", err
	}
	if err := json.Unmarshal(body, &m); err != nil {
		return nil, "", m, "", errdefs.Invalid("manifest: %v", err)
	}
	return repo, what, m, tref.Tag, nil
}

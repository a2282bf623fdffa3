package image

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// RepoOptions tune OpenRepo; the fields mean what they mean in PullOptions.
type RepoOptions struct {
	Insecure           bool
	Username, Password string
	DockerConfig       string
	Client             *http.Client
}

// Repo is one repository of an OCI distribution registry, for artifacts
// other than container images (dsec's layer images): manifests read and
// written by tag or digest, blobs read whole or by byte range and pushed.
// Authentication is Pull's (bearer tokens from the registry's challenge,
// or basic credentials). Safe for concurrent use.
type Repo struct {
	reg *registry
}

// OpenRepo returns a client for the repository ref names (its tag or
// digest is ignored: each call names what it wants). It sends nothing.
func OpenRepo(ref Reference, opts RepoOptions) (*Repo, error) {
	reg, err := newRegistry(ref, PullOptions{Insecure: opts.Insecure, Username: opts.Username,
		Password: opts.Password, DockerConfig: opts.DockerConfig, Client: opts.Client})
	if err != nil {
		return nil, err
	}
	return &Repo{reg: reg}, nil
}

// Manifest fetches the manifest that tagOrDigest names, with its media
// type and digest. Fetched by digest, the content is checked against it.
func (r *Repo) Manifest(ctx context.Context, tagOrDigest string) (body []byte, mediaType, digest string, err error) {
	body, mediaType, err = r.reg.getManifest(ctx, tagOrDigest)
	if err != nil {
		return nil, "", "", err
	}
	digest = digestOf(body)
	if checkDigest(tagOrDigest) == nil && digest != tagOrDigest {
		return nil, "", "", errdefs.Invalid("manifest %s: content has digest %s", tagOrDigest, digest)
	}
	return body, mediaType, digest, nil
}

// IsDigestString reports whether s is a sha256 digest ("sha256:" and 64
// lower-case hex digits).
func IsDigestString(s string) bool {
	return checkDigest(s) == nil
}

// Blob fetches a small blob whole (at most max bytes) and checks it
// against its digest.
func (r *Repo) Blob(ctx context.Context, digest string, size, max int64) ([]byte, error) {
	if err := checkDigest(digest); err != nil {
		return nil, err
	}
	if size > max {
		return nil, errdefs.Invalid("blob %s is %d bytes, more than the %d allowed", digest, size, max)
	}
	resp, err := r.reg.get(ctx, r.blobPath(digest), nil)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, statusErr(resp, "blob "+digest)
	}
	return readVerified(resp.Body, descriptor{Digest: digest, Size: size}, max)
}

// BlobRange opens bytes [off, off+n) of a blob with an HTTP Range request.
// A registry that answers with the whole blob instead of the range is an
// error (errdefs.ErrPrecondition): reading on demand needs ranges. The
// body is not checked here; the caller verifies what it reads.
func (r *Repo) BlobRange(ctx context.Context, digest string, off, n int64) (io.ReadCloser, error) {
	if err := checkDigest(digest); err != nil {
		return nil, err
	}
	if off < 0 || n <= 0 {
		return nil, errdefs.Invalid("bad range %d+%d", off, n)
	}
	hdr := http.Header{"Range": {"bytes=" + strconv.FormatInt(off, 10) + "-" + strconv.FormatInt(off+n-1, 10)}}
	resp, err := r.reg.get(ctx, r.blobPath(digest), hdr)
	if err != nil {
		return nil, err
	}
	switch resp.StatusCode {
	case http.StatusPartialContent:
		return resp.Body, nil
	case http.StatusOK:
		resp.Body.Close()
		return nil, errdefs.Precondition("registry %s does not serve byte ranges of blobs", r.reg.ref.Registry)
	}
	defer resp.Body.Close()
	return nil, statusErr(resp, "blob "+digest)
}

// HasBlob reports whether the repository has the blob (HEAD).
func (r *Repo) HasBlob(ctx context.Context, digest string) (bool, error) {
	if err := checkDigest(digest); err != nil {
		return false, err
	}
	resp, err := r.reg.do(ctx, http.MethodHead, r.blobPath(digest), nil, nil)
	if err != nil {
		return false, err
	}
	defer resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusOK:
		return true, nil
	case http.StatusNotFound:
		return false, nil
	}
	return false, statusErr(resp, "blob "+digest)
}

// PushBlob uploads a blob of the given digest and size unless the
// repository has it, in one monolithic upload (POST, then PUT with the
// digest). open is called for each attempt and must give the blob from
// its start. It reports whether it sent the blob.
func (r *Repo) PushBlob(ctx context.Context, digest string, size int64, open func() (io.ReadCloser, error)) (bool, error) {
	if err := checkDigest(digest); err != nil {
		return false, err
	}
	if ok, err := r.HasBlob(ctx, digest); err != nil || ok {
		return false, err
	}
	resp, err := r.reg.do(ctx, http.MethodPost, "/v2/"+r.reg.ref.Repository+"/blobs/uploads/", nil,
		func() (io.Reader, int64, error) { return bytes.NewReader(nil), 0, nil })
	if err != nil {
		return false, err
	}
	io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
	if resp.StatusCode != http.StatusAccepted {
		return false, statusErr(resp, "starting upload of "+digest)
	}
	loc, err := r.uploadURL(resp.Header.Get("Location"), digest)
	if err != nil {
		return false, err
	}
	var body io.ReadCloser
	defer func() {
		if body != nil {
			body.Close()
		}
	}()
	resp, err = r.reg.do(ctx, http.MethodPut, loc, http.Header{"Content-Type": {"application/octet-stream"}},
		func() (io.Reader, int64, error) {
			if body != nil {
				body.Close()
			}
			var err error
			body, err = open()
			return body, size, err
		})
	if err != nil {
		return false, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		return false, statusErr(resp, "uploading "+digest)
	}
	return true, nil
}

// uploadURL turns an upload's Location (absolute, or relative to the
// registry) into the URL that completes it with digest. A Location on
// another host is refused: credentials must not follow it there.
func (r *Repo) uploadURL(loc, digest string) (string, error) {
	if loc == "" {
		return "", errdefs.Invalid("registry %s started an upload without a Location", r.reg.ref.Registry)
	}
	base, err := url.Parse(r.reg.base + "/")
	if err != nil {
		return "", errdefs.Invalid("registry base: %v", err)
	}
	u, err := base.Parse(loc)
	if err != nil {
		return "", errdefs.Invalid("registry %s sent a bad upload Location %q", r.reg.ref.Registry, loc)
	}
	if u.Host != base.Host || u.Scheme != base.Scheme {
		return "", errdefs.Invalid("registry %s sent an upload Location on another host (%s)", r.reg.ref.Registry, u.Host)
	}
	q := u.Query()
	q.Set("digest", digest)
	u.RawQuery = q.Encode()
	return u.String(), nil
}

// PushManifest stores a manifest under tag and returns its digest.
func (r *Repo) PushManifest(ctx context.Context, tag, mediaType string, body []byte) (string, error) {
	if !validTag(tag) {
		return "", errdefs.Invalid("bad tag %q", tag)
	}
	resp, err := r.reg.do(ctx, http.MethodPut, "/v2/"+r.reg.ref.Repository+"/manifests/"+tag,
		http.Header{"Content-Type": {mediaType}},
		func() (io.Reader, int64, error) { return bytes.NewReader(body), int64(len(body)), nil })
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		return "", statusErr(resp, "manifest "+tag)
	}
	return digestOf(body), nil
}

func (r *Repo) blobPath(digest string) string {
	return "/v2/" + r.reg.ref.Repository + "/blobs/" + digest
}

// String names the repository (REGISTRY/REPO).
func (r *Repo) String() string {
	return fmt.Sprintf("%s/%s", r.reg.ref.Registry, r.reg.ref.Repository)
}

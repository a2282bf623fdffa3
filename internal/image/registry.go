package image

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// PullOptions tune Pull.
type PullOptions struct {
	Options
	// CacheDir holds downloaded blobs by digest (CacheDir/blobs/sha256/<hex>)
	// and partial downloads next to them, which a later Pull resumes.
	// Required; created if missing.
	CacheDir string
	// Insecure talks plain HTTP to the registry (and lets a token endpoint
	// be plain HTTP too).
	Insecure bool
	// Username and Password, if set, are sent as basic credentials where
	// the registry asks for them (directly or at its token endpoint).
	Username, Password string
	// DockerConfig is a docker config.json whose "auths" entry for the
	// registry supplies credentials when Username is empty. Credential
	// helpers are not run.
	DockerConfig string
	// Attempts bounds the tries per blob download, each resuming where
	// the last broke off; zero means 4.
	Attempts int
	// Client is the HTTP client; nil means one with connection timeouts
	// and no overall timeout (layers can take long).
	Client *http.Client
}

// Pull pulls ref (REGISTRY/REPO:TAG or REGISTRY/REPO@sha256:...) from an
// OCI distribution registry and unpacks it into dest like Unpack, which
// see. Blobs are downloaded into opts.CacheDir first, each checked against
// its digest (a mismatch deletes the download and fails the pull), so a
// later pull of an image sharing layers downloads only what it lacks; a
// transfer that breaks resumes from where it stopped with an HTTP Range
// request. Errors: ErrInvalid for bad references and bad content,
// ErrNotFound for unknown images and platforms, ErrUnauthenticated and
// ErrPermissionDenied from the registry's refusals, ErrUnavailable when it
// cannot be reached.
func Pull(ctx context.Context, ref, dest string, opts PullOptions) (*Result, error) {
	res, err := pull(ctx, ref, dest, opts)
	if err != nil {
		return nil, fmt.Errorf("pulling %s: %w", ref, err)
	}
	return res, nil
}

func pull(ctx context.Context, ref, dest string, opts PullOptions) (*Result, error) {
	if err := opts.Options.check(); err != nil {
		return nil, err
	}
	want, _ := parsePlatform(opts.Platform)
	r, err := ParseReference(ref)
	if err != nil {
		return nil, err
	}
	if opts.CacheDir == "" {
		return nil, errdefs.Invalid("no cache directory given")
	}
	reg, err := newRegistry(r, opts)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(reg.blobDir(), 0o700); err != nil {
		return nil, fmt.Errorf("creating cache: %w", err)
	}

	root, err := reg.root(ctx)
	if err != nil {
		return nil, err
	}
	img, err := resolveImage(ctx, reg, root, want)
	if err != nil {
		return nil, err
	}
	var total int64
	for _, l := range img.layers {
		total += l.Size
	}
	// Compressed layers larger than twice what may be extracted cannot
	// fit; refuse before filling the cache.
	if total > 2*opts.MaxBytes {
		return nil, errdefs.Invalid("layers total %s, over twice the limit of %s", humanBytes(total), humanBytes(opts.MaxBytes))
	}
	for _, l := range img.layers {
		if err := reg.fetch(ctx, l); err != nil {
			return nil, err
		}
	}
	return applyImage(ctx, img, reg, dest, opts.Options)
}

// registry is one repository of one registry, as a source.
type registry struct {
	ref      Reference
	base     string // scheme://host
	client   *http.Client
	insecure bool
	user     string
	pass     string
	cache    string
	attempts int
	progress io.Writer

	// authMu guards the authorization learnt from challenges: a Repo
	// serves concurrent range reads.
	authMu sync.Mutex
	token  string
	basic  bool
	// docs holds the document fetched by tag, so resolving it again by
	// digest costs no request.
	docs map[string]fetchedDoc
}

type fetchedDoc struct {
	body      []byte
	mediaType string
}

func newRegistry(r Reference, opts PullOptions) (*registry, error) {
	reg := &registry{
		ref:      r,
		base:     "https://" + r.endpoint(),
		client:   opts.Client,
		insecure: opts.Insecure,
		user:     opts.Username,
		pass:     opts.Password,
		cache:    opts.CacheDir,
		attempts: opts.Attempts,
		progress: opts.Progress,
		docs:     map[string]fetchedDoc{},
	}
	if opts.Insecure {
		reg.base = "http://" + r.endpoint()
	}
	if reg.client == nil {
		t := http.DefaultTransport.(*http.Transport).Clone()
		t.ResponseHeaderTimeout = time.Minute
		reg.client = &http.Client{Transport: t}
	}
	if reg.attempts <= 0 {
		reg.attempts = 4
	}
	if reg.user == "" && opts.DockerConfig != "" {
		u, p, err := DockerConfigAuth(opts.DockerConfig, r.Registry)
		if err != nil {
			return nil, err
		}
		reg.user, reg.pass = u, p
	}
	return reg, nil
}

func (r *registry) blobDir() string { return filepath.Join(r.cache, "blobs", "sha256") }

func (r *registry) blobPath(digest string) string {
	return filepath.Join(r.blobDir(), digestHex(digest))
}

// root fetches the manifest or index the reference names, and describes it.
func (r *registry) root(ctx context.Context) (descriptor, error) {
	what := r.ref.Tag
	if r.ref.Digest != "" {
		what = r.ref.Digest
	}
	body, mt, err := r.getManifest(ctx, what)
	if err != nil {
		return descriptor{}, err
	}
	d := descriptor{MediaType: mt, Digest: digestOf(body), Size: int64(len(body))}
	if r.ref.Digest != "" && d.Digest != r.ref.Digest {
		return descriptor{}, errdefs.Invalid("manifest %s: content has digest %s", r.ref.Digest, d.Digest)
	}
	r.docs[d.Digest] = fetchedDoc{body: body, mediaType: mt}
	return d, nil
}

func (r *registry) manifest(ctx context.Context, d descriptor) ([]byte, string, error) {
	if doc, ok := r.docs[d.Digest]; ok {
		return doc.body, doc.mediaType, nil
	}
	body, mt, err := r.getManifest(ctx, d.Digest)
	if err != nil {
		return nil, "", err
	}
	if got := digestOf(body); got != d.Digest {
		return nil, "", errdefs.Invalid("manifest %s: content has digest %s", d.Digest, got)
	}
	if int64(len(body)) != d.Size {
		return nil, "", errdefs.Invalid("manifest %s: size %d, descriptor says %d", d.Digest, len(body), d.Size)
	}
	return body, mt, nil
}

// getManifest GETs /v2/<repo>/manifests/<tag or digest>.
func (r *registry) getManifest(ctx context.Context, tagOrDigest string) ([]byte, string, error) {
	hdr := http.Header{"Accept": {acceptManifests}}
	resp, err := r.get(ctx, "/v2/"+r.ref.Repository+"/manifests/"+tagOrDigest, hdr)
	if err != nil {
		return nil, "", err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, "", statusErr(resp, "manifest "+tagOrDigest)
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxManifestBytes+1))
	if err != nil {
		return nil, "", transient{fmt.Errorf("reading manifest %s: %w", tagOrDigest, err)}
	}
	if len(body) > maxManifestBytes {
		return nil, "", errdefs.Invalid("manifest %s is larger than %d bytes", tagOrDigest, maxManifestBytes)
	}
	mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	return body, mt, nil
}

func (r *registry) config(ctx context.Context, d descriptor) ([]byte, error) {
	if d.Size > maxManifestBytes {
		return nil, errdefs.Invalid("config %s is larger than %d bytes", d.Digest, maxManifestBytes)
	}
	resp, err := r.get(ctx, "/v2/"+r.ref.Repository+"/blobs/"+d.Digest, nil)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, statusErr(resp, "blob "+d.Digest)
	}
	return readVerified(resp.Body, d, maxManifestBytes)
}

// layer opens a layer fetched into the cache.
func (r *registry) layer(_ context.Context, d descriptor) (io.ReadCloser, error) {
	return os.Open(r.blobPath(d.Digest))
}

// get sends a GET, answering one authentication challenge: a Bearer
// challenge is met with a token from the realm it names, a Basic one with
// the credentials. Later requests reuse what was learnt.
func (r *registry) get(ctx context.Context, path string, hdr http.Header) (*http.Response, error) {
	return r.do(ctx, http.MethodGet, path, hdr, nil)
}

// do sends a request as get does, with any method. body, if not nil,
// opens the request body (again after a challenge) and gives its length.
// path is below the registry's base, or an absolute URL on the same host
// (an upload's Location).
func (r *registry) do(ctx context.Context, method, path string, hdr http.Header, body func() (io.Reader, int64, error)) (*http.Response, error) {
	target := r.base + path
	if strings.HasPrefix(path, "http://") || strings.HasPrefix(path, "https://") {
		target = path
	}
	for attempt := 0; ; attempt++ {
		var rd io.Reader
		size := int64(0)
		if body != nil {
			var err error
			if rd, size, err = body(); err != nil {
				return nil, err
			}
		}
		req, err := http.NewRequestWithContext(ctx, method, target, rd)
		if err != nil {
			return nil, errdefs.Invalid("building request: %v", err)
		}
		if body != nil {
			req.ContentLength = size
		}
		for k, v := range hdr {
			req.Header[k] = v
		}
		r.authMu.Lock()
		switch {
		case r.token != "":
			req.Header.Set("Authorization", "Bearer "+r.token)
		case r.basic:
			req.SetBasicAuth(r.user, r.pass)
		}
		r.authMu.Unlock()
		resp, err := r.client.Do(req)
		if err != nil {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			return nil, transient{errdefs.Unavailable("contacting registry %s: %v", r.ref.Registry, err)}
		}
		if resp.StatusCode != http.StatusUnauthorized || attempt > 0 {
			return resp, nil
		}
		challenges := resp.Header.Values("Www-Authenticate")
		io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		resp.Body.Close()
		if err := r.authenticate(ctx, challenges); err != nil {
			return nil, err
		}
	}
}

// authenticate answers the challenges of a 401.
func (r *registry) authenticate(ctx context.Context, challenges []string) error {
	for _, c := range challenges {
		scheme, params := parseChallenge(c)
		switch strings.ToLower(scheme) {
		case "bearer":
			return r.fetchToken(ctx, params)
		case "basic":
			if r.user == "" {
				return errdefs.Unauthenticated("registry %s wants credentials and none were given", r.ref.Registry)
			}
			r.authMu.Lock()
			r.basic = true
			r.authMu.Unlock()
			return nil
		}
	}
	return errdefs.Unauthenticated("registry %s refused the request without a usable challenge", r.ref.Registry)
}

// fetchToken gets a bearer token from the realm of a challenge, sending
// the credentials, if any, as basic auth (the distribution token protocol).
func (r *registry) fetchToken(ctx context.Context, params map[string]string) error {
	u, err := url.Parse(params["realm"])
	if err != nil || (u.Scheme != "https" && u.Scheme != "http") || u.Host == "" {
		return errdefs.Unauthenticated("registry %s sent a bad token realm %q", r.ref.Registry, params["realm"])
	}
	// A registry served over TLS must not steer credentials to a
	// plain-text endpoint.
	if u.Scheme == "http" && !r.insecure {
		return errdefs.Unauthenticated("registry %s sent a plain-HTTP token realm %q; refusing without Insecure", r.ref.Registry, u)
	}
	q := u.Query()
	if s := params["service"]; s != "" {
		q.Set("service", s)
	}
	scope := params["scope"]
	if scope == "" {
		scope = "repository:" + r.ref.Repository + ":pull"
	}
	q.Set("scope", scope)
	u.RawQuery = q.Encode()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return errdefs.Invalid("building token request: %v", err)
	}
	if r.user != "" {
		req.SetBasicAuth(r.user, r.pass)
	}
	resp, err := r.client.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return errdefs.Unavailable("fetching token from %s: %v", u.Host, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("fetching token: %w", statusErr(resp, "token"))
	}
	var tok struct {
		Token       string `json:"token"`
		AccessToken string `json:"access_token"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&tok); err != nil {
		return errdefs.Unauthenticated("parsing token from %s: %v", u.Host, err)
	}
	token := tok.Token
	if token == "" {
		token = tok.AccessToken
	}
	if token == "" {
		return errdefs.Unauthenticated("token endpoint %s returned no token", u.Host)
	}
	r.authMu.Lock()
	r.token = token
	r.authMu.Unlock()
	return nil
}

// parseChallenge splits a WWW-Authenticate value, `Bearer realm="...",
// service="...",scope="..."`, into its scheme and parameters.
func parseChallenge(s string) (string, map[string]string) {
	scheme, rest, _ := strings.Cut(strings.TrimSpace(s), " ")
	params := map[string]string{}
	for rest = strings.TrimSpace(rest); rest != ""; {
		key, after, ok := strings.Cut(rest, "=")
		if !ok {
			break
		}
		key = strings.ToLower(strings.TrimSpace(key))
		after = strings.TrimSpace(after)
		var val string
		if strings.HasPrefix(after, `"`) {
			// quoted-string: backslash escapes the next character
			var b strings.Builder
			i := 1
			for ; i < len(after) && after[i] != '"'; i++ {
				if after[i] == '\\' && i+1 < len(after) {
					i++
				}
				b.WriteByte(after[i])
			}
			val, after = b.String(), after[min(i+1, len(after)):]
		} else {
			val, after, _ = strings.Cut(after, ",")
			after = "," + after
		}
		params[key] = strings.TrimSpace(val)
		_, rest, _ = strings.Cut(after, ",")
		rest = strings.TrimSpace(rest)
	}
	return scheme, params
}

// transient marks errors worth another attempt: the network, the
// registry's overload, a body cut short.
type transient struct{ err error }

func (t transient) Error() string { return t.err.Error() }
func (t transient) Unwrap() error { return t.err }

func isTransient(err error) bool {
	var t transient
	return errors.As(err, &t)
}

// statusErr classifies a registry's refusal, quoting the start of its
// error body (registries explain themselves in JSON).
func statusErr(resp *http.Response, what string) error {
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
	msg := fmt.Sprintf("%s: registry answered %s: %s", what, resp.Status, strings.TrimSpace(string(body)))
	switch code := resp.StatusCode; {
	case code == http.StatusUnauthorized:
		return errdefs.Unauthenticated("%s", msg)
	case code == http.StatusForbidden:
		return errdefs.PermissionDenied("%s", msg)
	case code == http.StatusNotFound:
		return errdefs.NotFound("%s", msg)
	case code == http.StatusTooManyRequests || code >= 500:
		return transient{errdefs.Unavailable("%s", msg)}
	}
	return errdefs.Invalid("%s", msg)
}

// DockerConfigAuth returns the credentials a docker config.json holds for
// registry (a Reference's Registry) in its "auths" map, whose keys may be
// bare hosts or URLs ("https://index.docker.io/v1/" for Docker Hub). None
// is not an error.
func DockerConfigAuth(path, registry string) (user, pass string, err error) {
	f, err := os.Open(path)
	if err != nil {
		return "", "", fmt.Errorf("reading docker config: %w", err)
	}
	defer f.Close()
	var cfg struct {
		Auths map[string]struct {
			Auth     string `json:"auth"`
			Username string `json:"username"`
			Password string `json:"password"`
		} `json:"auths"`
	}
	if err := json.NewDecoder(io.LimitReader(f, 1<<20)).Decode(&cfg); err != nil {
		return "", "", errdefs.Invalid("parsing docker config %s: %v", path, err)
	}
	for key, a := range cfg.Auths {
		if configHost(key) != registry && !(registry == dockerHub && configHost(key) == "index.docker.io") {
			continue
		}
		if a.Auth == "" {
			return a.Username, a.Password, nil
		}
		raw, err := base64.StdEncoding.DecodeString(a.Auth)
		if err != nil {
			return "", "", errdefs.Invalid("docker config %s: auth for %s is not base64", path, key)
		}
		u, p, ok := strings.Cut(string(raw), ":")
		if !ok {
			return "", "", errdefs.Invalid("docker config %s: auth for %s is not user:password", path, key)
		}
		return u, p, nil
	}
	return "", "", nil
}

// configHost reduces an "auths" key to its host[:port].
func configHost(key string) string {
	key = strings.TrimPrefix(strings.TrimPrefix(key, "https://"), "http://")
	host, _, _ := strings.Cut(key, "/")
	return host
}

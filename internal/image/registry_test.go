package image

import (
	"bytes"
	"context"
	"encoding/base64"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/image/registrytest"
)

// startRegistry runs the distribution registry (Debian's docker-registry)
// on a free 127.0.0.1 port and returns its host:port.
func startRegistry(t *testing.T) string {
	t.Helper()
	return registrytest.Start(t).Addr
}

// push uploads img to the registry at base (http://host:port) as
// repo:tag: blobs through the monolithic upload (POST, then PUT with the
// digest), manifests below an index by digest, the top one by tag.
func push(t *testing.T, base, repo, tag string, img *testImage) {
	t.Helper()
	docs := map[string]bool{img.top.Digest: true}
	for _, m := range img.manifests {
		docs[m.Digest] = true
	}
	for d, b := range img.blobs {
		if docs[d] {
			continue
		}
		resp, err := http.Post(base+"/v2/"+repo+"/blobs/uploads/", "", nil)
		must(t, err)
		resp.Body.Close()
		if resp.StatusCode != http.StatusAccepted {
			t.Fatalf("starting upload: %s", resp.Status)
		}
		loc, err := url.Parse(resp.Header.Get("Location"))
		must(t, err)
		u, _ := url.Parse(base)
		u = u.ResolveReference(loc)
		q := u.Query()
		q.Set("digest", d)
		u.RawQuery = q.Encode()
		putOK(t, u.String(), "application/octet-stream", b)
	}
	for _, m := range img.manifests {
		putOK(t, base+"/v2/"+repo+"/manifests/"+m.Digest, m.MediaType, img.blobs[m.Digest])
	}
	putOK(t, base+"/v2/"+repo+"/manifests/"+tag, img.top.MediaType, img.blobs[img.top.Digest])
}

func putOK(t *testing.T, u, contentType string, body []byte) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPut, u, bytes.NewReader(body))
	must(t, err)
	req.Header.Set("Content-Type", contentType)
	resp, err := http.DefaultClient.Do(req)
	must(t, err)
	msg, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("PUT %s: %s: %s", u, resp.Status, msg)
	}
}

// proxy fronts the registry on another 127.0.0.1 port. It can demand
// bearer or basic auth (serving its own token endpoint), cut the first
// `cuts` GETs of one blob halfway, or corrupt that blob, and records the
// Range headers that blob was asked with.
type proxy struct {
	upstream string
	srv      *httptest.Server

	auth       string // "", "bearer", "basic"
	user, pass string // credentials demanded; "" for anonymous tokens

	blob    string
	cuts    int
	corrupt bool

	mu         sync.Mutex
	blobRanges []string // Range header of each GET of blob
	tokenReqs  []url.Values
}

func newProxy(t *testing.T, upstream string) *proxy {
	p := &proxy{upstream: upstream}
	p.srv = httptest.NewServer(http.HandlerFunc(p.serve))
	t.Cleanup(p.srv.Close)
	return p
}

func (p *proxy) host() string { return strings.TrimPrefix(p.srv.URL, "http://") }

func (p *proxy) serve(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/token" {
		p.mu.Lock()
		p.tokenReqs = append(p.tokenReqs, r.URL.Query())
		p.mu.Unlock()
		if u, pw, _ := r.BasicAuth(); p.user != "" && (u != p.user || pw != p.pass) {
			http.Error(w, `{"details":"bad credentials"}`, http.StatusUnauthorized)
			return
		}
		fmt.Fprint(w, `{"token":"good-token","expires_in":300}`)
		return
	}
	switch p.auth {
	case "bearer":
		if r.Header.Get("Authorization") != "Bearer good-token" {
			w.Header().Set("Www-Authenticate", fmt.Sprintf(`Bearer realm="%s/token",service="test-registry",scope="repository:test/img:pull"`, p.srv.URL))
			http.Error(w, `{"errors":[{"code":"UNAUTHORIZED"}]}`, http.StatusUnauthorized)
			return
		}
	case "basic":
		if u, pw, ok := r.BasicAuth(); !ok || u != p.user || pw != p.pass {
			w.Header().Set("Www-Authenticate", `Basic realm="test"`)
			http.Error(w, `{"errors":[{"code":"UNAUTHORIZED"}]}`, http.StatusUnauthorized)
			return
		}
	}
	req, _ := http.NewRequestWithContext(r.Context(), r.Method, "http://"+p.upstream+r.URL.RequestURI(), r.Body)
	for _, h := range []string{"Accept", "Range", "Content-Type"} {
		if v := r.Header.Get(h); v != "" {
			req.Header.Set(h, v)
		}
	}
	resp, err := http.DefaultTransport.RoundTrip(req)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)

	isBlob := r.Method == http.MethodGet && p.blob != "" && strings.HasSuffix(r.URL.Path, "/blobs/"+p.blob)
	cut := false
	if isBlob {
		p.mu.Lock()
		p.blobRanges = append(p.blobRanges, r.Header.Get("Range"))
		if p.cuts > 0 {
			p.cuts--
			cut = true
		}
		p.mu.Unlock()
		if p.corrupt && len(body) > 0 {
			body[len(body)/2] ^= 0xff
		}
	}
	for k, v := range resp.Header {
		w.Header()[k] = v
	}
	w.WriteHeader(resp.StatusCode)
	if cut {
		// Send half, then drop the connection: the client sees a body
		// shorter than its Content-Length.
		w.Write(body[:len(body)/2])
		w.(http.Flusher).Flush()
		panic(http.ErrAbortHandler)
	}
	w.Write(body)
}

func (p *proxy) ranges() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.blobRanges...)
}

// pushTestImage pushes the multi-arch base image as test/img:v1.
func pushTestImage(t *testing.T, reg string) *testImage {
	t.Helper()
	amd := buildImage(t, "amd64", true, baseLayers(t)...)
	arm := buildImage(t, "arm64", true, layerTar(t, file("arm", "arm64 only")))
	img := multiArch(t, amd, arm)
	push(t, "http://"+reg, "test/img", "v1", img)
	return img
}

func TestPullResumesBrokenTransfer(t *testing.T) {
	reg := startRegistry(t)
	img := pushTestImage(t, reg)
	px := newProxy(t, reg)
	px.auth = "bearer" // anonymous token, as Docker Hub hands out
	px.blob = sha(img.layers[0])
	cache := t.TempDir()

	// One attempt only: the cut leaves a partial download behind.
	px.cuts = 1
	_, err := Pull(t.Context(), px.host()+"/test/img:v1", t.TempDir(), PullOptions{CacheDir: cache, Insecure: true, Attempts: 1})
	if err == nil {
		t.Fatal("pull with a cut connection and one attempt succeeded")
	}
	partial := filepath.Join(cache, "blobs", "sha256", digestHex(px.blob)+".partial")
	fi, err := os.Stat(partial)
	must(t, err)
	if fi.Size() != int64(len(img.layers[0])/2) {
		t.Errorf("partial holds %d bytes, want %d", fi.Size(), len(img.layers[0])/2)
	}

	// The next pull resumes it, and within it a second cut is retried.
	px.cuts = 1
	f := newFixture(t)
	var progress bytes.Buffer
	res, err := Pull(t.Context(), px.host()+"/test/img:v1", f.dest, PullOptions{
		CacheDir: cache, Insecure: true, Options: Options{Progress: &progress}})
	must(t, err)
	checkBaseTree(t, f.dest)
	f.checkOutside(t)
	if res.Digest != img.manifest.Digest || res.Config.WorkingDir != "/work" || len(res.Layers) != 2 {
		t.Errorf("result = %+v", res)
	}
	half := len(img.layers[0]) / 2
	quarter := half + (len(img.layers[0])-half)/2
	want := []string{"", fmt.Sprintf("bytes=%d-", half), fmt.Sprintf("bytes=%d-", quarter)}
	if got := px.ranges(); strings.Join(got, "|") != strings.Join(want, "|") {
		t.Errorf("blob requests' Range headers = %q, want %q", got, want)
	}
	if px.tokenReqs[0].Get("scope") != "repository:test/img:pull" || px.tokenReqs[0].Get("service") != "test-registry" {
		t.Errorf("token request = %v", px.tokenReqs[0])
	}
	if _, err := os.Stat(partial); !os.IsNotExist(err) {
		t.Errorf("partial left behind: %v", err)
	}
	if lines := strings.Count(progress.String(), "\n"); lines == 0 || lines > 20 {
		t.Errorf("%d progress lines:\n%s", lines, progress.String())
	}

	// By digest, from the cache: no blob is fetched again.
	n := len(px.ranges())
	_, err = Pull(t.Context(), px.host()+"/test/img@"+img.top.Digest, t.TempDir(), PullOptions{CacheDir: cache, Insecure: true})
	must(t, err)
	if len(px.ranges()) != n {
		t.Error("a cached blob was downloaded again")
	}
}

func TestPullBadDigestDeletesDownload(t *testing.T) {
	reg := startRegistry(t)
	img := pushTestImage(t, reg)
	px := newProxy(t, reg)
	px.blob = sha(img.layers[1])
	px.corrupt = true
	cache := t.TempDir()
	_, err := Pull(t.Context(), px.host()+"/test/img:v1", t.TempDir(), PullOptions{CacheDir: cache, Insecure: true})
	wantClass(t, err, errdefs.ErrInvalid)
	for _, p := range []string{"", ".partial"} {
		if _, err := os.Stat(filepath.Join(cache, "blobs", "sha256", digestHex(px.blob)+p)); !os.IsNotExist(err) {
			t.Errorf("corrupt blob%s kept in the cache: %v", p, err)
		}
	}
	if len(px.ranges()) != 1 {
		t.Errorf("a bad digest was retried: %q", px.ranges())
	}
}

func TestPullAuth(t *testing.T) {
	reg := startRegistry(t)
	pushTestImage(t, reg)

	dockerConfig := func(t *testing.T, host, user, pass string) string {
		p := filepath.Join(t.TempDir(), "config.json")
		auth := base64.StdEncoding.EncodeToString([]byte(user + ":" + pass))
		must(t, os.WriteFile(p, []byte(fmt.Sprintf(`{"auths":{"http://%s":{"auth":%q},"other.example":{"auth":"eDp5"}}}`, host, auth)), 0o600))
		return p
	}
	t.Run("bearer with docker config credentials", func(t *testing.T) {
		px := newProxy(t, reg)
		px.auth, px.user, px.pass = "bearer", "alice", "s3cret:with:colons"
		_, err := Pull(t.Context(), px.host()+"/test/img:v1", t.TempDir(), PullOptions{
			CacheDir: t.TempDir(), Insecure: true, DockerConfig: dockerConfig(t, px.host(), "alice", "s3cret:with:colons")})
		must(t, err)
	})
	t.Run("bearer with wrong password", func(t *testing.T) {
		px := newProxy(t, reg)
		px.auth, px.user, px.pass = "bearer", "alice", "right"
		_, err := Pull(t.Context(), px.host()+"/test/img:v1", t.TempDir(), PullOptions{
			CacheDir: t.TempDir(), Insecure: true, Username: "alice", Password: "wrong"})
		wantClass(t, err, errdefs.ErrUnauthenticated)
	})
	t.Run("basic", func(t *testing.T) {
		px := newProxy(t, reg)
		px.auth, px.user, px.pass = "basic", "bob", "pw"
		_, err := Pull(t.Context(), px.host()+"/test/img:v1", t.TempDir(), PullOptions{
			CacheDir: t.TempDir(), Insecure: true, Username: "bob", Password: "pw"})
		must(t, err)
	})
	t.Run("basic without credentials", func(t *testing.T) {
		px := newProxy(t, reg)
		px.auth, px.user, px.pass = "basic", "bob", "pw"
		_, err := Pull(t.Context(), px.host()+"/test/img:v1", t.TempDir(), PullOptions{CacheDir: t.TempDir(), Insecure: true})
		wantClass(t, err, errdefs.ErrUnauthenticated)
	})
}

func TestPullErrors(t *testing.T) {
	reg := startRegistry(t)
	img := pushTestImage(t, reg)
	opts := func() PullOptions { return PullOptions{CacheDir: t.TempDir(), Insecure: true} }

	_, err := Pull(t.Context(), reg+"/test/img:nope", t.TempDir(), opts())
	wantClass(t, err, errdefs.ErrNotFound)

	o := opts()
	o.Platform = "linux/riscv64"
	_, err = Pull(t.Context(), reg+"/test/img:v1", t.TempDir(), o)
	wantClass(t, err, errdefs.ErrNotFound)
	if !strings.Contains(err.Error(), "linux/arm64") {
		t.Errorf("error does not list the platforms: %v", err)
	}

	// A digest the tag does not resolve to.
	wrong := sha([]byte("x"))
	_, err = Pull(t.Context(), reg+"/test/img@"+wrong, t.TempDir(), opts())
	wantClass(t, err, errdefs.ErrNotFound)

	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	_, err = Pull(ctx, reg+"/test/img:v1", t.TempDir(), opts())
	if err == nil || !strings.Contains(err.Error(), "context canceled") {
		t.Errorf("cancelled pull: %v", err)
	}

	// Nothing listens on a port we just closed: unavailable.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	must(t, err)
	dead := l.Addr().String()
	l.Close()
	_, err = Pull(t.Context(), dead+"/test/img:v1", t.TempDir(), opts())
	wantClass(t, err, errdefs.ErrUnavailable)

	_ = img
}

// skopeo copies from the registry into the archive formats other tools
// write; Unpack must read them.
func TestUnpackSkopeoArchives(t *testing.T) {
	skopeo, err := exec.LookPath("skopeo")
	if err != nil {
		t.Skip("needs skopeo (apt-get install skopeo) to write oci-archive and docker-archive files")
	}
	reg := startRegistry(t)
	pushTestImage(t, reg)
	for _, format := range []string{"oci-archive", "docker-archive"} {
		t.Run(format, func(t *testing.T) {
			out := filepath.Join(t.TempDir(), "image.tar")
			dest := out + ":test/img:v1"
			cmd := exec.Command(skopeo, "--insecure-policy", "copy", "--src-tls-verify=false",
				"docker://"+reg+"/test/img:v1", format+":"+dest)
			home := t.TempDir()
			cmd.Env = append(os.Environ(), "HOME="+home, "TMPDIR="+home, "XDG_RUNTIME_DIR="+home)
			if b, err := cmd.CombinedOutput(); err != nil {
				t.Fatalf("skopeo copy: %v\n%s", err, b)
			}
			f := newFixture(t)
			res, err := Unpack(t.Context(), out, f.dest, Options{})
			must(t, err)
			checkBaseTree(t, f.dest)
			if res.Config.WorkingDir != "/work" || len(res.Layers) != 2 {
				t.Errorf("result = %+v", res)
			}
			f.checkOutside(t)
		})
	}
}

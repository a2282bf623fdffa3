package e2e

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/internal/image/registrytest"
)

// authProxy puts basic authentication in front of a registry: what OCI
// registries with htpasswd users answer.
func authProxy(t *testing.T, upstream, user, pass string) string {
	t.Helper()
	u, _ := url.Parse("http://" + upstream)
	rp := httputil.NewSingleHostReverseProxy(u)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if u, p, ok := r.BasicAuth(); !ok || u != user || p != pass {
			w.Header().Set("Www-Authenticate", `Basic realm="e2e"`)
			http.Error(w, `{"errors":[{"code":"UNAUTHORIZED"}]}`, http.StatusUnauthorized)
			return
		}
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}

// layer push and add send the credentials they are given (flags, or the
// registry's entry in a docker config) for that call only; without them
// the registry's refusal is the caller's error, never a dsec 401.
func TestLayerPushAddWithRegistryCredentials(t *testing.T) {
	needDaemon(t)
	reg := registrytest.Start(t)
	host := authProxy(t, reg.Addr, "alice", "s3cret")
	tarball := tarLayer(t, layerEntry{Name: "auth/", Dir: true}, layerEntry{Name: "auth/hello.txt", Body: "behind a password\n"})
	const ref = "workspace/e2e-auth:v1"
	if _, err := client.BuildLayer(ctx(t), "workspace", "e2e-auth", "v1", bytes.NewReader(tarball)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, r := range []string{ref, "workspace/e2e-auth-added:v1", "workspace/e2e-auth-cfg:v1"} {
			client.DeleteLayer(ctx(t), r)
		}
	})
	target := "oci://" + host + "/e2e/auth:v1"
	empty := filepath.Join(t.TempDir(), "none.json")
	if err := os.WriteFile(empty, []byte(`{"auths":{}}`), 0o600); err != nil {
		t.Fatal(err)
	}

	out, errOut, code := cli("layer", "push", "--insecure", "--docker-config", empty, ref, target)
	if code == 0 || !strings.Contains(errOut, "registry refused access") {
		t.Fatalf("push without credentials: exit %d: %s %s", code, out, errOut)
	}
	out, errOut, code = cliIn([]byte("wrong\n"), "layer", "push", "--insecure", "--username", "alice", "--password-stdin", ref, target)
	if code == 0 || !strings.Contains(errOut, "registry refused access") {
		t.Fatalf("push with a wrong password: exit %d: %s %s", code, out, errOut)
	}
	out, errOut, code = cliIn([]byte("s3cret\n"), "layer", "push", "--insecure", "--username", "alice", "--password-stdin", ref, target)
	if code != 0 || !strings.Contains(out, "pushed "+ref) {
		t.Fatalf("push with credentials: exit %d: %s %s", code, out, errOut)
	}

	out, errOut, code = cli("layer", "add", "--insecure", "--docker-config", empty, "workspace/e2e-auth-added:v1", target)
	if code == 0 || !strings.Contains(errOut, "registry refused access") {
		t.Fatalf("add without credentials: exit %d: %s %s", code, out, errOut)
	}
	out, errOut, code = cliIn([]byte("s3cret"), "layer", "add", "--insecure", "--username", "alice", "--password-stdin", "workspace/e2e-auth-added:v1", target)
	if code != 0 {
		t.Fatalf("add with credentials: exit %d: %s %s", code, out, errOut)
	}
	// The docker config's entry for the registry, as docker login writes it.
	cfg := filepath.Join(t.TempDir(), "config.json")
	auth := base64.StdEncoding.EncodeToString([]byte("alice:s3cret"))
	if err := os.WriteFile(cfg, []byte(fmt.Sprintf(`{"auths":{"%s":{"auth":%q}}}`, host, auth)), 0o600); err != nil {
		t.Fatal(err)
	}
	out, errOut, code = cli("layer", "add", "--insecure", "--docker-config", cfg, "workspace/e2e-auth-cfg:v1", target)
	if code != 0 {
		t.Fatalf("add with the docker config's credentials: exit %d: %s %s", code, out, errOut)
	}
	// Nothing of them is kept.
	l, err := client.GetLayer(ctx(t), "workspace/e2e-auth-cfg:v1")
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := json.Marshal(l); strings.Contains(string(b), "s3cret") || strings.Contains(string(b), auth) {
		t.Errorf("the catalog entry holds the credentials: %s", b)
	}
	// --username alone, or the password alone, is a usage error.
	if _, errOut, code := cli("layer", "add", "--insecure", "--username", "alice", "workspace/x:1", target); code == 0 || !strings.Contains(errOut, "--password-stdin") {
		t.Errorf("--username without a password: exit %d: %s", code, errOut)
	}
}

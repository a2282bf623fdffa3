package e2e

import (
	"bufio"
	"bytes"
	"encoding/base64"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// authRoutes is every /v1 route of the API (API.md and the apiserver's mux),
// with a concrete path. None of them may do anything without a valid key.
func authRoutes(id string) [][2]string {
	sb := "/v1/sandboxes/" + id
	return [][2]string{
		{"GET", "/v1/openapi.yaml"},
		{"POST", "/v1/sandboxes"},
		{"POST", "/v1/sandboxes:batch"},
		{"GET", "/v1/sandboxes"},
		{"POST", "/v1/sandboxes:delete"},
		{"POST", "/v1/sandboxes:pause"},
		{"POST", "/v1/sandboxes:resume"},
		{"GET", sb},
		{"DELETE", sb},
		{"POST", sb + "/keepalive"},
		{"GET", sb + "/stats"},
		{"POST", sb + "/exec"},
		{"POST", sb + "/exec?stream=true"},
		{"POST", sb + "/sessions"},
		{"POST", sb + "/sessions/s1/run"},
		{"DELETE", sb + "/sessions/s1"},
		{"GET", sb + "/pty"},
		{"GET", sb + "/files?path=/etc/passwd"},
		{"PUT", sb + "/files?path=/tmp/unauth"},
		{"DELETE", sb + "/files?path=/etc/passwd"},
		{"GET", sb + "/files:list?path=/"},
		{"GET", sb + "/files:stat?path=/"},
		{"GET", sb + "/files:tar?path=/etc"},
		{"PUT", sb + "/files:tar?path=/tmp"},
		{"POST", sb + "/pause"},
		{"POST", sb + "/resume"},
		{"POST", sb + "/snapshot"},
		{"POST", sb + "/fork"},
		{"PUT", sb + "/network"},
		{"GET", sb + "/ports/8080/x"},
		{"GET", sb + "/log"},
		{"POST", "/v1/fncall"},
		{"POST", "/v1/layers?kind=toolkit&name=unauth&tag=v1"},
		{"GET", "/v1/layers"},
		{"GET", "/v1/layers/" + baseRef},
		{"DELETE", "/v1/layers/" + toolkitRef},
		{"POST", "/v1/images:import?ref=base/unauth:v1"},
		{"POST", "/v1/images:pull"},
		{"GET", "/v1/nodes"},
		{"POST", "/v1/projects"},
		{"GET", "/v1/projects/root"},
		{"POST", "/v1/projects/root/keys"},
		{"GET", "/v1/no/such/route"},
	}
}

func TestAuthRequiredOnEveryV1Route(t *testing.T) {
	needDaemon(t)
	sb := newSandbox(t, api.SandboxSpec{})
	marker := "/tmp/unauth"
	layersBefore, _, _ := cli("layer", "list", "--json")

	badAuth := map[string]string{
		"no header":      wireAuthNone,
		"wrong key":      "Bearer wrong-" + d.key,
		"key prefix":     "Bearer " + d.key[:len(d.key)-1],
		"key with junk":  "Bearer " + d.key + "x",
		"empty bearer":   "Bearer ",
		"bare key":       d.key,
		"basic":          "Basic " + base64.StdEncoding.EncodeToString([]byte("admin:"+d.key)),
		"basic with key": "Basic " + d.key,
		"token scheme":   "Token " + d.key,
	}
	body := []byte(`{"base":"` + baseRef + `","cmd":"touch /tmp/pwned","count":1,"labels":{"x":"y"}}`)
	limited := 0
	t.Cleanup(func() { waitAuthLimit(t) })
	for _, rt := range authRoutes(sb.ID) {
		for name, auth := range badAuth {
			what := name + ": " + rt[0] + " " + rt[1]
			r := wireCallAuth(t, rt[0], rt[1], body, auth)
			wireWantError(t, what, r, 401, "unauthenticated")
			if bytes.Contains(r.Body, []byte("too many failed authentications")) {
				limited++
			}
			if wa := r.Header.Get("WWW-Authenticate"); !strings.HasPrefix(wa, "Bearer") {
				t.Errorf("%s: WWW-Authenticate %q, want a Bearer challenge", what, wa)
			}
			if bytes.Contains(r.Body, []byte(d.key)) {
				t.Errorf("%s: the response echoes the admin key", what)
			}
		}
	}
	// The wrong keys were rate limited past the burst (a key is looked
	// at again once the address's bucket refills, about a second).
	if limited == 0 {
		t.Error("hundreds of wrong keys from one address were never rate limited")
	}
	waitAuthLimit(t)
	// None of it had an effect.
	res := sh(t, sb.ID, "test -e "+marker+" && echo written; test -e /tmp/pwned && echo ran; test -e /etc/passwd || echo deleted")
	if res.Stdout != "" {
		t.Errorf("unauthenticated calls had effects in the sandbox: %q", res.Stdout)
	}
	if got, err := client.GetSandbox(ctx(t), sb.ID); err != nil || got.State != api.StateRunning {
		t.Errorf("sandbox after unauthenticated calls: %+v, %v", got, err)
	}
	if after, _, _ := cli("layer", "list", "--json"); after != layersBefore {
		t.Errorf("layers changed:\nbefore %s\nafter %s", layersBefore, after)
	}

	// The right key, in any case of the scheme, works.
	for _, scheme := range []string{"Bearer ", "bearer ", "BEARER "} {
		if r := wireCallAuth(t, "GET", "/v1/sandboxes/"+sb.ID, nil, scheme+d.key); r.Status != 200 {
			t.Errorf("%q scheme: status %d %s", scheme, r.Status, r.Body)
		}
	}
	// The SDK with a wrong key gets the classified error.
	bad, err := dsec.New(dsec.WithEndpoint("http://"+d.listen), dsec.WithAPIKey("nope"))
	if err != nil {
		t.Fatal(err)
	}
	_, err = bad.GetSandbox(ctx(t), sb.ID)
	wantCode(t, err, "unauthenticated")
}

// waitAuthLimit waits until this address may authenticate again after a
// test's wrong keys (the rate limit of failed authentication).
func waitAuthLimit(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if r := wireCallAuth(t, "GET", "/v1/whoami", nil, "Bearer "+d.key); r.Status == 200 {
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Fatal("the admin key is still refused 10 s after the wrong keys")
}

func TestAuthHealthzAndMetricsAreOpen(t *testing.T) {
	needDaemon(t)
	r := wireCallAuth(t, "GET", "/healthz", nil, wireAuthNone)
	if r.Status != 200 || !bytes.Contains(r.Body, []byte(`"ok"`)) {
		t.Fatalf("healthz: %d %s", r.Status, r.Body)
	}
	r = wireCallAuth(t, "GET", "/metrics", nil, wireAuthNone)
	if r.Status != 200 || !bytes.Contains(r.Body, []byte("# TYPE")) {
		t.Fatalf("metrics: %d %.300s", r.Status, r.Body)
	}
	// A bad key on an open endpoint does not turn it into a 401.
	if r := wireCallAuth(t, "GET", "/healthz", nil, "Bearer wrong"); r.Status != 200 {
		t.Errorf("healthz with a wrong key: %d", r.Status)
	}
}

// metricValue returns the value of the first sample line of name whose
// labels include every given label pair (in any order), and whether one was
// found.
func metricValue(text, name string, labels ...string) (float64, bool) {
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "#") {
			continue
		}
		series, val, ok := strings.Cut(line, " ")
		if !ok {
			continue
		}
		n, lbl, _ := strings.Cut(series, "{")
		if n != name {
			continue
		}
		all := true
		for _, l := range labels {
			all = all && strings.Contains(","+strings.TrimSuffix(lbl, "}")+",", ","+l+",")
		}
		if !all {
			continue
		}
		f, err := strconv.ParseFloat(strings.Fields(val)[0], 64)
		if err != nil {
			continue
		}
		return f, true
	}
	return 0, false
}

func TestAuthMetricsContent(t *testing.T) {
	needDaemon(t)
	sb := newSandbox(t, api.SandboxSpec{})
	sh(t, sb.ID, "true")

	// A creation that fails on the edge: a layer whose blob is corrupt on
	// disk (the catalog is fine, so the apiserver forwards the create).
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "f"), []byte("corrupt-me "+t.Name()+strconv.Itoa(os.Getpid())), 0o644); err != nil {
		t.Fatal(err)
	}
	ref := "toolkit/e2e-corrupt:v1"
	if _, e, code := cli("layer", "build", "--kind", "toolkit", "--name", "e2e-corrupt", "--tag", "v1", dir); code != 0 {
		t.Fatalf("layer build: %s", e)
	}
	t.Cleanup(func() { cli("layer", "delete", ref) })
	l, err := client.GetLayer(ctx(t), ref)
	if err != nil {
		t.Fatal(err)
	}
	blob := filepath.Join(d.stateDir, "layers", "blobs", "sha256", strings.TrimPrefix(l.Digest, "sha256:")+".erofs")
	if err := os.WriteFile(blob, bytes.Repeat([]byte("not erofs "), 1000), 0o644); err != nil {
		t.Fatal(err)
	}
	mountsBefore := len(hostMounts(d.stateDir))
	before := wireSandboxIDs(t)
	failuresBefore, _ := metricValue(string(wireCallAuth(t, "GET", "/metrics", nil, wireAuthNone).Body), "dsec_sandbox_create_failures_total")
	failed, err := client.CreateSandbox(ctx(t), api.SandboxSpec{Base: baseRef, Toolkits: []string{ref}})
	if err == nil {
		_ = client.DeleteSandbox(ctx(t), failed.ID)
		t.Fatal("create with a corrupt layer blob succeeded")
	}
	t.Logf("create with a corrupt layer: %v", err)
	if n := len(hostMounts(d.stateDir)); n != mountsBefore {
		t.Errorf("failed create left mounts: %d before, %d after", mountsBefore, n)
	}
	if after := wireSandboxIDs(t); strings.Join(after, ",") != strings.Join(before, ",") {
		t.Errorf("failed create left a sandbox: before %v after %v", before, after)
	}

	r := wireCallAuth(t, "GET", "/metrics", nil, wireAuthNone)
	if r.Status != 200 {
		t.Fatalf("metrics: %d", r.Status)
	}
	text := string(r.Body)
	if v, ok := metricValue(text, "dsec_sandboxes", `state="running"`, `backend="container"`); !ok || v < 1 {
		t.Errorf("dsec_sandboxes{state=\"running\"} = %v (found %v), want >= 1", v, ok)
	}
	for _, st := range []string{"creating", "paused", "stopped", "failed"} {
		if _, ok := metricValue(text, "dsec_sandboxes", `state="`+st+`"`); !ok {
			t.Errorf("dsec_sandboxes has no state=%q series", st)
		}
	}
	if v, ok := metricValue(text, "dsec_sandbox_create_seconds_count"); !ok || v < 1 {
		t.Errorf("dsec_sandbox_create_seconds_count = %v (found %v), want >= 1", v, ok)
	}
	if !regexp.MustCompile(`(?m)^dsec_sandbox_create_seconds_bucket\{le="[^"]+"\} \d+`).MatchString(text) {
		t.Error("no dsec_sandbox_create_seconds_bucket series")
	}
	if v, ok := metricValue(text, "dsec_exec_seconds_count"); !ok || v < 1 {
		t.Errorf("dsec_exec_seconds_count = %v (found %v), want >= 1", v, ok)
	}
	if !regexp.MustCompile(`(?m)^dsec_exec_seconds_bucket\{`).MatchString(text) {
		t.Error("no dsec_exec_seconds_bucket series")
	}
	if v, ok := metricValue(text, "dsec_sandbox_create_failures_total"); !ok || v < failuresBefore+1 {
		t.Errorf("dsec_sandbox_create_failures_total = %v (found %v), want >= %v after a failed create", v, ok, failuresBefore+1)
	}
	if !strings.Contains(text, "dsec_api_requests_total{") {
		t.Error("no dsec_api_requests_total series")
	}
	// Metrics never carry the key.
	if strings.Contains(text, d.key) {
		t.Error("/metrics contains the admin key")
	}
}

func TestAuthOpenAPIServed(t *testing.T) {
	needDaemon(t)
	r := wireCall(t, "GET", "/v1/openapi.yaml", nil)
	if r.Status != 200 {
		t.Fatalf("openapi: %d %s", r.Status, r.Body)
	}
	if !bytes.HasPrefix(r.Body, []byte("openapi: 3.0")) {
		t.Fatalf("openapi.yaml starts with %.40q, want \"openapi: 3.0\"", r.Body)
	}
	if !bytes.Equal(r.Body, api.OpenAPI) {
		t.Error("served openapi.yaml differs from the embedded api/openapi.yaml")
	}
	for _, p := range []string{"/v1/sandboxes", "files:tar", "/exec"} {
		if !bytes.Contains(r.Body, []byte(p)) {
			t.Errorf("openapi.yaml does not describe %s", p)
		}
	}
}

func TestAuthConfigFileWrittenByUp(t *testing.T) {
	needDaemon(t)
	cfg, err := dsec.LoadConfig(d.cfgPath)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Endpoint != "http://"+d.listen {
		t.Errorf("config endpoint %q, want %q", cfg.Endpoint, "http://"+d.listen)
	}
	if cfg.APIKey != d.key {
		t.Errorf("config api_key %q, want the --api-key value", cfg.APIKey)
	}
	st, err := os.Stat(d.cfgPath)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm()&0o077 != 0 {
		t.Errorf("config file mode %v: it holds a key, want no group/other access", st.Mode().Perm())
	}
	// The CLI works from the config file alone (no DSEC_ENDPOINT/DSEC_API_KEY).
	cmd := exec.Command(d.bin, "sandbox", "list")
	env := []string{"DSEC_CONFIG=" + d.cfgPath}
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "DSEC_") {
			env = append(env, kv)
		}
	}
	cmd.Env = env
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("dsec sandbox list with only the config file: %v: %s", err, out)
	}
	// And the SDK's config loading (FromEnv with only DSEC_CONFIG) agrees.
	t.Setenv(dsec.EnvEndpoint, "")
	t.Setenv(dsec.EnvAPIKey, "")
	t.Setenv(dsec.EnvConfig, d.cfgPath)
	c, err := dsec.FromEnv()
	if err != nil {
		t.Fatal(err)
	}
	if c.Endpoint() != "http://"+d.listen {
		t.Errorf("FromEnv endpoint %q", c.Endpoint())
	}
	if _, err := c.ListSandboxes(ctx(t), dsec.ListOptions{}); err != nil {
		t.Errorf("listing with the config's key: %v", err)
	}
}

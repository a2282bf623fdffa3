package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"mime"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// The helpers below (wire*) talk to the daemon with plain net/http, so that
// the tests see exactly what goes over the wire, not what the SDK makes of it.

// wireResp is one raw HTTP answer.
type wireResp struct {
	Status int
	Header http.Header
	Body   []byte
}

// wireAuthNone asks wireCallAuth to send no Authorization header.
const wireAuthNone = "\x00none"

var wireHTTP = &http.Client{Timeout: 2 * time.Minute}

// wireCall sends an authenticated request (Bearer d.key). target is the path
// with its query, already escaped.
func wireCall(t *testing.T, method, target string, body []byte) wireResp {
	t.Helper()
	return wireCallAuth(t, method, target, body, "Bearer "+d.key)
}

// wireCallAuth sends a request with the given Authorization header value
// (wireAuthNone: no header at all).
func wireCallAuth(t *testing.T, method, target string, body []byte, auth string) wireResp {
	t.Helper()
	r, err := wireTry(t, method, target, body, auth)
	if err != nil {
		t.Fatalf("%s %s: %v", method, target, err)
	}
	return r
}

// wireTry is wireCallAuth that returns transport errors (a connection the
// server aborted) instead of failing the test.
func wireTry(t *testing.T, method, target string, body []byte, auth string) (wireResp, error) {
	t.Helper()
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx(t), method, "http://"+d.listen+target, rd)
	if err != nil {
		t.Fatalf("building %s %s: %v", method, target, err)
	}
	if auth != wireAuthNone {
		req.Header.Set("Authorization", auth)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := wireHTTP.Do(req)
	if err != nil {
		return wireResp{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return wireResp{}, fmt.Errorf("reading body: %w", err)
	}
	return wireResp{Status: resp.StatusCode, Header: resp.Header, Body: b}, nil
}

// wireWantError asserts the API.md error shape: the status, a JSON body that
// is exactly {"error":{"code","message"}} with the given code and a
// non-empty message. It returns the message.
func wireWantError(t *testing.T, what string, r wireResp, status int, code string) string {
	t.Helper()
	if r.Status != status {
		t.Errorf("%s: status %d, want %d; body %.300q", what, r.Status, status, r.Body)
		return ""
	}
	if ct, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type")); ct != "application/json" {
		t.Errorf("%s: Content-Type %q, want application/json", what, r.Header.Get("Content-Type"))
	}
	// Strict shape: no other top-level or nested fields.
	var top map[string]json.RawMessage
	if err := json.Unmarshal(r.Body, &top); err != nil {
		t.Errorf("%s: body is not a JSON object: %v: %.300q", what, err, r.Body)
		return ""
	}
	if len(top) != 1 || top["error"] == nil {
		t.Errorf("%s: body %s: want exactly one top-level field \"error\"", what, r.Body)
		return ""
	}
	var inner map[string]any
	if err := json.Unmarshal(top["error"], &inner); err != nil {
		t.Errorf("%s: error is not an object: %s", what, r.Body)
		return ""
	}
	gotCode, _ := inner["code"].(string)
	msg, _ := inner["message"].(string)
	if len(inner) != 2 || gotCode != code || msg == "" {
		t.Errorf("%s: error %s, want {code:%q, message:<non-empty>}", what, top["error"], code)
	}
	return msg
}

// wireSandboxIDs lists the ids of all sandboxes through the SDK.
func wireSandboxIDs(t *testing.T) []string {
	t.Helper()
	all, err := client.ListAllSandboxes(ctx(t), dsec.ListOptions{})
	if err != nil {
		t.Fatalf("listing sandboxes: %v", err)
	}
	ids := make([]string, 0, len(all))
	for _, sb := range all {
		ids = append(ids, sb.ID)
	}
	sort.Strings(ids)
	return ids
}

// wireSandboxDirs lists the edge's per-sandbox directories on the host.
func wireSandboxDirs(t *testing.T) []string {
	t.Helper()
	ents, err := os.ReadDir(filepath.Join(d.stateDir, "edge", "sandboxes"))
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	sort.Strings(out)
	return out
}

func TestBadInputErrorsAndNoLeftovers(t *testing.T) {
	needDaemon(t)
	idsBefore := wireSandboxIDs(t)
	dirsBefore := wireSandboxDirs(t)
	mountsBefore := len(hostMounts(d.stateDir))

	// A sandbox that exists (for exec cases) and one that existed.
	live := newSandbox(t, api.SandboxSpec{})
	gone, err := client.CreateSandbox(ctx(t), api.SandboxSpec{Base: baseRef})
	if err != nil {
		t.Fatal(err)
	}
	if err := client.DeleteSandbox(ctx(t), gone.ID); err != nil {
		t.Fatal(err)
	}

	spec := func(extra string) []byte {
		return []byte(`{"base":"` + baseRef + `"` + extra + `}`)
	}
	type tc struct {
		name         string
		method, path string
		body         []byte
		status       int
		code         string
		msgHas       string // the message must mention this
	}
	const sbs = "/v1/sandboxes"
	cases := []tc{
		// Decoding.
		{"malformed JSON", "POST", sbs, []byte(`{"base":`), 400, "invalid_argument", ""},
		{"not JSON", "POST", sbs, []byte(`base=base/e2e:v1`), 400, "invalid_argument", ""},
		{"JSON array", "POST", sbs, []byte(`[]`), 400, "invalid_argument", ""},
		{"wrong type memory_mb", "POST", sbs, spec(`,"memory_mb":"lots"`), 400, "invalid_argument", "memory_mb"},
		{"wrong type cpu", "POST", sbs, spec(`,"cpu":"two"`), 400, "invalid_argument", "cpu"},
		{"wrong type labels", "POST", sbs, spec(`,"labels":["a"]`), 400, "invalid_argument", "labels"},
		{"wrong type toolkits", "POST", sbs, spec(`,"toolkits":"toolkit/e2e:v1"`), 400, "invalid_argument", "toolkits"},
		{"number overflows int64", "POST", sbs, spec(`,"memory_mb":1e30`), 400, "invalid_argument", "memory_mb"},
		{"unknown field", "POST", sbs, spec(`,"bogus_field":1`), 400, "invalid_argument", "bogus_field"},
		{"trailing garbage", "POST", sbs, append(spec(""), []byte(` xyz`)...), 400, "invalid_argument", ""},
		{"two objects", "POST", sbs, append(spec(""), spec("")...), 400, "invalid_argument", ""},
		{"empty body", "POST", sbs, []byte{}, 400, "invalid_argument", ""},
		{"empty object", "POST", sbs, []byte(`{}`), 400, "invalid_argument", "base"},
		{"null", "POST", sbs, []byte(`null`), 400, "invalid_argument", ""},
		// Layer refs.
		{"unknown base", "POST", sbs, []byte(`{"base":"base/no-such-layer:v9"}`), 404, "not_found", "base/no-such-layer:v9"},
		{"unknown workspace", "POST", sbs, spec(`,"workspace":"workspace/no-such-ws:v1"`), 404, "not_found", "workspace/no-such-ws:v1"},
		{"unknown toolkit", "POST", sbs, spec(`,"toolkits":["toolkit/e2e:v1","toolkit/no-such-tk:v1"]`), 404, "not_found", "toolkit/no-such-tk:v1"},
		{"unknown digest", "POST", sbs, []byte(`{"base":"sha256:` + strings.Repeat("ab", 32) + `"}`), 404, "not_found", strings.Repeat("ab", 32)},
		{"malformed ref no tag", "POST", sbs, []byte(`{"base":"base/e2e"}`), 400, "invalid_argument", ""},
		{"malformed ref no kind", "POST", sbs, []byte(`{"base":"e2e:v1"}`), 400, "invalid_argument", ""},
		{"malformed ref bad kind", "POST", sbs, []byte(`{"base":"bogus/e2e:v1"}`), 400, "invalid_argument", ""},
		{"malformed ref spaces", "POST", sbs, []byte(`{"base":"base/e 2e:v1"}`), 400, "invalid_argument", ""},
		{"malformed ref traversal", "POST", sbs, []byte(`{"base":"base/../../etc:v1"}`), 400, "invalid_argument", ""},
		{"malformed digest", "POST", sbs, []byte(`{"base":"sha256:xyz"}`), 400, "invalid_argument", ""},
		{"base and image", "POST", sbs, spec(`,"image":"base/e2e:v1"`), 400, "invalid_argument", ""},
		{"workspace ref as base", "POST", sbs, []byte(`{"base":"` + workspaceRef + `"}`), 400, "invalid_argument", workspaceRef},
		{"toolkit ref as workspace", "POST", sbs, spec(`,"workspace":"` + toolkitRef + `"`), 400, "invalid_argument", toolkitRef},
		{"base ref as toolkit", "POST", sbs, spec(`,"toolkits":["` + baseRef + `"]`), 400, "invalid_argument", baseRef},
		// Resources.
		{"negative cpu", "POST", sbs, spec(`,"cpu":-1`), 400, "invalid_argument", "cpu"},
		{"absurd cpu", "POST", sbs, spec(`,"cpu":1e9`), 400, "invalid_argument", "cpu"},
		{"tiny cpu", "POST", sbs, spec(`,"cpu":0.0001`), 400, "invalid_argument", "cpu"},
		{"negative memory", "POST", sbs, spec(`,"memory_mb":-5`), 400, "invalid_argument", "memory_mb"},
		{"absurd memory", "POST", sbs, spec(`,"memory_mb":9223372036854775807`), 400, "invalid_argument", "memory_mb"},
		{"negative pids", "POST", sbs, spec(`,"pids":-1`), 400, "invalid_argument", "pids"},
		{"absurd pids", "POST", sbs, spec(`,"pids":1000000000000`), 400, "invalid_argument", "pids"},
		{"negative ttl", "POST", sbs, spec(`,"ttl":-1`), 400, "invalid_argument", "ttl"},
		{"absurd ttl", "POST", sbs, spec(`,"ttl":1000000000000`), 400, "invalid_argument", "ttl"},
		{"negative idle_timeout", "POST", sbs, spec(`,"idle_timeout":-3`), 400, "invalid_argument", "idle_timeout"},
		{"negative disk", "POST", sbs, spec(`,"disk_mb":-1`), 400, "invalid_argument", "disk_mb"},
		{"unknown backend", "POST", sbs, spec(`,"backend":"hyperdrive"`), 400, "invalid_argument", "hyperdrive"},
		{"bad qos", "POST", sbs, spec(`,"qos":"gold"`), 400, "invalid_argument", "qos"},
		{"relative workdir", "POST", sbs, spec(`,"workdir":"repo"`), 400, "invalid_argument", "workdir"},
		{"bad env name", "POST", sbs, spec(`,"env":{"A=B":"x"}`), 400, "invalid_argument", ""},
		{"bad label", "POST", sbs, spec(`,"labels":{"bad key!":"x"}`), 400, "invalid_argument", ""},
		// Not supported: refused, not silently ignored.
		{"network unknown preset", "POST", sbs, spec(`,"network":{"allow":["nosuchpreset"]}`), 400, "invalid_argument", "nosuchpreset"},
		{"network ipv6", "POST", sbs, spec(`,"network":{"allow":["::/0"]}`), 400, "invalid_argument", "IPv6"},
		{"disk_mb too small", "POST", sbs, spec(`,"disk_mb":8`), 400, "invalid_argument", "disk_mb"},
		{"disk_mb too big", "POST", sbs, spec(`,"disk_mb":2000000`), 400, "invalid_argument", "disk_mb"},
		// Batch.
		{"batch count 0", "POST", sbs + ":batch", []byte(`{"count":0,"spec":{"base":"` + baseRef + `"}}`), 400, "invalid_argument", "count"},
		{"batch count negative", "POST", sbs + ":batch", []byte(`{"count":-4,"spec":{"base":"` + baseRef + `"}}`), 400, "invalid_argument", "count"},
		{"batch count 100000", "POST", sbs + ":batch", []byte(`{"count":100000,"spec":{"base":"` + baseRef + `"}}`), 400, "invalid_argument", "count"},
		{"batch bad spec", "POST", sbs + ":batch", []byte(`{"count":2,"spec":{"base":"base/no-such-layer:v9"}}`), 404, "not_found", "base/no-such-layer:v9"},
		{"batch unknown field", "POST", sbs + ":batch", []byte(`{"count":1,"spec":{"base":"` + baseRef + `","nope":1}}`), 400, "invalid_argument", "nope"},
		// List.
		{"list limit not a number", "GET", sbs + "?limit=abc", nil, 400, "invalid_argument", "limit"},
		{"list limit 0", "GET", sbs + "?limit=0", nil, 400, "invalid_argument", "limit"},
		{"list limit negative", "GET", sbs + "?limit=-1", nil, 400, "invalid_argument", "limit"},
		{"list limit huge", "GET", sbs + "?limit=10000000", nil, 400, "invalid_argument", "limit"},
		{"list bad state", "GET", sbs + "?state=zombie", nil, 400, "invalid_argument", "state"},
		{"list bad page_token", "GET", sbs + "?page_token=%21%21%21not-a-token", nil, 400, "invalid_argument", "page_token"},
		{"list bad label selector", "GET", sbs + "?label=novalue", nil, 400, "invalid_argument", ""},
		// Exec.
		{"exec neither cmd nor argv", "POST", sbs + "/" + live.ID + "/exec", []byte(`{}`), 400, "invalid_argument", "cmd"},
		{"exec both cmd and argv", "POST", sbs + "/" + live.ID + "/exec", []byte(`{"cmd":"true","argv":["true"]}`), 400, "invalid_argument", "cmd"},
		{"exec negative timeout", "POST", sbs + "/" + live.ID + "/exec", []byte(`{"cmd":"true","timeout":-1}`), 400, "invalid_argument", "timeout"},
		{"exec huge max_output_bytes", "POST", sbs + "/" + live.ID + "/exec", []byte(`{"cmd":"true","max_output_bytes":1099511627776}`), 400, "invalid_argument", "max_output_bytes"},
		{"exec negative max_output_bytes", "POST", sbs + "/" + live.ID + "/exec", []byte(`{"cmd":"true","max_output_bytes":-1}`), 400, "invalid_argument", "max_output_bytes"},
		{"exec wrong type argv", "POST", sbs + "/" + live.ID + "/exec", []byte(`{"argv":"ls -l"}`), 400, "invalid_argument", "argv"},
		{"exec relative cwd", "POST", sbs + "/" + live.ID + "/exec", []byte(`{"cmd":"true","cwd":"tmp"}`), 400, "invalid_argument", "cwd"},
		{"exec bad stream flag", "POST", sbs + "/" + live.ID + "/exec?stream=maybe", []byte(`{"cmd":"true"}`), 400, "invalid_argument", "stream"},
		{"exec missing sandbox", "POST", sbs + "/sb-local-aaaaaaaaaaaaaaaa/exec", []byte(`{"cmd":"true"}`), 404, "not_found", "sb-local-aaaaaaaaaaaaaaaa"},
		{"exec unknown node", "POST", sbs + "/sb-elsewhere-aaaaaaaaaaaaaaaa/exec", []byte(`{"cmd":"true"}`), 404, "not_found", ""},
		{"exec deleted sandbox", "POST", sbs + "/" + gone.ID + "/exec", []byte(`{"cmd":"true"}`), 404, "not_found", gone.ID},
		{"exec malformed id", "POST", sbs + "/not-an-id/exec", []byte(`{"cmd":"true"}`), 404, "not_found", ""},
		{"get malformed id", "GET", sbs + "/%2e%2e", nil, 404, "not_found", ""},
		{"get deleted sandbox", "GET", sbs + "/" + gone.ID, nil, 404, "not_found", gone.ID},
		{"keepalive negative ttl", "POST", sbs + "/" + live.ID + "/keepalive", []byte(`{"ttl":-5}`), 400, "invalid_argument", "ttl"},
		{"delete by labels none", "POST", sbs + ":delete", []byte(`{"labels":{}}`), 400, "invalid_argument", "labels"},
		// Unknown routes under /v1 are JSON 404s.
		{"unknown /v1 path", "GET", "/v1/no/such/thing", nil, 404, "not_found", ""},
		{"unknown sandbox verb", "POST", sbs + "/" + live.ID + "/frobnicate", []byte(`{}`), 404, "not_found", ""},
		{"unknown v1 root", "GET", "/v1/", nil, 404, "not_found", ""},
	}
	for _, c := range cases {
		r := wireCall(t, c.method, c.path, c.body)
		msg := wireWantError(t, c.name, r, c.status, c.code)
		if c.msgHas != "" && msg != "" && !strings.Contains(msg, c.msgHas) {
			t.Errorf("%s: message %q does not mention %q", c.name, msg, c.msgHas)
		}
	}

	// The sandbox used above still works: bad input did not wedge it.
	if r := sh(t, live.ID, "echo alive"); r.Stdout != "alive\n" {
		t.Errorf("live sandbox after the barrage: %+v", r)
	}
	// The daemon is healthy.
	if r := wireCallAuth(t, "GET", "/healthz", nil, wireAuthNone); r.Status != 200 {
		t.Errorf("healthz after the barrage: %d %s", r.Status, r.Body)
	}
	if err := client.DeleteSandbox(ctx(t), live.ID); err != nil {
		t.Fatal(err)
	}
	// Nothing was left half-created: no sandbox, no directory, no mount.
	if after := wireSandboxIDs(t); fmt.Sprint(after) != fmt.Sprint(idsBefore) {
		t.Errorf("sandboxes before %v, after %v", idsBefore, after)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		dirs, mounts := wireSandboxDirs(t), len(hostMounts(d.stateDir))
		if fmt.Sprint(dirs) == fmt.Sprint(dirsBefore) && mounts == mountsBefore {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("sandbox dirs before %v, after %v; mounts under the state dir before %d, after %d: %v",
				dirsBefore, dirs, mountsBefore, mounts, hostMounts(d.stateDir))
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestBadInputOversizedAndHostileBodies sends bodies built to hurt a JSON
// decoder: deep nesting, huge strings, invalid UTF-8, a body much larger
// than anything sensible.
func TestBadInputOversizedAndHostileBodies(t *testing.T) {
	needDaemon(t)
	before := wireSandboxIDs(t)
	deep := strings.Repeat(`{"a":`, 100000) + "1" + strings.Repeat("}", 100000)
	cases := []struct {
		name string
		body []byte
	}{
		{"deeply nested", []byte(`{"base":"` + baseRef + `","labels":` + deep + `}`)},
		{"invalid utf-8 in ref", []byte("{\"base\":\"base/\xff\xfe:v1\"}")},
		{"NUL in ref", []byte(`{"base":"base/e2e\u0000:v1"}`)},
		{"huge env value", []byte(`{"base":"` + baseRef + `","env":{"X":"` + strings.Repeat("x", 1<<20) + `"}}`)},
		{"NUL in env", []byte(`{"base":"` + baseRef + `","env":{"X":"a\u0000b"}}`)},
		{"too many labels", func() []byte {
			var b strings.Builder
			b.WriteString(`{"base":"` + baseRef + `","labels":{`)
			for i := range 1000 {
				if i > 0 {
					b.WriteString(",")
				}
				fmt.Fprintf(&b, `"k%d":"v"`, i)
			}
			b.WriteString("}}")
			return []byte(b.String())
		}()},
		{"body over 32 MiB", append(append([]byte(`{"base":"`), bytes.Repeat([]byte("a"), 33<<20)...), []byte(`"}`)...)},
	}
	for _, c := range cases {
		r := wireCall(t, "POST", "/v1/sandboxes", c.body)
		wireWantError(t, c.name, r, 400, "invalid_argument")
	}
	if r := wireCallAuth(t, "GET", "/healthz", nil, wireAuthNone); r.Status != 200 {
		t.Errorf("healthz: %d", r.Status)
	}
	if after := wireSandboxIDs(t); fmt.Sprint(after) != fmt.Sprint(before) {
		t.Errorf("sandboxes before %v, after %v", before, after)
	}
}

// wireQuery builds "?k=v&..." from pairs, escaping values.
func wireQuery(kv ...string) string {
	q := url.Values{}
	for i := 0; i+1 < len(kv); i += 2 {
		q.Add(kv[i], kv[i+1])
	}
	return "?" + q.Encode()
}

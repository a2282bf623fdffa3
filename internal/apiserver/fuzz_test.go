package apiserver

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"path"
	"slices"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// decodeBytes runs body through the API's own strict decoder.
func decodeBytes(body []byte, v any) error {
	r := httptest.NewRequest(http.MethodPost, "/v1/sandboxes", bytes.NewReader(body))
	return decode(r, v)
}

// wantRequestError fails unless err has one of the codes a bad request may get.
func wantRequestError(t *testing.T, what string, err error, codes ...string) {
	t.Helper()
	if code := errdefs.Code(err); !slices.Contains(codes, code) {
		t.Fatalf("%s: error %q is %s, want one of %v", what, err, code, codes)
	}
}

// FuzzSandboxSpec decodes a create body as POST /v1/sandboxes does and
// normalizes it with the default policy. Nothing may panic, refusals are
// classified, an accepted spec is within the policy's bounds, and
// normalizing is idempotent across the wire: the edge decodes the spec the
// apiserver normalized and normalizes it again, and must get the same spec.
func FuzzSandboxSpec(f *testing.F) {
	for _, s := range []string{
		`{"base":"base/python:3.11"}`,
		`{"image":"base/x:1","cpu":0.5,"memory_mb":512,"pids":64,"ttl":60,"disk_mb":16}`,
		`{"base":"base/x:1","workspace":"workspace/t:v1","toolkits":["toolkit/a:1"],"env":{"A":"b"},` +
			`"labels":{"job":"grpo-1"},"user":"1000:1000","workdir":"/repo","qos":"be"}`,
		`{"base":"base/x:1","network":{"allow":["pypi","10.1.2.0/24:443/tcp"],"deny":["evil.example.com"]}}`,
		`{"base":"base/x:1","network":{},"env":{},"labels":{},"node_selector":{},"toolkits":[]}`,
		`{"base":"base/x:1","memory_cgroup":"shared","node_selector":{"gpu":"a100"}}`,
		`{"base":"base/x:1","memory_cgroup":"shared","userns":true}`,
		`{"base":"base/x:1","userns":true,"idle_timeout":600,"snapshot":"snapshot/s:1"}`,
		`{"base":"base/x:1","cpu":-0,"memory_mb":7,"pids":3,"disk_mb":15}`,
		`{"base":"base/x:1","cpu":0.001}`,
		`{"base":"base/x:1","cpu":1e400}`,
		`{"base":"b","image":"i"}`,
		`{"base":"base/x:1","bogus":1}`,
		`{"base":"base/x:1"} {}`,
		`{"base":"base/x:1","env":{"A":"\u0000"},"user":"root:root"}`,
		`{"backend":"gvisor","base":"base/x:1"}`,
		`{"base":"\ud800<>&\u2028"}`,
		`[]`,
		``,
	} {
		f.Add([]byte(s))
	}
	p := sandbox.DefaultPolicy()
	f.Fuzz(func(t *testing.T, body []byte) {
		var spec api.SandboxSpec
		if err := decodeBytes(body, &spec); err != nil {
			wantRequestError(t, "decoding", err, "invalid_argument")
			return
		}
		if err := sandbox.Normalize(&spec, p); err != nil {
			wantRequestError(t, "normalizing", err, "invalid_argument", "failed_precondition")
			return
		}
		checkSpecBounds(t, &spec, p)
		wire, err := json.Marshal(spec)
		if err != nil {
			t.Fatalf("encoding a normalized spec: %v", err)
		}
		var again api.SandboxSpec
		if err := decodeBytes(wire, &again); err != nil {
			t.Fatalf("the API refuses its own encoding %s: %v", wire, err)
		}
		if err := sandbox.Normalize(&again, p); err != nil {
			t.Fatalf("normalizing a normalized spec %s: %v", wire, err)
		}
		if wire2, _ := json.Marshal(again); !bytes.Equal(wire, wire2) {
			t.Fatalf("normalizing is not idempotent:\nonce  %s\ntwice %s", wire, wire2)
		}
	})
}

func checkSpecBounds(t *testing.T, s *api.SandboxSpec, p sandbox.Policy) {
	t.Helper()
	bad := func(format string, args ...any) {
		t.Helper()
		t.Fatalf("accepted spec out of bounds: "+format, args...)
	}
	switch {
	case !slices.Contains(p.Backends, s.Backend):
		bad("backend %q", s.Backend)
	case s.Base == "" || s.Image != "":
		bad("base %q, image %q", s.Base, s.Image)
	case !(s.CPU >= 0 && s.CPU <= p.MaxCPU) || s.CPU > 0 && s.CPU < 0.01:
		bad("cpu %g", s.CPU)
	case s.MemoryMB < 0 || s.MemoryMB > p.MaxMemoryMB || s.MemoryMB > 0 && s.MemoryMB < 8:
		bad("memory_mb %d", s.MemoryMB)
	case s.Pids < 4 || s.Pids > p.MaxPids:
		bad("pids %d", s.Pids)
	case s.DiskMB < 0 || s.DiskMB > p.MaxDiskMB || s.DiskMB > 0 && s.DiskMB < sandbox.MinDiskMB:
		bad("disk_mb %d", s.DiskMB)
	case s.TTL <= 0 || s.TTL > p.MaxTTL:
		bad("ttl %d", s.TTL)
	case s.IdleTimeout < 0 || s.IdleTimeout > p.MaxIdleTimout:
		bad("idle_timeout %d", s.IdleTimeout)
	case s.Network != nil && len(s.Network.Allow)+len(s.Network.Deny) == 0:
		bad("empty network policy kept")
	case len(s.Env) > p.MaxEnv || len(s.Labels)-ownLabels(s.Labels) > p.MaxLabels || ownLabels(s.Labels) > sandbox.OwnLabels ||
		len(s.NodeSelector) > p.MaxLabels:
		bad("%d env, %d labels, %d node labels", len(s.Env), len(s.Labels), len(s.NodeSelector))
	case s.User == "" || !strings.HasPrefix(s.Workdir, "/"):
		bad("user %q, workdir %q", s.User, s.Workdir)
	case s.MemoryCgroup != api.MemoryCgroupOwn && s.MemoryCgroup != api.MemoryCgroupShared:
		bad("memory_cgroup %q", s.MemoryCgroup)
	case s.MemoryCgroup == api.MemoryCgroupShared && s.MemoryMB > 0:
		bad("shared memory cgroup with memory_mb %d", s.MemoryMB)
	case s.QoS != "ls" && s.QoS != "be":
		bad("qos %q", s.QoS)
	case len(s.Toolkits) > 16:
		bad("%d toolkits", len(s.Toolkits))
	}
	for k, v := range s.Env {
		if strings.IndexByte(v, 0) >= 0 || len(v) > 128<<10 {
			bad("env %s", k)
		}
	}
}

// FuzzExecRequest decodes a body as the API does, as an exec, a session
// run and a fncall request, and validates each that decodes with the
// checks the edge applies. Nothing may panic, refusals are Invalid, and an
// accepted request is within bounds and normalizes to itself again.
func FuzzExecRequest(f *testing.F) {
	for _, s := range []string{
		`{"cmd":"echo hi"}`,
		`{"argv":["/bin/ls","-l"],"cwd":"/repo","env":{"A":"1"},"user":"nobody","timeout":5,"max_output_bytes":100}`,
		`{"argv":[""]}`,
		`{"cmd":"x","argv":["y"]}`,
		`{"cmd":"cat","stdin":"hello","stdin_b64":"aGVsbG8="}`,
		`{"cmd":"cat","stdin_b64":"aGVsbG8="}`,
		`{"cmd":"true","timeout":86401,"max_output_bytes":-1}`,
		`{"cmd":"a\u0000b","cwd":"repo","user":"Root"}`,
		`{"command":"cd /repo; ls","timeout":86400}`,
		`{"command":"  \n"}`,
		`{"base":"base/python:3.11","cmd":"python3 main.py","files":{"main.py":"cHJpbnQoMSk=","lib/a.py":""},"fetch_files":["out.json"]}`,
		`{"base":"base/x:1","argv":["sh"],"files":{"a":"","a/b":""}}`,
		`{"base":"base/x:1","cmd":"x","files":{"../etc/passwd":""},"fetch_files":["/etc/shadow","./x"]}`,
		`{"base":"base/x:1","cmd":"x","stdin_b64":"!!"}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		var x api.ExecRequest
		if decodeBytes(body, &x) == nil {
			checkExec(t, x)
		}
		var run api.SessionRunRequest
		if decodeBytes(body, &run) == nil {
			checkRun(t, run)
		}
		var fc api.FnCallRequest
		if decodeBytes(body, &fc) == nil {
			checkFnCall(t, fc)
		}
	})
}

// rewire sends v across the internal API as the apiserver does (JSON,
// decoded without the strict checks) into out.
func rewire(t *testing.T, v, out any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatalf("encoding %T: %v", v, err)
	}
	if err := json.Unmarshal(b, out); err != nil {
		t.Fatalf("decoding %T %s: %v", v, b, err)
	}
	return b
}

func checkExec(t *testing.T, x api.ExecRequest) {
	if err := sandbox.NormalizeExec(&x); err != nil {
		wantRequestError(t, "exec", err, "invalid_argument")
		return
	}
	switch {
	case (x.Cmd == "") == (len(x.Argv) == 0):
		t.Fatalf("exec accepted with cmd %q and argv %q", x.Cmd, x.Argv)
	case strings.IndexByte(x.Cmd, 0) >= 0 || slices.ContainsFunc(x.Argv, func(a string) bool { return strings.IndexByte(a, 0) >= 0 }):
		t.Fatalf("exec accepted with a NUL byte: %q %q", x.Cmd, x.Argv)
	case len(x.Argv) > 0 && x.Argv[0] == "":
		t.Fatal("exec accepted with an empty argv[0]")
	case x.Cwd != "" && !strings.HasPrefix(x.Cwd, "/"):
		t.Fatalf("exec accepted with cwd %q", x.Cwd)
	case x.Timeout < 1 || x.Timeout > sandbox.MaxExecTimeout:
		t.Fatalf("exec accepted with timeout %d", x.Timeout)
	case x.MaxOutputBytes < 1 || x.MaxOutputBytes > sandbox.MaxMaxOutputBytes:
		t.Fatalf("exec accepted with max_output_bytes %d", x.MaxOutputBytes)
	case x.Stdin != "" && x.StdinB64 != "" || len(x.Stdin) > sandbox.MaxStdinBytes:
		t.Fatalf("exec accepted with stdin of %d and stdin_b64 of %d bytes", len(x.Stdin), len(x.StdinB64))
	}
	var again api.ExecRequest
	wire := rewire(t, x, &again)
	if err := sandbox.NormalizeExec(&again); err != nil {
		t.Fatalf("normalizing a normalized exec %s: %v", wire, err)
	}
	if wire2, _ := json.Marshal(again); !bytes.Equal(wire, wire2) {
		t.Fatalf("exec normalizing is not idempotent:\nonce  %s\ntwice %s", wire, wire2)
	}
}

func checkRun(t *testing.T, r api.SessionRunRequest) {
	if err := sandbox.NormalizeRun(&r); err != nil {
		wantRequestError(t, "session run", err, "invalid_argument")
		return
	}
	switch {
	case strings.TrimSpace(r.Command) == "" || strings.IndexByte(r.Command, 0) >= 0 || len(r.Command) > 1<<20:
		t.Fatalf("session run accepted with command %q", r.Command)
	case r.Timeout < 1 || r.Timeout > sandbox.MaxExecTimeout:
		t.Fatalf("session run accepted with timeout %d", r.Timeout)
	case r.MaxOutputBytes < 1 || r.MaxOutputBytes > sandbox.MaxMaxOutputBytes:
		t.Fatalf("session run accepted with max_output_bytes %d", r.MaxOutputBytes)
	}
	var again api.SessionRunRequest
	wire := rewire(t, r, &again)
	if err := sandbox.NormalizeRun(&again); err != nil {
		t.Fatalf("normalizing a normalized session run %s: %v", wire, err)
	}
	if wire2, _ := json.Marshal(again); !bytes.Equal(wire, wire2) {
		t.Fatalf("session run normalizing is not idempotent:\nonce  %s\ntwice %s", wire, wire2)
	}
}

func checkFnCall(t *testing.T, req api.FnCallRequest) {
	if err := sandbox.CheckFnCall(&req); err != nil {
		wantRequestError(t, "fncall", err, "invalid_argument")
		return
	}
	if req.Base == "" {
		t.Fatal("fncall accepted without a base")
	}
	// Every file written or fetched stays below the work dir.
	below := func(field, name string) {
		p := path.Join(sandbox.FnCallWorkdir, name)
		if !strings.HasPrefix(p, sandbox.FnCallWorkdir+"/") || p != sandbox.FnCallWorkdir+"/"+name {
			t.Fatalf("fncall accepted %s %q, which is %s", field, name, p)
		}
	}
	for name := range req.Files {
		below("files", name)
		for dir := path.Dir(name); dir != "."; dir = path.Dir(dir) {
			if _, ok := req.Files[dir]; ok {
				t.Fatalf("fncall accepted %q both as a file and as a directory", dir)
			}
		}
	}
	for _, name := range req.FetchFiles {
		below("fetch_files", name)
	}
	if _, err := base64.StdEncoding.DecodeString(req.StdinB64); err != nil {
		t.Fatalf("fncall accepted stdin_b64 %q", req.StdinB64)
	}
	x := sandbox.FnCallExec(&req)
	if err := sandbox.NormalizeExec(&x); err != nil {
		t.Fatalf("fncall accepted a command its edge refuses: %v", err)
	}
}

// ownLabels counts the labels of dsec's own in l.
func ownLabels(l map[string]string) int {
	n := 0
	for k := range l {
		if sandbox.IsOwnLabel(k) {
			n++
		}
	}
	return n
}

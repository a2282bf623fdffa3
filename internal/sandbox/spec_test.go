package sandbox

import (
	"errors"
	"fmt"
	"math"
	"testing"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

func TestNormalize(t *testing.T) {
	p := DefaultPolicy()
	type normCase struct {
		name  string
		spec  api.SandboxSpec
		class error // nil: valid
	}
	tests := []normCase{
		{"minimal", api.SandboxSpec{Base: "base/x:1"}, nil},
		{"image alias", api.SandboxSpec{Image: "base/x:1"}, nil},
		{"both base and image", api.SandboxSpec{Base: "base/x:1", Image: "base/y:1"}, errdefs.ErrInvalid},
		{"no base", api.SandboxSpec{}, errdefs.ErrInvalid},
		{"unknown backend", api.SandboxSpec{Base: "b", Backend: "vmware"}, errdefs.ErrInvalid},
		{"negative cpu", api.SandboxSpec{Base: "b", CPU: -1}, errdefs.ErrInvalid},
		{"NaN cpu", api.SandboxSpec{Base: "b", CPU: math.NaN()}, errdefs.ErrInvalid},
		{"absurd cpu", api.SandboxSpec{Base: "b", CPU: 1e9}, errdefs.ErrInvalid},
		{"tiny cpu", api.SandboxSpec{Base: "b", CPU: 0.001}, errdefs.ErrInvalid},
		{"negative memory", api.SandboxSpec{Base: "b", MemoryMB: -5}, errdefs.ErrInvalid},
		{"tiny memory", api.SandboxSpec{Base: "b", MemoryMB: 1}, errdefs.ErrInvalid},
		{"absurd memory", api.SandboxSpec{Base: "b", MemoryMB: 1 << 40}, errdefs.ErrInvalid},
		{"negative pids", api.SandboxSpec{Base: "b", Pids: -1}, errdefs.ErrInvalid},
		{"tiny pids", api.SandboxSpec{Base: "b", Pids: 2}, errdefs.ErrInvalid},
		{"negative ttl", api.SandboxSpec{Base: "b", TTL: -1}, errdefs.ErrInvalid},
		{"absurd ttl", api.SandboxSpec{Base: "b", TTL: 1 << 40}, errdefs.ErrInvalid},
		{"negative idle", api.SandboxSpec{Base: "b", IdleTimeout: -1}, errdefs.ErrInvalid},
		{"disk too small", api.SandboxSpec{Base: "b", DiskMB: 10}, errdefs.ErrInvalid},
		{"disk too big", api.SandboxSpec{Base: "b", DiskMB: 1<<20 + 1}, errdefs.ErrInvalid},
		{"disk ok", api.SandboxSpec{Base: "b", DiskMB: 64}, nil},
		{"network allow is the edge's to check", api.SandboxSpec{Base: "b", Network: &api.NetworkPolicy{Allow: []string{"pypi"}}}, nil},
		{"network deny only is fine", api.SandboxSpec{Base: "b", Network: &api.NetworkPolicy{Deny: []string{"npm"}}}, nil},
		{"bad env name", api.SandboxSpec{Base: "b", Env: map[string]string{"A=B": "x"}}, errdefs.ErrInvalid},
		{"NUL in env", api.SandboxSpec{Base: "b", Env: map[string]string{"A": "x\x00y"}}, errdefs.ErrInvalid},
		{"bad label", api.SandboxSpec{Base: "b", Labels: map[string]string{"-x": "y"}}, errdefs.ErrInvalid},
		{"bad label value", api.SandboxSpec{Base: "b", Labels: map[string]string{"x": "a b"}}, errdefs.ErrInvalid},
		{"user name", api.SandboxSpec{Base: "b", User: "alice"}, nil},
		{"user uid:gid", api.SandboxSpec{Base: "b", User: "1000:1000"}, nil},
		{"bad user", api.SandboxSpec{Base: "b", User: "a b"}, errdefs.ErrInvalid},
		{"relative workdir", api.SandboxSpec{Base: "b", Workdir: "repo"}, errdefs.ErrInvalid},
		{"bad qos", api.SandboxSpec{Base: "b", QoS: "gold"}, errdefs.ErrInvalid},
		{"shared memory cgroup", api.SandboxSpec{Base: "b", MemoryCgroup: "shared"}, nil},
		{"own memory cgroup with a limit", api.SandboxSpec{Base: "b", MemoryCgroup: "own", MemoryMB: 64}, nil},
		{"shared memory cgroup with a limit", api.SandboxSpec{Base: "b", MemoryCgroup: "shared", MemoryMB: 64}, errdefs.ErrInvalid},
		{"shared memory cgroup in a userns", api.SandboxSpec{Base: "b", MemoryCgroup: "shared", UserNS: new(true)}, nil},
		{"bad memory cgroup", api.SandboxSpec{Base: "b", MemoryCgroup: "Shared"}, errdefs.ErrInvalid},
	}
	// A caller's full allowance of labels, and dsec's own on top (a keyed
	// create's dsec.idempotency, added after the apiserver checked the
	// caller's): the edge normalizes the spec again with both.
	full := labelsN(p.MaxLabels)
	keyed := labelsN(p.MaxLabels)
	keyed["dsec.idempotency"] = "0123456789abcdef0123456789abcdef"
	tests = append(tests,
		normCase{"as many labels as allowed", api.SandboxSpec{Base: "b", Labels: full}, nil},
		normCase{"as many labels as allowed, and dsec's own", api.SandboxSpec{Base: "b", Labels: keyed}, nil},
		normCase{"one label too many", api.SandboxSpec{Base: "b", Labels: labelsN(p.MaxLabels + 1)}, errdefs.ErrInvalid},
		normCase{"more of dsec's own than it ever sets", api.SandboxSpec{Base: "b", Labels: ownN(OwnLabels + 1)}, errdefs.ErrInvalid},
	)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			spec := tt.spec
			err := Normalize(&spec, p)
			if tt.class == nil {
				if err != nil {
					t.Fatalf("Normalize: %v", err)
				}
				return
			}
			if !errors.Is(err, tt.class) {
				t.Fatalf("Normalize = %v, want class %v", err, tt.class)
			}
		})
	}
}

// labelsN is n distinct labels.
func labelsN(n int) map[string]string {
	l := map[string]string{}
	for i := range n {
		l[fmt.Sprintf("l%d", i)] = "v"
	}
	return l
}

// ownN is n distinct labels of dsec's own.
func ownN(n int) map[string]string {
	l := map[string]string{}
	for i := range n {
		l[fmt.Sprintf("%sx%d", ReservedLabelPrefix, i)] = "v"
	}
	return l
}

func TestNormalizeDefaults(t *testing.T) {
	s := api.SandboxSpec{Image: "base/x:1"}
	if err := Normalize(&s, DefaultPolicy()); err != nil {
		t.Fatal(err)
	}
	if s.Base != "base/x:1" || s.Image != "" || s.Backend != "container" || s.TTL != 3600 ||
		s.Pids != 4096 || s.User != "root" || s.Workdir != "/" || s.QoS != "ls" || s.MemoryCgroup != "own" {
		t.Fatalf("defaults not applied: %+v", s)
	}
}

func TestNormalizeExec(t *testing.T) {
	tests := []struct {
		name string
		req  api.ExecRequest
		ok   bool
	}{
		{"cmd", api.ExecRequest{Cmd: "true"}, true},
		{"argv", api.ExecRequest{Argv: []string{"/bin/true"}}, true},
		{"neither", api.ExecRequest{}, false},
		{"both", api.ExecRequest{Cmd: "x", Argv: []string{"y"}}, false},
		{"empty argv0", api.ExecRequest{Argv: []string{""}}, false},
		{"NUL in cmd", api.ExecRequest{Cmd: "a\x00b"}, false},
		{"NUL in argv", api.ExecRequest{Argv: []string{"a", "b\x00"}}, false},
		{"relative cwd", api.ExecRequest{Cmd: "x", Cwd: "tmp"}, false},
		{"negative timeout", api.ExecRequest{Cmd: "x", Timeout: -1}, false},
		{"huge timeout", api.ExecRequest{Cmd: "x", Timeout: MaxExecTimeout + 1}, false},
		{"huge output", api.ExecRequest{Cmd: "x", MaxOutputBytes: MaxMaxOutputBytes + 1}, false},
		{"both stdins", api.ExecRequest{Cmd: "x", Stdin: "a", StdinB64: "YQ=="}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := tt.req
			err := NormalizeExec(&r)
			if (err == nil) != tt.ok {
				t.Fatalf("NormalizeExec = %v, want ok=%v", err, tt.ok)
			}
			if err != nil && !errors.Is(err, errdefs.ErrInvalid) {
				t.Fatalf("error class: %v", err)
			}
			if err == nil && (r.Timeout != DefaultExecTimeout || r.MaxOutputBytes != DefaultMaxOutputBytes) {
				t.Fatalf("defaults not applied: %+v", r)
			}
		})
	}
}

func TestSelectors(t *testing.T) {
	sel, err := ParseSelector([]string{"job=a", "task=b"})
	if err != nil {
		t.Fatal(err)
	}
	if !LabelsMatch(map[string]string{"job": "a", "task": "b", "x": "y"}, sel) {
		t.Fatal("superset should match")
	}
	if LabelsMatch(map[string]string{"job": "a"}, sel) {
		t.Fatal("subset should not match")
	}
	if _, err := ParseSelector([]string{"novalue"}); err == nil {
		t.Fatal("selector without = accepted")
	}
	items, sel := []string{}, map[string]string{}
	for i := range MaxSelectorLabels {
		items = append(items, fmt.Sprintf("k%d=v", i))
		sel[fmt.Sprintf("k%d", i)] = "v"
	}
	if _, err := ParseSelector(items); err != nil {
		t.Fatalf("%d pairs: %v", len(items), err)
	}
	if err := ValidateSelector(sel); err != nil {
		t.Fatalf("%d pairs: %v", len(sel), err)
	}
	if _, err := ParseSelector(append(items, "one=more")); err == nil {
		t.Fatal("a selector past the bound was accepted")
	}
	sel["one"] = "more"
	if err := ValidateSelector(sel); err == nil {
		t.Fatal("a selector past the bound was accepted")
	}
	if err := ValidateSelector(map[string]string{"bad key!": "v"}); err == nil {
		t.Fatal("a bad key was accepted")
	}
}

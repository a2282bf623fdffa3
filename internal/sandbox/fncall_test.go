package sandbox

import (
	"errors"
	"testing"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// TestCheckFnCall: everything wrong with a call is found before a sandbox
// is made for it, the command's fields included.
func TestCheckFnCall(t *testing.T) {
	ok := api.FnCallRequest{Base: "base/x:1", Cmd: "true", Files: map[string]string{"a/b.py": ""},
		FetchFiles: []string{"out.txt"}, Env: map[string]string{"A": "b"}, StdinB64: "/w==", Timeout: 5, MaxOutputBytes: 10}
	if err := CheckFnCall(&ok); err != nil {
		t.Fatalf("good call refused: %v", err)
	}
	for name, mut := range map[string]func(*api.FnCallRequest){
		"no base":            func(r *api.FnCallRequest) { r.Base = "" },
		"cmd and argv":       func(r *api.FnCallRequest) { r.Argv = []string{"true"} },
		"absolute file":      func(r *api.FnCallRequest) { r.Files = map[string]string{"/etc/passwd": ""} },
		"dotdot fetch":       func(r *api.FnCallRequest) { r.FetchFiles = []string{"../x"} },
		"both stdins":        func(r *api.FnCallRequest) { r.Stdin = "x" },
		"stdin_b64 not b64":  func(r *api.FnCallRequest) { r.StdinB64 = "not base64!" },
		"negative timeout":   func(r *api.FnCallRequest) { r.Timeout = -1 },
		"huge output cap":    func(r *api.FnCallRequest) { r.MaxOutputBytes = 1 << 40 },
		"empty env name":     func(r *api.FnCallRequest) { r.Env = map[string]string{"": "x"} },
		"NUL in env":         func(r *api.FnCallRequest) { r.Env = map[string]string{"A": "x\x00y"} },
		"NUL in the command": func(r *api.FnCallRequest) { r.Cmd = "true\x00" },
		"file and dir":       func(r *api.FnCallRequest) { r.Files = map[string]string{"a": "", "a/b/c.py": ""} },
	} {
		r := ok
		mut(&r)
		if err := CheckFnCall(&r); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%s: %v, want invalid", name, err)
		}
	}
}

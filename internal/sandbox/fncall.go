package sandbox

import (
	"encoding/base64"
	"path"
	"strings"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// FnCall limits.
const (
	FnCallWorkdir       = "/work"
	MaxFnCallFiles      = 256
	MaxFnCallFetchBytes = 16 << 20
)

// CheckFnCall validates a FnCall request. It is pure: the apiserver calls
// it before resolving the base, and the edge again before it makes a
// sandbox.
func CheckFnCall(req *api.FnCallRequest) error {
	if req.Base == "" {
		return errdefs.Invalid("base is required")
	}
	if (req.Cmd == "") == (len(req.Argv) == 0) {
		return errdefs.Invalid("give exactly one of cmd and argv")
	}
	if len(req.Files) > MaxFnCallFiles || len(req.FetchFiles) > MaxFnCallFiles {
		return errdefs.Invalid("at most %d files and %d fetch_files", MaxFnCallFiles, MaxFnCallFiles)
	}
	for name := range req.Files {
		if err := checkRelName("files", name); err != nil {
			return err
		}
		// "a" and "a/b" cannot both be written: one would have to be a
		// directory.
		for dir := path.Dir(name); dir != "."; dir = path.Dir(dir) {
			if _, both := req.Files[dir]; both {
				return errdefs.Invalid("files: %q and %q: %q cannot be both a file and a directory", dir, name, dir)
			}
		}
	}
	for _, name := range req.FetchFiles {
		if err := checkRelName("fetch_files", name); err != nil {
			return err
		}
	}
	// The command's fields, checked as an exec's, before any sandbox is
	// made for it.
	x := FnCallExec(req)
	if err := NormalizeExec(&x); err != nil {
		return err
	}
	if _, err := base64.StdEncoding.DecodeString(req.StdinB64); err != nil {
		return errdefs.Invalid("stdin_b64 is not valid base64: %v", err)
	}
	return nil
}

// FnCallExec is the command of a call, run in the work dir.
func FnCallExec(req *api.FnCallRequest) api.ExecRequest {
	return api.ExecRequest{Cmd: req.Cmd, Argv: req.Argv, Env: req.Env, Stdin: req.Stdin, StdinB64: req.StdinB64,
		Timeout: req.Timeout, MaxOutputBytes: req.MaxOutputBytes, Cwd: FnCallWorkdir}
}

// checkRelName accepts a relative path that stays below the work dir
// (the files layer confines it to the sandbox anyway; this keeps calls
// from writing outside /work by mistake).
func checkRelName(field, name string) error {
	if name == "" || strings.HasPrefix(name, "/") || path.Clean(name) != name || name == "." || strings.HasPrefix(name, "../") || name == ".." {
		return errdefs.Invalid("%s: %q must be a clean relative path below %s", field, name, FnCallWorkdir)
	}
	return nil
}

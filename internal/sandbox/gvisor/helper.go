package gvisor

import (
	"bytes"
	"crypto/sha256"
	_ "embed"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
)

// seccompExecSrc is the program every exec'd command starts as
// (seccomp_exec.csrc: C without libc; the extension keeps the Go tool
// from taking it for a cgo file).
//
//go:embed seccomp_exec.csrc
var seccompExecSrc []byte

// execHelperPath is where the helper appears inside every sandbox: a
// read-only bind mount in /dev, which the sandbox can neither write nor
// shadow (as the pinned shell).
const execHelperPath = "/dev/.dsec-exec"

// buildExecHelper compiles the helper into dir (once per source: the name
// carries its hash) and returns its host path.
func buildExecHelper(dir string) (string, error) {
	if runtime.GOARCH != "amd64" {
		return "", fmt.Errorf("the gvisor backend's exec helper is x86_64 only (this is %s)", runtime.GOARCH)
	}
	sum := sha256.Sum256(seccompExecSrc)
	out := filepath.Join(dir, "seccomp-exec-"+hex.EncodeToString(sum[:6]))
	if st, err := os.Stat(out); err == nil && st.Mode().IsRegular() {
		return out, nil
	}
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		return "", fmt.Errorf("building the exec helper needs gcc (apt-get install gcc): %w", err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("creating helper dir: %w", err)
	}
	tmp, err := os.CreateTemp(dir, ".build-")
	if err != nil {
		return "", fmt.Errorf("building exec helper: %w", err)
	}
	tmp.Close()
	defer os.Remove(tmp.Name())
	cmd := exec.Command(gcc, "-x", "c", "-", "-o", tmp.Name(), "-static", "-nostdlib", "-O1",
		"-fno-builtin", "-fno-stack-protector", "-fno-tree-loop-distribute-patterns", "-fno-pie", "-no-pie")
	cmd.Stdin = bytes.NewReader(seccompExecSrc)
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("building exec helper: %w: %s", err, clip(string(b)))
	}
	if err := os.Chmod(tmp.Name(), 0o755); err != nil {
		return "", fmt.Errorf("building exec helper: %w", err)
	}
	if err := os.Rename(tmp.Name(), out); err != nil {
		return "", fmt.Errorf("building exec helper: %w", err)
	}
	return out, nil
}

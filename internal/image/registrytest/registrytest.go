// Package registrytest runs a real OCI distribution registry (Debian's
// docker-registry) on loopback for tests, with its storage in a temp dir,
// and can stop and start it again on the same address and storage (a
// source going down mid-run). Tests only.
package registrytest

import (
	"bytes"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Bin is the registry binary.
const Bin = "/usr/bin/docker-registry"

// Registry is a running registry.
type Registry struct {
	// Addr is its 127.0.0.1:PORT.
	Addr string
	// Storage is its storage root (blobs under docker/registry/v2/blobs).
	Storage string

	t   testing.TB
	cfg string

	mu  sync.Mutex
	cmd *exec.Cmd
	out *bytes.Buffer
}

// Start starts a registry and stops it when the test ends; it skips the
// test when the binary is missing.
func Start(t testing.TB) *Registry {
	t.Helper()
	if _, err := os.Stat(Bin); err != nil {
		t.Skipf("needs %s (apt-get install docker-registry): %v", Bin, err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	dir := t.TempDir()
	r := &Registry{Addr: addr, Storage: filepath.Join(dir, "storage"), t: t, cfg: filepath.Join(dir, "config.yml")}
	cfg := fmt.Sprintf("version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: %s\n  delete:\n    enabled: true\nhttp:\n  addr: %s\n", r.Storage, addr)
	if err := os.WriteFile(r.cfg, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	r.Restart()
	t.Cleanup(r.Stop)
	return r
}

// Stop kills the registry (a source gone without notice).
func (r *Registry) Stop() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.cmd != nil {
		r.cmd.Process.Kill()
		r.cmd.Wait()
		r.cmd = nil
	}
}

// Pause stops the registry process (SIGSTOP) without closing anything: a
// source that accepts connections and never answers. Resume undoes it.
func (r *Registry) Pause() { r.signal(syscall.SIGSTOP) }

// Resume lets a paused registry go on (SIGCONT).
func (r *Registry) Resume() { r.signal(syscall.SIGCONT) }

func (r *Registry) signal(sig syscall.Signal) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.cmd != nil {
		if err := r.cmd.Process.Signal(sig); err != nil {
			r.t.Errorf("signalling the registry: %v", err)
		}
	}
}

// Restart starts the registry again (or for the first time) and waits
// until it answers.
func (r *Registry) Restart() {
	r.t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.cmd != nil {
		return
	}
	r.out = &bytes.Buffer{}
	cmd := exec.Command(Bin, "serve", r.cfg)
	cmd.Stdout, cmd.Stderr = r.out, r.out
	if err := cmd.Start(); err != nil {
		r.t.Fatal(err)
	}
	r.cmd = cmd
	deadline := time.Now().Add(15 * time.Second)
	for {
		resp, err := http.Get("http://" + r.Addr + "/v2/")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("registry did not come up on %s: %v\n%s", r.Addr, err, r.out.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// BlobPath is where the registry keeps a blob's data.
func (r *Registry) BlobPath(digest string) string {
	hex := digest[len("sha256:"):]
	return filepath.Join(r.Storage, "docker", "registry", "v2", "blobs", "sha256", hex[:2], hex, "data")
}

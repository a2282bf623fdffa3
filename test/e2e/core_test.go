package e2e

import (
	"crypto/sha256"
	"encoding/hex"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
)

func TestLayersComposeTopWinsAndStayReadOnly(t *testing.T) {
	needDaemon(t)
	sb := newSandbox(t, api.SandboxSpec{Workspace: workspaceRef, Toolkits: []string{toolkitRef}})
	r := sh(t, sb.ID, "cat /repo/a.txt /repo/ws-only /repo/base-only; /opt/tool/run.sh")
	want := "toolkit\nonly in workspace\nonly in base\ntool ran\n"
	if r.ExitCode != 0 || r.Stdout != want {
		t.Fatalf("got %+v, want stdout %q", r, want)
	}
	// Writes land in the sandbox's upper layer only: the layer blobs keep
	// their digests.
	digests := sb.Layers
	if len(digests) != 3 {
		t.Fatalf("layers = %v, want 3 digests", digests)
	}
	r = sh(t, sb.ID, "echo changed > /repo/a.txt && rm /repo/base-only && echo new > /bin/new && cat /repo/a.txt")
	if r.ExitCode != 0 || r.Stdout != "changed\n" {
		t.Fatalf("write: %+v", r)
	}
	for _, dg := range digests {
		blob := filepath.Join(d.stateDir, "layers", "blobs", "sha256", strings.TrimPrefix(dg, "sha256:")+".erofs")
		f, err := os.Open(blob)
		if err != nil {
			t.Fatal(err)
		}
		h := sha256.New()
		_, _ = io.Copy(h, f)
		f.Close()
		if got := "sha256:" + hex.EncodeToString(h.Sum(nil)); got != dg {
			t.Fatalf("layer blob %s changed: now %s", dg, got)
		}
	}
	// A second sandbox from the same layers sees the original content.
	sb2 := newSandbox(t, api.SandboxSpec{Workspace: workspaceRef, Toolkits: []string{toolkitRef}})
	r = sh(t, sb2.ID, "cat /repo/a.txt /repo/base-only; test -e /bin/new && echo leaked")
	if r.Stdout != "toolkit\nonly in base\n" {
		t.Fatalf("second sandbox sees another's writes: %+v", r)
	}
	// Each layer is mounted once per node, whatever the number of sandboxes.
	for _, dg := range digests {
		if n := len(hostMounts(strings.TrimPrefix(dg, "sha256:"))); n != 1 {
			t.Errorf("layer %s mounted %d times, want 1", dg, n)
		}
	}
}

func TestLayerDeleteInUseRefused(t *testing.T) {
	needDaemon(t)
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "f"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, e, code := cli("layer", "build", "--kind", "toolkit", "--name", "inuse", "--tag", "v1", dir); code != 0 {
		t.Fatalf("build: %s", e)
	}
	sb := newSandbox(t, api.SandboxSpec{Toolkits: []string{"toolkit/inuse:v1"}})
	_, e, code := cli("layer", "delete", "toolkit/inuse:v1")
	if code == 0 || !strings.Contains(e, "used by") {
		t.Fatalf("delete of an in-use layer: exit %d, stderr %q", code, e)
	}
	if err := client.DeleteSandbox(ctx(t), sb.ID); err != nil {
		t.Fatal(err)
	}
	if _, e, code := cli("layer", "delete", "toolkit/inuse:v1"); code != 0 {
		t.Fatalf("delete after the sandbox went: %s", e)
	}
	_, e, code = cli("layer", "get", "toolkit/inuse:v1")
	if code == 0 || !strings.Contains(e, "not_found") && !strings.Contains(e, "not found") {
		t.Fatalf("get after delete: exit %d %q", code, e)
	}
}

// initPid finds the host pid of a sandbox's init (/dev/init) by the
// cgroup its record names.
func initPid(t *testing.T, id string) int {
	t.Helper()
	rel := sandboxCgroupRel(t, id)
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cg, _ := os.ReadFile("/proc/" + e.Name() + "/cgroup")
		cmd, _ := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if strings.Contains(string(cg), ":"+rel+"\n") && strings.HasPrefix(string(cmd), "/dev/init") {
			return pid
		}
	}
	t.Fatalf("no init process found for %s", id)
	return 0
}

func TestSandboxWhoseInitDiesIsMarkedFailed(t *testing.T) {
	needDaemon(t)
	sb := newSandbox(t, api.SandboxSpec{})
	neighbour := newSandbox(t, api.SandboxSpec{})
	if err := syscall.Kill(initPid(t, sb.ID), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(15 * time.Second)
	var got *api.Sandbox
	for time.Now().Before(deadline) {
		var err error
		if got, err = client.GetSandbox(ctx(t), sb.ID); err != nil {
			t.Fatal(err)
		}
		if got.State == api.StateFailed {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	if got.State != api.StateFailed || !strings.Contains(got.Error, "init exited") {
		t.Fatalf("state %q (%q), want failed with a reason", got.State, got.Error)
	}
	_, err := client.Exec(ctx(t), sb.ID, api.ExecRequest{Cmd: "true"})
	wantCode(t, err, "failed_precondition")
	if n := len(anyMounts(sb.ID)); n != 0 {
		t.Fatalf("failed sandbox keeps %d mounts", n)
	}
	if r := sh(t, neighbour.ID, "echo ok"); r.Stdout != "ok\n" {
		t.Fatalf("neighbour: %+v", r)
	}
}

package microvm

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/internal/sandbox/microvm/agent"
)

// guestCache keeps the downloaded kernel between runs (where dsec keeps
// it: one download per host).
const guestCache = "/var/cache/dsec/microvm"

// testGuest builds the agent and a guest with busybox, or skips.
func testGuest(t *testing.T) *Guest {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: downloads the guest kernel with apt-get")
	}
	for _, bin := range []string{"qemu-system-x86_64", "dpkg-deb", "apt-get", "busybox"} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Skipf("needs %s (apt-get install qemu-system-x86 busybox-static)", bin)
		}
	}
	bb, _ := exec.LookPath("busybox")
	agentBin := filepath.Join(t.TempDir(), "dsec-agent")
	build := exec.Command("go", "build", "-o", agentBin, "github.com/dsecproject/dsec/cmd/dsec-agent")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building the agent: %v\n%s", err, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	var progress strings.Builder
	g, err := PrepareGuest(ctx, guestCache, t.TempDir(), agentBin, map[string]string{"/bin/busybox": bb}, &progress)
	if err != nil {
		t.Fatalf("preparing the guest: %v\n%s", err, progress.String())
	}
	t.Logf("guest: %s, kernel package %s", g.Initrd, g.KernelPackage)
	return g
}

// TestBootAndExec boots a guest under QEMU (TCG here) and runs commands
// in it through the agent: its own kernel, its own processes, output,
// exit codes, a timeout; and Stop leaves no VMM behind.
func TestBootAndExec(t *testing.T) {
	g := testGuest(t)
	// A guest under TCG boots in seconds here; two minutes is a hang.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	vm, err := Start(ctx, VMConfig{Guest: g, Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer vm.Stop()
	first := time.Now()
	run := func(args ...string) (int, string) {
		var out strings.Builder
		p, err := vm.Agent.Exec(ctx, agent.Msg{Args: args}, nil, &out, &out)
		if err != nil {
			t.Fatal(err)
		}
		code, err := p.Wait()
		if err != nil {
			t.Fatal(err)
		}
		return code, out.String()
	}
	code, out := run("/bin/busybox", "sh", "-c", "echo hi; busybox uname -r; cat /proc/1/cmdline; echo; busybox ls /sys/block")
	t.Logf("boot to agent ready %v, first exec %v", vm.Boot.Round(time.Millisecond), time.Since(first).Round(time.Millisecond))
	host, _ := os.ReadFile("/proc/sys/kernel/osrelease")
	lines := strings.Split(out, "\n")
	if code != 0 || len(lines) < 3 || lines[0] != "hi" || lines[1] == strings.TrimSpace(string(host)) || strings.TrimRight(lines[2], "\x00") != "/init" {
		t.Fatalf("exec in the guest: %d %q; want hi, the guest's kernel (not the host's %s), /init as pid 1", code, out, host)
	}
	if code, _ := run("/bin/busybox", "sh", "-c", "exit 9"); code != 9 {
		t.Fatalf("exit code %d", code)
	}
	vm.Stop()
	select {
	case <-vm.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the VMM runs after Stop")
	}
}

func TestModuleOrderNeedsDependenciesFirst(t *testing.T) {
	g := testGuest(t)
	mods, _ := filepath.Glob(filepath.Join(filepath.Dir(filepath.Dir(g.Kernel)), "lib", "modules", "*", "kernel"))
	if len(mods) != 1 {
		t.Fatalf("module trees: %v", mods)
	}
	order, _, err := moduleOrder(mods[0], []string{"virtio_blk"})
	if err != nil {
		t.Fatal(err)
	}
	pos := map[string]int{}
	for i, m := range order {
		pos[m] = i
	}
	if pos["virtio_ring.ko"] >= pos["virtio.ko"] || pos["virtio.ko"] >= pos["virtio_blk.ko"] || len(order) != 3 {
		t.Fatalf("order %v: want virtio_ring, virtio, virtio_blk", order)
	}
	if _, _, err := moduleOrder(mods[0], []string{"no_such_module"}); err == nil {
		t.Fatal("a module the kernel lacks was resolved")
	}
}

// Package sandboxtest is the conformance suite every sandbox.Backend must
// pass, plus fixtures for it (a busybox root filesystem). Backend packages
// call Run from their tests.
package sandboxtest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// BusyboxRootfs builds a minimal root filesystem from the host's static
// busybox (Debian's busybox-static) in a temp dir, or skips the test.
func BusyboxRootfs(t testing.TB) string {
	t.Helper()
	bb, err := exec.LookPath("busybox")
	if err != nil {
		t.Skip("needs busybox (apt-get install busybox-static)")
	}
	root := t.TempDir()
	for _, d := range []string{"bin", "proc", "dev", "sys", "tmp", "etc", "root", "home/user"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	data, err := os.ReadFile(bb)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "bin/busybox"), data, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, app := range []string{"sh", "cat", "echo", "sleep", "ls", "id", "ps", "pwd", "env", "true", "false", "yes", "head", "wc", "touch", "rm", "mkdir", "kill", "grep", "dd", "seq", "stat", "mount", "umount"} {
		if err := os.Symlink("busybox", filepath.Join(root, "bin", app)); err != nil {
			t.Fatal(err)
		}
	}
	_ = os.WriteFile(filepath.Join(root, "etc/passwd"), []byte("root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\n"), 0o644)
	_ = os.WriteFile(filepath.Join(root, "etc/group"), []byte("root:x:0:\nuser:x:1000:\n"), 0o644)
	return root
}

// Env is what the suite needs from the backend's test.
type Env struct {
	Backend sandbox.Backend
	// NewConfig returns a ready-to-create config for a fresh sandbox id
	// (rootfs prepared, private dir created). The suite calls Destroy.
	NewConfig func(t *testing.T, id string) sandbox.Config
	// CgroupProcs, when set, lists host pids in a sandbox's cgroup, so the
	// suite can check that Destroy leaves nothing running.
	CgroupProcs func(cgroupPath string) ([]int, error)
}

type result struct {
	code           int
	stdout, stderr string
}

func run(t *testing.T, b sandbox.Backend, id string, p sandbox.Process) result {
	t.Helper()
	var out, errb bytes.Buffer
	p.Stdout, p.Stderr = &out, &errb
	pr, err := b.Exec(context.Background(), id, p)
	if err != nil {
		t.Fatalf("exec %v: %v", p.Args, err)
	}
	code, err := pr.Wait()
	if err != nil {
		t.Fatalf("wait %v: %v", p.Args, err)
	}
	return result{code, out.String(), errb.String()}
}

// Run runs the conformance suite.
func Run(t *testing.T, e Env) {
	b := e.Backend
	ctx := context.Background()
	id := fmt.Sprintf("conf-%d", time.Now().UnixNano()%1e9)
	cfg := e.NewConfig(t, id)
	var nullBefore syscall.Stat_t
	if err := syscall.Stat("/dev/null", &nullBefore); err != nil {
		t.Fatal(err)
	}
	if err := b.Create(ctx, cfg); err != nil {
		t.Fatalf("create: %v", err)
	}
	// Creating a sandbox leaves the host's /dev/null alone (a runtime
	// that hands its stdio to the sandbox's user would chown it).
	var nullAfter syscall.Stat_t
	if err := syscall.Stat("/dev/null", &nullAfter); err != nil {
		t.Fatal(err)
	}
	if nullAfter.Uid != 0 || nullAfter.Gid != 0 || nullAfter.Ctim != nullBefore.Ctim {
		t.Errorf("creating a sandbox changed the host's /dev/null: owner %d:%d, ctime %v -> %v", nullAfter.Uid, nullAfter.Gid, nullBefore.Ctim, nullAfter.Ctim)
	}
	destroyed := false
	t.Cleanup(func() {
		if !destroyed {
			_ = b.Destroy(ctx, id)
		}
	})

	t.Run("status", func(t *testing.T) {
		st, err := b.Status(ctx, id)
		if err != nil || !st.Running || st.Pid <= 0 {
			t.Fatalf("status = %+v, %v; want running", st, err)
		}
		ids, err := b.List(ctx)
		if err != nil || !slices.Contains(ids, id) {
			t.Fatalf("list = %v, %v; want it to contain %s", ids, err, id)
		}
	})
	if cfg.RootfsMount != nil {
		// A detached rootfs is attached only in the sandbox's own mount
		// namespace: the host's table must not show it, the host's mount
		// point stays empty, and the sandbox sees its files and can write.
		t.Run("detached-rootfs-stays-off-the-host", func(t *testing.T) {
			mi, err := os.ReadFile("/proc/self/mountinfo")
			if err != nil {
				t.Fatal(err)
			}
			for _, line := range strings.Split(string(mi), "\n") {
				if f := strings.Fields(line); len(f) > 4 && f[4] == cfg.Rootfs {
					t.Fatalf("rootfs is mounted on the host: %s", line)
				}
			}
			if ents, err := os.ReadDir(cfg.Rootfs); err != nil || len(ents) != 0 {
				t.Fatalf("host's %s: %d entries, %v; want an empty directory", cfg.Rootfs, len(ents), err)
			}
			r := run(t, b, id, sandbox.Process{Args: []string{"/bin/sh", "-c", "echo hi > /tmp/detached && cat /etc/passwd | head -1"}})
			if r.code != 0 || !strings.HasPrefix(r.stdout, "root:") {
				t.Fatalf("sandbox does not see its rootfs: %+v", r)
			}
		})
	}
	ok, isOwn := b.(sandbox.OwnKernel)
	ownKernel := isOwn && ok.OwnKernel()
	t.Run("masked-directories-empty-and-read-only", func(t *testing.T) {
		if ownKernel {
			t.Skip("a kernel of the sandbox's own: what its root does to it stays in the VM, and nothing of the host's is there to mask")
		}
		// Whichever of these this kernel has must look empty and take no
		// writes, however the backend masks them (mkdir and touch are what
		// catch a writable mask; remount and umount are refused by the
		// seccomp profile and capabilities anyway).
		r := run(t, b, id, sandbox.Process{Args: []string{"/bin/sh", "-c", `n=0
for d in /proc/acpi /proc/asound /proc/scsi /sys/firmware /sys/kernel/debug /sys/kernel/tracing /sys/devices/virtual/powercap; do
  [ -d "$d" ] || continue
  n=$((n+1))
  [ -z "$(ls -A "$d")" ] || echo "$d not empty"
  mkdir "$d/x" 2>/dev/null && echo "$d writable"
  touch "$d/y" 2>/dev/null && echo "$d writable"
  mount -o remount,rw "$d" 2>/dev/null && touch "$d/z" 2>/dev/null && echo "$d writable after remount"
  umount "$d" 2>/dev/null && echo "$d unmasked"
done
echo "checked $n"`}})
		if r.code != 0 || !strings.HasPrefix(r.stdout, "checked ") || strings.Contains(r.stdout, "not empty") || strings.Contains(r.stdout, "writable") || strings.Contains(r.stdout, "unmasked") {
			t.Fatalf("masked directories: %+v", r)
		}
		t.Log(strings.TrimSpace(r.stdout))
	})
	t.Run("stdout-stderr-exit", func(t *testing.T) {
		r := run(t, b, id, sandbox.Process{Args: []string{"/bin/sh", "-c", "echo out; echo err >&2; exit 7"}})
		if r.code != 7 || r.stdout != "out\n" || r.stderr != "err\n" {
			t.Fatalf("got %+v", r)
		}
	})
	t.Run("stdio-not-the-hosts-null", func(t *testing.T) {
		// A command without stdin, and init, may read the host's
		// /dev/null; root inside (CAP_CHOWN, CAP_FOWNER) must not be
		// able to chmod or chown that through /proc (a runtime may give
		// init the sandbox's own node instead, which is its to change).
		// Modes and owners are the ones the node has: a failing check
		// changes nothing but the host node's ctime.
		var before, after syscall.Stat_t
		if err := syscall.Stat("/dev/null", &before); err != nil {
			t.Fatal(err)
		}
		r := run(t, b, id, sandbox.Process{Args: []string{"/bin/sh", "-c", `for f in /proc/self/fd/0 /proc/1/fd/0 /proc/1/fd/1 /dev/null; do
  chmod 666 $f 2>/dev/null; chown 0:0 $f 2>/dev/null
done; echo done`}})
		if err := syscall.Stat("/dev/null", &after); err != nil {
			t.Fatal(err)
		}
		if r.code != 0 || r.stdout != "done\n" || after.Ctim != before.Ctim {
			t.Fatalf("host /dev/null changed from inside (ctime %v -> %v): %+v", before.Ctim, after.Ctim, r)
		}
	})
	t.Run("stdin-env-cwd", func(t *testing.T) {
		r := run(t, b, id, sandbox.Process{
			Args:  []string{"/bin/sh", "-c", `read x; echo "$x $FOO $(pwd)"`},
			Env:   []string{"FOO=bar"},
			Cwd:   "/tmp",
			Stdin: strings.NewReader("hello\n"),
		})
		if r.code != 0 || r.stdout != "hello bar /tmp\n" {
			t.Fatalf("got %+v", r)
		}
	})
	t.Run("user", func(t *testing.T) {
		r := run(t, b, id, sandbox.Process{Args: []string{"/bin/id", "-u"}, UID: 1000, GID: 1000})
		if strings.TrimSpace(r.stdout) != "1000" {
			t.Fatalf("got %+v", r)
		}
	})
	t.Run("isolated-pid-namespace", func(t *testing.T) {
		r := run(t, b, id, sandbox.Process{Args: []string{"/bin/sh", "-c", "cat /proc/1/cmdline | tr '\\0' ' '; ls /proc | grep -c '^[0-9]'"}})
		if !strings.Contains(r.stdout, "/dev/init") && !strings.Contains(r.stdout, "init") {
			t.Fatalf("pid1 is not the sandbox init: %q", r.stdout)
		}
	})
	t.Run("kill-tree", func(t *testing.T) {
		var out syncBuffer
		pr, err := b.Exec(ctx, id, sandbox.Process{
			Args:   []string{"/bin/sh", "-c", "sleep 1000 & sleep 1000 & echo started; wait"},
			Stdout: &out, Stderr: &out,
		})
		if err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(5 * time.Second)
		for !strings.Contains(out.String(), "started") && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		done := make(chan int, 1)
		go func() { c, _ := pr.Wait(); done <- c }()
		if err := pr.Kill(); err != nil {
			t.Fatal(err)
		}
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Fatal("process did not exit after Kill")
		}
		// No sleep may survive inside the sandbox. Killed ones may be
		// zombies for a moment, until the sandbox's init reaps them: the
		// count, zombies included, is polled. The shell counting must see
		// itself, or the count proves nothing.
		count := `n=0; self=0; for d in /proc/[0-9]*; do c=$(cat $d/comm 2>/dev/null); [ "$c" = sleep ] && n=$((n+1)); [ "$c" = sh ] && self=1; done; echo $n $self`
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			r := run(t, b, id, sandbox.Process{Args: []string{"/bin/sh", "-c", count}})
			if strings.TrimSpace(r.stdout) == "0 1" {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("processes survived Kill: %q", r.stdout)
			}
		}
		if err := pr.Kill(); err != nil {
			t.Fatalf("second Kill: %v", err)
		}
	})
	t.Run("exec-no-more-privilege-than-init", func(t *testing.T) {
		// A command gets at most what the sandbox's init has: the same
		// bounding set and cgroups, no_new_privs and a seccomp filter.
		r := run(t, b, id, sandbox.Process{Args: []string{"/bin/sh", "-c",
			"grep -E '^(CapBnd|CapEff|NoNewPrivs|Seccomp):' /proc/self/status; echo ==; grep -E '^(CapBnd|CapEff):' /proc/1/status; echo ==; cat /proc/self/cgroup; echo ==; cat /proc/1/cgroup"}})
		parts := strings.Split(r.stdout, "==\n")
		if r.code != 0 || len(parts) != 4 {
			t.Fatalf("got %+v", r)
		}
		self, initCaps := parts[0], parts[1]
		for _, line := range strings.Split(strings.TrimSpace(initCaps), "\n") {
			if !strings.Contains(self, line+"\n") {
				t.Errorf("exec'd process as root lacks init's %q:\n%s", line, self)
			}
		}
		if _, own := b.(sandbox.InnerSignaler); !own && (!strings.Contains(self, "NoNewPrivs:\t1") || !strings.Contains(self, "Seccomp:\t2")) {
			// A kernel of the backend's own need not report them.
			t.Errorf("exec'd process status:\n%s", self)
		}
		if parts[2] != parts[3] && !ownKernel {
			// (A VM's init is its agent, in the guest's root cgroup.)
			t.Errorf("exec'd process cgroups differ from init's:\n%s\nvs\n%s", parts[2], parts[3])
		}
	})
	t.Run("seccomp-profile-applies", func(t *testing.T) {
		if ownKernel {
			t.Skip("a kernel of the sandbox's own: no host seccomp profile applies inside it, and its kernel log is its own")
		}
		// syslog(2) is on the profile's deny list and allowed by every
		// capability set a kernel checks (a user-space kernel answers it
		// from its own log): dmesg must fail as root, in an exec'd
		// process and in a child of init alike.
		r := run(t, b, id, sandbox.Process{Args: []string{"/bin/sh", "-c", "busybox dmesg >/dev/null 2>&1 && echo allowed || echo denied"}})
		if r.code != 0 || r.stdout != "denied\n" {
			t.Fatalf("syslog(2) from an exec'd root process: %+v", r)
		}
	})
	t.Run("own-network-namespace-loopback-up", func(t *testing.T) {
		// Only lo exists, and it is up. Asked over netlink (ip), not
		// sysfs: /sys may be shared between sandboxes (dsec's launcher).
		r := run(t, b, id, sandbox.Process{Args: []string{"/bin/sh", "-c", "busybox ip -o link | wc -l; busybox ip -o link show lo; readlink /proc/self/ns/net; readlink /proc/1/ns/net || echo unreadable"}})
		lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
		// A kernel of the backend's own numbers its namespaces as it likes
		// (and a VM's init, holding the agent's socket, may hide them).
		_, own := b.(sandbox.InnerSignaler)
		if r.code != 0 || len(lines) != 4 || strings.TrimSpace(lines[0]) != "1" || !strings.Contains(lines[1], "lo: <LOOPBACK,UP") || (!own && lines[2] != lines[3]) {
			t.Fatalf("got %+v", r)
		}
		self, _ := os.Readlink("/proc/self/ns/net")
		if lines[2] == self {
			t.Fatalf("sandbox shares the host's network namespace %s", self)
		}
	})
	if pauser, ok := b.(sandbox.Pauser); ok {
		t.Run("pause-stops-and-resume-restarts", func(t *testing.T) {
			// A counter in the rootfs moves while running, not while paused
			// (it runs on until the destroy case). It is replaced whole
			// (rename), so a pause between a truncate and a write cannot
			// leave it empty.
			if r := run(t, b, id, sandbox.Process{Args: []string{"/bin/sh", "-c", "(i=0; while true; do i=$((i+1)); echo $i > /pausecount.new; busybox mv /pausecount.new /pausecount; sleep 0.05; done) >/dev/null 2>&1 & echo ok"}}); r.stdout != "ok\n" {
				t.Fatalf("starting the counter: %+v", r)
			}
			count := func() string {
				b, _ := os.ReadFile(filepath.Join(cfg.Rootfs, "pausecount"))
				return string(b)
			}
			if cfg.Rootfs == "" {
				// No host view of the rootfs: the counter is read from
				// inside, before the pause and after the resume. A second
				// paused must not count (20 a second when running).
				count = func() string {
					return run(t, b, id, sandbox.Process{Args: []string{"/bin/cat", "/pausecount"}}).stdout
				}
				deadline := time.Now().Add(10 * time.Second)
				for count() == "" && time.Now().Before(deadline) {
					time.Sleep(20 * time.Millisecond)
				}
				before := count()
				if err := pauser.Pause(ctx, id); err != nil {
					t.Fatal(err)
				}
				if err := pauser.Pause(ctx, id); err != nil {
					t.Fatalf("pausing a paused sandbox: %v", err)
				}
				time.Sleep(2 * time.Second)
				if err := pauser.Resume(ctx, id); err != nil {
					t.Fatal(err)
				}
				if err := pauser.Resume(ctx, id); err != nil {
					t.Fatalf("resuming a running sandbox: %v", err)
				}
				after := count()
				var n0, n1 int
				fmt.Sscan(before, &n0)
				fmt.Sscan(after, &n1)
				if n0 == 0 || n1-n0 > 15 {
					t.Fatalf("counter across a 2 s pause: %d -> %d", n0, n1)
				}
				for deadline := time.Now().Add(10 * time.Second); count() == after; time.Sleep(50 * time.Millisecond) {
					if time.Now().After(deadline) {
						t.Fatal("counter stuck after resume")
					}
				}
				return
			}
			deadline := time.Now().Add(10 * time.Second)
			for count() == "" && time.Now().Before(deadline) {
				time.Sleep(20 * time.Millisecond)
			}
			if err := pauser.Pause(ctx, id); err != nil {
				t.Fatal(err)
			}
			if err := pauser.Pause(ctx, id); err != nil {
				t.Fatalf("pausing a paused sandbox: %v", err)
			}
			before := count()
			time.Sleep(500 * time.Millisecond)
			if after := count(); after != before || before == "" {
				t.Fatalf("counter moved while paused: %q -> %q", before, after)
			}
			if err := pauser.Resume(ctx, id); err != nil {
				t.Fatal(err)
			}
			if err := pauser.Resume(ctx, id); err != nil {
				t.Fatalf("resuming a running sandbox: %v", err)
			}
			for deadline := time.Now().Add(10 * time.Second); count() == before; time.Sleep(20 * time.Millisecond) {
				if time.Now().After(deadline) {
					t.Fatal("counter stuck after resume")
				}
			}
		})
	}
	t.Run("cwd-cannot-leave-the-root", func(t *testing.T) {
		marker := "test -e /dev/init"
		if ownKernel {
			// Above the sandbox's root is the agent's, which has /init.
			marker = "test -e /bin/busybox && ! test -e /init"
		}
		r := run(t, b, id, sandbox.Process{Args: []string{"/bin/sh", "-c", "pwd; " + marker + " && echo sandbox-root"}, Cwd: "/../../.."})
		if r.code != 0 || r.stdout != "/\nsandbox-root\n" {
			t.Fatalf("got %+v", r)
		}
	})
	t.Run("exec-missing-cwd", func(t *testing.T) {
		var out bytes.Buffer
		pr, err := b.Exec(ctx, id, sandbox.Process{Args: []string{"/bin/true"}, Cwd: "/no/such/dir", Stdout: &out, Stderr: &out})
		if err == nil {
			if code, _ := pr.Wait(); code == 0 {
				t.Fatalf("exec in a missing directory succeeded: %q", out.String())
			}
		}
	})
	t.Run("exec-missing-binary", func(t *testing.T) {
		var out bytes.Buffer
		pr, err := b.Exec(ctx, id, sandbox.Process{Args: []string{"/nonexistent"}, Stdout: &out, Stderr: &out})
		if err == nil {
			code, _ := pr.Wait()
			if code == 0 {
				t.Fatalf("exec of a missing binary succeeded: %q", out.String())
			}
		}
	})
	t.Run("destroy", func(t *testing.T) {
		// Processes reparented to init must die with the sandbox too.
		if r := run(t, b, id, sandbox.Process{Args: []string{"/bin/sh", "-c", "sleep 1000 >/dev/null 2>&1 & sleep 1000 >/dev/null 2>&1 & echo ok"}}); r.stdout != "ok\n" {
			t.Fatalf("starting background processes: %+v", r)
		}
		if err := b.Destroy(ctx, id); err != nil {
			t.Fatalf("destroy: %v", err)
		}
		destroyed = true
		if _, err := b.Status(ctx, id); !errors.Is(err, errdefs.ErrNotFound) {
			t.Fatalf("status after destroy: %v, want not found", err)
		}
		if err := b.Destroy(ctx, id); err != nil {
			t.Fatalf("second destroy: %v", err)
		}
		ids, _ := b.List(ctx)
		if slices.Contains(ids, id) {
			t.Fatalf("list still has %s", id)
		}
		if e.CgroupProcs != nil {
			if pids, _ := e.CgroupProcs(cfg.CgroupPath); len(pids) > 0 {
				t.Fatalf("processes left in cgroup: %v", pids)
			}
		}
	})
	t.Run("exec-after-destroy", func(t *testing.T) {
		var out bytes.Buffer
		pr, err := b.Exec(ctx, id, sandbox.Process{Args: []string{"/bin/true"}, Stdout: &out, Stderr: &out})
		if err == nil {
			if code, _ := pr.Wait(); code == 0 {
				t.Fatal("exec in a destroyed sandbox succeeded")
			}
		}
	})
	t.Run("pids-limit", func(t *testing.T) {
		lid := id + "-pids"
		lcfg := e.NewConfig(t, lid)
		lcfg.Limits.Pids = 16
		if err := b.Create(ctx, lcfg); err != nil {
			t.Fatalf("create: %v", err)
		}
		defer b.Destroy(ctx, lid)
		r := run(t, b, lid, sandbox.Process{Args: []string{"/bin/sh", "-c", "for i in $(seq 1 40); do sleep 2 & done; wait"}})
		if !strings.Contains(r.stderr, "fork") {
			t.Fatalf("pids limit 16 not enforced: forking 40 processes gave no error (stderr %q)", r.stderr)
		}
	})
}

// syncBuffer is a bytes.Buffer safe to read while a process's output is
// being copied into it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

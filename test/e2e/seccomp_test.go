package e2e

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/api"
)

// The attack tests for the container backend's kernel-facing hardening
// (DSEC-FACTS.md §7: incident 4, XFS_IOC_SWAPEXT used to get around file
// rules, and incident 7, a read of /proc/kpagecgroup that crashed the
// kernel): a static C prober, run as root inside a sandbox, tries each
// dangerous operation with raw syscalls and reports what the kernel said.

// proberWant is what a prober line must show.
type proberWant int

const (
	// wantEPERM: blocked by the seccomp profile, which answers EPERM. Most
	// of these also need a capability sandboxes lack; asking for EPERM
	// rather than "any failure" still catches a profile that lost the rule
	// when the capability check happens to give another errno, and the
	// *_child / *_usermode / noatime / *_sync variants need no capability
	// at all, so only seccomp stops them.
	wantEPERM proberWant = iota
	// wantEPERMOrENOSYS: user-namespace creation; the profile may answer
	// ENOSYS (clone3, whose flags seccomp cannot see) so that libc falls
	// back to clone.
	wantEPERMOrENOSYS
	// wantFail: any errno or a fatal signal (e.g. SIGSYS, or SIGSEGV for
	// int $0x80 on a kernel without ia32 emulation), but not success.
	wantFail
	// wantNoData: a masked file: opening or reading fails, or 0 bytes.
	wantNoData
	// wantInfo: logged only; not part of the lead's profile.
	wantInfo
	// wantEAFNOSUPPORT, wantEPROTONOSUPPORT: a socket family, or a netlink
	// protocol, off the profile's allow list. The profile answers what a
	// kernel built without it would, and other refusals (EPERM for
	// AF_PACKET without CAP_NET_RAW) show the call got past the filter.
	wantEAFNOSUPPORT
	wantEPROTONOSUPPORT
	// wantOK: must succeed (what the allow lists are for).
	wantOK
)

// proberExpect lists every probe the prober runs, in its order.
var proberExpect = []struct {
	name string
	want proberWant
}{
	{"mount_tmpfs", wantEPERM},
	{"umount_kcore_mask", wantEPERM},
	{"fsopen", wantEPERM},
	{"fsmount", wantEPERM},
	{"move_mount", wantEPERM},
	{"open_tree", wantEPERM},
	{"fspick", wantEPERM},
	{"mount_setattr", wantEPERM},
	{"unshare_newuser", wantEPERMOrENOSYS},
	{"unshare_newns", wantEPERM},
	{"unshare_userns_mount", wantEPERMOrENOSYS},
	{"clone_newuser", wantEPERMOrENOSYS},
	{"clone3_newuser", wantEPERMOrENOSYS},
	{"setns_mnt", wantEPERM},
	{"ptrace_attach_init", wantEPERM},
	{"ptrace_attach_child", wantEPERM},
	{"process_vm_readv_init", wantEPERM},
	{"process_vm_readv_child", wantEPERM},
	{"process_vm_writev_child", wantEPERM},
	{"bpf_map_create", wantEPERM},
	{"bpf_prog_load", wantEPERM},
	{"perf_event_open", wantEPERM},
	{"init_module", wantEPERM},
	{"finit_module", wantEPERM},
	{"delete_module", wantEPERM},
	{"kexec_load", wantEPERM},
	{"kexec_file_load", wantEPERM},
	{"reboot_cad_off", wantEPERM},
	{"keyctl_get_session", wantEPERM},
	{"add_key", wantEPERM},
	{"request_key", wantEPERM},
	{"name_to_handle_at", wantEPERM},
	{"open_by_handle_at", wantEPERM},
	{"userfaultfd", wantEPERM},
	{"userfaultfd_usermode", wantEPERM},
	{"swapon", wantEPERM},
	{"swapoff", wantEPERM},
	{"syslog_read_all", wantEPERM},
	{"acct", wantEPERM},
	{"settimeofday_now", wantEPERM},
	{"clock_settime_now", wantEPERM},
	{"adjtimex_read", wantEPERM},
	{"clock_adjtime_read", wantEPERM},
	{"iopl", wantEPERM},
	{"ioperm", wantEPERM},
	{"quotactl_sync", wantEPERM},
	{"quotactl_fd_sync", wantEPERM},
	{"io_uring_setup", wantEPERM},
	// Incident 4. The kernel truncates ioctl's request to 32 bits, so the
	// *_hibits variants (upper half set) must be caught too: a rule that
	// compares all 64 bits lets them through.
	{"ioctl_xfs_swapext", wantEPERM},
	{"ioctl_xfs_swapext_hibits", wantEPERM},
	{"ioctl_setflags_immutable", wantEPERM},
	{"ioctl_setflags_noatime", wantEPERM},
	{"ioctl_setflags_noatime_hibits", wantEPERM},
	{"ioctl_setflags32_noatime", wantFail},
	{"ioctl_fssetxattr_immutable", wantEPERM},
	{"ioctl_fssetxattr_noatime", wantEPERM},
	// Physical layout of the host's disk: a file in the sandbox (the
	// overlay's upper is the host's filesystem), a host file bound in.
	{"ioctl_fiemap", wantEPERM},
	{"ioctl_fiemap_hibits", wantEPERM},
	{"ioctl_fiemap_host_bind", wantEPERM},
	{"ioctl_fibmap", wantEPERM},
	{"ioctl_getfsmap", wantEPERM},
	// The same calls through the i386 (int $0x80) and x32 entry points: a
	// profile written for x86_64 numbers only must not let them through.
	{"i386_unshare_newuser", wantFail},
	{"i386_mount_tmpfs", wantFail},
	{"i386_ptrace_attach_child", wantFail},
	{"i386_ioctl_setflags32_noatime", wantFail},
	{"x32_unshare_newuser", wantFail},
	// Sockets: an allow list of families (Unix, IPv4, IPv6, netlink) and
	// netlink protocols (route, sock_diag). vsock is not confined by the
	// network namespace, uevents are the host's, audit is the host's log.
	// The *_hibits variants set bit 32, which the kernel ignores.
	{"socket_unix", wantOK},
	{"socket_inet", wantOK},
	{"socket_inet6", wantOK},
	{"socket_netlink_route", wantOK},
	{"socket_netlink_sock_diag", wantOK},
	{"socketpair_unix", wantOK},
	{"socket_vsock", wantEAFNOSUPPORT},
	{"socket_vsock_hibits", wantEAFNOSUPPORT},
	{"socket_packet", wantEAFNOSUPPORT},
	{"socket_alg", wantEAFNOSUPPORT},
	{"socket_xdp", wantEAFNOSUPPORT},
	{"socket_key", wantEAFNOSUPPORT},
	{"socket_netlink_uevent", wantEPROTONOSUPPORT},
	{"socket_netlink_audit", wantEPROTONOSUPPORT},
	{"socket_netlink_generic", wantEPROTONOSUPPORT},
	{"socket_netlink_netfilter", wantEPROTONOSUPPORT},
	{"socket_netlink_xfrm", wantEPROTONOSUPPORT},
	{"socket_netlink_route_hibits", wantEPROTONOSUPPORT},
	{"socketpair_inet", wantEAFNOSUPPORT},
	{"socketpair_netlink", wantEAFNOSUPPORT},
	{"i386_socket_vsock", wantFail},
	{"i386_socketcall_vsock", wantFail},
	{"x32_socket_vsock", wantFail},
	// CAP_MKNOD is granted: the device cgroup must stop the open.
	{"open_blockdev", wantFail},
	{"open_devmem", wantFail},
	// Incident 7 and the other masked paths.
	{"read_proc_kcore", wantNoData},
	{"read_proc_kpagecgroup", wantNoData},
	{"read_proc_kpageflags", wantNoData},
	{"read_proc_kpagecount", wantNoData},
	{"read_proc_timer_list", wantNoData},
	{"read_proc_sched_debug", wantNoData},
	{"read_proc_keys", wantNoData},
	{"read_proc_kallsyms", wantNoData},
	// Host-wide allocator state and the physical memory map (spec.go's
	// maskedPaths says why); what tools read stays.
	{"read_proc_slabinfo", wantNoData},
	{"read_proc_vmallocinfo", wantNoData},
	{"read_proc_pagetypeinfo", wantNoData},
	{"read_proc_zoneinfo", wantNoData},
	{"read_proc_buddyinfo", wantNoData},
	{"read_proc_iomem", wantNoData},
	{"read_proc_ioports", wantNoData},
	{"read_proc_mtrr", wantNoData},
	{"read_proc_meminfo", wantOK},
	{"read_proc_cpuinfo", wantOK},
	{"read_proc_stat", wantOK},
	{"read_proc_loadavg", wantOK},
	// A cgroup namespace: no host cgroup path, v1 hierarchies included.
	{"proc_self_cgroup_root", wantOK},
	{"list_sys_firmware", wantNoData},
	// Read-only /proc/sys and /proc/sysrq-trigger.
	{"write_sysrq_trigger", wantFail},
	{"write_proc_sys_hostname", wantFail},
	{"write_proc_sys_core_pattern", wantFail},
	{"umount_proc", wantEPERM},
}

// proberLine is one parsed line of the prober's output.
type proberLine struct {
	ok     bool
	errno  int
	signal int
	bytes  int // ok lines of the read probes: "bytes=N"; -1 if absent
	raw    string
}

var proberLineRE = regexp.MustCompile(`^(\S+) (?:(ok)(?: (.*))?|errno=(\d+) .*|signal=(\d+) .*)$`)
var proberBytesRE = regexp.MustCompile(`\bbytes=(\d+)`)

func parseProber(t *testing.T, out string) map[string]proberLine {
	t.Helper()
	res := map[string]proberLine{}
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		if line == "done" || line == "" {
			continue
		}
		m := proberLineRE.FindStringSubmatch(line)
		if m == nil {
			t.Errorf("unparsable prober line %q", line)
			continue
		}
		l := proberLine{ok: m[2] == "ok", bytes: -1, raw: line}
		l.errno, _ = strconv.Atoi(m[4])
		l.signal, _ = strconv.Atoi(m[5])
		if b := proberBytesRE.FindStringSubmatch(m[3]); b != nil {
			l.bytes, _ = strconv.Atoi(b[1])
		}
		res[m[1]] = l
	}
	return res
}

// buildProber compiles testdata/prober.c statically, or skips the test.
func buildProber(t *testing.T) string {
	t.Helper()
	return buildStatic(t, "prober")
}

// buildStatic compiles testdata/NAME.c into a static binary, or skips the
// test when the host cannot.
func buildStatic(t *testing.T, name string) string {
	t.Helper()
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		t.Skipf("needs gcc to build the static %s (testdata/%s.c)", name, name)
	}
	// gcc prints the bare name back when it cannot find the file.
	if out, err := exec.Command(gcc, "-print-file-name=libc.a").Output(); err != nil || !filepath.IsAbs(strings.TrimSpace(string(out))) {
		t.Skipf("needs a static libc (libc.a, e.g. libc6-dev) to build the static %s", name)
	}
	src, err := filepath.Abs("testdata/" + name + ".c")
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), name)
	if out, err := exec.Command(gcc, "-static", "-O1", "-o", bin, src).CombinedOutput(); err != nil {
		t.Fatalf("building the %s: %v\n%s", name, err, out)
	}
	return bin
}

// uploadProber puts the prober at /tmp/prober in the sandbox.
func uploadProber(t *testing.T, id, bin string) {
	t.Helper()
	uploadBinary(t, id, bin, "/tmp/prober")
}

// uploadBinary puts the host file bin at path in the sandbox, executable.
func uploadBinary(t *testing.T, id, bin, path string) {
	t.Helper()
	f, err := os.Open(bin)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := client.WriteFile(ctx(t), id, path, f, 0o755); err != nil {
		t.Fatalf("uploading %s: %v", path, err)
	}
}

func readHost(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestSeccompBlocksDangerousSyscalls(t *testing.T) {
	needDaemon(t)
	seccompAttack(t, api.BackendContainer, nil)
}

// seccompAttack runs the prober in a sandbox of backend and checks every
// verdict (proberExpect's, or differs' where it names the probe), and that
// nothing around the sandbox changed.
func seccompAttack(t *testing.T, backend string, differs map[string]proberWant) {
	bin := buildProber(t)
	hostHostname := readHost(t, "/proc/sys/kernel/hostname")
	hostCorePattern := readHost(t, "/proc/sys/kernel/core_pattern")
	hostTaint := readHost(t, "/proc/sys/kernel/tainted")

	// A neighbour created before the attack, with a file that must survive.
	neighbour := newSandbox(t, api.SandboxSpec{Backend: backend})
	if r := sh(t, neighbour.ID, "echo neighbour-data > /tmp/keep && cat /tmp/keep"); r.ExitCode != 0 || r.Stdout != "neighbour-data\n" {
		t.Fatalf("neighbour setup: %+v", r)
	}

	sb := newSandbox(t, api.SandboxSpec{Backend: backend})
	uploadProber(t, sb.ID, bin)
	res, err := client.Exec(ctx(t), sb.ID, api.ExecRequest{Argv: []string{"/tmp/prober"}, Timeout: 300})
	if err != nil {
		t.Fatalf("running the prober: %v", err)
	}
	t.Logf("prober (exit %d, timed out %v):\n%s%s", res.ExitCode, res.TimedOut, res.Stdout, res.Stderr)
	if res.ExitCode != 0 || !strings.HasSuffix(res.Stdout, "done\n") {
		t.Errorf("prober did not finish: exit %d, timed out %v", res.ExitCode, res.TimedOut)
	}
	got := parseProber(t, res.Stdout)

	var succeeded []string
	for _, e := range proberExpect {
		if w, ok := differs[e.name]; ok {
			e.want = w
		}
		l, ok := got[e.name]
		if !ok {
			t.Errorf("%s: no result from the prober", e.name)
			continue
		}
		switch e.want {
		case wantEPERM:
			if l.errno != 1 {
				t.Errorf("%s: want EPERM from the seccomp profile, got %q", e.name, l.raw)
			}
		case wantEPERMOrENOSYS:
			if l.errno != 1 && l.errno != 38 {
				t.Errorf("%s: want EPERM or ENOSYS from the seccomp profile, got %q", e.name, l.raw)
			}
		case wantFail:
			if l.ok {
				t.Errorf("%s: must fail, got %q", e.name, l.raw)
			}
		case wantNoData:
			if l.ok && l.bytes != 0 {
				t.Errorf("%s: masked path gave data: %q", e.name, l.raw)
			}
		case wantInfo:
			if l.ok {
				t.Logf("note: %s is allowed (not in the profile): %q", e.name, l.raw)
			}
		case wantEAFNOSUPPORT:
			if l.errno != 97 {
				t.Errorf("%s: want EAFNOSUPPORT from the seccomp profile, got %q", e.name, l.raw)
			}
		case wantEPROTONOSUPPORT:
			if l.errno != 93 {
				t.Errorf("%s: want EPROTONOSUPPORT from the seccomp profile, got %q", e.name, l.raw)
			}
		case wantOK:
			if !l.ok {
				t.Errorf("%s: must be allowed, got %q", e.name, l.raw)
			}
		}
		if l.ok && e.want != wantNoData && e.want != wantInfo && e.want != wantOK {
			succeeded = append(succeeded, e.name)
		}
	}
	if len(succeeded) > 0 {
		t.Errorf("operations that succeeded inside the sandbox: %s", strings.Join(succeeded, ", "))
	}
	for name := range got {
		known := false
		for _, e := range proberExpect {
			known = known || e.name == name
		}
		if !known {
			t.Errorf("prober reported %q, which the test does not check", name)
		}
	}

	// Collateral: the sandbox itself, its neighbour, the host, the daemon.
	if r := sh(t, sb.ID, "echo alive; head -c 1 /proc/self/stat >/dev/null && echo proc"); r.Stdout != "alive\nproc\n" {
		t.Errorf("sandbox after the prober: %+v", r)
	}
	if r := sh(t, neighbour.ID, "cat /tmp/keep"); r.ExitCode != 0 || r.Stdout != "neighbour-data\n" {
		t.Errorf("neighbour after the prober: %+v", r)
	}
	if now := readHost(t, "/proc/sys/kernel/hostname"); now != hostHostname {
		t.Errorf("host hostname changed: %q -> %q", hostHostname, now)
	}
	if now := readHost(t, "/proc/sys/kernel/core_pattern"); now != hostCorePattern {
		t.Errorf("host core_pattern changed: %q -> %q", hostCorePattern, now)
	}
	if now := readHost(t, "/proc/sys/kernel/tainted"); now != hostTaint {
		t.Errorf("host kernel taint changed during the run: %q -> %q (kernel warning or oops?)", hostTaint, now)
	}
	if err := client.Health(ctx(t)); err != nil {
		t.Errorf("daemon unhealthy after the prober: %v", err)
	}
}

var whoamiRE = regexp.MustCompile(`uid=(\d+) euid=(\d+) gid=(\d+) egid=(\d+) capeff=([0-9a-f]+)`)

// TestSetuidAndFileCapsIgnored: root in a sandbox can plant a setuid-root
// binary or one with file capabilities; no_new_privs must make both inert
// for the sandbox's unprivileged user.
func TestSetuidAndFileCapsIgnored(t *testing.T) {
	needDaemon(t)
	bin := buildProber(t)
	sb := newSandbox(t, api.SandboxSpec{})
	uploadProber(t, sb.ID, bin)
	r := sh(t, sb.ID, `set -e
cp /tmp/prober /tmp/suid && chown 0:0 /tmp/suid && chmod 4755 /tmp/suid
cp /tmp/prober /tmp/fcap && chown 0:0 /tmp/fcap && chmod 0755 /tmp/fcap && /tmp/prober setcap /tmp/fcap
ls -ln /tmp/suid /tmp/fcap`)
	t.Logf("setup:\n%s%s", r.Stdout, r.Stderr)
	if r.ExitCode != 0 || !strings.Contains(r.Stdout, "-rwsr-xr-x") || !strings.Contains(r.Stdout, "setcap ok") {
		t.Fatalf("planting the helpers: %+v", r)
	}
	for _, helper := range []string{"/tmp/suid", "/tmp/fcap"} {
		res, err := client.Exec(ctx(t), sb.ID, api.ExecRequest{Argv: []string{helper, "whoami"}, User: "1000"})
		if err != nil {
			t.Fatalf("exec %s: %v", helper, err)
		}
		t.Logf("%s whoami as 1000 (exit %d):\n%s%s", helper, res.ExitCode, res.Stdout, res.Stderr)
		m := whoamiRE.FindStringSubmatch(res.Stdout)
		if res.ExitCode != 0 || m == nil {
			t.Errorf("%s: no whoami output: %+v", helper, res)
			continue
		}
		if m[1] != "1000" || m[2] != "1000" {
			t.Errorf("%s: uid=%s euid=%s, want 1000/1000 (setuid bit honoured)", helper, m[1], m[2])
		}
		if c, _ := strconv.ParseUint(m[5], 16, 64); c != 0 {
			t.Errorf("%s: CapEff=%s, want none (file capabilities or setuid honoured)", helper, m[5])
		}
		if !strings.Contains(res.Stdout, "setuid0 errno=1 ") {
			t.Errorf("%s: setuid(0) as uid 1000 did not fail with EPERM", helper)
		}
	}
}

// Package e2e drives a real `dsec up` (built from this tree) through the CLI
// and the Go SDK. It needs root (the daemon mounts layers and runs
// containers); without root every test skips with the reason.
package e2e

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/hostfs"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// Layer refs every test may use. base has busybox and bash; workspace puts
// /repo/a.txt ("workspace") and /repo/ws-only; toolkit overrides /repo/a.txt
// ("toolkit") and adds /opt/tool/run.sh.
const (
	baseRef      = "base/e2e:v1"
	workspaceRef = "workspace/e2e:v1"
	toolkitRef   = "toolkit/e2e:v1"
)

// daemon is a `dsec up` process under test.
type daemon struct {
	bin      string
	stateDir string
	listen   string
	key      string
	cfgPath  string
	cmd      *exec.Cmd
	logPath  string
	extra    []string // more dsec up flags
}

var (
	skipReason string
	d          *daemon
	client     *dsec.Client
	workDir    string
)

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	if os.Geteuid() != 0 {
		skipReason = "needs root: starts dsec up, which mounts layers and runs containers"
		return m.Run()
	}
	for _, tool := range []string{"mkfs.erofs", "busybox", "catatonit"} {
		if _, err := exec.LookPath(tool); err != nil {
			skipReason = "needs " + tool + " (run make deps)"
			return m.Run()
		}
	}
	if _, err := exec.LookPath("crun"); err != nil {
		if _, err := exec.LookPath("runc"); err != nil {
			skipReason = "needs crun or runc (run make deps)"
			return m.Run()
		}
	}
	var err error
	workDir, err = os.MkdirTemp("", "dsec-e2e-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(workDir)
	// MkdirTemp makes it 0700; user-namespace sandboxes need to pass
	// through it (as they pass through /var/lib).
	if err := os.Chmod(workDir, 0o711); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if err := setup(); err != nil {
		fmt.Fprintln(os.Stderr, "e2e setup:", err)
		if d != nil {
			d.dumpLog(os.Stderr)
			d.stop()
		}
		netTeardown()
		return 1
	}
	code := m.Run()
	if code != 0 {
		d.dumpLog(os.Stderr)
	}
	// Leave nothing running: delete every sandbox, then stop the daemon.
	if client != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		if all, err := client.ListAllSandboxes(ctx, dsec.ListOptions{}); err == nil {
			for _, sb := range all {
				_ = client.DeleteSandbox(ctx, sb.ID)
			}
		}
		cancel()
	}
	d.stop()
	netTeardown()
	return code
}

func setup() error {
	bin := filepath.Join(workDir, "dsec")
	build := exec.Command("go", "build", "-o", bin, "github.com/dsecproject/dsec/cmd/dsec")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		return fmt.Errorf("building dsec: %w", err)
	}
	// The microvm backend's guest agent, beside dsec where it looks.
	build = exec.Command("go", "build", "-o", filepath.Join(workDir, "dsec-agent"), "github.com/dsecproject/dsec/cmd/dsec-agent")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		return fmt.Errorf("building dsec-agent: %w", err)
	}
	d = &daemon{
		bin:      bin,
		stateDir: filepath.Join(workDir, "state"),
		listen:   freeAddr(),
		key:      "e2e-admin-key-0123456789abcdef",
		cfgPath:  filepath.Join(workDir, "config.json"),
		logPath:  filepath.Join(workDir, "dsec.log"),
	}
	// No warm pools by default: they keep sandboxes the leftover checks
	// would count. The pool tests restart the daemon with them.
	d.extra = append(netSetup(), "--warm-pool-max", "0", "--e2b-default-template", baseRef)
	if err := d.start(); err != nil {
		return err
	}
	var err error
	client, err = dsec.New(dsec.WithEndpoint("http://"+d.listen), dsec.WithAPIKey(d.key))
	if err != nil {
		return err
	}
	if err := buildLayers(); err != nil {
		return err
	}
	return buildProbeLayer()
}

// buildLayers builds the shared base/workspace/toolkit set through the CLI.
func buildLayers() error {
	base := filepath.Join(workDir, "base")
	if err := hostfs.Build(base, hostfs.Options{Bash: true}); err != nil {
		return err
	}
	ws := filepath.Join(workDir, "ws")
	tk := filepath.Join(workDir, "tk")
	for path, content := range map[string]string{
		ws + "/repo/a.txt":       "workspace\n",
		ws + "/repo/ws-only":     "only in workspace\n",
		tk + "/repo/a.txt":       "toolkit\n",
		tk + "/opt/tool/run.sh":  "#!/bin/sh\necho tool ran\n",
		base + "/repo/base-only": "only in base\n",
	} {
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(path, []byte(content), 0o755); err != nil {
			return err
		}
	}
	for _, l := range []struct{ kind, name, dir string }{
		{"base", "e2e", base}, {"workspace", "e2e", ws}, {"toolkit", "e2e", tk},
	} {
		out, errOut, code := cli("layer", "build", "--kind", l.kind, "--name", l.name, "--tag", "v1", l.dir)
		if code != 0 {
			return fmt.Errorf("layer build %s: exit %d: %s %s", l.kind, code, out, errOut)
		}
	}
	return nil
}

func freeAddr() string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// start runs `dsec up` and waits for /healthz.
func (d *daemon) start() error {
	logf, err := os.OpenFile(d.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	d.cmd = exec.Command(d.bin, "up", "--listen", d.listen, "--state-dir", d.stateDir,
		"--api-key", d.key, "--config", d.cfgPath, "--log-level", "debug")
	d.cmd.Args = append(d.cmd.Args, d.extra...)
	d.cmd.Stdout, d.cmd.Stderr = logf, logf
	// Own process group: the test can kill -9 it without touching itself.
	d.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := d.cmd.Start(); err != nil {
		return err
	}
	// Ready is an answer to /healthz, not an accepted connection: dsec up
	// listens before it recovers the last run's sandboxes, and serves
	// only after.
	hc := &http.Client{Timeout: time.Second}
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		resp, err := hc.Get("http://" + d.listen + "/healthz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		if d.cmd.ProcessState != nil {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	return errors.New("dsec up did not answer /healthz within 30s")
}

// kill9 kills the daemon without letting it clean up.
func (d *daemon) kill9() {
	if d.cmd != nil && d.cmd.Process != nil {
		_ = d.cmd.Process.Signal(syscall.SIGKILL)
		_, _ = d.cmd.Process.Wait()
		d.cmd = nil
	}
}

// stop stops the daemon gracefully.
func (d *daemon) stop() {
	if d.cmd != nil && d.cmd.Process != nil {
		_ = d.cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _, _ = d.cmd.Process.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			_ = d.cmd.Process.Kill()
		}
		d.cmd = nil
	}
}

func (d *daemon) dumpLog(w *os.File) {
	b, _ := os.ReadFile(d.logPath)
	// Warnings and errors from the whole run first: the tail is mostly
	// the final clean-up.
	var bad []string
	for _, line := range strings.Split(string(b), "\n") {
		if strings.Contains(line, "level=WARN") || strings.Contains(line, "level=ERROR") || strings.HasPrefix(line, "dsec:") {
			bad = append(bad, line)
		}
	}
	if len(bad) > 60 {
		bad = bad[len(bad)-60:]
	}
	fmt.Fprintf(w, "---- dsec up log: warnings and errors ----\n%s\n", strings.Join(bad, "\n"))
	if len(b) > 20000 {
		b = b[len(b)-20000:]
	}
	fmt.Fprintf(w, "---- dsec up log (tail) ----\n%s\n", b)
}

// needDaemon skips without root.
func needDaemon(t *testing.T) {
	t.Helper()
	if skipReason != "" {
		t.Skip(skipReason)
	}
}

// cli runs the dsec CLI against the daemon and returns stdout, stderr, exit code.
func cli(args ...string) (string, string, int) {
	return cliIn(nil, args...)
}

func cliIn(stdin []byte, args ...string) (string, string, int) {
	cmd := exec.Command(d.bin, args...)
	cmd.Env = append(os.Environ(), "DSEC_ENDPOINT=http://"+d.listen, "DSEC_API_KEY="+d.key, "DSEC_CONFIG="+d.cfgPath)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	err := cmd.Run()
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		code = -1
	}
	return out.String(), errb.String(), code
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return c
}

// newSandbox creates a sandbox from the shared layers and deletes it when
// the test ends.
func newSandbox(t *testing.T, spec api.SandboxSpec) *api.Sandbox {
	t.Helper()
	if spec.Base == "" {
		spec.Base = baseRef
	}
	sb, err := client.CreateSandbox(ctx(t), spec)
	if err != nil {
		t.Fatalf("create sandbox: %v", err)
	}
	t.Cleanup(func() { _ = client.DeleteSandbox(context.Background(), sb.ID) })
	return sb
}

// sh runs a shell command in a sandbox and fails the test on API errors.
func sh(t *testing.T, id, cmd string) *api.ExecResult {
	t.Helper()
	res, err := client.Exec(ctx(t), id, api.ExecRequest{Cmd: cmd})
	if err != nil {
		t.Fatalf("exec %q: %v", cmd, err)
	}
	return res
}

// wantCode asserts that err is an SDK error with the given API code.
func wantCode(t *testing.T, err error, code string) {
	t.Helper()
	var e *dsec.Error
	if !errors.As(err, &e) || e.Code != code {
		t.Fatalf("error = %v, want code %s", err, code)
	}
}

// hostMounts returns mount points that contain substr.
// anyMounts is hostMounts over every mount namespace on the host (each
// read once): the mounts whose mount point or superblock options contain
// substr, such as an overlay whose upperdir is in a sandbox's dir. A
// sandbox's rootfs is mounted only in its own namespace, so leak checks
// look everywhere. Each entry is "MOUNTPOINT FSTYPE OPTIONS", once per
// distinct entry.
func anyMounts(substr string) []string {
	seen := map[string]bool{}
	var out []string
	procs, _ := filepath.Glob("/proc/[0-9]*/ns/mnt")
	nss := map[string]bool{}
	for _, p := range procs {
		ns, err := os.Readlink(p)
		if err != nil || nss[ns] {
			continue
		}
		nss[ns] = true
		b, err := os.ReadFile(filepath.Join(filepath.Dir(filepath.Dir(p)), "mountinfo"))
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n") {
			pre, post, ok := strings.Cut(line, " - ")
			f := strings.Fields(pre)
			if !ok || len(f) < 5 || !strings.Contains(line, substr) {
				continue
			}
			pf := strings.Fields(post)
			if len(pf) < 3 || !(strings.Contains(f[4], substr) || strings.Contains(pf[2], substr)) {
				continue
			}
			key := f[4] + " " + pf[0] + " " + pf[2]
			if !seen[key] {
				seen[key] = true
				out = append(out, key)
			}
		}
	}
	return out
}

// sandboxOverlays returns the rootfs path (<sandboxes>/<id>/rootfs) of every
// sandbox that has an overlay mounted in any mount namespace (its upperdir
// is in the sandbox's dir), once each, sorted.
func sandboxOverlays() []string {
	dir := filepath.Join(d.stateDir, "edge", "sandboxes") + "/"
	ids := map[string]bool{}
	for _, m := range anyMounts("upperdir=" + dir) {
		for _, o := range strings.Split(m, ",") {
			if rest, ok := strings.CutPrefix(o, "upperdir="+dir); ok {
				id, _, _ := strings.Cut(rest, "/")
				ids[id] = true
			}
		}
	}
	var out []string
	for id := range ids {
		out = append(out, filepath.Join(dir, id, "rootfs"))
	}
	slices.Sort(out)
	return out
}

func hostMounts(substr string) []string {
	b, _ := os.ReadFile("/proc/self/mountinfo")
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && strings.Contains(f[4], substr) {
			out = append(out, f[4])
		}
	}
	return out
}

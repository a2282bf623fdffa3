package e2e

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// e2bSDKVersion is the E2B SDK the compatibility suite runs, unmodified.
const e2bSDKVersion = "2.51.0"

// e2bSDK installs the E2B SDK from npm (once per machine: the directory is
// kept between runs) and returns the directory the suite runs in.
func e2bSDK(t *testing.T) string {
	t.Helper()
	for _, tool := range []string{"node", "npm"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("the E2B suite needs %s (Debian: apt-get install nodejs npm)", tool)
		}
	}
	dir := os.Getenv("DSEC_E2B_SDK_DIR")
	if dir == "" {
		dir = filepath.Join(os.TempDir(), "dsec-e2b-sdk-"+e2bSDKVersion)
	}
	var pkg struct{ Version string }
	b, err := os.ReadFile(filepath.Join(dir, "node_modules", "e2b", "package.json"))
	if err != nil || json.Unmarshal(b, &pkg) != nil || pkg.Version != e2bSDKVersion {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		_ = os.WriteFile(filepath.Join(dir, "package.json"), []byte(`{"name":"dsec-e2b-suite","private":true,"type":"module"}`), 0o644)
		t.Logf("installing e2b@%s from npm into %s", e2bSDKVersion, dir)
		cmd := exec.Command("npm", "install", "--no-audit", "--no-fund", "--prefix", dir, "e2b@"+e2bSDKVersion)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("npm install e2b@%s: %v\n%s", e2bSDKVersion, err, out)
		}
	}
	suite, err := os.ReadFile("testdata/e2b/suite.mjs")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "suite.mjs"), suite, 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestE2BSDK runs the real E2B SDK, unmodified, against dsec up: the
// control plane, commands, files, terminals, pause and connect, 32
// sandboxes at once, and the envd auth cases (testdata/e2b/suite.mjs).
func TestE2BSDK(t *testing.T) {
	needDaemon(t)
	dir := e2bSDK(t)
	c := ctx(t)
	if _, err := client.CreateTemplate(c, api.Template{Name: "e2e-user", Base: baseRef, User: "user"}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.DeleteTemplate(c, "e2e-user") })
	sessionsBefore := sessionsOpen(t)
	run := fmt.Sprintf("r%d", time.Now().UnixNano())
	endpoint := "http://" + d.listen

	// An E2B sandbox is a dsec sandbox: the same record, labels, TTL.
	req, _ := http.NewRequest("POST", endpoint+"/v2/sandboxes", strings.NewReader(`{"templateID":"base","timeout":120,"metadata":{"from":"e2b"}}`))
	req.Header.Set("X-API-KEY", d.key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var made struct {
		SandboxID, EnvdVersion, EnvdAccessToken string
	}
	json.NewDecoder(resp.Body).Decode(&made)
	resp.Body.Close()
	if resp.StatusCode != 201 || made.SandboxID == "" || made.EnvdAccessToken == "" || made.EnvdVersion == "" {
		t.Fatalf("E2B create: %d %+v", resp.StatusCode, made)
	}
	sb, err := client.GetSandbox(c, made.SandboxID)
	if err != nil {
		t.Fatalf("the E2B sandbox is not a dsec sandbox: %v", err)
	}
	if sb.Labels["from"] != "e2b" || sb.Spec.TTL != 120 || sb.Spec.Base != baseRef {
		t.Errorf("dsec's view of the E2B sandbox: labels %v, ttl %d, base %s", sb.Labels, sb.Spec.TTL, sb.Spec.Base)
	}
	if err := client.DeleteSandbox(c, made.SandboxID); err != nil {
		t.Fatal(err)
	}

	// The suite sends the key as recent E2B SDKs insist on it ("e2b_" and
	// hex digits), as `dsec key e2b` spells it; TestE2BOnMicroVM sends it
	// as it is.
	spelt, stderr, code := cliIn([]byte(d.key+"\n"), "key", "e2b", "-")
	spelt = strings.TrimSpace(spelt)
	if code != 0 || !strings.HasPrefix(spelt, "e2b_") || strings.Contains(spelt, d.key) {
		t.Fatalf("dsec key e2b: %d %q %s", code, spelt, stderr)
	}
	for _, name := range []string{"lifecycle", "paging", "commands", "files", "pty", "pauseKeepsState", "concurrent", "auth"} {
		t.Run(name, func(t *testing.T) { runE2BCase(t, dir, name, run, "base", "e2e-user", "E2B_API_KEY="+spelt) })
	}
	checkE2BLeftNothing(t, run, sessionsBefore)
}

// TestE2BOnMicroVM: an alias with a backend gives E2B code VMs: the SDK's
// commands (streamed, background, stdin), files (and watchDir),
// terminals, and pause and connect keeping state, run unmodified against
// sandboxes that are VMs.
func TestE2BOnMicroVM(t *testing.T) {
	needMicroVM(t)
	dir := e2bSDK(t)
	c := ctx(t)
	for _, tpl := range []api.Template{
		{Name: "e2e-vm", Base: baseRef, Backend: api.BackendMicroVM},
		{Name: "e2e-vm-user", Base: baseRef, User: "user", Backend: api.BackendMicroVM},
	} {
		if _, err := client.CreateTemplate(c, tpl); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = client.DeleteTemplate(ctx(t), tpl.Name) })
	}
	if _, err := client.CreateTemplate(c, api.Template{Name: "e2e-bad-backend", Base: baseRef, Backend: "qemu"}); err == nil {
		_ = client.DeleteTemplate(c, "e2e-bad-backend")
		t.Fatal("an alias with an unknown backend was made")
	}
	sessionsBefore := sessionsOpen(t)
	run := fmt.Sprintf("r%d", time.Now().UnixNano())
	// The commands case checks that its sandbox has a kernel of its own.
	host, _ := os.ReadFile("/proc/sys/kernel/osrelease")
	for _, name := range []string{"commands", "files", "pty", "pauseKeepsState"} {
		t.Run(name, func(t *testing.T) {
			runE2BCase(t, dir, name, run, "e2e-vm", "e2e-vm-user", "E2B_TEST_KERNEL_NOT="+strings.TrimSpace(string(host)))
		})
	}
	checkE2BLeftNothing(t, run, sessionsBefore)
}

// runE2BCase runs one case of testdata/e2b/suite.mjs with the SDK in dir,
// its sandboxes made from template (and userTemplate, where it needs the
// user "user") and labelled run; env is added to its environment.
func runE2BCase(t *testing.T, dir, name, run, template, userTemplate string, env ...string) {
	t.Helper()
	endpoint := "http://" + d.listen
	cmd := exec.CommandContext(ctx(t), "node", "suite.mjs", name)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "E2B_API_URL="+endpoint, "E2B_SANDBOX_URL="+endpoint, "E2B_API_KEY="+d.key,
		"E2B_TEST_RUN="+run, "E2B_TEST_USER_TEMPLATE="+userTemplate, "E2B_TEST_TEMPLATE="+template)
	cmd.Env = append(cmd.Env, env...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	done, checks := false, 0
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var line struct {
			Check string
			OK    bool
			Got   *string
			Done  bool
		}
		if json.Unmarshal(sc.Bytes(), &line) != nil {
			continue
		}
		switch {
		case line.Done:
			done = true
		case line.Check != "":
			checks++
			if !line.OK {
				got := ""
				if line.Got != nil {
					got = *line.Got
				}
				t.Errorf("%s: failed (got %s)", line.Check, got)
			}
		}
	}
	if err != nil || !done || checks == 0 {
		t.Fatalf("node suite.mjs %s: %v, done=%v, %d checks\nstdout: %s\nstderr: %s", name, err, done, checks, out, stderr.Bytes())
	}
}

// checkE2BLeftNothing checks that the suite's run left no sandbox and no
// process slot.
func checkE2BLeftNothing(t *testing.T, run string, sessionsBefore float64) {
	t.Helper()
	c := ctx(t)
	left, err := client.ListAllSandboxes(c, dsec.ListOptions{Labels: map[string]string{"run": run}})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range left {
		t.Errorf("sandbox %s (%s) left by the suite", s.ID, s.State)
		_ = client.DeleteSandbox(c, s.ID)
	}
	deadline := time.Now().Add(15 * time.Second)
	for sessionsOpen(t) != sessionsBefore {
		if time.Now().After(deadline) {
			t.Fatalf("dsec_sessions_open %v, %v before the suite: processes leaked", sessionsOpen(t), sessionsBefore)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

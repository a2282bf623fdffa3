package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
)

// pythonCmd builds a python3 (3.10 or later) command run from the
// repository root against this suite's daemon, with libdsec on PYTHONPATH,
// or skips the test. Call cancel when done.
func pythonCmd(t *testing.T, timeout time.Duration, args ...string) (*exec.Cmd, context.CancelFunc) {
	t.Helper()
	needDaemon(t)
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("needs python3 (3.10 or later)")
	}
	if out, err := exec.Command(py, "-c", "import sys; sys.exit(sys.version_info < (3, 10))").CombinedOutput(); err != nil {
		t.Skipf("needs python3 3.10 or later for libdsec: %v %s", err, out)
	}
	// The test runs in test/e2e; the repository root is two levels up.
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	c, cancel := context.WithTimeout(context.Background(), timeout)
	cmd := exec.CommandContext(c, py, args...)
	cmd.Dir = root
	cmd.Env = append(os.Environ(),
		"DSEC_ENDPOINT=http://"+d.listen,
		"DSEC_API_KEY="+d.key,
		"DSEC_CONFIG="+d.cfgPath,
		"PYTHONPATH="+filepath.Join(root, "sdk", "python", "src"),
		"PYTHONDONTWRITEBYTECODE=1",
	)
	return cmd, cancel
}

// TestPythonSDK runs the libdsec (sdk/python) test suite, unit and
// integration tests both, against this suite's daemon and layers.
func TestPythonSDK(t *testing.T) {
	cmd, cancel := pythonCmd(t, 4*time.Minute, "-m", "unittest", "discover", "-s", "sdk/python/tests", "-v")
	defer cancel()
	cmd.Env = append(cmd.Env,
		"DSEC_TEST_BASE="+baseRef,
		"DSEC_TEST_WORKSPACE="+workspaceRef,
		"DSEC_TEST_TOOLKIT="+toolkitRef,
		"DSEC_TEST_LISTING=1",
	)
	if netw.skip == "" {
		cmd.Env = append(cmd.Env, "DSEC_TEST_PYPI_URL=http://"+pypiName+"/", "DSEC_TEST_NPM_URL=http://"+npmName+"/")
	}
	start := time.Now()
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("python -m unittest (%s): %v\n%s", time.Since(start).Round(time.Millisecond), err, out)
	}
	// The integration tests skip themselves without an endpoint; here they
	// must have run.
	if strings.Contains(string(out), "integration tests need DSEC_ENDPOINT") {
		t.Fatalf("libdsec integration tests were skipped:\n%s", out)
	}
	t.Logf("libdsec tests passed in %s:\n%s", time.Since(start).Round(time.Millisecond), out)
}

// pythonTerminalScript drives a terminal of the sandbox named by its
// argument through libdsec: output, the size and a resize, the exit
// status; then the blocking facade with cmd=. It exits non-zero with the
// transcript when the terminal does not show what it should, else prints
// what it saw as JSON.
const pythonTerminalScript = `
import asyncio, json, re, sys
import libdsec, libdsec.sync

SB = sys.argv[1]

async def main():
    out = bytearray()
    async with libdsec.DSecClient() as c:
        async with c.sandbox(SB).pty(cols=100, rows=30) as term:
            async def until(pattern):
                while not re.search(pattern, out):
                    try:
                        chunk = await term.read(timeout=20)
                    except libdsec.DeadlineExceeded:
                        sys.exit(f"the terminal never showed {pattern!r}; it showed {bytes(out)!r}")
                    if not chunk:
                        sys.exit(f"the terminal ended (exit code {term.exit_code}) before showing {pattern!r}; it showed {bytes(out)!r}")
                    out.extend(chunk)
            await term.write("echo $((6*7))\n")
            await until(rb"(^|[\r\n])42\r?\n")
            await term.write("stty size\n")
            await until(rb"(^|[\r\n])30 100\r?\n")
            await term.resize(132, 43)
            await term.write("stty size\n")
            await until(rb"(^|[\r\n])43 132\r?\n")
            await term.write("exit 5\n")
            code = await term.wait(timeout=20)
    return code, out.decode("utf-8", "replace")

code, transcript = asyncio.run(main())
with libdsec.sync.DSecClient() as c:
    with c.sandbox(SB).pty(cmd="echo from-cmd; exit 3") as term:
        shown = b"".join(term)
        sync_code = term.exit_code
print(json.dumps({"exit_code": code, "transcript": transcript,
                  "sync_exit_code": sync_code, "sync_output": shown.decode("utf-8", "replace")}))
`

// TestPythonTerminal runs a shell under a terminal through libdsec's
// Sandbox.pty (the SDK's own WebSocket client) and checks what the
// terminal showed, the resize, the exit codes, and that every terminal
// gave its slot back.
func TestPythonTerminal(t *testing.T) {
	needDaemon(t)
	before := sessionsOpen(t)
	sb := newSandbox(t, api.SandboxSpec{})
	cmd, cancel := pythonCmd(t, 2*time.Minute, "-c", pythonTerminalScript, sb.ID)
	defer cancel()
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	start := time.Now()
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("terminal script (%s): %v\nstdout:\n%s\nstderr:\n%s", time.Since(start).Round(time.Millisecond), err, out, stderr.String())
	}
	var res struct {
		ExitCode     int    `json:"exit_code"`
		Transcript   string `json:"transcript"`
		SyncExitCode int    `json:"sync_exit_code"`
		SyncOutput   string `json:"sync_output"`
	}
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatalf("terminal script output is not JSON: %v\n%s", err, out)
	}
	if res.ExitCode != 5 {
		t.Errorf("exit 5 in the terminal gave exit code %d; transcript:\n%s", res.ExitCode, res.Transcript)
	}
	if res.SyncExitCode != 3 || !strings.Contains(res.SyncOutput, "from-cmd") {
		t.Errorf("sync pty(cmd=...): exit code %d, output %q; want 3 and from-cmd", res.SyncExitCode, res.SyncOutput)
	}
	deadline := time.Now().Add(10 * time.Second)
	for sessionsOpen(t) != before {
		if time.Now().After(deadline) {
			t.Fatalf("dsec_sessions_open %v, was %v before: a libdsec terminal leaked", sessionsOpen(t), before)
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("libdsec terminal in %s", time.Since(start).Round(time.Millisecond))
}

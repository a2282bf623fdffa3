package e2e

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
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

package e2e

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
)

// TestImageBootstrap builds a real Debian base with `dsec image bootstrap`
// (debootstrap from the Debian mirror, or $DSEC_TEST_DEBIAN_MIRROR) and
// runs Debian's python3 and apt in a sandbox on it. It downloads about
// 40 MB and takes a minute or so, so it runs only when asked.
func TestImageBootstrap(t *testing.T) {
	if os.Getenv("DSEC_TEST_BOOTSTRAP") != "1" {
		t.Skip("set DSEC_TEST_BOOTSTRAP=1 to run: debootstraps Debian from the network (~40 MB, about a minute)")
	}
	needDaemon(t)
	const ref = "base/debian-e2e:12"
	args := []string{"image", "bootstrap", "--suite", "bookworm", "--ref", ref, "--packages", "python3"}
	if m := os.Getenv("DSEC_TEST_DEBIAN_MIRROR"); m != "" {
		args = append(args, "--mirror", m)
	}

	// Bad input is refused before anything is downloaded or created: well
	// within the minute a download takes, however busy the host.
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp) // the CLI's work dir goes here, so the test sees it removed
	for _, bad := range [][]string{
		{"--suite", "Bookworm", "--ref", ref},
		{"--suite", "bookworm", "--ref", "toolkit/debian:12"},
		{"--suite", "bookworm", "--ref", ref, "--packages", "python3,-x"},
		{"--suite", "bookworm", "--ref", ref, "--mirror", "ftp://deb.debian.org/debian"},
	} {
		start := time.Now()
		_, errOut, code := cli(append([]string{"image", "bootstrap"}, bad...)...)
		if code == 0 || !strings.Contains(errOut, "image bootstrap:") || time.Since(start) > 30*time.Second {
			t.Errorf("bootstrap %q: exit %d after %s: %s", bad, code, time.Since(start), errOut)
		}
	}
	if _, err := client.GetLayer(ctx(t), ref); err == nil {
		t.Fatalf("%s exists after refused bootstraps", ref)
	}

	start := time.Now()
	out, errOut, code := cli(args...)
	took := time.Since(start)
	if code != 0 {
		t.Fatalf("image bootstrap: exit %d\nstdout: %s\nstderr: %s", code, out, errOut)
	}
	t.Cleanup(func() { _, _, _ = cli("layer", "delete", ref) }) // after the sandbox's cleanup
	for _, line := range strings.Split(errOut, "\n") {
		if strings.HasPrefix(line, "image bootstrap:") || strings.HasPrefix(line, "sent ") {
			t.Log(line)
		}
	}
	t.Logf("image bootstrap took %s", took.Round(100*time.Millisecond))
	if !strings.HasPrefix(out, ref+" sha256:") {
		t.Errorf("stdout %q, want the layer line", out)
	}
	if !strings.Contains(errOut, "  debootstrap: I: ") {
		t.Errorf("stderr has no debootstrap progress:\n%s", errOut)
	}
	if left, _ := os.ReadDir(tmp); len(left) != 0 {
		t.Errorf("work dir left behind in TMPDIR: %v", left)
	}

	// A second run finds the ref and does nothing (no download either).
	start = time.Now()
	out2, errOut2, code := cli(args...)
	if code != 0 || !strings.Contains(errOut2, "already exists") || out2 != out || time.Since(start) > 30*time.Second {
		t.Errorf("second bootstrap: exit %d after %s\nstdout: %s\nstderr: %s", code, time.Since(start), out2, errOut2)
	}

	sb := newSandbox(t, api.SandboxSpec{Base: ref})
	for _, c := range []struct{ cmd, want string }{
		{`python3 -c 'import sys, sqlite3; print("py", sys.version_info[:2])'`, "py (3, 11)"},
		{`apt-cache policy python3`, "/var/lib/dpkg/status"},
		{`cat /etc/debian_version`, "12."},
		{`bash -c 'echo "bash $BASH_VERSION"'`, "bash 5."},
		// The cleaning: no apt lists, caches or log files, no host names.
		{`echo lists=$(ls -A /var/lib/apt/lists | wc -l) archives=$(ls -A /var/cache/apt/archives)`, "lists=0 archives=partial"},
		{`echo logs=$(find /var/log -type f | wc -l) host=$(cat /etc/hostname) resolv=$(wc -c </etc/resolv.conf)`, "logs=0 host=sandbox"},
	} {
		res := sh(t, sb.ID, c.cmd)
		t.Logf("$ %s\n%s%s", c.cmd, res.Stdout, res.Stderr)
		if res.ExitCode != 0 || !strings.Contains(res.Stdout, c.want) {
			t.Errorf("%s: exit %d, stdout %q, stderr %q; want %q", c.cmd, res.ExitCode, res.Stdout, res.Stderr, c.want)
		}
	}
}

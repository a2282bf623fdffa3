package e2e

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/hostfs"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// instance is a second `dsec up`, with its own state dir, port, key and
// flags, for behaviour the shared daemon's defaults do not show.
type instance struct {
	dir, state, listen, key, cfg, logPath string
	cmd                                   *exec.Cmd
	client                                *dsec.Client
}

// startInstance runs `dsec up` with extra flags under a new temporary
// directory and waits until it listens. Cleanup deletes its sandboxes and
// stops it, whatever the test did.
func startInstance(t *testing.T, flags ...string) *instance {
	t.Helper()
	dir := t.TempDir()
	in := &instance{
		dir: dir, state: filepath.Join(dir, "state"), listen: freeAddr(),
		key: "second-instance-key-0123456789", cfg: filepath.Join(dir, "config.json"),
		logPath: filepath.Join(dir, "dsec.log"),
	}
	logf, err := os.Create(in.logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	args := append([]string{"up", "--listen", in.listen, "--state-dir", in.state, "--api-key", in.key,
		"--config", in.cfg, "--log-level", "debug"}, flags...)
	in.cmd = exec.Command(d.bin, args...)
	in.cmd.Stdout, in.cmd.Stderr = logf, logf
	in.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := in.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		in.deleteSandboxes()
		in.stop()
		// Mounts left by a failed test would make the temporary
		// directory's removal fail: detach those under it, and only those.
		for _, mp := range hostMounts(in.dir + "/") {
			_ = unix.Unmount(mp, unix.MNT_DETACH)
		}
		if t.Failed() {
			b, _ := os.ReadFile(in.logPath)
			if len(b) > 20000 {
				b = b[len(b)-20000:]
			}
			t.Logf("second instance log (tail):\n%s", b)
		}
	})
	// Ready once it serves: it listens before recovery and writes the
	// client config (which in.cli reads) just before serving.
	deadline := time.Now().Add(30 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", in.listen, 200*time.Millisecond)
		if err == nil {
			c.Close()
			if _, err := os.Stat(in.cfg); err == nil {
				break
			}
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(in.logPath)
			t.Fatalf("second instance did not serve within 30s:\n%s", b)
		}
		time.Sleep(50 * time.Millisecond)
	}
	in.client, err = dsec.New(dsec.WithEndpoint("http://"+in.listen), dsec.WithAPIKey(in.key))
	if err != nil {
		t.Fatal(err)
	}
	return in
}

// cli runs the dsec CLI against the instance.
func (in *instance) cli(args ...string) (string, string, error) {
	cmd := exec.Command(d.bin, args...)
	cmd.Env = append(os.Environ(), "DSEC_ENDPOINT=http://"+in.listen, "DSEC_API_KEY="+in.key, "DSEC_CONFIG="+in.cfg)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	return out.String(), errb.String(), err
}

func (in *instance) deleteSandboxes() {
	if in.client == nil || in.cmd == nil {
		return
	}
	c, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	all, _ := in.client.ListAllSandboxes(c, dsec.ListOptions{})
	for _, sb := range all {
		_ = in.client.DeleteSandbox(c, sb.ID)
	}
}

// stop ends the instance with SIGTERM (SIGKILL after 20 s); it may be
// called more than once.
func (in *instance) stop() {
	if in.cmd == nil {
		return
	}
	_ = in.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { _ = in.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		_ = in.cmd.Process.Kill()
		<-done
	}
	in.cmd = nil
}

// cgroupParent is the instance's sandbox cgroup parent, as `dsec up`
// derives it from the node name and the absolute state dir.
func (in *instance) cgroupParent() string {
	sum := sha256.Sum256([]byte(in.state))
	return "/dsec/local-" + hex.EncodeToString(sum[:4])
}

// flattenStep is the shell script of step i of the chain: write a file,
// delete the previous step's, replace a directory, and alternately delete
// and re-create a directory of the base, so that a plain directory lands
// on a whiteout of a lower snapshot layer.
func flattenStep(i int) string {
	var b strings.Builder
	b.WriteString("set -e\n")
	fmt.Fprintf(&b, "echo %d > /work/f%d\nrm /work/f%d\n", i, i, i-1)
	fmt.Fprintf(&b, "rm -rf /data && mkdir /data && echo %d > /data/only%d\n", i, i)
	switch {
	case i%2 == 0:
		b.WriteString("rm -rf /cycle\n")
	case i > 1:
		fmt.Fprintf(&b, "mkdir /cycle && echo %d > /cycle/n%d\n", i, i)
	}
	switch i {
	case 1:
		b.WriteString("mkdir /keep && echo early > /keep/early\n")
		b.WriteString("echo s > /work/suid && chown 1000:1000 /work/suid && chmod 4755 /work/suid\n")
		b.WriteString("ln -s /etc/passwd /work/link\n")
	case 3:
		// Left out by this step's include rule.
		b.WriteString("echo late > /keep/late\n")
	}
	return b.String()
}

// flattenWant is the tree a sandbox started from snapshot i sees, as
// flattenDump prints it.
func flattenWant(i int) []string {
	want := []string{
		"/data/", fmt.Sprintf("/data/only%d=%d 644 0:0", i, i),
		"/keep/", "/keep/early=early 644 0:0",
		"/work/", fmt.Sprintf("/work/f%d=%d 644 0:0", i, i), "/work/link -> /etc/passwd", "/work/suid=s 4755 1000:1000",
	}
	switch {
	case i == 1:
		want = append(want, "/cycle/", "/cycle/a=a 644 0:0", "/cycle/b=b 644 0:0")
	case i%2 == 1:
		want = append(want, "/cycle/", fmt.Sprintf("/cycle/n%d=%d 644 0:0", i, i))
	}
	slices.Sort(want)
	return want
}

const flattenDump = `for p in $(find /work /data /cycle /keep 2>/dev/null); do
if [ -L "$p" ]; then echo "$p -> $(readlink "$p")"
elif [ -f "$p" ]; then echo "$p=$(cat "$p") $(stat -c '%a %u:%g' "$p")"
else echo "$p/"; fi
done`

// A chain of snapshots deeper than --snapshot-depth is flattened into one
// layer on base, and sandboxes started from it see what the chain would
// have shown.
func TestFlattenSnapshotChain(t *testing.T) {
	needDaemon(t)
	in := startInstance(t, "--snapshot-depth", "2")

	base := filepath.Join(in.dir, "base")
	if err := hostfs.Build(base, hostfs.Options{}); err != nil {
		t.Fatal(err)
	}
	for p, data := range map[string]string{
		"work/f0": "0", "data/a": "a", "data/b": "b", "data/c": "c", "cycle/a": "a", "cycle/b": "b",
	} {
		if err := os.MkdirAll(filepath.Join(base, filepath.Dir(p)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(base, p), []byte(data+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if out, errOut, err := in.cli("layer", "build", "--kind", "base", "--name", "flat", "--tag", "v1", base); err != nil {
		t.Fatalf("layer build: %v: %s %s", err, out, errOut)
	}
	baseLayer, err := in.client.GetLayer(ctx(t), "base/flat:v1")
	if err != nil {
		t.Fatal(err)
	}

	cur, err := in.client.CreateSandbox(ctx(t), api.SandboxSpec{Base: "base/flat:v1"})
	if err != nil {
		t.Fatal(err)
	}
	// Snapshot layers under snapshot i (after it was taken): 1 and 2 stack,
	// 3 merges 1 and 2 into itself, 4 stacks on 3, 5 merges 3 and 4.
	wantBelow := []int{0, 0, 1, 0, 1, 0}
	wantFlattened := []int{0, 0, 0, 2, 0, 2}
	var last *api.Layer
	for i := 1; i <= 5; i++ {
		res, err := in.client.Exec(ctx(t), cur.ID, api.ExecRequest{Cmd: flattenStep(i)})
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("step %d: %+v %v", i, res, err)
		}
		req := api.SnapshotRequest{Ref: fmt.Sprintf("snapshot/flat:s%d", i)}
		if i == 3 {
			req.Include = []string{"/work", "/data", "/cycle"}
		}
		l, err := in.client.Snapshot(ctx(t), cur.ID, req)
		if err != nil {
			t.Fatalf("snapshot %d: %v", i, err)
		}
		info := l.Snapshot
		if info == nil || info.Layers[0] != baseLayer.Digest || len(info.Layers) != 1+wantBelow[i] || info.Flattened != wantFlattened[i] {
			t.Fatalf("snapshot %d sits on %v, flattened %d; want base + %d snapshot layers, flattened %d",
				i, info.Layers, info.Flattened, wantBelow[i], wantFlattened[i])
		}
		if left, _ := os.ReadDir(filepath.Join(in.state, "edge", "snapstage")); len(left) != 0 {
			t.Errorf("after snapshot %d, staging holds %d entries", i, len(left))
		}
		// The source continues, unfrozen.
		if r, err := in.client.Exec(ctx(t), cur.ID, api.ExecRequest{Cmd: "echo alive"}); err != nil || r.Stdout != "alive\n" {
			t.Fatalf("source after snapshot %d: %+v %v", i, r, err)
		}
		next, err := in.client.CreateSandbox(ctx(t), api.SandboxSpec{Snapshot: req.Ref})
		if err != nil {
			t.Fatalf("create from snapshot %d: %v", i, err)
		}
		if len(next.Layers) != len(info.Layers)+1 || next.Layers[len(next.Layers)-1] != l.Digest {
			t.Fatalf("sandbox from snapshot %d stacks %v", i, next.Layers)
		}
		if err := in.client.DeleteSandbox(ctx(t), cur.ID); err != nil {
			t.Fatal(err)
		}
		cur = next
		r, err := in.client.Exec(ctx(t), cur.ID, api.ExecRequest{Cmd: flattenDump})
		if err != nil || r.ExitCode != 0 {
			t.Fatalf("listing the tree from snapshot %d: %+v %v", i, r, err)
		}
		got := strings.Split(strings.TrimSpace(r.Stdout), "\n")
		slices.Sort(got)
		if want := flattenWant(i); !slices.Equal(got, want) {
			t.Fatalf("sandbox from snapshot %d sees\n%s\nwant\n%s", i, strings.Join(got, "\n"), strings.Join(want, "\n"))
		}
		last = l
	}
	if len(last.Snapshot.Layers) != 1 || last.Snapshot.Flattened == 0 {
		t.Fatalf("final snapshot: layers %v, flattened %d", last.Snapshot.Layers, last.Snapshot.Flattened)
	}
	// Nothing refers to the merged-away layers any more.
	for _, ref := range []string{"snapshot/flat:s1", "snapshot/flat:s2", "snapshot/flat:s3", "snapshot/flat:s4"} {
		if out, errOut, err := in.cli("layer", "delete", ref); err != nil {
			t.Errorf("layer delete %s: %v %s %s", ref, err, out, errOut)
		}
	}
	if r, err := in.client.Exec(ctx(t), cur.ID, api.ExecRequest{Cmd: "cat /work/f5 /data/only5 /cycle/n5"}); err != nil || r.Stdout != "5\n5\n5\n" {
		t.Fatalf("after deleting the chain's layers: %+v %v", r, err)
	}

	// Stop the instance and check that it leaves nothing behind.
	if err := in.client.DeleteSandbox(ctx(t), cur.ID); err != nil {
		t.Fatal(err)
	}
	in.stop()
	if m := hostMounts(in.state + "/"); len(m) != 0 {
		t.Errorf("mounts left under the instance's state dir: %v", m)
	}
	for _, sub := range []string{"sandboxes", "snapstage", "mnt"} {
		left, err := os.ReadDir(filepath.Join(in.state, "edge", sub))
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			t.Error(err)
		}
		if len(left) != 0 {
			t.Errorf("edge/%s holds %d entries after the instance stopped", sub, len(left))
		}
	}
	for _, h := range cgroupHierarchies() {
		kids, _ := os.ReadDir(filepath.Join(h, in.cgroupParent()))
		for _, k := range kids {
			if k.IsDir() {
				t.Errorf("cgroup %s left in %s", k.Name(), filepath.Join(h, in.cgroupParent()))
			}
		}
	}
}

package e2e

import (
	"context"
	"encoding/base64"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// withPools restarts the daemon with warm pools of up to n, and back
// without them when the test ends (pooled sandboxes are reaped then).
func withPools(t *testing.T, n string) {
	t.Helper()
	withPoolFlags(t, "--warm-pool-max", n)
}

// withPoolFlags restarts the daemon with flags added for the test.
func withPoolFlags(t *testing.T, flags ...string) {
	t.Helper()
	saved := append([]string(nil), d.extra...)
	d.stop()
	d.extra = append(append([]string(nil), saved...), flags...) // the last flag wins
	if err := d.start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		d.stop()
		d.extra = saved
		if err := d.start(); err != nil {
			t.Errorf("restarting the daemon without pools: %v", err)
		}
		// The pooled sandboxes of the pool run are gone.
		deadline := time.Now().Add(10 * time.Second)
		for pooledDirs() > 0 && time.Now().Before(deadline) {
			time.Sleep(100 * time.Millisecond)
		}
		if n := pooledDirs(); n > 0 {
			t.Errorf("%d pooled sandboxes left after a restart without pools", n)
		}
	})
}

// pooledDirs counts sandbox records marked pooled on disk.
func pooledDirs() int {
	recs, _ := filepath.Glob(filepath.Join(d.stateDir, "edge", "sandboxes", "*", "sandbox.json"))
	n := 0
	for _, r := range recs {
		if b, err := os.ReadFile(r); err == nil && strings.Contains(string(b), `"pooled":true`) {
			n++
		}
	}
	return n
}

func pooledCount(t *testing.T) int {
	t.Helper()
	nodes, err := client.ListNodes(ctx(t))
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, nd := range nodes {
		n += nd.Counts["pooled"]
	}
	return n
}

// TestWarmPoolFloor: with --warm-pool-min, one create of a class is
// enough for the edge to keep that many ready (and no more, without
// demand), and the next create of the class is served from them.
func TestWarmPoolFloor(t *testing.T) {
	needDaemon(t)
	withPoolFlags(t, "--warm-pool-max", "4", "--warm-pool-min", "2")
	spec := api.SandboxSpec{Base: baseRef, MemoryMB: 192}
	first, err := client.CreateSandbox(ctx(t), spec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.DeleteSandbox(ctx(t), first.ID) })
	deadline := time.Now().Add(20 * time.Second)
	for pooledCount(t) < 2 {
		if time.Now().After(deadline) {
			t.Fatalf("pool did not fill to its floor after one create: %d pooled", pooledCount(t))
		}
		time.Sleep(100 * time.Millisecond)
	}
	// A refill past the floor would show by now: the node view is at
	// most a poll (about a second) old.
	time.Sleep(2 * time.Second)
	if n := pooledCount(t); n != 2 {
		t.Errorf("%d pooled after one create, want the floor of 2", n)
	}
	hits := func() float64 {
		v, _ := metricValue(string(wireCallAuth(t, "GET", "/metrics", nil, wireAuthNone).Body), "dsec_pool_claims_total", `result="hit"`)
		return v
	}
	before := hits()
	second, err := client.CreateSandbox(ctx(t), spec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.DeleteSandbox(ctx(t), second.ID) })
	if n := hits() - before; n != 1 {
		t.Errorf("the second create was not served from the pool (%v hits)", n)
	}
	// Bad floors are refused at start (bounded: a daemon that did start
	// is killed).
	for _, bad := range [][]string{{"--warm-pool-min", "5", "--warm-pool-max", "4"}, {"--warm-pool-min", "-1"}, {"--warm-pool-max", "-1"}} {
		c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		cmd := exec.CommandContext(c, d.bin, append([]string{"up", "--listen", "127.0.0.1:0", "--state-dir", t.TempDir()}, bad...)...)
		cmd.WaitDelay = 5 * time.Second
		out, err := cmd.CombinedOutput()
		timedOut := c.Err() != nil
		cancel()
		if err == nil || timedOut || !strings.Contains(string(out), "warm-pool") {
			t.Errorf("dsec up %v: %v: %s", bad, err, out)
		}
	}
}

func TestWarmPoolServesFreshSandboxes(t *testing.T) {
	needDaemon(t)
	withPools(t, "4")
	spec := api.SandboxSpec{Base: baseRef, MemoryMB: 256}
	// Demand: a few creates of one class make the edge keep some ready.
	for i := 0; i < 6; i++ {
		sb, err := client.CreateSandbox(ctx(t), spec)
		if err != nil {
			t.Fatal(err)
		}
		sh(t, sb.ID, "echo used > /root/used")
		if err := client.DeleteSandbox(ctx(t), sb.ID); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(20 * time.Second)
	for pooledCount(t) < 2 {
		if time.Now().After(deadline) {
			t.Fatalf("pool did not fill: %d pooled", pooledCount(t))
		}
		time.Sleep(100 * time.Millisecond)
	}
	// Pooled sandboxes are nobody's: not listed.
	all, err := client.ListAllSandboxes(ctx(t), dsecListAll())
	if err != nil {
		t.Fatal(err)
	}
	before := len(all)

	claimSpec := spec
	claimSpec.Labels = map[string]string{"from": "pool"}
	claimSpec.Env = map[string]string{"GREETING": "hi"}
	claimSpec.Workdir = "/tmp"
	start := time.Now()
	sb, err := client.CreateSandbox(ctx(t), claimSpec)
	took := time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = client.DeleteSandbox(ctx(t), sb.ID) })
	t.Logf("create from the warm pool: %v", took)
	if sb.Labels["from"] != "pool" || sb.State != api.StateRunning {
		t.Fatalf("claimed sandbox: %+v", sb)
	}
	r := sh(t, sb.ID, "echo $GREETING; pwd; test -e /root/used && echo USED || echo fresh")
	if r.Stdout != "hi\n/tmp\nfresh\n" {
		t.Fatalf("claimed sandbox: %q (env, workdir and freshness)", r.Stdout)
	}
	all, _ = client.ListAllSandboxes(ctx(t), dsecListAll())
	if len(all) != before+1 {
		t.Fatalf("listing shows %d sandboxes, want %d (pooled ones must not show)", len(all), before+1)
	}
	// A different class is not served from this pool.
	other, err := client.CreateSandbox(ctx(t), api.SandboxSpec{Base: baseRef, MemoryMB: 128})
	if err != nil {
		t.Fatal(err)
	}
	_ = client.DeleteSandbox(ctx(t), other.ID)
	got, err := client.GetSandbox(ctx(t), other.ID)
	if err == nil {
		t.Fatalf("deleted sandbox still there: %+v", got)
	}
}

func TestFnCall(t *testing.T) {
	needDaemon(t)
	withPools(t, "4")
	b64 := func(s string) string { return base64.StdEncoding.EncodeToString([]byte(s)) }
	req := api.FnCallRequest{
		Base:       baseRef,
		Cmd:        "sh main.sh < /dev/stdin; cat /tmp/left 2>/dev/null; echo secret > /tmp/left",
		Files:      map[string]string{"main.sh": b64("read x; echo got $x; echo result > out.txt; pwd")},
		Stdin:      "input\n",
		FetchFiles: []string{"out.txt", "absent.txt"},
		Timeout:    30,
	}
	var durs []time.Duration
	for i := 0; i < 5; i++ {
		start := time.Now()
		res, err := client.FnCall(ctx(t), req)
		durs = append(durs, time.Since(start))
		if err != nil {
			t.Fatal(err)
		}
		// Nothing of one call is seen by the next: /tmp/left never shows.
		if res.ExitCode != 0 || res.Stdout != "got input\n/work\n" {
			t.Fatalf("call %d: %+v", i, res)
		}
		if out, _ := base64.StdEncoding.DecodeString(res.Files["out.txt"]); string(out) != "result\n" {
			t.Fatalf("fetched out.txt = %q", out)
		}
		if len(res.Missing) != 1 || res.Missing[0] != "absent.txt" {
			t.Fatalf("missing = %v", res.Missing)
		}
	}
	t.Logf("fncall round trips: %v", durs)
	res, err := client.FnCall(ctx(t), api.FnCallRequest{Base: baseRef, Argv: []string{"sleep", "10"}, Timeout: 1})
	if err != nil || !res.TimedOut {
		t.Fatalf("timeout: %+v %v", res, err)
	}
	// Bytes in and out exactly, env, and the output cap.
	res, err = client.FnCall(ctx(t), api.FnCallRequest{Base: baseRef, Cmd: `cat; printf "$A"; head -c 5000 /dev/zero >&2`,
		StdinB64: base64.StdEncoding.EncodeToString([]byte{0xff, 0xfe}), Env: map[string]string{"A": `\375`}, MaxOutputBytes: 100})
	if err != nil {
		t.Fatal(err)
	}
	if out, _ := base64.StdEncoding.DecodeString(res.StdoutB64); string(out) != "\xff\xfe\xfd" || !res.Truncated || len(res.Stderr) != 100 {
		t.Errorf("binary call: stdout %q (b64 %q), stderr %d bytes, truncated %v", res.Stdout, res.StdoutB64, len(res.Stderr), res.Truncated)
	}
	// The CLI: files in from disk, out to disk, the command's status.
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "in.txt"), []byte("from disk\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	o, e, code := cli("fncall", "--file", filepath.Join(dir, "in.txt"), "--file", "sub/b.txt="+filepath.Join(dir, "in.txt"),
		"--fetch", "r/out.txt", "--out", filepath.Join(dir, "res"), baseRef, "--cmd", "cat in.txt sub/b.txt; mkdir r; echo done > r/out.txt; exit 7")
	if got, _ := os.ReadFile(filepath.Join(dir, "res", "r", "out.txt")); code != 7 || o != "from disk\nfrom disk\n" || string(got) != "done\n" {
		t.Errorf("dsec fncall: exit %d, stdout %q, stderr %q, fetched %q", code, o, e, got)
	}
	// A fetch of a directory is missing, and the result still comes.
	res, err = client.FnCall(ctx(t), api.FnCallRequest{Base: baseRef, Cmd: "mkdir d; echo ran", FetchFiles: []string{"d"}})
	if err != nil || res.Stdout != "ran\n" || len(res.Missing) != 1 {
		t.Errorf("fetching a directory: %+v %v", res, err)
	}
	// Bad calls are refused before a sandbox is made for them.
	creates := func() float64 {
		v, _ := metricValue(string(wireCallAuth(t, "GET", "/metrics", nil, wireAuthNone).Body), "dsec_sandbox_create_seconds_count")
		return v
	}
	createsBefore := creates()
	for _, bad := range []api.FnCallRequest{
		{Cmd: "true"},
		{Base: baseRef},
		{Base: baseRef, Cmd: "true", Argv: []string{"true"}},
		{Base: baseRef, Cmd: "true", Files: map[string]string{"/etc/passwd": ""}},
		{Base: baseRef, Cmd: "true", Files: map[string]string{"../x": ""}},
		{Base: baseRef, Cmd: "true", Files: map[string]string{"x": "not base64!"}},
		{Base: baseRef, Cmd: "true", FetchFiles: []string{"/etc/shadow"}},
		{Base: baseRef, Cmd: "true", Stdin: "x", StdinB64: "eA=="},
		{Base: baseRef, Cmd: "true", StdinB64: "not base64!"},
		{Base: baseRef, Cmd: "true", Timeout: -1},
		{Base: baseRef, Cmd: "true", MaxOutputBytes: 1 << 40},
		{Base: baseRef, Cmd: "true", Env: map[string]string{"": "x"}},
		{Base: baseRef, Cmd: "true", Files: map[string]string{"a": "", "a/b": ""}},
	} {
		_, err := client.FnCall(ctx(t), bad)
		wantCode(t, err, "invalid_argument")
	}
	if n := creates() - createsBefore; n != 0 {
		t.Errorf("bad calls made %v sandboxes", n)
	}
	_, err = client.FnCall(ctx(t), api.FnCallRequest{Base: "base/nosuch:v1", Cmd: "true"})
	wantCode(t, err, "not_found")
	// The call sandboxes are deleted after the answers.
	deadline := time.Now().Add(10 * time.Second)
	for {
		all, _ := client.ListAllSandboxes(ctx(t), dsecListAll())
		n := 0
		for _, s := range all {
			if s.Labels["dsec.fncall"] == "true" {
				n++
			}
		}
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d fncall sandboxes left", n)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func dsecListAll() dsec.ListOptions { return dsec.ListOptions{} }

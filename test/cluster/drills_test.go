package cluster

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/cluster"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// burst creates n sandboxes labelled job, conc at a time, through cl, and
// returns how many calls succeeded and the errors of the others.
func burst(t *testing.T, cl *dsec.Client, job string, n, conc int, during func(i int)) (int, []error) {
	t.Helper()
	var ok atomic.Int32
	var mu sync.Mutex
	var errs []error
	sem := make(chan struct{}, conc)
	var wg sync.WaitGroup
	for i := range n {
		if during != nil {
			during(i)
		}
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			cctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
			defer cancel()
			_, err := cl.CreateSandbox(cctx, api.SandboxSpec{Base: baseRef, Labels: map[string]string{"job": job}})
			if err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
				return
			}
			ok.Add(1)
		}()
	}
	wg.Wait()
	return int(ok.Load()), errs
}

func countJob(t *testing.T, job string) (int, map[string]int) {
	t.Helper()
	all, err := c.client.ListAllSandboxes(ctx(t), dsec.ListOptions{Labels: map[string]string{"job": job}})
	if err != nil {
		t.Fatal(err)
	}
	per := map[string]int{}
	for _, sb := range all {
		per[sb.Node]++
	}
	return len(all), per
}

// TestDrillEdgeKilled: kill -9 of an edge mid-burst. Placement stops
// choosing it within 3 s, the burst goes on on the others, calls to its
// sandboxes fail fast and clearly, and once it restarts its sandboxes are
// re-adopted and reachable again through every apiserver.
func TestDrillEdgeKilled(t *testing.T) {
	need(t)
	victim := edgeOf("e3")
	on3 := newSandbox(t, api.SandboxSpec{NodeSelector: map[string]string{"zone": "z3"}})
	mustExec(t, c.client, on3.ID, "echo before > /root/mark")
	t.Cleanup(func() { _, _ = c.client.DeleteSandboxes(context.Background(), map[string]string{"job": "drill-edge"}) })

	var killedAt time.Time
	restarted := false
	restart := func() {
		if restarted {
			return
		}
		restarted = true
		if err := victim.start(c.bin); err != nil {
			t.Fatal(err)
		}
		if err := c.waitNodes(60*time.Second, "e3"); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(restart)
	made, errs := burst(t, c.client, "drill-edge", 30, 4, func(i int) {
		if i == 10 {
			victim.kill9()
			killedAt = time.Now()
		}
	})
	// Placement stops choosing it within 3 s: every apiserver's view says so.
	for i, pc := range c.perServer {
		for {
			nodes, err := pc.ListNodes(ctx(t))
			if err == nil && !healthy(nodes, "e3") {
				break
			}
			if time.Since(killedAt) > 3*time.Second {
				t.Fatalf("s%d still counts e3 healthy %v after the kill", i, time.Since(killedAt))
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	t.Logf("burst of 30 with e3 killed at the 10th: %d made, %d failed: %v", made, len(errs), errs)
	// None fails: a create in flight on e3 at the kill is sent to e3 again,
	// refused, and placed on another node.
	if len(errs) > 0 {
		t.Fatalf("%d creates failed with e3 killed: %v", len(errs), errs)
	}
	// A call to a sandbox of the dead edge: a clear unavailable, fast.
	start := time.Now()
	_, err := c.perServer[0].Exec(ctx(t), on3.ID, api.ExecRequest{Cmd: "true"})
	wantCode(t, err, "unavailable")
	if el := time.Since(start); el > 5*time.Second {
		t.Fatalf("exec to a dead edge took %v", el)
	}
	// The list says what it could not see.
	l, err := c.perServer[1].ListSandboxes(ctx(t), dsec.ListOptions{Labels: map[string]string{"job": "drill-edge"}, Limit: 1000})
	if err != nil || strings.Join(l.UnreachableNodes, ",") != "e3" {
		t.Fatalf("list with e3 down: unreachable %v, %v", l.UnreachableNodes, err)
	}

	// The restart (within the dead edge's lease) takes its name back.
	start = time.Now()
	restart()
	t.Logf("e3 back in every view %v after its restart", time.Since(start).Round(time.Millisecond))
	for _, pc := range c.perServer {
		if out := mustExec(t, pc, on3.ID, "cat /root/mark"); out != "before\n" {
			t.Fatalf("re-adopted sandbox reads %q", out)
		}
	}
	// Every create made exactly one sandbox: what e3 made for a create it
	// never answered (placed elsewhere meanwhile) it deleted as it came back.
	if n, per := countJob(t, "drill-edge"); n != made {
		t.Fatalf("%d creates succeeded but %d sandboxes are listed (%v)", made, n, per)
	}
}

// TestDrillServerKilled: kill -9 of an apiserver mid-burst. The client
// fails over to the other; with idempotency keys no create is lost or
// doubled.
func TestDrillServerKilled(t *testing.T) {
	need(t)
	victim := c.servers[0]
	t.Cleanup(func() {
		_, _ = c.client.DeleteSandboxes(context.Background(), map[string]string{"job": "drill-server"})
	})
	// A client that starts on the victim.
	cl, err := dsec.New(dsec.WithEndpoint(c.endpoints()), dsec.WithAPIKey(adminKey))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if victim.running() {
			return
		}
		if err := victim.start(c.bin); err != nil {
			t.Fatal(err)
		}
		if err := waitHTTP("http://"+victim.addr+"/healthz", 30*time.Second, victim); err != nil {
			t.Fatal(err)
		}
	})
	// A terminal open through the victim: its shell must end with the
	// victim, not hold a session slot of the sandbox for good.
	term := newSandbox(t, api.SandboxSpec{Labels: map[string]string{"job": "drill-server"}})
	tm, err := c.perServer[0].Terminal(ctx(t), term.ID, dsec.TerminalOptions{Cmd: "exec sleep 7777"})
	if err != nil {
		t.Fatal(err)
	}
	defer tm.Close()
	sleeping := func() string {
		return strings.TrimSpace(mustExec(t, c.perServer[1], term.ID, `n=0; for p in /proc/[0-9]*; do case "$(cat $p/cmdline 2>/dev/null | tr '\0' ' ')" in "sleep 7777 ") n=$((n+1));; esac; done; echo $n`))
	}
	// The terminal answers once its stream is open; its shell starts a
	// moment later.
	for deadline := time.Now().Add(10 * time.Second); sleeping() != "1"; time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the terminal's shell is not running after 10 s")
		}
	}
	const n = 30
	start := time.Now()
	made, errs := burst(t, cl, "drill-server", n, 6, func(i int) {
		if i == 8 {
			victim.kill9()
		}
	})
	t.Logf("30 keyed creates with s0 killed at the 8th: %d made in %v", made, time.Since(start).Round(time.Millisecond))
	if made != n || len(errs) > 0 {
		t.Fatalf("%d of %d creates made with s0 killed mid-burst; errors: %v", made, n, errs)
	}
	if got, per := countJob(t, "drill-server"); got != n+1 {
		t.Fatalf("%d sandboxes for %d keyed creates and a terminal's (%v): a create was lost or doubled", got, n, per)
	}
	for deadline := time.Now().Add(10 * time.Second); sleeping() != "0"; time.Sleep(200 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the terminal's shell outlived the apiserver it was opened through by 10 s")
		}
	}
	if err := victim.start(c.bin); err != nil {
		t.Fatal(err)
	}
	if err := waitHTTP("http://"+victim.addr+"/healthz", 30*time.Second, victim); err != nil {
		t.Fatal(err)
	}
	if err := c.waitNodes(30*time.Second, "e1", "e2", "e3"); err != nil {
		t.Fatal(err)
	}
}

// TestDrillEtcdMemberKilled: one etcd member down changes nothing, even
// when it is the leader (writes in flight are made again on the new one).
func TestDrillEtcdMemberKilled(t *testing.T) {
	need(t)
	leader, err := c.etcd.Leader(10 * time.Second)
	if err != nil {
		t.Fatal(err)
	}
	c.etcd.Kill(leader)
	t.Cleanup(func() {
		if err := c.etcd.Restart(leader); err != nil {
			t.Errorf("restarting etcd m%d: %v", leader, err)
		}
		if err := c.etcd.WaitHealthy(30 * time.Second); err != nil {
			t.Error(err)
		}
	})
	for i := range 2 {
		sb, err := c.perServer[i].CreateSandbox(ctx(t), api.SandboxSpec{Base: baseRef})
		if err != nil {
			t.Fatalf("create through s%d with one etcd member down: %v", i, err)
		}
		t.Cleanup(func() { _ = c.client.DeleteSandbox(context.Background(), sb.ID) })
		mustExec(t, c.client, sb.ID, "true")
	}
}

// TestDrillEtcdQuorumLost: with two of three etcd members down, creates
// fail clearly; running sandboxes keep running and exec and files keep
// working (the edges are cut off from etcd too, and keep serving); when
// quorum returns, so does everything.
func TestDrillEtcdQuorumLost(t *testing.T) {
	need(t)
	sb := newSandbox(t, api.SandboxSpec{})
	mustExec(t, c.client, sb.ID, "echo kept > /root/kept")
	c.etcd.Kill(1)
	c.etcd.Kill(2)
	restored := false
	restore := func() {
		if restored {
			return
		}
		restored = true
		for _, m := range []int{1, 2} {
			if err := c.etcd.Restart(m); err != nil {
				t.Errorf("restarting etcd m%d: %v", m, err)
			}
		}
		if err := c.etcd.WaitHealthy(60 * time.Second); err != nil {
			t.Error(err)
		}
	}
	t.Cleanup(restore)

	start := time.Now()
	_, err := c.perServer[0].CreateSandbox(ctx(t), api.SandboxSpec{Base: baseRef})
	wantCode(t, err, "unavailable")
	if el := time.Since(start); el > 15*time.Second {
		t.Fatalf("a create without quorum took %v to fail", el)
	}
	t.Logf("create without quorum: %v after %v", err, time.Since(start).Round(time.Millisecond))
	// Wait past the registry leases (5 s): the edges have lost theirs.
	time.Sleep(7 * time.Second)
	for i, pc := range c.perServer {
		if out := mustExec(t, pc, sb.ID, "cat /root/kept"); out != "kept\n" {
			t.Fatalf("exec through s%d without quorum: %q", i, out)
		}
		if err := pc.WriteFile(ctx(t), sb.ID, fmt.Sprintf("/root/w%d", i), strings.NewReader("x"), 0); err != nil {
			t.Fatalf("files through s%d without quorum: %v", i, err)
		}
		if _, err := pc.GetSandbox(ctx(t), sb.ID); err != nil {
			t.Fatalf("get through s%d without quorum: %v", i, err)
		}
	}
	restore()
	// Edges take their registry entries again; creates work again. The
	// old leases, which the new leader extended, lapse after quorum
	// returns; each edge moves its entry to a new lease in one step, so
	// no apiserver's view drops a node meanwhile (it used to remove the
	// entry and hold it anew, and a listing in that gap lost the node).
	if err := c.waitNodes(60*time.Second, "e1", "e2", "e3"); err != nil {
		t.Fatal(err)
	}
	for end := time.Now().Add(cluster.LeaseTTL + 4*time.Second); time.Now().Before(end); time.Sleep(100 * time.Millisecond) {
		if err := c.waitNodes(0, "e1", "e2", "e3"); err != nil {
			t.Fatalf("while the old registry leases lapsed: %v", err)
		}
	}
	for i, pc := range c.perServer {
		deadline := time.Now().Add(30 * time.Second)
		for {
			sb2, err := pc.CreateSandbox(ctx(t), api.SandboxSpec{Base: baseRef})
			if err == nil {
				_ = c.client.DeleteSandbox(ctx(t), sb2.ID)
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("creates through s%d after quorum returned: %v", i, err)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
}

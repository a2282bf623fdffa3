package cluster

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// TestTenantsAcrossServers: two projects' keys through different
// apiservers cannot see each other's sandboxes on any node; a builder key
// can snapshot and a runtime key cannot; a key revoked through one
// apiserver stops working on the other within 2 s.
func TestTenantsAcrossServers(t *testing.T) {
	need(t)
	n := time.Now().UnixNano() % 1e9
	pa, pb := fmt.Sprintf("cl-a-%d", n), fmt.Sprintf("cl-b-%d", n)
	for _, p := range []string{pa, pb} {
		if _, err := c.perServer[0].CreateProject(ctx(t), api.CreateProjectRequest{Parent: "root", Name: p}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.client.DeleteProject(context.Background(), p, true) })
	}
	// keyed returns a client of a new key of role in project through
	// apiserver i only, and the key's id.
	keyed := func(i int, project, role string) (*dsec.Client, string) {
		t.Helper()
		k, err := c.perServer[0].CreateKey(ctx(t), project, api.CreateKeyRequest{Role: role})
		if err != nil {
			t.Fatal(err)
		}
		cl, err := dsec.New(dsec.WithEndpoint("http://"+c.servers[i].addr), dsec.WithAPIKey(k.Key), dsec.WithRetries(1))
		if err != nil {
			t.Fatal(err)
		}
		return cl, k.ID
	}
	a0, _ := keyed(0, pa, "member")
	b1, _ := keyed(1, pb, "member")
	builder1, _ := keyed(1, pa, "builder")

	// One sandbox of a on every node (spread by the job label).
	var mine []string
	for range 3 {
		sb, err := a0.CreateSandbox(ctx(t), api.SandboxSpec{Base: baseRef, Labels: map[string]string{"job": "tenant-" + pa}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.client.DeleteSandbox(context.Background(), sb.ID) })
		mine = append(mine, sb.ID)
	}
	for _, id := range mine {
		_, err := b1.GetSandbox(ctx(t), id)
		wantCode(t, err, "not_found")
		_, err = b1.Exec(ctx(t), id, api.ExecRequest{Cmd: "true"})
		wantCode(t, err, "not_found")
	}
	if l, err := b1.ListSandboxes(ctx(t), dsec.ListOptions{}); err != nil || len(l.Sandboxes) != 0 {
		t.Fatalf("tenant b lists %d of others' sandboxes (%v)", len(l.Sandboxes), err)
	}
	if l, err := a0.ListSandboxes(ctx(t), dsec.ListOptions{}); err != nil || len(l.Sandboxes) != 3 {
		t.Fatalf("tenant a lists %v (%v), want its 3", l, err)
	}
	if k, err := b1.DeleteSandboxes(ctx(t), map[string]string{"job": "tenant-" + pa}); err != nil || k != 0 {
		t.Fatalf("tenant b deleted %d by labels (%v)", k, err)
	}

	_, err := a0.Snapshot(ctx(t), mine[0], api.SnapshotRequest{Ref: fmt.Sprintf("snapshot/cl%d:1", n)})
	wantCode(t, err, "permission_denied")
	l, err := builder1.Snapshot(ctx(t), mine[0], api.SnapshotRequest{Ref: fmt.Sprintf("snapshot/cl%d:1", n)})
	if err != nil {
		t.Fatalf("a builder's snapshot through the other apiserver: %v", err)
	}
	t.Cleanup(func() { _ = c.client.DeleteLayer(context.Background(), l.Ref) })

	// Revocation through s0 reaches s1, which has the key cached.
	victim, id := keyed(1, pa, "member")
	if _, err := victim.ListSandboxes(ctx(t), dsec.ListOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := c.perServer[0].RevokeKey(ctx(t), pa, id); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	for {
		_, err := victim.ListSandboxes(ctx(t), dsec.ListOptions{})
		if err != nil {
			wantCode(t, err, "unauthenticated")
			break
		}
		if time.Since(start) > 2*time.Second {
			t.Fatalf("a key revoked through s0 still works on s1 after %v", time.Since(start))
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("revocation seen by the other apiserver after %v", time.Since(start).Round(time.Millisecond))
}

// TestQuotaBurstThroughTwoServers: a job key whose project allows 100
// sandboxes sends a burst of 1,000 creates, half through each apiserver,
// 64 at a time: exactly 100 are made, the rest refused with
// quota_exceeded.
func TestQuotaBurstThroughTwoServers(t *testing.T) {
	need(t)
	n := time.Now().UnixNano() % 1e9
	p := fmt.Sprintf("cl-quota-%d", n)
	if _, err := c.perServer[0].CreateProject(ctx(t), api.CreateProjectRequest{Parent: "root", Name: p, Quota: api.ProjectQuota{Sandboxes: 100}}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.client.DeleteProject(context.Background(), p, true) })
	k, err := c.perServer[0].CreateKey(ctx(t), p, api.CreateKeyRequest{Role: "member"})
	if err != nil {
		t.Fatal(err)
	}
	var per []*dsec.Client
	for _, s := range c.servers {
		cl, err := dsec.New(dsec.WithEndpoint("http://"+s.addr), dsec.WithAPIKey(k.Key), dsec.WithRetries(1))
		if err != nil {
			t.Fatal(err)
		}
		per = append(per, cl)
	}
	var made, refused, other atomic.Int32
	var firstOther atomic.Value
	sem := make(chan struct{}, 64)
	var wg sync.WaitGroup
	start := time.Now()
	for i := range 1000 {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			_, err := per[i%2].CreateSandbox(ctx(t), api.SandboxSpec{Base: baseRef, Labels: map[string]string{"job": p}})
			var e *dsec.Error
			switch {
			case err == nil:
				made.Add(1)
			case errors.As(err, &e) && e.Code == "quota_exceeded":
				refused.Add(1)
			default:
				other.Add(1)
				firstOther.CompareAndSwap(nil, err.Error())
			}
		}()
	}
	wg.Wait()
	t.Logf("a burst of 1000 against a quota of 100 through two apiservers: %d made, %d refused (quota_exceeded), %d other errors, in %v",
		made.Load(), refused.Load(), other.Load(), time.Since(start).Round(time.Millisecond))
	if made.Load() != 100 || refused.Load() != 900 {
		t.Fatalf("%d made, %d refused, %d other (first: %v); want 100 and 900", made.Load(), refused.Load(), other.Load(), firstOther.Load())
	}
	l, err := c.client.ListAllSandboxes(ctx(t), dsec.ListOptions{Labels: map[string]string{"job": p}})
	if err != nil || len(l) != 100 {
		t.Fatalf("the nodes hold %d of the project's sandboxes (%v), want 100", len(l), err)
	}
}

// TestDedicatedNodes: a project that asks for dedicated nodes never shares
// a node with another project's sandboxes, whichever apiserver places
// them, while both create at once.
func TestDedicatedNodes(t *testing.T) {
	need(t)
	n := time.Now().UnixNano() % 1e9
	ded, shared := fmt.Sprintf("cl-ded-%d", n), fmt.Sprintf("cl-shared-%d", n)
	if _, err := c.perServer[0].CreateProject(ctx(t), api.CreateProjectRequest{Parent: "root", Name: ded, DedicatedNodes: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.perServer[0].CreateProject(ctx(t), api.CreateProjectRequest{Parent: "root", Name: shared}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, p := range []string{ded, shared} {
			if err := c.client.DeleteProject(context.Background(), p, true); err != nil {
				t.Errorf("deleting project %s: %v", p, err)
			}
		}
		// The next tests may pin creates to any node: wait until both
		// apiservers' views have the dedicated node free again (a poll
		// after the delete), or they would be refused until then.
		began := time.Now()
		for deadline := began.Add(15 * time.Second); ; time.Sleep(200 * time.Millisecond) {
			held := ""
			for _, cl := range c.perServer {
				l, err := cl.ListNodes(context.Background())
				if err != nil {
					held = err.Error()
				}
				for _, nd := range l {
					if nd.DedicatedTo != "" || nd.LastSeen == nil || !nd.LastSeen.After(began.Add(time.Second)) {
						held = fmt.Sprintf("%s: dedicated to %q, polled %v", nd.Name, nd.DedicatedTo, nd.LastSeen)
					}
				}
			}
			if held == "" {
				break
			}
			if time.Now().After(deadline) {
				t.Errorf("a node is not free 15 s after the dedicated project went: %s", held)
				break
			}
		}
	})
	// A dedicated project needs an empty node to start on: wait until the
	// views show one (earlier tests' sandboxes are gone within a poll).
	// A view polled before the last test's sandboxes were made would look
	// idle too: only polls that ended a second after the wait began count.
	began := time.Now()
	deadline := began.Add(15 * time.Second)
	for {
		l, err := c.perServer[0].ListNodes(ctx(t))
		idle := 0
		for _, nd := range l {
			if nd.DedicatedTo == "" && nd.Counts["running"]+nd.Counts["creating"]+nd.Counts["paused"] == 0 &&
				nd.LastSeen != nil && nd.LastSeen.After(began.Add(time.Second)) {
				idle++
			}
		}
		if err == nil && idle == len(l) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the nodes are not idle after 15 s: %v (%v)", l, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	var mu sync.Mutex
	nodes := map[string]map[string]bool{} // project → nodes
	// The dedicated project takes a node first (a dedicated project
	// needs an empty node to start on); then both create at once.
	first, err := c.perServer[0].CreateSandbox(ctx(t), api.SandboxSpec{Base: baseRef, Project: ded})
	if err != nil {
		l, _ := c.perServer[0].ListNodes(ctx(t))
		t.Fatalf("the first sandbox of a dedicated project on an idle cluster: %v (nodes %+v)", err, l)
	}
	nodes[ded] = map[string]bool{first.Node: true}
	// Both apiservers' views must show that node as the dedicated
	// project's before the two create at once: on a view a poll old the
	// project holds no node yet, and its creates may take every empty one
	// (placement fills a project's own nodes first only as far as it
	// knows them), leaving none for the other tenant.
	for deadline := time.Now().Add(15 * time.Second); ; {
		seen := 0
		for _, cl := range c.perServer[:2] {
			l, err := cl.ListNodes(ctx(t))
			for _, nd := range l {
				if err == nil && nd.Name == first.Node && nd.DedicatedTo != "" {
					seen++
				}
			}
		}
		if seen == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("node %s is not shown dedicated by both apiservers after 15 s", first.Node)
		}
		time.Sleep(200 * time.Millisecond)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 12)
	for i := range 12 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p, labels := shared, map[string]string{"job": shared}
			if i%3 == 0 {
				p, labels = ded, nil
			}
			// Two apiservers placing at once on views a poll old may both
			// pick a node the other just gave to another tenancy; its edge
			// refuses (resource_exhausted), and the client retries.
			var sb *api.Sandbox
			var err error
			for try := 0; try < 5; try++ {
				sb, err = c.perServer[i%2].CreateSandbox(ctx(t), api.SandboxSpec{Base: baseRef, Project: p, Labels: labels})
				var e *dsec.Error
				if err == nil || !errors.As(err, &e) || e.Code != "resource_exhausted" {
					break
				}
				time.Sleep(500 * time.Millisecond)
			}
			if err != nil {
				errs <- fmt.Errorf("create in %s: %w", p, err)
				return
			}
			mu.Lock()
			if nodes[p] == nil {
				nodes[p] = map[string]bool{}
			}
			nodes[p][sb.Node] = true
			mu.Unlock()
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	for node := range nodes[ded] {
		if nodes[shared][node] {
			t.Errorf("node %s holds sandboxes of the dedicated project and of another (%v)", node, nodes)
		}
	}
	if len(nodes[ded]) == 0 || len(nodes[shared]) == 0 {
		t.Fatalf("placements: %v", nodes)
	}
	t.Logf("dedicated project on %v, the other on %v", nodes[ded], nodes[shared])
}

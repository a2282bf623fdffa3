package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// testLabel returns a label value unique to this test run, so that list
// and delete-by-label assertions see only the test's own sandboxes.
func testLabel(t *testing.T) string {
	t.Helper()
	name := strings.ToLower(strings.NewReplacer("/", "-", "_", "-").Replace(t.Name()))
	if len(name) > 40 {
		name = name[:40]
	}
	return fmt.Sprintf("%s-%d", name, time.Now().UnixNano()%1_000_000_000)
}

// rawAPI does one authenticated HTTP call and returns the status and body,
// for assertions on exact status codes the SDK hides.
func rawAPI(t *testing.T, method, path string, body io.Reader) (int, []byte) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx(t), method, "http://"+d.listen+path, body)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer "+d.key)
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// waitSandboxState polls GET (which does not count as activity) until the
// sandbox reaches state or the timeout passes.
func waitSandboxState(t *testing.T, id, state string, timeout time.Duration) *api.Sandbox {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var last *api.Sandbox
	for {
		sb, err := client.GetSandbox(ctx(t), id)
		if err != nil {
			t.Fatalf("get %s: %v", id, err)
		}
		last = sb
		if sb.State == state {
			return sb
		}
		if time.Now().After(deadline) {
			t.Fatalf("sandbox %s: state %q (error %q) after %s, want %q", id, last.State, last.Error, timeout, state)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// createLabelled creates n sandboxes one by one with the given labels.
func createLabelled(t *testing.T, n int, labels map[string]string) []*api.Sandbox {
	t.Helper()
	var out []*api.Sandbox
	for range n {
		out = append(out, newSandbox(t, api.SandboxSpec{Labels: labels}))
	}
	return out
}

// deleteUntilGone deletes a sandbox and insists until GET says not_found:
// a delete racing the TTL/idle reaper answers 204 yet leaves the record
// (see TestSandboxDeleteDuringTTLStop), which would leak into later tests.
func deleteUntilGone(id string) {
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		_ = client.DeleteSandbox(context.Background(), id)
		_, err := client.GetSandbox(context.Background(), id)
		if errors.Is(err, dsec.ErrNotFound) {
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// deadHint explains an exec that found the sandbox's container gone while
// the API still says running: on a host where several dsec instances run,
// another instance's startup may reap cgroups it does not own (see
// TestRecoveryLeavesOtherInstancesAlone).
func deadHint(r *api.ExecResult) string {
	if r == nil || !strings.Contains(r.Stderr, "is not running") {
		return ""
	}
	return fmt.Sprintf(" [container died under the edge; other dsec daemons on this host: %v]", foreignDaemons())
}

func ids(sbs []api.Sandbox) []string {
	var out []string
	for _, sb := range sbs {
		out = append(out, sb.ID)
	}
	slices.Sort(out)
	return out
}

func TestSandboxGet(t *testing.T) {
	needDaemon(t)
	lbl := testLabel(t)
	sb := newSandbox(t, api.SandboxSpec{Labels: map[string]string{"suite": lbl}, TTL: 600})
	got, err := client.GetSandbox(ctx(t), sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	if got.ID != sb.ID || got.State != api.StateRunning || got.Spec.Base != baseRef ||
		got.Labels["suite"] != lbl || got.Backend != "container" || got.Node == "" {
		t.Fatalf("get = %+v", got)
	}
	if got.ExpiresAt == nil || got.ExpiresAt.Sub(got.CreatedAt) != 600*time.Second {
		t.Fatalf("expires_at %v, created_at %v: want created_at+600s", got.ExpiresAt, got.CreatedAt)
	}
	if !strings.HasPrefix(got.ID, "sb-"+got.Node+"-") {
		t.Fatalf("id %s does not name node %s", got.ID, got.Node)
	}
	_, err = client.GetSandbox(ctx(t), "sb-local-doesnotexist0000")
	wantCode(t, err, "not_found")
}

func TestSandboxListLabelsStatePagination(t *testing.T) {
	needDaemon(t)
	lbl := testLabel(t)
	a := createLabelled(t, 2, map[string]string{"suite": lbl, "role": "a", "tier": "x"})
	b := createLabelled(t, 2, map[string]string{"suite": lbl, "role": "b", "tier": "x"})
	c := createLabelled(t, 1, map[string]string{"suite": lbl, "role": "a", "tier": "y"})
	var all []string
	for _, s := range append(append(a, b...), c...) {
		all = append(all, s.ID)
	}
	slices.Sort(all)

	// Several labels are ANDed.
	for _, tc := range []struct {
		sel  map[string]string
		want []*api.Sandbox
	}{
		{map[string]string{"suite": lbl}, append(append(slices.Clone(a), b...), c...)},
		{map[string]string{"suite": lbl, "role": "a"}, append(slices.Clone(a), c...)},
		{map[string]string{"suite": lbl, "role": "a", "tier": "x"}, a},
		{map[string]string{"suite": lbl, "role": "b", "tier": "y"}, nil},
		{map[string]string{"suite": lbl, "nosuchkey": "a"}, nil},
	} {
		var want []string
		for _, s := range tc.want {
			want = append(want, s.ID)
		}
		slices.Sort(want)
		got, err := client.ListSandboxes(ctx(t), dsec.ListOptions{Labels: tc.sel})
		if err != nil {
			t.Fatal(err)
		}
		if g := ids(got.Sandboxes); !slices.Equal(g, want) {
			t.Errorf("list %v = %v, want %v", tc.sel, g, want)
		}
		if got.NextPageToken != "" {
			t.Errorf("list %v: next_page_token %q on a single page", tc.sel, got.NextPageToken)
		}
	}
	// The raw query form, label=k=v repeated.
	code, body := rawAPI(t, "GET", "/v1/sandboxes?label=suite="+lbl+"&label=role=b", nil)
	var raw api.SandboxList
	if code != 200 || json.Unmarshal(body, &raw) != nil || len(raw.Sandboxes) != 2 {
		t.Errorf("GET ?label=suite=..&label=role=b: %d %s", code, body)
	}
	if code, body := rawAPI(t, "GET", "/v1/sandboxes?label=novalue", nil); code != 400 {
		t.Errorf("label without =: %d %s, want 400", code, body)
	}

	// State filter.
	got, err := client.ListSandboxes(ctx(t), dsec.ListOptions{Labels: map[string]string{"suite": lbl}, State: api.StateRunning})
	if err != nil {
		t.Fatal(err)
	}
	if g := ids(got.Sandboxes); !slices.Equal(g, all) {
		t.Errorf("state=running = %v, want %v", g, all)
	}
	for _, st := range []string{api.StateStopped, api.StateFailed, api.StateCreating} {
		got, err := client.ListSandboxes(ctx(t), dsec.ListOptions{Labels: map[string]string{"suite": lbl}, State: st})
		if err != nil {
			t.Fatal(err)
		}
		if len(got.Sandboxes) != 0 {
			t.Errorf("state=%s = %v, want none", st, ids(got.Sandboxes))
		}
	}
	if code, body := rawAPI(t, "GET", "/v1/sandboxes?state=bogus", nil); code != 400 {
		t.Errorf("state=bogus: %d %s, want 400", code, body)
	}

	// Pagination: limit=2 over 5 → pages of 2, 2, 1; disjoint, complete,
	// no token after the last.
	var pages [][]string
	seen := map[string]bool{}
	tok := ""
	for i := 0; ; i++ {
		if i > 5 {
			t.Fatalf("pagination does not end: pages %v", pages)
		}
		p, err := client.ListSandboxes(ctx(t), dsec.ListOptions{Labels: map[string]string{"suite": lbl}, Limit: 2, PageToken: tok})
		if err != nil {
			t.Fatal(err)
		}
		var pg []string
		for _, sb := range p.Sandboxes {
			if seen[sb.ID] {
				t.Errorf("sandbox %s on two pages", sb.ID)
			}
			seen[sb.ID] = true
			pg = append(pg, sb.ID)
		}
		pages = append(pages, pg)
		if len(pg) > 2 {
			t.Errorf("page %d has %d sandboxes with limit 2", i, len(pg))
		}
		if p.NextPageToken == "" {
			break
		}
		tok = p.NextPageToken
	}
	if len(pages) != 3 || len(pages[0]) != 2 || len(pages[1]) != 2 || len(pages[2]) != 1 {
		t.Errorf("pages = %v, want sizes 2,2,1", pages)
	}
	var union []string
	for id := range seen {
		union = append(union, id)
	}
	slices.Sort(union)
	if !slices.Equal(union, all) {
		t.Errorf("pages cover %v, want %v", union, all)
	}
	if code, body := rawAPI(t, "GET", "/v1/sandboxes?limit=0", nil); code != 400 {
		t.Errorf("limit=0: %d %s, want 400", code, body)
	}
	if code, body := rawAPI(t, "GET", "/v1/sandboxes?page_token=!!!", nil); code != 400 {
		t.Errorf("bad page_token: %d %s, want 400", code, body)
	}
}

func TestSandboxDeleteIdempotent(t *testing.T) {
	needDaemon(t)
	sb := newSandbox(t, api.SandboxSpec{})
	sh(t, sb.ID, "true")
	for i := range 2 {
		if code, body := rawAPI(t, "DELETE", "/v1/sandboxes/"+sb.ID, nil); code != http.StatusNoContent {
			t.Fatalf("delete #%d: %d %s, want 204", i+1, code, body)
		}
	}
	_, err := client.GetSandbox(ctx(t), sb.ID)
	wantCode(t, err, "not_found")
	if _, err := os.Stat(filepath.Join(d.stateDir, "edge", "sandboxes", sb.ID)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("sandbox dir still there after delete: %v", err)
	}
	// Well-formed ids that never existed, on this node and on an unknown one.
	for _, id := range []string{"sb-local-neverexisted23456", "sb-othernode-abcdefabcdefabcd"} {
		if code, body := rawAPI(t, "DELETE", "/v1/sandboxes/"+id, nil); code != http.StatusNoContent {
			t.Errorf("delete never-existing %s: %d %s, want 204", id, code, body)
		}
	}
}

func TestSandboxBatchCreate(t *testing.T) {
	needDaemon(t)
	lbl := testLabel(t)
	res, err := client.CreateSandboxes(ctx(t), 5, api.SandboxSpec{Base: baseRef, Labels: map[string]string{"suite": lbl}})
	if err != nil {
		t.Fatal(err)
	}
	for _, sb := range res.Sandboxes {
		t.Cleanup(func() { _ = client.DeleteSandbox(context.Background(), sb.ID) })
	}
	if len(res.Sandboxes) != 5 || len(res.Errors) != 0 {
		t.Fatalf("batch of 5: %d sandboxes, errors %+v", len(res.Sandboxes), res.Errors)
	}
	seen := map[string]bool{}
	for i, sb := range res.Sandboxes {
		if seen[sb.ID] {
			t.Fatalf("duplicate id %s", sb.ID)
		}
		seen[sb.ID] = true
		if sb.State != api.StateRunning || sb.Labels["suite"] != lbl {
			t.Errorf("sandbox %d: %+v", i, sb)
		}
		// Usable, and each has its own writable layer.
		r := sh(t, sb.ID, fmt.Sprintf("cat /mine 2>/dev/null; echo %d > /mine; cat /mine", i))
		if r.ExitCode != 0 || r.Stdout != fmt.Sprintf("%d\n", i) {
			t.Errorf("exec in batch sandbox %d: %+v", i, r)
		}
	}
	list, err := client.ListAllSandboxes(ctx(t), dsec.ListOptions{Labels: map[string]string{"suite": lbl}})
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 5 {
		t.Errorf("list by label: %d sandboxes, want 5", len(list))
	}
	// Out-of-range counts are refused without creating anything.
	for _, n := range []int{0, 1001} {
		_, err := client.CreateSandboxes(ctx(t), n, api.SandboxSpec{Base: baseRef, Labels: map[string]string{"suite": lbl}})
		wantCode(t, err, "invalid_argument")
	}
	if list, _ := client.ListAllSandboxes(ctx(t), dsec.ListOptions{Labels: map[string]string{"suite": lbl}}); len(list) != 5 {
		t.Errorf("after refused batches: %d sandboxes, want 5", len(list))
	}
}

func TestSandboxDeleteByLabels(t *testing.T) {
	needDaemon(t)
	lbl := testLabel(t)
	gone := createLabelled(t, 3, map[string]string{"suite": lbl, "grp": "gone"})
	kept := createLabelled(t, 2, map[string]string{"suite": lbl, "grp": "kept"})
	other := newSandbox(t, api.SandboxSpec{Labels: map[string]string{"grp": "gone"}}) // lacks suite
	n, err := client.DeleteSandboxes(ctx(t), map[string]string{"suite": lbl, "grp": "gone"})
	if err != nil {
		t.Fatal(err)
	}
	if n != 3 {
		t.Errorf("deleted %d, want 3", n)
	}
	for _, sb := range gone {
		_, err := client.GetSandbox(ctx(t), sb.ID)
		wantCode(t, err, "not_found")
	}
	for _, sb := range append(kept, other) {
		if r := sh(t, sb.ID, "echo ok"); r.Stdout != "ok\n" {
			t.Errorf("untouched sandbox %s: %+v", sb.ID, r)
		}
	}
	// Again: nothing left to match.
	if n, err := client.DeleteSandboxes(ctx(t), map[string]string{"suite": lbl, "grp": "gone"}); err != nil || n != 0 {
		t.Errorf("second delete by labels: %d, %v; want 0", n, err)
	}
	// An empty selector is refused by the server, not taken as "all".
	code, body := rawAPI(t, "POST", "/v1/sandboxes:delete", strings.NewReader(`{"labels":{}}`))
	if code != 400 {
		t.Errorf("delete with empty labels: %d %s, want 400", code, body)
	}
	if r := sh(t, kept[0].ID, "echo ok"); r.Stdout != "ok\n" {
		t.Errorf("after refused delete-all: %+v", r)
	}
}

// assertReleased checks that a stopped sandbox holds no node resources:
// no mount under its dir, no process in rel, the cgroup its record named
// while it ran (the edge keeps emptied cgroups for reuse, so it may still
// exist; the stopped record names none), no runtime state.
func assertReleased(t *testing.T, id, rel string) {
	t.Helper()
	if m := anyMounts(filepath.Join(d.stateDir, "edge", "sandboxes", id) + "/"); len(m) > 0 {
		t.Errorf("%s: mounts left (in some mount namespace): %v", id, m)
	}
	if b, err := os.ReadFile(filepath.Join(d.stateDir, "edge", "sandboxes", id, "sandbox.json")); err == nil && strings.Contains(string(b), `"cgroup_path":"/`) {
		t.Errorf("%s: the stopped record still names a cgroup", id)
	}
	for _, root := range cgroupHierarchies() {
		if procs := cgroupProcs(filepath.Join(root, rel)); len(procs) > 0 {
			t.Errorf("%s: processes %v left in its cgroup %s", id, procs, filepath.Join(root, rel))
		}
	}
	rt, _ := filepath.Glob(filepath.Join(d.stateDir, "runtime", "*", id))
	if len(rt) > 0 {
		t.Errorf("%s: runtime state left: %v", id, rt)
	}
}

func TestSandboxTTLStops(t *testing.T) {
	needDaemon(t)
	lbl := testLabel(t)
	// The TTL runs from the start of the create: it leaves time for the
	// create and the checks below on a busy host.
	sb := newSandbox(t, api.SandboxSpec{TTL: 4, Labels: map[string]string{"suite": lbl}})
	rel := sandboxCgroupRel(t, sb.ID)
	if r := sh(t, sb.ID, "echo up"); r.Stdout != "up\n" {
		t.Fatalf("exec: %+v", r)
	}
	// Ensure the resources exist before, so that "gone" below means something.
	if !slices.Contains(sandboxOverlays(), filepath.Join(d.stateDir, "edge", "sandboxes", sb.ID, "rootfs")) {
		t.Fatalf("rootfs of a running sandbox is not mounted")
	}
	got := waitSandboxState(t, sb.ID, api.StateStopped, time.Until(*sb.ExpiresAt)+15*time.Second)
	t.Logf("stopped %s after creation", time.Since(sb.CreatedAt).Round(10*time.Millisecond))
	if time.Since(sb.CreatedAt) < 4*time.Second {
		t.Errorf("stopped before its ttl: %s", time.Since(sb.CreatedAt))
	}
	if !strings.Contains(strings.ToLower(got.Error), "ttl") {
		t.Errorf("stopped sandbox error = %q, want it to mention ttl", got.Error)
	}
	_, err := client.Exec(ctx(t), sb.ID, api.ExecRequest{Cmd: "true"})
	wantCode(t, err, "failed_precondition")
	var e *dsec.Error
	if errors.As(err, &e) && e.Status != http.StatusConflict {
		t.Errorf("exec on stopped: HTTP %d, want 409", e.Status)
	}
	assertReleased(t, sb.ID, rel)
	// The state filter sees it as stopped.
	for st, want := range map[string]int{api.StateStopped: 1, api.StateRunning: 0} {
		l, err := client.ListSandboxes(ctx(t), dsec.ListOptions{State: st, Labels: map[string]string{"suite": lbl}})
		if err != nil {
			t.Fatal(err)
		}
		if len(l.Sandboxes) != want {
			t.Errorf("state=%s: %v, want %d", st, ids(l.Sandboxes), want)
		}
	}
	// Keepalive cannot revive it; delete removes the record.
	wantCode(t, client.Keepalive(ctx(t), sb.ID, time.Minute), "failed_precondition")
	if err := client.DeleteSandbox(ctx(t), sb.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(d.stateDir, "edge", "sandboxes", sb.ID)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("stopped sandbox dir left after delete: %v", err)
	}
}

func TestSandboxIdleTimeoutStops(t *testing.T) {
	needDaemon(t)
	sb := newSandbox(t, api.SandboxSpec{IdleTimeout: 2})
	rel := sandboxCgroupRel(t, sb.ID)
	// GET does not count as activity, so polling does not keep it alive.
	got := waitSandboxState(t, sb.ID, api.StateStopped, time.Until(sb.CreatedAt.Add(2*time.Second))+15*time.Second)
	if el := time.Since(sb.CreatedAt); el < 2*time.Second {
		t.Errorf("idle stop after %s, before the 2 s timeout", el)
	}
	if !strings.Contains(strings.ToLower(got.Error), "idle") {
		t.Errorf("error = %q, want it to mention idle", got.Error)
	}
	_, err := client.Exec(ctx(t), sb.ID, api.ExecRequest{Cmd: "true"})
	wantCode(t, err, "failed_precondition")
	assertReleased(t, sb.ID, rel)

	// Activity keeps an idle sandbox alive past its timeout: an exec
	// every 500 ms until twice the timeout has passed. The idle clock
	// starts with the create, so the first exec goes at once, and the
	// timeout leaves room for a slow create.
	busy := newSandbox(t, api.SandboxSpec{IdleTimeout: 4})
	for time.Now().Before(busy.CreatedAt.Add(8 * time.Second)) {
		if r := sh(t, busy.ID, "true"); r.ExitCode != 0 {
			t.Fatalf("exec: %+v", r)
		}
		time.Sleep(500 * time.Millisecond)
	}
	if got, _ := client.GetSandbox(ctx(t), busy.ID); got == nil || got.State != api.StateRunning {
		t.Fatalf("active sandbox stopped: %+v", got)
	}
}

func TestSandboxKeepaliveExtends(t *testing.T) {
	needDaemon(t)
	// The TTL runs from the start of the create; the keepalive comes 2 s
	// after that (so that "30 s from now" differs from "30 s from the
	// create"), well before the TTL ends even after a slow create.
	sb := newSandbox(t, api.SandboxSpec{TTL: 6})
	time.Sleep(time.Until(sb.CreatedAt.Add(2 * time.Second)))
	before := time.Now()
	if err := client.Keepalive(ctx(t), sb.ID, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	got, err := client.GetSandbox(ctx(t), sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	if got.ExpiresAt == nil || got.ExpiresAt.Before(before.Add(29*time.Second)) || got.ExpiresAt.After(time.Now().Add(31*time.Second)) {
		t.Fatalf("expires_at after keepalive 30s = %v, want ~%v", got.ExpiresAt, before.Add(30*time.Second))
	}
	time.Sleep(time.Until(sb.CreatedAt.Add(8 * time.Second)))
	got, err = client.GetSandbox(ctx(t), sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	if got.State != api.StateRunning {
		t.Fatalf("8 s after create (ttl 6, kept alive for 30): state %s (%s)", got.State, got.Error)
	}
	if r := sh(t, sb.ID, "echo alive"); r.Stdout != "alive\n" {
		t.Fatalf("exec: %+v%s", r, deadHint(r))
	}
	// Out-of-range keepalive is refused.
	code, body := rawAPI(t, "POST", "/v1/sandboxes/"+sb.ID+"/keepalive", strings.NewReader(`{"ttl":-1}`))
	if code != 400 {
		t.Errorf("keepalive ttl=-1: %d %s, want 400", code, body)
	}
}

func TestCLISandboxRoundTrip(t *testing.T) {
	needDaemon(t)
	lbl := testLabel(t)
	out, errOut, code := cli("sandbox", "create", "--base", baseRef, "--label", "suite="+lbl, "--label", "role=cli", "--ttl", "600", "--json")
	if code != 0 {
		t.Fatalf("create: exit %d: %s", code, errOut)
	}
	var sb api.Sandbox
	if err := json.Unmarshal([]byte(out), &sb); err != nil {
		t.Fatalf("create --json output %q: %v", out, err)
	}
	t.Cleanup(func() { _ = client.DeleteSandbox(context.Background(), sb.ID) })
	if sb.State != api.StateRunning || sb.Labels["suite"] != lbl || sb.Labels["role"] != "cli" || sb.Spec.TTL != 600 {
		t.Fatalf("created: %+v", sb)
	}

	out, errOut, code = cli("sandbox", "list", "--label", "suite="+lbl, "--label", "role=cli", "--json")
	var list []api.Sandbox
	if code != 0 || json.Unmarshal([]byte(out), &list) != nil || len(list) != 1 || list[0].ID != sb.ID {
		t.Fatalf("list --json: exit %d, %q %s", code, out, errOut)
	}
	out, _, code = cli("sandbox", "list", "--label", "suite="+lbl, "--label", "role=other", "--json")
	if code != 0 || strings.TrimSpace(out) != "[]" {
		t.Fatalf("list with a non-matching label: exit %d, %q", code, out)
	}
	out, _, code = cli("sandbox", "list", "--label", "suite="+lbl)
	if code != 0 || !strings.Contains(out, sb.ID) || !strings.Contains(out, "running") || !strings.Contains(out, "role=cli") {
		t.Fatalf("list table: exit %d, %q", code, out)
	}

	out, errOut, code = cli("sandbox", "get", "--json", sb.ID)
	var got api.Sandbox
	if code != 0 || json.Unmarshal([]byte(out), &got) != nil || got.ID != sb.ID || got.State != api.StateRunning || got.Labels["role"] != "cli" {
		t.Fatalf("get --json: exit %d, %q %s", code, out, errOut)
	}
	out, _, code = cli("sandbox", "get", sb.ID)
	if code != 0 || !strings.Contains(out, sb.ID) || !strings.Contains(out, "running") {
		t.Fatalf("get: exit %d, %q", code, out)
	}

	out, errOut, code = cli("sandbox", "delete", sb.ID)
	if code != 0 || strings.TrimSpace(out) != sb.ID {
		t.Fatalf("delete: exit %d, %q %s", code, out, errOut)
	}
	_, errOut, code = cli("sandbox", "get", sb.ID)
	if code == 0 || !strings.Contains(errOut, "not_found") && !strings.Contains(errOut, "not found") {
		t.Fatalf("get after delete: exit %d, %q", code, errOut)
	}
	// Delete is idempotent through the CLI too.
	if _, errOut, code := cli("sandbox", "delete", sb.ID); code != 0 {
		t.Fatalf("second delete: exit %d %s", code, errOut)
	}

	// Batch create and delete by label.
	out, errOut, code = cli("sandbox", "create", "--base", baseRef, "--label", "suite="+lbl, "--count", "2")
	created := strings.Fields(out)
	for _, id := range created {
		t.Cleanup(func() { _ = client.DeleteSandbox(context.Background(), id) })
	}
	if code != 0 || len(created) != 2 {
		t.Fatalf("create --count 2: exit %d, %q %s", code, out, errOut)
	}
	out, errOut, code = cli("sandbox", "delete", "--label", "suite="+lbl)
	if code != 0 || !strings.Contains(out, "deleted 2") {
		t.Fatalf("delete --label: exit %d, %q %s", code, out, errOut)
	}
	out, _, _ = cli("sandbox", "list", "--label", "suite="+lbl, "--json")
	if strings.TrimSpace(out) != "[]" {
		t.Fatalf("list after delete --label: %q", out)
	}
}

// An exec that runs longer than the idle timeout is activity: the sandbox
// must not be stopped under it.
func TestSandboxIdleTimeoutSparesRunningExec(t *testing.T) {
	needDaemon(t)
	// The idle clock starts with the create: the timeout leaves room for
	// a slow one before the exec starts, and the exec outlasts it by 2 s.
	sb := newSandbox(t, api.SandboxSpec{IdleTimeout: 4})
	t.Cleanup(func() { deleteUntilGone(sb.ID) })
	res, err := client.Exec(ctx(t), sb.ID, api.ExecRequest{Cmd: "sleep 6; echo done"})
	if err != nil {
		t.Fatalf("exec longer than the idle timeout: %v", err)
	}
	got, err := client.GetSandbox(ctx(t), sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	if res.ExitCode != 0 || res.Stdout != "done\n" || got.State != api.StateRunning {
		t.Fatalf("a 6 s exec in a sandbox with idle_timeout=4: result %+v, sandbox state %q (%q); want exit 0 \"done\" and running",
			res, got.State, got.Error)
	}
}

// A delete that answers 204 while the reaper is stopping the sandbox (TTL)
// must still delete it: afterwards GET says not_found.
func TestSandboxDeleteDuringTTLStop(t *testing.T) {
	needDaemon(t)
	lbl := testLabel(t)
	res, err := client.CreateSandboxes(ctx(t), 16, api.SandboxSpec{Base: baseRef, TTL: 2, Labels: map[string]string{"suite": lbl}})
	if err != nil {
		t.Fatal(err)
	}
	for _, sb := range res.Sandboxes {
		t.Cleanup(func() { deleteUntilGone(sb.ID) })
	}
	// The reaper's teardown removes the runtime state first and marks the
	// record stopped last; a delete in between is what this test is about.
	if runtimeName(t) == "" {
		t.Fatalf("no runtime state root in %s", filepath.Join(d.stateDir, "runtime"))
	}
	pending := map[string]bool{}
	for _, sb := range res.Sandboxes {
		pending[sb.ID] = true
	}
	type outcome struct {
		id    string
		state string
		err   error
	}
	results := make(chan outcome, len(pending))
	deadline := time.Now().Add(8 * time.Second)
	for len(pending) > 0 && time.Now().Before(deadline) {
		for id := range pending {
			if _, err := os.Stat(filepath.Join(d.stateDir, "runtime", runtimeName(t), id)); err == nil {
				continue
			}
			delete(pending, id)
			go func() {
				err := client.DeleteSandbox(context.Background(), id)
				if err != nil {
					results <- outcome{id: id, err: err}
					return
				}
				sb, err := client.GetSandbox(context.Background(), id)
				if err != nil {
					results <- outcome{id: id, err: err}
					return
				}
				// Let the reaper finish, then look again: a delete that
				// lost the race leaves a stopped record for StoppedRetention.
				time.Sleep(1500 * time.Millisecond)
				if later, err := client.GetSandbox(context.Background(), id); err == nil {
					results <- outcome{id: id, state: sb.State + ", 1.5 s later " + later.State + " (" + later.Error + ")"}
					return
				}
				results <- outcome{id: id, state: sb.State + ", 1.5 s later gone"}
			}()
		}
		time.Sleep(time.Millisecond)
	}
	n := len(res.Sandboxes) - len(pending)
	bad := 0
	for range n {
		o := <-results
		var e *dsec.Error
		switch {
		case errors.As(o.err, &e) && e.Code == "not_found":
		case o.err != nil:
			t.Errorf("%s: %v", o.id, o.err)
		default:
			bad++
			t.Errorf("%s: DELETE answered 204 but GET still shows it, state %q", o.id, o.state)
		}
	}
	t.Logf("%d sandboxes deleted while the reaper stopped them; %d still there after a 204", n, bad)
}

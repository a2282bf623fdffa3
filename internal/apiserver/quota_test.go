package apiserver

import (
	"encoding/json"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// burst sends n creates of body with key, spread over the servers, 16 at a
// time, and returns how many were made and how many refused for quota.
func (f *fixture) burst(t *testing.T, servers []*httptest.Server, key, body string, n int) (made, refused int) {
	t.Helper()
	var mk, rf atomic.Int32
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	for i := range n {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			resp, b := f.doAt(t, servers[i%len(servers)], key, "", "POST", "/v1/sandboxes", body)
			switch resp.StatusCode {
			case 201:
				mk.Add(1)
			case 429:
				var e struct {
					Error struct{ Code, Message string }
				}
				if json.Unmarshal(b, &e) != nil || e.Error.Code != "quota_exceeded" || !strings.Contains(e.Error.Message, "quota") {
					t.Errorf("refusal: %s", b)
				}
				rf.Add(1)
			default:
				t.Errorf("create: %d %s", resp.StatusCode, b)
			}
		}()
	}
	wg.Wait()
	return int(mk.Load()), int(rf.Load())
}

// TestQuotaAcrossApiservers: a burst against a quota of 5 through two
// apiservers admits exactly 5, though neither apiserver's view of the
// nodes shows any of them yet; deletes make room again once the nodes
// have been polled; a failed create gives its share back.
func TestQuotaAcrossApiservers(t *testing.T) {
	f := newFixture(t, true)
	b := f.apiserver(t, "b")
	f.mkProject(t, f.admin, "root", "job", `{"sandboxes":5}`)
	key, _ := f.mkKey(t, f.admin, "job", "member")
	servers := []*httptest.Server{f.srv, b}
	made, refused := f.burst(t, servers, key, `{"base":"base/py:1"}`, 60)
	if made != 5 || refused != 55 || f.edge.Len() != 5 {
		t.Fatalf("a burst of 60 against a quota of 5: %d made, %d refused, %d on the node", made, refused, f.edge.Len())
	}
	// Done, but not yet in any view of the node: the reservations still
	// count.
	time.Sleep(100 * time.Millisecond) // the completions are written
	resp, body := f.do(t, key, "POST", "/v1/sandboxes", `{"base":"base/py:1"}`)
	wantError(t, resp, body, 429, "quota_exceeded")
	// After the nodes were polled, the view holds what reservations did.
	f.view.Sync(t.Context())
	if made, _ := f.burst(t, servers, key, `{"base":"base/py:1"}`, 10); made != 0 {
		t.Fatalf("%d more made over a full quota", made)
	}
	// Two deleted: two may be made, once a poll shows the room.
	resp, body = f.do(t, key, "GET", "/v1/sandboxes", "")
	var l struct{ Sandboxes []struct{ ID string } }
	if resp.StatusCode != 200 || json.Unmarshal(body, &l) != nil || len(l.Sandboxes) != 5 {
		t.Fatalf("list: %d %s", resp.StatusCode, body)
	}
	for _, sb := range l.Sandboxes[:2] {
		f.do(t, key, "DELETE", "/v1/sandboxes/"+sb.ID, "")
	}
	f.view.Sync(t.Context())
	if made, _ := f.burst(t, servers, key, `{"base":"base/py:1"}`, 10); made != 2 {
		t.Fatalf("%d made after 2 deletes, want 2", made)
	}
	// A create the node refuses gives its reservation back. The burst's
	// completions may still linger in the other apiserver's queue (up to
	// quotaLinger), counting as in flight there: until they are written,
	// a create at the quota is refused (the count errs on the safe side).
	time.Sleep(5 * quotaLinger)
	f.view.Sync(t.Context())
	for _, sb := range l.Sandboxes[2:3] {
		f.do(t, key, "DELETE", "/v1/sandboxes/"+sb.ID, "")
	}
	f.view.Sync(t.Context())
	f.edge.SetRefuse(true)
	resp, body = f.do(t, key, "POST", "/v1/sandboxes", `{"base":"base/py:1"}`)
	wantError(t, resp, body, 503, "resource_exhausted")
	f.edge.SetRefuse(false)
	resp, body = f.do(t, key, "POST", "/v1/sandboxes", `{"base":"base/py:1"}`)
	if resp.StatusCode != 201 {
		t.Fatalf("after a refused create, its share was not given back: %d %s", resp.StatusCode, body)
	}
}

// TestQuotaUpTheLineage: a sandbox counts against every ancestor: a
// parent's limit binds a child with a larger one, and a sibling's
// sandboxes use the parent's room; a limited resource must be asked for.
func TestQuotaUpTheLineage(t *testing.T) {
	f := newFixture(t, false)
	f.mkProject(t, f.admin, "root", "team", `{"sandboxes":3,"cpu":4}`)
	f.mkProject(t, f.admin, "team", "job-a", `{"sandboxes":3}`)
	f.mkProject(t, f.admin, "team", "job-b", "")
	ka, _ := f.mkKey(t, f.admin, "job-a", "member")
	kb, _ := f.mkKey(t, f.admin, "job-b", "member")
	resp, body := f.do(t, ka, "POST", "/v1/sandboxes", `{"base":"base/py:1"}`)
	e := wantError(t, resp, body, 400, "invalid_argument")
	if !strings.Contains(e.Message, "cpu") {
		t.Fatalf("refusal of a sandbox without cpu under a cpu quota: %s", e.Message)
	}
	one := `{"base":"base/py:1","cpu":1}`
	if made, _ := f.burst(t, []*httptest.Server{f.srv}, kb, one, 2); made != 2 {
		t.Fatalf("job-b made %d of 2", made)
	}
	if made, _ := f.burst(t, []*httptest.Server{f.srv}, ka, one, 3); made != 1 {
		t.Fatalf("job-a made %d, want 1 (team's 3, job-b has 2)", made)
	}
	// cpu: 3 sandboxes of 1 CPU hold 3 of team's 4.
	f.view.Sync(t.Context())
	resp, body = f.do(t, f.admin, "GET", "/v1/projects/team", "")
	if resp.StatusCode != 200 || !strings.Contains(string(body), `"usage":{"sandboxes":3,"cpu":3`) {
		t.Fatalf("team usage: %s", body)
	}
	resp, body = f.do(t, f.admin, "PATCH", "/v1/projects/team", `{"quota":{"sandboxes":10,"cpu":4}}`)
	if resp.StatusCode != 200 {
		t.Fatalf("raising team's quota: %d %s", resp.StatusCode, body)
	}
	resp, body = f.do(t, kb, "POST", "/v1/sandboxes", `{"base":"base/py:1","cpu":2}`)
	e = wantError(t, resp, body, 429, "quota_exceeded")
	if !strings.Contains(e.Message, "cpu quota 4") {
		t.Fatalf("cpu refusal: %s", e.Message)
	}
}

// TestQuotaDoneCountsUntilSeen: a done create keeps counting while the
// view of its node does not show it, however long the node's polls are
// held up (a slow store, a busy node): past reservationDoneTTL it used to
// count nowhere, and a create got past the quota.
func TestQuotaDoneCountsUntilSeen(t *testing.T) {
	old := reservationDoneTTL
	reservationDoneTTL = 100 * time.Millisecond
	t.Cleanup(func() { reservationDoneTTL = old })
	f := newFixture(t, false)
	f.mkProject(t, f.admin, "root", "slow", `{"sandboxes":3}`)
	key, _ := f.mkKey(t, f.admin, "slow", "member")
	made, _ := f.burst(t, []*httptest.Server{f.srv}, key, `{"base":"base/py:1"}`, 3)
	if made != 3 {
		t.Fatalf("%d made of a quota of 3", made)
	}
	// No poll of the node; the done entries outlive their TTL, and a
	// write prunes the ledger.
	time.Sleep(5 * reservationDoneTTL)
	for range 3 {
		resp, body := f.do(t, key, "POST", "/v1/sandboxes", `{"base":"base/py:1"}`)
		wantError(t, resp, body, 429, "quota_exceeded")
		time.Sleep(reservationDoneTTL)
	}
	if n := f.edge.Len(); n != 3 {
		t.Fatalf("%d sandboxes on the node, quota 3", n)
	}
	// Once the view shows them, they count there (and the ledger may
	// drop them): still full.
	f.view.Sync(t.Context())
	resp, body := f.do(t, key, "POST", "/v1/sandboxes", `{"base":"base/py:1"}`)
	wantError(t, resp, body, 429, "quota_exceeded")
}

package apiserver

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/iam"
	"github.com/dsecproject/dsec/internal/store"
)

func decodeSandbox(t *testing.T, body []byte) api.Sandbox {
	t.Helper()
	var sb api.Sandbox
	if err := json.Unmarshal(body, &sb); err != nil || sb.ID == "" {
		t.Fatalf("not a sandbox: %s", body)
	}
	return sb
}

// TestIdempotentCreate: a repeat with the same key returns the first
// answer, from any apiserver, and makes nothing; another body is a 409.
func TestIdempotentCreate(t *testing.T) {
	bothWays(t, func(t *testing.T, f *fixture) {
		b := f.apiserver(t, "b")
		spec := `{"base":"base/py:1","labels":{"job":"j"}}`
		resp, body := f.doAt(t, f.srv, f.admin, "k1", "POST", "/v1/sandboxes", spec)
		if resp.StatusCode != 201 {
			t.Fatalf("create: %d %s", resp.StatusCode, body)
		}
		first := decodeSandbox(t, body)
		if first.Labels[IdempotencyLabel] == "" {
			t.Fatalf("keyed sandbox not labelled: %v", first.Labels)
		}
		for _, srv := range []string{"a", "b"} {
			target := f.srv
			if srv == "b" {
				target = b
			}
			resp, body = f.doAt(t, target, f.admin, "k1", "POST", "/v1/sandboxes", spec)
			if resp.StatusCode != 201 || decodeSandbox(t, body).ID != first.ID || resp.Header.Get("Idempotent-Replayed") != "true" {
				t.Fatalf("repeat on %s: %d %s", srv, resp.StatusCode, body)
			}
		}
		if creates, _ := f.edge.Counts(); creates != 1 {
			t.Fatalf("%d creates for one key", creates)
		}
		resp, body = f.doAt(t, b, f.admin, "k1", "POST", "/v1/sandboxes", `{"base":"base/py:1"}`)
		wantError(t, resp, body, 409, "failed_precondition")
		// Keys are the caller's: another principal's k1 is another call.
		resp, body = f.doAt(t, f.srv, f.viewer, "k1", "POST", "/v1/sandboxes", spec)
		wantError(t, resp, body, 403, "permission_denied")
		// A bad key is refused before anything runs.
		resp, body = f.doAt(t, f.srv, f.admin, strings.Repeat("k", 256), "POST", "/v1/sandboxes", spec)
		wantError(t, resp, body, 400, "invalid_argument")
	})
}

// TestIdempotentRefusalFreesTheKey: a create no node took leaves no
// record, so that the same retry succeeds once a node has room.
func TestIdempotentRefusalFreesTheKey(t *testing.T) {
	f := newFixture(t, false)
	f.edge.SetRefuse(true)
	spec := `{"base":"base/py:1"}`
	resp, body := f.doAt(t, f.srv, f.admin, "k2", "POST", "/v1/sandboxes", spec)
	wantError(t, resp, body, 503, "resource_exhausted")
	f.edge.SetRefuse(false)
	resp, body = f.doAt(t, f.srv, f.admin, "k2", "POST", "/v1/sandboxes", spec)
	if resp.StatusCode != 201 || resp.Header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("retry after a refusal: %d %s", resp.StatusCode, body)
	}
}

// TestIdempotentTakeover: the apiserver that ran a keyed create died
// before recording it. A retry on another apiserver finds the sandbox the
// first attempt made instead of making a second; a batch makes only the
// missing ones.
func TestIdempotentTakeover(t *testing.T) {
	f := newFixture(t, true)
	b := f.apiserver(t, "b")
	spec := `{"base":"base/py:1"}`
	// What apiserver "a" left: a pending record, and the sandbox it made.
	rk := f.leavePending(t, "k3", "a", "/v1/sandboxes", spec)
	f.edge.Put(api.Sandbox{ID: "sb-n1-made", Node: "n1", Project: iam.RootProject, State: api.StateRunning, Labels: map[string]string{IdempotencyLabel: rk[:32]}})
	// While "a" lives, the retry waits; once it is gone, the retry takes over.
	go func() {
		time.Sleep(300 * time.Millisecond)
		f.setAlive("a", false)
	}()
	resp, body := f.doAt(t, b, f.admin, "k3", "POST", "/v1/sandboxes", spec)
	if resp.StatusCode != 201 || decodeSandbox(t, body).ID != "sb-n1-made" {
		t.Fatalf("takeover: %d %s", resp.StatusCode, body)
	}
	if creates, _ := f.edge.Counts(); creates != 0 {
		t.Fatalf("takeover made %d sandboxes, want none", creates)
	}

	// A batch of 3 of which the dead apiserver made 1.
	batch := `{"count":3,"spec":{"base":"base/py:1"}}`
	rk = f.leavePending(t, "k4", "dead", "/v1/sandboxes:batch", batch)
	f.edge.Put(api.Sandbox{ID: "sb-n1-b0", Node: "n1", Project: iam.RootProject, State: api.StateRunning, Labels: map[string]string{IdempotencyLabel: rk[:32]}})
	resp, body = f.doAt(t, b, f.admin, "k4", "POST", "/v1/sandboxes:batch", batch)
	var br api.BatchResult
	if resp.StatusCode != 200 || json.Unmarshal(body, &br) != nil || len(br.Sandboxes) != 3 || len(br.Errors) != 0 || br.Sandboxes[0].ID != "sb-n1-b0" {
		t.Fatalf("batch takeover: %d %s", resp.StatusCode, body)
	}
	if creates, _ := f.edge.Counts(); creates != 2 {
		t.Fatalf("batch takeover made %d, want the 2 missing", creates)
	}
}

// leavePending stores what an apiserver (owner) that died running a keyed
// POST of body to path leaves for key k of the fixture's admin: a pending
// record. It returns the record key.
func (f *fixture) leavePending(t *testing.T, k, owner, path, body string) string {
	t.Helper()
	rk := idemRecordKey(principalOf(t, f, f.admin), k)
	pending, _ := json.Marshal(idemRecord{Hash: requestHash("POST", path, "", []byte(body)), State: "pending", Owner: owner,
		Started: time.Now(), Expires: time.Now().Add(time.Hour)})
	if err := f.st.Put(idemBucket, rk, pending); err != nil {
		t.Fatal(err)
	}
	return rk
}

// TestTakeoverAdoptsOnlyItsProjectsSandboxes: a takeover adopts what
// carries its attempt's label in the caller's project only. Callers
// cannot set dsec's labels now, but a sandbox made before they were
// refused may carry any: another tenant's, planted with the label of a
// key it learnt, would otherwise be handed to the caller as its own.
func TestTakeoverAdoptsOnlyItsProjectsSandboxes(t *testing.T) {
	f := newFixture(t, false)
	b := f.apiserver(t, "b")
	spec := `{"base":"base/py:1"}`
	rk := f.leavePending(t, "k7", "dead", "/v1/sandboxes", spec)
	f.edge.Put(api.Sandbox{ID: "sb-n1-planted", Node: "n1", Project: "mallory", State: api.StateRunning, Labels: map[string]string{IdempotencyLabel: rk[:32]}})
	resp, body := f.doAt(t, b, f.admin, "k7", "POST", "/v1/sandboxes", spec)
	if resp.StatusCode != 201 {
		t.Fatalf("takeover: %d %s", resp.StatusCode, body)
	}
	if sb := decodeSandbox(t, body); sb.ID == "sb-n1-planted" || sb.Project != iam.RootProject {
		t.Fatalf("the takeover answered another project's sandbox: %s", body)
	}
	if creates, _ := f.edge.Counts(); creates != 1 {
		t.Fatalf("takeover made %d sandboxes, want 1", creates)
	}
}

// TestIdempotentExec: a repeated keyed exec is answered from the record
// and does not run again.
func TestIdempotentExec(t *testing.T) {
	bothWays(t, func(t *testing.T, f *fixture) {
		_, body := f.do(t, f.admin, "POST", "/v1/sandboxes", `{"base":"base/py:1"}`)
		id := decodeSandbox(t, body).ID
		for range 3 {
			resp, body := f.doAt(t, f.srv, f.admin, "x1", "POST", "/v1/sandboxes/"+id+"/exec", `{"cmd":"make test"}`)
			if resp.StatusCode != 200 {
				t.Fatalf("exec: %d %s", resp.StatusCode, body)
			}
		}
		if _, execs := f.edge.Counts(); execs != 1 {
			t.Fatalf("keyed exec ran %d times", execs)
		}
		// Without a key, every call runs.
		f.do(t, f.admin, "POST", "/v1/sandboxes/"+id+"/exec", `{"cmd":"make test"}`)
		if _, execs := f.edge.Counts(); execs != 2 {
			t.Fatalf("unkeyed exec: %d runs", execs)
		}
	})
}

// TestKeyedExecCutOffIsNotRunAgain: a keyed exec whose apiserver died
// running it may have run, in whole or in part: a repeat is refused (and
// every later repeat with it), not run a second time. One its apiserver
// gave up on (no owner: a node it could not reach) is run by a repeat.
func TestKeyedExecCutOffIsNotRunAgain(t *testing.T) {
	f := newFixture(t, true)
	b := f.apiserver(t, "b")
	_, body := f.do(t, f.admin, "POST", "/v1/sandboxes", `{"base":"base/py:1"}`)
	path := "/v1/sandboxes/" + decodeSandbox(t, body).ID + "/exec"
	cmd := `{"cmd":"echo run >> /tmp/runs"}`
	f.leavePending(t, "x9", "dead", path, cmd)
	for i := range 2 {
		resp, body := f.doAt(t, b, f.admin, "x9", "POST", path, cmd)
		if resp.StatusCode != 409 || !strings.Contains(string(body), "it is not run again") || (i == 1) != (resp.Header.Get("Idempotent-Replayed") == "true") {
			t.Fatalf("repeat %d of a cut-off exec: %d %s %v", i, resp.StatusCode, body, resp.Header)
		}
	}
	if _, execs := f.edge.Counts(); execs != 0 {
		t.Fatalf("the cut-off exec ran %d more times", execs)
	}
	// Given up on by its apiserver (owner ""): run by the repeat.
	f.leavePending(t, "x10", "", path, cmd)
	if resp, body := f.doAt(t, b, f.admin, "x10", "POST", path, cmd); resp.StatusCode != 200 {
		t.Fatalf("repeat of an exec given up on: %d %s", resp.StatusCode, body)
	}
	if _, execs := f.edge.Counts(); execs != 1 {
		t.Fatalf("the exec given up on ran %d times, want 1", execs)
	}
}

func principalOf(t *testing.T, f *fixture, key string) string {
	t.Helper()
	p, err := f.iam.Authenticate(key)
	if err != nil {
		t.Fatal(err)
	}
	return p.ID
}

// TestRecordedAnswerCompressed: a create's answer is kept compressed in
// its record (records are most of what etcd holds) and replayed byte for
// byte; a record whose body does not decode answers an internal error,
// and no second sandbox.
func TestRecordedAnswerCompressed(t *testing.T) {
	f := newFixture(t, true)
	spec := `{"base":"base/py:1","labels":{"job":"compressed"}}`
	resp, first := f.doAt(t, f.srv, f.admin, "k11", "POST", "/v1/sandboxes", spec)
	if resp.StatusCode != 201 {
		t.Fatalf("create: %d %s", resp.StatusCode, first)
	}
	rk := idemRecordKey(principalOf(t, f, f.admin), "k11")
	var rec idemRecord
	deadline := time.Now().Add(5 * time.Second)
	for rec.State != "done" {
		if time.Now().After(deadline) {
			t.Fatalf("the answer was not recorded: %+v", rec)
		}
		time.Sleep(10 * time.Millisecond)
		v, err := f.st.Get(idemBucket, rk)
		if err != nil || json.Unmarshal(v, &rec) != nil {
			t.Fatalf("record: %s %v", v, err)
		}
	}
	if rec.Encoding != "gzip" || len(rec.Body) >= len(first) {
		t.Fatalf("record keeps %d bytes (%q) of a %d-byte answer, want it compressed", len(rec.Body), rec.Encoding, len(first))
	}
	t.Logf("a %d-byte create answer is kept in %d bytes", len(first), len(rec.Body))
	resp, again := f.doAt(t, f.srv, f.admin, "k11", "POST", "/v1/sandboxes", spec)
	if resp.StatusCode != 201 || string(again) != string(first) || resp.Header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("replay: %d %q, want the first answer %q", resp.StatusCode, again, first)
	}
	rec.Body = []byte("not gzip at all")
	b, _ := json.Marshal(rec)
	if err := f.st.Put(idemBucket, rk, b); err != nil {
		t.Fatal(err)
	}
	resp, body := f.doAt(t, f.srv, f.admin, "k11", "POST", "/v1/sandboxes", spec)
	wantError(t, resp, body, 500, "internal")
	if creates, _ := f.edge.Counts(); creates != 1 {
		t.Fatalf("%d creates for one key", creates)
	}
}

// TestRecordBodyRoundTrips compresses many answers at once with the shared
// compressors: each decodes to its own answer, whoever used a compressor
// before.
func TestRecordBodyRoundTrips(t *testing.T) {
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 200 {
				body := []byte(strings.Repeat(fmt.Sprintf(`{"id":"sb-%d-%d","state":"running"},`, g, i), 1+i%40))
				var rec idemRecord
				rec.recordBody(body)
				got, err := rec.answer()
				if err != nil || string(got) != string(body) {
					errs <- fmt.Errorf("answer %d/%d (%q): %q, %v; want %q", g, i, rec.Encoding, got, err, body)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}

// BenchmarkRecordBody prices keeping a create's answer (about 600 bytes):
// a new gzip compressor per answer cost 0.69 ms and 1.2 MB; a reused one
// 6-9 µs and under 1 KB.
func BenchmarkRecordBody(b *testing.B) {
	body := []byte(strings.Repeat(`{"id":"abc","state":"running","labels":{"x":"y"}}`, 12))
	b.ReportAllocs()
	for b.Loop() {
		var rec idemRecord
		rec.recordBody(body)
	}
}

// TestIdempotencyTTL: a record answers repeats for the apiserver's TTL
// (Deps.IdempotencyTTL, --idempotency-ttl) and no longer: past it, the
// same key runs the call again.
func TestIdempotencyTTL(t *testing.T) {
	f := newFixture(t, false)
	srv := f.apiserverWith(t, "ttl", func(d *Deps) { d.IdempotencyTTL = 300 * time.Millisecond })
	spec := `{"base":"base/py:1"}`
	resp, body := f.doAt(t, srv, f.admin, "ttl-1", "POST", "/v1/sandboxes", spec)
	if resp.StatusCode != 201 {
		t.Fatalf("create: %d %s", resp.StatusCode, body)
	}
	first := decodeSandbox(t, body)
	resp, body = f.doAt(t, srv, f.admin, "ttl-1", "POST", "/v1/sandboxes", spec)
	if resp.StatusCode != 201 || decodeSandbox(t, body).ID != first.ID || resp.Header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("repeat within the TTL: %d %s", resp.StatusCode, body)
	}
	time.Sleep(400 * time.Millisecond)
	resp, body = f.doAt(t, srv, f.admin, "ttl-1", "POST", "/v1/sandboxes", spec)
	if resp.StatusCode != 201 || decodeSandbox(t, body).ID == first.ID || resp.Header.Get("Idempotent-Replayed") == "true" {
		t.Fatalf("repeat past the TTL: %d %s (first %s)", resp.StatusCode, body, first.ID)
	}
	if creates, _ := f.edge.Counts(); creates != 2 {
		t.Fatalf("%d creates, want 2", creates)
	}
}

// pagedOnly is a store whose records may be read only a page at a time.
type pagedOnly struct {
	store.Store
	pages atomic.Int32
	// failAbove, if not 0, fails pages asked for more records than that
	// (too big for the store's time limit).
	failAbove int
}

func (s *pagedOnly) List(bucket, prefix string) ([]store.KV, error) {
	return nil, errors.New("listed whole")
}

func (s *pagedOnly) ListAfter(bucket, after string, limit int) ([]store.KV, error) {
	s.pages.Add(1)
	if s.failAbove > 0 && limit > s.failAbove {
		return nil, errdefs.Unavailable("store: context deadline exceeded")
	}
	return s.Store.(store.Pager).ListAfter(bucket, after, limit)
}

// TestSweepReadsRecordsInPages: the sweep of expired records reads a
// store that pages a page at a time, never whole, and removes every
// expired record of every page and nothing else.
func TestSweepReadsRecordsInPages(t *testing.T) {
	for _, failAbove := range []int{0, 2, 1} {
		t.Run(fmt.Sprintf("failAbove-%d", failAbove), func(t *testing.T) { testSweepInPages(t, failAbove) })
	}
}

// testSweepInPages: with failAbove, pages of more records fail, and the
// sweep asks for smaller ones.
func testSweepInPages(t *testing.T, failAbove int) {
	defer func(n int) { sweepPage = n }(sweepPage)
	sweepPage = 3
	f := newFixture(t, false)
	st := &pagedOnly{Store: f.st, failAbove: failAbove}
	s := New(Deps{IAM: f.iam, Nodes: f.view, Store: st, Log: slog.New(slog.DiscardHandler)})
	live := map[string]bool{}
	for i := range 11 {
		rec := idemRecord{State: "done", Started: time.Now(), Expires: time.Now().Add(time.Hour)}
		if i%2 == 0 {
			rec.Expires = time.Now().Add(-time.Second)
		} else {
			live[fmt.Sprintf("k%02d", i)] = true
		}
		b, _ := json.Marshal(rec)
		if err := f.st.Put(idemBucket, fmt.Sprintf("k%02d", i), b); err != nil {
			t.Fatal(err)
		}
	}
	pages := 0
	s.sweepRecords(t.Context(), func() { pages++ })
	if pages == 0 { // 11 records, pages of 3 or fewer
		t.Error("the sweep did not say it was still at it between pages")
	}
	kvs, err := f.st.List(idemBucket, "")
	if err != nil {
		t.Fatal(err)
	}
	left := map[string]bool{}
	for _, kv := range kvs {
		left[kv.Key] = true
	}
	if fmt.Sprint(left) != fmt.Sprint(live) {
		t.Fatalf("left %v, want the unexpired %v", left, live)
	}
	if n := st.pages.Load(); n < 4 {
		t.Fatalf("%d pages read for 11 records at 3 a page", n)
	}
}

// TestSweepKeepsARecordClaimedAgain: the sweep deletes a record only if it
// is still expired when deleted (a repeat may have claimed the key anew
// since the sweep read it).
func TestSweepKeepsARecordClaimedAgain(t *testing.T) {
	f := newFixture(t, false)
	s := New(Deps{IAM: f.iam, Nodes: f.view, Store: f.st, Log: slog.New(slog.DiscardHandler)})
	now := time.Now()
	for _, tc := range []struct {
		expires time.Time
		gone    bool
	}{{now.Add(time.Hour), false}, {now.Add(-time.Second), true}} {
		b, _ := json.Marshal(idemRecord{State: "pending", Started: now, Expires: tc.expires})
		if err := f.st.Put(idemBucket, "rk", b); err != nil {
			t.Fatal(err)
		}
		deleted := s.deleteExpired("rk", now)
		_, err := f.st.Get(idemBucket, "rk")
		if deleted != tc.gone || errors.Is(err, errdefs.ErrNotFound) != tc.gone {
			t.Fatalf("record expiring %v: deleted %v, then %v", tc.expires.Sub(now), deleted, err)
		}
	}
}

// TestSweepTurns: apiservers sharing a store take turns at the sweep (it
// reads every record): one sweeps per period between them, another takes
// over when the last sweep is a period old, and a mark from a clock far
// ahead does not stop the sweeps.
func TestSweepTurns(t *testing.T) {
	f := newFixture(t, false)
	server := func(instance string) *Server {
		return New(Deps{IAM: f.iam, Nodes: f.view, Store: f.st, Instance: instance, Log: slog.New(slog.DiscardHandler)})
	}
	a, b := server("a"), server("b")
	now := time.Now()
	steps := []struct {
		s    *Server
		at   time.Duration
		want bool
	}{
		{a, 0, true},                                 // nobody swept yet
		{b, time.Second, false},                      // a just did
		{a, sweepEvery / 2, false},                   // a's own turn is not due either
		{b, sweepEvery - sweepEvery/20, true},        // ticks a little early still take their turn
		{a, sweepEvery, false},                       // b just did
		{a, 2*sweepEvery - sweepEvery/20, true},      // and so on
		{b, 2*sweepEvery - sweepEvery/20 + 1, false}, // the same moment: one of them
	}
	for i, st := range steps {
		if got := st.s.sweepTurn(now.Add(st.at)); got != st.want {
			t.Fatalf("step %d (%s at +%v): turn %v, want %v", i, st.s.deps.Instance, st.at, got, st.want)
		}
	}
	// Another apiserver's sweep that renews its mark holds the turn past
	// the period; the sweeper's own turns keep their pace from its starts.
	start := now.Add(3 * sweepEvery)
	if !a.sweepTurn(start) {
		t.Fatal("a's turn after a period")
	}
	a.renewSweep(start.Add(sweepEvery - sweepEvery/20))
	if b.sweepTurn(start.Add(sweepEvery)) {
		t.Fatal("b took the turn from a sweep that renewed its mark")
	}
	if !a.sweepTurn(start.Add(sweepEvery)) {
		t.Fatal("a's renewals held off its own next turn")
	}
	b.renewSweep(start.Add(sweepEvery + time.Second)) // not b's mark: no effect
	if b.sweepTurn(start.Add(sweepEvery + 2*time.Second)) {
		t.Fatal("b's renewal of a's mark counted")
	}
	// A store that retries a write whose answer it lost runs the update
	// again on the value written: the caller still has its turn.
	retried := New(Deps{IAM: f.iam, Nodes: f.view, Store: &replayUpdates{Store: f.st}, Instance: "c", Log: slog.New(slog.DiscardHandler)})
	if !retried.sweepTurn(start.Add(3 * sweepEvery)) {
		t.Fatal("a retried write of its own mark lost c its turn")
	}
	// A mark far in the future (a clock that was far ahead) is stale.
	future, _ := json.Marshal(sweepMark{At: now.Add(24 * time.Hour), By: "skewed"})
	if err := f.st.Put(sweepBucket, "last", future); err != nil {
		t.Fatal(err)
	}
	if !b.sweepTurn(now) {
		t.Fatal("a mark a day ahead stopped the sweeps")
	}
}

// replayUpdates runs every update twice, the second time on what the first
// wrote, as a store retrying a write whose answer it lost does.
type replayUpdates struct{ store.Store }

func (s *replayUpdates) Update(bucket, key string, fn func([]byte) ([]byte, error)) error {
	if err := s.Store.Update(bucket, key, fn); err != nil {
		return err
	}
	return s.Store.Update(bucket, key, fn)
}

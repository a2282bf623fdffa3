package apiserver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/iam"
	"github.com/dsecproject/dsec/internal/store"
	"github.com/dsecproject/dsec/internal/watcher"
)

// slowListEdge fails its first lists as an edge too busy to answer in
// time does.
type slowListEdge struct {
	edgeapi.Edge
	fails atomic.Int32
	// polls fail: the view counts the node down.
	pollsFail atomic.Bool
}

func (e *slowListEdge) Info(ctx context.Context) (api.Node, error) {
	if e.pollsFail.Load() {
		return api.Node{}, &edgeapi.Unreachable{Node: e.Name(), Err: context.DeadlineExceeded}
	}
	return e.Edge.Info(ctx)
}

func (e *slowListEdge) List(ctx context.Context, f edgeapi.ListFilter) ([]api.Sandbox, error) {
	if e.fails.Add(-1) >= 0 {
		return nil, &edgeapi.Unreachable{Node: e.Name(), Err: context.DeadlineExceeded}
	}
	return e.Edge.List(ctx, f)
}

// TestTakeoverAsksASlowNodeAgain: a takeover must hear from every node
// before it creates; a node that does not answer at first (and that the
// view then marks down) is asked again, and its sandbox is found instead
// of being made a second time. A node that never answers fails the call
// with unavailable, having made nothing.
func TestTakeoverAsksASlowNodeAgain(t *testing.T) {
	defer func(p time.Duration) { madeBeforePause = p }(madeBeforePause)
	madeBeforePause = 10 * time.Millisecond
	// fails -1: the node answers lists, but its polls failed twice, so
	// the view has it down.
	for _, fails := range []int32{-1, 1, 2, 100} {
		t.Run(fmt.Sprintf("fails-%d", fails), func(t *testing.T) {
			f := newFixture(t, false)
			slow := &slowListEdge{Edge: f.edge}
			view := watcher.New(watcher.Static{slow}, watcher.Config{DownAfter: time.Hour})
			view.Sync(t.Context())
			if fails < 0 {
				slow.pollsFail.Store(true)
				view.Sync(t.Context())
				view.Sync(t.Context())
				if tg := view.Edges(); len(tg) != 1 || !tg[0].Down {
					t.Fatalf("the node is not down in the view: %+v", tg)
				}
				fails = 0
			}
			b := f.apiserverWith(t, "b", func(d *Deps) { d.Nodes = view })
			spec := `{"base":"base/py:1"}`
			rk := f.leavePending(t, "k9", "dead", "/v1/sandboxes", spec)
			f.edge.Put(api.Sandbox{ID: "sb-n1-first", Node: "n1", Project: iam.RootProject, State: api.StateRunning, Labels: map[string]string{IdempotencyLabel: rk[:32]}})
			slow.fails.Store(fails)
			resp, body := f.doAt(t, b, f.admin, "k9", "POST", "/v1/sandboxes", spec)
			if fails == 100 {
				wantError(t, resp, body, 503, "unavailable")
			} else if resp.StatusCode != 201 || decodeSandbox(t, body).ID != "sb-n1-first" {
				t.Fatalf("takeover: %d %s", resp.StatusCode, body)
			}
			if creates, _ := f.edge.Counts(); creates != 0 {
				t.Fatalf("takeover made %d sandboxes, want none", creates)
			}
		})
	}
}

// flakyUpdates fails a store's first updates as a loaded etcd does.
type flakyUpdates struct {
	store.Store
	fails atomic.Int32
}

func (s *flakyUpdates) Update(bucket, key string, fn func([]byte) ([]byte, error)) error {
	if s.fails.Add(-1) >= 0 {
		return errdefs.Unavailable("store: context deadline exceeded")
	}
	return s.Store.Update(bucket, key, fn)
}

// TestRepeatRidesOverAStoreHiccup: a repeat whose reads of the record
// time out once or twice gets the recorded answer all the same; one
// whose store stays down is told unavailable.
func TestRepeatRidesOverAStoreHiccup(t *testing.T) {
	f := newFixture(t, false)
	spec := `{"base":"base/py:1"}`
	resp, body := f.doAt(t, f.srv, f.admin, "k10", "POST", "/v1/sandboxes", spec)
	if resp.StatusCode != 201 {
		t.Fatalf("create: %d %s", resp.StatusCode, body)
	}
	first := decodeSandbox(t, body)
	for _, fails := range []int32{2, 100} {
		fl := &flakyUpdates{Store: f.st}
		fl.fails.Store(fails)
		b := f.apiserverWith(t, fmt.Sprintf("b%d", fails), func(d *Deps) { d.Store = fl })
		resp, body = f.doAt(t, b, f.admin, "k10", "POST", "/v1/sandboxes", spec)
		if fails == 2 {
			if resp.StatusCode != 201 || decodeSandbox(t, body).ID != first.ID {
				t.Fatalf("repeat over %d failed reads: %d %s", fails, resp.StatusCode, body)
			}
		} else {
			wantError(t, resp, body, 503, "unavailable")
		}
	}
	if creates, _ := f.edge.Counts(); creates != 1 {
		t.Fatalf("%d creates for one key", creates)
	}
}

// landedAnyway writes the idempotency records' first writes, then says
// the store was unavailable: a write that timed out at the client and was
// applied all the same.
type landedAnyway struct{ store.Store }

func (s *landedAnyway) Create(bucket, key string, value []byte) error {
	if err := s.Store.Create(bucket, key, value); err != nil || bucket != idemBucket {
		return err
	}
	return errdefs.Unavailable("store: context deadline exceeded")
}

// TestClaimThatLandedAnywayIsRemoved: a keyed create whose claim the store
// reported failed is refused (503) having made nothing; the claim, written
// after all, is removed, so that the caller's retry (on another apiserver)
// runs instead of waiting for a call nobody runs.
func TestClaimThatLandedAnywayIsRemoved(t *testing.T) {
	defer func(d []time.Duration) { releaseAfter = d }(releaseAfter)
	releaseAfter = []time.Duration{10 * time.Millisecond, 50 * time.Millisecond}
	f := newFixture(t, false)
	flaky := f.apiserverWith(t, "flaky", func(d *Deps) { d.Store = &landedAnyway{Store: f.st} })
	spec := `{"base":"base/py:1"}`
	resp, body := f.doAt(t, flaky, f.admin, "k11", "POST", "/v1/sandboxes", spec)
	wantError(t, resp, body, 503, "unavailable")
	if creates, _ := f.edge.Counts(); creates != 0 {
		t.Fatalf("a create whose claim failed made %d sandboxes", creates)
	}
	rk := idemRecordKey(principalOf(t, f, f.admin), "k11")
	deadline := time.Now().Add(5 * time.Second)
	for {
		if _, err := f.st.Get(idemBucket, rk); errors.Is(err, errdefs.ErrNotFound) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the claim written after all was kept")
		}
		time.Sleep(10 * time.Millisecond)
	}
	start := time.Now()
	resp, body = f.doAt(t, f.srv, f.admin, "k11", "POST", "/v1/sandboxes", spec)
	if resp.StatusCode != 201 || resp.Header.Get("Idempotent-Replayed") != "" || time.Since(start) > 5*time.Second {
		t.Fatalf("retry: %d %s after %v", resp.StatusCode, body, time.Since(start))
	}
}

// TestReleaseClaimRemovesOnlyItsOwnPendingRecord: another attempt's
// record, or this attempt's answered one, is kept.
func TestReleaseClaimRemovesOnlyItsOwnPendingRecord(t *testing.T) {
	defer func(d []time.Duration) { releaseAfter = d }(releaseAfter)
	releaseAfter = []time.Duration{0}
	f := newFixture(t, false)
	s := New(Deps{IAM: f.iam, Nodes: f.view, Store: f.st, Log: slog.New(slog.DiscardHandler)})
	for _, tc := range []struct {
		rec  idemRecord
		gone bool
	}{
		{idemRecord{Nonce: "other", State: "pending"}, false},
		{idemRecord{Nonce: "mine", State: "done"}, false},
		{idemRecord{Nonce: "mine", State: "pending"}, true},
	} {
		b, _ := json.Marshal(tc.rec)
		if err := f.st.Put(idemBucket, "rk-release", b); err != nil {
			t.Fatal(err)
		}
		s.releaseClaim("rk-release", "mine")
		if _, err := f.st.Get(idemBucket, "rk-release"); errors.Is(err, errdefs.ErrNotFound) != tc.gone {
			t.Fatalf("record %+v: after release %v, want gone %v", tc.rec, err, tc.gone)
		}
	}
}

// slowUpdates makes every Update of the idempotency records wait first,
// as a loaded etcd does.
type slowUpdates struct {
	store.Store
	wait time.Duration
}

func (s *slowUpdates) Update(bucket, key string, fn func([]byte) ([]byte, error)) error {
	if bucket == idemBucket {
		time.Sleep(s.wait)
	}
	return s.Store.Update(bucket, key, fn)
}

// TestRefusalDoesNotWaitForTheStore: a keyed call refused (here: no node
// has room) is answered without waiting for its record to be removed,
// and the record goes afterwards, so that the retry runs.
func TestRefusalDoesNotWaitForTheStore(t *testing.T) {
	f := newFixture(t, false)
	slow := f.apiserverWith(t, "slow", func(d *Deps) { d.Store = &slowUpdates{Store: f.st, wait: time.Second} })
	f.edge.SetRefuse(true)
	spec := `{"base":"base/py:1"}`
	t0 := time.Now()
	resp, body := f.doAt(t, slow, f.admin, "k12", "POST", "/v1/sandboxes", spec)
	wantError(t, resp, body, 503, "resource_exhausted")
	if d := time.Since(t0); d > 500*time.Millisecond {
		t.Fatalf("the refusal took %v: it waited for the store", d)
	}
	f.edge.SetRefuse(false)
	resp, body = f.doAt(t, slow, f.admin, "k12", "POST", "/v1/sandboxes", spec)
	if resp.StatusCode != 201 {
		t.Fatalf("retry after a refusal: %d %s", resp.StatusCode, body)
	}
}

// TestRefusalKeepsATakersRecord: freeing a refused call's key removes only
// the record that call claimed, not one another attempt wrote since.
func TestRefusalKeepsATakersRecord(t *testing.T) {
	f := newFixture(t, false)
	s := New(Deps{IAM: f.iam, Nodes: f.view, Store: f.st, Instance: "a", Log: slog.New(slog.DiscardHandler)})
	theirs, _ := json.Marshal(idemRecord{Nonce: "theirs", State: "pending", Owner: "b", Started: time.Now(), Expires: time.Now().Add(time.Hour)})
	if err := f.st.Put(idemBucket, "rk", theirs); err != nil {
		t.Fatal(err)
	}
	if err := s.deleteOwnPending("rk", "mine", errKept); !errors.Is(err, errKept) {
		t.Fatalf("deleteOwnPending of another's record: %v", err)
	}
	if v, err := f.st.Get(idemBucket, "rk"); err != nil || v == nil {
		t.Fatalf("another attempt's record was removed: %v", err)
	}
	if err := s.deleteOwnPending("rk", "theirs", errKept); err != nil {
		t.Fatalf("deleteOwnPending of its own: %v", err)
	}
}

// TestTakeoverWaitsForASandboxBeingMade: an earlier attempt's sandbox
// still "creating" is waited for: made, it is the answer (running);
// undone, the takeover makes one.
func TestTakeoverWaitsForASandboxBeingMade(t *testing.T) {
	for _, made := range []bool{true, false} {
		f := newFixture(t, true)
		spec := `{"base":"base/py:1"}`
		rk := f.leavePending(t, "k11", "dead", "/v1/sandboxes", spec)
		first := api.Sandbox{ID: "sb-n1-making", Node: "n1", Project: iam.RootProject, State: api.StateCreating, Labels: map[string]string{IdempotencyLabel: rk[:32]}}
		f.edge.Put(first)
		go func() {
			time.Sleep(300 * time.Millisecond)
			if made {
				first.State = api.StateRunning
				f.edge.Put(first)
			} else {
				_ = f.edge.Delete(context.Background(), first.ID)
			}
		}()
		resp, body := f.doAt(t, f.srv, f.admin, "k11", "POST", "/v1/sandboxes", spec)
		if resp.StatusCode != 201 {
			t.Fatalf("takeover (made %v): %d %s", made, resp.StatusCode, body)
		}
		got := decodeSandbox(t, body)
		creates, _ := f.edge.Counts()
		switch {
		case made && (got.ID != first.ID || got.State != api.StateRunning || creates != 0):
			t.Fatalf("takeover of a sandbox that was made answered %s after %d creates", body, creates)
		case !made && (got.ID == first.ID || creates != 1):
			t.Fatalf("takeover of a sandbox that was undone answered %s after %d creates", body, creates)
		}
	}
}

package apiserver

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/store"
)

// batchStore records the transactions a groupCommit makes, and can hold
// the first one to let others queue behind it.
type batchStore struct {
	store.Store
	mu      sync.Mutex
	writes  []string // "c<creates>p<puts>" per transaction
	hold    chan struct{}
	holding bool
}

func (b *batchStore) Write(bucket string, creates, puts []store.KV) error {
	// As etcd: a key at most once per transaction.
	seen := map[string]bool{}
	for _, kv := range append(append([]store.KV(nil), creates...), puts...) {
		if seen[kv.Key] {
			return errdefs.Invalid("duplicate key given in txn request")
		}
		seen[kv.Key] = true
	}
	b.mu.Lock()
	b.writes = append(b.writes, fmt.Sprintf("c%dp%d", len(creates), len(puts)))
	hold := b.hold != nil && !b.holding
	b.holding = b.holding || hold
	b.mu.Unlock()
	if hold {
		<-b.hold
	}
	for _, kv := range creates {
		if _, err := b.Get(bucket, kv.Key); err == nil {
			return errdefs.AlreadyExists("%s exists", kv.Key)
		}
	}
	for _, kv := range append(append([]store.KV(nil), creates...), puts...) {
		if err := b.Put(bucket, kv.Key, kv.Value); err != nil {
			return err
		}
	}
	return nil
}

func (b *batchStore) Create(bucket, key string, val []byte) error {
	b.mu.Lock()
	b.writes = append(b.writes, "c1p0")
	hold := b.hold != nil && !b.holding
	b.holding = b.holding || hold
	b.mu.Unlock()
	if hold {
		<-b.hold
	}
	return b.Store.Create(bucket, key, val)
}

func (b *batchStore) log() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]string(nil), b.writes...)
}

// TestGroupCommit: a lone claim goes at once; claims arriving while one
// is in flight go together, with the queued answers; a repeat among them
// is refused alone; an answer waits for a claim to travel with.
func TestGroupCommit(t *testing.T) {
	bs := &batchStore{Store: store.NewMemory(), hold: make(chan struct{})}
	g := newGroupCommit(bs, "b", slog.New(slog.DiscardHandler))
	if err := bs.Put("b", "dup", []byte("x")); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make([]error, 6)
	wg.Add(1)
	go func() { defer wg.Done(); errs[0] = g.create(store.KV{Key: "k0", Value: []byte("v")}, false) }()
	time.Sleep(50 * time.Millisecond) // k0's transaction is held
	for i := 1; i < 5; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = g.create(store.KV{Key: fmt.Sprint("k", i), Value: []byte("v")}, false)
		}()
	}
	g.put(store.KV{Key: "a0", Value: []byte("answer")})
	time.Sleep(50 * time.Millisecond)
	close(bs.hold)
	wg.Wait()
	if got := bs.log(); fmt.Sprint(got) != "[c1p0 c4p1]" {
		t.Fatalf("transactions %v, want a lone claim, then four claims with the answer", got)
	}
	for i, err := range errs[:5] {
		if err != nil {
			t.Errorf("claim %d: %v", i, err)
		}
	}
	// A repeat in a batch: the others still succeed, it alone is refused.
	bs2 := &batchStore{Store: store.NewMemory(), hold: make(chan struct{})}
	_ = bs2.Put("b", "dup", []byte("x"))
	g2 := newGroupCommit(bs2, "b", slog.New(slog.DiscardHandler))
	wg.Add(1)
	go func() { defer wg.Done(); errs[0] = g2.create(store.KV{Key: "z0", Value: []byte("v")}, false) }()
	time.Sleep(50 * time.Millisecond)
	for i, k := range []string{"z1", "dup", "z2"} {
		wg.Add(1)
		go func() { defer wg.Done(); errs[i+1] = g2.create(store.KV{Key: k, Value: []byte("v")}, false) }()
	}
	time.Sleep(50 * time.Millisecond)
	close(bs2.hold)
	wg.Wait()
	for i, err := range errs[:4] {
		if (err != nil) != (i == 2) || i == 2 && !errors.Is(err, errdefs.ErrAlreadyExists) {
			t.Errorf("claim %d: %v", i, err)
		}
	}
	// The same key twice among the queued (a repeat's claim beside the
	// first, an answer beside its key's next claim): never one
	// transaction; the first claim wins, the repeat is refused, nothing
	// else fails.
	bs4 := &batchStore{Store: store.NewMemory(), hold: make(chan struct{})}
	g4 := newGroupCommit(bs4, "b", slog.New(slog.DiscardHandler))
	wg.Add(1)
	go func() { defer wg.Done(); errs[0] = g4.create(store.KV{Key: "y0", Value: []byte("v")}, false) }()
	time.Sleep(50 * time.Millisecond)
	g4.put(store.KV{Key: "y1", Value: []byte("answer")})
	for i, k := range []string{"y1", "same", "same", "y2"} {
		wg.Add(1)
		go func() { defer wg.Done(); errs[i+1] = g4.create(store.KV{Key: k, Value: []byte("v")}, false) }()
		time.Sleep(5 * time.Millisecond) // queued in this order
	}
	time.Sleep(50 * time.Millisecond)
	close(bs4.hold)
	wg.Wait()
	for i, err := range errs[:5] {
		switch {
		case i == 1 || i == 3: // y1 exists (the answer went first), "same" repeated
			if !errors.Is(err, errdefs.ErrAlreadyExists) {
				t.Errorf("claim %d: %v, want already exists", i, err)
			}
		case err != nil:
			t.Errorf("claim %d: %v", i, err)
		}
	}
	if v, err := bs4.Get("b", "y1"); err != nil || string(v) != "answer" {
		t.Errorf("the answer for y1: %q, %v", v, err)
	}

	// An answer alone is written after the linger.
	bs3 := &batchStore{Store: store.NewMemory()}
	g3 := newGroupCommit(bs3, "b", slog.New(slog.DiscardHandler))
	g3.put(store.KV{Key: "solo", Value: []byte("a")})
	deadline := time.Now().Add(2 * time.Second)
	for {
		if _, err := bs3.Get("b", "solo"); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("a lone answer was never written")
		}
		time.Sleep(time.Millisecond)
	}
}

// TestAnswersWaitForAClaim: answers queued one after another wait
// together for the next claim (another answer does not end the wait),
// lone answers are written after the linger, and settle writes them at
// once.
func TestAnswersWaitForAClaim(t *testing.T) {
	bs := &batchStore{Store: store.NewMemory()}
	g := newGroupCommit(bs, "b", slog.New(slog.DiscardHandler))
	for i := range 3 {
		g.put(store.KV{Key: fmt.Sprint("a", i), Value: []byte("answer")})
		time.Sleep(commitLinger / 5)
	}
	if err := g.create(store.KV{Key: "c0", Value: []byte("v")}, false); err != nil {
		t.Fatal(err)
	}
	if got := bs.log(); fmt.Sprint(got) != "[c1p3]" {
		t.Fatalf("transactions %v, want the three answers with the claim", got)
	}

	// Alone, an answer is written once the linger is over.
	start := time.Now()
	g.put(store.KV{Key: "lone", Value: []byte("answer")})
	for {
		if _, err := bs.Get("b", "lone"); err == nil {
			break
		}
		if time.Since(start) > 2*time.Second {
			t.Fatal("a lone answer was never written")
		}
		time.Sleep(time.Millisecond)
	}
	if el := time.Since(start); el < commitLinger*9/10 {
		t.Errorf("a lone answer was written after %v, before the linger (%v)", el, commitLinger)
	}

	// A stopping server's answers go at once.
	g.put(store.KV{Key: "last", Value: []byte("answer")})
	start = time.Now()
	g.settle(2 * time.Second)
	if _, err := bs.Get("b", "last"); err != nil {
		t.Fatalf("after settle: %v", err)
	}
	if el := time.Since(start); el > commitLinger/2 {
		t.Errorf("settle took %v: it waited for the linger", el)
	}
}

// TestCreatesClaimsWaitForOneAnother: in a burst of creates (more than
// claimSiblings keyed calls that make sandboxes running), their claims
// wait up to claimLinger for one another and go in one transaction; a
// claim that is not patient (an exec's) does not wait, and takes the
// waiting ones along; a create's claim does not wait when few run.
func TestCreatesClaimsWaitForOneAnother(t *testing.T) {
	defer func(d time.Duration) { claimLinger = d }(claimLinger)
	claimLinger = 500 * time.Millisecond
	claims := func(making int64, patient ...bool) ([]string, time.Duration) {
		bs := &batchStore{Store: store.NewMemory()}
		g := newGroupCommit(bs, "b", slog.New(slog.DiscardHandler))
		g.making.Store(making)
		var wg sync.WaitGroup
		start := time.Now()
		for i, p := range patient {
			wg.Add(1)
			go func() {
				defer wg.Done()
				kv := store.KV{Key: fmt.Sprint("k", i), Value: []byte("v")}
				if err := g.create(kv, p); err != nil {
					t.Error(err)
				}
			}()
			time.Sleep(10 * time.Millisecond)
		}
		wg.Wait()
		return bs.log(), time.Since(start)
	}
	if log, d := claims(claimSiblings+1, true, true, true, true); fmt.Sprint(log) != "[c4p0]" || d < claimLinger/2 {
		t.Fatalf("a burst's claims: transactions %v after %v, want the four in one after a wait", log, d)
	}
	if log, d := claims(claimSiblings+1, true, false); fmt.Sprint(log) != "[c2p0]" || d >= claimLinger/2 {
		t.Fatalf("a create's claim, then an exec's: transactions %v after %v, want both in one at once", log, d)
	}
	if log, d := claims(1, true); fmt.Sprint(log) != "[c1p0]" || d >= claimLinger/2 {
		t.Fatalf("a lone create's claim: transactions %v after %v, want it at once", log, d)
	}
}

// TestGroupCommitUnderLoad: claims and answers from many goroutines, some
// claims written from their caller's goroutine and some by the drain's,
// are all written, each once, in transactions that never hold a key
// twice, and settle leaves nothing queued.
func TestGroupCommitUnderLoad(t *testing.T) {
	bs := &batchStore{Store: store.NewMemory()}
	g := newGroupCommit(bs, "b", slog.New(slog.DiscardHandler))
	var wg sync.WaitGroup
	for i := range 200 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			k := fmt.Sprint("k", i)
			if err := g.create(store.KV{Key: k, Value: []byte("pending")}, i%3 == 0); err != nil {
				t.Errorf("claim %s: %v", k, err)
				return
			}
			g.put(store.KV{Key: k, Value: []byte("done")})
		}()
	}
	wg.Wait()
	g.settle(5 * time.Second)
	for i := range 200 {
		if v, err := bs.Get("b", fmt.Sprint("k", i)); err != nil || string(v) != "done" {
			t.Fatalf("k%d: %q, %v; want its answer", i, v, err)
		}
	}
	if err := g.create(store.KV{Key: "k7", Value: []byte("again")}, false); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("a claim of a written key: %v, want already exists", err)
	}
}

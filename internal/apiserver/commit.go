package apiserver

import (
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/store"
)

// groupCommit groups the idempotency records' writes into store
// transactions, as databases group commits: claims (create if absent,
// which the caller waits for) and answers (puts, which nobody waits for:
// the caller already has its answer). A claim that finds no write in
// flight goes at once, with whatever answers are queued; writes that
// arrive while a transaction is in flight go together in the next one.
// Answers wait for a claim to travel with, up to linger after the first of
// them was queued (more answers arriving meanwhile do not end the wait),
// or until a batch is full: a client sending creates one after another,
// and a burst of creates, then cost one transaction, one raft entry and
// one fsync per create (or per batch), not two. A repeat of a call whose
// answer still waits here finds its record pending and polls for it.
//
// Claims of calls that make sandboxes (creates, batches, forks,
// snapshots, fncalls) are patient: while more than claimSiblings of those
// calls run on this apiserver (a burst), their claims wait up to
// claimLinger for one another, so that a burst's claims share
// transactions too, as a database delays a commit while others are about
// to commit (PostgreSQL's commit_delay and commit_siblings). Each
// transaction costs etcd and this apiserver CPU that a burst on shared
// cores would rather give the nodes, and a create in a burst takes far
// longer than the wait. One create at a time never waits, nor does an
// exec's claim.
//
// An answer not yet written when the apiserver dies leaves its record
// pending with a dead owner: a repeat takes the call over and finds what
// it made, as for any call cut short.
type groupCommit struct {
	st       store.Store
	batcher  store.Batcher // nil: the store writes one key at a time
	bucket   string
	linger   time.Duration
	maxOps   int
	maxBytes int
	log      *slog.Logger

	// making counts the keyed calls that make sandboxes running.
	making atomic.Int64

	mu      sync.Mutex
	queue   []*commitOp
	running bool
	// settling: the server stops; answers no longer wait.
	settling bool
	kick     chan struct{}
	idle     *sync.Cond // signalled when a drain finds the queue empty
}

type commitOp struct {
	kv     store.KV
	create bool
	// patient: the claim of a call that makes sandboxes, which may
	// wait for others (claimLinger) from at.
	patient bool
	at      time.Time
	err     error
	done    chan struct{} // nil for an answer
}

// Batch bounds: etcd takes up to 128 operations and 1.5 MiB per request.
// commitLinger is how long answers wait for a claim: a few create times,
// so that under any steady flow of keyed calls they ride with the next
// claim.
const (
	commitMaxOps   = 64
	commitMaxBytes = 1 << 20
	commitLinger   = 50 * time.Millisecond
	claimSiblings  = 8
)

// claimLinger is how long the claims of calls that make sandboxes wait
// for one another in a burst. A variable for tests.
var claimLinger = 10 * time.Millisecond

func newGroupCommit(st store.Store, bucket string, log *slog.Logger) *groupCommit {
	g := &groupCommit{st: st, bucket: bucket, linger: commitLinger, maxOps: commitMaxOps, maxBytes: commitMaxBytes,
		log: log, kick: make(chan struct{}, 1)}
	g.idle = sync.NewCond(&g.mu)
	g.batcher, _ = st.(store.Batcher)
	if g.batcher == nil {
		g.linger = 0 // nothing to group
	}
	return g
}

// create writes kv if its key is absent (errdefs.ErrAlreadyExists
// otherwise) and waits for the write; patient: the claim of a call that
// makes sandboxes.
func (g *groupCommit) create(kv store.KV, patient bool) error {
	op := &commitOp{kv: kv, create: true, patient: patient, at: time.Now(), done: make(chan struct{})}
	g.enqueue(op)
	<-op.done
	return op.err
}

// put queues kv to be written soon and returns at once; a failure is
// logged.
func (g *groupCommit) put(kv store.KV) {
	g.enqueue(&commitOp{kv: kv})
}

func (g *groupCommit) enqueue(op *commitOp) {
	g.mu.Lock()
	g.queue = append(g.queue, op)
	if !g.running {
		g.running = true
		go g.drain()
	}
	g.mu.Unlock()
	select {
	case g.kick <- struct{}{}:
	default:
	}
}

// settle writes what is queued without waiting for claims, and returns
// once nothing is queued or within timeout: for a server that stops, so
// that the answers it gave are recorded.
func (g *groupCommit) settle(timeout time.Duration) {
	g.mu.Lock()
	g.settling = true
	g.mu.Unlock()
	select {
	case g.kick <- struct{}{}:
	default:
	}
	done := make(chan struct{})
	go func() {
		g.mu.Lock()
		for g.running || len(g.queue) > 0 {
			g.idle.Wait()
		}
		g.mu.Unlock()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(timeout):
		g.log.Warn("stopping with idempotency answers not yet recorded (their keys will be taken over by a retry)")
	}
}

// drain writes batches until the queue is empty.
func (g *groupCommit) drain() {
	var until time.Time // end of the answers' wait (zero: not waiting)
	for {
		g.mu.Lock()
		if len(g.queue) == 0 {
			g.running = false
			g.idle.Broadcast()
			g.mu.Unlock()
			return
		}
		claims, patient := false, true
		var oldest time.Time
		for _, op := range g.queue {
			if op.create {
				claims = true
				patient = patient && op.patient
				if oldest.IsZero() || op.at.Before(oldest) {
					oldest = op.at
				}
			}
		}
		var wait time.Duration
		switch {
		case claims && patient && !g.settling && g.batcher != nil && len(g.queue) < g.maxOps && g.making.Load() > claimSiblings:
			// Patient claims only, in a burst: give others a moment
			// to join them.
			wait = time.Until(oldest.Add(claimLinger))
		case !claims && !g.settling && g.linger > 0 && len(g.queue) < g.maxOps:
			// Answers only: give a claim a moment to join them.
			if until.IsZero() {
				until = time.Now().Add(g.linger)
			}
			wait = time.Until(until)
		}
		if wait > 0 {
			g.mu.Unlock()
			t := time.NewTimer(wait)
			select {
			case <-g.kick:
			case <-t.C:
			}
			t.Stop()
			continue
		}
		// A key goes into a transaction once (etcd refuses a repeat):
		// a second write of it (a repeat's claim, or an answer and the
		// next claim of its key) waits for the next.
		n, size := 0, 0
		keys := map[string]bool{}
		for n < len(g.queue) && n < g.maxOps && (n == 0 || size+len(g.queue[n].kv.Value) <= g.maxBytes) && !keys[g.queue[n].kv.Key] {
			keys[g.queue[n].kv.Key] = true
			size += len(g.queue[n].kv.Value)
			n++
		}
		batch := append([]*commitOp(nil), g.queue[:n]...)
		g.queue = g.queue[n:]
		g.mu.Unlock()
		until = time.Time{}
		g.write(batch)
		for _, op := range batch {
			if op.done != nil {
				close(op.done)
			} else if op.err != nil {
				g.log.Warn("recording an idempotent answer", "err", op.err)
			}
		}
	}
}

// write stores a batch: in one transaction where the store allows it (the
// claims created only if every one of them is absent), else one by one.
func (g *groupCommit) write(batch []*commitOp) {
	if g.batcher != nil && len(batch) > 1 {
		var creates, puts []store.KV
		for _, op := range batch {
			if op.create {
				creates = append(creates, op.kv)
			} else {
				puts = append(puts, op.kv)
			}
		}
		err := g.batcher.Write(g.bucket, creates, puts)
		if err == nil || !errors.Is(err, errdefs.ErrAlreadyExists) {
			for _, op := range batch {
				op.err = err
			}
			return
		}
		// A claim's key exists (a repeat): each on its own.
	}
	for _, op := range batch {
		if op.create {
			op.err = g.st.Create(g.bucket, op.kv.Key, op.kv.Value)
		} else {
			op.err = g.st.Put(g.bucket, op.kv.Key, op.kv.Value)
		}
	}
}

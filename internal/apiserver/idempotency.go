package apiserver

// Idempotency keys (DSec §6.1: after a preemption, completed operations
// return their recorded results instead of running again). A mutating call
// with an Idempotency-Key leaves a record in the store: pending while it
// runs (with the apiserver that runs it), then its answer. A repeat with
// the same key and body gets the recorded answer from any apiserver; with
// another body, 409. A repeat that finds the call still pending waits for
// it; if the apiserver running it died, the repeat takes the call over:
// a create first looks for the sandboxes the first attempt made (they
// carry the record's label), so that nothing is made twice.

import (
	"bytes"
	"compress/gzip"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync"
	"time"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/store"
)

// idemBucket holds the records, by idemRecordKey.
const idemBucket = "idempotency"

// IdempotencyLabel marks the sandboxes a keyed create made, so that a
// retry that takes over from a dead apiserver finds them.
const IdempotencyLabel = "dsec.idempotency"

// Idempotency tuning.
const (
	// DefaultIdempotencyTTL is how long a record answers repeats.
	DefaultIdempotencyTTL = 24 * time.Hour
	// maxRecordedBytes bounds the answer a record keeps (etcd takes
	// requests of up to 1.5 MiB, and the record holds the body in
	// base64). A larger answer is recorded as done without its body: a
	// repeat is told so rather than run again.
	maxRecordedBytes = 768 << 10
	// idemWait is how long a repeat waits for a pending call of a live
	// apiserver before answering 409.
	idemWait   = 60 * time.Second
	maxIdemKey = 255
)

type idemRecord struct {
	Hash string `json:"hash"`
	// Nonce names the attempt that wrote a pending record, so that a
	// store retry of that write knows it as its own.
	Nonce   string    `json:"nonce,omitempty"`
	State   string    `json:"state"` // pending | done
	Owner   string    `json:"owner"` // apiserver instance running it
	Started time.Time `json:"started"`
	Expires time.Time `json:"expires"`
	Status  int       `json:"status,omitempty"`
	Type    string    `json:"content_type,omitempty"`
	Body    []byte    `json:"body,omitempty"`
	// TooLarge: done, but the answer was too large to keep.
	TooLarge int `json:"too_large,omitempty"`
	// Encoding is "gzip" for a body kept compressed ("" for as sent).
	Encoding string `json:"encoding,omitempty"`
}

// idemCtx is what a keyed call's handler learns from the middleware.
type idemCtx struct {
	// label is the value of IdempotencyLabel for sandboxes it creates.
	label string
	// takeover: an earlier attempt may have made some of them already.
	takeover bool
}

type idemCtxKey struct{}

func idemFrom(ctx context.Context) *idemCtx {
	ic, _ := ctx.Value(idemCtxKey{}).(*idemCtx)
	return ic
}

// idempotent wraps a keyed route. creates says the call makes sandboxes
// (or layers): when the store cannot record it, it is refused rather than
// run unrecorded; an exec runs anyway (sandboxes must stay usable while
// etcd has no quorum).
func (s *Server) idempotent(creates bool, h http.HandlerFunc) http.HandlerFunc {
	return s.keyed(creates, creates, h)
}

// idempotentOnce wraps a keyed route whose handler cannot tell what an
// attempt cut short did (an exec, a session run, an fncall, a snapshot):
// a repeat that takes over from an apiserver that died running it is
// refused, and keeps that refusal as the key's answer, rather than run
// the call a second time. (A call its apiserver gave up on with a 5xx,
// such as a node it could not reach, is run again by a repeat, as
// before.)
func (s *Server) idempotentOnce(creates bool, h http.HandlerFunc) http.HandlerFunc {
	return s.keyed(creates, false, h)
}

// keyed is idempotent; resumable says the handler finishes what an
// attempt cut short started (creates look for the sandboxes it made).
func (s *Server) keyed(creates, resumable bool, h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		if key == "" || s.deps.Store == nil {
			h(w, r)
			return
		}
		if len(key) > maxIdemKey || !printable(key) {
			s.writeError(w, r, errdefs.Invalid("Idempotency-Key must be 1-%d printable ASCII characters", maxIdemKey))
			return
		}
		body, err := io.ReadAll(http.MaxBytesReader(nil, r.Body, maxJSONBody))
		if err != nil {
			s.writeError(w, r, errdefs.Invalid("request body larger than %d bytes", maxJSONBody))
			return
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		hash := requestHash(r.Method, r.URL.Path, r.URL.RawQuery, body)
		rk := idemRecordKey(principalID(r), key)
		if creates {
			s.records.making.Add(1)
			defer s.records.making.Add(-1)
		}
		rec, run, err := s.claim(r.Context(), rk, hash, creates)
		switch {
		case err != nil && errors.Is(err, errdefs.ErrUnavailable) && !creates:
			s.log.Warn("running a keyed call unrecorded: the store is unavailable", "path", r.URL.Path, "err", err)
			w.Header().Set("Idempotency-Recorded", "false")
			h(w, r)
			return
		case err != nil:
			s.writeError(w, r, err)
			return
		case !run:
			s.replay(w, r, rec)
			return
		}
		tee := &teeWriter{ResponseWriter: w, status: http.StatusOK}
		if rec.cutOff && !resumable {
			s.writeError(tee, r, errdefs.Precondition("an earlier attempt of this request (this Idempotency-Key) was cut off when the apiserver running it stopped, "+
				"and what it did is not known (a command may have run, in whole or in part): it is not run again; send it with a new key to run it"))
			s.record(rk, hash, rec.idemRecord, tee, "done")
			return
		}
		ic := &idemCtx{label: rk[:32], takeover: rec.takeover}
		h(tee, r.WithContext(context.WithValue(r.Context(), idemCtxKey{}, ic)))
		s.finish(rk, hash, rec.idemRecord, tee)
	}
}

// requestHash identifies a request: the same key with another hash is
// another request.
func requestHash(method, path, query string, body []byte) string {
	h := sha256.New()
	_, _ = io.WriteString(h, method+" "+path+"?"+query+"\n")
	_, _ = h.Write(body) // not copied: bodies run to tens of MiB
	return hex.EncodeToString(h.Sum(nil))
}

func newNonce() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

func printable(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			return false
		}
	}
	return true
}

// idemRecordKey scopes a key to the principal that sent it.
func idemRecordKey(principal, key string) string {
	sum := sha256.Sum256([]byte(principal + "\x00" + key))
	return hex.EncodeToString(sum[:])
}

type claimed struct {
	idemRecord
	takeover bool
	// cutOff: taken over from an apiserver that died running the call
	// (not one that gave up on it, leaving it with no owner).
	cutOff bool
}

// claim makes this apiserver the runner of rk, or returns the record to
// answer from (run false). It waits while a live apiserver runs it.
// patient: the call makes sandboxes (its claim may wait for others in a
// burst, see groupCommit).
func (s *Server) claim(ctx context.Context, rk, hash string, patient bool) (claimed, bool, error) {
	deadline := time.Now().Add(idemWait)
	nonce := newNonce()
	misses := 0 // store calls given up in a row (a loaded store; a lost quorum)
	// The common case, a new key, is one write.
	{
		now := time.Now()
		mine := idemRecord{Hash: hash, Nonce: nonce, State: "pending", Owner: s.deps.Instance, Started: now, Expires: now.Add(s.idemTTL())}
		b, err := json.Marshal(mine)
		if err != nil {
			return claimed{}, false, err
		}
		switch err := s.records.create(store.KV{Key: rk, Value: b}, patient); {
		case err == nil:
			return claimed{idemRecord: mine}, true, nil
		case errors.Is(err, errdefs.ErrUnavailable):
			// The write may land all the same (a store that timed out
			// may still apply it): a record pending with this live
			// apiserver as owner, running nothing, would hold every
			// repeat off.
			go s.releaseClaim(rk, nonce)
			return claimed{}, false, err
		case !errors.Is(err, errdefs.ErrAlreadyExists):
			return claimed{}, false, err
		}
	}
	for {
		now := time.Now()
		mine := idemRecord{Hash: hash, Nonce: nonce, State: "pending", Owner: s.deps.Instance, Started: now, Expires: now.Add(s.idemTTL())}
		var got claimed
		run := false
		err := s.deps.Store.Update(idemBucket, rk, func(old []byte) ([]byte, error) {
			got, run = claimed{}, false
			if old != nil {
				if err := json.Unmarshal(old, &got.idemRecord); err != nil {
					return nil, fmt.Errorf("decoding idempotency record: %w", err)
				}
			}
			switch {
			case old != nil && got.Nonce == nonce && got.State == "pending":
				// Our own write, seen again after its answer was lost.
				run, mine = true, got.idemRecord
				return old, nil
			case old == nil || now.After(got.Expires):
				run = true
				return json.Marshal(mine)
			case got.Hash != hash:
				return nil, errdefs.Precondition("Idempotency-Key was used with another request (method, path or body differ); use a new key")
			case got.State == "done":
				return nil, errAnswered
			case got.Owner != s.deps.Instance && !s.alive(got.Owner):
				// Its apiserver is gone: take the call over.
				run = true
				mine.Started = got.Started
				b, err := json.Marshal(mine)
				got.takeover, got.cutOff = true, got.Owner != ""
				return b, err
			}
			return nil, errPending
		})
		switch {
		case err == nil && run:
			got.idemRecord = mine
			return got, true, nil
		case errors.Is(err, errAnswered):
			return got, false, nil
		case errors.Is(err, errPending):
			if time.Now().After(deadline) {
				return got, false, errdefs.Precondition("a request with this Idempotency-Key is still running (since %s); retry later", got.Started.UTC().Format(time.RFC3339))
			}
			select {
			case <-ctx.Done():
				return got, false, ctx.Err()
			case <-time.After(100 * time.Millisecond):
			}
			misses = 0
			continue
		case errors.Is(err, errdefs.ErrUnavailable) && misses+1 < claimStoreTries && time.Now().Before(deadline):
			// A repeat waits anyway: a store slow under load gets
			// another chance before the caller is told.
			misses++
			select {
			case <-ctx.Done():
				return got, false, ctx.Err()
			case <-time.After(time.Duration(misses) * 200 * time.Millisecond):
			}
			continue
		case err != nil:
			return got, false, err
		}
		return got, false, nil
	}
}

// claimStoreTries is how many store calls in a row a repeat's claim may
// see fail before it answers unavailable.
const claimStoreTries = 3

var (
	errAnswered = errors.New("answered")
	errPending  = errors.New("pending")
)

func (s *Server) idemTTL() time.Duration {
	if s.deps.IdempotencyTTL > 0 {
		return s.deps.IdempotencyTTL
	}
	return DefaultIdempotencyTTL
}

// alive reports whether the apiserver instance still runs. Without a
// liveness source (dsec up: one process) only this one does.
func (s *Server) alive(instance string) bool {
	if instance == "" {
		return false // orphaned by a failed attempt
	}
	if s.deps.Alive == nil {
		return instance == s.deps.Instance
	}
	ok, err := s.deps.Alive(instance)
	if err != nil {
		return true // cannot tell: wait rather than run twice
	}
	return ok
}

// replay answers from a record.
func (s *Server) replay(w http.ResponseWriter, r *http.Request, rec claimed) {
	if rec.TooLarge > 0 {
		s.writeError(w, r, errdefs.Precondition("a request with this Idempotency-Key completed with status %d, but its answer (%d bytes) was too large to keep; it is not run again", rec.Status, rec.TooLarge))
		return
	}
	body, err := rec.answer()
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	w.Header().Set("Idempotent-Replayed", "true")
	if rec.Type != "" {
		w.Header().Set("Content-Type", rec.Type)
	}
	w.WriteHeader(rec.Status)
	_, _ = w.Write(body)
}

// recordBody sets a record's body to the answer b, compressed when that
// makes it smaller: records are most of what etcd holds (a sandbox's JSON
// shrinks to about half).
func (rec *idemRecord) recordBody(b []byte) {
	rec.Body, rec.Encoding = b, ""
	if len(b) < 256 {
		return
	}
	var z bytes.Buffer
	zw := gzipWriters.Get().(*gzip.Writer)
	defer gzipWriters.Put(zw)
	zw.Reset(&z)
	if _, err := zw.Write(b); err != nil || zw.Close() != nil || z.Len() >= len(b) {
		return
	}
	rec.Body, rec.Encoding = z.Bytes(), "gzip"
}

// gzipWriters keeps compressors for reuse: a new one allocates over a
// megabyte of tables, which cost more (0.7 ms) than compressing an answer.
var gzipWriters = sync.Pool{New: func() any {
	zw, _ := gzip.NewWriterLevel(io.Discard, gzip.BestSpeed)
	return zw
}}

// answer is the recorded body as it was sent.
func (rec *idemRecord) answer() ([]byte, error) {
	switch rec.Encoding {
	case "":
		return rec.Body, nil
	case "gzip":
		zr, err := gzip.NewReader(bytes.NewReader(rec.Body))
		if err != nil {
			return nil, fmt.Errorf("decoding a recorded answer: %w", err)
		}
		// A record never holds more than maxRecordedBytes of answer.
		b, err := io.ReadAll(io.LimitReader(zr, maxRecordedBytes+1))
		if err == nil && len(b) > maxRecordedBytes {
			err = errors.New("longer than any answer recorded")
		}
		if err != nil {
			return nil, fmt.Errorf("decoding a recorded answer: %w", err)
		}
		return b, nil
	}
	return nil, fmt.Errorf("a recorded answer has the unknown encoding %q", rec.Encoding)
}

// finish records the answer of a call this apiserver ran. A refusal that
// left nothing done (a 4xx, or no node could take it) frees the key for a
// retry instead of pinning the error. A failure that may have left
// something done (the edge was lost mid-call, an internal error) leaves
// the record pending with no owner: a retry takes it over and, for a
// create, first looks for what the first attempt made.
func (s *Server) finish(rk, hash string, claim idemRecord, tee *teeWriter) {
	outcome := "done"
	switch {
	case tee.status >= 400 && tee.status < 500:
		outcome = "free"
	case tee.status >= 500:
		outcome = "orphan"
		var eb struct {
			Error struct{ Code string } `json:"error"`
		}
		if !tee.over && json.Unmarshal(tee.buf.Bytes(), &eb) == nil && eb.Error.Code == "resource_exhausted" {
			outcome = "free"
		}
	}
	s.record(rk, hash, claim, tee, outcome)
}

// record settles rk's record by outcome: "free" removes it (the call
// left nothing done), "orphan" leaves it pending with no owner, "done"
// keeps the answer tee holds.
func (s *Server) record(rk, hash string, claim idemRecord, tee *teeWriter, outcome string) {
	if outcome == "free" {
		// After the answer, not before it (the caller would wait for the
		// store), and only the record this call claimed: a repeat that
		// meanwhile took the key over (this apiserver's lease lost)
		// keeps its own. A repeat arriving first finds it pending and
		// polls until it is gone.
		go func() {
			if err := s.deleteOwnPending(rk, claim.Nonce, errKept); err != nil && !errors.Is(err, errKept) {
				s.log.Warn("freeing an idempotency key", "err", err)
			}
		}()
		return
	}
	// One write, not a compare-and-set: the record is this apiserver's
	// (its claim made it) unless another took it over, which needs this
	// one's liveness lease gone; and a taker-over's own finish leaves a
	// record it does not own alone. Either answer is the same call's.
	rec := claim
	rec.Hash = hash
	if outcome == "orphan" {
		rec.Owner = ""
	} else {
		rec.State, rec.Status, rec.Type = "done", tee.status, tee.Header().Get("Content-Type")
		if tee.over {
			rec.TooLarge = tee.total
		} else {
			rec.recordBody(tee.buf.Bytes())
		}
	}
	b, err := json.Marshal(rec)
	if err != nil {
		s.log.Warn("recording an idempotent answer", "err", err)
		return
	}
	// Queued, not written: the caller has its answer (in one write, as
	// the handler returns) before the record is written. Should this
	// apiserver die in between, the record stays pending without a live
	// owner, and a repeat takes it over (and finds what was made).
	s.records.put(store.KV{Key: rk, Value: b})
}

// teeWriter passes a response through and keeps a copy (up to
// maxRecordedBytes) for the record.
type teeWriter struct {
	http.ResponseWriter
	mu     sync.Mutex
	status int
	wrote  bool
	buf    bytes.Buffer
	total  int
	over   bool
}

func (t *teeWriter) WriteHeader(code int) {
	t.mu.Lock()
	if !t.wrote {
		t.status, t.wrote = code, true
	}
	t.mu.Unlock()
	t.ResponseWriter.WriteHeader(code)
}

func (t *teeWriter) Write(b []byte) (int, error) {
	t.mu.Lock()
	t.wrote = true
	t.total += len(b)
	if !t.over && t.buf.Len()+len(b) <= maxRecordedBytes {
		t.buf.Write(b)
	} else if !t.over {
		t.over = true
		t.buf.Reset()
	}
	t.mu.Unlock()
	return t.ResponseWriter.Write(b)
}

func (t *teeWriter) Flush() {
	if f, ok := t.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

func (t *teeWriter) Unwrap() http.ResponseWriter { return t.ResponseWriter }

// idemJanitor deletes expired records now and then. Every apiserver runs
// one, but a sweep reads every record (hundreds of MiB in a busy
// cluster), so they take turns: at its tick an apiserver sweeps only if
// none has within sweepEvery (sweepTurn). Should two sweep at once,
// deleting twice is harmless.
func (s *Server) idemJanitor(ctx context.Context) {
	t := time.NewTicker(sweepEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if s.sweepTurn(time.Now()) {
			s.sweepRecords(ctx, func() { s.renewSweep(time.Now()) })
		}
	}
}

// sweepEvery is how often the records are swept, by one apiserver or
// another.
const sweepEvery = 10 * time.Minute

// sweepBucket holds when the records were last swept, and by whom.
const sweepBucket = "idempotency-sweep"

type sweepMark struct {
	// At is when By started its last sweep; Renewed, when it last
	// said it was still at it (a sweep of many records takes long).
	At      time.Time `json:"at"`
	By      string    `json:"by"`
	Renewed time.Time `json:"renewed,omitzero"`
}

// sweepTurn reports whether it is this apiserver's turn to sweep: no
// apiserver has started a sweep within the last sweepEvery (less a tenth,
// so that apiservers ticking together do not all skip), and this one has
// now noted its own, in one compare-and-set. A mark from the future (a
// clock far ahead) counts as old. A store it cannot reach gives no turn:
// the sweep would fail as well.
func (s *Server) sweepTurn(now time.Time) bool {
	turn := false
	err := s.deps.Store.Update(sweepBucket, "last", func(old []byte) ([]byte, error) {
		turn = false
		var m sweepMark
		if old != nil && json.Unmarshal(old, &m) == nil {
			if m.By == s.deps.Instance && m.At.Equal(now) {
				// This call's own mark, seen again by a store
				// retrying a write whose answer it lost.
				turn = true
				return old, nil
			}
			// Its own sweeps keep their pace from their starts;
			// another's holds the turn while it renews its mark.
			last := m.At
			if m.By != s.deps.Instance && m.Renewed.After(last) {
				last = m.Renewed
			}
			if age := now.Sub(last); age < sweepEvery-sweepEvery/10 && age > -sweepEvery {
				return nil, errKept
			}
		}
		turn = true
		return json.Marshal(sweepMark{At: now, By: s.deps.Instance})
	})
	if err != nil && !errors.Is(err, errKept) {
		s.log.Warn("taking a turn at sweeping idempotency records", "err", err)
	}
	return err == nil && turn
}

// renewSweep notes in the mark that this apiserver's sweep still runs,
// if the mark is still its own.
func (s *Server) renewSweep(now time.Time) {
	err := s.deps.Store.Update(sweepBucket, "last", func(old []byte) ([]byte, error) {
		var m sweepMark
		if old == nil || json.Unmarshal(old, &m) != nil || m.By != s.deps.Instance {
			return nil, errKept
		}
		m.Renewed = now
		return json.Marshal(m)
	})
	if err != nil && !errors.Is(err, errKept) {
		s.log.Warn("renewing the idempotency sweep's mark", "err", err)
	}
}

// sweepPage is how many records a sweep asks a store that pages
// (store.Pager: etcd) for at a time: about 1.5 MiB of create records. A
// page that fails (records that keep large answers, up to 768 KiB each,
// can make one too big for the store's time limit) is asked for again at
// half the size, down to one record. A variable for tests.
var sweepPage = 1000

// sweepRecords deletes the expired records. A store that pages is read a
// page at a time, so that no apiserver ever holds every record (hundreds
// of MiB at the scale of a busy cluster, past what one etcd answer may
// carry); others are listed whole.
func (s *Server) sweepRecords(ctx context.Context, onPage func()) {
	pg, paged := s.deps.Store.(store.Pager)
	now := time.Now()
	n, after, size := 0, "", sweepPage
	for ctx.Err() == nil {
		var kvs []store.KV
		var err error
		if paged {
			kvs, err = pg.ListAfter(idemBucket, after, size)
		} else {
			kvs, err = s.deps.Store.List(idemBucket, "")
		}
		if err != nil && paged && size > 1 {
			size = max(size/2, 1)
			continue
		}
		if err != nil {
			s.log.Warn("listing idempotency records to remove the expired ones", "after", after, "err", err)
			break
		}
		for _, kv := range kvs {
			if expired(kv.Value, now) && s.deleteExpired(kv.Key, now) {
				n++
			}
		}
		if !paged || len(kvs) < size {
			break
		}
		if onPage != nil {
			onPage()
		}
		after = kvs[len(kvs)-1].Key
	}
	if n > 0 {
		s.log.Info("expired idempotency records removed", "count", n)
	}
}

// expired reports whether a record's value is of a record past its time.
func expired(v []byte, now time.Time) bool {
	var rec idemRecord
	return json.Unmarshal(v, &rec) == nil && now.After(rec.Expires)
}

// deleteExpired deletes record rk if it is still expired: a repeat may
// have claimed the key anew since the sweep read it.
func (s *Server) deleteExpired(rk string, now time.Time) bool {
	return s.deleteRecordIf(rk, func(old []byte) error {
		if old == nil || !expired(old, now) {
			return errKept
		}
		return nil
	}) == nil
}

// deleteRecordIf deletes record rk in one compare-and-set if keep, given
// its value (nil: none), returns nil; else it returns keep's error.
func (s *Server) deleteRecordIf(rk string, keep func(old []byte) error) error {
	return s.deps.Store.Update(idemBucket, rk, func(old []byte) ([]byte, error) {
		return nil, keep(old)
	})
}

// errKept says a record is not to be deleted (deleteRecordIf).
var errKept = errors.New("kept")

// releaseClaim deletes rk's record if it is the pending one of attempt
// nonce: a claim whose write failed as far as this apiserver could tell,
// which the store may have made anyway, then or a moment later. It looks
// a few times (releaseAfter), until it finds the record someone else's or
// removes it.
func (s *Server) releaseClaim(rk, nonce string) {
	var err error
	for _, after := range releaseAfter {
		time.Sleep(after)
		err = s.deleteOwnPending(rk, nonce, errNotYet)
		switch {
		case err == nil:
			s.log.Info("removed the record of an idempotency claim whose write had failed", "record", rk[:8])
			return
		case errors.Is(err, errKept):
			return
		}
	}
	if !errors.Is(err, errNotYet) {
		s.log.Warn("removing the record of an idempotency claim whose write had failed (repeats wait for it while this apiserver lives)", "err", err)
	}
}

// deleteOwnPending deletes rk's record if it is the pending one of
// attempt nonce; otherwise it returns errKept, or absent if there is none.
func (s *Server) deleteOwnPending(rk, nonce string, absent error) error {
	return s.deleteRecordIf(rk, func(old []byte) error {
		var rec idemRecord
		switch {
		case old == nil:
			return absent
		case json.Unmarshal(old, &rec) != nil || rec.Nonce != nonce || rec.State != "pending":
			return errKept
		}
		return nil
	})
}

// releaseAfter are the waits before each of releaseClaim's looks. A
// variable for tests.
var releaseAfter = []time.Duration{time.Second, 3 * time.Second, 10 * time.Second}

// errNotYet aborts releaseClaim's update when there is no record (yet).
var errNotYet = errors.New("no record")

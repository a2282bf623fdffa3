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
	Nonce string `json:"nonce,omitempty"`
	// Attempt names what the call made: the sandboxes carry it in their
	// IdempotencyLabel (idemLabel), and a takeover keeps it, so that it
	// adopts what every earlier holder of the record made and nothing
	// else (not what a speculative create that lost the claim made).
	// Empty in records of earlier versions: the label is then the key
	// alone.
	Attempt string    `json:"attempt,omitempty"`
	State   string    `json:"state"` // pending | done
	Owner   string    `json:"owner"` // apiserver instance running it
	Started time.Time `json:"started"`
	Expires time.Time `json:"expires"`
	Status  int       `json:"status,omitempty"`
	Type    string    `json:"content_type,omitempty"`
	Body    []byte    `json:"body,omitempty"`
	// TooLarge: done, but the answer was too large to keep.
	TooLarge int `json:"too_large,omitempty"`
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
		rec, run, err := s.claim(r.Context(), rk, hash)
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
		ic := &idemCtx{label: idemLabel(rk, rec.Attempt), takeover: rec.takeover}
		tee := &teeWriter{ResponseWriter: w, status: http.StatusOK}
		h(tee, r.WithContext(context.WithValue(r.Context(), idemCtxKey{}, ic)))
		// The caller has its answer before the record is written: should
		// this apiserver die in between, the record stays pending without
		// a live owner, and a repeat takes it over (and finds what was
		// made).
		tee.Flush()
		s.finish(rk, hash, rec.idemRecord, tee)
	}
}

// idempotentCreate is idempotent(true, h) for a call that makes one
// sandbox (POST /v1/sandboxes), with the claim written while the create
// runs instead of before it: a keyed create then costs what the slower
// of the two costs, not their sum (with etcd, the claim is a raft round
// and an fsync, a third of a create). The answer is held until the claim
// is in. If the claim finds a record (a repeat, which is rare), what this
// attempt made is deleted (it carries this attempt's label, which no
// takeover adopts) and the call goes on as any keyed call that finds a
// record: replayed, waited for, or taken over. A repeat that comes after
// the record is written (the usual retry) is seen before anything runs.
func (s *Server) idempotentCreate(h http.HandlerFunc) http.HandlerFunc {
	slow := s.idempotent(true, h)
	return func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		if key == "" || s.deps.Store == nil || len(key) > maxIdemKey || !printable(key) {
			slow(w, r)
			return
		}
		body, err := io.ReadAll(http.MaxBytesReader(nil, r.Body, maxJSONBody))
		if err != nil {
			s.writeError(w, r, errdefs.Invalid("request body larger than %d bytes", maxJSONBody))
			return
		}
		hash := requestHash(r.Method, r.URL.Path, r.URL.RawQuery, body)
		rk := idemRecordKey(principalID(r), key)
		// A repeat (a retry after a lost answer) finds the record here
		// and runs nothing. A local read: one that misses a record
		// written a moment ago costs a create and its undo, no more.
		if _, err := store.GetLocal(s.deps.Store, idemBucket, rk); !errors.Is(err, errdefs.ErrNotFound) {
			r.Body = io.NopCloser(bytes.NewReader(body))
			slow(w, r)
			return
		}
		mine := s.newClaim(hash, newNonce())
		claimed := make(chan error, 1)
		go func() { claimed <- s.records.create(mine.kv(rk)) }()
		held := newHeldResponse()
		r.Body = io.NopCloser(bytes.NewReader(body))
		ic := &idemCtx{label: idemLabel(rk, mine.Attempt)}
		h(held, r.WithContext(context.WithValue(r.Context(), idemCtxKey{}, ic)))
		err = <-claimed
		if err == nil {
			tee := &teeWriter{ResponseWriter: w, status: http.StatusOK}
			held.writeTo(tee)
			tee.Flush()
			s.finish(rk, hash, mine, tee)
			return
		}
		if id := held.createdID(); id != "" {
			if uerr := s.undoCreate(r.Context(), id); uerr != nil {
				s.log.Warn("deleting the sandbox of a keyed create that lost its claim", "sandbox_id", id, "err", uerr)
				s.writeError(w, r, errdefs.Unavailable("a request with this Idempotency-Key is already recorded, and the sandbox this attempt made (%s) could not be deleted: %v; retry", id, uerr))
				return
			}
			s.log.Info("a keyed create lost its claim to an earlier attempt; its sandbox was deleted", "sandbox_id", id)
		}
		if !errors.Is(err, errdefs.ErrAlreadyExists) {
			s.writeError(w, r, err)
			return
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
		slow(w, r)
	}
}

// undoCreate deletes a sandbox a call made but must not answer with.
func (s *Server) undoCreate(ctx context.Context, id string) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	e, err := s.edgeOf(ctx, id)
	if err != nil {
		return err
	}
	return e.Delete(ctx, id)
}

// heldResponse keeps a small answer (a create's) until it may be sent.
type heldResponse struct {
	header http.Header
	status int
	body   bytes.Buffer
}

func newHeldResponse() *heldResponse {
	return &heldResponse{header: http.Header{}, status: http.StatusOK}
}

func (h *heldResponse) Header() http.Header { return h.header }

func (h *heldResponse) WriteHeader(code int) { h.status = code }

func (h *heldResponse) Write(b []byte) (int, error) { return h.body.Write(b) }

func (h *heldResponse) writeTo(w http.ResponseWriter) {
	for k, v := range h.header {
		w.Header()[k] = v
	}
	w.WriteHeader(h.status)
	_, _ = w.Write(h.body.Bytes())
}

// createdID is the id of the sandbox a 201 answer describes.
func (h *heldResponse) createdID() string {
	if h.status != http.StatusCreated {
		return ""
	}
	var sb struct {
		ID string `json:"id"`
	}
	if json.Unmarshal(h.body.Bytes(), &sb) != nil {
		return ""
	}
	return sb.ID
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
}

// idemLabel is the IdempotencyLabel value of what the holder of record
// rk's attempt makes.
func idemLabel(rk, attempt string) string {
	if attempt == "" {
		return rk[:32]
	}
	return rk[:32] + "-" + attempt
}

// claim makes this apiserver the runner of rk, or returns the record to
// answer from (run false). It waits while a live apiserver runs it.
func (s *Server) claim(ctx context.Context, rk, hash string) (claimed, bool, error) {
	deadline := time.Now().Add(idemWait)
	nonce := newNonce()
	// The common case, a new key, is one write.
	{
		mine := s.newClaim(hash, nonce)
		switch err := s.records.create(mine.kv(rk)); {
		case err == nil:
			return claimed{idemRecord: mine}, true, nil
		case !errors.Is(err, errdefs.ErrAlreadyExists):
			return claimed{}, false, err
		}
	}
	return s.claimSlow(ctx, rk, hash, nonce, deadline)
}

// newClaim is the pending record of a new attempt.
func (s *Server) newClaim(hash, nonce string) idemRecord {
	now := time.Now()
	return idemRecord{Hash: hash, Nonce: nonce, Attempt: nonce, State: "pending", Owner: s.deps.Instance, Started: now, Expires: now.Add(s.idemTTL())}
}

func (r idemRecord) kv(rk string) store.KV {
	b, _ := json.Marshal(r) // plain fields: cannot fail
	return store.KV{Key: rk, Value: b}
}

// claimSlow is claim once the key has a record: answer from it, wait for
// its live owner, or take it over from a dead one.
func (s *Server) claimSlow(ctx context.Context, rk, hash, nonce string, deadline time.Time) (claimed, bool, error) {
	for {
		mine := s.newClaim(hash, nonce)
		now := mine.Started
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
				// Its apiserver is gone: take the call over, with
				// what its attempt made.
				run = true
				mine.Started, mine.Attempt = got.Started, got.Attempt
				b, err := json.Marshal(mine)
				got.takeover = true
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
			continue
		case err != nil:
			return got, false, err
		}
		return got, false, nil
	}
}

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
	w.Header().Set("Idempotent-Replayed", "true")
	if rec.Type != "" {
		w.Header().Set("Content-Type", rec.Type)
	}
	w.WriteHeader(rec.Status)
	_, _ = w.Write(rec.Body)
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
	if outcome == "free" {
		if err := s.deps.Store.Delete(idemBucket, rk); err != nil {
			s.log.Warn("freeing an idempotency key", "err", err)
		}
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
			rec.Body = tee.buf.Bytes()
		}
	}
	b, err := json.Marshal(rec)
	if err != nil {
		s.log.Warn("recording an idempotent answer", "err", err)
		return
	}
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

// janitor deletes expired records now and then. Every apiserver runs one;
// deleting twice is harmless.
func (s *Server) idemJanitor(ctx context.Context) {
	t := time.NewTicker(10 * time.Minute)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		kvs, err := s.deps.Store.List(idemBucket, "")
		if err != nil {
			continue
		}
		now := time.Now()
		n := 0
		for _, kv := range kvs {
			var rec idemRecord
			if json.Unmarshal(kv.Value, &rec) == nil && now.After(rec.Expires) {
				if s.deps.Store.Delete(idemBucket, kv.Key) == nil {
					n++
				}
			}
		}
		if n > 0 {
			s.log.Info("expired idempotency records removed", "count", n)
		}
	}
}

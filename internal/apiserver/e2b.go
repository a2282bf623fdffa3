package apiserver

// The E2B dialect (docs/e2b.md). dsec's listener also serves E2B's
// control plane (REST: /sandboxes, /v2/sandboxes) and its in-sandbox API
// ("envd": Connect RPC under /process.Process/ and /filesystem.Filesystem/,
// plus /files and /health), so the unmodified E2B SDK works with
// E2B_API_URL and E2B_SANDBOX_URL both pointed at dsec. Nothing here is a
// second implementation: every call maps onto the same create, placement,
// edge calls and IAM as the /v1 API, and an E2B sandbox is a dsec sandbox.
//
// Auth: control-plane calls carry a dsec key in X-API-KEY (same IAM,
// same scope). envd calls carry no key: each names its sandbox in the
// E2b-Sandbox-Id header and proves access with X-Access-Token, the
// sandbox's envdAccessToken that create and connect return. The token
// is an HMAC of the sandbox id under a secret the control plane keeps in
// its store (e2bSecret), so every apiserver can check it with no lookup
// and no per-sandbox state.

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/dsecproject/dsec/internal/conns"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/iam"
)

// e2bBucket holds the E2B dialect's control-plane state: the token
// secret and template aliases.
const e2bBucket = "e2b"

// envdPort is the port the SDK names in E2b-Sandbox-Port (and in the
// host name <port>-<id>.<domain>): envd's.
const envdPort = "49983"

// e2bError writes an error in the E2B control plane's shape: the SDK
// branches on the numeric code in the body.
func (s *Server) e2bError(w http.ResponseWriter, r *http.Request, err error) {
	s.noteUnreachable(err)
	code := errdefs.Code(err)
	st := errdefs.HTTPStatus(code)
	msg := err.Error()
	if st == http.StatusInternalServerError {
		msg = s.internalRef(r, err)
	}
	if st == http.StatusTooManyRequests && w.Header().Get("Retry-After") == "" {
		w.Header().Set("Retry-After", "1")
	}
	writeJSON(w, st, map[string]any{"code": st, "message": msg})
}

// e2bHandle registers an E2B control-plane route: the dsec key comes in
// X-API-KEY (or, as on /v1, Authorization: Bearer), as is or in its E2B
// spelling (iam.E2BKey), with the same IAM checks and scope as the /v1
// routes.
func (s *Server) e2bHandle(pattern string, action iam.Action, h http.HandlerFunc) {
	s.actions[pattern] = action
	s.mux.Handle(pattern, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec := &statusRecorder{ResponseWriter: w, status: http.StatusOK}
		defer func() { s.metrics.requests.WithLabelValues(pattern, strconv.Itoa(rec.status)).Inc() }()
		key := r.Header.Get("X-API-KEY")
		found := key != ""
		if !found {
			key, found = bearer(r)
		}
		// Recent E2B SDKs send only keys spelled "e2b_" and hex digits:
		// such a spelling stands for the key it spells.
		if k, ok := iam.FromE2BKey(key); ok {
			key = k
		}
		ctx, ok := s.admit(rec, r, key, found, action, "", s.e2bError)
		if !ok {
			return
		}
		h(rec, r.WithContext(ctx))
	}))
}

type envdSandboxKey struct{}

// envdSignedKey marks an envd request let in by a presigned URL's
// signature rather than the sandbox's token.
type envdSignedKey struct{}

// envdSigned reports whether an envd request was let in by a presigned
// URL: it may act only as the URL says.
func envdSigned(ctx context.Context) bool {
	signed, _ := ctx.Value(envdSignedKey{}).(bool)
	return signed
}

// envdSandbox is the sandbox an envd request was admitted for.
func envdSandbox(ctx context.Context) string {
	id, _ := ctx.Value(envdSandboxKey{}).(string)
	return id
}

// envdHandle registers an envd route. The sandbox is named by the
// E2b-Sandbox-Id header (or a host name <port>-<id>.<domain>, or, for
// URLs that carry no headers, the sandbox query parameter); the request
// must carry that sandbox's access token in X-Access-Token (or the
// access_token query parameter). fail writes a refusal in the route's
// own error shape. The edge calls of the request see only that sandbox
// (a token grants it alone), under the root's scope.
func (s *Server) envdHandle(pattern string, h http.Handler, fail func(http.ResponseWriter, *http.Request, error)) {
	s.actions[pattern] = envdAction
	s.mux.Handle(pattern, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec := &statusRecorder{ResponseWriter: w, status: http.StatusOK}
		defer func() { s.metrics.requests.WithLabelValues(pattern, strconv.Itoa(rec.status)).Inc() }()
		id := envdTarget(r)
		if id == "" {
			fail(rec, r, errdefs.Invalid("no sandbox named: send the E2b-Sandbox-Id header"))
			return
		}
		addr := peer(r)
		if d := s.authFails.wait(addr); d > 0 {
			rec.Header().Set("Retry-After", retryAfter(d))
			hangUp(rec)
			fail(rec, r, errdefs.Unauthenticated("too many failed authentications from %s; retry in %s s", addr, retryAfter(d)))
			return
		}
		tok := r.Header.Get("X-Access-Token")
		if tok == "" {
			tok = r.URL.Query().Get("access_token")
		}
		var ok, signed bool
		var err error
		if q := r.URL.Query(); tok == "" && r.URL.Path == "/files" && q.Get("signature") != "" {
			ok, err = s.checkFileSignature(id, r.Method, q)
			signed = true
		} else {
			ok, err = s.checkEnvdToken(id, tok)
		}
		if err != nil {
			fail(rec, r, err)
			return
		}
		if !ok {
			s.authFails.fail(addr)
			hangUp(rec)
			fail(rec, r, errdefs.Unauthenticated("missing or wrong access token for sandbox %s (X-Access-Token: the envdAccessToken create or connect returned)", id))
			return
		}
		conns.Trust(r.Context())
		ctx := context.WithValue(r.Context(), envdSandboxKey{}, id)
		if signed {
			ctx = context.WithValue(ctx, envdSignedKey{}, true)
		}
		h.ServeHTTP(rec, r.WithContext(ctx))
	}))
}

// envdAction marks envd routes in the route table: they are authorized
// by a sandbox's access token, not by a key's role.
const envdAction iam.Action = "envd:token"

// envdTarget finds the sandbox an envd request is for.
func envdTarget(r *http.Request) string {
	if id := r.Header.Get("E2b-Sandbox-Id"); id != "" {
		return id
	}
	host := r.Host
	if i := strings.IndexByte(host, ':'); i >= 0 {
		host = host[:i]
	}
	if first, _, ok := strings.Cut(host, "."); ok {
		if port, id, ok := strings.Cut(first, "-"); ok && port == envdPort && strings.HasPrefix(id, "sb-") {
			return id
		}
	}
	return r.URL.Query().Get("sandbox")
}

// envdToken returns the access token of sandbox id.
func (s *Server) envdToken(id string) (string, error) {
	key, err := s.e2bSecret()
	if err != nil {
		return "", err
	}
	m := hmac.New(sha256.New, key)
	m.Write([]byte("envd-access-token\x00" + id))
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil)), nil
}

// checkEnvdToken compares tok with sandbox id's token in constant time.
func (s *Server) checkEnvdToken(id, tok string) (bool, error) {
	want, err := s.envdToken(id)
	if err != nil {
		return false, err
	}
	return hmac.Equal([]byte(tok), []byte(want)), nil
}

// e2bSecretState caches the token secret once read.
type e2bSecretState struct {
	mu  sync.Mutex
	key []byte
}

// e2bSecret returns the control plane's token secret, creating it the
// first time any apiserver needs it (the store's create-if-absent
// settles a race between apiservers).
func (s *Server) e2bSecret() ([]byte, error) {
	s.e2bKey.mu.Lock()
	defer s.e2bKey.mu.Unlock()
	if s.e2bKey.key != nil {
		return s.e2bKey.key, nil
	}
	st := s.stateStore()
	if st == nil {
		return nil, errdefs.Precondition("the E2B API needs a control-plane store")
	}
	key, err := st.Get(e2bBucket, "token-secret")
	if errors.Is(err, errdefs.ErrNotFound) {
		fresh := make([]byte, 32)
		if _, err := rand.Read(fresh); err != nil {
			return nil, err
		}
		err = st.Create(e2bBucket, "token-secret", fresh)
		if err == nil {
			key = fresh
		} else if errors.Is(err, errdefs.ErrAlreadyExists) {
			key, err = st.Get(e2bBucket, "token-secret")
		}
	}
	if err != nil {
		return nil, err
	}
	if len(key) < 32 {
		return nil, errors.New("the E2B token secret in the store is too short")
	}
	s.e2bKey.key = key
	return key, nil
}

// envdEdge returns the edge of the envd request's sandbox, and the id.
func (s *Server) envdEdge(ctx context.Context) (edgeapi.Edge, string, error) {
	id := envdSandbox(ctx)
	e, err := s.edgeOf(ctx, id)
	return e, id, err
}

// e2bRoutes registers the E2B dialect's routes.
func (s *Server) e2bRoutes() {
	s.e2bControlRoutes()  // e2b_sandboxes.go
	s.envdProcessRoutes() // envd_process.go
	s.envdFilesRoutes()   // envd_files.go
}

// checkFileSignature checks a presigned /files URL (the SDK's uploadUrl
// and downloadUrl): signature is "v1_" and the unpadded base64 of
// SHA-256("<path>:<read|write>:<username>:<token>[:<expiration>]"), made
// with the sandbox's access token, and signature_expiration, when given,
// is a Unix time not yet past. Such a URL names no sandbox by itself:
// the caller adds sandbox=<id> (docs/e2b.md).
func (s *Server) checkFileSignature(id, method string, q url.Values) (bool, error) {
	op := "read"
	if method == http.MethodPost {
		op = "write"
	}
	tok, err := s.envdToken(id)
	if err != nil {
		return false, err
	}
	raw := q.Get("path") + ":" + op + ":" + q.Get("username") + ":" + tok
	if exp := q.Get("signature_expiration"); exp != "" {
		n, err := strconv.ParseInt(exp, 10, 64)
		if err != nil || time.Now().Unix() > n {
			return false, nil
		}
		raw += ":" + exp
	}
	sum := sha256.Sum256([]byte(raw))
	want := "v1_" + strings.TrimRight(base64.StdEncoding.EncodeToString(sum[:]), "=")
	return hmac.Equal([]byte(q.Get("signature")), []byte(want)), nil
}

// defaultKeepalive is a stream's keepalive interval when the request
// names none.
const defaultKeepalive = 50 * time.Second

// keepaliveInterval is the interval a stream's Keepalive-Ping-Interval
// header names (whole seconds), or defaultKeepalive.
func keepaliveInterval(h http.Header) time.Duration {
	n, err := strconv.Atoi(h.Get("Keepalive-Ping-Interval"))
	if err != nil || n <= 0 {
		return defaultKeepalive
	}
	return time.Duration(min(n, 3600)) * time.Second
}

// streamSender orders the sends of one envd server stream (connect's
// ServerStream is not safe for concurrent use) and, once started, sends a
// keepalive whenever the stream has been silent for the interval the
// request's Keepalive-Ping-Interval header names (undici cuts a body
// silent for 300 s). Stop ends the keepalives and waits for them: a
// stream may not be used once its handler has returned.
type streamSender[M any] struct {
	send     func(M) error
	keep     func() M
	interval time.Duration
	ctx      context.Context
	cancel   context.CancelFunc
	wg       sync.WaitGroup
	started  bool

	mu   sync.Mutex // guards the stream, last and err
	last time.Time
	err  error
}

func newStreamSender[M any](ctx context.Context, h http.Header, send func(M) error, keep func() M) *streamSender[M] {
	ctx, cancel := context.WithCancel(ctx)
	return &streamSender[M]{send: send, keep: keep, interval: keepaliveInterval(h), ctx: ctx, cancel: cancel, last: time.Now()}
}

// Send sends m; after a failed send every later one fails alike.
func (s *streamSender[M]) Send(m M) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil {
		return s.err
	}
	s.last = time.Now()
	s.err = s.send(m)
	return s.err
}

// Err is the first send's error, if any failed.
func (s *streamSender[M]) Err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

// Start starts the keepalives (after the stream's first frame, which
// must be its start event). Only the handler's goroutine calls it.
func (s *streamSender[M]) Start() {
	if s.started {
		return
	}
	s.started = true
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		t := time.NewTimer(s.interval)
		defer t.Stop()
		for {
			select {
			case <-s.ctx.Done():
				return
			case <-t.C:
			}
			s.mu.Lock()
			idle := time.Since(s.last)
			s.mu.Unlock()
			if idle < s.interval {
				t.Reset(s.interval - idle)
				continue
			}
			if s.Send(s.keep()) != nil {
				return
			}
			t.Reset(s.interval)
		}
	}()
}

// Stop ends the keepalives and waits for the last one.
func (s *streamSender[M]) Stop() {
	s.cancel()
	s.wg.Wait()
}

// Package dsec is the public Go client of the dsec REST API (docs/API.md).
//
// A Client is safe for concurrent use and holds one connection pool; create
// one per process and share it, since callers typically drive hundreds of
// concurrent requests against one apiserver. The CLI (cmd/dsec) is built on
// this package only.
//
//	c, err := dsec.FromEnv()
//	sb, err := c.CreateSandbox(ctx, api.SandboxSpec{Base: "base/python:3.11"})
//	res, err := c.Exec(ctx, sb.ID, api.ExecRequest{Cmd: "python -V"})
package dsec

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync/atomic"
	"time"
)

// DefaultEndpoint is used when neither options, environment nor config file
// name an endpoint.
const DefaultEndpoint = "http://127.0.0.1:7070"

// UserAgent is sent with every request.
const UserAgent = "dsec-go/1"

// Client talks to dsec: `dsec up`, or the apiservers of a cluster. Given
// several endpoints it fails over between them: a call that cannot reach
// one apiserver (connection refused or lost, a gateway error) is sent to
// the next, and the client then stays with the one that answered. Calls
// that change state are retried only when that is safe: reads, deletes
// and PUTs are idempotent, and every sandbox create, batch, fork, snapshot
// and fncall carries an Idempotency-Key (the server answers a repeat with
// the recorded result instead of running it again; project and key
// creates carry none, see CreateProject). Exec and session runs
// carry one only when the caller gives it (WithIdempotencyKey), and are
// otherwise sent again only when the first attempt never left.
type Client struct {
	endpoints []string // scheme://host[:port][/prefix], no trailing slash
	cur       atomic.Int32
	apiKey    string
	http      *http.Client
	userAgent string
	// retries bounds the attempts of one call over all endpoints.
	retries int
	// noKeys turns off the automatic Idempotency-Keys.
	noKeys bool
}

// Option configures a Client built by New or FromEnv.
type Option func(*Client) error

// WithEndpoint sets the base URL, e.g. "http://10.0.0.5:7070", or a
// comma-separated list of the apiservers of a cluster to fail over
// between. A bare "host:port" is taken as http.
func WithEndpoint(endpoint string) Option {
	return func(c *Client) error {
		var eps []string
		for _, part := range strings.Split(endpoint, ",") {
			if strings.TrimSpace(part) == "" && strings.Contains(endpoint, ",") {
				continue
			}
			ep, err := normalizeEndpoint(part)
			if err != nil {
				return err
			}
			eps = append(eps, ep)
		}
		if len(eps) == 0 {
			return fmt.Errorf("empty endpoint")
		}
		c.endpoints = eps
		c.cur.Store(0)
		return nil
	}
}

// WithoutIdempotencyKeys stops the client from putting a fresh
// Idempotency-Key on creates, batches, forks, snapshots and fncalls (each
// costs the server a record write). Those calls are then sent again only
// when the first attempt never left; a key given with WithIdempotencyKey
// is still sent.
func WithoutIdempotencyKeys() Option {
	return func(c *Client) error {
		c.noKeys = true
		return nil
	}
}

// WithRetries bounds the attempts of one call over all endpoints (default:
// twice the number of endpoints, at least 3; 1 turns retries off).
func WithRetries(n int) Option {
	return func(c *Client) error {
		if n < 1 {
			return fmt.Errorf("WithRetries(%d): want at least 1", n)
		}
		c.retries = n
		return nil
	}
}

// WithAPIKey sets the key sent as "Authorization: Bearer <key>".
func WithAPIKey(key string) Option {
	return func(c *Client) error {
		c.apiKey = key
		return nil
	}
}

// WithHTTPClient replaces the tuned default http.Client. The caller then owns
// connection pooling and timeouts; note that exec and streaming calls can run
// for as long as the command does, so a Client.Timeout cuts them short.
func WithHTTPClient(hc *http.Client) Option {
	return func(c *Client) error {
		if hc == nil {
			return fmt.Errorf("WithHTTPClient: nil http.Client")
		}
		c.http = hc
		return nil
	}
}

// WithUserAgent overrides the User-Agent header.
func WithUserAgent(ua string) Option {
	return func(c *Client) error {
		c.userAgent = ua
		return nil
	}
}

// New builds a Client from options alone; see FromEnv for the usual way.
func New(opts ...Option) (*Client, error) {
	c := &Client{
		endpoints: []string{DefaultEndpoint},
		http:      &http.Client{Transport: newTransport()},
		userAgent: UserAgent,
	}
	for _, o := range opts {
		if err := o(c); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// Endpoint returns the base URL the client sends requests to now.
func (c *Client) Endpoint() string { return c.endpoints[int(c.cur.Load())%len(c.endpoints)] }

// Endpoints returns every endpoint the client fails over between.
func (c *Client) Endpoints() []string { return append([]string(nil), c.endpoints...) }

// newTransport is http.DefaultTransport tuned for many concurrent requests to
// one host: the default keeps only 2 idle connections per host, so a burst of
// a few hundred parallel execs would otherwise open and close a connection
// per request and run the client out of ephemeral ports.
func newTransport() *http.Transport {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.MaxIdleConns = 1024
	t.MaxIdleConnsPerHost = 256
	t.IdleConnTimeout = 90 * time.Second
	t.DialContext = (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext
	return t
}

func normalizeEndpoint(s string) (string, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return "", fmt.Errorf("empty endpoint")
	}
	if !strings.Contains(s, "://") {
		s = "http://" + s
	}
	u, err := url.Parse(s)
	if err != nil {
		return "", fmt.Errorf("parsing endpoint %q: %w", s, err)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return "", fmt.Errorf("endpoint %q: scheme must be http or https", s)
	}
	if u.Host == "" {
		return "", fmt.Errorf("endpoint %q has no host", s)
	}
	if u.RawQuery != "" || u.Fragment != "" {
		return "", fmt.Errorf("endpoint %q must not have a query or fragment", s)
	}
	return strings.TrimRight(u.String(), "/"), nil
}

// esc escapes one path segment. Refs ("base/python:3.11") contain '/', which
// PathEscape turns into %2F so the server's router sees a single segment.
func esc(s string) string { return url.PathEscape(s) }

// request describes one API call.
type request struct {
	method      string
	path        string // already escaped, starting with "/"
	query       url.Values
	body        io.Reader // raw body; nil if jsonBody is used or no body
	jsonBody    any
	contentType string
	accept      string
	// keyed marks the calls that carry an Idempotency-Key (creates and
	// the like), which makes a POST safe to send again. keyedIfAsked marks
	// those that carry one only when the caller chose it
	// (WithIdempotencyKey): exec and session runs, which are not sent
	// twice otherwise, so that they cost no record in the store.
	keyed, keyedIfAsked bool
}

// HeaderIdempotencyKey is the header of a retry-safe mutating call.
const HeaderIdempotencyKey = "Idempotency-Key"

type idemKey struct{}

// WithIdempotencyKey makes the calls made with ctx send key as their
// Idempotency-Key instead of a fresh random one: a caller that retries a
// whole operation itself (after its own process restarted, say) gets the
// first attempt's answer. Exec and session runs carry a key only this
// way (they are then also retried after a lost answer). Use it for one
// call at a time.
func WithIdempotencyKey(ctx context.Context, key string) context.Context {
	return context.WithValue(ctx, idemKey{}, key)
}

func newIdempotencyKey() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return "dsec-" + hex.EncodeToString(b[:])
}

// send performs req and returns the response if its status is 2xx; any other
// status is turned into an *Error and the body is closed. The caller closes
// the returned body (with drainClose, so the connection is reused). A call
// that could not reach an apiserver is sent to the next endpoint when that
// is safe (see Client).
func (c *Client) send(ctx context.Context, r request) (*http.Response, error) {
	var body []byte
	if r.jsonBody != nil {
		b, err := json.Marshal(r.jsonBody)
		if err != nil {
			return nil, fmt.Errorf("encoding request: %w", err)
		}
		body = b
		r.contentType = "application/json"
	}
	key := ""
	if r.keyed || r.keyedIfAsked {
		if k, ok := ctx.Value(idemKey{}).(string); ok && k != "" {
			key = k
		} else if r.keyed && !c.noKeys {
			key = newIdempotencyKey()
		}
	}
	safe := r.method == http.MethodGet || r.method == http.MethodHead || r.method == http.MethodDelete ||
		r.method == http.MethodPut || key != ""
	rewind, replayable := rewinder(r.body)
	attempts := c.retries
	if attempts == 0 {
		attempts = max(3, 2*len(c.endpoints))
	}
	if !replayable {
		attempts = 1
	}
	start := int(c.cur.Load())
	var lastErr error
	for i := range attempts {
		if i > 0 {
			if err := sleepCtx(ctx, backoff(i)); err != nil {
				return nil, lastErr
			}
			if err := rewind(); err != nil {
				return nil, lastErr
			}
		}
		idx := (start + i) % len(c.endpoints)
		var rd io.Reader = r.body
		if body != nil {
			rd = bytes.NewReader(body)
		} else if _, closes := r.body.(io.Closer); closes && replayable && attempts > 1 {
			// The transport closes a body it is given, on failure too:
			// a file to send again must stay open.
			rd = struct{ io.Reader }{r.body}
		}
		resp, err := c.sendTo(ctx, c.endpoints[idx], r, rd, key)
		if err == nil {
			if idx != start {
				c.cur.Store(int32(idx))
			}
			return resp, nil
		}
		lastErr = err
		// An unsafe call goes again only if it never left (no
		// connection): the server did nothing of it.
		if ctx.Err() != nil || !failover(err) || !safe && !neverSent(err) {
			return nil, err
		}
		// The next calls start at the next endpoint too, rather than
		// each trying this one first.
		if failover(err) {
			c.cur.CompareAndSwap(int32(idx), int32((idx+1)%len(c.endpoints)))
		}
	}
	return nil, lastErr
}

// sendTo sends one attempt of r to endpoint.
func (c *Client) sendTo(ctx context.Context, endpoint string, r request, body io.Reader, key string) (*http.Response, error) {
	u := endpoint + r.path
	if len(r.query) > 0 {
		u += "?" + r.query.Encode()
	}
	req, err := http.NewRequestWithContext(ctx, r.method, u, body)
	if err != nil {
		return nil, fmt.Errorf("building request: %w", err)
	}
	if r.contentType != "" {
		req.Header.Set("Content-Type", r.contentType)
	}
	if r.accept != "" {
		req.Header.Set("Accept", r.accept)
	} else {
		req.Header.Set("Accept", "application/json")
	}
	if key != "" {
		req.Header.Set(HeaderIdempotencyKey, key)
	}
	if c.apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+c.apiKey)
	}
	if c.userAgent != "" {
		req.Header.Set("User-Agent", c.userAgent)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, &transportError{endpoint: endpoint, err: err}
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		defer drainClose(resp.Body)
		return nil, errorFromResponse(resp)
	}
	return resp, nil
}

// transportError is a call that got no answer from an apiserver.
type transportError struct {
	endpoint string
	err      error
}

func (e *transportError) Error() string { return e.err.Error() }
func (e *transportError) Unwrap() error { return e.err }

// failover reports whether err says the apiserver itself could not be
// reached or did not answer, so that another one may: no connection, or a
// gateway's 502/503/504 without a dsec error body. A dsec error (even a
// 503 unavailable: the sandbox's node is down) is the cluster's answer.
func failover(err error) bool {
	var te *transportError
	if errors.As(err, &te) {
		return true
	}
	var ae *Error
	if errors.As(err, &ae) && ae.guessed {
		switch ae.Status {
		case http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
			return true
		}
	}
	return false
}

// neverSent reports whether err says the request could not be sent at
// all (the connection was refused or could not be made).
func neverSent(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}

func backoff(attempt int) time.Duration {
	return min(time.Duration(attempt)*50*time.Millisecond, 500*time.Millisecond)
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// rewinder returns how to send a raw body again from where it starts
// now, and whether that is possible (no body, or one that can seek).
func rewinder(r io.Reader) (func() error, bool) {
	if r == nil {
		return func() error { return nil }, true
	}
	s, ok := r.(io.Seeker)
	if !ok {
		return nil, false
	}
	at, err := s.Seek(0, io.SeekCurrent)
	if err != nil {
		return nil, false
	}
	return func() error {
		_, err := s.Seek(at, io.SeekStart)
		return err
	}, true
}

// call performs r and decodes a JSON response into out (if out is non-nil).
func (c *Client) call(ctx context.Context, r request, out any) error {
	resp, err := c.send(ctx, r)
	if err != nil {
		return err
	}
	defer drainClose(resp.Body)
	if out == nil {
		return nil
	}
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		return fmt.Errorf("decoding response of %s %s: %w", r.method, r.path, err)
	}
	return nil
}

// drainClose reads what is left of a body (up to a bound) before closing it:
// net/http only returns a connection to the pool once its body hit EOF.
func drainClose(rc io.ReadCloser) {
	_, _ = io.Copy(io.Discard, io.LimitReader(rc, 256<<10))
	_ = rc.Close()
}

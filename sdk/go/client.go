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
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"
)

// DefaultEndpoint is used when neither options, environment nor config file
// name an endpoint.
const DefaultEndpoint = "http://127.0.0.1:7070"

// UserAgent is sent with every request.
const UserAgent = "dsec-go/1"

// Client talks to one dsec apiserver (or `dsec up`).
type Client struct {
	endpoint  string // scheme://host[:port][/prefix], no trailing slash
	apiKey    string
	http      *http.Client
	userAgent string
}

// Option configures a Client built by New or FromEnv.
type Option func(*Client) error

// WithEndpoint sets the base URL, e.g. "http://10.0.0.5:7070". A bare
// "host:port" is taken as http.
func WithEndpoint(endpoint string) Option {
	return func(c *Client) error {
		ep, err := normalizeEndpoint(endpoint)
		if err != nil {
			return err
		}
		c.endpoint = ep
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
		endpoint:  DefaultEndpoint,
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

// Endpoint returns the base URL the client sends requests to.
func (c *Client) Endpoint() string { return c.endpoint }

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
}

// send performs req and returns the response if its status is 2xx; any other
// status is turned into an *Error and the body is closed. The caller closes
// the returned body (with drainClose, so the connection is reused).
func (c *Client) send(ctx context.Context, r request) (*http.Response, error) {
	u := c.endpoint + r.path
	if len(r.query) > 0 {
		u += "?" + r.query.Encode()
	}
	body := r.body
	ctype := r.contentType
	if r.jsonBody != nil {
		b, err := json.Marshal(r.jsonBody)
		if err != nil {
			return nil, fmt.Errorf("encoding request: %w", err)
		}
		body = bytes.NewReader(b)
		ctype = "application/json"
	}
	req, err := http.NewRequestWithContext(ctx, r.method, u, body)
	if err != nil {
		return nil, fmt.Errorf("building request: %w", err)
	}
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	if r.accept != "" {
		req.Header.Set("Accept", r.accept)
	} else {
		req.Header.Set("Accept", "application/json")
	}
	if c.apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+c.apiKey)
	}
	if c.userAgent != "" {
		req.Header.Set("User-Agent", c.userAgent)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		defer drainClose(resp.Body)
		return nil, errorFromResponse(resp)
	}
	return resp, nil
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

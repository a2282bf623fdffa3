package edgeapi

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"os"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// Client is an Edge reached over the internal API. It is safe for
// concurrent use.
type Client struct {
	name string
	base string // scheme://host:port, no trailing slash
	hc   *http.Client
}

var _ Edge = (*Client)(nil)

// NewClient returns the edge named name whose internal API is at base
// (https://host:port in a cluster). hc carries the transport (the cluster
// certificates); it must not set a Timeout, since exec and streams last as
// long as their command.
func NewClient(name, base string, hc *http.Client) *Client {
	return &Client{name: name, base: base, hc: hc}
}

// Name implements Edge.
func (c *Client) Name() string { return c.name }

// Unreachable is the error of a call that could not reach the edge (or
// lost it before the answer). It is an errdefs.ErrUnavailable.
type Unreachable struct {
	Node string
	Err  error
	// NotSent says the request never left: the connection could not be
	// made, so the edge did nothing of it.
	NotSent bool
}

func (e *Unreachable) Error() string {
	if errors.Is(e.Err, ErrRevoked) {
		return fmt.Sprintf("node %s is refused: %v", e.Node, e.Err)
	}
	return fmt.Sprintf("node %s cannot be reached now (retry later): %v", e.Node, e.Err)
}

// ErrRevoked is in the error of a call refused because the node's
// certificate was revoked: no retry reaches that node until it has a new
// one.
var ErrRevoked = errors.New("dsec cluster revoke-edge")

// Is makes Unreachable an errdefs.ErrUnavailable.
func (e *Unreachable) Is(target error) bool { return target == errdefs.ErrUnavailable }

// Unwrap returns the transport's error.
func (e *Unreachable) Unwrap() error { return e.Err }

// IsUnreachable reports whether err says the edge could not be reached,
// rather than that the edge answered with an error.
func IsUnreachable(err error) bool {
	var u *Unreachable
	return errors.As(err, &u)
}

// call describes one request.
type call struct {
	method string
	path   string // after Prefix, already escaped
	query  url.Values
	json   any       // request body as JSON, or
	body   io.Reader // a raw body
	header http.Header
}

func esc(s string) string { return url.PathEscape(s) }

func sbPath(id string, rest string) string { return "/sandboxes/" + esc(id) + rest }

// do sends c and returns the response if it is 2xx (or 101); any other
// status becomes the classified error of its body.
func (c *Client) do(ctx context.Context, cl call) (*http.Response, error) {
	u := c.base + Prefix + cl.path
	if len(cl.query) > 0 {
		u += "?" + cl.query.Encode()
	}
	body := cl.body
	if cl.json != nil {
		b, err := json.Marshal(cl.json)
		if err != nil {
			return nil, fmt.Errorf("encoding internal request: %w", err)
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, cl.method, u, body)
	if err != nil {
		return nil, fmt.Errorf("building internal request: %w", err)
	}
	for k, v := range cl.header {
		req.Header[k] = v
	}
	if sc := ScopeOf(ctx); sc != "" {
		req.Header.Set(ScopeHeader, sc)
	}
	if cl.json != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	// Not sent: the connection could not be made, or its TLS handshake
	// failed (the edge's certificate refused: another host at the node's
	// address). A request the transport may send again (Idempotency-Key)
	// can fail so after an earlier attempt was written: it was sent all
	// the same.
	var wrote, handshakeFailed atomic.Bool
	req = req.WithContext(httptrace.WithClientTrace(req.Context(), &httptrace.ClientTrace{
		WroteRequest: func(i httptrace.WroteRequestInfo) {
			if i.Err == nil {
				wrote.Store(true)
			}
		},
		TLSHandshakeDone: func(_ tls.ConnectionState, err error) {
			if err != nil {
				handshakeFailed.Store(true)
			}
		},
	}))
	resp, err := c.hc.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		var op *net.OpError
		dialed := errors.As(err, &op) && op.Op == "dial"
		return nil, &Unreachable{Node: c.name, Err: err, NotSent: (dialed || handshakeFailed.Load()) && !wrote.Load()}
	}
	if resp.StatusCode/100 == 2 || resp.StatusCode == http.StatusSwitchingProtocols {
		return resp, nil
	}
	defer drain(resp.Body)
	return nil, c.errorOf(resp)
}

// errorOf rebuilds the classified error of a non-2xx answer.
func (c *Client) errorOf(resp *http.Response) error {
	var eb api.ErrorBody
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if err := json.Unmarshal(b, &eb); err != nil || eb.Error.Code == "" {
		return &Unreachable{Node: c.name, Err: fmt.Errorf("HTTP %d without an error body: %.200q", resp.StatusCode, b)}
	}
	return errdefs.FromCode(eb.Error.Code, eb.Error.Message)
}

func drain(rc io.ReadCloser) {
	_, _ = io.Copy(io.Discard, io.LimitReader(rc, 256<<10))
	_ = rc.Close()
}

// roundTrip sends cl and decodes the JSON answer into out (if not nil).
func (c *Client) roundTrip(ctx context.Context, cl call, out any) error {
	resp, err := c.do(ctx, cl)
	if err != nil {
		return err
	}
	defer drain(resp.Body)
	if out == nil || resp.StatusCode == http.StatusNoContent {
		return nil
	}
	switch out.(type) {
	case *api.ExecResult, *api.FnCallResult:
		if err := readOutputFrame(resp, out); err != nil {
			return &Unreachable{Node: c.name, Err: fmt.Errorf("reading the answer to %s %s: %w", cl.method, cl.path, err)}
		}
		return nil
	}
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		return &Unreachable{Node: c.name, Err: fmt.Errorf("reading the answer to %s %s: %w", cl.method, cl.path, err)}
	}
	return nil
}

// Info implements Edge.
func (c *Client) Info(ctx context.Context) (api.Node, error) {
	var n api.Node
	err := c.roundTrip(ctx, call{method: "GET", path: "/info"}, &n)
	return n, err
}

// LayerUsers implements Edge.
func (c *Client) LayerUsers(ctx context.Context, digest string) (int, error) {
	var b usersBody
	err := c.roundTrip(ctx, call{method: "GET", path: "/layers/" + esc(digest) + "/users"}, &b)
	return b.Users, err
}

// Create implements Edge.
func (c *Client) Create(ctx context.Context, req CreateRequest) (*api.Sandbox, error) {
	var sb api.Sandbox
	cl := call{method: "POST", path: "/sandboxes", json: req}
	if req.Token != "" {
		// net/http resends a request with this header when its reused
		// connection fails before an answer: the token makes that safe.
		cl.header = http.Header{"Idempotency-Key": {req.Token}}
	}
	if err := c.roundTrip(ctx, cl, &sb); err != nil {
		return nil, err
	}
	return &sb, nil
}

// Get implements Edge.
func (c *Client) Get(ctx context.Context, id string) (*api.Sandbox, error) {
	var sb api.Sandbox
	if err := c.roundTrip(ctx, call{method: "GET", path: sbPath(id, "")}, &sb); err != nil {
		return nil, err
	}
	return &sb, nil
}

// List implements Edge.
func (c *Client) List(ctx context.Context, f ListFilter) ([]api.Sandbox, error) {
	var b listBody
	if err := c.roundTrip(ctx, call{method: "POST", path: "/sandboxes:list", json: f}, &b); err != nil {
		return nil, err
	}
	return b.Sandboxes, nil
}

// Delete implements Edge.
func (c *Client) Delete(ctx context.Context, id string) error {
	// A delete is idempotent (an absent sandbox is deleted already): the
	// transport may send it again when its kept-alive connection failed
	// before an answer. (An Idempotency-Key without a value marks the
	// request so and is not sent.)
	return c.roundTrip(ctx, call{method: "DELETE", path: sbPath(id, ""), header: http.Header{"Idempotency-Key": nil}}, nil)
}

func (c *Client) byLabels(ctx context.Context, verb string, sel map[string]string) (int, error) {
	var b countBody
	resp, err := c.do(ctx, call{method: "POST", path: "/sandboxes:" + verb, json: labelsBody{Labels: sel}})
	if err != nil {
		return 0, err
	}
	defer drain(resp.Body)
	if err := json.NewDecoder(resp.Body).Decode(&b); err != nil {
		return 0, &Unreachable{Node: c.name, Err: err}
	}
	return b.Count, nil
}

// DeleteByLabels implements Edge.
func (c *Client) DeleteByLabels(ctx context.Context, sel map[string]string) (int, error) {
	return c.byLabels(ctx, "delete", sel)
}

// PauseByLabels implements Edge.
func (c *Client) PauseByLabels(ctx context.Context, sel map[string]string) (int, error) {
	return c.byLabels(ctx, "pause", sel)
}

// ResumeByLabels implements Edge.
func (c *Client) ResumeByLabels(ctx context.Context, sel map[string]string) (int, error) {
	return c.byLabels(ctx, "resume", sel)
}

// Keepalive implements Edge.
func (c *Client) Keepalive(ctx context.Context, id string, ttl int64) (*api.Sandbox, error) {
	var sb api.Sandbox
	if err := c.roundTrip(ctx, call{method: "POST", path: sbPath(id, "/keepalive"), json: ttlBody{TTL: ttl}}, &sb); err != nil {
		return nil, err
	}
	return &sb, nil
}

// Stats implements Edge.
func (c *Client) Stats(ctx context.Context, id string) (*api.Stats, error) {
	var st api.Stats
	if err := c.roundTrip(ctx, call{method: "GET", path: sbPath(id, "/stats")}, &st); err != nil {
		return nil, err
	}
	return &st, nil
}

// Pause implements Edge.
func (c *Client) Pause(ctx context.Context, id string) (*api.PauseResult, error) {
	var res api.PauseResult
	if err := c.roundTrip(ctx, call{method: "POST", path: sbPath(id, "/pause")}, &res); err != nil {
		return nil, err
	}
	return &res, nil
}

// Resume implements Edge.
func (c *Client) Resume(ctx context.Context, id string) (*api.Sandbox, error) {
	var sb api.Sandbox
	if err := c.roundTrip(ctx, call{method: "POST", path: sbPath(id, "/resume")}, &sb); err != nil {
		return nil, err
	}
	return &sb, nil
}

// Snapshot implements Edge.
func (c *Client) Snapshot(ctx context.Context, id string, o SnapshotOptions) (*SnapshotResult, error) {
	var res SnapshotResult
	if err := c.roundTrip(ctx, call{method: "POST", path: sbPath(id, "/snapshot"), json: o}, &res); err != nil {
		return nil, err
	}
	return &res, nil
}

// SetNetwork implements Edge.
func (c *Client) SetNetwork(ctx context.Context, id string, np api.NetworkPolicy) (*api.Sandbox, error) {
	var sb api.Sandbox
	if err := c.roundTrip(ctx, call{method: "PUT", path: sbPath(id, "/network"), json: np}, &sb); err != nil {
		return nil, err
	}
	return &sb, nil
}

// FnCall implements Edge.
func (c *Client) FnCall(ctx context.Context, req api.FnCallRequest, cr CreateRequest) (*api.FnCallResult, error) {
	var res api.FnCallResult
	if err := c.roundTrip(ctx, call{method: "POST", path: "/fncall", json: fnCallBody{Request: req, Create: cr}}, &res); err != nil {
		return nil, err
	}
	return &res, nil
}

// DialPort implements Edge: the connection is an upgraded internal API
// request, spliced by the edge to the sandbox's port.
func (c *Client) DialPort(ctx context.Context, id string, port int) (net.Conn, func(), error) {
	h := http.Header{}
	h.Set("Connection", "Upgrade")
	h.Set("Upgrade", upgradePort)
	resp, err := c.do(ctx, call{method: "GET", path: sbPath(id, "/ports/"+strconv.Itoa(port)), header: h})
	if err != nil {
		return nil, nil, err
	}
	rwc, ok := resp.Body.(io.ReadWriteCloser)
	if resp.StatusCode != http.StatusSwitchingProtocols || !ok {
		drain(resp.Body)
		return nil, nil, &Unreachable{Node: c.name, Err: fmt.Errorf("port connection: HTTP %d, not an upgrade", resp.StatusCode)}
	}
	return &streamConn{rwc: rwc}, func() {}, nil
}

// streamConn is an upgraded connection as a net.Conn. Deadlines are not
// supported (the proxies using it rely on contexts and Close).
type streamConn struct{ rwc io.ReadWriteCloser }

func (s *streamConn) Read(p []byte) (int, error)       { return s.rwc.Read(p) }
func (s *streamConn) Write(p []byte) (int, error)      { return s.rwc.Write(p) }
func (s *streamConn) Close() error                     { return s.rwc.Close() }
func (s *streamConn) LocalAddr() net.Addr              { return streamAddr{} }
func (s *streamConn) RemoteAddr() net.Addr             { return streamAddr{} }
func (s *streamConn) SetDeadline(time.Time) error      { return nil }
func (s *streamConn) SetReadDeadline(time.Time) error  { return nil }
func (s *streamConn) SetWriteDeadline(time.Time) error { return nil }

type streamAddr struct{}

func (streamAddr) Network() string { return "dsec-port" }
func (streamAddr) String() string  { return "sandbox-port" }

// Exec implements Edge.
func (c *Client) Exec(ctx context.Context, id string, req api.ExecRequest, emit func(api.ExecEvent) error) (*api.ExecResult, error) {
	if emit == nil {
		var res api.ExecResult
		if err := c.roundTrip(ctx, call{method: "POST", path: sbPath(id, "/exec"), json: req}, &res); err != nil {
			return nil, err
		}
		return &res, nil
	}
	resp, err := c.do(ctx, call{method: "POST", path: sbPath(id, "/exec"), query: url.Values{"stream": {"1"}}, json: req})
	if err != nil {
		return nil, err
	}
	defer drain(resp.Body)
	sc := bufio.NewScanner(resp.Body)
	// One event holds at most one read of output, JSON-escaped.
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	for sc.Scan() {
		var ev wireEvent
		if err := json.Unmarshal(sc.Bytes(), &ev); err != nil {
			return nil, &Unreachable{Node: c.name, Err: fmt.Errorf("decoding a streamed event: %w", err)}
		}
		switch {
		case ev.Error != nil:
			return nil, errdefs.FromCode(ev.Error.Code, ev.Error.Message)
		case ev.Result != nil:
			return ev.Result, nil
		case ev.Event != nil:
			if err := emit(*ev.Event); err != nil {
				return nil, err
			}
		}
	}
	err = sc.Err()
	if err == nil {
		err = io.ErrUnexpectedEOF
	}
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	return nil, &Unreachable{Node: c.name, Err: fmt.Errorf("exec stream ended early: %w", err)}
}

// OpenSession implements Edge.
func (c *Client) OpenSession(ctx context.Context, id string, req api.SessionRequest) (*api.Session, error) {
	var ss api.Session
	if err := c.roundTrip(ctx, call{method: "POST", path: sbPath(id, "/sessions"), json: req}, &ss); err != nil {
		return nil, err
	}
	return &ss, nil
}

// RunInSession implements Edge.
func (c *Client) RunInSession(ctx context.Context, id, sid string, req api.SessionRunRequest) (*api.ExecResult, error) {
	var res api.ExecResult
	if err := c.roundTrip(ctx, call{method: "POST", path: sbPath(id, "/sessions/"+esc(sid)+"/run"), json: req}, &res); err != nil {
		return nil, err
	}
	return &res, nil
}

// CloseSession implements Edge.
func (c *Client) CloseSession(ctx context.Context, id, sid string) error {
	return c.roundTrip(ctx, call{method: "DELETE", path: sbPath(id, "/sessions/"+esc(sid))}, nil)
}

func pathQuery(p string) url.Values { return url.Values{"path": {p}} }

// ReadFile implements Edge: the body streams from the edge.
func (c *Client) ReadFile(ctx context.Context, id, path string) (io.ReadCloser, api.FileEntry, error) {
	resp, err := c.do(ctx, call{method: "GET", path: sbPath(id, "/files"), query: pathQuery(path)})
	if err != nil {
		return nil, api.FileEntry{}, err
	}
	var fe api.FileEntry
	b, err := base64.StdEncoding.DecodeString(resp.Header.Get(headerFileEntry))
	if err == nil {
		err = json.Unmarshal(b, &fe)
	}
	if err != nil {
		drain(resp.Body)
		return nil, api.FileEntry{}, &Unreachable{Node: c.name, Err: fmt.Errorf("reading a file: bad %s header: %w", headerFileEntry, err)}
	}
	return &bodyReader{c: c, rc: resp.Body}, fe, nil
}

// bodyReader turns a transport error mid-body into Unreachable.
type bodyReader struct {
	c  *Client
	rc io.ReadCloser
}

func (b *bodyReader) Read(p []byte) (int, error) {
	n, err := b.rc.Read(p)
	if err != nil && err != io.EOF {
		err = &Unreachable{Node: b.c.name, Err: err}
	}
	return n, err
}

func (b *bodyReader) Close() error { return b.rc.Close() }

// WriteFile implements Edge: data streams to the edge.
func (c *Client) WriteFile(ctx context.Context, id, path string, data io.Reader, mode os.FileMode, owner string) (api.FileEntry, error) {
	q := ownerQuery(path, owner)
	q.Set("mode", strconv.FormatUint(uint64(mode), 10))
	var fe api.FileEntry
	err := c.roundTrip(ctx, call{method: "PUT", path: sbPath(id, "/files"), query: q, body: nonNilBody(data)}, &fe)
	return fe, err
}

// ownerQuery is the query of a call that creates files: the path, and
// the owner when there is one.
func ownerQuery(path, owner string) url.Values {
	q := pathQuery(path)
	if owner != "" {
		q.Set("owner", owner)
	}
	return q
}

// nonNilBody keeps a nil reader from making a request without a body.
func nonNilBody(r io.Reader) io.Reader {
	if r == nil {
		return http.NoBody
	}
	return r
}

// StatFile implements Edge.
func (c *Client) StatFile(ctx context.Context, id, path string) (api.FileEntry, error) {
	var fe api.FileEntry
	err := c.roundTrip(ctx, call{method: "GET", path: sbPath(id, "/files:stat"), query: pathQuery(path)}, &fe)
	return fe, err
}

// ListFiles implements Edge.
func (c *Client) ListFiles(ctx context.Context, id, path string, depth int) ([]api.FileEntry, error) {
	q := pathQuery(path)
	q.Set("depth", strconv.Itoa(depth))
	var b filesBody
	if err := c.roundTrip(ctx, call{method: "GET", path: sbPath(id, "/files:list"), query: q}, &b); err != nil {
		return nil, err
	}
	return b.Entries, nil
}

// RemoveFile implements Edge.
func (c *Client) RemoveFile(ctx context.Context, id, path string, recursive bool) error {
	q := pathQuery(path)
	if recursive {
		q.Set("recursive", "1")
	}
	return c.roundTrip(ctx, call{method: "DELETE", path: sbPath(id, "/files"), query: q}, nil)
}

// WriteTar implements Edge: the archive streams from the edge to w, and
// an error the edge met after it began arrives in the trailer.
func (c *Client) WriteTar(ctx context.Context, id, path string, w io.Writer) error {
	resp, err := c.do(ctx, call{method: "GET", path: sbPath(id, "/files:tar"), query: pathQuery(path)})
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if _, err := io.Copy(w, &bodyReader{c: c, rc: resp.Body}); err != nil {
		return err
	}
	if t := resp.Trailer.Get(trailerError); t != "" {
		var ed api.ErrorDetail
		if b, err := base64.StdEncoding.DecodeString(t); err == nil && json.Unmarshal(b, &ed) == nil {
			return errdefs.FromCode(ed.Code, ed.Message)
		}
		return &Unreachable{Node: c.name, Err: errors.New("tar stream broken (unreadable trailer)")}
	}
	return nil
}

// ExtractTar implements Edge: rd streams to the edge.
func (c *Client) ExtractTar(ctx context.Context, id, path string, rd io.Reader, owner string) (api.TarResult, error) {
	var res api.TarResult
	err := c.roundTrip(ctx, call{method: "PUT", path: sbPath(id, "/files:tar"), query: ownerQuery(path, owner), body: nonNilBody(rd)}, &res)
	return res, err
}

// MakeDir implements Edge.
func (c *Client) MakeDir(ctx context.Context, id, path, owner string) (api.FileEntry, error) {
	var fe api.FileEntry
	err := c.roundTrip(ctx, call{method: "POST", path: sbPath(id, "/files:mkdir"), query: ownerQuery(path, owner)}, &fe)
	return fe, err
}

// MoveFile implements Edge.
func (c *Client) MoveFile(ctx context.Context, id, src, dst string) (api.FileEntry, error) {
	var fe api.FileEntry
	err := c.roundTrip(ctx, call{method: "POST", path: sbPath(id, "/files:move"), json: moveBody{Source: src, Destination: dst}}, &fe)
	return fe, err
}

// maxWatchLine bounds one line of a streamed watch: an event names one
// entry, whose paths are at most files.MaxPathLen bytes each (JSON
// escaping may multiply them by six).
const maxWatchLine = 1 << 20

// WatchDir implements Edge: the edge streams the events as NDJSON lines.
func (c *Client) WatchDir(ctx context.Context, id, path string, recursive bool, emit func(api.FileEvent) error) error {
	q := pathQuery(path)
	if recursive {
		q.Set("recursive", "1")
	}
	resp, err := c.do(ctx, call{method: "GET", path: sbPath(id, "/files:watch"), query: q})
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 16<<10), maxWatchLine)
	for sc.Scan() {
		var ev wireFileEvent
		if err := json.Unmarshal(sc.Bytes(), &ev); err != nil {
			return &Unreachable{Node: c.name, Err: fmt.Errorf("decoding a watch event: %w", err)}
		}
		switch {
		case ev.Error != nil:
			return errdefs.FromCode(ev.Error.Code, ev.Error.Message)
		case ev.End:
			return nil
		case ev.Event != nil:
			if err := emit(*ev.Event); err != nil {
				return err
			}
		}
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	err = sc.Err()
	if err == nil {
		err = io.ErrUnexpectedEOF
	}
	return &Unreachable{Node: c.name, Err: fmt.Errorf("watch stream ended early: %w", err)}
}

// ReadLog implements Edge.
func (c *Client) ReadLog(ctx context.Context, id string, sinceSeq int64, limit int) (*api.LogPage, error) {
	q := url.Values{"since_seq": {strconv.FormatInt(sinceSeq, 10)}, "limit": {strconv.Itoa(limit)}}
	var page api.LogPage
	if err := c.roundTrip(ctx, call{method: "GET", path: sbPath(id, "/log"), query: q}, &page); err != nil {
		return nil, err
	}
	return &page, nil
}

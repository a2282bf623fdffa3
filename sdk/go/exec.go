package dsec

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"syscall"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// Exec runs one command and waits for it. A command that exits non-zero or
// times out is not an error: see the result's ExitCode and TimedOut.
func (c *Client) Exec(ctx context.Context, id string, req api.ExecRequest) (*api.ExecResult, error) {
	var res api.ExecResult
	if err := c.call(ctx, request{method: http.MethodPost, path: "/v1/sandboxes/" + esc(id) + "/exec", jsonBody: req, keyedIfAsked: true}, &res); err != nil {
		return nil, err
	}
	return &res, nil
}

// ExecStream runs one command and calls fn for each output event as it
// arrives (NDJSON, ?stream=true). It returns the final event, the one whose
// ExitCode is set; fn is not called for it. An error event from the server
// is returned as an *Error; an error from fn stops the stream and is
// returned as is. fn may be nil.
func (c *Client) ExecStream(ctx context.Context, id string, req api.ExecRequest, fn func(api.ExecEvent) error) (*api.ExecEvent, error) {
	resp, err := c.send(ctx, request{
		method:       http.MethodPost,
		path:         "/v1/sandboxes/" + esc(id) + "/exec",
		query:        url.Values{"stream": {"true"}},
		jsonBody:     req,
		accept:       "application/x-ndjson",
		keyedIfAsked: true,
	})
	if err != nil {
		return nil, err
	}
	final, err := readExecEvents(resp.Body, fn)
	if err != nil {
		// Closing without draining drops the connection, which also stops
		// a command whose output nobody reads any more.
		resp.Body.Close()
		return nil, err
	}
	drainClose(resp.Body)
	return final, nil
}

// readExecEvents decodes an NDJSON event stream up to its final event.
func readExecEvents(r io.Reader, fn func(api.ExecEvent) error) (*api.ExecEvent, error) {
	dec := json.NewDecoder(r)
	for {
		var ev api.ExecEvent
		if err := dec.Decode(&ev); err != nil {
			var ne net.Error
			if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) || errors.As(err, &ne) && !ne.Timeout() {
				// The connection broke (an apiserver or node restarted):
				// what became of the command is not known.
				if errors.Is(err, io.EOF) {
					err = io.ErrUnexpectedEOF // between events: still cut short
				}
				return nil, fmt.Errorf("%w: %w", errdefs.Unavailable("the exec stream ended before the command's exit status: the connection to the API server broke (it or the sandbox's node may have restarted); the command may still be running, or may have run"), err)
			}
			return nil, fmt.Errorf("reading exec stream: %w", err)
		}
		if ev.Error != nil {
			return nil, &Error{Code: ev.Error.Code, Message: ev.Error.Message}
		}
		if ev.ExitCode != nil {
			return &ev, nil
		}
		if fn != nil {
			if err := fn(ev); err != nil {
				return nil, err
			}
		}
	}
}

// CreateSession opens a persistent shell in a sandbox and returns its id.
func (c *Client) CreateSession(ctx context.Context, id string, req api.SessionRequest) (string, error) {
	var s api.Session
	if err := c.call(ctx, request{method: http.MethodPost, path: "/v1/sandboxes/" + esc(id) + "/sessions", jsonBody: req}, &s); err != nil {
		return "", err
	}
	return s.SessionID, nil
}

// SessionRun runs one command in a session's shell; cwd, variables and
// functions persist between runs.
func (c *Client) SessionRun(ctx context.Context, id, sid string, req api.SessionRunRequest) (*api.ExecResult, error) {
	var res api.ExecResult
	p := "/v1/sandboxes/" + esc(id) + "/sessions/" + esc(sid) + "/run"
	if err := c.call(ctx, request{method: http.MethodPost, path: p, jsonBody: req, keyedIfAsked: true}, &res); err != nil {
		return nil, err
	}
	return &res, nil
}

// CloseSession kills a session's process tree.
func (c *Client) CloseSession(ctx context.Context, id, sid string) error {
	p := "/v1/sandboxes/" + esc(id) + "/sessions/" + esc(sid)
	return c.call(ctx, request{method: http.MethodDelete, path: p}, nil)
}

// OutputBytes returns the exact bytes of an output field pair: the decoded
// _b64 variant when the server sent one (output that is not valid UTF-8),
// else the text. Use it as OutputBytes(res.Stdout, res.StdoutB64).
func OutputBytes(text, b64 string) []byte {
	if b64 != "" {
		if b, err := base64.StdEncoding.DecodeString(b64); err == nil {
			return b
		}
	}
	return []byte(text)
}

// FnCall runs a short stateless job in a fresh sandbox (POST /v1/fncall).
func (c *Client) FnCall(ctx context.Context, req api.FnCallRequest) (*api.FnCallResult, error) {
	var res api.FnCallResult
	if err := c.call(ctx, request{method: http.MethodPost, path: "/v1/fncall", jsonBody: req, keyed: true}, &res); err != nil {
		return nil, err
	}
	return &res, nil
}

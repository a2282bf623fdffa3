package edgeapi

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// Processes over the internal API. A process stream is NDJSON: one
// processLine per event, flushed as it comes; the end event is the last
// line of a stream that ran its course, and an error line ends one that
// did not. A stream the apiserver closes detaches (the process goes on).

type processLine struct {
	Event *ProcessEvent    `json:"event,omitempty"`
	Error *api.ErrorDetail `json:"error,omitempty"`
}

type processCall struct {
	Selector ProcessSelector `json:"selector"`
	Data     []byte          `json:"data,omitempty"`
	Signal   int             `json:"signal,omitempty"`
	Size     *PTYSize        `json:"size,omitempty"`
}

func (s *Server) processRoutes(p string) {
	s.mux.HandleFunc("POST "+p+"/sandboxes/{id}/processes", func(w http.ResponseWriter, r *http.Request) {
		var req ProcessRequest
		if err := decodeBody(r, &req); err != nil {
			writeError(w, err)
			return
		}
		streamProcess(w, func(emit func(ProcessEvent) error) error {
			return s.e.StartProcess(r.Context(), r.PathValue("id"), req, emit)
		})
	})
	s.mux.HandleFunc("POST "+p+"/sandboxes/{id}/processes:connect", func(w http.ResponseWriter, r *http.Request) {
		var c processCall
		if err := decodeBody(r, &c); err != nil {
			writeError(w, err)
			return
		}
		streamProcess(w, func(emit func(ProcessEvent) error) error {
			return s.e.ConnectProcess(r.Context(), r.PathValue("id"), c.Selector, emit)
		})
	})
	s.mux.HandleFunc("GET "+p+"/sandboxes/{id}/processes", func(w http.ResponseWriter, r *http.Request) {
		l, err := s.e.ListProcesses(r.Context(), r.PathValue("id"))
		answer(w, http.StatusOK, l, err)
	})
	unary := func(verb string, fn func(r *http.Request, id string, c processCall) error) {
		s.mux.HandleFunc("POST "+p+"/sandboxes/{id}/processes:"+verb, func(w http.ResponseWriter, r *http.Request) {
			var c processCall
			if err := decodeBody(r, &c); err != nil {
				writeError(w, err)
				return
			}
			answer(w, http.StatusNoContent, nil, fn(r, r.PathValue("id"), c))
		})
	}
	unary("input", func(r *http.Request, id string, c processCall) error {
		return s.e.ProcessInput(r.Context(), id, c.Selector, c.Data)
	})
	unary("close-stdin", func(r *http.Request, id string, c processCall) error {
		return s.e.CloseProcessStdin(r.Context(), id, c.Selector)
	})
	unary("signal", func(r *http.Request, id string, c processCall) error {
		return s.e.SignalProcess(r.Context(), id, c.Selector, c.Signal)
	})
	unary("resize", func(r *http.Request, id string, c processCall) error {
		if c.Size == nil {
			return errdefs.Invalid("resize needs a size")
		}
		return s.e.ResizeProcess(r.Context(), id, c.Selector, *c.Size)
	})
}

// streamProcess answers with run's events as NDJSON.
func streamProcess(w http.ResponseWriter, run func(emit func(ProcessEvent) error) error) {
	ls := newLineStream(w)
	err := run(func(ev ProcessEvent) error { return ls.send(processLine{Event: &ev}) })
	switch {
	case err != nil && !ls.begun():
		writeError(w, err)
	case err != nil:
		_ = ls.send(processLine{Error: errorDetail(err)})
	}
}

// StartProcess implements Edge.
func (c *Client) StartProcess(ctx context.Context, id string, req ProcessRequest, emit func(ProcessEvent) error) error {
	return c.followProcess(ctx, call{method: "POST", path: sbPath(id, "/processes"), json: req}, emit)
}

// ConnectProcess implements Edge.
func (c *Client) ConnectProcess(ctx context.Context, id string, sel ProcessSelector, emit func(ProcessEvent) error) error {
	return c.followProcess(ctx, call{method: "POST", path: sbPath(id, "/processes:connect"), json: processCall{Selector: sel}}, emit)
}

func (c *Client) followProcess(ctx context.Context, cl call, emit func(ProcessEvent) error) error {
	resp, err := c.do(ctx, cl)
	if err != nil {
		return err
	}
	defer drain(resp.Body)
	sc := bufio.NewScanner(resp.Body)
	// One event holds at most one read of output (32 KiB), base64'd.
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	for sc.Scan() {
		var l processLine
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			return &Unreachable{Node: c.name, Err: fmt.Errorf("decoding a process event: %w", err)}
		}
		switch {
		case l.Error != nil:
			return errdefs.FromCode(l.Error.Code, l.Error.Message)
		case l.Event != nil:
			if err := emit(*l.Event); err != nil {
				return err
			}
			if l.Event.End != nil {
				return nil
			}
		}
	}
	err = sc.Err()
	if err == nil {
		err = io.ErrUnexpectedEOF
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return &Unreachable{Node: c.name, Err: fmt.Errorf("process stream ended early: %w", err)}
}

// ListProcesses implements Edge.
func (c *Client) ListProcesses(ctx context.Context, id string) ([]ProcessInfo, error) {
	var out []ProcessInfo
	err := c.roundTrip(ctx, call{method: "GET", path: sbPath(id, "/processes")}, &out)
	return out, err
}

func (c *Client) processUnary(ctx context.Context, id, verb string, pc processCall) error {
	return c.roundTrip(ctx, call{method: "POST", path: sbPath(id, "/processes:"+verb), json: pc}, nil)
}

// ProcessInput implements Edge.
func (c *Client) ProcessInput(ctx context.Context, id string, sel ProcessSelector, data []byte) error {
	return c.processUnary(ctx, id, "input", processCall{Selector: sel, Data: data})
}

// CloseProcessStdin implements Edge.
func (c *Client) CloseProcessStdin(ctx context.Context, id string, sel ProcessSelector) error {
	return c.processUnary(ctx, id, "close-stdin", processCall{Selector: sel})
}

// SignalProcess implements Edge.
func (c *Client) SignalProcess(ctx context.Context, id string, sel ProcessSelector, signal int) error {
	return c.processUnary(ctx, id, "signal", processCall{Selector: sel, Signal: signal})
}

// ResizeProcess implements Edge.
func (c *Client) ResizeProcess(ctx context.Context, id string, sel ProcessSelector, size PTYSize) error {
	return c.processUnary(ctx, id, "resize", processCall{Selector: sel, Size: &size})
}

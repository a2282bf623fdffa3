package apiserver

import (
	"encoding/json"
	"net/http"
	"sync"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
)

func (s *Server) exec(w http.ResponseWriter, r *http.Request) {
	var req api.ExecRequest
	if err := decode(r, &req); err != nil {
		s.writeError(w, r, err)
		return
	}
	id := r.PathValue("id")
	e, err := s.edgeOf(r.Context(), id)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	stream := false
	switch v := r.URL.Query().Get("stream"); v {
	case "", "false", "0":
	case "true", "1":
		stream = true
	default:
		s.writeError(w, r, badQuery("stream", v, "want true or false"))
		return
	}
	if !stream {
		res, err := e.Exec(r.Context(), id, req, nil)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		writeJSON(w, http.StatusOK, res)
		return
	}
	// Streaming: headers go out with the first event, so errors found
	// before the command starts still get a proper status.
	var mu sync.Mutex
	started := false
	enc := json.NewEncoder(w)
	flusher, _ := w.(http.Flusher)
	emit := func(ev api.ExecEvent) error {
		mu.Lock()
		defer mu.Unlock()
		if !started {
			w.Header().Set("Content-Type", "application/x-ndjson")
			w.WriteHeader(http.StatusOK)
			started = true
		}
		if err := enc.Encode(ev); err != nil {
			return err
		}
		if flusher != nil {
			flusher.Flush()
		}
		return nil
	}
	res, err := e.Exec(r.Context(), id, req, emit)
	mu.Lock()
	begun := started
	mu.Unlock()
	if err != nil {
		if !begun {
			s.writeError(w, r, err)
			return
		}
		_ = emit(api.ExecEvent{Error: &api.ErrorDetail{Code: errdefs.Code(err), Message: err.Error()}})
		return
	}
	code := res.ExitCode
	_ = emit(api.ExecEvent{ExitCode: &code, TimedOut: res.TimedOut, Truncated: res.Truncated, DurationMS: res.DurationMS})
}

func (s *Server) openSession(w http.ResponseWriter, r *http.Request) {
	var req api.SessionRequest
	if err := decodeOptional(r, &req); err != nil {
		s.writeError(w, r, err)
		return
	}
	s.forward(w, r, http.StatusCreated, func(e edgeapi.Edge, id string) (any, error) {
		return e.OpenSession(r.Context(), id, req)
	})
}

func (s *Server) runSession(w http.ResponseWriter, r *http.Request) {
	var req api.SessionRunRequest
	if err := decode(r, &req); err != nil {
		s.writeError(w, r, err)
		return
	}
	s.forward(w, r, http.StatusOK, func(e edgeapi.Edge, id string) (any, error) {
		return e.RunInSession(r.Context(), id, r.PathValue("sid"), req)
	})
}

func (s *Server) closeSession(w http.ResponseWriter, r *http.Request) {
	s.forward(w, r, http.StatusNoContent, func(e edgeapi.Edge, id string) (any, error) {
		return nil, e.CloseSession(r.Context(), id, r.PathValue("sid"))
	})
}

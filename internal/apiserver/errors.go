package apiserver

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"strings"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/heap"
)

// writeError writes the API error body for err. Classified errors carry
// their message (written for the caller). Internal errors may hold host
// detail (paths, runtime output), so the caller gets a reference and the
// operator's log gets the detail under the same reference.
func (s *Server) writeError(w http.ResponseWriter, r *http.Request, err error) {
	if r.Context().Err() != nil && errors.Is(err, context.Canceled) {
		// The caller went away (gave up, or its connection closed): no
		// one reads an answer, and nothing failed on this side.
		s.log.Debug("request canceled by the caller", "method", r.Method, "path", r.URL.Path)
		w.WriteHeader(StatusCallerGone)
		return
	}
	s.noteUnreachable(err)
	code := errdefs.Code(err)
	st := errdefs.HTTPStatus(code)
	msg := err.Error()
	if st == http.StatusInternalServerError {
		msg = s.internalRef(r, err)
	}
	writeJSON(w, st, api.ErrorBody{Error: api.ErrorDetail{Code: code, Message: msg}})
}

// StatusCallerGone is the status a request is counted with when its
// caller went away before the answer (nginx's 499).
const StatusCallerGone = 499

// internalRef logs an internal error under a fresh reference and returns
// the message the caller gets instead of its detail.
func (s *Server) internalRef(r *http.Request, err error) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	ref := hex.EncodeToString(b[:])
	p := principal(r.Context())
	s.log.Error("request failed", "ref", ref, "method", r.Method, "path", r.URL.Path, "principal", p.ID, "project", p.Project, "err", err)
	return "internal error (ref " + ref + "; the server log has the details)"
}

// noteUnreachable tells the view about an edge a call could not reach, so
// that placement stops choosing it before the next poll says so.
func (s *Server) noteUnreachable(err error) {
	var u *edgeapi.Unreachable
	if errors.As(err, &u) && s.deps.Nodes != nil {
		s.deps.Nodes.MarkFailed(u.Node, err)
	}
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	var err error
	switch v := v.(type) {
	case *api.ExecResult:
		// Sandbox output: encoded in constant memory (api.WriteExecResult),
		// and its buffers' memory given back to the OS once written.
		err = api.WriteExecResult(w, v)
		heap.Released(int64(len(v.Stdout) + len(v.Stderr) + len(v.StdoutB64) + len(v.StderrB64)))
	case *api.FnCallResult:
		err = api.WriteFnCallResult(w, v)
		heap.Released(int64(len(v.Stdout) + len(v.Stderr) + len(v.StdoutB64) + len(v.StderrB64)))
	default:
		err = json.NewEncoder(w).Encode(v)
	}
	if err != nil {
		slog.Debug("writing response", "err", err)
	}
}

// maxJSONBody bounds JSON request bodies.
const maxJSONBody = 32 << 20

// decode reads a JSON body strictly: unknown fields, trailing data and wrong
// types are errors that name the problem.
func decode(r *http.Request, v any) error { return decodeJSON(r, v, true) }

// decodeLoose is decode that ignores unknown fields: the E2B API's
// clients send fields dsec has no use for.
func decodeLoose(r *http.Request, v any) error { return decodeJSON(r, v, false) }

func decodeJSON(r *http.Request, v any, strict bool) error {
	body := http.MaxBytesReader(nil, r.Body, maxJSONBody)
	dec := json.NewDecoder(body)
	if strict {
		dec.DisallowUnknownFields()
	}
	if err := dec.Decode(v); err != nil {
		var se *json.SyntaxError
		var te *json.UnmarshalTypeError
		var mbe *http.MaxBytesError
		switch {
		case errors.Is(err, io.EOF):
			return errdefs.Invalid("request body is empty; a JSON object is required")
		case errors.As(err, &se):
			return errdefs.Invalid("malformed JSON at byte %d: %v", se.Offset, err)
		case errors.As(err, &te):
			return errdefs.Invalid("field %q must be %s, got JSON %s", te.Field, te.Type, te.Value)
		case errors.As(err, &mbe):
			return errdefs.Invalid("request body larger than %d bytes", maxJSONBody)
		case strings.HasPrefix(err.Error(), "json: unknown field"):
			return errdefs.Invalid("unknown field %s", strings.TrimPrefix(err.Error(), "json: unknown field "))
		}
		return errdefs.Invalid("malformed JSON: %v", err)
	}
	if dec.More() {
		return errdefs.Invalid("request body has data after the JSON object")
	}
	var extra json.RawMessage
	if err := dec.Decode(&extra); err != io.EOF {
		return errdefs.Invalid("request body has data after the JSON object")
	}
	return nil
}

// decodeOptional is decode for endpoints whose body may be empty.
func decodeOptional(r *http.Request, v any) error { return decodeOptionalJSON(r, v, true) }

// decodeLooseOptional is decodeLoose for endpoints whose body may be empty.
func decodeLooseOptional(r *http.Request, v any) error { return decodeOptionalJSON(r, v, false) }

func decodeOptionalJSON(r *http.Request, v any, strict bool) error {
	if r.ContentLength == 0 {
		return nil
	}
	err := decodeJSON(r, v, strict)
	if err != nil && strings.Contains(err.Error(), "request body is empty") {
		return nil
	}
	return err
}

func badQuery(name, val, want string) error {
	return errdefs.Invalid("query parameter %s=%q: %s", name, val, want)
}

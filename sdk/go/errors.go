package dsec

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"unicode/utf8"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// Error classes, the same values the server classifies with. Test with
// errors.Is: errors.Is(err, dsec.ErrNotFound).
var (
	ErrInvalid          = errdefs.ErrInvalid
	ErrNotFound         = errdefs.ErrNotFound
	ErrAlreadyExists    = errdefs.ErrAlreadyExists
	ErrPrecondition     = errdefs.ErrPrecondition
	ErrExhausted        = errdefs.ErrExhausted
	ErrQuota            = errdefs.ErrQuota
	ErrUnauthenticated  = errdefs.ErrUnauthenticated
	ErrPermissionDenied = errdefs.ErrPermissionDenied
	ErrUnavailable      = errdefs.ErrUnavailable
)

// Error is a non-2xx answer of the API. Status is the HTTP status (0 for an
// error reported inside a stream), Code the API error code ("not_found", ...)
// and Message the server's text.
type Error struct {
	Status  int
	Code    string
	Message string
	// guessed: the body was not dsec's error JSON (a proxy or load
	// balancer answered), so Code is guessed from the status.
	guessed bool
}

func (e *Error) Error() string {
	switch {
	case e.Code != "" && e.Message != "":
		return e.Code + ": " + e.Message
	case e.Message != "":
		return e.Message
	case e.Code != "":
		return e.Code
	}
	return fmt.Sprintf("HTTP %d %s", e.Status, http.StatusText(e.Status))
}

// Unwrap returns the error class matching Code, so that errors.Is(err,
// dsec.ErrNotFound) works; nil for codes without a class ("internal").
func (e *Error) Unwrap() error {
	cls := errdefs.FromCode(e.Code, e.Message)
	if errdefs.Code(cls) == "internal" {
		return nil
	}
	return cls
}

// NodesUnreachableError says a call over many nodes (delete, pause or
// resume by labels) could not ask some of them: their sandboxes were left
// as they are, and Count is of the others. It is unavailable
// (errors.Is(err, dsec.ErrUnavailable)); the call may be sent again once
// the nodes are back.
type NodesUnreachableError struct {
	// Done is what the call did ("deleted", "paused", "resumed").
	Done  string
	Count int
	Nodes []string
}

func (e *NodesUnreachableError) Error() string {
	return fmt.Sprintf("%s %d sandboxes, but %d node(s) could not be asked and their sandboxes were left as they are: %s (retry once they are back)",
		e.Done, e.Count, len(e.Nodes), strings.Join(e.Nodes, ", "))
}

// Unwrap returns ErrUnavailable.
func (e *NodesUnreachableError) Unwrap() error { return ErrUnavailable }

// unreachable is the error of a call by labels that could not ask nodes
// (nil if it asked all).
func unreachable(done string, count int, nodes []string) error {
	if len(nodes) == 0 {
		return nil
	}
	return &NodesUnreachableError{Done: done, Count: count, Nodes: nodes}
}

// errorFromResponse builds an *Error from a non-2xx response. A body that is
// not the API's error JSON (a proxy's HTML page, a panic trace) still yields
// the status and the start of the body, and a code guessed from the status.
func errorFromResponse(resp *http.Response) error {
	const keep = 200
	raw, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	var eb api.ErrorBody
	if json.Unmarshal(raw, &eb) == nil && (eb.Error.Code != "" || eb.Error.Message != "") {
		code := eb.Error.Code
		if code == "" {
			code = codeForStatus(resp.StatusCode)
		}
		return &Error{Status: resp.StatusCode, Code: code, Message: eb.Error.Message}
	}
	text := strings.TrimSpace(string(raw))
	if len(text) > keep {
		text = text[:keep]
		for len(text) > 0 && !utf8.ValidString(text) {
			text = text[:len(text)-1]
		}
		text += "..."
	}
	msg := fmt.Sprintf("HTTP %d %s", resp.StatusCode, http.StatusText(resp.StatusCode))
	if text != "" {
		msg += ": " + text
	}
	return &Error{Status: resp.StatusCode, Code: codeForStatus(resp.StatusCode), Message: msg, guessed: true}
}

// codeForStatus guesses a code for a response that did not carry one. 409 is
// left unclassified: it means either already_exists or failed_precondition.
func codeForStatus(status int) string {
	switch status {
	case http.StatusBadRequest:
		return "invalid_argument"
	case http.StatusUnauthorized:
		return "unauthenticated"
	case http.StatusForbidden:
		return "permission_denied"
	case http.StatusNotFound:
		return "not_found"
	case http.StatusTooManyRequests:
		return "quota_exceeded"
	case http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return "unavailable"
	}
	return ""
}

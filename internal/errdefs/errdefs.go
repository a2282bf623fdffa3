// Package errdefs classifies errors once, so that every layer can wrap freely
// with %w and the HTTP layers (the public API in apiserver, the internal
// API in edgeapi) can map a class to a status code with HTTPStatus. Any
// package may import it.
package errdefs

import (
	"errors"
	"fmt"
)

// Classes. Test with errors.Is; create with the constructors below.
var (
	ErrInvalid          = errors.New("invalid argument")
	ErrNotFound         = errors.New("not found")
	ErrAlreadyExists    = errors.New("already exists")
	ErrPrecondition     = errors.New("failed precondition")
	ErrExhausted        = errors.New("resource exhausted")
	ErrQuota            = errors.New("quota exceeded")
	ErrUnauthenticated  = errors.New("unauthenticated")
	ErrPermissionDenied = errors.New("permission denied")
	ErrUnavailable      = errors.New("unavailable")
)

type classified struct {
	class error
	msg   string
}

func (e *classified) Error() string        { return e.msg }
func (e *classified) Is(target error) bool { return target == e.class }

func mk(class error, format string, args ...any) error {
	return &classified{class: class, msg: fmt.Sprintf(format, args...)}
}

// Invalid reports bad input from the caller.
func Invalid(format string, args ...any) error { return mk(ErrInvalid, format, args...) }

// NotFound reports a missing object.
func NotFound(format string, args ...any) error { return mk(ErrNotFound, format, args...) }

// AlreadyExists reports a name collision.
func AlreadyExists(format string, args ...any) error { return mk(ErrAlreadyExists, format, args...) }

// Precondition reports an object in the wrong state for the request.
func Precondition(format string, args ...any) error { return mk(ErrPrecondition, format, args...) }

// Exhausted reports that the node (or cluster) cannot hold the request.
func Exhausted(format string, args ...any) error { return mk(ErrExhausted, format, args...) }

// Quota reports that a project's quota forbids the request.
func Quota(format string, args ...any) error { return mk(ErrQuota, format, args...) }

// Unauthenticated reports a missing or unknown credential.
func Unauthenticated(format string, args ...any) error {
	return mk(ErrUnauthenticated, format, args...)
}

// PermissionDenied reports a known principal asking for something it may not do.
func PermissionDenied(format string, args ...any) error {
	return mk(ErrPermissionDenied, format, args...)
}

// Unavailable reports a dependency that cannot be reached right now.
func Unavailable(format string, args ...any) error { return mk(ErrUnavailable, format, args...) }

// Code returns the API error code (API.md) for err.
func Code(err error) string {
	switch {
	case err == nil:
		return ""
	case errors.Is(err, ErrInvalid):
		return "invalid_argument"
	case errors.Is(err, ErrNotFound):
		return "not_found"
	case errors.Is(err, ErrAlreadyExists):
		return "already_exists"
	case errors.Is(err, ErrPrecondition):
		return "failed_precondition"
	case errors.Is(err, ErrExhausted):
		return "resource_exhausted"
	case errors.Is(err, ErrQuota):
		return "quota_exceeded"
	case errors.Is(err, ErrUnauthenticated):
		return "unauthenticated"
	case errors.Is(err, ErrPermissionDenied):
		return "permission_denied"
	case errors.Is(err, ErrUnavailable):
		return "unavailable"
	}
	return "internal"
}

// HTTPStatus maps an API error code to its HTTP status (API.md). Only the
// HTTP layers call it.
func HTTPStatus(code string) int {
	switch code {
	case "invalid_argument":
		return 400
	case "unauthenticated":
		return 401
	case "permission_denied":
		return 403
	case "not_found":
		return 404
	case "already_exists", "failed_precondition":
		return 409
	case "quota_exceeded":
		return 429
	case "resource_exhausted", "unavailable":
		return 503
	}
	return 500
}

// FromCode builds a classified error from an API error code and message, so
// that clients see the same classes the server used.
func FromCode(code, msg string) error {
	switch code {
	case "invalid_argument":
		return Invalid("%s", msg)
	case "not_found":
		return NotFound("%s", msg)
	case "already_exists":
		return AlreadyExists("%s", msg)
	case "failed_precondition":
		return Precondition("%s", msg)
	case "resource_exhausted":
		return Exhausted("%s", msg)
	case "quota_exceeded":
		return Quota("%s", msg)
	case "unauthenticated":
		return Unauthenticated("%s", msg)
	case "permission_denied":
		return PermissionDenied("%s", msg)
	case "unavailable":
		return Unavailable("%s", msg)
	}
	return errors.New(msg)
}

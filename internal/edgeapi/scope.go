package edgeapi

import (
	"context"
	"net/http"
	"strings"
)

// Tenancy on a node. A sandbox belongs to a project, and an edge keeps
// the project's path in the tree ("root/team-a/job-7") with the sandbox.
// A call on behalf of a principal carries the principal's scope, the path
// of the principal's project: the edge answers it only about sandboxes
// whose path is the scope or below it, and about any other sandbox as if
// it did not exist (not found, no existence oracle). The apiserver sets
// the scope of every call it makes for a caller; calls without one are the
// control plane's own (placement, the watcher, takeovers of dead
// apiservers' calls) and see everything.
//
// Paths are immutable (projects do not move in the tree), so the check
// is a prefix comparison on the node, with no lookup.

// ScopeHeader carries the scope over the internal API.
const ScopeHeader = "Dsec-Scope"

// RootPath is the path of the root project, and of sandboxes made before
// projects existed.
const RootPath = "root"

type scopeKey struct{}

// WithScope returns ctx carrying scope (a project path). An empty scope
// leaves ctx as it is.
func WithScope(ctx context.Context, scope string) context.Context {
	if scope == "" {
		return ctx
	}
	return context.WithValue(ctx, scopeKey{}, scope)
}

// ScopeOf returns the scope ctx carries, "" for none.
func ScopeOf(ctx context.Context) string {
	s, _ := ctx.Value(scopeKey{}).(string)
	return s
}

// InScope reports whether a sandbox of project path may be seen by a call
// of ctx.
func InScope(ctx context.Context, path string) bool {
	return PathIn(path, ScopeOf(ctx))
}

// PathIn reports whether path is scope or below it; every path is in the
// empty scope, and an empty path is the root's.
func PathIn(path, scope string) bool {
	if scope == "" {
		return true
	}
	if path == "" {
		path = RootPath
	}
	return path == scope || strings.HasPrefix(path, scope+"/")
}

// scopeFromRequest is the scope of an internal API request.
func scopeFromRequest(r *http.Request) *http.Request {
	if sc := r.Header.Get(ScopeHeader); sc != "" {
		return r.WithContext(WithScope(r.Context(), sc))
	}
	return r
}

//go:build !linux || !cgo

package nsexec

// Available reports whether this build has the helper: a build without
// cgo has no constructor to run, so callers fall back to the runtime.
const Available = false

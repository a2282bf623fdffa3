//go:build linux && cgo

// Package nsexec starts a command inside a running sandbox without the OCI
// runtime: the process image of the binary that links this package (dsec
// itself) is re-executed as a helper whose C constructor joins the
// sandbox's cgroups and namespaces before any Go code runs, then forks the
// command under the sandbox's credentials, capabilities and seccomp filter
// (nsexec.c). It replaces `crun exec`, which costs ~9 ms per call
// (re-executing itself, loading libseccomp, compiling the filter); the
// helper needs about one.
//
// Only the container backend imports it. Linking it is what installs the
// constructor, so a binary that uses Command must import this package
// (importing the container backend does).
package nsexec

/*
#cgo CFLAGS: -O2 -Wall
*/
import "C"

// Available reports whether this build has the helper (cgo on linux).
const Available = true

package sandbox

import (
	"path"
	"regexp"
	"strings"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// Policy holds the bounds a node or platform puts on specs.
type Policy struct {
	Backends    []string // backends this node offers
	DefaultTTL  int64    // seconds, applied when spec.TTL == 0
	MaxTTL      int64
	MaxCPU      float64
	MaxMemoryMB int64
	MaxPids     int64
	DefaultPids int64 // applied when spec.Pids == 0
	// DefaultMemoryMB is applied when spec.MemoryMB == 0 and the sandbox
	// has a memory cgroup of its own: no sandbox is without a limit
	// unless it asks for a shared memory cgroup.
	DefaultMemoryMB int64
	MaxEnv          int
	MaxLabels       int
	MaxIdleTimout   int64
	MaxDiskMB       int64
}

// MinDiskMB is the smallest writable-layer limit a spec may ask for.
const MinDiskMB = 16

// DefaultPolicy is the policy of `dsec up` unless flags change it.
func DefaultPolicy() Policy {
	return Policy{
		Backends:    []string{api.BackendContainer},
		DefaultTTL:  3600,
		MaxTTL:      7 * 24 * 3600,
		MaxCPU:      256,
		MaxMemoryMB: 1 << 20, // 1 TiB
		MaxPids:     1 << 20,
		DefaultPids: 4096,
		// A sandbox that asks for nothing may use 4 GiB: one runaway
		// agent cannot take the node's memory (the host reserve on the
		// instance's cgroup bounds all of them together).
		DefaultMemoryMB: 4096,
		MaxEnv:          1024,
		MaxLabels:       64,
		MaxIdleTimout:   7 * 24 * 3600,
		MaxDiskMB:       1 << 20, // 1 TiB
	}
}

var (
	labelKeyRE = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?$`)
	labelValRE = regexp.MustCompile(`^[A-Za-z0-9._:/@+=-]{0,128}$`)
	envKeyRE   = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_.-]{0,255}$`)
	userRE     = regexp.MustCompile(`^([a-z_][a-z0-9_.-]{0,31}|[0-9]{1,10})(:([a-z_][a-z0-9_.-]{0,31}|[0-9]{1,10}))?$`)
)

// Normalize validates spec against p and fills defaults (backend, ttl,
// pids, user, workdir). It is pure: layer refs are checked for syntax only.
func Normalize(spec *api.SandboxSpec, p Policy) error {
	if spec.Backend == "" {
		spec.Backend = api.BackendContainer
	}
	ok := false
	for _, b := range p.Backends {
		ok = ok || b == spec.Backend
	}
	if !ok {
		switch spec.Backend {
		case api.BackendGVisor, api.BackendMicroVM:
			return errdefs.Precondition("backend %q is not offered here (available: %s)", spec.Backend, strings.Join(p.Backends, ", "))
		}
		return errdefs.Invalid("unknown backend %q (available: %s)", spec.Backend, strings.Join(p.Backends, ", "))
	}
	switch {
	case spec.Base != "" && spec.Image != "":
		return errdefs.Invalid("give either base or image, not both")
	case spec.Base == "" && spec.Image == "":
		return errdefs.Invalid("base (or image) is required")
	case spec.Image != "":
		spec.Base, spec.Image = spec.Image, ""
	}
	if spec.CPU < 0 || spec.CPU > p.MaxCPU || spec.CPU != spec.CPU {
		return errdefs.Invalid("cpu must be between 0 and %g cores, got %g", p.MaxCPU, spec.CPU)
	}
	if spec.CPU > 0 && spec.CPU < 0.01 {
		return errdefs.Invalid("cpu must be at least 0.01 cores, got %g", spec.CPU)
	}
	if spec.MemoryMB < 0 || spec.MemoryMB > p.MaxMemoryMB {
		return errdefs.Invalid("memory_mb must be between 0 and %d, got %d", p.MaxMemoryMB, spec.MemoryMB)
	}
	if spec.MemoryMB > 0 && spec.MemoryMB < 8 {
		return errdefs.Invalid("memory_mb must be at least 8, got %d", spec.MemoryMB)
	}
	if spec.Pids < 0 || spec.Pids > p.MaxPids {
		return errdefs.Invalid("pids must be between 0 and %d, got %d", p.MaxPids, spec.Pids)
	}
	if spec.Pids == 0 {
		spec.Pids = p.DefaultPids
	}
	if spec.Pids > 0 && spec.Pids < 4 {
		return errdefs.Invalid("pids must be at least 4, got %d", spec.Pids)
	}
	if spec.DiskMB < 0 {
		return errdefs.Invalid("disk_mb must not be negative, got %d", spec.DiskMB)
	}
	if spec.DiskMB > p.MaxDiskMB {
		return errdefs.Invalid("disk_mb must be at most %d, got %d", p.MaxDiskMB, spec.DiskMB)
	}
	if spec.DiskMB > 0 && spec.DiskMB < MinDiskMB {
		return errdefs.Invalid("disk_mb must be at least %d, got %d", MinDiskMB, spec.DiskMB)
	}
	if spec.TTL < 0 || spec.TTL > p.MaxTTL {
		return errdefs.Invalid("ttl must be between 0 and %d seconds, got %d", p.MaxTTL, spec.TTL)
	}
	if spec.TTL == 0 {
		spec.TTL = p.DefaultTTL
	}
	if spec.IdleTimeout < 0 || spec.IdleTimeout > p.MaxIdleTimout {
		return errdefs.Invalid("idle_timeout must be between 0 and %d seconds, got %d", p.MaxIdleTimout, spec.IdleTimeout)
	}
	// The rules themselves are the edge's to check: presets are node
	// configuration.
	if spec.Network != nil && len(spec.Network.Allow) == 0 && len(spec.Network.Deny) == 0 {
		spec.Network = nil
	}
	if err := ValidateEnv(spec.Env, p.MaxEnv); err != nil {
		return err
	}
	// dsec's own labels (added after the caller's were checked) do not
	// count against the caller's allowance; they have one of their own.
	n := callerLabels(spec.Labels)
	if n > p.MaxLabels {
		return errdefs.Invalid("at most %d labels, got %d", p.MaxLabels, n)
	}
	if own := len(spec.Labels) - n; own > OwnLabels {
		return errdefs.Invalid("at most %d labels starting %q, got %d", OwnLabels, ReservedLabelPrefix, own)
	}
	for k, v := range spec.Labels {
		if err := ValidateLabel(k, v); err != nil {
			return err
		}
	}
	if len(spec.NodeSelector) > p.MaxLabels {
		return errdefs.Invalid("node_selector: at most %d labels, got %d", p.MaxLabels, len(spec.NodeSelector))
	}
	for k, v := range spec.NodeSelector {
		if err := ValidateLabel(k, v); err != nil {
			return errdefs.Invalid("node_selector: %v", err)
		}
	}
	if len(spec.NodeSelector) == 0 {
		spec.NodeSelector = nil
	}
	if spec.User == "" {
		spec.User = "root"
	}
	if err := ValidateUser(spec.User); err != nil {
		return err
	}
	if spec.Workdir == "" {
		spec.Workdir = "/"
	}
	if err := ValidateAbsPath("workdir", spec.Workdir); err != nil {
		return err
	}
	switch spec.MemoryCgroup {
	case "", api.MemoryCgroupOwn:
		spec.MemoryCgroup = api.MemoryCgroupOwn
		if spec.MemoryMB == 0 {
			spec.MemoryMB = min(p.DefaultMemoryMB, p.MaxMemoryMB)
		}
	case api.MemoryCgroupShared:
		if spec.MemoryMB > 0 {
			return errdefs.Invalid("memory_mb needs memory_cgroup %q: a shared memory cgroup has no limit per sandbox", api.MemoryCgroupOwn)
		}
	default:
		return errdefs.Invalid("memory_cgroup must be own or shared, got %q", spec.MemoryCgroup)
	}
	switch spec.QoS {
	case "":
		spec.QoS = "ls"
	case "ls", "be":
	default:
		return errdefs.Invalid("qos must be ls or be, got %q", spec.QoS)
	}
	if len(spec.Toolkits) > 16 {
		return errdefs.Invalid("at most 16 toolkits, got %d", len(spec.Toolkits))
	}
	return nil
}

// ReservedLabelPrefix starts the label keys dsec sets itself
// (dsec.idempotency marks what a keyed create made, and a retry that takes
// the call over adopts what carries it): callers may select by them but
// not set them.
const ReservedLabelPrefix = "dsec."

// IsOwnLabel reports whether a label key is one of dsec's own.
func IsOwnLabel(k string) bool { return strings.HasPrefix(k, ReservedLabelPrefix) }

// ValidateCallerLabels checks labels a caller asks a sandbox to carry: each
// pair as ValidateLabel, and none of dsec's own.
func ValidateCallerLabels(labels map[string]string) error {
	for k, v := range labels {
		if err := ValidateLabel(k, v); err != nil {
			return err
		}
		if IsOwnLabel(k) {
			return errdefs.Invalid("label key %q: keys starting with %q are reserved for the labels dsec sets itself", k, ReservedLabelPrefix)
		}
	}
	return nil
}

// OwnLabels is how many of dsec's own labels a sandbox may carry on top
// of the policy's MaxLabels of the caller's.
const OwnLabels = 4

// callerLabels counts the labels that are not dsec's own.
func callerLabels(labels map[string]string) int {
	n := 0
	for k := range labels {
		if !IsOwnLabel(k) {
			n++
		}
	}
	return n
}

// WithoutReservedLabels is labels less dsec's own (a new map).
func WithoutReservedLabels(labels map[string]string) map[string]string {
	out := make(map[string]string, len(labels))
	for k, v := range labels {
		if !IsOwnLabel(k) {
			out[k] = v
		}
	}
	return out
}

// ValidateLabel checks one label pair (also used for label selectors).
func ValidateLabel(k, v string) error {
	if !labelKeyRE.MatchString(k) {
		return errdefs.Invalid("label key %q is invalid (1-63 chars of [A-Za-z0-9._/-], alphanumeric at both ends)", k)
	}
	if !labelValRE.MatchString(v) {
		return errdefs.Invalid("label %q has an invalid value (0-128 chars of [A-Za-z0-9._:/@+=-])", k)
	}
	return nil
}

// ValidateEnv checks environment variables.
func ValidateEnv(env map[string]string, max int) error {
	if max > 0 && len(env) > max {
		return errdefs.Invalid("at most %d environment variables, got %d", max, len(env))
	}
	for k, v := range env {
		if !envKeyRE.MatchString(k) {
			return errdefs.Invalid("environment variable name %q is invalid", k)
		}
		if strings.IndexByte(v, 0) >= 0 {
			return errdefs.Invalid("environment variable %s contains a NUL byte", k)
		}
		if len(v) > 128<<10 {
			return errdefs.Invalid("environment variable %s is longer than 128 KiB", k)
		}
	}
	return nil
}

// ValidateUser checks a user spec: name or uid, optionally ":group" or ":gid".
func ValidateUser(u string) error {
	if !userRE.MatchString(u) {
		return errdefs.Invalid("user %q is invalid (want NAME, UID, NAME:GROUP or UID:GID)", u)
	}
	return nil
}

// ValidateAbsPath checks that p is a clean-able absolute path without NUL bytes.
func ValidateAbsPath(what, p string) error {
	switch {
	case strings.IndexByte(p, 0) >= 0:
		return errdefs.Invalid("%s contains a NUL byte", what)
	case !strings.HasPrefix(p, "/"):
		return errdefs.Invalid("%s must be an absolute path, got %q", what, p)
	case len(p) > 4096:
		return errdefs.Invalid("%s is longer than 4096 bytes", what)
	}
	return nil
}

// CleanAbs returns the cleaned form of an absolute sandbox path.
func CleanAbs(p string) string { return path.Clean("/" + p) }

// ExecDefaults are the bounds applied to exec and session runs.
const (
	DefaultExecTimeout    = 60
	MaxExecTimeout        = 86400
	DefaultMaxOutputBytes = 1 << 20
	MaxMaxOutputBytes     = 64 << 20
	MaxStdinBytes         = 16 << 20
)

// NormalizeExec validates an exec request and fills defaults. Exactly one
// of Cmd and Argv must be given.
func NormalizeExec(r *api.ExecRequest) error {
	if (r.Cmd == "") == (len(r.Argv) == 0) {
		return errdefs.Invalid("give exactly one of cmd and argv")
	}
	if strings.IndexByte(r.Cmd, 0) >= 0 {
		return errdefs.Invalid("cmd contains a NUL byte")
	}
	for i, a := range r.Argv {
		if strings.IndexByte(a, 0) >= 0 {
			return errdefs.Invalid("argv[%d] contains a NUL byte", i)
		}
	}
	if len(r.Argv) > 0 && r.Argv[0] == "" {
		return errdefs.Invalid("argv[0] is empty")
	}
	if r.Cwd != "" {
		if err := ValidateAbsPath("cwd", r.Cwd); err != nil {
			return err
		}
	}
	if r.User != "" {
		if err := ValidateUser(r.User); err != nil {
			return err
		}
	}
	if err := ValidateEnv(r.Env, 1024); err != nil {
		return err
	}
	if r.Stdin != "" && r.StdinB64 != "" {
		return errdefs.Invalid("give at most one of stdin and stdin_b64")
	}
	if len(r.Stdin) > MaxStdinBytes || len(r.StdinB64) > MaxStdinBytes*4/3+4 {
		return errdefs.Invalid("stdin is larger than %d bytes", MaxStdinBytes)
	}
	var err error
	r.Timeout, r.MaxOutputBytes, err = normalizeBounds(r.Timeout, r.MaxOutputBytes)
	return err
}

// NormalizeRun validates a session run request.
func NormalizeRun(r *api.SessionRunRequest) error {
	if strings.TrimSpace(r.Command) == "" {
		return errdefs.Invalid("command is required")
	}
	if strings.IndexByte(r.Command, 0) >= 0 {
		return errdefs.Invalid("command contains a NUL byte")
	}
	if len(r.Command) > 1<<20 {
		return errdefs.Invalid("command is longer than 1 MiB")
	}
	var err error
	r.Timeout, r.MaxOutputBytes, err = normalizeBounds(r.Timeout, r.MaxOutputBytes)
	return err
}

func normalizeBounds(timeout, maxOut int64) (int64, int64, error) {
	if timeout < 0 || timeout > MaxExecTimeout {
		return 0, 0, errdefs.Invalid("timeout must be between 0 and %d seconds, got %d", MaxExecTimeout, timeout)
	}
	if timeout == 0 {
		timeout = DefaultExecTimeout
	}
	if maxOut < 0 || maxOut > MaxMaxOutputBytes {
		return 0, 0, errdefs.Invalid("max_output_bytes must be between 0 and %d, got %d", MaxMaxOutputBytes, maxOut)
	}
	if maxOut == 0 {
		maxOut = DefaultMaxOutputBytes
	}
	return timeout, maxOut, nil
}

// LabelsMatch reports whether labels contain every pair of sel.
func LabelsMatch(labels, sel map[string]string) bool {
	for k, v := range sel {
		if got, ok := labels[k]; !ok || got != v {
			return false
		}
	}
	return true
}

// MaxSelectorLabels bounds a label selector: more pairs than a sandbox
// can carry (the default policy's 64 and dsec's own) match nothing, and a
// selector goes to every edge.
const MaxSelectorLabels = 128

// ValidateSelector checks a label selector's pairs and their number.
func ValidateSelector(sel map[string]string) error {
	if len(sel) > MaxSelectorLabels {
		return errdefs.Invalid("a label selector has at most %d pairs, got %d", MaxSelectorLabels, len(sel))
	}
	for k, v := range sel {
		if err := ValidateLabel(k, v); err != nil {
			return err
		}
	}
	return nil
}

// ParseSelector parses "k=v" label selector strings.
func ParseSelector(items []string) (map[string]string, error) {
	sel := map[string]string{}
	for _, it := range items {
		k, v, ok := strings.Cut(it, "=")
		if !ok {
			return nil, errdefs.Invalid("label selector %q must be key=value", it)
		}
		sel[k] = v
	}
	if err := ValidateSelector(sel); err != nil {
		return nil, err
	}
	return sel, nil
}

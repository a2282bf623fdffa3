package edgeapi

import "time"

// Processes are long-lived commands an edge keeps in a table per sandbox:
// started with a stream attached, they outlive it (a client may detach
// and connect again), take input while they run, may run under a
// terminal, and are found by pid or tag. They carry E2B's process model
// and dsec's terminals (GET /v1/sandboxes/{id}/pty).

// ProcessRequest starts a process.
type ProcessRequest struct {
	// Argv runs directly (argv[0] searched in the sandbox's PATH).
	Argv []string          `json:"argv"`
	Env  map[string]string `json:"env,omitempty"`
	Cwd  string            `json:"cwd,omitempty"`
	User string            `json:"user,omitempty"`
	// CwdHome starts the process in its user's home when Cwd is empty
	// (E2B's default), instead of the sandbox's workdir.
	CwdHome bool `json:"cwd_home,omitempty"`
	// Tag names the process for later calls, besides its pid.
	Tag string `json:"tag,omitempty"`
	// Stdin keeps a pipe to the process's stdin open for ProcessInput;
	// without it stdin is /dev/null. A terminal always takes input.
	Stdin bool `json:"stdin,omitempty"`
	// EndWithStream kills the process (and what it started) when the
	// stream that started it ends before it does: a terminal, whose
	// caller, or the apiserver between them, is gone. Without it a
	// process outlives its stream (E2B's processes are reconnected to).
	EndWithStream bool `json:"end_with_stream,omitempty"`
	// PTY runs the process under a new pseudo-terminal of this size.
	PTY *PTYSize `json:"pty,omitempty"`
	// TimeoutMS kills the process's tree this long after it starts
	// (0: it runs until it exits, is killed or the sandbox ends). It is
	// not bound to any stream: detaching does not stop the process.
	TimeoutMS int64 `json:"timeout_ms,omitempty"`
}

// PTYSize is a terminal's size in characters.
type PTYSize struct {
	Cols uint16 `json:"cols"`
	Rows uint16 `json:"rows"`
}

// ProcessSelector names a process by pid or, if PID is 0, by tag.
type ProcessSelector struct {
	PID int    `json:"pid,omitempty"`
	Tag string `json:"tag,omitempty"`
}

// ProcessInfo describes a running process.
type ProcessInfo struct {
	// PID is the process's pid inside the sandbox.
	PID       int               `json:"pid"`
	Tag       string            `json:"tag,omitempty"`
	Argv      []string          `json:"argv"`
	Env       map[string]string `json:"env,omitempty"`
	Cwd       string            `json:"cwd,omitempty"`
	PTY       bool              `json:"pty,omitempty"`
	StartedAt time.Time         `json:"started_at"`
}

// ProcessEvent is one event of a process's stream: exactly one field is
// set. Start comes first, End last.
type ProcessEvent struct {
	Start  *ProcessStarted `json:"start,omitempty"`
	Stdout []byte          `json:"stdout,omitempty"`
	Stderr []byte          `json:"stderr,omitempty"`
	// PTY is terminal output (a terminal merges stdout and stderr).
	PTY []byte      `json:"pty,omitempty"`
	End *ProcessEnd `json:"end,omitempty"`
}

// ProcessStarted opens a process's stream.
type ProcessStarted struct {
	PID int `json:"pid"`
}

// ProcessEnd closes a process's stream.
type ProcessEnd struct {
	// ExitCode is the exit status, or 128+signal when a signal ended it.
	ExitCode int `json:"exit_code"`
	// Exited is false when a signal ended the process.
	Exited bool `json:"exited"`
	// Status is a short description ("exit status 1", "killed: timeout").
	Status string `json:"status"`
	// Error is set when the process could not be waited for.
	Error string `json:"error,omitempty"`
}

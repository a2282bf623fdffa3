// Package agent is the microVM backend's in-guest agent and the host's
// client of it. The agent is the guest's pid 1 (cmd/dsec-agent, a static
// binary in the guest's initramfs): it mounts the kernel's filesystems,
// loads the modules the initramfs lists, finds the virtio-serial port the
// host named PortName, says it is ready and serves requests on it.
//
// The protocol is one JSON object per line in each direction, one request
// at a time: a Request, then its Response. It runs commands to completion
// and returns their output; streaming, sessions, terminals and files come
// with the backend that uses them.
//
// This package must build without cgo: it runs in a guest that has no libc.
package agent

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// PortName is the name of the virtio-serial port the agent serves.
const PortName = "dsec.agent"

// ModulesDir is where the initramfs keeps the kernel modules the agent
// loads, and ModulesList the file naming them in load order.
const (
	ModulesDir  = "/lib/dsec/modules"
	ModulesList = "/lib/dsec/modules/order"
)

// Request is one call to the agent.
type Request struct {
	// Op is "exec".
	Op   string   `json:"op"`
	Args []string `json:"args,omitempty"`
	Env  []string `json:"env,omitempty"`
	Cwd  string   `json:"cwd,omitempty"`
	// Stdin is given to the command whole.
	Stdin []byte `json:"stdin,omitempty"`
	// TimeoutMS kills the command after that long (0: none).
	TimeoutMS int64 `json:"timeout_ms,omitempty"`
}

// Response answers a Request. Error is set when the request could not be
// carried out (a command that ran and failed is ExitCode, not Error).
type Response struct {
	Ready    bool   `json:"ready,omitempty"`
	Error    string `json:"error,omitempty"`
	ExitCode int    `json:"exit_code"`
	Stdout   []byte `json:"stdout,omitempty"`
	Stderr   []byte `json:"stderr,omitempty"`
	TimedOut bool   `json:"timed_out,omitempty"`
	// Truncated says output beyond MaxOutput was dropped.
	Truncated bool `json:"truncated,omitempty"`
}

// MaxOutput bounds each of a command's streams in a Response.
const MaxOutput = 1 << 20

// Serve answers requests read from rw until it is closed. It first writes
// a Response with Ready set.
func Serve(rw io.ReadWriter) error {
	enc := json.NewEncoder(rw)
	if err := enc.Encode(Response{Ready: true}); err != nil {
		return err
	}
	r := bufio.NewReaderSize(rw, 64<<10)
	for {
		line, err := r.ReadBytes('\n')
		if len(bytes.TrimSpace(line)) > 0 {
			var req Request
			resp := Response{}
			if jerr := json.Unmarshal(line, &req); jerr != nil {
				resp.Error = "bad request: " + jerr.Error()
			} else {
				resp = handle(req)
			}
			if werr := enc.Encode(resp); werr != nil {
				return werr
			}
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
	}
}

func handle(req Request) Response {
	switch req.Op {
	case "exec":
		return run(req)
	default:
		return Response{Error: fmt.Sprintf("unknown op %q", req.Op)}
	}
}

// capped keeps the first MaxOutput bytes written to it. (A bytes.Buffer
// embedded would lend it ReadFrom, which io.Copy prefers to Write.)
type capped struct {
	buf     bytes.Buffer
	dropped bool
}

func (c *capped) Write(p []byte) (int, error) {
	if room := MaxOutput - c.buf.Len(); room < len(p) {
		c.dropped = true
		if room > 0 {
			c.buf.Write(p[:room])
		}
		return len(p), nil
	}
	return c.buf.Write(p)
}

func (c *capped) Bytes() []byte { return c.buf.Bytes() }

func run(req Request) Response {
	if len(req.Args) == 0 {
		return Response{Error: "exec: no command"}
	}
	ctx := context.Background()
	var cancel context.CancelFunc = func() {}
	if req.TimeoutMS > 0 {
		ctx, cancel = context.WithTimeout(ctx, time.Duration(req.TimeoutMS)*time.Millisecond)
	}
	defer cancel()
	cmd := exec.Command(req.Args[0], req.Args[1:]...)
	cmd.Env = req.Env
	cmd.Dir = req.Cwd
	cmd.Stdin = bytes.NewReader(req.Stdin)
	var out, errb capped
	cmd.Stdout, cmd.Stderr = &out, &errb
	// Its own process group, so a timeout kills what it started too.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return Response{ExitCode: 127, Stderr: []byte(err.Error() + "\n")}
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	var err error
	timedOut := false
	select {
	case err = <-done:
	case <-ctx.Done():
		timedOut = true
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		err = <-done
	}
	resp := Response{Stdout: out.Bytes(), Stderr: errb.Bytes(), TimedOut: timedOut, Truncated: out.dropped || errb.dropped}
	var ee *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &ee):
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			resp.ExitCode = 128 + int(ws.Signal())
		} else {
			resp.ExitCode = ee.ExitCode()
		}
	default:
		resp.Error = err.Error()
	}
	return resp
}

// FindPort returns the device of the virtio-serial port named name,
// waiting up to within for it to appear.
func FindPort(name string, within time.Duration) (string, error) {
	deadline := time.Now().Add(within)
	for {
		ents, _ := os.ReadDir("/sys/class/virtio-ports")
		for _, e := range ents {
			n, err := os.ReadFile(filepath.Join("/sys/class/virtio-ports", e.Name(), "name"))
			if err == nil && strings.TrimSpace(string(n)) == name {
				return "/dev/" + e.Name(), nil
			}
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("no virtio-serial port named %s after %s", name, within)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

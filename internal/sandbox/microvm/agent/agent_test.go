package agent

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"
)

// TestServeOverAConnection runs the agent's server on one end of a socket
// pair and the client on the other: real commands, their output, exit
// codes, a timeout that kills a process group, and bad requests.
func TestServeOverAConnection(t *testing.T) {
	a, b := net.Pipe()
	go Serve(a)
	c := NewClient(b)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := c.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	r, err := c.Call(ctx, Request{Op: "exec", Args: []string{"/bin/sh", "-c", `read x; echo "$x $FOO $(pwd)"; echo err >&2; exit 3`}, Env: []string{"FOO=bar"}, Cwd: "/tmp", Stdin: []byte("hi\n")})
	if err != nil || r.ExitCode != 3 || string(r.Stdout) != "hi bar /tmp\n" || string(r.Stderr) != "err\n" {
		t.Fatalf("exec: %+v %v", r, err)
	}
	start := time.Now()
	r, err = c.Call(ctx, Request{Op: "exec", Args: []string{"/bin/sh", "-c", "sleep 30 & sleep 30; echo no"}, TimeoutMS: 200})
	if err != nil || !r.TimedOut || r.ExitCode != 137 || time.Since(start) > 10*time.Second {
		t.Fatalf("timeout: %+v %v after %v", r, err, time.Since(start))
	}
	r, err = c.Call(ctx, Request{Op: "exec", Args: []string{"/no/such/binary"}})
	if err != nil || r.ExitCode != 127 || !strings.Contains(string(r.Stderr), "no such file") {
		t.Fatalf("missing binary: %+v %v", r, err)
	}
	r, err = c.Call(ctx, Request{Op: "exec", Args: []string{"/bin/sh", "-c", "head -c 2000000 /dev/zero"}})
	if err != nil || !r.Truncated || len(r.Stdout) != MaxOutput {
		t.Fatalf("output cap: %d bytes, truncated %v, %v", len(r.Stdout), r.Truncated, err)
	}
	r, err = c.Call(ctx, Request{Op: "format-disk"})
	if err != nil || r.Error == "" {
		t.Fatalf("unknown op: %+v %v", r, err)
	}
}

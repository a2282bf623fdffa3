package microvm

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"time"
)

// qmpRun runs one command on the VMM's monitor socket (QMP: JSON lines,
// a greeting, capability negotiation, then commands answered with
// "return" or "error", with events in between) and returns its result.
func qmpRun(ctx context.Context, sock, command string, args map[string]any) (json.RawMessage, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", sock)
	if err != nil {
		return nil, fmt.Errorf("connecting to the VMM's monitor: %w", err)
	}
	defer conn.Close()
	deadline := time.Now().Add(30 * time.Second)
	if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
		deadline = dl
	}
	_ = conn.SetDeadline(deadline)
	r := bufio.NewReader(conn)
	type reply struct {
		QMP    json.RawMessage `json:"QMP"`
		Return json.RawMessage `json:"return"`
		Error  *struct {
			Class string `json:"class"`
			Desc  string `json:"desc"`
		} `json:"error"`
		Event string `json:"event"`
	}
	read := func() (reply, error) {
		for {
			line, err := r.ReadBytes('\n')
			if err != nil {
				return reply{}, fmt.Errorf("reading the VMM's monitor: %w", err)
			}
			var m reply
			if err := json.Unmarshal(line, &m); err != nil {
				return reply{}, fmt.Errorf("decoding the VMM's monitor: %w", err)
			}
			if m.Event == "" && m.QMP == nil {
				return m, nil
			}
		}
	}
	// The greeting.
	if _, err := r.ReadBytes('\n'); err != nil {
		return nil, fmt.Errorf("reading the VMM's monitor: %w", err)
	}
	call := func(cmd string, args map[string]any) (json.RawMessage, error) {
		req := map[string]any{"execute": cmd}
		if args != nil {
			req["arguments"] = args
		}
		b, _ := json.Marshal(req)
		if _, err := conn.Write(append(b, '\n')); err != nil {
			return nil, fmt.Errorf("writing to the VMM's monitor: %w", err)
		}
		m, err := read()
		if err != nil {
			return nil, err
		}
		if m.Error != nil {
			return nil, fmt.Errorf("VMM %s: %s: %s", cmd, m.Error.Class, m.Error.Desc)
		}
		return m.Return, nil
	}
	if _, err := call("qmp_capabilities", nil); err != nil {
		return nil, err
	}
	return call(command, args)
}

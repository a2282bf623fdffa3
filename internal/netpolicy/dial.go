package netpolicy

import (
	"context"
	"fmt"
	"net"
	"strconv"

	"github.com/vishvananda/netns"
)

// DialLoopback connects to 127.0.0.1:port inside the network namespace of
// pid. The socket is created by a thread that has joined the namespace and
// stays bound to it after the thread leaves, so this reaches services that
// listen only on the sandbox's loopback, with or without a veth, and never
// touches an address outside the sandbox.
func DialLoopback(ctx context.Context, pid, port int) (net.Conn, error) {
	if port < 1 || port > 65535 {
		return nil, fmt.Errorf("port %d out of range", port)
	}
	ns, err := netns.GetFromPid(pid)
	if err != nil {
		return nil, fmt.Errorf("opening network namespace of pid %d: %w", pid, err)
	}
	defer ns.Close()
	var conn net.Conn
	err = inNetns(ns, func() error {
		var d net.Dialer
		c, err := d.DialContext(ctx, "tcp4", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		conn = c
		return err
	})
	if err != nil {
		if conn != nil {
			conn.Close()
		}
		return nil, err
	}
	return conn, nil
}

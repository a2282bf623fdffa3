package apiserver

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/conns"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// connsServer serves a fresh apiserver over the fixture's IAM and edge
// the way the daemons do: a conns.Listener on 127.0.0.1 and its Server.
func (f *fixture) connsServer(t *testing.T, cfg conns.Config) (*conns.Listener, string) {
	t.Helper()
	s := New(Deps{IAM: f.iam, Layers: f.layers, Nodes: f.view, Policy: sandbox.DefaultPolicy(),
		Log: slog.New(slog.DiscardHandler), Instance: "a"})
	raw, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := conns.Listen(raw, cfg)
	hs := l.Server(s.Handler())
	go func() { _ = hs.Serve(l) }()
	t.Cleanup(func() { _ = hs.Close() })
	return l, raw.Addr().String()
}

// TestConnectionFloodCannotStopExec: 2,000 connections that never send a
// byte (30 times the limit) cannot keep an authenticated exec out, nor
// close the connection of a client that has authenticated; once they stop
// coming, the server closes what is left of them.
func TestConnectionFloodCannotStopExec(t *testing.T) {
	f := newFixture(t, false)
	resp, body := f.do(t, f.admin, "POST", "/v1/sandboxes", `{"base":"base/py:1"}`)
	if resp.StatusCode != 201 {
		t.Fatalf("create: %d %s", resp.StatusCode, body)
	}
	var sb api.Sandbox
	_ = json.Unmarshal(body, &sb)
	cfg := conns.Config{Max: 64, MaxUntrusted: 32, ReadHeaderTimeout: 500 * time.Millisecond, IdleTimeout: time.Minute}
	l, addr := f.connsServer(t, cfg)
	exec := func(c *http.Client) error {
		req, _ := http.NewRequest("POST", "http://"+addr+"/v1/sandboxes/"+sb.ID+"/exec", strings.NewReader(`{"cmd":"echo hi"}`))
		req.Header.Set("Authorization", "Bearer "+f.admin)
		resp, err := c.Do(req)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != 200 {
			return fmt.Errorf("%d %s", resp.StatusCode, b)
		}
		return nil
	}
	client := func(dials *atomic.Int64) *http.Client {
		d := &net.Dialer{Timeout: 2 * time.Second}
		return &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
			DialContext: func(ctx context.Context, network, a string) (net.Conn, error) {
				dials.Add(1)
				return d.DialContext(ctx, network, a)
			},
		}}
	}
	var keptDials atomic.Int64
	kept := client(&keptDials)
	if err := exec(kept); err != nil {
		t.Fatal(err)
	}

	var idle []net.Conn
	t.Cleanup(func() {
		for _, c := range idle {
			c.Close()
		}
	})
	for range 2000 {
		c, err := net.DialTimeout("tcp", addr, 2*time.Second)
		if err != nil {
			t.Fatalf("flood: %v", err)
		}
		idle = append(idle, c)
	}
	start := time.Now()
	var freshDials atomic.Int64
	if err := exec(client(&freshDials)); err != nil {
		t.Fatalf("an authenticated exec on a new connection during the flood: %v", err)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Fatalf("an authenticated exec took %v during the flood", d)
	}
	open, untrusted, evicted := l.Stats()
	t.Logf("exec during the flood: %v; connections open %d, untrusted %d, closed to make room %d", time.Since(start), open, untrusted, evicted)
	if err := exec(kept); err != nil || keptDials.Load() != 1 {
		t.Fatalf("the authenticated client's connection after the flood: %v, %d dials", err, keptDials.Load())
	}
	if open > cfg.Max || untrusted > cfg.MaxUntrusted {
		t.Fatalf("open %d (max %d), untrusted %d (max %d)", open, cfg.Max, untrusted, cfg.MaxUntrusted)
	}
	// Every flood connection is closed: pushed out, or at the header
	// timeout.
	for i, c := range idle {
		_ = c.SetReadDeadline(time.Now().Add(3 * time.Second))
		if _, err := c.Read(make([]byte, 512)); !errors.Is(err, io.EOF) && !errors.Is(err, syscall.ECONNRESET) {
			t.Fatalf("flood connection %d still open: %v", i, err)
		}
	}
	deadline := time.Now().Add(3 * time.Second)
	for {
		open, untrusted, _ := l.Stats()
		if untrusted == 0 && open <= 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after the flood: open %d, untrusted %d", open, untrusted)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestUnauthenticatedConnectionCloses: a request without a valid key is
// answered at once on a connection that then closes, even when it
// announces a body it never sends (the server would otherwise wait for
// that body before answering, with no deadline).
func TestUnauthenticatedConnectionCloses(t *testing.T) {
	f := newFixture(t, false)
	_, addr := f.connsServer(t, conns.Config{Max: 64, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: time.Minute})
	for _, key := range []string{"", "wrong-key"} {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		auth := ""
		if key != "" {
			auth = "Authorization: Bearer " + key + "\r\n"
		}
		fmt.Fprintf(c, "POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\n%sContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n", auth)
		_ = c.SetReadDeadline(time.Now().Add(3 * time.Second))
		br := bufio.NewReader(c)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("key %q: no answer: %v", key, err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 401 || !resp.Close {
			t.Fatalf("key %q: %d, close %v; want 401 on a closing connection", key, resp.StatusCode, resp.Close)
		}
		if _, err := br.ReadByte(); !errors.Is(err, io.EOF) {
			t.Fatalf("key %q: connection still open after the answer: %v", key, err)
		}
	}
}

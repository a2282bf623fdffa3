package conns

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// serve runs h on a Listener over 127.0.0.1 and returns it with its URL.
func serve(t *testing.T, cfg Config, h http.Handler) (*Listener, string) {
	t.Helper()
	raw, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := Listen(raw, cfg)
	hs := l.Server(h)
	go func() { _ = hs.Serve(l) }()
	t.Cleanup(func() { _ = hs.Close() })
	return l, "http://" + raw.Addr().String()
}

// authHandler trusts requests with the right key, as the apiserver does.
func authHandler(w http.ResponseWriter, r *http.Request) {
	if r.Header.Get("Authorization") != "Bearer good" {
		w.WriteHeader(http.StatusUnauthorized)
		return
	}
	Trust(r.Context())
	io.WriteString(w, "ok")
}

// countingClient is an HTTP client that counts the connections it dials.
func countingClient(dials *atomic.Int64) *http.Client {
	d := &net.Dialer{Timeout: 2 * time.Second}
	return &http.Client{Timeout: 3 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			dials.Add(1)
			return d.DialContext(ctx, network, addr)
		},
	}}
}

func get(c *http.Client, url, key string) error {
	req, _ := http.NewRequest("GET", url, nil)
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := c.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 || string(b) != "ok" {
		return fmt.Errorf("%d %q", resp.StatusCode, b)
	}
	return nil
}

// flood opens n connections that send nothing.
func flood(t *testing.T, url string, n int) []net.Conn {
	t.Helper()
	addr := strings.TrimPrefix(url, "http://")
	var cs []net.Conn
	for range n {
		c, err := net.DialTimeout("tcp", addr, 2*time.Second)
		if err != nil {
			t.Fatalf("flood dial: %v", err)
		}
		cs = append(cs, c)
	}
	t.Cleanup(func() {
		for _, c := range cs {
			c.Close()
		}
	})
	return cs
}

// TestFloodCannotStarveAuthenticated: ten times as many idle connections
// as the limit, which never send a byte, can neither keep a new client's
// authenticated request out nor push out a connection that has carried
// one; the daemon never holds more than its bound.
func TestFloodCannotStarveAuthenticated(t *testing.T) {
	cfg := Config{Max: 32, MaxUntrusted: 16, ReadHeaderTimeout: time.Minute, IdleTimeout: time.Minute}
	l, url := serve(t, cfg, http.HandlerFunc(authHandler))
	var dials atomic.Int64
	kept := countingClient(&dials)
	if err := get(kept, url, "good"); err != nil {
		t.Fatal(err)
	}
	flood(t, url, 10*cfg.Max)
	start := time.Now()
	var fresh atomic.Int64
	if err := get(countingClient(&fresh), url, "good"); err != nil {
		t.Fatalf("an authenticated request on a new connection during the flood: %v", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("an authenticated request took %v during the flood", d)
	}
	flood(t, url, 10*cfg.Max)
	if err := get(kept, url, "good"); err != nil {
		t.Fatalf("the kept-alive authenticated connection after the flood: %v", err)
	}
	if n := dials.Load(); n != 1 {
		t.Fatalf("the authenticated client dialled %d times: its connection was closed by the flood", n)
	}
	open, untrusted, evicted := l.Stats()
	if open > cfg.Max || untrusted > cfg.MaxUntrusted || evicted == 0 {
		t.Fatalf("open %d (max %d), untrusted %d (max %d), evicted %d", open, cfg.Max, untrusted, cfg.MaxUntrusted, evicted)
	}
}

// TestAllTrustedWaits: when every connection is trusted, a new one waits
// for one of them to close rather than pushing any out.
func TestAllTrustedWaits(t *testing.T) {
	cfg := Config{Max: 2, MaxUntrusted: 2, ReadHeaderTimeout: time.Minute, IdleTimeout: time.Minute}
	_, url := serve(t, cfg, http.HandlerFunc(authHandler))
	var d1, d2, d3 atomic.Int64
	a, b := countingClient(&d1), countingClient(&d2)
	for _, c := range []*http.Client{a, b} {
		if err := get(c, url, "good"); err != nil {
			t.Fatal(err)
		}
	}
	c := countingClient(&d3)
	c.Timeout = 300 * time.Millisecond
	if err := get(c, url, "good"); err == nil {
		t.Fatal("a third connection was served while two trusted ones were open")
	}
	a.CloseIdleConnections()
	c.Timeout = 3 * time.Second
	if err := get(c, url, "good"); err != nil {
		t.Fatalf("after a trusted connection closed: %v", err)
	}
	if err := get(b, url, "good"); err != nil || d2.Load() != 1 {
		t.Fatalf("the other trusted connection: %v, %d dials", err, d2.Load())
	}
}

// TestIdleConnectionsClose: the server built by Server closes a
// connection that sends nothing after ReadHeaderTimeout, and a kept-alive
// one after IdleTimeout, trusted or not.
func TestIdleConnectionsClose(t *testing.T) {
	cfg := Config{Max: 64, ReadHeaderTimeout: 200 * time.Millisecond, IdleTimeout: 400 * time.Millisecond}
	l, url := serve(t, cfg, http.HandlerFunc(authHandler))
	silent := flood(t, url, 8)
	kept := flood(t, url, 1)[0]
	fmt.Fprintf(kept, "GET / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer good\r\n\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(kept), nil)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("request: %v", err)
	}
	resp.Body.Close()
	start := time.Now()
	for _, c := range append(silent, kept) {
		_ = c.SetReadDeadline(time.Now().Add(3 * time.Second))
		if _, err := c.Read(make([]byte, 1024)); !errors.Is(err, io.EOF) {
			t.Fatalf("an idle connection is still open after %v: %v", time.Since(start), err)
		}
	}
	deadline := time.Now().Add(2 * time.Second)
	for {
		if open, _, _ := l.Stats(); open == 0 {
			break
		}
		if time.Now().After(deadline) {
			open, untrusted, _ := l.Stats()
			t.Fatalf("%d connections still counted (%d untrusted)", open, untrusted)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestWriteStall: a response to a peer that stops reading fails once a
// write has waited WriteStall, instead of holding the handler, its
// buffers and the connection for ever; a slow peer that keeps reading
// gets the whole response.
func TestWriteStall(t *testing.T) {
	const size = 8 << 20
	failed := make(chan error, 2)
	_, url := serve(t, Config{Max: 8, WriteStall: 500 * time.Millisecond}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		buf := make([]byte, 64<<10)
		var err error
		// To the stuck peer, more than any socket buffers hold.
		for n := 0; (n < size || r.URL.Path == "/stuck") && err == nil; n += len(buf) {
			_, err = w.Write(buf)
		}
		failed <- err
	}))
	stuck := flood(t, url, 1)[0]
	fmt.Fprintf(stuck, "GET /stuck HTTP/1.1\r\nHost: x\r\n\r\n")
	select {
	case err := <-failed:
		if err == nil {
			t.Fatal("the handler's writes to a peer that reads nothing did not fail")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the handler is still writing to a peer that reads nothing")
	}
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	got := 0
	buf := make([]byte, 64<<10)
	for {
		n, err := resp.Body.Read(buf)
		got += n
		if err != nil {
			break
		}
		time.Sleep(5 * time.Millisecond) // about 10 MiB/s at most
	}
	if err := <-failed; err != nil || got != size {
		t.Fatalf("a slow reader got %d of %d bytes: %v", got, size, err)
	}
}

// TestTrustUnderTLS: a request over TLS finds its connection under the
// TLS one, so Trusting (the edge's mutual-TLS API) takes it out of the
// untrusted pool.
func TestTrustUnderTLS(t *testing.T) {
	ts := httptest.NewUnstartedServer(nil)
	l := Listen(ts.Listener, Config{Max: 8})
	ts.Listener = l
	ts.Config = l.Server(Trusting(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })))
	ts.StartTLS()
	defer ts.Close()
	if err := get(ts.Client(), ts.URL, ""); err != nil {
		t.Fatal(err)
	}
	if open, untrusted, _ := l.Stats(); open != 1 || untrusted != 0 {
		t.Fatalf("open %d untrusted %d, want 1 trusted", open, untrusted)
	}
}

func TestDefaultMax(t *testing.T) {
	for _, c := range []struct {
		nofile uint64
		want   int
	}{{100, 64}, {1024, 256}, {20000, 5000}, {1 << 20, 16384}} {
		if got := DefaultMax(c.nofile); got != c.want {
			t.Errorf("DefaultMax(%d) = %d, want %d", c.nofile, got, c.want)
		}
	}
}

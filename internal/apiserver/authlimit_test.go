package apiserver

import (
	"strings"
	"testing"
	"time"
)

// TestAuthLimiter: an address may fail authFailBurst times at once, then
// one more per 1/authFailRate seconds; other addresses are unaffected;
// the memory it keeps is bounded under a flood of addresses.
func TestAuthLimiter(t *testing.T) {
	now := time.Unix(1000, 0)
	l := newAuthLimiter()
	l.now = func() time.Time { return now }
	for i := range authFailBurst {
		if d := l.wait("a"); d != 0 {
			t.Fatalf("attempt %d refused (%v) within the burst", i, d)
		}
		l.fail("a")
	}
	if d := l.wait("a"); d <= 0 || d > time.Second {
		t.Fatalf("after the burst: wait %v, want (0, 1s]", d)
	}
	if d := l.wait("b"); d != 0 {
		t.Fatalf("another address waits %v", d)
	}
	now = now.Add(time.Second)
	if d := l.wait("a"); d != 0 {
		t.Fatalf("after a second: wait %v", d)
	}
	l.fail("a")
	if d := l.wait("a"); d == 0 {
		t.Fatal("a second failure within the second was allowed")
	}
	for i := range 3 * authMaxTracked {
		l.fail(strings.Repeat("x", i%7) + time.Duration(i).String())
	}
	if len(l.m) > authMaxTracked {
		t.Fatalf("%d addresses remembered, bound %d", len(l.m), authMaxTracked)
	}
}

// TestFailedAuthIsRateLimited: past the burst of wrong keys, a request
// from the same address is refused before its key is looked at, valid or
// not, with Retry-After.
func TestFailedAuthIsRateLimited(t *testing.T) {
	f := newFixture(t, false)
	for range authFailBurst {
		resp, body := f.do(t, "dsec_guess-"+strings.Repeat("a", 40), "GET", "/v1/sandboxes", "")
		wantError(t, resp, body, 401, "unauthenticated")
	}
	resp, body := f.do(t, f.admin, "GET", "/v1/sandboxes", "")
	e := wantError(t, resp, body, 401, "unauthenticated")
	if !strings.Contains(e.Message, "too many failed authentications") || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("past the burst: %q, Retry-After %q", e.Message, resp.Header.Get("Retry-After"))
	}
}

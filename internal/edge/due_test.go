package edge

import (
	"context"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/sandbox/fake"
)

// TestReaperLooksAtWhatIsDue: between full passes the reaper looks only at
// the sandboxes due by now, and every change of a due time (a create, a
// keepalive) queues the sandbox for it; a full pass also catches a due
// time that was never queued, and leaves the queue one entry per sandbox
// with something due.
func TestReaperLooksAtWhatIsDue(t *testing.T) {
	ctx := context.Background()
	src := &testImages{dir: t.TempDir()}
	layers := src.digests(t, 1)
	e := fakeEdgeWith(t, t.TempDir(), fake.New("container"), src, func(c *Config) { c.ReapInterval = time.Hour })
	defer e.Close()
	mk := func(ttl int64) string {
		t.Helper()
		sb, err := e.Create(ctx, edgeapi.CreateRequest{Spec: api.SandboxSpec{Base: "base/x:1", TTL: ttl}, Digests: layers})
		if err != nil {
			t.Fatal(err)
		}
		return sb.ID
	}
	state := func(id string) string {
		t.Helper()
		sb, err := e.Get(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		return sb.State
	}
	// The stop runs in the background: wait for it.
	waitState := func(id, want string) {
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); state(id) != want; {
			if time.Now().After(deadline) {
				t.Fatalf("%s is %s, want %s", id, state(id), want)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	start := time.Now()
	short, long, lost := mk(10), mk(3600), mk(3600)

	e.reapOnce(start.Add(11*time.Second), false)
	waitState(short, api.StateStopped)
	if state(long) != api.StateRunning {
		t.Fatal("a sandbox with an hour to live was stopped")
	}
	// A keepalive that shortens the TTL is seen at its new time.
	if _, err := e.Keepalive(ctx, long, 5); err != nil {
		t.Fatal(err)
	}
	e.reapOnce(time.Now().Add(6*time.Second), false)
	waitState(long, api.StateStopped)

	// A due time changed behind the queue's back waits for a full pass.
	s, _ := e.get(ctx, lost)
	s.mu.Lock()
	past := time.Now().Add(-time.Second)
	s.rec.Sandbox.ExpiresAt = &past
	s.mu.Unlock()
	e.reapOnce(time.Now(), false)
	time.Sleep(20 * time.Millisecond)
	if state(lost) != api.StateRunning {
		t.Fatal("a sandbox that was never queued for its time was looked at between full passes")
	}
	e.reapOnce(time.Now(), true)
	waitState(lost, api.StateStopped)
	// One entry per sandbox with something due (the stopped ones'
	// retention), whatever was queued before.
	e.reapOnce(time.Now(), true)
	if n := e.due.len(); n != 3 {
		t.Fatalf("%d queued after a full pass, want 3", n)
	}
}

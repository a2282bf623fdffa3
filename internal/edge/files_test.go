package edge

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

func TestMakeDirAndMoveLogged(t *testing.T) {
	e, _ := logEdge(t, CmdLogConfig{})
	ctx := context.Background()
	id := "sb-n1-log"
	if fe, err := e.MakeDir(ctx, id, "/work/sub", ""); err != nil || fe.Type != "dir" || fe.Path != "/work/sub" {
		t.Fatalf("mkdir: %+v, %v", fe, err)
	}
	if _, err := e.MakeDir(ctx, id, "/work/sub", ""); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("mkdir again: %v, want already exists", err)
	}
	if _, err := e.WriteFile(ctx, id, "/work/a", strings.NewReader("abc"), 0o644, ""); err != nil {
		t.Fatal(err)
	}
	if fe, err := e.MoveFile(ctx, id, "/work/a", "/elsewhere/b"); err != nil || fe.Path != "/elsewhere/b" || fe.Size != 3 {
		t.Fatalf("move: %+v, %v", fe, err)
	}
	if _, err := e.MoveFile(ctx, id, "/work/a", "/x"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("move of a moved file: %v, want not found", err)
	}
	got := readAll(t, e, 0)
	kinds := []string{api.LogFilesMkdir, api.LogFilesMkdir, api.LogFilesWrite, api.LogFilesMove, api.LogFilesMove}
	if len(got) != len(kinds) {
		t.Fatalf("%d entries, want %d: %+v", len(got), len(kinds), got)
	}
	for i, k := range kinds {
		if got[i].Kind != k {
			t.Fatalf("entry %d: %+v, want kind %s", i, got[i], k)
		}
	}
	mv, failed := got[3], got[4]
	switch {
	case got[1].Result.Error == nil || got[1].Result.Error.Code != "already_exists":
		t.Fatalf("failed mkdir: %+v", got[1])
	case mv.Request.Path != "/work/a" || mv.Request.Dest != "/elsewhere/b" || mv.Result.Size == nil || *mv.Result.Size != 3:
		t.Fatalf("move: %+v", mv)
	case failed.Result.Error == nil || failed.Result.Error.Code != "not_found":
		t.Fatalf("failed move: %+v", failed)
	}
}

// watchEvents runs a watch in the background, passing its events on.
func watchEvents(t *testing.T, e *Edge, ctx context.Context, path string, recursive bool) (<-chan api.FileEvent, <-chan error) {
	t.Helper()
	evs := make(chan api.FileEvent, 100)
	done := make(chan error, 1)
	go func() {
		done <- e.WatchDir(ctx, "sb-n1-log", path, recursive, func(ev api.FileEvent) error {
			evs <- ev
			return nil
		})
	}()
	return evs, done
}

func nextEvent(t *testing.T, evs <-chan api.FileEvent) api.FileEvent {
	t.Helper()
	select {
	case ev := <-evs:
		return ev
	case <-time.After(10 * time.Second):
		t.Fatal("no event within 10 s")
	}
	return api.FileEvent{}
}

func TestWatchDir(t *testing.T) {
	e, s := logEdge(t, CmdLogConfig{})
	ctx := context.Background()
	id := "sb-n1-log"
	if _, err := e.MakeDir(ctx, id, "/w", ""); err != nil {
		t.Fatal(err)
	}
	if err := e.WatchDir(ctx, id, "/nope", false, func(api.FileEvent) error {
		t.Error("a failed watch emitted an event")
		return nil
	}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("watch of a missing directory: %v", err)
	}

	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	evs, done := watchEvents(t, e, wctx, "/w", false)
	if ev := nextEvent(t, evs); ev.Type != api.FileEventStart {
		t.Fatalf("first event %+v, want start", ev)
	}
	if _, err := e.WriteFile(ctx, id, "/w/a.txt", strings.NewReader("hi"), 0o644, ""); err != nil {
		t.Fatal(err)
	}
	ev := nextEvent(t, evs)
	if ev.Type != api.FileEventCreate || ev.Name != "a.txt" || ev.Entry == nil || ev.Entry.Path != "/w/a.txt" {
		t.Fatalf("after a write: %+v, want create a.txt with its entry", ev)
	}
	if ev := nextEvent(t, evs); ev.Type != api.FileEventWrite || ev.Name != "a.txt" {
		t.Fatalf("then %+v, want write a.txt", ev)
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("watch ended with %v, want its context's error", err)
	}
	s.mu.Lock()
	left := s.watches
	s.mu.Unlock()
	if left != 0 {
		t.Fatalf("%d watches counted after the watch ended", left)
	}
	got := readAll(t, e, 0)
	last := got[len(got)-1]
	if last.Kind != api.LogFilesWatch || last.Request.Path != "/w" || last.Result.Error != nil || last.Result.Entries == nil || *last.Result.Entries != 2 {
		t.Fatalf("watch log entry %+v", last)
	}

	// A sandbox that stops running ends its watches.
	evs, done = watchEvents(t, e, ctx, "/w", true)
	nextEvent(t, evs)
	s.mu.Lock()
	s.rec.Sandbox.State = api.StateStopped
	s.mu.Unlock()
	select {
	case err := <-done:
		if !errors.Is(err, errdefs.ErrUnavailable) {
			t.Fatalf("watch of a stopped sandbox ended with %v, want unavailable", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the watch outlived its sandbox")
	}
}

func TestWatchDirBounded(t *testing.T) {
	e, s := logEdge(t, CmdLogConfig{})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if _, err := e.MakeDir(ctx, "sb-n1-log", "/w", ""); err != nil {
		t.Fatal(err)
	}
	var dones []<-chan error
	for range maxWatches {
		evs, done := watchEvents(t, e, ctx, "/w", false)
		nextEvent(t, evs)
		dones = append(dones, done)
	}
	err := e.WatchDir(ctx, "sb-n1-log", "/w", false, func(api.FileEvent) error { return nil })
	if !errors.Is(err, errdefs.ErrExhausted) {
		t.Fatalf("watch %d: %v, want resource exhausted", maxWatches+1, err)
	}
	cancel()
	for _, d := range dones {
		<-d
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.watches != 0 || s.ops != 0 {
		t.Fatalf("after the watches: %d watches, %d ops counted", s.watches, s.ops)
	}
}

// ownerEdge is logEdge with a sandbox that has the users root and alice
// (1001:1002) and the group staff (50), and alice's home, owned by root.
func ownerEdge(t *testing.T, userns bool) (*Edge, *sbx) {
	t.Helper()
	e, s := logEdge(t, CmdLogConfig{})
	if userns {
		e.cfg.UserNSBase = 1_000_000_000
		s.rec.UserNS = true
	}
	rootfs := filepath.Join(s.dir, "rootfs")
	for p, content := range map[string]string{
		"etc/passwd": "root:x:0:0:root:/root:/bin/sh\nalice:x:1001:1002::/home/alice:/bin/sh\n",
		"etc/group":  "root:x:0:\nstaff:x:50:\n",
	} {
		if err := os.MkdirAll(filepath.Dir(filepath.Join(rootfs, p)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(rootfs, p), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.MkdirAll(filepath.Join(rootfs, "home/alice"), 0o755); err != nil {
		t.Fatal(err)
	}
	return e, s
}

// TestFileOwnerUnknown: an owner the sandbox does not have (or that
// could not be a user) is invalid and nothing is written, for every call
// that creates files; the refusal is in the command log.
func TestFileOwnerUnknown(t *testing.T) {
	e, s := ownerEdge(t, false)
	ctx := context.Background()
	id := s.rec.Sandbox.ID
	for _, owner := range []string{"bob", "alice:nogroup", "a b", "../x"} {
		if _, err := e.WriteFile(ctx, id, "/home/alice/new/f", strings.NewReader("x"), 0o644, owner); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("write as %q: %v, want invalid", owner, err)
		}
		if _, err := e.MakeDir(ctx, id, "/home/alice/new", owner); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("mkdir as %q: %v, want invalid", owner, err)
		}
		if _, err := e.ExtractTar(ctx, id, "/home/alice/new", bytes.NewReader(make([]byte, 1024)), owner); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("tar as %q: %v, want invalid", owner, err)
		}
	}
	if _, err := os.Lstat(filepath.Join(s.dir, "rootfs/home/alice/new")); !os.IsNotExist(err) {
		t.Fatalf("a refused call wrote: %v", err)
	}
	got := readAll(t, e, 0)
	if len(got) == 0 || got[0].Request.User != "bob" || got[0].Result.Error == nil || got[0].Result.Error.Code != "invalid_argument" {
		t.Fatalf("log: %+v", got)
	}
}

// TestFileOwner: a write, a mkdir and a tar extraction as alice leave
// what they create alice's (her group, or the one named), and what was
// there root's; in a user namespace the IDs on disk are shifted.
func TestFileOwner(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: chowns to another user")
	}
	for _, userns := range []bool{false, true} {
		e, s := ownerEdge(t, userns)
		ctx := context.Background()
		id := s.rec.Sandbox.ID
		var base uint32
		if userns {
			base = e.cfg.UserNSBase
		}
		if _, err := e.WriteFile(ctx, id, "/home/alice/new/f", strings.NewReader("x"), 0o644, "alice"); err != nil {
			t.Fatal(err)
		}
		fe, err := e.MakeDir(ctx, id, "/home/alice/d/e", "alice:staff")
		if err != nil || fe.UID != 1001 || fe.GID != 50 {
			t.Fatalf("mkdir: %+v, %v", fe, err)
		}
		var tarball bytes.Buffer
		tw := tar.NewWriter(&tarball)
		_ = tw.WriteHeader(&tar.Header{Name: "a", Typeflag: tar.TypeReg, Mode: 0o644, Size: 1, Uid: 7})
		_, _ = tw.Write([]byte("a"))
		_ = tw.Close()
		if _, err := e.ExtractTar(ctx, id, "/home/alice/t", &tarball, "1001"); err != nil {
			t.Fatal(err)
		}
		if _, err := e.WriteFile(ctx, id, "/root/f", strings.NewReader("x"), 0o644, ""); err != nil {
			t.Fatal(err)
		}
		for p, want := range map[string][2]uint32{
			"home/alice/new": {1001, 1002}, "home/alice/new/f": {1001, 1002},
			"home/alice/d": {1001, 50}, "home/alice/d/e": {1001, 50},
			"home/alice/t": {1001, 1002}, "home/alice/t/a": {1001, 1002},
			"home/alice": {0, 0}, "home": {0, 0},
			// No owner: root's (the user namespace's root), as before.
			"root": {0, 0}, "root/f": {0, 0},
		} {
			var st unix.Stat_t
			if err := unix.Lstat(filepath.Join(s.dir, "rootfs", p), &st); err != nil {
				t.Fatal(err)
			}
			wantUID, wantGID := want[0], want[1]
			if p != "home/alice" && p != "home" {
				wantUID, wantGID = wantUID+base, wantGID+base
			}
			if st.Uid != wantUID || st.Gid != wantGID {
				t.Errorf("userns=%v: %s owned by %d:%d, want %d:%d", userns, p, st.Uid, st.Gid, wantUID, wantGID)
			}
		}
		if got := readAll(t, e, 0); got[0].Request.User != "alice" {
			t.Errorf("the write's log entry: %+v, want user alice", got[0])
		}
	}
}

package edge

import (
	"bytes"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/internal/files"
	"github.com/dsecproject/dsec/internal/files/filestest"
)

// TestTrash: a discarded sandbox dir leaves its place at once, the janitor
// removes it, and what a stop left in the trash goes at the next start.
func TestTrash(t *testing.T) {
	state := t.TempDir()
	e, err := New(Config{Name: "n1", StateDir: state}, Deps{})
	if err != nil {
		t.Fatal(err)
	}
	leftover := filepath.Join(e.trashDir(), "sb-old.1")
	if err := os.MkdirAll(filepath.Join(leftover, "upper", "deep"), 0o700); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(state, "sandboxes", "sb-n1-x")
	if err := os.MkdirAll(filepath.Join(dir, "upper", "a", "b"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "upper", "a", "f"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := e.discard(dir); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("sandbox dir still in place: %v", err)
	}
	if err := e.discard(dir); err != nil {
		t.Fatalf("discarding a dir already gone: %v", err)
	}
	done := make(chan struct{})
	go func() { e.janitor(); close(done) }()
	deadline := time.Now().Add(30 * time.Second)
	for {
		ents, err := os.ReadDir(e.trashDir())
		if err != nil {
			t.Fatal(err)
		}
		if len(ents) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("trash not emptied: %v", ents)
		}
		time.Sleep(10 * time.Millisecond)
	}
	close(e.stop)
	<-done
}

// TestTrashDeepTree: a deleted sandbox whose upper dir is a 5,000-level
// tree goes from the trash in one pass while the daemon could open only
// MaxRemoveFDs+2 more descriptors. (os.RemoveAll holds one per level: it ran
// the daemon out of descriptors and left the tree in the trash for good.)
func TestTrashDeepTree(t *testing.T) {
	const depth = 5000
	state := t.TempDir()
	var logs bytes.Buffer
	e, err := New(Config{Name: "n1", StateDir: state}, Deps{Log: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(state, "sandboxes", "sb-n1-deep")
	if err := os.MkdirAll(filepath.Join(dir, "upper"), 0o700); err != nil {
		t.Fatal(err)
	}
	filestest.DeepTree(t, filepath.Join(dir, "upper"), depth, nil)
	if err := e.discard(dir); err != nil {
		t.Fatal(err)
	}
	filestest.WithFDHeadroom(t, files.MaxRemoveFDs+2, func() { e.emptyTrash() })
	ents, err := os.ReadDir(e.trashDir())
	if err != nil {
		t.Fatal(err)
	}
	if len(ents) != 0 {
		t.Fatalf("trash not emptied: %v; log:\n%.2000s", ents, logs.String())
	}
}

// TestTrashRetriesBackOff: an entry that cannot be removed is logged once
// with its error cut short (a failure deep in a hostile tree was a 40 KB
// line per attempt), is not tried again before its pause ends, and is
// logged again only when its failure changes.
func TestTrashRetriesBackOff(t *testing.T) {
	state := t.TempDir()
	var logs bytes.Buffer
	e, err := New(Config{Name: "n1", StateDir: state}, Deps{Log: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(e.trashDir(), "sb-stuck.1"), 0o700); err != nil {
		t.Fatal(err)
	}
	calls := 0
	failure := errors.New("removing: " + strings.Repeat("d/", 20000) + ": too many open files")
	e.rmTree = func(string) error { calls++; return failure }
	warnings := func() []string {
		var out []string
		for _, l := range strings.Split(logs.String(), "\n") {
			if strings.Contains(l, "level=WARN") {
				out = append(out, l)
			}
		}
		return out
	}
	for range 10 {
		e.emptyTrash()
	}
	if calls != 1 {
		t.Fatalf("tried %d times within the pause, want 1", calls)
	}
	w := warnings()
	if len(w) != 1 || len(w[0]) > maxLoggedError+300 {
		t.Fatalf("want one bounded warning, got %d, longest %d bytes", len(w), longest(w))
	}
	r := e.trashRetries["sb-stuck.1"]
	if r == nil || time.Until(r.next) < trashRetryMin/2 {
		t.Fatalf("no pause before the next attempt: %+v", r)
	}
	first := r.wait
	r.next = time.Now().Add(-time.Second)
	e.emptyTrash()
	if calls != 2 || len(warnings()) != 1 || r.wait != 2*first {
		t.Fatalf("second attempt: calls %d, warnings %d, pause %v (first %v)", calls, len(warnings()), r.wait, first)
	}
	r.next = time.Now().Add(-time.Second)
	failure = errors.New("another failure")
	e.emptyTrash()
	if len(warnings()) != 2 {
		t.Fatalf("a changed failure was not logged: %d warnings", len(warnings()))
	}
	r.next = time.Now().Add(-time.Second)
	e.rmTree = nil
	e.emptyTrash()
	if _, ok := e.trashRetries["sb-stuck.1"]; ok {
		t.Fatal("a removed entry is still waiting for a retry")
	}
	if ents, _ := os.ReadDir(e.trashDir()); len(ents) != 0 {
		t.Fatalf("trash not emptied: %v", ents)
	}
}

func longest(ss []string) int {
	n := 0
	for _, s := range ss {
		n = max(n, len(s))
	}
	return n
}

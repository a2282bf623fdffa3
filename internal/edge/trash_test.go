package edge

import (
	"os"
	"path/filepath"
	"testing"
	"time"
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

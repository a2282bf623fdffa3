package store

import (
	"errors"
	"path/filepath"
	"testing"
	"time"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// The contract itself runs from store_contract_test.go (package store_test),
// since storetest imports this package.

func TestBoltPersists(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.db")
	b, err := OpenBolt(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Put("b", "k", []byte("v")); err != nil {
		t.Fatal(err)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	b, err = OpenBolt(path)
	if err != nil {
		t.Fatalf("reopening: %v", err)
	}
	defer b.Close()
	got, err := b.Get("b", "k")
	if err != nil || string(got) != "v" {
		t.Fatalf("Get after reopen = %q, %v; want \"v\"", got, err)
	}
}

func TestBoltSecondOpenFailsFast(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.db")
	first, err := OpenBolt(path)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()

	// flock locks are per open file, so a second open in this process
	// contends exactly like a second daemon would.
	start := time.Now()
	second, err := openBolt(path, 100*time.Millisecond, false)
	if err == nil {
		second.Close()
		t.Fatal("second open of a locked store succeeded")
	}
	if !errors.Is(err, errdefs.ErrUnavailable) {
		t.Errorf("err = %v, want ErrUnavailable", err)
	}
	if d := time.Since(start); d > 30*time.Second {
		t.Errorf("second open took %v; it should fail fast", d)
	}
}

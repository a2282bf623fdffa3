package layer

import (
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/internal/store"
)

// A pin its holder keeps is renewed, so that it does not go stale (and
// stop holding) however long the holder takes; once dropped, it is gone.
func TestPinRenewedWhileHeld(t *testing.T) {
	st := store.NewMemory()
	s, err := NewStore(filepath.Join(t.TempDir(), "layers"), st, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	old := pinRenewEvery
	pinRenewEvery = 10 * time.Millisecond
	defer func() { pinRenewEvery = old }()
	d := "sha256:ab" + strings.Repeat("0", 62)
	unpin, err := s.pin(d)
	if err != nil {
		t.Fatal(err)
	}
	// Age the pin past staleAfter, as if its holder had worked that long.
	b, err := st.Get(blobsBucket, d)
	if err != nil {
		t.Fatal(err)
	}
	var r blobRecord
	if err := json.Unmarshal(b, &r); err != nil || len(r.Pins) != 1 {
		t.Fatalf("pin record %s: %v", b, err)
	}
	for k := range r.Pins {
		r.Pins[k] = time.Now().Add(-2 * staleAfter)
	}
	b, _ = json.Marshal(r)
	if err := st.Put(blobsBucket, d, b); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		b, err := st.Get(blobsBucket, d)
		if err != nil {
			t.Fatal(err)
		}
		got, err := decodeBlob(b)
		if err != nil {
			t.Fatal(err)
		}
		if len(got.Pins) == 1 {
			break // renewed: no longer stale
		}
		if time.Now().After(deadline) {
			t.Fatal("a held pin went stale: it was not renewed")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if gone, err := s.collect(d); err != nil || gone {
		t.Fatalf("collect of a pinned blob: removed %v, %v", gone, err)
	}
	unpin()
	unpin() // twice is once
	time.Sleep(50 * time.Millisecond)
	if b, err := st.Get(blobsBucket, d); err == nil {
		t.Fatalf("after unpin the record is %s", b)
	}
}

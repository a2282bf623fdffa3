package layer

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/store"
)

func digestOf(c byte) string { return "sha256:" + strings.Repeat(string(c), 64) }

func remoteLayer(ref, digest, index string) api.Layer {
	return api.Layer{Ref: ref, Digest: digest, CreatedAt: time.Now().UTC(),
		Remote: &api.LayerRemote{Source: "oci://127.0.0.1:5000/x:1", Index: index, ChunkSize: 1 << 18, Pull: api.PullLazy}}
}

// TestOneIndexPerDigest: apiservers adding one image's digest at once
// with two chunk indexes (two contents under one name) leave it with one;
// the digest takes another index only once no ref names it (deleted,
// re-pointed, or the add that claimed it failed).
func TestOneIndexPerDigest(t *testing.T) {
	shared := store.NewMemory()
	dir := filepath.Join(t.TempDir(), "layers")
	var stores []*Store
	for range 2 { // two apiservers over one catalog
		s, err := NewStore(dir, shared, slog.New(slog.DiscardHandler))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		stores = append(stores, s)
	}
	d, i1, i2 := digestOf('a'), digestOf('1'), digestOf('2')
	var mu sync.Mutex
	won := map[string]int{}
	var wg sync.WaitGroup
	for k := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			index := []string{i1, i2}[k%2]
			_, err := stores[k/2%2].AddRemote(remoteLayer(fmt.Sprintf("base/x%d:1", k), d, index), BuildOptions{})
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				won[index]++
			case !errors.Is(err, errdefs.ErrAlreadyExists) || !strings.Contains(err.Error(), "chunk index"):
				t.Errorf("add %d: %v, want refused for the other chunk index", k, err)
			}
		}()
	}
	wg.Wait()
	if len(won) != 1 || won[i1]+won[i2] != 8 {
		t.Fatalf("adds that succeeded, by index: %v; want the 8 of one index", won)
	}
	winner, loser := i1, i2
	if won[i2] > 0 {
		winner, loser = i2, i1
	}
	// Still refused while any ref names the digest.
	for k := range 16 {
		if k%2 != map[string]int{i1: 0, i2: 1}[winner] {
			continue
		}
		if _, err := stores[0].AddRemote(remoteLayer("base/late:1", d, loser), BuildOptions{}); err == nil {
			t.Fatalf("the other index was taken with %d refs left", 8-k/2)
		}
		if err := stores[1].Delete(fmt.Sprintf("base/x%d:1", k), nil); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := stores[0].AddRemote(remoteLayer("base/late:1", d, loser), BuildOptions{}); err != nil {
		t.Fatalf("after every ref was deleted: %v", err)
	}

	// A ref re-pointed elsewhere gives its old digest up.
	d2 := digestOf('b')
	if _, err := stores[0].AddRemote(remoteLayer("base/late:1", d2, i1), BuildOptions{Replace: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := stores[1].AddRemote(remoteLayer("base/other:1", d, winner), BuildOptions{}); err != nil {
		t.Fatalf("after its ref was re-pointed: %v", err)
	}

	// An add that fails (its ref exists) leaves no claim behind.
	d3 := digestOf('c')
	if _, err := stores[0].AddRemote(remoteLayer("base/other:1", d3, i1), BuildOptions{}); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("adding over an existing ref: %v", err)
	}
	if _, err := stores[1].AddRemote(remoteLayer("base/third:1", d3, i2), BuildOptions{}); err != nil {
		t.Fatalf("after a failed add: %v", err)
	}
}

// TestIndexClaimGoesWithALocalRef: a pushed layer's local ref names the
// digest its registry ref does; the claim goes when the last of them,
// local or not, goes (a local ref deleted last used to leave it for good).
func TestIndexClaimGoesWithALocalRef(t *testing.T) {
	s, _ := newTestStore(t)
	d, i1, i2 := digestOf('d'), digestOf('1'), digestOf('2')
	local, err := json.Marshal(api.Layer{Ref: "base/py:1", Kind: "base", Digest: d, CreatedAt: time.Now().UTC()})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.st.Create(catalogBucket, "base/py:1", local); err != nil {
		t.Fatal(err)
	}
	if _, err := s.AddRemote(remoteLayer("base/py-lazy:1", d, i1), BuildOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := s.Delete("base/py-lazy:1", nil); err != nil {
		t.Fatal(err)
	}
	if _, err := s.AddRemote(remoteLayer("base/py-other:1", d, i2), BuildOptions{}); err == nil {
		t.Fatal("another index was taken while the local ref names the digest")
	}
	if err := s.Delete("base/py:1", nil); err != nil {
		t.Fatal(err)
	}
	if _, err := s.AddRemote(remoteLayer("base/py-other:1", d, i2), BuildOptions{}); err != nil {
		t.Fatalf("after the last ref, a local one, was deleted: %v", err)
	}
}

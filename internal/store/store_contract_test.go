package store_test

import (
	"fmt"
	"path/filepath"
	"testing"

	"github.com/dsecproject/dsec/internal/store"
	"github.com/dsecproject/dsec/internal/store/storetest"
)

func TestBoltContract(t *testing.T) {
	dir := t.TempDir()
	n := 0
	storetest.Run(t, func() store.Store {
		n++
		b, err := store.OpenBolt(filepath.Join(dir, fmt.Sprintf("state-%d.db", n)))
		if err != nil {
			// open runs on a subtest's goroutine, where t.Fatal on the
			// parent is not allowed; a panic still fails the test loudly.
			panic(err)
		}
		return b
	})
}

func TestBoltNoSyncContract(t *testing.T) {
	dir := t.TempDir()
	n := 0
	storetest.Run(t, func() store.Store {
		n++
		b, err := store.OpenBoltNoSync(filepath.Join(dir, fmt.Sprintf("nosync-%d.db", n)))
		if err != nil {
			panic(err)
		}
		return b
	})
}

func TestMemoryContract(t *testing.T) {
	storetest.Run(t, store.NewMemory)
}

// TestBoltWatcher: bbolt's file belongs to one process, so its own writes
// are all there is to watch; the watch contract holds as for etcd.
func TestBoltWatcher(t *testing.T) {
	dir := t.TempDir()
	n := 0
	storetest.RunWatcher(t, func() store.Store {
		n++
		b, err := store.OpenBolt(filepath.Join(dir, fmt.Sprintf("watch-%d.db", n)))
		if err != nil {
			panic(err)
		}
		return b
	})
}

func TestBoltPager(t *testing.T) {
	storetest.RunPager(t, func() store.Store {
		b, err := store.OpenBolt(filepath.Join(t.TempDir(), "pager.db"))
		if err != nil {
			t.Fatal(err)
		}
		return b
	})
}

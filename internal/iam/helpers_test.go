package iam

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/dsecproject/dsec/internal/store"
)

// plainStore hides the Watcher of the store it wraps: a store that cannot
// be watched, as bbolt (reads go to the store, keys are cached for
// cacheTTL).
type plainStore struct{ store.Store }

// countingStore counts the reads that reach the store it wraps; it keeps
// the wrapped store's Watcher.
type countingStore struct {
	store.Store
	gets, lists atomic.Int64
}

func (s *countingStore) Get(bucket, key string) ([]byte, error) {
	s.gets.Add(1)
	return s.Store.Get(bucket, key)
}

func (s *countingStore) List(bucket, prefix string) ([]store.KV, error) {
	s.lists.Add(1)
	return s.Store.List(bucket, prefix)
}

func (s *countingStore) WatchBucket(ctx context.Context, bucket string, reset func([]store.KV), change func(string, []byte)) {
	s.Store.(store.Watcher).WatchBucket(ctx, bucket, reset, change)
}

// lagStore is a watchable store whose change events wait until deliver is
// called, as etcd's arrive some time after the write (the memory store
// calls them inside the write).
type lagStore struct {
	store.Store
	mu      sync.Mutex
	pending []func()
}

func (s *lagStore) WatchBucket(ctx context.Context, bucket string, reset func([]store.KV), change func(string, []byte)) {
	s.Store.(store.Watcher).WatchBucket(ctx, bucket, reset, func(key string, val []byte) {
		s.mu.Lock()
		defer s.mu.Unlock()
		s.pending = append(s.pending, func() { change(key, val) })
	})
}

// deliver runs the events held back so far, in order.
func (s *lagStore) deliver() {
	s.mu.Lock()
	events := s.pending
	s.pending = nil
	s.mu.Unlock()
	for _, ev := range events {
		ev()
	}
}

// watched returns an IAM over st with its mirror on for the test's life.
func watched(t *testing.T, st store.Store) *IAM {
	t.Helper()
	m := newIAM(t, st)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	m.Watch(ctx)
	m.mu.RLock()
	on := m.mirrored()
	m.mu.RUnlock()
	if !on {
		t.Fatal("mirror not synced after Watch over a memory store")
	}
	return m
}

// storeMode is one way an IAM reads.
type storeMode struct {
	name string
	on   func(t *testing.T, st store.Store) *IAM
}

// iam returns an IAM of this mode over a new memory store.
func (mode storeMode) iam(t *testing.T) *IAM { return mode.on(t, store.NewMemory()) }

// storeModes are the two ways an IAM reads: from the store (bbolt, no
// watch) and from the mirror (etcd, watched). Tests of rules run in both.
var storeModes = []storeMode{
	{"store", func(t *testing.T, st store.Store) *IAM { return newIAM(t, plainStore{st}) }},
	{"mirror", watched},
}

package store

import (
	"bytes"
	"context"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// memory is a Store held in process memory. It passes the same contract as
// Bolt but keeps nothing across restarts: a fake for callers' tests, never a
// production backend.
type memory struct {
	mu      sync.Mutex
	buckets map[string]map[string][]byte
	// holds names the live Hold of each held key (bucket + "/" + key).
	holds map[string]*byte
	// watches are the WatchBucket callbacks by bucket, called under mu.
	watches map[string][]*memWatch
}

type memWatch struct {
	ctx    context.Context
	change func(key string, val []byte)
}

// NewMemory returns an empty in-memory Store for tests. Close is a no-op and
// the store stays usable after it.
func NewMemory() Store {
	return &memory{buckets: make(map[string]map[string][]byte), holds: map[string]*byte{}, watches: map[string][]*memWatch{}}
}

// Get implements Store.
func (m *memory) Get(bucket, key string) ([]byte, error) {
	if err := checkName(bucket, key); err != nil {
		return nil, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	v, ok := m.buckets[bucket][key]
	if !ok {
		return nil, errdefs.NotFound("%s/%s not found", bucket, key)
	}
	return bytes.Clone(v), nil
}

// Put implements Store.
func (m *memory) Put(bucket, key string, val []byte) error {
	if err := checkName(bucket, key); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.set(bucket, key, val)
	return nil
}

// Create implements Store.
func (m *memory) Create(bucket, key string, val []byte) error {
	if err := checkName(bucket, key); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.buckets[bucket][key]; ok {
		return errdefs.AlreadyExists("%s/%s already exists", bucket, key)
	}
	m.set(bucket, key, val)
	return nil
}

// Update implements Store. fn runs under the store's lock.
func (m *memory) Update(bucket, key string, fn func(old []byte) ([]byte, error)) error {
	if err := checkName(bucket, key); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	val, err := fn(bytes.Clone(m.buckets[bucket][key]))
	if err != nil {
		return err
	}
	if val == nil {
		m.unset(bucket, key)
		return nil
	}
	m.set(bucket, key, val)
	return nil
}

// Delete implements Store.
func (m *memory) Delete(bucket, key string) error {
	if err := checkName(bucket, key); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.unset(bucket, key)
	return nil
}

// List implements Store.
func (m *memory) List(bucket, prefix string) ([]KV, error) {
	if bucket == "" {
		return nil, errdefs.Invalid("store: empty bucket name")
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.list(bucket, prefix), nil
}

var _ Pager = (*memory)(nil)

// ListAfter implements Pager.
func (m *memory) ListAfter(bucket, after string, limit int) ([]KV, error) {
	if err := checkPage(bucket, limit); err != nil {
		return nil, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	var keys []string
	for k := range m.buckets[bucket] {
		if k > after {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	out := make([]KV, 0, min(len(keys), limit))
	for _, k := range keys[:min(len(keys), limit)] {
		out = append(out, KV{Key: k, Value: bytes.Clone(m.buckets[bucket][k])})
	}
	return out, nil
}

// list copies bucket's keys under prefix, in key order.
// Preconditions: m.mu held.
func (m *memory) list(bucket, prefix string) []KV {
	var out []KV
	for k, v := range m.buckets[bucket] {
		if strings.HasPrefix(k, prefix) {
			out = append(out, KV{Key: k, Value: bytes.Clone(v)})
		}
	}
	// Go compares strings bytewise, which is bbolt's key order too.
	sort.Slice(out, func(i, j int) bool { return out[i].Key < out[j].Key })
	return out
}

// Close implements Store.
func (m *memory) Close() error { return nil }

// Hold implements Leaser: the key lives until ctx ends (a memory store
// has no holder to lose). takeover runs under the store's lock.
func (m *memory) Hold(ctx context.Context, bucket, key string, val []byte, ttl time.Duration, takeover func(cur []byte) bool) (<-chan struct{}, error) {
	if err := checkName(bucket, key); err != nil {
		return nil, err
	}
	token := new(byte)
	m.mu.Lock()
	if cur, ok := m.buckets[bucket][key]; ok && (takeover == nil || !takeover(bytes.Clone(cur))) {
		m.mu.Unlock()
		return nil, errdefs.AlreadyExists("%s/%s is held by another process", bucket, key)
	}
	m.set(bucket, key, val)
	m.holds[bucket+"/"+key] = token
	m.mu.Unlock()
	lost := make(chan struct{})
	go func() {
		<-ctx.Done()
		// Only its own entry: a taker-over may hold the key since.
		m.mu.Lock()
		if m.holds[bucket+"/"+key] == token {
			delete(m.holds, bucket+"/"+key)
			m.unset(bucket, key)
		}
		m.mu.Unlock()
		close(lost)
	}()
	return lost, nil
}

// set stores a copy of val; a nil val is stored as empty, so it reads back
// as present.
//
// Preconditions: m.mu is held.
func (m *memory) set(bucket, key string, val []byte) {
	b, ok := m.buckets[bucket]
	if !ok {
		b = make(map[string][]byte)
		m.buckets[bucket] = b
	}
	b[key] = append([]byte{}, val...)
	m.notify(bucket, key, b[key])
}

// unset deletes key and tells the watches.
//
// Preconditions: m.mu is held.
func (m *memory) unset(bucket, key string) {
	if _, ok := m.buckets[bucket][key]; !ok {
		return
	}
	delete(m.buckets[bucket], key)
	m.notify(bucket, key, nil)
}

// notify tells the bucket's live watches about a write (val nil: deleted).
//
// Preconditions: m.mu is held.
func (m *memory) notify(bucket, key string, val []byte) {
	live := m.watches[bucket][:0]
	for _, w := range m.watches[bucket] {
		if w.ctx.Err() != nil {
			continue
		}
		live = append(live, w)
		w.change(key, bytes.Clone(val))
	}
	m.watches[bucket] = live
}

// WatchBucket implements Watcher. The callbacks run with the store's lock
// held: they must not call the store.
func (m *memory) WatchBucket(ctx context.Context, bucket string, reset func([]KV), change func(key string, val []byte)) {
	m.mu.Lock()
	defer m.mu.Unlock()
	reset(m.list(bucket, ""))
	m.watches[bucket] = append(m.watches[bucket], &memWatch{ctx: ctx, change: change})
}

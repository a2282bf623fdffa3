package iam

import (
	"context"
	"encoding/hex"
	"encoding/json"

	"github.com/dsecproject/dsec/internal/store"
)

// Watch keeps the projects and keys buckets in memory while ctx lasts, if
// the store can be watched (store.Watcher: etcd); otherwise it does
// nothing and reads go to the store. The server calls it once, at start;
// later calls do nothing.
//
// Once both buckets are synced, Authenticate and project lookups read
// memory. A key or project the mirror does not hold is read from the
// store once (it may have been created on another apiserver a moment
// ago). A key revoked on another apiserver stops working here when the
// watch delivers the deletion, within milliseconds while etcd answers.
// While etcd is unreachable the mirror keeps what it holds, so known keys
// keep working; the store's watch lists the buckets again when it
// reconnects.
func (m *IAM) Watch(ctx context.Context) {
	w, ok := m.st.(store.Watcher)
	if !ok {
		return
	}
	m.mu.Lock()
	if m.watching {
		m.mu.Unlock()
		return
	}
	m.watching = true
	m.tree, m.keys = newTree(), map[digest]Principal{}
	m.mu.Unlock()

	// The callbacks check ctx under mu: once the goroutine below has
	// turned the mirror off, a late callback of the store's (a listing
	// that finished after ctx ended) cannot turn it on again.
	w.WatchBucket(ctx, bucketProjects, func(kvs []store.KV) {
		t := newTree()
		for _, kv := range kvs {
			if proj, err := decodeProject(kv.Key, kv.Value); err == nil {
				t.put(proj)
			}
		}
		m.mu.Lock()
		defer m.mu.Unlock()
		if ctx.Err() != nil {
			return
		}
		m.tree, m.projSynced = t, true
		m.gen++
	}, func(key string, val []byte) {
		// An undecodable value is dropped: reads of it then go to the
		// store and fail there, as they would without a mirror.
		var proj Project
		var err error
		if val != nil {
			proj, err = decodeProject(key, val)
		}
		m.mu.Lock()
		defer m.mu.Unlock()
		if ctx.Err() != nil {
			return
		}
		m.gen++
		if val != nil && err == nil {
			m.tree.put(proj)
		} else {
			m.tree.del(key)
		}
	})
	w.WatchBucket(ctx, bucketKeys, func(kvs []store.KV) {
		keys := make(map[digest]Principal, len(kvs))
		for _, kv := range kvs {
			d, ok := parseDigest(kv.Key)
			var p Principal
			if ok && json.Unmarshal(kv.Value, &p) == nil {
				keys[d] = p
			}
		}
		m.mu.Lock()
		defer m.mu.Unlock()
		if ctx.Err() != nil {
			return
		}
		m.keys, m.keysSynced = keys, true
		m.gen++
	}, func(key string, val []byte) {
		d, ok := parseDigest(key)
		if !ok {
			return
		}
		var p Principal
		decoded := val != nil && json.Unmarshal(val, &p) == nil
		m.mu.Lock()
		defer m.mu.Unlock()
		if ctx.Err() != nil {
			return
		}
		m.gen++
		if decoded {
			m.keys[d] = p
		} else {
			delete(m.keys, d)
		}
	})
	go func() {
		<-ctx.Done()
		m.mu.Lock()
		defer m.mu.Unlock()
		m.projSynced, m.keysSynced = false, false
		m.tree, m.keys = newTree(), map[digest]Principal{}
		m.gen++
	}()
}

// mirrored reports whether the mirror answers reads.
//
// Preconditions: m.mu is held.
func (m *IAM) mirrored() bool { return m.projSynced && m.keysSynced }

// generation returns m.gen, to be noted before a store read or write whose
// result is then put in memory with learnProject or learnKey.
func (m *IAM) generation() uint64 {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return m.gen
}

// learnProject puts proj, just read from or written to the store, in the
// mirror, unless the mirror changed since gen: the watch then has (or will
// have) the newer state, which a late write here would overwrite for good.
func (m *IAM) learnProject(proj Project, gen uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.gen == gen && m.mirrored() {
		m.tree.put(proj)
	}
}

// forgetProject removes project id, just deleted from the store, from the
// mirror, with learnProject's condition: a delete overtaken by a
// re-creation elsewhere must not hide the new project from listings. The
// watch's own event removes it in every case.
func (m *IAM) forgetProject(id string, gen uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.gen == gen && m.mirrored() {
		m.tree.del(id)
		m.gen++
	}
}

// learnKey puts p, just read from or written to the store under d, in the
// mirror or (without a mirror) the cache, unless an eviction or a watch
// event happened since gen: a lookup that raced with a revocation may have
// read the key just before its deletion, and must not put it back.
func (m *IAM) learnKey(d digest, p Principal, gen uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.gen != gen {
		return
	}
	if m.mirrored() {
		m.keys[d] = p
		return
	}
	m.cache[d] = cacheEntry{p: p, expires: m.now().Add(cacheTTL)}
}

// forgetKey removes key d, just deleted from the store, from the mirror and
// the cache at once, whatever happened meanwhile: a revocation takes effect
// on this apiserver before RevokeKey returns. Forgetting too much is
// harmless: a key missing from memory is read from the store.
func (m *IAM) forgetKey(d digest) {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.cache, d)
	if m.keys != nil {
		delete(m.keys, d)
	}
	m.gen++
}

func parseDigest(s string) (digest, bool) {
	var d digest
	if len(s) != 2*len(d) {
		return d, false
	}
	if _, err := hex.Decode(d[:], []byte(s)); err != nil {
		return d, false
	}
	return d, true
}

package layer

import (
	"context"
	"encoding/json"
	"sync"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/store"
)

// catalogCache keeps the catalog in memory, fed by the store's watch
// (store.Watcher: etcd), so that resolving a ref on every create is not a
// round trip to etcd. A miss reads the store: a layer published a moment
// ago elsewhere is found even before its watch event arrives. This
// process's own writes go into the cache at once. A ref deleted or
// re-pointed on another process is seen when its event arrives (within
// milliseconds while etcd answers).
type catalogCache struct {
	mu     sync.RWMutex
	synced bool
	refs   map[string]api.Layer
}

// WatchCatalog starts keeping the catalog in memory while ctx lasts, if
// the store can be watched; otherwise every resolve reads the store
// (cheap for the local bbolt file).
func (s *Store) WatchCatalog(ctx context.Context) {
	w, ok := s.st.(store.Watcher)
	if !ok {
		return
	}
	c := &catalogCache{refs: map[string]api.Layer{}}
	s.cache = c
	w.WatchBucket(ctx, catalogBucket, func(kvs []store.KV) {
		refs := make(map[string]api.Layer, len(kvs))
		for _, kv := range kvs {
			var l api.Layer
			if json.Unmarshal(kv.Value, &l) == nil {
				refs[kv.Key] = l
			}
		}
		c.mu.Lock()
		c.refs, c.synced = refs, true
		c.mu.Unlock()
	}, func(key string, val []byte) {
		c.mu.Lock()
		defer c.mu.Unlock()
		if val == nil {
			delete(c.refs, key)
			return
		}
		var l api.Layer
		if json.Unmarshal(val, &l) == nil {
			c.refs[key] = l
		}
	})
	go func() {
		<-ctx.Done()
		c.mu.Lock()
		c.synced = false
		c.mu.Unlock()
	}()
}

func (c *catalogCache) get(ref string) (api.Layer, bool) {
	if c == nil {
		return api.Layer{}, false
	}
	c.mu.RLock()
	defer c.mu.RUnlock()
	if !c.synced {
		return api.Layer{}, false
	}
	l, ok := c.refs[ref]
	return l, ok
}

func (c *catalogCache) put(l api.Layer) {
	if c == nil {
		return
	}
	c.mu.Lock()
	c.refs[l.Ref] = l
	c.mu.Unlock()
}

func (c *catalogCache) del(ref string) {
	if c == nil {
		return
	}
	c.mu.Lock()
	delete(c.refs, ref)
	c.mu.Unlock()
}

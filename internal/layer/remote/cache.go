package remote

import (
	"container/list"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Cache is a node's size-bounded directory of verified chunks, named by
// their sha256 (so chunks shared by layers are kept once), evicted least
// recently used first. It outlives the process: opening it again finds
// what is there, oldest first. A chunk read back is checked against its
// name, so a file changed on disk is dropped, never served. Safe for
// concurrent use.
type Cache struct {
	dir string
	max int64

	mu   sync.Mutex
	size int64
	lru  *list.List // of *cacheEntry, most recent first
	ents map[[sha256.Size]byte]*list.Element
	// inflight holds the fetches under way, by chunk digest: a chunk that
	// several layers share is fetched once however many miss it.
	inflight map[[sha256.Size]byte]*fetchCall
}

type cacheEntry struct {
	sum  [sha256.Size]byte
	size int64
	// touched is when (unix nanos) the file's mtime was last moved
	// forward; it is moved at most once a minute, so hits cost no write.
	touched atomic.Int64
	// verified is the identity (inode and change time) of the file as
	// this process last checked it against its name (it wrote it, or read
	// it back whole and hashed it): a hit on the same file reads it
	// without hashing it again; a file replaced or changed since is
	// hashed again.
	verified atomic.Pointer[fileID]
}

// fileID identifies a file's content as far as the kernel tells: any
// write changes its ctime, a replacement its inode.
type fileID struct {
	ino   uint64
	ctime int64
}

func idOf(fi os.FileInfo) *fileID {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return nil
	}
	return &fileID{ino: st.Ino, ctime: st.Ctim.Nano()}
}

// OpenCache opens (creating) the cache at dir, bounded to max bytes; what
// is there beyond the bound is evicted, oldest first.
func OpenCache(dir string, max int64) (*Cache, error) {
	if max <= 0 {
		return nil, fmt.Errorf("chunk cache: bound must be positive, got %d", max)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("opening chunk cache: %w", err)
	}
	c := &Cache{dir: dir, max: max, lru: list.New(), ents: map[[sha256.Size]byte]*list.Element{},
		inflight: map[[sha256.Size]byte]*fetchCall{}}
	type found struct {
		e     *cacheEntry
		mtime time.Time
	}
	var all []found
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			return nil
		}
		name := d.Name()
		b, herr := hex.DecodeString(name)
		if herr != nil || len(b) != sha256.Size {
			os.Remove(p) // a temp file a crash left, or a stranger
			return nil
		}
		fi, err := d.Info()
		if err != nil {
			return nil
		}
		var sum [sha256.Size]byte
		copy(sum[:], b)
		e := &cacheEntry{sum: sum, size: fi.Size()}
		e.touched.Store(fi.ModTime().UnixNano())
		all = append(all, found{e, fi.ModTime()})
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("opening chunk cache: %w", err)
	}
	sort.Slice(all, func(i, j int) bool { return all[i].mtime.After(all[j].mtime) })
	for _, f := range all {
		c.ents[f.e.sum] = c.lru.PushBack(f.e)
		c.size += f.e.size
	}
	c.mu.Lock()
	c.evictLocked()
	c.mu.Unlock()
	return c, nil
}

func (c *Cache) path(sum [sha256.Size]byte) string {
	h := hex.EncodeToString(sum[:])
	return filepath.Join(c.dir, h[:2], h)
}

// Get returns the chunk with the given sum, if the cache has it intact.
func (c *Cache) Get(sum [sha256.Size]byte) ([]byte, bool) {
	c.mu.Lock()
	el, ok := c.ents[sum]
	if ok {
		c.lru.MoveToFront(el)
	}
	c.mu.Unlock()
	if !ok {
		return nil, false
	}
	e := el.Value.(*cacheEntry)
	b, ok := e.read(c.path(sum))
	if !ok {
		c.drop(sum, el)
		return nil, false
	}
	if now := time.Now(); now.Sub(time.Unix(0, e.touched.Load())) > time.Minute {
		e.touched.Store(now.UnixNano())
		os.Chtimes(c.path(sum), now, now)
	}
	return b, true
}

// read reads the entry's file, hashing it unless it is the very file
// this process checked before.
func (e *cacheEntry) read(path string) ([]byte, bool) {
	f, err := os.Open(path)
	if err != nil {
		return nil, false
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil || fi.Size() != e.size {
		return nil, false
	}
	b := make([]byte, e.size)
	if _, err := io.ReadFull(f, b); err != nil {
		return nil, false
	}
	id := idOf(fi)
	if v := e.verified.Load(); v == nil || id == nil || *v != *id {
		if sha256.Sum256(b) != e.sum {
			return nil, false
		}
		e.verified.Store(id)
	}
	return b, true
}

// Put stores a verified chunk and evicts what no longer fits. A chunk
// larger than the whole bound is not kept.
func (c *Cache) Put(sum [sha256.Size]byte, data []byte) error {
	if int64(len(data)) > c.max {
		return nil
	}
	c.mu.Lock()
	_, ok := c.ents[sum]
	c.mu.Unlock()
	if ok {
		return nil
	}
	p := c.path(sum)
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return fmt.Errorf("caching chunk: %w", err)
	}
	tmp, err := os.CreateTemp(filepath.Dir(p), ".tmp-*")
	if err != nil {
		return fmt.Errorf("caching chunk: %w", err)
	}
	_, werr := tmp.Write(data)
	cerr := tmp.Close()
	if err := errors.Join(werr, cerr); err != nil {
		os.Remove(tmp.Name())
		return fmt.Errorf("caching chunk: %w", err)
	}
	if err := os.Rename(tmp.Name(), p); err != nil {
		os.Remove(tmp.Name())
		return fmt.Errorf("caching chunk: %w", err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.ents[sum]; !ok {
		e := &cacheEntry{sum: sum, size: int64(len(data))}
		e.touched.Store(time.Now().UnixNano())
		if fi, err := os.Stat(p); err == nil {
			e.verified.Store(idOf(fi)) // the caller verified data; this process wrote it
		}
		c.ents[sum] = c.lru.PushFront(e)
		c.size += int64(len(data))
	}
	c.evictLocked()
	return nil
}

// drop removes the entry el of sum, unless it has been replaced since.
func (c *Cache) drop(sum [sha256.Size]byte, el *list.Element) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if cur, ok := c.ents[sum]; ok && cur == el {
		c.removeLocked(el)
	}
}

// evictLocked removes least recently used chunks until the cache fits.
//
// Preconditions: c.mu held.
func (c *Cache) evictLocked() {
	for c.size > c.max {
		el := c.lru.Back()
		if el == nil {
			return
		}
		c.removeLocked(el)
	}
}

func (c *Cache) removeLocked(el *list.Element) {
	e := el.Value.(*cacheEntry)
	c.lru.Remove(el)
	delete(c.ents, e.sum)
	c.size -= e.size
	os.Remove(c.path(e.sum))
}

// Size is the bytes the cache holds now.
func (c *Cache) Size() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.size
}

// Clear removes every chunk (a cold start, for measurements).
func (c *Cache) Clear() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for el := c.lru.Front(); el != nil; el = c.lru.Front() {
		c.removeLocked(el)
	}
}

// Has reports whether the cache holds the chunk (without reading it).
func (c *Cache) Has(sum [sha256.Size]byte) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	_, ok := c.ents[sum]
	return ok
}

// claim returns the fetch under way of the chunk sum, or registers a new
// one that the caller (owner) must complete.
func (c *Cache) claim(sum [sha256.Size]byte) (call *fetchCall, owner bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if f, ok := c.inflight[sum]; ok {
		return f, false
	}
	f := &fetchCall{done: make(chan struct{})}
	c.inflight[sum] = f
	return f, true
}

// complete ends a claimed fetch and wakes its waiters.
func (c *Cache) complete(sum [sha256.Size]byte, f *fetchCall, data []byte, err error) {
	c.mu.Lock()
	if c.inflight[sum] == f {
		delete(c.inflight, sum)
	}
	c.mu.Unlock()
	f.data, f.err = data, err
	close(f.done)
}

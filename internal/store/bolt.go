package store

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.etcd.io/bbolt"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// openTimeout bounds the wait for bbolt's exclusive file lock. bbolt's default
// (zero) waits forever, so a second `dsec up` on the same state file would hang
// silently; one second is long enough to ride out a predecessor that is still
// closing, and short enough for the operator to see the error at once.
const openTimeout = time.Second

// Bolt is a Store in a single bbolt file, for `dsec up` and single-node
// servers. Writes are fsynced before they return (bbolt's defaults).
//
// It is a Watcher too: the file is locked for one process, so every write
// goes through this Bolt, which tells the watches after it commits. Writes
// and notices go in order under wmu (bbolt has a single writer anyway).
type Bolt struct {
	db *bbolt.DB

	wmu     sync.Mutex
	watches map[string][]*memWatch
}

var (
	_ Store   = (*Bolt)(nil)
	_ Watcher = (*Bolt)(nil)
	_ Pager   = (*Bolt)(nil)
)

// OpenBolt opens (creating if needed) the bbolt file at path. The file is
// locked for the life of the Bolt: if another process holds it, OpenBolt fails
// after a short wait with an error of class errdefs.ErrUnavailable.
func OpenBolt(path string) (*Bolt, error) {
	return openBolt(path, openTimeout, false)
}

// OpenBoltNoSync is OpenBolt for state that may lose its last writes in a
// crash of the host (not of the process: written pages are in the page
// cache): writes are not fsynced, which takes a write from milliseconds to
// tens of microseconds. dsec up keeps its idempotency records so.
func OpenBoltNoSync(path string) (*Bolt, error) {
	return openBolt(path, openTimeout, true)
}

func openBolt(path string, timeout time.Duration, noSync bool) (*Bolt, error) {
	db, err := bbolt.Open(path, 0o600, &bbolt.Options{Timeout: timeout, NoSync: noSync, NoFreelistSync: noSync})
	if errors.Is(err, bbolt.ErrTimeout) {
		return nil, fmt.Errorf("opening store %s: %w: the file is locked by another process (is another dsec daemon running on it?)",
			path, errdefs.ErrUnavailable)
	}
	if err != nil {
		return nil, fmt.Errorf("opening store %s: %w", path, err)
	}
	return &Bolt{db: db, watches: map[string][]*memWatch{}}, nil
}

// write runs fn in a write transaction and, once it has committed, tells
// the bucket's watches what it changed (fn reports it through set).
func (b *Bolt) write(bucket string, fn func(tx *bbolt.Tx, set func(key string, val []byte)) error) error {
	b.wmu.Lock()
	defer b.wmu.Unlock()
	type change struct {
		key string
		val []byte
	}
	var changes []change
	err := b.db.Update(func(tx *bbolt.Tx) error {
		changes = changes[:0] // bbolt does not retry, but be exact
		return fn(tx, func(key string, val []byte) { changes = append(changes, change{key, bytes.Clone(val)}) })
	})
	if err != nil || len(b.watches[bucket]) == 0 {
		return err
	}
	live := b.watches[bucket][:0]
	for _, w := range b.watches[bucket] {
		if w.ctx.Err() != nil {
			continue
		}
		live = append(live, w)
		for _, c := range changes {
			w.change(c.key, bytes.Clone(c.val))
		}
	}
	b.watches[bucket] = live
	return nil
}

// WatchBucket implements Watcher. The callbacks run with the store's write
// lock held: they must not call the store.
func (b *Bolt) WatchBucket(ctx context.Context, bucket string, reset func([]KV), change func(key string, val []byte)) {
	b.wmu.Lock()
	defer b.wmu.Unlock()
	kvs, err := b.List(bucket, "")
	if err != nil {
		kvs = nil
	}
	reset(kvs)
	b.watches[bucket] = append(b.watches[bucket], &memWatch{ctx: ctx, change: change})
}

// Get implements Store.
func (b *Bolt) Get(bucket, key string) ([]byte, error) {
	if err := checkName(bucket, key); err != nil {
		return nil, err
	}
	var out []byte
	err := b.db.View(func(tx *bbolt.Tx) error {
		v, ok := lookup(tx.Bucket([]byte(bucket)), key)
		if !ok {
			return errdefs.NotFound("%s/%s not found", bucket, key)
		}
		out = v
		return nil
	})
	return out, err
}

// Put implements Store.
func (b *Bolt) Put(bucket, key string, val []byte) error {
	if err := checkName(bucket, key); err != nil {
		return err
	}
	return b.write(bucket, func(tx *bbolt.Tx, set func(string, []byte)) error {
		bk, err := tx.CreateBucketIfNotExists([]byte(bucket))
		if err != nil {
			return fmt.Errorf("creating bucket %s: %w", bucket, err)
		}
		set(key, nonNilValue(val))
		return putCopy(bk, key, val)
	})
}

// Create implements Store.
func (b *Bolt) Create(bucket, key string, val []byte) error {
	if err := checkName(bucket, key); err != nil {
		return err
	}
	return b.write(bucket, func(tx *bbolt.Tx, set func(string, []byte)) error {
		bk, err := tx.CreateBucketIfNotExists([]byte(bucket))
		if err != nil {
			return fmt.Errorf("creating bucket %s: %w", bucket, err)
		}
		if _, ok := lookup(bk, key); ok {
			return errdefs.AlreadyExists("%s/%s already exists", bucket, key)
		}
		set(key, nonNilValue(val))
		return putCopy(bk, key, val)
	})
}

// Update implements Store. fn runs inside bbolt's write transaction, which
// serialises it against every other writer of the file.
func (b *Bolt) Update(bucket, key string, fn func(old []byte) ([]byte, error)) error {
	if err := checkName(bucket, key); err != nil {
		return err
	}
	return b.write(bucket, func(tx *bbolt.Tx, set func(string, []byte)) error {
		bk, err := tx.CreateBucketIfNotExists([]byte(bucket))
		if err != nil {
			return fmt.Errorf("creating bucket %s: %w", bucket, err)
		}
		old, had := lookup(bk, key)
		val, err := fn(old)
		if err != nil {
			return err
		}
		if val == nil {
			if had {
				set(key, nil)
			}
			return deleteKey(bk, key)
		}
		set(key, nonNilValue(val))
		return putCopy(bk, key, val)
	})
}

// Delete implements Store.
func (b *Bolt) Delete(bucket, key string) error {
	if err := checkName(bucket, key); err != nil {
		return err
	}
	return b.write(bucket, func(tx *bbolt.Tx, set func(string, []byte)) error {
		bk := tx.Bucket([]byte(bucket))
		if bk == nil {
			return nil
		}
		if _, ok := lookup(bk, key); ok {
			set(key, nil)
		}
		return deleteKey(bk, key)
	})
}

// List implements Store.
func (b *Bolt) List(bucket, prefix string) ([]KV, error) {
	if bucket == "" {
		return nil, errdefs.Invalid("store: empty bucket name")
	}
	var out []KV
	err := b.db.View(func(tx *bbolt.Tx) error {
		bk := tx.Bucket([]byte(bucket))
		if bk == nil {
			return nil
		}
		p := []byte(prefix)
		c := bk.Cursor()
		for k, v := c.Seek(p); k != nil && bytes.HasPrefix(k, p); k, v = c.Next() {
			out = append(out, KV{Key: string(k), Value: bytes.Clone(nonNil(v))})
		}
		return nil
	})
	return out, err
}

// ListAfter implements Pager.
func (b *Bolt) ListAfter(bucket, after string, limit int) ([]KV, error) {
	if err := checkPage(bucket, limit); err != nil {
		return nil, err
	}
	var out []KV
	err := b.db.View(func(tx *bbolt.Tx) error {
		bk := tx.Bucket([]byte(bucket))
		if bk == nil {
			return nil
		}
		c := bk.Cursor()
		k, v := c.Seek([]byte(after))
		if k != nil && string(k) == after {
			k, v = c.Next()
		}
		for ; k != nil && len(out) < limit; k, v = c.Next() {
			out = append(out, KV{Key: string(k), Value: bytes.Clone(nonNil(v))})
		}
		return nil
	})
	return out, err
}

// Close implements Store. It releases the file lock.
func (b *Bolt) Close() error {
	return b.db.Close()
}

// lookup returns a copy of key's value in bk (nil-safe) and whether the key
// exists. It seeks with a cursor rather than calling Bucket.Get because Get
// cannot tell an absent key from an empty value.
func lookup(bk *bbolt.Bucket, key string) ([]byte, bool) {
	if bk == nil {
		return nil, false
	}
	k, v := bk.Cursor().Seek([]byte(key))
	if k == nil || string(k) != key {
		return nil, false
	}
	// The slice points into the mmap and dies with the transaction.
	return bytes.Clone(nonNil(v)), true
}

// putCopy stores a copy of val: bbolt keeps a reference to the slice until
// the transaction commits, and the caller may reuse it meanwhile.
func putCopy(bk *bbolt.Bucket, key string, val []byte) error {
	if err := bk.Put([]byte(key), bytes.Clone(nonNil(val))); err != nil {
		return fmt.Errorf("writing %s: %w", key, err)
	}
	return nil
}

func deleteKey(bk *bbolt.Bucket, key string) error {
	if err := bk.Delete([]byte(key)); err != nil {
		return fmt.Errorf("deleting %s: %w", key, err)
	}
	return nil
}

// nonNil turns nil into an empty slice so that a stored empty value reads
// back as present (non-nil), distinct from "absent".
func nonNil(b []byte) []byte {
	if b == nil {
		return []byte{}
	}
	return b
}

// nonNilValue is what a watch is told a key now holds: an empty value
// reads back as present, so it is not passed as nil (deleted).
func nonNilValue(val []byte) []byte {
	if val == nil {
		return []byte{}
	}
	return val
}

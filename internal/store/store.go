// Package store keeps the control plane's durable state (IAM, layer catalog,
// node registry) behind a narrow key/value interface: an embedded bbolt file
// for `dsec up`, etcd for clusters. Values are opaque bytes (JSON by
// convention); buckets are flat namespaces. Only control-plane packages
// (iam, layer catalog, apiserver) import it; the edge keeps its own state on
// local disk.
package store

import (
	"context"
	"strings"
	"time"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// KV is one key and its value.
type KV struct {
	Key   string
	Value []byte
}

// Store is the control plane's key/value store. Implementations are safe for
// concurrent use. Missing keys yield errdefs.ErrNotFound; an empty bucket or
// key name yields errdefs.ErrInvalid. Values handed in are copied, and values
// handed out belong to the caller. Every implementation passes the contract
// in package storetest.
type Store interface {
	// Get returns the value of key in bucket.
	Get(bucket, key string) ([]byte, error)
	// Put sets key to val, creating the bucket if needed.
	Put(bucket, key string, val []byte) error
	// Create sets key to val only if key is absent (errdefs.ErrAlreadyExists otherwise).
	Create(bucket, key string, val []byte) error
	// Update atomically replaces the value of key with fn(old); old is nil
	// when absent. fn returning nil deletes the key; an error aborts and is
	// returned unchanged. fn runs inside the store's transaction, so it must
	// not call the Store, and it may run more than once (an etcd store
	// retries on conflict, and after a write whose answer was lost, when
	// fn sees the value its own earlier run wrote), so it must have no side
	// effects and must accept its own result as old.
	Update(bucket, key string, fn func(old []byte) ([]byte, error)) error
	// Delete removes key; deleting an absent key is not an error.
	Delete(bucket, key string) error
	// List returns the pairs whose key starts with prefix, in key order.
	List(bucket, prefix string) ([]KV, error)
	// Close releases the store.
	Close() error
}

// Leaser is implemented by stores whose keys can be bound to the life of
// the process that wrote them (etcd leases): the node registry.
type Leaser interface {
	// Hold creates key with val and keeps it while ctx lasts and the
	// store hears from the holder at least every ttl. The returned channel
	// closes once the key is gone: ctx ended (the key is then removed) or
	// the lease was lost (the holder was cut off from the store for longer
	// than ttl).
	//
	// If key exists, takeover (when not nil) is asked about its value: if
	// it says yes, the key is given val and moved to this hold in one
	// step, so no reader ever sees it missing, and the earlier holder's
	// end no longer removes it. Otherwise the answer is
	// errdefs.ErrAlreadyExists.
	Hold(ctx context.Context, bucket, key string, val []byte, ttl time.Duration, takeover func(cur []byte) bool) (lost <-chan struct{}, err error)
}

// checkBucket rejects a bucket name no backend can list: empty, or with
// the "/" that ends an etcd bucket's prefix.
func checkBucket(bucket string) error {
	if bucket == "" {
		return errdefs.Invalid("store: empty bucket name")
	}
	if strings.Contains(bucket, "/") {
		return errdefs.Invalid("store: bucket name %q contains /", bucket)
	}
	return nil
}

// checkPage rejects a page request no backend can answer.
func checkPage(bucket string, limit int) error {
	if err := checkBucket(bucket); err != nil {
		return err
	}
	if limit < 1 {
		return errdefs.Invalid("store: a page of %d keys; want at least 1", limit)
	}
	return nil
}

// checkName rejects the names no backend can store: bbolt refuses empty keys
// and buckets, and an etcd key built from them would be ambiguous.
func checkName(bucket, key string) error {
	if bucket == "" {
		return errdefs.Invalid("store: empty bucket name")
	}
	if key == "" {
		return errdefs.Invalid("store: empty key in bucket %q", bucket)
	}
	return nil
}

// Watcher is implemented by stores that tell about changes (etcd), so
// that a process can keep a bucket in memory instead of reading it on
// every request.
type Watcher interface {
	// WatchBucket calls reset with the whole bucket, then change with
	// every later write (val nil: deleted) in order, until ctx ends. After
	// a gap it cannot replay (a reconnect past a compaction), it calls
	// reset again with the bucket as it is then. Both run on one
	// goroutine of the store's; WatchBucket returns at once.
	WatchBucket(ctx context.Context, bucket string, reset func([]KV), change func(key string, val []byte))
}

// Pager is implemented by stores that list a bucket a page at a time, so
// that a bucket of any size is never held whole (etcd: one bounded range
// request a page).
type Pager interface {
	// ListAfter returns at most limit pairs of bucket whose key sorts
	// after the key after (from the first with after ""), in key order.
	ListAfter(bucket, after string, limit int) ([]KV, error)
}

// Batcher is implemented by stores that can write many keys in one
// transaction (etcd: one raft entry and one fsync for all), which callers
// use to group concurrent writes.
type Batcher interface {
	// Write creates every key of creates (absent before) and sets every
	// key of puts, in one transaction; if any key of creates exists,
	// nothing is written (errdefs.ErrAlreadyExists).
	Write(bucket string, creates, puts []KV) error
}

package store

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/store/etcdtest"
)

// TestEtcdExpiringBucket: every kind of write to an expiring bucket binds
// its key to a lease that ends at least the bucket's time later, other
// buckets' keys are bound to none, etcd removes the keys when the lease
// ends, and a lease that went away behind the store's back is replaced.
func TestEtcdExpiringBucket(t *testing.T) {
	if _, err := etcdtest.Binary(); err != nil {
		t.Skip(err)
	}
	defer func(s time.Duration) { expiryStep = s }(expiryStep)
	expiryStep = time.Second
	c, err := etcdtest.Start(t.TempDir(), 1)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Stop()
	const ttl = 2 * time.Second
	st, err := OpenEtcd(EtcdConfig{Endpoints: c.Endpoints(), Prefix: fmt.Sprintf("/exp-%d/", time.Now().UnixNano()),
		Expiring: map[string]time.Duration{"exp": ttl}})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if st.ExpiresAfter("exp") != ttl || st.ExpiresAfter("keep") != 0 {
		t.Fatalf("ExpiresAfter: %v, %v", st.ExpiresAfter("exp"), st.ExpiresAfter("keep"))
	}
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(st.Put("exp", "put", []byte("1")))
	must(st.Create("exp", "create", []byte("1")))
	must(st.Write("exp", []KV{{Key: "w-create", Value: []byte("1")}}, []KV{{Key: "w-put", Value: []byte("1")}}))
	must(st.Update("exp", "update", func([]byte) ([]byte, error) { return []byte("1"), nil }))
	must(st.Put("keep", "k", []byte("1")))
	// An update of a key keeps it bound to a lease.
	must(st.Update("exp", "put", func(old []byte) ([]byte, error) { return append(old, '2'), nil }))
	leaseOf := func(bucket, key string) (clientv3.LeaseID, bool) {
		t.Helper()
		r, err := st.c.Get(context.Background(), st.key(bucket, key))
		if err != nil {
			t.Fatal(err)
		}
		if len(r.Kvs) == 0 {
			return 0, false
		}
		return clientv3.LeaseID(r.Kvs[0].Lease), true
	}
	keys := []string{"put", "create", "w-create", "w-put", "update"}
	for _, k := range keys {
		id, ok := leaseOf("exp", k)
		if !ok || id == 0 {
			t.Fatalf("exp/%s: present %v, lease %x; want a lease", k, ok, id)
		}
		ttlr, err := st.c.TimeToLive(context.Background(), id)
		if err != nil {
			t.Fatal(err)
		}
		if left := time.Duration(ttlr.TTL) * time.Second; left < ttl-time.Second || left > ttl+2*expiryStep+time.Second {
			t.Errorf("exp/%s: its lease ends in %v, want about %v", k, left, ttl)
		}
	}
	if id, ok := leaseOf("keep", "k"); !ok || id != 0 {
		t.Fatalf("keep/k: present %v, lease %x; want no lease", ok, id)
	}

	// A lease revoked behind the store's back is replaced.
	id, _ := leaseOf("exp", "put")
	if _, err := st.c.Revoke(context.Background(), id); err != nil {
		t.Fatal(err)
	}
	must(st.Put("exp", "after-revoke", []byte("1")))
	if nid, ok := leaseOf("exp", "after-revoke"); !ok || nid == 0 || nid == id {
		t.Fatalf("after a revoke: lease %x (revoked %x)", nid, id)
	}

	// etcd removes the keys once their leases end; other buckets keep theirs.
	deadline := time.Now().Add(ttl + 2*expiryStep + 10*time.Second)
	for _, k := range append(keys, "after-revoke") {
		for {
			_, err := st.Get("exp", k)
			if errors.Is(err, errdefs.ErrNotFound) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("exp/%s still there after its lease ended (%v)", k, err)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	if _, err := st.Get("keep", "k"); err != nil {
		t.Fatalf("keep/k: %v", err)
	}
	if _, err := OpenEtcd(EtcdConfig{Endpoints: c.Endpoints(), Expiring: map[string]time.Duration{"exp": 0}}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("an expiry of 0: %v, want invalid", err)
	}
}

package iam

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/store"
)

// TestMirrorDeliversRevocation: a key deleted behind this IAM's back (by
// another apiserver) keeps working from memory until the watch delivers
// the deletion, and stops at once when it does.
func TestMirrorDeliversRevocation(t *testing.T) {
	ls := &lagStore{Store: store.NewMemory()}
	cs := &countingStore{Store: ls}
	m := watched(t, cs)
	key, p := mustKey(t, m, rootAdmin, RootProject, RoleMember)
	ls.deliver()

	gets := cs.gets.Load()
	for range 3 {
		if _, err := m.Authenticate(key); err != nil {
			t.Fatal(err)
		}
	}
	if n := cs.gets.Load() - gets; n != 0 {
		t.Errorf("Authenticate of a mirrored key read the store %d times", n)
	}

	if err := ls.Store.Delete(bucketKeys, hashKey(key).hex()); err != nil { // another apiserver
		t.Fatal(err)
	}
	if _, err := m.Authenticate(key); err != nil {
		t.Fatalf("before the watch delivered the deletion: %v (the mirror answers until then)", err)
	}
	ls.deliver()
	_, err := m.Authenticate(key)
	wantErr(t, "once the deletion is delivered", err, errdefs.ErrUnauthenticated)
	if ks, _ := m.ListKeys(rootAdmin, RootProject); len(ks) != 0 {
		t.Errorf("ListKeys after the deletion = %v (was %s)", ks, p.ID)
	}
}

// TestMirrorReadsThroughForNewKey: a key created on another apiserver
// works here before its watch event arrives, for one store read.
func TestMirrorReadsThroughForNewKey(t *testing.T) {
	ls := &lagStore{Store: store.NewMemory()}
	cs := &countingStore{Store: ls}
	m := watched(t, cs)
	const key = "dsec_made_on_another_apiserver"
	putKey(t, ls.Store, key, Principal{Project: RootProject, Role: RoleViewer})

	gets := cs.gets.Load()
	for range 3 {
		if p, err := m.Authenticate(key); err != nil || p.Role != RoleViewer {
			t.Fatalf("Authenticate(new key) = %+v, %v", p, err)
		}
	}
	if n := cs.gets.Load() - gets; n != 1 {
		t.Errorf("store read %d times for a new key, want 1", n)
	}
	// Unknown keys are read through too, and refused.
	_, err := m.Authenticate("dsec_nobody")
	wantErr(t, "unknown key", err, errdefs.ErrUnauthenticated)

	// Projects too.
	putProject(t, ls.Store, Project{ID: "fresh", Parent: RootProject, Name: "fresh"})
	if _, err := m.GetProject(rootAdmin, "fresh"); err != nil {
		t.Errorf("GetProject(created elsewhere, event pending): %v", err)
	}
	if err := ls.Store.Delete(bucketProjects, "fresh"); err != nil {
		t.Fatal(err)
	}
	ls.deliver()
	_, err = m.GetProject(rootAdmin, "fresh")
	wantErr(t, "GetProject(deleted elsewhere, delivered)", err, errdefs.ErrNotFound)
}

// raceStore deletes a key right after a Get reads it, once: the deletion
// lands between a lookup's read and its putting the result in memory.
type raceStore struct {
	store.Store
	mu    sync.Mutex
	armed func()
}

func (s *raceStore) Get(bucket, key string) ([]byte, error) {
	val, err := s.Store.Get(bucket, key)
	s.mu.Lock()
	hook := s.armed
	s.armed = nil
	s.mu.Unlock()
	if hook != nil && bucket == bucketKeys {
		hook()
	}
	return val, err
}

func (s *raceStore) WatchBucket(ctx context.Context, bucket string, reset func([]store.KV), change func(string, []byte)) {
	s.Store.(store.Watcher).WatchBucket(ctx, bucket, reset, change)
}

// TestLookupRacingDeletionNotRemembered: a lookup that read a key just
// before its deletion must not put it back in memory.
func TestLookupRacingDeletionNotRemembered(t *testing.T) {
	t.Run("mirror", func(t *testing.T) {
		mem := store.NewMemory()
		rs := &raceStore{Store: mem}
		m := watched(t, rs)
		const key = "dsec_racing_key_mirror"
		// Written with the watch's event lost, so the mirror does not
		// hold it and the next Authenticate reads the store.
		putKey(t, plainStore{mem}, key, Principal{Project: RootProject, Role: RoleViewer})
		h := hashKey(key)
		m.forgetKey(h)
		rs.armed = func() { _ = mem.Delete(bucketKeys, h.hex()) } // the watch delivers it at once
		if _, err := m.Authenticate(key); err != nil {
			t.Fatalf("the read before the deletion: %v", err)
		}
		_, err := m.Authenticate(key)
		wantErr(t, "after the deletion", err, errdefs.ErrUnauthenticated)
	})
	t.Run("cache", func(t *testing.T) {
		mem := store.NewMemory()
		rs := &raceStore{Store: mem}
		m := newIAM(t, plainStore{rs})
		key, p := mustKey(t, m, rootAdmin, RootProject, RoleViewer)
		m.forgetKey(hashKey(key))
		rs.armed = func() {
			if err := m.RevokeKey(rootAdmin, RootProject, p.ID); err != nil {
				t.Error(err)
			}
		}
		if _, err := m.Authenticate(key); err != nil {
			t.Fatalf("the read before the revocation: %v", err)
		}
		_, err := m.Authenticate(key)
		wantErr(t, "after the revocation", err, errdefs.ErrUnauthenticated)
	})
}

// TestNoWatcherRevocationWithin2s: without a watch (bbolt), a key deleted
// behind this IAM's back stops working within cacheTTL, at most 1 s.
func TestNoWatcherRevocationWithin2s(t *testing.T) {
	if cacheTTL > time.Second {
		t.Fatalf("cacheTTL = %v; a revocation must take effect within 2 s", cacheTTL)
	}
	mem := store.NewMemory()
	m := newIAM(t, plainStore{mem})
	m.Watch(context.Background()) // not a Watcher: does nothing
	advance := fakeClock(m)
	key, _ := mustKey(t, m, rootAdmin, RootProject, RoleMember)
	if _, err := m.Authenticate(key); err != nil {
		t.Fatal(err)
	}
	if err := mem.Delete(bucketKeys, hashKey(key).hex()); err != nil {
		t.Fatal(err)
	}
	advance(cacheTTL)
	_, err := m.Authenticate(key)
	wantErr(t, "cacheTTL after the deletion", err, errdefs.ErrUnauthenticated)
}

// downStore fails every read and write with errdefs.ErrUnavailable while
// down is set, as etcd without quorum.
type downStore struct {
	store.Store
	down atomic.Bool
}

func (s *downStore) Get(bucket, key string) ([]byte, error) {
	if s.down.Load() {
		return nil, errdefs.Unavailable("etcd: no quorum")
	}
	return s.Store.Get(bucket, key)
}

func (s *downStore) List(bucket, prefix string) ([]store.KV, error) {
	if s.down.Load() {
		return nil, errdefs.Unavailable("etcd: no quorum")
	}
	return s.Store.List(bucket, prefix)
}

func (s *downStore) WatchBucket(ctx context.Context, bucket string, reset func([]store.KV), change func(string, []byte)) {
	s.Store.(store.Watcher).WatchBucket(ctx, bucket, reset, change)
}

// TestStoreDownKnownKeysWork: while the store is unreachable, keys this
// apiserver knew keep working (in both modes), expired ones do not, and
// unknown ones fail as unavailable.
func TestStoreDownKnownKeysWork(t *testing.T) {
	for _, mode := range []storeMode{
		{"store", func(t *testing.T, st store.Store) *IAM { return newIAM(t, plainStore{st}) }},
		{"mirror", watched},
	} {
		t.Run(mode.name, func(t *testing.T) {
			ds := &downStore{Store: store.NewMemory()}
			m := newTeamsOn(t, mode.on(t, ds).st)
			if mode.name == "mirror" {
				m = watched(t, ds)
			}
			advance := fakeClock(m)
			key, p := mustKey(t, m, rootAdmin, "a-sub", RoleMember)
			shortKey, _, err := m.CreateKey(rootAdmin, "a-sub", RoleMember, "", time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			for _, k := range []string{key, shortKey} {
				if _, err := m.Authenticate(k); err != nil {
					t.Fatal(err)
				}
			}
			ds.down.Store(true)
			advance(2 * time.Minute) // past the cache's TTL and the short key's life
			if got, err := m.Authenticate(key); err != nil || got.ID != p.ID {
				t.Errorf("known key while the store is down: %+v, %v", got, err)
			}
			_, err = m.Authenticate(shortKey)
			wantErr(t, "expired key while the store is down", err, errdefs.ErrUnauthenticated)
			_, err = m.Authenticate("dsec_never_seen")
			wantErr(t, "unknown key while the store is down", err, errdefs.ErrUnavailable)
			if mode.name == "mirror" {
				if err := m.AuthorizeIn(p, SandboxCreate, "a-sub"); err != nil {
					t.Errorf("AuthorizeIn from the mirror while the store is down: %v", err)
				}
			}
		})
	}
}

// scriptStore lets a test play the store's watch: it keeps the callbacks
// and calls them only when told.
type scriptStore struct {
	store.Store
	mu      sync.Mutex
	resets  map[string]func([]store.KV)
	changes map[string]func(string, []byte)
}

func (s *scriptStore) WatchBucket(ctx context.Context, bucket string, reset func([]store.KV), change func(string, []byte)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.resets == nil {
		s.resets, s.changes = map[string]func([]store.KV){}, map[string]func(string, []byte){}
	}
	s.resets[bucket], s.changes[bucket] = reset, change
}

// relist calls the reset of bucket with the store's contents, as etcd's
// watch does after a gap it cannot replay.
func (s *scriptStore) relist(t *testing.T, bucket string) {
	t.Helper()
	kvs, err := s.Store.List(bucket, "")
	if err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	reset := s.resets[bucket]
	s.mu.Unlock()
	reset(kvs)
}

func TestMirrorResetAndStop(t *testing.T) {
	ss := &scriptStore{Store: store.NewMemory()}
	m := newIAM(t, ss)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	m.Watch(ctx)
	m.Watch(ctx) // a second call does nothing
	key, _ := mustKey(t, m, rootAdmin, RootProject, RoleViewer)

	mirrored := func() bool {
		m.mu.RLock()
		defer m.mu.RUnlock()
		return m.mirrored()
	}
	if mirrored() {
		t.Fatal("mirror on before both buckets were listed")
	}
	ss.relist(t, bucketProjects)
	if mirrored() {
		t.Fatal("mirror on with one bucket listed")
	}
	ss.relist(t, bucketKeys)
	if !mirrored() {
		t.Fatal("mirror off with both buckets listed")
	}
	if _, err := m.Authenticate(key); err != nil {
		t.Fatal(err)
	}

	// The key is deleted during a gap in the watch: the re-listing
	// replaces the mirror.
	if err := ss.Store.Delete(bucketKeys, hashKey(key).hex()); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Authenticate(key); err != nil {
		t.Fatalf("before the re-listing: %v", err)
	}
	ss.relist(t, bucketKeys)
	_, err := m.Authenticate(key)
	wantErr(t, "after the re-listing", err, errdefs.ErrUnauthenticated)

	// Once ctx ends the mirror is off for good, even if a listing that
	// was under way lands after.
	cancel()
	deadline := time.Now().Add(5 * time.Second)
	for mirrored() && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	ss.relist(t, bucketProjects)
	ss.relist(t, bucketKeys)
	if mirrored() {
		t.Fatal("mirror on after its context ended")
	}
	if _, err := m.GetProject(rootAdmin, RootProject); err != nil {
		t.Errorf("reads from the store after the mirror stopped: %v", err)
	}
}

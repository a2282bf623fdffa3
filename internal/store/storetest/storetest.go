// Package storetest is the contract every store.Store implementation must
// pass. Implementations call Run from their own tests; nothing else imports it.
package storetest

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/store"
)

// Run runs the contract against stores made by open. Each subtest gets a
// fresh, empty store, closed when the subtest ends.
func Run(t *testing.T, open func() store.Store) {
	tests := []struct {
		name string
		fn   func(*testing.T, store.Store)
	}{
		{"GetPut", testGetPut},
		{"EmptyValue", testEmptyValue},
		{"InvalidNames", testInvalidNames},
		{"Copies", testCopies},
		{"Create", testCreate},
		{"Update", testUpdate},
		{"Delete", testDelete},
		{"List", testList},
		{"ConcurrentUpdate", testConcurrentUpdate},
		{"ConcurrentCreate", testConcurrentCreate},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := open()
			t.Cleanup(func() {
				if err := s.Close(); err != nil {
					t.Errorf("Close: %v", err)
				}
			})
			tc.fn(t, s)
		})
	}
}

func mustPut(t *testing.T, s store.Store, bucket, key, val string) {
	t.Helper()
	if err := s.Put(bucket, key, []byte(val)); err != nil {
		t.Fatalf("Put(%s, %s): %v", bucket, key, err)
	}
}

func wantValue(t *testing.T, s store.Store, bucket, key, want string) {
	t.Helper()
	got, err := s.Get(bucket, key)
	if err != nil {
		t.Fatalf("Get(%s, %s): %v", bucket, key, err)
	}
	if string(got) != want {
		t.Fatalf("Get(%s, %s) = %q, want %q", bucket, key, got, want)
	}
}

func wantNotFound(t *testing.T, s store.Store, bucket, key string) {
	t.Helper()
	if v, err := s.Get(bucket, key); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("Get(%s, %s) = %q, %v; want ErrNotFound", bucket, key, v, err)
	}
}

func testGetPut(t *testing.T, s store.Store) {
	wantNotFound(t, s, "b", "k") // bucket absent
	mustPut(t, s, "b", "k", "v1")
	wantValue(t, s, "b", "k", "v1")
	wantNotFound(t, s, "b", "other") // bucket present, key absent
	wantNotFound(t, s, "other", "k") // buckets are separate namespaces
	mustPut(t, s, "b", "k", "v2")
	wantValue(t, s, "b", "k", "v2")
}

func testEmptyValue(t *testing.T, s store.Store) {
	// An empty value is present, and Update sees it as non-nil.
	if err := s.Put("b", "k", nil); err != nil {
		t.Fatalf("Put(nil): %v", err)
	}
	got, err := s.Get("b", "k")
	if err != nil || got == nil || len(got) != 0 {
		t.Fatalf("Get = %#v, %v; want empty non-nil value", got, err)
	}
	err = s.Update("b", "k", func(old []byte) ([]byte, error) {
		if old == nil {
			t.Error("Update saw an empty value as absent")
		}
		return old, nil
	})
	if err != nil {
		t.Fatalf("Update: %v", err)
	}
}

func testInvalidNames(t *testing.T, s store.Store) {
	calls := map[string]func() error{
		"Get empty bucket":    func() error { _, err := s.Get("", "k"); return err },
		"Get empty key":       func() error { _, err := s.Get("b", ""); return err },
		"Put empty key":       func() error { return s.Put("b", "", []byte("v")) },
		"Create empty bucket": func() error { return s.Create("", "k", []byte("v")) },
		"Update empty key": func() error {
			return s.Update("b", "", func([]byte) ([]byte, error) { return []byte("v"), nil })
		},
		"Delete empty key":  func() error { return s.Delete("b", "") },
		"List empty bucket": func() error { _, err := s.List("", ""); return err },
	}
	for name, call := range calls {
		if err := call(); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%s: err = %v, want ErrInvalid", name, err)
		}
	}
}

func testCopies(t *testing.T, s store.Store) {
	in := []byte("abc")
	mustPut(t, s, "b", "k", string(in))
	if err := s.Put("b", "k2", in); err != nil {
		t.Fatal(err)
	}
	in[0] = 'X' // the store must have copied it
	wantValue(t, s, "b", "k2", "abc")
	out, err := s.Get("b", "k2")
	if err != nil {
		t.Fatal(err)
	}
	out[0] = 'Y' // and must hand out a copy
	wantValue(t, s, "b", "k2", "abc")
}

func testCreate(t *testing.T, s store.Store) {
	if err := s.Create("b", "k", []byte("first")); err != nil {
		t.Fatalf("Create: %v", err)
	}
	if err := s.Create("b", "k", []byte("second")); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("second Create: err = %v, want ErrAlreadyExists", err)
	}
	wantValue(t, s, "b", "k", "first")
	if err := s.Delete("b", "k"); err != nil {
		t.Fatal(err)
	}
	if err := s.Create("b", "k", []byte("again")); err != nil {
		t.Fatalf("Create after Delete: %v", err)
	}
	wantValue(t, s, "b", "k", "again")
}

func testUpdate(t *testing.T, s store.Store) {
	// Absent: fn sees nil and its result is stored.
	err := s.Update("b", "k", func(old []byte) ([]byte, error) {
		if old != nil {
			t.Errorf("old = %q, want nil for an absent key", old)
		}
		return []byte("v1"), nil
	})
	if err != nil {
		t.Fatalf("Update (create): %v", err)
	}
	wantValue(t, s, "b", "k", "v1")

	// Present: fn sees the old value.
	err = s.Update("b", "k", func(old []byte) ([]byte, error) {
		return append(old, "+v2"...), nil
	})
	if err != nil {
		t.Fatalf("Update (modify): %v", err)
	}
	wantValue(t, s, "b", "k", "v1+v2")

	// An error aborts, is returned as is, and leaves the value alone.
	errAbort := errors.New("abort")
	err = s.Update("b", "k", func([]byte) ([]byte, error) {
		return []byte("lost"), errAbort
	})
	if !errors.Is(err, errAbort) {
		t.Fatalf("Update (abort): err = %v, want %v", err, errAbort)
	}
	wantValue(t, s, "b", "k", "v1+v2")

	// nil deletes.
	if err := s.Update("b", "k", func([]byte) ([]byte, error) { return nil, nil }); err != nil {
		t.Fatalf("Update (delete): %v", err)
	}
	wantNotFound(t, s, "b", "k")

	// nil on an absent key is a no-op.
	if err := s.Update("b", "absent", func([]byte) ([]byte, error) { return nil, nil }); err != nil {
		t.Fatalf("Update (delete absent): %v", err)
	}
	wantNotFound(t, s, "b", "absent")
}

func testDelete(t *testing.T, s store.Store) {
	if err := s.Delete("nobucket", "k"); err != nil {
		t.Fatalf("Delete in absent bucket: %v", err)
	}
	mustPut(t, s, "b", "k", "v")
	mustPut(t, s, "b", "keep", "v")
	for i := 0; i < 2; i++ { // the second Delete is of an absent key
		if err := s.Delete("b", "k"); err != nil {
			t.Fatalf("Delete #%d: %v", i+1, err)
		}
	}
	wantNotFound(t, s, "b", "k")
	wantValue(t, s, "b", "keep", "v")
}

func testList(t *testing.T, s store.Store) {
	if kvs, err := s.List("nobucket", ""); err != nil || len(kvs) != 0 {
		t.Fatalf("List(absent bucket) = %v, %v; want empty", kvs, err)
	}
	// Inserted out of order; "a/" sorts before "a0" and "ab" bytewise.
	for _, k := range []string{"b/2", "a/2", "ab", "a/10", "a/1", "a0", "b/1", "a"} {
		mustPut(t, s, "b", k, "v:"+k)
	}
	mustPut(t, s, "other", "a/3", "x")
	cases := []struct {
		prefix string
		want   []string
	}{
		{"", []string{"a", "a/1", "a/10", "a/2", "a0", "ab", "b/1", "b/2"}},
		{"a/", []string{"a/1", "a/10", "a/2"}},
		{"a/1", []string{"a/1", "a/10"}},
		{"b/", []string{"b/1", "b/2"}},
		{"c", nil},
	}
	for _, tc := range cases {
		kvs, err := s.List("b", tc.prefix)
		if err != nil {
			t.Fatalf("List(%q): %v", tc.prefix, err)
		}
		var got []string
		for _, kv := range kvs {
			got = append(got, kv.Key)
			if string(kv.Value) != "v:"+kv.Key {
				t.Errorf("List(%q): %s = %q, want %q", tc.prefix, kv.Key, kv.Value, "v:"+kv.Key)
			}
		}
		if fmt.Sprint(got) != fmt.Sprint(tc.want) {
			t.Errorf("List(%q) keys = %v, want %v", tc.prefix, got, tc.want)
		}
	}
}

func testConcurrentUpdate(t *testing.T, s store.Store) {
	const workers, perWorker = 16, 50
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range perWorker {
				err := s.Update("b", "counter", func(old []byte) ([]byte, error) {
					n := 0
					if old != nil {
						var err error
						if n, err = strconv.Atoi(string(old)); err != nil {
							return nil, err
						}
					}
					return []byte(strconv.Itoa(n + 1)), nil
				})
				if err != nil {
					t.Errorf("Update: %v", err)
					return
				}
			}
		}()
	}
	wg.Wait()
	wantValue(t, s, "b", "counter", strconv.Itoa(workers*perWorker))
}

func testConcurrentCreate(t *testing.T, s store.Store) {
	const workers = 16
	var wins, conflicts atomic.Int32
	var wg sync.WaitGroup
	for i := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := s.Create("b", "k", []byte(strconv.Itoa(i)))
			switch {
			case err == nil:
				wins.Add(1)
			case errors.Is(err, errdefs.ErrAlreadyExists):
				conflicts.Add(1)
			default:
				t.Errorf("Create: %v", err)
			}
		}()
	}
	wg.Wait()
	if wins.Load() != 1 || conflicts.Load() != workers-1 {
		t.Fatalf("Create race: %d wins, %d conflicts; want 1 and %d", wins.Load(), conflicts.Load(), workers-1)
	}
}

// openAs opens a store, closes it when the test ends, and returns it
// also as the optional interface T the test is about.
func openAs[T any](t *testing.T, open func() store.Store) (store.Store, T) {
	t.Helper()
	s := open()
	t.Cleanup(func() { _ = s.Close() })
	v, ok := s.(T)
	if !ok {
		t.Fatalf("%T does not implement %T", s, (*T)(nil))
	}
	return s, v
}

// RunLeaser runs the contract of store.Leaser against stores made by open.
func RunLeaser(t *testing.T, open func() store.Store) {
	s, l := openAs[store.Leaser](t, open)
	ctx, cancel := context.WithCancel(t.Context())
	lost, err := l.Hold(ctx, "nodes", "n1", []byte("a"), 3*time.Second, nil)
	if err != nil {
		t.Fatalf("Hold: %v", err)
	}
	wantValue(t, s, "nodes", "n1", "a")
	if _, err := l.Hold(t.Context(), "nodes", "n1", []byte("b"), 3*time.Second, nil); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("second Hold of a held key: %v, want ErrAlreadyExists", err)
	}
	wantValue(t, s, "nodes", "n1", "a")
	select {
	case <-lost:
		t.Fatal("lease lost while held")
	case <-time.After(4 * time.Second): // longer than the ttl: renewals work
	}
	wantValue(t, s, "nodes", "n1", "a")
	cancel()
	wantClosed(t, lost, "lost not closed after the holder's ctx ended")
	wantNotFound(t, s, "nodes", "n1")
	// Released: another holder may take it.
	ctx2, cancel2 := context.WithCancel(t.Context())
	defer cancel2()
	lost2, err := l.Hold(ctx2, "nodes", "n1", []byte("c"), 3*time.Second, nil)
	if err != nil {
		t.Fatalf("Hold after release: %v", err)
	}
	wantValue(t, s, "nodes", "n1", "c")

	// A takeover the holder's value does not allow is refused.
	if _, err := l.Hold(t.Context(), "nodes", "n1", []byte("x"), 3*time.Second, func(cur []byte) bool { return false }); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("Hold with a takeover that says no: %v, want ErrAlreadyExists", err)
	}
	wantValue(t, s, "nodes", "n1", "c")
	// An allowed takeover moves the key to the new holder in one step: a
	// watch of the bucket sees "d" follow "c", never a deletion between.
	var mu sync.Mutex
	var seen []string
	if w, ok := s.(store.Watcher); ok {
		wctx, wcancel := context.WithCancel(t.Context())
		defer wcancel()
		ready := make(chan struct{})
		go w.WatchBucket(wctx, "nodes", func([]store.KV) { close(ready) }, func(key string, val []byte) {
			mu.Lock()
			defer mu.Unlock()
			if val == nil {
				seen = append(seen, key+" deleted")
			} else {
				seen = append(seen, key+"="+string(val))
			}
		})
		select {
		case <-ready:
		case <-time.After(10 * time.Second):
			t.Fatal("no reset from WatchBucket")
		}
	}
	var asked []string
	ctx3, cancel3 := context.WithCancel(t.Context())
	defer cancel3()
	lost3, err := l.Hold(ctx3, "nodes", "n1", []byte("d"), 3*time.Second, func(cur []byte) bool {
		asked = append(asked, string(cur))
		return string(cur) == "c"
	})
	if err != nil {
		t.Fatalf("Hold with a takeover that says yes: %v", err)
	}
	if len(asked) == 0 || asked[len(asked)-1] != "c" {
		t.Fatalf("takeover was asked about %q, want the held value c", asked)
	}
	wantValue(t, s, "nodes", "n1", "d")
	// The earlier holder's end no longer removes the key.
	cancel2()
	wantClosed(t, lost2, "lost not closed after the earlier holder's ctx ended")
	select {
	case <-lost3:
		t.Fatal("the new holder lost the key when the earlier one ended")
	case <-time.After(4 * time.Second): // longer than the ttl
	}
	wantValue(t, s, "nodes", "n1", "d")
	if _, ok := s.(store.Watcher); ok {
		mu.Lock()
		got := strings.Join(seen, ", ")
		mu.Unlock()
		if got != "n1=d" {
			t.Fatalf("the watch saw %q during the takeover, want just n1=d", got)
		}
	}
	cancel3()
	wantClosed(t, lost3, "lost not closed after the new holder's ctx ended")
	wantNotFound(t, s, "nodes", "n1")
}

// wantClosed fails the test unless ch closes within 10 s.
func wantClosed(t *testing.T, ch <-chan struct{}, failure string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(10 * time.Second):
		t.Fatal(failure)
	}
}

// RunWatcher runs the contract of store.Watcher against a store made by
// open: a reset with the bucket as it is, then every change in order, and
// nothing of other buckets.
func RunWatcher(t *testing.T, open func() store.Store) {
	s, w := openAs[store.Watcher](t, open)
	mustPut(t, s, "w", "a", "1")
	mustPut(t, s, "w", "b", "2")
	mustPut(t, s, "other", "x", "0")
	type ev struct{ key, val string }
	events := make(chan ev, 16)
	resets := make(chan []store.KV, 4)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	w.WatchBucket(ctx, "w", func(kvs []store.KV) { resets <- kvs }, func(key string, val []byte) {
		v := "<deleted>"
		if val != nil {
			v = string(val)
		}
		events <- ev{key, v}
	})
	select {
	case kvs := <-resets:
		if len(kvs) != 2 || kvs[0].Key != "a" || string(kvs[0].Value) != "1" || kvs[1].Key != "b" {
			t.Fatalf("reset %v, want a=1 b=2", kvs)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no reset")
	}
	mustPut(t, s, "w", "c", "3")
	mustPut(t, s, "other", "y", "0")
	if err := s.Delete("w", "a"); err != nil {
		t.Fatal(err)
	}
	if err := s.Update("w", "b", func([]byte) ([]byte, error) { return []byte("22"), nil }); err != nil {
		t.Fatal(err)
	}
	for _, want := range []ev{{"c", "3"}, {"a", "<deleted>"}, {"b", "22"}} {
		select {
		case got := <-events:
			if got != want {
				t.Fatalf("change %v, want %v", got, want)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("no change %v", want)
		}
	}
	select {
	case got := <-events:
		t.Fatalf("unexpected change %v", got)
	case <-time.After(200 * time.Millisecond):
	}
}

// RunBatcher runs the contract of store.Batcher.
func RunBatcher(t *testing.T, open func() store.Store) {
	s, b := openAs[store.Batcher](t, open)
	kv := func(k, v string) store.KV { return store.KV{Key: k, Value: []byte(v)} }
	if err := b.Write("b", []store.KV{kv("a", "1"), kv("b", "2")}, []store.KV{kv("p", "0")}); err != nil {
		t.Fatalf("Write: %v", err)
	}
	wantValue(t, s, "b", "a", "1")
	wantValue(t, s, "b", "b", "2")
	wantValue(t, s, "b", "p", "0")
	// One existing key among the creates: nothing is written.
	if err := b.Write("b", []store.KV{kv("c", "3"), kv("a", "x")}, []store.KV{kv("p", "9")}); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("Write over an existing key: %v, want ErrAlreadyExists", err)
	}
	wantNotFound(t, s, "b", "c")
	wantValue(t, s, "b", "a", "1")
	wantValue(t, s, "b", "p", "0")
	// Puts alone overwrite.
	if err := b.Write("b", nil, []store.KV{kv("a", "10"), kv("c", "30")}); err != nil {
		t.Fatalf("Write of puts: %v", err)
	}
	wantValue(t, s, "b", "a", "10")
	wantValue(t, s, "b", "c", "30")
	if err := b.Write("b", []store.KV{kv("", "x")}, nil); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("Write with an empty key: %v", err)
	}
}

// RunPager checks store.Pager: pages in key order, each starting after
// the key given, bounded by the limit, of one bucket only; bad requests
// refused.
func RunPager(t *testing.T, open func() store.Store) {
	s, p := openAs[store.Pager](t, open)
	for _, k := range []string{"e", "a", "c", "b", "d", "b0"} {
		if err := s.Put("pg", k, []byte("v"+k)); err != nil {
			t.Fatal(err)
		}
	}
	// Neighbours that must not show: another bucket, one whose name the
	// first's starts, and a key of the first's name in a bucket sorting
	// before it.
	for _, b := range []string{"pgx", "ph", "p"} {
		if err := s.Put(b, "a", []byte("other")); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.Put("p", "g", []byte("other")); err != nil {
		t.Fatal(err)
	}
	var got []string
	after := ""
	for pages := 0; ; pages++ {
		if pages > 10 {
			t.Fatalf("paging does not end: %v", got)
		}
		kvs, err := p.ListAfter("pg", after, 2)
		if err != nil {
			t.Fatalf("ListAfter(%q): %v", after, err)
		}
		if len(kvs) > 2 {
			t.Fatalf("ListAfter(%q, 2) gave %d", after, len(kvs))
		}
		for _, kv := range kvs {
			if string(kv.Value) != "v"+kv.Key {
				t.Fatalf("key %q has %q", kv.Key, kv.Value)
			}
			got = append(got, kv.Key)
		}
		if len(kvs) < 2 {
			break
		}
		after = kvs[len(kvs)-1].Key
	}
	if want := []string{"a", "b", "b0", "c", "d", "e"}; fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("pages gave %v, want %v", got, want)
	}
	// after need not be a key; past the last, nothing; an empty bucket, nothing.
	if kvs, err := p.ListAfter("pg", "bz", 10); err != nil || len(kvs) != 3 || kvs[0].Key != "c" {
		t.Fatalf("ListAfter(bz): %v %v", kvs, err)
	}
	if kvs, err := p.ListAfter("pg", "e", 10); err != nil || len(kvs) != 0 {
		t.Fatalf("ListAfter(e): %v %v", kvs, err)
	}
	if kvs, err := p.ListAfter("none", "", 10); err != nil || len(kvs) != 0 {
		t.Fatalf("empty bucket: %v %v", kvs, err)
	}
	for _, bad := range []struct {
		bucket string
		limit  int
	}{{"", 1}, {"pg", 0}, {"a/b", 1}} {
		if _, err := p.ListAfter(bad.bucket, "", bad.limit); !errors.Is(err, errdefs.ErrInvalid) {
			t.Fatalf("ListAfter(%q, limit %d): %v, want invalid", bad.bucket, bad.limit, err)
		}
	}
}

package remote

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dsecproject/dsec/internal/image"
)

// blobServer serves one blob the way a registry does (GET with Range on
// /v2/<repo>/blobs/<digest>), counting requests and holding each one for
// delay, so that concurrent readers overlap.
type blobServer struct {
	*httptest.Server
	data     []byte
	requests atomic.Int64
	delay    time.Duration
}

func newBlobServer(t *testing.T, data []byte, delay time.Duration) (*blobServer, *image.Repo, string) {
	t.Helper()
	digest := digestOf(data)
	b := &blobServer{data: data, delay: delay}
	b.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v2/x/blobs/"+digest {
			http.NotFound(w, r)
			return
		}
		b.requests.Add(1)
		select {
		case <-time.After(b.delay):
		case <-r.Context().Done(): // the client gave up
			return
		}
		http.ServeContent(w, r, "blob", time.Time{}, bytes.NewReader(b.data))
	}))
	t.Cleanup(b.Close)
	ref, err := image.ParseReference(strings.TrimPrefix(b.URL, "http://") + "/x:1")
	must(t, err)
	repo, err := image.OpenRepo(ref, image.RepoOptions{Insecure: true})
	must(t, err)
	return b, repo, digest
}

func newTestReader(t *testing.T, data []byte, delay time.Duration, cacheBytes int64) (*Reader, *blobServer) {
	t.Helper()
	srv, repo, digest := newBlobServer(t, data, delay)
	ix, err := BuildIndex(bytes.NewReader(data), int64(len(data)), 4096)
	must(t, err)
	cache, err := OpenCache(t.TempDir(), cacheBytes)
	must(t, err)
	return NewReader(digest, ix, repo, cache, FetchPolicy{Timeout: 5 * time.Second, Attempts: 1}, nil), srv
}

// Readers missing one chunk at once make one request between them.
func TestConcurrentMissesShareARequest(t *testing.T) {
	data := make([]byte, 64<<10)
	rand.Read(data)
	rd, srv := newTestReader(t, data, 100*time.Millisecond, 1<<20)
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, 100)
			if _, err := rd.ReadAt(context.Background(), buf, 5*4096+10); err != nil {
				errs <- err
				return
			}
			if !bytes.Equal(buf, data[5*4096+10:5*4096+110]) {
				errs <- fmt.Errorf("wrong bytes")
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if n := srv.requests.Load(); n != 1 {
		t.Fatalf("%d requests for one chunk missed by 16 readers", n)
	}
}

// A read spanning missing adjacent chunks fetches them in one request;
// a read of cached chunks makes none.
func TestAdjacentMissesMerge(t *testing.T) {
	data := make([]byte, 64<<10)
	rand.Read(data)
	rd, srv := newTestReader(t, data, 0, 1<<20)
	buf := make([]byte, 3*4096)
	if _, err := rd.ReadAt(context.Background(), buf, 2*4096); err != nil || !bytes.Equal(buf, data[2*4096:5*4096]) {
		t.Fatalf("read: %v", err)
	}
	if n := srv.requests.Load(); n != 1 {
		t.Fatalf("%d requests for 3 adjacent chunks", n)
	}
	// Chunk 3 is cached; 1-2 and 4-6 are two runs around it... 2 and 4
	// are cached too: a read of 1-6 fetches 1 and 5-6.
	buf = make([]byte, 6*4096)
	if _, err := rd.ReadAt(context.Background(), buf, 1*4096); err != nil || !bytes.Equal(buf, data[4096:7*4096]) {
		t.Fatalf("read: %v", err)
	}
	if n := srv.requests.Load(); n != 3 {
		t.Fatalf("%d requests in all, want 3 (one more for chunk 1, one for 5-6)", n)
	}
	if got := rd.Stats.BytesFetched.Load(); got != 6*4096 {
		t.Fatalf("fetched %d bytes, want %d", got, 6*4096)
	}
	// The end of the image: a short last chunk, and EOF past it.
	tail := make([]byte, 10)
	if n, _ := rd.ReadAt(context.Background(), tail, int64(len(data))-5); n != 5 {
		t.Fatalf("read at the end: %d bytes", n)
	}
}

// The cache keeps its bound, evicts the least recently used, survives a
// reopen with its order, and drops a chunk changed on disk.
func TestCacheBoundOrderAndReopen(t *testing.T) {
	dir := t.TempDir()
	c, err := OpenCache(dir, 3*1000)
	must(t, err)
	chunk := func(i int) ([]byte, [sha256.Size]byte) {
		b := bytes.Repeat([]byte{byte(i)}, 1000)
		return b, sha256.Sum256(b)
	}
	for i := range 3 {
		b, s := chunk(i)
		must(t, c.Put(s, b))
		time.Sleep(10 * time.Millisecond) // distinct mtimes for the reopen
	}
	_, s0 := chunk(0)
	if _, ok := c.Get(s0); !ok { // 0 is now the most recent
		t.Fatal("chunk 0 missing")
	}
	b3, s3 := chunk(3)
	must(t, c.Put(s3, b3)) // evicts 1, the least recently used
	_, s1 := chunk(1)
	if c.Has(s1) || !c.Has(s0) || c.Size() != 3000 {
		t.Fatalf("after eviction: has1 %v has0 %v size %d", c.Has(s1), c.Has(s0), c.Size())
	}
	// Reopened smaller: the oldest by file time go. A hit moves a
	// chunk's file time at most once a minute, so 0, written first and
	// read just now, counts as the oldest here.
	c2, err := OpenCache(dir, 2*1000)
	must(t, err)
	if c2.Size() != 2000 {
		t.Fatalf("reopened: %d bytes", c2.Size())
	}
	_, s2 := chunk(2)
	if c2.Has(s0) || !c2.Has(s2) || !c2.Has(s3) {
		t.Fatal("reopen kept the wrong chunks")
	}
	// A chunk changed on disk is not served: in the process that wrote
	// and checked it as after a reopen.
	b4, s4 := chunk(4)
	must(t, c2.Put(s4, b4))
	p4 := filepath.Join(dir, fmt.Sprintf("%x", s4[:1]), fmt.Sprintf("%x", s4))
	if _, ok := c2.Get(s4); !ok {
		t.Fatal("chunk 4 missing")
	}
	must(t, os.WriteFile(p4, bytes.Repeat([]byte{8}, 1000), 0o600))
	if _, ok := c2.Get(s4); ok {
		t.Fatal("a chunk changed after it was checked was served")
	}
	p := filepath.Join(dir, fmt.Sprintf("%x", s3[:1]), fmt.Sprintf("%x", s3))
	must(t, os.WriteFile(p, bytes.Repeat([]byte{9}, 1000), 0o600))
	if _, ok := c2.Get(s3); ok || c2.Has(s3) {
		t.Fatal("a changed chunk was served")
	}
}

// Layers that share a chunk share its fetch: two readers (as of two
// images holding the same bytes) missing it at once make one request.
func TestSharedChunkFetchedOnce(t *testing.T) {
	data := make([]byte, 64<<10)
	rand.Read(data)
	a, srv := newTestReader(t, data, 100*time.Millisecond, 1<<20)
	b := NewReader(a.digest, a.ix, a.repo, a.cache, a.policy, nil)
	var wg sync.WaitGroup
	for _, rd := range []*Reader{a, b} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, 10)
			if _, err := rd.ReadAt(context.Background(), buf, 7*4096); err != nil || !bytes.Equal(buf, data[7*4096:7*4096+10]) {
				t.Errorf("read: %v", err)
			}
		}()
	}
	wg.Wait()
	if n := srv.requests.Load(); n != 1 {
		t.Fatalf("%d requests for a chunk two layers share", n)
	}
}

// A source that accepts and then stalls fails a read after the policy's
// tries, each bounded by its timeout, instead of hanging it.
func TestStalledSourceFailsInBoundedTime(t *testing.T) {
	data := make([]byte, 64<<10)
	rand.Read(data)
	rd, srv := newTestReader(t, data, 30*time.Second, 1<<20)
	rd.policy = FetchPolicy{Timeout: 300 * time.Millisecond, Attempts: 2}
	start := time.Now()
	_, err := rd.ReadAt(context.Background(), make([]byte, 100), 4096)
	took := time.Since(start)
	if err == nil {
		t.Fatal("a read from a stalled source succeeded")
	}
	if took > 3*time.Second {
		t.Fatalf("the read failed after %v; the policy allows about 0.85 s", took)
	}
	if n := srv.requests.Load(); n != 2 {
		t.Fatalf("%d requests, want 2 (the policy's tries)", n)
	}
	if rd.Stats.FetchErrors.Load() != 2 {
		t.Fatalf("fetch errors counted: %d", rd.Stats.FetchErrors.Load())
	}
}

// The bytes a metadata pack holds are not asked of the source again when
// the chunks around them are fetched: only the stretches the pack lacks
// are, two of them in one request unless the pack holds at least minSkip
// between them. Chunks the pack holds whole cost no request, and a chunk
// put together from the pack is verified like any other.
func TestPackHeldBytesAreNotFetched(t *testing.T) {
	const kib = 1 << 10
	const cs = 256 * kib
	ms := int64(minSkip)
	if ms%cs != 0 || ms > 8*cs {
		t.Fatalf("the test lays the pack out in chunks of %d around minSkip %d", cs, ms)
	}
	data := make([]byte, 16*cs) // one run at most (maxRun)
	rand.Read(data)
	mk := func(pack []byte) (*Reader, *blobServer) {
		srv, repo, digest := newBlobServer(t, data, 0)
		ix, err := BuildIndex(bytes.NewReader(data), int64(len(data)), cs)
		must(t, err)
		cache, err := OpenCache(t.TempDir(), 64<<20)
		must(t, err)
		rd := NewReader(digest, ix, repo, cache, FetchPolicy{Timeout: 5 * time.Second, Attempts: 1}, nil)
		rd.meta, err = UnmarshalMetaPack(pack, int64(len(data)))
		must(t, err)
		return rd, srv
	}
	// The pack holds 8 KiB at the start, minSkip from chunk 1 on (whole
	// chunks), and one page 44 KiB after that (less than minSkip).
	heldEnd := cs + ms
	held := []Range{{0, 8 * kib}, {cs, ms}, {heldEnd + 44*kib, 4 * kib}}
	pack, err := encodeMetaPack(bytes.NewReader(data), held)
	must(t, err)

	rd, srv := mk(pack)
	buf := make([]byte, len(data))
	if _, err := rd.ReadAt(context.Background(), buf, 0); err != nil || !bytes.Equal(buf, data) {
		t.Fatalf("read of the whole image: %v", err)
	}
	// [8K, cs) alone; [heldEnd, end) in one request over the lone page.
	if n := srv.requests.Load(); n != 2 {
		t.Fatalf("%d requests, want 2", n)
	}
	if got, want := rd.Stats.BytesFetched.Load(), int64(len(data))-8*kib-ms; got != want {
		t.Fatalf("fetched %d bytes, want %d", got, want)
	}
	if got, want := rd.Stats.FromPack.Load(), 8*kib+ms; got != want {
		t.Fatalf("%d bytes taken from the pack, want %d", got, want)
	}
	// Read: the whole image, its pack's bytes counted once.
	if got := rd.ReadBytes(); got != int64(len(data)) {
		t.Fatalf("ReadBytes = %d, want %d", got, len(data))
	}

	// Prefetching the chunks the pack holds whole asks nothing of the
	// source and still checks them into the cache.
	rd, srv = mk(pack)
	whole := []int{}
	for i := 1; int64(i)*cs < heldEnd; i++ {
		whole = append(whole, i)
	}
	rd.Prefetch(context.Background(), whole, 1)
	if n := srv.requests.Load(); n != 0 {
		t.Fatalf("%d requests for chunks the pack holds whole", n)
	}
	for _, i := range whole {
		if !rd.cache.Has(rd.ix.Sums[i]) {
			t.Fatalf("chunk %d, which the pack holds whole, was not checked into the cache", i)
		}
	}
	if got := rd.Stats.FromPack.Load(); got != ms {
		t.Fatalf("%d bytes taken from the pack, want %d", got, ms)
	}
	if _, err := rd.ReadAt(context.Background(), buf[:100*kib], cs); err != nil || !bytes.Equal(buf[:100*kib], data[cs:cs+100*kib]) {
		t.Fatalf("read in the pack: %v", err)
	}
	// The pack alone: the read fell wholly in it.
	if got, want := rd.ReadBytes(), 12*kib+ms; got != want {
		t.Fatalf("ReadBytes = %d, want %d", got, want)
	}

	// A pack whose bytes are not the image's: the chunk it completes
	// fails its digest and is fetched whole from the source, which
	// passes; the pack is not used again, for chunks or metadata reads.
	bad := append([]byte(nil), pack...)
	bad[len(bad)-5000] ^= 1 // 904 bytes before the end of the range at cs
	at := heldEnd - 904
	rd, _ = mk(bad)
	if _, err := rd.ReadAt(context.Background(), buf[:20*kib], heldEnd-10*kib); err != nil || !bytes.Equal(buf[:20*kib], data[heldEnd-10*kib:heldEnd+10*kib]) {
		t.Fatalf("a read of a chunk the bad pack completed: %v", err)
	}
	if rd.Stats.PackMismatches.Load() != 1 || rd.Stats.BadChunks.Load() != 0 {
		t.Fatalf("%d pack mismatches and %d bad chunks, want 1 and 0", rd.Stats.PackMismatches.Load(), rd.Stats.BadChunks.Load())
	}
	if _, err := rd.ReadAt(context.Background(), buf[:100], at-50); err != nil || !bytes.Equal(buf[:100], data[at-50:at+50]) {
		t.Fatalf("a metadata read after the pack proved wrong: %v", err)
	}
	if rd.Stats.MetaReads.Load() != 0 {
		t.Fatalf("%d reads served from a pack known to be wrong", rd.Stats.MetaReads.Load())
	}
}

package remote

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/image"
)

// FetchPolicy bounds how a Reader waits on its source: each request is
// given Timeout and tried Attempts times in all, so an unreachable source
// fails a read after about Attempts×Timeout instead of hanging it.
type FetchPolicy struct {
	Timeout  time.Duration
	Attempts int
}

func (p FetchPolicy) withDefaults() FetchPolicy {
	if p.Timeout <= 0 {
		p.Timeout = 20 * time.Second
	}
	if p.Attempts <= 0 {
		p.Attempts = 3
	}
	return p
}

// maxRun bounds the chunks one request fetches: adjacent misses merge up
// to this many (4 MiB at the default chunk size).
const maxRun = 16

// minSkip is the least a metadata pack must hold between two stretches
// of a run for them to be fetched in two requests rather than one: a
// request to a registry costs milliseconds (7.6 ms each from Debian's
// docker-registry on loopback), which is about a MiB at 125 MB/s.
const minSkip = 1 << 20

// Reader reads one remote image on demand: each read is served from the
// node's cache where it can be, and the chunks missing are fetched, runs
// of adjacent ones in one Range request, and verified against the index
// before they are used or cached. Concurrent misses of one chunk make one
// request. Safe for concurrent use.
type Reader struct {
	digest string
	// traceKey names the reader's trace: its index's hex, since chunk
	// numbers mean something only for one chunk size.
	traceKey string
	ix       *Index
	repo     *image.Repo
	cache    *Cache
	policy   FetchPolicy
	log      *slog.Logger
	Stats    Stats
	// meta, if set, serves the reads that fall in the image's metadata
	// (metapack.go), unless packBad: a chunk it completed did not match
	// the index while the source's own bytes did.
	meta    *MetaPack
	packBad atomic.Bool

	mu    sync.Mutex
	seen  []bool // chunks read at least once
	order []int  // chunks in the order of their first read: the trace
}

// Stats count a Reader's work.
type Stats struct {
	BytesFetched  atomic.Int64
	Requests      atomic.Int64
	FetchErrors   atomic.Int64
	FetchNanos    atomic.Int64
	CacheHits     atomic.Int64
	CacheMisses   atomic.Int64
	ChunksTouched atomic.Int64
	BadChunks     atomic.Int64
	MetaReads     atomic.Int64
	// PackMismatches counts chunks that failed their digest completed
	// from the metadata pack and passed fetched whole from the source.
	PackMismatches atomic.Int64
	// FromPack counts the bytes of fetched chunks taken from the
	// metadata pack rather than asked of the source.
	FromPack atomic.Int64
}

type fetchCall struct {
	done chan struct{}
	data []byte // the chunk, verified; nil on error
	err  error
}

// NewReader returns a reader of the image digest in repo, described by ix.
func NewReader(digest string, ix *Index, repo *image.Repo, cache *Cache, policy FetchPolicy, log *slog.Logger) *Reader {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Reader{digest: digest, ix: ix, repo: repo, cache: cache, policy: policy.withDefaults(), log: log,
		seen: make([]bool, ix.Chunks())}
}

// pack is the metadata pack reads may use: none once one of its bytes
// proved wrong.
func (r *Reader) pack() *MetaPack {
	if r.packBad.Load() {
		return nil
	}
	return r.meta
}

// Size is the image's size.
func (r *Reader) Size() int64 { return r.ix.Size }

// ReadAt fills p from off (short only at the end of the image).
func (r *Reader) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	if off >= r.ix.Size || len(p) == 0 {
		return 0, io.EOF
	}
	end := min(off+int64(len(p)), r.ix.Size)
	if m := r.pack(); m != nil && m.ReadAt(p, off, end) {
		r.Stats.MetaReads.Add(1)
		return int(end - off), nil
	}
	cs := int64(r.ix.ChunkSize)
	first, last := int(off/cs), int((end-1)/cs)
	chunks, err := r.chunks(ctx, first, last)
	if err != nil {
		return 0, err
	}
	n := 0
	for i := first; i <= last; i++ {
		c := chunks[i-first]
		lo := max(off, int64(i)*cs) - int64(i)*cs
		hi := min(end, int64(i+1)*cs) - int64(i)*cs
		n += copy(p[n:], c[lo:hi])
	}
	return n, nil
}

// chunks returns chunks first..last, from the cache or fetched.
func (r *Reader) chunks(ctx context.Context, first, last int) ([][]byte, error) {
	out := make([][]byte, last-first+1)
	var missing []int
	for i := first; i <= last; i++ {
		if b, ok := r.cache.Get(r.ix.Sums[i]); ok {
			r.Stats.CacheHits.Add(1)
			out[i-first] = b
			r.touch(i)
			continue
		}
		r.Stats.CacheMisses.Add(1)
		missing = append(missing, i)
	}
	if len(missing) == 0 {
		return out, nil
	}
	// Join fetches in flight on the node (of this layer, or of another
	// with the same chunk); start the rest, adjacent ones together.
	waits := map[int]*fetchCall{}
	var runs [][]int
	var calls [][]*fetchCall
	for _, i := range missing {
		c, owner := r.cache.claim(r.ix.Sums[i])
		waits[i] = c
		if !owner {
			continue
		}
		if n := len(runs); n > 0 && runs[n-1][len(runs[n-1])-1] == i-1 && len(runs[n-1]) < maxRun {
			runs[n-1] = append(runs[n-1], i)
			calls[n-1] = append(calls[n-1], c)
		} else {
			runs = append(runs, []int{i})
			calls = append(calls, []*fetchCall{c})
		}
	}
	for k, run := range runs {
		// A fetch is not bound to the reader that started it: others
		// may be waiting for the same chunks.
		r.fetchRun(context.WithoutCancel(ctx), run, calls[k])
	}
	for _, i := range missing {
		c := waits[i]
		select {
		case <-c.done:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		if c.err != nil {
			return nil, c.err
		}
		out[i-first] = c.data
		r.touch(i)
	}
	return out, nil
}

func (r *Reader) touch(i int) {
	r.mu.Lock()
	if !r.seen[i] {
		r.seen[i] = true
		r.order = append(r.order, i)
		r.Stats.ChunksTouched.Add(1)
	}
	r.mu.Unlock()
}

// ReadBytes is how much of the image has been brought to the node: the
// metadata pack and the chunks read, the bytes they share counted once.
func (r *Reader) ReadBytes() int64 {
	var n int64
	if r.meta != nil {
		n = r.meta.Bytes()
	}
	cs := int64(r.ix.ChunkSize)
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, i := range r.order {
		off := int64(i) * cs
		end := off + int64(r.ix.ChunkLen(i))
		n += end - off - r.meta.Held(off, end)
	}
	return n
}

// Trace returns the chunks read so far, in the order of their first read.
func (r *Reader) Trace() []int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]int(nil), r.order...)
}

// Prefetch reads the chunks of an earlier run's trace into the cache, in
// its order, runs of adjacent ones together, at most conc requests at
// once; chunks already cached cost nothing. It counts what it fetches
// like any read but leaves the trace and the touched chunks alone.
func (r *Reader) Prefetch(ctx context.Context, trace []int, conc int) {
	type span struct{ first, last int }
	var spans []span
	for _, i := range trace {
		if i < 0 || i >= r.ix.Chunks() {
			continue
		}
		if n := len(spans); n > 0 && spans[n-1].last == i-1 && i-spans[n-1].first < maxRun {
			spans[n-1].last = i
			continue
		}
		spans = append(spans, span{i, i})
	}
	sem := make(chan struct{}, max(conc, 1))
	var wg sync.WaitGroup
	for _, sp := range spans {
		if ctx.Err() != nil {
			break
		}
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			r.fill(ctx, sp.first, sp.last)
		}()
	}
	wg.Wait()
}

// fill brings chunks first..last into the cache without counting them as
// read.
func (r *Reader) fill(ctx context.Context, first, last int) {
	var missing []int
	for i := first; i <= last; i++ {
		if !r.cache.Has(r.ix.Sums[i]) {
			missing = append(missing, i)
		}
	}
	if len(missing) == 0 {
		return
	}
	var run []int
	var calls []*fetchCall
	for _, i := range missing {
		if c, owner := r.cache.claim(r.ix.Sums[i]); owner {
			run = append(run, i)
			calls = append(calls, c)
		}
	}
	// Adjacent misses in one request; a gap starts another.
	start := 0
	for k := 1; k <= len(run); k++ {
		if k == len(run) || run[k] != run[k-1]+1 || k-start >= maxRun {
			if k > start {
				r.fetchRun(context.WithoutCancel(ctx), run[start:k], calls[start:k])
			}
			start = k
		}
	}
}

// fetchRun fetches the adjacent chunks of run (retried under the
// policy), verifies and caches each, and completes their calls (calls[k]
// is run[k]'s, claimed by the caller). The bytes the metadata pack holds
// are taken from it: only the stretches it lacks are asked of the source,
// in one request unless the pack holds at least minSkip between two of
// them.
func (r *Reader) fetchRun(ctx context.Context, run []int, calls []*fetchCall) {
	cs := int64(r.ix.ChunkSize)
	off := int64(run[0]) * cs
	n := int64(0)
	for _, i := range run {
		n += int64(r.ix.ChunkLen(i))
	}
	buf := make([]byte, n)
	gaps := []Range{{off, n}}
	m := r.pack()
	if m != nil {
		gaps = joinGaps(m.Fill(buf, off), minSkip)
	}
	asked := int64(0)
	var err error
	for _, g := range gaps {
		asked += g.Len
		if err = r.fetchRetry(ctx, buf[g.Off-off:g.Off-off+g.Len], g.Off); err != nil {
			break
		}
	}
	if err == nil {
		r.Stats.FromPack.Add(n - asked)
	}
	pos := 0
	for k, i := range run {
		l := r.ix.ChunkLen(i)
		var data []byte
		cerr := err
		if cerr == nil {
			data = buf[pos : pos+l : pos+l]
			cerr = r.ix.Check(i, data)
			if cerr != nil && m != nil && m.Held(off+int64(pos), off+int64(pos+l)) > 0 {
				data, cerr = r.refetch(ctx, i)
			}
			if cerr != nil {
				r.Stats.BadChunks.Add(1)
				r.log.Error("a chunk from the layer source does not match its digest; refusing it", "digest", r.digest, "chunk", i)
				data = nil
			} else if perr := r.cache.Put(r.ix.Sums[i], data); perr != nil {
				r.log.Warn("caching a layer chunk", "digest", r.digest, "err", perr)
			}
		}
		pos += l
		r.cache.complete(r.ix.Sums[i], calls[k], data, cerr)
	}
}

// refetch fetches chunk i whole from the source, after it failed its
// digest completed from the metadata pack. If the source's bytes pass,
// the pack is wrong: it is not used again by this reader (the metadata
// reads it served before cannot be checked: the log says so).
func (r *Reader) refetch(ctx context.Context, i int) ([]byte, error) {
	data := make([]byte, r.ix.ChunkLen(i))
	if err := r.fetchRetry(ctx, data, int64(i)*int64(r.ix.ChunkSize)); err != nil {
		return nil, err
	}
	if err := r.ix.Check(i, data); err != nil {
		return nil, err
	}
	r.Stats.PackMismatches.Add(1)
	if r.packBad.CompareAndSwap(false, true) {
		r.log.Error("the layer's metadata pack does not match its image (a chunk it completed failed its digest, the source's own bytes passed); reading without it. Metadata already read from it was not checked: recreate the layer's sandboxes, and push the layer again",
			"digest", r.digest, "chunk", i)
	}
	return data, nil
}

// fetchRetry fills p from off of the source, retried under the policy.
func (r *Reader) fetchRetry(ctx context.Context, p []byte, off int64) error {
	var err error
	for attempt := range r.policy.Attempts {
		if attempt > 0 {
			select {
			case <-ctx.Done():
			case <-time.After(time.Duration(attempt) * 250 * time.Millisecond):
			}
		}
		if err = r.fetch(ctx, p, off); err == nil {
			return nil
		}
		r.Stats.FetchErrors.Add(1)
		r.log.Warn("fetching layer chunks", "digest", r.digest, "offset", off, "bytes", len(p), "attempt", attempt+1, "err", err)
		if errors.Is(err, errdefs.ErrInvalid) || errors.Is(err, errdefs.ErrPrecondition) {
			break // a bad answer will not get better by asking again
		}
	}
	return err
}

// fetch fills p from off of the source in one request.
func (r *Reader) fetch(ctx context.Context, p []byte, off int64) error {
	ctx, cancel := context.WithTimeout(ctx, r.policy.Timeout)
	defer cancel()
	start := time.Now()
	r.Stats.Requests.Add(1)
	rc, err := r.repo.BlobRange(ctx, r.digest, off, int64(len(p)))
	if err != nil {
		return err
	}
	defer rc.Close()
	got, err := io.ReadFull(rc, p)
	r.Stats.BytesFetched.Add(int64(got))
	r.Stats.FetchNanos.Add(int64(time.Since(start)))
	if err != nil {
		return errdefs.Unavailable("reading %d bytes at %d of %s: %v", len(p), off, short(r.digest), err)
	}
	return nil
}

// joinGaps joins the stretches of gaps (sorted, disjoint) that less than
// skip separates: asking the source again costs more than that many bytes.
func joinGaps(gaps []Range, skip int64) []Range {
	var out []Range
	for _, g := range gaps {
		if n := len(out); n > 0 && g.Off-(out[n-1].Off+out[n-1].Len) < skip {
			out[n-1].Len = g.Off + g.Len - out[n-1].Off
			continue
		}
		out = append(out, g)
	}
	return out
}

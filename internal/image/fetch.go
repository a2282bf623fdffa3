package image

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// progressEvery is how often a download reports: a few lines a second at
// most, whatever the speed.
const progressEvery = 500 * time.Millisecond

// fetch makes sure the layer blob d is in the cache, checked against its
// digest: a cached copy is re-hashed (the cache is only a cache), a missing
// one is downloaded with up to r.attempts tries, each resuming the partial
// file the last one left.
func (r *registry) fetch(ctx context.Context, d descriptor) error {
	final := r.blobPath(d.Digest)
	if fi, err := os.Stat(final); err == nil {
		ok, err := fileHasDigest(final, d)
		if err != nil {
			return fmt.Errorf("checking cached blob %s: %w", d.Digest, err)
		}
		if ok {
			printf(r.progress, "%s: cached (%s)\n", shortDigest(d.Digest), humanBytes(fi.Size()))
			return nil
		}
		if err := os.Remove(final); err != nil {
			return fmt.Errorf("removing bad cached blob %s: %w", d.Digest, err)
		}
	}
	part := final + ".partial"
	var err error
	for attempt := range r.attempts {
		if attempt > 0 {
			printf(r.progress, "%s: retrying after: %v\n", shortDigest(d.Digest), err)
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(time.Duration(attempt) * 200 * time.Millisecond):
			}
		}
		if err = r.download(ctx, d, part); err == nil {
			if err := os.Rename(part, final); err != nil {
				return fmt.Errorf("caching blob %s: %w", d.Digest, err)
			}
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if !isTransient(err) {
			return err
		}
	}
	return fmt.Errorf("downloading blob %s: giving up after %d attempts: %w", d.Digest, r.attempts, err)
}

// download brings the partial file part up to d's size, asking only for
// what it lacks, and checks the digest of the whole. A bad digest (or a
// blob longer than its descriptor) deletes part: resuming it could never
// succeed.
func (r *registry) download(ctx context.Context, d descriptor, part string) error {
	f, err := os.OpenFile(part, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("downloading blob %s: %w", d.Digest, err)
	}
	defer f.Close()
	have, err := f.Seek(0, io.SeekEnd)
	if err != nil {
		return err
	}
	h := sha256.New()
	if have > d.Size {
		have = 0
	} else if _, err := io.Copy(h, io.NewSectionReader(f, 0, have)); err != nil {
		return fmt.Errorf("hashing partial blob %s: %w", d.Digest, err)
	}
	if have < d.Size {
		var derr error
		have, derr = r.downloadFrom(ctx, d, f, have, h)
		// Whatever happened, the file must end where the hashed bytes
		// end, for the next attempt to resume from.
		if err := f.Truncate(have); err != nil && derr == nil {
			derr = err
		}
		if errors.Is(derr, errdefs.ErrInvalid) {
			f.Close()
			os.Remove(part)
		}
		if derr != nil {
			return derr
		}
	}
	if got := sumString(h); got != d.Digest {
		f.Close()
		os.Remove(part)
		return errdefs.Invalid("downloading blob %s: content has digest %s", d.Digest, got)
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("downloading blob %s: %w", d.Digest, err)
	}
	return nil
}

// downloadFrom appends the blob's bytes from offset have onward to f and
// h, and returns how many bytes f now holds.
func (r *registry) downloadFrom(ctx context.Context, d descriptor, f *os.File, have int64, h io.Writer) (int64, error) {
	// identity: a transparently decompressed body would not hash to the
	// digest, and a Range applies to the stored bytes only.
	hdr := http.Header{"Accept-Encoding": {"identity"}}
	if have > 0 {
		hdr.Set("Range", "bytes="+strconv.FormatInt(have, 10)+"-")
	}
	resp, err := r.get(ctx, "/v2/"+r.ref.Repository+"/blobs/"+d.Digest, hdr)
	if err != nil {
		return have, err
	}
	defer resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusOK:
		if have > 0 { // the server ignored the Range: start over
			if hr, ok := h.(interface{ Reset() }); ok {
				hr.Reset()
			}
			have = 0
		}
	case http.StatusPartialContent:
		if !strings.HasPrefix(resp.Header.Get("Content-Range"), "bytes "+strconv.FormatInt(have, 10)+"-") {
			f.Truncate(0)
			return 0, transient{fmt.Errorf("blob %s: registry answered range %q to a request from %d", d.Digest, resp.Header.Get("Content-Range"), have)}
		}
	case http.StatusRequestedRangeNotSatisfiable:
		f.Truncate(0)
		return 0, transient{fmt.Errorf("blob %s: registry refused to resume at %d", d.Digest, have)}
	default:
		return have, statusErr(resp, "blob "+d.Digest)
	}
	if _, err := f.Seek(have, io.SeekStart); err != nil {
		return have, err
	}
	pw := &progressWriter{w: r.progress, name: shortDigest(d.Digest), total: d.Size, done: have}
	n, err := io.Copy(io.MultiWriter(f, h, pw), io.LimitReader(resp.Body, d.Size-have+1))
	have += n
	pw.report(true)
	switch {
	case ctx.Err() != nil:
		return have, ctx.Err()
	case have > d.Size:
		return have, errdefs.Invalid("blob %s is larger than its descriptor's %d bytes", d.Digest, d.Size)
	case err != nil:
		var pe *os.PathError
		if errors.As(err, &pe) { // our write failed: the disk, not the network
			return have, fmt.Errorf("downloading blob %s: %w", d.Digest, err)
		}
		return have, transient{fmt.Errorf("downloading blob %s: %w", d.Digest, err)}
	case have < d.Size:
		return have, transient{fmt.Errorf("downloading blob %s: connection closed at %d of %d bytes", d.Digest, have, d.Size)}
	}
	return have, nil
}

// fileHasDigest reports whether the file at p holds exactly the blob d.
func fileHasDigest(p string, d descriptor) (bool, error) {
	f, err := os.Open(p)
	if err != nil {
		return false, err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return false, err
	}
	return n == d.Size && sumString(h) == d.Digest, nil
}

func shortDigest(d string) string {
	if len(d) > len("sha256:")+12 {
		return d[:len("sha256:")+12]
	}
	return d
}

// progressWriter counts a download's bytes and prints at most one line per
// progressEvery.
type progressWriter struct {
	w           io.Writer
	name        string
	total, done int64
	last        time.Time
}

func (p *progressWriter) Write(b []byte) (int, error) {
	p.done += int64(len(b))
	p.report(false)
	return len(b), nil
}

func (p *progressWriter) report(final bool) {
	if p.w == nil || (!final && time.Since(p.last) < progressEvery) {
		return
	}
	p.last = time.Now()
	printf(p.w, "%s: %s / %s\n", p.name, humanBytes(p.done), humanBytes(p.total))
}

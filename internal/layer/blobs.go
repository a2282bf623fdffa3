package layer

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// blobsBucket holds digest → blobRecord: who is publishing a blob right
// now (pins), and whether one process is removing it (a collect mark).
// Both are set by compare-and-set, so that across processes sharing a
// layer directory a blob is never removed between a publisher finding it
// (or renaming it into place) and the catalog naming it. A digest with
// neither has no record.
const blobsBucket = "layer_blobs"

type blobRecord struct {
	Pins map[string]time.Time `json:"pins,omitempty"`
	// Collecting is when a process marked the blob for removal.
	Collecting *time.Time `json:"collecting,omitempty"`
	By         string     `json:"by,omitempty"`
}

// staleAfter is how old a pin or mark may be before it is taken for one
// a crashed process left: far longer than a publish or a removal takes.
const staleAfter = 10 * time.Minute

// pinRenewEvery is how often a live pin is renewed (a variable for tests).
var pinRenewEvery = staleAfter / 4

var (
	errCollecting = errors.New("blob being removed")
	errPinned     = errors.New("blob pinned by a publisher")
)

func decodeBlob(old []byte) (blobRecord, error) {
	var r blobRecord
	if old == nil {
		return r, nil
	}
	if err := json.Unmarshal(old, &r); err != nil {
		return r, fmt.Errorf("decoding blob record: %w", err)
	}
	now := time.Now()
	for k, t := range r.Pins {
		if now.Sub(t) > staleAfter {
			delete(r.Pins, k)
		}
	}
	if r.Collecting != nil && now.Sub(*r.Collecting) > staleAfter {
		r.Collecting, r.By = nil, ""
	}
	return r, nil
}

func encodeBlob(r blobRecord) ([]byte, error) {
	if len(r.Pins) == 0 && r.Collecting == nil {
		return nil, nil // nothing to say: no record
	}
	return json.Marshal(r)
}

// pin records that this process is about to name digest in the catalog;
// it waits while another process removes the blob (at most a few
// seconds). The returned func drops the pin.
func (s *Store) pin(digest string) (func(), error) {
	id := s.instance + "-" + strconv.FormatUint(s.pinSeq.Add(1), 10)
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := s.st.Update(blobsBucket, digest, func(old []byte) ([]byte, error) {
			r, err := decodeBlob(old)
			if err != nil {
				return nil, err
			}
			if r.Collecting != nil {
				return nil, errCollecting
			}
			if r.Pins == nil {
				r.Pins = map[string]time.Time{}
			}
			r.Pins[id] = time.Now()
			return encodeBlob(r)
		})
		if err == nil {
			break
		}
		if !errors.Is(err, errCollecting) {
			return nil, fmt.Errorf("pinning blob %s: %w", digest, err)
		}
		if time.Now().After(deadline) {
			return nil, errdefs.Unavailable("blob %s is being removed by another process; retry", digest)
		}
		time.Sleep(50 * time.Millisecond)
	}
	// A pin held long (the lowers of a long merged import) is renewed so
	// that it does not go stale while its holder lives: written again,
	// even if another process already took it for stale. mu orders the
	// renewals before the unpin.
	var mu sync.Mutex
	done := false
	stop := make(chan struct{})
	go func() {
		t := time.NewTicker(pinRenewEvery)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
			}
			mu.Lock()
			if done {
				mu.Unlock()
				return
			}
			err := s.st.Update(blobsBucket, digest, func(old []byte) ([]byte, error) {
				r, err := decodeBlob(old)
				if err != nil {
					return nil, err
				}
				if r.Pins == nil {
					r.Pins = map[string]time.Time{}
				}
				r.Pins[id] = time.Now()
				return encodeBlob(r)
			})
			mu.Unlock()
			if err != nil {
				s.log.Warn("renewing a layer blob's pin", "digest", digest, "err", err)
			}
		}
	}()
	var once sync.Once
	return func() {
		once.Do(func() {
			mu.Lock()
			done = true
			close(stop)
			mu.Unlock()
			err := s.st.Update(blobsBucket, digest, func(old []byte) ([]byte, error) {
				r, err := decodeBlob(old)
				if err != nil {
					return nil, err
				}
				delete(r.Pins, id)
				return encodeBlob(r)
			})
			if err != nil {
				// The pin goes stale on its own.
				s.log.Warn("unpinning layer blob", "digest", digest, "err", err)
			}
		})
	}, nil
}

// collect removes digest's blob unless a ref names it or a publisher has
// it pinned (then it stays, for a later delete or GC). It reports whether
// the blob is gone.
func (s *Store) collect(digest string) (bool, error) {
	now := time.Now()
	me := s.instance + "-" + strconv.FormatUint(s.pinSeq.Add(1), 10)
	err := s.st.Update(blobsBucket, digest, func(old []byte) ([]byte, error) {
		r, err := decodeBlob(old)
		if err != nil {
			return nil, err
		}
		if r.Collecting != nil && r.By == me {
			return old, nil // our own mark, seen again after a lost answer
		}
		if len(r.Pins) > 0 {
			return nil, errPinned
		}
		if r.Collecting != nil {
			return nil, errCollecting
		}
		r.Collecting, r.By = &now, me
		return encodeBlob(r)
	})
	if errors.Is(err, errPinned) || errors.Is(err, errCollecting) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	defer func() {
		if err := s.st.Delete(blobsBucket, digest); err != nil {
			s.log.Warn("clearing a layer blob's removal mark", "digest", digest, "err", err)
		}
	}()
	// Under the mark no new pin can start; a publisher that pinned,
	// named the blob and unpinned before it shows in the catalog.
	named, err := s.referenced(digest)
	if err != nil || named {
		return false, err
	}
	if err := os.Remove(s.BlobPath(digest)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return false, fmt.Errorf("removing blob: %w", err)
	}
	return true, nil
}

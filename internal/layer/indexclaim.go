package layer

import (
	"errors"
	"fmt"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// A registry-backed layer is read by its image's digest on the nodes, and
// its chunks are checked against its chunk index: one digest must stand
// for one index (one content) in a catalog, or two nodes could read two
// contents under one name. Several apiservers may add layers at once, so
// the rule is a claim made with the store's create-if-absent, not a look
// at the catalog followed by a write.

// indexBucket holds image digest → the chunk index digest it stands for,
// with the digest of its metadata pack after a newline if it has one: the
// pack's bytes are served for the digest too.
const indexBucket = "layer_indexes"

// claimOf is what a remote layer claims for its digest.
func claimOf(r *api.LayerRemote) string {
	if r.Meta == "" {
		return r.Index
	}
	return r.Index + "\n" + r.Meta
}

// claimIndex makes index the chunk index of image digest, or says which
// one it already is.
func (s *Store) claimIndex(digest, index string) error {
	for range 3 {
		err := s.st.Create(indexBucket, digest, []byte(index))
		if err == nil || !errors.Is(err, errdefs.ErrAlreadyExists) {
			return err
		}
		cur, err := s.st.Get(indexBucket, digest)
		switch {
		case errors.Is(err, errdefs.ErrNotFound):
			continue // dropped meanwhile: claim again
		case err != nil:
			return err
		case string(cur) != index:
			return errdefs.AlreadyExists("image %s is already in the catalog with another chunk index or metadata pack (%q, not %q); add that artifact, or delete the refs naming the digest first",
				digest, cur, index)
		}
		return nil
	}
	return fmt.Errorf("claiming the chunk index of %s: the claim kept changing", digest)
}

// dropIndex gives up digest's claim, if it has one, once no ref in the
// catalog points at it (s.mu held): the digest may then come back with
// another index. Any ref counts, a local one too (a pushed layer's local
// ref names the digest its registry ref does).
//
// Not closed: an add of the same digest and index by another apiserver
// whose entry is not written yet loses its claim here; an add of another
// index in that moment is then refused only by remote.Add's look at the
// catalog, which a third apiserver can race.
//
// A failure is logged, not returned: the catalog change it follows stands,
// and the claim is then only refused to another index.
func (s *Store) dropIndex(digest string) {
	_, err := s.st.Get(indexBucket, digest)
	if errors.Is(err, errdefs.ErrNotFound) {
		return // never claimed: no need to look through the catalog
	}
	named := false
	if err == nil {
		named, err = s.referenced(digest)
	}
	if err == nil && !named {
		err = s.st.Delete(indexBucket, digest)
	}
	if err != nil {
		s.log.Warn("giving up the chunk index of an image no ref names", "digest", digest, "err", err)
	}
}

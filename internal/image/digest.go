package image

import (
	"crypto/sha256"
	"encoding/hex"
	"hash"
	"io"
	"strings"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// checkDigest accepts only "sha256:" and 64 lowercase hex digits. Digests
// become file names (blobs/sha256/<hex>, the pull cache) and URL paths, so
// anything else — "sha256:../../x", other algorithms, upper case — is
// refused before it is used.
func checkDigest(d string) error {
	hexPart, ok := strings.CutPrefix(d, "sha256:")
	if !ok {
		if i := strings.IndexByte(d, ':'); i > 0 && !strings.ContainsAny(d[:i], "/.") {
			return errdefs.Invalid("digest %q: only sha256 is supported", d)
		}
		return errdefs.Invalid("digest %q is not of the form sha256:<64 hex digits>", d)
	}
	if len(hexPart) != 64 {
		return errdefs.Invalid("digest %q is not of the form sha256:<64 hex digits>", d)
	}
	for _, c := range hexPart {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return errdefs.Invalid("digest %q is not of the form sha256:<64 hex digits>", d)
		}
	}
	return nil
}

// digestHex returns the hex part of a checked digest.
func digestHex(d string) string { return strings.TrimPrefix(d, "sha256:") }

func digestOf(b []byte) string {
	sum := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(sum[:])
}

func sumString(h hash.Hash) string { return "sha256:" + hex.EncodeToString(h.Sum(nil)) }

// hashingReader hashes and counts what is read through it.
type hashingReader struct {
	r io.Reader
	h hash.Hash
	n int64
}

func newHashingReader(r io.Reader) *hashingReader {
	return &hashingReader{r: r, h: sha256.New()}
}

func (h *hashingReader) Read(b []byte) (int, error) {
	n, err := h.r.Read(b)
	h.h.Write(b[:n])
	h.n += int64(n)
	return n, err
}

func (h *hashingReader) digest() string { return sumString(h.h) }

// readVerified reads the blob d from r, which must hold exactly d.Size
// bytes hashing to d.Digest, and at most limit bytes.
func readVerified(r io.Reader, d descriptor, limit int64) ([]byte, error) {
	if d.Size > limit {
		return nil, errdefs.Invalid("blob %s: size %d exceeds limit of %d bytes", d.Digest, d.Size, limit)
	}
	b, err := io.ReadAll(io.LimitReader(r, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > limit {
		return nil, errdefs.Invalid("blob %s: exceeds limit of %d bytes", d.Digest, limit)
	}
	if int64(len(b)) != d.Size {
		return nil, errdefs.Invalid("blob %s: size %d, descriptor says %d", d.Digest, len(b), d.Size)
	}
	if got := digestOf(b); d.Digest != "" && got != d.Digest {
		return nil, errdefs.Invalid("blob %s: content has digest %s", d.Digest, got)
	}
	return b, nil
}

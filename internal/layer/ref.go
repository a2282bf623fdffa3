package layer

import (
	"errors"
	"fmt"
	"strings"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// Ref names a layer in the catalog: "kind/name:tag", for example
// "base/python:3.11" or "workspace/team-a/sphinx-9658:v1".
//
// Names may be nested with '/' (like OCI repository paths) so that teams can
// group their layers; the kind is always the first segment, so nesting is
// never ambiguous. Each name segment starts with [a-z0-9] and continues with
// [a-z0-9._-], which rules out empty, "." and ".." segments. There is no
// implicit "latest": a ref without a tag is invalid, because a layer silently
// changing under a running workload is worse than a typo caught early.
type Ref struct {
	Kind string
	Name string
	Tag  string
}

// Limits on the parts of a ref.
const (
	maxNameLen    = 200
	maxSegmentLen = 64
	maxTagLen     = 128
)

// ParseRef parses "kind/name:tag". Errors are errdefs.ErrInvalid.
func ParseRef(s string) (Ref, error) {
	kind, rest, ok := strings.Cut(s, "/")
	if !ok {
		return Ref{}, errdefs.Invalid("layer ref %q: want kind/name:tag", s)
	}
	if !validKind(kind) {
		return Ref{}, errdefs.Invalid("layer ref %q: kind %q is not one of base, workspace, toolkit, snapshot", s, kind)
	}
	name, tag, ok := strings.Cut(rest, ":")
	if !ok {
		return Ref{}, errdefs.Invalid("layer ref %q: missing :tag (there is no implicit latest)", s)
	}
	if err := checkName(name); err != nil {
		return Ref{}, errdefs.Invalid("layer ref %q: %s", s, err)
	}
	if err := checkTag(tag); err != nil {
		return Ref{}, errdefs.Invalid("layer ref %q: %s", s, err)
	}
	return Ref{Kind: kind, Name: name, Tag: tag}, nil
}

// String returns the canonical form "kind/name:tag", which is also the
// catalog key.
func (r Ref) String() string { return r.Kind + "/" + r.Name + ":" + r.Tag }

// IsDigest reports whether s is "sha256:" followed by 64 lowercase hex digits.
func IsDigest(s string) bool {
	hex, ok := strings.CutPrefix(s, "sha256:")
	if !ok || len(hex) != 64 {
		return false
	}
	for i := 0; i < len(hex); i++ {
		c := hex[i]
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

func validKind(k string) bool {
	switch k {
	case api.KindBase, api.KindWorkspace, api.KindToolkit, api.KindSnapshot:
		return true
	}
	return false
}

func checkName(name string) error {
	if name == "" {
		return errors.New("empty name")
	}
	if len(name) > maxNameLen {
		return errors.New("name longer than 200 bytes")
	}
	for seg := range strings.SplitSeq(name, "/") {
		if seg == "" {
			return errors.New("empty name segment")
		}
		if len(seg) > maxSegmentLen {
			return errors.New("name segment longer than 64 bytes")
		}
		if !isLowerAlnum(seg[0]) {
			return fmt.Errorf("name segment %q must start with a lowercase letter or digit", seg)
		}
		for i := 1; i < len(seg); i++ {
			if c := seg[i]; !isLowerAlnum(c) && c != '.' && c != '_' && c != '-' {
				return fmt.Errorf("name segment %q may contain only a-z 0-9 . _ -", seg)
			}
		}
	}
	return nil
}

func checkTag(tag string) error {
	if tag == "" {
		return errors.New("empty tag")
	}
	if len(tag) > maxTagLen {
		return errors.New("tag longer than 128 bytes")
	}
	for i := 0; i < len(tag); i++ {
		c := tag[i]
		if !isLowerAlnum(c) && (c < 'A' || c > 'Z') && c != '.' && c != '_' && c != '-' {
			return fmt.Errorf("tag %q may contain only A-Z a-z 0-9 . _ -", tag)
		}
	}
	return nil
}

func isLowerAlnum(c byte) bool { return c >= 'a' && c <= 'z' || c >= '0' && c <= '9' }

package layer

import (
	"errors"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// FuzzParseRef parses a fuzzed layer ref, as every spec's base, workspace
// and toolkits are. A refusal is Invalid. An accepted ref is already
// canonical (it is the catalog key, so two spellings of one layer must not
// both parse), has no empty, "." or ".." name segment, stays within the
// length limits and is never taken for a digest.
func FuzzParseRef(f *testing.F) {
	for _, s := range []string{
		"base/python:3.11", "workspace/team-a/sphinx:v1", "snapshot/run_1.a:Build-7", "toolkit/x:" + strings.Repeat("T", 128),
		"base/python", "base/python:", "base/../x:1", "base/a//b:1", "base/a/:1", "Base/x:1", "base/x:1:2",
		"base/x:t@sha256:00", "sha256:" + strings.Repeat("0", 64), "base/" + strings.Repeat("a", 65) + ":1",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		r, err := ParseRef(s)
		if err != nil {
			if !errors.Is(err, errdefs.ErrInvalid) {
				t.Fatalf("ParseRef(%q): error %q is not Invalid", s, err)
			}
			return
		}
		if r.String() != s {
			t.Fatalf("ParseRef(%q) = %+v, which is written %q", s, r, r.String())
		}
		if !validKind(r.Kind) || len(r.Name) > maxNameLen || len(r.Tag) == 0 || len(r.Tag) > maxTagLen {
			t.Fatalf("ParseRef(%q) = %+v", s, r)
		}
		for _, seg := range strings.Split(r.Name, "/") {
			if seg == "" || seg == "." || seg == ".." || len(seg) > maxSegmentLen {
				t.Fatalf("ParseRef(%q): name segment %q", s, seg)
			}
		}
		if IsDigest(s) {
			t.Fatalf("%q is both a ref and a digest", s)
		}
	})
}

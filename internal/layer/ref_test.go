package layer

import (
	"errors"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/internal/errdefs"
)

func TestParseRef(t *testing.T) {
	tests := []struct {
		in   string
		want Ref
		ok   bool
	}{
		{"base/python:3.11", Ref{"base", "python", "3.11"}, true},
		{"workspace/sphinx-9658:v1", Ref{"workspace", "sphinx-9658", "v1"}, true},
		{"toolkit/harness:v3", Ref{"toolkit", "harness", "v3"}, true},
		{"snapshot/run_1.a:Build-7", Ref{"snapshot", "run_1.a", "Build-7"}, true},
		{"workspace/team-a/sphinx:v1", Ref{"workspace", "team-a/sphinx", "v1"}, true},
		{"base/x:" + strings.Repeat("T", 128), Ref{"base", "x", strings.Repeat("T", 128)}, true},
		{"base/9:_", Ref{"base", "9", "_"}, true},

		{"", Ref{}, false},
		{"python:3.11", Ref{}, false},       // no kind
		{"image/python:3.11", Ref{}, false}, // unknown kind
		{"Base/python:3.11", Ref{}, false},  // kinds are lowercase
		{"base/python", Ref{}, false},       // no implicit latest
		{"base/python:", Ref{}, false},      // empty tag
		{"base/:1", Ref{}, false},           // empty name
		{"base/Python:1", Ref{}, false},     // uppercase name
		{"base/py thon:1", Ref{}, false},    // space
		{"base/a//b:1", Ref{}, false},       // empty segment
		{"base/a/:1", Ref{}, false},         // trailing slash
		{"base/../etc:1", Ref{}, false},     // dot segment
		{"base/.hidden:1", Ref{}, false},    // segment starting with '.'
		{"base/-x:1", Ref{}, false},         // segment starting with '-'
		{"base/x:1:2", Ref{}, false},        // two colons
		{"base/x:a/b", Ref{}, false},        // slash in tag
		{"base/x:" + strings.Repeat("T", 129), Ref{}, false},
		{"base/" + strings.Repeat("a", 65) + ":1", Ref{}, false},
		{"base/" + strings.Repeat("abcdefghi/", 21) + "a:1", Ref{}, false}, // name > 200
		{"base/x:t\x00", Ref{}, false},
		{"sha256:" + strings.Repeat("a", 64), Ref{}, false},
	}
	for _, tt := range tests {
		got, err := ParseRef(tt.in)
		if tt.ok {
			if err != nil {
				t.Errorf("ParseRef(%q): %v", tt.in, err)
				continue
			}
			if got != tt.want {
				t.Errorf("ParseRef(%q) = %+v, want %+v", tt.in, got, tt.want)
			}
			if got.String() != tt.in {
				t.Errorf("ParseRef(%q).String() = %q", tt.in, got.String())
			}
			continue
		}
		if err == nil {
			t.Errorf("ParseRef(%q) = %+v, want error", tt.in, got)
		} else if !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("ParseRef(%q): error %v is not ErrInvalid", tt.in, err)
		}
	}
}

func TestIsDigest(t *testing.T) {
	hex := strings.Repeat("0123456789abcdef", 4)
	tests := []struct {
		in   string
		want bool
	}{
		{"sha256:" + hex, true},
		{"sha256:" + strings.ToUpper(hex), false},
		{"sha256:" + hex[:63], false},
		{"sha256:" + hex + "0", false},
		{"sha512:" + hex, false},
		{hex, false},
		{"sha256:" + hex[:63] + "g", false},
		{"", false},
	}
	for _, tt := range tests {
		if got := IsDigest(tt.in); got != tt.want {
			t.Errorf("IsDigest(%q) = %v, want %v", tt.in, got, tt.want)
		}
	}
}

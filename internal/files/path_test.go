package files

import (
	"errors"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/internal/errdefs"
)

func TestCleanPath(t *testing.T) {
	long := "/" + strings.Repeat("a", MaxPathLen)
	tests := []struct {
		in, want string
		bad      bool
	}{
		{in: "/", want: "/"},
		{in: "/repo/a.py", want: "/repo/a.py"},
		{in: "//repo//a.py/", want: "/repo/a.py"},
		{in: "/repo/./a.py", want: "/repo/a.py"},
		{in: "/repo/x/../a.py", want: "/repo/a.py"},
		// ".." cannot climb above the sandbox's "/".
		{in: "/..", want: "/"},
		{in: "/../../etc/shadow", want: "/etc/shadow"},
		{in: "/repo/../../../etc", want: "/etc"},
		{in: long[:MaxPathLen], want: long[:MaxPathLen]},
		{in: "", bad: true},
		{in: "repo/a.py", bad: true},
		{in: "./a", bad: true},
		{in: "../etc/passwd", bad: true},
		{in: "/repo/a\x00.py", bad: true},
		{in: "\x00", bad: true},
		{in: long, bad: true},
	}
	for _, tt := range tests {
		got, err := CleanPath(tt.in)
		if tt.bad {
			if !errors.Is(err, errdefs.ErrInvalid) {
				t.Errorf("CleanPath(%q) = %q, %v; want Invalid", tt.in, got, err)
			}
			continue
		}
		if err != nil || got != tt.want {
			t.Errorf("CleanPath(%q) = %q, %v; want %q", tt.in, got, err, tt.want)
		}
	}
}

func TestCleanEntryName(t *testing.T) {
	tests := []struct {
		in, want string
		bad      bool
	}{
		{in: "a", want: "a"},
		{in: "a/b/", want: "a/b"},
		{in: "./a/b", want: "a/b"},
		{in: "./", want: "."},
		{in: ".", want: "."},
		{in: "/", want: "."},
		{in: "/abs", want: "abs"},
		{in: "///abs/x", want: "abs/x"},
		{in: "/etc/passwd", want: "etc/passwd"},
		{in: "a/../b", want: "b"},
		{in: "a/./b//c", want: "a/b/c"},
		{in: "..a", want: "..a"},
		{in: "a..", want: "a.."},
		{in: "", bad: true},
		{in: "..", bad: true},
		{in: "../escape", bad: true},
		{in: "a/../../b", bad: true},
		{in: "a/b/../../../c", bad: true},
		{in: "/../abs", bad: true},
		{in: "./..", bad: true},
		{in: "a\x00b", bad: true},
	}
	for _, tt := range tests {
		got, err := cleanEntryName(tt.in)
		if tt.bad {
			if !errors.Is(err, errdefs.ErrInvalid) {
				t.Errorf("cleanEntryName(%q) = %q, %v; want Invalid", tt.in, got, err)
			}
			continue
		}
		if err != nil || got != tt.want {
			t.Errorf("cleanEntryName(%q) = %q, %v; want %q", tt.in, got, err, tt.want)
		}
	}
}

package layer

import (
	"strings"
	"testing"
)

func TestParseMountinfo(t *testing.T) {
	in := `22 1 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:5 - proc proc rw
101 29 0:52 / /var/lib/dsec/mnt/ab\040c rw,relatime - erofs /var/lib/dsec/blobs/x.erofs ro
102 29 0:53 / /run/sb/1/rootfs rw master:3 shared:7 - overlay overlay rw,lowerdir+=/a
103 29 0:54 / /odd\134path\011tab rw - tmpfs none rw
`
	got, err := parseMountinfo(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	want := []mountEntry{
		{ID: 22, Parent: 1, Mountpoint: "/proc", FSType: "proc", Source: "proc"},
		{ID: 101, Parent: 29, Mountpoint: "/var/lib/dsec/mnt/ab c", FSType: "erofs", Source: "/var/lib/dsec/blobs/x.erofs"},
		{ID: 102, Parent: 29, Mountpoint: "/run/sb/1/rootfs", FSType: "overlay", Source: "overlay"},
		{ID: 103, Parent: 29, Mountpoint: "/odd\\path\ttab", FSType: "tmpfs", Source: "none"},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d entries, want %d: %+v", len(got), len(want), got)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("entry %d = %+v, want %+v", i, got[i], want[i])
		}
	}

	for _, bad := range []string{"1 2 3\n", "x 1 0:1 / /a rw - ext4 /dev/a rw\n", "1 1 0:1 / /a rw shared:1\n"} {
		if _, err := parseMountinfo(strings.NewReader(bad)); err == nil {
			t.Errorf("parseMountinfo(%q) succeeded", bad)
		}
	}
}

func TestUnescapeMountPath(t *testing.T) {
	for in, want := range map[string]string{
		`/plain`:      "/plain",
		`/a\040b`:     "/a b",
		`/nl\012`:     "/nl\n",
		`/trailing\`:  `/trailing\`,
		`/short\04`:   `/short\04`,
		`/not\999oct`: `/not\999oct`,
	} {
		if got := unescapeMountPath(in); got != want {
			t.Errorf("unescapeMountPath(%q) = %q, want %q", in, got, want)
		}
	}
}

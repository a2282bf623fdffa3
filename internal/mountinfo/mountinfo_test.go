package mountinfo

import (
	"os"
	"slices"
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	tests := []struct {
		name    string
		in      string
		want    []Entry
		wantErr bool
	}{
		{
			name: "optional fields and escaped space",
			in:   `40 31 0:37 / /sys/fs/cgroup/my\040tree rw,relatime shared:9 master:2 - cgroup cgroup rw,xattr,name=systemd` + "\n",
			want: []Entry{{ID: 40, Parent: 31, Root: "/", MountPoint: "/sys/fs/cgroup/my tree", Options: "rw,relatime", FSType: "cgroup", Source: "cgroup", SuperOptions: "rw,xattr,name=systemd"}},
		},
		{
			name: "cgroup namespace root and blank lines",
			in:   "41 31 0:38 /docker/abc /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n\n  \n",
			want: []Entry{{ID: 41, Parent: 31, Root: "/docker/abc", MountPoint: "/sys/fs/cgroup", Options: "rw", FSType: "cgroup2", Source: "cgroup2", SuperOptions: "rw"}},
		},
		{
			name: "mixed lines",
			in: `22 1 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:5 - proc proc rw
101 29 0:52 / /var/lib/dsec/mnt/ab\040c rw,relatime - erofs /var/lib/dsec/blobs/x\040y.erofs ro
102 29 0:53 / /run/sb/1/rootfs rw master:3 shared:7 - overlay overlay rw,lowerdir+=/a
103 29 0:54 /a\134b /odd\134path\011tab rw - tmpfs none rw
104 29 0:55 / /nosuper rw - tmpfs none
`,
			want: []Entry{
				{ID: 22, Parent: 1, Root: "/", MountPoint: "/proc", Options: "rw,nosuid,nodev,noexec,relatime", FSType: "proc", Source: "proc", SuperOptions: "rw"},
				{ID: 101, Parent: 29, Root: "/", MountPoint: "/var/lib/dsec/mnt/ab c", Options: "rw,relatime", FSType: "erofs", Source: "/var/lib/dsec/blobs/x y.erofs", SuperOptions: "ro"},
				{ID: 102, Parent: 29, Root: "/", MountPoint: "/run/sb/1/rootfs", Options: "rw", FSType: "overlay", Source: "overlay", SuperOptions: "rw,lowerdir+=/a"},
				{ID: 103, Parent: 29, Root: `/a\b`, MountPoint: "/odd\\path\ttab", Options: "rw", FSType: "tmpfs", Source: "none", SuperOptions: "rw"},
				{ID: 104, Parent: 29, Root: "/", MountPoint: "/nosuper", Options: "rw", FSType: "tmpfs", Source: "none"},
			},
		},
		{name: "empty", in: "", want: nil},
		{name: "no separator", in: "41 31 0:38 / /sys/fs/cgroup rw cgroup2 cgroup2 rw\n", wantErr: true},
		{name: "separator too early", in: "41 31 0:38 / - cgroup2 cgroup2 rw\n", wantErr: true},
		{name: "too few fields", in: "1 2 3\n", wantErr: true},
		{name: "bad ID", in: "x 1 0:1 / /a rw - ext4 /dev/a rw\n", wantErr: true},
		{name: "bad parent", in: "1 y 0:1 / /a rw - ext4 /dev/a rw\n", wantErr: true},
		{name: "nothing after separator", in: "1 1 0:1 / /a rw shared:1 -\n", wantErr: true},
		{name: "no source", in: "1 1 0:1 / /a rw - ext4\n", wantErr: true},
		{name: "optional field only", in: "1 1 0:1 / /a rw shared:1\n", wantErr: true},
		{name: "one bad line fails all", in: "22 1 0:21 / /proc rw - proc proc rw\n1 2 3\n", wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Parse(strings.NewReader(tt.in))
			if (err != nil) != tt.wantErr {
				t.Fatalf("err = %v, wantErr %v", err, tt.wantErr)
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("got  %+v\nwant %+v", got, tt.want)
			}
		})
	}
}

func TestUnescape(t *testing.T) {
	for in, want := range map[string]string{
		`/plain`:      "/plain",
		`/a\040b`:     "/a b",
		`/nl\012`:     "/nl\n",
		`/bs\134`:     `/bs\`,
		`/tab\011x`:   "/tab\tx",
		`/trailing\`:  `/trailing\`,
		`/short\04`:   `/short\04`,
		`/not\999oct`: `/not\999oct`,
		`/big\777`:    `/big\777`,
		`/sign\+12`:   `/sign\+12`,
	} {
		if got := Unescape(in); got != want {
			t.Errorf("Unescape(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestUnder(t *testing.T) {
	entries := []Entry{
		{ID: 1, MountPoint: "/"},
		{ID: 2, MountPoint: "/var/lib/dsec"},
		{ID: 3, MountPoint: "/var/lib/dsec/sandboxes/a/rootfs"},
		{ID: 4, MountPoint: "/var/lib/dsecx"},
		{ID: 5, MountPoint: "/var/lib"},
		{ID: 6, MountPoint: "/var/lib/dsec/sandboxes/a/rootfs"},
	}
	ids := func(es []Entry) []int {
		var out []int
		for _, e := range es {
			out = append(out, e.ID)
		}
		return out
	}
	for prefix, want := range map[string][]int{
		"/var/lib/dsec":           {2, 3, 6},
		"/var/lib/dsec/sandboxes": {3, 6},
		"/var/lib":                {2, 3, 4, 5, 6},
		"/":                       {1, 2, 3, 4, 5, 6},
		"/nowhere":                nil,
	} {
		if got := ids(Under(entries, prefix)); !slices.Equal(got, want) {
			t.Errorf("Under(%q) = %v, want %v", prefix, got, want)
		}
	}
}

func TestSuperOptionList(t *testing.T) {
	if got := (Entry{}).SuperOptionList(); got != nil {
		t.Errorf("empty: got %q, want nil", got)
	}
	if got, want := (Entry{SuperOptions: "rw,cpu,cpuacct"}).SuperOptionList(), []string{"rw", "cpu", "cpuacct"}; !slices.Equal(got, want) {
		t.Errorf("got %q, want %q", got, want)
	}
}

// TestRead parses this process's own mount table, which has at least the
// root mount.
func TestRead(t *testing.T) {
	if _, err := os.Stat("/proc/self/mountinfo"); err != nil {
		t.Skip(err)
	}
	entries, err := Read()
	if err != nil {
		t.Fatal(err)
	}
	if len(Under(entries, "/")) == 0 {
		t.Fatal("no mounts at or below /")
	}
}

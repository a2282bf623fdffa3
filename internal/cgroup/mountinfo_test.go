package cgroup

import (
	"errors"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/internal/errdefs"
)

func TestNewInfoFromFixtures(t *testing.T) {
	systemdV1 := map[string]string{
		"blkio":        "/sys/fs/cgroup/blkio",
		"cpu":          "/sys/fs/cgroup/cpu",
		"cpuacct":      "/sys/fs/cgroup/cpuacct",
		"cpuset":       "/sys/fs/cgroup/cpuset",
		"devices":      "/sys/fs/cgroup/devices",
		"freezer":      "/sys/fs/cgroup/freezer",
		"memory":       "/sys/fs/cgroup/memory",
		"name=systemd": "/sys/fs/cgroup/systemd",
		"pids":         "/sys/fs/cgroup/pids",
	}
	withHugetlb := maps.Clone(systemdV1)
	withHugetlb["hugetlb"] = "/sys/fs/cgroup/hugetlb"

	tests := []struct {
		file   string
		mode   Mode
		v2Root string
		v1     map[string]string
	}{
		{
			// This dev machine as booted: hugetlb is still in the v2 tree.
			file: "mountinfo-hybrid", mode: Hybrid,
			v2Root: "/sys/fs/cgroup/unified", v1: systemdV1,
		},
		{
			// The same machine after hugetlb was bound to v1 for crun.
			file: "mountinfo-hybrid-hugetlb-moved", mode: Hybrid,
			v2Root: "/sys/fs/cgroup/unified", v1: withHugetlb,
		},
		{
			// Debian 12 / systemd default: pure cgroup2.
			file: "mountinfo-v2", mode: V2,
			v2Root: "/sys/fs/cgroup", v1: map[string]string{},
		},
		{
			// EL7-style v1 with co-mounted controllers.
			file: "mountinfo-v1", mode: V1,
			v1: map[string]string{
				"blkio":        "/sys/fs/cgroup/blkio",
				"cpu":          "/sys/fs/cgroup/cpu,cpuacct",
				"cpuacct":      "/sys/fs/cgroup/cpu,cpuacct",
				"cpuset":       "/sys/fs/cgroup/cpuset",
				"devices":      "/sys/fs/cgroup/devices",
				"freezer":      "/sys/fs/cgroup/freezer",
				"hugetlb":      "/sys/fs/cgroup/hugetlb",
				"memory":       "/sys/fs/cgroup/memory",
				"name=systemd": "/sys/fs/cgroup/systemd",
				"net_cls":      "/sys/fs/cgroup/net_cls,net_prio",
				"net_prio":     "/sys/fs/cgroup/net_cls,net_prio",
				"perf_event":   "/sys/fs/cgroup/perf_event",
				"pids":         "/sys/fs/cgroup/pids",
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.file, func(t *testing.T) {
			f, err := os.Open(filepath.Join("testdata", tt.file))
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			mounts, err := parseMountinfo(f)
			if err != nil {
				t.Fatalf("parseMountinfo: %v", err)
			}
			info, err := newInfo(mounts)
			if err != nil {
				t.Fatalf("newInfo: %v", err)
			}
			if info.Mode != tt.mode {
				t.Errorf("Mode = %v, want %v", info.Mode, tt.mode)
			}
			if info.V2Root != tt.v2Root {
				t.Errorf("V2Root = %q, want %q", info.V2Root, tt.v2Root)
			}
			if !maps.Equal(info.V1, tt.v1) {
				t.Errorf("V1 = %v\nwant %v", info.V1, tt.v1)
			}
		})
	}
}

func TestParseMountinfo(t *testing.T) {
	tests := []struct {
		name    string
		in      string
		want    []mount
		wantErr bool
	}{
		{
			name: "optional fields and escaped space",
			in:   `40 31 0:37 / /sys/fs/cgroup/my\040tree rw,relatime shared:9 master:2 - cgroup cgroup rw,xattr,name=systemd` + "\n",
			want: []mount{{Root: "/", Mountpoint: "/sys/fs/cgroup/my tree", FSType: "cgroup", SuperOpts: []string{"rw", "xattr", "name=systemd"}}},
		},
		{
			name: "cgroup namespace root",
			in:   "41 31 0:38 /docker/abc /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n\n",
			want: []mount{{Root: "/docker/abc", Mountpoint: "/sys/fs/cgroup", FSType: "cgroup2", SuperOpts: []string{"rw"}}},
		},
		{name: "no separator", in: "41 31 0:38 / /sys/fs/cgroup rw cgroup2 cgroup2 rw\n", wantErr: true},
		{name: "separator too early", in: "41 31 0:38 / - cgroup2 cgroup2 rw\n", wantErr: true},
		{name: "empty", in: "", want: nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseMountinfo(strings.NewReader(tt.in))
			if (err != nil) != tt.wantErr {
				t.Fatalf("err = %v, wantErr %v", err, tt.wantErr)
			}
			if !slices.EqualFunc(got, tt.want, func(a, b mount) bool {
				return a.Root == b.Root && a.Mountpoint == b.Mountpoint && a.FSType == b.FSType && slices.Equal(a.SuperOpts, b.SuperOpts)
			}) {
				t.Errorf("got %+v\nwant %+v", got, tt.want)
			}
		})
	}
}

func TestNewInfoEdgeCases(t *testing.T) {
	t.Run("no cgroups", func(t *testing.T) {
		_, err := newInfo([]mount{{Mountpoint: "/", FSType: "ext4"}})
		if !errors.Is(err, errdefs.ErrPrecondition) {
			t.Fatalf("err = %v, want precondition", err)
		}
	})
	t.Run("first mount of a hierarchy wins", func(t *testing.T) {
		info, err := newInfo([]mount{
			{Mountpoint: "/sys/fs/cgroup/memory", FSType: "cgroup", SuperOpts: []string{"rw", "memory"}},
			{Mountpoint: "/run/bind/memory", FSType: "cgroup", SuperOpts: []string{"rw", "memory"}},
			{Mountpoint: "/sys/fs/cgroup/unified", FSType: "cgroup2", SuperOpts: []string{"rw"}},
			{Mountpoint: "/elsewhere", FSType: "cgroup2", SuperOpts: []string{"rw"}},
		})
		if err != nil {
			t.Fatal(err)
		}
		if info.V1["memory"] != "/sys/fs/cgroup/memory" || info.V2Root != "/sys/fs/cgroup/unified" || info.Mode != Hybrid {
			t.Errorf("got %+v", info)
		}
	})
}

func TestModeString(t *testing.T) {
	for m, want := range map[Mode]string{V1: "v1", Hybrid: "hybrid", V2: "v2", 0: "unknown"} {
		if m.String() != want {
			t.Errorf("Mode(%d).String() = %q, want %q", int(m), m.String(), want)
		}
	}
}

func TestLevels(t *testing.T) {
	if got, want := levels("/a/b/c"), []string{"/a", "/a/b", "/a/b/c"}; !slices.Equal(got, want) {
		t.Errorf("levels = %v, want %v", got, want)
	}
	if got, want := levels("/dsec"), []string{"/dsec"}; !slices.Equal(got, want) {
		t.Errorf("levels = %v, want %v", got, want)
	}
}

// TestInvalidPaths needs no cgroups: validation happens before any I/O.
func TestInvalidPaths(t *testing.T) {
	info := &Info{Mode: V2, V2Root: t.TempDir(), V1: map[string]string{}}
	for _, rel := range []string{"", "/", "dsec", "/dsec/", "/a/../b", "/a//b", "/dsec/."} {
		calls := map[string]error{
			"EnsureParent": info.EnsureParent(rel),
			"Remove":       info.Remove(rel),
			"Thaw":         info.Thaw(rel),
		}
		_, calls["Stats"] = info.Stats(rel)
		_, calls["Procs"] = info.Procs(rel)
		_, calls["Children"] = info.Children(rel)
		for name, err := range calls {
			if !errors.Is(err, errdefs.ErrInvalid) {
				t.Errorf("%s(%q) = %v, want invalid", name, rel, err)
			}
		}
	}
}

func TestCrunCompatibleNonHybrid(t *testing.T) {
	for _, m := range []Mode{V1, V2} {
		info := &Info{Mode: m}
		if ok, reason := info.CrunCompatible(); !ok {
			t.Errorf("%v: CrunCompatible = false (%s), want true", m, reason)
		}
		if actions, err := info.PrepareForCrun(); err != nil || len(actions) != 0 {
			t.Errorf("%v: PrepareForCrun = %v, %v; want no-op", m, actions, err)
		}
	}
}

func TestCrunCompatibleHybrid(t *testing.T) {
	root := t.TempDir()
	info := &Info{Mode: Hybrid, V2Root: root}
	file := filepath.Join(root, "cgroup.controllers")
	if err := os.WriteFile(file, []byte("hugetlb misc\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	ok, reason := info.CrunCompatible()
	if ok || !strings.Contains(reason, "hugetlb misc") {
		t.Errorf("CrunCompatible = %v, %q; want false naming the controllers", ok, reason)
	}
	if err := os.WriteFile(file, []byte("\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if ok, reason := info.CrunCompatible(); !ok {
		t.Errorf("CrunCompatible = false (%s) with no v2 controllers, want true", reason)
	}
}

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
	"github.com/dsecproject/dsec/internal/mountinfo"
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
			mounts, err := mountinfo.Parse(f)
			if err != nil {
				t.Fatalf("mountinfo.Parse: %v", err)
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

func TestNewInfoEdgeCases(t *testing.T) {
	t.Run("no cgroups", func(t *testing.T) {
		_, err := newInfo([]mountinfo.Entry{
			{MountPoint: "/", FSType: "ext4", SuperOptions: "rw"},
			// A cgroup line without super options names no controller.
			{MountPoint: "/sys/fs/cgroup/odd", FSType: "cgroup"},
		})
		if !errors.Is(err, errdefs.ErrPrecondition) {
			t.Fatalf("err = %v, want precondition", err)
		}
	})
	t.Run("first mount of a hierarchy wins", func(t *testing.T) {
		info, err := newInfo([]mountinfo.Entry{
			{MountPoint: "/sys/fs/cgroup/memory", FSType: "cgroup", SuperOptions: "rw,memory"},
			{MountPoint: "/run/bind/memory", FSType: "cgroup", SuperOptions: "rw,memory"},
			{MountPoint: "/sys/fs/cgroup/unified", FSType: "cgroup2", SuperOptions: "rw"},
			{MountPoint: "/elsewhere", FSType: "cgroup2", SuperOptions: "rw"},
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

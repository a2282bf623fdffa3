package cgroup

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// These tests use plain directories as stand-in hierarchies: enough for
// validation, listing and clean-up on failure, which need no cgroupfs.

func mkdirs(t *testing.T, dirs ...string) {
	t.Helper()
	for _, d := range dirs {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
}

func TestEnsureParentV2MissingController(t *testing.T) {
	root := t.TempDir()
	if err := os.WriteFile(filepath.Join(root, "cgroup.controllers"), []byte("cpu io\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	info := &Info{Mode: V2, V2Root: root, V1: map[string]string{}}
	err := info.EnsureParent("/dsec")
	if !errors.Is(err, errdefs.ErrPrecondition) {
		t.Fatalf("EnsureParent = %v, want precondition (memory, pids missing)", err)
	}
	if isDir(filepath.Join(root, "dsec")) {
		t.Error("EnsureParent left /dsec behind after failing")
	}
}

func TestEnsureParentCleansUpOnFailure(t *testing.T) {
	tmp := t.TempDir()
	// Hierarchies are handled in path order: memory first, so there is
	// something to clean up when cpuset fails.
	memory, cpuset := filepath.Join(tmp, "memory"), filepath.Join(tmp, "x", "cpuset")
	mkdirs(t, memory, cpuset)
	// The cpuset root has its files but a plain directory made below it
	// does not, so copying cpuset.cpus fails after mkdir succeeded.
	if err := os.WriteFile(filepath.Join(cpuset, "cpuset.cpus"), []byte("0-1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	info := &Info{Mode: V1, V1: map[string]string{"memory": memory, "cpuset": cpuset}}
	if err := info.EnsureParent("/dsec/inner"); err == nil {
		t.Fatal("EnsureParent succeeded without cpuset files")
	}
	for _, root := range []string{memory, cpuset} {
		if isDir(filepath.Join(root, "dsec")) {
			t.Errorf("EnsureParent left %s/dsec behind after failing", root)
		}
	}
}

func TestChildrenUnion(t *testing.T) {
	tmp := t.TempDir()
	memory, pids, unified := filepath.Join(tmp, "memory"), filepath.Join(tmp, "pids"), filepath.Join(tmp, "unified")
	mkdirs(t,
		filepath.Join(memory, "dsec", "b"),
		filepath.Join(memory, "dsec", "a"),
		filepath.Join(pids, "dsec", "a"),
		filepath.Join(unified, "dsec", "c"), // left behind in one hierarchy only
		unified,
	)
	if err := os.WriteFile(filepath.Join(memory, "dsec", "memory.stat"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	info := &Info{Mode: Hybrid, V2Root: unified, V1: map[string]string{"memory": memory, "pids": pids}}
	got, err := info.Children("/dsec")
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"a", "b", "c"}; !slices.Equal(got, want) {
		t.Errorf("Children = %v, want %v", got, want)
	}
	if got, err := info.Children("/absent"); err != nil || len(got) != 0 {
		t.Errorf("Children(/absent) = %v, %v; want none", got, err)
	}
}

func TestProcsFiles(t *testing.T) {
	hybrid := &Info{Mode: Hybrid, V2Root: "/sys/fs/cgroup/unified", V1: map[string]string{
		"cpu": "/sys/fs/cgroup/cpu,cpuacct", "cpuacct": "/sys/fs/cgroup/cpu,cpuacct",
		"memory": "/sys/fs/cgroup/memory", "name=systemd": "/sys/fs/cgroup/systemd",
	}}
	got, err := hybrid.procsFiles([]byte("4:memory:/dsec/n/sb\n3:cpu,cpuacct:/dsec/n/sb\n2:net_cls:/\n1:name=systemd:/dsec/n/sb\n0::/dsec/n/sb\n"))
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"/sys/fs/cgroup/memory/dsec/n/sb/cgroup.procs",
		"/sys/fs/cgroup/cpu,cpuacct/dsec/n/sb/cgroup.procs",
		"/sys/fs/cgroup/systemd/dsec/n/sb/cgroup.procs",
		"/sys/fs/cgroup/unified/dsec/n/sb/cgroup.procs",
	}
	if !slices.Equal(got, want) {
		t.Errorf("hybrid: got %q\nwant %q", got, want)
	}
	v2 := &Info{Mode: V2, V2Root: "/sys/fs/cgroup"}
	got, err = v2.procsFiles([]byte("0::/dsec/n/sb\n"))
	if err != nil || !slices.Equal(got, []string{"/sys/fs/cgroup/dsec/n/sb/cgroup.procs"}) {
		t.Errorf("v2: got %q %v", got, err)
	}
	for _, bad := range []string{"0::/dsec/../../etc\n", "0::relative\n", "", "5:net_cls:/x\n"} {
		if got, err := v2.procsFiles([]byte(bad)); err == nil {
			t.Errorf("%q: got %q, want an error", bad, got)
		}
	}
}

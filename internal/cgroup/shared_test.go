package cgroup

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestSharedMemoryHost: a cgroup below SharedMemory gets every hierarchy
// but a memory cgroup of its own: its process is charged to the shared
// parent, it refuses a memory limit, its stats count resident sets, it has
// nothing to reclaim, and it resets and recycles as a slot (memory left
// out) and is removed without trace.
func TestSharedMemoryHost(t *testing.T) {
	needRoot(t)
	info, err := Detect()
	if err != nil {
		t.Fatal(err)
	}
	mem, v1mem := info.V1["memory"]
	if !v1mem && info.Mode != V2 {
		t.Skip("needs the memory controller in v1 or a pure cgroup v2 host")
	}
	info.SharedMemory = fmt.Sprintf("/dsec-test-shm-%d-%08x", os.Getpid(), rand.Uint32())
	if err := info.EnsureSharedMemoryParent(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := info.Remove(info.SharedMemory); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
	if info.Mode == V2 {
		sub, err := readList(filepath.Join(info.V2Root, info.SharedMemory, "cgroup.subtree_control"))
		if err != nil || strings.Contains(strings.Join(sub, " "), "memory") || len(sub) == 0 {
			t.Fatalf("shared parent's subtree_control %v (%v): want its controllers but memory", sub, err)
		}
	}
	slots, err := info.NewSlots(info.SharedMemory, 2)
	if err != nil {
		t.Fatal(err)
	}
	rel, _ := slots.Get("sb-1")
	if _, err := info.MakeSandbox(rel, Limits{MemoryBytes: 64 << 20}); err == nil {
		t.Fatal("a memory limit below the shared parent was taken")
	}
	if info.exists(rel) {
		t.Fatal("a refused MakeSandbox left the cgroup")
	}
	procs, err := info.MakeSandbox(rel, Limits{Pids: 50})
	if err != nil {
		t.Fatal(err)
	}
	if v1mem {
		want := filepath.Join(mem, info.SharedMemory, "cgroup.procs")
		if n := strings.Count(strings.Join(procs, " "), mem+"/"); n != 1 || !strings.Contains(strings.Join(procs, " "), want) {
			t.Fatalf("procs files %v: want the shared parent's %s and no other memory one", procs, want)
		}
		if isDir(filepath.Join(mem, rel)) {
			t.Fatalf("memory cgroup %s made below the shared parent", rel)
		}
	} else if _, err := os.Stat(filepath.Join(info.V2Root, rel, "memory.max")); err == nil {
		t.Fatalf("%s has memory files of its own", rel)
	}
	p := startIn(t, procs, "sleep", "60")
	cg, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", p.pid))
	for _, line := range strings.Split(strings.TrimSpace(string(cg)), "\n") {
		f := strings.SplitN(line, ":", 3)
		want := rel
		if strings.Contains(","+f[1]+",", ",memory,") {
			want = info.SharedMemory
		}
		if len(f) == 3 && f[2] != want {
			t.Errorf("sleep is in %s, want %s", line, want)
		}
	}
	if got, err := info.RelOf(p.pid); err != nil || got != rel {
		t.Errorf("RelOf = %q, %v; want %s", got, err, rel)
	}
	st, err := info.Stats(rel)
	if err != nil || !st.MemoryFromRSS || st.MemoryBytes == 0 || st.MemoryLimitBytes != 0 || st.Pids != 1 {
		t.Errorf("stats %+v, %v: want the resident set of one process, no limit", st, err)
	}
	if r, err := info.Reclaim(rel); err != nil || r.BeforeBytes != 0 || !strings.HasPrefix(r.Method, "none") {
		t.Errorf("reclaim %+v, %v: want none", r, err)
	}
	if err := info.Kill(rel); err != nil {
		t.Fatal(err)
	}
	p.waitSignal(t)
	if err := slots.Put(rel, "sb-1"); err != nil {
		t.Fatal(err)
	}
	if free := slots.FreeSlots(); len(free) != 1 || free[0] != rel {
		t.Fatalf("free slots %v after Put: want %s reset for reuse", free, rel)
	}
	if again, _ := slots.Get("sb-2"); again != rel {
		t.Fatalf("Get = %s, want the free slot %s", again, rel)
	}
	limitFile := filepath.Join(info.V2Root, info.SharedMemory, "memory.max")
	if v1mem {
		limitFile = filepath.Join(mem, info.SharedMemory, "memory.limit_in_bytes")
	}
	if err := info.SetSharedMemoryLimit(128 << 20); err != nil {
		t.Fatal(err)
	}
	if got, _ := readString(limitFile); got != "134217728" {
		t.Errorf("shared limit %q, want 134217728", got)
	}
	if err := info.SetSharedMemoryLimit(0); err != nil {
		t.Fatal(err)
	}
	if got, _ := readString(limitFile); !isDefault(got, map[bool]string{true: "-1", false: "max"}[v1mem]) {
		t.Errorf("shared limit %q after lifting it", got)
	}
	if err := info.Remove(rel); err != nil || info.exists(rel) {
		t.Fatalf("remove: %v (exists %v)", err, info.exists(rel))
	}
}

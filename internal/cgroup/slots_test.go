package cgroup

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"
)

func TestSlotNames(t *testing.T) {
	s := &Slots{parent: "/dsec/x", next: 1, owner: map[string]string{}}
	for _, c := range []struct {
		rel  string
		owns bool
	}{
		{"/dsec/x/s-1", true},
		{"/dsec/x/s-42", true},
		{"/dsec/x/s-007", false}, // not how Get names them
		{"/dsec/x/s-", false},
		{"/dsec/x/s-1/child", false},
		{"/dsec/y/s-1", false},
		{"/dsec/x/sb-local-abc", false},
		{"/dsec/x/s--1", false},
	} {
		if got := s.Owns(c.rel); got != c.owns {
			t.Errorf("Owns(%q) = %v, want %v", c.rel, got, c.owns)
		}
	}
	s.Seen("s-41")
	s.Seen("s-7")
	s.Seen("sb-local-s-99")
	s.Seen("s-0099")
	if rel, base := s.Get("sb-a"); rel != "/dsec/x/s-42" || base != 0 {
		t.Errorf("Get after Seen(s-41) = %q %d, want /dsec/x/s-42 0", rel, base)
	}
}

func TestIsDefault(t *testing.T) {
	for _, c := range []struct {
		cur, want string
		is        bool
	}{
		{"-1", "-1", true},
		{"9223372036854771712", "-1", true},
		{"67108864", "-1", false},
		{"max", "max", true},
		{"max 100000", "max", true},
		{"50000 100000", "max", false},
		{"4096", "max", false},
		{"THAWED", "THAWED", true},
		{"FROZEN", "THAWED", false},
		{"1", "0", false},
	} {
		if got := isDefault(c.cur, c.want); got != c.is {
			t.Errorf("isDefault(%q, %q) = %v, want %v", c.cur, c.want, got, c.is)
		}
	}
}

// TestSlotsRecycle runs slots on the host's real hierarchies: a slot a
// "sandbox" (processes moved in, limits written as a runtime would) used
// comes back with nothing of it left, and a slot that is not provably
// empty is removed, its processes killed, never handed out again.
func TestSlotsRecycle(t *testing.T) {
	needRoot(t)
	info, err := Detect()
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := info.V1["memory"]; !ok && info.Mode != V2 {
		t.Skip("needs the memory controller in v1 or a pure cgroup v2 host")
	}
	parent := fmt.Sprintf("/dsec-test-%d-%08x", os.Getpid(), rand.Uint32())
	if err := info.EnsureParent(parent); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := info.Remove(parent); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
	slots, err := info.NewSlots(parent, 2)
	if err != nil {
		t.Fatal(err)
	}

	// mkslot creates rel as a runtime would and returns the cgroup.procs
	// files a process joins (not cpuset's: it would need cpus and mems).
	mkslot := func(rel string) []string {
		t.Helper()
		var procs []string
		for _, root := range info.roots() {
			if err := os.Mkdir(filepath.Join(root, rel), 0o755); err != nil && !errors.Is(err, os.ErrExist) {
				t.Fatal(err)
			}
			if root != info.V1["cpuset"] {
				procs = append(procs, filepath.Join(root, rel, "cgroup.procs"))
			}
		}
		return procs
	}
	// limits writes a sandbox's settings, the ones a reuse must undo.
	limits := func(rel string) []slotWrite {
		t.Helper()
		var set []slotWrite
		put := func(dir, file, value string) {
			p := filepath.Join(dir, rel, file)
			if _, err := os.Stat(p); err != nil {
				return
			}
			if err := writeFile(p, value); err != nil {
				t.Fatalf("setting %s: %v", p, err)
			}
			set = append(set, slotWrite{file: p, value: value})
		}
		if root, ok := info.V1["memory"]; ok {
			put(root, "memory.limit_in_bytes", "67108864")
			put(root, "memory.memsw.limit_in_bytes", "67108864")
		} else {
			put(info.V2Root, "memory.max", "67108864")
		}
		if root, ok := info.V1["cpu"]; ok {
			put(root, "cpu.cfs_quota_us", "50000")
			put(root, "cpu.shares", "2")
			put(root, "cpu.idle", "1")
		} else {
			put(info.V2Root, "cpu.max", "50000 100000")
			put(info.V2Root, "cpu.weight", "1")
			put(info.V2Root, "cpu.idle", "1")
		}
		if root, ok := info.V1["pids"]; ok {
			put(root, "pids.max", "64")
		} else {
			put(info.V2Root, "pids.max", "64")
		}
		if root, ok := info.V1["freezer"]; ok {
			put(root, "freezer.state", "FROZEN")
		} else {
			put(info.V2Root, "cgroup.freeze", "1")
		}
		return set
	}

	rel, base := slots.Get("sb-a")
	if rel != parent+"/s-1" || base != 0 {
		t.Fatalf("first Get = %q %d, want %s/s-1 0", rel, base, parent)
	}
	procs := mkslot(rel)
	spinner := startIn(t, procs, "yes")
	var used uint64
	waitFor(t, "cpu usage to show", func() bool {
		used, _ = info.cpuUsage(rel)
		return used > 0
	})
	set := limits(rel)
	if len(set) < 4 {
		t.Fatalf("only %d settings could be written: %+v", len(set), set)
	}
	// The freezer setting goes in last; thaw so the kill is not held.
	_ = info.Thaw(rel)
	spinner.cmd.Process.Kill()
	<-spinner.done
	for _, w := range set { // frozen again once empty, as a paused sandbox's
		if filepath.Base(w.file) == "freezer.state" || filepath.Base(w.file) == "cgroup.freeze" {
			_ = writeFile(w.file, w.value)
		}
	}

	if err := slots.Put(rel, "sb-a"); err != nil {
		t.Fatalf("Put(%s): %v", rel, err)
	}
	if got := slots.FreeSlots(); !slices.Equal(got, []string{rel}) {
		t.Fatalf("free slots %v after Put, want [%s]", got, rel)
	}
	for _, w := range set {
		cur, err := readString(w.file)
		if err != nil {
			t.Fatal(err)
		}
		if cur == w.value {
			t.Errorf("%s still %q after Put", w.file, cur)
		}
	}
	for _, w := range info.slotDefaults(rel) {
		cur, err := readString(w.file)
		if w.optional && errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil || !isDefault(cur, w.value) {
			t.Errorf("%s = %q (%v) after Put, want %s", w.file, cur, err, w.value)
		}
	}

	// A second Put of the same slot must not list it twice: two
	// sandboxes would share one cgroup. Nor may a record found at
	// recovery claim a free slot.
	if err := slots.Put(rel, "sb-a"); err != nil {
		t.Fatal(err)
	}
	if got := slots.FreeSlots(); len(got) != 1 {
		t.Fatalf("free slots %v after a second Put, want one", got)
	}
	if slots.Claim(rel, "sb-dead") {
		t.Errorf("Claim of a free slot succeeded")
	}

	got, base := slots.Get("sb-b")
	if got != rel {
		t.Fatalf("Get = %q, want the free slot %s", got, rel)
	}
	if base < used {
		t.Errorf("cpu base %d of a reused slot, want at least the %d ns used in it", base, used)
	}

	// The slot is sb-b's now: a late Put by its last sandbox (a teardown
	// retried) or a claim by another record must not touch it.
	sleeper := startIn(t, procs, "sleep", "600")
	if err := slots.Put(rel, "sb-a"); err != nil {
		t.Fatal(err)
	}
	if slots.Claim(rel, "sb-dead") {
		t.Errorf("Claim of a slot sb-b holds succeeded")
	}
	select {
	case <-sleeper.done:
		t.Fatalf("a Put by the slot's last sandbox killed its new one's process")
	case <-time.After(50 * time.Millisecond):
	}
	if !slots.Claim(rel, "sb-b") {
		t.Errorf("Claim by the holder refused")
	}

	// A slot with a process left is removed, the process killed.
	if err := slots.Put(rel, "sb-b"); err != nil {
		t.Fatalf("Put of a busy slot: %v", err)
	}
	if sig := sleeper.waitSignal(t); sig != syscall.SIGKILL {
		t.Errorf("process in a busy slot ended by %v, want SIGKILL", sig)
	}
	if slots.Free() != 0 {
		t.Errorf("busy slot kept: %v", slots.FreeSlots())
	}
	for _, root := range info.roots() {
		if isDir(filepath.Join(root, rel)) {
			t.Errorf("busy slot %s still exists", filepath.Join(root, rel))
		}
	}

	// A slot with a child cgroup (which a sandbox could only have made
	// by mounting cgroup2) is removed too.
	rel, _ = slots.Get("sb-c")
	mkslot(rel)
	mkslot(rel + "/nested")
	if err := slots.Put(rel, "sb-c"); err != nil {
		t.Fatal(err)
	}
	if info.V2Root != "" && slots.Free() != 0 {
		t.Errorf("slot with a child cgroup kept: %v", slots.FreeSlots())
	}

	// A slot the runtime never created is not kept.
	rel, _ = slots.Get("sb-d")
	if err := slots.Put(rel, "sb-d"); err != nil || slots.Free() != 0 {
		t.Errorf("Put of a never-created slot: %v, free %v", err, slots.FreeSlots())
	}

	// A cgroup named after a sandbox (an older record) is removed.
	old := parent + "/sb-local-old"
	mkslot(old)
	if err := slots.Put(old, "sb-local-old"); err != nil || info.exists(old) {
		t.Errorf("Put(%s) = %v, exists %v; want it removed", old, err, info.exists(old))
	}

	// At most max free slots; the rest are removed.
	_ = slots.Drain()
	var three []string
	for range 3 {
		r, _ := slots.Get(fmt.Sprint("sb-three-", len(three)))
		mkslot(r)
		three = append(three, r)
	}
	for i, r := range three {
		if err := slots.Put(r, fmt.Sprint("sb-three-", i)); err != nil {
			t.Fatal(err)
		}
	}
	if got := slots.FreeSlots(); !slices.Equal(got, three[:2]) {
		t.Errorf("free slots %v, want the first two of %v", got, three)
	}
	if info.exists(three[2]) {
		t.Errorf("%s kept beyond max", three[2])
	}

	// Trim waits for creates to stop, then removes the longest-free.
	if n := slots.Trim(0, 5, time.Hour); n != 0 {
		t.Errorf("Trim right after a Get removed %d", n)
	}
	if n := slots.Trim(1, 5, 0); n != 1 || !slices.Equal(slots.FreeSlots(), three[1:2]) || info.exists(three[0]) {
		t.Errorf("Trim(keep 1) removed %d, left %v (exists %s: %v)", n, slots.FreeSlots(), three[0], info.exists(three[0]))
	}
	if err := slots.Drain(); err != nil || slots.Free() != 0 || info.exists(three[1]) {
		t.Errorf("Drain: %v, left %v", err, slots.FreeSlots())
	}

	// Puts at once keep no more than max either.
	var many []string
	for range 16 {
		r, _ := slots.Get(fmt.Sprint("sb-many-", len(many)))
		mkslot(r)
		many = append(many, r)
	}
	var wg sync.WaitGroup
	for i, r := range many {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := slots.Put(r, fmt.Sprint("sb-many-", i)); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if n := slots.Free(); n != 2 {
		t.Errorf("%d free slots after 16 Puts at once, want max 2", n)
	}
	kept := 0
	for _, r := range many {
		if info.exists(r) {
			kept++
		}
	}
	if kept != 2 {
		t.Errorf("%d of the 16 slots exist after the Puts, want 2", kept)
	}
}

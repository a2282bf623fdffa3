package main

import (
	"strings"
	"testing"

	"github.com/dsecproject/dsec/internal/mountinfo"
)

func TestParseMeminfo(t *testing.T) {
	in := "MemTotal:       24683916 kB\nMemFree:        22667320 kB\nMemAvailable:   23682436 kB\n" +
		"Slab:             241960 kB\nSReclaimable:     157312 kB\nSUnreclaim:        84648 kB\n"
	m, err := parseMeminfo(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	if m != (memInfo{AvailKiB: 23682436, SlabKiB: 241960, SUnreclaimKiB: 84648}) {
		t.Fatalf("got %+v", m)
	}
	if _, err := parseMeminfo(strings.NewReader("MemTotal: 1 kB\nSlab: 2 kB\n")); err == nil {
		t.Fatal("want an error without MemAvailable")
	}
}

func TestParseLoadavgTasks(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int
		ok   bool
	}{
		{"0.52 0.58 0.59 2/345 12345\n", 345, true},
		{"0.52 0.58 0.59 1/40000 1", 40000, true},
		{"0.52 0.58", 0, false},
		{"0.52 0.58 0.59 345 1", 0, false},
	} {
		got, err := parseLoadavgTasks(tc.in)
		if (err == nil) != tc.ok || got != tc.want {
			t.Errorf("parseLoadavgTasks(%q) = %d, %v; want %d, ok=%v", tc.in, got, err, tc.want, tc.ok)
		}
	}
}

func TestParseMetrics(t *testing.T) {
	in := "# HELP process_open_fds Number of open file descriptors.\n# TYPE process_open_fds gauge\n" +
		"process_open_fds 42\nprocess_resident_memory_bytes 2.4117248e+07\n" +
		"dsec_api_requests_total{code=\"200\",route=\"GET /v1/nodes\"} 3\ngo_goroutines 17\n"
	m := parseMetrics(in)
	if m["process_open_fds"] != 42 || m["process_resident_memory_bytes"] != 24117248 || m["go_goroutines"] != 17 {
		t.Fatalf("got %v", m)
	}
	if len(m) != 3 {
		t.Fatalf("labelled samples should be skipped: %v", m)
	}
}

func TestCountMounts(t *testing.T) {
	mi := strings.Join([]string{
		"22 1 254:0 / / rw,relatime - ext4 /dev/vda rw",
		"100 22 0:50 / /var/lib/dsec/edge/mnt/abc ro - erofs /dev/loop0 ro",
		"101 22 0:51 / /var/lib/dsec/edge/sandboxes/sb-1/rootfs rw - overlay overlay rw",
		"102 22 0:52 / /var/lib/dsec/edge/sandboxes/sb-2/rootfs rw - overlay overlay rw",
		"103 22 0:53 / /var/lib/dsec\\040old/x rw - tmpfs tmpfs rw",
		"104 22 0:54 / /var/lib/dsec-other/sb-1 rw - tmpfs tmpfs rw",
	}, "\n")
	total, ours := countMounts(mi, "/var/lib/dsec", map[string]bool{"sb-1": true})
	if total != 3 || ours != 1 {
		t.Fatalf("countMounts = %d, %d; want 3, 1", total, ours)
	}
	total, ours = countMounts(mi, "/var/lib/dsec old/", nil)
	if total != 1 || ours != 0 {
		t.Fatalf("escaped mount point: countMounts = %d, %d; want 1, 0", total, ours)
	}
}

func TestUnescapeMountinfo(t *testing.T) {
	for in, want := range map[string]string{
		`/a\040b`:   "/a b",
		`/plain`:    "/plain",
		`/tab\011x`: "/tab\tx",
		`/end\04`:   `/end\04`,
		`/back\\`:   `/back\\`,
	} {
		if got := mountinfo.Unescape(in); got != want {
			t.Errorf("mountinfo.Unescape(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestPerSandbox(t *testing.T) {
	if got := perSandbox(1000, 400, 3); got != 200 {
		t.Errorf("perSandbox = %v, want 200", got)
	}
	if got := perSandbox(1, 0, 0); got != 0 {
		t.Errorf("perSandbox with n=0 = %v, want 0", got)
	}
}

func TestDensityLimits(t *testing.T) {
	roomy := hostLimits{MaxSandboxes: 4096, Live: 10, PidMax: 4194304, ThreadsMax: 200000, Tasks: 300, MemAvailKiB: 20 << 20}
	for _, tc := range []struct {
		name    string
		check   func() error
		wantErr string // "" = fits
	}{
		{"fits", func() error { return densityPrecheck(1000, roomy) }, ""},
		{"max-sandboxes", func() error {
			l := roomy
			l.MaxSandboxes = 1000
			return densityPrecheck(1000, l)
		}, "--max-sandboxes 1000 (10 live, room for 990)"},
		{"pid_max at one task each", func() error {
			l := roomy
			l.PidMax = 32768
			return densityPrecheck(40000, hostLimits{PidMax: l.PidMax, Tasks: 300})
		}, "kernel.pid_max is 32768"},
		{"pid_max projected", func() error {
			l := roomy
			l.PidMax = 32768
			return densityProject(10000, 500, 4, 100, 500, l)
		}, "4.0 tasks per sandbox measured on the first 500"},
		{"threads-max", func() error {
			l := roomy
			l.ThreadsMax, l.MaxSandboxes = 5000, 0
			return densityPrecheck(4600, l)
		}, "--count 4600 needs about 4600 more tasks (at least one task per sandbox) but kernel.threads-max is 5000"},
		{"memory projected", func() error {
			l := roomy
			l.MemAvailKiB = 1 << 20 // 1 GiB
			return densityProject(10000, 100, 1, 1024, 100, l)
		}, "MemAvailable is 1.0 GiB"},
		{"memory fits", func() error {
			return densityProject(10000, 100, 1, 1024, 100, roomy)
		}, ""},
	} {
		err := tc.check()
		switch {
		case tc.wantErr == "" && err != nil:
			t.Errorf("%s: unexpected error %v", tc.name, err)
		case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
			t.Errorf("%s: error %v, want one containing %q", tc.name, err, tc.wantErr)
		}
	}
}

func TestLeaks(t *testing.T) {
	before := hostSample{sandboxes: 2, mounts: 5, cgroups: 20, metrics: map[string]float64{"process_open_fds": 30}}
	if l := leaks(before, before); len(l) != 0 {
		t.Fatalf("no change should be no leak: %v", l)
	}
	end := before
	end.ourMounts, end.mounts, end.busyCgroups = 1, 6, 10
	end.metrics = map[string]float64{"process_open_fds": 100}
	if l := leaks(before, end); len(l) != 4 {
		t.Fatalf("want 4 leaks, got %v", l)
	}
	// Empty cgroups kept for reuse are not a leak; more than the edge's
	// free slots in every hierarchy are.
	end = before
	end.cgroups, end.hierarchies = 200, 10
	end.metrics = map[string]float64{"process_open_fds": 30, "dsec_cgroup_slots_free": 20}
	if l := leaks(before, end); len(l) != 0 {
		t.Fatalf("empty cgroups counted as a leak: %v", l)
	}
	end.metrics["dsec_cgroup_slots_free"] = 18
	if l := leaks(before, end); len(l) != 1 {
		t.Fatalf("empty cgroups beyond the free slots: %v, want one leak", l)
	}
	// Fewer live sandboxes than before (another client's, ended by a
	// TTL meanwhile) is not a leak; more is.
	end = before
	end.sandboxes = 0
	if l := leaks(before, end); len(l) != 0 {
		t.Fatalf("sandboxes that ended meanwhile counted as a leak: %v", l)
	}
	end.sandboxes = 3
	if l := leaks(before, end); len(l) != 1 {
		t.Fatalf("a sandbox more than before: %v, want one leak", l)
	}
	// The client's own idle connections hold daemon fds: not a leak.
	end = before
	end.metrics = map[string]float64{"process_open_fds": 46}
	end.ownSockets = 16
	if l := leaks(before, end); len(l) != 0 {
		t.Fatalf("client connections counted as a leak: %v", l)
	}
}

func TestLiveSandboxes(t *testing.T) {
	if n := liveSandboxes(map[string]int{"running": 3, "paused": 2, "creating": 1, "stopped": 7, "failed": 1}); n != 6 {
		t.Fatalf("liveSandboxes = %d, want 6", n)
	}
}

func TestMemFloor(t *testing.T) {
	for _, c := range []struct{ avail, want int64 }{
		{24 << 20, 24 << 20 / 10}, // a tenth of 24 GiB
		{4 << 20, 1 << 20},        // at least 1 GiB
		{0, 1 << 20},
	} {
		if got := memFloorKiB(c.avail); got != c.want {
			t.Errorf("memFloorKiB(%d) = %d, want %d", c.avail, got, c.want)
		}
	}
}

func TestParseSlabinfo(t *testing.T) {
	text := `slabinfo - version: 2.1
# name            <active_objs> <num_objs> <objsize> <objperslab> <pagesperslab> : tunables <limit> <batchcount> <sharedfactor> : slabdata <active_slabs> <num_slabs> <sharedavail>
kmalloc-1k          3000   3072   1024   32    8 : tunables    0    0    0 : slabdata     96     96      0
dentry               100    120    192   21    1 : tunables    0    0    0 : slabdata      6      6      0
`
	got, err := parseSlabinfo(text)
	if err != nil || got != 3000*1024+100*192 {
		t.Fatalf("got %d, %v", got, err)
	}
	if _, err := parseSlabinfo("kmalloc-1k x 1 1024 32\n"); err == nil {
		t.Fatal("a malformed line was accepted")
	}
}

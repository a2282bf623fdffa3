package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestSoakWorkload(t *testing.T) {
	// Every 10th cycle is adversarial, the kinds in turn; the others are
	// uses, every other one networked when the node has networking.
	var got []soakKind
	for i := range 70 {
		got = append(got, soakWorkload(i, 10, true))
	}
	for i, k := range got {
		switch {
		case (i+1)%10 == 0:
			want := soakAdversarial[((i+1)/10-1)%len(soakAdversarial)]
			if k != want {
				t.Errorf("cycle %d: %v, want %v", i, k, want)
			}
		case i%2 == 1 && k != soakUseNet, i%2 == 0 && k != soakUse:
			t.Errorf("cycle %d: %v, want a use (networked: %v)", i, k, i%2 == 1)
		}
	}
	// The six kinds take turns: cycles 9, 19, ..., 59, then 69 again.
	want := []soakKind{soakFlood, soakForkBomb, soakDeepTree, soakDiskFill, soakMemHog, soakOpenSession, soakFlood}
	for j, w := range want {
		if k := got[10*j+9]; k != w {
			t.Errorf("adversarial cycle %d: %v, want %v", 10*j+9, k, w)
		}
	}
	for i := range 50 {
		if k := soakWorkload(i, 0, false); k != soakUse {
			t.Fatalf("--adversarial-every 0, no networking: cycle %d is %v", i, k)
		}
		if k := soakWorkload(i, 1, false); k != soakAdversarial[i%len(soakAdversarial)] {
			t.Fatalf("--adversarial-every 1: cycle %d is %v", i, k)
		}
	}
}

func TestSoakSpec(t *testing.T) {
	for _, tc := range []struct {
		k               soakKind
		pids, disk, mem int64
		networked       bool
	}{
		{soakUse, 0, 0, 0, false},
		{soakUseNet, 0, 0, 0, true},
		{soakForkBomb, soakPids, 0, 0, false},
		{soakDiskFill, 0, soakDiskMB, 0, false},
		{soakMemHog, 0, 0, soakMemoryMB, false},
	} {
		s := soakSpec(tc.k, "base/x:1", "l")
		if s.Pids != tc.pids || s.DiskMB != tc.disk || s.MemoryMB != tc.mem || (s.Network != nil) != tc.networked {
			t.Errorf("%v: spec %+v", tc.k, s)
		}
		if s.Labels["bench"] != "l" || s.TTL == 0 || s.Base != "base/x:1" {
			t.Errorf("%v: labels, ttl or base missing: %+v", tc.k, s)
		}
	}
}

// soakBaseline is a reading of a node at rest.
func soakBaseline() soakSample {
	return soakSample{
		host: hostSample{
			sandboxes: 1, mounts: 4, cgroups: 12, busyCgroups: 3, hierarchies: 4, ownSockets: 2,
			metrics: map[string]float64{
				"process_open_fds": 40, "go_goroutines": 60, "process_resident_memory_bytes": 50 << 20,
				"dsec_cgroup_slots_free": 2, "dsec_sessions_open": 0, "dsec_streams_open": 0,
			},
		},
		loops: 1, veths: 0, nftObjects: 0, nftElems: 3, diskBytes: 100 << 20,
	}
}

func failed(checks []soakCheck) []string {
	var out []string
	for _, c := range checks {
		if !c.OK {
			out = append(out, c.Reading)
		}
	}
	return out
}

func withMetrics(s soakSample, kv ...any) soakSample {
	m := map[string]float64{}
	for k, v := range s.host.metrics {
		m[k] = v
	}
	for i := 0; i < len(kv); i += 2 {
		m[kv[i].(string)] = kv[i+1].(float64)
	}
	s.host.metrics = m
	return s
}

func TestSoakCompare(t *testing.T) {
	b := soakBaseline()
	if f := failed(soakCompare(b, b, soakPer{})); len(f) != 0 {
		t.Fatalf("the baseline against itself: %v", f)
	}
	per := soakPer{FDs: 2, Goroutines: 3, RSSBytes: 100 << 10}
	for _, tc := range []struct {
		name  string
		after func(soakSample) soakSample
		want  []string // readings not back; nil = all back
	}{
		{"fewer is back", func(a soakSample) soakSample {
			a.host.sandboxes, a.host.mounts, a.loops, a.nftElems, a.diskBytes = 0, 2, 0, 0, 10<<20
			return withMetrics(a, "process_open_fds", 30.0, "process_resident_memory_bytes", float64(20<<20))
		}, nil},
		{"a live sandbox more", func(a soakSample) soakSample { a.host.sandboxes++; return a }, []string{"live sandboxes on the node"}},
		{"listed", func(a soakSample) soakSample { a.listed = 1; return a }, []string{"soak sandboxes still listed"}},
		{"record", func(a soakSample) soakSample { a.ourRecords = 1; return a }, []string{"records of deleted soak sandboxes"}},
		{"mounts", func(a soakSample) soakSample {
			a.host.ourMounts, a.host.mounts = 1, 5
			return a
		}, []string{"mounts of deleted soak sandboxes", "mounts under the state dir"}},
		{"mounts of held sandboxes are not counted", func(a soakSample) soakSample {
			a.held, a.host.mounts, a.host.heldMounts = 3, 10, 6
			return a
		}, nil},
		{"a held mount fewer than mounts more", func(a soakSample) soakSample {
			a.held, a.host.mounts, a.host.heldMounts = 3, 10, 5
			return a
		}, []string{"mounts under the state dir"}},
		{"busy cgroup", func(a soakSample) soakSample {
			a.host.busyCgroups, a.host.cgroups = 4, 13
			return a
		}, []string{"cgroups holding processes"}},
		{"busy cgroups of held sandboxes", func(a soakSample) soakSample {
			a.host.busyCgroups, a.host.heldBusyCgroups, a.host.cgroups = 7, 4, 16
			return a
		}, nil},
		{"empty cgroups within the free slots", func(a soakSample) soakSample {
			// (free 5 + 1) × 4 hierarchies = 24 idle at most.
			a.host.cgroups = 3 + 24
			return withMetrics(a, "dsec_cgroup_slots_free", 5.0)
		}, nil},
		{"empty cgroups beyond the free slots", func(a soakSample) soakSample {
			a.host.cgroups = 3 + 25
			return withMetrics(a, "dsec_cgroup_slots_free", 5.0)
		}, []string{"empty cgroups (the edge's free slots +1, per hierarchy)"}},
		{"loop, veth, nft, trash", func(a soakSample) soakSample {
			a.loops, a.veths, a.nftObjects, a.nftElems, a.trash = 2, 1, 5, 5, 1
			return a
		}, []string{"loop devices backed under the state dir", "veths of the instance", "nft sets and chains of the instance",
			"nft set and map elements of the instance", "trash entries"}},
		{"fds within the slack", func(a soakSample) soakSample {
			return withMetrics(a, "process_open_fds", 40.0+daemonFDSlack)
		}, nil},
		{"fds beyond the slack", func(a soakSample) soakSample {
			return withMetrics(a, "process_open_fds", 40.0+daemonFDSlack+1)
		}, []string{"daemon fds (not the bench's connections)"}},
		{"fds of the bench's connections", func(a soakSample) soakSample {
			a.host.ownSockets = 32
			return withMetrics(a, "process_open_fds", 70.0, "go_goroutines", 110.0)
		}, nil},
		{"fds and goroutines of 5 sandboxes held more", func(a soakSample) soakSample {
			a.held = 5
			return withMetrics(a, "process_open_fds", 40.0+daemonFDSlack+10, "go_goroutines", 60.0+soakGoroutineSlack+15)
		}, nil},
		{"goroutines beyond the slack", func(a soakSample) soakSample {
			return withMetrics(a, "go_goroutines", 60.0+soakGoroutineSlack+1)
		}, []string{"daemon goroutines"}},
		{"a session left open", func(a soakSample) soakSample {
			return withMetrics(a, "dsec_sessions_open", 1.0, "dsec_streams_open", 1.0)
		}, []string{"daemon sessions open", "daemon streams open"}},
		{"RSS within 32 MiB", func(a soakSample) soakSample {
			return withMetrics(a, "process_resident_memory_bytes", float64(82<<20))
		}, nil},
		{"RSS beyond 32 MiB", func(a soakSample) soakSample {
			return withMetrics(a, "process_resident_memory_bytes", float64(83<<20))
		}, []string{"daemon RSS"}},
		{"disk within 64 MiB", func(a soakSample) soakSample { a.diskBytes += 64 << 20; return a }, nil},
		{"disk beyond 64 MiB", func(a soakSample) soakSample { a.diskBytes += 65 << 20; return a }, []string{"state dir usage (outside held sandboxes)"}},
	} {
		got := failed(soakCompare(b, tc.after(b), per))
		if strings.Join(got, "|") != strings.Join(tc.want, "|") {
			t.Errorf("%s: not back %q, want %q", tc.name, got, tc.want)
		}
	}

	// Above 160 MiB of RSS the slack is 20%, above 640 MiB of disk 10%.
	big := withMetrics(b, "process_resident_memory_bytes", float64(500<<20))
	big.diskBytes = 1 << 30
	for _, tc := range []struct {
		rss, disk int64
		want      []string
	}{
		{600 << 20, (1 << 30) + 102<<20, nil},
		{601 << 20, (1 << 30) + 102<<20, []string{"daemon RSS"}},
		{600 << 20, (1 << 30) + 103<<20, []string{"state dir usage (outside held sandboxes)"}},
	} {
		a := withMetrics(big, "process_resident_memory_bytes", float64(tc.rss))
		a.diskBytes = tc.disk
		if got := failed(soakCompare(big, a, soakPer{})); strings.Join(got, "|") != strings.Join(tc.want, "|") {
			t.Errorf("rss %d MiB, disk +%d MiB: not back %q, want %q", tc.rss>>20, (tc.disk-1<<30)>>20, got, tc.want)
		}
	}

	// Without /metrics the daemon's readings are left out.
	nm := b
	nm.host.metrics = nil
	for _, c := range soakCompare(nm, nm, soakPer{}) {
		if strings.HasPrefix(c.Reading, "daemon") || strings.HasPrefix(c.Reading, "empty cgroups") {
			t.Errorf("without metrics: %s compared", c.Reading)
		}
	}
}

func TestPerHeld(t *testing.T) {
	gone := withMetrics(soakBaseline())
	gone.held = 2
	alive := withMetrics(gone, "process_open_fds", 40.0+3*20, "go_goroutines", 60.0+4*20, "process_resident_memory_bytes", float64(50<<20+20*(200<<10)))
	alive.held = 6 // the pool refilled 4 meanwhile: 16 of the bench's + 4 = 20 more
	p := perHeld(alive, gone, 16)
	if p.FDs != 3 || p.Goroutines != 4 || p.RSSBytes != 200<<10 {
		t.Fatalf("perHeld = %+v", p)
	}
	if p := perHeld(gone, gone, 0); p != (soakPer{}) {
		t.Fatalf("no difference: %+v", p)
	}
	down := withMetrics(gone, "process_open_fds", 30.0)
	if p := perHeld(down, gone, 4); p.FDs != 0 {
		t.Fatalf("fewer fds with more sandboxes should cost nothing: %+v", p)
	}
}

func TestParseNftTable(t *testing.T) {
	js := `{"nftables": [{"metainfo": {"version": "1.0.6", "json_schema_version": 1}},
{"table": {"family": "inet", "name": "dsec_abcde", "handle": 3}},
{"set": {"family": "inet", "name": "protected", "table": "dsec_abcde", "type": "ipv4_addr", "handle": 1, "flags": ["interval"],
  "elem": [{"prefix": {"addr": "10.0.0.0", "len": 8}}, {"prefix": {"addr": "169.254.0.0", "len": 16}}]}},
{"map": {"family": "inet", "name": "egress", "table": "dsec_abcde", "type": "ifname", "map": "verdict", "handle": 2,
  "elem": [["dsabcde00001", {"goto": {"target": "e_1"}}], ["dsabcde0000a", {"goto": {"target": "e_10"}}]]}},
{"map": {"family": "inet", "name": "ingress", "table": "dsec_abcde", "type": "ifname", "map": "verdict", "handle": 3,
  "elem": [["dsabcde00001", {"goto": {"target": "i_1"}}], ["dsabcde0000a", {"goto": {"target": "i_10"}}]]}},
{"chain": {"family": "inet", "table": "dsec_abcde", "name": "forward", "handle": 4, "type": "filter", "hook": "forward", "prio": -5, "policy": "accept"}},
{"chain": {"family": "inet", "table": "dsec_abcde", "name": "e_1", "handle": 10}},
{"chain": {"family": "inet", "table": "dsec_abcde", "name": "i_1", "handle": 11}},
{"chain": {"family": "inet", "table": "dsec_abcde", "name": "e_10", "handle": 12}},
{"chain": {"family": "inet", "table": "dsec_abcde", "name": "i_10", "handle": 13}},
{"set": {"family": "inet", "name": "a_1", "table": "dsec_abcde", "type": ["ipv4_addr", "inet_proto", "inet_service"], "handle": 5,
  "elem": [{"elem": {"val": {"concat": ["192.0.2.1", "tcp", 443]}, "timeout": 600}}]}},
{"set": {"family": "inet", "name": "p_1", "table": "dsec_abcde", "type": ["ipv4_addr", "inet_proto", "inet_service"], "handle": 6}},
{"set": {"family": "inet", "name": "d_1", "table": "dsec_abcde", "type": ["ipv4_addr", "inet_proto", "inet_service"], "handle": 7}},
{"set": {"family": "inet", "name": "a_10", "table": "dsec_abcde", "type": ["ipv4_addr", "inet_proto", "inet_service"], "handle": 8,
  "elem": [{"concat": ["192.0.2.1", "tcp", {"range": [0, 65535]}]}]}},
{"rule": {"family": "inet", "table": "dsec_abcde", "chain": "e_1", "handle": 20, "expr": []}}
]}`
	// Nothing held: slot 1 (5 objects) and slot 10 (3) count, elements
	// 2 protected + 2 + 2 in the maps + 1 + 1 in a_1 and a_10.
	objs, elems, err := parseNftTable([]byte(js), "dsabcde", nil)
	if err != nil || objs != 8 || elems != 8 {
		t.Fatalf("nothing held: %d objects, %d elements, %v; want 8, 8", objs, elems, err)
	}
	// Slot 10 held by a live sandbox: only slot 1's and the shared ones.
	objs, elems, err = parseNftTable([]byte(js), "dsabcde", map[int]bool{10: true})
	if err != nil || objs != 5 || elems != 5 {
		t.Fatalf("slot 10 held: %d objects, %d elements, %v; want 5, 5", objs, elems, err)
	}
	if _, _, err := parseNftTable([]byte("not json"), "dsabcde", nil); err == nil {
		t.Fatal("bad JSON accepted")
	}
}

func TestVethSlotAndLoops(t *testing.T) {
	for name, want := range map[string]int{"dsabcde00001": 1, "dsabcde0000a": 10, "dsabcde00100": 256} {
		if got, ok := vethSlot(name, "dsabcde"); !ok || got != want {
			t.Errorf("vethSlot(%q) = %d, %v; want %d", name, got, ok, want)
		}
	}
	for _, name := range []string{"eth0", "dsabcde", "dsabcdeXYZ", "dsfffff00001"} {
		if _, ok := vethSlot(name, "dsabcde"); ok {
			t.Errorf("vethSlot(%q) took it for one of the instance's", name)
		}
	}
	held := map[string]bool{"sb-held": true}
	for backing, want := range map[string]bool{
		"/var/lib/dsec/edge/sandboxes/sb-gone/disk.img":           true,
		"/var/lib/dsec/edge/sandboxes/sb-gone/disk.img (deleted)": true,
		"/var/lib/dsec/edge/trash/sb-gone.3/disk.img":             true,
		"/var/lib/dsec/layers/blobs/sha256/ab.erofs":              true,
		"/var/lib/dsec/edge/sandboxes/sb-held/disk.img":           false,
		"/var/lib/dsec-other/edge/sandboxes/x/disk.img":           false,
		"/home/x/disk.img": false,
	} {
		if got := loopUnder(backing, "/var/lib/dsec", held); got != want {
			t.Errorf("loopUnder(%q) = %v, want %v", backing, got, want)
		}
	}
}

func TestSoakRecordsAndDisk(t *testing.T) {
	dir := t.TempDir()
	sbs := filepath.Join(dir, "edge", "sandboxes")
	write := func(p, s string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(filepath.Join(sbs, "sb-a", "sandbox.json"), `{"version":1,"sandbox":{"id":"sb-a","state":"running"},"cgroup_path":"/dsec/n-1/s-7","pooled":true,"net":{"slot":3}}`)
	write(filepath.Join(sbs, "sb-b", "sandbox.json"), `{"version":1,"sandbox":{"id":"sb-b","state":"running"},"cgroup_path":"/dsec/n-1/sb-b"}`)
	write(filepath.Join(sbs, "sb-c", "sandbox.json.tmp"), `{}`) // being written
	write(filepath.Join(sbs, "sb-b", "upper", "big"), strings.Repeat("x", 1<<20))
	write(filepath.Join(dir, "store", "db"), strings.Repeat("y", 256<<10))
	recs, err := readSoakRecords(sbs)
	if err != nil || len(recs) != 2 {
		t.Fatalf("records %+v, %v; want 2", recs, err)
	}
	for _, r := range recs {
		switch r.Sandbox.ID {
		case "sb-a":
			if r.CgroupPath != "/dsec/n-1/s-7" || r.Net == nil || r.Net.Slot != 3 {
				t.Errorf("sb-a: %+v", r)
			}
		case "sb-b":
			if r.Net != nil {
				t.Errorf("sb-b has no veth: %+v", r)
			}
		}
	}
	all, by := diskUsage(dir, nil)
	skipped, _ := diskUsage(dir, map[string]bool{filepath.Join(sbs, "sb-b"): true})
	if all-skipped < 1<<20 {
		t.Errorf("skipping sb-b saved %d bytes, want its 1 MiB at least", all-skipped)
	}
	if by["store/db"] < 256<<10 || by["edge/sandboxes"] < 1<<20 {
		t.Errorf("by directory: %v", by)
	}
	if g := diskGrowth(map[string]int64{"a": 10, "b": 10}, map[string]int64{"a": 5, "b": 30, "c": 1}); len(g) != 2 || g["b"] != 20 || g["c"] != 1 {
		t.Errorf("diskGrowth = %v", g)
	}
}

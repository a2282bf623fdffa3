package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	dsec "github.com/dsecproject/dsec/sdk/go"
)

// The readings of `bench soak`. A node holds sandboxes that are not the
// soak's while it runs, and their number changes: the warm pools refill
// and drain as demand comes and goes, another client may create some. So
// every count leaves out what the sandboxes the node holds at the reading
// hold — found through their records in the state dir: their ids (a path
// element of their mounts and disk images), cgroups and veth slots — and
// what is left is what no sandbox holds, which must be back to the
// baseline. The soak's own deleted sandboxes are never left out.

// soakSample is one reading.
type soakSample struct {
	// host is density's reading, with the held sandboxes' mounts and
	// busy cgroups counted apart.
	host hostSample
	// held are the sandboxes the node holds that are not the soak's.
	held int
	// ourRecords are records of the soak's sandboxes still in the state
	// dir; listed those the API still lists (filled by back).
	ourRecords, listed int
	loops              int // loop devices backed by a file under the state dir
	veths              int // host-side veths of the instance
	nftObjects         int // per-slot sets and chains in the instance's table
	nftElems           int // elements of the table's sets and maps
	trash              int // entries of the edge's trash
	// diskBytes is the state dir's usage (mounts not crossed) outside the
	// held sandboxes' directories, diskByDir the same by directory.
	diskBytes int64
	diskByDir map[string]int64
	err       error
}

// soakProbe reads the host around one daemon.
type soakProbe struct {
	c        *dsec.Client
	stateDir string // absolute
	edgeDir  string
	parent   string // the daemon's parent cgroup
	instance string // names its nftables table and veths

	mu   sync.Mutex
	ours map[string]bool // every sandbox the soak made
}

func (p *soakProbe) addOurs(id string) {
	p.mu.Lock()
	p.ours[id] = true
	p.mu.Unlock()
}

// soakRecord is the part of an edge's sandbox record (sandbox.json) the
// soak reads.
type soakRecord struct {
	Sandbox struct {
		ID string `json:"id"`
	} `json:"sandbox"`
	CgroupPath string `json:"cgroup_path"`
	Net        *struct {
		Slot int `json:"slot"`
	} `json:"net"`
}

// readSoakRecords reads the records under dir (<edge>/sandboxes), skipping
// those being written or removed.
func readSoakRecords(dir string) ([]soakRecord, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var out []soakRecord
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join(dir, e.Name(), "sandbox.json"))
		if err != nil {
			continue
		}
		var r soakRecord
		if json.Unmarshal(b, &r) != nil || r.Sandbox.ID == "" {
			continue
		}
		out = append(out, r)
	}
	return out, nil
}

// read takes one reading.
func (p *soakProbe) read(ctx context.Context) soakSample {
	var s soakSample
	recs, err := readSoakRecords(filepath.Join(p.edgeDir, "sandboxes"))
	if err != nil {
		s.err = fmt.Errorf("reading the sandbox records: %w", err)
	}
	p.mu.Lock()
	ours := maps.Clone(p.ours)
	p.mu.Unlock()
	held := heldSet{ids: map[string]bool{}, cgroups: map[string]bool{}}
	slots := map[int]bool{}
	skip := map[string]bool{}
	for _, r := range recs {
		id := r.Sandbox.ID
		if ours[id] {
			s.ourRecords++
			continue
		}
		s.held++
		held.ids[id] = true
		skip[filepath.Join(p.edgeDir, "sandboxes", id)] = true
		if r.CgroupPath != "" {
			held.cgroups[path.Base(r.CgroupPath)] = true
		}
		if r.Net != nil {
			slots[r.Net.Slot] = true
		}
	}
	s.host = sampleHost(ctx, p.c, p.stateDir, p.parent, ours, held)
	if s.host.sampleError != nil && s.err == nil {
		s.err = s.host.sampleError
	}
	s.loops = countLoops(p.stateDir, held.ids)
	s.veths = countVeths("ds"+p.instance, slots)
	if s.nftObjects, s.nftElems, err = countNft(ctx, "dsec_"+p.instance, "ds"+p.instance, slots); err != nil && s.err == nil {
		s.err = err
	}
	if ents, err := os.ReadDir(filepath.Join(p.edgeDir, "trash")); err == nil {
		s.trash = len(ents)
	}
	s.diskBytes, s.diskByDir = diskUsage(p.stateDir, skip)
	return s
}

// settled takes readings until two in a row agree and the trash is empty,
// or soakSettleMax has passed, and returns the last one.
func (p *soakProbe) settled(ctx context.Context) (soakSample, error) {
	deadline := time.Now().Add(soakSettleMax)
	prev := p.read(ctx)
	for {
		if err := sleepCtx(ctx, soakSettlePoll); err != nil {
			return prev, err
		}
		cur := p.read(ctx)
		if (sameCounts(prev, cur) && cur.trash == 0) || time.Now().After(deadline) {
			return cur, nil
		}
		prev = cur
	}
}

// back takes readings until every one is back to the baseline or
// soakSettleMax has passed, and returns the last one with its comparison.
func (p *soakProbe) back(ctx context.Context, before soakSample, per soakPer, label string) (soakSample, []soakCheck) {
	deadline := time.Now().Add(soakSettleMax)
	for {
		cur := p.read(ctx)
		if left, err := p.c.ListAllSandboxes(ctx, dsec.ListOptions{Labels: map[string]string{"bench": label}}); err == nil {
			cur.listed = len(left)
		}
		checks := soakCompare(before, cur, per)
		ok := true
		for _, c := range checks {
			ok = ok && c.OK
		}
		if ok || time.Now().After(deadline) || sleepCtx(ctx, soakSettlePoll) != nil {
			return cur, checks
		}
	}
}

// sameCounts reports whether two readings agree on every count (the
// daemon's RSS and the disk usage move on their own).
func sameCounts(a, b soakSample) bool {
	fa, _ := daemonFDs(a.host)
	fb, _ := daemonFDs(b.host)
	return a.held == b.held && a.host.mounts == b.host.mounts && a.host.busyCgroups == b.host.busyCgroups &&
		a.host.cgroups == b.host.cgroups && a.loops == b.loops && a.veths == b.veths &&
		a.nftObjects == b.nftObjects && a.nftElems == b.nftElems && a.trash == b.trash && fa == fb
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}

// countLoops counts the loop devices whose backing file is under dir
// (layer blobs, sandbox disks; also those whose file is deleted), leaving
// out the disks of the held sandboxes.
func countLoops(dir string, held map[string]bool) int {
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	n := 0
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		if loopUnder(strings.TrimSpace(string(b)), dir, held) {
			n++
		}
	}
	return n
}

// loopUnder reports whether a loop device's backing file is under dir
// and not in the directory of a held sandbox.
func loopUnder(backing, dir string, held map[string]bool) bool {
	prefix := strings.TrimSuffix(dir, "/") + "/"
	if !strings.HasPrefix(backing, prefix) {
		return false
	}
	for _, el := range strings.Split(backing[len(prefix):], "/") {
		if held[el] {
			return false
		}
	}
	return true
}

// countVeths counts the host's interfaces named with prefix (the
// instance's host-side veths) but those of the held slots.
func countVeths(prefix string, slots map[int]bool) int {
	ents, _ := os.ReadDir("/sys/class/net")
	n := 0
	for _, e := range ents {
		if slot, ok := vethSlot(e.Name(), prefix); ok && !slots[slot] {
			n++
		}
	}
	return n
}

// vethSlot parses a host-side veth name, prefix then the slot in hex
// (netpolicy's layout.hostIf).
func vethSlot(name, prefix string) (int, bool) {
	rest, ok := strings.CutPrefix(name, prefix)
	if !ok || rest == "" {
		return 0, false
	}
	n, err := strconv.ParseInt(rest, 16, 32)
	if err != nil {
		return 0, false
	}
	return int(n), true
}

// countNft lists the instance's table and counts its per-slot sets and
// chains (a_N, p_N, d_N, e_N, i_N) and the elements of its sets and maps,
// leaving out those of the held slots. A missing table (no networking)
// counts 0.
func countNft(ctx context.Context, table, ifPrefix string, slots map[int]bool) (objects, elems int, err error) {
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, "nft", "-j", "list", "table", "inet", table).Output()
	if err != nil {
		var ee *exec.ExitError
		if _, lerr := exec.LookPath("nft"); lerr != nil || (errors.As(err, &ee) && strings.Contains(string(ee.Stderr), "No such file")) {
			return 0, 0, nil
		}
		return 0, 0, fmt.Errorf("listing nftables table %s: %w", table, err)
	}
	return parseNftTable(out, ifPrefix, slots)
}

// parseNftTable counts in the JSON listing of a table (nft -j) the
// per-slot sets and chains and the set and map elements, leaving out
// those of the held slots: sets and chains named x_N, map elements keyed
// by the veth of slot N.
func parseNftTable(js []byte, ifPrefix string, slots map[int]bool) (objects, elems int, err error) {
	var doc struct {
		Nftables []map[string]json.RawMessage `json:"nftables"`
	}
	if err := json.Unmarshal(js, &doc); err != nil {
		return 0, 0, fmt.Errorf("parsing nft -j: %w", err)
	}
	for _, obj := range doc.Nftables {
		for kind, raw := range obj {
			if kind != "set" && kind != "map" && kind != "chain" {
				continue
			}
			var o struct {
				Name string            `json:"name"`
				Elem []json.RawMessage `json:"elem"`
			}
			if json.Unmarshal(raw, &o) != nil {
				continue
			}
			slot, perSlot := nftSlot(o.Name)
			if perSlot && slots[slot] {
				continue
			}
			if perSlot {
				objects++
			}
			if kind == "chain" {
				continue
			}
			for _, e := range o.Elem {
				if kind == "map" {
					// [key, verdict]; the key is the veth's name.
					var kv []json.RawMessage
					var key string
					if json.Unmarshal(e, &kv) == nil && len(kv) == 2 && json.Unmarshal(kv[0], &key) == nil {
						if s, ok := vethSlot(key, ifPrefix); ok && slots[s] {
							continue
						}
					}
				}
				elems++
			}
		}
	}
	return objects, elems, nil
}

// nftSlot parses a per-slot object name (a_12 → 12).
func nftSlot(name string) (int, bool) {
	if len(name) < 3 || name[1] != '_' {
		return 0, false
	}
	n, err := strconv.Atoi(name[2:])
	return n, err == nil
}

// diskUsage sums the space the files under root take (st_blocks) on
// root's filesystem, skipping the directories in skip and other
// filesystems (the layers' and sandboxes' mounts), in total and by
// directory (two levels deep: "edge/trash", "store").
func diskUsage(root string, skip map[string]bool) (int64, map[string]int64) {
	var rootDev uint64
	if fi, err := os.Lstat(root); err == nil {
		if st, ok := fi.Sys().(*syscall.Stat_t); ok {
			rootDev = uint64(st.Dev)
		}
	}
	var total int64
	by := map[string]int64{}
	_ = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil // gone meanwhile, or beyond PATH_MAX: not counted
		}
		if d.IsDir() && skip[p] {
			return filepath.SkipDir
		}
		fi, err := d.Info()
		if err != nil {
			return nil
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok {
			return nil
		}
		if uint64(st.Dev) != rootDev {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		n := st.Blocks * 512
		total += n
		rel, _ := filepath.Rel(root, p)
		if rel != "." {
			parts := strings.SplitN(rel, string(filepath.Separator), 3)
			by[strings.Join(parts[:min(len(parts), 2)], "/")] += n
		}
		return nil
	})
	return total, by
}

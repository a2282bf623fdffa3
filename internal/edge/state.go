package edge

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/files"
	"github.com/dsecproject/dsec/internal/netpolicy"
)

// recordVersion is bumped when record changes incompatibly.
const recordVersion = 1

// record is what the edge persists per sandbox (sandbox.json).
type record struct {
	Version int         `json:"version"`
	Sandbox api.Sandbox `json:"sandbox"`
	Digests []string    `json:"digests"` // layer digests, bottom first
	// Below is CreateRequest.Below: how many of Digests are base (with
	// its lowers), workspace and toolkits (0: edgeapi.StackBelow's count).
	Below      int    `json:"below,omitempty"`
	CgroupPath string `json:"cgroup_path"`
	// CgroupCPUBase is the CPU time (ns) the cgroup had counted before
	// this sandbox got it: a recycled cgroup's counter cannot be reset on
	// cgroup v2, so stats subtract it.
	CgroupCPUBase uint64 `json:"cgroup_cpu_base,omitempty"`
	// Disk is set when the writable layer is on the sandbox's own disk
	// (disk_mb > 0; see disk.go).
	Disk bool `json:"disk,omitempty"`
	// ProjectPath is the path of the sandbox's project in the project
	// tree (edgeapi/scope.go); empty: the root's.
	ProjectPath string `json:"project_path,omitempty"`
	// Dedicated is CreateRequest.Dedicated (tenancy.go).
	Dedicated string `json:"dedicated,omitempty"`
	// Pooled is set while the sandbox waits in a warm pool (pool.go).
	Pooled bool `json:"pooled,omitempty"`
	// Token is the create's CreateRequest.Token (tokens.go).
	Token string `json:"token,omitempty"`
	// UserNS is set for a sandbox in a user namespace (userns.go).
	UserNS bool `json:"userns,omitempty"`
	// UserNSOwner is the host uid that made its user namespace (userns.go;
	// 0 for sandboxes of an older edge, whose runtime made it as root).
	UserNSOwner uint32 `json:"userns_owner,omitempty"`
	// UserNSHost is the first host ID of the sandbox's own ID range
	// (userns.go); 0: the node's shared range at Config.UserNSBase.
	UserNSHost uint32 `json:"userns_host,omitempty"`
	// PrivateRootfs is set when the overlay is mounted only inside the
	// sandbox's mount namespace (sandbox.Config.RootfsMount), not on the
	// host at <dir>/rootfs: it goes away with the sandbox's processes, and
	// the files API reaches it through /proc/<init>/root.
	PrivateRootfs bool `json:"private_rootfs,omitempty"`
	// Images is set when the backend took the layer images and made the
	// rootfs itself (sandbox.LayerImages): nothing of it is mounted on the
	// host, and the host has no view of its files.
	Images bool `json:"images,omitempty"`
	// Net is the sandbox's veth slot, once its policy let something out.
	Net *netpolicy.Attachment `json:"net,omitempty"`
	// DefaultUser is the identity of the spec's user, resolved against the
	// sandbox's /etc/passwd by the first exec or session that runs as it
	// (before anything of the agent's has run) and kept: an agent that
	// later replaces /etc/passwd (a FIFO, a symlink, another uid) changes
	// nothing for the default user.
	DefaultUser *userRecord `json:"default_user,omitempty"`
	// StoppedAt is when the sandbox stopped; its record is removed
	// StoppedRetention later.
	StoppedAt *time.Time `json:"stopped_at,omitempty"`
}

// sbx is one sandbox in memory.
type sbx struct {
	dir string
	// active is the time of the last request (kept out of mu: every call
	// touches it).
	active clock

	// life serialises the transitions that release the sandbox's
	// resources (stop by the reaper, delete); it is held across them.
	life sync.Mutex

	mu   sync.Mutex
	rec  record
	root *files.Root // opened lazily on the rootfs
	// releaseImages gives back the layer images a LayerImages backend
	// holds (record.Images); nil otherwise.
	releaseImages func()
	sessions      map[string]*session
	// procs are the sandbox's processes by pid (process.go); procSeq
	// numbers those whose pid could not be read.
	procs   map[int]*mproc
	procSeq int
	// opening counts sessions being started, which count against
	// MaxSessions with those open.
	opening int
	// going is set while the sandbox is being stopped or deleted: new
	// operations are refused.
	going bool
	// pooled is set while the sandbox waits in a warm pool: it is then
	// invisible to the API.
	pooled bool
	// diskResumed is when a sandbox the disk guard paused was last
	// resumed (diskguard.go): it is given a moment to clean up.
	diskResumed time.Time
	// ops counts operations in flight (see Edge.begin).
	ops int
	// watches counts the directory watches running (WatchDir).
	watches int
	// listed is set while the sandbox is in e.sandboxes; share is what it
	// adds to the node's counts (tally.go).
	listed bool
	share  share
	// indexed are the labels s is indexed under (labelindex.go).
	indexed []label

	// netMu serialises network policy changes.
	netMu sync.Mutex

	// logMu serialises the command log (cmdlog.go): a seq is assigned and
	// its line appended under it, so seqs are gap-free in file order. It is
	// never held together with mu.
	logMu sync.Mutex
	log   cmdLog
}

func (s *sbx) touch() { s.active.set(time.Now()) }

func (s *sbx) view() api.Sandbox {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.viewLocked()
}

func (s *sbx) viewLocked() api.Sandbox {
	v := s.rec.Sandbox
	if t := s.active.get(); !t.IsZero() && t.Unix() > 0 {
		t = t.UTC()
		v.LastActiveAt = &t
	}
	return v
}

// persistLocked writes the record atomically.
// Preconditions: s.mu held.
func (s *sbx) persistLocked() error {
	return writeRecordSync(s.dir, &s.rec, true)
}

// persistClaimLocked persists a pool claim without fsync: the rename is
// atomic, so a daemon crash keeps the claim; a host crash within the
// kernel's writeback delay may leave the record saying "pooled", and the
// next start deletes the sandbox, as it would any pooled one. Its processes
// and unsynced writes are gone after a host crash anyway. The fsync was
// most of a claim's time (1-5 ms while the pool refills beside it).
func (s *sbx) persistClaimLocked() error {
	return writeRecordSync(s.dir, &s.rec, false)
}

func writeRecord(dir string, rec *record) error { return writeRecordSync(dir, rec, true) }

func writeRecordSync(dir string, rec *record, durable bool) error {
	rec.Version = recordVersion
	data, err := json.Marshal(rec)
	if err != nil {
		return fmt.Errorf("encoding sandbox record: %w", err)
	}
	tmp := filepath.Join(dir, "."+recordFile+".tmp")
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("writing sandbox record: %w", err)
	}
	_, err = f.Write(data)
	if err == nil && durable {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, filepath.Join(dir, recordFile))
	}
	if err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("writing sandbox record: %w", err)
	}
	return nil
}

func readRecord(dir string) (*record, error) {
	data, err := os.ReadFile(filepath.Join(dir, recordFile))
	if err != nil {
		return nil, err
	}
	var rec record
	if err := json.Unmarshal(data, &rec); err != nil {
		return nil, fmt.Errorf("decoding %s: %w", filepath.Join(dir, recordFile), err)
	}
	if rec.Version != recordVersion {
		return nil, fmt.Errorf("sandbox record version %d, want %d", rec.Version, recordVersion)
	}
	return &rec, nil
}

func (s *sbx) closeSessions() {
	s.mu.Lock()
	ss := s.sessions
	s.sessions = nil
	s.mu.Unlock()
	for _, se := range ss {
		se.close()
	}
}

package quota

import (
	"errors"
	"math"
	"strconv"
	"testing"
	"unsafe"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/mountinfo"
)

func TestParseMode(t *testing.T) {
	tests := []struct {
		in      string
		want    Mode
		wantErr bool
	}{
		{"direct", ModeDirect, false},
		{"loop", ModeLoop, false},
		{" loop\n", ModeLoop, false},
		{"", "", true},
		{"Loop", "", true},
		{"off", "", true},
	}
	for _, tt := range tests {
		got, err := ParseMode(tt.in)
		if (err != nil) != tt.wantErr || got != tt.want {
			t.Errorf("ParseMode(%q) = %q, %v; want %q, err %v", tt.in, got, err, tt.want, tt.wantErr)
		}
		if err != nil && !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("ParseMode(%q) error %v is not classified invalid", tt.in, err)
		}
	}
}

func TestParseSize(t *testing.T) {
	tests := []struct {
		in      string
		want    uint64
		wantErr bool
	}{
		{"0", 0, false},
		{"4096", 4096, false},
		{"512b", 512, false},
		{"1k", 1 << 10, false},
		{"10M", 10 << 20, false},
		{"10mb", 10 << 20, false},
		{"512MiB", 512 << 20, false},
		{"64G", 64 << 30, false},
		{"64 GiB", 64 << 30, false},
		{"2t", 2 << 40, false},
		{"16383P", 16383 << 50, false},
		{"16384P", 0, true}, // 2^64
		{"18446744073709551615", math.MaxUint64, false},
		{"18446744073709551616", 0, true},
		{"", 0, true},
		{"G", 0, true},
		{"-1G", 0, true},
		{"1.5G", 0, true},
		{"10x", 0, true},
		{"10 g b", 0, true},
	}
	for _, tt := range tests {
		got, err := ParseSize(tt.in)
		if (err != nil) != tt.wantErr || got != tt.want {
			t.Errorf("ParseSize(%q) = %d, %v; want %d, err %v", tt.in, got, err, tt.want, tt.wantErr)
		}
		if err != nil && !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("ParseSize(%q) error %v is not classified invalid", tt.in, err)
		}
	}
}

func TestOptionsValidate(t *testing.T) {
	tests := []struct {
		name    string
		o       Options
		wantErr bool
	}{
		{"direct", Options{Dir: "/var/lib/dsec/upper", Mode: ModeDirect}, false},
		{"direct ignores image", Options{Dir: "/d", Mode: ModeDirect, Image: "rel", ImageSize: 1}, false},
		{"loop", Options{Dir: "/s/edge/data", Mode: ModeLoop, Image: "/s/edge/data.xfs", ImageSize: 64 << 30}, false},
		{"loop sibling with shared prefix", Options{Dir: "/s/data", Mode: ModeLoop, Image: "/s/data.xfs", ImageSize: MinImageSize}, false},
		{"relative dir", Options{Dir: "data", Mode: ModeDirect}, true},
		{"empty dir", Options{Mode: ModeDirect}, true},
		{"no mode", Options{Dir: "/d"}, true},
		{"unknown mode", Options{Dir: "/d", Mode: "lvm"}, true},
		{"loop without image", Options{Dir: "/d", Mode: ModeLoop, ImageSize: 64 << 30}, true},
		{"loop relative image", Options{Dir: "/d", Mode: ModeLoop, Image: "d.xfs", ImageSize: 64 << 30}, true},
		{"image under dir", Options{Dir: "/d", Mode: ModeLoop, Image: "/d/x/../data.xfs", ImageSize: 64 << 30}, true},
		{"image is dir", Options{Dir: "/d/", Mode: ModeLoop, Image: "/d", ImageSize: 64 << 30}, true},
		{"root dir", Options{Dir: "/", Mode: ModeLoop, Image: "/d.xfs", ImageSize: 64 << 30}, true},
		{"image too small", Options{Dir: "/d", Mode: ModeLoop, Image: "/d.xfs", ImageSize: MinImageSize - 1}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.o.Validate()
			if (err != nil) != tt.wantErr {
				t.Fatalf("Validate() = %v, wantErr %v", err, tt.wantErr)
			}
			if err != nil && !errors.Is(err, errdefs.ErrInvalid) {
				t.Fatalf("error %v is not classified invalid", err)
			}
		})
	}
}

func TestBasicBlocks(t *testing.T) {
	tests := []struct{ bytes, bb uint64 }{
		{0, 0},
		{1, 1},
		{511, 1},
		{512, 1},
		{513, 2},
		{8 << 20, 16384},
		{math.MaxUint64, 1 << 55}, // rounds up without wrapping
	}
	for _, tt := range tests {
		if got := basicBlocks(tt.bytes); got != tt.bb {
			t.Errorf("basicBlocks(%d) = %d, want %d", tt.bytes, got, tt.bb)
		}
	}
	back := []struct{ bb, bytes uint64 }{
		{0, 0},
		{1, 512},
		{16384, 8 << 20},
		{1<<55 - 1, math.MaxUint64 - 511},
		{1 << 55, math.MaxUint64}, // saturates
		{math.MaxUint64, math.MaxUint64},
	}
	for _, tt := range back {
		if got := bytesOf(tt.bb); got != tt.bytes {
			t.Errorf("bytesOf(%d) = %d, want %d", tt.bb, got, tt.bytes)
		}
	}
}

func TestProjectID(t *testing.T) {
	// Pinned: an edge derives IDs again after a restart, so changing the
	// hash would orphan the quota of every existing sandbox.
	pinned := []struct {
		id      string
		attempt int
		want    uint32
	}{
		{"", 0, 383008011},
		{"", 1, 1227971042},
		{"sb-1", 0, 1239914024},
		{"sb-1", 1, 1818412913},
		{"sb-2", 0, 704092993},
		{"sb-2", 1, 207798872},
		{"01JABCDEF0123456789", 0, 49362078},
		{"01JABCDEF0123456789", 1, 557122957},
	}
	for _, tt := range pinned {
		if got := ProjectIDAttempt(tt.id, tt.attempt); got != tt.want {
			t.Errorf("ProjectIDAttempt(%q, %d) = %d, want %d", tt.id, tt.attempt, got, tt.want)
		}
	}
	seen := map[uint32]bool{}
	const n = 10000
	for i := range n {
		id := "sandbox-" + strconv.Itoa(i)
		p := ProjectID(id)
		if p < MinDerivedID || p > MaxDerivedID {
			t.Fatalf("ProjectID(%q) = %d, outside [%d, %d]", id, p, MinDerivedID, MaxDerivedID)
		}
		if p != ProjectIDAttempt(id, 0) {
			t.Fatalf("ProjectID(%q) != ProjectIDAttempt(%q, 0)", id, id)
		}
		if q := ProjectIDAttempt(id, 1); q == p || q < MinDerivedID || q > MaxDerivedID {
			t.Fatalf("ProjectIDAttempt(%q, 1) = %d (attempt 0: %d)", id, q, p)
		}
		seen[p] = true
	}
	// Expected collisions among 10000 uniform draws from 2^31 IDs: 0.02.
	if len(seen) < n-2 {
		t.Fatalf("only %d distinct IDs for %d sandboxes", len(seen), n)
	}
}

func TestContainingMount(t *testing.T) {
	entries := []mountinfo.Entry{
		{ID: 1, MountPoint: "/"},
		{ID: 2, MountPoint: "/var"},
		{ID: 3, MountPoint: "/var/lib/dsec/data"},
		{ID: 4, MountPoint: "/var/lib/dsec/data"}, // mounted over 3
		{ID: 5, MountPoint: "/var/lib/dsec/data2"},
		{ID: 6, MountPoint: "/var/lib/dsec/data/sb/merged"},
	}
	tests := []struct {
		path string
		want int
	}{
		{"/", 1},
		{"/etc", 1},
		{"/var", 2},
		{"/variable", 1},
		{"/var/lib/dsec", 2},
		{"/var/lib/dsec/data", 4},
		{"/var/lib/dsec/data/sb/upper", 4},
		{"/var/lib/dsec/data2/x", 5},
		{"/var/lib/dsec/data/sb/merged/etc", 6},
	}
	for _, tt := range tests {
		got, ok := containingMount(entries, tt.path)
		if !ok || got.ID != tt.want {
			t.Errorf("containingMount(%q) = %d, %v; want %d", tt.path, got.ID, ok, tt.want)
		}
	}
	if _, ok := containingMount(entries[1:2], "/etc"); ok {
		t.Errorf("containingMount found a mount for /etc among [/var]")
	}
}

// TestABILayout checks the hand-written kernel structures against sizeof and
// offsetof from linux/fs.h and linux/dqblk_xfs.h (values printed by a C
// program on x86-64).
func TestABILayout(t *testing.T) {
	checks := []struct {
		name      string
		got, want uintptr
	}{
		{"sizeof(struct fsxattr)", unsafe.Sizeof(fsxattr{}), 28},
		{"offsetof(fsxattr, fsx_projid)", unsafe.Offsetof(fsxattr{}.Projid), 12},
		{"sizeof(struct fs_disk_quota)", unsafe.Sizeof(fsDiskQuota{}), 112},
		{"offsetof(fs_disk_quota, d_blk_hardlimit)", unsafe.Offsetof(fsDiskQuota{}.BlkHardlimit), 8},
		{"offsetof(fs_disk_quota, d_bcount)", unsafe.Offsetof(fsDiskQuota{}.Bcount), 40},
		{"offsetof(fs_disk_quota, d_itimer_hi)", unsafe.Offsetof(fsDiskQuota{}.ItimerHi), 68},
		{"offsetof(fs_disk_quota, d_rtb_hardlimit)", unsafe.Offsetof(fsDiskQuota{}.RtbHardlimit), 72},
		{"offsetof(fs_disk_quota, d_padding4)", unsafe.Offsetof(fsDiskQuota{}.Padding4), 104},
		{"sizeof(struct fs_quota_stat)", unsafe.Sizeof(fsQuotaStat{}), 80},
		{"offsetof(fs_quota_stat, qs_flags)", unsafe.Offsetof(fsQuotaStat{}.Flags), 2},
		{"offsetof(fs_quota_stat, qs_incoredqs)", unsafe.Offsetof(fsQuotaStat{}.Incoredqs), 56},
		{"QCMD(Q_XGETQUOTA, PRJQUOTA)", uintptr(qcmd(qXGetQuota, prjQuota)), 0x580302},
		{"QCMD(Q_XSETQLIM, PRJQUOTA)", uintptr(qcmd(qXSetQLim, prjQuota)), 0x580402},
		{"QCMD(Q_XGETQSTAT, PRJQUOTA)", uintptr(qcmd(qXGetQStat, prjQuota)), 0x580502},
	}
	for _, c := range checks {
		if c.got != c.want {
			t.Errorf("%s = %d (%#x), want %d (%#x)", c.name, c.got, c.got, c.want, c.want)
		}
	}
}

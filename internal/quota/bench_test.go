package quota

import (
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"
)

// Run with: go test -run '^$' -bench . -benchtime 200x ./internal/quota/
// (the image benchmarks with -benchtime 5x: each iteration formats 64 GiB).

const benchImageSize = 64 << 30

// BenchmarkSet measures Set on fresh directories, one per iteration.
func BenchmarkSet(b *testing.B) {
	v := newVolume(b)
	dirs := benchDirs(b, v.Dir(), b.N)
	b.ResetTimer()
	for i := range b.N {
		if err := v.Set(dirs[i], MinDerivedID+uint32(i), 1<<30, 100000); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkTag measures the project-tagging half of Set (open,
// FS_IOC_FSGETXATTR, FS_IOC_FSSETXATTR), which runs without quota support.
func BenchmarkTag(b *testing.B) {
	root, _ := plainXFS(b)
	dirs := benchDirs(b, root, b.N)
	b.ResetTimer()
	for i := range b.N {
		fd, err := unix.Open(dirs[i], unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			b.Fatal(err)
		}
		err = setProject(fd, MinDerivedID+uint32(i))
		unix.Close(fd)
		if err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkPrepareFresh64G measures Prepare in ModeLoop with no image yet:
// sparse file, mkfs.xfs, loop device, prjquota mount, quota probe.
func BenchmarkPrepareFresh64G(b *testing.B) {
	needXFSQuota(b)
	for range b.N {
		b.StopTimer()
		o := loopOptions(b)
		o.ImageSize = benchImageSize
		b.StartTimer()
		v, err := Prepare(o)
		if err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		if err := v.Close(); err != nil {
			b.Fatal(err)
		}
		os.Remove(o.Image)
		b.StartTimer()
	}
}

// BenchmarkMountFresh64G measures what Prepare does for a new image up to
// and including the mount (without prjquota, so it runs on any kernel with
// XFS): sparse file, mkfs.xfs, LOOP_CONFIGURE, mount.
func BenchmarkMountFresh64G(b *testing.B) {
	needXFSLoop(b)
	for range b.N {
		b.StopTimer()
		o := loopOptions(b)
		mkdir(b, o.Dir)
		b.StartTimer()
		if err := mountImage(o.Dir, o.Image, benchImageSize, ""); err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		if err := unix.Unmount(o.Dir, 0); err != nil {
			b.Fatal(err)
		}
		os.Remove(o.Image)
		b.StartTimer()
	}
}

func benchDirs(b *testing.B, root string, n int) []string {
	b.Helper()
	dirs := make([]string, n)
	for i := range dirs {
		dirs[i] = filepath.Join(root, "sb"+strconv.Itoa(i))
		mkdir(b, dirs[i])
	}
	return dirs
}

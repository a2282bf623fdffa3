package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"time"

	"github.com/dsecproject/dsec/internal/cgroup"
	"github.com/dsecproject/dsec/internal/layer"
	"github.com/dsecproject/dsec/internal/layer/remote"
)

// runLayerFS runs the node's layer daemon: registry-backed layer images
// as files of a FUSE filesystem, read on demand through a chunk cache.
// The edge starts it when a sandbox first needs such a layer.
func runLayerFS(args []string) error {
	fs := newCmdFlags("layerfs", "--dir DIR [--cache-mb N] [--fetch-timeout D] [--fetch-attempts N] [--idle D]",
		"Serve registry-backed layer images on demand at DIR/mnt (started by the edge;\n"+
			"its state directory's layerfs/). Chunks are verified against each layer's\n"+
			"index and kept in DIR/cache, bounded by --cache-mb.")
	dir := fs.String("dir", "", "the daemon's directory (required)")
	cacheMB := fs.Int64("cache-mb", defaultLayerCacheMB, "bound of the node's chunk cache, in MiB")
	timeout := fs.Duration("fetch-timeout", 20*time.Second, "time one request to a layer's source may take")
	attempts := fs.Int("fetch-attempts", 3, "requests per read before it fails with EIO")
	idle := fs.Duration("idle", 0, "exit after this long with no image open (0 = never)")
	dockerConfig := fs.String("docker-config", "", "docker config.json whose auths give registry credentials")
	fuseFD := fs.Int("fuse-fd", -1, "serve this inherited /dev/fuse descriptor, mounted at DIR/mnt by the edge (which keeps a copy), instead of mounting")
	prefetch := fs.Bool("prefetch", true, "when a layer is first read, fetch in the background the chunks earlier runs read (a trace per layer)")
	reattach := fs.Bool("reattach", false, "with --fuse-fd: take over a connection an earlier daemon served (no INIT; requests it left are resent)")
	logFormat := fs.String("log-format", "text", "text or json")
	logLevel := fs.String("log-level", "info", "debug, info, warn or error")
	if _, err := fs.parseN(args, 0, 0); err != nil {
		return err
	}
	if *dir == "" {
		return errors.New("layerfs: --dir is required")
	}
	if *cacheMB < 1 || *attempts < 1 || *timeout <= 0 {
		return fmt.Errorf("layerfs: --cache-mb, --fetch-attempts and --fetch-timeout must be positive")
	}
	if os.Geteuid() != 0 {
		return errors.New("dsec layerfs needs root: it mounts a FUSE filesystem")
	}
	var fuseFile *os.File
	if *fuseFD >= 0 {
		fuseFile = os.NewFile(uintptr(*fuseFD), "/dev/fuse")
	} else if *reattach {
		return errors.New("layerfs: --reattach needs --fuse-fd")
	}
	return daemon(*logFormat, *logLevel, func(ctx context.Context, log *slog.Logger) error {
		return remote.Serve(ctx, remote.DaemonConfig{Dir: *dir, CacheBytes: *cacheMB << 20,
			Policy: remote.FetchPolicy{Timeout: *timeout, Attempts: *attempts}, Idle: *idle,
			DockerConfig: *dockerConfig, FUSE: fuseFile, Reattach: *reattach, Prefetch: *prefetch, Log: log})
	})
}

// defaultLayerCacheMB bounds a node's chunk cache unless told otherwise.
const defaultLayerCacheMB = 10 << 10

// The layer daemon's cgroup, a sibling of the sandboxes' parent
// (<parent>-layerfs), bounds what it may take of the node: memory (its
// heap is kept near GOMEMLIMIT, 512 MiB; the rest is fetch buffers and the
// page cache of its chunk files, which is reclaimed first) and tasks.
const (
	layerDaemonMemory = 1 << 30
	layerDaemonPids   = 512
	fuseDevice        = "c 10:229 rwm" // /dev/fuse, on a v1 devices hierarchy
)

// layerSource is an edge's source of layer images: the layer directory,
// and registry-backed layers through the node's layer daemon, which it
// starts from this binary with its state under stateDir, in a cgroup of
// its own under cg (none with cg nil).
func layerSource(layers *layer.Store, stateDir string, cacheMB int64, registryConfig string, cg *cgroup.Info, cgroupParent string, log *slog.Logger) *remote.Source {
	dir := filepath.Join(stateDir, "layerfs")
	src := &remote.Source{
		Store: layers, Dir: dir, PulledDir: filepath.Join(stateDir, "pulled"), PulledKeepBytes: cacheMB << 20, Log: log,
		DockerConfig: registryConfig,
		Command: func() *exec.Cmd {
			exe, err := os.Executable()
			if err != nil {
				exe = os.Args[0]
			}
			args := []string{"layerfs", "--dir", dir, "--cache-mb", strconv.FormatInt(cacheMB, 10)}
			if registryConfig != "" {
				args = append(args, "--docker-config", registryConfig)
			}
			return exec.Command(exe, args...)
		},
	}
	if cg != nil && cgroupParent != "" {
		rel := cgroupParent + "-layerfs"
		src.Cgroup = &remote.DaemonCgroup{
			Join: func() ([]string, error) {
				return cg.MakeSandbox(rel, cgroup.Limits{MemoryBytes: layerDaemonMemory, Pids: layerDaemonPids, Devices: []string{fuseDevice}})
			},
			Remove: func() error { return cg.RemoveIdle(rel) },
		}
	}
	return src
}

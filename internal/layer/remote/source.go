package remote

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/image"
	"github.com/dsecproject/dsec/internal/layer"
	"github.com/dsecproject/dsec/internal/mountinfo"
)

// Source is an edge's layer.Source: an image in the layer directory is
// used in place; a registry-backed layer (api.Layer.Remote) is served by
// the node's layerfs daemon, read on demand (pull lazy), or fetched whole
// into PulledDir first (pull full).
type Source struct {
	// Store is the layer store: its blobs, and its catalog, which says
	// where a layer it has no blob of lives.
	Store *layer.Store
	// Dir is the daemon's directory (DaemonConfig.Dir).
	Dir string
	// Command returns the command that runs the daemon on Dir; the edge
	// starts it when a lazy layer is first opened, in a session of its
	// own, so that it outlives a restart of the edge.
	Command func() *exec.Cmd
	// PulledDir holds images of pull-full layers: while they are
	// mounted, and after, the least recently used first to go, as long as
	// those not mounted fit in PulledKeepBytes (0: none is kept).
	PulledDir       string
	PulledKeepBytes int64
	// DockerConfig is a docker config.json whose auths full pulls use
	// (the daemon is given its own, DaemonConfig.DockerConfig).
	DockerConfig string
	Policy       FetchPolicy
	Log          *slog.Logger
	// Cgroup, if set, is the daemon's cgroup: Join returns the
	// cgroup.procs files it joins once started (making the cgroup, with
	// its limits, if need be), and Remove takes the cgroup away once no
	// daemon runs (the edge stopped and the daemon with it).
	Cgroup *DaemonCgroup

	once   sync.Once
	absDir string
	hc     *http.Client

	// mu serialises starting the daemon and guards fuse.
	mu sync.Mutex
	// fuse is this edge's copy of the daemon's /dev/fuse descriptor: while
	// it is open the mount survives the daemon, and a new daemon takes it
	// over with the sandboxes' EROFS mounts of its files intact.
	fuse *os.File
	pid  int
	// stopWatch ends the watchdog that starts a new daemon when the one
	// serving this edge's mount dies (nil: none running); stopped says
	// the edge stopped, and no watchdog starts again.
	stopWatch chan struct{}
	stopped   bool

	// pulledMu guards pulledRefs: the opens of each pulled image not
	// released yet (this process's; after a restart the mounts found
	// are not counted, and their files may go: an open file outlives
	// its name).
	pulledMu   sync.Mutex
	pulledRefs map[string]int
	// configChecked is set once a running daemon's registry config has
	// been compared with DockerConfig.
	configChecked atomic.Bool
}

// checkDaemonConfig warns, once, when the daemon found running (it
// outlives an edge restart while images are mounted) reads with another
// registry config than this edge was given: it keeps its own until it
// exits, once no image of it is mounted.
func (s *Source) checkDaemonConfig(ctx context.Context) {
	if s.configChecked.Swap(true) {
		return
	}
	st, err := s.Stats(ctx)
	if err != nil {
		s.configChecked.Store(false)
		return
	}
	if st.DockerConfig != s.DockerConfig {
		s.log().Warn("the running layer daemon reads registries with another config than this edge's --registry-config; it keeps it until it exits with no image mounted",
			"daemon", st.DockerConfig, "edge", s.DockerConfig)
	}
}

var _ layer.Source = (*Source)(nil)

// Open implements layer.Source.
func (s *Source) Open(ctx context.Context, digest string) (string, func(), error) {
	path, release, err := s.Store.Open(ctx, digest)
	if err == nil || !errors.Is(err, errdefs.ErrNotFound) {
		return path, release, err
	}
	l, gerr := s.Store.Get(digest)
	if gerr != nil || l.Remote == nil {
		return "", nil, err
	}
	if l.Remote.Pull == api.PullFull {
		return s.pull(ctx, l)
	}
	p, err := s.openLazy(ctx, l)
	if err != nil {
		return "", nil, err
	}
	// The daemon keeps the image registered; it costs nothing unused.
	return p, func() {}, nil
}

func (s *Source) log() *slog.Logger {
	if s.Log == nil {
		return slog.New(slog.DiscardHandler)
	}
	return s.Log
}

// client is the one HTTP client of the daemon's control socket (one
// transport, so kept-alive connections are reused, not piled up).
func (s *Source) client() *http.Client {
	s.init()
	return s.hc
}

// dir is Dir made absolute, its symlinks resolved: the mount table shows
// resolved paths, and the mount checks compare with it.
func (s *Source) dir() string {
	s.init()
	return s.absDir
}

func (s *Source) init() {
	s.once.Do(func() {
		s.absDir = resolveDir(s.Dir)
		sock := SocketPath(s.absDir)
		s.hc = &http.Client{Transport: &http.Transport{
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				var d net.Dialer
				return d.DialContext(ctx, "unix", sock)
			},
			MaxIdleConns: 4, IdleConnTimeout: 30 * time.Second,
		}}
	})
}

// resolveDir makes dir absolute and resolves the symlinks of its deepest
// existing ancestor.
func resolveDir(dir string) string {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return filepath.Clean(dir)
	}
	rest := ""
	for p := abs; ; p = filepath.Dir(p) {
		if real, err := filepath.EvalSymlinks(p); err == nil {
			return filepath.Join(real, rest)
		}
		if p == filepath.Dir(p) {
			return abs
		}
		rest = filepath.Join(filepath.Base(p), rest)
	}
}

func (s *Source) openLazy(ctx context.Context, l api.Layer) (string, error) {
	if err := s.ensureDaemon(ctx); err != nil {
		return "", err
	}
	desc := Descriptor{Digest: l.Digest, Size: l.SizeBytes, Source: l.Remote.Source, Insecure: l.Remote.Insecure,
		Index: l.Remote.Index, IndexSize: l.Remote.IndexSize, Meta: l.Remote.Meta, MetaSize: l.Remote.MetaSize}
	body, _ := json.Marshal(desc)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://layerfs/layers", bytes.NewReader(body))
	if err != nil {
		return "", err
	}
	resp, err := s.client().Do(req)
	if err != nil {
		return "", errdefs.Unavailable("layer %s: the node's layer daemon did not answer: %v", l.Ref, err)
	}
	defer resp.Body.Close()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if resp.StatusCode != http.StatusOK {
		text := strings.TrimSpace(string(msg))
		if resp.StatusCode == http.StatusServiceUnavailable {
			return "", errdefs.Unavailable("layer %s cannot be read from %s now: %s", l.Ref, l.Remote.Source, text)
		}
		return "", errdefs.Precondition("layer %s from %s: %s", l.Ref, l.Remote.Source, text)
	}
	var out struct{ Path string }
	if err := json.Unmarshal(msg, &out); err != nil || out.Path == "" {
		return "", fmt.Errorf("layer daemon's answer: %q", msg)
	}
	return out.Path, nil
}

// healthy reports whether a daemon answers on Dir's socket.
func (s *Source) healthy(ctx context.Context) bool {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://layerfs/healthz", nil)
	resp, err := s.client().Do(req)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// The layer daemon's own limits.
const (
	daemonMemLimit = "512MiB"
	daemonOOMScore = "500"
)

// ensureDaemon starts the daemon unless one answers, and waits for it.
//
// The edge mounts the daemon's filesystem itself and keeps a copy of the
// /dev/fuse descriptor (one it opened, or, after an edge restart, one the
// running daemon hands over), so that when the daemon dies the mount and
// every EROFS mount of its files stay: the next daemon is given the same
// descriptor and takes over (reads wait meanwhile, and requests the dead
// one had read are resent by the kernel). Only a daemon that died while
// no edge held the descriptor loses its mount: then its images read EIO
// until their sandboxes are recreated.
func (s *Source) ensureDaemon(ctx context.Context) error {
	if s.healthy(ctx) {
		s.holdFD()
		s.checkDaemonConfig(ctx)
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.healthy(ctx) {
		s.holdFDLocked()
		return nil
	}
	if s.Command == nil {
		return errdefs.Precondition("this node cannot read layers on demand (no layer daemon configured)")
	}
	// Nothing here may stat the mount point: with the daemon gone, that
	// waits for the next one.
	if err := os.MkdirAll(s.dir(), 0o700); err != nil {
		return fmt.Errorf("starting layer daemon: %w", err)
	}
	mnt := MountDir(s.dir())
	// One daemon per connection: one that no longer answers but still
	// runs would take requests the next could not answer.
	killDaemon(s.dir())
	reattach := s.fuse != nil && fuseMounted(mnt)
	if !reattach {
		if fuseMounted(mnt) {
			s.log().Warn("the layer daemon died while no edge held its mount; the images it served read EIO until their sandboxes are recreated", "mount", mnt)
			_ = unix.Unmount(mnt, unix.MNT_DETACH)
		}
		if s.fuse != nil {
			s.fuse.Close()
			s.fuse = nil
		}
		if err := os.MkdirAll(mnt, 0o700); err != nil {
			return fmt.Errorf("starting layer daemon: %w", err)
		}
		f, err := mountFUSE(mnt)
		if err != nil {
			return fmt.Errorf("starting layer daemon: %w", err)
		}
		s.fuse = f
	}
	logf, err := os.OpenFile(filepath.Join(s.dir(), "layerfs.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("starting layer daemon: %w", err)
	}
	defer logf.Close()
	cmd := s.Command()
	cmd.Args = append(cmd.Args, "--fuse-fd", "3")
	if reattach {
		cmd.Args = append(cmd.Args, "--reattach")
	}
	cmd.ExtraFiles = []*os.File{s.fuse}
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if cmd.Env == nil {
		cmd.Env = os.Environ()
	}
	// The daemon's heap is bounded softly (the Go runtime collects harder
	// as it nears the limit); what it holds beyond is fetch buffers.
	cmd.Env = append(cmd.Env, "GOMEMLIMIT="+daemonMemLimit)
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting layer daemon: %w", err)
	}
	if err := s.joinCgroup(cmd.Process.Pid); err != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return errdefs.Unavailable("putting the layer daemon in its cgroup: %v", err)
	}
	// Not the edge's OOM shield (-999, inherited): if memory runs out the
	// kernel may take the daemon before a sandbox, and the watchdog starts
	// another on the same mount.
	if err := os.WriteFile(fmt.Sprintf("/proc/%d/oom_score_adj", cmd.Process.Pid), []byte(daemonOOMScore), 0); err != nil {
		s.log().Warn("setting the layer daemon's OOM score", "err", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	deadline := time.After(15 * time.Second)
	for {
		if s.healthy(ctx) {
			s.pid = cmd.Process.Pid
			s.log().Info("layer daemon started", "pid", cmd.Process.Pid, "dir", s.dir(), "took_over", reattach)
			s.watchLocked()
			return nil
		}
		select {
		case err := <-exited:
			return errdefs.Unavailable("the layer daemon exited at start (%v); see %s", err, filepath.Join(s.dir(), "layerfs.log"))
		case <-deadline:
			cmd.Process.Kill()
			return errdefs.Unavailable("the layer daemon did not come up in 15 s; see %s", filepath.Join(s.dir(), "layerfs.log"))
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// DaemonPid is the pid of the daemon this source started (0: none).
func (s *Source) DaemonPid() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pid
}

func (s *Source) holdFD() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.holdFDLocked()
}

// holdFDLocked takes a copy of a running daemon's descriptor if this
// edge has none (it restarted).
//
// Preconditions: s.mu held.
func (s *Source) holdFDLocked() {
	if s.fuse != nil {
		return
	}
	f, err := fetchFD(fdSocketPath(s.dir()))
	if err != nil {
		s.log().Warn("taking the layer daemon's FUSE descriptor; its mount will not outlive it", "err", err)
		return
	}
	s.fuse = f
	s.watchLocked()
}

// watchLocked starts, once, the watchdog: while this edge holds the
// mount, a daemon that stops answering is replaced within about a
// second, so sandboxes reading its images wait instead of failing.
//
// Preconditions: s.mu held.
func (s *Source) watchLocked() {
	if s.stopWatch != nil || s.Command == nil || s.stopped {
		return
	}
	stop := make(chan struct{})
	s.stopWatch = stop
	go func() {
		t := time.NewTicker(time.Second)
		defer t.Stop()
		missed := 0
		for {
			select {
			case <-stop:
				return
			case <-t.C:
			}
			s.mu.Lock()
			held := s.fuse != nil
			s.mu.Unlock()
			if !held || s.healthy(context.Background()) {
				missed = 0
				continue
			}
			// A daemon busy enough to miss one check is not dead: three
			// in a row (about 9 s) are needed before it is replaced.
			if missed++; missed < 3 {
				continue
			}
			missed = 0
			select {
			case <-stop:
				return
			default:
			}
			s.log().Warn("the layer daemon stopped answering; starting another on its mount")
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			if err := s.ensureDaemon(ctx); err != nil {
				s.log().Error("restarting the layer daemon", "err", err)
			}
			cancel()
		}
	}()
}

// fetchFD receives a /dev/fuse descriptor from a daemon's fd socket.
func fetchFD(path string) (*os.File, error) {
	c, err := net.DialTimeout("unix", path, 2*time.Second)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Second))
	oob := make([]byte, unix.CmsgSpace(4))
	buf := make([]byte, 1)
	_, oobn, _, _, err := c.(*net.UnixConn).ReadMsgUnix(buf, oob)
	if err != nil {
		return nil, err
	}
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil || len(msgs) != 1 {
		return nil, fmt.Errorf("no descriptor received")
	}
	fds, err := unix.ParseUnixRights(&msgs[0])
	if err != nil || len(fds) != 1 {
		return nil, fmt.Errorf("no descriptor received")
	}
	var st unix.Stat_t
	if err := unix.Fstat(fds[0], &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != unix.Mkdev(10, 229) {
		unix.Close(fds[0])
		return nil, fmt.Errorf("the descriptor received is not /dev/fuse")
	}
	unix.CloseOnExec(fds[0])
	return os.NewFile(uintptr(fds[0]), "/dev/fuse"), nil
}

// mountFUSE mounts a new connection of the daemon's filesystem at mnt and
// returns its descriptor.
func mountFUSE(mnt string) (*os.File, error) {
	fd, err := unix.Open("/dev/fuse", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("opening /dev/fuse: %w", err)
	}
	opts := fmt.Sprintf("fd=%d,rootmode=40000,user_id=0,group_id=0,allow_other,max_read=%d", fd, 1<<20)
	if err := unix.Mount(fsName, mnt, "fuse."+fsName, unix.MS_NOSUID|unix.MS_NODEV, opts); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("mounting the layer filesystem at %s: %w", mnt, err)
	}
	return os.NewFile(uintptr(fd), "/dev/fuse"), nil
}

// fuseMounted reports whether the daemon's filesystem is mounted at mnt,
// from the mount table: a stat of a mount whose daemon is gone would wait.
func fuseMounted(mnt string) bool {
	entries, err := mountinfo.Read()
	if err != nil {
		return false
	}
	for _, e := range entries {
		if e.MountPoint == mnt && e.FSType == "fuse."+fsName {
			return true
		}
	}
	return false
}

// pull fetches the whole image of l into PulledDir, checked against its
// digest; the file is removed when the image is released.
func (s *Source) pull(ctx context.Context, l api.Layer) (string, func(), error) {
	if s.PulledDir == "" {
		return "", nil, errdefs.Precondition("this node cannot pull layers (no pull directory configured)")
	}
	if err := os.MkdirAll(s.PulledDir, 0o700); err != nil {
		return "", nil, fmt.Errorf("pulling layer %s: %w", l.Ref, err)
	}
	final := filepath.Join(s.PulledDir, strings.TrimPrefix(l.Digest, "sha256:")+fileSuffix)
	// Held before it is looked at or downloaded: a trim meanwhile (another
	// image's release) leaves it alone.
	release := s.holdPulled(final)
	if fi, err := os.Stat(final); err == nil && fi.Size() == l.SizeBytes {
		s.log().Info("layer pulled before, kept on the node", "ref", l.Ref, "bytes", l.SizeBytes)
		return final, release, nil
	}
	ok := false
	defer func() {
		if !ok {
			release()
		}
	}()
	ref, err := ParseSource(l.Remote.Source)
	if err != nil {
		return "", nil, err
	}
	repo, err := image.OpenRepo(ref, image.RepoOptions{Insecure: l.Remote.Insecure, DockerConfig: s.DockerConfig})
	if err != nil {
		return "", nil, err
	}
	pol := s.Policy.withDefaults()
	var lastErr error
	for attempt := range pol.Attempts {
		if attempt > 0 {
			time.Sleep(time.Duration(attempt) * 250 * time.Millisecond)
		}
		if lastErr = s.download(ctx, repo, l, final); lastErr == nil {
			s.log().Info("layer pulled", "ref", l.Ref, "bytes", l.SizeBytes)
			ok = true
			s.trimPulled()
			return final, release, nil
		}
		if ctx.Err() != nil || errors.Is(lastErr, errdefs.ErrInvalid) {
			break
		}
	}
	return "", nil, errdefs.Unavailable("pulling layer %s from %s: %v", l.Ref, l.Remote.Source, lastErr)
}

// holdPulled counts an open of the pulled image at p and returns what
// releases it: the last release dates the file (its last use) and trims
// the directory to its bound.
func (s *Source) holdPulled(p string) func() {
	s.pulledMu.Lock()
	if s.pulledRefs == nil {
		s.pulledRefs = map[string]int{}
	}
	s.pulledRefs[p]++
	s.pulledMu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			s.pulledMu.Lock()
			s.pulledRefs[p]--
			last := s.pulledRefs[p] <= 0
			if last {
				delete(s.pulledRefs, p)
			}
			s.pulledMu.Unlock()
			if last {
				now := time.Now()
				_ = os.Chtimes(p, now, now)
				s.trimPulled()
			}
		})
	}
}

// trimPulled removes pulled images no open holds, least recently used
// first, until those left unheld fit in PulledKeepBytes.
func (s *Source) trimPulled() {
	s.pulledMu.Lock()
	defer s.pulledMu.Unlock()
	entries, err := os.ReadDir(s.PulledDir)
	if err != nil {
		return
	}
	type kept struct {
		path string
		size int64
		used time.Time
	}
	var idle []kept
	var total int64
	for _, e := range entries {
		if !strings.HasSuffix(e.Name(), fileSuffix) {
			continue
		}
		p := filepath.Join(s.PulledDir, e.Name())
		if s.pulledRefs[p] > 0 {
			continue
		}
		fi, err := e.Info()
		if err != nil {
			continue
		}
		idle = append(idle, kept{p, fi.Size(), fi.ModTime()})
		total += fi.Size()
	}
	sort.Slice(idle, func(i, j int) bool { return idle[i].used.Before(idle[j].used) })
	for _, k := range idle {
		if total <= s.PulledKeepBytes {
			break
		}
		if err := os.Remove(k.path); err == nil || errors.Is(err, fs.ErrNotExist) {
			total -= k.size
			s.log().Info("pulled layer image dropped (least recently used)", "file", filepath.Base(k.path), "bytes", k.size)
		}
	}
}

func (s *Source) download(ctx context.Context, repo *image.Repo, l api.Layer, final string) error {
	tmp, err := os.CreateTemp(s.PulledDir, ".pull-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	defer tmp.Close()
	n, got, err := copyBlob(ctx, repo, l.Digest, l.SizeBytes, tmp)
	if err != nil {
		return err
	}
	if n != l.SizeBytes || got != l.Digest {
		return errdefs.Invalid("the source's image (%d bytes, %s) is not the layer's (%d bytes, %s)", n, got, l.SizeBytes, l.Digest)
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), final)
}

// copyBlob copies blob d of size bytes from repo to w (one byte more if
// the registry sends more) and returns what it copied and its digest, for
// the caller to check against d and size.
func copyBlob(ctx context.Context, repo *image.Repo, d string, size int64, w io.Writer) (int64, string, error) {
	h := sha256.New()
	if size > 0 {
		body, err := repo.BlobRange(ctx, d, 0, size)
		if err != nil {
			return 0, "", err
		}
		defer body.Close()
		n, err := io.Copy(io.MultiWriter(w, h), io.LimitReader(body, size+1))
		if err != nil {
			return n, "", errdefs.Unavailable("reading blob %s: %v", short(d), err)
		}
		return n, "sha256:" + hex.EncodeToString(h.Sum(nil)), nil
	}
	return 0, "sha256:" + hex.EncodeToString(h.Sum(nil)), nil
}

// EdgeStopped implements layer.EdgeStopper: the node's layer daemon is
// asked to exit if no image of it is mounted (no sandbox reads one), and
// waited for, so that a stopped edge leaves no mount; with images in use
// it stays for the sandboxes that outlive the edge.
func (s *Source) EdgeStopped() {
	s.mu.Lock()
	s.stopped = true
	if s.stopWatch != nil {
		close(s.stopWatch)
		s.stopWatch = nil
	}
	s.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for {
		asked, done := s.askToExit(ctx)
		if done {
			return
		}
		if asked {
			break
		}
		// The daemon that answered went before it could be asked (a
		// watchdog's replacement under way): look again.
		time.Sleep(100 * time.Millisecond)
		if ctx.Err() != nil {
			s.log().Warn("asking the layer daemon to exit: it kept going away")
			return
		}
	}
	for s.healthy(ctx) {
		if ctx.Err() != nil {
			s.log().Warn("layer daemon did not exit")
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	// The socket closes just before the daemon's own mount goes; a mount
	// the edge made is the edge's to take off.
	s.mu.Lock()
	defer s.mu.Unlock()
	for ctx.Err() == nil && fuseMounted(MountDir(s.dir())) {
		if s.fuse != nil || ctx.Err() != nil {
			break
		}
		time.Sleep(20 * time.Millisecond) // a daemon that mounted itself unmounts itself
	}
	if fuseMounted(MountDir(s.dir())) {
		_ = unix.Unmount(MountDir(s.dir()), unix.MNT_DETACH)
	}
	if s.fuse != nil {
		s.fuse.Close()
		s.fuse = nil
	}
	s.removeCgroup()
}

// askToExit asks the daemon to exit if no image is open. asked says it
// agreed (it is exiting); done says there is nothing more to do: no
// daemon answered and what it leaves was seen to, or it refused (images
// are open). Neither: the daemon stopped answering between the two.
func (s *Source) askToExit(ctx context.Context) (asked, done bool) {
	if !s.healthy(ctx) {
		// No daemon answers (it died and the watchdog had not replaced
		// it yet). Sandboxes still reading its images get one that
		// outlives this edge; with none, the mount goes.
		s.mu.Lock()
		held := s.fuse != nil
		s.mu.Unlock()
		if !held {
			s.removeCgroup()
			return false, true
		}
		if mountedImages(s.dir()) > 0 {
			if err := s.ensureDaemon(ctx); err != nil {
				s.log().Error("starting a layer daemon for the sandboxes that outlive the edge", "err", err)
			}
			return false, true
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		_ = unix.Unmount(MountDir(s.dir()), unix.MNT_DETACH)
		s.fuse.Close()
		s.fuse = nil
		s.removeCgroup()
		return false, true
	}
	// Asked a few times: a busy host can fail one request to a daemon
	// that is there (it answered healthy just now).
	var resp *http.Response
	var err error
	for try := 0; try < 3; try++ {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://layerfs/exit-if-idle", nil)
		if resp, err = s.client().Do(req); err == nil {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		s.log().Warn("asking the layer daemon to exit", "err", err)
		return false, false
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		s.log().Info("layer daemon kept: sandboxes read its images")
		return false, true
	}
	return true, false
}

// removeCgroup takes the daemon's cgroup away once no daemon runs. A
// daemon that has just said it exits may take a moment to: the cgroup is
// asked again for a few seconds.
func (s *Source) removeCgroup() {
	c := s.Cgroup
	if c == nil || c.Remove == nil {
		return
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		err := c.Remove()
		if err == nil {
			return
		}
		if !errors.Is(err, errdefs.ErrPrecondition) || time.Now().After(deadline) {
			s.log().Warn("removing the layer daemon's cgroup", "err", err)
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// DaemonCgroup is where a Source puts its daemon (Source.Cgroup).
type DaemonCgroup struct {
	Join   func() ([]string, error)
	Remove func() error
}

// joinCgroup moves the daemon pid into its cgroup, in every hierarchy.
func (s *Source) joinCgroup(pid int) error {
	c := s.Cgroup
	if c == nil || c.Join == nil {
		return nil
	}
	procs, err := c.Join()
	if err != nil {
		return err
	}
	for _, p := range procs {
		if err := os.WriteFile(p, []byte(strconv.Itoa(pid)), 0); err != nil {
			return fmt.Errorf("joining %s: %w", p, err)
		}
	}
	return nil
}

// killDaemon kills the daemon whose pid file is in dir, if that process
// is a layer daemon of dir, and waits for it to go.
func killDaemon(dir string) {
	b, err := os.ReadFile(filepath.Join(dir, pidName))
	if err != nil {
		return
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 1 {
		return
	}
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil || !bytes.Contains(cmdline, []byte(dir)) {
		return // gone, or a pid reused by another process
	}
	_ = unix.Kill(pid, unix.SIGKILL)
	for range 100 {
		if err := unix.Kill(pid, 0); err != nil {
			return
		}
		var ws unix.WaitStatus
		unix.Wait4(pid, &ws, unix.WNOHANG, nil) // our child: reap it
		time.Sleep(20 * time.Millisecond)
	}
}

// Stats asks the node's layer daemon for its figures (errdefs-free: any
// error means no daemon answered).
func (s *Source) Stats(ctx context.Context) (DaemonStats, error) {
	var st DaemonStats
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://layerfs/stats", nil)
	if err != nil {
		return st, err
	}
	resp, err := s.client().Do(req)
	if err != nil {
		return st, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return st, fmt.Errorf("layer daemon: %s", resp.Status)
	}
	return st, json.NewDecoder(resp.Body).Decode(&st)
}

// DropCache asks the node's layer daemon to empty its chunk cache (and,
// with traces, forget the recorded traces); it refuses while any of its
// images is mounted. ok is false when no daemon answered.
func (s *Source) DropCache(ctx context.Context, traces bool) (ok bool, err error) {
	u := "http://layerfs/drop-cache"
	if traces {
		u += "?traces=1"
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u, nil)
	if err != nil {
		return false, err
	}
	resp, err := s.client().Do(req)
	if err != nil {
		return false, nil
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return true, fmt.Errorf("emptying the layer daemon's cache: %s", strings.TrimSpace(string(msg)))
	}
	return true, nil
}

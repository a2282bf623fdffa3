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
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/image"
	"github.com/dsecproject/dsec/internal/layer"
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
	// PulledDir holds images of pull-full layers while they are mounted.
	PulledDir string
	Policy    FetchPolicy
	Log       *slog.Logger

	// mu serialises starting the daemon.
	mu sync.Mutex
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

func (s *Source) client() *http.Client {
	sock := SocketPath(s.Dir)
	return &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", sock)
		},
	}}
}

func (s *Source) openLazy(ctx context.Context, l api.Layer) (string, error) {
	if err := s.ensureDaemon(ctx); err != nil {
		return "", err
	}
	desc := Descriptor{Digest: l.Digest, Size: l.SizeBytes, Source: l.Remote.Source, Insecure: l.Remote.Insecure,
		Index: l.Remote.Index, IndexSize: l.Remote.IndexSize}
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

// ensureDaemon starts the daemon unless one answers, and waits for it.
func (s *Source) ensureDaemon(ctx context.Context) error {
	if s.healthy(ctx) {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.healthy(ctx) {
		return nil
	}
	if s.Command == nil {
		return errdefs.Precondition("this node cannot read layers on demand (no layer daemon configured)")
	}
	if err := os.MkdirAll(s.Dir, 0o700); err != nil {
		return fmt.Errorf("starting layer daemon: %w", err)
	}
	logf, err := os.OpenFile(filepath.Join(s.Dir, "layerfs.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("starting layer daemon: %w", err)
	}
	defer logf.Close()
	cmd := s.Command()
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting layer daemon: %w", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	deadline := time.After(15 * time.Second)
	for {
		if s.healthy(ctx) {
			s.log().Info("layer daemon started", "pid", cmd.Process.Pid, "dir", s.Dir)
			return nil
		}
		select {
		case err := <-exited:
			return errdefs.Unavailable("the layer daemon exited at start (%v); see %s", err, filepath.Join(s.Dir, "layerfs.log"))
		case <-deadline:
			cmd.Process.Kill()
			return errdefs.Unavailable("the layer daemon did not come up in 15 s; see %s", filepath.Join(s.Dir, "layerfs.log"))
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
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
	release := func() { os.Remove(final) }
	if fi, err := os.Stat(final); err == nil && fi.Size() == l.SizeBytes {
		return final, release, nil
	}
	ref, err := ParseSource(l.Remote.Source)
	if err != nil {
		return "", nil, err
	}
	repo, err := image.OpenRepo(ref, image.RepoOptions{Insecure: l.Remote.Insecure})
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
			return final, release, nil
		}
		if ctx.Err() != nil || errors.Is(lastErr, errdefs.ErrInvalid) {
			break
		}
	}
	return "", nil, errdefs.Unavailable("pulling layer %s from %s: %v", l.Ref, l.Remote.Source, lastErr)
}

func (s *Source) download(ctx context.Context, repo *image.Repo, l api.Layer, final string) error {
	tmp, err := os.CreateTemp(s.PulledDir, ".pull-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	defer tmp.Close()
	var body io.ReadCloser = io.NopCloser(bytes.NewReader(nil))
	if l.SizeBytes > 0 {
		if body, err = repo.BlobRange(ctx, l.Digest, 0, l.SizeBytes); err != nil {
			return err
		}
	}
	defer body.Close()
	h := sha256.New()
	n, err := io.Copy(io.MultiWriter(tmp, h), io.LimitReader(body, l.SizeBytes+1))
	if err != nil {
		return errdefs.Unavailable("reading the image: %v", err)
	}
	if got := "sha256:" + hex.EncodeToString(h.Sum(nil)); n != l.SizeBytes || got != l.Digest {
		return errdefs.Invalid("the source's image (%d bytes, %s) is not the layer's (%d bytes, %s)", n, got, l.SizeBytes, l.Digest)
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), final)
}

// EdgeStopped implements layer.EdgeStopper: the node's layer daemon is
// asked to exit if no image of it is mounted (no sandbox reads one), and
// waited for, so that a stopped edge leaves no mount; with images in use
// it stays for the sandboxes that outlive the edge.
func (s *Source) EdgeStopped() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if !s.healthy(ctx) {
		return
	}
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, "http://layerfs/exit-if-idle", nil)
	resp, err := s.client().Do(req)
	if err != nil {
		return
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		s.log().Info("layer daemon kept: sandboxes read its images")
		return
	}
	for s.healthy(ctx) {
		if ctx.Err() != nil {
			s.log().Warn("layer daemon did not exit")
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	// The socket closes just before the mount goes; wait for that too.
	for ctx.Err() == nil && isFUSEMount(MountDir(s.Dir)) {
		time.Sleep(20 * time.Millisecond)
	}
}

// isFUSEMount reports whether dir is the daemon's FUSE mount right now.
func isFUSEMount(dir string) bool {
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		return false // dead (ENOTCONN): nothing to wait for
	}
	return st.Type == fuseSuperMagic
}

const fuseSuperMagic = 0x65735546

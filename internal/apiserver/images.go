package apiserver

// Image import and pull: a container image becomes a base layer (and, split,
// a base plus a workspace layer) in the catalog. The image package unpacks
// into a tree under the layer store's staging directory, the layer store
// seals that tree; the image's config is kept with the base layer and
// applied to sandboxes created on it (applyImageDefaults).

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/image"
	"github.com/dsecproject/dsec/internal/layer"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// imageCacheDir is the subdirectory of the layer store's directory where
// pulls keep downloaded blobs (by digest), so a later pull of an image
// sharing layers downloads only what it lacks.
const imageCacheDir = "image-cache"

// imageJob is one import or pull, validated.
type imageJob struct {
	base      layer.Ref
	workspace *layer.Ref
	split     int
	// mergeUnder, if positive, cuts the image into runs of layers under
	// it (image.Options.MergeUnder): the base is the top run's layer over
	// the others' (api.Layer.Lowers).
	mergeUnder int64
	platform   string
	// project owns the layers built.
	project string
}

// newImageJob checks refs and the split before anything is read or
// downloaded, and that both refs are still free.
func (s *Server) newImageJob(ref, workspace string, split int, mergeUnder int64, platform string) (*imageJob, error) {
	if ref == "" {
		return nil, errdefs.Invalid("ref is required (base/NAME:TAG)")
	}
	base, err := layer.ParseRef(ref)
	if err != nil {
		return nil, err
	}
	if base.Kind != api.KindBase {
		return nil, errdefs.Invalid("ref %s is a %s ref; an image is imported as a base layer (base/NAME:TAG)", ref, base.Kind)
	}
	job := &imageJob{base: base, split: split, mergeUnder: mergeUnder, platform: platform}
	switch {
	case mergeUnder < 0:
		return nil, errdefs.Invalid("merge_under must be a positive byte count, got %d", mergeUnder)
	case mergeUnder > 0 && (split != 0 || workspace != ""):
		return nil, errdefs.Invalid("give merge_under or split with a workspace, not both")
	case split < 0:
		return nil, errdefs.Invalid("split must be positive, got %d", split)
	case workspace == "" && split > 0:
		return nil, errdefs.Invalid("split %d needs a workspace ref (workspace/NAME:TAG) for the layers above it", split)
	case workspace != "" && split == 0:
		return nil, errdefs.Invalid("a workspace ref needs split=K: the first K image layers make the base, the rest the workspace")
	}
	if workspace != "" {
		ws, err := layer.ParseRef(workspace)
		if err != nil {
			return nil, err
		}
		if ws.Kind != api.KindWorkspace {
			return nil, errdefs.Invalid("workspace %s is a %s ref, want workspace/NAME:TAG", workspace, ws.Kind)
		}
		job.workspace = &ws
	}
	for _, r := range job.refs() {
		switch _, err := s.deps.Layers.Resolve(r.String()); {
		case err == nil:
			return nil, errdefs.AlreadyExists("layer %s already exists (delete it first)", r)
		case !errors.Is(err, errdefs.ErrNotFound):
			return nil, err
		}
	}
	return job, nil
}

func (j *imageJob) refs() []layer.Ref {
	if j.workspace != nil {
		return []layer.Ref{j.base, *j.workspace}
	}
	return []layer.Ref{j.base}
}

// unpackFunc unpacks an image into dest (and opts.UpperDir).
type unpackFunc func(ctx context.Context, dest string, opts image.Options) (*image.Result, error)

// run unpacks the image into a staging tree and builds the layers. On any
// error nothing stays in the staging area or the catalog.
func (s *Server) runImageJob(ctx context.Context, j *imageJob, unpack unpackFunc, progress io.Writer) (*api.ImageResult, error) {
	start := time.Now()
	stage, err := os.MkdirTemp(s.deps.Layers.StagingDir(), "image-")
	if err != nil {
		return nil, fmt.Errorf("staging image: %w", err)
	}
	defer os.RemoveAll(stage)
	root := filepath.Join(stage, "root")
	if err := os.Mkdir(root, 0o755); err != nil {
		return nil, fmt.Errorf("staging image: %w", err)
	}
	opts := image.Options{Platform: j.platform, MaxBytes: s.deps.MaxLayerBytes, Progress: progress}
	if j.workspace != nil || j.mergeUnder > 0 {
		opts.SplitAt, opts.MergeUnder = j.split, j.mergeUnder
		opts.UpperDir = filepath.Join(stage, "upper")
		if err := os.Mkdir(opts.UpperDir, 0o755); err != nil {
			return nil, fmt.Errorf("staging image: %w", err)
		}
	}
	// The runs below the top one become blobs no entry names until the
	// base is written: pinned till then, and taken back if it is not.
	var lowers []string
	var lowersBytes int64
	var unpins []func()
	done := false
	defer func() {
		for _, unpin := range unpins {
			unpin()
		}
		for _, d := range lowers {
			if done {
				break
			}
			if _, err := s.deps.Layers.Collect(d); err != nil {
				s.log.Warn("removing a lower layer of a failed import", "digest", d, "err", err)
			}
		}
	}()
	if j.mergeUnder > 0 {
		opts.Sealed = func(run, runs int, dir string) error {
			if runs > layer.MaxLowers+1 {
				return errdefs.Invalid("merge_under %s cuts the image into %d layers, more than a base may stack (%d): raise it",
					layer.HumanBytes(j.mergeUnder), runs, layer.MaxLowers+1)
			}
			printf(progress, "sealing run %d/%d of the image's layers\n", run+1, runs)
			d, n, unpin, err := s.deps.Layers.BuildBlob(ctx, dir, layer.BuildOptions{}, progress)
			if err != nil {
				return err
			}
			if slices.Contains(lowers, d) {
				unpin()
				return errdefs.Invalid("merge_under %s: run %d of the image's layers has the content of an earlier run (empty layers, or changes undone), and a node mounts a layer once per sandbox: raise merge_under to merge it with its neighbours",
					layer.HumanBytes(j.mergeUnder), run+1)
			}
			lowersBytes += n
			lowers, unpins = append(lowers, d), append(unpins, unpin)
			return nil
		}
	}
	res, err := unpack(ctx, root, opts)
	if err != nil {
		return nil, err
	}
	if j.workspace != nil && j.split >= len(res.Layers) {
		return nil, errdefs.Invalid("split %d leaves nothing for the workspace: the image has %d layers (split must be 1 to %d)",
			j.split, len(res.Layers), len(res.Layers)-1)
	}
	cfg := res.Config
	out := &api.ImageResult{
		Digest: res.Digest, Platform: res.Platform, Config: cfg, ImageLayers: len(res.Layers),
		Files: res.Files, Bytes: res.Bytes,
	}
	if j.mergeUnder > 0 {
		out.Runs = len(res.Runs)
		printf(progress, "sealing run %d/%d of the image's layers\n", len(res.Runs), len(res.Runs))
	}
	top := root // the base's tree: the whole image, the split's lower part, or the top run
	if j.mergeUnder > 0 {
		top = res.Top
	}
	base, err := s.deps.Layers.BuildFromDir(ctx, j.base, top, layer.BuildOptions{Image: &cfg, Project: j.project, Lowers: lowers, LowersBytes: lowersBytes}, progress)
	if err != nil {
		return nil, err
	}
	done = true
	out.Layers = append(out.Layers, base)
	if j.workspace != nil {
		out.Split = j.split
		ws, err := s.deps.Layers.BuildFromDir(ctx, *j.workspace, opts.UpperDir, layer.BuildOptions{Project: j.project}, progress)
		if err != nil {
			// The base alone is half an import: take it back.
			if derr := s.deps.Layers.Delete(j.base.String(), func(d string) (bool, error) { return s.inUse(ctx, d) }); derr != nil {
				s.log.Error("removing base layer of a failed split import", "ref", j.base.String(), "err", derr)
			}
			return nil, err
		}
		out.Layers = append(out.Layers, ws)
	}
	out.DurationMS = time.Since(start).Milliseconds()
	s.log.Info("image imported", "ref", j.base.String(), "image_digest", res.Digest, "image_layers", len(res.Layers),
		"split", j.split, "runs", len(res.Runs), "files", res.Files, "bytes", res.Bytes, "duration_ms", out.DurationMS)
	return out, nil
}

// maxArchiveBytes bounds an uploaded archive: twice what may be extracted
// from it, the bound Pull puts on an image's compressed layers.
func (s *Server) maxArchiveBytes() int64 {
	if s.deps.MaxLayerBytes > 0 {
		return 2 * s.deps.MaxLayerBytes
	}
	return 2 * image.DefaultMaxBytes
}

func (s *Server) importImage(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	split := 0
	if v := q.Get("split"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			s.writeError(w, r, badQuery("split", v, "want the number of image layers that make the base"))
			return
		}
		split = n
	}
	var mergeUnder int64
	if v := q.Get("merge_under"); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			s.writeError(w, r, badQuery("merge_under", v, "want a byte count: image layers are merged into runs under it"))
			return
		}
		mergeUnder = n
	}
	job, err := s.newImageJob(q.Get("ref"), q.Get("workspace"), split, mergeUnder, q.Get("platform"))
	if job != nil {
		job.project = s.callerProject(r.Context())
	}
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	// Archives are read at random (index.json, then blobs by offset), so
	// the body goes to a file first; the staging directory is root-only
	// and emptied at start.
	f, err := os.CreateTemp(s.deps.Layers.StagingDir(), "import-*.tar")
	if err != nil {
		s.writeError(w, r, fmt.Errorf("staging archive: %w", err))
		return
	}
	archive := f.Name()
	defer os.Remove(archive)
	limit := s.maxArchiveBytes()
	_, err = copyBuffer(f, http.MaxBytesReader(w, r.Body, limit))
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	var mbe *http.MaxBytesError
	switch {
	case errors.As(err, &mbe):
		s.writeError(w, r, errdefs.Invalid("archive larger than %d bytes (twice the layer size limit)", limit))
		return
	case err != nil:
		s.writeError(w, r, errdefs.Invalid("reading archive: %v", err))
		return
	}
	unpack := func(ctx context.Context, dest string, opts image.Options) (*image.Result, error) {
		res, err := image.Unpack(ctx, archive, dest, opts)
		if err != nil {
			// The caller knows no staging path: name its archive instead.
			return nil, errdefs.FromCode(errdefs.Code(err), strings.ReplaceAll(err.Error(), archive, "archive"))
		}
		return res, nil
	}
	s.serveImageJob(w, r, job, unpack)
}

func (s *Server) pullImage(w http.ResponseWriter, r *http.Request) {
	var req api.ImagePullRequest
	if err := decode(r, &req); err != nil {
		s.writeError(w, r, err)
		return
	}
	if req.Image == "" {
		s.writeError(w, r, errdefs.Invalid("image is required (REGISTRY/REPO:TAG)"))
		return
	}
	if _, err := image.ParseReference(req.Image); err != nil {
		s.writeError(w, r, err)
		return
	}
	job, err := s.newImageJob(req.Ref, req.Workspace, req.Split, req.MergeUnder, req.Platform)
	if job != nil {
		job.project = s.callerProject(r.Context())
	}
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	cache := filepath.Join(s.deps.Layers.Dir(), imageCacheDir)
	unpack := func(ctx context.Context, dest string, opts image.Options) (*image.Result, error) {
		unlock, err := lockCache(ctx, cache, opts.Progress)
		if err != nil {
			return nil, err
		}
		defer unlock()
		res, err := image.Pull(ctx, req.Image, dest, image.PullOptions{
			Options: opts, CacheDir: cache, Insecure: req.Insecure,
			Username: req.Username, Password: req.Password,
		})
		// The registry's refusal is about the credentials in the request,
		// not about the caller's dsec API key: 400, never 401/403.
		if errors.Is(err, errdefs.ErrUnauthenticated) || errors.Is(err, errdefs.ErrPermissionDenied) {
			return nil, errdefs.Invalid("registry refused access: %v (give username and password)", err)
		}
		return res, err
	}
	s.serveImageJob(w, r, job, unpack)
}

// lockCache takes the pull cache's lock: two pulls of one blob would write
// the same partial download. flock, so the lock also holds against another
// process, and polled, so a cancelled request stops waiting.
func lockCache(ctx context.Context, dir string, progress io.Writer) (unlock func(), err error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("creating image cache: %w", err)
	}
	f, err := os.OpenFile(filepath.Join(dir, "lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, fmt.Errorf("locking image cache: %w", err)
	}
	for waited := false; ; waited = true {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return func() { f.Close() }, nil // closing releases the lock
		}
		if !errors.Is(err, unix.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("locking image cache: %w", err)
		}
		if !waited && progress != nil {
			fmt.Fprintln(progress, "waiting for another pull to finish")
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// serveImageJob runs job and answers: 201 with the ImageResult, or, if the
// client accepts application/x-ndjson, 200 with progress events and a
// final result or error event.
func (s *Server) serveImageJob(w http.ResponseWriter, r *http.Request, job *imageJob, unpack unpackFunc) {
	if !strings.Contains(r.Header.Get("Accept"), "application/x-ndjson") {
		res, err := s.runImageJob(r.Context(), job, unpack, nil)
		if err != nil {
			s.writeError(w, r, err)
			return
		}
		writeJSON(w, http.StatusCreated, res)
		return
	}
	ev := &eventWriter{w: w, enc: json.NewEncoder(w)}
	ev.f, _ = w.(http.Flusher)
	w.Header().Set("Content-Type", "application/x-ndjson")
	w.WriteHeader(http.StatusOK)
	ev.send(api.ImageEvent{Progress: "importing as " + strings.Join(refStrings(job.refs()), " + ")})
	res, err := s.runImageJob(r.Context(), job, unpack, ev)
	ev.flushLine()
	if err != nil {
		code := errdefs.Code(err)
		msg := err.Error()
		if errdefs.HTTPStatus(code) == http.StatusInternalServerError {
			// As writeError: host detail goes to the log only.
			var b [6]byte
			_, _ = rand.Read(b[:])
			ref := hex.EncodeToString(b[:])
			s.log.Error("request failed", "ref", ref, "method", r.Method, "path", r.URL.Path, "err", err)
			msg = "internal error (ref " + ref + "; the server log has the details)"
		}
		ev.send(api.ImageEvent{Error: &api.ErrorDetail{Code: code, Message: msg}})
		return
	}
	ev.send(api.ImageEvent{Result: res})
}

func refStrings(refs []layer.Ref) []string {
	out := make([]string, len(refs))
	for i, r := range refs {
		out[i] = r.String()
	}
	return out
}

// eventWriter turns the progress lines written to it into NDJSON progress
// events, flushed one by one.
type eventWriter struct {
	w   io.Writer
	enc *json.Encoder
	f   http.Flusher

	mu      sync.Mutex
	partial []byte
}

func (e *eventWriter) Write(b []byte) (int, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.partial = append(e.partial, b...)
	for {
		i := strings.IndexByte(string(e.partial), '\n')
		if i < 0 {
			break
		}
		line := strings.TrimSpace(string(e.partial[:i]))
		e.partial = e.partial[i+1:]
		if line != "" {
			e.sendLocked(api.ImageEvent{Progress: line})
		}
	}
	return len(b), nil
}

func (e *eventWriter) flushLine() {
	e.mu.Lock()
	defer e.mu.Unlock()
	if line := strings.TrimSpace(string(e.partial)); line != "" {
		e.sendLocked(api.ImageEvent{Progress: line})
	}
	e.partial = nil
}

func (e *eventWriter) send(ev api.ImageEvent) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.sendLocked(ev)
}

// sendLocked writes one event. A client gone away shows as write errors,
// which are ignored: the request's context stops the job.
func (e *eventWriter) sendLocked(ev api.ImageEvent) {
	_ = e.enc.Encode(ev)
	if e.f != nil {
		e.f.Flush()
	}
}

// applyImageDefaults fills spec from the image config recorded with its
// base layer: the image's Env under the spec's env (the spec wins per
// variable), and WorkingDir and User where the spec leaves workdir and
// user empty. Values dsec cannot express (entries without "=", env names
// its validation refuses, a relative WorkingDir, a user that is not NAME, UID, NAME:GROUP
// or UID:GID) are skipped. An unresolvable base is left for prepare to
// report.
func (s *Server) applyImageDefaults(spec *api.SandboxSpec, resolve func(string) (api.Layer, error)) {
	ref := spec.Base
	if ref == "" || spec.Image != "" {
		if ref != "" {
			return // both given: Normalize refuses the spec
		}
		ref = spec.Image
	}
	if ref == "" {
		return
	}
	l, err := resolve(ref)
	if err != nil || l.Kind != api.KindBase || l.Image == nil {
		return
	}
	cfg := l.Image
	if len(cfg.Env) > 0 {
		// A fresh map: batch creates share the caller's spec.
		env := make(map[string]string, len(cfg.Env)+len(spec.Env))
		for _, kv := range cfg.Env {
			k, v, ok := strings.Cut(kv, "=")
			if ok && sandbox.ValidateEnv(map[string]string{k: v}, 0) == nil {
				env[k] = v
			}
		}
		for k, v := range spec.Env {
			env[k] = v
		}
		spec.Env = env
	}
	if spec.Workdir == "" && strings.HasPrefix(cfg.WorkingDir, "/") {
		spec.Workdir = path.Clean(cfg.WorkingDir)
	}
	if spec.User == "" && cfg.User != "" && sandbox.ValidateUser(cfg.User) == nil {
		spec.User = cfg.User
	}
}

// printf writes a progress line to w, if there is one to write to.
func printf(w io.Writer, format string, args ...any) {
	if w != nil {
		fmt.Fprintf(w, format, args...)
	}
}

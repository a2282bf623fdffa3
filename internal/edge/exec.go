package edge

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"fmt"
	"io"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/files"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// Exec runs a one-shot command. With emit set, output is streamed as events
// (the final status is returned, not emitted); otherwise it is collected
// into the result, each stream capped at MaxOutputBytes. The call goes in
// the command log.
func (e *Edge) Exec(ctx context.Context, id string, req api.ExecRequest, emit func(api.ExecEvent) error) (res *api.ExecResult, err error) {
	if err := sandbox.NormalizeExec(&req); err != nil {
		return nil, err
	}
	s, done, err := e.begin(ctx, id)
	if err != nil {
		return nil, err
	}
	defer done()
	start := time.Now()
	var outHead, errHead *headWriter
	defer func() {
		e.record(s, api.LogExec, start, execRequestLog(req, emit != nil), execResultLog(res, outHead, errHead), err)
	}()
	release, ok := e.streams.take()
	if !ok {
		return nil, e.streamsFull()
	}
	defer release()
	p, err := e.process(s, req.User, req.Cwd, req.Env)
	if err != nil {
		return nil, err
	}
	if req.Cmd != "" {
		p.Args = []string{"/bin/sh", "-c", req.Cmd}
	} else {
		p.Args = req.Argv
	}
	p.Private = req.Private
	switch {
	case req.StdinB64 != "":
		b, err := base64.StdEncoding.DecodeString(req.StdinB64)
		if err != nil {
			return nil, errdefs.Invalid("stdin_b64 is not valid base64: %v", err)
		}
		p.Stdin = bytes.NewReader(b)
	case req.Stdin != "":
		p.Stdin = strings.NewReader(req.Stdin)
	}

	var outBuf, errBuf *capBuffer
	var sink *eventSink
	var outW, errW *streamWriter
	if emit != nil {
		sink = &eventSink{emit: emit, remaining: [2]int64{req.MaxOutputBytes, req.MaxOutputBytes}}
		outW, errW = &streamWriter{sink: sink}, &streamWriter{sink: sink, stderr: true}
		p.Stdout, p.Stderr = outW, errW
	} else {
		release, err := e.output.take(2 * req.MaxOutputBytes)
		if err != nil {
			return nil, err
		}
		defer release()
		outBuf, errBuf = &capBuffer{max: req.MaxOutputBytes}, &capBuffer{max: req.MaxOutputBytes}
		p.Stdout, p.Stderr = outBuf, errBuf
	}
	outHead, errHead = &headWriter{w: p.Stdout}, &headWriter{w: p.Stderr}
	p.Stdout, p.Stderr = outHead, errHead
	proc, err := e.backendOf(s).Exec(ctx, id, p)
	if err != nil {
		return nil, fmt.Errorf("starting command: %w", err)
	}
	code, timedOut, err := waitBounded(ctx, proc, time.Duration(req.Timeout)*time.Second)
	if err != nil {
		return nil, fmt.Errorf("waiting for command: %w", err)
	}
	res = &api.ExecResult{ExitCode: code, TimedOut: timedOut, DurationMS: time.Since(start).Milliseconds()}
	if emit != nil {
		outW.flush()
		errW.flush()
		res.Truncated = sink.truncated
	} else {
		ob, ot := outBuf.bytes()
		eb, et := errBuf.bytes()
		res.Stdout, res.StdoutB64 = textFields(ob)
		res.Stderr, res.StderrB64 = textFields(eb)
		res.Truncated = ot || et
	}
	e.metrics.execSeconds.Observe(time.Since(start).Seconds())
	return res, nil
}

// waitBounded waits for proc, killing its tree when the timeout passes or
// ctx ends (the caller went away).
func waitBounded(ctx context.Context, proc sandbox.Proc, timeout time.Duration) (int, bool, error) {
	type result struct {
		code int
		err  error
	}
	done := make(chan result, 1)
	go func() {
		c, err := proc.Wait()
		done <- result{c, err}
	}()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	timedOut := false
	select {
	case r := <-done:
		return r.code, false, r.err
	case <-timer.C:
		timedOut = true
	case <-ctx.Done():
	}
	_ = proc.Kill()
	r := <-done
	if timedOut {
		return 124, true, r.err
	}
	return r.code, false, r.err
}

// process builds the sandbox.Process for a request: user resolved against
// the sandbox's own /etc/passwd, env = spec env + request env, cwd defaulting
// to the spec's workdir.
func (e *Edge) process(s *sbx, user, cwd string, env map[string]string) (sandbox.Process, error) {
	s.mu.Lock()
	spec := s.rec.Sandbox.Spec
	s.mu.Unlock()
	if user == "" {
		user = spec.User
	}
	if cwd == "" {
		cwd = spec.Workdir
	}
	s.mu.Lock()
	images := s.rec.Images
	s.mu.Unlock()
	var read sandboxFile
	if images {
		if user != spec.User {
			// The node cannot read this sandbox's /etc/passwd: the
			// backend resolves the user inside it.
			return sandbox.Process{Env: envList(nil, spec.Env, env), Cwd: filepath.Clean(cwd), User: user}, nil
		}
		// The default user is resolved once through the backend's
		// files and kept, as for the others.
		fsrv, ok := e.backendFor(&s.rec).(sandbox.FileServer)
		if !ok {
			return sandbox.Process{Env: envList(nil, spec.Env, env), Cwd: filepath.Clean(cwd), User: user}, nil
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		id := s.rec.Sandbox.ID
		read = func(p string) (io.ReadCloser, error) {
			f, err := fsrv.Files(ctx, id)
			if err != nil {
				return nil, err
			}
			rc, _, err := f.ReadFile(ctx, p)
			return rc, err
		}
	} else {
		root, err := e.root(s)
		if err != nil {
			return sandbox.Process{}, err
		}
		read = rootFiles(root)
	}
	var u userInfo
	var err error
	if user == spec.User {
		u, err = e.defaultUser(s, read, user)
	} else {
		u, err = resolveUser(read, user)
	}
	if err != nil {
		return sandbox.Process{}, err
	}
	base := map[string]string{"HOME": u.home, "USER": u.name}
	if u.name == "" {
		delete(base, "USER")
	}
	return sandbox.Process{Env: envList(base, spec.Env, env), Cwd: filepath.Clean(cwd), UID: u.uid, GID: u.gid}, nil
}

// envList merges environments, later ones winning, into sorted KEY=VALUE
// pairs.
func envList(envs ...map[string]string) []string {
	merged := map[string]string{}
	for _, e := range envs {
		for k, v := range e {
			merged[k] = v
		}
	}
	keys := make([]string, 0, len(merged))
	for k := range merged {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	out := make([]string, 0, len(keys))
	for _, k := range keys {
		out = append(out, k+"="+merged[k])
	}
	return out
}

// root returns the sandbox's rootfs opened for confined file access.
func (e *Edge) root(s *sbx) (*files.Root, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.root != nil {
		return s.root, nil
	}
	if s.rec.Images {
		return nil, errdefs.Precondition("sandbox %s runs on the %s backend, whose files the node cannot reach from the host: directory watches and what else reads its rootfs from the host do not serve it",
			s.rec.Sandbox.ID, s.rec.Sandbox.Backend)
	}
	var r *files.Root
	var err error
	if s.rec.PrivateRootfs {
		r, err = e.openPrivateRoot(e.backendFor(&s.rec), s.rec.Sandbox.ID)
	} else {
		r, err = files.Open(rootfsDir(s.dir))
	}
	if err != nil {
		return nil, fmt.Errorf("opening sandbox rootfs: %w", err)
	}
	if s.rec.UserNS {
		m := e.userNSMapOf(&s.rec)
		base := int(m.HostID)
		r.SetOwner(files.Owner{UID: base, GID: base})
		r.SetIDMap(m.HostID, m.Size)
	}
	s.root = r
	return r, nil
}

// openPrivateRoot opens the root of a sandbox whose overlay is mounted only
// in its own mount namespace, through its init's /proc/PID/root. Lookups
// from it stay on the overlay (files resolves with RESOLVE_NO_XDEV), so
// the sandbox's /proc, /sys and /dev are out of reach, as they are from
// a host-side mount.
//
// A pid can be reused once its process is gone, so the open is fenced: a
// pidfd is taken first and the runtime's view (with the init's start time)
// is read again, so the pidfd is the init's; the pidfd must still be alive
// after the open, so the pid was not reused in between; and the root must
// be an overlay (without a start time to check, a reused pid's root would
// be the host's "/").
func (e *Edge) openPrivateRoot(be sandbox.Backend, id string) (*files.Root, error) {
	ctx := context.Background()
	gone := errdefs.Precondition("sandbox %s is not running", id)
	st, err := be.Status(ctx, id)
	if err != nil {
		return nil, err
	}
	if !st.Running || st.Pid <= 0 {
		return nil, gone
	}
	pidfd, err := unix.PidfdOpen(st.Pid, 0)
	if err != nil {
		return nil, gone
	}
	defer unix.Close(pidfd)
	if again, err := be.Status(ctx, id); err != nil || !again.Running || again.Pid != st.Pid {
		return nil, gone
	}
	r, err := files.Open("/proc/" + strconv.Itoa(st.Pid) + "/root")
	if err != nil {
		return nil, err
	}
	fs, serr := r.Statfs()
	if unix.PidfdSendSignal(pidfd, 0, nil, 0) != nil || serr != nil || fs.Type != unix.OVERLAYFS_SUPER_MAGIC {
		r.Close()
		return nil, gone
	}
	return r, nil
}

type userInfo struct {
	name     string
	uid, gid uint32
	home     string
}

// userRecord is a userInfo as a sandbox record keeps it.
type userRecord struct {
	Name string `json:"name,omitempty"`
	UID  uint32 `json:"uid"`
	GID  uint32 `json:"gid"`
	Home string `json:"home"`
}

// sandboxFile opens a file of a sandbox's for reading (a regular file
// only: the sandbox's files may be hostile).
type sandboxFile func(path string) (io.ReadCloser, error)

// rootFiles reads files through a confined root.
func rootFiles(root *files.Root) sandboxFile {
	return func(p string) (io.ReadCloser, error) {
		rc, _, err := root.ReadFile(p)
		return rc, err
	}
}

// defaultUser returns the identity of the spec's user, resolving it the
// first time and keeping it in the record.
func (e *Edge) defaultUser(s *sbx, root sandboxFile, spec string) (userInfo, error) {
	s.mu.Lock()
	if du := s.rec.DefaultUser; du != nil {
		s.mu.Unlock()
		return userInfo{name: du.Name, uid: du.UID, gid: du.GID, home: du.Home}, nil
	}
	s.mu.Unlock()
	u, err := resolveUser(root, spec)
	if err != nil {
		return u, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.rec.DefaultUser == nil {
		s.rec.DefaultUser = &userRecord{Name: u.name, UID: u.uid, GID: u.gid, Home: u.home}
		// No fsync: a daemon crash keeps the record (page cache); a host
		// crash ends the sandbox anyway.
		if err := writeRecordSync(s.dir, &s.rec, false); err != nil {
			// Kept in memory all the same; a restart resolves it again.
			e.log.Warn("keeping the default user in the record", "sandbox_id", s.rec.Sandbox.ID, "err", err)
		}
	}
	du := s.rec.DefaultUser
	return userInfo{name: du.Name, uid: du.UID, gid: du.GID, home: du.Home}, nil
}

// resolveUser maps NAME, UID, NAME:GROUP or UID:GID to ids using the
// sandbox's own /etc/passwd and /etc/group, read through the confined root
// (the files are the sandbox's and may be hostile: only parsed, bounded).
func resolveUser(root sandboxFile, spec string) (userInfo, error) {
	userPart, groupPart, hasGroup := strings.Cut(spec, ":")
	u := userInfo{home: "/"}
	if n, err := strconv.ParseUint(userPart, 10, 32); err == nil {
		u.uid, u.gid = uint32(n), uint32(n)
		if ent, ok := lookupDB(root, "/etc/passwd", func(f []string) bool { return len(f) >= 3 && f[2] == userPart }); ok && len(ent) >= 6 {
			u.name, u.home = ent[0], ent[5]
			if g, err := strconv.ParseUint(ent[3], 10, 32); err == nil {
				u.gid = uint32(g)
			}
		}
	} else {
		ent, ok := lookupDB(root, "/etc/passwd", func(f []string) bool { return f[0] == userPart })
		if !ok || len(ent) < 6 {
			return u, errdefs.Invalid("user %q does not exist in the sandbox's /etc/passwd", userPart)
		}
		uid, err1 := strconv.ParseUint(ent[2], 10, 32)
		gid, err2 := strconv.ParseUint(ent[3], 10, 32)
		if err1 != nil || err2 != nil {
			return u, errdefs.Invalid("user %q has a malformed /etc/passwd entry", userPart)
		}
		u.name, u.uid, u.gid, u.home = userPart, uint32(uid), uint32(gid), ent[5]
	}
	if u.uid == 0 && u.name == "" {
		u.name, u.home = "root", "/root"
	}
	if hasGroup {
		if n, err := strconv.ParseUint(groupPart, 10, 32); err == nil {
			u.gid = uint32(n)
		} else {
			ent, ok := lookupDB(root, "/etc/group", func(f []string) bool { return f[0] == groupPart })
			if !ok || len(ent) < 3 {
				return u, errdefs.Invalid("group %q does not exist in the sandbox's /etc/group", groupPart)
			}
			g, err := strconv.ParseUint(ent[2], 10, 32)
			if err != nil {
				return u, errdefs.Invalid("group %q has a malformed /etc/group entry", groupPart)
			}
			u.gid = uint32(g)
		}
	}
	if u.home == "" {
		u.home = "/"
	}
	return u, nil
}

// lookupDB scans a colon-separated database file inside the sandbox.
func lookupDB(root sandboxFile, path string, match func([]string) bool) ([]string, bool) {
	rc, err := root(path)
	if err != nil {
		return nil, false
	}
	defer rc.Close()
	sc := bufio.NewScanner(io.LimitReader(rc, 4<<20))
	for sc.Scan() {
		f := strings.Split(sc.Text(), ":")
		if len(f) > 0 && match(f) {
			return f, true
		}
	}
	return nil, false
}

package gvisor

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	specs "github.com/opencontainers/runtime-spec/specs-go"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// execPrivate runs p as a private run: a subcontainer of its own in the
// sandbox's Sentry, on the sandbox's rootfs with its mounts, whose pid
// namespace is beside the sandbox's (see the package comment). Its init is
// the command, pid 1 there; when it exits the Sentry kills what it left.
// No terminal: its stdio are pipes.
func (g *GVisor) execPrivate(ctx context.Context, id string, p sandbox.Process) (sandbox.Proc, error) {
	if p.TTY {
		return nil, errdefs.Precondition("a private run has no terminal")
	}
	m := g.meta(id)
	if !m.Split {
		return nil, errdefs.Precondition("gvisor sandbox %s was made by a dsec without private runs (its commands share the Sentry's root pid namespace): recreate it for them", id)
	}
	var spec specs.Spec
	b, err := os.ReadFile(g.specPath(id))
	if err == nil {
		err = json.Unmarshal(b, &spec)
	}
	if err != nil || spec.Linux == nil {
		return nil, fmt.Errorf("reading the sandbox's OCI spec: %v", err)
	}
	// Random, not counted: one left by an edge that died mid-run keeps
	// its name until the sandbox goes.
	var rnd [6]byte
	_, _ = rand.Read(rnd[:])
	cid := "p" + hex.EncodeToString(rnd[:]) + "-" + id
	dir := filepath.Join(g.cfg.StateRoot, "private", cid)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("creating private run bundle: %w", err)
	}
	spec.Process = g.process(p)
	// A subcontainer's init gets its own spec's rlimits: the sandbox's.
	spec.Process.Rlimits = rlimits(m.Pids)
	if err := writeSpec(dir, subcontainer(&spec, id)); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	pr := &privateProc{g: g, cid: cid, dir: dir, done: make(chan struct{})}
	pr.waitCtx, pr.cancelWait = context.WithCancel(context.Background())
	if err := pr.start(ctx, p); err != nil {
		pr.remove()
		return nil, fmt.Errorf("starting private run: %w", err)
	}
	return pr, nil
}

// privateProc is a private run: its container, and the copies of its
// stdio.
type privateProc struct {
	g   *GVisor
	cid string
	dir string

	copies sync.WaitGroup
	// outs are the read ends of its stdout and stderr, closed once
	// copied (or given up on, copyGrace after it exited).
	outs []*os.File
	done chan struct{}
	// waitCtx bounds runsc wait: Kill ends it if the run does not end
	// after its SIGKILL (a Sentry that hangs).
	waitCtx    context.Context
	cancelWait context.CancelFunc

	once sync.Once
	code int
	err  error
}

// copyGrace bounds the wait for a private run's output once it has
// exited (its processes are gone; the Sentry closes their pipes).
const copyGrace = time.Second

// start creates and starts the container with pipes for stdio, copied to
// and from p's.
func (pr *privateProc) start(ctx context.Context, p sandbox.Process) error {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), runscTimeout)
	defer cancel()
	logPath := filepath.Join(pr.dir, "runsc.log")
	logFlags := []string{"--log", logPath, "--log-format", "json"}
	if _, err := pr.g.run(rctx, append(logFlags, "create", "--bundle", pr.dir, pr.cid)...); err != nil {
		return fmt.Errorf("runsc create: %w: %s", err, logErrors(logPath))
	}
	inR, inW, err := os.Pipe()
	if err != nil {
		return err
	}
	var ends []*os.File // the container's ends, closed here once it has them
	defer func() {
		for _, f := range ends {
			f.Close()
		}
	}()
	ends = append(ends, inR)
	for _, w := range []io.Writer{p.Stdout, p.Stderr} {
		r, wf, err := os.Pipe()
		if err != nil {
			inW.Close()
			pr.closeOuts()
			return err
		}
		ends = append(ends, wf)
		pr.outs = append(pr.outs, r)
		if w == nil {
			w = io.Discard
		}
		pr.copies.Add(1)
		go func() {
			defer pr.copies.Done()
			_, _ = io.Copy(w, r)
		}()
	}
	cmd := pr.g.command(rctx, append(logFlags, "start", pr.cid)...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = ends[0], ends[1], ends[2]
	if err := cmd.Run(); err != nil {
		inW.Close()
		pr.closeOuts()
		return fmt.Errorf("runsc start: %w: %s", err, logErrors(logPath))
	}
	go func() {
		if p.Stdin != nil {
			_, _ = io.Copy(inW, p.Stdin)
		}
		inW.Close()
	}()
	return nil
}

func (pr *privateProc) closeOuts() {
	for _, r := range pr.outs {
		r.Close()
	}
}

// Wait implements sandbox.Proc: runsc wait gives the init's exit status;
// then the container is deleted in the background.
func (pr *privateProc) Wait() (int, error) {
	pr.once.Do(func() {
		defer close(pr.done)
		defer pr.cancelWait()
		out, err := pr.g.run(pr.waitCtx, "wait", pr.cid)
		var st struct {
			ExitStatus int `json:"exitStatus"`
		}
		if err == nil {
			err = json.Unmarshal(out, &st)
		}
		if err != nil {
			pr.code, pr.err = -1, fmt.Errorf("waiting for private run: %w", err)
		} else {
			pr.code = st.ExitStatus
		}
		copied := make(chan struct{})
		go func() { pr.copies.Wait(); close(copied) }()
		select {
		case <-copied:
		case <-time.After(copyGrace):
			// Closing the read ends ends the copies: none writes after
			// Wait has returned.
			pr.closeOuts()
			<-copied
		}
		pr.closeOuts()
		go pr.remove()
	})
	return pr.code, pr.err
}

// remove deletes the container (its gofer, its mounts in the Sentry, its
// state) and its bundle.
func (pr *privateProc) remove() {
	ctx, cancel := context.WithTimeout(context.Background(), runscTimeout)
	defer cancel()
	if _, err := pr.g.run(ctx, "delete", "--force", pr.cid); err != nil && !strings.Contains(err.Error(), "does not exist") {
		pr.g.log.Debug("deleting a private run's container", "container", pr.cid, "err", err)
	}
	_ = os.RemoveAll(pr.dir)
}

// Kill implements sandbox.Proc: SIGKILL to every process of the
// container (the init's exit would end the rest).
func (pr *privateProc) Kill() error {
	select {
	case <-pr.done:
		return nil
	default:
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := pr.g.run(ctx, "kill", "--all", pr.cid, "9")
	// Its wait ends with it; if it does not (a Sentry that hangs), the
	// wait is given up after a while, so that no caller waits for ever.
	go func() {
		select {
		case <-pr.done:
		case <-time.After(killGrace):
			pr.cancelWait()
		}
	}()
	if err != nil && (strings.Contains(err.Error(), "no such process") || strings.Contains(err.Error(), "stopped")) {
		return nil
	}
	return err
}

// killGrace is how long Kill lets a private run's wait go on after its
// SIGKILL before it ends the wait.
const killGrace = 10 * time.Second

// removeOrphans deletes the containers of private runs an edge that died
// left (their bundles are in dir): each runs on, unwaited for, until its
// sandbox goes otherwise.
func (g *GVisor) removeOrphans(dir string) {
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		pr := &privateProc{g: g, cid: e.Name(), dir: filepath.Join(dir, e.Name())}
		pr.remove()
	}
}

// Pid implements sandbox.Proc: no host pid.
func (pr *privateProc) Pid() int { return 0 }

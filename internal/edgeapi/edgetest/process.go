package edgetest

import (
	"context"
	"sort"
	"strings"
	"sync"

	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// The fake's processes. Canned behaviours, by argv[0]:
//   - "echo" writes its arguments to stdout and exits 0;
//   - "fail" writes its arguments to stderr and exits 3;
//   - "cat" echoes its input (stdin or terminal) to stdout (pty under a
//     terminal) until its stdin is closed, then exits 0;
//   - anything else runs until it is signalled (exit 128+signal).
// Pids count from 100 per fake.

type fakeProc struct {
	info edgeapi.ProcessInfo
	mu   sync.Mutex
	subs []chan edgeapi.ProcessEvent
	done chan struct{}
	end  edgeapi.ProcessEnd
}

func (p *fakeProc) attach() (chan edgeapi.ProcessEvent, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.done:
		return nil, false
	default:
	}
	ch := make(chan edgeapi.ProcessEvent, 64)
	p.subs = append(p.subs, ch)
	return ch, true
}

func (p *fakeProc) publish(ev edgeapi.ProcessEvent) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, ch := range p.subs {
		select {
		case ch <- ev:
		default:
		}
	}
}

func (p *fakeProc) finish(code int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.done:
		return
	default:
	}
	p.end = edgeapi.ProcessEnd{ExitCode: code, Exited: code < 128, Status: "fake"}
	close(p.done)
	for _, ch := range p.subs {
		close(ch)
	}
	p.subs = nil
}

func (p *fakeProc) output(b []byte) edgeapi.ProcessEvent {
	if p.info.PTY {
		return edgeapi.ProcessEvent{PTY: b}
	}
	return edgeapi.ProcessEvent{Stdout: b}
}

func (f *Fake) proc(ctx context.Context, id string, sel edgeapi.ProcessSelector) (*fakeProc, error) {
	if _, err := f.Get(ctx, id); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, p := range f.procs[id] {
		if sel.PID > 0 && p.info.PID == sel.PID || sel.PID == 0 && sel.Tag != "" && p.info.Tag == sel.Tag {
			return p, nil
		}
	}
	return nil, errdefs.NotFound("no process %+v in sandbox %s", sel, id)
}

func follow(ctx context.Context, p *fakeProc, ch chan edgeapi.ProcessEvent, emit func(edgeapi.ProcessEvent) error) error {
	if err := emit(edgeapi.ProcessEvent{Start: &edgeapi.ProcessStarted{PID: p.info.PID}}); err != nil {
		return err
	}
	for ch != nil {
		select {
		case ev, ok := <-ch:
			if !ok {
				ch = nil
				continue
			}
			if err := emit(ev); err != nil {
				return err
			}
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	end := p.end
	return emit(edgeapi.ProcessEvent{End: &end})
}

// StartProcess implements edgeapi.Edge.
func (f *Fake) StartProcess(ctx context.Context, id string, req edgeapi.ProcessRequest, emit func(edgeapi.ProcessEvent) error) error {
	if _, err := f.Get(ctx, id); err != nil {
		return err
	}
	if len(req.Argv) == 0 {
		return errdefs.Invalid("argv must name a command")
	}
	f.mu.Lock()
	if f.procs == nil {
		f.procs = map[string][]*fakeProc{}
	}
	f.pids++
	p := &fakeProc{info: edgeapi.ProcessInfo{PID: 99 + f.pids, Tag: req.Tag, Argv: req.Argv, Env: req.Env, Cwd: req.Cwd, PTY: req.PTY != nil}, done: make(chan struct{})}
	f.procs[id] = append(f.procs[id], p)
	f.mu.Unlock()
	ch, _ := p.attach()
	switch req.Argv[0] {
	case "echo":
		p.publish(p.output([]byte(strings.Join(req.Argv[1:], " ") + "\n")))
		p.finish(0)
	case "fail":
		p.publish(edgeapi.ProcessEvent{Stderr: []byte(strings.Join(req.Argv[1:], " ") + "\n")})
		p.finish(3)
	}
	return follow(ctx, p, ch, emit)
}

// ConnectProcess implements edgeapi.Edge.
func (f *Fake) ConnectProcess(ctx context.Context, id string, sel edgeapi.ProcessSelector, emit func(edgeapi.ProcessEvent) error) error {
	p, err := f.proc(ctx, id, sel)
	if err != nil {
		return err
	}
	ch, _ := p.attach()
	return follow(ctx, p, ch, emit)
}

// ListProcesses implements edgeapi.Edge.
func (f *Fake) ListProcesses(ctx context.Context, id string) ([]edgeapi.ProcessInfo, error) {
	if _, err := f.Get(ctx, id); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	out := []edgeapi.ProcessInfo{}
	for _, p := range f.procs[id] {
		select {
		case <-p.done:
		default:
			out = append(out, p.info)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].PID < out[j].PID })
	return out, nil
}

// ProcessInput implements edgeapi.Edge.
func (f *Fake) ProcessInput(ctx context.Context, id string, sel edgeapi.ProcessSelector, data []byte) error {
	p, err := f.proc(ctx, id, sel)
	if err != nil {
		return err
	}
	if p.info.Argv[0] == "cat" {
		p.publish(p.output(append([]byte(nil), data...)))
	}
	return nil
}

// CloseProcessStdin implements edgeapi.Edge.
func (f *Fake) CloseProcessStdin(ctx context.Context, id string, sel edgeapi.ProcessSelector) error {
	p, err := f.proc(ctx, id, sel)
	if err != nil {
		return err
	}
	if p.info.Argv[0] == "cat" {
		p.finish(0)
	}
	return nil
}

// SignalProcess implements edgeapi.Edge.
func (f *Fake) SignalProcess(ctx context.Context, id string, sel edgeapi.ProcessSelector, signal int) error {
	p, err := f.proc(ctx, id, sel)
	if err != nil {
		return err
	}
	p.finish(128 + signal)
	return nil
}

// ResizeProcess implements edgeapi.Edge.
func (f *Fake) ResizeProcess(ctx context.Context, id string, sel edgeapi.ProcessSelector, size edgeapi.PTYSize) error {
	p, err := f.proc(ctx, id, sel)
	if err != nil {
		return err
	}
	if !p.info.PTY {
		return errdefs.Precondition("process %d has no terminal", p.info.PID)
	}
	return nil
}

package apiserver

// envd's process service (E2B's process.Process over Connect RPC), mapped
// onto the edges' processes (edgeapi.Edge.StartProcess and the rest).
//
// Lifetime: a process started here is not bound to its stream. The
// Connect-Timeout-Ms header the SDK sends (its timeoutMs, 60 s by
// default; 0 for none) bounds the process itself: when it passes, the
// process's tree is killed and the stream ends with deadline_exceeded.
// Closing the stream earlier (the SDK's disconnect) leaves the process
// running; commands.connect attaches again.

import (
	"context"
	"errors"
	"net/http"
	"strconv"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/e2b/processpb"
	"github.com/dsecproject/dsec/internal/e2b/processpb/processpbconnect"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
)

func (s *Server) envdProcessRoutes() {
	path, h := processpbconnect.NewProcessHandler(&envdProcess{s: s}, connect.WithReadMaxBytes(4<<20))
	s.envdHandle(path, h, s.connectError)
}

// envdProcess implements processpbconnect.ProcessHandler.
type envdProcess struct {
	processpbconnect.UnimplementedProcessHandler
	s *Server
}

var _ processpbconnect.ProcessHandler = (*envdProcess)(nil)

// fail makes err (nil: none) a Connect error.
func (p *envdProcess) fail(ctx context.Context, err error) error {
	if err == nil {
		return nil
	}
	return p.s.toConnect(ctx, "process", err)
}

// processTimeout is the process's lifetime the request asks for.
func processTimeout(h http.Header) (int64, error) {
	v := h.Get("Connect-Timeout-Ms")
	if v == "" {
		return 0, nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 0 {
		return 0, errdefs.Invalid("Connect-Timeout-Ms=%q is not a number of milliseconds", v)
	}
	return n, nil
}

// toProcessEvent maps an edge event to envd's.
func toProcessEvent(ev edgeapi.ProcessEvent) *processpb.ProcessEvent {
	switch {
	case ev.Start != nil:
		return &processpb.ProcessEvent{Event: &processpb.ProcessEvent_Start{Start: &processpb.ProcessEvent_StartEvent{Pid: uint32(ev.Start.PID)}}}
	case ev.End != nil:
		end := &processpb.ProcessEvent_EndEvent{ExitCode: int32(ev.End.ExitCode), Exited: ev.End.Exited, Status: ev.End.Status}
		if ev.End.Error != "" {
			end.Error = &ev.End.Error
		}
		return &processpb.ProcessEvent{Event: &processpb.ProcessEvent_End{End: end}}
	case ev.PTY != nil:
		return dataEvent(&processpb.ProcessEvent_DataEvent{Output: &processpb.ProcessEvent_DataEvent_Pty{Pty: ev.PTY}})
	case ev.Stderr != nil:
		return dataEvent(&processpb.ProcessEvent_DataEvent{Output: &processpb.ProcessEvent_DataEvent_Stderr{Stderr: ev.Stderr}})
	default:
		return dataEvent(&processpb.ProcessEvent_DataEvent{Output: &processpb.ProcessEvent_DataEvent_Stdout{Stdout: ev.Stdout}})
	}
}

func dataEvent(d *processpb.ProcessEvent_DataEvent) *processpb.ProcessEvent {
	return &processpb.ProcessEvent{Event: &processpb.ProcessEvent_Data{Data: d}}
}

// stream runs an edge stream call, sending its events (and keepalives)
// with send. A stream that ends because the Connect deadline passed
// answers deadline_exceeded.
func (p *envdProcess) stream(ctx context.Context, h http.Header, send func(*processpb.ProcessEvent) error,
	run func(ctx context.Context, emit func(edgeapi.ProcessEvent) error) error) error {
	ss := newStreamSender(ctx, h, send, func() *processpb.ProcessEvent {
		return &processpb.ProcessEvent{Event: &processpb.ProcessEvent_Keepalive{Keepalive: &processpb.ProcessEvent_KeepAlive{}}}
	})
	defer ss.Stop()
	err := run(ctx, func(ev edgeapi.ProcessEvent) error {
		if err := ss.Send(toProcessEvent(ev)); err != nil {
			return err
		}
		if ev.Start != nil {
			ss.Start()
		}
		return nil
	})
	ss.Stop()
	if err != nil && errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return connect.NewError(connect.CodeDeadlineExceeded, errors.New("the command's timeout passed: it was killed"))
	}
	return p.fail(ctx, err)
}

func (p *envdProcess) Start(ctx context.Context, req *connect.Request[processpb.StartRequest], st *connect.ServerStream[processpb.StartResponse]) error {
	e, id, err := p.s.envdEdge(ctx)
	if err != nil {
		return p.fail(ctx, err)
	}
	user, err := basicUser(req.Header())
	if err != nil {
		return p.fail(ctx, err)
	}
	timeout, err := processTimeout(req.Header())
	if err != nil {
		return p.fail(ctx, err)
	}
	m := req.Msg
	if m.GetProcess() == nil || m.GetProcess().GetCmd() == "" {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("process.cmd is required"))
	}
	pr := edgeapi.ProcessRequest{
		Argv:      append([]string{m.GetProcess().GetCmd()}, m.GetProcess().GetArgs()...),
		Env:       m.GetProcess().GetEnvs(),
		Cwd:       m.GetProcess().GetCwd(),
		User:      user,
		CwdHome:   true,
		Tag:       m.GetTag(),
		Stdin:     m.GetStdin(),
		TimeoutMS: timeout,
	}
	if m.Pty != nil {
		sz := m.GetPty().GetSize()
		pr.PTY = &edgeapi.PTYSize{Cols: clampSize(sz.GetCols()), Rows: clampSize(sz.GetRows())}
	}
	send := func(ev *processpb.ProcessEvent) error { return st.Send(&processpb.StartResponse{Event: ev}) }
	// The headers go now, while the command starts (milliseconds in a
	// sandbox): the SDK's client spends about as long taking them in.
	// A failure from here on is told in the stream's end, as Connect
	// streams tell any.
	if err := st.Send(nil); err != nil {
		return p.fail(ctx, err)
	}
	return p.stream(ctx, req.Header(), send, func(ctx context.Context, emit func(edgeapi.ProcessEvent) error) error {
		return e.StartProcess(ctx, id, pr, emit)
	})
}

// clampSize makes a terminal dimension fit the edge's type; the edge
// refuses 0 and anything past 4096.
func clampSize(v uint32) uint16 { return uint16(min(v, 65535)) }

func selector(sel *processpb.ProcessSelector) (edgeapi.ProcessSelector, error) {
	switch v := sel.GetSelector().(type) {
	case *processpb.ProcessSelector_Pid:
		if v.Pid == 0 {
			return edgeapi.ProcessSelector{}, connect.NewError(connect.CodeInvalidArgument, errors.New("pid 0 names no process"))
		}
		return edgeapi.ProcessSelector{PID: int(v.Pid)}, nil
	case *processpb.ProcessSelector_Tag:
		if v.Tag == "" {
			return edgeapi.ProcessSelector{}, connect.NewError(connect.CodeInvalidArgument, errors.New("an empty tag names no process"))
		}
		return edgeapi.ProcessSelector{Tag: v.Tag}, nil
	}
	return edgeapi.ProcessSelector{}, connect.NewError(connect.CodeInvalidArgument, errors.New("name the process by pid or tag"))
}

// target finds the edge and sandbox of a call on one process, and the
// process.
func (p *envdProcess) target(ctx context.Context, ps *processpb.ProcessSelector) (edgeapi.Edge, string, edgeapi.ProcessSelector, error) {
	sel, err := selector(ps)
	if err != nil {
		return nil, "", sel, err
	}
	e, id, err := p.s.envdEdge(ctx)
	if err != nil {
		return nil, "", sel, p.fail(ctx, err)
	}
	return e, id, sel, nil
}

func (p *envdProcess) Connect(ctx context.Context, req *connect.Request[processpb.ConnectRequest], st *connect.ServerStream[processpb.ConnectResponse]) error {
	e, id, err := p.s.envdEdge(ctx)
	if err != nil {
		return p.fail(ctx, err)
	}
	sel, err := selector(req.Msg.GetProcess())
	if err != nil {
		return err
	}
	send := func(ev *processpb.ProcessEvent) error { return st.Send(&processpb.ConnectResponse{Event: ev}) }
	return p.stream(ctx, req.Header(), send, func(ctx context.Context, emit func(edgeapi.ProcessEvent) error) error {
		return e.ConnectProcess(ctx, id, sel, emit)
	})
}

func (p *envdProcess) List(ctx context.Context, req *connect.Request[processpb.ListRequest]) (*connect.Response[processpb.ListResponse], error) {
	e, id, err := p.s.envdEdge(ctx)
	if err != nil {
		return nil, p.fail(ctx, err)
	}
	l, err := e.ListProcesses(ctx, id)
	if err != nil {
		return nil, p.fail(ctx, err)
	}
	out := &processpb.ListResponse{Processes: make([]*processpb.ProcessInfo, 0, len(l))}
	for _, pi := range l {
		info := &processpb.ProcessInfo{Pid: uint32(pi.PID), Config: &processpb.ProcessConfig{Envs: pi.Env}}
		if len(pi.Argv) > 0 {
			info.Config.Cmd, info.Config.Args = pi.Argv[0], pi.Argv[1:]
		}
		if pi.Cwd != "" {
			cwd := pi.Cwd
			info.Config.Cwd = &cwd
		}
		if pi.Tag != "" {
			tag := pi.Tag
			info.Tag = &tag
		}
		out.Processes = append(out.Processes, info)
	}
	return connect.NewResponse(out), nil
}

func (p *envdProcess) SendInput(ctx context.Context, req *connect.Request[processpb.SendInputRequest]) (*connect.Response[processpb.SendInputResponse], error) {
	e, id, sel, err := p.target(ctx, req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	var data []byte
	switch v := req.Msg.GetInput().GetInput().(type) {
	case *processpb.ProcessInput_Stdin:
		data = v.Stdin
	case *processpb.ProcessInput_Pty:
		data = v.Pty
	default:
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("input must be stdin or pty"))
	}
	if err := e.ProcessInput(ctx, id, sel, data); err != nil {
		return nil, p.fail(ctx, err)
	}
	return connect.NewResponse(&processpb.SendInputResponse{}), nil
}

func (p *envdProcess) SendSignal(ctx context.Context, req *connect.Request[processpb.SendSignalRequest]) (*connect.Response[processpb.SendSignalResponse], error) {
	e, id, sel, err := p.target(ctx, req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	var sig int
	switch req.Msg.GetSignal() {
	case processpb.Signal_SIGNAL_SIGKILL:
		sig = int(unix.SIGKILL)
	case processpb.Signal_SIGNAL_SIGTERM:
		sig = int(unix.SIGTERM)
	default:
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("signal must be SIGTERM or SIGKILL"))
	}
	if err := e.SignalProcess(ctx, id, sel, sig); err != nil {
		return nil, p.fail(ctx, err)
	}
	return connect.NewResponse(&processpb.SendSignalResponse{}), nil
}

func (p *envdProcess) CloseStdin(ctx context.Context, req *connect.Request[processpb.CloseStdinRequest]) (*connect.Response[processpb.CloseStdinResponse], error) {
	e, id, sel, err := p.target(ctx, req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if err := e.CloseProcessStdin(ctx, id, sel); err != nil {
		return nil, p.fail(ctx, err)
	}
	return connect.NewResponse(&processpb.CloseStdinResponse{}), nil
}

func (p *envdProcess) Update(ctx context.Context, req *connect.Request[processpb.UpdateRequest]) (*connect.Response[processpb.UpdateResponse], error) {
	e, id, sel, err := p.target(ctx, req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if req.Msg.Pty != nil {
		sz := req.Msg.GetPty().GetSize()
		if err := e.ResizeProcess(ctx, id, sel, edgeapi.PTYSize{Cols: clampSize(sz.GetCols()), Rows: clampSize(sz.GetRows())}); err != nil {
			return nil, p.fail(ctx, err)
		}
	}
	return connect.NewResponse(&processpb.UpdateResponse{}), nil
}

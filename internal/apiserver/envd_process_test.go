package apiserver

import (
	"bytes"
	"context"
	"github.com/dsecproject/dsec/internal/store"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/dsecproject/dsec/internal/e2b/processpb"
	"github.com/dsecproject/dsec/internal/e2b/processpb/processpbconnect"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/watcher"
)

// envdClient returns a Connect client of the process service that names
// sandbox id with token, speaking JSON as the E2B SDK does.
func (f *fixture) envdProcessClient(id, token string) processpbconnect.ProcessClient {
	hc := &http.Client{Transport: headerTransport{"E2b-Sandbox-Id": id, "X-Access-Token": token, "Keepalive-Ping-Interval": "1"}}
	return processpbconnect.NewProcessClient(hc, f.srv.URL, connect.WithProtoJSON())
}

type headerTransport map[string]string

func (h headerTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	for k, v := range h {
		if v != "" {
			r.Header.Set(k, v)
		}
	}
	return http.DefaultTransport.RoundTrip(r)
}

func (f *fixture) sandboxFor(t testing.TB) string {
	t.Helper()
	resp, b := f.do(t, f.admin, "POST", "/v1/sandboxes", `{"base":"base/py:1"}`)
	if resp.StatusCode != 201 {
		t.Fatalf("create: %d %s", resp.StatusCode, b)
	}
	return strings.Split(strings.Split(string(b), `"id":"`)[1], `"`)[0]
}

func TestEnvdProcessNeedsTheSandboxToken(t *testing.T) {
	f := newFixture(t, false)
	a, b := f.sandboxFor(t), f.sandboxFor(t)
	for _, tc := range []struct{ name, token string }{
		{"none", ""}, {"another sandbox's", f.envdTokenOf(t, b)}, {"made up", "AAAA"},
	} {
		c := f.envdProcessClient(a, tc.token)
		_, err := c.List(t.Context(), connect.NewRequest(&processpb.ListRequest{}))
		if connect.CodeOf(err) != connect.CodeUnauthenticated {
			t.Errorf("%s token: %v, want unauthenticated", tc.name, err)
		}
		st, err := c.Start(t.Context(), connect.NewRequest(&processpb.StartRequest{Process: &processpb.ProcessConfig{Cmd: "echo", Args: []string{"x"}}}))
		if err == nil {
			for st.Receive() {
				t.Errorf("%s token: a process event came: %v", tc.name, st.Msg())
			}
			err = st.Err()
		}
		if connect.CodeOf(err) != connect.CodeUnauthenticated {
			t.Errorf("%s token: start: %v, want unauthenticated", tc.name, err)
		}
	}
	if l, _ := f.edge.ListProcesses(t.Context(), a); len(l) != 0 {
		t.Errorf("refused calls started processes: %v", l)
	}
	// No sandbox named at all.
	_, err := f.envdProcessClient("", "x").List(t.Context(), connect.NewRequest(&processpb.ListRequest{}))
	if connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("no sandbox header: %v, want invalid_argument", err)
	}
}

func TestEnvdProcessStream(t *testing.T) {
	bothWays(t, func(t *testing.T, f *fixture) {
		id := f.sandboxFor(t)
		c := f.envdProcessClient(id, f.envdTokenOf(t, id))
		ctx := t.Context()
		// Start: start first, then output, then the end.
		st, err := c.Start(ctx, connect.NewRequest(&processpb.StartRequest{Process: &processpb.ProcessConfig{Cmd: "fail", Args: []string{"oops"}}}))
		if err != nil {
			t.Fatal(err)
		}
		var kinds []string
		var stderr string
		var code int32 = -1
		for st.Receive() {
			switch e := st.Msg().GetEvent().GetEvent().(type) {
			case *processpb.ProcessEvent_Start:
				kinds = append(kinds, "start")
			case *processpb.ProcessEvent_Data:
				kinds = append(kinds, "data")
				stderr += string(e.Data.GetStderr())
			case *processpb.ProcessEvent_End:
				kinds = append(kinds, "end")
				code = e.End.GetExitCode()
			}
		}
		if err := st.Err(); err != nil {
			t.Fatal(err)
		}
		if strings.Join(kinds, ",") != "start,data,end" || stderr != "oops\n" || code != 3 {
			t.Fatalf("events %v, stderr %q, exit %d; want start,data,end, oops, 3", kinds, stderr, code)
		}

		// A process with stdin, tagged: input, connect by tag, list, close.
		tag := "svc"
		bg, err := c.Start(ctx, connect.NewRequest(&processpb.StartRequest{Process: &processpb.ProcessConfig{Cmd: "cat"}, Tag: &tag, Stdin: optional(true)}))
		if err != nil {
			t.Fatal(err)
		}
		if !bg.Receive() || bg.Msg().GetEvent().GetStart() == nil {
			t.Fatalf("first event %v, %v; want start", bg.Msg(), bg.Err())
		}
		pid := bg.Msg().GetEvent().GetStart().GetPid()
		bg.Close() // detach: the process goes on
		l, err := c.List(ctx, connect.NewRequest(&processpb.ListRequest{}))
		if err != nil || len(l.Msg.GetProcesses()) != 1 || l.Msg.GetProcesses()[0].GetPid() != pid || l.Msg.GetProcesses()[0].GetTag() != "svc" {
			t.Fatalf("list: %v %v; want pid %d tagged svc", l, err, pid)
		}
		conn, err := c.Connect(ctx, connect.NewRequest(&processpb.ConnectRequest{Process: &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Tag{Tag: "svc"}}}))
		if err != nil {
			t.Fatal(err)
		}
		if !conn.Receive() || conn.Msg().GetEvent().GetStart().GetPid() != pid {
			t.Fatalf("connect: first event %v, %v", conn.Msg(), conn.Err())
		}
		sel := &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: pid}}
		if _, err := c.SendInput(ctx, connect.NewRequest(&processpb.SendInputRequest{Process: sel, Input: &processpb.ProcessInput{Input: &processpb.ProcessInput_Stdin{Stdin: []byte("hello")}}})); err != nil {
			t.Fatal(err)
		}
		got := ""
		for got == "" && conn.Receive() {
			got = string(conn.Msg().GetEvent().GetData().GetStdout())
		}
		if got != "hello" {
			t.Fatalf("echoed %q, want hello (%v)", got, conn.Err())
		}
		if _, err := c.CloseStdin(ctx, connect.NewRequest(&processpb.CloseStdinRequest{Process: sel})); err != nil {
			t.Fatal(err)
		}
		ended := false
		for conn.Receive() {
			ended = ended || conn.Msg().GetEvent().GetEnd() != nil
		}
		if !ended || conn.Err() != nil {
			t.Fatalf("no end after close-stdin: %v", conn.Err())
		}

		// A silent process gets keepalives; SIGKILL ends it.
		quiet, err := c.Start(ctx, connect.NewRequest(&processpb.StartRequest{Process: &processpb.ProcessConfig{Cmd: "sleep"}}))
		if err != nil {
			t.Fatal(err)
		}
		quiet.Receive()
		qpid := quiet.Msg().GetEvent().GetStart().GetPid()
		deadline := time.Now().Add(5 * time.Second)
		for quiet.Receive() {
			if quiet.Msg().GetEvent().GetKeepalive() != nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("no keepalive")
			}
		}
		if _, err := c.SendSignal(ctx, connect.NewRequest(&processpb.SendSignalRequest{
			Process: &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: qpid}}, Signal: processpb.Signal_SIGNAL_SIGKILL})); err != nil {
			t.Fatal(err)
		}
		for quiet.Receive() {
			if e := quiet.Msg().GetEvent().GetEnd(); e != nil && e.GetExitCode() != 137 {
				t.Errorf("killed: exit %d, want 137", e.GetExitCode())
			}
		}

		// Errors keep their class: an unknown pid is not found.
		_, err = c.SendInput(ctx, connect.NewRequest(&processpb.SendInputRequest{Process: &processpb.ProcessSelector{Selector: &processpb.ProcessSelector_Pid{Pid: 4242}},
			Input: &processpb.ProcessInput{Input: &processpb.ProcessInput_Stdin{Stdin: []byte("x")}}}))
		if connect.CodeOf(err) != connect.CodeNotFound {
			t.Errorf("input to pid 4242: %v, want not_found", err)
		}
		// An unknown sandbox with its own (valid) token: not found, not a crash.
		ghost := "sb-n1-ghost"
		_, err = f.envdProcessClient(ghost, f.envdTokenOf(t, ghost)).List(ctx, connect.NewRequest(&processpb.ListRequest{}))
		if connect.CodeOf(err) != connect.CodeNotFound {
			t.Errorf("list of a missing sandbox: %v, want not_found", err)
		}
	})
}

func TestEnvdProcessBadEnvelopes(t *testing.T) {
	f := newFixture(t, false)
	id := f.sandboxFor(t)
	tok := f.envdTokenOf(t, id)
	for _, tc := range []struct{ ctype, body string }{
		{"application/connect+json", "\x00\x00\x00\x00\x10{}"},                // length past the body
		{"application/connect+json", "\x00\xff\xff\xff\xff{}"},                // 4 GiB frame
		{"application/connect+json", "\x00\x00\x00\x00\x02[]"},                // not an object
		{"application/connect+json", `{"process":{"cmd":"echo"}}`},            // no envelope
		{"text/plain", "hello"},                                               // wrong type
		{"application/connect+json", "\x01\x00\x00\x00\x02{}"},                // compressed flag, no encoding
		{"application/connect+json", "\x00\x00\x00\x00\x0f{\"process\":7}xx"}, // wrong field type
	} {
		req, _ := http.NewRequest("POST", f.srv.URL+"/process.Process/Start", strings.NewReader(tc.body))
		req.Header.Set("Content-Type", tc.ctype)
		req.Header.Set("E2b-Sandbox-Id", id)
		req.Header.Set("X-Access-Token", tok)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode == 200 && !strings.Contains(string(b), `"error"`) || resp.StatusCode >= 500 {
			t.Errorf("%s %q: %d %s; want a Connect error", tc.ctype, tc.body, resp.StatusCode, b)
		}
	}
	if l, _ := f.edge.ListProcesses(context.Background(), id); len(l) != 0 {
		t.Errorf("bad envelopes started processes: %v", l)
	}
}

func optional[T any](v T) *T { return &v }

// The token secret lives in the durable state store, not in the records'
// store (dsec up's is not fsynced).
func TestE2BSecretIsDurableState(t *testing.T) {
	records, state := store.NewMemory(), store.NewMemory()
	s := New(Deps{Store: records, StateStore: state, Log: slog.New(slog.DiscardHandler)})
	tok, err := s.envdToken("sb-n1-a")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := state.Get(e2bBucket, "token-secret"); err != nil {
		t.Fatalf("no secret in the state store: %v", err)
	}
	if _, err := records.Get(e2bBucket, "token-secret"); err == nil {
		t.Fatal("the secret went to the records' store")
	}
	// Another apiserver over the same state agrees.
	again, _ := New(Deps{Store: store.NewMemory(), StateStore: state, Log: slog.New(slog.DiscardHandler)}).envdToken("sb-n1-a")
	if again != tok {
		t.Fatal("two apiservers over one state store disagree on a token")
	}
}

// slowStartEdge starts processes only once gate is closed, as a sandbox
// takes milliseconds to.
type slowStartEdge struct {
	edgeapi.Edge
	gate chan struct{}
}

func (e *slowStartEdge) StartProcess(ctx context.Context, id string, req edgeapi.ProcessRequest, emit func(edgeapi.ProcessEvent) error) error {
	select {
	case <-e.gate:
	case <-ctx.Done():
		return ctx.Err()
	}
	return e.Edge.StartProcess(ctx, id, req, emit)
}

// TestProcessStartSendsHeadersAtOnce: Process/Start answers its headers
// before the command has started, and its first frame is still the start
// event.
func TestProcessStartSendsHeadersAtOnce(t *testing.T) {
	f := newFixture(t, false)
	slow := &slowStartEdge{Edge: f.edge, gate: make(chan struct{})}
	release := sync.OnceFunc(func() { close(slow.gate) })
	view := watcher.New(watcher.Static{slow}, watcher.Config{})
	view.Sync(t.Context())
	srv := f.apiserverWith(t, "b", func(d *Deps) { d.Nodes = view })
	t.Cleanup(release)
	id := f.sandboxFor(t)
	msg := []byte(`{"process":{"cmd":"echo","args":["hi"]}}`)
	body := append([]byte{0, 0, 0, 0, byte(len(msg))}, msg...)
	req, _ := http.NewRequest("POST", srv.URL+"/process.Process/Start", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/connect+json")
	req.Header.Set("E2b-Sandbox-Id", id)
	req.Header.Set("X-Access-Token", f.envdTokenOf(t, id))
	type answer struct {
		resp *http.Response
		err  error
	}
	got := make(chan answer, 1)
	go func() {
		resp, err := http.DefaultClient.Do(req)
		got <- answer{resp, err}
	}()
	var a answer
	select {
	case a = <-got:
	case <-time.After(5 * time.Second):
		t.Fatal("no headers while the command was starting")
	}
	if a.err != nil {
		t.Fatal(a.err)
	}
	defer a.resp.Body.Close()
	if a.resp.StatusCode != 200 || a.resp.Header.Get("Content-Type") != "application/connect+json" {
		t.Fatalf("answer: %d %v", a.resp.StatusCode, a.resp.Header)
	}
	release()
	frames, err := io.ReadAll(a.resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if len(frames) < 5 || frames[0] != 0 || !bytes.Contains(frames[5:], []byte(`{"event":{"start":{"pid":`)) || !bytes.HasPrefix(frames[5:], []byte(`{"event":{"start"`)) {
		t.Fatalf("first frame is not the start event: %q", frames)
	}
}

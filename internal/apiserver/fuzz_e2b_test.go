package apiserver

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// The E2B surfaces, fuzzed through the real handler chain (an httptest
// server over the fake edge): the control plane's create body as the E2B
// SDK sends it, and envd's Connect procedures with any envelope, in each
// of the content types Connect serves. A refusal must be a client error
// (4xx, a Connect error; 501 for a procedure dsec does not serve), never
// a 5xx (an error nobody classified) or a broken connection (a panic).

// FuzzE2BCreate posts a body to POST /v2/sandboxes. An accepted sandbox
// carries the metadata it was given as labels and the template label,
// and no metadata key of dsec's own.
func FuzzE2BCreate(f *testing.F) {
	for _, s := range []string{
		`{"templateID":"base"}`,
		`{"templateID":"base/py:1","timeout":60,"metadata":{"job":"grpo-1"},"envVars":{"A":"b"}}`,
		`{"templateID":"base/py:1","allow_internet_access":false}`,
		`{"templateID":"base/py:1","network":{"allowOut":["10.0.0.0/8"],"denyOut":["0.0.0.0/0"]}}`,
		`{"templateID":"base/py:1","metadata":{"e2b.template":"x"}}`,
		`{"templateID":"base/py:1","metadata":{"dsec.idempotency":"x"}}`,
		`{"templateID":"base/py:1","autoPause":true}`,
		`{"templateID":"base/py:1","volumeMounts":[{"name":"v","path":"/v"}]}`,
		`{"templateID":"base/py:1","timeout":-1}`,
		`{"templateID":"../../etc","timeout":1e99}`,
		`{"templateID":"\u0000"}`,
		`{"metadata":{"":""}}`,
		`[]`,
		``,
	} {
		f.Add([]byte(s))
	}
	fx := newFixture(f, false)
	var lastSync time.Time
	post := func(body []byte) (int, []byte, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if time.Since(lastSync) > time.Second {
			// The fixture's node stays healthy only while it is seen.
			fx.view.Sync(ctx)
			lastSync = time.Now()
		}
		req, _ := http.NewRequestWithContext(ctx, "POST", fx.srv.URL+"/v2/sandboxes", bytes.NewReader(body))
		req.Header.Set("X-API-KEY", fx.admin)
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0, nil, err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return resp.StatusCode, b, err
	}
	// The target means something only if a good body gets through.
	if code, b, err := post([]byte(`{"templateID":"base/py:1"}`)); err != nil || code != http.StatusCreated {
		f.Fatalf("a plain create: %d %s %v", code, b, err)
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		code, b, err := post(body)
		if err != nil {
			t.Fatalf("POST /v2/sandboxes %q: %v (a handler that panicked breaks the connection)", body, err)
		}
		if code >= 500 || (code != http.StatusCreated && code/100 != 4) {
			t.Fatalf("POST /v2/sandboxes %q: %d %s; want 201 or a 4xx", body, code, b)
		}
		if code != http.StatusCreated {
			return
		}
		var sb e2bSandboxBody
		if err := json.Unmarshal(b, &sb); err != nil || sb.SandboxID == "" {
			t.Fatalf("created, but the answer is %s: %v", b, err)
		}
		got, err := fx.edge.Get(context.Background(), sb.SandboxID)
		if err != nil {
			t.Fatalf("created %s, which the edge does not have: %v", sb.SandboxID, err)
		}
		var req e2bCreateRequest
		_ = json.Unmarshal(body, &req)
		for k, v := range req.Metadata {
			if e2bReservedLabel(k) {
				t.Fatalf("metadata key %q of dsec's own was accepted", k)
			}
			if got.Spec.Labels[k] != v {
				t.Fatalf("metadata %q=%q became label %q", k, v, got.Spec.Labels[k])
			}
		}
		if got.Spec.Labels[e2bTemplateLabel] == "" {
			t.Fatalf("no template label on %+v", got.Spec.Labels)
		}
		_ = fx.edge.Delete(context.Background(), sb.SandboxID)
	})
}

// envdProcedures are the Connect procedures envd serves.
var envdProcedures = []string{
	"/process.Process/Start", "/process.Process/Connect", "/process.Process/List",
	"/process.Process/SendInput", "/process.Process/SendSignal", "/process.Process/CloseStdin",
	"/process.Process/Update", "/process.Process/StreamInput",
	"/filesystem.Filesystem/Stat", "/filesystem.Filesystem/MakeDir", "/filesystem.Filesystem/Move",
	"/filesystem.Filesystem/ListDir", "/filesystem.Filesystem/Remove", "/filesystem.Filesystem/WatchDir",
	"/filesystem.Filesystem/CreateWatcher", "/filesystem.Filesystem/GetWatcherEvents",
	"/filesystem.Filesystem/RemoveWatcher",
}

// connectTypes are the content types of Connect's unary and streaming
// protocols, in JSON and binary, and one it does not serve.
var connectTypes = []string{"application/connect+json", "application/connect+proto", "application/json", "application/proto", "text/plain"}

// FuzzEnvdConnect sends any body to any envd procedure of a sandbox, with
// its token. A streaming call that stays open (a process that runs on)
// is cut after a moment, which is not a failure; anything else must end
// with an answer below 500.
func FuzzEnvdConnect(f *testing.F) {
	frame := func(s string) []byte {
		n := len(s)
		return append([]byte{0, byte(n >> 24), byte(n >> 16), byte(n >> 8), byte(n)}, s...)
	}
	for i := range envdProcedures {
		f.Add(uint8(i), uint8(0), frame(`{}`))
		f.Add(uint8(i), uint8(2), []byte(`{}`))
	}
	f.Add(uint8(0), uint8(0), frame(`{"process":{"cmd":"echo","args":["hi"]}}`))
	f.Add(uint8(0), uint8(0), frame(`{"process":{"cmd":"fail"},"pty":{"size":{"rows":99999,"cols":0}}}`))
	f.Add(uint8(0), uint8(0), append(frame(`{"process":{"cmd":"echo"}}`), frame(`{}`)...))
	f.Add(uint8(0), uint8(0), []byte("\x00\xff\xff\xff\xff{}"))
	f.Add(uint8(0), uint8(0), []byte("\x01\x00\x00\x00\x02{}"))
	f.Add(uint8(4), uint8(2), []byte(`{"process":{"pid":1},"signal":"SIGNAL_SIGKILL"}`))
	f.Add(uint8(3), uint8(2), []byte(`{"process":{"tag":"t"},"input":{"stdin":"aGk="}}`))
	f.Add(uint8(8), uint8(2), []byte(`{"path":"../../../etc/passwd"}`))
	f.Add(uint8(10), uint8(2), []byte(`{"source":"/a","destination":"\u0000"}`))
	f.Add(uint8(11), uint8(2), []byte(`{"path":"/","depth":4294967295}`))
	f.Add(uint8(1), uint8(1), []byte{0, 0, 0, 0, 3, 0x0a, 0x01, 0x08})
	fx := newFixture(f, false)
	id := fx.sandboxFor(f)
	tok := fx.envdTokenOf(f, id)
	var lastSync time.Time
	f.Fuzz(func(t *testing.T, proc, ctype uint8, body []byte) {
		if time.Since(lastSync) > time.Second {
			fx.view.Sync(context.Background())
			lastSync = time.Now()
		}
		path := envdProcedures[int(proc)%len(envdProcedures)]
		ct := connectTypes[int(ctype)%len(connectTypes)]
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		req, _ := http.NewRequestWithContext(ctx, "POST", fx.srv.URL+path, bytes.NewReader(body))
		req.Header.Set("Content-Type", ct)
		req.Header.Set("E2b-Sandbox-Id", id)
		req.Header.Set("X-Access-Token", tok)
		if strings.HasPrefix(ct, "application/connect+") {
			req.Header.Set("Connect-Protocol-Version", "1")
		}
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			_, err = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
		if errors.Is(err, context.DeadlineExceeded) || ctx.Err() != nil {
			return // a stream still open
		}
		if err != nil {
			t.Fatalf("%s (%s) %q: %v (a handler that panicked breaks the connection)", path, ct, body, err)
		}
		// 501: a procedure dsec does not serve (Connect's unimplemented).
		if resp.StatusCode >= 500 && resp.StatusCode != http.StatusNotImplemented {
			t.Fatalf("%s (%s) %q: %d; want an answer below 500", path, ct, body, resp.StatusCode)
		}
	})
}

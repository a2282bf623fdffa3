package apiserver

import (
	"bytes"
	"context"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"
)

// syncBuffer is a log sink for concurrent writers.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestCallerGoneIsNotAnError: an exec whose caller gives up is no error of
// the server's: nothing is logged as a failure, and the node is not taken
// for unreachable (a canceled call to it is not its fault).
func TestCallerGoneIsNotAnError(t *testing.T) {
	bothWays(t, func(t *testing.T, f *fixture) {
		logs := &syncBuffer{}
		srv := f.apiserverWith(t, "c", func(d *Deps) {
			d.Log = slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
		})
		_, body := f.do(t, f.admin, "POST", "/v1/sandboxes", `{"base":"base/py:1"}`)
		id := decodeSandbox(t, body).ID
		ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
		defer cancel()
		req, _ := http.NewRequestWithContext(ctx, "POST", srv.URL+"/v1/sandboxes/"+id+"/exec", strings.NewReader(`{"cmd":"wait-for-cancel"}`))
		req.Header.Set("Authorization", "Bearer "+f.admin)
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
			t.Fatalf("the exec answered %s before its caller gave up", resp.Status)
		}
		deadline := time.Now().Add(5 * time.Second)
		for !strings.Contains(logs.String(), "request canceled by the caller") {
			if time.Now().After(deadline) {
				t.Fatalf("the server did not see the caller go: %s", logs.String())
			}
			time.Sleep(10 * time.Millisecond)
		}
		if strings.Contains(logs.String(), "level=ERROR") {
			t.Fatalf("a caller going away was logged as an error:\n%s", logs.String())
		}
		for _, v := range f.view.Snapshot() {
			if !v.Healthy {
				t.Fatalf("node %s taken for unhealthy after a canceled call", v.Name)
			}
		}
	})
}

package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
)

// Issue 21, class 1: the daemon's memory is not the sandbox's to spend.
// A sandbox writes the worst output there is for JSON, NUL bytes (each
// one six bytes escaped), up to the largest cap on both streams, from
// several execs at once. The bound the daemon must hold, derived in
// docs/architecture.md ("Output memory"): each call keeps at most its two
// capped streams, 2 × 64 MiB here, and the encoder a constant; Go's
// collector lets the heap reach about twice what is live before it
// collects, which also covers the old half a doubling buffer leaves
// behind. So the daemon may grow by at most 2 × (2 × 64 MiB) per call
// during them, and is back near its baseline within seconds after. Before the fix 3 such execs took it from
// 32 MB to 7.6 GB, where it stayed.
const (
	outputCap   = 64 << 20
	outputCalls = 3
)

// rawExec posts an exec and counts the answer's bytes without keeping
// them (the Go SDK would hold ~800 MB per answer in the test process).
func rawExec(id string, req api.ExecRequest) (status int, n int64, head []byte, err error) {
	body, _ := json.Marshal(req)
	hr, _ := http.NewRequest("POST", "http://"+d.listen+"/v1/sandboxes/"+id+"/exec", bytes.NewReader(body))
	hr.Header.Set("Authorization", "Bearer "+d.key)
	hr.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(hr)
	if err != nil {
		return 0, 0, nil, err
	}
	defer resp.Body.Close()
	var first bytes.Buffer
	n, err = io.Copy(io.Discard, io.TeeReader(resp.Body, &limitedBuffer{&first, 4096}))
	return resp.StatusCode, n, first.Bytes(), err
}

type limitedBuffer struct {
	b   *bytes.Buffer
	max int
}

func (l *limitedBuffer) Write(p []byte) (int, error) {
	if room := l.max - l.b.Len(); room > 0 {
		l.b.Write(p[:min(room, len(p))])
	}
	return len(p), nil
}

func TestRedteamOutputMemory(t *testing.T) {
	needDaemon(t)
	// A budget for exactly outputCalls worst-case calls.
	withPoolFlags(t, "--output-buffer-mb", fmt.Sprint(outputCalls*2*outputCap>>20+8))
	by := newBystander(t)
	sbs := make([]*api.Sandbox, outputCalls)
	for i := range sbs {
		sbs[i] = newSandbox(t, api.SandboxSpec{})
	}
	base := daemonRSS(t)
	// Both streams full of NULs, after a pause that lets the calls overlap.
	flood := api.ExecRequest{Cmd: fmt.Sprintf("sleep 2; head -c %d /dev/zero; head -c %d /dev/zero >&2", outputCap, outputCap),
		MaxOutputBytes: outputCap, Timeout: 120}

	var peak int64
	stop := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			if r := daemonRSS(t); r > peak {
				peak = r
			}
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
		}
	}()
	var wg sync.WaitGroup
	type answer struct {
		status int
		n      int64
		head   []byte
		err    error
	}
	answers := make([]answer, outputCalls)
	for i, sb := range sbs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			a := &answers[i]
			a.status, a.n, a.head, a.err = rawExec(sb.ID, flood)
		}()
	}
	// While they hold the budget, one more worst-case call is refused
	// before it runs, and a small one still gets through.
	time.Sleep(time.Second)
	status, _, head, err := rawExec(by.id, api.ExecRequest{Cmd: "echo ran > /root/ran", MaxOutputBytes: outputCap})
	if err != nil || status != http.StatusServiceUnavailable || !bytes.Contains(head, []byte("resource_exhausted")) {
		t.Errorf("a call past the output budget: HTTP %d %s %v; want 503 resource_exhausted", status, head, err)
	}
	if r := sh(t, by.id, "cat /root/ran 2>/dev/null; echo small"); r.Stdout != "small\n" {
		t.Errorf("the refused call ran, or a small one failed: %q", r.Stdout)
	}
	wg.Wait()
	close(stop)
	<-sampled
	for i, a := range answers {
		// 2 × 64 MiB of NULs is 768 MiB of JSON.
		if a.err != nil || a.status != 200 || a.n < 12*outputCap {
			t.Fatalf("flood %d: HTTP %d, %d bytes, %v: %.200s", i, a.status, a.n, a.err, a.head)
		}
	}
	bound := int64(outputCalls) * 2 * 2 * outputCap
	t.Logf("daemon RSS: %d MiB before, %d MiB at most during %d execs of 2 × %d MiB of NULs (bound +%d MiB)",
		base>>20, peak>>20, outputCalls, outputCap>>20, bound>>20)
	if peak-base > bound {
		t.Errorf("daemon RSS grew by %d MiB during the floods; the bound is %d MiB", (peak-base)>>20, bound>>20)
	}
	// And the memory goes back to the OS within seconds.
	deadline := time.Now().Add(15 * time.Second)
	after := daemonRSS(t)
	for after-base > 64<<20 && time.Now().Before(deadline) {
		time.Sleep(200 * time.Millisecond)
		after = daemonRSS(t)
	}
	t.Logf("daemon RSS after: %d MiB", after>>20)
	if after-base > 64<<20 {
		t.Errorf("daemon RSS stayed %d MiB above its baseline after the floods", (after-base)>>20)
	}
	by.check(t)
}

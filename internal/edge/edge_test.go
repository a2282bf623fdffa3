package edge

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/files"
)

func TestCapBuffer(t *testing.T) {
	c := &capBuffer{max: 5}
	for _, s := range []string{"ab", "cd", "ef", "gh"} {
		if n, err := c.Write([]byte(s)); n != 2 || err != nil {
			t.Fatalf("Write = %d, %v: a capped writer must keep draining", n, err)
		}
	}
	b, tr := c.bytes()
	if string(b) != "abcde" || !tr || c.total != 8 {
		t.Fatalf("got %q truncated=%v total=%d", b, tr, c.total)
	}
}

// TestCapBufferNeverGrowsPastCap: however the output arrives, a capped
// stream's buffer holds at most its cap (append's doubling would reach
// the next power of two, up to twice the cap).
func TestCapBufferNeverGrowsPastCap(t *testing.T) {
	for _, max := range []int64{1, 5 << 10, 1 << 20, 3<<20 + 7} {
		for _, chunk := range []int{1, 4 << 10, 64 << 10, 1 << 20} {
			c := &capBuffer{max: max}
			p := make([]byte, chunk)
			for c.total < 2*max+int64(chunk) {
				_, _ = c.Write(p)
				if int64(cap(c.buf)) > max {
					t.Fatalf("max %d, writes of %d: buffer capacity %d after %d bytes", max, chunk, cap(c.buf), c.total)
				}
			}
			if b, tr := c.bytes(); int64(len(b)) != max || !tr {
				t.Fatalf("max %d, writes of %d: kept %d, truncated %v", max, chunk, len(b), tr)
			}
		}
	}
}

func TestStreamWriterKeepsRunesWhole(t *testing.T) {
	var got []api.ExecEvent
	sink := &eventSink{remaining: [2]int64{1 << 20, 1 << 20}, emit: func(ev api.ExecEvent) error { got = append(got, ev); return nil }}
	w := &streamWriter{sink: sink}
	s := "héllo wörld €"
	b := []byte(s)
	// Write byte by byte: every multi-byte rune is split across writes.
	for i := range b {
		_, _ = w.Write(b[i : i+1])
	}
	w.flush()
	var out strings.Builder
	for _, ev := range got {
		if ev.StdoutB64 != "" {
			t.Fatalf("valid UTF-8 split across writes came out as base64: %+v", ev)
		}
		if !utf8.ValidString(ev.Stdout) {
			t.Fatalf("event is not valid UTF-8: %q", ev.Stdout)
		}
		out.WriteString(ev.Stdout)
	}
	if out.String() != s {
		t.Fatalf("got %q, want %q", out.String(), s)
	}
	// Invalid bytes go out as base64.
	got = nil
	_, _ = w.Write([]byte{0xff, 0xfe, 'a'})
	w.flush()
	if len(got) != 1 || got[0].StdoutB64 == "" {
		t.Fatalf("invalid UTF-8: %+v", got)
	}
}

func TestEventSinkCap(t *testing.T) {
	n := 0
	sink := &eventSink{remaining: [2]int64{10, 10}, emit: func(ev api.ExecEvent) error { n += len(ev.Stdout) + len(ev.Stderr); return nil }}
	w := &streamWriter{sink: sink}
	ew := &streamWriter{sink: sink, stderr: true}
	_, _ = w.Write([]byte(strings.Repeat("x", 8)))
	_, _ = ew.Write([]byte(strings.Repeat("e", 6)))
	_, _ = w.Write([]byte(strings.Repeat("x", 8)))
	_, _ = w.Write([]byte("more"))
	// Each stream has its own cap: 10 of stdout, all 6 of stderr.
	if n != 16 || !sink.truncated {
		t.Fatalf("emitted %d bytes, truncated=%v; want 16, true", n, sink.truncated)
	}
}

func TestMarkerCapture(t *testing.T) {
	c := newCapture()
	_, _ = c.Write([]byte("between runs is dropped"))
	prefix := markerPrefix("n0nce")
	c.arm(prefix, 1<<20)
	full := "line one\nline two" + string(prefix) + "3\x1e\ntrailing"
	// Feed in awkward chunks so the marker straddles writes.
	for i := 0; i < len(full); i += 3 {
		end := min(i+3, len(full))
		_, _ = c.Write([]byte(full[i:end]))
	}
	buf, tr, done, code := c.result()
	if string(buf) != "line one\nline two" || tr || !done || code != 3 {
		t.Fatalf("got %q truncated=%v done=%v code=%d", buf, tr, done, code)
	}
	// A fake marker with the wrong nonce is output, not an end.
	c.arm(markerPrefix("real"), 1<<20)
	_, _ = c.Write([]byte("\x1eDSEC:fake:0\x1e\nstill running"))
	if _, _, done, _ := c.result(); done {
		t.Fatal("a marker with another nonce ended the run")
	}
	// Cap: output beyond max is dropped, the marker is still found.
	c.arm(prefix, 4)
	_, _ = c.Write([]byte(strings.Repeat("y", 1000) + string(prefix) + "0\x1e\n"))
	buf, tr, done, _ = c.result()
	if string(buf) != "yyyy" || !tr || !done {
		t.Fatalf("cap: got %q truncated=%v done=%v", buf, tr, done)
	}
}

func TestRunScriptQuoting(t *testing.T) {
	sh, err := exec.LookPath("sh")
	if err != nil {
		t.Skip("needs sh")
	}
	// Hostile commands stay one word for the wrapper: quotes, $(...),
	// newlines and a fake end marker cannot break out of eval.
	for _, cmd := range []string{`echo 'it''s'`, "echo a\necho b", `echo "$(echo x)"`, `printf '\036DSEC:x:0\036\n'`, `'`} {
		for _, bash := range []bool{false, true} {
			if bash {
				if _, err := exec.LookPath("bash"); err != nil {
					continue
				}
			}
			script := runScript(cmd, "abc", bash)
			shell := sh
			if bash {
				shell = "bash"
				script = bashSetup + script
			}
			out, _ := exec.Command(shell, "-c", script).CombinedOutput()
			if !strings.Contains(string(out), "\x1eDSEC:abc:") {
				t.Errorf("%s: %q: no end marker in %q", shell, cmd, out)
			}
		}
	}
}

func TestResolveUser(t *testing.T) {
	dir := t.TempDir()
	_ = os.MkdirAll(filepath.Join(dir, "etc"), 0o755)
	_ = os.WriteFile(filepath.Join(dir, "etc/passwd"), []byte("root:x:0:0:root:/root:/bin/sh\nalice:x:1001:1002::/home/alice:/bin/sh\nbroken:x:zz:0::/:/bin/sh\n"), 0o644)
	_ = os.WriteFile(filepath.Join(dir, "etc/group"), []byte("root:x:0:\nstaff:x:50:\n"), 0o644)
	r, err := files.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	tests := []struct {
		spec     string
		uid, gid uint32
		home     string
		wantErr  bool
	}{
		{"root", 0, 0, "/root", false},
		{"alice", 1001, 1002, "/home/alice", false},
		{"alice:staff", 1001, 50, "/home/alice", false},
		{"1001", 1001, 1002, "/home/alice", false},
		{"4242", 4242, 4242, "/", false},
		{"4242:7", 4242, 7, "/", false},
		{"nobody", 0, 0, "", true},
		{"alice:nogroup", 0, 0, "", true},
		{"broken", 0, 0, "", true},
	}
	for _, tt := range tests {
		u, err := resolveUser(rootFiles(r), tt.spec)
		if tt.wantErr {
			if err == nil {
				t.Errorf("%s: no error", tt.spec)
			}
			continue
		}
		if err != nil || u.uid != tt.uid || u.gid != tt.gid || u.home != tt.home {
			t.Errorf("%s: got %+v, %v", tt.spec, u, err)
		}
	}
}

// TestListPages: List filters on state and labels, skips pool sandboxes,
// returns ids after After in order, at most Limit of them.
func TestListPages(t *testing.T) {
	e := &Edge{sandboxes: map[string]*sbx{}, labels: newLabelIndex()}
	add := func(id, state, job string, pooled bool) {
		s := &sbx{pooled: pooled, listed: true}
		s.rec.Sandbox = api.Sandbox{ID: id, State: state, Labels: map[string]string{"job": job}}
		e.sandboxes[id] = s
		e.reindexLocked(s)
	}
	add("sb-n-05", api.StateRunning, "a", false)
	add("sb-n-01", api.StateRunning, "a", false)
	add("sb-n-03", api.StatePaused, "a", false)
	add("sb-n-02", api.StateRunning, "b", false)
	add("sb-n-04", api.StateRunning, "a", true)
	ids := func(l []api.Sandbox) string {
		var out []string
		for _, s := range l {
			out = append(out, s.ID)
		}
		return strings.Join(out, ",")
	}
	for _, c := range []struct {
		f    edgeapi.ListFilter
		want string
	}{
		{edgeapi.ListFilter{}, "sb-n-01,sb-n-02,sb-n-03,sb-n-05"},
		{edgeapi.ListFilter{Labels: map[string]string{"job": "a"}}, "sb-n-01,sb-n-03,sb-n-05"},
		{edgeapi.ListFilter{State: api.StateRunning, Labels: map[string]string{"job": "a"}}, "sb-n-01,sb-n-05"},
		{edgeapi.ListFilter{Limit: 2}, "sb-n-01,sb-n-02"},
		{edgeapi.ListFilter{After: "sb-n-02", Limit: 2}, "sb-n-03,sb-n-05"},
		{edgeapi.ListFilter{After: "sb-n-05"}, ""},
		{edgeapi.ListFilter{Labels: map[string]string{"job": "a"}, After: "sb-n-01", Limit: 1}, "sb-n-03"},
	} {
		if got := ids(e.list(context.Background(), c.f)); got != c.want {
			t.Errorf("List(%+v) = %s, want %s", c.f, got, c.want)
		}
	}
}

// TestOutputBudget: calls take their worst case until the node's budget is
// spent; the next is refused as exhausted (retryable) and gets in once
// another gives its share back, which it can do only once.
func TestOutputBudget(t *testing.T) {
	b := &outputBudget{limit: 10 << 20}
	r1, err := b.take(4 << 20)
	if err != nil {
		t.Fatal(err)
	}
	r2, err := b.take(6 << 20)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.take(1); !errors.Is(err, errdefs.ErrExhausted) || !strings.Contains(err.Error(), "--output-buffer-mb") {
		t.Fatalf("take past the budget: %v; want exhausted, naming the flag", err)
	}
	r1()
	r1() // a second release gives nothing back
	if b.used != 6<<20 {
		t.Fatalf("used %d after one release, want %d", b.used, 6<<20)
	}
	r3, err := b.take(4 << 20)
	if err != nil {
		t.Fatalf("take after a release: %v", err)
	}
	r2()
	r3()
	if b.used != 0 {
		t.Fatalf("used %d after every release", b.used)
	}
	if got := DefaultOutputBufferMB(24 << 30); got != 3<<10 {
		t.Fatalf("default for 24 GiB: %d MiB", got)
	}
	if DefaultOutputBufferMB(1<<30) != 256 || DefaultOutputBufferMB(1<<40) != 8<<10 {
		t.Fatal("default not clamped to 256 MiB .. 8 GiB")
	}
}

package main

import (
	"context"
	"errors"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestParseFlowLine(t *testing.T) {
	ms := func(f float64) time.Duration { return time.Duration(f * float64(time.Millisecond)) }
	for _, tc := range []struct {
		line    string
		want    flowTimes
		failed  string // a flowFailed with this message
		invalid bool   // an answer that is not one
	}{
		{line: `{"create_ms": 1.5, "run_ms": 10.25, "kill_ms": 3, "flow_ms": 14.9}`,
			want: flowTimes{create: ms(1.5), run: ms(10.25), kill: ms(3), flow: ms(14.9)}},
		{line: `{"create_ms": 0, "run_ms": 0, "kill_ms": 0, "flow_ms": 0}`},
		// Rounding in the process's clock arithmetic is allowed for.
		{line: `{"create_ms": 1, "run_ms": 1, "kill_ms": 1, "flow_ms": 2.9995}`,
			want: flowTimes{create: ms(1), run: ms(1), kill: ms(1), flow: ms(2.9995)}},
		{line: `{"error": "commands.run: CommandExitError (exit 127)\n"}`, failed: "commands.run: CommandExitError (exit 127)"},
		{line: `{"error": ""}`, failed: ""},
		{line: `{"create_ms": 1, "run_ms": 2, "kill_ms": 3}`, invalid: true},
		{line: `{"create_ms": -1, "run_ms": 2, "kill_ms": 3, "flow_ms": 6}`, invalid: true},
		{line: `{"create_ms": 5, "run_ms": 5, "kill_ms": 5, "flow_ms": 6}`, invalid: true},
		{line: `{"ready": true}`, invalid: true},
		{line: `Traceback (most recent call last):`, invalid: true},
		{line: ``, invalid: true},
	} {
		got, err := parseFlowLine([]byte(tc.line))
		var failed flowFailed
		switch {
		case tc.invalid:
			if err == nil || errors.As(err, &failed) {
				t.Errorf("%q: got %v, %v; want an invalid-answer error", tc.line, got, err)
			}
		case tc.failed != "" || strings.Contains(tc.line, `"error"`):
			if !errors.As(err, &failed) || failed.msg != tc.failed {
				t.Errorf("%q: got %v; want flowFailed %q", tc.line, err, tc.failed)
			}
		default:
			if err != nil || got != tc.want {
				t.Errorf("%q: got %+v, %v; want %+v", tc.line, got, err, tc.want)
			}
		}
	}
}

func TestParseReadyLine(t *testing.T) {
	if v, err := parseReadyLine([]byte(`{"ready": true, "version": "v20.20.2"}`)); err != nil || v != "v20.20.2" {
		t.Fatalf("got %q, %v", v, err)
	}
	for _, l := range []string{`{"error": "Cannot find package 'e2b'"}`, `{"create_ms": 1}`, `node: bad option`} {
		if _, err := parseReadyLine([]byte(l)); err == nil {
			t.Errorf("%q: no error", l)
		}
	}
}

func TestSummarize(t *testing.T) {
	if s := summarize(nil); s != (stepStats{}) {
		t.Fatalf("empty: %+v", s)
	}
	var d []time.Duration
	for i := 1; i <= 100; i++ {
		d = append(d, time.Duration(i)*time.Millisecond)
	}
	// Shuffled input: the percentiles sort a copy and leave d alone.
	slices.Reverse(d)
	s := summarize(d)
	if s.N != 100 || s.P50MS != 50 || s.P99MS != 99 || math.Abs(s.MeanMS-50.5) > 1e-9 {
		t.Fatalf("got %+v, want n 100, p50 50, p99 99, mean 50.5", s)
	}
	if d[0] != 100*time.Millisecond {
		t.Fatal("summarize reordered its input")
	}
	if s := summarize([]time.Duration{1500 * time.Microsecond}); s.P50MS != 1.5 || s.P99MS != 1.5 || s.MeanMS != 1.5 {
		t.Fatalf("one sample: %+v", s)
	}
}

func TestSamplesCountFailures(t *testing.T) {
	var s flowSamples
	s.add(flowTimes{create: time.Millisecond, run: 2 * time.Millisecond, kill: 3 * time.Millisecond, flow: 6 * time.Millisecond}, nil)
	s.add(flowTimes{}, flowFailed{"create: quota"})
	r := s.result(e2bClient{key: "rest", name: "REST"})
	if r.Failures != 1 || r.Flow.N != 1 || r.Flow.P50MS != 6 || r.Create.P50MS != 1 || r.Run.P50MS != 2 || r.Kill.P50MS != 3 {
		t.Fatalf("got %+v", r)
	}
}

func TestE2BReportJudge(t *testing.T) {
	client := func(key string, p50 float64, fails int) e2bClientResult {
		n := 10
		if p50 == 0 {
			n = 0
		}
		return e2bClientResult{Client: key, Failures: fails, Flow: stepStats{N: n, P50MS: p50}}
	}
	for _, tc := range []struct {
		name             string
		e2b, lib, rest   e2bClientResult
		wantE2B, wantLib float64
		wantMet          bool
	}{
		{"within", client("e2b", 15, 0), client("libdsec", 12, 0), client("rest", 10, 0), 1.5, 1.2, true},
		{"over", client("e2b", 15.1, 0), client("libdsec", 12, 0), client("rest", 10, 0), 1.51, 1.2, false},
		{"e2b failures", client("e2b", 11, 1), client("libdsec", 12, 0), client("rest", 10, 0), 1.1, 1.2, false},
		{"native failures", client("e2b", 11, 0), client("libdsec", 12, 0), client("rest", 10, 2), 1.1, 1.2, false},
		{"no e2b flows", client("e2b", 0, 10), client("libdsec", 12, 0), client("rest", 10, 0), 0, 1.2, false},
		{"no native flows", client("e2b", 11, 0), client("libdsec", 12, 0), client("rest", 0, 10), 0, 0, false},
	} {
		r := e2bReport{Clients: []e2bClientResult{tc.e2b, tc.lib, tc.rest}}
		r.judge()
		if r.E2BNodeRatio != 0 {
			t.Errorf("%s: E2B over node's native flow is %.3f with no node flows, want 0", tc.name, r.E2BNodeRatio)
		}
		if math.Abs(r.E2BRatio-tc.wantE2B) > 1e-9 || math.Abs(r.LibdsecRatio-tc.wantLib) > 1e-9 || r.TargetMet != tc.wantMet {
			t.Errorf("%s: got e2b %.3f libdsec %.3f met %v; want %.3f %.3f %v", tc.name, r.E2BRatio, r.LibdsecRatio, r.TargetMet, tc.wantE2B, tc.wantLib, tc.wantMet)
		}
		if !strings.Contains(r.Target, "1.5") {
			t.Errorf("%s: target %q does not state 1.5×", tc.name, r.Target)
		}
	}
}

// The same-runtime ratio is reported beside the target and never decides
// it.
func TestE2BReportNodeRatio(t *testing.T) {
	flow := func(key string, p50 float64) e2bClientResult {
		return e2bClientResult{Client: key, Flow: stepStats{N: 10, P50MS: p50}}
	}
	r := e2bReport{Clients: []e2bClientResult{flow("e2b", 20), flow("libdsec", 12), flow("rest", 10), flow("rest-node", 16)}}
	r.judge()
	if math.Abs(r.E2BNodeRatio-1.25) > 1e-9 || math.Abs(r.E2BRatio-2) > 1e-9 || r.TargetMet {
		t.Errorf("got node ratio %.3f, native ratio %.3f, met %v; want 1.25, 2, not met", r.E2BNodeRatio, r.E2BRatio, r.TargetMet)
	}
}

func TestE2BSDKDir(t *testing.T) {
	home := func() (string, error) { return "/home/u", nil }
	noHome := func() (string, error) { return "", errors.New("$HOME is not defined") }
	for _, tc := range []struct {
		xdg  string
		home func() (string, error)
		want string
	}{
		{"/var/cache/x", home, "/var/cache/x/dsec/e2b-" + e2bSDKVersion},
		{"", home, "/home/u/.cache/dsec/e2b-" + e2bSDKVersion},
		// A relative XDG_CACHE_HOME is invalid under the spec: ignored.
		{"cache", home, "/home/u/.cache/dsec/e2b-" + e2bSDKVersion},
		{"/var/cache/x", noHome, "/var/cache/x/dsec/e2b-" + e2bSDKVersion},
	} {
		got, err := e2bSDKDir(tc.xdg, tc.home)
		if err != nil || got != tc.want {
			t.Errorf("xdg %q: got %q, %v; want %q", tc.xdg, got, err, tc.want)
		}
	}
	if _, err := e2bSDKDir("", noHome); err == nil || !strings.Contains(err.Error(), "--sdk-dir") {
		t.Errorf("no home: got %v, want an error naming --sdk-dir", err)
	}
}

func TestInstalledVersion(t *testing.T) {
	dir := t.TempDir()
	if v := installedVersion(dir); v != "" {
		t.Fatalf("empty dir: %q", v)
	}
	pkg := filepath.Join(dir, "node_modules", "e2b")
	if err := os.MkdirAll(pkg, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(pkg, "package.json"), []byte(`{"name": "e2b", "version": "2.51.0"}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if v := installedVersion(dir); v != "2.51.0" {
		t.Fatalf("got %q", v)
	}
}

func TestEnvWith(t *testing.T) {
	env := []string{"PATH=/bin", "E2B_DEBUG=true", "E2B_API_URL=https://api.e2b.app", "DSEC_API_KEY=old", "DSEC_API_KEYS=keep"}
	got := envWith(env, []string{"E2B_", "DSEC_API_KEY="}, "E2B_API_URL=http://127.0.0.1:7070", "DSEC_API_KEY=new")
	want := []string{"PATH=/bin", "DSEC_API_KEYS=keep", "E2B_API_URL=http://127.0.0.1:7070", "DSEC_API_KEY=new"}
	if !slices.Equal(got, want) {
		t.Fatalf("got %q, want %q", got, want)
	}
}

// The line protocol, against a stand-in for node and python: the ready
// line, answers, a reported failure, and the process ending.
func TestFlowDriver(t *testing.T) {
	sh, err := exec.LookPath("sh")
	if err != nil {
		t.Skip("needs sh to stand in for the SDK processes")
	}
	script := `echo '{"ready": true, "version": "fake 1"}'
n=0
while read l; do
	n=$((n+1))
	case $n in
	1) echo '{"create_ms": 1, "run_ms": 2, "kill_ms": 3, "flow_ms": 6.5}' ;;
	2) echo '{"error": "create: quota exceeded"}' ;;
	*) exit 3 ;;
	esac
done`
	ctx := context.Background()
	d, err := startFlowDriver(ctx, "fake", exec.Command(sh, "-c", script))
	if err != nil {
		t.Fatal(err)
	}
	defer d.close()
	if d.version != "fake 1" {
		t.Fatalf("version %q", d.version)
	}
	ft, err := d.flow(ctx)
	if err != nil || ft.flow != 6500*time.Microsecond || ft.run != 2*time.Millisecond {
		t.Fatalf("first flow: %+v, %v", ft, err)
	}
	var failed flowFailed
	if _, err := d.flow(ctx); !errors.As(err, &failed) || failed.msg != "create: quota exceeded" {
		t.Fatalf("second flow: %v, want the reported failure", err)
	}
	if _, err := d.flow(ctx); err == nil || errors.As(err, &failed) || !strings.Contains(err.Error(), "ended") {
		t.Fatalf("third flow: %v, want the process's end", err)
	}
}

func TestFlowDriverNotReady(t *testing.T) {
	sh, err := exec.LookPath("sh")
	if err != nil {
		t.Skip("needs sh to stand in for the SDK processes")
	}
	_, err = startFlowDriver(context.Background(), "fake", exec.Command(sh, "-c", `echo '{"error": "Cannot find package e2b"}'; exit 1`))
	if err == nil || !strings.Contains(err.Error(), "Cannot find package e2b") {
		t.Fatalf("got %v, want the process's own error", err)
	}
}

// The embedded scripts are valid for the interpreters that run them.
func TestFlowScriptsParse(t *testing.T) {
	if py, err := exec.LookPath("python3"); err == nil {
		cmd := exec.Command(py, "-c", "import ast, sys; ast.parse(sys.stdin.read())")
		cmd.Stdin = strings.NewReader(libdsecFlowScript)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("libdsec_flow.py: %v\n%s", err, out)
		}
	} else {
		t.Log("python3 not found: libdsec_flow.py not checked")
	}
	if node, err := exec.LookPath("node"); err == nil {
		f := filepath.Join(t.TempDir(), "flow.mjs")
		if err := os.WriteFile(f, e2bFlowScript, 0o644); err != nil {
			t.Fatal(err)
		}
		if out, err := exec.Command(node, "--check", f).CombinedOutput(); err != nil {
			t.Errorf("e2b_flow.mjs: %v\n%s", err, out)
		}
	} else {
		t.Log("node not found: e2b_flow.mjs not checked")
	}
}

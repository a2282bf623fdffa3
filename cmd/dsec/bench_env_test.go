package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// The generated trees and their archives are the same on every run, so
// the layers' content-hash tags let a rerun reuse them.
func TestEnvTreesAreDeterministic(t *testing.T) {
	hash := func() (string, string) {
		dir := t.TempDir()
		ws, tk := filepath.Join(dir, "ws"), filepath.Join(dir, "tk")
		if err := envBuildWorkspace(ws); err != nil {
			t.Fatal(err)
		}
		if err := envBuildToolkit(tk); err != nil {
			t.Fatal(err)
		}
		var sums []string
		for _, d := range []string{ws, tk} {
			if err := stampTree(d, envEpoch); err != nil {
				t.Fatal(err)
			}
			sum, n, err := writeTarGz(d, d+".tar.gz")
			if err != nil {
				t.Fatal(err)
			}
			if n < 60 {
				t.Fatalf("%s: only %d entries", d, n)
			}
			sums = append(sums, sum)
		}
		return sums[0], sums[1]
	}
	w1, t1 := hash()
	time.Sleep(10 * time.Millisecond)
	w2, t2 := hash()
	if w1 != w2 || t1 != t2 {
		t.Fatalf("archives differ between builds: %s/%s vs %s/%s", w1, t1, w2, t2)
	}
}

// Every tool call refers to files the trees provide.
func TestEnvToolCallsMatchTrees(t *testing.T) {
	dir := t.TempDir()
	if err := envBuildWorkspace(dir); err != nil {
		t.Fatal(err)
	}
	if err := envBuildToolkit(dir); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"workspace/repo/README.md", "workspace/repo/src/benchpkg/mod000.py",
		"workspace/repo/src/benchpkg/mod001.py", "opt/toolkit/bin/check.sh", "opt/toolkit/bin/summarize.py"} {
		if _, err := os.Stat(filepath.Join(dir, p)); err != nil {
			t.Errorf("tree lacks %s", p)
		}
	}
	if fi, err := os.Stat(filepath.Join(dir, "opt/toolkit/bin/check.sh")); err != nil || fi.Mode()&0o111 == 0 {
		t.Errorf("check.sh is not executable: %v", err)
	}
}

func TestCopyTree(t *testing.T) {
	src, dst := t.TempDir(), filepath.Join(t.TempDir(), "out")
	if err := writeFiles(src, map[string]string{"a/b/c.txt": "hello", "top": "x"}, 0o640); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("a/b/c.txt", filepath.Join(src, "link")); err != nil {
		t.Fatal(err)
	}
	if err := copyTree(src, dst); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(dst, "link"))
	if err != nil || string(b) != "hello" {
		t.Fatalf("link → %q, %v", b, err)
	}
	if l, _ := os.Readlink(filepath.Join(dst, "link")); l != "a/b/c.txt" {
		t.Fatalf("symlink target %q", l)
	}
	if fi, err := os.Stat(filepath.Join(dst, "top")); err != nil || fi.Mode().Perm() != 0o640 {
		t.Fatalf("mode not kept: %v %v", fi.Mode(), err)
	}
}

func TestEnvPhasesRows(t *testing.T) {
	ph := newEnvPhases(3)
	ms := time.Millisecond
	ph.setup[0], ph.calls[0], ph.teardown[0], ph.total[0] = 10*ms, 20*ms, 5*ms, 35*ms
	ph.setup[2], ph.calls[2], ph.teardown[2], ph.total[2] = 30*ms, 20*ms, 5*ms, 55*ms
	ph.setup[1] = 99 * ms // failed later: left out
	ph.fails = 1
	if ph.ok() != 2 {
		t.Fatalf("ok = %d", ph.ok())
	}
	rows := ph.rows(benchOpts{count: 3, concurrency: 2}, time.Second)
	if len(rows) != 4 {
		t.Fatalf("%d rows", len(rows))
	}
	if rows[0].P50MS != 10 || rows[0].P99MS != 10 || rows[0].Failures != 1 || rows[0].PerSec != 2 {
		t.Fatalf("setup row %+v", rows[0])
	}
	if rows[3].P99MS != 35 {
		t.Fatalf("workload row %+v", rows[3])
	}
}

func TestEnvSummaryLines(t *testing.T) {
	s := envSummary{Sandboxes: 20, ToolCalls: 5, WallS: 4, BaselineWallS: 10, Speedup: 2.5, SetupSpeedup: 30, PaperSpeedup: envPaperSpeedup,
		Layers: map[string]string{"base": "base/bench-env:x"}, LayerFiles: map[string]int{}, TarGzBytes: map[string]int64{}}
	got := strings.Join(envSummaryLines(s), "\n")
	for _, want := range []string{"20 sandboxes × 5 tool calls in 4.00 s with dsec (5.00 sandboxes/s), 10.00 s with tar.gz extraction (2.00 sandboxes/s)", "completion speedup 2.50x", "E2: 1.76x"} {
		if !strings.Contains(got, want) {
			t.Errorf("summary lacks %q:\n%s", want, got)
		}
	}
}

package fake

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/dsecproject/dsec/internal/sandbox"
)

// TestDistSample: the samples' median and 99th percentile are the ones
// asked for (within sampling error), and degenerate distributions are
// constant.
func TestDistSample(t *testing.T) {
	d := Dist{Median: 4 * time.Millisecond, P99: 20 * time.Millisecond}
	const n = 20000
	s := make([]time.Duration, n)
	for i := range s {
		s[i] = d.Sample()
	}
	slices.Sort(s)
	if m := s[n/2]; m < 3600*time.Microsecond || m > 4400*time.Microsecond {
		t.Errorf("median %v, want about 4ms", m)
	}
	if p := s[n*99/100]; p < 16*time.Millisecond || p > 25*time.Millisecond {
		t.Errorf("p99 %v, want about 20ms", p)
	}
	if got := (Dist{}).Sample(); got != 0 {
		t.Errorf("zero distribution sampled %v", got)
	}
	if got := (Dist{Median: time.Millisecond}).Sample(); got != time.Millisecond {
		t.Errorf("distribution without spread sampled %v", got)
	}
}

// TestExecTakesItsTime: a simulated process runs for its sampled time,
// and a killed one ends at once with 137.
func TestExecTakesItsTime(t *testing.T) {
	ctx := context.Background()
	b := NewWithLatency("container", Latency{Exec: Dist{Median: 30 * time.Millisecond}})
	dir := t.TempDir()
	if err := b.Create(ctx, sandbox.Config{ID: "sb-a", Images: []string{dir}, Upper: dir}); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	p, err := b.Exec(ctx, "sb-a", sandbox.Process{Args: []string{"true"}})
	if err != nil {
		t.Fatal(err)
	}
	if code, _ := p.Wait(); code != 0 || time.Since(start) < 30*time.Millisecond {
		t.Fatalf("exit %d after %v, want 0 after 30ms", code, time.Since(start))
	}
	p, _ = b.Exec(ctx, "sb-a", sandbox.Process{Args: []string{"sleep"}})
	_ = p.Kill()
	if code, _ := p.Wait(); code != 137 {
		t.Fatalf("killed process exited %d, want 137", code)
	}
	if err := b.Pause(ctx, "sb-a"); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Exec(ctx, "sb-a", sandbox.Process{Args: []string{"true"}}); err == nil {
		t.Fatal("exec in a paused sandbox ran")
	}
	if err := b.Create(ctx, sandbox.Config{ID: "sb-b", Rootfs: dir}); err == nil {
		t.Fatal("a rootfs instead of layer images was taken")
	}
}

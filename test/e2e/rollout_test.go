package e2e

import (
	"bytes"
	"encoding/json"
	"os"
	"testing"
	"time"
)

// TestRollout runs examples/rollout (a scripted-policy RL rollout over
// generated bug-fix tasks) with four tasks against this suite's daemon and
// checks that every task earned reward 1.
func TestRollout(t *testing.T) {
	needDaemon(t) // before d.bin below: d is nil when the suite skips
	if _, err := os.Stat("/usr/bin/python3.11"); err != nil {
		t.Skip("needs /usr/bin/python3.11: examples/rollout/make_base.sh builds the base from it")
	}
	cmd, cancel := pythonCmd(t, 90*time.Second, "examples/rollout/rollout.py",
		"--tasks", "4", "--concurrency", "4", "--json", "--dsec-bin", d.bin)
	defer cancel()
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	start := time.Now()
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("rollout.py (%s): %v\nstdout:\n%s\nstderr:\n%s", time.Since(start).Round(time.Millisecond), err, out, stderr.String())
	}
	var doc struct {
		Results []struct {
			Task   int    `json:"task"`
			Reward int    `json:"reward"`
			Steps  int    `json:"steps"`
			Error  string `json:"error"`
		} `json:"results"`
		Totals map[string]any `json:"totals"`
	}
	if err := json.Unmarshal(out, &doc); err != nil {
		t.Fatalf("rollout.py output is not JSON: %v\n%s", err, out)
	}
	if len(doc.Results) != 4 {
		t.Fatalf("got %d results, want 4:\n%s", len(doc.Results), out)
	}
	for _, r := range doc.Results {
		if r.Reward != 1 {
			t.Errorf("task %d: reward %d after %d steps (error %q)", r.Task, r.Reward, r.Steps, r.Error)
		}
	}
	t.Logf("rollout of 4 tasks in %s: %v", time.Since(start).Round(time.Millisecond), doc.Totals)
}

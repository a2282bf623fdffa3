package main

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/internal/store/etcdtest"
)

// TestControlPlaneBenchShort runs a short control-plane benchmark (a real
// etcd, two real apiservers, 20 hollow edges in two processes, 20,000
// sandboxes) and checks what it must hold whatever the machine's speed:
// no create lost, GET /v1/nodes counting what the clients hold, every
// sandbox reachable through either apiserver, nothing left after the
// teardown, and no daemon or directory left behind.
func TestControlPlaneBenchShort(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: the benchmark takes about a minute")
	}
	if _, err := etcdtest.Binary(); err != nil {
		t.Skip(err)
	}
	if _, err := exec.LookPath("mkfs.erofs"); err != nil {
		t.Skip("needs mkfs.erofs (make deps-test)")
	}
	dir := t.TempDir()
	bin := filepath.Join(dir, "dsec")
	if out, err := exec.Command("go", "build", "-buildvcs=false", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	work := filepath.Join(dir, "work")
	cmd := exec.Command(bin, "bench", "control-plane", "--edges", "20", "--sandboxes", "20000", "--rate", "1500",
		"--duration", "10", "--apiservers", "2", "--jobs", "4", "--exec-rate", "200", "--hollow-procs", "4", "--dir", work, "--json")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("bench: %v\n%s", err, stderr.String())
	}
	var r cpReport
	if err := json.Unmarshal(out, &r); err != nil {
		t.Fatalf("bench printed %q: %v", out, err)
	}
	if d := r.EdgeDeath; d != nil {
		t.Logf("edge death: %d edges killed after %d of %d creates: %d failed, %d sent to a dead edge, %d resent, unhealthy in every view after %.2f s, back in %.1f s",
			d.EdgesKilled, d.KilledAfter, d.BurstCreates, d.FailedCreates, d.SentToDead, d.Resent, d.UnhealthySeconds, d.RestartSeconds)
	}
	t.Logf("fill %.0f/s; hold %.0f creates/s (p50 %.1f ms, p99 %.1f ms), %.0f deletes/s, %.0f execs/s; job of %d: list %.2f s, pause %.2f s; placement %.3f",
		r.FillCreatesPerSec, r.CreatesPerSec, r.CreateP50MS, r.CreateP99MS, r.DeletesPerSec, r.ExecsPerSec, r.JobSize, r.ListJobSeconds, r.PauseJobSeconds, r.PlacementMaxOverMean)
	switch {
	case r.FailedCreates != 0 || r.FailedDeletes != 0 || r.FailedExecs != 0:
		t.Errorf("failed: %d creates, %d deletes, %d execs (%v %v %v %v)", r.FailedCreates, r.FailedDeletes, r.FailedExecs, r.FillErrors, r.HoldErrors, r.DeleteErrors, r.ExecErrors)
	case r.LiveSandboxes < 20000 || r.LiveSandboxes > 20000+256:
		// (The hold's deletes follow its creates: at its end, a
		// concurrency's worth of deletes may not have followed yet.)
		t.Errorf("%d live after the hold, want 20000 and at most --concurrency more", r.LiveSandboxes)
	case r.NodeSandboxes != r.LiveSandboxes:
		t.Errorf("GET /v1/nodes counts %d, the clients hold %d", r.NodeSandboxes, r.LiveSandboxes)
	case r.Unreachable != 0 || r.ReachChecked < r.JobSize*2:
		t.Errorf("%d of %d checks through the apiservers found nothing", r.Unreachable, r.ReachChecked)
	case r.JobSize != 5000 || r.ListJobSeconds <= 0 || r.PauseJobSeconds <= 0:
		t.Errorf("job by label: %d sandboxes, list %.2f s, pause %.2f s", r.JobSize, r.ListJobSeconds, r.PauseJobSeconds)
	case r.EdgeDeath == nil || r.EdgeDeath.EdgesKilled != 5 || r.EdgeDeath.KilledAfter == 0 || r.EdgeDeath.KilledAfter >= r.EdgeDeath.BurstCreates:
		t.Errorf("edge death: %+v, want 5 edges killed mid-burst", r.EdgeDeath)
	case r.EdgeDeath.FailedCreates != 0:
		t.Errorf("edge death: %d creates failed (%v)", r.EdgeDeath.FailedCreates, r.EdgeDeath.Errors)
	case r.EdgeDeath.UnhealthySeconds > 10:
		t.Errorf("edge death: the killed edges counted healthy for %.1f s", r.EdgeDeath.UnhealthySeconds)
	case r.EdgeDeath.NodeSandboxes != r.EdgeDeath.LiveAfter:
		t.Errorf("after the edge death GET /v1/nodes counts %d, the clients hold %d", r.EdgeDeath.NodeSandboxes, r.EdgeDeath.LiveAfter)
	case r.DeletedAll != r.EdgeDeath.LiveAfter+r.EdgeDeath.SandboxesLost || r.LeftAfterDelete != 0:
		// (The killed edges' sandboxes are failed records once they are
		// back: deleted by label too.)
		t.Errorf("teardown deleted %d (want %d live and %d failed), left %d", r.DeletedAll, r.EdgeDeath.LiveAfter, r.EdgeDeath.SandboxesLost, r.LeftAfterDelete)
	case r.PlacementMaxOverMean < 1 || r.PlacementMaxOverMean > 1.5:
		t.Errorf("placement max/mean %.3f", r.PlacementMaxOverMean)
	}
	if ents, _ := os.ReadDir(work); len(ents) != 0 {
		t.Errorf("left in the working directory: %v", ents)
	}
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		if b, err := os.ReadFile(p); err == nil && strings.Contains(string(b), work) {
			t.Errorf("a daemon outlived the bench: %s", strings.ReplaceAll(string(b), "\x00", " "))
		}
	}
}

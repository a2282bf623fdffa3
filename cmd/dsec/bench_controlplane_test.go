package main

import (
	"encoding/json"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/internal/store/etcdtest"
)

// TestControlPlaneBenchShort runs a short control-plane benchmark (a real
// etcd, two real apiservers, 20 hollow edges in two processes, 20,000
// sandboxes) and checks what it must hold whatever the machine's speed:
// no create lost, GET /v1/nodes counting what the clients hold, every
// sandbox reachable through either apiserver, nothing lost or made twice
// when an edge process or an apiserver dies mid-burst, nothing left after
// the teardown, placement strategies compared, the cloud pool used only
// past its threshold, and no daemon or directory left behind.
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
		"--duration", "10", "--apiservers", "2", "--job-size", "5000", "--exec-rate", "200", "--hollow-procs", "4", "--dir", work, "--json")
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
	case r.APIDeath == nil || r.DeletedAll != r.EdgeDeath.LiveAfter+r.EdgeDeath.SandboxesLost+r.APIDeath.BurstCreates || r.LeftAfterDelete != 0:
		// (The killed edges' sandboxes are failed records once they are
		// back: deleted by label too; then the apiserver death's burst.)
		t.Errorf("teardown deleted %d (want %d live, %d failed and the apiserver death's burst), left %d", r.DeletedAll, r.EdgeDeath.LiveAfter, r.EdgeDeath.SandboxesLost, r.LeftAfterDelete)
	case r.PlacementMaxOverMean < 1 || r.PlacementMaxOverMean > 1.5:
		t.Errorf("placement max/mean %.3f", r.PlacementMaxOverMean)
	case r.APIDeath == nil || r.APIDeath.KilledAfter == 0 || r.APIDeath.KilledAfter >= r.APIDeath.BurstCreates:
		t.Errorf("apiserver death: %+v, want one killed mid-burst", r.APIDeath)
	case r.APIDeath.FailedCreates != 0 || r.APIDeath.Duplicates != 0:
		t.Errorf("apiserver death: %d creates failed (%v), %d made twice", r.APIDeath.FailedCreates, r.APIDeath.Errors, r.APIDeath.Duplicates)
	}
	// Who spent the hold's CPU: every group measured, the apiservers and
	// the hollow edges busy, the host's cores no busier than it has.
	t.Logf("hold CPU: host %.2f of %d cores; %+v; apiservers %.2f ms per create", r.HoldHostBusyCores, r.HostCores, r.HoldCPU, r.ApiserverMSPerCreate)
	busy := map[string]float64{}
	for _, c := range r.HoldCPU {
		busy[c.Name] = c.Cores
	}
	if len(r.HoldCPU) != 5 || busy["server0"] <= 0 || busy["server1"] <= 0 || busy["hollow edges"] <= 0 || busy["bench (clients)"] <= 0 ||
		r.HoldHostBusyCores <= 0 || r.HoldHostBusyCores > float64(r.HostCores)+0.5 || r.ApiserverMSPerCreate <= 0 {
		t.Errorf("hold CPU: host %.2f of %d cores, %+v, apiservers %.2f ms per create", r.HoldHostBusyCores, r.HostCores, r.HoldCPU, r.ApiserverMSPerCreate)
	}
	for _, s := range r.Strategies {
		t.Logf("placement %s (k %s, overlay %v): max/mean %.3f, worst during %.3f, job %.3f", s.Strategy, s.PlacementK, s.Overlay, s.MaxOverMean, s.WorstDuring, s.JobMaxOverMean)
	}
	// The strategies in their order (strategies): the overlay is what
	// keeps a burst placed from a view a poll old from herding.
	switch st := r.Strategies; {
	case len(st) != len(strategies):
		t.Errorf("%d placement strategies compared, want %d", len(st), len(strategies))
	case st[0].FailedCreates+st[1].FailedCreates+st[2].FailedCreates+st[3].FailedCreates+st[4].FailedCreates != 0:
		t.Errorf("placement strategies: creates failed: %+v", st)
	case st[0].MaxOverMean < 1 || st[0].MaxOverMean > 1.5:
		t.Errorf("power of 2 with the overlay: max/mean %.3f", st[0].MaxOverMean)
	case st[4].MaxOverMean <= st[3].MaxOverMean:
		t.Errorf("least loaded: max/mean %.3f without the overlay, %.3f with it: no herding shown", st[4].MaxOverMean, st[3].MaxOverMean)
	}
	if b := r.CloudBurst; b == nil || b.FailedCreates != 0 || b.ToCloud == 0 || b.FirstToCloud < b.ThresholdCreates-256 {
		// (Creates are counted in the order they were answered: up to
		// --concurrency of them may overtake each other.)
		t.Errorf("cloud bursting: %+v, want the cloud pool used only once the others passed the threshold", b)
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

// TestHoldCPU checks the hold's CPU arithmetic: cores over the wall time,
// milliseconds per create, and the apiservers' sum scaled to the target.
func TestHoldCPU(t *testing.T) {
	var r cpReport
	r.Target.Rate = 5000
	roles := []cpuGroup{{name: "server0", apiserver: true}, {name: "server1", apiserver: true}, {name: "hollow edges"}, {name: "etcd"}, {name: "bench (clients)"}}
	before := []float64{10, 20, 100, 1, 5}
	after := []float64{14, 25, 110, 1.5, 7}
	r.holdCPU(roles, before, after, 10*time.Second, 4000)
	if len(r.HoldCPU) != len(roles) {
		t.Fatalf("%d groups, want %d", len(r.HoldCPU), len(roles))
	}
	for i, want := range []cpHoldCPU{{"server0", 0.4, 1}, {"server1", 0.5, 1.25}, {"hollow edges", 1, 2.5}, {"etcd", 0.05, 0.125}, {"bench (clients)", 0.2, 0.5}} {
		if got := r.HoldCPU[i]; got.Name != want.Name || math.Abs(got.Cores-want.Cores) > 1e-9 || math.Abs(got.MSPerCreate-want.MSPerCreate) > 1e-9 {
			t.Errorf("group %d: %+v, want %+v", i, got, want)
		}
	}
	// 9 s of apiserver CPU over 4,000 creates: 2.25 ms each, 11.25 cores
	// at 5,000/s.
	if math.Abs(r.ApiserverMSPerCreate-2.25) > 1e-9 || math.Abs(r.ApiserverCoresAtTarget-11.25) > 1e-9 {
		t.Errorf("apiservers %.3f ms per create, %.3f cores at the target; want 2.25 and 11.25", r.ApiserverMSPerCreate, r.ApiserverCoresAtTarget)
	}
}

// TestParseProcStat reads a /proc/stat of two cores: the busy time is
// user+nice+system+irq+softirq of the "cpu" line (not idle, iowait or
// steal) in seconds, and the cores are the "cpuN" lines.
func TestParseProcStat(t *testing.T) {
	const stat = `cpu  1000 20 300 50000 700 11 22 33 0 0
cpu0 500 10 150 25000 350 5 11 16 0 0
cpu1 500 10 150 25000 350 6 11 17 0 0
intr 12345 0 0
ctxt 999
btime 1700000000
`
	busy, cores, err := parseProcStat(stat)
	if err != nil {
		t.Fatal(err)
	}
	// (1000+20+300+11+22) / 100
	if math.Abs(busy-13.53) > 1e-9 || cores != 2 {
		t.Errorf("busy %.4f s on %d cores, want 13.53 s on 2", busy, cores)
	}
	for _, bad := range []string{"", "intr 1 2\n", "cpu 1 2 3\ncpu0 1 2 3 4 5 6 7\n", "cpu 1 2 x 4 5 6 7 8\ncpu0 1 2 3 4 5 6 7 8\n", "cpu 1 2 3 4 5 6 7 8\n"} {
		if _, _, err := parseProcStat(bad); err == nil {
			t.Errorf("parseProcStat(%q): no error", bad)
		}
	}
}

// TestHostBusySeconds reads /proc/stat twice around some work: busy time
// grows, and by no more than the cores could give.
func TestHostBusySeconds(t *testing.T) {
	a, cores, err := hostBusySeconds()
	if err != nil {
		t.Skip(err) // not Linux
	}
	start := time.Now()
	for time.Since(start) < 200*time.Millisecond {
	}
	b, _, err := hostBusySeconds()
	if err != nil {
		t.Fatal(err)
	}
	// (Each of five fields rounds to 10 ms on each core.)
	if d := b - a; d <= 0 || d > float64(cores)*time.Since(start).Seconds()+0.1*float64(cores) {
		t.Errorf("host busy grew by %.3f s over %v of spinning on %d cores", d, time.Since(start), cores)
	}
}

// TestCPOptsJobs checks how the fill's jobs follow from the flags: a
// --job-size alone makes as many jobs as it takes (the refill after the
// job's listing is named after them, so it must count them all).
func TestCPOptsJobs(t *testing.T) {
	for _, tc := range []struct {
		sandboxes, jobs, jobSize int
		wantJobs, wantSize       int
	}{
		{380000, 0, 0, 12, 31667},
		{380000, 12, 32000, 12, 32000},
		{20000, 4, 0, 4, 5000},
		{10000, 0, 2500, 4, 2500},
		{10000, 0, 2400, 5, 2400},
		{1000, 0, 0, 2, 500},
	} {
		o := cpOpts{edges: 160, sandboxes: tc.sandboxes, rate: 100, duration: time.Second, apiservers: 2, jobs: tc.jobs, jobSize: tc.jobSize, concurrency: 256}
		if err := o.check(); err != nil {
			t.Errorf("%+v: %v", tc, err)
			continue
		}
		if o.jobs != tc.wantJobs || o.jobSize != tc.wantSize {
			t.Errorf("--sandboxes %d --jobs %d --job-size %d: %d jobs of %d, want %d of %d", tc.sandboxes, tc.jobs, tc.jobSize, o.jobs, o.jobSize, tc.wantJobs, tc.wantSize)
		}
	}
}

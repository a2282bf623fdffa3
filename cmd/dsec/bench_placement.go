package main

import (
	"context"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dsecproject/dsec/api"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// cpTier is a pair (--apiservers) of apiservers a phase starts for itself,
// with placement flags of its own, and a client on each. The bench's own
// apiservers keep running beside them (their views are what the phase
// samples) but take no creates meanwhile.
type cpTier struct {
	procs   []*benchProc
	clients []*dsec.Client
}

// startTier starts o.apiservers apiservers named name-0, name-1, ... with
// args added to their flags, and waits until each one's view has every
// one of want hollow edges healthy.
func (w *cpWorld) startTier(ctx context.Context, o cpOpts, name string, want int, args ...string) (*cpTier, error) {
	t := &cpTier{}
	var urls []string
	for i := range o.apiservers {
		url, p, err := w.startServer(ctx, fmt.Sprintf("%s-%d", name, i), "", nil, args...)
		if p != nil {
			t.procs = append(t.procs, p)
		}
		if err != nil {
			return t, err
		}
		urls = append(urls, url)
	}
	var err error
	if t.clients, err = w.clientsOf(cpOpts{}, urls); err != nil {
		return t, err
	}
	deadline := time.Now().Add(60 * time.Second)
	for _, c := range t.clients {
		for {
			nodes, err := c.ListNodes(ctx)
			healthy := 0
			for _, n := range nodes {
				if n.Hollow && n.Healthy {
					healthy++
				}
			}
			if err == nil && healthy == want {
				break
			}
			if time.Now().After(deadline) || ctx.Err() != nil {
				return t, fmt.Errorf("%s: %d of %d hollow edges healthy in %s's view after 60 s (%v)", name, healthy, want, c.Endpoint(), err)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	return t, nil
}

func (t *cpTier) stop() {
	for _, p := range t.procs {
		p.stop()
	}
}

// cpStrategy is one placement strategy's burst in the comparison
// (--placement-compare): the same creates, from empty edges, through
// apiservers started with that strategy.
type cpStrategy struct {
	Strategy      string `json:"strategy"`
	PlacementK    string `json:"placement_k"`
	Overlay       bool   `json:"overlay"`
	Creates       int    `json:"creates"`
	FailedCreates int    `json:"failed_creates"`
	// Errors counts the failed creates by their error's first words.
	Errors        map[string]int `json:"errors,omitempty"`
	CreatesPerSec float64        `json:"creates_per_sec"`
	// MaxOverMean and Stddev are the per-edge load once every create is
	// in the view; WorstDuring is the largest max/mean the view showed
	// while the burst ran (once the mean was a tenth of its end), where
	// herding shows; JobMaxOverMean the largest over the burst's jobs of
	// one job's max/mean per edge at the end.
	MaxOverMean    float64 `json:"max_over_mean"`
	Stddev         float64 `json:"stddev"`
	WorstDuring    float64 `json:"worst_max_over_mean_during"`
	JobMaxOverMean float64 `json:"job_max_over_mean"`
}

// strategies are the compared placements: power of two choices and least
// loaded from the view, each with and without the overlay, and random
// (which reads no load, so the overlay does not matter to it).
var strategies = []struct {
	name, k string
	overlay bool
}{
	{"power-of-2", "2", true},
	{"power-of-2", "2", false},
	{"random", "1", true},
	{"least-loaded", "all", true},
	{"least-loaded", "all", false},
}

// comparePlacement runs the same burst of n creates (jobs of a quarter
// each, at most --job-size) once per strategy, each through apiservers of
// its own and from the edges' load at the start (the bench runs it on
// empty edges), and deletes each burst's sandboxes before the next.
func (w *cpWorld) comparePlacement(ctx context.Context, o cpOpts, n int, live *atomic.Int64) ([]cpStrategy, error) {
	var out []cpStrategy
	jobSize := max(1, min(o.jobSize, n/4))
	for si, st := range strategies {
		name := fmt.Sprintf("place-%s", st.name)
		if !st.overlay {
			name += "-no-overlay"
		}
		progress("placement: %s (k %s, overlay %v), %d creates", st.name, st.k, st.overlay, n)
		tier, err := w.startTier(ctx, o, name, o.edges, "--placement-k", st.k, fmt.Sprintf("--placement-overlay=%v", st.overlay))
		if err != nil {
			tier.stop()
			return nil, err
		}
		r := cpStrategy{Strategy: st.name, PlacementK: st.k, Overlay: st.overlay, Creates: n}
		base := int(live.Load())
		sampleCtx, endSample := context.WithCancel(ctx)
		var worst float64
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			worst = w.worstSpread(sampleCtx, base, float64(n)/float64(o.edges)/10)
		}()
		var jobs []string
		t := time.Now()
		made := 0
		for j := 0; made < n; j++ {
			job := fmt.Sprintf("place-%d-%d", si, j)
			ph := w.createsVia(ctx, o, tier.clients, job, min(jobSize, n-made), o.rate, time.Time{}, live)
			r.FailedCreates += ph.fails
			r.Errors = addCounts(r.Errors, ph.errs)
			made += min(jobSize, n-made)
			jobs = append(jobs, job)
		}
		r.CreatesPerSec = float64(n-r.FailedCreates) / time.Since(t).Seconds()
		want := base + n - r.FailedCreates
		if _, err := w.nodesHolding(ctx, want); err != nil {
			endSample()
			wg.Wait()
			tier.stop()
			return nil, err
		}
		endSample()
		wg.Wait()
		r.WorstDuring = worst
		nodes, err := w.clients[0].ListNodes(ctx)
		if err != nil {
			tier.stop()
			return nil, err
		}
		r.MaxOverMean, r.Stddev = placementSpread(nodes)
		r.JobMaxOverMean = jobSpread(nodes, jobs)
		r.WorstDuring = max(r.WorstDuring, r.MaxOverMean)
		tier.stop()
		for _, job := range jobs {
			d, err := w.clients[0].DeleteSandboxes(ctx, map[string]string{"job": job, "bench": w.label})
			live.Add(-int64(d))
			if err != nil {
				return nil, fmt.Errorf("deleting %s: %w", job, err)
			}
		}
		if held, err := w.nodesHolding(ctx, base); err != nil || held != base {
			return nil, fmt.Errorf("after %s's burst was deleted the nodes hold %d, want %d (%v)", name, held, base, err)
		}
		out = append(out, r)
	}
	return out, nil
}

// worstSpread samples the per-edge spread of what the creates since base
// added (GET /v1/nodes, every 250 ms) until ctx ends, and returns the
// largest max/mean seen once the mean was at least minMean.
func (w *cpWorld) worstSpread(ctx context.Context, base int, minMean float64) float64 {
	var worst float64
	for ctx.Err() == nil {
		if nodes, err := w.clients[0].ListNodes(ctx); err == nil {
			var loads []float64
			for _, n := range nodes {
				if n.Hollow {
					loads = append(loads, float64(liveOn(n)))
				}
			}
			if m, mean := maxMean(loads); mean-float64(base)/float64(len(loads)) >= max(minMean, 1) {
				worst = max(worst, m/mean)
			}
		}
		select {
		case <-ctx.Done():
		case <-time.After(250 * time.Millisecond):
		}
	}
	return worst
}

// maxMean is the largest of loads and their mean.
func maxMean(loads []float64) (float64, float64) {
	var sum, mx float64
	for _, l := range loads {
		sum += l
		mx = math.Max(mx, l)
	}
	if len(loads) == 0 {
		return 0, 0
	}
	return mx, sum / float64(len(loads))
}

// jobSpread is the largest over jobs of a job's max/mean sandboxes per
// hollow edge.
func jobSpread(nodes []api.Node, jobs []string) float64 {
	var worst float64
	for _, job := range jobs {
		var loads []float64
		for _, n := range nodes {
			if n.Hollow {
				loads = append(loads, float64(n.Jobs[job]))
			}
		}
		if m, mean := maxMean(loads); mean > 0 {
			worst = max(worst, m/mean)
		}
	}
	return worst
}

// cpBurst is the cloud-bursting phase (--cloud-edges): hollow edges
// labelled pool=cloud join, apiservers started with --overflow-pool
// cloud=THRESHOLD take a burst of creates, and the threshold is set so
// that the other edges pass it part of the way in.
type cpBurst struct {
	CloudEdges int `json:"cloud_edges"`
	// Threshold is the utilization (of --max-sandboxes) every regular
	// edge must reach before the cloud pool takes creates: reached, on
	// average, after ThresholdCreates of the burst's creates.
	Threshold        float64 `json:"threshold_utilization"`
	ThresholdCreates int     `json:"threshold_after_creates"`
	Creates          int     `json:"creates"`
	FailedCreates    int     `json:"failed_creates"`
	// Errors counts the failed creates by their error's first words.
	Errors map[string]int `json:"errors,omitempty"`
	// ToCloud counts the creates placed on the cloud pool; FirstToCloud
	// is how many creates had succeeded before the first one did (in the
	// order they were answered); BeforeThreshold counts those that went
	// there among the first ThresholdCreates (the target is 0).
	ToCloud         int `json:"to_cloud"`
	FirstToCloud    int `json:"first_to_cloud_after_creates"`
	BeforeThreshold int `json:"to_cloud_before_threshold"`
	// ShareAfter is the share of the creates after ThresholdCreates that
	// went to the cloud pool, and CloudShareOfEdges the cloud pool's
	// share of the edges (what an even spread over all would give it).
	ShareAfter        float64 `json:"cloud_share_after_threshold"`
	CloudShareOfEdges float64 `json:"cloud_share_of_edges"`
	// RegularMin is the least any regular edge held at the end (the
	// threshold's load is Threshold × max_sandboxes).
	RegularMin  int `json:"regular_min_at_end"`
	ThresholdAt int `json:"threshold_sandboxes_per_edge"`
}

// cloudBurst starts --cloud-edges hollow edges with pool=cloud in a process
// of their own, sets the threshold so that the regular edges pass it 60% of
// the way into a burst of n creates, runs the burst through apiservers with
// that overflow pool, and then deletes it and stops the cloud edges.
func (w *cpWorld) cloudBurst(ctx context.Context, o cpOpts, n int, live *atomic.Int64) (*cpBurst, error) {
	out := &cpBurst{CloudEdges: o.cloudEdges, Creates: n}
	names, proc, err := w.startHollow(ctx, o, "cloud", o.cloudEdges, "--node-labels", "pool=cloud")
	if proc != nil {
		defer proc.stop()
	}
	if err != nil {
		return nil, err
	}
	cloud := map[string]bool{}
	for _, name := range names {
		cloud[name] = true
	}
	base := int(live.Load())
	// Load per regular edge at the threshold: what they hold now plus
	// 60% of the burst, spread evenly.
	out.ThresholdAt = (base + n*6/10 + o.edges - 1) / o.edges
	out.ThresholdCreates = out.ThresholdAt*o.edges - base
	perEdge := w.perEdge(o)
	// Half a sandbox under the threshold's load, so that rounding never
	// keeps the pool shut once every edge is there.
	out.Threshold = (float64(out.ThresholdAt) - 0.5) / float64(perEdge)
	out.CloudShareOfEdges = float64(o.cloudEdges) / float64(o.edges+o.cloudEdges)
	progress("cloud bursting: %d cloud edges, threshold %.4f (%d per edge, after %d creates), %d creates", o.cloudEdges, out.Threshold, out.ThresholdAt, out.ThresholdCreates, n)
	tier, err := w.startTier(ctx, o, "burst", o.edges+o.cloudEdges, "--overflow-pool", fmt.Sprintf("cloud=%.6f", out.Threshold))
	defer tier.stop()
	if err != nil {
		return nil, err
	}
	ph := w.createsVia(ctx, o, tier.clients, "cloud-burst", n, o.rate, time.Time{}, live)
	out.FailedCreates, out.Errors = ph.fails, addCounts(nil, ph.errs)
	out.FirstToCloud = -1
	after := 0
	for i, node := range ph.nodes {
		if !cloud[node] {
			continue
		}
		out.ToCloud++
		if out.FirstToCloud < 0 {
			out.FirstToCloud = i
		}
		if i < out.ThresholdCreates {
			out.BeforeThreshold++
		} else {
			after++
		}
	}
	if len(ph.nodes) > out.ThresholdCreates {
		out.ShareAfter = float64(after) / float64(len(ph.nodes)-out.ThresholdCreates)
	}
	if _, err := w.nodesHolding(ctx, base+len(ph.ids)); err != nil {
		return nil, err
	}
	nodes, err := w.clients[0].ListNodes(ctx)
	if err != nil {
		return nil, err
	}
	out.RegularMin = math.MaxInt
	for _, nd := range nodes {
		if nd.Hollow && !cloud[nd.Name] {
			out.RegularMin = min(out.RegularMin, liveOn(nd))
		}
	}
	d, err := w.clients[0].DeleteSandboxes(ctx, map[string]string{"job": "cloud-burst", "bench": w.label})
	live.Add(-int64(d))
	if err != nil {
		return nil, fmt.Errorf("deleting the cloud burst: %w", err)
	}
	if held, err := w.nodesHolding(ctx, base); err != nil || held != base {
		return nil, fmt.Errorf("after the cloud burst was deleted the nodes hold %d, want %d (%v)", held, base, err)
	}
	return out, nil
}

// addCounts adds b's counts to a (made when nil and b has any) and returns
// it.
func addCounts(a, b map[string]int) map[string]int {
	for k, v := range b {
		if a == nil {
			a = map[string]int{}
		}
		a[k] += v
	}
	return a
}

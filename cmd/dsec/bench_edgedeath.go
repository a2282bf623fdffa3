package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// cpDeath is what the edge-death phase measured: a burst of creates during
// which one hollow process (a tenth of the edges by default) is killed.
type cpDeath struct {
	Process     string `json:"process"`
	EdgesKilled int    `json:"edges_killed"`
	// SandboxesLost went with the killed edges (the clients held them).
	SandboxesLost int `json:"sandboxes_lost_with_them"`
	BurstCreates  int `json:"burst_creates"`
	// FailedCreates counts the burst's creates that failed: the target
	// is 0 (one in flight on a killed edge goes to another node).
	FailedCreates int            `json:"failed_creates"`
	Errors        map[string]int `json:"errors,omitempty"`
	CreateP50MS   float64        `json:"create_p50_ms"`
	CreateP99MS   float64        `json:"create_p99_ms"`
	// KilledAfter is how many of the burst's creates had succeeded at
	// the kill.
	KilledAfter int `json:"killed_after_creates"`
	// UnhealthySeconds is the time from the kill until every apiserver's
	// view shows every killed edge unhealthy (placement avoids them from
	// then on, and before that a create sent to one goes elsewhere).
	UnhealthySeconds float64 `json:"unhealthy_in_every_view_seconds"`
	// SentToDead counts the creates the apiservers sent to an edge that
	// refused the connection, and Resent those sent to their node again
	// after a lost answer (dsec_placements_total over the phase): what
	// the dead edges cost until every view had them down.
	SentToDead int `json:"sent_to_dead_edges"`
	Resent     int `json:"resent"`
	// RestartSeconds is the time from the restart of the killed process
	// until every view shows its edges healthy again.
	RestartSeconds float64 `json:"restart_seconds"`
	// LiveAfter is what the clients hold once the edges are back, and
	// NodeSandboxes what GET /v1/nodes counts then (they must agree).
	LiveAfter     int `json:"live_after"`
	NodeSandboxes int `json:"node_sandboxes"`
}

// edgeDeath runs a burst of creates and kills the last hollow process
// (SIGKILL: its edges' simulated sandboxes go with it) a quarter of the
// way in; then it restarts the process and checks the nodes' counts
// against the clients'.
func (w *cpWorld) edgeDeath(ctx context.Context, o cpOpts, live *atomic.Int64) (*cpDeath, error) {
	k := len(w.hollow) - 1
	victim := map[string]bool{}
	for _, n := range w.hollow[k] {
		victim[n] = true
	}
	out := &cpDeath{Process: w.hollowProc[k].name, EdgesKilled: len(w.hollow[k]), Errors: map[string]int{}}
	// What the victims hold, from a view caught up with the clients (no
	// create or delete is in flight now).
	if _, err := w.nodesHolding(ctx, int(live.Load())); err != nil {
		return nil, err
	}
	nodes, err := w.clients[0].ListNodes(ctx)
	if err != nil {
		return nil, err
	}
	before := 0
	for _, n := range nodes {
		if victim[n.Name] {
			before += liveOn(n)
		}
	}
	out.SandboxesLost = before
	n := min(5*o.rate, max(o.sandboxes/10, 100), 20000)
	out.BurstCreates = n
	progress("edge death: %d creates; %s (%d edges) killed a quarter of the way in", n, out.Process, out.EdgesKilled)

	var mu sync.Mutex
	var durs []time.Duration
	var killedAt time.Time
	var made atomic.Int64
	killed := make(chan struct{})
	go func() {
		for made.Load() < int64(n/4) {
			if ctx.Err() != nil {
				return
			}
			time.Sleep(time.Millisecond)
		}
		p := w.hollowProc[k]
		_ = p.cmd.Process.Kill()
		mu.Lock()
		killedAt = time.Now()
		out.KilledAfter = int(made.Load())
		mu.Unlock()
		close(killed)
		_ = p.cmd.Wait()
	}()
	placed0 := w.placements()
	var burst sync.WaitGroup
	burst.Add(1)
	go func() {
		defer burst.Done()
		w.paced(ctx, o.concurrency, n, o.rate, nil, func(c *dsec.Client, _ int64) {
			t := time.Now()
			sb, err := c.CreateSandbox(ctx, api.SandboxSpec{Base: w.ref, TTL: 86400, Labels: map[string]string{"job": "edge-death", "bench": w.label}})
			end := time.Now()
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				out.FailedCreates++
				out.Errors[errClass(err)]++
				return
			}
			made.Add(1)
			durs = append(durs, end.Sub(t))
			if node, _ := edgeapi.NodeOf(sb.ID); victim[node] {
				out.SandboxesLost++
				return
			}
			live.Add(1)
		})
	}()
	select {
	case <-killed:
	case <-ctx.Done():
		burst.Wait()
		return nil, ctx.Err()
	}
	// Until every apiserver's view has every killed edge unhealthy.
	if err := w.untilEdges(ctx, victim, false, 60*time.Second); err != nil {
		burst.Wait()
		return nil, err
	}
	out.UnhealthySeconds = time.Since(killedAt).Seconds()
	burst.Wait()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	// (The burst's creates on killed edges never counted as live.)
	live.Add(-int64(before))
	out.CreateP50MS, out.CreateP99MS = pct(durs, .5), pct(durs, .99)
	placed1 := w.placements()
	out.SentToDead = int(placed1["unreachable"] - placed0["unreachable"])
	out.Resent = int(placed1["resent"] - placed0["resent"])

	// The process comes back with the same state dirs: its edges take
	// their names back, and their sandboxes (which died with it) are
	// failed records.
	t := time.Now()
	hc := w.hollowCmd[k]
	p, err := w.startEnv(out.Process+"-restarted", hc.env, hc.args...)
	if err != nil {
		return nil, err
	}
	w.hollowProc[k] = p
	if err := w.untilEdges(ctx, victim, true, 120*time.Second); err != nil {
		return nil, err
	}
	out.RestartSeconds = time.Since(t).Seconds()
	out.LiveAfter = int(live.Load())
	if out.NodeSandboxes, err = w.nodesHolding(ctx, out.LiveAfter); err != nil {
		return nil, err
	}
	return out, nil
}

// untilEdges waits until every apiserver's view shows every edge of names
// healthy (or every one unhealthy), at most limit.
func (w *cpWorld) untilEdges(ctx context.Context, names map[string]bool, healthy bool, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	for {
		done := true
		for _, c := range w.clients {
			nodes, err := c.ListNodes(ctx)
			if err != nil {
				done = false
				break
			}
			seen := 0
			for _, n := range nodes {
				if names[n.Name] {
					seen++
					if n.Healthy != healthy {
						done = false
					}
				}
			}
			if healthy && seen != len(names) {
				done = false
			}
		}
		if done {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the edges %v are not all healthy=%v in every view after %s", keys(names), healthy, limit)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func keys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

// placements sums dsec_placements_total by result over the apiservers.
func (w *cpWorld) placements() map[string]float64 {
	out := map[string]float64{}
	hc := &http.Client{Timeout: 5 * time.Second}
	for _, u := range w.servers {
		resp, err := hc.Get(u + "/metrics")
		if err != nil {
			continue
		}
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 32<<20))
		resp.Body.Close()
		for _, line := range strings.Split(string(b), "\n") {
			rest, ok := strings.CutPrefix(line, `dsec_placements_total{result="`)
			if !ok {
				continue
			}
			result, val, ok := strings.Cut(rest, `"} `)
			if v, err := strconv.ParseFloat(strings.TrimSpace(val), 64); ok && err == nil {
				out[result] += v
			}
		}
	}
	return out
}

package main

import (
	"context"
	"fmt"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/dsecproject/dsec/internal/edgeapi"
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
	out := &cpDeath{Process: w.hollowProc[k].name, EdgesKilled: len(w.hollow[k])}
	// What the victims hold, from a view caught up with the clients (no
	// create or delete is in flight now).
	if _, err := w.nodesHolding(ctx, int(live.Load())); err != nil {
		return nil, err
	}
	nodes, err := w.clients[0].ListNodes(ctx)
	if err != nil {
		return nil, err
	}
	for _, n := range nodes {
		if victim[n.Name] {
			out.SandboxesLost += liveOn(n)
		}
	}
	n := min(5*o.rate, max(o.sandboxes/10, 100), 20000)
	out.BurstCreates = n
	progress("edge death: %d creates; %s (%d edges) killed a quarter of the way in", n, out.Process, out.EdgesKilled)

	// The kill, once a quarter of the burst's creates succeeded.
	kill := w.killWhenMade(ctx, w.hollowProc[k], int64(n/4))
	placed0 := w.placements()
	var ph cpPhase
	burst := make(chan struct{})
	go func() {
		defer close(burst)
		ph = w.creates(ctx, o, "edge-death", n, o.rate, live)
	}()
	select {
	case <-kill.done:
	case <-ctx.Done():
		<-burst
		return nil, ctx.Err()
	}
	// Until every apiserver's view has every killed edge unhealthy.
	if err := w.untilEdges(ctx, victim, false, 60*time.Second); err != nil {
		<-burst
		return nil, err
	}
	out.UnhealthySeconds = time.Since(kill.at).Seconds()
	out.KilledAfter = kill.after
	<-burst
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	out.FailedCreates, out.Errors = ph.fails, ph.errs
	// What the killed edges held went with them: before the burst, and
	// what the burst made on them.
	for _, id := range ph.ids {
		if node, _ := edgeapi.NodeOf(id); victim[node] {
			out.SandboxesLost++
		}
	}
	live.Add(-int64(out.SandboxesLost))
	d := durs(ph.samples)
	out.CreateP50MS, out.CreateP99MS = pct(d, .5), pct(d, .99)
	placed1 := w.placements()
	out.SentToDead = int(placed1["unreachable"] - placed0["unreachable"])
	out.Resent = int(placed1["resent"] - placed0["resent"])

	// The process comes back with the same state dirs: its edges take
	// their names back, and their sandboxes (which died with it) are
	// failed records.
	t := time.Now()
	dead := w.hollowProc[k]
	p, err := w.startEnv(out.Process+"-restarted", dead.env, dead.args...)
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
		m, err := promValues(hc, u+"/metrics")
		if err != nil {
			continue
		}
		for _, result := range []string{"unreachable", "resent"} {
			out[result] += m[`dsec_placements_total{result="`+result+`"}`]
		}
	}
	return out
}

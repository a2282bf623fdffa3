package main

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	dsec "github.com/dsecproject/dsec/sdk/go"
)

// cpAPIDeath is what the apiserver-death phase measured: a burst of creates
// through clients that know every apiserver (as DSEC_ENDPOINT lists them)
// and send Idempotency-Keys (the SDK's default), during which one
// apiserver is killed.
type cpAPIDeath struct {
	Server       string `json:"server"`
	BurstCreates int    `json:"burst_creates"`
	KilledAfter  int    `json:"killed_after_creates"`
	// FailedCreates must be 0: a create the dead apiserver held is sent
	// to another with its key, which finds what the first made.
	FailedCreates int            `json:"failed_creates"`
	Errors        map[string]int `json:"errors,omitempty"`
	CreateP50MS   float64        `json:"create_p50_ms"`
	CreateP99MS   float64        `json:"create_p99_ms"`
	CreateMaxMS   float64        `json:"create_max_ms"`
	// Duplicates is what the nodes hold beyond what the clients do once
	// the view has caught up (the target is 0: a repeat never makes a
	// second sandbox).
	Duplicates int `json:"duplicates"`
	// RestartSeconds is the time the killed apiserver took to serve again
	// (it keeps no state: it syncs its view and serves).
	RestartSeconds float64 `json:"restart_seconds"`
}

// cpKill is a kill of a daemon once a count of creates had succeeded.
type cpKill struct {
	done  chan struct{}
	at    time.Time
	after int
}

// killWhenMade kills p (SIGKILL) once count creates have succeeded from
// now on; done is closed at the kill.
func (w *cpWorld) killWhenMade(ctx context.Context, p *benchProc, count int64) *cpKill {
	k := &cpKill{done: make(chan struct{})}
	base := w.made.Load()
	go func() {
		for w.made.Load()-base < count {
			if ctx.Err() != nil {
				return
			}
			time.Sleep(time.Millisecond)
		}
		_ = p.cmd.Process.Kill()
		k.at, k.after = time.Now(), int(w.made.Load()-base)
		close(k.done)
		_ = p.cmd.Wait()
	}()
	return k
}

// apiserverDeath runs a burst of creates spread over every apiserver (each
// client lists them all, its own first) and kills the last apiserver a
// quarter of the way in; then it checks that nothing failed or was made
// twice, and starts the apiserver again.
func (w *cpWorld) apiserverDeath(ctx context.Context, o cpOpts, live *atomic.Int64) (*cpAPIDeath, error) {
	last := len(w.servers) - 1
	name := fmt.Sprintf("server%d", last)
	i := slices.IndexFunc(w.procs, func(p *benchProc) bool { return p.name == name })
	if i < 0 {
		return nil, fmt.Errorf("no process %s", name)
	}
	victim := w.procs[i]
	var clients []*dsec.Client
	for k := range w.servers {
		eps := append(append([]string{}, w.servers[k:]...), w.servers[:k]...)
		c, err := dsec.New(dsec.WithEndpoint(strings.Join(eps, ",")), dsec.WithAPIKey(benchKey), dsec.WithHTTPClient(w.hc))
		if err != nil {
			return nil, err
		}
		clients = append(clients, c)
	}
	n := min(5*o.rate, max(o.sandboxes/10, 100), 20000)
	out := &cpAPIDeath{Server: name, BurstCreates: n}
	progress("apiserver death: %d creates; %s killed a quarter of the way in", n, name)
	kill := w.killWhenMade(ctx, victim, int64(n/4))
	ph := w.createsVia(ctx, o, clients, "apiserver-death", n, o.rate, time.Time{}, live)
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	select {
	case <-kill.done:
	default:
		return nil, fmt.Errorf("%s was not killed: %d of %d creates succeeded", name, len(ph.ids), n)
	}
	out.KilledAfter = kill.after
	out.FailedCreates, out.Errors = ph.fails, ph.errs
	d := durs(ph.samples)
	out.CreateP50MS, out.CreateP99MS, out.CreateMaxMS = pct(d, .5), pct(d, .99), pct(d, 1)
	held, err := w.nodesHolding(ctx, int(live.Load()))
	if err != nil {
		return nil, err
	}
	out.Duplicates = held - int(live.Load())

	t := time.Now()
	p, err := w.startEnv(name+"-restarted", victim.env, victim.args...)
	if err != nil {
		return nil, err
	}
	if err := waitHealthz(ctx, w.servers[last]+"/healthz", p); err != nil {
		return nil, err
	}
	out.RestartSeconds = time.Since(t).Seconds()
	return out, nil
}

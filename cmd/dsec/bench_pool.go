package main

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/dsecproject/dsec/api"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// benchPool measures creates served from a warm pool and FnCall round
// trips, each against a plain create measured in the same run. The daemon
// must run with warm pools (dsec up --warm-pool-max, default 8). Creates
// are spaced (--pool-gap) so that the pool's one-at-a-time refill keeps up:
// what is measured is a claim, not a refill under a burst.
func benchPool(ctx context.Context, c *dsec.Client, o benchOpts, ref string) ([]benchRow, error) {
	label := fmt.Sprintf("bench-pool-%d", time.Now().UnixNano())
	spec := api.SandboxSpec{Base: ref, MemoryMB: 512, Labels: map[string]string{"bench": label}}
	defer func() { _, _ = c.DeleteSandboxes(context.Background(), map[string]string{"bench": label}) }()

	// Demand first: the edge sizes a class's pool by its recent creates.
	fmt.Fprintf(os.Stderr, "dsec: warming the pool (12 creates)...\n")
	for range 12 {
		sb, err := c.CreateSandbox(ctx, spec)
		if err != nil {
			return nil, err
		}
		_ = c.DeleteSandbox(ctx, sb.ID)
	}
	if err := waitPooled(ctx, c, 2, 30*time.Second); err != nil {
		return nil, err
	}
	claim := func() ([]time.Duration, int, time.Duration, error) {
		var durs []time.Duration
		fails := 0
		start := time.Now()
		for range o.count {
			t0 := time.Now()
			sb, err := c.CreateSandbox(ctx, spec)
			if err != nil {
				fails++
				continue
			}
			durs = append(durs, time.Since(t0))
			_ = c.DeleteSandbox(ctx, sb.ID)
			time.Sleep(o.poolGap)
		}
		return durs, fails, time.Since(start), nil
	}
	fmt.Fprintf(os.Stderr, "dsec: %d creates from the pool, %v apart...\n", o.count, o.poolGap)
	pd, pf, pw, _ := claim()
	pooled := row("create from warm pool", o.count, 1, pd, pf, pw)

	// The same creates for a class with no pool (a label does not make a
	// class; the memory limit does), spaced the same way.
	cold := spec
	cold.MemoryMB = 513
	fmt.Fprintf(os.Stderr, "dsec: %d creates without a pool...\n", o.count)
	pooledBefore, err := pooledNow(ctx, c)
	if err != nil {
		return nil, err
	}
	var cd []time.Duration
	cf := 0
	cstart := time.Now()
	for i := range o.count {
		cold.MemoryMB = 513 + int64(i%1000) // a new class each time: never pooled
		t0 := time.Now()
		sb, err := c.CreateSandbox(ctx, cold)
		if err != nil {
			cf++
			continue
		}
		cd = append(cd, time.Since(t0))
		_ = c.DeleteSandbox(ctx, sb.ID)
		time.Sleep(o.poolGap)
	}
	plain := row("create, no pool", o.count, 1, cd, cf, time.Since(cstart))
	// A node with a pool floor (dsec up --warm-pool-min) pools even these
	// one-off classes, refilling beside the creates measured.
	if after, err := pooledNow(ctx, c); err == nil && after > pooledBefore {
		fmt.Fprintf(os.Stderr, "dsec: warning: the pools grew from %d to %d during the no-pool creates: the node keeps a floor (dsec up --warm-pool-min > 0), so that baseline ran beside refills; use a daemon with --warm-pool-min 0\n", pooledBefore, after)
	}
	pooled = withBaseline(pooled, plain, "create, no pool")

	fmt.Fprintf(os.Stderr, "dsec: %d fncalls (echo)...\n", o.count)
	req := api.FnCallRequest{Base: ref, Argv: []string{"echo", "hi"}}
	for range 6 { // their own demand
		if _, err := c.FnCall(ctx, req); err != nil {
			return nil, err
		}
	}
	_ = waitPooled(ctx, c, 1, 10*time.Second)
	var fd []time.Duration
	ff := 0
	fstart := time.Now()
	for range o.count {
		t0 := time.Now()
		res, err := c.FnCall(ctx, req)
		if err != nil || res.Stdout != "hi\n" {
			ff++
			continue
		}
		fd = append(fd, time.Since(t0))
		time.Sleep(o.poolGap)
	}
	fn := row("fncall echo", o.count, 1, fd, ff, time.Since(fstart))
	return []benchRow{pooled, fn}, nil
}

// waitPooled waits until the nodes hold at least n pooled sandboxes.
func waitPooled(ctx context.Context, c *dsec.Client, n int, within time.Duration) error {
	deadline := time.Now().Add(within)
	for {
		have, err := pooledNow(ctx, c)
		if err != nil {
			return err
		}
		if have >= n {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("bench pool: %d pooled sandboxes after %v, want %d (is the daemon running with --warm-pool-max > 0?)", have, within, n)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// pooledNow is how many sandboxes the nodes hold in their warm pools.
func pooledNow(ctx context.Context, c *dsec.Client) (int, error) {
	nodes, err := c.ListNodes(ctx)
	if err != nil {
		return 0, err
	}
	have := 0
	for _, nd := range nodes {
		have += nd.Counts["pooled"]
	}
	return have, nil
}

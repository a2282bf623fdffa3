package main

import (
	"context"
	"fmt"
	"os"
	"slices"
	"time"

	"github.com/dsecproject/dsec/api"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// benchCreateNested prices authorization and quotas: one-at-a-time
// creates with the caller's key, with a member key of a project
// --nested-key-depth levels below root, and with a member key of a
// project as deep under a chain whose top sets a quota (which every
// create then reserves against), interleaved call by call so that the
// machine's noise weighs on all three alike. The projects and keys are
// deleted afterwards.
func benchCreateNested(ctx context.Context, c *dsec.Client, o benchOpts, ref string) ([]benchRow, error) {
	stamp := time.Now().UnixNano() % 1e9
	chain := func(name string, quota api.ProjectQuota) (string, string, error) {
		parent, top := "root", ""
		for i := range o.nestedDepth {
			p := fmt.Sprintf("bench-%s-%d-%d", name, stamp, i+1)
			q := api.ProjectQuota{}
			if i == 0 {
				q, top = quota, p
			}
			if _, err := c.CreateProject(ctx, api.CreateProjectRequest{Parent: parent, Name: p, Quota: q}); err != nil {
				return top, "", fmt.Errorf("creating project %s: %w", p, err)
			}
			parent = p
		}
		k, err := c.CreateKey(ctx, parent, api.CreateKeyRequest{Role: "member", Name: "bench"})
		if err != nil {
			return top, "", err
		}
		return top, k.Key, nil
	}
	fmt.Fprintf(os.Stderr, "dsec: making two chains of %d projects and a member key at the bottom of each...\n", o.nestedDepth)
	var clients []*dsec.Client
	for _, ch := range []struct {
		name  string
		quota api.ProjectQuota
	}{{"auth", api.ProjectQuota{}}, {"quota", api.ProjectQuota{Sandboxes: 1 << 20}}} {
		top, key, err := chain(ch.name, ch.quota)
		if top != "" {
			defer func() { _ = c.DeleteProject(context.Background(), top, true) }()
		}
		if err != nil {
			return nil, err
		}
		kc, err := dsec.FromEnv(dsec.WithAPIKey(key))
		if err != nil {
			return nil, err
		}
		clients = append(clients, kc)
	}
	sides := []struct {
		what string
		c    *dsec.Client
	}{
		{"create, caller's key", c},
		{fmt.Sprintf("create, member key %d projects deep", o.nestedDepth), clients[0]},
		{fmt.Sprintf("create, member key %d deep, quota on the chain", o.nestedDepth), clients[1]},
	}
	label := fmt.Sprintf("bench-%d", stamp)
	durs := make([][]time.Duration, len(sides))
	fails := make([]int, len(sides))
	walls := make([]time.Duration, len(sides))
	var made []struct {
		c  *dsec.Client
		id string
	}
	fmt.Fprintf(os.Stderr, "dsec: %d creates one at a time with each key, interleaved...\n", o.count)
	// pairs[si] are the differences to the caller's key's create of the
	// same round: their median is steadier than a difference of medians
	// when the machine's speed drifts.
	pairs := make([][]time.Duration, len(sides))
	for i := range o.count {
		round := make([]time.Duration, len(sides))
		for k := range sides {
			si := (i + k) % len(sides)
			t0 := time.Now()
			sb, err := sides[si].c.CreateSandbox(ctx, api.SandboxSpec{Base: ref, Labels: map[string]string{"bench": label}})
			d := time.Since(t0)
			walls[si] += d
			if err != nil {
				fails[si]++
				continue
			}
			round[si] = d
			durs[si] = append(durs[si], d)
			made = append(made, struct {
				c  *dsec.Client
				id string
			}{sides[si].c, sb.ID})
		}
		for si := 1; si < len(sides); si++ {
			if round[si] > 0 && round[0] > 0 {
				pairs[si] = append(pairs[si], round[si]-round[0])
			}
		}
	}
	fmt.Fprintf(os.Stderr, "dsec: deleting...\n")
	_, _, _, _ = runParallel(len(made), 8, func(i int) error { return made[i].c.DeleteSandbox(ctx, made[i].id) })
	var rows []benchRow
	for si, sd := range sides {
		rows = append(rows, row(sd.what, o.count, 1, durs[si], fails[si], walls[si]))
	}
	for i := 1; i < len(rows); i++ {
		rows[i] = withBaseline(rows[i], rows[0], "caller's key")
		slices.Sort(pairs[i])
		med := 0.0
		if len(pairs[i]) > 0 {
			med = float64(pairs[i][len(pairs[i])/2]) / float64(time.Millisecond)
		}
		fmt.Fprintf(os.Stderr, "dsec: %s: p50 %+.2f ms against the caller's key; median of the %d paired differences %+.3f ms\n",
			rows[i].Measure, rows[i].P50MS-rows[0].P50MS, len(pairs[i]), med)
	}
	return rows, nil
}

package apiserver

import (
	"fmt"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/edgeapi/edgetest"
	"github.com/dsecproject/dsec/internal/placement"
	"github.com/dsecproject/dsec/internal/watcher"
)

// TestOverlayKeepsABurstSpread: a burst placed from a view that is a poll
// old. One node was the least loaded at that poll. With the in-flight
// overlay the burst fills it up to the others and then spreads; without
// it (placement.Config.NoOverlay) every create of the burst herds onto
// that one node, which is what the overlay is for.
func TestOverlayKeepsABurstSpread(t *testing.T) {
	for _, tc := range []struct {
		name      string
		noOverlay bool
	}{{"overlay", false}, {"no-overlay", true}} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, false)
			var targets watcher.Static
			var fakes []*edgetest.Fake
			for i := range 4 {
				fe := edgetest.NewFake(fmt.Sprintf("n%d", i))
				for range map[bool]int{true: 0, false: 6}[i == 0] {
					if _, err := fe.Create(t.Context(), edgeapi.CreateRequest{Spec: api.SandboxSpec{Base: "base/py:1"}}); err != nil {
						t.Fatal(err)
					}
				}
				fakes = append(fakes, fe)
				targets = append(targets, fe)
			}
			// Synced once and never polled again: the whole burst sees
			// n0 empty and the others at 6.
			view := watcher.New(targets, watcher.Config{DownAfter: time.Hour})
			view.Sync(t.Context())
			srv := f.apiserverWith(t, "s", func(d *Deps) {
				d.Nodes = view
				d.Placement = placement.Config{K: placement.AllNodes, NoOverlay: tc.noOverlay}
			})
			const burst = 30
			for i := range burst {
				resp, body := f.doAt(t, srv, f.admin, "", "POST", "/v1/sandboxes", `{"base":"base/py:1"}`)
				if resp.StatusCode != 201 {
					t.Fatalf("create %d: %s %s", i, resp.Status, body)
				}
			}
			var held []int
			for _, fe := range fakes {
				l, err := fe.List(t.Context(), edgeapi.ListFilter{})
				if err != nil {
					t.Fatal(err)
				}
				held = append(held, len(l))
			}
			if tc.noOverlay {
				if held[0] != burst {
					t.Fatalf("held %v without the overlay, want all %d of the burst herded onto n0", held, burst)
				}
				return
			}
			// 18 + 30 = 48 over 4 nodes: 12 each.
			for i, n := range held {
				if n != 12 {
					t.Fatalf("held %v with the overlay (node %d holds %d), want 12 on every node", held, i, n)
				}
			}
		})
	}
}

package placement

import (
	"errors"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

func node(name string, running, max int, healthy bool) Candidate {
	return Candidate{Node: &api.Node{Name: name, Healthy: healthy, Backends: []string{"container"},
		Capacity: api.Capacity{MaxSandboxes: max}, Counts: map[string]int{"running": running}}}
}

func labelled(c Candidate, kv ...string) Candidate {
	c.Labels = map[string]string{}
	for i := 0; i+1 < len(kv); i += 2 {
		c.Labels[kv[i]] = kv[i+1]
	}
	return c
}

func TestPick(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	inflight := node("b", 5, 10, true)
	inflight.InFlight = 5
	cloud := Config{Overflow: map[string]float64{"cloud": 0.8}}
	tests := []struct {
		name    string
		nodes   []Candidate
		req     Request
		cfg     Config
		want    string
		wantErr string // a reason the error must count
	}{
		{"single", []Candidate{node("a", 0, 10, true)}, Request{Backend: "container"}, Config{}, "a", ""},
		{"skips unhealthy", []Candidate{node("a", 0, 10, false), node("b", 5, 10, true)}, Request{Backend: "container"}, Config{}, "b", ""},
		{"skips full", []Candidate{node("a", 10, 10, true), node("b", 9, 10, true)}, Request{Backend: "container"}, Config{}, "b", ""},
		{"in-flight placements fill a node", []Candidate{inflight, node("c", 9, 10, true)}, Request{Backend: "container"}, Config{}, "c", ""},
		{"skips excluded", []Candidate{node("a", 0, 10, true), node("b", 9, 10, true)}, Request{Backend: "container", Exclude: map[string]bool{"a": true}}, Config{}, "b", ""},
		{"selector", []Candidate{node("a", 0, 10, true), labelled(node("g", 9, 10, true), "gpu", "a100")},
			Request{Backend: "container", Selector: map[string]string{"gpu": "a100"}}, Config{}, "g", ""},
		{"selector matches none", []Candidate{labelled(node("a", 0, 10, true), "gpu", "h100")},
			Request{Backend: "container", Selector: map[string]string{"gpu": "a100"}}, Config{}, "", ReasonSelector},
		{"overflow unused while others have room", []Candidate{node("a", 7, 10, true), labelled(node("c", 0, 10, true), "pool", "cloud")},
			Request{Backend: "container"}, cloud, "a", ""},
		{"overflow used when the others are full", []Candidate{node("a", 10, 10, true), labelled(node("c", 5, 10, true), "pool", "cloud")},
			Request{Backend: "container"}, cloud, "c", ""},
		{"overflow used when the others refused", []Candidate{node("a", 0, 10, true), labelled(node("c", 0, 10, true), "pool", "cloud")},
			Request{Backend: "container", Exclude: map[string]bool{"a": true}}, cloud, "c", ""},
		{"overflow alone", []Candidate{labelled(node("c", 0, 10, true), "pool", "cloud")}, Request{Backend: "container"}, cloud, "c", ""},
		{"ignore capacity", []Candidate{node("a", 10, 10, true)}, Request{Backend: "container", IgnoreCapacity: true}, Config{}, "a", ""},
		{"backend missing", []Candidate{node("a", 0, 10, true)}, Request{Backend: "microvm"}, Config{}, "", ReasonBackend},
		{"all full", []Candidate{node("a", 10, 10, true)}, Request{Backend: "container"}, Config{}, "", ReasonFull},
		{"none", nil, Request{Backend: "container"}, Config{}, "", "no nodes"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for range 20 { // random sampling: the answer must not depend on it
				got, err := Pick(tt.nodes, tt.req, tt.cfg, rng)
				if tt.wantErr != "" {
					var nn *NoNode
					if !errors.Is(err, errdefs.ErrExhausted) || !errors.As(err, &nn) {
						t.Fatalf("err = %v, want a NoNode exhausted error", err)
					}
					if tt.wantErr != "no nodes" && nn.Reasons[tt.wantErr] == 0 {
						t.Fatalf("err = %v, want it to count %q", err, tt.wantErr)
					}
					return
				}
				if err != nil || got != tt.want {
					t.Fatalf("Pick = %q, %v; want %q", got, err, tt.want)
				}
			}
		})
	}
}

func TestNoNodeOnlyFull(t *testing.T) {
	_, err := Pick([]Candidate{node("a", 10, 10, true), node("b", 10, 10, true)}, Request{Backend: "container"}, Config{}, nil)
	var nn *NoNode
	if !errors.As(err, &nn) || !nn.OnlyFull() {
		t.Fatalf("err = %v, want only-full", err)
	}
	_, err = Pick([]Candidate{node("a", 10, 10, true), node("b", 0, 10, false)}, Request{Backend: "container"}, Config{}, nil)
	if !errors.As(err, &nn) || nn.OnlyFull() {
		t.Fatalf("err = %v, want not only-full (one is unhealthy)", err)
	}
}

// share counts how often each node wins over n picks.
func share(t *testing.T, nodes []Candidate, req Request, cfg Config, n int) map[string]int {
	t.Helper()
	rng := rand.New(rand.NewPCG(3, 4))
	got := map[string]int{}
	for range n {
		name, err := Pick(nodes, req, cfg, rng)
		if err != nil {
			t.Fatal(err)
		}
		got[name]++
	}
	return got
}

func TestPickPrefersLessLoaded(t *testing.T) {
	// Two distinct choices out of two nodes: the idle one always wins.
	got := share(t, []Candidate{node("busy", 900, 1000, true), node("idle", 0, 1000, true)}, Request{Backend: "container"}, Config{}, 1000)
	if got["idle"] != 1000 {
		t.Fatalf("idle node chosen %d/1000 times, want every time", got["idle"])
	}
	// Out of four nodes, the busiest loses unless both samples are the
	// two busiest (1/6 of pairs) and it is the less busy of them (never):
	// it is never chosen, and the idlest wins whenever sampled (1/2).
	four := []Candidate{node("a", 900, 1000, true), node("b", 800, 1000, true), node("c", 100, 1000, true), node("d", 0, 1000, true)}
	got = share(t, four, Request{Backend: "container"}, Config{}, 1200)
	if got["a"] != 0 || got["d"] < 500 || got["d"] > 700 {
		t.Fatalf("four nodes: %v, want a never and d about 600/1200", got)
	}
	// k=1 is a random choice: about half.
	got = share(t, []Candidate{node("busy", 900, 1000, true), node("idle", 0, 1000, true)}, Request{Backend: "container"}, Config{K: 1}, 1000)
	if got["idle"] < 400 || got["idle"] > 600 {
		t.Fatalf("k=1: idle node chosen %d/1000 times, want about 500", got["idle"])
	}
}

func TestPickSpreadsAJob(t *testing.T) {
	a, b := node("a", 0, 1000, true), node("b", 50, 1000, true)
	a.Jobs = map[string]int{"grpo": 40}
	b.Jobs = map[string]int{"grpo": 0}
	// b is busier but holds none of the job: it wins.
	got := share(t, []Candidate{a, b}, Request{Backend: "container", Job: "grpo"}, Config{}, 1000)
	if got["b"] != 1000 {
		t.Fatalf("job spread: b chosen %d/1000, want every time", got["b"])
	}
	// Without the job label, load decides.
	got = share(t, []Candidate{a, b}, Request{Backend: "container"}, Config{}, 1000)
	if got["a"] != 1000 {
		t.Fatalf("no job: a chosen %d/1000, want every time", got["a"])
	}
	// This apiserver's own placements of the job since the last poll
	// count: 41 in flight on b outweigh a's 40.
	b.InFlight, b.InFlightJob = 41, 41
	got = share(t, []Candidate{a, b}, Request{Backend: "container", Job: "grpo"}, Config{}, 1000)
	if got["a"] != 1000 {
		t.Fatalf("job in flight: a chosen %d/1000, want every time", got["a"])
	}
}

func TestPickPrefersMountedLayers(t *testing.T) {
	a, b := node("a", 1, 100, true), node("b", 0, 100, true)
	a.Layers = []string{"sha256:aa", "sha256:bb"}
	req := Request{Backend: "container", Layers: []string{"sha256:aa", "sha256:bb"}}
	got := share(t, []Candidate{a, b}, req, Config{}, 1000)
	if got["a"] != 1000 {
		t.Fatalf("a has the layers: chosen %d/1000, want every time", got["a"])
	}
	// Affinity never outweighs much load: a node 10 busier loses.
	a.Counts = map[string]int{"running": 10}
	got = share(t, []Candidate{a, b}, req, Config{}, 1000)
	if got["b"] != 1000 {
		t.Fatalf("b is much less loaded: chosen %d/1000, want every time", got["b"])
	}
}

func TestPickOverflowThreshold(t *testing.T) {
	cloud := Config{Overflow: map[string]float64{"cloud": 0.8}}
	c := labelled(node("c", 0, 10, true), "pool", "cloud")
	// Below the threshold the cloud node is never chosen, however idle.
	if got := share(t, []Candidate{node("a", 7, 10, true), c}, Request{Backend: "container"}, cloud, 200); got["c"] != 0 {
		t.Fatalf("regular node at 70%%: cloud chosen %d/200 times", got["c"])
	}
	// At the threshold it joins, and being idle it wins.
	if got := share(t, []Candidate{node("a", 8, 10, true), c}, Request{Backend: "container"}, cloud, 1000); got["c"] != 1000 {
		t.Fatalf("regular node at 80%%: cloud chosen %d/1000 times, want every time", got["c"])
	}
}

// TestPickDedicatedNodes: a dedicated project's sandbox goes to a node of
// its own or an empty one, never to a node with others' sandboxes or
// others' placements in flight; anyone else's never to a dedicated node.
func TestPickDedicatedNodes(t *testing.T) {
	ded := func(c Candidate, to string) Candidate { c.DedicatedTo = to; return c }
	other := func(c Candidate, n int) Candidate { c.InFlight += n; c.InFlightOther = n; return c }
	for _, c := range []struct {
		name      string
		nodes     []Candidate
		dedicated string
		want      string // "" for no node
	}{
		{"dedicated takes its own node", []Candidate{node("shared", 1, 10, true), ded(node("mine", 3, 10, true), "root/a")}, "root/a", "mine"},
		{"dedicated fills its own node before an empty one", []Candidate{node("empty", 0, 10, true), ded(node("mine", 8, 10, true), "root/a")}, "root/a", "mine"},
		{"dedicated fills a node it is being given", []Candidate{node("empty", 0, 10, true), func() Candidate { c := node("mine", 0, 10, true); c.InFlight = 2; return c }()}, "root/a", "mine"},
		{"dedicated takes an empty node", []Candidate{node("shared", 1, 10, true), node("empty", 0, 10, true)}, "root/a", "empty"},
		{"dedicated never shares", []Candidate{node("shared", 1, 10, true), ded(node("theirs", 1, 10, true), "root/b")}, "root/a", ""},
		{"an empty node with others in flight", []Candidate{other(node("empty", 0, 10, true), 1)}, "root/a", ""},
		{"shared never on a dedicated node", []Candidate{ded(node("theirs", 1, 10, true), "root/b"), node("shared", 5, 10, true)}, "", "shared"},
		{"shared, only dedicated nodes", []Candidate{ded(node("theirs", 1, 10, true), "root/b")}, "", ""},
		{"shared beside a dedicated placement in flight", []Candidate{other(node("empty", 0, 10, true), 1)}, "", ""},
	} {
		for range 20 {
			got, err := Pick(c.nodes, Request{Backend: "container", Dedicated: c.dedicated}, Config{K: 2}, nil)
			if c.want == "" {
				if err == nil || !strings.Contains(err.Error(), ReasonTenancy) {
					t.Errorf("%s: picked %q (%v), want no node for tenancy", c.name, got, err)
				}
				break
			}
			if err != nil || got != c.want {
				t.Errorf("%s: picked %q (%v), want %s", c.name, got, err, c.want)
				break
			}
		}
	}
}

// Hollow edges (simulated, running nothing) take sandboxes only from an
// apiserver that places on them: joined to a real cluster they would
// swallow real creates.
func TestPickHollow(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	hollow := node("h", 0, 100, true)
	hollow.Hollow = true
	real := node("r", 90, 100, true)
	for range 20 {
		if got, err := Pick([]Candidate{hollow, real}, Request{Backend: "container"}, Config{}, rng); err != nil || got != "r" {
			t.Fatalf("without Hollow: %q %v", got, err)
		}
	}
	_, err := Pick([]Candidate{hollow}, Request{Backend: "container"}, Config{}, rng)
	if err == nil || !strings.Contains(err.Error(), "hollow") {
		t.Fatalf("only a hollow node: %v", err)
	}
	if got, err := Pick([]Candidate{hollow, real}, Request{Backend: "container"}, Config{Hollow: true}, rng); err != nil || got != "h" {
		t.Fatalf("with Hollow, the less loaded: %q %v", got, err)
	}
}

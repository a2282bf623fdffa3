package placement

import (
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

func node(name string, running, max int, healthy bool) api.Node {
	return api.Node{Name: name, Healthy: healthy, Backends: []string{"container"},
		Capacity: api.Capacity{MaxSandboxes: max}, Counts: map[string]int{"running": running}}
}

func TestPick(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	tests := []struct {
		name    string
		nodes   []api.Node
		req     Request
		want    string
		wantErr bool
	}{
		{"single", []api.Node{node("a", 0, 10, true)}, Request{Backend: "container"}, "a", false},
		{"skips unhealthy", []api.Node{node("a", 0, 10, false), node("b", 5, 10, true)}, Request{Backend: "container"}, "b", false},
		{"skips full", []api.Node{node("a", 10, 10, true), node("b", 9, 10, true)}, Request{Backend: "container"}, "b", false},
		{"skips excluded", []api.Node{node("a", 0, 10, true), node("b", 9, 10, true)}, Request{Backend: "container", Exclude: map[string]bool{"a": true}}, "b", false},
		{"backend missing", []api.Node{node("a", 0, 10, true)}, Request{Backend: "microvm"}, "", true},
		{"all full", []api.Node{node("a", 10, 10, true)}, Request{Backend: "container"}, "", true},
		{"none", nil, Request{Backend: "container"}, "", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Pick(tt.nodes, tt.req, rng)
			if tt.wantErr {
				if !errors.Is(err, errdefs.ErrExhausted) {
					t.Fatalf("err = %v, want exhausted", err)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("Pick = %q, %v; want %q", got, err, tt.want)
			}
		})
	}
}

func TestPickPrefersLessLoaded(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	nodes := []api.Node{node("busy", 900, 1000, true), node("idle", 0, 1000, true)}
	idle := 0
	for i := 0; i < 1000; i++ {
		n, _ := Pick(nodes, Request{Backend: "container"}, rng)
		if n == "idle" {
			idle++
		}
	}
	// With two choices the idle node wins unless both samples hit "busy" (1/4).
	if idle < 650 {
		t.Fatalf("idle node chosen %d/1000 times, want about 750", idle)
	}
}

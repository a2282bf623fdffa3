package edge

import (
	"testing"
	"time"

	"github.com/dsecproject/dsec/internal/edgeapi"
)

// TestPoolTarget: a class's target follows its last 30 s of creates (a
// third of them), never below the floor while it was created in the last
// 5 minutes, never above the ceiling; an idle class has none.
func TestPoolTarget(t *testing.T) {
	now := time.Now()
	p := newPool()
	creates := func(k poolKey, ago ...time.Duration) {
		for _, a := range ago {
			p.seen[k] = append(p.seen[k], now.Add(-a))
		}
	}
	creates("burst", 1*time.Second, 2*time.Second, 3*time.Second, 4*time.Second, 5*time.Second, 6*time.Second, 7*time.Second)
	creates("once", time.Minute)
	creates("idle", PoolIdle+time.Second)
	for _, c := range []struct {
		k                    poolKey
		floor, ceiling, want int
	}{
		{"burst", 0, 8, 2}, // 7 creates / 3
		{"burst", 3, 8, 3}, // the floor
		{"burst", 0, 1, 1}, // the ceiling
		{"burst", 5, 4, 4}, // the ceiling over the floor
		{"once", 0, 8, 0},
		{"once", 2, 8, 2},
		{"idle", 2, 8, 0},
		{"never", 2, 8, 0},
	} {
		if got := p.targetLocked(c.k, now, c.floor, c.ceiling); got != c.want {
			t.Errorf("%s floor %d ceiling %d: target %d, want %d", c.k, c.floor, c.ceiling, got, c.want)
		}
	}
}

// TestPoolPick: the refill goes to the class furthest below its target,
// but not to one whose refill just failed (it would be picked again and
// again, and the others never); idle classes are forgotten, pooled or
// not, and their pooled sandboxes handed back for deletion.
func TestPoolPick(t *testing.T) {
	now := time.Now()
	p := newPool()
	for _, k := range []poolKey{"a", "b"} {
		p.seen[k] = []time.Time{now.Add(-time.Minute)}
		var req edgeapi.CreateRequest
		req.Spec.Base = string(k)
		p.template[k] = req
	}
	p.ready["b"] = []*sbx{{}} // b is one short of 2, a two
	if k, req, ok := p.pick(now, 2, 4); !ok || k != "a" || req.Spec.Base != "a" {
		t.Fatalf("pick %q %v, want a", k, ok)
	}
	p.retryAt["a"] = now.Add(RefillBackoff)
	if k, _, ok := p.pick(now, 2, 4); !ok || k != "b" {
		t.Fatalf("pick %q %v with a backing off, want b", k, ok)
	}
	if k, _, ok := p.pick(now.Add(RefillBackoff+time.Second), 2, 4); !ok || k != "a" {
		t.Fatalf("pick %q %v after the backoff, want a", k, ok)
	}
	p.ready["b"] = append(p.ready["b"], &sbx{})
	p.retryAt["a"] = now.Add(RefillBackoff)
	if k, _, ok := p.pick(now, 2, 4); ok {
		t.Fatalf("pick %q with nothing to do", k)
	}

	p.seen["old"] = []time.Time{now.Add(-PoolIdle - time.Second)}
	p.template["old"] = edgeapi.CreateRequest{}
	drop := p.forgetIdle(now)
	if len(drop) != 0 || len(p.seen) != 2 || len(p.template) != 2 {
		t.Fatalf("forgot %d sandboxes; classes left %d, templates %d, want 0, 2, 2", len(drop), len(p.seen), len(p.template))
	}
	drop = p.forgetIdle(now.Add(PoolIdle))
	if len(drop) != 2 || len(p.seen)+len(p.template)+len(p.ready)+len(p.retryAt) != 0 {
		t.Fatalf("after %v idle: %d sandboxes to delete (want b's 2), left %v %v %v %v", PoolIdle, len(drop), p.seen, p.template, p.ready, p.retryAt)
	}
}

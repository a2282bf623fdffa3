package edge

import (
	"testing"
	"time"
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

package store_test

import (
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/dsecproject/dsec/internal/store"
	"github.com/dsecproject/dsec/internal/store/etcdtest"
)

// TestEtcdLeaderKilledUnderWrites kills the raft leader while one client
// writes without pause: writes caught in flight by the kill hang on the
// member that forwarded them, and must be given up and made again on the
// new leader within the operation timeout, each exactly once: every create
// succeeds (its own earlier write recognised) and every key holds what its
// writer wrote.
func TestEtcdLeaderKilledUnderWrites(t *testing.T) {
	if _, err := etcdtest.Binary(); err != nil {
		t.Skip(err)
	}
	dir, err := os.MkdirTemp("", "dsec-etcd-failover-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	c, err := etcdtest.Start(dir, 3)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Stop)
	const opTimeout = 3 * time.Second
	s, err := store.OpenEtcd(store.EtcdConfig{Endpoints: c.Endpoints(), OpTimeout: opTimeout})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	var b store.Batcher = s

	for round := range 2 {
		leader, err := c.Leader(10 * time.Second)
		if err != nil {
			t.Fatal(err)
		}
		stop := make(chan struct{})
		var wg sync.WaitGroup
		var mu sync.Mutex
		var fails []string
		var slowest time.Duration
		want := map[string]string{}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				k := fmt.Sprintf("r%d-%05d", round, i)
				v := "v-" + k
				start := time.Now()
				var err error
				switch i % 4 {
				case 0:
					err = s.Create("fo", k, []byte(v))
				case 1:
					err = s.Put("fo", k, []byte(v))
				case 2:
					err = s.Update("fo", k, func(old []byte) ([]byte, error) { return []byte(v), nil })
				case 3:
					err = b.Write("fo", []store.KV{{Key: k, Value: []byte(v)}}, []store.KV{{Key: k + "-p", Value: []byte(v)}})
					want[k+"-p"] = v
				}
				el := time.Since(start)
				mu.Lock()
				slowest = max(slowest, el)
				if err != nil {
					fails = append(fails, fmt.Sprintf("op %d (%s) after %v: %v", i%4, k, el.Round(time.Millisecond), err))
				}
				mu.Unlock()
				want[k] = v
			}
		}()
		time.Sleep(300 * time.Millisecond)
		c.Kill(leader)
		killed := time.Now()
		if _, err := c.Leader(10 * time.Second); err != nil {
			t.Error(err)
		}
		t.Logf("round %d: killed leader m%d; a new leader after %v", round, leader, time.Since(killed).Round(time.Millisecond))
		time.Sleep(1500 * time.Millisecond)
		close(stop)
		wg.Wait()
		t.Logf("round %d: %d keys written, slowest write %v", round, len(want), slowest.Round(time.Millisecond))
		for _, f := range fails {
			t.Errorf("round %d: %s", round, f)
		}
		for k, v := range want {
			got, err := s.Get("fo", k)
			if err != nil || string(got) != v {
				t.Errorf("round %d: %s holds %q (%v), want %q", round, k, got, err, v)
			}
		}
		if err := c.Restart(leader); err != nil {
			t.Fatal(err)
		}
		if err := c.WaitHealthy(30 * time.Second); err != nil {
			t.Fatal(err)
		}
	}
}

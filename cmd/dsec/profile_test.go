package main

import "testing"

// TestProfilerListensOnLoopbackOnly: profiles and goroutine dumps show a
// daemon's internals, so DSEC_PPROF_ADDR takes loopback IP literals only.
func TestProfilerListensOnLoopbackOnly(t *testing.T) {
	for _, ok := range []string{"127.0.0.1:6060", "127.1.2.3:0", "[::1]:6060"} {
		if err := checkLoopback(ok); err != nil {
			t.Errorf("%s refused: %v", ok, err)
		}
	}
	for _, bad := range []string{"0.0.0.0:6060", ":6060", "localhost:6060", "10.0.0.1:6060", "[::]:6060", "[::ffff:10.0.0.1]:1", "127.0.0.1", ""} {
		if err := checkLoopback(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
	t.Setenv(profileEnv, "0.0.0.0:0")
	if err := startProfiler(); err == nil {
		t.Fatal("a daemon would start with a profiler on every address")
	}
}

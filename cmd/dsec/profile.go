package main

// DSEC_PPROF_ADDR: an opt-in profiling listener for the daemons (net/http/pprof),
// for finding what a benchmark is spending. Loopback only: profiles and
// goroutine dumps show internals no remote caller may see.

import (
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
)

// profileEnv names the variable that turns the listener on.
const profileEnv = "DSEC_PPROF_ADDR"

// startProfiler serves pprof on $DSEC_PPROF_ADDR if it is set. An address
// that is not loopback, or one that cannot be listened on, is an error:
// the daemon does not start with a profiler other than the one asked for.
func startProfiler() error {
	addr := os.Getenv(profileEnv)
	if addr == "" {
		return nil
	}
	if err := checkLoopback(addr); err != nil {
		return fmt.Errorf("%s=%q: %w", profileEnv, addr, err)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("%s: %w", profileEnv, err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	fmt.Fprintf(os.Stderr, "dsec: profiling on http://%s/debug/pprof/\n", ln.Addr())
	go func() { _ = http.Serve(ln, mux) }()
	return nil
}

// checkLoopback accepts host:port whose host is a loopback IP literal
// (not a name: what a name resolves to is not ours to trust).
func checkLoopback(addr string) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return err
	}
	ip := net.ParseIP(host)
	if ip == nil || !ip.IsLoopback() {
		return fmt.Errorf("want a loopback address (127.0.0.1:PORT), not %q", host)
	}
	return nil
}

// Command dsec is the dsec CLI and its daemons in one binary: `dsec up`
// runs a whole single-node platform (apiserver + edge + embedded store +
// local layer directory); `dsec server` and `dsec edge` are the processes
// of a cluster (`dsec cluster init` makes their certificates); the other
// subcommands are clients of the REST API.
package main

import (
	"errors"
	"fmt"
	"os"
)

// daemonCommands are the subcommands that run on the node itself.
var daemonCommands = map[string]struct {
	summary string
	run     func(args []string) error
}{
	"up":      {"run apiserver + edge + store on this machine (needs root)", runUp},
	"server":  {"run a stateless apiserver of a cluster (state in etcd)", runServer},
	"edge":    {"run the node daemon of a cluster on this machine (needs root)", runEdgeDaemon},
	"cluster": {"init: write a cluster's CA and certificates; add-edge: a node's own certificate; revoke-edge: take it back; etcd-auth: etcd users per role", runCluster},
	"bench":   {"measure create and exec latency against a bare runtime loop", runBench},
	// Started by the edge, not by hand: not listed in the usage.
	"layerfs": {"serve registry-backed layers on demand (started by the edge)", runLayerFS},
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: dsec COMMAND [flags]   (dsec COMMAND -h for help)\n\ncommands:")
	for _, name := range []string{"up", "server", "edge", "cluster", "bench"} {
		fmt.Fprintf(os.Stderr, "  %-9s %s\n", name, daemonCommands[name].summary)
	}
	clientUsage(os.Stderr)
}

func main() {
	if len(os.Args) < 2 || os.Args[1] == "-h" || os.Args[1] == "--help" || os.Args[1] == "help" {
		usage()
		if len(os.Args) < 2 {
			os.Exit(2)
		}
		return
	}
	name, args := os.Args[1], os.Args[2:]
	var err error
	if d, ok := daemonCommands[name]; ok {
		if err = startProfiler(); err == nil {
			err = d.run(args)
		}
		if errors.Is(err, errHelpShown) {
			err = nil
		}
	} else {
		var handled bool
		handled, err = runCommand(name, args)
		if !handled {
			fmt.Fprintf(os.Stderr, "dsec: unknown command %q\n\n", name)
			usage()
			os.Exit(2)
		}
	}
	var ec interface{ ExitCode() int }
	if errors.As(err, &ec) {
		os.Exit(ec.ExitCode()) // the sandboxed command's status; its output already went out
	}
	if err != nil {
		printf(os.Stderr, "dsec: %v\n", err) // errors quote what the server and sandboxes said
		os.Exit(1)
	}
}

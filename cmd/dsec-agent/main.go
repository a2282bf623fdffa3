// dsec-agent is the microVM backend's in-guest agent, the guest's pid 1
// (package internal/sandbox/microvm/agent). It is built static, without
// cgo: make build puts it next to dsec. The agent runs it again as the
// sandbox's init and as a private run's first process, each pid 1 of a
// pid namespace of its own.
package main

import (
	"fmt"
	"os"

	"github.com/dsecproject/dsec/internal/sandbox/microvm/agent"
)

func main() {
	if os.Getpid() != 1 {
		fmt.Fprintln(os.Stderr, "dsec-agent: runs as a microVM guest's init (pid 1), started by dsec")
		os.Exit(2)
	}
	if len(os.Args) == 5 && os.Args[1] == agent.SandboxInitArg {
		if err := agent.RunSandboxInit(os.Args[2], os.Args[3], os.Args[4]); err != nil {
			fmt.Fprintln(os.Stderr, "dsec-agent: the sandbox's init:", err)
		}
		os.Exit(1)
	}
	if len(os.Args) == 6 && os.Args[1] == agent.PrivateArg {
		err := agent.RunPrivate(os.Args[2], os.Args[3], os.Args[4], os.Args[5])
		fmt.Fprintln(os.Stderr, "dsec: private run:", err)
		os.Exit(126)
	}
	if err := agent.RunInit(); err != nil {
		fmt.Fprintln(os.Stderr, "dsec-agent:", err)
	}
	agent.PowerOff()
}

// dsec-agent is the microVM backend's in-guest agent, the guest's pid 1
// (package internal/sandbox/microvm/agent). It is built static, without
// cgo: make build puts it next to dsec.
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
	if err := agent.RunInit(); err != nil {
		fmt.Fprintln(os.Stderr, "dsec-agent:", err)
	}
	agent.PowerOff()
}

//go:build !cgo

package layer

import (
	"fmt"
	"os"
	"os/exec"
	"syscall"
)

// NewIDMapNS returns an open user namespace file with mapping m (uids and
// gids alike), for idmapped mounts (a build without cgo). The namespace is made by a short-lived
// child (a process is the only way to create one with a mapping written by
// a privileged parent); the open file keeps it alive after the child is
// gone.
func NewIDMapNS(m IDMap) (*os.File, error) {
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		return nil, fmt.Errorf("creating id-mapping namespace: %w", err)
	}
	cmd := exec.Command(sleep, "60")
	ids := []syscall.SysProcIDMap{{ContainerID: 0, HostID: int(m.HostID), Size: int(m.Size)}}
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags: syscall.CLONE_NEWUSER, UidMappings: ids, GidMappings: ids,
		GidMappingsEnableSetgroups: false, Pdeathsig: syscall.SIGKILL,
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("creating id-mapping namespace: %w", err)
	}
	defer func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}()
	// The maps are written before Start returns (the child waits for them
	// before it execs), so the namespace is complete here.
	f, err := os.Open(fmt.Sprintf("/proc/%d/ns/user", cmd.Process.Pid))
	if err != nil {
		return nil, fmt.Errorf("creating id-mapping namespace: %w", err)
	}
	return f, nil
}

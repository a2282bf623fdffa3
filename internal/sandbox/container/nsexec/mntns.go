//go:build linux && cgo

package nsexec

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"time"
)

// RunInMountNS runs argv (argv[0] is a path) to completion in a new mount
// namespace, a copy of the caller's in which mount (a detached mount, as
// from layer.DetachedOverlay) is attached at target first (mntns.c). The
// copy is a slave of the caller's: the attachment never shows on the host.
// A setup failure is returned with the helper's message; a failure of
// argv itself as the *exec.ExitError of its run.
func RunInMountNS(ctx context.Context, mount *os.File, target string, env []string, argv []string) error {
	if len(argv) == 0 {
		return errors.New("RunInMountNS: no command")
	}
	cmd := &exec.Cmd{
		Path:       "/proc/self/exe",
		Args:       append([]string{"dsec-mntns", target}, argv...),
		Env:        env,
		ExtraFiles: []*os.File{mount},
		WaitDelay:  5 * time.Second,
	}
	stop := func() bool { return false }
	defer func() { stop() }()
	// No read timeout: the runtime's own run is bounded by ctx.
	msg, _, err := startHelper(cmd, 0, func() {
		stop = context.AfterFunc(ctx, func() { _ = cmd.Process.Kill() })
	})
	if err != nil {
		return fmt.Errorf("starting the rootfs launcher: %w", err)
	}
	werr := cmd.Wait()
	if len(msg) > 0 {
		return fmt.Errorf("rootfs launcher: %s", strings.TrimSpace(string(msg)))
	}
	return werr
}

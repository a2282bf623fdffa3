//go:build linux && cgo

package nsexec

/*
#include <stdlib.h>
int dsec_spawn_mntns(int mntfd, const char *target, const char *path, char *const argv[], char *const envp[], int errfd, int nullfd);
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"syscall"
)

// RunInMountNS runs argv (argv[0] is a path) to completion in a new mount
// namespace, a copy of the caller's in which mount (a detached mount, as
// from layer.DetachedOverlay) is attached at target first (mntns.c: a
// vfork'd child of the caller does that and execs argv). The copy is a
// slave of the caller's: the attachment never shows on the host. Its
// stdio is null (nil: /dev/null). A setup failure is returned with the step that
// failed; a failure of argv itself as an *exec.ExitError. When ctx ends,
// argv is killed.
func RunInMountNS(ctx context.Context, mount *os.File, target string, env []string, argv []string, null *os.File) error {
	if len(argv) == 0 {
		return errors.New("RunInMountNS: no command")
	}
	r, w, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("starting the rootfs launcher: creating error pipe: %w", err)
	}
	defer r.Close()
	var a cAlloc
	defer a.free()
	cargv, cenv, ctarget := a.strs(argv), a.strs(env), a.str(target)
	nullfd := -1
	if null != nil {
		nullfd = int(null.Fd())
	}
	pid := C.dsec_spawn_mntns(C.int(mount.Fd()), ctarget, *cargv, cargv, cenv, C.int(w.Fd()), C.int(nullfd))
	runtime.KeepAlive(mount)
	runtime.KeepAlive(null)
	w.Close()
	if pid < 0 {
		return fmt.Errorf("starting the rootfs launcher: %w", syscall.Errno(-pid))
	}
	proc, err := os.FindProcess(int(pid))
	if err != nil {
		return fmt.Errorf("starting the rootfs launcher: %w", err)
	}
	stop := context.AfterFunc(ctx, func() { _ = proc.Kill() })
	defer stop()
	// No read timeout: the runtime's own run is bounded by ctx.
	msg, _ := io.ReadAll(io.LimitReader(r, 4096))
	st, werr := proc.Wait()
	if len(msg) > 0 {
		return fmt.Errorf("rootfs launcher: %s", strings.TrimSpace(string(msg)))
	}
	if werr != nil {
		return werr
	}
	if !st.Success() {
		return &exec.ExitError{ProcessState: st}
	}
	return nil
}

//go:build linux && cgo

package nsexec

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"time"
)

// UserNS makes a user namespace owned by host uid owner, in which IDs
// 0..size-1 are host IDs hostID.. (uids and gids alike), held by a helper
// process (userns.c). It returns the namespace's path for a runtime to
// join and release, which lets the helper go: call it once the sandbox's
// first process is in the namespace (which then lives as long as it has
// processes), or on failure.
func UserNS(owner, hostID, size uint32) (path string, release func(), err error) {
	if owner == 0 || size == 0 {
		return "", nil, errors.New("user namespace: owner and size must not be 0")
	}
	var stdin, ready [2]*os.File
	// The helper waits for EOF on stdin, and writes one byte on ready
	// once the namespace exists.
	if stdin[0], stdin[1], err = os.Pipe(); err != nil {
		return "", nil, err
	}
	if ready[0], ready[1], err = os.Pipe(); err != nil {
		stdin[0].Close()
		stdin[1].Close()
		return "", nil, err
	}
	cmd := &exec.Cmd{
		Path:        "/proc/self/exe",
		Args:        []string{"dsec-userns", strconv.FormatUint(uint64(owner), 10)},
		Env:         []string{},
		Stdin:       stdin[0],
		Stdout:      ready[1],
		SysProcAttr: &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL},
	}
	var errBuf limitedWriter
	cmd.Stderr = &errBuf
	err = cmd.Start()
	stdin[0].Close()
	ready[1].Close()
	if err != nil {
		stdin[1].Close()
		ready[0].Close()
		return "", nil, fmt.Errorf("user namespace: starting its holder: %w", err)
	}
	release = func() {
		stdin[1].Close()
		_ = cmd.Wait()
	}
	fail := func(err error) (string, func(), error) {
		_ = cmd.Process.Kill()
		release()
		if msg := errBuf.String(); msg != "" {
			err = fmt.Errorf("%w: %s", err, msg)
		}
		return "", nil, fmt.Errorf("user namespace: %w", err)
	}
	_ = ready[0].SetReadDeadline(time.Now().Add(10 * time.Second))
	var b [1]byte
	_, rerr := io.ReadFull(ready[0], b[:])
	ready[0].Close()
	if rerr != nil {
		return fail(fmt.Errorf("its holder did not make it: %v", rerr))
	}
	pid := cmd.Process.Pid
	m := fmt.Sprintf("0 %d %d\n", hostID, size)
	for _, f := range []string{"uid_map", "gid_map"} {
		if err := os.WriteFile(fmt.Sprintf("/proc/%d/%s", pid, f), []byte(m), 0); err != nil {
			return fail(fmt.Errorf("writing its %s: %w", f, err))
		}
	}
	return fmt.Sprintf("/proc/%d/ns/user", pid), release, nil
}

// limitedWriter keeps the first 4 KiB written to it.
type limitedWriter struct{ b []byte }

func (w *limitedWriter) Write(p []byte) (int, error) {
	if room := 4096 - len(w.b); room > 0 {
		w.b = append(w.b, p[:min(room, len(p))]...)
	}
	return len(p), nil
}

func (w *limitedWriter) String() string { return string(w.b) }

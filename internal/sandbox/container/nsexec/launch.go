//go:build linux && cgo

package nsexec

/*
#include <stdlib.h>
#include "launch.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

var lastCap = sync.OnceValue(func() int {
	b, err := os.ReadFile("/proc/sys/kernel/cap_last_cap")
	if err != nil {
		return 40
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return 40
	}
	return n
})

// nonDumpable makes the calling process non-dumpable, once: init's change
// of credentials as it joins a user namespace (launch.c, join_userns) does
// that to the memory it shares with the caller anyway. For a root process
// it changes nothing but core dumps.
var nonDumpable = sync.OnceFunc(func() { _ = unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0) })

// Launch starts the sandbox's init in new pid, mount, ipc, uts and network
// namespaces (launch.c; the network one may be cfg.NetNS) and returns its pid and a pidfd (the caller
// closes it) once it has exec'd Argv. Init is not the caller's child: the
// host's reaper inherits it. On error nothing of it is left running,
// except when something outside killed the launcher halfway (SIGKILL to
// its middle process): then init may still be setting up, and only
// killing the sandbox's cgroup stops it. A SIGKILL to init itself during
// its setup (the OOM killer spares it while the launcher waits for it)
// returns a pidfd of a dead process: the caller checks that init runs.
func Launch(cfg LaunchConfig) (pid, pidfd int, err error) {
	if len(cfg.Argv) == 0 {
		return 0, -1, errors.New("sandbox launcher: no init command")
	}
	if cfg.Null == nil {
		return 0, -1, errors.New("sandbox launcher: no /dev/null for stdio")
	}
	var fds []*os.File
	defer func() {
		for _, f := range fds {
			f.Close()
		}
	}()
	for _, p := range cfg.CgroupProcs {
		f, err := os.OpenFile(p, os.O_WRONLY, 0)
		if err != nil {
			return 0, -1, fmt.Errorf("sandbox launcher: opening %s: %w", p, err)
		}
		fds = append(fds, f)
	}

	var a cAlloc
	defer a.free()
	l := (*C.struct_dsec_launch)(a.alloc(C.sizeof_struct_dsec_launch))
	l.rootfs_mnt = -1
	if cfg.RootfsMount != nil {
		l.rootfs_mnt = C.int(cfg.RootfsMount.Fd())
	}
	l.rootfs = a.str(cfg.Rootfs)
	l.hostname = a.str(cfg.Hostname)
	if n := len(cfg.Mounts); n > 0 {
		ops := unsafe.Slice((*C.struct_dsec_op)(a.alloc(C.size_t(n)*C.sizeof_struct_dsec_op)), n)
		for i, m := range cfg.Mounts {
			ops[i].kind = C.int(m.Kind)
			ops[i].target = a.str(m.Target)
			ops[i].arg1 = a.str(m.Arg1)
			ops[i].arg2 = a.str(m.Arg2)
			ops[i].attr = C.uint(m.Attr)
		}
		l.ops, l.nops = &ops[0], C.int(n)
	}
	if n := len(fds); n > 0 {
		cfds := unsafe.Slice((*C.int)(a.alloc(C.size_t(n)*C.sizeof_int)), n)
		for i, f := range fds {
			cfds[i] = C.int(f.Fd())
		}
		l.cgroup_fds, l.ncgroups = &cfds[0], C.int(n)
	}
	if cfg.CgroupNS {
		l.cgroupns = 1
	}
	l.netns_fd = -1
	if cfg.NetNS != nil {
		l.netns_fd = C.int(cfg.NetNS.Fd())
	}
	if m := cfg.UserNS; m != nil {
		if m.Owner == 0 || m.Size == 0 {
			return 0, -1, errors.New("sandbox launcher: a user namespace needs an owner and IDs")
		}
		l.userns_owner, l.userns_host, l.userns_size = C.uint(m.Owner), C.uint(m.HostID), C.uint(m.Size)
		wait := cfg.OwnerWait
		if wait <= 0 {
			wait = 10 * time.Second
		}
		l.owner_wait_ms = C.int(wait.Milliseconds())
	}
	l.caps = C.uint64_t(cfg.Caps)
	l.last_cap = C.int(lastCap())
	l.nofile = C.uint64_t(cfg.NoFile)
	if n := len(cfg.Filter); n > 0 {
		if n > 0xffff {
			return 0, -1, errors.New("sandbox launcher: seccomp filter too long")
		}
		size := C.size_t(n) * C.size_t(unsafe.Sizeof(cfg.Filter[0]))
		p := a.alloc(size)
		copy(unsafe.Slice((*unix.SockFilter)(p), n), cfg.Filter)
		l.filter, l.nfilter = p, C.ushort(n)
	}
	l.argv = a.strs(cfg.Argv)
	l.envp = a.strs(cfg.Env)
	l.null_fd = C.int(cfg.Null.Fd())

	if cfg.UserNS != nil {
		nonDumpable()
	}
	cpid := C.dsec_launch(l)
	runtime.KeepAlive(cfg.RootfsMount)
	runtime.KeepAlive(cfg.Null)
	runtime.KeepAlive(cfg.NetNS)
	runtime.KeepAlive(fds)
	if cpid < 0 {
		return 0, -1, fmt.Errorf("sandbox launcher: clone: %w", syscall.Errno(-cpid))
	}
	if cpid == 0 {
		msg := C.GoString(&l.err[0])
		if l.leaked != 0 {
			// init may still use this memory: never free it.
			a = nil
		}
		return 0, -1, &LaunchError{Step: msg, Errno: syscall.Errno(l.err_errno), Killed: l.leaked != 0}
	}
	return int(cpid), int(l.pidfd), nil
}

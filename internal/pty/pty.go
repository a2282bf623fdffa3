// Package pty opens pseudo-terminals and sets their size and mode. The
// edge (a process's terminal), the microVM agent (a terminal inside the
// guest), the microvm backend (joining the two) and the CLI (dsec shell's
// own terminal) use it. It builds without cgo.
package pty

import (
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// Open makes a pseudo-terminal of rows×cols (0 leaves the size alone) on
// the devpts whose ptmx is at ptmx ("/dev/ptmx" for the caller's own):
// the master, and the slave opened from it (TIOCGPTPEER), not by a path
// the terminal's owner could have changed. Neither becomes the caller's
// controlling terminal.
func Open(ptmx string, rows, cols uint16) (master, slave *os.File, err error) {
	master, err = os.OpenFile(filepath.Clean(ptmx), os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("opening a terminal: %w", err)
	}
	rc, err := master.SyscallConn()
	if err != nil {
		master.Close()
		return nil, nil, err
	}
	var sfd uintptr
	var ierr error
	cerr := rc.Control(func(fd uintptr) {
		if ierr = unix.IoctlSetPointerInt(int(fd), unix.TIOCSPTLCK, 0); ierr != nil {
			return
		}
		// TIOCGPTPEER takes the slave's open flags as its argument.
		r, _, errno := unix.Syscall(unix.SYS_IOCTL, fd, unix.TIOCGPTPEER, uintptr(unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC))
		if errno != 0 {
			ierr = errno
			return
		}
		sfd = r
	})
	if cerr != nil || ierr != nil {
		master.Close()
		return nil, nil, fmt.Errorf("opening a terminal: %v %v", cerr, ierr)
	}
	slave = os.NewFile(sfd, "pty")
	if err := SetSize(master, rows, cols); err != nil {
		master.Close()
		slave.Close()
		return nil, nil, err
	}
	return master, slave, nil
}

// SetSize sets a terminal's size (0 rows or columns: left as it is).
func SetSize(f *os.File, rows, cols uint16) error {
	if rows == 0 || cols == 0 {
		return nil
	}
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var werr error
	if err := rc.Control(func(fd uintptr) {
		werr = unix.IoctlSetWinsize(int(fd), unix.TIOCSWINSZ, &unix.Winsize{Row: rows, Col: cols})
	}); err != nil {
		return err
	}
	if werr != nil {
		return fmt.Errorf("resizing the terminal: %w", werr)
	}
	return nil
}

// MakeRaw puts the terminal fd in raw mode (no echo, no line editing, no
// signals from keys: bytes pass as they are) and returns the mode it had.
func MakeRaw(fd int) (*unix.Termios, error) {
	t, err := unix.IoctlGetTermios(fd, unix.TCGETS)
	if err != nil {
		return nil, err
	}
	old := *t
	t.Iflag &^= unix.IGNBRK | unix.BRKINT | unix.PARMRK | unix.ISTRIP | unix.INLCR | unix.IGNCR | unix.ICRNL | unix.IXON
	t.Oflag &^= unix.OPOST
	t.Lflag &^= unix.ECHO | unix.ECHONL | unix.ICANON | unix.ISIG | unix.IEXTEN
	t.Cflag &^= unix.CSIZE | unix.PARENB
	t.Cflag |= unix.CS8
	t.Cc[unix.VMIN], t.Cc[unix.VTIME] = 1, 0
	if err := unix.IoctlSetTermios(fd, unix.TCSETS, t); err != nil {
		return nil, err
	}
	return &old, nil
}

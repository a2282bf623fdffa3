package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/pty"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

func runShell(ctx context.Context, args []string) error {
	fs := newCmdFlags("shell", "[flags] ID",
		"Open an interactive terminal in a sandbox: a login shell (bash if the sandbox\n"+
			"has it) under a pseudo-terminal. dsec's terminal is put in raw mode and follows\n"+
			"its size; what the sandbox writes reaches it unescaped (it is a terminal).\n"+
			"Exits with the shell's status.")
	user := fs.String("user", "", "user to run as")
	shell := fs.String("shell", "", "run this `shell` instead (an absolute path in the sandbox)")
	pos, _, err := fs.parse(args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return fmt.Errorf("usage: dsec shell %s", fs.synopsis)
	}
	return runTerminal(ctx, pos[0], dsec.TerminalOptions{User: *user, Shell: *shell})
}

// runTerminal connects dsec's stdin and stdout to a terminal in sandbox
// id and returns the shell's status as an exit code.
func runTerminal(ctx context.Context, id string, o dsec.TerminalOptions) error {
	c, err := newClient()
	if err != nil {
		return err
	}
	in, out := int(os.Stdin.Fd()), int(os.Stdout.Fd())
	if ws, err := unix.IoctlGetWinsize(out, unix.TIOCGWINSZ); err == nil && ws.Col > 0 && ws.Row > 0 {
		o.Cols, o.Rows = int(ws.Col), int(ws.Row)
	}
	t, err := c.Terminal(ctx, id, o)
	if err != nil {
		return err
	}
	defer t.Close()
	if restore, err := makeRaw(in); err == nil {
		defer restore()
	}
	winch := make(chan os.Signal, 1)
	signal.Notify(winch, syscall.SIGWINCH)
	defer signal.Stop(winch)
	go func() {
		for range winch {
			if ws, err := unix.IoctlGetWinsize(out, unix.TIOCGWINSZ); err == nil && ws.Col > 0 && ws.Row > 0 {
				_ = t.Resize(int(ws.Col), int(ws.Row))
			}
		}
	}()
	go func() {
		// Typing goes to the sandbox until dsec's stdin ends; the
		// terminal stays open for the shell's output.
		_, _ = io.Copy(t, os.Stdin)
	}()
	if _, err := io.Copy(os.Stdout, t); err != nil && !errors.Is(err, io.EOF) {
		return fmt.Errorf("terminal: %w", err)
	}
	code, _, ended := t.ExitCode()
	if !ended {
		return errors.New("terminal: the connection ended before the shell did")
	}
	if code != 0 {
		return &exitCodeError{code: code}
	}
	return nil
}

// makeRaw puts the terminal fd in raw mode (no echo, no line editing, no
// signals from keys: ^C goes to the sandbox) and returns how to restore it.
func makeRaw(fd int) (func(), error) {
	old, err := pty.MakeRaw(fd)
	if err != nil {
		return nil, err
	}
	return func() { _ = unix.IoctlSetTermios(fd, unix.TCSETS, old) }, nil
}

// shellJoin quotes argv for /bin/sh -c.
func shellJoin(argv []string) string {
	q := make([]string, len(argv))
	for i, a := range argv {
		q[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
	}
	return strings.Join(q, " ")
}

package main

import (
	"context"
	"encoding/base64"
	"fmt"
	"io"
	"os"
	"strings"
	"unicode/utf8"

	"github.com/dsecproject/dsec/api"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// exitTimedOut is the status for a command killed by its timeout, the same
// one coreutils timeout(1) uses.
const exitTimedOut = 124

func runExec(ctx context.Context, args []string) error {
	fs := newCmdFlags("exec", "[flags] ID -- ARGV...  |  dsec exec [flags] ID --cmd 'shell command'",
		"Run a command in a sandbox. Its stdout and stderr go to dsec's, and dsec exits\n"+
			"with its exit status (124 if it timed out). ARGV runs directly; --cmd runs\nunder /bin/sh -c.")
	var req api.ExecRequest
	var timeout secondsFlag
	env := kvFlag{}
	fs.StringVar(&req.Cmd, "cmd", "", "shell command, run by /bin/sh -c")
	fs.StringVar(&req.Cwd, "cwd", "", "working directory")
	fs.Var(env, "env", "environment variable `K=V` (repeatable)")
	fs.StringVar(&req.User, "user", "", "user to run as")
	fs.Var(&timeout, "timeout", "kill the command after this long (`seconds` or duration; 0 = server default)")
	fs.Int64Var(&req.MaxOutputBytes, "max-output-bytes", 0, "cap per output stream (0 = server default)")
	stdin := fs.String("stdin", "", "send this `FILE` as the command's stdin ('-' = dsec's stdin)")
	stream := fs.Bool("stream", false, "stream output as it is produced")
	fs.BoolVar(&req.Private, "private", false, "run where the sandbox's own processes cannot see, signal or read it (for graders)")
	tty := fs.Bool("t", false, "run the command under a terminal, interactively (as dsec shell does)")
	asJSON := fs.Bool("json", false, "print the result as JSON instead of the output (not with --stream)")
	raw := rawFlag(fs)
	pos, _, err := fs.parse(args)
	if err != nil {
		return err
	}
	if len(pos) < 1 {
		return fmt.Errorf("usage: dsec exec %s", fs.synopsis)
	}
	id, argv := pos[0], pos[1:]
	switch {
	case req.Cmd == "" && len(argv) == 0:
		return fmt.Errorf("exec: give a command: ID -- ARGV... or --cmd 'shell command'")
	case req.Cmd != "" && len(argv) > 0:
		return fmt.Errorf("exec: give either --cmd or ARGV, not both")
	case *stream && *asJSON:
		return fmt.Errorf("exec: --json and --stream do not mix")
	}
	if *tty {
		if *stream || *asJSON || *stdin != "" || timeout != 0 {
			return fmt.Errorf("exec: -t does not mix with --stream, --json, --stdin or --timeout")
		}
		cmd := req.Cmd
		if cmd == "" {
			cmd = "exec " + shellJoin(argv)
		}
		if req.Cwd != "" {
			cmd = "cd " + shellJoin([]string{req.Cwd}) + " && " + cmd
		}
		for k, v := range env {
			cmd = "export " + shellJoin([]string{k + "=" + v}) + "; " + cmd
		}
		return runTerminal(ctx, id, dsec.TerminalOptions{Cmd: cmd, User: req.User})
	}
	if len(argv) > 0 {
		req.Argv = argv
	}
	if len(env) > 0 {
		req.Env = env
	}
	req.Timeout = int64(timeout)
	if *stdin != "" {
		if err := setStdin(&req, *stdin); err != nil {
			return err
		}
	}

	c, err := newClient()
	if err != nil {
		return err
	}
	if *stream {
		stdout, stderr := newStreamOut(os.Stdout, *raw), newStreamOut(os.Stderr, *raw)
		final, err := c.ExecStream(ctx, id, req, func(ev api.ExecEvent) error {
			if b := dsec.OutputBytes(ev.Stdout, ev.StdoutB64); len(b) > 0 {
				if _, err := stdout.Write(b); err != nil {
					return err
				}
			}
			if b := dsec.OutputBytes(ev.Stderr, ev.StderrB64); len(b) > 0 {
				stderr.Write(b)
			}
			return nil
		})
		stderr.Flush()
		if ferr := stdout.Flush(); err == nil {
			err = ferr
		}
		if err != nil {
			return err
		}
		return commandStatus(*final.ExitCode, final.TimedOut, final.Truncated)
	}
	res, err := c.Exec(ctx, id, req)
	if err != nil {
		return err
	}
	return reportResult(res, *asJSON, *raw)
}

// rawFlag defines --raw, for the commands that print a command's output
// or a file.
func rawFlag(fs *cmdFlags) *bool {
	return fs.Bool("raw", false, "write the output unchanged even to a terminal (where control characters are shown escaped by default)")
}

// setStdin loads the command's stdin from a file or dsec's own stdin. The
// API carries it inline, as text or, if it is not UTF-8, as base64.
func setStdin(req *api.ExecRequest, name string) (err error) {
	req.Stdin, req.StdinB64, err = readStdin(name)
	return err
}

// readStdin reads name ('-': dsec's stdin) as the API's stdin fields: text,
// or base64 when it is not UTF-8.
func readStdin(name string) (text, b64 string, err error) {
	var r io.Reader = os.Stdin
	if name != "-" {
		f, err := os.Open(name)
		if err != nil {
			return "", "", err
		}
		defer f.Close()
		r = f
	}
	b, err := io.ReadAll(r)
	if err != nil {
		return "", "", fmt.Errorf("reading stdin: %w", err)
	}
	if utf8.Valid(b) {
		return string(b), "", nil
	}
	return "", base64.StdEncoding.EncodeToString(b), nil
}

// reportResult writes a finished command's output (or its JSON) and turns
// its status into dsec's. raw is --raw.
func reportResult(res *api.ExecResult, asJSON, raw bool) error {
	if asJSON {
		if err := printJSON(res); err != nil {
			return err
		}
	} else {
		if err := copyStream(os.Stdout, raw, dsec.OutputBytes(res.Stdout, res.StdoutB64)); err != nil {
			return err
		}
		copyStream(os.Stderr, raw, dsec.OutputBytes(res.Stderr, res.StderrB64))
	}
	return commandStatus(res.ExitCode, res.TimedOut, res.Truncated)
}

// commandStatus prints notices for a timeout or truncated output and maps
// the command's exit code onto dsec's.
func commandStatus(code int, timedOut, truncated bool) error {
	return commandStatusHint(code, timedOut, truncated, "raise --max-output-bytes or use files get")
}

// commandStatusHint is commandStatus with what to do about truncated
// output.
func commandStatusHint(code int, timedOut, truncated bool, hint string) error {
	if truncated {
		fmt.Fprintf(os.Stderr, "dsec: output truncated (%s)\n", hint)
	}
	if timedOut {
		fmt.Fprintln(os.Stderr, "dsec: command timed out and was killed")
		return &exitCodeError{code: exitTimedOut}
	}
	switch {
	case code == 0:
		return nil
	case code < 0 || code > 255:
		// Not a value a process can exit with (e.g. -1 for "killed"):
		// still fail, without aliasing to success.
		return &exitCodeError{code: 255}
	}
	return &exitCodeError{code: code}
}

func runSession(ctx context.Context, args []string) error {
	return dispatchGroup(ctx, "session", []subcommand{
		{"open", "open a persistent shell and print its id", sessionOpen},
		{"run", "run a command in a session's shell", sessionRun},
		{"close", "close a session, killing its processes", sessionClose},
	}, args)
}

func sessionOpen(ctx context.Context, args []string) error {
	fs := newCmdFlags("session open", "[flags] ID", "Open a persistent shell in a sandbox and print the session id.")
	var req api.SessionRequest
	env := kvFlag{}
	fs.StringVar(&req.Shell, "shell", "", "shell to run (default: the server's, e.g. /bin/bash)")
	fs.StringVar(&req.Cwd, "cwd", "", "initial working directory")
	fs.Var(env, "env", "environment variable `K=V` (repeatable)")
	fs.StringVar(&req.User, "user", "", "user to run as")
	pos, err := fs.parseN(args, 1, 1)
	if err != nil {
		return err
	}
	if len(env) > 0 {
		req.Env = env
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	sid, err := c.CreateSession(ctx, pos[0], req)
	if err != nil {
		return err
	}
	printf(os.Stdout, "%s\n", sid)
	return nil
}

func sessionRun(ctx context.Context, args []string) error {
	fs := newCmdFlags("session run", "[flags] ID SID 'command'",
		"Run a command in a session's shell; cwd, variables and functions persist\nbetween runs. dsec exits with the command's status.")
	var timeout secondsFlag
	fs.Var(&timeout, "timeout", "kill the command after this long (`seconds` or duration)")
	maxOut := fs.Int64("max-output-bytes", 0, "cap per output stream (0 = server default)")
	asJSON := fs.Bool("json", false, "print the result as JSON instead of the output")
	raw := rawFlag(fs)
	pos, _, err := fs.parse(args)
	if err != nil {
		return err
	}
	if len(pos) < 3 {
		return fmt.Errorf("usage: dsec session run %s", fs.synopsis)
	}
	// Like ssh, several words are joined into one command line.
	req := api.SessionRunRequest{Command: strings.Join(pos[2:], " "), Timeout: int64(timeout), MaxOutputBytes: *maxOut}
	c, err := newClient()
	if err != nil {
		return err
	}
	res, err := c.SessionRun(ctx, pos[0], pos[1], req)
	if err != nil {
		return err
	}
	return reportResult(res, *asJSON, *raw)
}

func sessionClose(ctx context.Context, args []string) error {
	fs := newCmdFlags("session close", "ID SID", "Close a session and kill its process tree.")
	pos, err := fs.parseN(args, 2, 2)
	if err != nil {
		return err
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	return c.CloseSession(ctx, pos[0], pos[1])
}

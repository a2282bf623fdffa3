package main

// The client subcommands of dsec (sandbox, exec, session, files, layer,
// template, image, nodes, health, project, key, whoami, audit). They talk
// to the API through sdk/go only, so everything the CLI can do an SDK user
// can do too. main calls runCommand; daemons (up, server, edge) and bench
// live in their own files.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sort"
	"strings"
	"syscall"

	dsec "github.com/dsecproject/dsec/sdk/go"
)

// clientCommands maps a top-level name to its handler. Group commands
// (sandbox, session, files, layer, project, key) dispatch again on their
// first argument.
var clientCommands = map[string]struct {
	summary string
	run     func(ctx context.Context, args []string) error
}{
	"sandbox":  {"create, list, inspect and delete sandboxes", runSandbox},
	"exec":     {"run a command in a sandbox", runExec},
	"shell":    {"open an interactive terminal in a sandbox", runShell},
	"fncall":   {"run a stateless job in a fresh sandbox, files in and out", runFnCall},
	"session":  {"open, use and close persistent shells", runSession},
	"files":    {"read, write and list files in a sandbox", runFiles},
	"layer":    {"build, list and delete layers", runLayer},
	"template": {"name layer stacks as E2B templates (alias, list, rm)", runTemplate},
	"image":    {"import, pull and bootstrap container images as layers", runImage},
	"nodes":    {"list the edges of the cluster", runNodes},
	"health":   {"check that the API endpoint answers", runHealth},
	"project":  {"create, list, change and delete projects (quotas)", runProject},
	"key":      {"mint, list and revoke API keys of a project", runKey},
	"whoami":   {"show the API key in use: project, role, permissions", runWhoAmI},
	"audit":    {"list recorded project and key changes", runAudit},
}

// runCommand runs the client subcommand name with its arguments. handled is
// false if name is not one of them. A command run in a sandbox that exits
// non-zero yields an *exitCodeError: main should exit with its ExitCode()
// without printing anything (the command's output already went out).
func runCommand(name string, args []string) (handled bool, err error) {
	cmd, ok := clientCommands[name]
	if !ok {
		return false, nil
	}
	// Ctrl-C cancels the request in flight instead of killing the process
	// mid-write (a half-written `files get -o` is removed on cancel).
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err = cmd.run(ctx, args)
	if errors.Is(err, errHelpShown) {
		err = nil
	}
	return true, err
}

// clientUsage writes the list of client subcommands, for main's usage text.
func clientUsage(w io.Writer) {
	names := make([]string, 0, len(clientCommands))
	for n := range clientCommands {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(w, "  %-9s %s\n", n, clientCommands[n].summary)
	}
}

// exitCodeError carries the exit status of a command run in a sandbox.
type exitCodeError struct{ code int }

func (e *exitCodeError) Error() string { return fmt.Sprintf("command exited with status %d", e.code) }

// ExitCode is the status dsec should exit with.
func (e *exitCodeError) ExitCode() int { return e.code }

// errHelpShown reports that -h printed help; runCommand turns it into success.
var errHelpShown = errors.New("help shown")

// newClient builds the API client from DSEC_ENDPOINT/DSEC_API_KEY and the
// config file `dsec up` writes.
func newClient() (*dsec.Client, error) {
	return dsec.FromEnv()
}

// subcommand is one verb of a group command.
type subcommand struct {
	name    string
	summary string
	run     func(ctx context.Context, args []string) error
}

// dispatchGroup runs the verb named by args[0] of a group such as "sandbox".
func dispatchGroup(ctx context.Context, group string, subs []subcommand, args []string) error {
	usage := func(w io.Writer) {
		fmt.Fprintf(w, "usage: dsec %s COMMAND [flags]\n\ncommands:\n", group)
		for _, s := range subs {
			fmt.Fprintf(w, "  %-10s %s\n", s.name, s.summary)
		}
		fmt.Fprintf(w, "\nRun 'dsec %s COMMAND -h' for a command's flags.\n", group)
	}
	if len(args) == 0 {
		usage(os.Stderr)
		return fmt.Errorf("%s: missing command", group)
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		usage(os.Stdout)
		return errHelpShown
	}
	for _, s := range subs {
		if s.name == args[0] {
			return s.run(ctx, args[1:])
		}
	}
	return fmt.Errorf("%s: unknown command %q (run 'dsec %s -h')", group, args[0], group)
}

// cmdFlags is a FlagSet for one subcommand that knows its synopsis, so that
// -h prints a complete help text and a bad flag names where to find it.
type cmdFlags struct {
	*flag.FlagSet
	cmdline  string // "sandbox create"
	synopsis string // "[flags] ID -- ARGV..."
	about    string
}

func newCmdFlags(cmdline, synopsis, about string) *cmdFlags {
	fs := flag.NewFlagSet("dsec "+cmdline, flag.ContinueOnError)
	fs.SetOutput(io.Discard) // errors are returned, help is printed by parse
	fs.Usage = func() {}
	return &cmdFlags{FlagSet: fs, cmdline: cmdline, synopsis: synopsis, about: about}
}

func (f *cmdFlags) printHelp(w io.Writer) {
	fmt.Fprintf(w, "usage: dsec %s %s\n\n%s\n", f.cmdline, f.synopsis, f.about)
	hasFlags := false
	f.VisitAll(func(*flag.Flag) { hasFlags = true })
	if hasFlags {
		fmt.Fprintf(w, "\nflags:\n")
		f.SetOutput(w)
		f.PrintDefaults()
		f.SetOutput(io.Discard)
	}
}

// parse parses flags and positional arguments in any order (the flag
// package alone stops at the first positional). Everything after "--" is
// positional; dashed reports whether "--" was present.
func (f *cmdFlags) parse(args []string) (pos []string, dashed bool, err error) {
	flags, pos, dashed := splitArgs(f.FlagSet, args)
	if err := f.Parse(flags); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			f.printHelp(os.Stdout)
			return nil, false, errHelpShown
		}
		return nil, false, fmt.Errorf("%s: %w (run 'dsec %s -h')", f.cmdline, err, f.cmdline)
	}
	return pos, dashed, nil
}

// parseN parses and checks that there are between min and max positional
// arguments (max < 0: no limit).
func (f *cmdFlags) parseN(args []string, min, max int) ([]string, error) {
	pos, _, err := f.parse(args)
	if err != nil {
		return nil, err
	}
	if len(pos) < min || (max >= 0 && len(pos) > max) {
		return nil, fmt.Errorf("usage: dsec %s %s", f.cmdline, f.synopsis)
	}
	return pos, nil
}

// splitArgs separates flag arguments (with their values) from positional
// ones. A flag's value is the next argument unless it is a boolean flag or
// written as -name=value. Unknown flags are passed on for Parse to report.
func splitArgs(fs *flag.FlagSet, args []string) (flags, pos []string, dashed bool) {
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			return flags, append(pos, args[i+1:]...), true
		}
		if len(a) < 2 || a[0] != '-' {
			pos = append(pos, a) // includes "-" (stdin)
			continue
		}
		flags = append(flags, a)
		name := strings.TrimLeft(a, "-")
		if strings.Contains(name, "=") {
			continue
		}
		fl := fs.Lookup(name)
		if fl == nil {
			continue
		}
		if b, ok := fl.Value.(interface{ IsBoolFlag() bool }); ok && b.IsBoolFlag() {
			continue
		}
		if i+1 < len(args) {
			flags = append(flags, args[i+1])
			i++
		}
	}
	return flags, pos, false
}

// printJSONList prints a list for --json; an empty one is [], never null.
func printJSONList[T any](v []T) error {
	if v == nil {
		v = []T{}
	}
	return printJSON(v)
}

// printJSON writes v indented to stdout, for --json (escapeJSON'd on a
// terminal).
func printJSON(v any) error {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return err
	}
	b := buf.Bytes()
	if isTerminal(os.Stdout) {
		b = escapeJSON(b)
	}
	_, err := os.Stdout.Write(b)
	return err
}

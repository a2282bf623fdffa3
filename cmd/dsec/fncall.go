package main

import (
	"context"
	"encoding/base64"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"strings"

	"github.com/dsecproject/dsec/api"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

func runFnCall(ctx context.Context, args []string) error {
	fs := newCmdFlags("fncall", "[flags] BASE -- ARGV...  |  dsec fncall [flags] BASE --cmd 'shell command'",
		"Run a short stateless job in a fresh sandbox on BASE (POST /v1/fncall): the\n"+
			"--file files are written under /work, the command runs there, and the --fetch\n"+
			"files are written back under --out. The sandbox is deleted afterwards. The\n"+
			"command's stdout and stderr go to dsec's, and dsec exits with its status (124\n"+
			"if it timed out).")
	var req api.FnCallRequest
	var timeout secondsFlag
	var uploads, fetches stringList
	env := kvFlag{}
	fs.StringVar(&req.Cmd, "cmd", "", "shell command, run by /bin/sh -c")
	fs.Var(&uploads, "file", "upload `[NAME=]LOCAL` as /work/NAME (default NAME: LOCAL's base name; repeatable)")
	fs.Var(&fetches, "fetch", "bring /work/`NAME` back into --out when the command ends (repeatable)")
	out := fs.String("out", ".", "local `DIR` the --fetch files are written into (made if missing)")
	fs.Var(env, "env", "environment variable `K=V` (repeatable)")
	stdin := fs.String("stdin", "", "send this `FILE` as the command's stdin ('-' = dsec's stdin)")
	fs.Var(&timeout, "timeout", "kill the command after this long (`seconds` or duration; 0 = server default, 60 s)")
	fs.Int64Var(&req.MaxOutputBytes, "max-output-bytes", 0, "cap per output stream (0 = server default)")
	fs.Int64Var(&req.MemoryMB, "memory-mb", 0, "memory limit of the call's sandbox in MiB (0 = none)")
	asJSON := fs.Bool("json", false, "print the whole result as JSON (fetched files base64 in it, none written)")
	pos, _, err := fs.parse(args)
	if err != nil {
		return err
	}
	if len(pos) < 1 {
		return fmt.Errorf("usage: dsec fncall %s", fs.synopsis)
	}
	req.Base, req.Argv = pos[0], pos[1:]
	switch {
	case req.Cmd == "" && len(req.Argv) == 0:
		return fmt.Errorf("fncall: give a command: BASE -- ARGV... or --cmd 'shell command'")
	case req.Cmd != "" && len(req.Argv) > 0:
		return fmt.Errorf("fncall: give either --cmd or ARGV, not both")
	}
	if len(req.Argv) == 0 {
		req.Argv = nil
	}
	if len(env) > 0 {
		req.Env = env
	}
	req.Timeout = int64(timeout)
	if req.Files, err = fnCallUploads(uploads); err != nil {
		return err
	}
	for _, name := range fetches {
		// The server refuses names outside /work too; checked here so that
		// nothing is run for a call whose results could not be written.
		if !filepath.IsLocal(name) || path.Clean(name) != name {
			return fmt.Errorf("fncall: --fetch %q: want a clean relative path below /work", name)
		}
	}
	req.FetchFiles = fetches
	var root *os.Root
	if len(fetches) > 0 && !*asJSON {
		// Made and opened first, so a wrong --out fails before the call
		// runs.
		if err := os.MkdirAll(*out, 0o755); err != nil {
			return fmt.Errorf("fncall: --out: %w", err)
		}
		if root, err = os.OpenRoot(*out); err != nil {
			return fmt.Errorf("fncall: --out: %w", err)
		}
		defer root.Close()
	}
	if *stdin != "" {
		if req.Stdin, req.StdinB64, err = readStdin(*stdin); err != nil {
			return err
		}
	}

	c, err := newClient()
	if err != nil {
		return err
	}
	res, err := c.FnCall(ctx, req)
	if err != nil {
		return err
	}
	if *asJSON {
		if err := printJSON(res); err != nil {
			return err
		}
		return commandStatus(res.ExitCode, res.TimedOut, res.Truncated)
	}
	if _, err := os.Stdout.Write(dsec.OutputBytes(res.Stdout, res.StdoutB64)); err != nil {
		return err
	}
	os.Stderr.Write(dsec.OutputBytes(res.Stderr, res.StderrB64))
	if err := writeFetched(root, *out, fetches, res); err != nil {
		return err
	}
	return commandStatus(res.ExitCode, res.TimedOut, res.Truncated)
}

// fnCallUploads reads the --file arguments ([NAME=]LOCAL) into the
// request's files, base64 by name.
func fnCallUploads(args []string) (map[string]string, error) {
	if len(args) == 0 {
		return nil, nil
	}
	files := map[string]string{}
	for _, a := range args {
		name, local, ok := strings.Cut(a, "=")
		if !ok {
			name, local = filepath.Base(a), a
		}
		if name == "" || local == "" {
			return nil, fmt.Errorf("fncall: --file %q: want LOCAL or NAME=LOCAL", a)
		}
		if _, dup := files[name]; dup {
			return nil, fmt.Errorf("fncall: --file: two files named %q", name)
		}
		st, err := os.Stat(local)
		if err != nil {
			return nil, fmt.Errorf("fncall: --file: %w", err)
		}
		if !st.Mode().IsRegular() {
			return nil, fmt.Errorf("fncall: --file %s: not a regular file", local)
		}
		b, err := os.ReadFile(local)
		if err != nil {
			return nil, fmt.Errorf("fncall: --file: %w", err)
		}
		files[name] = base64.StdEncoding.EncodeToString(b)
	}
	return files, nil
}

// writeFetched writes the fetched files into root (the --out dir, shown as
// out), by the names asked for only, and says on stderr which were missing.
// os.Root keeps every write below out, symlinks included.
func writeFetched(root *os.Root, out string, names []string, res *api.FnCallResult) error {
	for _, name := range res.Missing {
		fmt.Fprintf(os.Stderr, "dsec: fncall: /work/%s did not exist when the command ended\n", name)
	}
	for _, name := range names {
		b64, ok := res.Files[name]
		if !ok {
			continue
		}
		b, err := base64.StdEncoding.DecodeString(b64)
		if err != nil {
			return fmt.Errorf("fncall: fetched %s: %w", name, err)
		}
		if dir := filepath.Dir(name); dir != "." {
			if err := root.MkdirAll(dir, 0o755); err != nil {
				return fmt.Errorf("fncall: writing %s: %w", filepath.Join(out, name), err)
			}
		}
		if err := root.WriteFile(name, b, 0o644); err != nil {
			return fmt.Errorf("fncall: writing %s: %w", filepath.Join(out, name), err)
		}
	}
	return nil
}

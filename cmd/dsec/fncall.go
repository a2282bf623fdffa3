package main

import (
	"context"
	"encoding/base64"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"strconv"
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
			"if it timed out). A fetched file that cannot be written is reported and the\n"+
			"others are still written; dsec then exits with the command's status if it\n"+
			"failed, else 1.")
	var req api.FnCallRequest
	var timeout secondsFlag
	var uploads, fetches stringList
	env := kvFlag{}
	fs.StringVar(&req.Cmd, "cmd", "", "shell command, run by /bin/sh -c")
	fs.Var(&uploads, "file", "upload `[NAME=]LOCAL` as /work/NAME (default NAME: LOCAL's base name; a LOCAL with '=' in it is taken whole if it exists; repeatable)")
	fs.Var(&fetches, "fetch", "bring /work/`NAME` back into --out when the command ends (repeatable)")
	out := fs.String("out", ".", "local `DIR` the --fetch files are written into (made if missing)")
	fs.Var(env, "env", "environment variable `K=V` (repeatable)")
	stdin := fs.String("stdin", "", "send this `FILE` as the command's stdin ('-' = dsec's stdin)")
	fs.Var(&timeout, "timeout", "kill the command after this long (`seconds` or duration; 0 = server default, 60 s)")
	fs.Int64Var(&req.MaxOutputBytes, "max-output-bytes", 0, "cap per output stream (0 = server default)")
	fs.Int64Var(&req.MemoryMB, "memory-mb", 0, "memory limit of the call's sandbox in MiB (0 = none)")
	asJSON := fs.Bool("json", false, "print the whole result as JSON (fetched files base64 in it, none written)")
	raw := rawFlag(fs)
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
	seen := map[string]bool{}
	for _, name := range fetches {
		// The server refuses names outside /work too; checked here so that
		// nothing is run for a call whose results could not be written.
		if !filepath.IsLocal(name) || path.Clean(name) != name || name == "." {
			return fmt.Errorf("fncall: --fetch %q: want a clean relative path below /work", name)
		}
		if !seen[name] {
			seen[name] = true
			req.FetchFiles = append(req.FetchFiles, name)
		}
	}
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
		if n := len(req.Stdin) + len(req.StdinB64)/4*3; n > maxFnCallStdin {
			return fmt.Errorf("fncall: --stdin: %d bytes; a call takes at most %d (send it with --file instead)", n, maxFnCallStdin)
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
	const hint = "raise --max-output-bytes, or write the output to a file and --fetch it"
	if *asJSON {
		if err := printJSON(res); err != nil {
			return err
		}
		return commandStatusHint(res.ExitCode, res.TimedOut, res.Truncated, hint)
	}
	if err := copyStream(os.Stdout, *raw, dsec.OutputBytes(res.Stdout, res.StdoutB64)); err != nil {
		return err
	}
	copyStream(os.Stderr, *raw, dsec.OutputBytes(res.Stderr, res.StderrB64))
	status := commandStatusHint(res.ExitCode, res.TimedOut, res.Truncated, hint)
	if failed := writeFetched(root, *out, req.FetchFiles, res); failed > 0 && status == nil {
		return fmt.Errorf("fncall: %d fetched file(s) could not be written", failed)
	}
	return status
}

// maxFnCallStdin is the most stdin a call carries (the server's limit).
const maxFnCallStdin = 16 << 20

// maxFnCallUpload bounds the --file files together: the call's JSON body
// (base64, so 4/3 of it) must stay below the API's 32 MiB.
const maxFnCallUpload = 20 << 20

// fnCallUploads reads the --file arguments ([NAME=]LOCAL) into the
// request's files, base64 by name.
func fnCallUploads(args []string) (map[string]string, error) {
	if len(args) == 0 {
		return nil, nil
	}
	files := map[string]string{}
	total := int64(0)
	for _, a := range args {
		name, local, ok := strings.Cut(a, "=")
		if _, err := os.Stat(a); !ok || err == nil {
			// No NAME, or a local path with '=' in it.
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
			return nil, fmt.Errorf("fncall: --file %q (NAME %q, LOCAL %q): %w", a, name, local, err)
		}
		if !st.Mode().IsRegular() {
			return nil, fmt.Errorf("fncall: --file %s: not a regular file", local)
		}
		if total += st.Size(); total > maxFnCallUpload {
			return nil, fmt.Errorf("fncall: --file: more than %d MiB in all; a call carries its files in its request (use a sandbox and files push for more)", maxFnCallUpload>>20)
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
// out), by the names asked for only, reports on stderr the ones missing
// and those it could not write, and returns how many of the latter.
// os.Root keeps every write below out; each file is written to a new
// temporary file and renamed over the name, so a link or FIFO already
// there is replaced, not written through, and no file is left half
// written.
func writeFetched(root *os.Root, out string, names []string, res *api.FnCallResult) (failed int) {
	missing := map[string]bool{}
	for _, name := range res.Missing {
		missing[name] = true
	}
	for _, name := range names {
		b64, ok := res.Files[name]
		if !ok {
			if missing[name] {
				printf(os.Stderr, "dsec: fncall: /work/%s was not a file when the command ended\n", name)
			} else {
				printf(os.Stderr, "dsec: fncall: the answer has no /work/%s\n", name)
			}
			continue
		}
		if err := writeFetchedFile(root, name, b64); err != nil {
			printf(os.Stderr, "dsec: fncall: writing %s: %v\n", filepath.Join(out, name), err)
			failed++
		}
	}
	return failed
}

func writeFetchedFile(root *os.Root, name, b64 string) error {
	b, err := base64.StdEncoding.DecodeString(b64)
	if err != nil {
		return fmt.Errorf("the answer's bytes: %w", err)
	}
	if dir := filepath.Dir(name); dir != "." {
		if err := root.MkdirAll(dir, 0o755); err != nil {
			return err
		}
	}
	tmp := filepath.Join(filepath.Dir(name), "."+filepath.Base(name)+".dsec-"+strconv.Itoa(os.Getpid()))
	f, err := root.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return err
	}
	_, err = f.Write(b)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = root.Rename(tmp, name)
	}
	if err != nil {
		root.Remove(tmp)
	}
	return err
}

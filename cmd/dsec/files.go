package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/dsecproject/dsec/api"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

func runFiles(ctx context.Context, args []string) error {
	return dispatchGroup(ctx, "files", []subcommand{
		{"get", "print or save a file", filesGet},
		{"put", "write a file from a local file or stdin", filesPut},
		{"ls", "list a directory", filesLs},
		{"stat", "describe one path", filesStat},
		{"rm", "remove a file or directory tree", filesRm},
		{"push", "upload a local directory (as a tar stream)", filesPush},
		{"pull", "download a directory into a local one", filesPull},
	}, args)
}

func filesGet(ctx context.Context, args []string) error {
	fs := newCmdFlags("files get", "[-o FILE] [--raw] ID PATH",
		"Print a file of a sandbox, or save it with -o. On a terminal its control\ncharacters are shown escaped unless --raw; a pipe or -o gets the exact bytes.")
	out := fs.String("o", "", "write to `FILE` instead of stdout")
	raw := rawFlag(fs)
	pos, err := fs.parseN(args, 2, 2)
	if err != nil {
		return err
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	if *out == "" || *out == "-" {
		stdout := newStreamOut(os.Stdout, *raw)
		_, err := c.ReadFileTo(ctx, pos[0], pos[1], stdout)
		if ferr := stdout.Flush(); err == nil {
			err = ferr
		}
		return err
	}
	// Write next to the target and rename, so a failed download never
	// leaves a truncated file under the requested name.
	tmp, err := os.CreateTemp(filepath.Dir(*out), "."+filepath.Base(*out)+".*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name()) // no-op after the rename
	if _, err := c.ReadFileTo(ctx, pos[0], pos[1], tmp); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Chmod(0o644); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), *out)
}

func filesPut(ctx context.Context, args []string) error {
	fs := newCmdFlags("files put", "[--mode 0644] ID PATH [FILE|-]",
		"Write a file in a sandbox from a local FILE, or from stdin if FILE is\nomitted or '-'. Parent directories are created.")
	modeStr := fs.String("mode", "", "permission bits in octal (default: the local file's, or the server's for stdin)")
	pos, err := fs.parseN(args, 2, 3)
	if err != nil {
		return err
	}
	var mode os.FileMode
	if *modeStr != "" {
		if mode, err = parseFileMode(*modeStr); err != nil {
			return err
		}
	}
	var src io.Reader = os.Stdin
	if len(pos) == 3 && pos[2] != "-" {
		f, err := os.Open(pos[2])
		if err != nil {
			return err
		}
		defer f.Close()
		fi, err := f.Stat()
		if err != nil {
			return err
		}
		if fi.IsDir() {
			return fmt.Errorf("%s is a directory (use files push for directories)", pos[2])
		}
		// Pipes and process substitutions stream like stdin.
		if *modeStr == "" && fi.Mode().IsRegular() {
			mode = fi.Mode() & (os.ModePerm | os.ModeSetuid | os.ModeSetgid | os.ModeSticky)
		}
		src = f
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	// Hide any Close from the SDK: stdin and the file are ours to close.
	return c.WriteFile(ctx, pos[0], pos[1], struct{ io.Reader }{src}, mode)
}

func filesLs(ctx context.Context, args []string) error {
	fs := newCmdFlags("files ls", "[--depth N] [--json] ID [PATH]", "List a directory of a sandbox (default /).")
	depth := fs.Int("depth", 0, "levels to descend (0 = server default, 1)")
	asJSON := fs.Bool("json", false, "print a JSON array")
	pos, err := fs.parseN(args, 1, 2)
	if err != nil {
		return err
	}
	p := "/"
	if len(pos) == 2 {
		p = pos[1]
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	entries, err := c.ListFiles(ctx, pos[0], p, *depth)
	if err != nil {
		return err
	}
	if *asJSON {
		return printJSONList(entries)
	}
	tw := newTable()
	tw.printf("MODE\tSIZE\tMODIFIED\tPATH\n")
	for _, e := range entries {
		name := e.Path
		if e.Type == "dir" {
			name += "/"
		}
		if e.LinkTarget != "" {
			name += " -> " + e.LinkTarget
		}
		tw.printf("%s %s\t%d\t%s\t%s\n", typeLetter(e.Type), e.Mode, e.Size, e.MTime.Local().Format("2006-01-02 15:04"), name)
	}
	return tw.Flush()
}

// typeLetter abbreviates a file type the way ls -l does.
func typeLetter(t string) string {
	switch t {
	case "dir":
		return "d"
	case "symlink":
		return "l"
	case "file":
		return "-"
	}
	return "?"
}

func filesStat(ctx context.Context, args []string) error {
	fs := newCmdFlags("files stat", "[--json] ID PATH", "Describe one path of a sandbox (a final symlink is not followed).")
	asJSON := fs.Bool("json", false, "print the API response as JSON")
	pos, err := fs.parseN(args, 2, 2)
	if err != nil {
		return err
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	e, err := c.StatFile(ctx, pos[0], pos[1])
	if err != nil {
		return err
	}
	if *asJSON {
		return printJSON(e)
	}
	tw := newTable()
	tw.printf("Path:\t%s\n", e.Path)
	tw.printf("Type:\t%s\n", e.Type)
	if e.LinkTarget != "" {
		tw.printf("Target:\t%s\n", e.LinkTarget)
	}
	tw.printf("Size:\t%d (%s)\n", e.Size, humanBytes(e.Size))
	tw.printf("Mode:\t%s\n", e.Mode)
	tw.printf("Modified:\t%s\n", e.MTime.Local().Format("2006-01-02 15:04:05 MST"))
	return tw.Flush()
}

func filesRm(ctx context.Context, args []string) error {
	fs := newCmdFlags("files rm", "[-r] ID PATH", "Remove a file, or with -r a directory tree, in a sandbox.")
	recursive := fs.Bool("r", false, "remove directories and their contents")
	pos, err := fs.parseN(args, 2, 2)
	if err != nil {
		return err
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	return c.DeleteFile(ctx, pos[0], pos[1], *recursive)
}

func filesPush(ctx context.Context, args []string) error {
	fs := newCmdFlags("files push", "ID DIR PATH",
		"Upload the contents of a local DIR into PATH in a sandbox (streamed as tar;\nmodes and symlinks are kept).")
	pos, err := fs.parseN(args, 3, 3)
	if err != nil {
		return err
	}
	id, dir, dest := pos[0], pos[1], pos[2]
	if fi, err := os.Stat(dir); err != nil {
		return err
	} else if !fi.IsDir() {
		return fmt.Errorf("%s is not a directory (use files put for one file)", dir)
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	var res *api.TarResult
	st, err := streamDirTar(dir, nil, func(body io.Reader) error {
		var err error
		res, err = c.UploadTar(ctx, id, dest, body)
		return err
	})
	if err != nil {
		return err
	}
	if st.Skipped > 0 {
		fmt.Fprintf(os.Stderr, "dsec: skipped %d sockets\n", st.Skipped)
	}
	printf(os.Stdout, "uploaded %d entries (%s) to %s\n", res.Files, humanBytes(res.Bytes), dest)
	return nil
}

func filesPull(ctx context.Context, args []string) error {
	fs := newCmdFlags("files pull", "ID PATH DIR",
		"Download PATH of a sandbox into a local DIR (created if missing). Entries\nthat would land outside DIR are refused.")
	pos, err := fs.parseN(args, 3, 3)
	if err != nil {
		return err
	}
	id, src, dir := pos[0], pos[1], pos[2]
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	pr, pw := io.Pipe()
	downloaded := make(chan error, 1)
	go func() {
		_, err := c.DownloadTar(ctx, id, src, pw)
		pw.CloseWithError(err)
		downloaded <- err
	}()
	st, xerr := extractTar(pr, dir)
	if xerr == nil {
		// Tar ends with padding the reader need not consume; read to EOF so
		// the download finishes cleanly.
		_, xerr = io.Copy(io.Discard, pr)
	}
	pr.CloseWithError(errors.Join(xerr, io.ErrClosedPipe)) // stops the download if extraction failed
	derr := <-downloaded
	var apiErr *dsec.Error
	switch {
	case errors.As(derr, &apiErr):
		return derr // the server's refusal explains more than the broken pipe
	case xerr != nil:
		return xerr
	case derr != nil:
		return derr
	}
	if st.Skipped > 0 {
		fmt.Fprintf(os.Stderr, "dsec: skipped %d device or fifo entries\n", st.Skipped)
	}
	printf(os.Stdout, "extracted %d entries (%s) into %s\n", st.Entries, humanBytes(st.Bytes), dir)
	return nil
}

// streamDirTar tars dir on the fly into the body given to send, counting
// bytes in sent if it is non-nil. Whichever side fails first explains the
// failure: an API error from send wins over the broken pipe it causes.
func streamDirTar(dir string, sent *countingReader, send func(body io.Reader) error) (tarStats, error) {
	pr, pw := io.Pipe()
	type tarDone struct {
		st  tarStats
		err error
	}
	done := make(chan tarDone, 1)
	go func() {
		st, err := writeTarDir(pw, dir)
		pw.CloseWithError(err)
		done <- tarDone{st, err}
	}()
	var body io.Reader = pr
	if sent != nil {
		sent.r = pr
		body = sent
	}
	serr := send(body)
	pr.Close() // the request is over; unblock the tar writer if it is still going
	td := <-done
	var apiErr *dsec.Error
	switch {
	case errors.As(serr, &apiErr):
		return td.st, serr
	case td.err != nil && !errors.Is(td.err, io.ErrClosedPipe):
		return td.st, fmt.Errorf("archiving %s: %w", dir, td.err)
	}
	return td.st, serr
}

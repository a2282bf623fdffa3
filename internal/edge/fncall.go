package edge

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"io"
	"path"
	"sort"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// FnCall runs req in a fresh sandbox (from the warm pool when one is
// ready) and deletes it afterwards, so nothing of one call is seen by the
// next. cr is the sandbox to create, its spec derived from req.
func (e *Edge) FnCall(ctx context.Context, req api.FnCallRequest, cr edgeapi.CreateRequest) (*api.FnCallResult, error) {
	if err := sandbox.CheckFnCall(&req); err != nil {
		return nil, err
	}
	files := map[string][]byte{}
	for name, b64 := range req.Files {
		b, err := base64.StdEncoding.DecodeString(b64)
		if err != nil {
			return nil, errdefs.Invalid("files[%q]: not base64: %v", name, err)
		}
		files[name] = b
	}
	// The fetched files are buffered too (the command's output is
	// counted by Exec).
	release, err := e.output.take(sandbox.MaxFnCallFetchBytes)
	if err != nil {
		return nil, err
	}
	defer release()
	start := time.Now()
	sb, err := e.Create(ctx, cr)
	if err != nil {
		return nil, err
	}
	// The delete runs after the answer: the caller does not wait for it.
	defer e.deleteLater(sb.ID)

	names := make([]string, 0, len(files))
	for n := range files {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		if _, err := e.WriteFile(ctx, sb.ID, path.Join(sandbox.FnCallWorkdir, n), bytes.NewReader(files[n]), 0o644, ""); err != nil {
			return nil, err
		}
	}
	if len(names) == 0 {
		// The work dir, for the command to run in: an empty archive
		// creates it.
		if _, err := e.ExtractTar(ctx, sb.ID, sandbox.FnCallWorkdir, bytes.NewReader(make([]byte, 1024)), ""); err != nil {
			return nil, err
		}
	}
	res, err := e.Exec(ctx, sb.ID, sandbox.FnCallExec(&req), nil)
	if err != nil {
		return nil, err
	}
	out := &api.FnCallResult{ExitCode: res.ExitCode, Stdout: res.Stdout, Stderr: res.Stderr,
		StdoutB64: res.StdoutB64, StderrB64: res.StderrB64, TimedOut: res.TimedOut, Truncated: res.Truncated}
	budget := int64(sandbox.MaxFnCallFetchBytes)
	for _, n := range req.FetchFiles {
		rc, fe, err := e.ReadFile(ctx, sb.ID, path.Join(sandbox.FnCallWorkdir, n))
		if errors.Is(err, errdefs.ErrNotFound) || errors.Is(err, errdefs.ErrInvalid) {
			// Absent, or not a regular file (a directory, a FIFO): the
			// command's result still comes back.
			out.Missing = append(out.Missing, n)
			continue
		}
		if err != nil {
			return nil, err
		}
		if fe.Size > budget {
			rc.Close()
			return nil, errdefs.Invalid("fetch_files: more than %d bytes in all", sandbox.MaxFnCallFetchBytes)
		}
		b, err := io.ReadAll(io.LimitReader(rc, budget+1))
		rc.Close()
		if err != nil {
			return nil, err
		}
		budget -= int64(len(b))
		if out.Files == nil {
			out.Files = map[string]string{}
		}
		out.Files[n] = base64.StdEncoding.EncodeToString(b)
	}
	out.DurationMS = time.Since(start).Milliseconds()
	return out, nil
}

// deleteLater deletes a sandbox in the background, a bounded number at a
// time (a burst of calls queues its deletes rather than running them all).
func (e *Edge) deleteLater(id string) {
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		e.deleteSem <- struct{}{}
		defer func() { <-e.deleteSem }()
		if err := e.Delete(context.Background(), id); err != nil {
			e.log.Warn("deleting fncall sandbox", "sandbox_id", id, "err", err)
		}
	}()
}

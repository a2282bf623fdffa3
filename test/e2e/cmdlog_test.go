package e2e

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
)

// cmdLogPath is where the edge keeps a sandbox's command log.
func cmdLogPath(id string) string {
	return filepath.Join(d.stateDir, "edge", "sandboxes", id, "cmdlog.jsonl")
}

// fileSeqs returns the seqs of the log file's lines, in file order, and
// fails on a line that is not a JSON entry or longer than the entry bound.
func fileSeqs(t *testing.T, id string) []int64 {
	t.Helper()
	f, err := os.Open(cmdLogPath(id))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var seqs []int64
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if len(sc.Bytes()) > 8<<10 {
			t.Fatalf("log line of %d bytes, bound is 8 KiB", len(sc.Bytes()))
		}
		var ent api.LogEntry
		if err := json.Unmarshal(sc.Bytes(), &ent); err != nil {
			t.Fatalf("log line %q: %v", sc.Bytes(), err)
		}
		seqs = append(seqs, ent.Seq)
	}
	return seqs
}

func readLog(t *testing.T, id string, since int64) []api.LogEntry {
	t.Helper()
	entries, err := client.ReadAllLog(ctx(t), id, since)
	if err != nil {
		t.Fatalf("reading the log of %s: %v", id, err)
	}
	return entries
}

func wantGapFree(t *testing.T, got []api.LogEntry, first, last int64) {
	t.Helper()
	if int64(len(got)) != last-first+1 {
		t.Fatalf("%d entries, want seqs %d..%d: %+v", len(got), first, last, got)
	}
	for i, e := range got {
		if e.Seq != first+int64(i) {
			t.Fatalf("entry %d has seq %d, want %d", i, e.Seq, first+int64(i))
		}
	}
}

func TestCmdLogConcurrentExecs(t *testing.T) {
	needDaemon(t)
	sb := newSandbox(t, api.SandboxSpec{})
	const n = 32
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := client.Exec(ctx(t), sb.ID, api.ExecRequest{Cmd: fmt.Sprintf("echo run-%d", i)})
			if err == nil && res.ExitCode != 0 {
				err = fmt.Errorf("exit %d: %s", res.ExitCode, res.Stderr)
			}
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	got := readLog(t, sb.ID, 0)
	wantGapFree(t, got, 1, n)
	seen := map[string]bool{}
	for _, e := range got {
		if e.Kind != api.LogExec || e.Result.ExitCode == nil || *e.Result.ExitCode != 0 || e.Result.Error != nil {
			t.Fatalf("entry %+v", e)
		}
		want := strings.TrimPrefix(e.Request.Cmd, "echo ") + "\n"
		if e.Result.StdoutHead != want {
			t.Fatalf("entry %d: stdout head %q, want %q", e.Seq, e.Result.StdoutHead, want)
		}
		seen[e.Request.Cmd] = true
	}
	if len(seen) != n {
		t.Fatalf("%d distinct commands in the log, want %d", len(seen), n)
	}
	// The file holds them in seq order.
	seqs := fileSeqs(t, sb.ID)
	for i, s := range seqs {
		if s != int64(i+1) {
			t.Fatalf("file order %v", seqs)
		}
	}
	// Paging.
	page, err := client.ReadLog(ctx(t), sb.ID, 30, 1)
	if err != nil || len(page.Entries) != 1 || page.Entries[0].Seq != 31 || page.NextSeq != 31 {
		t.Fatalf("page after 30: %+v %v", page, err)
	}
	_, err = client.ReadLog(ctx(t), "sb-local-doesnotexist", 0, 0)
	wantCode(t, err, "not_found")
}

func TestCmdLogSummariesBounded(t *testing.T) {
	needDaemon(t)
	sb := newSandbox(t, api.SandboxSpec{})
	const secret = "s3cr3t-stdin-and-file-contents"
	res, err := client.Exec(ctx(t), sb.ID, api.ExecRequest{Cmd: "yes | head -c 3000000; yes err | head -c 500000 >&2; exit 3"})
	if err != nil || res.ExitCode != 3 {
		t.Fatalf("yes: %+v %v", res, err)
	}
	if _, err := client.Exec(ctx(t), sb.ID, api.ExecRequest{Argv: []string{"wc", "-c"}, Stdin: secret, Cwd: "/tmp", Timeout: 5}); err != nil {
		t.Fatal(err)
	}
	long := strings.Repeat("x", 20000)
	if _, err := client.Exec(ctx(t), sb.ID, api.ExecRequest{Cmd: "true " + long}); err != nil {
		t.Fatal(err)
	}
	if _, err := client.ExecStream(ctx(t), sb.ID, api.ExecRequest{Cmd: "yes | head -c 100000"}, func(api.ExecEvent) error { return nil }); err != nil {
		t.Fatal(err)
	}
	if _, err := client.Exec(ctx(t), sb.ID, api.ExecRequest{Cmd: "true", User: "nosuchuser"}); err == nil {
		t.Fatal("exec as an unknown user succeeded")
	}

	got := readLog(t, sb.ID, 0)
	wantGapFree(t, got, 1, 5)
	yes, cat, longCmd, stream, badUser := got[0], got[1], got[2], got[3], got[4]
	if *yes.Result.ExitCode != 3 || !strings.HasPrefix(yes.Result.StdoutHead, "y\ny\n") ||
		!strings.HasSuffix(yes.Result.StdoutHead, "…[truncated]") || len(yes.Result.StdoutHead) > 1100 ||
		!strings.HasSuffix(yes.Result.StderrHead, "…[truncated]") || yes.Result.DurationMS <= 0 {
		t.Fatalf("yes: %+v", yes.Result)
	}
	if strings.Join(cat.Request.Argv, " ") != "wc -c" || cat.Request.Cwd != "/tmp" || cat.Request.Timeout != 5 ||
		cat.Request.StdinBytes != int64(len(secret)) {
		t.Fatalf("cat request: %+v", cat.Request)
	}
	if !strings.HasSuffix(longCmd.Request.Cmd, "…[truncated]") || len(longCmd.Request.Cmd) > 4096 {
		t.Fatalf("long command kept %d bytes", len(longCmd.Request.Cmd))
	}
	if !stream.Request.Stream || !strings.HasSuffix(stream.Result.StdoutHead, "…[truncated]") || *stream.Result.ExitCode != 0 {
		t.Fatalf("streamed exec: %+v", stream)
	}
	if badUser.Result.Error == nil || badUser.Result.Error.Code != "invalid_argument" || badUser.Result.ExitCode != nil {
		t.Fatalf("failed exec: %+v", badUser.Result)
	}
	fileSeqs(t, sb.ID) // every line within the bound
	raw, _ := os.ReadFile(cmdLogPath(sb.ID))
	if bytes.Contains(raw, []byte(secret)) {
		t.Fatal("stdin content in the log")
	}
}

func TestCmdLogSessionsAndFiles(t *testing.T) {
	needDaemon(t)
	sb := newSandbox(t, api.SandboxSpec{})
	c := ctx(t)
	const secret = "file-body-that-must-not-be-logged"
	sid, err := client.CreateSession(c, sb.ID, api.SessionRequest{Cwd: "/tmp"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client.SessionRun(c, sb.ID, sid, api.SessionRunRequest{Command: "cd /repo && pwd"}); err != nil {
		t.Fatal(err)
	}
	if err := client.CloseSession(c, sb.ID, sid); err != nil {
		t.Fatal(err)
	}
	if err := client.WriteFile(c, sb.ID, "/data/a.txt", strings.NewReader(secret), 0o600); err != nil {
		t.Fatal(err)
	}
	if b, err := client.ReadFile(c, sb.ID, "/data/a.txt"); err != nil || string(b) != secret {
		t.Fatalf("read back %q %v", b, err)
	}
	if _, err := client.StatFile(c, sb.ID, "/data/a.txt"); err != nil {
		t.Fatal(err)
	}
	if _, err := client.ListFiles(c, sb.ID, "/data", 2); err != nil {
		t.Fatal(err)
	}
	var tarball bytes.Buffer
	if _, err := client.DownloadTar(c, sb.ID, "/data", &tarball); err != nil {
		t.Fatal(err)
	}
	if _, err := client.UploadTar(c, sb.ID, "/copy", bytes.NewReader(tarball.Bytes())); err != nil {
		t.Fatal(err)
	}
	if err := client.DeleteFile(c, sb.ID, "/copy", true); err != nil {
		t.Fatal(err)
	}
	_, err = client.StatFile(c, sb.ID, "/nope")
	wantCode(t, err, "not_found")

	got := readLog(t, sb.ID, 0)
	kinds := []string{"session.open", "session.run", "session.close", "files.write", "files.read",
		"files.stat", "files.list", "files.tar_out", "files.tar_in", "files.remove", "files.stat"}
	wantGapFree(t, got, 1, int64(len(kinds)))
	for i, k := range kinds {
		if got[i].Kind != k {
			t.Fatalf("entry %d is %s, want %s", i+1, got[i].Kind, k)
		}
	}
	open, run, closed, write := got[0], got[1], got[2], got[3]
	if open.Request.Cwd != "/tmp" || open.Result.SessionID != sid {
		t.Fatalf("session.open: %+v", open)
	}
	if run.Request.SessionID != sid || run.Request.Command != "cd /repo && pwd" || run.Result.StdoutHead != "/repo\n" {
		t.Fatalf("session.run: %+v", run)
	}
	if closed.Request.SessionID != sid || closed.Result.Error != nil {
		t.Fatalf("session.close: %+v", closed)
	}
	if write.Request.Path != "/data/a.txt" || write.Request.Mode != "0600" || *write.Result.Size != int64(len(secret)) {
		t.Fatalf("files.write: %+v", write)
	}
	if tarIn := got[8]; *tarIn.Result.Files < 1 || tarIn.Request.Path != "/copy" {
		t.Fatalf("files.tar_in: %+v", tarIn)
	}
	if rm := got[9]; !rm.Request.Recursive {
		t.Fatalf("files.remove: %+v", rm)
	}
	if st := got[10]; st.Result.Error == nil || st.Result.Error.Code != "not_found" {
		t.Fatalf("failed stat: %+v", st)
	}
	raw, _ := os.ReadFile(cmdLogPath(sb.ID))
	if bytes.Contains(raw, []byte(secret)) {
		t.Fatal("file contents in the log")
	}
	// The CLI shows the same log.
	out, errOut, code := cli("sandbox", "log", "--since", "9", sb.ID)
	if code != 0 || !strings.Contains(out, "files.remove") || strings.Contains(out, "files.tar_in") {
		t.Fatalf("dsec sandbox log: %d %s %s", code, out, errOut)
	}
}

func TestCmdLogSurvivesRestart(t *testing.T) {
	needDaemon(t)
	sb := newSandbox(t, api.SandboxSpec{})
	for i := range 3 {
		sh(t, sb.ID, fmt.Sprintf("echo before-%d", i))
	}
	d.kill9()
	if err := d.start(); err != nil {
		t.Fatal(err)
	}
	wantGapFree(t, readLog(t, sb.ID, 0), 1, 3)
	sh(t, sb.ID, "echo after")
	got := readLog(t, sb.ID, 0)
	wantGapFree(t, got, 1, 4)
	if got[3].Request.Cmd != "echo after" || got[3].Result.StdoutHead != "after\n" {
		t.Fatalf("entry after restart: %+v", got[3])
	}
	seqs := fileSeqs(t, sb.ID)
	if len(seqs) != 4 || seqs[3] != 4 {
		t.Fatalf("file seqs %v", seqs)
	}
}

func TestCmdLogKeptForStoppedSandbox(t *testing.T) {
	needDaemon(t)
	// The idle clock starts with the create: 4 s leave room for a slow
	// one before the exec.
	sb := newSandbox(t, api.SandboxSpec{IdleTimeout: 4})
	sh(t, sb.ID, "echo last words")
	waitSandboxState(t, sb.ID, api.StateStopped, 30*time.Second)
	got := readLog(t, sb.ID, 0)
	wantGapFree(t, got, 1, 1)
	if got[0].Result.StdoutHead != "last words\n" {
		t.Fatalf("entry %+v", got[0])
	}
	// Calls refused by a stopped sandbox are not operations on it.
	if _, err := client.Exec(ctx(t), sb.ID, api.ExecRequest{Cmd: "true"}); err == nil {
		t.Fatal("exec in a stopped sandbox succeeded")
	}
	wantGapFree(t, readLog(t, sb.ID, 0), 1, 1)
}

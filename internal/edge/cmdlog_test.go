package edge

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// logEdge is an edge with one running sandbox whose rootfs is a plain
// directory: enough for the command log and the files API, without root.
func logEdge(t *testing.T, cfg CmdLogConfig) (*Edge, *sbx) {
	t.Helper()
	e, err := New(Config{Name: "n1", StateDir: t.TempDir(), CmdLog: cfg}, Deps{})
	if err != nil {
		t.Fatal(err)
	}
	id := "sb-n1-log"
	s := &sbx{dir: e.sandboxDir(id), rec: record{Sandbox: api.Sandbox{ID: id, State: api.StateRunning}}}
	if err := os.MkdirAll(filepath.Join(s.dir, "rootfs"), 0o755); err != nil {
		t.Fatal(err)
	}
	e.sandboxes[id] = s
	return e, s
}

func readAll(t *testing.T, e *Edge, since int64) []api.LogEntry {
	t.Helper()
	page, err := e.ReadLog(context.Background(), "sb-n1-log", since, edgeapi.MaxLogLimit)
	if err != nil {
		t.Fatal(err)
	}
	return page.Entries
}

func wantSeqs(t *testing.T, got []api.LogEntry, first, last int64) {
	t.Helper()
	if int64(len(got)) != last-first+1 {
		t.Fatalf("got %d entries, want seqs %d..%d", len(got), first, last)
	}
	for i, ent := range got {
		if ent.Seq != first+int64(i) {
			t.Fatalf("entry %d has seq %d, want %d", i, ent.Seq, first+int64(i))
		}
	}
}

func TestCmdLogConcurrentSeqs(t *testing.T) {
	e, s := logEdge(t, CmdLogConfig{})
	const n = 200
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			e.record(s, api.LogExec, time.Now(), api.LogRequest{Cmd: fmt.Sprint("echo ", i)}, api.LogResult{}, nil)
		}()
	}
	wg.Wait()
	got := readAll(t, e, 0)
	wantSeqs(t, got, 1, n)
	seen := map[string]bool{}
	for _, ent := range got {
		seen[ent.Request.Cmd] = true
	}
	if len(seen) != n {
		t.Fatalf("%d distinct commands logged, want %d", len(seen), n)
	}
	// Paging: since_seq is exclusive and next_seq continues.
	page, err := e.ReadLog(context.Background(), "sb-n1-log", 10, 5)
	if err != nil {
		t.Fatal(err)
	}
	wantSeqs(t, page.Entries, 11, 15)
	if page.NextSeq != 15 {
		t.Fatalf("next_seq = %d, want 15", page.NextSeq)
	}
	page, _ = e.ReadLog(context.Background(), "sb-n1-log", n, 5)
	if len(page.Entries) != 0 || page.NextSeq != n {
		t.Fatalf("past the end: %+v", page)
	}
}

func TestCmdLogRestartContinuesAndSkipsTornTail(t *testing.T) {
	e, s := logEdge(t, CmdLogConfig{})
	for range 3 {
		e.record(s, api.LogExec, time.Now(), api.LogRequest{Cmd: "true"}, api.LogResult{}, nil)
	}
	// A host crash tore the last write.
	path := filepath.Join(s.dir, cmdLogFile)
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = f.WriteString(`{"seq":4,"time":"2026-`)
	f.Close()
	wantSeqs(t, readAll(t, e, 0), 1, 3)

	// A restarted edge knows nothing but the file.
	s2 := &sbx{dir: s.dir, rec: s.rec}
	e.sandboxes["sb-n1-log"] = s2
	e.record(s2, api.LogExec, time.Now(), api.LogRequest{Cmd: "after restart"}, api.LogResult{}, nil)
	got := readAll(t, e, 0)
	wantSeqs(t, got, 1, 4)
	if got[3].Request.Cmd != "after restart" {
		t.Fatalf("entry 4 = %+v", got[3])
	}
	b, _ := os.ReadFile(path)
	if bytes.Count(b, []byte("\n")) != 4 || strings.Contains(string(b), `"time":"2026-{`) {
		t.Fatalf("torn tail was not cut:\n%s", b)
	}
}

func TestCmdLogTruncationMarker(t *testing.T) {
	e, s := logEdge(t, CmdLogConfig{MaxEntries: 10})
	for i := range 25 {
		e.record(s, api.LogExec, time.Now(), api.LogRequest{Cmd: fmt.Sprint("cmd ", i+1)}, api.LogResult{}, nil)
	}
	got := readAll(t, e, 0)
	if len(got) > 10 {
		t.Fatalf("%d entries kept, bound is 10", len(got))
	}
	m := got[0]
	if m.Kind != api.LogTruncatedKind || m.Result.FirstSeq != 1 || m.Result.LastSeq != m.Seq {
		t.Fatalf("head is not a truncation marker from seq 1: %+v", m)
	}
	// One marker, then the newest entries, gap-free, ending at 25.
	wantSeqs(t, got, m.Seq, 25)
	for _, ent := range got[1:] {
		if ent.Kind != api.LogExec || ent.Request.Cmd != fmt.Sprint("cmd ", ent.Seq) {
			t.Fatalf("entry %d: %+v", ent.Seq, ent)
		}
	}
	// A reader behind the cut sees the marker; one past it does not.
	if got := readAll(t, e, 3); len(got) == 0 || got[0].Kind != api.LogTruncatedKind {
		t.Fatalf("reader at since_seq=3 does not see the marker: %+v", got)
	}
	if got := readAll(t, e, m.Seq); len(got) == 0 || got[0].Kind == api.LogTruncatedKind {
		t.Fatalf("reader past the marker sees it again: %+v", got)
	}
	// The seq goes on after compaction and after a restart.
	s2 := &sbx{dir: s.dir, rec: s.rec}
	e.sandboxes["sb-n1-log"] = s2
	e.record(s2, api.LogExec, time.Now(), api.LogRequest{Cmd: "cmd 26"}, api.LogResult{}, nil)
	got = readAll(t, e, 0)
	if last := got[len(got)-1]; last.Seq != 26 || last.Request.Cmd != "cmd 26" {
		t.Fatalf("after restart: last entry %+v, want seq 26", last)
	}
	if got[0].Kind != api.LogTruncatedKind || got[0].Result.FirstSeq != 1 {
		t.Fatalf("markers were not merged into one from seq 1: %+v", got[0])
	}
	for _, ent := range got[1:] {
		if ent.Kind == api.LogTruncatedKind {
			t.Fatalf("a second marker: %+v", got)
		}
	}
}

func TestCmdLogByteBound(t *testing.T) {
	cfg := CmdLogConfig{EntryBytes: 1024, MaxBytes: 16 << 10}
	e, s := logEdge(t, cfg)
	for range 200 {
		e.record(s, api.LogExec, time.Now(), api.LogRequest{Cmd: strings.Repeat("x", 600)}, api.LogResult{}, nil)
	}
	st, err := os.Stat(filepath.Join(s.dir, cmdLogFile))
	if err != nil {
		t.Fatal(err)
	}
	if st.Size() > cfg.MaxBytes {
		t.Fatalf("log is %d bytes, bound %d", st.Size(), cfg.MaxBytes)
	}
	got := readAll(t, e, 0)
	if got[0].Kind != api.LogTruncatedKind || got[len(got)-1].Seq != 200 {
		t.Fatalf("first %+v last seq %d", got[0], got[len(got)-1].Seq)
	}
	wantSeqs(t, got, got[0].Seq, 200)
}

func TestEncodeEntryBounds(t *testing.T) {
	huge := strings.Repeat("é<>&\x01", 50000)
	argv := make([]string, 1000)
	for i := range argv {
		argv[i] = huge[:100]
	}
	ent := &api.LogEntry{Seq: 123, Time: time.Now(), Kind: api.LogExec,
		Request: api.LogRequest{Cmd: huge, Argv: argv, Cwd: huge, Path: huge, User: huge},
		Result: api.LogResult{StdoutHead: huge, StderrHead: huge,
			Error: &api.ErrorDetail{Code: "invalid_argument", Message: huge}}}
	for _, limit := range []int{minLogEntryBytes, 1024, defaultLogEntryBytes} {
		b, err := encodeEntry(ent, limit)
		if err != nil {
			t.Fatal(err)
		}
		if len(b) > limit {
			t.Fatalf("entry is %d bytes, limit %d", len(b), limit)
		}
		if seq, ok := lineSeq(b); !ok || seq != 123 || b[len(b)-1] != '\n' {
			t.Fatalf("line does not start with its seq or end in a newline: %.60q", b)
		}
		var back api.LogEntry
		if err := json.Unmarshal(b, &back); err != nil {
			t.Fatal(err)
		}
		if !strings.HasSuffix(back.Request.Cmd, cutMarker) || !utf8.ValidString(back.Request.Cmd) {
			t.Fatalf("cut command is not marked or not UTF-8: %q", back.Request.Cmd)
		}
	}
	// Small entries are kept as they are.
	small := &api.LogEntry{Seq: 1, Kind: api.LogExec, Request: api.LogRequest{Argv: []string{"ls", "-l"}}}
	b, _ := encodeEntry(small, defaultLogEntryBytes)
	var back api.LogEntry
	_ = json.Unmarshal(b, &back)
	if len(back.Request.Argv) != 2 || back.Request.Argv[1] != "-l" {
		t.Fatalf("small argv changed: %q", back.Request.Argv)
	}
}

func TestHeadWriter(t *testing.T) {
	var sink bytes.Buffer
	h := &headWriter{w: &sink}
	big := strings.Repeat("y\n", 4096)
	for range 3 {
		if n, err := h.Write([]byte(big)); n != len(big) || err != nil {
			t.Fatal(n, err)
		}
	}
	if sink.Len() != 3*len(big) {
		t.Fatalf("passed through %d bytes, want %d", sink.Len(), 3*len(big))
	}
	txt := h.text()
	if !strings.HasSuffix(txt, cutMarker) || len(txt) != logHeadBytes+len(cutMarker) {
		t.Fatalf("head is %d bytes: %.40q", len(txt), txt)
	}
	// A rune split at the cap is dropped, not shown as garbage.
	h = &headWriter{w: io.Discard}
	_, _ = h.Write([]byte(strings.Repeat("a", logHeadBytes-1) + "€€"))
	if txt := h.text(); !utf8.ValidString(txt) || strings.Contains(txt, "\uFFFD") {
		t.Fatalf("split rune: %q", txt[len(txt)-20:])
	}
	var nilHead *headWriter
	if nilHead.text() != "" {
		t.Fatal("nil head writer")
	}
}

func TestFilesOpsLogged(t *testing.T) {
	e, _ := logEdge(t, CmdLogConfig{})
	ctx := context.Background()
	id := "sb-n1-log"
	secret := "top secret file contents"
	if _, err := e.WriteFile(ctx, id, "/work/a.txt", strings.NewReader(secret), 0o640, ""); err != nil {
		t.Fatal(err)
	}
	if _, err := e.StatFile(ctx, id, "/work/a.txt"); err != nil {
		t.Fatal(err)
	}
	if _, err := e.ListFiles(ctx, id, "/work", 1); err != nil {
		t.Fatal(err)
	}
	rc, _, err := e.ReadFile(ctx, id, "/work/a.txt")
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, rc)
	rc.Close()
	var tarball bytes.Buffer
	if err := e.WriteTar(ctx, id, "/work", &tarball); err != nil {
		t.Fatal(err)
	}
	if _, err := e.ExtractTar(ctx, id, "/copy", bytes.NewReader(tarball.Bytes()), ""); err != nil {
		t.Fatal(err)
	}
	if err := e.RemoveFile(ctx, id, "/nope", false); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("remove /nope: %v", err)
	}
	if err := e.RemoveFile(ctx, id, "/copy", true); err != nil {
		t.Fatal(err)
	}

	got := readAll(t, e, 0)
	raw, _ := os.ReadFile(filepath.Join(e.sandboxDir(id), cmdLogFile))
	if bytes.Contains(raw, []byte(secret)) {
		t.Fatalf("file contents in the log:\n%s", raw)
	}
	kinds := []string{api.LogFilesWrite, api.LogFilesStat, api.LogFilesList, api.LogFilesRead,
		api.LogFilesTarOut, api.LogFilesTarIn, api.LogFilesRemove, api.LogFilesRemove}
	if len(got) != len(kinds) {
		t.Fatalf("%d entries, want %d:\n%s", len(got), len(kinds), raw)
	}
	for i, k := range kinds {
		if got[i].Kind != k || got[i].Seq != int64(i+1) {
			t.Fatalf("entry %d: %+v, want kind %s", i, got[i], k)
		}
	}
	size := int64(len(secret))
	w, st, ls, rd, out, in, rmErr, rm := got[0], got[1], got[2], got[3], got[4], got[5], got[6], got[7]
	switch {
	case w.Request.Path != "/work/a.txt" || w.Request.Mode != "0640" || w.Result.Size == nil || *w.Result.Size != size:
		t.Fatalf("write: %+v", w)
	case st.Result.Type != "file" || *st.Result.Size != size:
		t.Fatalf("stat: %+v", st)
	case ls.Request.Depth != 1 || ls.Result.Entries == nil || *ls.Result.Entries != 1:
		t.Fatalf("list: %+v", ls)
	case rd.Result.Size == nil || *rd.Result.Size != size:
		t.Fatalf("read: %+v", rd)
	case out.Result.Bytes == nil || *out.Result.Bytes != int64(tarball.Len()):
		t.Fatalf("tar out: %+v", out)
	case in.Result.Files == nil || *in.Result.Files < 1:
		t.Fatalf("tar in: %+v", in)
	case rmErr.Result.Error == nil || rmErr.Result.Error.Code != "not_found":
		t.Fatalf("failed remove: %+v", rmErr)
	case !rm.Request.Recursive || rm.Result.Error != nil:
		t.Fatalf("remove: %+v", rm)
	}
}

func TestReadLogErrors(t *testing.T) {
	e, _ := logEdge(t, CmdLogConfig{})
	ctx := context.Background()
	if _, err := e.ReadLog(ctx, "sb-n1-nope", 0, 0); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("unknown sandbox: %v", err)
	}
	for _, c := range []struct {
		since int64
		limit int
	}{{-1, 0}, {0, -1}, {0, edgeapi.MaxLogLimit + 1}} {
		if _, err := e.ReadLog(ctx, "sb-n1-log", c.since, c.limit); !errors.Is(err, errdefs.ErrInvalid) {
			t.Fatalf("since %d limit %d: %v", c.since, c.limit, err)
		}
	}
	// No operation yet: an empty page, not an error.
	page, err := e.ReadLog(ctx, "sb-n1-log", 0, 0)
	if err != nil || page.Entries == nil || len(page.Entries) != 0 || page.NextSeq != 0 {
		t.Fatalf("empty log: %+v, %v", page, err)
	}
}

func TestLogErrorHidesInternalDetail(t *testing.T) {
	d := logError(fmt.Errorf("mounting /var/lib/dsec/secret: %w", os.ErrPermission))
	if d.Code != "internal" || strings.Contains(d.Message, "/var/lib") {
		t.Fatalf("internal error leaks detail: %+v", d)
	}
	d = logError(errdefs.Invalid("bad path"))
	if d.Code != "invalid_argument" || d.Message != "bad path" {
		t.Fatalf("classified error: %+v", d)
	}
}

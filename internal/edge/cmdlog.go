package edge

// The command log records every exec, session and files operation on a
// sandbox, in order, with a bounded summary of what was asked and how it
// ended (DSEC-FACTS §6.1: replay after preemption, trajectory audit). It
// never holds file contents, stdin or environment values.
//
// It lives in <sandbox dir>/cmdlog.jsonl, one JSON object per line, each
// appended by one write(2) on a file opened with O_APPEND. Under sbx.logMu
// the next seq is assigned and its line written, so seqs are distinct,
// gap-free and in file order however many calls run at once; the
// operations themselves run outside the lock. Readers take no lock: they
// skip a last line still being written (no newline yet).
//
// Durability: entries are not fsynced, for one small append per operation.
// A write that returned is in the page cache, so an edge crash or kill -9
// loses nothing; a host crash may lose the last entries. A restarted edge
// takes the next seq from the file (last valid seq + 1) at its first append
// to the sandbox, so seqs keep growing over what survived; seqs of entries
// lost to a host crash may be handed out again. A torn last line (no
// newline or not JSON) is skipped by readers and cut off before the next
// append.
//
// Bound: past MaxEntries or MaxBytes the oldest entries are dropped down to
// three quarters of the bound (so the rewrite is rare) and one log.truncated
// entry stands in for them at the head. It carries the seq of the last
// entry it replaces and the dropped range in result.first_seq/last_seq, so a
// reader behind the cut always sees that something was dropped. Compaction
// writes the new file beside the old one (fsynced) and renames it over it:
// a crash leaves one or the other, both valid logs.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
)

const (
	cmdLogFile = "cmdlog.jsonl"

	defaultLogMaxEntries = 10000
	defaultLogMaxBytes   = 16 << 20
	defaultLogEntryBytes = 8 << 10
	minLogEntryBytes     = 512

	// logHeadBytes is how much of each output stream an entry keeps;
	// logFieldBytes bounds other strings (twice that for a command line or
	// an argv); logMaxArgs bounds an argv.
	logHeadBytes  = 1 << 10
	logFieldBytes = 1 << 10
	logMaxArgs    = 64
	// cutMarker ends every string the log shortened.
	cutMarker = "…[truncated]"
)

// CmdLogConfig bounds each sandbox's command log. Zero fields take the
// defaults.
type CmdLogConfig struct {
	// MaxEntries and MaxBytes bound one sandbox's log (default 10,000
	// entries and 16 MiB); past either, the oldest entries are dropped.
	MaxEntries int
	MaxBytes   int64
	// EntryBytes bounds one entry as stored (default 8 KiB, at least 512):
	// longer strings are cut further.
	EntryBytes int
}

func (c CmdLogConfig) withDefaults() CmdLogConfig {
	if c.MaxEntries <= 0 {
		c.MaxEntries = defaultLogMaxEntries
	}
	c.MaxEntries = max(c.MaxEntries, 2)
	if c.EntryBytes <= 0 {
		c.EntryBytes = defaultLogEntryBytes
	}
	c.EntryBytes = max(c.EntryBytes, minLogEntryBytes)
	if c.MaxBytes <= 0 {
		c.MaxBytes = defaultLogMaxBytes
	}
	c.MaxBytes = max(c.MaxBytes, 4*int64(c.EntryBytes))
	return c
}

// cmdLog is what the edge knows about one sandbox's log file. It is loaded
// from the file at the first append (after a restart too), not at recovery:
// reads need none of it, and a node with thousands of kept sandboxes would
// otherwise scan every log at start.
// Preconditions for every method: sbx.logMu held.
type cmdLog struct {
	loaded  bool
	next    int64 // seq of the next entry
	entries int   // lines in the file, a log.truncated marker included
	bytes   int64 // size of the file
}

// record appends the log entry of one operation on s that started at start.
// A failure to write is logged, not returned: the operation has happened
// and its caller gets its result either way.
func (e *Edge) record(s *sbx, kind string, start time.Time, req api.LogRequest, res api.LogResult, err error) {
	if res.DurationMS == 0 {
		res.DurationMS = time.Since(start).Milliseconds()
	}
	if err != nil {
		res.Error = logError(err)
	}
	ent := api.LogEntry{Time: start.UTC(), Kind: kind, Request: req, Result: res}
	if werr := s.appendLog(e.cfg.CmdLog.withDefaults(), &ent); werr != nil {
		e.log.Warn("writing command log", "sandbox_id", filepath.Base(s.dir), "err", werr)
	}
}

// appendLog gives ent the next seq and appends it.
func (s *sbx) appendLog(cfg CmdLogConfig, ent *api.LogEntry) error {
	// A sandbox being deleted gets no new file in its directory: the delete
	// would fail to remove a directory that gained an entry under it. (The
	// operation racing a delete or stop is then missing from a log it would
	// have started; an existing log is appended to.)
	s.mu.Lock()
	going := s.going
	s.mu.Unlock()
	flags := os.O_WRONLY | os.O_APPEND
	if !going {
		flags |= os.O_CREATE
	}

	s.logMu.Lock()
	defer s.logMu.Unlock()
	l := &s.log
	path := filepath.Join(s.dir, cmdLogFile)
	if !l.loaded {
		if err := l.load(path); err != nil {
			return err
		}
	}
	ent.Seq = l.next
	line, err := encodeEntry(ent, cfg.EntryBytes)
	if err != nil {
		return err
	}
	f, err := os.OpenFile(path, flags, 0o600)
	if errors.Is(err, fs.ErrNotExist) && going {
		return nil
	}
	if err != nil {
		return fmt.Errorf("opening command log: %w", err)
	}
	_, err = f.Write(line)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		// A short write leaves a torn line: reload (and cut it) before the
		// next append, which takes the seq again if the line did not land.
		l.loaded = false
		return fmt.Errorf("appending to command log: %w", err)
	}
	l.next++
	l.entries++
	l.bytes += int64(len(line))
	if (l.entries > cfg.MaxEntries || l.bytes > cfg.MaxBytes) && !going {
		if err := l.compact(path, cfg); err != nil {
			l.loaded = false
			return fmt.Errorf("compacting command log: %w", err)
		}
	}
	return nil
}

// load reads the state of the log file. A torn tail is cut off so the next
// append starts on a line of its own.
func (l *cmdLog) load(path string) error {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if errors.Is(err, fs.ErrNotExist) {
		*l = cmdLog{loaded: true, next: 1}
		return nil
	}
	if err != nil {
		return fmt.Errorf("opening command log: %w", err)
	}
	defer f.Close()
	var last, end int64
	n := 0
	size, err := scanLines(f, func(off int64, line []byte) bool {
		if seq, ok := lineSeq(line); ok && json.Valid(line) {
			last = max(last, seq)
			n++
			end = off + int64(len(line))
		}
		return true
	})
	if err != nil {
		return fmt.Errorf("reading command log: %w", err)
	}
	if size > end {
		if err := f.Truncate(end); err != nil {
			return fmt.Errorf("cutting the torn tail of the command log: %w", err)
		}
	}
	*l = cmdLog{loaded: true, next: last + 1, entries: n, bytes: end}
	return nil
}

// compact drops the oldest entries down to three quarters of the bounds and
// puts one log.truncated entry in their place (merging an earlier marker).
func (l *cmdLog) compact(path string, cfg CmdLogConfig) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	type lineAt struct{ off, seq int64 }
	var lines []lineAt
	var head api.LogEntry
	headMarker := false
	size, err := scanLines(f, func(off int64, line []byte) bool {
		seq, ok := lineSeq(line)
		if !ok {
			return true // torn: dropped with its neighbours, or kept as is
		}
		if len(lines) == 0 && json.Unmarshal(line, &head) == nil && head.Kind == api.LogTruncatedKind {
			headMarker = true
		}
		lines = append(lines, lineAt{off, seq})
		return true
	})
	if err != nil {
		return err
	}
	if len(lines) == 0 {
		return nil
	}
	newest := lines[len(lines)-1].seq
	// The marker's size hardly depends on its numbers: measure it with the
	// largest ones it can carry.
	probe, err := encodeEntry(truncationMarker(newest, newest, newest), cfg.EntryBytes)
	if err != nil {
		return err
	}
	keepEntries := max(cfg.MaxEntries*3/4, 1)
	keepBytes := cfg.MaxBytes * 3 / 4
	// Drop lines[:k]; an earlier marker alone is not progress.
	k := 1
	if headMarker {
		k = min(2, len(lines))
	}
	for k < len(lines) && (len(lines)-k+1 > keepEntries || size-lines[k].off+int64(len(probe)) > keepBytes) {
		k++
	}
	first := lines[0].seq
	if headMarker && head.Result.FirstSeq > 0 {
		first = head.Result.FirstSeq
	}
	marker, err := encodeEntry(truncationMarker(lines[k-1].seq, first, lines[k-1].seq), cfg.EntryBytes)
	if err != nil {
		return err
	}
	keepFrom := size
	if k < len(lines) {
		keepFrom = lines[k].off
	}
	tmp := filepath.Join(filepath.Dir(path), "."+cmdLogFile+".tmp")
	out, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	_, err = out.Write(marker)
	if err == nil {
		_, err = f.Seek(keepFrom, io.SeekStart)
	}
	if err == nil {
		_, err = io.CopyN(out, f, size-keepFrom)
	}
	if err == nil {
		err = out.Sync()
	}
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		_ = os.Remove(tmp)
		return err
	}
	l.entries = len(lines) - k + 1
	l.bytes = int64(len(marker)) + size - keepFrom
	return nil
}

func truncationMarker(seq, first, last int64) *api.LogEntry {
	return &api.LogEntry{Seq: seq, Time: time.Now().UTC(), Kind: api.LogTruncatedKind,
		Result: api.LogResult{FirstSeq: first, LastSeq: last}}
}

// ReadLog returns a sandbox's command log entries with seq > sinceSeq, in
// order, at most limit (0: edgeapi.DefaultLogLimit). It serves every sandbox whose
// record is kept, stopped and failed ones included. NextSeq is the seq of
// the last entry returned (sinceSeq when none): the sinceSeq of the next
// call.
func (e *Edge) ReadLog(ctx context.Context, id string, sinceSeq int64, limit int) (*api.LogPage, error) {
	if sinceSeq < 0 {
		return nil, errdefs.Invalid("since_seq must not be negative, got %d", sinceSeq)
	}
	if limit == 0 {
		limit = edgeapi.DefaultLogLimit
	}
	if limit < 0 || limit > edgeapi.MaxLogLimit {
		return nil, errdefs.Invalid("limit must be between 1 and %d, got %d", edgeapi.MaxLogLimit, limit)
	}
	s, err := e.get(ctx, id)
	if err != nil {
		return nil, err
	}
	page := &api.LogPage{Entries: []api.LogEntry{}, NextSeq: sinceSeq}
	f, err := os.Open(filepath.Join(s.dir, cmdLogFile))
	if errors.Is(err, fs.ErrNotExist) {
		return page, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading command log: %w", err)
	}
	defer f.Close()
	_, err = scanLines(f, func(_ int64, line []byte) bool {
		seq, ok := lineSeq(line)
		if !ok || seq <= sinceSeq {
			return true
		}
		var ent api.LogEntry
		if json.Unmarshal(line, &ent) != nil {
			return true // torn by a host crash
		}
		page.Entries = append(page.Entries, ent)
		page.NextSeq = ent.Seq
		return len(page.Entries) < limit
	})
	if err != nil {
		return nil, fmt.Errorf("reading command log: %w", err)
	}
	return page, nil
}

// scanLines calls fn with each newline-terminated line of r (newline
// included; valid only during the call) and its offset, until fn returns
// false. It returns the offset after the last byte it read. A last line
// without a newline is torn or still being written, and is not passed.
func scanLines(r io.Reader, fn func(off int64, line []byte) bool) (int64, error) {
	br := bufio.NewReaderSize(r, 64<<10)
	var off int64
	var long []byte
	for {
		chunk, err := br.ReadSlice('\n')
		if errors.Is(err, bufio.ErrBufferFull) {
			long = append(long, chunk...)
			continue
		}
		line := chunk
		if long != nil {
			line = append(long, chunk...)
			long = nil
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				return off + int64(len(line)), nil
			}
			return off, err
		}
		if !fn(off, line) {
			return off + int64(len(line)), nil
		}
		off += int64(len(line))
	}
}

// lineSeq reads the seq of a log line: lines are written seq first, so the
// prefix is enough and most lines of a read are never decoded.
func lineSeq(line []byte) (int64, bool) {
	rest, ok := bytes.CutPrefix(line, []byte(`{"seq":`))
	if !ok {
		return 0, false
	}
	i := 0
	for i < len(rest) && rest[i] >= '0' && rest[i] <= '9' {
		i++
	}
	if i == 0 || i >= len(rest) || rest[i] != ',' {
		return 0, false
	}
	n, err := strconv.ParseInt(string(rest[:i]), 10, 64)
	return n, err == nil && n > 0
}

// encodeEntry renders one log line (newline included) of at most limit
// bytes (limit >= minLogEntryBytes), cutting the entry's strings shorter
// until it fits.
func encodeEntry(ent *api.LogEntry, limit int) ([]byte, error) {
	var buf bytes.Buffer
	for n := logFieldBytes; ; n /= 2 {
		e := boundEntry(*ent, n)
		buf.Reset()
		enc := json.NewEncoder(&buf)
		enc.SetEscapeHTML(false)
		if err := enc.Encode(&e); err != nil {
			return nil, fmt.Errorf("encoding command log entry: %w", err)
		}
		if buf.Len() <= limit || n <= 8 {
			return buf.Bytes(), nil
		}
	}
}

// boundEntry returns a copy of e with every string cut to n bytes (a
// command line and argv to 2n together; at n <= 8 the argv goes).
func boundEntry(e api.LogEntry, n int) api.LogEntry {
	q, r := &e.Request, &e.Result
	q.Cmd, q.Command = cut(q.Cmd, 2*n), cut(q.Command, 2*n)
	q.Cwd, q.User, q.Shell, q.Path, q.Mode, q.SessionID = cut(q.Cwd, n), cut(q.User, n), cut(q.Shell, n), cut(q.Path, n), cut(q.Mode, n), cut(q.SessionID, n)
	q.Argv = cutArgv(q.Argv, n)
	r.StdoutHead, r.StderrHead = cut(r.StdoutHead, n), cut(r.StderrHead, n)
	r.SessionID, r.Type = cut(r.SessionID, n), cut(r.Type, n)
	if r.Error != nil {
		d := *r.Error
		d.Message = cut(d.Message, n)
		r.Error = &d
	}
	return e
}

// cutArgv keeps at most logMaxArgs arguments and 2n bytes of them, each
// cut to n/2; a last "…[truncated]" argument says some were left out.
func cutArgv(argv []string, n int) []string {
	if argv == nil || n <= 8 {
		if argv != nil {
			return []string{cutMarker}
		}
		return nil
	}
	out := make([]string, 0, min(len(argv), logMaxArgs))
	total := 0
	for i, a := range argv {
		a = cut(a, n/2)
		if i == logMaxArgs || total+len(a) > 2*n {
			return append(out, cutMarker)
		}
		total += len(a)
		out = append(out, a)
	}
	return out
}

// cut shortens s to n bytes at a rune boundary, marking the cut.
func cut(s string, n int) string {
	if len(s) <= n {
		return s
	}
	i := max(n, 0)
	for i > 0 && !utf8.RuneStart(s[i]) {
		i--
	}
	return s[:i] + cutMarker
}

// headWriter passes output through and keeps its first logHeadBytes for the
// command log.
type headWriter struct {
	w    io.Writer
	mu   sync.Mutex
	head []byte
	more bool
}

func (h *headWriter) Write(p []byte) (int, error) {
	h.mu.Lock()
	if room := logHeadBytes - len(h.head); room > 0 {
		h.head = append(h.head, p[:min(room, len(p))]...)
		h.more = h.more || len(p) > room
	} else if len(p) > 0 {
		h.more = true
	}
	h.mu.Unlock()
	return h.w.Write(p)
}

// text returns the head as text, marked when the stream went on.
func (h *headWriter) text() string {
	if h == nil {
		return ""
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	b := h.head
	// A rune split at the cap is not the command's fault.
	for k := 1; k <= 3 && k <= len(b) && h.more; k++ {
		if utf8.RuneStart(b[len(b)-k]) {
			if !utf8.FullRune(b[len(b)-k:]) {
				b = b[:len(b)-k]
			}
			break
		}
	}
	s := strings.ToValidUTF8(string(b), "\uFFFD")
	if h.more {
		s += cutMarker
	}
	return s
}

// logError is an operation's error as the log shows it. Internal errors
// may hold host detail (paths, runtime output) and only name their class,
// as the API does.
func logError(err error) *api.ErrorDetail {
	code := errdefs.Code(err)
	msg := err.Error()
	if code == "internal" {
		msg = "internal error"
	}
	return &api.ErrorDetail{Code: code, Message: msg}
}

// Summaries of each kind of operation.

func execRequestLog(req api.ExecRequest, stream bool) api.LogRequest {
	stdin := int64(len(req.Stdin))
	if req.StdinB64 != "" {
		stdin = int64(len(req.StdinB64)/4*3 - strings.Count(req.StdinB64[max(len(req.StdinB64)-2, 0):], "="))
	}
	return api.LogRequest{Cmd: req.Cmd, Argv: req.Argv, Cwd: req.Cwd, User: req.User,
		Timeout: req.Timeout, StdinBytes: max(stdin, 0), Stream: stream, Private: req.Private}
}

func execResultLog(res *api.ExecResult, stdout, stderr *headWriter) api.LogResult {
	if res == nil {
		return api.LogResult{}
	}
	code := res.ExitCode
	return api.LogResult{ExitCode: &code, TimedOut: res.TimedOut, Truncated: res.Truncated,
		DurationMS: res.DurationMS, StdoutHead: stdout.text(), StderrHead: stderr.text()}
}

func sessionRunLog(res *api.ExecResult, ended bool) api.LogResult {
	if res == nil {
		return api.LogResult{}
	}
	code := res.ExitCode
	return api.LogResult{ExitCode: &code, TimedOut: res.TimedOut, Truncated: res.Truncated,
		DurationMS: res.DurationMS, StdoutHead: cut(res.Stdout, logHeadBytes), StderrHead: cut(res.Stderr, logHeadBytes),
		SessionEnded: ended}
}

// modeString renders a file mode as the API's octal permission bits.
func modeString(m os.FileMode) string {
	n := uint32(m.Perm())
	if m&os.ModeSetuid != 0 {
		n |= 0o4000
	}
	if m&os.ModeSetgid != 0 {
		n |= 0o2000
	}
	if m&os.ModeSticky != 0 {
		n |= 0o1000
	}
	return fmt.Sprintf("%04o", n)
}

// countWriter counts the bytes written through it.
type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

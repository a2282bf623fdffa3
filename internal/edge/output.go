package edge

import (
	"sync"
	"unicode/utf8"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// capBuffer keeps the first max bytes written to it and counts the rest,
// so a command printing gigabytes (`yes`) costs the edge at most max bytes
// while it keeps draining the pipe.
type capBuffer struct {
	mu        sync.Mutex
	max       int64
	buf       []byte
	total     int64
	truncated bool
}

func (c *capBuffer) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.total += int64(len(p))
	room := c.max - int64(len(c.buf))
	if room <= 0 {
		if len(p) > 0 {
			c.truncated = true
		}
		return len(p), nil
	}
	keep := p
	if int64(len(p)) > room {
		keep = p[:room]
		c.truncated = true
	}
	c.buf = appendCapped(c.buf, keep, c.max)
	return len(p), nil
}

// appendCapped appends b to buf, which never holds more than max bytes
// (len(buf)+len(b) <= limit): it grows as append does, by doubling, but not
// past limit, so a capped stream costs at most limit bytes rather than the
// next power of two.
func appendCapped(buf, b []byte, limit int64) []byte {
	if cap(buf)-len(buf) < len(b) {
		// Not slices.Grow: append's growth rounds up past what was asked.
		n := min(int64(max(2*cap(buf), len(buf)+len(b), 4<<10)), limit)
		grown := make([]byte, len(buf), n)
		copy(grown, buf)
		buf = grown
	}
	return append(buf, b...)
}

func (c *capBuffer) bytes() ([]byte, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.buf, c.truncated
}

// textFields returns output as a result's text (the bytes themselves, not
// a copy: b must not change afterwards) and, when it is not valid UTF-8,
// its exact bytes base64-encoded (api.OutputText).
func textFields(b []byte) (string, string) { return api.OutputText(b) }

// streamWriter turns one output stream into NDJSON events. Chunks that end
// inside a UTF-8 sequence keep the tail for the next write, so text arrives
// as text; bytes that are not UTF-8 at all go out as _b64 events.
type streamWriter struct {
	stderr bool
	sink   *eventSink
	carry  []byte
}

// eventSink serialises events from both streams and enforces the output
// cap of each (remaining[0] stdout, [1] stderr).
type eventSink struct {
	mu        sync.Mutex
	emit      func(api.ExecEvent) error
	remaining [2]int64
	truncated bool
	err       error // first error from emit: the client went away
}

func (w *streamWriter) Write(p []byte) (int, error) {
	n := len(p)
	data := append(w.carry, p...)
	w.carry = nil
	// Hold back an incomplete trailing rune (at most 3 bytes).
	if !utf8.Valid(data) {
		for k := 1; k <= 3 && k <= len(data); k++ {
			if utf8.Valid(data[:len(data)-k]) && !utf8.FullRune(data[len(data)-k:]) {
				w.carry = append([]byte(nil), data[len(data)-k:]...)
				data = data[:len(data)-k]
				break
			}
		}
	}
	w.sink.send(w.stderr, data)
	return n, nil
}

func (w *streamWriter) flush() {
	if len(w.carry) > 0 {
		w.sink.send(w.stderr, w.carry)
		w.carry = nil
	}
}

func (s *eventSink) send(stderr bool, data []byte) {
	if len(data) == 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil {
		return
	}
	i := 0
	if stderr {
		i = 1
	}
	if s.remaining[i] <= 0 {
		s.truncated = true
		return
	}
	if int64(len(data)) > s.remaining[i] {
		data = data[:s.remaining[i]]
		s.truncated = true
	}
	s.remaining[i] -= int64(len(data))
	var ev api.ExecEvent
	text, b64 := textFields(data)
	switch {
	case stderr && b64 != "":
		ev.StderrB64 = b64
	case stderr:
		ev.Stderr = text
	case b64 != "":
		ev.StdoutB64 = b64
	default:
		ev.Stdout = text
	}
	s.err = s.emit(ev)
}

// outputBudget is the node-wide bound on buffered command output. A
// one-shot exec, a session run or a fncall collects its output in memory
// until the command ends (capBuffer), up to max_output_bytes per stream;
// each takes its worst case, 2 × max_output_bytes, from the budget
// before the command starts and gives it back when the result has been
// built. When the budget cannot hold it the call is refused before
// anything runs (resource_exhausted, retryable), so the daemon's memory
// for output stays bounded however many callers ask at once, whatever
// the sandboxes write. Streamed execs buffer nothing and take none.
type outputBudget struct {
	mu    sync.Mutex
	limit int64
	used  int64
}

// DefaultOutputBufferMB is the budget for a host with memTotal bytes of
// memory: an eighth of it, at least 256 MiB and at most 8 GiB.
func DefaultOutputBufferMB(memTotal uint64) int64 {
	return min(max(int64(memTotal>>20)/8, 256), 8<<10)
}

// take reserves n bytes (2 × max_output_bytes for a command); release
// gives them back.
func (b *outputBudget) take(n int64) (release func(), err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.used+n > b.limit {
		return nil, errdefs.Exhausted("the node's output buffers are taken: commands running now may buffer %d MiB of output and this one %d MiB more, past the node's %d MiB (--output-buffer-mb); retry later, stream the output (?stream=true) or ask for a lower max_output_bytes",
			b.used>>20, n>>20, b.limit>>20)
	}
	b.used += n
	var once sync.Once
	return func() {
		once.Do(func() {
			b.mu.Lock()
			b.used -= n
			b.mu.Unlock()
		})
	}, nil
}

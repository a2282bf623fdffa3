package edge

import (
	"encoding/base64"
	"sync"
	"unicode/utf8"

	"github.com/dsecproject/dsec/api"
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
	if int64(len(p)) > room {
		c.buf = append(c.buf, p[:room]...)
		c.truncated = true
		return len(p), nil
	}
	c.buf = append(c.buf, p...)
	return len(p), nil
}

func (c *capBuffer) bytes() ([]byte, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.buf, c.truncated
}

// textFields returns output as a JSON-safe string and, when it is not valid
// UTF-8, the exact bytes base64-encoded.
func textFields(b []byte) (string, string) {
	if utf8.Valid(b) {
		return string(b), ""
	}
	return string([]rune(string(b))), base64.StdEncoding.EncodeToString(b)
}

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

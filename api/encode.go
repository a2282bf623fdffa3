package api

import (
	"bufio"
	"encoding/base64"
	"io"
	"strconv"
	"unicode/utf8"
	"unsafe"
)

// Results that carry a sandbox's output are the one place where what the
// sandbox writes decides how much memory the server spends: encoding/json
// builds a whole response in memory, and a control byte (NUL, ESC) takes
// six bytes there (\u0000), so a 64 MiB result of NULs became ~400 MB of
// buffer, plus the doubling growth of that buffer. WriteExecResult and
// WriteFnCallResult write the same JSON as encoding/json would decode, in
// a constant amount of memory: text is escaped and base64 encoded on the
// way out.
//
// In memory on the server side, Stdout and Stderr hold the output's bytes
// as they were (OutputText), which need not be UTF-8; StdoutB64 and
// StderrB64 hold their exact bytes when they are not. Encoded, each byte
// that is not UTF-8 becomes U+FFFD, as encoding/json does.

// OutputText returns a command's output as the text and base64 fields of
// a result: text is out itself, without a copy (out must not change
// afterwards), and b64 is set only when out is not valid UTF-8.
func OutputText(out []byte) (text, b64 string) {
	if len(out) == 0 {
		return "", ""
	}
	text = unsafe.String(unsafe.SliceData(out), len(out))
	if !utf8.Valid(out) {
		b64 = base64.StdEncoding.EncodeToString(out)
	}
	return text, b64
}

// WriteExecResult writes r as JSON followed by a newline (what
// json.Encoder.Encode writes), with a buffer of constant size.
func WriteExecResult(w io.Writer, r *ExecResult) error {
	e := newStreamEncoder(w)
	e.resultHead(r.ExitCode, r.Stdout, r.Stderr, r.StdoutB64, r.StderrB64, r.TimedOut, r.Truncated, r.DurationMS)
	e.raw("}\n")
	return e.flush()
}

// WriteFnCallResult is WriteExecResult for a FnCallResult. Its files are
// base64 already (ASCII, no escaping) and bounded by MaxFnCallFetchBytes.
func WriteFnCallResult(w io.Writer, r *FnCallResult) error {
	e := newStreamEncoder(w)
	e.resultHead(r.ExitCode, r.Stdout, r.Stderr, r.StdoutB64, r.StderrB64, r.TimedOut, r.Truncated, r.DurationMS)
	if len(r.Files) > 0 {
		e.raw(",\"files\":{")
		first := true
		for name, data := range r.Files {
			if !first {
				e.raw(",")
			}
			first = false
			e.string(name)
			e.raw(":")
			e.string(data)
		}
		e.raw("}")
	}
	if len(r.Missing) > 0 {
		e.raw(",\"missing\":[")
		for i, m := range r.Missing {
			if i > 0 {
				e.raw(",")
			}
			e.string(m)
		}
		e.raw("]")
	}
	e.raw("}\n")
	return e.flush()
}

// streamEncoder writes JSON through a fixed buffer, keeping the first
// write error.
type streamEncoder struct {
	w   *bufio.Writer
	err error
}

func newStreamEncoder(w io.Writer) *streamEncoder {
	return &streamEncoder{w: bufio.NewWriterSize(w, 32<<10)}
}

func (e *streamEncoder) raw(s string) {
	if e.err == nil {
		_, e.err = e.w.WriteString(s)
	}
}

func (e *streamEncoder) int(v int64) { e.raw(strconv.FormatInt(v, 10)) }

func (e *streamEncoder) bool(v bool) { e.raw(strconv.FormatBool(v)) }

func (e *streamEncoder) flush() error {
	if e.err != nil {
		return e.err
	}
	return e.w.Flush()
}

// resultHead opens a result object and writes the fields ExecResult and
// FnCallResult share.
func (e *streamEncoder) resultHead(exitCode int, stdout, stderr, stdoutB64, stderrB64 string, timedOut, truncated bool, durationMS int64) {
	e.raw("{\"exit_code\":")
	e.int(int64(exitCode))
	e.outputFields(stdout, stderr, stdoutB64, stderrB64)
	e.raw(",\"timed_out\":")
	e.bool(timedOut)
	e.raw(",\"truncated\":")
	e.bool(truncated)
	e.raw(",\"duration_ms\":")
	e.int(durationMS)
}

// outputFields writes ,"stdout":…,"stderr":… and the base64 fields that
// are set. A text that is not valid UTF-8 and comes without its base64
// (OutputText's in-memory form always has it; a caller's may not) gets
// one computed on the way out, so the exact bytes are never lost.
func (e *streamEncoder) outputFields(stdout, stderr, stdoutB64, stderrB64 string) {
	e.raw(",\"stdout\":")
	e.string(stdout)
	e.raw(",\"stderr\":")
	e.string(stderr)
	for _, f := range []struct{ name, text, b64 string }{
		{"stdout_b64", stdout, stdoutB64}, {"stderr_b64", stderr, stderrB64},
	} {
		switch {
		case f.b64 != "":
			e.raw(",\"" + f.name + "\":")
			e.string(f.b64)
		case !utf8.ValidString(f.text):
			e.raw(",\"" + f.name + "\":\"")
			e.base64(f.text)
			e.raw("\"")
		}
	}
}

// base64 writes s base64-encoded, in pieces.
func (e *streamEncoder) base64(s string) {
	if e.err != nil {
		return
	}
	enc := base64.NewEncoder(base64.StdEncoding, e.w)
	if _, err := io.WriteString(enc, s); err != nil {
		e.err = err
		return
	}
	e.err = enc.Close()
}

const hexDigits = "0123456789abcdef"

// string writes s as a JSON string: the escapes encoding/json uses (HTML
// characters included), each byte that is not UTF-8 as \ufffd.
func (e *streamEncoder) string(s string) {
	if e.err != nil {
		return
	}
	w := e.w
	w.WriteByte('"')
	start := 0
	for i := 0; i < len(s); {
		if b := s[i]; b < utf8.RuneSelf {
			if b >= 0x20 && b != '"' && b != '\\' && b != '<' && b != '>' && b != '&' {
				i++
				continue
			}
			w.WriteString(s[start:i])
			switch b {
			case '"', '\\':
				w.WriteByte('\\')
				w.WriteByte(b)
			case '\n':
				w.WriteString(`\n`)
			case '\r':
				w.WriteString(`\r`)
			case '\t':
				w.WriteString(`\t`)
			default:
				w.WriteString(`\u00`)
				w.WriteByte(hexDigits[b>>4])
				w.WriteByte(hexDigits[b&0xF])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			w.WriteString(s[start:i])
			w.WriteString(`\ufffd`)
			i++
			start = i
			continue
		}
		// U+2028 and U+2029 end lines in JavaScript; encoding/json escapes
		// them too.
		if r == '\u2028' || r == '\u2029' {
			w.WriteString(s[start:i])
			w.WriteString(`\u202`)
			w.WriteByte(hexDigits[r&0xF])
			i += size
			start = i
			continue
		}
		i += size
	}
	w.WriteString(s[start:])
	w.WriteByte('"') // a write error sticks in w: flush returns it
}

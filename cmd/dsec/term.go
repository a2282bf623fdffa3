package main

// Escaping for terminals. Names, labels, paths, error messages and command
// output that the CLI prints come from sandboxes, or from whoever drives
// them, and a sandbox is hostile: printed raw, an escape sequence can write
// the clipboard (OSC 52), retitle the window, plant a link (OSC 8) or move
// the cursor over earlier lines; a carriage return or backspace can hide
// text; a newline in a name can forge a table row; a bidi override can make
// a line read in another order. So what goes to a terminal is escaped, and
// what goes to a pipe or a file is left exact, for scripts:
//
//   - Fields (table cells, ids, names, labels, paths, error messages, any
//     string in a line of dsec's own): every control character, \n, \r
//     and \t included, DEL, C1 controls, bidi formatting characters, the
//     Unicode line and paragraph separators and invalid UTF-8 are written
//     as Go-style escapes (\n, \x1b, \u202e, \xff), and a backslash as \\,
//     so that the shown text stands for one string only.
//   - Streams (exec, session and fncall output, files get): the same, but
//     \n, \t and the \r of a \r\n pass, and a backslash stays one: the
//     output keeps its lines and reads as it would, only the characters
//     that steer the terminal show as escapes. Colours are escaped too: a
//     command run by exec has no terminal, so only forced ones appear, and
//     --raw prints them.
//   - --json is unchanged except that, on a terminal, DEL, C1 controls and
//     bidi characters inside strings (encoding/json leaves them as they
//     are) are written as \u escapes, which decode to the same strings.
//
// --raw (exec, session run, fncall, files get) prints a stream's bytes as
// they are, even to a terminal.

import (
	"fmt"
	"io"
	"os"
	"reflect"
	"text/tabwriter"
	"unicode/utf8"

	"golang.org/x/sys/unix"
)

// isTerminal reports whether f is a terminal, as isatty(3) decides: it
// answers TCGETS. A character device alone is not enough (/dev/null is
// one). It is a variable only so that tests can force either answer.
var isTerminal = func(f *os.File) bool {
	rc, err := f.SyscallConn() // unlike Fd, leaves the file's mode alone
	if err != nil {
		return false
	}
	tty := false
	rc.Control(func(fd uintptr) {
		_, err := unix.IoctlGetTermios(int(fd), unix.TCGETS)
		tty = err == nil
	})
	return tty
}

// unsafeRune reports whether r can do more on a terminal than show a
// glyph: C0 and C1 controls and DEL, the bidirectional formatting
// characters (U+061C, U+200E, U+200F, U+202A–U+202E, U+2066–U+2069) and
// the line and paragraph separators (U+2028, U+2029).
func unsafeRune(r rune) bool {
	switch {
	case r < 0x20, r >= 0x7f && r < 0xa0:
		return true
	case r == 0x061c, r == 0x200e, r == 0x200f, r >= 0x202a && r <= 0x202e, r >= 0x2066 && r <= 0x2069:
		return true
	case r == 0x2028, r == 0x2029:
		return true
	}
	return false
}

// appendRuneEscape appends the visible form of an unsafe rune.
func appendRuneEscape(dst []byte, r rune) []byte {
	switch r {
	case '\n':
		return append(dst, `\n`...)
	case '\r':
		return append(dst, `\r`...)
	case '\t':
		return append(dst, `\t`...)
	}
	if r < utf8.RuneSelf {
		return fmt.Appendf(dst, `\x%02x`, r)
	}
	return fmt.Appendf(dst, `\u%04x`, r)
}

// appendEscaped appends s escaped as a field, or as a stream if stream is
// set (see the top of this file). A stream's \r is let through only when
// a \n follows it within s: the caller holds back a \r that ends a write.
func appendEscaped(dst, s []byte, stream bool) []byte {
	for i := 0; i < len(s); {
		c := s[i]
		if c >= 0x20 && c < 0x7f && (c != '\\' || stream) {
			dst = append(dst, c)
			i++
			continue
		}
		if c == '\\' {
			dst = append(dst, `\\`...)
			i++
			continue
		}
		r, n := utf8.DecodeRune(s[i:])
		switch {
		case r == utf8.RuneError && n == 1:
			dst = fmt.Appendf(dst, `\x%02x`, c)
		case stream && (r == '\n' || r == '\t' || r == '\r' && i+1 < len(s) && s[i+1] == '\n'):
			dst = append(dst, c)
		case unsafeRune(r):
			dst = appendRuneEscape(dst, r)
		default:
			dst = append(dst, s[i:i+n]...)
		}
		i += n
	}
	return dst
}

// escapeField returns s as it may be shown on a terminal as one field.
func escapeField(s string) string {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c >= 0x7f || c == '\\' {
			return string(appendEscaped(nil, []byte(s), false))
		}
	}
	return s
}

// fieldArgs returns args with every string (of any string type) and error
// escaped as a field, if escape is set. Other values, numbers, are printed
// by dsec's own verbs and cannot carry control characters.
func fieldArgs(escape bool, args []any) []any {
	if !escape {
		return args
	}
	out := make([]any, len(args))
	for i, a := range args {
		switch v := a.(type) {
		case error:
			out[i] = escapeField(v.Error())
		default:
			if rv := reflect.ValueOf(a); rv.Kind() == reflect.String {
				out[i] = escapeField(rv.String())
			} else {
				out[i] = a
			}
		}
	}
	return out
}

// printf formats to f, escaping its string and error arguments as fields
// when f is a terminal; the format itself is dsec's and goes out as it is.
// Use %s or %v for such arguments (%q would quote the escapes again).
func printf(f *os.File, format string, args ...any) {
	fmt.Fprintf(f, format, fieldArgs(isTerminal(f), args)...)
}

// table is an aligned table on stdout whose cells are escaped as fields
// when stdout is a terminal, so that no cell can break its row or column.
type table struct {
	tw     *tabwriter.Writer
	escape bool
}

// newTable returns a table on stdout; call Flush when done.
func newTable() *table {
	return &table{tw: tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0), escape: isTerminal(os.Stdout)}
}

// printf writes part of the table: tabs and newlines come from format
// only, cells from args.
func (t *table) printf(format string, args ...any) {
	fmt.Fprintf(t.tw, format, fieldArgs(t.escape, args)...)
}

// Flush writes out the aligned table.
func (t *table) Flush() error { return t.tw.Flush() }

// streamOut writes a byte stream (a command's output, a file) to f,
// escaped as a stream when f is a terminal and raw is not set, else as it
// is. A write may end inside a UTF-8 character or between \r and \n, so
// up to three bytes are held for the next write; Flush writes them out.
type streamOut struct {
	w      io.Writer
	escape bool
	held   []byte
}

func newStreamOut(f *os.File, raw bool) *streamOut {
	return &streamOut{w: f, escape: !raw && isTerminal(f)}
}

func (s *streamOut) Write(p []byte) (int, error) {
	if !s.escape {
		return s.w.Write(p)
	}
	buf := append(s.held, p...)
	keep := incompleteTail(buf)
	out := appendEscaped(nil, buf[:len(buf)-keep], true)
	s.held = append([]byte(nil), buf[len(buf)-keep:]...)
	if _, err := s.w.Write(out); err != nil {
		return 0, err
	}
	return len(p), nil
}

// Flush writes out what Write held back, escaped as it stands (a lone
// \r, an unfinished character's bytes).
func (s *streamOut) Flush() error {
	if len(s.held) == 0 {
		return nil
	}
	out := appendEscaped(nil, s.held, true)
	s.held = nil
	_, err := s.w.Write(out)
	return err
}

// incompleteTail is how many bytes at the end of b must wait for more
// input to be escaped right: a final \r, or the start of a UTF-8
// character cut short.
func incompleteTail(b []byte) int {
	if len(b) > 0 && b[len(b)-1] == '\r' {
		return 1
	}
	for i := len(b) - 1; i >= 0 && i >= len(b)-utf8.UTFMax+1; i-- {
		if utf8.RuneStart(b[i]) {
			if !utf8.FullRune(b[i:]) {
				return len(b) - i
			}
			return 0
		}
	}
	return 0
}

// copyStream writes b to f as a streamOut does, in one go.
func copyStream(f *os.File, raw bool, b []byte) error {
	s := newStreamOut(f, raw)
	if _, err := s.Write(b); err != nil {
		return err
	}
	return s.Flush()
}

// escapeJSON rewrites encoded JSON for a terminal: the unsafe runes that
// encoding/json leaves as they are (DEL, C1 controls, bidi characters) are
// written as \u escapes. They occur only inside strings, where the escape
// means the same character, so the JSON decodes to the same value.
func escapeJSON(b []byte) []byte {
	var out []byte
	for i := 0; i < len(b); {
		r, n := utf8.DecodeRune(b[i:])
		if r >= 0x7f && unsafeRune(r) {
			if out == nil {
				out = append(make([]byte, 0, len(b)+16), b[:i]...)
			}
			out = fmt.Appendf(out, `\u%04x`, r)
		} else if out != nil {
			out = append(out, b[i:i+n]...)
		}
		i += n
	}
	if out == nil {
		return b
	}
	return out
}

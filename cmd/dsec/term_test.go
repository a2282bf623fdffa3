package main

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"testing"
	"unicode/utf8"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/api"
)

// hostile is what a sandbox names things when it wants to fool whoever
// reads the CLI: an OSC 52 clipboard write, a screen clear, a carriage
// return that hides what came before, a newline and tab that forge a
// table row, a bidi override, a C1 CSI, an OSC 8 link and a backslash.
const hostile = "x\x1b]52;c;cm0gLXJmIH4K\x07\x1b[2J\rspoof\nsb-2\trunning\u202etxt.exe\u009b" +
	"\x1b]8;;http://evil/\x1b\\link\x1b]8;;\x1b\\\\"

// hostileEscaped is hostile as a field on a terminal.
const hostileEscaped = `x\x1b]52;c;cm0gLXJmIH4K\x07\x1b[2J\rspoof\nsb-2\trunning\u202etxt.exe\u009b` +
	`\x1b]8;;http://evil/\x1b\\link\x1b]8;;\x1b\\\\`

// forceTerminal makes every file a terminal for the rest of the test.
func forceTerminal(t *testing.T) {
	t.Helper()
	old := isTerminal
	isTerminal = func(*os.File) bool { return true }
	t.Cleanup(func() { isTerminal = old })
}

// unsafeIn returns the first rune of s a terminal could act on, other
// than a newline, and whether there is one.
func unsafeIn(s string) (string, bool) {
	for i, r := range s {
		if r == utf8.RuneError {
			if _, n := utf8.DecodeRuneInString(s[i:]); n == 1 {
				return fmt.Sprintf("%q at %d", s[i], i), true
			}
		}
		if r != '\n' && unsafeRune(r) {
			return fmt.Sprintf("%U at %d", r, i), true
		}
	}
	return "", false
}

func TestEscapeField(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"sb-e1-a", "sb-e1-a"},
		{"héllo 日本 ✓", "héllo 日本 ✓"},
		{"", ""},
		{hostile, hostileEscaped},
		{"a\r\nb", `a\r\nb`},
		{"del\x7f nul\x00 bell\a bs\b", `del\x7f nul\x00 bell\x07 bs\x08`},
		{"bad\xff\xe2\x80", `bad\xff\xe2\x80`},
		{"\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u2066\u2067\u2068\u2069", `\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u2066\u2067\u2068\u2069`},
		{"line\u2028para\u2029", `line\u2028para\u2029`},
		{"c1\u0080\u0085\u009f nbsp\u00a0", `c1\u0080\u0085\u009f nbsp` + "\u00a0"},
		{`C:\dir`, `C:\\dir`},
	} {
		if got := escapeField(tc.in); got != tc.want {
			t.Errorf("escapeField(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

// TestStreamOut: a stream keeps its lines, tabs and CRLFs; everything else
// that steers a terminal is escaped, also when a write ends inside a
// character or between \r and \n.
func TestStreamOut(t *testing.T) {
	for _, tc := range []struct {
		name   string
		writes []string
		want   string
	}{
		{"plain", []string{"a\tb\nc\\d\n"}, "a\tb\nc\\d\n"},
		{"crlf", []string{"one\r\ntwo\r\n"}, "one\r\ntwo\r\n"},
		{"lone cr", []string{"rm -rf ~\rls     \n"}, `rm -rf ~\rls     ` + "\n"},
		{"crlf split", []string{"a\r", "\nb"}, "a\r\nb"},
		{"cr split", []string{"a\r", "b"}, `a\rb`},
		{"cr at end", []string{"a\r"}, `a\r`},
		{"colours", []string{"\x1b[31mred\x1b[0m\n"}, `\x1b[31mred\x1b[0m` + "\n"},
		{"osc 52", []string{"\x1b]52;c;cm0gLXJmIH4K\x07"}, `\x1b]52;c;cm0gLXJmIH4K\x07`},
		{"bidi split", []string{"x\xe2\x80", "\xae", "y"}, `x\u202ey`},
		{"utf-8 split", []string{"caf\xc3", "\xa9"}, "café"},
		{"cut short", []string{"a\xe2\x80", "b"}, `a\xe2\x80b`},
		{"cut short at end", []string{"a\xf0\x9f\x98"}, `a\xf0\x9f\x98`},
		{"binary", []string{"\x00\x01\xff\xfe"}, `\x00\x01\xff\xfe`},
		{"c1", []string{"\u009b2J"}, `\u009b2J`},
	} {
		var buf bytes.Buffer
		s := &streamOut{w: &buf, escape: true}
		for _, w := range tc.writes {
			if n, err := s.Write([]byte(w)); n != len(w) || err != nil {
				t.Fatalf("%s: Write = %d, %v", tc.name, n, err)
			}
		}
		if err := s.Flush(); err != nil {
			t.Fatal(err)
		}
		if buf.String() != tc.want {
			t.Errorf("%s: got %q, want %q", tc.name, buf.String(), tc.want)
		}
	}
}

// TestEscapeJSON: on a terminal --json carries no rune a terminal acts on,
// and decodes to what the exact bytes decode to.
func TestEscapeJSON(t *testing.T) {
	v := map[string]any{"name": hostile + "\x7f\u0085\u202e", "n": 1, "list": []string{"\u2066a\u2069"}}
	exact, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	esc := escapeJSON(exact)
	if what, bad := unsafeIn(string(esc)); bad {
		t.Errorf("escaped JSON still has %s: %s", what, esc)
	}
	var a, b any
	if err := json.Unmarshal(exact, &a); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(esc, &b); err != nil {
		t.Fatalf("escaped JSON does not parse: %v\n%s", err, esc)
	}
	if fmt.Sprint(a) != fmt.Sprint(b) {
		t.Errorf("escaped JSON decodes to %v, want %v", b, a)
	}
	if plain := []byte(`{"a": "b"}`); !bytes.Equal(escapeJSON(plain), plain) {
		t.Error("JSON without unsafe runes was changed")
	}
}

// hostileAPI is a server whose every name, label, path, message and state
// is v.
func hostileAPI(v string) *http.ServeMux {
	mux := http.NewServeMux()
	sb := api.Sandbox{ID: v, State: v, Error: v, Node: v, Backend: v, Labels: map[string]string{"k": v},
		Spec: api.SandboxSpec{Base: v, Image: v, Workspace: v, Toolkits: []string{v}, Snapshot: v}}
	fail := api.ErrorBody{Error: api.ErrorDetail{Code: "failed_precondition", Message: v}}
	mux.HandleFunc("GET /v1/sandboxes", func(w http.ResponseWriter, r *http.Request) {
		jsonReply(w, 200, api.SandboxList{Sandboxes: []api.Sandbox{sb}})
	})
	mux.HandleFunc("GET /v1/sandboxes/{id}", func(w http.ResponseWriter, r *http.Request) { jsonReply(w, 200, sb) })
	mux.HandleFunc("DELETE /v1/sandboxes/{id}", func(w http.ResponseWriter, r *http.Request) { jsonReply(w, 409, fail) })
	mux.HandleFunc("POST /v1/sandboxes:batch", func(w http.ResponseWriter, r *http.Request) {
		jsonReply(w, 200, api.BatchResult{Sandboxes: []api.Sandbox{sb}, Errors: []api.BatchError{{Index: 1, Error: fail.Error}}})
	})
	mux.HandleFunc("PUT /v1/sandboxes/{id}/network", func(w http.ResponseWriter, r *http.Request) {
		s := sb
		s.Spec.Network = &api.NetworkPolicy{Allow: []string{v}, Deny: []string{v}}
		jsonReply(w, 200, s)
	})
	mux.HandleFunc("GET /v1/sandboxes/{id}/files:list", func(w http.ResponseWriter, r *http.Request) {
		jsonReply(w, 200, api.FileList{Entries: []api.FileEntry{
			{Path: v, Type: "symlink", Mode: v, LinkTarget: v}, {Path: v, Type: "dir", Mode: "0755"}}})
	})
	mux.HandleFunc("GET /v1/sandboxes/{id}/files:stat", func(w http.ResponseWriter, r *http.Request) {
		jsonReply(w, 200, api.FileEntry{Path: v, Type: v, Mode: v, LinkTarget: v})
	})
	mux.HandleFunc("GET /v1/sandboxes/{id}/log", func(w http.ResponseWriter, r *http.Request) {
		page := api.LogPage{Entries: []api.LogEntry{}, NextSeq: 1}
		if r.URL.Query().Get("since_seq") != "1" {
			page.Entries = []api.LogEntry{{Seq: 1, Kind: v, Request: api.LogRequest{Cmd: v},
				Result: api.LogResult{Error: &api.ErrorDetail{Code: v, Message: v}}}}
		}
		jsonReply(w, 200, page)
	})
	mux.HandleFunc("GET /v1/layers", func(w http.ResponseWriter, r *http.Request) {
		jsonReply(w, 200, api.LayerList{Layers: []api.Layer{{Ref: v, Digest: v, Kind: v}}})
	})
	mux.HandleFunc("GET /v1/layers/{ref}", func(w http.ResponseWriter, r *http.Request) {
		jsonReply(w, 200, api.Layer{Ref: v, Digest: v, Kind: v})
	})
	mux.HandleFunc("GET /v1/nodes", func(w http.ResponseWriter, r *http.Request) {
		jsonReply(w, 200, api.NodeList{Nodes: []api.Node{{Name: v, Backends: []string{v}}}})
	})
	proj := api.Project{ID: v, Name: v, Parent: v, Path: v, Children: []string{v}}
	mux.HandleFunc("GET /v1/projects", func(w http.ResponseWriter, r *http.Request) {
		jsonReply(w, 200, api.ProjectList{Projects: []api.Project{proj}})
	})
	mux.HandleFunc("GET /v1/projects/{id}", func(w http.ResponseWriter, r *http.Request) { jsonReply(w, 200, proj) })
	mux.HandleFunc("PATCH /v1/projects/{id}", func(w http.ResponseWriter, r *http.Request) { jsonReply(w, 200, proj) })
	key := api.APIKey{ID: v, Key: v, Name: v, Project: v, Role: v}
	mux.HandleFunc("POST /v1/projects/{id}/keys", func(w http.ResponseWriter, r *http.Request) { jsonReply(w, 201, key) })
	mux.HandleFunc("GET /v1/projects/{id}/keys", func(w http.ResponseWriter, r *http.Request) {
		jsonReply(w, 200, api.KeyList{Keys: []api.APIKey{key}})
	})
	mux.HandleFunc("GET /v1/templates", func(w http.ResponseWriter, r *http.Request) {
		jsonReply(w, 200, api.TemplateList{Templates: []api.Template{{Name: v, Base: v, Workspace: v, Toolkits: []string{v}, User: v, Project: v}}})
	})
	mux.HandleFunc("GET /v1/whoami", func(w http.ResponseWriter, r *http.Request) {
		jsonReply(w, 200, api.WhoAmI{Principal: v, Project: v, Role: v, Permissions: []string{v}})
	})
	mux.HandleFunc("GET /v1/audit", func(w http.ResponseWriter, r *http.Request) {
		jsonReply(w, 200, api.AuditList{Entries: []api.AuditEntry{{Principal: v, Project: v, Action: v, Target: v, Detail: v}}})
	})
	return mux
}

// TestCLIFieldsEscapedOnTerminal: on a terminal, no name, label, path,
// state or message a sandbox chose reaches the screen as control
// characters, and none adds a line (a forged row) to a table or to
// stderr; to a pipe the exact bytes go out.
func TestCLIFieldsEscapedOnTerminal(t *testing.T) {
	benign, evil := hostileAPI("plain"), hostileAPI(hostile)
	for _, args := range [][]string{
		{"sandbox", "list"},
		{"sandbox", "get", "sb-1"},
		{"sandbox", "log", "sb-1"},
		{"sandbox", "network", "sb-1", "--allow", "pypi"},
		{"sandbox", "delete", "sb-1"},
		{"sandbox", "create", "--base", "base/x:1", "--count", "2"},
		{"files", "ls", "sb-1"},
		{"files", "stat", "sb-1", "/x"},
		{"layer", "list"},
		{"layer", "get", "base/x:1"},
		{"template", "list"},
		{"nodes"},
		{"project", "list"},
		{"project", "show", "p"},
		{"project", "update", "p", "--dedicated-nodes=true"},
		{"key", "create", "p", "--role", "member"},
		{"key", "list", "p"},
		{"whoami"},
		{"audit"},
	} {
		name := strings.Join(args, " ")
		// To a pipe, tables are what they always were: the cells' bytes,
		// aligned by tabwriter, for which a tab in a cell ends the cell.
		pipeOut, pipeErr, _ := runCLIStderr(t, evil, args...)
		if exact := strings.Split(hostile, "\t")[0]; name != "sandbox log" && !strings.Contains(pipeOut+pipeErr, exact) {
			t.Errorf("%s to a pipe: the exact bytes did not come through:\n%q", name, pipeOut+pipeErr)
		}

		t.Run(name, func(t *testing.T) {
			forceTerminal(t)
			wantOut, wantErr, _ := runCLIStderr(t, benign, args...)
			out, errOut, err := runCLIStderr(t, evil, args...)
			for _, s := range []struct{ what, got, benign string }{{"stdout", out, wantOut}, {"stderr", errOut, wantErr}} {
				if what, bad := unsafeIn(s.got); bad {
					t.Errorf("%s has %s:\n%s", s.what, what, s.got)
				}
				if g, w := strings.Count(s.got, "\n"), strings.Count(s.benign, "\n"); g != w {
					t.Errorf("%s has %d lines, want %d:\n%s", s.what, g, w, s.got)
				}
			}
			if name != "sandbox log" && !strings.Contains(out+errOut, hostileEscaped) {
				t.Errorf("the escaped form is missing:\n%s%s", out, errOut)
			}
			// main prints a returned error as "dsec: %v".
			if err != nil {
				if what, bad := unsafeIn(errorLine(t, err)); bad {
					t.Errorf("error line has %s: %q", what, errorLine(t, err))
				}
			}
		})
	}
}

// errorLine is what main prints for err on stderr.
func errorLine(t *testing.T, err error) string {
	t.Helper()
	f, ferr := os.CreateTemp(t.TempDir(), "stderr")
	if ferr != nil {
		t.Fatal(ferr)
	}
	defer f.Close()
	printf(f, "dsec: %v\n", err)
	b, _ := os.ReadFile(f.Name())
	return string(b)
}

// TestCLIErrorEscapedOnTerminal: an API error that quotes a sandbox is one
// escaped line on a terminal.
func TestCLIErrorEscapedOnTerminal(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/sandboxes/{id}", func(w http.ResponseWriter, r *http.Request) {
		jsonReply(w, 404, api.ErrorBody{Error: api.ErrorDetail{Code: "not_found", Message: hostile}})
	})
	_, err := runCLI(t, mux, "sandbox", "get", "sb-1")
	if err == nil {
		t.Fatal("no error")
	}
	if got, want := errorLine(t, err), "dsec: not_found: "+hostile+"\n"; got != want {
		t.Errorf("to a pipe: %q, want %q", got, want)
	}
	forceTerminal(t)
	if got, want := errorLine(t, err), "dsec: not_found: "+hostileEscaped+"\n"; got != want {
		t.Errorf("on a terminal: %q, want %q", got, want)
	}
}

// streamBytes is a command's output as a hostile sandbox writes it, and
// streamEscaped how it shows on a terminal.
const (
	streamBytes   = "ok\r\nhidden\rshown\n\x1b]52;c;cm0gLXJmIH4K\x07\u202eexe.txt\xff tab\there \\n\n"
	streamEscaped = "ok\r\n" + `hidden\rshown` + "\n" + `\x1b]52;c;cm0gLXJmIH4K\x07\u202eexe.txt\xff` + " tab\there \\n\n"
)

// outputAPI serves exec, session run, fncall and files get, all with
// streamBytes as stdout (and stderr), the stream split inside a character
// and between \r and \n.
func outputAPI() *http.ServeMux {
	b64 := base64.StdEncoding.EncodeToString([]byte(streamBytes))
	res := api.ExecResult{Stdout: strings.ToValidUTF8(streamBytes, "?"), StdoutB64: b64, Stderr: "?", StderrB64: b64}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/sandboxes/{id}/exec", func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("stream") != "true" {
			jsonReply(w, 200, res)
			return
		}
		cut := strings.Index(streamBytes, "\u202e") + 1 // inside U+202E
		for _, part := range []string{"ok\r", streamBytes[3:cut], streamBytes[cut:]} {
			p := base64.StdEncoding.EncodeToString([]byte(part))
			json.NewEncoder(w).Encode(api.ExecEvent{StdoutB64: p, StderrB64: p})
		}
		code := 0
		json.NewEncoder(w).Encode(api.ExecEvent{ExitCode: &code})
	})
	mux.HandleFunc("POST /v1/sandboxes/{id}/sessions/{sid}/run", func(w http.ResponseWriter, r *http.Request) { jsonReply(w, 200, res) })
	mux.HandleFunc("POST /v1/fncall", func(w http.ResponseWriter, r *http.Request) {
		jsonReply(w, 200, api.FnCallResult{Stdout: res.Stdout, StdoutB64: b64, Stderr: "?", StderrB64: b64})
	})
	mux.HandleFunc("GET /v1/sandboxes/{id}/files", func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, streamBytes) })
	return mux
}

// TestCLIOutputEscapedOnTerminal: a command's output and a printed file
// show on a terminal with their lines but without control characters,
// and go to a pipe, or with --raw, byte for byte.
func TestCLIOutputEscapedOnTerminal(t *testing.T) {
	mux := outputAPI()
	for _, args := range [][]string{
		{"exec", "sb-1", "--", "cat", "x"},
		{"exec", "--stream", "sb-1", "--", "cat", "x"},
		{"session", "run", "sb-1", "s-1", "cat x"},
		{"fncall", "base/x:1", "--", "cat", "x"},
		{"files", "get", "sb-1", "/x"},
	} {
		name := strings.Join(args[:2], " ")
		stderrToo := args[0] != "files"
		check := func(mode, out, errOut, want string) {
			t.Helper()
			if out != want {
				t.Errorf("%s, %s: stdout %q, want %q", name, mode, out, want)
			}
			if stderrToo && errOut != want {
				t.Errorf("%s, %s: stderr %q, want %q", name, mode, errOut, want)
			}
		}
		out, errOut, err := runCLIStderr(t, mux, args...)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		check("pipe", out, errOut, streamBytes)

		t.Run(name, func(t *testing.T) {
			forceTerminal(t)
			out, errOut, err := runCLIStderr(t, mux, args...)
			if err != nil {
				t.Fatal(err)
			}
			check("terminal", out, errOut, streamEscaped)
			raw := append([]string{args[0], "--raw"}, args[1:]...)
			if args[0] == "session" || args[0] == "files" {
				raw = append([]string{args[0], args[1], "--raw"}, args[2:]...)
			}
			out, errOut, err = runCLIStderr(t, mux, raw...)
			if err != nil {
				t.Fatal(err)
			}
			check("terminal --raw", out, errOut, streamBytes)
		})
	}
}

// TestCLIJSONOnTerminal: --json to a pipe is exactly what the encoder
// wrote; on a terminal it decodes to the same value and carries no rune a
// terminal acts on.
func TestCLIJSONOnTerminal(t *testing.T) {
	v := hostile + "\x7f\u0085\u2066"
	mux := hostileAPI(v)
	pipe, err := runCLI(t, mux, "sandbox", "get", "--json", "sb-1")
	if err != nil {
		t.Fatal(err)
	}
	var want bytes.Buffer
	enc := json.NewEncoder(&want)
	enc.SetIndent("", "  ")
	var sb api.Sandbox
	if err := json.Unmarshal([]byte(pipe), &sb); err != nil {
		t.Fatal(err)
	}
	enc.Encode(sb)
	if pipe != want.String() || sb.Error != v {
		t.Errorf("--json to a pipe changed:\n%s\nwant\n%s", pipe, want.String())
	}
	forceTerminal(t)
	term, err := runCLI(t, mux, "sandbox", "get", "--json", "sb-1")
	if err != nil {
		t.Fatal(err)
	}
	if what, bad := unsafeIn(term); bad {
		t.Errorf("--json on a terminal has %s:\n%s", what, term)
	}
	var got api.Sandbox
	if err := json.Unmarshal([]byte(term), &got); err != nil || got.Error != v || got.Labels["k"] != v {
		t.Errorf("--json on a terminal decodes to %+v (%v)", got, err)
	}
}

// openPty returns the two ends of a new pseudo-terminal, the slave end
// with output post-processing off (so \n stays \n).
func openPty(t *testing.T) (master, slave *os.File) {
	t.Helper()
	m, err := os.OpenFile("/dev/ptmx", os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Skipf("no pseudo-terminals here (%v): the real terminal check is not tested", err)
	}
	t.Cleanup(func() { m.Close() })
	if err := unix.IoctlSetPointerInt(int(m.Fd()), unix.TIOCSPTLCK, 0); err != nil {
		t.Fatalf("unlocking the pty: %v", err)
	}
	n, err := unix.IoctlGetUint32(int(m.Fd()), unix.TIOCGPTN)
	if err != nil {
		t.Fatalf("TIOCGPTN: %v", err)
	}
	s, err := os.OpenFile(fmt.Sprintf("/dev/pts/%d", n), os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Skipf("opening the pty's slave end: %v", err)
	}
	t.Cleanup(func() { s.Close() })
	tio, err := unix.IoctlGetTermios(int(s.Fd()), unix.TCGETS)
	if err != nil {
		t.Fatal(err)
	}
	tio.Oflag &^= unix.OPOST
	if err := unix.IoctlSetTermios(int(s.Fd()), unix.TCSETS, tio); err != nil {
		t.Fatal(err)
	}
	return m, s
}

// TestIsTerminalPty: the real check tells a terminal from a pipe, a file
// and /dev/null, and a command printing to a real terminal is escaped.
func TestIsTerminalPty(t *testing.T) {
	master, slave := openPty(t)
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	null, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer null.Close()
	file, err := os.CreateTemp(t.TempDir(), "out")
	if err != nil {
		t.Fatal(err)
	}
	defer file.Close()
	for _, tc := range []struct {
		name string
		f    *os.File
		want bool
	}{{"pty", slave, true}, {"pipe", w, false}, {"/dev/null", null, false}, {"file", file, false}} {
		if got := isTerminal(tc.f); got != tc.want {
			t.Errorf("isTerminal(%s) = %v, want %v", tc.name, got, tc.want)
		}
	}

	got := make(chan []byte, 1)
	go func() {
		var buf bytes.Buffer
		io.Copy(&buf, master) // ends with EIO once the slave end is closed
		got <- buf.Bytes()
	}()
	err = runCLIOn(t, outputAPI(), slave, file, "exec", "sb-1", "--", "cat", "x")
	slave.Close()
	if err != nil {
		t.Fatal(err)
	}
	if out := string(<-got); out != streamEscaped {
		t.Errorf("on a pty: %q, want %q", out, streamEscaped)
	}
	if b, _ := os.ReadFile(file.Name()); string(b) != streamBytes {
		t.Errorf("stderr to a file: %q, want the exact bytes", b)
	}
}

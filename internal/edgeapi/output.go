package edgeapi

import (
	"bufio"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"unicode/utf8"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/heap"
)

// A result that carries a sandbox's output (one-shot exec, session run,
// fncall) crosses the internal API as an output frame rather than as its
// JSON: one JSON line, the result without its output and the output's
// sizes, then the output's raw bytes:
//
//	{"exec":{...},"stdout_bytes":N,"stderr_bytes":M}\n<N bytes><M bytes>
//
// JSON would cost the apiserver up to six bytes per output byte (a NUL is
// \u0000) held whole by the decoder; a frame costs it the output's size.
const outputFrameType = "application/vnd.dsec.output-frame"

// maxFrameOutput bounds each stream of a frame: no cap (max_output_bytes,
// MaxMaxOutputBytes in package sandbox) is larger.
const maxFrameOutput = 64 << 20

// maxFrameHead bounds a frame's JSON line: a fncall's fetched files
// (16 MiB in all, base64) ride in it.
const maxFrameHead = 32 << 20

type frameHead struct {
	Exec        *api.ExecResult   `json:"exec,omitempty"`
	FnCall      *api.FnCallResult `json:"fncall,omitempty"`
	StdoutBytes int64             `json:"stdout_bytes"`
	StderrBytes int64             `json:"stderr_bytes"`
}

// rawOutput returns the exact bytes of an output field pair. In
// api.OutputText's form the text is those bytes (its base64 set only when
// they are not UTF-8); a producer that put replacement text beside the
// base64 gets the base64 decoded.
func rawOutput(text, b64 string) (string, error) {
	if b64 == "" || !utf8.ValidString(text) {
		return text, nil
	}
	b, err := base64.StdEncoding.DecodeString(b64)
	return string(b), err
}

// writeOutputFrame answers with res (*api.ExecResult or
// *api.FnCallResult) as an output frame.
func writeOutputFrame(w http.ResponseWriter, status int, res any) error {
	var head frameHead
	var stdout, stderr string
	var err1, err2 error
	switch r := res.(type) {
	case *api.ExecResult:
		stdout, err1 = rawOutput(r.Stdout, r.StdoutB64)
		stderr, err2 = rawOutput(r.Stderr, r.StderrB64)
		c := *r
		c.Stdout, c.Stderr, c.StdoutB64, c.StderrB64 = "", "", "", ""
		head.Exec = &c
	case *api.FnCallResult:
		stdout, err1 = rawOutput(r.Stdout, r.StdoutB64)
		stderr, err2 = rawOutput(r.Stderr, r.StderrB64)
		c := *r
		c.Stdout, c.Stderr, c.StdoutB64, c.StderrB64 = "", "", "", ""
		head.FnCall = &c
	default:
		return fmt.Errorf("output frame: %T carries no output", res)
	}
	if err1 != nil || err2 != nil {
		return fmt.Errorf("output frame: decoding base64 output: %v %v", err1, err2)
	}
	head.StdoutBytes, head.StderrBytes = int64(len(stdout)), int64(len(stderr))
	w.Header().Set("Content-Type", outputFrameType)
	w.WriteHeader(status)
	if err := json.NewEncoder(w).Encode(head); err != nil {
		return err
	}
	if _, err := io.WriteString(w, stdout); err != nil {
		return err
	}
	_, err := io.WriteString(w, stderr)
	heap.Released(int64(len(stdout) + len(stderr)))
	return err
}

// readOutputFrame reads an output frame into out (*api.ExecResult or
// *api.FnCallResult).
func readOutputFrame(resp *http.Response, out any) error {
	if ct := resp.Header.Get("Content-Type"); ct != outputFrameType {
		return fmt.Errorf("want an output frame, got Content-Type %q", ct)
	}
	br := bufio.NewReaderSize(resp.Body, 64<<10)
	line, err := readLine(br, maxFrameHead)
	if err != nil {
		return fmt.Errorf("reading the frame's head: %w", err)
	}
	var head frameHead
	if err := json.Unmarshal(line, &head); err != nil {
		return fmt.Errorf("decoding the frame's head: %w", err)
	}
	if head.StdoutBytes < 0 || head.StdoutBytes > maxFrameOutput || head.StderrBytes < 0 || head.StderrBytes > maxFrameOutput {
		return fmt.Errorf("frame output sizes %d and %d out of range", head.StdoutBytes, head.StderrBytes)
	}
	stdout := make([]byte, head.StdoutBytes)
	stderr := make([]byte, head.StderrBytes)
	if _, err := io.ReadFull(br, stdout); err != nil {
		return fmt.Errorf("reading the frame's stdout: %w", err)
	}
	if _, err := io.ReadFull(br, stderr); err != nil {
		return fmt.Errorf("reading the frame's stderr: %w", err)
	}
	switch o := out.(type) {
	case *api.ExecResult:
		if head.Exec == nil {
			return fmt.Errorf("the frame holds no exec result")
		}
		*o = *head.Exec
		o.Stdout, o.StdoutB64 = api.OutputText(stdout)
		o.Stderr, o.StderrB64 = api.OutputText(stderr)
	case *api.FnCallResult:
		if head.FnCall == nil {
			return fmt.Errorf("the frame holds no fncall result")
		}
		*o = *head.FnCall
		o.Stdout, o.StdoutB64 = api.OutputText(stdout)
		o.Stderr, o.StderrB64 = api.OutputText(stderr)
	default:
		return fmt.Errorf("output frame: cannot read into %T", out)
	}
	return nil
}

// readLine reads up to and without a newline, refusing lines over max.
func readLine(br *bufio.Reader, max int) ([]byte, error) {
	var line []byte
	for {
		chunk, err := br.ReadSlice('\n')
		if len(line)+len(chunk) > max {
			return nil, fmt.Errorf("line longer than %d bytes", max)
		}
		line = append(line, chunk...)
		switch err {
		case nil:
			return line[:len(line)-1], nil
		case bufio.ErrBufferFull:
			continue
		default:
			return nil, err
		}
	}
}

package api

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"math/rand/v2"
	"reflect"
	"runtime"
	"strings"
	"testing"
	"unicode/utf8"
)

// hostile are outputs a sandbox may write: every kind of byte the encoder
// treats apart.
var hostile = []string{
	"", "plain text\n", "\x00\x01\x1f\x7f", "quote \" backslash \\ slash /",
	"<script>&amp;</script>", "\u2028\u2029", "caf\xc3\xa9", "\xff\xfe bad", "\xe2\x82",
	"\x1b[31mred\x1b[0m\r\t", strings.Repeat("\x00", 1000), "emoji \U0001F600 and \xf0\x9f",
}

func randomOutput(r *rand.Rand) string {
	b := make([]byte, r.IntN(300))
	for i := range b {
		switch r.IntN(4) {
		case 0:
			b[i] = byte(r.IntN(0x20))
		case 1:
			b[i] = byte(0x80 + r.IntN(0x80))
		default:
			b[i] = byte(0x20 + r.IntN(0x60))
		}
	}
	return string(b)
}

// TestWriteExecResultMatchesEncodingJSON: what the stream writer sends
// decodes to what encoding/json's encoding of the same result decodes to,
// for hostile and random outputs, and raw output that is not UTF-8 comes
// with its exact bytes in the _b64 field.
func TestWriteExecResultMatchesEncodingJSON(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	outs := append([]string{}, hostile...)
	for range 300 {
		outs = append(outs, randomOutput(r))
	}
	for i, out := range outs {
		errOut := outs[(i+1)%len(outs)]
		res := &ExecResult{ExitCode: i - 3, TimedOut: i%2 == 0, Truncated: i%3 == 0, DurationMS: int64(i)}
		res.Stdout, res.StdoutB64 = OutputText([]byte(out))
		res.Stderr, res.StderrB64 = OutputText([]byte(errOut))
		var got bytes.Buffer
		if err := WriteExecResult(&got, res); err != nil {
			t.Fatal(err)
		}
		if !json.Valid(got.Bytes()) {
			t.Fatalf("output %q: not valid JSON: %q", out, got.String())
		}
		want, _ := json.Marshal(res)
		var a, b ExecResult
		if err := json.Unmarshal(got.Bytes(), &a); err != nil {
			t.Fatal(err)
		}
		_ = json.Unmarshal(want, &b)
		if a != b {
			t.Fatalf("output %q:\nstream:        %+v\nencoding/json: %+v", out, a, b)
		}
		for _, f := range []struct{ text, b64, raw string }{{a.Stdout, a.StdoutB64, out}, {a.Stderr, a.StderrB64, errOut}} {
			if utf8.ValidString(f.raw) {
				if f.text != f.raw || f.b64 != "" {
					t.Fatalf("valid output %q came back as %q (b64 %q)", f.raw, f.text, f.b64)
				}
				continue
			}
			exact, err := base64.StdEncoding.DecodeString(f.b64)
			if err != nil || string(exact) != f.raw {
				t.Fatalf("output %q: b64 gives %q, %v", f.raw, exact, err)
			}
		}
	}
}

// TestWriteExecResultAddsMissingB64: a result built without OutputText
// (invalid text, no base64) still goes out with its exact bytes.
func TestWriteExecResultAddsMissingB64(t *testing.T) {
	var buf bytes.Buffer
	if err := WriteExecResult(&buf, &ExecResult{Stdout: "a\xffb"}); err != nil {
		t.Fatal(err)
	}
	var got ExecResult
	if err := json.Unmarshal(buf.Bytes(), &got); err != nil {
		t.Fatal(err)
	}
	if got.Stdout != "a\ufffdb" || got.StdoutB64 != base64.StdEncoding.EncodeToString([]byte("a\xffb")) {
		t.Fatalf("got %+v", got)
	}
}

func TestWriteFnCallResultMatchesEncodingJSON(t *testing.T) {
	for _, res := range []*FnCallResult{
		{},
		{ExitCode: 7, Stdout: "\x00out\xff", Stderr: "<err>", TimedOut: true, Truncated: true, DurationMS: 12,
			Files: map[string]string{"a.txt": "aGk=", "dir/\"q\".bin": ""}, Missing: []string{"gone", "\x1bweird"}},
	} {
		res.Stdout, res.StdoutB64 = OutputText([]byte(res.Stdout))
		var got bytes.Buffer
		if err := WriteFnCallResult(&got, res); err != nil {
			t.Fatal(err)
		}
		want, _ := json.Marshal(res)
		var a, b FnCallResult
		if err := json.Unmarshal(got.Bytes(), &a); err != nil {
			t.Fatalf("%v: %q", err, got.String())
		}
		_ = json.Unmarshal(want, &b)
		if !reflect.DeepEqual(a, b) {
			t.Fatalf("stream: %+v\nencoding/json: %+v", a, b)
		}
	}
}

// TestWritersCoverFields: a field added to ExecResult or FnCallResult
// must be written by its stream writer too; a result with every field set
// must decode back whole.
func TestWritersCoverFields(t *testing.T) {
	for _, v := range []any{&ExecResult{}, &FnCallResult{}} {
		rv := reflect.ValueOf(v).Elem()
		for i := range rv.NumField() {
			f := rv.Field(i)
			switch f.Kind() {
			case reflect.Int, reflect.Int64:
				f.SetInt(int64(i + 1))
			case reflect.Bool:
				f.SetBool(true)
			case reflect.String:
				f.SetString("v" + rv.Type().Field(i).Name)
			case reflect.Map:
				f.Set(reflect.ValueOf(map[string]string{"k": "v"}))
			case reflect.Slice:
				f.Set(reflect.ValueOf([]string{"m"}))
			default:
				t.Fatalf("%s.%s: kind %v not covered by this test", rv.Type().Name(), rv.Type().Field(i).Name, f.Kind())
			}
		}
		var buf bytes.Buffer
		var err error
		back := reflect.New(rv.Type())
		switch v := v.(type) {
		case *ExecResult:
			err = WriteExecResult(&buf, v)
		case *FnCallResult:
			err = WriteFnCallResult(&buf, v)
		}
		if err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(buf.Bytes(), back.Interface()); err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(back.Elem().Interface(), rv.Interface()) {
			t.Errorf("%s: a field is not written:\nwrote %+v\ngot   %+v", rv.Type().Name(), rv.Interface(), back.Elem().Interface())
		}
	}
}

// TestWriteExecResultMemory: writing 16 MiB of NULs (96 MiB of JSON)
// allocates a constant amount, not a copy of the escaped result.
func TestWriteExecResultMemory(t *testing.T) {
	out := make([]byte, 16<<20)
	res := &ExecResult{}
	res.Stdout, res.StdoutB64 = OutputText(out)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	n := &countWriter{}
	if err := WriteExecResult(n, res); err != nil {
		t.Fatal(err)
	}
	runtime.ReadMemStats(&after)
	if n.n < 6*int64(len(out)) {
		t.Fatalf("wrote %d bytes, want at least %d", n.n, 6*len(out))
	}
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 1<<20 {
		t.Errorf("writing allocated %d bytes; want under 1 MiB (constant)", alloc)
	}
}

type countWriter struct{ n int64 }

func (c *countWriter) Write(p []byte) (int, error) { c.n += int64(len(p)); return len(p), nil }

package main

import (
	"context"
	"errors"
	"flag"
	"io"
	"net/netip"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/internal/apiserver"
	"github.com/dsecproject/dsec/internal/placement"
)

func TestParseKV(t *testing.T) {
	tests := []struct {
		in, k, v string
		bad      bool
	}{
		{in: "job=grpo-42", k: "job", v: "grpo-42"},
		{in: "expr=a=b", k: "expr", v: "a=b"},
		{in: "empty=", k: "empty", v: ""},
		{in: "novalue", bad: true},
		{in: "=v", bad: true},
	}
	for _, tt := range tests {
		k, v, err := parseKV(tt.in)
		if tt.bad {
			if err == nil {
				t.Errorf("%q: want error", tt.in)
			}
			continue
		}
		if err != nil || k != tt.k || v != tt.v {
			t.Errorf("%q: got %q %q %v", tt.in, k, v, err)
		}
	}
}

func TestKVFlagRepeats(t *testing.T) {
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	m := kvFlag{}
	fs.Var(m, "label", "")
	if err := fs.Parse([]string{"--label", "b=2", "--label=a=1", "--label", "b=3"}); err != nil {
		t.Fatal(err)
	}
	if got := formatKV(m); got != "a=1,b=3" {
		t.Fatalf("got %q", got)
	}
	if err := fs.Parse([]string{"--label", "oops"}); err == nil {
		t.Fatal("want error for a label without '='")
	}
}

func TestParseSeconds(t *testing.T) {
	tests := []struct {
		in   string
		want int64
		bad  bool
	}{
		{in: "600", want: 600},
		{in: "0", want: 0},
		{in: "10m", want: 600},
		{in: "1h30m", want: 5400},
		{in: "1500ms", want: 2},
		{in: "-5", bad: true},
		{in: "-1m", bad: true},
		{in: "soon", bad: true},
	}
	for _, tt := range tests {
		got, err := parseSeconds(tt.in)
		if tt.bad {
			if err == nil {
				t.Errorf("%q: want error, got %d", tt.in, got)
			}
			continue
		}
		if err != nil || got != tt.want {
			t.Errorf("%q: got %d, %v; want %d", tt.in, got, err, tt.want)
		}
	}
}

func TestParseFileMode(t *testing.T) {
	tests := []struct {
		in   string
		want os.FileMode
		bad  bool
	}{
		{in: "0644", want: 0o644},
		{in: "755", want: 0o755},
		{in: "4755", want: 0o755 | os.ModeSetuid},
		{in: "1777", want: 0o777 | os.ModeSticky},
		{in: "0999", bad: true},
		{in: "17777", bad: true},
		{in: "rw", bad: true},
	}
	for _, tt := range tests {
		got, err := parseFileMode(tt.in)
		if tt.bad {
			if err == nil {
				t.Errorf("%q: want error", tt.in)
			}
			continue
		}
		if err != nil || got != tt.want {
			t.Errorf("%q: got %v, %v; want %v", tt.in, got, err, tt.want)
		}
	}
}

func TestCmdFlagsInterspersed(t *testing.T) {
	newFS := func() (*cmdFlags, *string, *bool, kvFlag) {
		fs := newCmdFlags("t", "", "")
		cwd := fs.String("cwd", "", "")
		stream := fs.Bool("stream", false, "")
		env := kvFlag{}
		fs.Var(env, "env", "")
		return fs, cwd, stream, env
	}
	tests := []struct {
		name   string
		args   []string
		pos    []string
		dashed bool
		cwd    string
		stream bool
	}{
		{"flags first", []string{"--cwd", "/r", "sb-1", "--", "ls", "-la"}, []string{"sb-1", "ls", "-la"}, true, "/r", false},
		{"flags after positional", []string{"sb-1", "--stream", "--cwd=/x", "--", "echo", "--cwd", "y"}, []string{"sb-1", "echo", "--cwd", "y"}, true, "/x", true},
		{"no dashes", []string{"sb-1", "ls", "/"}, []string{"sb-1", "ls", "/"}, false, "", false},
		{"stdin dash is positional", []string{"ID", "PATH", "-", "--cwd", "c"}, []string{"ID", "PATH", "-"}, false, "c", false},
		{"bool with value syntax", []string{"--stream=false", "ID"}, []string{"ID"}, false, "", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fs, cwd, stream, _ := newFS()
			pos, dashed, err := fs.parse(tt.args)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(pos, tt.pos) || dashed != tt.dashed || *cwd != tt.cwd || *stream != tt.stream {
				t.Fatalf("pos %q dashed %v cwd %q stream %v", pos, dashed, *cwd, *stream)
			}
		})
	}

	fs, _, _, _ := newFS()
	if _, _, err := fs.parse([]string{"ID", "--nope"}); err == nil || errors.Is(err, errHelpShown) {
		t.Fatalf("unknown flag: got %v", err)
	}
	fs, _, _, env := newFS()
	if _, _, err := fs.parse([]string{"--env", "A=1", "ID", "--env", "B=x=y"}); err != nil || formatKV(env) != "A=1,B=x=y" {
		t.Fatalf("env %v, %v", env, err)
	}
	fs, _, _, _ = newFS()
	devnull, _ := os.Open(os.DevNull)
	defer devnull.Close()
	stdout := os.Stdout
	os.Stdout = devnull // -h prints help
	_, _, err := fs.parse([]string{"ID", "-h"})
	os.Stdout = stdout
	if !errors.Is(err, errHelpShown) {
		t.Fatalf("-h: got %v", err)
	}
}

func TestParseN(t *testing.T) {
	fs := newCmdFlags("files put", "ID PATH [FILE|-]", "")
	if _, err := fs.parseN([]string{"a"}, 2, 3); err == nil {
		t.Error("too few: want error")
	}
	if _, err := fs.parseN([]string{"a", "b", "c", "d"}, 2, 3); err == nil {
		t.Error("too many: want error")
	}
	if pos, err := fs.parseN([]string{"a", "b"}, 2, 3); err != nil || len(pos) != 2 {
		t.Errorf("got %v, %v", pos, err)
	}
}

func TestCommandStatus(t *testing.T) {
	code := func(err error) int {
		var ec *exitCodeError
		if errors.As(err, &ec) {
			return ec.ExitCode()
		}
		if err != nil {
			return -1
		}
		return 0
	}
	devnull, _ := os.Open(os.DevNull)
	defer devnull.Close()
	stderr := os.Stderr
	os.Stderr = devnull // notices
	defer func() { os.Stderr = stderr }()
	tests := []struct {
		exit     int
		timedOut bool
		want     int
	}{
		{0, false, 0},
		{3, false, 3},
		{137, true, exitTimedOut},
		{0, true, exitTimedOut},
		{-1, false, 255},
		{256, false, 255},
	}
	for _, tt := range tests {
		if got := code(commandStatus(tt.exit, tt.timedOut, false)); got != tt.want {
			t.Errorf("exit %d timedOut %v: got %d, want %d", tt.exit, tt.timedOut, got, tt.want)
		}
	}
}

func TestHumanFormats(t *testing.T) {
	for n, want := range map[int64]string{0: "0 B", 1023: "1023 B", 1536: "1.5 KiB", 5 << 30: "5.0 GiB"} {
		if got := humanBytes(n); got != want {
			t.Errorf("humanBytes(%d) = %q, want %q", n, got, want)
		}
	}
	now := time.Now()
	for d, want := range map[time.Duration]string{30 * time.Second: "30s", 45 * time.Minute: "45m", 5 * time.Hour: "5h", 72 * time.Hour: "3d"} {
		if got := humanAge(now.Add(-d), now); got != want {
			t.Errorf("humanAge(%v) = %q, want %q", d, got, want)
		}
	}
	if got := shortDigest("sha256:0123456789abcdef0123"); got != "sha256:0123456789ab" {
		t.Errorf("shortDigest = %q", got)
	}
}

// TestPlacementFlags: --placement-k takes a count from 1 or all (least
// loaded), --placement-overlay=false turns the overlay off; anything else
// is refused with the flag named.
func TestPlacementFlags(t *testing.T) {
	base := []string{"--etcd", "http://127.0.0.1:2379", "--cluster", "/c", "--layers", "/l"}
	for _, tc := range []struct {
		args      []string
		k         int
		noOverlay bool
	}{
		{nil, placement.DefaultK, false},
		{[]string{"--placement-k", "1"}, 1, false},
		{[]string{"--placement-k", "all", "--placement-overlay=false"}, placement.AllNodes, true},
	} {
		_, pc, err := parseServer(append(append([]string{}, base...), tc.args...))
		if err != nil || pc.K != tc.k || pc.NoOverlay != tc.noOverlay {
			t.Errorf("%q: K %d no-overlay %v (%v), want %d %v", tc.args, pc.K, pc.NoOverlay, err, tc.k, tc.noOverlay)
		}
	}
	for _, bad := range []string{"0", "-2", "some", ""} {
		if _, _, err := parseServer(append(append([]string{}, base...), "--placement-k", bad)); err == nil || !strings.Contains(err.Error(), "--placement-k") {
			t.Errorf("--placement-k %q: %v, want an error naming the flag", bad, err)
		}
	}
}

func TestIdempotencyTTLFlag(t *testing.T) {
	base := []string{"--etcd", "http://127.0.0.1:2379", "--cluster", "/c", "--layers", "/l"}
	c, _, err := parseServer(base)
	if err != nil || c.idemTTL != apiserver.DefaultIdempotencyTTL {
		t.Fatalf("default: %v (%v), want %v", c.idemTTL, err, apiserver.DefaultIdempotencyTTL)
	}
	c, _, err = parseServer(append(append([]string{}, base...), "--idempotency-ttl", "2h"))
	if err != nil || c.idemTTL != 2*time.Hour {
		t.Fatalf("2h: %v (%v)", c.idemTTL, err)
	}
	for _, bad := range []string{"30s", "721h", "-1h", "0"} {
		if _, _, err := parseServer(append(append([]string{}, base...), "--idempotency-ttl", bad)); err == nil || !strings.Contains(err.Error(), "--idempotency-ttl") {
			t.Errorf("--idempotency-ttl %s: %v, want an error naming the flag", bad, err)
		}
	}
}

// TestSandboxDenyFlag: --sandbox-deny takes IPv4 addresses and prefixes,
// and refuses anything else before a node starts.
func TestSandboxDenyFlag(t *testing.T) {
	base := []string{"--listen", "10.0.0.5:7071", "--etcd", "http://127.0.0.1:2379", "--cluster", "/c", "--layers", "/l",
		"--node-name", "n1", "--state-dir", "/s"}
	c, err := parseEdge(append(append([]string{}, base...), "--sandbox-deny", " 10.0.0.11, 192.168.7.0/24 ,"))
	if err != nil {
		t.Fatal(err)
	}
	want := []netip.Prefix{netip.MustParsePrefix("10.0.0.11/32"), netip.MustParsePrefix("192.168.7.0/24")}
	if !slices.Equal(c.node.deny, want) {
		t.Fatalf("deny %v, want %v", c.node.deny, want)
	}
	if err := c.node.check(); err != nil || !slices.Equal(c.node.deny, want) {
		t.Fatalf("a second check: %v, %v", err, c.node.deny)
	}
	for _, bad := range []string{"10.0.0.11/24", "fd00::1", "etcd.internal", "10.0.0.0/33"} {
		if _, err := parseEdge(append(append([]string{}, base...), "--sandbox-deny", bad)); err == nil || !strings.Contains(err.Error(), "--sandbox-deny") {
			t.Errorf("--sandbox-deny %s: %v", bad, err)
		}
	}
}

// TestEtcdAddrs: the edge keeps sandboxes from its etcd endpoints, named
// by address or host name, as URLs or host:port (as the etcd client takes
// them); what has no address is told, not fatal.
func TestEtcdAddrs(t *testing.T) {
	got, unresolved := etcdAddrs(context.Background(), "http://10.0.0.12:2379, https://10.0.0.11:2379,10.0.0.13:2379,http://10.0.0.11:2380,unix:///run/etcd.sock,[::1]:2379")
	want := []netip.Prefix{netip.MustParsePrefix("10.0.0.11/32"), netip.MustParsePrefix("10.0.0.12/32"), netip.MustParsePrefix("10.0.0.13/32")}
	if !slices.Equal(got, want) || len(unresolved) != 0 {
		t.Fatalf("etcdAddrs = %v, %v; want %v", got, unresolved, want)
	}
	for _, bad := range []string{"http://", "just-a-name"} {
		if got, unresolved := etcdAddrs(context.Background(), bad); len(got) != 0 || len(unresolved) != 1 {
			t.Errorf("etcdAddrs(%q) = %v, %v", bad, got, unresolved)
		}
	}
}

// TestEtcdTLSFlags: etcd is reached over TLS when every endpoint is
// https://; TLS files given for plain endpoints, and a mix of schemes, are
// refused at start rather than sending the cluster's keys in clear.
func TestEtcdTLSFlags(t *testing.T) {
	base := []string{"--cluster", "/c", "--layers", "/l"}
	for _, tc := range []struct {
		args []string
		err  string
	}{
		{[]string{"--etcd", "http://10.0.0.1:2379,10.0.0.2:2379"}, ""},
		{[]string{"--etcd", "https://10.0.0.1:2379,HTTPS://10.0.0.2:2379"}, ""},
		{[]string{"--etcd", "https://10.0.0.1:2379", "--etcd-ca", "/ca.pem", "--etcd-cert", "/c.pem", "--etcd-key", "/k.pem"}, ""},
		{[]string{"--etcd", "https://10.0.0.1:2379,http://10.0.0.2:2379"}, "mixes https:// and other endpoints (http://10.0.0.2:2379)"},
		{[]string{"--etcd", "https://10.0.0.1:2379,10.0.0.2:2379"}, "mixes https://"},
		{[]string{"--etcd", "http://10.0.0.1:2379", "--etcd-ca", "/ca.pem"}, "are for https:// endpoints"},
		{[]string{"--etcd", "10.0.0.1:2379", "--etcd-cert", "/c.pem", "--etcd-key", "/k.pem"}, "are for https:// endpoints"},
	} {
		_, _, err := parseServer(append(append([]string{}, base...), tc.args...))
		switch {
		case tc.err == "" && err != nil:
			t.Errorf("%v: %v", tc.args, err)
		case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
			t.Errorf("%v: %v, want %q", tc.args, err, tc.err)
		}
	}
}

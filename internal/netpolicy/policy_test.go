package netpolicy

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/internal/errdefs"
)

func TestCompile(t *testing.T) {
	presets := map[string]Preset{
		"pypi": {Domains: []string{"pypi.org", "files.pythonhosted.org"}, Ports: []string{"443/tcp", "80"}},
		"any":  {Domains: []string{"*.example.com"}},
	}
	pfx := netip.MustParsePrefix
	tests := []struct {
		in      string
		entries []Entry
		names   []NameRule
		err     bool
	}{
		{in: "10.1.2.0/24:443/tcp", entries: []Entry{{pfx("10.1.2.0/24"), Ports{ProtoTCP, 443, 443}}}},
		{in: "10.1.2.3", entries: []Entry{{pfx("10.1.2.3/32"), AllPorts}}},
		{in: "10.1.2.3:53", entries: []Entry{{pfx("10.1.2.3/32"), Ports{ProtoTCP, 53, 53}}, {pfx("10.1.2.3/32"), Ports{ProtoUDP, 53, 53}}}},
		{in: "10.0.0.0/8/udp", entries: []Entry{{pfx("10.0.0.0/8"), Ports{ProtoUDP, 0, 65535}}}},
		{in: "0.0.0.0/0:8000-8100/tcp", entries: []Entry{{pfx("0.0.0.0/0"), Ports{ProtoTCP, 8000, 8100}}}},
		{in: "1.2.3.4/icmp", entries: []Entry{{pfx("1.2.3.4/32"), Ports{ProtoICMP, 0, 65535}}}},
		{in: "Example.COM.", names: []NameRule{{"example.com", AllPorts}}},
		{in: "*.example.com:443/tcp", names: []NameRule{{"*.example.com", Ports{ProtoTCP, 443, 443}}}},
		{in: "123.example.com", names: []NameRule{{"123.example.com", AllPorts}}},
		{in: "1PASSWORD.COM:443/tcp", names: []NameRule{{"1password.com", Ports{ProtoTCP, 443, 443}}}},
		{in: "*", names: []NameRule{{"*", AllPorts}}},
		{in: "*:443/tcp", names: []NameRule{{"*", Ports{ProtoTCP, 443, 443}}}},
		{in: "pypi", names: []NameRule{
			{"pypi.org", Ports{ProtoTCP, 443, 443}}, {"pypi.org", Ports{ProtoTCP, 80, 80}},
			{"files.pythonhosted.org", Ports{ProtoTCP, 443, 443}}, {"files.pythonhosted.org", Ports{ProtoTCP, 80, 80}},
		}},
		{in: "nosuchpreset", err: true},
		{in: "", err: true},
		{in: "10.1.2.3/24", err: true}, // host bits
		{in: "10.1.2.300", err: true},
		{in: "::1", err: true},
		{in: "[::1]:80", err: true},
		{in: "10.1.2.3:0", err: true},
		{in: "10.1.2.3:70000", err: true},
		{in: "10.1.2.3:90-80", err: true},
		{in: "1.2.3.4:80/icmp", err: true},
		{in: "exa_mple.com", err: true},
		{in: "a.*.com", err: true},
		{in: "*.*", err: true},
		{in: "**", err: true},
		{in: "-bad.com", err: true},
		{in: "10.1.2.3/sctp", err: true},
		{in: strings.Repeat("a", 300) + ".com", err: true},
	}
	for _, tc := range tests {
		p, err := Compile([]string{tc.in}, nil, presets)
		if tc.err {
			if err == nil || !errors.Is(err, errdefs.ErrInvalid) {
				t.Errorf("%q: got %v, want an invalid-argument error", tc.in, err)
			}
			continue
		}
		if err != nil {
			t.Errorf("%q: %v", tc.in, err)
			continue
		}
		if !equal(p.Allow, tc.entries) || !equal(p.Names, tc.names) {
			t.Errorf("%q: got %+v %+v, want %+v %+v", tc.in, p.Allow, p.Names, tc.entries, tc.names)
		}
	}
	if _, err := Compile(make([]string, MaxRules+1), nil, presets); err == nil {
		t.Error("too many rules accepted")
	}
}

func equal[T comparable](a, b []T) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestMatch(t *testing.T) {
	p, err := Compile([]string{"pypi.org:443/tcp", "*.example.com", "pypi.org:80/tcp"}, []string{"evil.example.com"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]int{
		"pypi.org": 2, "PYPI.org.": 2, "x.pypi.org": 0, "example.com": 0, "a.example.com": 1,
		"a.b.example.com": 1, "evil.example.com": 0, "notexample.com": 0, "pypi.org.evil.net": 0,
	} {
		ports, ok := p.Match(name)
		if len(ports) != want || ok != (want > 0) {
			t.Errorf("Match(%q) = %v %v, want %d port sets", name, ports, ok, want)
		}
	}
}

// TestMatchAnyName: "*" permits every name, a deny entry still wins, and
// no wildcard limit shortens what it permits.
func TestMatchAnyName(t *testing.T) {
	p, err := Compile([]string{"*", "*.example.com"}, []string{"evil.example.com"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	long := strings.Repeat("a", 63) + ".example.com"
	for name, want := range map[string]bool{"pypi.org": true, "a.b.c.d.net.": true, long: true, "evil.example.com": false} {
		if _, ok := p.Match(name); ok != want {
			t.Errorf("Match(%q) = %v, want %v", name, ok, want)
		}
	}
	if part, wild := p.wildcardPart(long); wild {
		t.Errorf("wildcardPart(%q) = %q: the wildcard limit applies under \"*\"", long, part)
	}
	if p, err := Compile(nil, []string{"*"}, nil); err != nil || len(p.DenyNames) != 1 || !p.denies("pypi.org") {
		t.Errorf("deny \"*\": %+v, %v", p, err)
	}
}

func TestLayout(t *testing.T) {
	l := layout{instance: "ab12f", pool: netip.MustParsePrefix("10.200.0.0/16")}
	if got := l.dnsAddr().String(); got != "10.200.0.1" {
		t.Errorf("dns %s", got)
	}
	h, s := l.slotAddrs(1)
	if h.String() != "10.200.0.5" || s.String() != "10.200.0.6" {
		t.Errorf("slot 1: %s %s", h, s)
	}
	h, s = l.slotAddrs(l.slots())
	if h.String() != "10.200.255.253" || s.String() != "10.200.255.254" {
		t.Errorf("last slot: %s %s", h, s)
	}
	if n := len(l.hostIf(l.slots())); n > 15 {
		t.Errorf("interface name %q is %d bytes", l.hostIf(l.slots()), n)
	}
	for e, want := range map[string]bool{
		"10.200.3.0/24": true, "169.254.169.254/32": true, "0.0.0.0/0": false, "10.0.0.0/8": false, "8.8.8.8/32": false,
	} {
		if got := l.isProtected(Entry{Prefix: netip.MustParsePrefix(e)}); got != want {
			t.Errorf("isProtected(%s) = %v", e, got)
		}
	}
}

// TestDenyIsFinal: an allow entry inside a denied range is refused with a
// clear error; one that merely overlaps is kept (the denied part is cut
// out by the rules, before the sandbox's own sets); the scripts carry the
// denied set and test it first.
func TestDenyIsFinal(t *testing.T) {
	// Ranges inside others (etcd's address in the operator's range) and
	// repeats are dropped: an nft interval set refuses overlaps.
	m, err := New(Config{Instance: "abcde", Pool: DefaultPool, Deny: []netip.Prefix{
		netip.MustParsePrefix("192.168.7.5/32"), netip.MustParsePrefix("10.0.0.11/32"), netip.MustParsePrefix("192.168.7.0/24"),
		netip.MustParsePrefix("10.0.0.11/32"), netip.MustParsePrefix("192.168.7.0/25")}})
	if err != nil {
		t.Fatal(err)
	}
	if got := fmt.Sprint(m.l.deny); got != "[10.0.0.11/32 192.168.7.0/24]" {
		t.Fatalf("denied ranges %s", got)
	}
	for _, allow := range []string{"10.0.0.11", "10.0.0.11:2379/tcp", "192.168.7.0/25", "192.168.7.9:80/tcp"} {
		_, err := m.Compile([]string{"8.8.8.8", allow}, nil)
		if !errors.Is(err, errdefs.ErrInvalid) || !strings.Contains(err.Error(), "closed to sandboxes") {
			t.Errorf("allow %s: %v, want it refused", allow, err)
		}
	}
	for _, allow := range []string{"10.0.0.0/8", "0.0.0.0/0", "192.168.0.0/16:443/tcp", "10.0.0.12"} {
		if _, err := m.Compile([]string{allow}, nil); err != nil {
			t.Errorf("allow %s: %v", allow, err)
		}
	}
	// A policy accepted before its range was denied keeps its other
	// entries after a restart (the rules refuse the denied part).
	if p, err := m.Recompile([]string{"8.8.8.8", "10.0.0.11:2379/tcp"}, nil); err != nil || len(p.Allow) != 2 {
		t.Errorf("Recompile: %+v, %v", p, err)
	}
	base, slot := m.l.baseScript(), m.l.slotScript(3, &Policy{}, nil, time.Now())
	if !strings.Contains(base, "add element inet dsec_abcde denied { 10.0.0.11/32, 192.168.7.0/24 }") {
		t.Errorf("base script without the denied set:\n%s", base)
	}
	e := strings.Index(slot, "e_3 ip daddr @denied goto refuse")
	if e < 0 || e > strings.Index(slot, "@d_3 goto refuse") || e > strings.Index(slot, "@p_3 accept") {
		t.Errorf("slot script does not refuse denied addresses first:\n%s", slot)
	}
	if i := strings.Index(slot, "i_3 ip saddr @denied ct state != related drop"); i < 0 || i > strings.Index(slot, "i_3 ct state established") {
		t.Errorf("slot script lets replies from denied addresses in:\n%s", slot)
	}
	// A DNS-admitted address inside a denied range is never written.
	dyn := []dynEntry{{netip.MustParseAddr("192.168.7.5"), AllPorts, time.Now().Add(time.Minute)}}
	if s := m.l.slotScript(3, &Policy{}, dyn, time.Now()); strings.Contains(s, "192.168.7.5") {
		t.Errorf("a denied address was admitted:\n%s", s)
	}
}

func TestCheckPool(t *testing.T) {
	for s, ok := range map[string]bool{
		"10.200.0.0/16": true, "192.168.64.0/20": true, "100.64.0.0/12": true,
		"8.8.0.0/16": false, "10.0.0.0/8": false, "10.1.1.0/30": false,
	} {
		if err := CheckPool(netip.MustParsePrefix(s)); (err == nil) != ok {
			t.Errorf("CheckPool(%s) = %v", s, err)
		}
	}
}

// TestScriptsParse has nft check (without applying) every script shape.
func TestScriptsParse(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: nft -c talks to the kernel")
	}
	if _, err := exec.LookPath("nft"); err != nil {
		t.Skip("needs nft (apt-get install nftables)")
	}
	denied := layout{instance: "fffff", pool: netip.MustParsePrefix("10.239.0.0/16"),
		deny: []netip.Prefix{netip.MustParsePrefix("10.0.0.11/32"), netip.MustParsePrefix("10.1.3.0/24")}}
	// What New makes of overlapping ranges, as the examples have them.
	m, err := New(Config{Instance: "fffff", Pool: netip.MustParsePrefix("10.239.0.0/16"), Deny: []netip.Prefix{
		netip.MustParsePrefix("10.0.0.0/24"), netip.MustParsePrefix("10.0.0.11/32"), netip.MustParsePrefix("10.0.0.0/24")}})
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range []layout{{instance: "fffff", pool: netip.MustParsePrefix("10.239.0.0/16")}, denied, m.l} {
		checkScripts(t, l)
	}
}

func checkScripts(t *testing.T, l layout) {
	t.Helper()
	p, err := Compile([]string{"10.1.2.0/24:443/tcp", "8.8.8.8", "169.254.169.254:80/tcp", "1.1.1.1/icmp", "x.example.com"},
		[]string{"10.1.2.7"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	dyn := []dynEntry{{netip.MustParseAddr("93.184.216.34"), AllPorts, now.Add(time.Minute)}}
	script := l.baseScript() + l.slotScript(7, p, dyn, now) + l.dynScript(7, dyn, now) +
		refreshScript(l.dynScript(7, dyn, now)) + l.removeScript(7) + "delete table inet " + l.table() + "\n"
	cmd := exec.Command("nft", "-c", "-f", "-")
	cmd.Stdin = strings.NewReader(script)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("nft -c: %v\n%s\nscript:\n%s", err, out, script)
	}
}

package netpolicy

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// formatPorts writes ports in the allow-list language, as a suffix.
func formatPorts(p Ports) string {
	var s string
	if p.Lo != 0 || p.Hi != 65535 {
		s = ":" + strconv.Itoa(int(p.Lo))
		if p.Hi != p.Lo {
			s += "-" + strconv.Itoa(int(p.Hi))
		}
	}
	switch p.Proto {
	case ProtoTCP:
		s += "/tcp"
	case ProtoUDP:
		s += "/udp"
	case ProtoICMP:
		s += "/icmp"
	}
	return s
}

// parseElement reads back what element renders for nft: the address (or
// prefix), protocol and port range.
func parseElement(s string) (netip.Prefix, Ports, error) {
	parts := strings.Split(s, " . ")
	if len(parts) != 3 {
		return netip.Prefix{}, Ports{}, fmt.Errorf("element %q has %d parts", s, len(parts))
	}
	var pfx netip.Prefix
	var err error
	if strings.Contains(parts[0], "/") {
		pfx, err = netip.ParsePrefix(parts[0])
	} else {
		var a netip.Addr
		a, err = netip.ParseAddr(parts[0])
		pfx = netip.PrefixFrom(a, 32)
	}
	if err != nil {
		return netip.Prefix{}, Ports{}, err
	}
	var p Ports
	if parts[1] != "0-255" {
		n, err := strconv.ParseUint(parts[1], 10, 8)
		if err != nil {
			return netip.Prefix{}, Ports{}, err
		}
		p.Proto = uint8(n)
	}
	los, his, ok := strings.Cut(parts[2], "-")
	if !ok {
		his = los
	}
	lo, err1 := strconv.ParseUint(los, 10, 16)
	hi, err2 := strconv.ParseUint(his, 10, 16)
	if err := errors.Join(err1, err2); err != nil {
		return netip.Prefix{}, Ports{}, err
	}
	p.Lo, p.Hi = uint16(lo), uint16(hi)
	return pfx, p, nil
}

func lines(s string) []string {
	if s == "" {
		return nil
	}
	return strings.Split(s, "\n")
}

// FuzzCompile compiles fuzzed allow and deny lists (one entry a line)
// against the default presets. Nothing may panic and refusals are Invalid.
// What compiles is well formed (masked IPv4 prefixes, ordered port ranges,
// no ports on icmp, valid lower-case patterns), round-trips through the
// list language (a name in any letter case), and is what reaches nft: the
// rendered set element is exactly the rule, so it matches an address iff
// the rule's prefix holds it. Policy.Match agrees with the rules.
func FuzzCompile(f *testing.F) {
	f.Add("pypi\n10.1.2.0/24:443/tcp", "evil.example.com", "files.pythonhosted.org", uint32(0x0a010203))
	f.Add("*.example.com:8000-8100\n1.2.3.4/udp", "bad.example.com\n1.2.3.4:53", "a.b.example.com.", uint32(0x01020304))
	f.Add("github\n0.0.0.0/0", "10.0.0.0/8\n*.githubusercontent.com", "RAW.githubusercontent.com", uint32(0x0a000001))
	f.Add("10.1.2.3/24\n::1\n1.2.3.4:0\n1.2.3.4:9-8\nexample\n-a.com", "", "example", uint32(0))
	f.Add("8.8.8.8/icmp\n8.8.8.8:1/icmp\n8.8.8.8/32", "", "", uint32(0x08080808))
	f.Add("1password.com:443\nEXAMPLE.ORG./tcp\n*.*.com", "1PASSWORD.COM", "1password.com", uint32(0xffffffff))
	f.Add("debian\nnpm\ngoproxy\nnone", "pypi", "deb.debian.org", uint32(0xc0a80001))
	f.Add("*\n0.0.0.0/0\n*:443/tcp", "*.example.com\n*", "a.example.com", uint32(0x08080808))
	presets := DefaultPresets()
	f.Fuzz(func(t *testing.T, allow, deny, name string, addr uint32) {
		p, err := Compile(lines(allow), lines(deny), presets)
		if err != nil {
			if !errors.Is(err, errdefs.ErrInvalid) {
				t.Fatalf("Compile error %q is not Invalid", err)
			}
			return
		}
		a := netip.AddrFrom4([4]byte{byte(addr >> 24), byte(addr >> 16), byte(addr >> 8), byte(addr)})
		for _, e := range slices.Concat(p.Allow, p.Deny) {
			checkEntry(t, e, presets, a)
		}
		for _, r := range p.Names {
			checkNameRule(t, r, presets)
		}
		for _, d := range p.DenyNames {
			if got, err := normalizePattern(d); err != nil || got != d {
				t.Fatalf("deny name %q is not a normalized pattern (%q, %v)", d, got, err)
			}
		}
		checkMatch(t, p, name)
	})
}

func checkEntry(t *testing.T, e Entry, presets map[string]Preset, a netip.Addr) {
	t.Helper()
	switch {
	case !e.Prefix.IsValid() || !e.Prefix.Addr().Is4() || e.Prefix.Masked() != e.Prefix:
		t.Fatalf("compiled prefix %v is not a masked IPv4 prefix", e.Prefix)
	case e.Lo > e.Hi || e.Lo == 0 && e.Hi != 65535:
		t.Fatalf("compiled port range %d-%d", e.Lo, e.Hi)
	case e.Proto != ProtoAny && e.Proto != ProtoTCP && e.Proto != ProtoUDP && e.Proto != ProtoICMP:
		t.Fatalf("compiled protocol %d", e.Proto)
	case (e.Proto == ProtoAny || e.Proto == ProtoICMP) && e.Ports != (Ports{e.Proto, 0, 65535}):
		t.Fatalf("compiled %+v: ports without tcp or udp", e)
	}
	s := e.Prefix.String() + formatPorts(e.Ports)
	q, err := Compile([]string{s}, nil, presets)
	if err != nil || len(q.Allow) != 1 || q.Allow[0] != e || len(q.Names) != 0 {
		t.Fatalf("entry %+v written as %q compiles to %+v, %v", e, s, q, err)
	}
	el := element(e.Prefix, e.Ports, 0)
	pfx, ports, err := parseElement(el)
	if err != nil || pfx != e.Prefix || ports.Lo != e.Lo || ports.Hi != e.Hi || ports.Proto != e.Proto {
		t.Fatalf("entry %+v renders as nft element %q (%v %+v, %v)", e, el, pfx, ports, err)
	}
	if pfx.Contains(a) != e.Prefix.Contains(a) {
		t.Fatalf("nft element %q and rule %v disagree on %v", el, e.Prefix, a)
	}
}

func checkNameRule(t *testing.T, r NameRule, presets map[string]Preset) {
	t.Helper()
	if got, err := normalizePattern(r.Pattern); err != nil || got != r.Pattern {
		t.Fatalf("name rule %q is not a normalized pattern (%q, %v)", r.Pattern, got, err)
	}
	if r.Lo > r.Hi || r.Lo == 0 && r.Hi != 65535 || r.Proto == ProtoAny && r.Ports != AllPorts {
		t.Fatalf("name rule %+v has bad ports", r)
	}
	for _, pat := range []string{r.Pattern, strings.ToUpper(r.Pattern)} {
		s := pat + formatPorts(r.Ports)
		q, err := Compile([]string{s}, nil, presets)
		if err != nil || len(q.Names) != 1 || q.Names[0] != r || len(q.Allow) != 0 {
			t.Fatalf("name rule %+v written as %q compiles to %+v, %v", r, s, q, err)
		}
	}
}

// checkMatch compares Policy.Match on name with the rules read plainly.
func checkMatch(t *testing.T, p *Policy, name string) {
	t.Helper()
	n := strings.TrimSuffix(strings.ToLower(name), ".")
	denied := slices.ContainsFunc(p.DenyNames, func(d string) bool { return nameMatches(d, n) })
	var want []Ports
	for _, r := range p.Names {
		if nameMatches(r.Pattern, n) && !slices.Contains(want, r.Ports) {
			want = append(want, r.Ports)
		}
	}
	if denied {
		want = nil
	}
	got, ok := p.Match(name)
	if ok != (len(want) > 0) || !slices.Equal(got, want) {
		t.Fatalf("Match(%q) = %v, %v; the rules say %v (denied %v)", name, got, ok, want, denied)
	}
}

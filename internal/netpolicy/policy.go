// Package netpolicy owns sandbox networking on a node: the egress allowlist
// language (CIDRs with ports and protocols, domain names, named presets),
// its compilation into nftables rules in the host's network namespace, the
// veth pair that gives a sandbox a route out, the DNS proxy that answers
// only permitted names and admits their addresses, and dialing a service
// inside a sandbox's network namespace. The edge is its only caller.
//
// A sandbox starts loopback-only: its namespace (made by the OCI runtime)
// has nothing but lo, and no packet can leave it. A veth is added the first
// time its policy allows something. Everything is enforced from the host
// side, where root inside the sandbox cannot reach.
package netpolicy

import (
	"fmt"
	"net/netip"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// MaxRules bounds the entries of one allow or deny list.
const MaxRules = 256

// Protocol numbers an entry can name.
const (
	ProtoAny  uint8 = 0
	ProtoICMP uint8 = 1
	ProtoTCP  uint8 = 6
	ProtoUDP  uint8 = 17
)

// Ports is a protocol and an inclusive port range. ProtoAny with the full
// range is "everything".
type Ports struct {
	Proto  uint8
	Lo, Hi uint16
}

// AllPorts matches every protocol and port.
var AllPorts = Ports{Proto: ProtoAny, Lo: 0, Hi: 65535}

// Entry is one address rule: a prefix with a protocol and port range.
type Entry struct {
	Prefix netip.Prefix
	Ports
}

// NameRule admits the addresses a permitted name resolves to, on Ports.
// Pattern is a lower-case domain, or "*.domain" for every name below it.
type NameRule struct {
	Pattern string
	Ports
}

// Preset is a named set of domains (and optionally the ports they may be
// reached on) that an allow or deny list can refer to by name.
type Preset struct {
	Domains []string `json:"domains"`
	// Ports like "443/tcp" or "80"; empty means every port.
	Ports []string `json:"ports,omitempty"`
}

// DefaultPresets are the presets an edge knows unless configured otherwise.
// Package indexes and code hosts are what RL tasks most often need.
func DefaultPresets() map[string]Preset {
	web := []string{"443/tcp", "80/tcp"}
	return map[string]Preset{
		"pypi":   {Domains: []string{"pypi.org", "files.pythonhosted.org"}, Ports: web},
		"npm":    {Domains: []string{"registry.npmjs.org", "registry.yarnpkg.com"}, Ports: web},
		"github": {Domains: []string{"github.com", "*.github.com", "*.githubusercontent.com"}, Ports: web},
		"debian": {Domains: []string{"deb.debian.org", "security.debian.org"}, Ports: web},
		"goproxy": {Domains: []string{"proxy.golang.org", "sum.golang.org", "storage.googleapis.com"},
			Ports: web},
	}
}

// Policy is a compiled allow/deny list.
type Policy struct {
	// Allow and Deny are the address rules. Deny wins over Allow.
	Allow, Deny []Entry
	// Names are the permitted names; DenyNames are refused even when a
	// broader pattern or preset permits them.
	Names     []NameRule
	DenyNames []string
}

// Empty reports whether the policy lets nothing out (a sandbox with it
// needs no veth).
func (p *Policy) Empty() bool { return len(p.Allow) == 0 && len(p.Names) == 0 }

var (
	presetRE = regexp.MustCompile(`^[a-z][a-z0-9_-]{0,31}$`)
	labelRE  = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$`)
)

// Compile parses allow and deny lists against the known presets. Entries:
//
//	pypi                      a preset
//	pypi.org  *.example.com   a name, or every name below a domain
//	*                         every name (with 0.0.0.0/0: the whole internet)
//	10.1.2.0/24  10.1.2.3     an IPv4 prefix or address
//	...:443  ...:8000-8100    with a port or port range (tcp and udp)
//	.../tcp  .../udp  .../icmp  with a protocol
//
// e.g. "10.1.2.0/24:443/tcp", "files.example.org:443/tcp".
func Compile(allow, deny []string, presets map[string]Preset) (*Policy, error) {
	if len(allow) > MaxRules || len(deny) > MaxRules {
		return nil, errdefs.Invalid("network: at most %d allow and %d deny entries", MaxRules, MaxRules)
	}
	p := &Policy{}
	for _, s := range allow {
		entries, names, err := parseEntry(s, presets)
		if err != nil {
			return nil, err
		}
		p.Allow = append(p.Allow, entries...)
		p.Names = append(p.Names, names...)
	}
	for _, s := range deny {
		entries, names, err := parseEntry(s, presets)
		if err != nil {
			return nil, err
		}
		p.Deny = append(p.Deny, entries...)
		for _, n := range names {
			// A denied name is refused whatever its ports: a name has
			// no ports of its own.
			p.DenyNames = append(p.DenyNames, n.Pattern)
		}
	}
	p.DenyNames = slices.Compact(sortedCopy(p.DenyNames))
	return p, nil
}

func sortedCopy(s []string) []string {
	out := slices.Clone(s)
	sort.Strings(out)
	return out
}

func parseEntry(s string, presets map[string]Preset) ([]Entry, []NameRule, error) {
	orig := s
	bad := func(why string, args ...any) error {
		return errdefs.Invalid("network entry %q: %s", orig, fmt.Sprintf(why, args...))
	}
	s = strings.TrimSpace(s)
	if s == "" || len(s) > 270 {
		return nil, nil, bad("want a preset, a domain name or an IPv4 prefix, with optional :port and /proto")
	}
	if presetRE.MatchString(s) {
		pr, ok := presets[s]
		if !ok {
			return nil, nil, bad("unknown preset (this node knows: %s)", strings.Join(presetNames(presets), ", "))
		}
		ports := []Ports{AllPorts}
		if len(pr.Ports) > 0 {
			ports = ports[:0]
			for _, ps := range pr.Ports {
				pp, err := parsePorts(ps)
				if err != nil {
					return nil, nil, bad("preset port %q: %v", ps, err)
				}
				ports = append(ports, pp)
			}
		}
		var names []NameRule
		for _, d := range pr.Domains {
			pat, err := normalizePattern(d)
			if err != nil {
				return nil, nil, bad("preset domain %q: %v", d, err)
			}
			for _, pp := range ports {
				names = append(names, NameRule{Pattern: pat, Ports: pp})
			}
		}
		return nil, names, nil
	}
	host, ports := s, AllPorts
	// A protocol suffix is the last "/word"; a prefix length is a number.
	if i := strings.LastIndexByte(host, '/'); i >= 0 {
		switch host[i+1:] {
		case "tcp", "udp", "icmp":
			proto := map[string]uint8{"tcp": ProtoTCP, "udp": ProtoUDP, "icmp": ProtoICMP}[host[i+1:]]
			ports.Proto = proto
			host = host[:i]
		}
	}
	if strings.Count(host, ":") > 1 {
		return nil, nil, bad("IPv6 is not supported (sandboxes have IPv4 only)")
	}
	if i := strings.LastIndexByte(host, ':'); i >= 0 {
		lo, hi, err := parseRange(host[i+1:])
		if err != nil {
			return nil, nil, bad("%v", err)
		}
		if ports.Proto == ProtoICMP {
			return nil, nil, bad("icmp has no ports")
		}
		ports.Lo, ports.Hi = lo, hi
		host = host[:i]
	}
	if host == "" {
		return nil, nil, bad("missing address or name")
	}
	// An address is all digits and dots: a name may start with a digit too
	// ("1password.com"), in either letter case.
	if c := host[0]; c >= '0' && c <= '9' && !strings.ContainsAny(strings.ToLower(host), "abcdefghijklmnopqrstuvwxyz*") {
		pfx, err := parsePrefix(host)
		if err != nil {
			return nil, nil, bad("%v", err)
		}
		if ports.Proto == ProtoAny && (ports.Lo != 0 || ports.Hi != 65535) {
			// A port without a protocol means both tcp and udp.
			return []Entry{{pfx, Ports{ProtoTCP, ports.Lo, ports.Hi}}, {pfx, Ports{ProtoUDP, ports.Lo, ports.Hi}}}, nil, nil
		}
		return []Entry{{pfx, ports}}, nil, nil
	}
	pat, err := normalizePattern(host)
	if err != nil {
		return nil, nil, bad("%v", err)
	}
	if ports.Proto == ProtoAny && (ports.Lo != 0 || ports.Hi != 65535) {
		return nil, []NameRule{{pat, Ports{ProtoTCP, ports.Lo, ports.Hi}}, {pat, Ports{ProtoUDP, ports.Lo, ports.Hi}}}, nil
	}
	return nil, []NameRule{{pat, ports}}, nil
}

func presetNames(presets map[string]Preset) []string {
	var out []string
	for k := range presets {
		out = append(out, k)
	}
	sort.Strings(out)
	if len(out) == 0 {
		return []string{"none"}
	}
	return out
}

func parsePrefix(s string) (netip.Prefix, error) {
	if strings.Contains(s, "/") {
		p, err := netip.ParsePrefix(s)
		if err != nil || !p.Addr().Is4() {
			return netip.Prefix{}, fmt.Errorf("bad IPv4 prefix %q", s)
		}
		if p.Masked() != p {
			return netip.Prefix{}, fmt.Errorf("prefix %q has host bits set (did you mean %s?)", s, p.Masked())
		}
		return p, nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil || !a.Is4() {
		return netip.Prefix{}, fmt.Errorf("bad IPv4 address %q", s)
	}
	return netip.PrefixFrom(a, 32), nil
}

func parseRange(s string) (uint16, uint16, error) {
	los, his, isRange := strings.Cut(s, "-")
	lo, err := strconv.ParseUint(los, 10, 16)
	if err != nil || lo == 0 {
		return 0, 0, fmt.Errorf("bad port %q (want 1-65535 or a range like 8000-8100)", s)
	}
	hi := lo
	if isRange {
		hi, err = strconv.ParseUint(his, 10, 16)
		if err != nil || hi < lo {
			return 0, 0, fmt.Errorf("bad port range %q", s)
		}
	}
	return uint16(lo), uint16(hi), nil
}

// parsePorts parses a preset's "443/tcp", "53/udp" or "8080" (tcp and udp
// would need two entries; a bare port in a preset means tcp).
func parsePorts(s string) (Ports, error) {
	num, proto, _ := strings.Cut(s, "/")
	p := Ports{Proto: ProtoTCP}
	switch proto {
	case "", "tcp":
	case "udp":
		p.Proto = ProtoUDP
	default:
		return p, fmt.Errorf("protocol %q: want tcp or udp", proto)
	}
	lo, hi, err := parseRange(num)
	if err != nil {
		return p, err
	}
	p.Lo, p.Hi = lo, hi
	return p, nil
}

// anyName is the pattern that permits every name. An address rule cannot
// say "every name": without it a sandbox allowed 0.0.0.0/0 could reach
// any address but look up none.
const anyName = "*"

// normalizePattern lower-cases a domain pattern and checks it: labels of
// letters, digits and hyphens; at least two labels; "*." only in front;
// or anyName alone.
func normalizePattern(s string) (string, error) {
	s = strings.TrimSuffix(strings.ToLower(s), ".")
	if s == anyName {
		return s, nil
	}
	rest := strings.TrimPrefix(s, "*.")
	if len(rest) > 253 {
		return "", fmt.Errorf("name too long")
	}
	labels := strings.Split(rest, ".")
	if len(labels) < 2 {
		return "", fmt.Errorf("%q is not a preset name here nor a domain (a domain has a dot)", s)
	}
	for _, l := range labels {
		if !labelRE.MatchString(l) {
			return "", fmt.Errorf("bad domain %q", s)
		}
	}
	return s, nil
}

// Match reports the port sets a resolved name may be reached on; ok is
// false when the name is not permitted (or is denied).
func (p *Policy) Match(name string) (ports []Ports, ok bool) {
	if p.denies(name) {
		return nil, false
	}
	name = strings.TrimSuffix(strings.ToLower(name), ".")
	for _, r := range p.Names {
		if nameMatches(r.Pattern, name) && !slices.Contains(ports, r.Ports) {
			ports = append(ports, r.Ports)
		}
	}
	return ports, len(ports) > 0
}

func nameMatches(pattern, name string) bool {
	if pattern == anyName {
		return true
	}
	if base, ok := strings.CutPrefix(pattern, "*."); ok {
		return strings.HasSuffix(name, "."+base)
	}
	return pattern == name
}

// denies reports whether a deny entry names name (whatever permits it).
func (p *Policy) denies(name string) bool {
	name = strings.TrimSuffix(strings.ToLower(name), ".")
	for _, d := range p.DenyNames {
		if nameMatches(d, name) {
			return true
		}
	}
	return false
}

// wildcardPart returns the labels of name in front of the base domain of
// the most specific wildcard pattern that matches it ("a.b" for
// "a.b.example.com" under "*.example.com"), and false when an exact name
// rule names it or no wildcard matches: the part a sandbox chooses, and
// hence what a query can carry to the zone's servers. anyName counts as
// naming every name exactly: a sandbox that may look up any name has no
// zone to keep its queries short for.
func (p *Policy) wildcardPart(name string) (string, bool) {
	name = strings.TrimSuffix(strings.ToLower(name), ".")
	part, wild := "", false
	for _, r := range p.Names {
		if r.Pattern == name || r.Pattern == anyName {
			return "", false
		}
		base, ok := strings.CutPrefix(r.Pattern, "*.")
		if !ok || !strings.HasSuffix(name, "."+base) {
			continue
		}
		if pp := strings.TrimSuffix(name, "."+base); !wild || len(pp) < len(part) {
			part, wild = pp, true
		}
	}
	return part, wild
}

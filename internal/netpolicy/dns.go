package netpolicy

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/miekg/dns"
)

// dnsProxy answers the sandboxes' DNS queries on the pool's first address.
// A query is forwarded upstream only when the asking sandbox's policy
// permits the name and the query is one a connection needs; the addresses
// the name resolves to are admitted to that sandbox's allow set before the
// answer is sent back, so the connection that follows the lookup already
// passes. Every other query is answered without leaving the host: a name
// is data, and a refused name never reaches any server.
//
// What leaves the host for a permitted name is a query built here, not the
// sandbox's message: the lower-cased name, the type (A or CNAME), a fresh
// ID, recursion desired and an EDNS buffer size of our own. The sandbox's
// ID, flags, EDNS options (client subnet, padding, anything) and letter
// case stay behind. AAAA, HTTPS and SVCB get an empty NOERROR here (no IPv6
// in sandboxes; clients fall back to A); every other type (TXT, ANY, NULL,
// MX, SRV, PTR, NS, SOA, CAA, zone transfers, ...) is REFUSED: none is
// needed to connect, and TXT, NULL and ANY are the usual tunnels.
//
// What an answer admits: the A records whose owner is the name or on its
// CNAME chain (see answerAddrs), of addresses addrFilter lets through.
// The answer itself goes back to the sandbox as the upstream gave it, so a
// client may see an address it then cannot reach (refused at once), unless
// an explicit CIDR entry of its policy opens that address.
type dnsProxy struct {
	policyFor func(netip.Addr) *Policy
	admit     func(src netip.Addr, name string, addrs []netip.Addr, ports []Ports, ttl time.Duration) error
	filter    *addrFilter
	upstreams []string
	log       *slog.Logger
	client    *dns.Client

	udp, tcp *dns.Server
	stop     chan struct{} // closed by close: ends keepHostFresh

	Refused   atomic.Int64
	Forwarded atomic.Int64
}

const (
	// maxChain bounds the CNAMEs followed from a question name (resolvers
	// give up after about a dozen; real chains have 1 to 3).
	maxChain = 8
	// maxAnswerAddrs bounds the addresses one answer admits (real answers
	// have at most a few dozen): a hostile answer of thousands would
	// otherwise become as many set elements.
	maxAnswerAddrs = 32
	// maxWildLabel and maxWildPart bound the labels a wildcard pattern
	// matches ("x" of "x.example.com" under "*.example.com"), the only
	// part of a forwarded name a sandbox chooses. DNS allows 63 per label
	// and 253 in all; CDN names and most bucket names fit in these.
	maxWildLabel = 40
	maxWildPart  = 64
	// upstreamUDPSize is the EDNS buffer size of upstream queries (DNS
	// flag day 2020).
	upstreamUDPSize = 1232
	// hostRefresh is how often the host's addresses are read again.
	hostRefresh = 10 * time.Second
)

func startDNS(m *Manager, addr netip.Addr) (*dnsProxy, error) {
	d := &dnsProxy{
		policyFor: m.policyFor, admit: m.admit, filter: m.filter, upstreams: m.cfg.Upstreams, log: m.log,
		client: &dns.Client{Timeout: 3 * time.Second}, stop: make(chan struct{}),
	}
	if err := d.refreshHost(); err != nil {
		return nil, fmt.Errorf("starting DNS proxy: %w", err)
	}
	hostport := net.JoinHostPort(addr.String(), "53")
	pc, err := net.ListenPacket("udp4", hostport)
	if err != nil {
		return nil, fmt.Errorf("starting DNS proxy: %w", err)
	}
	ln, err := net.Listen("tcp4", hostport)
	if err != nil {
		pc.Close()
		return nil, fmt.Errorf("starting DNS proxy: %w", err)
	}
	d.udp = &dns.Server{PacketConn: pc, Handler: d}
	d.tcp = &dns.Server{Listener: ln, Handler: d}
	for _, s := range []*dns.Server{d.udp, d.tcp} {
		go func() {
			if err := s.ActivateAndServe(); err != nil {
				m.log.Warn("DNS proxy stopped", "err", err)
			}
		}()
	}
	go d.keepHostFresh()
	return d, nil
}

func (d *dnsProxy) close() {
	close(d.stop)
	_ = d.udp.Shutdown()
	_ = d.tcp.Shutdown()
}

// refreshHost reads the host's addresses into the filter.
func (d *dnsProxy) refreshHost() error {
	addrs, err := hostAddrs()
	if err != nil {
		return err
	}
	d.filter.setHost(hostExclusions(addrs))
	return nil
}

// keepHostFresh re-reads the host's addresses until close (one netlink
// dump each time), so the request path only reads the filter.
func (d *dnsProxy) keepHostFresh() {
	t := time.NewTicker(hostRefresh)
	defer t.Stop()
	for {
		select {
		case <-d.stop:
			return
		case <-t.C:
			if err := d.refreshHost(); err != nil {
				d.log.Warn("reading host addresses for the DNS proxy (keeping the previous ones)", "err", err)
			}
		}
	}
}

// ServeDNS implements dns.Handler.
func (d *dnsProxy) ServeDNS(w dns.ResponseWriter, r *dns.Msg) {
	src, ok := addrOf(w.RemoteAddr())
	var p *Policy
	if ok {
		p = d.policyFor(src)
	}
	if p == nil {
		reply(w, r, dns.RcodeRefused)
		return
	}
	v, ports := classify(r, p)
	switch v {
	case notImp:
		reply(w, r, dns.RcodeNotImplemented)
		return
	case refuse:
		d.Refused.Add(1)
		q := r.Question[0]
		d.log.Debug("DNS query refused", "src", src.String(), "name", q.Name, "type", dns.TypeToString[q.Qtype])
		reply(w, r, dns.RcodeRefused)
		return
	case empty:
		reply(w, r, dns.RcodeSuccess)
		return
	}
	name := dns.CanonicalName(r.Question[0].Name)
	resp, err := d.exchange(upstreamQuery(name, r.Question[0].Qtype))
	if err == nil && resp.Rcode > 0xf {
		// An extended rcode lives in the OPT record, which the sandbox
		// may not have asked for.
		err = fmt.Errorf("extended rcode %d", resp.Rcode)
	}
	if err != nil {
		d.log.Warn("DNS upstream failed", "name", name, "err", err)
		reply(w, r, dns.RcodeServerFailure)
		return
	}
	d.Forwarded.Add(1)
	if resp.Rcode == dns.RcodeSuccess {
		chain, addrs, ttl := answerAddrs(name, resp.Answer)
		if i := slices.IndexFunc(chain, p.denies); i >= 0 {
			// A permitted name that is an alias of a denied one would
			// open the denied one's addresses.
			d.Refused.Add(1)
			d.log.Debug("DNS answer leads to a denied name", "src", src.String(), "name", name, "denied", chain[i])
			reply(w, r, dns.RcodeRefused)
			return
		}
		admitted := addrs[:0]
		for _, a := range addrs {
			if d.filter.admits(a) {
				admitted = append(admitted, a)
			} else {
				d.log.Debug("DNS answer address not admitted", "src", src.String(), "name", name, "addr", a.String())
			}
		}
		if len(admitted) > 0 {
			if err := d.admit(src, name, admitted, ports, time.Duration(ttl)*time.Second); err != nil {
				// An answer whose addresses could not be admitted would
				// only lead to a refused connection: fail the lookup.
				d.log.Warn("admitting resolved addresses", "name", name, "err", err)
				reply(w, r, dns.RcodeServerFailure)
				return
			}
		}
	}
	writeAnswer(w, r, resp)
}

func reply(w dns.ResponseWriter, r *dns.Msg, rcode int) {
	m := new(dns.Msg)
	m.SetRcode(r, rcode)
	_ = w.WriteMsg(m)
}

// verdict is what the proxy does with a sandbox's query.
type verdict int

const (
	refuse  verdict = iota // REFUSED; nothing leaves the host
	notImp                 // NOTIMP: not a query of one question
	empty                  // NOERROR without records; nothing leaves the host
	forward                // asked upstream
)

// classify decides what to do with query r of a sandbox whose policy is p,
// and returns the ports the name is permitted on when it is forwarded.
func classify(r *dns.Msg, p *Policy) (verdict, []Ports) {
	if r.Response || r.Opcode != dns.OpcodeQuery || len(r.Question) != 1 {
		return notImp, nil
	}
	q := r.Question[0]
	if q.Qclass != dns.ClassINET || !hostname(q.Name) {
		return refuse, nil
	}
	ports, ok := p.Match(q.Name)
	if !ok {
		return refuse, nil
	}
	if part, wild := p.wildcardPart(q.Name); wild && !wildcardPartOK(part) {
		return refuse, nil
	}
	switch q.Qtype {
	case dns.TypeA, dns.TypeCNAME:
		return forward, ports
	case dns.TypeAAAA, dns.TypeHTTPS, dns.TypeSVCB:
		return empty, nil
	}
	return refuse, nil
}

// hostname reports whether name is a host name: labels of letters, digits
// and hyphens, 1 to 63 long, 253 in all; no escaped bytes (a label on the
// wire may hold any byte), no underscores.
func hostname(name string) bool {
	name = strings.TrimSuffix(strings.ToLower(name), ".")
	if name == "" || len(name) > 253 {
		return false
	}
	for l := range strings.SplitSeq(name, ".") {
		if !labelRE.MatchString(l) {
			return false
		}
	}
	return true
}

// wildcardPartOK reports whether the part of a name a wildcard matches is
// within maxWildPart and each of its labels within maxWildLabel.
func wildcardPartOK(part string) bool {
	if len(part) > maxWildPart {
		return false
	}
	for l := range strings.SplitSeq(part, ".") {
		if len(l) > maxWildLabel {
			return false
		}
	}
	return true
}

// upstreamQuery is the query sent upstream for a permitted name (lower
// case, fully qualified) and type: nothing of the sandbox's message.
func upstreamQuery(name string, qtype uint16) *dns.Msg {
	m := new(dns.Msg)
	m.SetQuestion(name, qtype)
	m.SetEdns0(upstreamUDPSize, false)
	return m
}

// answerAddrs follows the CNAME chain of name through an answer section
// and returns the chain (name first, every name canonical), the IPv4
// addresses of the A records (class IN) whose owner is on it, at most
// maxAnswerAddrs of them, and their smallest TTL. Records of every other
// owner are ignored, and so are the authority and additional sections
// (never passed in): an answer for a permitted name may carry anything,
// and only what that name resolves to may be admitted. Names compare
// without regard to case. The chain ends at a name without a CNAME, at a
// loop, or after maxChain CNAMEs.
func answerAddrs(name string, answer []dns.RR) (chain []string, addrs []netip.Addr, ttl uint32) {
	chain = []string{dns.CanonicalName(name)}
	for len(chain) <= maxChain {
		next := cnameOf(chain[len(chain)-1], answer)
		if next == "" || slices.Contains(chain, next) {
			break
		}
		chain = append(chain, next)
	}
	for _, rr := range answer {
		a, ok := rr.(*dns.A)
		if !ok || a.Hdr.Class != dns.ClassINET || !slices.Contains(chain, dns.CanonicalName(a.Hdr.Name)) {
			continue
		}
		ip, ok := netip.AddrFromSlice(a.A.To4())
		if !ok {
			continue
		}
		if len(addrs) == 0 || a.Hdr.Ttl < ttl {
			ttl = a.Hdr.Ttl
		}
		if slices.Contains(addrs, ip) {
			continue
		}
		addrs = append(addrs, ip)
		if len(addrs) == maxAnswerAddrs {
			break
		}
	}
	return chain, addrs, ttl
}

// cnameOf returns the (canonical) target of owner's first CNAME record in
// answer, or "".
func cnameOf(owner string, answer []dns.RR) string {
	for _, rr := range answer {
		if c, ok := rr.(*dns.CNAME); ok && c.Hdr.Class == dns.ClassINET && dns.CanonicalName(c.Hdr.Name) == owner {
			return dns.CanonicalName(c.Target)
		}
	}
	return ""
}

// writeAnswer sends an upstream answer to the sandbox as the answer to r:
// under r's ID and question (its letter case), with an OPT record only if
// r had one, and no larger than r can take over UDP.
func writeAnswer(w dns.ResponseWriter, r, resp *dns.Msg) {
	resp.Id = r.Id
	resp.Question = r.Question
	resp.Extra = slices.DeleteFunc(resp.Extra, func(rr dns.RR) bool { _, ok := rr.(*dns.OPT); return ok })
	_, udp := w.RemoteAddr().(*net.UDPAddr)
	size := dns.MaxMsgSize
	if udp {
		size = dns.MinMsgSize
	}
	if o := r.IsEdns0(); o != nil {
		resp.SetEdns0(upstreamUDPSize, false)
		if udp {
			size = int(min(o.UDPSize(), upstreamUDPSize))
		}
	}
	resp.Truncate(size)
	_ = w.WriteMsg(resp)
}

// exchange asks each upstream in turn, over TCP when the UDP answer is
// truncated.
func (d *dnsProxy) exchange(q *dns.Msg) (*dns.Msg, error) {
	if len(d.upstreams) == 0 {
		return nil, errors.New("no upstream DNS server configured")
	}
	var last error
	for _, up := range d.upstreams {
		resp, _, err := d.client.Exchange(q, up)
		if err == nil && resp.Truncated {
			c := *d.client
			c.Net = "tcp"
			resp, _, err = c.Exchange(q, up)
		}
		if err == nil {
			return resp, nil
		}
		last = err
	}
	return nil, last
}

func addrOf(a net.Addr) (netip.Addr, bool) {
	var ip net.IP
	switch v := a.(type) {
	case *net.UDPAddr:
		ip = v.IP
	case *net.TCPAddr:
		ip = v.IP
	default:
		return netip.Addr{}, false
	}
	ad, ok := netip.AddrFromSlice(ip.To4())
	return ad, ok
}

// UpstreamsFromResolvConf reads the host's nameservers ("host:53") from a
// resolv.conf.
func UpstreamsFromResolvConf(path string) []string {
	cc, err := dns.ClientConfigFromFile(path)
	if err != nil {
		return nil
	}
	var out []string
	for _, s := range cc.Servers {
		out = append(out, net.JoinHostPort(s, strconv.Itoa(53)))
	}
	return out
}

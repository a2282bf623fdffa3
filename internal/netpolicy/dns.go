package netpolicy

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/miekg/dns"
)

// dnsProxy answers the sandboxes' DNS queries on the pool's first address.
// A query is forwarded upstream only when the asking sandbox's policy
// permits the name; the A records of the answer are admitted to that
// sandbox's allow set before the answer is sent back, so the connection
// that follows the lookup already passes. Every other query is refused
// without leaving the host: a name is data, and a refused name never
// reaches any server (no DNS exfiltration).
type dnsProxy struct {
	m        *Manager
	udp, tcp *dns.Server
	client   *dns.Client

	Refused   atomic.Int64
	Forwarded atomic.Int64
}

func startDNS(m *Manager, addr netip.Addr) (*dnsProxy, error) {
	d := &dnsProxy{m: m, client: &dns.Client{Timeout: 3 * time.Second}}
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
	return d, nil
}

func (d *dnsProxy) close() {
	_ = d.udp.Shutdown()
	_ = d.tcp.Shutdown()
}

// ServeDNS implements dns.Handler.
func (d *dnsProxy) ServeDNS(w dns.ResponseWriter, r *dns.Msg) {
	reply := func(rcode int) {
		m := new(dns.Msg)
		m.SetRcode(r, rcode)
		_ = w.WriteMsg(m)
	}
	src, ok := addrOf(w.RemoteAddr())
	p := d.m.policyFor(src)
	if !ok || p == nil {
		reply(dns.RcodeRefused)
		return
	}
	if r.Opcode != dns.OpcodeQuery || len(r.Question) != 1 {
		reply(dns.RcodeNotImplemented)
		return
	}
	q := r.Question[0]
	ports, permitted := p.Match(q.Name)
	if !permitted {
		d.Refused.Add(1)
		d.m.log.Debug("DNS query refused by policy", "src", src.String(), "name", q.Name)
		reply(dns.RcodeRefused)
		return
	}
	if q.Qtype == dns.TypeAAAA {
		// Sandboxes have no IPv6: an empty answer makes clients use A
		// records at once.
		reply(dns.RcodeSuccess)
		return
	}
	resp, err := d.exchange(r)
	if err != nil {
		d.m.log.Warn("DNS upstream failed", "name", q.Name, "err", err)
		reply(dns.RcodeServerFailure)
		return
	}
	d.Forwarded.Add(1)
	var addrs []netip.Addr
	minTTL := uint32(0)
	for _, rr := range resp.Answer {
		if a, ok := rr.(*dns.A); ok {
			if ip, ok := netip.AddrFromSlice(a.A.To4()); ok {
				addrs = append(addrs, ip)
				if minTTL == 0 || a.Hdr.Ttl < minTTL {
					minTTL = a.Hdr.Ttl
				}
			}
		}
	}
	if len(addrs) > 0 {
		if err := d.m.admit(src, dns.CanonicalName(q.Name), addrs, ports, time.Duration(minTTL)*time.Second); err != nil {
			// An answer whose addresses could not be admitted would
			// only lead to a refused connection: fail the lookup.
			d.m.log.Warn("admitting resolved addresses", "name", q.Name, "err", err)
			reply(dns.RcodeServerFailure)
			return
		}
	}
	resp.Id = r.Id
	_ = w.WriteMsg(resp)
}

// exchange asks each upstream in turn, over TCP when the UDP answer is
// truncated.
func (d *dnsProxy) exchange(r *dns.Msg) (*dns.Msg, error) {
	if len(d.m.cfg.Upstreams) == 0 {
		return nil, errors.New("no upstream DNS server configured")
	}
	var last error
	q := r.Copy()
	for _, up := range d.m.cfg.Upstreams {
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

package netpolicy

import (
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
)

// The proxy's tests drive ServeDNS with a fake ResponseWriter that says the
// query came from a sandbox, against a fake upstream on 127.0.0.1 that
// records every question it gets; admissions are recorded instead of
// reaching nft. Nothing leaves loopback.

var testSandbox = netip.MustParseAddr("10.77.0.6")

// fakeUpstream is a DNS server on 127.0.0.1 whose answers the test sets.
type fakeUpstream struct {
	addr string

	mu     sync.Mutex
	asked  []*dns.Msg
	answer func(q dns.Question, m *dns.Msg) // fills the reply
}

func newFakeUpstream(t *testing.T) *fakeUpstream {
	t.Helper()
	pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	up := &fakeUpstream{addr: pc.LocalAddr().String()}
	srv := &dns.Server{PacketConn: pc, Handler: dns.HandlerFunc(func(w dns.ResponseWriter, r *dns.Msg) {
		m := new(dns.Msg)
		m.SetReply(r)
		up.mu.Lock()
		up.asked = append(up.asked, r.Copy())
		fill := up.answer
		up.mu.Unlock()
		if fill != nil && len(r.Question) == 1 {
			fill(r.Question[0], m)
		}
		_ = w.WriteMsg(m)
	})}
	started := make(chan struct{})
	srv.NotifyStartedFunc = func() { close(started) }
	go func() { _ = srv.ActivateAndServe() }()
	<-started
	t.Cleanup(func() { _ = srv.Shutdown() })
	return up
}

func (u *fakeUpstream) set(fill func(q dns.Question, m *dns.Msg)) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.answer, u.asked = fill, nil
}

func (u *fakeUpstream) questions() []dns.Question {
	u.mu.Lock()
	defer u.mu.Unlock()
	var out []dns.Question
	for _, m := range u.asked {
		out = append(out, m.Question...)
	}
	return out
}

// admitCall is one call of the proxy's admit.
type admitCall struct {
	name  string
	addrs []netip.Addr
	ports []Ports
}

type testProxy struct {
	*dnsProxy
	mu       sync.Mutex
	admitted []admitCall
}

// newTestProxy is a proxy for one sandbox (testSandbox) with policy p,
// whose filter excludes pool 10.77.0.0/16, DefaultPool and the host
// addresses given, and opens the private ranges given.
func newTestProxy(t *testing.T, p *Policy, upstream string, host []ifAddr, private ...string) *testProxy {
	t.Helper()
	var priv []netip.Prefix
	for _, s := range private {
		priv = append(priv, netip.MustParsePrefix(s))
	}
	f := newAddrFilter(netip.MustParsePrefix("10.77.0.0/16"), priv, nil)
	f.setHost(hostExclusions(host))
	tp := &testProxy{}
	tp.dnsProxy = &dnsProxy{
		policyFor: func(a netip.Addr) *Policy {
			if a == testSandbox {
				return p
			}
			return nil
		},
		admit: func(src netip.Addr, name string, addrs []netip.Addr, ports []Ports, ttl time.Duration) error {
			if src != testSandbox {
				t.Errorf("admit for %s", src)
			}
			tp.mu.Lock()
			defer tp.mu.Unlock()
			tp.admitted = append(tp.admitted, admitCall{name, slices.Clone(addrs), ports})
			return nil
		},
		filter: f, upstreams: []string{upstream}, log: slog.New(slog.DiscardHandler),
		client: &dns.Client{Timeout: 2 * time.Second},
	}
	return tp
}

// admittedAddrs returns what was admitted since the last call, as strings.
func (tp *testProxy) admittedAddrs() []string {
	tp.mu.Lock()
	defer tp.mu.Unlock()
	var out []string
	for _, a := range tp.admitted {
		for _, ip := range a.addrs {
			out = append(out, ip.String())
		}
	}
	tp.admitted = nil
	return out
}

// fakeWriter is a dns.ResponseWriter for a query from remote.
type fakeWriter struct {
	remote net.Addr
	msg    *dns.Msg
	packed []byte
}

func (w *fakeWriter) LocalAddr() net.Addr  { return &net.UDPAddr{IP: net.IPv4(10, 77, 0, 1), Port: 53} }
func (w *fakeWriter) RemoteAddr() net.Addr { return w.remote }
func (w *fakeWriter) WriteMsg(m *dns.Msg) error {
	b, err := m.Pack()
	w.msg, w.packed = m, b
	return err
}
func (w *fakeWriter) Write(b []byte) (int, error) { w.packed = b; return len(b), nil }
func (w *fakeWriter) Close() error                { return nil }
func (w *fakeWriter) TsigStatus() error           { return nil }
func (w *fakeWriter) TsigTimersOnly(bool)         {}
func (w *fakeWriter) Hijack()                     {}

func sandboxWriter() *fakeWriter {
	return &fakeWriter{remote: &net.UDPAddr{IP: net.IP(testSandbox.AsSlice()), Port: 40000}}
}

// ask sends the sandbox's query r and returns the reply, failing if none
// comes within 5 s (a chain walk that does not end).
func (tp *testProxy) ask(t *testing.T, r *dns.Msg) *dns.Msg {
	t.Helper()
	w := sandboxWriter()
	done := make(chan struct{})
	go func() { tp.ServeDNS(w, r); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatalf("no reply to %v within 5 s", r.Question)
	}
	if w.msg == nil {
		t.Fatalf("no reply to %v", r.Question)
	}
	return w.msg
}

func query(name string, qtype uint16) *dns.Msg {
	m := new(dns.Msg)
	m.SetQuestion(name, qtype)
	return m
}

func rrs(t *testing.T, ss ...string) []dns.RR {
	t.Helper()
	var out []dns.RR
	for _, s := range ss {
		rr, err := dns.NewRR(s)
		if err != nil {
			t.Fatalf("%q: %v", s, err)
		}
		out = append(out, rr)
	}
	return out
}

func testPolicy(t *testing.T) *Policy {
	t.Helper()
	presets := map[string]Preset{"pypi": {Domains: []string{"pypi.org", "files.pythonhosted.org"}, Ports: []string{"443/tcp"}}}
	p, err := Compile([]string{"pypi", "*.example.com"}, []string{"evil.example.com"}, presets)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// TestDNSAdmitsOnlyChainGlobalAddresses attacks admission with crafted
// answers for permitted names.
func TestDNSAdmitsOnlyChainGlobalAddresses(t *testing.T) {
	up := newFakeUpstream(t)
	host := []ifAddr{
		{netip.MustParsePrefix("93.184.215.14/24"), "eth0"},
		{netip.MustParsePrefix("10.88.0.5/30"), "ds0abcd00001"}, // another instance's sandbox veth
	}
	// A chain of n CNAMEs from c0.example.com, the last with an address.
	chain := func(n int) []string {
		var out []string
		for i := 0; i < n; i++ {
			owner := fmt.Sprintf("c%d.cdn.net.", i)
			if i == 0 {
				owner = "c0.example.com."
			}
			out = append(out, fmt.Sprintf("%s 60 IN CNAME c%d.cdn.net.", owner, i+1))
		}
		return append(out, fmt.Sprintf("c%d.cdn.net. 60 IN A 151.101.9.9", n))
	}
	many := []string{}
	for i := 1; i <= 40; i++ {
		many = append(many, fmt.Sprintf("pypi.org. 60 IN A 151.101.0.%d", i))
	}
	tests := []struct {
		name    string
		q       string
		rcode   int
		answer  []string
		ns      []string
		extra   []string
		private []string
		want    []string
		refused bool
	}{
		{name: "global address", q: "pypi.org.", answer: []string{"pypi.org. 60 IN A 151.101.0.223"}, want: []string{"151.101.0.223"}},
		{name: "RFC 1918", q: "pypi.org.", answer: []string{
			"pypi.org. 60 IN A 10.1.2.3", "pypi.org. 60 IN A 172.16.5.4", "pypi.org. 60 IN A 192.168.1.1"}},
		{name: "CGNAT", q: "pypi.org.", answer: []string{"pypi.org. 60 IN A 100.64.0.1", "pypi.org. 60 IN A 100.127.255.254"}},
		{name: "loopback, link-local, this network, multicast, reserved, broadcast", q: "pypi.org.", answer: []string{
			"pypi.org. 60 IN A 127.0.0.1", "pypi.org. 60 IN A 169.254.169.254", "pypi.org. 60 IN A 0.1.2.3",
			"pypi.org. 60 IN A 224.0.0.251", "pypi.org. 60 IN A 240.0.0.1", "pypi.org. 60 IN A 255.255.255.255"}},
		{name: "documentation and benchmarking", q: "pypi.org.", answer: []string{
			"pypi.org. 60 IN A 192.0.2.1", "pypi.org. 60 IN A 198.51.100.1", "pypi.org. 60 IN A 203.0.113.1",
			"pypi.org. 60 IN A 198.18.0.1", "pypi.org. 60 IN A 192.0.0.8"}},
		{name: "host address, not its neighbour", q: "pypi.org.", answer: []string{
			"pypi.org. 60 IN A 93.184.215.14", "pypi.org. 60 IN A 93.184.215.15"}, want: []string{"93.184.215.15"}},
		{name: "pools and other instance's sandbox even with 10/8 opened", q: "pypi.org.", private: []string{"10.0.0.0/8"},
			answer: []string{"pypi.org. 60 IN A 10.77.0.10", "pypi.org. 60 IN A 10.200.0.6",
				"pypi.org. 60 IN A 10.88.0.6", "pypi.org. 60 IN A 10.5.5.5"},
			want: []string{"10.5.5.5"}},
		{name: "mixed answer", q: "pypi.org.", answer: []string{
			"pypi.org. 60 IN A 10.0.0.1", "pypi.org. 60 IN A 151.101.0.223", "pypi.org. 60 IN A 127.0.0.1"},
			want: []string{"151.101.0.223"}},
		{name: "unrelated owners in the answer", q: "pypi.org.", answer: []string{
			"evil.net. 60 IN A 1.2.3.4", "pypi.org. 60 IN A 151.101.0.223", "pypi.org.evil.net. 60 IN A 5.6.7.8",
			"xpypi.org. 60 IN A 5.6.7.9"},
			want: []string{"151.101.0.223"}},
		{name: "only an unrelated owner", q: "pypi.org.", answer: []string{"evil.net. 60 IN A 1.2.3.4"}},
		{name: "authority and additional sections", q: "pypi.org.",
			ns: []string{"pypi.org. 60 IN A 1.2.3.4"}, extra: []string{"pypi.org. 60 IN A 1.2.3.5"}},
		{name: "CNAME to a CDN", q: "files.pythonhosted.org.", answer: []string{
			"files.pythonhosted.org. 60 IN CNAME Dualstack.Python.Map.Fastly.NET.",
			"dualstack.python.map.fastly.net. 60 IN A 151.101.64.223"},
			want: []string{"151.101.64.223"}},
		{name: "two CNAMEs, owners in another case", q: "files.pythonhosted.org.", answer: []string{
			"FILES.PythonHosted.org. 60 IN CNAME a.cdn.net.", "A.CDN.net. 60 IN CNAME b.cdn.net.",
			"b.cdn.net. 60 IN A 151.101.1.1", "c.cdn.net. 60 IN A 151.101.1.2"},
			want: []string{"151.101.1.1"}},
		{name: "CNAME to a private address", q: "files.pythonhosted.org.", answer: []string{
			"files.pythonhosted.org. 60 IN CNAME internal.corp.", "internal.corp. 60 IN A 10.0.0.1"}},
		{name: "CNAME loop", q: "files.pythonhosted.org.", answer: []string{
			"files.pythonhosted.org. 60 IN CNAME a.cdn.net.", "a.cdn.net. 60 IN CNAME b.cdn.net.",
			"b.cdn.net. 60 IN CNAME a.cdn.net.", "c.cdn.net. 60 IN A 151.101.1.2"}},
		{name: "chain at the bound", q: "c0.example.com.", answer: chain(maxChain), want: []string{"151.101.9.9"}},
		{name: "chain past the bound", q: "c0.example.com.", answer: chain(maxChain + 1)},
		{name: "class CHAOS", q: "pypi.org.", answer: []string{"pypi.org. 60 CH A 1.2.3.4"}},
		{name: "alias of a denied name", q: "a.example.com.", answer: []string{
			"a.example.com. 60 IN CNAME Evil.Example.com.", "evil.example.com. 60 IN A 1.2.3.4"}, refused: true},
		{name: "NXDOMAIN with an address", q: "pypi.org.", rcode: dns.RcodeNameError, answer: []string{"pypi.org. 60 IN A 1.2.3.4"}},
		{name: "too many addresses", q: "pypi.org.", answer: many, want: func() []string {
			var w []string
			for i := 1; i <= maxAnswerAddrs; i++ {
				w = append(w, fmt.Sprintf("151.101.0.%d", i))
			}
			return w
		}()},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tp := newTestProxy(t, testPolicy(t), up.addr, host, tc.private...)
			up.set(func(q dns.Question, m *dns.Msg) {
				m.Rcode = tc.rcode
				m.Answer, m.Ns = rrs(t, tc.answer...), rrs(t, tc.ns...)
				m.Extra = append(m.Extra, rrs(t, tc.extra...)...)
			})
			resp := tp.ask(t, query(tc.q, dns.TypeA))
			if got := tp.admittedAddrs(); !slices.Equal(got, tc.want) {
				t.Errorf("admitted %v, want %v", got, tc.want)
			}
			wantRcode := tc.rcode
			if tc.refused {
				wantRcode = dns.RcodeRefused
			}
			if resp.Rcode != wantRcode {
				t.Errorf("rcode %s, want %s", dns.RcodeToString[resp.Rcode], dns.RcodeToString[wantRcode])
			}
			if qs := up.questions(); len(qs) != 1 {
				t.Errorf("upstream asked %v, want the one question", qs)
			}
		})
	}
}

// TestDNSQueryTypes checks that only what a connection needs is forwarded:
// tunnel-friendly types are refused and never reach the upstream.
func TestDNSQueryTypes(t *testing.T) {
	up := newFakeUpstream(t)
	tp := newTestProxy(t, testPolicy(t), up.addr, nil)
	up.set(func(q dns.Question, m *dns.Msg) {
		if q.Qtype == dns.TypeA {
			m.Answer = rrs(t, q.Name+" 60 IN A 151.101.0.223")
		}
	})
	types := []struct {
		qtype    uint16
		rcode    int
		forwards bool
	}{
		{dns.TypeA, dns.RcodeSuccess, true},
		{dns.TypeCNAME, dns.RcodeSuccess, true},
		{dns.TypeAAAA, dns.RcodeSuccess, false},
		{dns.TypeHTTPS, dns.RcodeSuccess, false},
		{dns.TypeSVCB, dns.RcodeSuccess, false},
	}
	for _, qt := range []uint16{
		dns.TypeTXT, dns.TypeANY, dns.TypeNULL, dns.TypeMX, dns.TypeSRV, dns.TypePTR, dns.TypeNS,
		dns.TypeSOA, dns.TypeCAA, dns.TypeAXFR, dns.TypeIXFR, dns.TypeDNSKEY, dns.TypeDS, dns.TypeNAPTR,
		dns.TypeHINFO, dns.TypeRRSIG, dns.TypeOPT, dns.TypeSPF, dns.TypeURI, 0, 65280, 65535,
	} {
		types = append(types, struct {
			qtype    uint16
			rcode    int
			forwards bool
		}{qt, dns.RcodeRefused, false})
	}
	for _, tc := range types {
		for _, name := range []string{"pypi.org.", "data-to-leak.example.com."} {
			up.set(up.answer)
			resp := tp.ask(t, query(name, tc.qtype))
			what := fmt.Sprintf("%s %s", dns.Type(tc.qtype), name)
			if resp.Rcode != tc.rcode {
				t.Errorf("%s: rcode %s, want %s", what, dns.RcodeToString[resp.Rcode], dns.RcodeToString[tc.rcode])
			}
			if qs := up.questions(); tc.forwards != (len(qs) == 1) || len(qs) > 1 {
				t.Errorf("%s: upstream asked %v (forwarding wanted: %v)", what, qs, tc.forwards)
			}
			if !tc.forwards && len(resp.Answer) > 0 {
				t.Errorf("%s: answered %v", what, resp.Answer)
			}
		}
	}
	if got := tp.admittedAddrs(); len(got) != 2 {
		t.Errorf("admitted %v, want the two A answers' addresses", got)
	}
	// Not class IN, not a plain query, not permitted.
	for _, tc := range []struct {
		what  string
		msg   func() *dns.Msg
		rcode int
	}{
		{"class CHAOS", func() *dns.Msg { m := query("pypi.org.", dns.TypeA); m.Question[0].Qclass = dns.ClassCHAOS; return m }, dns.RcodeRefused},
		{"class ANY", func() *dns.Msg { m := query("pypi.org.", dns.TypeA); m.Question[0].Qclass = dns.ClassANY; return m }, dns.RcodeRefused},
		{"opcode NOTIFY", func() *dns.Msg { m := query("pypi.org.", dns.TypeA); m.Opcode = dns.OpcodeNotify; return m }, dns.RcodeNotImplemented},
		{"opcode UPDATE", func() *dns.Msg { m := query("pypi.org.", dns.TypeA); m.Opcode = dns.OpcodeUpdate; return m }, dns.RcodeNotImplemented},
		{"a response", func() *dns.Msg { m := query("pypi.org.", dns.TypeA); m.Response = true; return m }, dns.RcodeNotImplemented},
		{"two questions", func() *dns.Msg {
			m := query("pypi.org.", dns.TypeA)
			m.Question = append(m.Question, dns.Question{Name: "files.pythonhosted.org.", Qtype: dns.TypeA, Qclass: dns.ClassINET})
			return m
		}, dns.RcodeNotImplemented},
		{"no question", func() *dns.Msg { m := query("pypi.org.", dns.TypeA); m.Question = nil; return m }, dns.RcodeNotImplemented},
		{"not permitted", func() *dns.Msg { return query("secret.evil.net.", dns.TypeA) }, dns.RcodeRefused},
		{"denied", func() *dns.Msg { return query("evil.example.com.", dns.TypeA) }, dns.RcodeRefused},
	} {
		up.set(up.answer)
		if resp := tp.ask(t, tc.msg()); resp.Rcode != tc.rcode {
			t.Errorf("%s: rcode %s, want %s", tc.what, dns.RcodeToString[resp.Rcode], dns.RcodeToString[tc.rcode])
		}
		if qs := up.questions(); len(qs) != 0 {
			t.Errorf("%s: upstream asked %v", tc.what, qs)
		}
	}
	// A query from an address that is no sandbox's is refused.
	w := &fakeWriter{remote: &net.UDPAddr{IP: net.IPv4(10, 77, 0, 10), Port: 1}}
	tp.ServeDNS(w, query("pypi.org.", dns.TypeA))
	if w.msg == nil || w.msg.Rcode != dns.RcodeRefused || len(up.questions()) != 0 {
		t.Errorf("query from a stranger: %v, upstream asked %v", w.msg, up.questions())
	}
}

// TestDNSForwardsOnlyNameAndType checks that nothing but the lower-cased
// name and the type of a sandbox's query reaches the upstream, and that
// the sandbox gets its own ID and question back.
func TestDNSForwardsOnlyNameAndType(t *testing.T) {
	up := newFakeUpstream(t)
	tp := newTestProxy(t, testPolicy(t), up.addr, nil)
	up.set(func(q dns.Question, m *dns.Msg) { m.Answer = rrs(t, "pypi.org. 60 IN A 151.101.0.223") })
	r := query("PyPI.Org.", dns.TypeA)
	r.Id = 4242
	r.CheckingDisabled = true
	r.AuthenticatedData = true
	r.Zero = true
	r.SetEdns0(4096, true)
	opt := r.IsEdns0()
	opt.Option = append(opt.Option,
		&dns.EDNS0_SUBNET{Code: dns.EDNS0SUBNET, Family: 1, SourceNetmask: 32, Address: net.IPv4(1, 2, 3, 4)},
		&dns.EDNS0_LOCAL{Code: 65001, Data: []byte("secret-data-in-an-option")},
		&dns.EDNS0_PADDING{Padding: []byte("secret-data-in-padding")},
		&dns.EDNS0_COOKIE{Code: dns.EDNS0COOKIE, Cookie: "0102030405060708"})
	resp := tp.ask(t, r)

	up.mu.Lock()
	asked := up.asked
	up.mu.Unlock()
	if len(asked) != 1 {
		t.Fatalf("upstream got %d queries", len(asked))
	}
	got := asked[0]
	if q := got.Question; len(q) != 1 || q[0].Name != "pypi.org." || q[0].Qtype != dns.TypeA || q[0].Qclass != dns.ClassINET {
		t.Errorf("upstream question %v", q)
	}
	if got.CheckingDisabled || got.AuthenticatedData || got.Zero || !got.RecursionDesired {
		t.Errorf("upstream flags from the sandbox: %+v", got.MsgHdr)
	}
	if o := got.IsEdns0(); o == nil || len(o.Option) != 0 || o.Do() || o.UDPSize() != upstreamUDPSize {
		t.Errorf("upstream OPT %v", o)
	}
	if len(got.Answer)+len(got.Ns) != 0 || len(got.Extra) != 1 {
		t.Errorf("upstream query carries records: %v %v %v", got.Answer, got.Ns, got.Extra)
	}
	if resp.Id != 4242 || len(resp.Question) != 1 || resp.Question[0].Name != "PyPI.Org." {
		t.Errorf("reply id %d question %v", resp.Id, resp.Question)
	}
	if len(resp.Answer) != 1 || resp.IsEdns0() == nil {
		t.Errorf("reply %v", resp)
	}

	// Without EDNS the sandbox gets no OPT record and at most 512 bytes.
	up.set(func(q dns.Question, m *dns.Msg) {
		for i := 1; i <= 40; i++ { // 986 bytes uncompressed, as the fake sends it
			m.Answer = append(m.Answer, rrs(t, fmt.Sprintf("pypi.org. 60 IN A 151.101.1.%d", i))...)
		}
	})
	w := sandboxWriter()
	tp.ServeDNS(w, query("pypi.org.", dns.TypeA))
	if w.msg == nil || w.msg.IsEdns0() != nil || len(w.packed) > dns.MinMsgSize || !w.msg.Truncated {
		t.Errorf("reply without EDNS: %d bytes, truncated %v, OPT %v: %v", len(w.packed), w.msg.Truncated, w.msg.IsEdns0(), w.msg)
	}
}

// TestDNSWildcardLimits checks the bounds on what a sandbox chooses of a
// name under a wildcard.
func TestDNSWildcardLimits(t *testing.T) {
	up := newFakeUpstream(t)
	long := strings.Repeat("e", 60) + ".example.com."
	p, err := Compile([]string{"*.example.com", strings.TrimSuffix(long, ".")}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	tp := newTestProxy(t, p, up.addr, nil)
	l := func(n int) string { return strings.Repeat("a", n) }
	for name, fwd := range map[string]bool{
		"x.example.com.":                                                 true,
		l(maxWildLabel) + ".example.com.":                                true,
		l(maxWildLabel+1) + ".example.com.":                              false,
		l(63) + ".example.com.":                                          false,
		l(31) + "." + l(32) + ".example.com.":                            true, // 64
		l(31) + "." + l(33) + ".example.com.":                            false,
		l(20) + "." + l(20) + "." + l(20) + "." + l(1) + ".example.com.": true, // 64
		l(20) + "." + l(20) + "." + l(20) + "." + l(2) + ".example.com.": false,
		long:                         true, // named exactly
		"X." + strings.ToUpper(long): false,
		"a_b.example.com.":           false,
		`a\000b.example.com.`:        false,
		`a\.b.example.com.`:          false,
		"-a.example.com.":            false,
		"a..example.com.":            false,
	} {
		up.set(nil)
		resp := tp.ask(t, query(name, dns.TypeA))
		if qs := up.questions(); fwd != (len(qs) == 1) {
			t.Errorf("%s: upstream asked %v, forwarding wanted: %v", name, qs, fwd)
		}
		if want := map[bool]int{true: dns.RcodeSuccess, false: dns.RcodeRefused}[fwd]; resp.Rcode != want {
			t.Errorf("%s: rcode %s", name, dns.RcodeToString[resp.Rcode])
		}
	}
}

func TestAnswerAddrsChainBound(t *testing.T) {
	loop := rrs(t, "a.example.com. 1 IN CNAME b.example.com.", "b.example.com. 1 IN CNAME A.example.com.")
	if chain, addrs, _ := answerAddrs("a.example.com.", loop); len(chain) != 2 || len(addrs) != 0 {
		t.Errorf("loop: chain %v addrs %v", chain, addrs)
	}
	var long []dns.RR
	for i := 0; i < 100; i++ {
		long = append(long, rrs(t, fmt.Sprintf("n%d.example.com. 1 IN CNAME n%d.example.com.", i, i+1))...)
	}
	if chain, _, _ := answerAddrs("n0.example.com.", long); len(chain) != maxChain+1 {
		t.Errorf("chain of %d names, want %d", len(chain), maxChain+1)
	}
	self := rrs(t, "a.example.com. 1 IN CNAME a.example.com.", "a.example.com. 7 IN A 1.2.3.4", "a.example.com. 5 IN A 1.2.3.4")
	if chain, addrs, ttl := answerAddrs("A.example.com", self); len(chain) != 1 || len(addrs) != 1 || ttl != 5 {
		t.Errorf("self-alias: chain %v addrs %v ttl %d", chain, addrs, ttl)
	}
}

// rawUpstream answers every UDP query on 127.0.0.1 with the bytes the
// fuzzer chose, under the query's ID and without the TC bit (which would
// send the client to TCP, where nothing listens).
type rawUpstream struct {
	addr string
	mu   sync.Mutex
	resp []byte
	hits int
}

func newRawUpstream(f *testing.F) *rawUpstream {
	pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		f.Fatal(err)
	}
	u := &rawUpstream{addr: pc.LocalAddr().String()}
	go func() {
		buf := make([]byte, 65535)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			u.mu.Lock()
			u.hits++
			out := slices.Clone(u.resp)
			u.mu.Unlock()
			if n >= 2 && len(out) >= 2 {
				out[0], out[1] = buf[0], buf[1]
			}
			if len(out) >= 3 {
				out[2] &^= 0x02
			}
			_, _ = pc.WriteTo(out, from)
		}
	}()
	f.Cleanup(func() { pc.Close() })
	return u
}

func packed(f *testing.F, m *dns.Msg) []byte {
	b, err := m.Pack()
	if err != nil {
		f.Fatal(err)
	}
	return b
}

// FuzzDNSProxy feeds the proxy a query from a sandbox and an answer from
// the upstream, both as bytes off the wire. Nothing may panic; whatever is
// admitted must pass the filter and be an A record's address; and only an
// A or CNAME query for a permitted name may reach the upstream.
func FuzzDNSProxy(f *testing.F) {
	up := newRawUpstream(f)
	p, err := Compile([]string{"pypi.org", "*.example.com"}, []string{"evil.example.com"}, nil)
	if err != nil {
		f.Fatal(err)
	}
	var admitted []netip.Addr
	f2 := newAddrFilter(netip.MustParsePrefix("10.77.0.0/16"), nil, nil)
	f2.setHost(hostExclusions([]ifAddr{{netip.MustParsePrefix("93.184.215.14/24"), "eth0"}}))
	d := &dnsProxy{
		policyFor: func(netip.Addr) *Policy { return p },
		admit: func(_ netip.Addr, _ string, addrs []netip.Addr, _ []Ports, _ time.Duration) error {
			admitted = append(admitted, addrs...)
			return nil
		},
		filter: f2, upstreams: []string{up.addr}, log: slog.New(slog.DiscardHandler),
		client: &dns.Client{Timeout: 500 * time.Millisecond},
	}

	ans := func(q string, qt uint16, records ...string) []byte {
		m := new(dns.Msg)
		m.SetQuestion(q, qt)
		m.Response = true
		for _, s := range records {
			rr, err := dns.NewRR(s)
			if err != nil {
				f.Fatal(err)
			}
			m.Answer = append(m.Answer, rr)
		}
		return packed(f, m)
	}
	qA := packed(f, query("pypi.org.", dns.TypeA))
	f.Add(qA, ans("pypi.org.", dns.TypeA, "pypi.org. 60 IN A 151.101.0.223", "evil.net. 60 IN A 1.2.3.4", "pypi.org. 60 IN A 10.0.0.1"))
	f.Add(packed(f, query("a.example.com.", dns.TypeA)), ans("a.example.com.", dns.TypeA,
		"a.example.com. 60 IN CNAME b.cdn.net.", "b.cdn.net. 60 IN CNAME a.example.com.", "b.cdn.net. 60 IN A 151.101.1.1"))
	f.Add(packed(f, query("a.example.com.", dns.TypeCNAME)), ans("a.example.com.", dns.TypeCNAME, "a.example.com. 60 IN CNAME evil.example.com."))
	f.Add(packed(f, query("pypi.org.", dns.TypeTXT)), ans("pypi.org.", dns.TypeTXT, `pypi.org. 60 IN TXT "x"`))
	f.Add(packed(f, query("pypi.org.", dns.TypeANY)), []byte{})
	e := query("PYPI.org.", dns.TypeA)
	e.SetEdns0(512, true)
	f.Add(packed(f, e), ans("pypi.org.", dns.TypeA, "pypi.org. 60 IN A 8.8.8.8"))
	// A compression pointer to itself in the answer; a truncated message.
	f.Add(qA, append(ans("pypi.org.", dns.TypeA)[:7], 1, 0, 0, 0, 0, 4, 'p', 'y', 'p', 'i', 3, 'o', 'r', 'g', 0, 0, 1, 0, 1, 0xc0, 26, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4, 1, 2, 3, 4))
	f.Add(qA, []byte{0, 0, 0x81, 0x80, 0, 1, 0, 5})
	f.Add([]byte{0, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0xc0, 12, 0, 1, 0, 1}, []byte{})

	f.Fuzz(func(t *testing.T, q, a []byte) {
		if len(a) > 4096 {
			return
		}
		var r dns.Msg
		if r.Unpack(q) != nil {
			return
		}
		up.mu.Lock()
		up.resp, up.hits = a, 0
		up.mu.Unlock()
		admitted = admitted[:0]
		w := sandboxWriter()
		d.ServeDNS(w, &r)
		up.mu.Lock()
		hits := up.hits
		up.mu.Unlock()
		if hits > 0 {
			if len(r.Question) != 1 {
				t.Fatalf("query of %d questions reached the upstream", len(r.Question))
			}
			q := r.Question[0]
			_, ok := p.Match(q.Name)
			if q.Qtype != dns.TypeA && q.Qtype != dns.TypeCNAME || q.Qclass != dns.ClassINET || !ok {
				t.Fatalf("query %v reached the upstream", q)
			}
		}
		for _, ip := range admitted {
			if !ip.Is4() || !globalUnicast(ip) || ip == netip.MustParseAddr("93.184.215.14") {
				t.Fatalf("admitted %s", ip)
			}
		}
		if w.msg == nil {
			t.Fatal("no reply")
		}
	})
}

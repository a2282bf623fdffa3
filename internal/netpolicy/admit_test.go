package netpolicy

import (
	"errors"
	"net/netip"
	"slices"
	"testing"

	"github.com/dsecproject/dsec/internal/errdefs"
)

func TestGlobalUnicast(t *testing.T) {
	for s, want := range map[string]bool{
		// Globally routable.
		"1.1.1.1": true, "8.8.8.8": true, "151.101.0.223": true, "93.184.215.14": true,
		"100.63.255.255": true, "100.128.0.0": true, "172.15.255.255": true, "172.32.0.0": true,
		"192.0.1.255": true, "192.0.3.0": true, "192.88.98.255": true, "192.169.0.0": true,
		"198.17.255.255": true, "198.20.0.0": true, "223.255.255.255": true,
		"2606:4700::1111": true, "2a00:1450:4001:80b::200e": true, "2001:200::1": true,
		"::ffff:8.8.8.8": true,
		// This network, RFC 1918, CGNAT, loopback, link-local.
		"0.0.0.0": false, "0.1.2.3": false, "10.0.0.1": false, "10.200.0.6": false,
		"100.64.0.1": false, "100.127.255.254": false, "127.0.0.1": false, "127.1.2.3": false,
		"169.254.169.254": false, "172.16.0.1": false, "172.31.255.255": false,
		"192.168.1.1": false,
		// IETF, documentation, 6to4 relay, benchmarking.
		"192.0.0.8": false, "192.0.0.9": false, "192.0.2.1": false, "192.88.99.1": false,
		"198.18.0.1": false, "198.19.255.255": false, "198.51.100.7": false, "203.0.113.9": false,
		// Multicast, reserved, broadcast.
		"224.0.0.251": false, "239.255.255.250": false, "240.0.0.1": false, "255.255.255.254": false,
		"255.255.255.255": false,
		// IPv6 specials.
		"::": false, "::1": false, "::ffff:10.0.0.1": false, "::ffff:127.0.0.1": false,
		"::ffff:169.254.169.254": false, "::ffff:0.0.0.0": false, "64:ff9b::808:808": false,
		"64:ff9b:1::1": false, "100::1": false, "2001::1": false, "2001:1ff::1": false,
		"2001:db8::1": false, "2002:808:808::1": false, "3fff::1": false, "5f00::1": false,
		"fc00::1": false, "fd12:3456::1": false, "fe80::1": false, "fec0::1": false,
		"ff02::1": false, "ff05::2": false, "::1.2.3.4": false, "4000::1": false,
		"fe80::1%eth0": false,
	} {
		if got := globalUnicast(netip.MustParseAddr(s)); got != want {
			t.Errorf("globalUnicast(%s) = %v, want %v", s, got, want)
		}
	}
	if globalUnicast(netip.Addr{}) {
		t.Error("the zero Addr is global")
	}
	// Every table entry is excluded at both of its ends.
	if a, b := lastAddr(netip.MustParsePrefix("240.0.0.0/4")), lastAddr(netip.MustParsePrefix("2001:db8::/32")); a.String() != "255.255.255.255" || b.String() != "2001:db8:ffff:ffff:ffff:ffff:ffff:ffff" {
		t.Fatalf("lastAddr: %s %s", a, b)
	}
	for _, p := range nonGlobal {
		for _, a := range []netip.Addr{p.Addr(), lastAddr(p)} {
			if globalUnicast(a) {
				t.Errorf("%s (in %s) is global", a, p)
			}
		}
	}
}

// lastAddr is the highest address of p.
func lastAddr(p netip.Prefix) netip.Addr {
	b := p.Masked().Addr().As16()
	bits := p.Bits()
	if p.Addr().Is4() {
		bits += 96
	}
	for i := bits; i < 128; i++ {
		b[i/8] |= 0x80 >> (i % 8)
	}
	a := netip.AddrFrom16(b)
	if p.Addr().Is4() {
		a = a.Unmap()
	}
	return a
}

func TestAddrFilter(t *testing.T) {
	f := newAddrFilter(netip.MustParsePrefix("10.77.0.0/16"), []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")},
		[]netip.Prefix{netip.MustParsePrefix("10.5.6.0/24"), netip.MustParsePrefix("151.101.64.10/32")})
	f.setHost(hostExclusions([]ifAddr{
		{netip.MustParsePrefix("93.184.215.14/24"), "eth0"},
		{netip.MustParsePrefix("2a01:4f8::2/64"), ""},
		{netip.MustParsePrefix("10.88.0.5/30"), "ds0abcd00001"}, // another instance's sandbox
		{netip.MustParsePrefix("10.88.0.1/32"), "lo:ds0abcd"},   // and its DNS address
	}))
	for s, want := range map[string]bool{
		"151.101.0.223": true, "93.184.215.15": true, "10.5.5.5": true, "10.88.0.9": true,
		"93.184.215.14": false, "::ffff:93.184.215.14": false, "2a01:4f8::2": false,
		"10.88.0.4": false, "10.88.0.6": false, "10.88.0.7": false, "10.88.0.1": false,
		"10.77.0.6": false, "10.77.255.254": false, "10.200.0.6": false, "::ffff:10.200.0.6": false,
		"172.16.0.1": false, "100.64.0.1": false, "127.0.0.1": false, "169.254.169.254": false,
		// Denied ranges: never, opened private range or global address alike.
		"10.5.6.7": false, "::ffff:10.5.6.7": false, "151.101.64.10": false, "151.101.64.11": true,
	} {
		if got := f.admits(netip.MustParseAddr(s)); got != want {
			t.Errorf("admits(%s) = %v, want %v", s, got, want)
		}
	}
	// Without a private range opened, no private address passes.
	g := newAddrFilter(DefaultPool, nil, nil)
	for _, s := range []string{"10.5.5.5", "192.168.0.1", "100.100.100.100"} {
		if g.admits(netip.MustParseAddr(s)) {
			t.Errorf("admits(%s) without AdmitPrivate", s)
		}
	}
	if len(g.pools) != 1 {
		t.Errorf("pools %v: DefaultPool twice", g.pools)
	}
}

func TestHostExclusions(t *testing.T) {
	pfx := netip.MustParsePrefix
	got := hostExclusions([]ifAddr{
		{pfx("192.168.1.20/24"), "eth0"},
		{pfx("127.0.0.1/8"), "lo"},
		{pfx("10.200.0.1/32"), "lo:ds1a2b3"},
		{pfx("10.200.0.5/30"), "ds1a2b300001"},
		{pfx("10.9.0.1/8"), "ds1a2b300002"}, // not dsec's /30 layout
		{pfx("10.201.0.9/30"), "dsother"},
		{pfx("fe80::1/64"), ""},
		{netip.Prefix{}, "eth9"},
	})
	want := []netip.Prefix{
		pfx("192.168.1.20/32"), pfx("127.0.0.1/32"), pfx("10.200.0.1/32"), pfx("10.200.0.4/30"),
		pfx("10.9.0.1/32"), pfx("10.201.0.9/32"), pfx("fe80::1/128"),
	}
	if !slices.Equal(got, want) {
		t.Errorf("hostExclusions = %v, want %v", got, want)
	}
}

func TestCheckDeny(t *testing.T) {
	for s, ok := range map[string]bool{
		"10.0.0.11/32": true, "10.0.0.0/24": true, "203.0.113.0/24": true, "0.0.0.0/0": true,
		"10.0.0.11/24": false, "fd00::/8": false, "::ffff:10.0.0.1/128": false,
	} {
		err := CheckDeny(netip.MustParsePrefix(s))
		if (err == nil) != ok || err != nil && !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("CheckDeny(%s) = %v", s, err)
		}
	}
	for _, d := range []string{"10.0.0.11/24", "10.200.3.0/24", "10.0.0.0/8"} {
		if _, err := New(Config{Instance: "abcde", Pool: DefaultPool, Deny: []netip.Prefix{netip.MustParsePrefix(d)}}); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("New with Deny %s: %v", d, err)
		}
	}
}

func TestCheckAdmitPrivate(t *testing.T) {
	for s, ok := range map[string]bool{
		"10.0.0.0/8": true, "10.251.7.0/24": true, "172.20.0.0/16": true, "192.168.5.0/24": true,
		"100.64.0.0/10": true, "10.1.2.3/32": true,
		"0.0.0.0/0": false, "127.0.0.0/8": false, "169.254.0.0/16": false, "8.8.8.0/24": false,
		"10.1.2.3/24": false, "172.0.0.0/8": false, "fd00::/8": false, "224.0.0.0/4": false,
	} {
		err := CheckAdmitPrivate(netip.MustParsePrefix(s))
		if (err == nil) != ok || err != nil && !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("CheckAdmitPrivate(%s) = %v", s, err)
		}
	}
	_, err := New(Config{Instance: "abcde", Pool: DefaultPool, AdmitPrivate: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}})
	if !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("New with AdmitPrivate 127/8: %v", err)
	}
}

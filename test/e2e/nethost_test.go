package e2e

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/miekg/dns"
	"github.com/vishvananda/netns"
)

// The network tests' outside world, all on this machine: a network
// namespace "dsec-e2e-<pid>" joined to the host by a veth (host side
// 10.251.N.1/24) whose side holds 10.251.N.2 ("pypi.e2e.test") and
// 10.251.N.3 ("npm.e2e.test") and 10.251.N.4 ("ctl.e2e.test", standing
// for the cluster's control plane, which dsec up is told sandboxes never
// reach), with HTTP servers on port 80 of each, a
// line-counting TCP server on 10.251.N.3:9000 and a datagram counter on
// 10.251.N.3:9001; a DNS server on 127.0.0.1 that knows those two names and
// records every name it is asked; and an HTTP server on the host itself
// (all addresses), which sandboxes must never reach. dsec up is told to use
// that DNS server upstream and presets "pypi"/"npm" that name the hosts.
//
// N, the names and the daemon's sandbox pool (10.N.0.0/16) derive from the
// test process's pid, so that two runs of the suite on one machine (a
// developer's and a helper's) do not take each other's world down.
var (
	netN      = 100 + os.Getpid()%90
	netNS     = fmt.Sprintf("dsec-e2e-%d", os.Getpid())
	netHostIf = fmt.Sprintf("dxe%d", os.Getpid())
	netPool   = fmt.Sprintf("10.%d.0.0/16", netN)
	netSubnet = fmt.Sprintf("10.251.%d", netN)
	hostAddr  = netSubnet + ".1"
	pypiAddr  = netSubnet + ".2"
	npmAddr   = netSubnet + ".3"
	// ctlAddr stands for the cluster's control plane (etcd, apiservers):
	// dsec up is told no sandbox may reach it (--sandbox-deny).
	ctlAddr = netSubnet + ".4"
)

const (
	pypiName = "pypi.e2e.test"
	npmName  = "npm.e2e.test"
	ctlName  = "ctl.e2e.test"
	probeRef = "toolkit/netprobe:v1"
	probe    = "/opt/netprobe"
)

var netw struct {
	skip      string
	dnsAddr   string
	hostPort  int // the host-only HTTP server's port
	streamed  atomic.Int64
	datagrams atomic.Int64
	mu        sync.Mutex
	queried   []string
	closers   []func()
}

// netSetup builds the outside world and returns the dsec up flags that
// point at it. On a machine that cannot (no nft, no ip) the network tests
// skip with the reason and dsec runs without networking.
func netSetup() []string {
	for _, tool := range []string{"nft", "ip"} {
		if _, err := exec.LookPath(tool); err != nil {
			netw.skip = "needs " + tool + " (apt-get install nftables iproute2)"
			return []string{"--network", "off"}
		}
	}
	if err := buildNetWorld(); err != nil {
		netw.skip = "could not build the test network: " + err.Error()
		netTeardown()
		return []string{"--network", "off"}
	}
	presets := map[string]any{
		"pypi": map[string]any{"domains": []string{pypiName}, "ports": []string{"80/tcp"}},
		"npm":  map[string]any{"domains": []string{npmName}, "ports": []string{"80/tcp"}},
	}
	b, _ := json.Marshal(presets)
	pf := filepath.Join(workDir, "presets.json")
	if err := os.WriteFile(pf, b, 0o644); err != nil {
		netw.skip = err.Error()
		return []string{"--network", "off"}
	}
	// The world's addresses are private: the proxy admits them only
	// because this range is opened.
	return []string{"--network", "on", "--sandbox-cidr", netPool, "--dns-upstream", netw.dnsAddr, "--net-presets", pf,
		"--dns-admit-private", netSubnet + ".0/24", "--sandbox-deny", ctlAddr + "," + ctlAddr + "/32"} // a repeat: ranges overlap in practice
}

func run1(name string, args ...string) error {
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %v: %s", name, strings.Join(args, " "), err, out)
	}
	return nil
}

func buildNetWorld() error {
	// Leftovers of interrupted runs: worlds whose test process is gone.
	old, _ := filepath.Glob("/run/netns/dsec-e2e-*")
	for _, p := range old {
		pid := strings.TrimPrefix(filepath.Base(p), "dsec-e2e-")
		if _, err := os.Stat("/proc/" + pid); err != nil || pid == strconv.Itoa(os.Getpid()) {
			_ = exec.Command("ip", "netns", "del", filepath.Base(p)).Run()
			_ = exec.Command("ip", "link", "del", "dxe"+pid).Run()
		}
	}
	_ = exec.Command("ip", "link", "del", netHostIf).Run()
	for _, c := range [][]string{
		{"netns", "add", netNS},
		{"link", "add", netHostIf, "type", "veth", "peer", "name", "eth0", "netns", netNS},
		{"addr", "add", hostAddr + "/24", "dev", netHostIf},
		{"link", "set", netHostIf, "up"},
		{"-n", netNS, "addr", "add", pypiAddr + "/24", "dev", "eth0"},
		{"-n", netNS, "addr", "add", npmAddr + "/24", "dev", "eth0"},
		{"-n", netNS, "addr", "add", ctlAddr + "/24", "dev", "eth0"},
		{"-n", netNS, "link", "set", "eth0", "up"},
		{"-n", netNS, "link", "set", "lo", "up"},
	} {
		if err := run1("ip", c...); err != nil {
			return err
		}
	}
	netw.closers = append(netw.closers, func() {
		_ = exec.Command("ip", "netns", "del", netNS).Run()
		_ = exec.Command("ip", "link", "del", netHostIf).Run()
	})
	// Listeners are opened from a thread inside the namespace; the
	// sockets stay there after the thread leaves.
	var lns []net.Listener
	var pc net.PacketConn
	err := inNS(netNS, func() error {
		for _, a := range []string{pypiAddr + ":80", npmAddr + ":80", npmAddr + ":9000", ctlAddr + ":80"} {
			ln, err := net.Listen("tcp4", a)
			if err != nil {
				return err
			}
			lns = append(lns, ln)
		}
		var err error
		pc, err = net.ListenPacket("udp4", npmAddr+":9001")
		return err
	})
	if err != nil {
		return err
	}
	for _, h := range []struct {
		name string
		ln   net.Listener
	}{{"pypi", lns[0]}, {"npm", lns[1]}, {"the control plane", lns[3]}} {
		srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			fmt.Fprintf(w, "hello from %s", h.name)
		})}
		go srv.Serve(h.ln)
		netw.closers = append(netw.closers, func() { srv.Close() })
	}
	go func() {
		for {
			c, err := lns[2].Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				sc := bufio.NewScanner(c)
				for sc.Scan() {
					netw.streamed.Add(1)
				}
			}()
		}
	}()
	netw.closers = append(netw.closers, func() { lns[2].Close(); pc.Close() })
	go func() {
		buf := make([]byte, 2048)
		for {
			if _, _, err := pc.ReadFrom(buf); err != nil {
				return
			}
			netw.datagrams.Add(1)
		}
	}()

	// A service on the host itself, on every address.
	hl, err := net.Listen("tcp4", "0.0.0.0:0")
	if err != nil {
		return err
	}
	netw.hostPort = hl.Addr().(*net.TCPAddr).Port
	hs := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, "host secret") })}
	go hs.Serve(hl)
	netw.closers = append(netw.closers, func() { hs.Close() })

	// The upstream DNS server.
	upc, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		return err
	}
	netw.dnsAddr = upc.LocalAddr().String()
	ds := &dns.Server{PacketConn: upc, Handler: dns.HandlerFunc(func(w dns.ResponseWriter, r *dns.Msg) {
		m := new(dns.Msg)
		m.SetReply(r)
		if len(r.Question) == 1 {
			q := r.Question[0]
			netw.mu.Lock()
			netw.queried = append(netw.queried, strings.ToLower(q.Name))
			netw.mu.Unlock()
			ip := map[string]string{pypiName + ".": pypiAddr, npmName + ".": npmAddr, ctlName + ".": ctlAddr}[strings.ToLower(q.Name)]
			switch {
			case ip == "":
				m.Rcode = dns.RcodeNameError
			case q.Qtype == dns.TypeA:
				rr, _ := dns.NewRR(q.Name + " 30 IN A " + ip)
				m.Answer = append(m.Answer, rr)
			}
		}
		_ = w.WriteMsg(m)
	})}
	go ds.ActivateAndServe()
	netw.closers = append(netw.closers, func() { ds.Shutdown() })
	return nil
}

// netTeardown removes the outside world and what the daemon left on the
// host for its pool (its nftables table and DNS address), which a real
// edge keeps across restarts.
func netTeardown() {
	for i := len(netw.closers) - 1; i >= 0; i-- {
		netw.closers[i]()
	}
	netw.closers = nil
	if d != nil {
		abs, _ := filepath.Abs(d.stateDir)
		sum := sha256.Sum256([]byte(abs))
		inst := hex.EncodeToString(sum[:3])[:5]
		_ = exec.Command("nft", "delete", "table", "inet", "dsec_"+inst).Run()
		_ = exec.Command("ip", "addr", "del", fmt.Sprintf("10.%d.0.1/32", netN), "dev", "lo").Run()
	}
}

// upstreamSaw reports whether the upstream DNS server was asked name.
func upstreamSaw(name string) bool {
	netw.mu.Lock()
	defer netw.mu.Unlock()
	for _, q := range netw.queried {
		if strings.TrimSuffix(q, ".") == name {
			return true
		}
	}
	return false
}

// inNS runs fn on a thread inside the named network namespace.
func inNS(name string, fn func() error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	orig, err := netns.Get()
	if err != nil {
		return err
	}
	defer orig.Close()
	ns, err := netns.GetFromName(name)
	if err != nil {
		return err
	}
	defer ns.Close()
	if err := netns.Set(ns); err != nil {
		return err
	}
	ferr := fn()
	if err := netns.Set(orig); err != nil {
		panic("cannot return to the host network namespace: " + err.Error())
	}
	return ferr
}

// buildProbeLayer builds netprobe (static) into a toolkit layer.
func buildProbeLayer() error {
	dir := filepath.Join(workDir, "probe", "opt")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	build := exec.Command("go", "build", "-o", filepath.Join(dir, "netprobe"), "./testdata/netprobe")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		return fmt.Errorf("building netprobe: %v: %s", err, out)
	}
	// The same tree is also DSec's listing's "toolkit/harness:v1", and the
	// e2e workspace its "workspace/t1:v1" (sdk/python's listing test).
	for _, l := range []struct{ kind, name, dir string }{
		{"toolkit", "netprobe", filepath.Dir(dir)}, {"toolkit", "harness", filepath.Dir(dir)},
		{"workspace", "t1", filepath.Join(workDir, "ws")},
	} {
		out, errOut, code := cli("layer", "build", "--kind", l.kind, "--name", l.name, "--tag", "v1", l.dir)
		if code != 0 {
			return fmt.Errorf("layer build %s/%s: exit %d: %s %s", l.kind, l.name, code, out, errOut)
		}
	}
	return nil
}

package e2e

import (
	"fmt"
	"io"
	"net/http"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

func needNet(t *testing.T) {
	t.Helper()
	needDaemon(t)
	if netw.skip != "" {
		t.Skip(netw.skip)
	}
}

// netSandbox creates a sandbox with netprobe and the given policy.
func netSandbox(t *testing.T, allow, deny []string) *api.Sandbox {
	t.Helper()
	spec := api.SandboxSpec{Toolkits: []string{probeRef}}
	if allow != nil || deny != nil {
		spec.Network = &api.NetworkPolicy{Allow: allow, Deny: deny}
	}
	return newSandbox(t, spec)
}

// probeRun runs netprobe in a sandbox and returns its output and exit code.
func probeRun(t *testing.T, id string, args ...string) (string, int) {
	t.Helper()
	res, err := client.Exec(ctx(t), id, api.ExecRequest{Argv: append([]string{probe}, args...), Timeout: 60})
	if err != nil {
		t.Fatalf("netprobe %v: %v", args, err)
	}
	return res.Stdout + res.Stderr, res.ExitCode
}

// mustReach and mustNotReach assert what a probe gets.
func mustReach(t *testing.T, id string, want string, args ...string) {
	t.Helper()
	out, code := probeRun(t, id, args...)
	if code != 0 || !strings.Contains(out, want) {
		t.Fatalf("netprobe %v = %d %q, want success with %q", args, code, out, want)
	}
}

func mustNotReach(t *testing.T, id string, args ...string) string {
	t.Helper()
	start := time.Now()
	out, code := probeRun(t, id, args...)
	if code == 0 {
		t.Fatalf("CONTAINMENT FAILURE: netprobe %v succeeded: %q", args, out)
	}
	t.Logf("netprobe %v refused in %v: %s", args, time.Since(start).Round(time.Millisecond), strings.TrimSpace(out))
	return out
}

// sandboxIP returns the sandbox's eth0 address ("" if it has none).
func sandboxIP(t *testing.T, id string) string {
	t.Helper()
	res := sh(t, id, "ip -4 -o addr show dev eth0 2>/dev/null")
	f := strings.Fields(res.Stdout)
	for i, x := range f {
		if x == "inet" && i+1 < len(f) {
			return strings.Split(f[i+1], "/")[0]
		}
	}
	return ""
}

func TestNetworkDefaultIsLoopbackOnly(t *testing.T) {
	needNet(t)
	sb := netSandbox(t, nil, nil)
	if res := sh(t, sb.ID, "ip -o link | grep -v ': lo:' | wc -l"); strings.TrimSpace(res.Stdout) != "0" {
		t.Fatalf("a sandbox without policy has interfaces besides lo: %q", res.Stdout)
	}
	mustNotReach(t, sb.ID, "dial", pypiAddr+":80")
	mustNotReach(t, sb.ID, "resolve", pypiName)
	mustNotReach(t, sb.ID, "dial", fmt.Sprintf("%s:%d", hostAddr, netw.hostPort))
	// Loopback inside works.
	sh(t, sb.ID, probe+" serve 127.0.0.1:7000 >/dev/null 2>&1 &")
	waitFor(t, func() bool { _, c := probeRun(t, sb.ID, "dial", "127.0.0.1:7000"); return c == 0 })
}

func TestNetworkPresetThroughDNSProxy(t *testing.T) {
	needNet(t)
	sb := netSandbox(t, []string{"pypi"}, nil)
	mustReach(t, sb.ID, "hello from pypi", "get", "http://"+pypiName+"/")
	// npm is not permitted: its name is refused by the proxy and its
	// address is not reachable either.
	mustNotReach(t, sb.ID, "get", "http://"+npmName+"/")
	mustNotReach(t, sb.ID, "dial", npmAddr+":80")
	// The preset admits port 80 only.
	mustNotReach(t, sb.ID, "dial", pypiAddr+":9000")
	// DNS exfiltration: a name carrying data never leaves the host.
	secret := "c2VjcmV0LWFuc3dlcg.exfil.e2e.test"
	mustNotReach(t, sb.ID, "resolve", secret)
	if upstreamSaw(secret) {
		t.Fatalf("CONTAINMENT FAILURE: upstream DNS was asked %s", secret)
	}
	// Nor can the sandbox ask another DNS server directly.
	mustNotReach(t, sb.ID, "dial", npmAddr+":53")
	before := netw.datagrams.Load()
	probeRun(t, sb.ID, "udp", npmAddr+":9001", "leak")
	time.Sleep(200 * time.Millisecond)
	if netw.datagrams.Load() != before {
		t.Fatal("CONTAINMENT FAILURE: a datagram to a non-allowed address arrived")
	}
}

func TestNetworkCIDRRulesAndDeny(t *testing.T) {
	needNet(t)
	sb := netSandbox(t, []string{netSubnet + ".0/24:80/tcp", npmAddr + ":9001/udp"}, []string{npmAddr + ":80/tcp"})
	mustReach(t, sb.ID, "hello from pypi", "get", "http://"+pypiAddr+"/")
	mustNotReach(t, sb.ID, "get", "http://"+npmAddr+"/") // deny wins
	before := netw.datagrams.Load()
	mustReach(t, sb.ID, "sent", "udp", npmAddr+":9001", "ok")
	waitFor(t, func() bool { return netw.datagrams.Load() > before })
	// The host's own address in that range is the host: closed.
	mustNotReach(t, sb.ID, "dial", fmt.Sprintf("%s:%d", hostAddr, netw.hostPort))
	mustNotReach(t, sb.ID, "dial", hostAddr+":80")
}

func TestNetworkLivePolicyChange(t *testing.T) {
	needNet(t)
	sb := netSandbox(t, nil, nil)
	mustNotReach(t, sb.ID, "dial", npmAddr+":9000")
	// Allow it live; the sandbox gets its veth now.
	if _, err := client.SetNetwork(ctx(t), sb.ID, api.NetworkPolicy{Allow: []string{npmAddr + ":9000/tcp", "npm"}}); err != nil {
		t.Fatal(err)
	}
	mustReach(t, sb.ID, "hello from npm", "get", "http://"+npmName+"/")
	got, err := client.GetSandbox(ctx(t), sb.ID)
	if err != nil || got.Spec.Network == nil || len(got.Spec.Network.Allow) != 2 {
		t.Fatalf("sandbox view does not show the new policy: %+v %v", got.Spec.Network, err)
	}
	// A connection streams; the policy is taken away mid-connection.
	sh(t, sb.ID, probe+" stream "+npmAddr+":9000 >/tmp/stream.out 2>&1 &")
	waitFor(t, func() bool { return netw.streamed.Load() > 5 })
	if _, err := client.SetNetwork(ctx(t), sb.ID, api.NetworkPolicy{}); err != nil {
		t.Fatal(err)
	}
	// Lines already in flight may still be counted (the test's reader
	// may lag on a busy host): wait until none has come for 500 ms (the
	// stream writes one every 100 ms). The last may come at most 2 s
	// after the cut, and after that none may.
	cut := time.Now()
	n := netw.streamed.Load()
	quiet := cut
	for time.Since(quiet) < 500*time.Millisecond {
		time.Sleep(50 * time.Millisecond)
		if m := netw.streamed.Load(); m != n {
			n, quiet = m, time.Now()
		}
		if quiet.Sub(cut) > 2*time.Second {
			t.Fatalf("CONTAINMENT FAILURE: lines still arrive %s after the policy was removed (%d so far)", quiet.Sub(cut).Round(time.Millisecond), n)
		}
	}
	time.Sleep(1500 * time.Millisecond)
	if m := netw.streamed.Load(); m != n {
		t.Fatalf("CONTAINMENT FAILURE: %d more lines arrived after the policy was removed", m-n)
	}
	mustNotReach(t, sb.ID, "get", "http://"+npmName+"/")
	mustNotReach(t, sb.ID, "dial", npmAddr+":80")
	t.Logf("stream cut after %d lines", n)
}

func TestNetworkIsolationFromNeighboursAndHost(t *testing.T) {
	needNet(t)
	a := netSandbox(t, []string{"0.0.0.0/0"}, nil)
	b := netSandbox(t, []string{"0.0.0.0/0"}, nil)
	ipB := sandboxIP(t, b.ID)
	if ipB == "" {
		t.Fatal("sandbox b has no address")
	}
	sh(t, b.ID, probe+" serve 0.0.0.0:8000 >/dev/null 2>&1 &")
	waitFor(t, func() bool { _, c := probeRun(t, b.ID, "dial", "127.0.0.1:8000"); return c == 0 })
	mustReach(t, a.ID, "hello from pypi", "get", "http://"+pypiAddr+"/") // 0.0.0.0/0 works
	mustNotReach(t, a.ID, "dial", ipB+":8000")                           // neighbour
	gw := sandboxIP(t, a.ID)
	gwParts := strings.Split(gw, ".")
	gwParts[3] = fmt.Sprint(atoi(gwParts[3]) - 1)
	gateway := strings.Join(gwParts, ".")
	mustNotReach(t, a.ID, "dial", fmt.Sprintf("%s:%d", gateway, netw.hostPort))  // host via gateway
	mustNotReach(t, a.ID, "dial", fmt.Sprintf("%s:%d", hostAddr, netw.hostPort)) // host via another address
	mustNotReach(t, a.ID, "dial", fmt.Sprintf("%s:%s", gateway, strings.Split(d.listen, ":")[1]))
	mustNotReach(t, a.ID, "dial", "169.254.169.254:80") // metadata
	// A port scan of the gateway and of the neighbour finds nothing and
	// ends quickly (refusals, not timeouts).
	start := time.Now()
	out, _ := probeRun(t, a.ID, "scan", gateway, "1", "200")
	if !strings.Contains(out, "open 0") {
		t.Fatalf("CONTAINMENT FAILURE: scan of the host found open ports: %s", out)
	}
	out, _ = probeRun(t, a.ID, "scan", ipB, "7990", "8010")
	if !strings.Contains(out, "open 0") {
		t.Fatalf("CONTAINMENT FAILURE: scan of a neighbour found open ports: %s", out)
	}
	t.Logf("scans of 221 ports took %v", time.Since(start).Round(time.Millisecond))
	// Sandboxes never connect to each other, whatever the policy says.
	_, err := client.SetNetwork(ctx(t), a.ID, api.NetworkPolicy{Allow: []string{ipB + ":8000/tcp"}})
	wantCode(t, err, "invalid_argument")
	// Link-local is reachable only when named explicitly.
	if _, err := client.SetNetwork(ctx(t), a.ID, api.NetworkPolicy{Allow: []string{"169.254.169.254:80/tcp"}}); err != nil {
		t.Fatal(err)
	}
}

func TestNetworkRawSocketsAndInterfaceChanges(t *testing.T) {
	needNet(t)
	sb := netSandbox(t, []string{"pypi"}, nil)
	// Raw IP sockets need CAP_NET_RAW (EPERM from the kernel); packet
	// sockets are off the seccomp profile's family list (EAFNOSUPPORT).
	out, _ := probeRun(t, sb.ID, "raw")
	if strings.Contains(out, "OPENED") || strings.Count(out, "operation not permitted") != 2 ||
		strings.Count(out, "address family not supported by protocol") != 2 {
		t.Fatalf("CONTAINMENT FAILURE: raw/packet sockets: %s", out)
	}
	for _, cmd := range []string{
		"ip addr add " + netSubnet + ".9/24 dev eth0", "ip link set eth0 down", "ip route add 10.0.0.0/8 dev eth0",
		"ip link add x type dummy", "echo 0 > /proc/sys/net/ipv4/conf/all/rp_filter",
	} {
		if res := sh(t, sb.ID, cmd); res.ExitCode == 0 {
			t.Fatalf("CONTAINMENT FAILURE: %q succeeded inside the sandbox", cmd)
		}
	}
	mustReach(t, sb.ID, "hello from pypi", "get", "http://"+pypiName+"/")
}

func TestNetworkBadInput(t *testing.T) {
	needNet(t)
	sb := netSandbox(t, nil, nil)
	for _, np := range []api.NetworkPolicy{
		{Allow: []string{"nosuchpreset"}}, {Allow: []string{"10.0.0.1/8"}}, {Allow: []string{"::/0"}},
		{Allow: []string{"1.2.3.4:99999"}}, {Deny: []string{"bad_name.com"}}, {Allow: []string{""}},
	} {
		_, err := client.SetNetwork(ctx(t), sb.ID, np)
		wantCode(t, err, "invalid_argument")
	}
	_, err := client.SetNetwork(ctx(t), "sb-local-nosuchsandbox", api.NetworkPolicy{})
	wantCode(t, err, "not_found")
	_, err = client.CreateSandbox(ctx(t), api.SandboxSpec{Base: baseRef, Network: &api.NetworkPolicy{Allow: []string{"nope"}}})
	wantCode(t, err, "invalid_argument")
	// The bad calls changed nothing.
	mustNotReach(t, sb.ID, "dial", pypiAddr+":80")
}

// TestNetworkNeverReachesDeniedRanges: the operator's --sandbox-deny
// (here standing for the cluster's control plane: etcd, apiservers) holds
// whatever a sandbox's allow list says. A range around it stops at its
// edge, an entry inside it is refused and changes nothing, and a name that
// resolves to it admits nothing.
func TestNetworkNeverReachesDeniedRanges(t *testing.T) {
	needNet(t)
	sb := netSandbox(t, []string{netSubnet + ".0/24", ctlName, "0.0.0.0/0"}, nil)
	mustReach(t, sb.ID, "hello from pypi", "get", "http://"+pypiAddr+"/")
	mustNotReach(t, sb.ID, "get", "http://"+ctlAddr+"/")
	mustNotReach(t, sb.ID, "dial", ctlAddr+":80")
	mustNotReach(t, sb.ID, "get", "http://"+ctlName+"/")
	before, err := client.ListAllSandboxes(ctx(t), dsec.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, allow := range []string{ctlAddr, ctlAddr + ":80/tcp", ctlAddr + "/32"} {
		_, err := client.CreateSandbox(ctx(t), api.SandboxSpec{Base: baseRef, Network: &api.NetworkPolicy{Allow: []string{allow}}})
		wantCode(t, err, "invalid_argument")
		if err == nil || !strings.Contains(err.Error(), "closed to sandboxes") {
			t.Errorf("create allowing %s: %v, want it to say the range is closed to sandboxes", allow, err)
		}
		_, err = client.SetNetwork(ctx(t), sb.ID, api.NetworkPolicy{Allow: []string{allow}})
		wantCode(t, err, "invalid_argument")
	}
	// The refused calls made nothing and left the sandbox's policy as it was.
	if after, err := client.ListAllSandboxes(ctx(t), dsec.ListOptions{}); err != nil || len(after) != len(before) {
		t.Fatalf("%d sandboxes after the refused creates, %d before (%v)", len(after), len(before), err)
	}
	mustReach(t, sb.ID, "hello from pypi", "get", "http://"+pypiAddr+"/")
	mustNotReach(t, sb.ID, "get", "http://"+ctlAddr+"/")
}

func TestPortProxy(t *testing.T) {
	needNet(t)
	sb := netSandbox(t, nil, nil)
	sh(t, sb.ID, probe+" serve 127.0.0.1:8080 >/dev/null 2>&1 &")
	waitFor(t, func() bool { _, c := probeRun(t, sb.ID, "dial", "127.0.0.1:8080"); return c == 0 })
	url := client.PortURL(sb.ID, 8080) + "some/path?q=1"
	req, _ := http.NewRequest("POST", url, strings.NewReader("payload"))
	req.Header.Set("Authorization", "Bearer "+d.key)
	req.Header.Set("X-Custom", "kept")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	got := string(body)
	if resp.StatusCode != 200 || !strings.HasPrefix(got, "POST /some/path?q=1") || !strings.Contains(got, "X-Custom: kept") || !strings.Contains(got, "body=payload") {
		t.Fatalf("proxied request: %d %q", resp.StatusCode, got)
	}
	if strings.Contains(got, d.key) || strings.Contains(got, "Authorization") {
		t.Fatalf("the API key was passed on to the sandbox: %q", got)
	}
	// Without a key: 401. A closed port: a clear error.
	resp, err = http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("unauthenticated proxy request: %d", resp.StatusCode)
	}
	req, _ = http.NewRequest("GET", client.PortURL(sb.ID, 8081), nil)
	req.Header.Set("Authorization", "Bearer "+d.key)
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(body), "8081") {
		t.Fatalf("closed port: %d %s", resp.StatusCode, body)
	}
	// A paused sandbox is resumed by the proxy.
	if _, err := client.Pause(ctx(t), sb.ID); err != nil {
		t.Fatal(err)
	}
	req, _ = http.NewRequest("GET", url, nil)
	req.Header.Set("Authorization", "Bearer "+d.key)
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("proxy to a paused sandbox: %d", resp.StatusCode)
	}
}

func atoi(s string) int {
	n := 0
	fmt.Sscan(s, &n)
	return n
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met within 10s")
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func TestNetworkSurvivesEdgeRestart(t *testing.T) {
	needNet(t)
	keep := netSandbox(t, []string{"pypi"}, nil)
	gone := netSandbox(t, []string{"npm"}, nil)
	mustReach(t, keep.ID, "hello from pypi", "get", "http://"+pypiName+"/")
	mustReach(t, gone.ID, "hello from npm", "get", "http://"+npmName+"/")
	d.kill9()
	// While the edge is down its rules stay in force.
	if err := d.start(); err != nil {
		t.Fatal(err)
	}
	mustReach(t, keep.ID, "hello from pypi", "get", "http://"+pypiName+"/")
	mustNotReach(t, keep.ID, "get", "http://"+npmName+"/")
	if err := client.DeleteSandbox(ctx(t), gone.ID); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("ip", "-o", "link").Output()
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(out), " ds"); n < 1 {
		t.Fatalf("the surviving sandbox lost its veth: %s", out)
	}
	mustReach(t, keep.ID, "hello from pypi", "get", "http://"+pypiName+"/")
}

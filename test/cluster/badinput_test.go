package cluster

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
)

// runFails runs dsec with args (and the cluster's common flags if common)
// and wants it to exit non-zero within 30 s, saying want.
func runFails(t *testing.T, want string, args ...string) {
	t.Helper()
	cmd := exec.Command(c.bin, args...)
	// A key in the caller's environment would be the server's --api-key.
	cmd.Env = append(os.Environ(), "DSEC_API_KEY=", "DSEC_ENDPOINT=")
	done := make(chan struct{})
	var out []byte
	var err error
	go func() { out, err = cmd.CombinedOutput(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		_ = cmd.Process.Kill()
		<-done
		t.Fatalf("dsec %s kept running: %s", strings.Join(args[:2], " "), out)
	}
	if err == nil || !strings.Contains(string(out), want) {
		t.Fatalf("dsec %s: %v, output %q; want a failure saying %q", strings.Join(args, " "), err, out, want)
	}
}

// TestBadProcesses: a second edge with a live name, an edge or server
// given another layer directory or another cluster's etcd, and a server on
// an empty etcd without --api-key all stop with a clear error, changing
// nothing.
func TestBadProcesses(t *testing.T) {
	need(t)
	dupState := filepath.Join(c.dir, "dup-state")
	runFails(t, "held by another live process", append([]string{"edge", "--listen", "127.0.0.29:" + freePort("127.0.0.29"),
		"--node-name", "e1", "--state-dir", dupState, "--sandbox-cidr", "10.253.200.0/24"}, c.common("edge")...)...)
	if _, err := os.Stat(filepath.Join(dupState, "edge")); err == nil {
		t.Errorf("the refused edge made its state dir")
	}
	if err := c.waitNodes(10*time.Second, "e1"); err != nil {
		t.Fatalf("the live e1 suffered from the refused duplicate: %v", err)
	}
	// A second edge on e1's state dir (under another name and address):
	// refused before it claims anything, e1 untouched.
	runFails(t, "is in use by process", append([]string{"edge", "--listen", "127.0.0.29:" + freePort("127.0.0.29"),
		"--node-name", "e1-again", "--state-dir", filepath.Join(c.dir, "e1"), "--sandbox-cidr", "10.253.200.0/24"}, c.common("edge")...)...)
	if err := c.waitNodes(10*time.Second, "e1"); err != nil {
		t.Fatalf("the live e1 suffered from an edge on its state dir: %v", err)
	}
	// A sandbox address pool that overlaps e1's: refused before the name
	// is claimed (pools show on the host only once a sandbox needs a route
	// out, so without the check it would start and fail creates later).
	e1Pool := ""
	for i, a := range c.edges[0].args {
		if a == "--sandbox-cidr" {
			e1Pool = c.edges[0].args[i+1]
		}
	}
	inside := strings.Replace(e1Pool, ".0/20", ".0/24", 1)
	runFails(t, "overlaps the pool of another dsec running on this host: "+e1Pool+" of node e1", append([]string{"edge", "--listen", "127.0.0.29:" + freePort("127.0.0.29"),
		"--node-name", "x8", "--state-dir", filepath.Join(c.dir, "x8"), "--sandbox-cidr", inside}, c.common("edge")...)...)
	if nodes, err := c.client.ListNodes(ctx(t)); err != nil || slices.ContainsFunc(nodes, func(n api.Node) bool { return n.Name == "x8" }) {
		t.Errorf("the refused edge is listed: %v %+v", err, nodes)
	}
	other := filepath.Join(c.dir, "other-layers")
	args := []string{"server", "--listen", "127.0.0.1:" + freePort("127.0.0.1"), "--etcd", strings.Join(c.etcd.Endpoints(), ","),
		"--cluster", c.clusterDir(), "--layers", other}
	runFails(t, "is not the cluster's layer directory", args...)
	// Another cluster's certificates on this etcd.
	otherCluster := filepath.Join(c.dir, "other-cluster")
	if out, err := exec.Command(c.bin, "cluster", "init", "--dir", otherCluster).CombinedOutput(); err != nil {
		t.Fatalf("%v %s", err, out)
	}
	// Its CA does not know etcd's certificate, nor etcd its client's.
	runFails(t, "certificate signed by unknown authority", "server", "--listen", "127.0.0.1:"+freePort("127.0.0.1"), "--etcd", strings.Join(c.etcd.Endpoints(), ","),
		"--cluster", otherCluster, "--layers", c.layersDir())
	// Trusting etcd's CA, it still presents a certificate etcd does not
	// know.
	runFails(t, "TLS with 127.0.0.1", "server", "--listen", "127.0.0.1:"+freePort("127.0.0.1"), "--etcd", strings.Join(c.etcd.Endpoints(), ","),
		"--etcd-ca", filepath.Join(c.clusterDir(), "ca.pem"), "--cluster", otherCluster, "--layers", c.layersDir())
	// With this cluster's etcd files it reaches etcd, which is not its.
	etcdFiles := []string{"--etcd-ca", filepath.Join(c.clusterDir(), "ca.pem"),
		"--etcd-cert", filepath.Join(c.clusterDir(), "etcd-client.pem"), "--etcd-key", filepath.Join(c.clusterDir(), "etcd-client-key.pem")}
	runFails(t, "etcd belongs to cluster", append([]string{"server", "--listen", "127.0.0.1:" + freePort("127.0.0.1"), "--etcd", strings.Join(c.etcd.Endpoints(), ","),
		"--cluster", otherCluster, "--layers", c.layersDir()}, etcdFiles...)...)
	// etcd's TLS port named as plain http.
	runFails(t, "serves TLS: give https:// endpoints", "server", "--listen", "127.0.0.1:"+freePort("127.0.0.1"),
		"--etcd", strings.ReplaceAll(strings.Join(c.etcd.Endpoints(), ","), "https://", "http://"), "--cluster", c.clusterDir(), "--layers", c.layersDir())
	// An empty etcd (a fresh prefix, which etcd's roles must cover too)
	// and no --api-key.
	if out, err := exec.Command(c.bin, "cluster", "etcd-auth", "--etcd", strings.Join(c.etcd.Endpoints(), ","), "--etcd-prefix", "/fresh/",
		"--cluster", c.clusterDir(), "--root-password-file", c.rootPasswordFile()).CombinedOutput(); err != nil || !strings.Contains(string(out), "was on already") {
		t.Fatalf("etcd-auth for a second prefix: %v %s", err, out)
	}
	runFails(t, "start the first server with --api-key", append([]string{"server", "--listen", "127.0.0.1:" + freePort("127.0.0.1"),
		"--etcd", strings.Join(c.etcd.Endpoints(), ","), "--etcd-prefix", "/fresh/", "--cluster", otherCluster, "--layers", filepath.Join(c.dir, "fresh-layers")}, etcdFiles...)...)
	if _, err := os.Stat(filepath.Join(c.dir, "fresh-layers")); err == nil {
		t.Errorf("the refused server marked a layer directory")
	}
	// etcd-auth given an edge's directory: it would log in as the edge.
	runFails(t, "holds the etcd pair of dsec-edge-", "cluster", "etcd-auth", "--etcd", strings.Join(c.etcd.Endpoints(), ","),
		"--cluster", filepath.Join(c.clusterDir(), "edge"), "--root-password-file", c.rootPasswordFile())
	// Missing flags, an etcd nobody serves.
	runFails(t, "--etcd is required", "server", "--cluster", c.clusterDir(), "--layers", c.layersDir())
	runFails(t, "connect: connection refused", "server", "--listen", "127.0.0.1:"+freePort("127.0.0.1"), "--etcd", "http://127.0.0.1:"+freePort("127.0.0.1"),
		"--cluster", c.clusterDir(), "--layers", c.layersDir())
	runFails(t, "--advertise", append([]string{"edge", "--listen", "0.0.0.0:7999", "--node-name", "x9", "--state-dir", dupState}, c.common("edge")...)...)
	// Another node's directory (dsec cluster add-edge): its certificate
	// names e2, which apiservers would refuse at x9's address.
	runFails(t, "holds node e2's certificate", append([]string{"edge", "--listen", "127.0.0.29:" + freePort("127.0.0.29"), "--node-name", "x9",
		"--state-dir", dupState}, c.nodeFlags("e2")...)...)
}

// TestBadRequests: ids naming unknown nodes, malformed ids, a stale page
// token, and a bad Idempotency-Key get clear errors.
func TestBadRequests(t *testing.T) {
	need(t)
	for _, id := range []string{"sb-nosuchnode-abc", "not-an-id"} {
		_, err := c.client.GetSandbox(ctx(t), id)
		wantCode(t, err, "not_found")
		_, err = c.client.Exec(ctx(t), id, api.ExecRequest{Cmd: "true"})
		wantCode(t, err, "not_found")
	}
	if err := c.client.DeleteSandbox(ctx(t), "sb-nosuchnode-abc"); err != nil {
		t.Fatalf("delete of an id no node owns: %v (delete is idempotent)", err)
	}
	resp, body := httpDo(t, "GET", "/v1/sandboxes?page_token=!!!", "", nil)
	if resp != 400 || !strings.Contains(body, "page_token") {
		t.Fatalf("bad page token: %d %s", resp, body)
	}
	resp, body = httpDo(t, "POST", "/v1/sandboxes", `{"base":"`+baseRef+`"}`, map[string]string{"Idempotency-Key": strings.Repeat("k", 300)})
	if resp != 400 || !strings.Contains(body, "Idempotency-Key") {
		t.Fatalf("bad idempotency key: %d %s", resp, body)
	}
}

// TestSandboxCannotReachTheControlPlane: a sandbox allowed everywhere
// still cannot open a connection to an edge's internal API (e1 listens on
// every host address) or to an apiserver.
func TestSandboxCannotReachTheControlPlane(t *testing.T) {
	need(t)
	sb := newSandbox(t, api.SandboxSpec{Network: &api.NetworkPolicy{Allow: []string{"0.0.0.0/0"}}, NodeSelector: map[string]string{"zone": "z1"}})
	_, edgePort, _ := strings.Cut(c.edges[0].addr, ":")
	_, serverPort, _ := strings.Cut(c.servers[0].addr, ":")
	script := fmt.Sprintf(`gw=$(ip route | awk '/default/ {print $3}')
[ -n "$gw" ] || { echo "no default route"; exit 3; }
for target in "$gw:%s" "$gw:%s" "127.0.0.21:%s" "127.0.0.1:%s"; do
  if nc -w 2 ${target%%:*} ${target##*:} </dev/null >/dev/null 2>&1; then echo "REACHED $target"; fi
done
echo done`, edgePort, serverPort, edgePort, serverPort)
	res, err := c.client.Exec(ctx(t), sb.ID, api.ExecRequest{Cmd: script, Timeout: 60})
	if err != nil {
		t.Fatal(err)
	}
	if res.ExitCode != 0 || strings.Contains(res.Stdout, "REACHED") || !strings.Contains(res.Stdout, "done") {
		t.Fatalf("probe: exit %d: %s %s", res.ExitCode, res.Stdout, res.Stderr)
	}
}

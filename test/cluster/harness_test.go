// Package cluster drives a real dsec cluster on one machine: a 3-member
// etcd on loopback, two `dsec server`s and three `dsec edge`s on loopback
// addresses of their own, built from this tree. It needs root (the edges
// mount layers and run containers) and etcd; without them every test skips
// with the reason.
package cluster

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/cluster"
	"github.com/dsecproject/dsec/internal/hostfs"
	"github.com/dsecproject/dsec/internal/store"
	"github.com/dsecproject/dsec/internal/store/etcdtest"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

const (
	adminKey = "cluster-admin-key-0123456789abcdef"
	baseRef  = "base/cl:v1"
)

// proc is one daemon of the cluster.
type proc struct {
	name string
	args []string
	log  string
	addr string // the API (server) or internal API (edge) address

	mu  sync.Mutex
	cmd *exec.Cmd
}

// env is the running cluster.
type env struct {
	dir     string
	bin     string
	etcd    *etcdtest.Cluster
	servers []*proc
	edges   []*proc
	// client knows both apiservers; perServer[i] only server i.
	client    *dsec.Client
	perServer []*dsec.Client
}

var (
	skipReason string
	c          *env
)

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	if os.Geteuid() != 0 {
		skipReason = "needs root: starts dsec edges, which mount layers and run containers"
		return m.Run()
	}
	for _, tool := range []string{"mkfs.erofs", "busybox", "catatonit", "nft"} {
		if _, err := exec.LookPath(tool); err != nil {
			skipReason = "needs " + tool + " (run make deps-test)"
			return m.Run()
		}
	}
	if _, err := etcdtest.Binary(); err != nil {
		skipReason = err.Error()
		return m.Run()
	}
	dir, err := os.MkdirTemp("", "dsec-cluster-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	_ = os.Chmod(dir, 0o711)
	c = &env{dir: dir}
	if err := c.setup(); err != nil {
		fmt.Fprintln(os.Stderr, "cluster setup:", err)
		c.dumpLogs(os.Stderr)
		c.teardown()
		return 1
	}
	code := m.Run()
	if code != 0 {
		c.dumpLogs(os.Stderr)
	}
	c.teardown()
	if code == 0 {
		os.RemoveAll(dir)
	} else {
		fmt.Fprintln(os.Stderr, "cluster test dir kept:", dir)
	}
	return code
}

func need(t *testing.T) {
	t.Helper()
	if skipReason != "" {
		t.Skip(skipReason)
	}
}

// cidrs are the sandbox address pools of the three edges: /20s in
// 10.252.0.0/16 that no host address falls in (an edge killed by an
// earlier run may have left its DNS address), clear of the e2e suite's
// pools (10.100-189.0.0/16) and dsec up's default.
func cidrs() []string {
	var used []netip.Addr
	if addrs, err := net.InterfaceAddrs(); err == nil {
		for _, a := range addrs {
			if p, err := netip.ParsePrefix(a.String()); err == nil {
				used = append(used, p.Addr())
			}
		}
	}
	var out []string
	start := os.Getpid() % 16
	for i := 0; i < 16 && len(out) < 3; i++ {
		p := netip.MustParsePrefix(fmt.Sprintf("10.252.%d.0/20", ((start+i)%16)*16))
		free := true
		for _, a := range used {
			if p.Contains(a) {
				free = false
			}
		}
		if free {
			out = append(out, p.String())
		}
	}
	for len(out) < 3 {
		out = append(out, fmt.Sprintf("10.253.%d.0/24", len(out)))
	}
	return out
}

func freePort(host string) string {
	p, err := etcdtest.FreePort(host)
	if err != nil {
		panic(err)
	}
	return p
}

func (e *env) setup() error {
	e.bin = filepath.Join(e.dir, "dsec")
	build := exec.Command("go", "build", "-o", e.bin, "github.com/dsecproject/dsec/cmd/dsec")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		return fmt.Errorf("building dsec: %w", err)
	}
	// etcd as in production: TLS for clients and peers, client
	// certificates of the cluster's CA required.
	if out, err := exec.Command(e.bin, "cluster", "init", "--dir", e.clusterDir(), "--etcd-hosts", "127.0.0.1").CombinedOutput(); err != nil {
		return fmt.Errorf("cluster init: %v: %s", err, out)
	}
	trust, err := cluster.Load(e.clusterDir())
	if err != nil {
		return err
	}
	client, err := trust.EtcdTLS(cluster.EtcdTLSFiles{})
	if err != nil {
		return err
	}
	ed := filepath.Join(e.clusterDir(), cluster.EtcdDir)
	if e.etcd, err = etcdtest.StartTLS(filepath.Join(e.dir, "etcd"), 3, &etcdtest.TLS{
		CA: filepath.Join(ed, "ca.pem"), Cert: filepath.Join(ed, cluster.EtcdServerCert), Key: filepath.Join(ed, cluster.EtcdServerKey), Client: client}); err != nil {
		return err
	}
	// Each edge with a certificate of its own node, and apiservers that
	// take no other (docs/operating.md).
	for i := range 3 {
		if out, err := exec.Command(e.bin, "cluster", "add-edge", "--dir", e.clusterDir(), "--node-name", fmt.Sprintf("e%d", i+1)).CombinedOutput(); err != nil {
			return fmt.Errorf("cluster add-edge: %v: %s", err, out)
		}
	}
	// etcd's authentication on, as docs/operating.md says: edges may
	// touch only what they use, each node only its own entries.
	if _, err := e.etcdAuth(); err != nil {
		return err
	}
	for i := range 2 {
		addr := "127.0.0.1:" + freePort("127.0.0.1")
		args := []string{"server", "--listen", addr, "--require-node-certs"}
		if i == 0 {
			args = append(args, "--api-key", adminKey)
		}
		p := &proc{name: fmt.Sprintf("s%d", i), addr: addr, args: append(args, e.common("server")...),
			log: filepath.Join(e.dir, fmt.Sprintf("s%d.log", i))}
		e.servers = append(e.servers, p)
		if err := p.start(e.bin); err != nil {
			return err
		}
		if err := waitHTTP("http://"+addr+"/healthz", 30*time.Second, p); err != nil {
			return err
		}
	}
	pools := cidrs()
	for i := range 3 {
		host := fmt.Sprintf("127.0.0.%d", 21+i)
		port := freePort(host)
		listen := host + ":" + port
		args := []string{"edge", "--listen", listen, "--node-name", fmt.Sprintf("e%d", i+1),
			"--state-dir", filepath.Join(e.dir, fmt.Sprintf("e%d", i+1)), "--sandbox-cidr", pools[i],
			"--node-labels", fmt.Sprintf("zone=z%d", i+1), "--warm-pool-max", "0", "--max-sandboxes", "200",
			// Only e1 offers gvisor (where runsc is installed): placement
			// must filter on backends.
			"--gvisor", "off"}
		if i == 0 {
			// e1 listens on every host address, as an edge on a real
			// node would: a sandbox must still not reach it.
			args = []string{"edge", "--listen", "0.0.0.0:" + port, "--advertise", listen, "--node-name", "e1",
				"--state-dir", filepath.Join(e.dir, "e1"), "--sandbox-cidr", pools[0],
				"--node-labels", "zone=z1", "--warm-pool-max", "0", "--max-sandboxes", "200",
				"--metrics-listen", "127.0.0.1:" + freePort("127.0.0.1")}
		}
		p := &proc{name: fmt.Sprintf("e%d", i+1), addr: listen, args: append(args, e.nodeFlags(fmt.Sprintf("e%d", i+1))...),
			log: filepath.Join(e.dir, fmt.Sprintf("e%d.log", i+1))}
		e.edges = append(e.edges, p)
		if err := p.start(e.bin); err != nil {
			return err
		}
	}
	e.client, err = dsec.New(dsec.WithEndpoint(e.endpoints()), dsec.WithAPIKey(adminKey))
	if err != nil {
		return err
	}
	for _, s := range e.servers {
		pc, err := dsec.New(dsec.WithEndpoint("http://"+s.addr), dsec.WithAPIKey(adminKey), dsec.WithRetries(1))
		if err != nil {
			return err
		}
		e.perServer = append(e.perServer, pc)
	}
	if err := e.waitNodes(60*time.Second, "e1", "e2", "e3"); err != nil {
		return err
	}
	// The CLI takes everything from the environment; its config file is
	// empty.
	if err := os.WriteFile(filepath.Join(e.dir, "no-config.json"), []byte("{}\n"), 0o600); err != nil {
		return err
	}
	base := filepath.Join(e.dir, "base")
	if err := hostfs.Build(base, hostfs.Options{Bash: true}); err != nil {
		return err
	}
	out, err := e.cli(0, "layer", "build", "--kind", "base", "--name", "cl", "--tag", "v1", base)
	if err != nil {
		return fmt.Errorf("layer build: %v: %s", err, out)
	}
	return nil
}

func (e *env) clusterDir() string { return filepath.Join(e.dir, "cluster") }
func (e *env) layersDir() string  { return filepath.Join(e.dir, "layers") }

// etcdAs opens etcd with the etcd pair of the cluster directory dir.
func (e *env) etcdAs(t *testing.T, dir string) *store.Etcd {
	t.Helper()
	tr, err := cluster.Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := tr.EtcdTLS(cluster.EtcdTLSFiles{})
	if err != nil {
		t.Fatal(err)
	}
	st, err := store.OpenEtcd(store.EtcdConfig{Endpoints: e.etcd.Endpoints(), TLS: cfg, OpTimeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

// clusterID is the cluster's id (cluster init's).
func (e *env) clusterID(t *testing.T) string {
	t.Helper()
	tr, err := cluster.Load(e.clusterDir())
	if err != nil {
		t.Fatal(err)
	}
	return tr.Info.ID
}

// etcdAuth runs dsec cluster etcd-auth (again): after add-edge and
// revoke-edge, it sets the nodes' own etcd users.
func (e *env) etcdAuth(more ...string) (string, error) {
	out, err := exec.Command(e.bin, append([]string{"cluster", "etcd-auth", "--etcd", strings.Join(e.etcd.Endpoints(), ","), "--cluster", e.clusterDir(),
		"--root-password-file", e.rootPasswordFile()}, more...)...).CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("cluster etcd-auth: %v: %s", err, out)
	}
	return string(out), nil
}

func (e *env) rootPasswordFile() string { return filepath.Join(e.dir, "etcd-root-password") }

// common are the flags every daemon of role ("server", "edge") gets: its
// role's directory, as a machine of that role has.
func (e *env) common(role string) []string { return e.flagsFrom(filepath.Join(e.clusterDir(), role)) }

// nodeFlags are common("edge") with node's own directory (dsec cluster
// add-edge) for --cluster.
func (e *env) nodeFlags(node string) []string {
	return e.flagsFrom(filepath.Join(e.clusterDir(), cluster.EdgesDir, node))
}

func (e *env) flagsFrom(dir string) []string {
	return []string{"--etcd", strings.Join(e.etcd.Endpoints(), ","), "--cluster", dir, "--layers", e.layersDir(), "--log-level", "debug"}
}

func (e *env) endpoints() string {
	var eps []string
	for _, s := range e.servers {
		eps = append(eps, "http://"+s.addr)
	}
	return strings.Join(eps, ",")
}

// cli runs the dsec CLI against server i (-1: both).
func (e *env) cli(i int, args ...string) (string, error) {
	cmd := exec.Command(e.bin, args...)
	ep := e.endpoints()
	if i >= 0 {
		ep = "http://" + e.servers[i].addr
	}
	cmd.Env = append(os.Environ(), "DSEC_ENDPOINT="+ep, "DSEC_API_KEY="+adminKey, "DSEC_CONFIG="+filepath.Join(e.dir, "no-config.json"))
	out, err := cmd.CombinedOutput()
	return string(out), err
}

func (p *proc) start(bin string) error {
	logf, err := os.OpenFile(p.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	fmt.Fprintf(logf, "=== %s start %s\n", time.Now().Format(time.RFC3339Nano), strings.Join(p.args, " "))
	cmd := exec.Command(bin, p.args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return err
	}
	p.mu.Lock()
	p.cmd = cmd
	p.mu.Unlock()
	return nil
}

// kill9 kills the daemon without letting it clean up.
func (p *proc) kill9() {
	p.mu.Lock()
	cmd := p.cmd
	p.cmd = nil
	p.mu.Unlock()
	if cmd != nil && cmd.Process != nil {
		_ = cmd.Process.Signal(syscall.SIGKILL)
		_, _ = cmd.Process.Wait()
	}
}

// stop stops the daemon with SIGTERM.
func (p *proc) stop() {
	p.mu.Lock()
	cmd := p.cmd
	p.cmd = nil
	p.mu.Unlock()
	if cmd == nil || cmd.Process == nil {
		return
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { _, _ = cmd.Process.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		_ = cmd.Process.Kill()
		<-done
	}
}

func (p *proc) running() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cmd != nil && p.cmd.ProcessState == nil
}

func waitHTTP(url string, within time.Duration, p *proc) error {
	hc := &http.Client{Timeout: time.Second}
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) {
		resp, err := hc.Get(url)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return nil
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	b, _ := os.ReadFile(p.log)
	return fmt.Errorf("%s did not answer %s within %v: %s", p.name, url, within, lastLines(string(b), 20))
}

// waitNodes waits until every apiserver sees the named nodes healthy.
func (e *env) waitNodes(within time.Duration, names ...string) error {
	deadline := time.Now().Add(within)
	for {
		bad := ""
		for i, pc := range e.perServer {
			if !e.servers[i].running() {
				continue
			}
			nodes, err := pc.ListNodes(context.Background())
			if err != nil {
				bad = err.Error()
				break
			}
			for _, want := range names {
				if !healthy(nodes, want) {
					bad = fmt.Sprintf("%s sees %s not healthy: %+v", e.servers[i].name, want, nodes)
				}
			}
		}
		if bad == "" {
			return nil
		}
		if time.Now().After(deadline) {
			return errors.New(bad)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func healthy(nodes []api.Node, name string) bool {
	for _, n := range nodes {
		if n.Name == name {
			return n.Healthy
		}
	}
	return false
}

func (e *env) teardown() {
	if e.client != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		if all, err := e.client.ListAllSandboxes(ctx, dsec.ListOptions{}); err == nil {
			for _, sb := range all {
				_ = e.client.DeleteSandbox(ctx, sb.ID)
			}
		}
		cancel()
	}
	for _, p := range e.edges {
		p.stop()
	}
	for _, p := range e.servers {
		p.stop()
	}
	if e.etcd != nil {
		e.etcd.Stop()
	}
}

func (e *env) dumpLogs(w io.Writer) {
	for _, p := range append(append([]*proc{}, e.servers...), e.edges...) {
		b, _ := os.ReadFile(p.log)
		var bad []string
		for _, line := range strings.Split(string(b), "\n") {
			if strings.Contains(line, "level=WARN") || strings.Contains(line, "level=ERROR") || strings.HasPrefix(line, "dsec:") || strings.HasPrefix(line, "panic") {
				bad = append(bad, line)
			}
		}
		fmt.Fprintf(w, "----- %s (%s): warnings and errors\n%s\n----- last lines\n%s\n", p.name, p.log, lastLines(strings.Join(bad, "\n"), 40), lastLines(string(b), 30))
	}
}

func lastLines(s string, n int) string {
	l := strings.Split(strings.TrimSpace(s), "\n")
	if len(l) > n {
		l = l[len(l)-n:]
	}
	return strings.Join(l, "\n")
}

func ctx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// newSandbox creates a sandbox (through both apiservers' client) and
// deletes it when the test ends.
func newSandbox(t *testing.T, spec api.SandboxSpec) *api.Sandbox {
	t.Helper()
	if spec.Base == "" && spec.Snapshot == "" {
		spec.Base = baseRef
	}
	sb, err := c.client.CreateSandbox(ctx(t), spec)
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	t.Cleanup(func() { _ = c.client.DeleteSandbox(context.Background(), sb.ID) })
	return sb
}

func mustExec(t *testing.T, cl *dsec.Client, id, cmd string) string {
	t.Helper()
	res, err := cl.Exec(ctx(t), id, api.ExecRequest{Cmd: cmd})
	if err != nil {
		t.Fatalf("exec %q in %s: %v", cmd, id, err)
	}
	if res.ExitCode != 0 {
		t.Fatalf("exec %q in %s: exit %d: %s %s", cmd, id, res.ExitCode, res.Stdout, res.Stderr)
	}
	return res.Stdout
}

func wantCode(t *testing.T, err error, code string) {
	t.Helper()
	var ae *dsec.Error
	if !errors.As(err, &ae) || ae.Code != code {
		t.Fatalf("error %v, want %s", err, code)
	}
}

func edgeOf(name string) *proc {
	for _, p := range c.edges {
		if p.name == name {
			return p
		}
	}
	return nil
}

// rss returns a process's resident set in bytes.
func rss(pid int) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			var kb int64
			fmt.Sscan(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), &kb)
			return kb << 10
		}
	}
	return 0
}

func (p *proc) pid() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil || p.cmd.Process == nil {
		return 0
	}
	return p.cmd.Process.Pid
}

// Package etcdtest runs a real etcd cluster (Debian's etcd-server) on
// loopback for tests: members on ports of their own, data in a temporary
// directory, and the means to kill and restart a member for failure
// drills. Only tests (and the cluster benchmark) import it.
package etcdtest

import (
	"context"
	"crypto/tls"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// Binary finds the etcd server binary, or says what to install.
func Binary() (string, error) {
	p, err := exec.LookPath("etcd")
	if err != nil {
		return "", fmt.Errorf("needs etcd (apt-get install etcd-server; make deps-test installs it)")
	}
	return p, nil
}

// Cluster is a running etcd cluster.
type Cluster struct {
	bin     string
	dir     string
	members []*member
	token   string
	tls     *TLS
	hc      *http.Client // health and status checks
}

// TLS makes a cluster serve clients and peers over TLS, and require
// client certificates of CA: CA, Cert and Key are PEM files for etcd's
// members; Client is the TLS this package's checks (and HTTPClient)
// reach them with, a client certificate included.
type TLS struct {
	CA, Cert, Key string
	Client        *tls.Config
}

func (c *Cluster) scheme() string {
	if c.tls != nil {
		return "https://"
	}
	return "http://"
}

type member struct {
	name             string
	client, peer     string // host:port
	dataDir, logPath string
	mu               sync.Mutex
	cmd              *exec.Cmd
	exited           chan struct{} // closed when cmd has exited
}

// Start runs an etcd cluster of n members under dir (its data and logs)
// and waits until it serves. The caller calls Stop. A member that cannot
// bind the port picked for it (another process took it in between) fails
// the attempt; a new one, on new ports and fresh data, follows, up to 3.
func Start(dir string, n int) (*Cluster, error) { return StartTLS(dir, n, nil) }

// StartTLS is Start with clients and peers served over TLS (t nil: plain).
func StartTLS(dir string, n int, t *TLS) (*Cluster, error) {
	bin, err := Binary()
	if err != nil {
		return nil, err
	}
	hc := http.DefaultClient
	if t != nil {
		hc = &http.Client{Transport: &http.Transport{TLSClientConfig: t.Client}}
	}
	for attempt := 1; ; attempt++ {
		if err := os.RemoveAll(dir); err != nil {
			return nil, err
		}
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return nil, err
		}
		c, err := start(&Cluster{bin: bin, dir: dir, tls: t, hc: hc, token: fmt.Sprintf("dsec-test-%d", time.Now().UnixNano())}, n)
		switch {
		case err == nil:
			return c, nil
		case c == nil || attempt == 3 || !c.bindFailed():
			return nil, err
		}
	}
}

// bindFailed tells whether a member's log says its port was taken.
func (c *Cluster) bindFailed() bool {
	for _, m := range c.members {
		if b, err := os.ReadFile(m.logPath); err == nil && strings.Contains(string(b), "address already in use") {
			return true
		}
	}
	return false
}

func start(c *Cluster, n int) (*Cluster, error) {
	dir := c.dir
	var initial []string
	for i := range n {
		cp, err := FreePort("127.0.0.1")
		if err != nil {
			return nil, err
		}
		pp, err := FreePort("127.0.0.1")
		if err != nil {
			return nil, err
		}
		m := &member{
			name:    fmt.Sprintf("m%d", i),
			client:  "127.0.0.1:" + cp,
			peer:    "127.0.0.1:" + pp,
			dataDir: filepath.Join(dir, fmt.Sprintf("m%d", i)),
			logPath: filepath.Join(dir, fmt.Sprintf("m%d.log", i)),
		}
		c.members = append(c.members, m)
		initial = append(initial, m.name+"="+c.scheme()+m.peer)
	}
	for _, m := range c.members {
		if err := c.start(m, strings.Join(initial, ",")); err != nil {
			c.Stop()
			return c, err
		}
	}
	if err := c.WaitHealthy(30 * time.Second); err != nil {
		c.Stop()
		return c, err
	}
	return c, nil
}

// FreePort returns a TCP port on host that nothing listens on now, from
// below the kernel's ephemeral range: a port that the kernel handed out
// for a moment (":0") may be given next to an outgoing connection as its
// source port, and a daemon told to listen there then fails to bind; a
// port picked from outside that range is only ever taken by a listener.
func FreePort(host string) (string, error) {
	given.Lock()
	defer given.Unlock()
	first := ephemeralStart()
	lo, hi := max(first-10000, 10000), first
	for range 200 {
		if hi-lo < 100 {
			break // an odd ephemeral range: fall back to the kernel's pick
		}
		p := lo + rand.IntN(hi-lo)
		if given.ports[p] {
			continue
		}
		ln, err := net.Listen("tcp", net.JoinHostPort(host, strconv.Itoa(p)))
		if err != nil {
			continue
		}
		ln.Close()
		given.ports[p] = true
		return strconv.Itoa(p), nil
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err == nil {
		defer ln.Close()
		_, p, _ := net.SplitHostPort(ln.Addr().String())
		return p, nil
	}
	return "", fmt.Errorf("no free port on %s: %w", host, err)
}

// given holds the ports FreePort returned, none returned twice.
var given = struct {
	sync.Mutex
	ports map[int]bool
}{ports: map[int]bool{}}

// ephemeralStart is the first port of net.ipv4.ip_local_port_range
// (32768 if it cannot be read).
func ephemeralStart() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 32768
	}
	f := strings.Fields(string(b))
	if len(f) != 2 {
		return 32768
	}
	first, err := strconv.Atoi(f[0])
	if err != nil || first < 1024 {
		return 32768
	}
	return first
}

func (c *Cluster) start(m *member, initial string) error {
	if initial == "" {
		var all []string
		for _, o := range c.members {
			all = append(all, o.name+"="+c.scheme()+o.peer)
		}
		initial = strings.Join(all, ",")
	}
	logf, err := os.OpenFile(m.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	sc := c.scheme()
	args := []string{
		"--name", m.name, "--data-dir", m.dataDir,
		"--listen-client-urls", sc + m.client, "--advertise-client-urls", sc + m.client,
		"--listen-peer-urls", sc + m.peer, "--initial-advertise-peer-urls", sc + m.peer,
		"--initial-cluster", initial, "--initial-cluster-token", c.token, "--initial-cluster-state", "new",
		// Fast elections keep failover drills short.
		"--heartbeat-interval", "50", "--election-timeout", "500",
		// History compacted as in deploy/ (benches write hundreds of
		// thousands of records), by revision: a periodic retention of
		// an hour would not start within a run.
		"--auto-compaction-mode", "revision", "--auto-compaction-retention", "1000",
		"--log-level", "warn"}
	if t := c.tls; t != nil {
		args = append(args, "--cert-file", t.Cert, "--key-file", t.Key, "--trusted-ca-file", t.CA, "--client-cert-auth",
			"--peer-cert-file", t.Cert, "--peer-key-file", t.Key, "--peer-trusted-ca-file", t.CA, "--peer-client-cert-auth")
	}
	cmd := exec.Command(c.bin, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("starting etcd %s: %w", m.name, err)
	}
	logf.Close()
	exited := make(chan struct{})
	m.mu.Lock()
	m.cmd, m.exited = cmd, exited
	m.mu.Unlock()
	go func() {
		_ = cmd.Wait()
		close(exited)
	}()
	return nil
}

// Endpoints are the client URLs of every member.
func (c *Cluster) Endpoints() []string {
	var out []string
	for _, m := range c.members {
		out = append(out, c.scheme()+m.client)
	}
	return out
}

// HTTPClient returns a client for the members' HTTP endpoints (/metrics,
// /health): with the cluster's TLS when it has one.
func (c *Cluster) HTTPClient() *http.Client {
	hc := *c.hc
	return &hc
}

// Pids returns the process ids of the running members.
func (c *Cluster) Pids() []int {
	var out []int
	for _, m := range c.members {
		m.mu.Lock()
		if m.cmd != nil && m.cmd.Process != nil {
			out = append(out, m.cmd.Process.Pid)
		}
		m.mu.Unlock()
	}
	return out
}

// Kill stops member i with SIGKILL.
func (c *Cluster) Kill(i int) {
	m := c.members[i]
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.cmd != nil && m.cmd.Process != nil {
		_ = m.cmd.Process.Kill()
		m.cmd = nil
	}
}

// Restart starts member i again on its data.
func (c *Cluster) Restart(i int) error {
	m := c.members[i]
	// An existing data dir makes etcd rejoin; the initial flags are
	// then ignored.
	return c.start(m, "")
}

// WaitHealthy waits until every running member reports healthy.
func (c *Cluster) WaitHealthy(within time.Duration) error {
	deadline := time.Now().Add(within)
	for {
		var bad *member
		for _, m := range c.members {
			m.mu.Lock()
			running, exited := m.cmd != nil, m.exited
			m.mu.Unlock()
			if !running {
				continue
			}
			select {
			case <-exited:
				b, _ := os.ReadFile(m.logPath)
				return fmt.Errorf("etcd member %s exited; its log: %s", m.name, lastLines(string(b), 10))
			default:
			}
			if !c.healthy(m.client) {
				bad = m
				break
			}
		}
		if bad == nil {
			return nil
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(bad.logPath)
			return fmt.Errorf("etcd member %s not healthy after %v; its log: %s", bad.name, within, lastLines(string(b), 10))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (c *Cluster) healthy(hostport string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "GET", c.scheme()+hostport+"/health", nil)
	resp, err := c.hc.Do(req)
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	return resp.StatusCode == 200
}

func lastLines(s string, n int) string {
	l := strings.Split(strings.TrimSpace(s), "\n")
	if len(l) > n {
		l = l[len(l)-n:]
	}
	return strings.Join(l, "\n")
}

// Stop kills every member.
func (c *Cluster) Stop() {
	for i := range c.members {
		c.Kill(i)
	}
}

// Leader returns the index of the member that is the raft leader now, as
// the running members report it, waiting up to within for one to be.
func (c *Cluster) Leader(within time.Duration) (int, error) {
	deadline := time.Now().Add(within)
	for {
		for i, m := range c.members {
			m.mu.Lock()
			running := m.cmd != nil
			m.mu.Unlock()
			if !running {
				continue
			}
			if id, leader, err := c.status(m.client); err == nil && leader != "" && leader != "0" && id == leader {
				return i, nil
			}
		}
		if time.Now().After(deadline) {
			return -1, fmt.Errorf("no etcd member is the leader after %v", within)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// status asks a member for its id and the id of the leader it follows
// (over gRPC: etcd's JSON gateway ignores client certificates, which
// etcd's authentication needs).
func (c *Cluster) status(hostport string) (id, leader string, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	var cfg *tls.Config
	if c.tls != nil {
		cfg = c.tls.Client
	}
	cl, err := clientv3.New(clientv3.Config{Endpoints: []string{c.scheme() + hostport}, DialTimeout: time.Second, TLS: cfg, Logger: zap.NewNop()})
	if err != nil {
		return "", "", err
	}
	defer cl.Close()
	st, err := cl.Status(ctx, c.scheme()+hostport)
	if err != nil {
		return "", "", err
	}
	return strconv.FormatUint(st.Header.MemberId, 10), strconv.FormatUint(st.Leader, 10), nil
}

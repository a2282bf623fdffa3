package main

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/dsecproject/dsec/internal/cluster"
	"github.com/dsecproject/dsec/internal/layer"
	"github.com/dsecproject/dsec/internal/store"
)

// runCluster is `dsec cluster init`, `dsec cluster add-edge`, `dsec
// cluster revoke-edge` and `dsec cluster etcd-auth`.
func runCluster(args []string) error {
	if len(args) > 0 && args[0] == "etcd-auth" {
		return runEtcdAuth(args[1:])
	}
	if len(args) > 0 && args[0] == "add-edge" {
		return runAddEdge(args[1:])
	}
	if len(args) > 0 && args[0] == "revoke-edge" {
		return runRevokeEdge(args[1:])
	}
	if len(args) == 0 || args[0] != "init" {
		return fmt.Errorf("usage: dsec cluster init --dir DIR [--etcd-hosts HOSTS], dsec cluster add-edge --dir DIR --node-name NAME, dsec cluster revoke-edge --etcd URLS --cluster DIR --node-name NAME, or dsec cluster etcd-auth --etcd URLS --cluster DIR --root-password-file FILE")
	}
	var dir, etcdHosts string
	f := newCmdFlags("cluster init", "--dir DIR [--etcd-hosts HOSTS]",
		"Write a new cluster directory: a CA and the certificates apiservers and\n"+
			"edges use to trust each other (mutual TLS on the internal API), and the\n"+
			"cluster's id; and in DIR/server and DIR/edge what each role's machines\n"+
			"get as their --cluster directory. Copy DIR/server to apiserver machines\n"+
			"and DIR/edge to edge machines, nothing more: an edge holding the\n"+
			"apiserver key could drive every other edge, and nothing that runs needs\n"+
			"ca-key.pem (keep it offline). The *-key.pem files are secrets.\n"+
			"Each role also gets etcd-client.pem, the pair it presents to an etcd\n"+
			"reached over https:// (etcd users dsec-server-ID and dsec-edge-ID, ID\n"+
			"the cluster's id: see dsec cluster etcd-auth); with --etcd-hosts,\n"+
			"DIR/etcd holds the pair etcd's members serve clients and each other\n"+
			"with (docs/operating.md).")
	f.StringVar(&dir, "dir", "", "directory to write (required; must not hold a cluster yet)")
	f.StringVar(&etcdHosts, "etcd-hosts", "", "comma-separated IP addresses and DNS names (*.x for a wildcard) etcd's members are reached at: also write DIR/etcd, their TLS pair")
	if _, err := f.parseN(args[1:], 0, 0); err != nil {
		return err
	}
	if dir == "" {
		return fmt.Errorf("--dir is required")
	}
	info, err := cluster.Init(dir, cluster.InitOptions{EtcdHosts: splitList(etcdHosts)})
	if err != nil {
		return err
	}
	server, edge := filepath.Join(dir, "server"), filepath.Join(dir, "edge")
	fmt.Printf("cluster %s written to %s\n", info.ID, dir)
	fmt.Printf("copy %s to apiserver machines and %s to edge machines; keep %s offline\n", server, edge, filepath.Join(dir, "ca-key.pem"))
	if etcdHosts != "" {
		fmt.Printf("copy %s to etcd machines (etcd --cert-file, --key-file, --trusted-ca-file and --client-cert-auth, and the same for peers) and give dsec https:// etcd URLs\n", filepath.Join(dir, cluster.EtcdDir))
	}
	fmt.Printf("next: dsec server --cluster %s --etcd URLS --layers DIR --api-key KEY; dsec edge --cluster %s ...\n", server, edge)
	return nil
}

// runAddEdge is `dsec cluster add-edge`.
func runAddEdge(args []string) error {
	var dir, node string
	f := newCmdFlags("cluster add-edge", "--dir DIR --node-name NAME",
		"Write DIR/edges/NAME, the --cluster directory of one edge: a certificate\n"+
			"of its own that names node NAME, and what DIR/edge holds besides. An\n"+
			"apiserver takes that certificate only from the edge it dials as NAME.\n"+
			"Once every node has its own, run the apiservers with --require-node-certs:\n"+
			"they then refuse the edges' shared certificate too, and no other edge host\n"+
			"can answer for a node (even one that rewrote its address in etcd). DIR is\n"+
			"the directory dsec cluster init wrote (this needs the CA's key). To take\n"+
			"a node's certificate back, dsec cluster revoke-edge; then add-edge issues\n"+
			"it a new one.")
	f.StringVar(&dir, "dir", "", "the cluster directory dsec cluster init wrote (required)")
	f.StringVar(&node, "node-name", "", "the node's name, as its dsec edge --node-name (required)")
	if _, err := f.parseN(args, 0, 0); err != nil {
		return err
	}
	if dir == "" || node == "" {
		return fmt.Errorf("--dir and --node-name are required")
	}
	out, err := cluster.AddEdge(dir, node)
	if err != nil {
		return err
	}
	fmt.Printf("node %s's directory written to %s\n", node, out)
	fmt.Printf("with etcd's authentication on, run dsec cluster etcd-auth --cluster %s ... again: it makes the node's own etcd user\n", dir)
	fmt.Printf("copy it to that machine and start it with dsec edge --cluster DIR --node-name %s ...\n", node)
	return nil
}

// runRevokeEdge is `dsec cluster revoke-edge`.
func runRevokeEdge(args []string) error {
	var c clusterFlags
	var node string
	f := newCmdFlags("cluster revoke-edge", "--etcd URLS --cluster DIR --node-name NAME [flags]",
		"Revoke node NAME's certificate, the one in DIR/edges/NAME (dsec cluster\n"+
			"add-edge): its serial is recorded in etcd, every apiserver refuses it\n"+
			"from then on (each drops its connections to the node within about a\n"+
			"second), and an edge started with it refuses to start. DIR/edges/NAME\n"+
			"moves to DIR/revoked/NAME-SERIAL; dsec cluster add-edge then issues the\n"+
			"node a new certificate. DIR is the directory dsec cluster init wrote:\n"+
			"this logs in to etcd with its etcd-client.pem (an apiserver's).")
	c.registerEtcd(f)
	f.StringVar(&c.clusterDir, "cluster", "", "the cluster directory dsec cluster init wrote (required)")
	f.StringVar(&node, "node-name", "", "the node whose certificate to revoke (required)")
	if _, err := f.parseN(args, 0, 0); err != nil {
		return err
	}
	for _, r := range []struct{ name, v string }{{"--etcd", c.etcd}, {"--cluster", c.clusterDir}, {"--node-name", node}} {
		if r.v == "" {
			return fmt.Errorf("%s is required", r.name)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, st, err := c.openEtcd(ctx, slog.New(slog.DiscardHandler))
	if err != nil {
		return err
	}
	defer st.Close()
	r, err := cluster.RevokeEdge(st, c.clusterDir, node)
	if err != nil {
		return err
	}
	fmt.Printf("node %s's certificate (serial %s) is revoked; its directory moved to %s\n", node, r.Serial, filepath.Join(c.clusterDir, cluster.RevokedDir, node+"-"+r.Serial))
	fmt.Printf("to bring the node back: dsec cluster add-edge --dir %s --node-name %s, copy the new directory to it, restart its edge\n", c.clusterDir, node)
	fmt.Printf("with etcd's authentication on, run dsec cluster etcd-auth --cluster %s ... now, before add-edge: it deletes the node's etcd user and registry entry\n", c.clusterDir)
	fmt.Printf("note: apiservers without --require-node-certs still take the shared certificate (%s) from any host that holds it, as etcd takes its etcd pair\n", filepath.Join(c.clusterDir, "edge"))
	return nil
}

// etcdUsers are dsec's users of etcd: apiservers may use every key of the
// prefix; an edge with the shared pair (unless !shared) its buckets and
// the ping key, and read the layer catalog (the apiservers publish the
// snapshots edges stage); a node with a pair of its own (nodes) the same,
// writing only its own registry entry and abandoned creates.
func etcdUsers(id string, nodes []cluster.NodeEtcdUser, shared bool) []store.EtcdUser {
	read := []store.EtcdGrant{{Key: store.EtcdPingKey}}
	for _, b := range layer.Buckets {
		read = append(read, store.EtcdGrant{Bucket: b})
	}
	edge := store.EtcdUser{Name: cluster.EtcdEdgeUser(id), Grants: slices.Clone(read)}
	for _, b := range cluster.EdgeReadBuckets {
		edge.Grants = append(edge.Grants, store.EtcdGrant{Bucket: b})
	}
	for _, b := range cluster.EdgeBuckets {
		edge.Grants = append(edge.Grants, store.EtcdGrant{Bucket: b, Write: true})
	}
	users := []store.EtcdUser{{Name: cluster.EtcdServerUser(id), All: true}}
	if shared {
		users = append(users, edge)
	}
	for _, n := range nodes {
		users = append(users, store.EtcdUser{Name: n.User, Grants: append(slices.Clone(read), cluster.NodeGrants(n.Node)...)})
	}
	return users
}

// runEtcdAuth is `dsec cluster etcd-auth`.
func runEtcdAuth(args []string) error {
	var c clusterFlags
	var pwFile string
	f := newCmdFlags("cluster etcd-auth", "--etcd URLS --cluster DIR --root-password-file FILE [flags]",
		"Turn etcd's authentication on for this cluster: apiservers (etcd user\n"+
			"dsec-server-ID) may use every key of --etcd-prefix, edges (dsec-edge-ID)\n"+
			"only the node registry, reading the layer buckets and what else an edge\n"+
			"uses: an edge's machine can then not read or write IAM, idempotency\n"+
			"records or quotas. A node with a directory of its own (dsec cluster\n"+
			"add-edge, under DIR/edges) gets a user of its own that writes only its\n"+
			"own registry entry; the users of revoked directories (DIR/revoked, dsec\n"+
			"cluster revoke-edge) are deleted. Each logs in with the etcd-client.pem\n"+
			"of its directory (etcd must require client certificates: https://).\n"+
			"etcd's root user gets the password in FILE, written (0600) if FILE does\n"+
			"not exist. Run again (with the same FILE) after add-edge, revoke-edge or\n"+
			"an upgrade: it sets the roles anew.")
	c.registerEtcd(f)
	f.StringVar(&c.clusterDir, "cluster", "", "the cluster directory or its server/ (required: its etcd client certificate and CA)")
	f.StringVar(&pwFile, "root-password-file", "", "file holding etcd's root password; written with a new one if it does not exist (required)")
	var sharedFlag bool
	f.BoolVar(&sharedFlag, "shared-edge-user", true, "keep the etcd user of DIR/edge's shared pair; false deletes it (once every node runs from its own directory), and later runs keep it deleted until given true")
	if _, err := f.parseN(args, 0, 0); err != nil {
		return err
	}
	for _, r := range []struct{ name, v string }{{"--etcd", c.etcd}, {"--cluster", c.clusterDir}, {"--root-password-file", pwFile}} {
		if r.v == "" {
			return fmt.Errorf("%s is required", r.name)
		}
	}
	eps := splitList(c.etcd)
	secure, err := etcdSecure(eps, c.etcdTLS)
	if err != nil {
		return err
	}
	if !secure {
		return fmt.Errorf("--etcd %s: give https:// endpoints: dsec's processes log in to etcd with their certificates", c.etcd)
	}
	trust, err := cluster.Load(c.clusterDir)
	if err != nil {
		return err
	}
	tlsCfg, err := trust.EtcdTLS(c.etcdTLS)
	if err != nil {
		return err
	}
	// It works as the apiservers' etcd user: another pair (an edge's
	// directory) would only be refused by etcd.
	if cn := etcdClientUser(tlsCfg); c.etcdTLS.Cert == "" && cn != "" && cn != cluster.EtcdServerUser(trust.Info.ID) {
		return fmt.Errorf("--cluster %s holds the etcd pair of %s, not the apiservers': give the directory dsec cluster init wrote (or its server/)", c.clusterDir, cn)
	}
	pw, made, err := rootPassword(pwFile)
	if err != nil {
		return err
	}
	// Nodes' own users: those of the node directories here are granted,
	// those of revoked directories deleted. A directory without them
	// (DIR/server) cannot tell: node users stay as they are.
	var nodes, revoked []cluster.NodeEtcdUser
	if nodes, revoked, err = trust.NodeEtcdUsers(); err != nil {
		return err
	}
	_, kerr := os.Stat(filepath.Join(c.clusterDir, "ca-key.pem"))
	if kerr != nil && len(nodes) == 0 && len(revoked) == 0 {
		fmt.Printf("note: %s holds no node directories: nodes' own etcd users are left as they are (run this with the directory dsec cluster init wrote to set them)\n", c.clusterDir)
	}
	// The shared edge user: kept unless this run or an earlier one said
	// otherwise (remembered in etcd). One client with the apiservers'
	// pair reads and writes that before and after the roles are set
	// (etcd takes its certificate's user per request).
	cfg := store.EtcdConfig{Endpoints: eps, Prefix: c.etcdPrefix, TLS: tlsCfg}
	st, err := store.OpenEtcd(cfg)
	if err != nil {
		return err
	}
	defer st.Close()
	shared, err := sharedEdgeUser(st, f, sharedFlag)
	if err != nil {
		return err
	}
	drop := map[string]bool{}
	for _, r := range revoked {
		drop[r.User] = true
	}
	if !shared {
		drop[cluster.EtcdEdgeUser(trust.Info.ID)] = true
	}
	users := etcdUsers(trust.Info.ID, nodes, shared)
	on, deleted, err := store.EnsureEtcdAuth(cfg, pw, users, func(name string) bool { return drop[name] })
	for _, d := range deleted {
		fmt.Printf("deleted etcd user %s\n", d)
	}
	if err == nil {
		err = afterEtcdAuth(st, shared, nodes, revoked, deleted)
	}
	if err != nil {
		switch {
		case made && errors.Is(err, store.ErrEtcdRootLogin):
			// Authentication was on already, with another password:
			// the one made here is nobody's.
			_ = os.Remove(pwFile)
		case made:
			// etcd may have taken it (an answer lost after the change).
			err = fmt.Errorf("%w (the root password made for this run is kept in %s: etcd may hold it)", err, pwFile)
		}
		return err
	}
	if made {
		fmt.Printf("wrote a new root password for etcd to %s\n", pwFile)
	}
	for _, n := range nodes {
		fmt.Printf("node %s: etcd user %s, writing only its own registry entry\n", n.Node, n.User)
	}
	edges := cluster.EtcdEdgeUser(trust.Info.ID) + " (DIR/edge's shared pair)"
	if !shared {
		edges = "only nodes' own users (DIR/edge's shared pair has none: --shared-edge-user=true brings it back)"
	}
	if on {
		fmt.Printf("etcd's authentication is on: %s may use %s*, %s only what an edge uses; root's password is in %s\n", users[0].Name, c.etcdPrefix, edges, pwFile)
	} else {
		fmt.Printf("etcd's authentication was on already: the roles of %s and %s are set anew\n", users[0].Name, edges)
	}
	return nil
}

// sharedEdgeUser decides whether the shared edge user is kept: as
// --shared-edge-user says if given, else as the last run that was told
// (cluster.SharedEdgeUser), else yes.
func sharedEdgeUser(st store.Store, f *cmdFlags, flagValue bool) (bool, error) {
	given := false
	f.Visit(func(fl *flag.Flag) { given = given || fl.Name == "shared-edge-user" })
	if given {
		return flagValue, nil
	}
	keep, err := cluster.SharedEdgeUser(st)
	if errors.Is(err, store.ErrEtcdRefused) {
		// A prefix no run has set roles for yet: its apiservers' user
		// may not read it, and nothing is recorded there.
		return true, nil
	}
	return keep, err
}

// afterEtcdAuth records the shared edge user's fate, and removes the
// registry entries of the revoked nodes whose users this run deleted and
// that have no new directory yet: a revoked edge still running could
// otherwise keep its entry alive (etcd renews a lease without asking who
// renews it), holding the node's name against its new directory.
func afterEtcdAuth(st store.Store, shared bool, nodes, revoked []cluster.NodeEtcdUser, deleted []string) error {
	if err := cluster.SetSharedEdgeUser(st, shared); err != nil {
		return err
	}
	for _, r := range revoked {
		if !slices.Contains(deleted, r.User) || slices.ContainsFunc(nodes, func(n cluster.NodeEtcdUser) bool { return n.Node == r.Node }) {
			continue
		}
		if err := cluster.DropNodeEntry(st, r.Node); err != nil {
			return err
		}
		fmt.Printf("removed node %s's registry entry (its certificate is revoked)\n", r.Node)
	}
	return nil
}

// rootPassword reads etcd's root password from path or, if path does not
// exist, makes one and writes it there first (0600, never over a file).
func rootPassword(path string) (pw string, made bool, err error) {
	b, err := os.ReadFile(path)
	switch {
	case err == nil:
		pw = strings.TrimSpace(string(b))
		if len(pw) < 12 {
			return "", false, fmt.Errorf("--root-password-file %s: a password of at least 12 characters, please", path)
		}
		return pw, false, nil
	case !errors.Is(err, fs.ErrNotExist):
		return "", false, fmt.Errorf("--root-password-file: %w", err)
	}
	var r [24]byte
	if _, err := rand.Read(r[:]); err != nil {
		return "", false, err
	}
	pw = hex.EncodeToString(r[:])
	fh, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return "", false, fmt.Errorf("--root-password-file: %w", err)
	}
	if _, err := fh.WriteString(pw + "\n"); err != nil {
		fh.Close()
		return "", false, fmt.Errorf("--root-password-file: %w", err)
	}
	if err := fh.Close(); err != nil {
		return "", false, fmt.Errorf("--root-password-file: %w", err)
	}
	return pw, true, nil
}

// etcdClientUser is the user etcd takes a client pair for: its
// certificate's common name ("" if there is none).
func etcdClientUser(cfg *tls.Config) string {
	if cfg == nil || len(cfg.Certificates) == 0 || len(cfg.Certificates[0].Certificate) == 0 {
		return ""
	}
	leaf, err := x509.ParseCertificate(cfg.Certificates[0].Certificate[0])
	if err != nil {
		return ""
	}
	return leaf.Subject.CommonName
}

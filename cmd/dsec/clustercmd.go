package main

import (
	"fmt"
	"path/filepath"

	"github.com/dsecproject/dsec/internal/cluster"
)

// runCluster is `dsec cluster init`.
func runCluster(args []string) error {
	if len(args) == 0 || args[0] != "init" {
		return fmt.Errorf("usage: dsec cluster init --dir DIR")
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
			"Both roles also get etcd-client.pem, the pair they present to an etcd\n"+
			"reached over https://; with --etcd-hosts, DIR/etcd holds the pair etcd's\n"+
			"members serve clients and each other with (docs/operating.md).")
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

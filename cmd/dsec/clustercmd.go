package main

import (
	"fmt"

	"github.com/dsecproject/dsec/internal/cluster"
)

// runCluster is `dsec cluster init`.
func runCluster(args []string) error {
	if len(args) == 0 || args[0] != "init" {
		return fmt.Errorf("usage: dsec cluster init --dir DIR")
	}
	var dir string
	f := newCmdFlags("cluster init", "--dir DIR",
		"Write a new cluster directory: a CA and the certificates apiservers and\n"+
			"edges use to trust each other (mutual TLS on the internal API), and the\n"+
			"cluster's id. Copy it to every machine of the cluster (the *-key.pem\n"+
			"files are secrets; ca-key.pem is needed only to issue more).")
	f.StringVar(&dir, "dir", "", "directory to write (required; must not hold a cluster yet)")
	if _, err := f.parseN(args[1:], 0, 0); err != nil {
		return err
	}
	if dir == "" {
		return fmt.Errorf("--dir is required")
	}
	info, err := cluster.Init(dir)
	if err != nil {
		return err
	}
	fmt.Printf("cluster %s written to %s\n", info.ID, dir)
	fmt.Printf("next: dsec server --cluster %s --etcd URLS --layers DIR --api-key KEY; dsec edge --cluster %s ...\n", dir, dir)
	return nil
}

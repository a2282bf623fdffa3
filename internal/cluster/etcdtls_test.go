package cluster

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/internal/store"
	"github.com/dsecproject/dsec/internal/store/etcdtest"
)

func TestInitEtcdHosts(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "c")
	if _, err := Init(dir, InitOptions{EtcdHosts: []string{"127.0.0.1", "etcd-0.example", "*.etcd.svc"}}); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(dir, EtcdDir, EtcdServerCert))
	if err != nil {
		t.Fatal(err)
	}
	pair, err := tls.LoadX509KeyPair(filepath.Join(dir, EtcdDir, EtcdServerCert), filepath.Join(dir, EtcdDir, EtcdServerKey))
	if err != nil {
		t.Fatalf("etcd pair: %v (%d bytes)", err, len(b))
	}
	leaf, _ := x509.ParseCertificate(pair.Certificate[0])
	tr, err := Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, host := range []string{"127.0.0.1", "etcd-0.example", "etcd-2.etcd.svc"} {
		if _, err := leaf.Verify(x509.VerifyOptions{DNSName: host, Roots: tr.pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
			t.Errorf("etcd certificate for %s: %v", host, err)
		}
		if _, err := leaf.Verify(x509.VerifyOptions{DNSName: host, Roots: tr.pool, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}); err != nil {
			t.Errorf("etcd certificate as a peer's client for %s: %v", host, err)
		}
	}
	if _, err := leaf.Verify(x509.VerifyOptions{DNSName: "10.0.0.9", Roots: tr.pool}); err == nil {
		t.Error("etcd certificate valid for an address not given")
	}
	if fi, err := os.Stat(filepath.Join(dir, EtcdDir, EtcdServerKey)); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("etcd key: %v %v, want mode 0600", fi, err)
	}
	// Each role directory holds the etcd client pair, and not etcd's.
	for role := range RoleFiles {
		for _, f := range []string{EtcdClientCert, EtcdClientKey} {
			if _, err := os.Stat(filepath.Join(dir, role, f)); err != nil {
				t.Errorf("%s/%s: %v", role, f, err)
			}
		}
		if _, err := os.Stat(filepath.Join(dir, role, EtcdServerKey)); err == nil {
			t.Errorf("%s/ holds etcd's key", role)
		}
		// Each role is its own user to etcd.
		pair, err := tls.LoadX509KeyPair(filepath.Join(dir, role, EtcdClientCert), filepath.Join(dir, role, EtcdClientKey))
		if err != nil {
			t.Fatalf("%s/ etcd client pair: %v", role, err)
		}
		leaf, _ := x509.ParseCertificate(pair.Certificate[0])
		if want := map[string]string{"server": EtcdServerUser(tr.Info.ID), "edge": EtcdEdgeUser(tr.Info.ID)}[role]; leaf.Subject.CommonName != want {
			t.Errorf("%s/%s is %q to etcd, want %q", role, EtcdClientCert, leaf.Subject.CommonName, want)
		}
	}
	// Without hosts, no etcd directory; bad hosts are refused before
	// anything is written.
	_, plain := mustInit(t)
	if _, err := os.Stat(filepath.Join(plain, EtcdDir)); err == nil {
		t.Error("etcd/ written without --etcd-hosts")
	}
	bad := filepath.Join(t.TempDir(), "bad")
	for _, h := range []string{"etcd 1", "a..b", "", "x/y"} {
		if _, err := Init(bad, InitOptions{EtcdHosts: []string{h}}); err == nil || !strings.Contains(err.Error(), "neither an IP address nor a DNS name") {
			t.Errorf("etcd host %q: %v", h, err)
		}
		if _, err := os.Stat(bad); err == nil {
			t.Fatalf("etcd host %q: %s written", h, bad)
		}
	}
	// An existing etcd/ is refused like a role's directory.
	half := t.TempDir()
	if err := os.Mkdir(filepath.Join(half, EtcdDir), 0o700); err != nil {
		t.Fatal(err)
	}
	if _, err := Init(half, InitOptions{EtcdHosts: []string{"127.0.0.1"}}); err == nil || !strings.Contains(err.Error(), "etcd/") {
		t.Fatalf("init over etcd/: %v", err)
	}
}

// TestEtcdTLS runs a real etcd that requires client certificates of the
// cluster's CA, and reaches it as each role does, and as callers without
// the right certificate.
func TestEtcdTLS(t *testing.T) {
	if _, err := etcdtest.Binary(); err != nil {
		t.Skip(err)
	}
	root := t.TempDir()
	dir := filepath.Join(root, "cluster")
	if _, err := Init(dir, InitOptions{EtcdHosts: []string{"127.0.0.1"}}); err != nil {
		t.Fatal(err)
	}
	other := filepath.Join(root, "other")
	if _, err := Init(other, InitOptions{EtcdHosts: []string{"127.0.0.1"}}); err != nil {
		t.Fatal(err)
	}
	tr, err := Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	client, err := tr.EtcdTLS(EtcdTLSFiles{})
	if err != nil {
		t.Fatal(err)
	}
	ed := filepath.Join(dir, EtcdDir)
	c, err := etcdtest.StartTLS(filepath.Join(root, "etcd"), 1, &etcdtest.TLS{
		CA: filepath.Join(ed, caCert), Cert: filepath.Join(ed, EtcdServerCert), Key: filepath.Join(ed, EtcdServerKey), Client: client})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Stop)
	eps := c.Endpoints()
	if !strings.HasPrefix(eps[0], "https://") {
		t.Fatalf("endpoints %v", eps)
	}
	open := func(cfg *tls.Config, eps []string) error {
		st, err := store.OpenEtcd(store.EtcdConfig{Endpoints: eps, TLS: cfg, DialTimeout: time.Second, OpTimeout: 1500 * time.Millisecond})
		if err != nil {
			return err
		}
		defer st.Close()
		if err := st.Ping(context.Background()); err != nil {
			return err
		}
		return st.Put("b", "k", []byte("v"))
	}
	load := func(d string) *Trust {
		tr, err := Load(d)
		if err != nil {
			t.Fatal(err)
		}
		return tr
	}
	for _, role := range []string{"server", "edge"} {
		cfg, err := load(filepath.Join(dir, role)).EtcdTLS(EtcdTLSFiles{})
		if err != nil {
			t.Fatal(err)
		}
		if err := open(cfg, eps); err != nil {
			t.Errorf("%s reaching etcd with its cluster directory: %v", role, err)
		}
	}
	// The same files given as flags (an etcd with a PKI of its own).
	cfg, err := load(filepath.Join(other, "edge")).EtcdTLS(EtcdTLSFiles{CA: filepath.Join(dir, caCert), Cert: filepath.Join(dir, EtcdClientCert), Key: filepath.Join(dir, EtcdClientKey)})
	if err != nil {
		t.Fatal(err)
	}
	if err := open(cfg, eps); err != nil {
		t.Errorf("with --etcd-ca/--etcd-cert/--etcd-key: %v", err)
	}

	good := load(dir)
	noCert, _ := good.EtcdTLS(EtcdTLSFiles{})
	noCert.Certificates = nil
	foreign, _ := good.EtcdTLS(EtcdTLSFiles{Cert: filepath.Join(other, EtcdClientCert), Key: filepath.Join(other, EtcdClientKey)})
	edgeCert, _ := good.EtcdTLS(EtcdTLSFiles{Cert: filepath.Join(dir, edgeCert), Key: filepath.Join(dir, edgeKey)})
	otherCA, _ := load(other).EtcdTLS(EtcdTLSFiles{})
	for _, bad := range []struct {
		name string
		cfg  *tls.Config
		eps  []string
	}{
		{"no client certificate", noCert, eps},
		{"another cluster's client certificate", foreign, eps},
		{"the edges' internal-API certificate (server use only)", edgeCert, eps},
		{"another cluster's CA and certificate", otherCA, eps},
		{"no TLS", nil, []string{strings.Replace(eps[0], "https://", "http://", 1)}},
	} {
		err := open(bad.cfg, bad.eps)
		t.Logf("%s: %v", bad.name, err)
		if err == nil {
			t.Errorf("%s: etcd answered", bad.name)
		}
	}
	if _, err := good.EtcdTLS(EtcdTLSFiles{Cert: filepath.Join(dir, EtcdClientCert)}); err == nil || !strings.Contains(err.Error(), "go together") {
		t.Errorf("cert without key: %v", err)
	}
	if _, err := good.EtcdTLS(EtcdTLSFiles{CA: filepath.Join(dir, "cluster.json")}); err == nil || !strings.Contains(err.Error(), "no PEM certificate") {
		t.Errorf("CA file without a certificate: %v", err)
	}
}

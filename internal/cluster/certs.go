// Package cluster holds what the processes of a multi-process dsec share
// to trust and find each other: the cluster directory (a CA and the
// certificates of apiservers and edges, made by `dsec cluster init`), the
// mutual TLS of the internal API, the node registry in the store (each
// edge under a lease), the apiservers' liveness records, and the check
// that every process uses the same etcd and the same layer directory.
package cluster

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"time"
)

// Names inside certificates. The internal API's TLS is checked against
// these, not against addresses: edges listen wherever they are told.
const (
	// EdgeName is the DNS name in every edge certificate (and the name
	// an apiserver verifies).
	EdgeName = "dsec-edge"
	// APIServerName is the common name of the apiserver certificate,
	// which edges require of every caller.
	APIServerName = "dsec-apiserver"
)

// Files of a cluster directory.
const (
	caCert        = "ca.pem"
	caKey         = "ca-key.pem"
	apiserverCert = "apiserver.pem"
	apiserverKey  = "apiserver-key.pem"
	edgeCert      = "edge.pem"
	edgeKey       = "edge-key.pem"
	infoFile      = "cluster.json"
	// EtcdClientCert and EtcdClientKey are the pair a role's directory
	// presents to an etcd that requires client certificates: common name
	// EtcdServerUser in DIR/server (and DIR itself), EtcdEdgeUser in
	// DIR/edge (DIR holds that one as etcdEdgeCert).
	EtcdClientCert = "etcd-client.pem"
	EtcdClientKey  = "etcd-client-key.pem"
	etcdEdgeCert   = "etcd-client-edge.pem"
	etcdEdgeKey    = "etcd-client-edge-key.pem"
	// EtcdDir is the subdirectory Init writes for etcd's members when
	// given their names: ca.pem, EtcdServerCert and EtcdServerKey.
	EtcdDir        = "etcd"
	EtcdServerCert = "etcd.pem"
	EtcdServerKey  = "etcd-key.pem"
)

// EtcdServerUser and EtcdEdgeUser are the common names of the roles'
// etcd client certificates of cluster id: the user names etcd sees when
// its authentication is on (dsec cluster etcd-auth gives edges only what
// they use). The id keeps apart the users of clusters sharing one etcd.
func EtcdServerUser(id string) string { return "dsec-server-" + id }

// EtcdEdgeUser: see EtcdServerUser.
func EtcdEdgeUser(id string) string { return "dsec-edge-" + id }

// EtcdNodeUserPrefix begins the user names of nodes' own etcd
// certificates (AddEdge): EtcdNodeUserPrefix(id) + NODE + "-" + a random
// suffix, new with each certificate, so that a certificate taken back
// (RevokeEdge) names a user nobody else's does.
func EtcdNodeUserPrefix(id string) string { return EtcdEdgeUser(id) + "-" }

// Info identifies a cluster.
type Info struct {
	// ID is random, made by Init; etcd and the layer directory remember
	// it, so that a process given another cluster's etcd or layers fails.
	ID        string    `json:"id"`
	CreatedAt time.Time `json:"created_at"`
}

// InitOptions are Init's choices.
type InitOptions struct {
	// EtcdHosts, if not empty, are the names and addresses etcd's
	// members are reached at (IP addresses or DNS names, "*.x" for a
	// wildcard): Init then also writes EtcdDir, a certificate for them
	// (client and peer TLS) from the cluster's CA.
	EtcdHosts []string
}

// Init writes a new cluster directory: a CA, a certificate for the
// apiservers (client) and one for the edges (server), the pair both
// present to etcd, and the cluster's ID; with opt.EtcdHosts, etcd's own
// pair. It refuses a directory that already holds a cluster.
func Init(dir string, opt InitOptions) (Info, error) {
	var etcdIPs []net.IP
	var etcdDNS []string
	for _, h := range opt.EtcdHosts {
		switch ip := net.ParseIP(h); {
		case ip != nil:
			etcdIPs = append(etcdIPs, ip)
		case validDNSName(h):
			etcdDNS = append(etcdDNS, h)
		default:
			return Info{}, fmt.Errorf("etcd host %q is neither an IP address nor a DNS name", h)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, caCert)); err == nil {
		return Info{}, fmt.Errorf("%s already holds a cluster (%s exists); use another directory, or remove it to start over", dir, caCert)
	} else if !errors.Is(err, fs.ErrNotExist) {
		return Info{}, err
	}
	for _, sub := range append(slices.Sorted(maps.Keys(RoleFiles)), EtcdDir) {
		if _, err := os.Lstat(filepath.Join(dir, sub)); err == nil {
			return Info{}, fmt.Errorf("%s already holds %s/: use another directory, or remove it to start over", dir, sub)
		}
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return Info{}, fmt.Errorf("creating %s: %w", dir, err)
	}
	var idb [8]byte
	if _, err := rand.Read(idb[:]); err != nil {
		return Info{}, err
	}
	info := Info{ID: hex.EncodeToString(idb[:]), CreatedAt: time.Now().UTC().Truncate(time.Second)}
	now := time.Now().Add(-time.Hour)
	until := now.Add(10 * 365 * 24 * time.Hour)

	caPriv, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return Info{}, err
	}
	caTmpl := &x509.Certificate{
		SerialNumber: serial(), Subject: pkix.Name{CommonName: "dsec cluster CA " + info.ID, Organization: []string{"dsec"}},
		NotBefore: now, NotAfter: until, IsCA: true, BasicConstraintsValid: true, MaxPathLen: 0, MaxPathLenZero: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caPriv.PublicKey, caPriv)
	if err != nil {
		return Info{}, fmt.Errorf("making the cluster CA: %w", err)
	}
	ca, _ := x509.ParseCertificate(caDER)
	iss := &issuer{id: info.ID, ca: ca, key: caPriv, from: now, until: until}
	apiDER, apiPriv, err := iss.leaf(APIServerName, leafNames{}, []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth})
	if err != nil {
		return Info{}, fmt.Errorf("making the apiserver certificate: %w", err)
	}
	edgeDER, edgePriv, err := iss.leaf(EdgeName, leafNames{dns: []string{EdgeName}}, []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth})
	if err != nil {
		return Info{}, fmt.Errorf("making the edge certificate: %w", err)
	}
	etcdServerDER, etcdServerPriv, err := iss.leaf(EtcdServerUser(info.ID), leafNames{}, []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth})
	if err != nil {
		return Info{}, fmt.Errorf("making the apiservers' etcd client certificate: %w", err)
	}
	etcdEdgeDER, etcdEdgePriv, err := iss.leaf(EtcdEdgeUser(info.ID), leafNames{}, []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth})
	if err != nil {
		return Info{}, fmt.Errorf("making the edges' etcd client certificate: %w", err)
	}
	infoJSON, _ := json.MarshalIndent(info, "", "  ")
	files := []pemFile{
		{caCert, pemBlock("CERTIFICATE", caDER), 0o644},
		{caKey, pemKey(caPriv), 0o600},
		{apiserverCert, pemBlock("CERTIFICATE", apiDER), 0o644},
		{apiserverKey, pemKey(apiPriv), 0o600},
		{edgeCert, pemBlock("CERTIFICATE", edgeDER), 0o644},
		{edgeKey, pemKey(edgePriv), 0o600},
		{EtcdClientCert, pemBlock("CERTIFICATE", etcdServerDER), 0o644},
		{EtcdClientKey, pemKey(etcdServerPriv), 0o600},
		{etcdEdgeCert, pemBlock("CERTIFICATE", etcdEdgeDER), 0o644},
		{etcdEdgeKey, pemKey(etcdEdgePriv), 0o600},
		{infoFile, append(infoJSON, '\n'), 0o644},
	}
	if err := writeFiles(dir, files); err != nil {
		return Info{}, err
	}
	if len(opt.EtcdHosts) > 0 {
		// Members serve clients and each other with one pair: server
		// and client use.
		der, priv, err := iss.leaf("dsec-etcd", leafNames{dns: etcdDNS, ips: etcdIPs}, []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth})
		if err != nil {
			return Info{}, fmt.Errorf("making the etcd certificate: %w", err)
		}
		if err := writeFiles(filepath.Join(dir, EtcdDir), []pemFile{{caCert, pemBlock("CERTIFICATE", caDER), 0o644},
			{EtcdServerCert, pemBlock("CERTIFICATE", der), 0o644}, {EtcdServerKey, pemKey(priv), 0o600}}); err != nil {
			return Info{}, err
		}
	}
	// What each role's machines get: its own pairs, the CA's certificate
	// and the id. An edge holding the apiserver key could drive every
	// other edge; nothing that runs needs the CA's key.
	byName := map[string]pemFile{}
	for _, f := range files {
		byName[f.name] = f
	}
	for role := range RoleFiles {
		if err := writeFiles(filepath.Join(dir, role), roleDir(role, byName)); err != nil {
			return Info{}, err
		}
	}
	return info, nil
}

// roleDir is the files of role's directory (RoleFiles), from the files of
// the cluster directory by name; a source missing there is left out.
func roleDir(role string, byName map[string]pemFile) []pemFile {
	var out []pemFile
	for name, from := range RoleFiles[role] {
		if f, ok := byName[from]; ok {
			f.name = name
			out = append(out, f)
		}
	}
	return out
}

// pemFile is a file of a cluster directory.
type pemFile struct {
	name string
	data []byte
	mode os.FileMode
}

// writeFiles writes files into dir, which it makes (0700) unless it
// exists.
func writeFiles(dir string, files []pemFile) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("creating %s: %w", dir, err)
	}
	for _, f := range files {
		if err := writeSynced(filepath.Join(dir, f.name), f.data, f.mode); err != nil {
			return fmt.Errorf("writing %s: %w", filepath.Join(dir, f.name), err)
		}
	}
	return nil
}

// writeSynced writes a new file and syncs it: keys and certificates are
// written once, and a directory renamed into place after a crash must not
// hold torn ones.
func writeSynced(path string, data []byte, mode os.FileMode) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, mode)
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	if serr := f.Sync(); err == nil {
		err = serr
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// RoleFiles are the files each role's machines need, which Init writes
// into a subdirectory named after the role (a --cluster directory of its
// own): by their name there, the file of the cluster directory each is.
// Apiservers ("server") get their pairs, edges ("edge") theirs (the
// edges' etcd pair under the name every role's has), both the CA's
// certificate and cluster.json.
var RoleFiles = map[string]map[string]string{
	"server": {infoFile: infoFile, caCert: caCert, apiserverCert: apiserverCert, apiserverKey: apiserverKey,
		EtcdClientCert: EtcdClientCert, EtcdClientKey: EtcdClientKey},
	"edge": {infoFile: infoFile, caCert: caCert, edgeCert: edgeCert, edgeKey: edgeKey,
		EtcdClientCert: etcdEdgeCert, EtcdClientKey: etcdEdgeKey},
}

// validDNSName reports whether h may stand in a certificate as a DNS
// name: letters, digits, '-' and '.', optionally after a leading "*.".
func validDNSName(h string) bool {
	h = strings.TrimPrefix(h, "*.")
	if h == "" || len(h) > 253 || strings.HasPrefix(h, ".") || strings.HasSuffix(h, ".") || strings.Contains(h, "..") {
		return false
	}
	for _, r := range h {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '.') {
			return false
		}
	}
	return true
}

func serial() *big.Int {
	n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 126))
	return n
}

func pemBlock(kind string, der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: kind, Bytes: der})
}

func pemKey(k *ecdsa.PrivateKey) []byte {
	der, _ := x509.MarshalECPrivateKey(k)
	return pemBlock("EC PRIVATE KEY", der)
}

// Trust is a loaded cluster directory.
type Trust struct {
	Info Info
	pool *x509.CertPool
	dir  string
	// revoked are the revoked certificates by serial (WatchRevoked).
	revoked atomic.Pointer[map[string]Revocation]
}

// Load reads the cluster directory dir (made by Init).
func Load(dir string) (*Trust, error) {
	b, err := os.ReadFile(filepath.Join(dir, infoFile))
	if err != nil {
		return nil, fmt.Errorf("--cluster %s: %w (make one with dsec cluster init --dir %s)", dir, err, dir)
	}
	var info Info
	if err := json.Unmarshal(b, &info); err != nil || info.ID == "" {
		return nil, fmt.Errorf("--cluster %s: %s is not a cluster description", dir, infoFile)
	}
	caPEM, err := os.ReadFile(filepath.Join(dir, caCert))
	if err != nil {
		return nil, fmt.Errorf("--cluster %s: %w", dir, err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return nil, fmt.Errorf("--cluster %s: %s holds no certificate", dir, caCert)
	}
	return &Trust{Info: info, pool: pool, dir: dir}, nil
}

func (t *Trust) pair(cert, key string) (tls.Certificate, error) {
	c, err := tls.LoadX509KeyPair(filepath.Join(t.dir, cert), filepath.Join(t.dir, key))
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("--cluster %s: loading %s: %w", t.dir, cert, err)
	}
	return c, nil
}

// EdgeServerTLS is the TLS of an edge's internal API listener: it serves
// only callers with the apiserver certificate of this cluster's CA.
func (t *Trust) EdgeServerTLS() (*tls.Config, error) {
	c, err := t.pair(edgeCert, edgeKey)
	if err != nil {
		return nil, err
	}
	return &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{c},
		ClientCAs:    t.pool,
		ClientAuth:   tls.RequireAndVerifyClientCert,
		// The chain is verified by the handshake; the caller must also
		// be an apiserver (an edge's certificate does not let one edge
		// drive another).
		VerifyPeerCertificate: func(_ [][]byte, chains [][]*x509.Certificate) error {
			if len(chains) == 0 || len(chains[0]) == 0 || chains[0][0].Subject.CommonName != APIServerName {
				return errors.New("the internal API serves only dsec apiservers")
			}
			return nil
		},
	}, nil
}

// APIServerClientTLS returns the TLS an apiserver dials each node's edge
// with: it presents the apiserver certificate and accepts only an edge
// certificate of this cluster's CA that names that node, or the edges'
// shared one unless requireNode (verifyEdge).
func (t *Trust) APIServerClientTLS(requireNode bool) (func(node string) *tls.Config, error) {
	c, err := t.pair(apiserverCert, apiserverKey)
	if err != nil {
		return nil, err
	}
	return func(node string) *tls.Config {
		return &tls.Config{
			MinVersion:   tls.VersionTLS13,
			Certificates: []tls.Certificate{c},
			ServerName:   EdgeName,
			// The chain and the name are verified below, against the
			// node dialed: the stock check knows one name for every edge.
			InsecureSkipVerify: true,
			VerifyConnection:   func(cs tls.ConnectionState) error { return t.verifyEdge(cs, node, requireNode) },
		}
	}, nil
}

// EtcdTLSFiles override what EtcdTLS takes from the cluster directory,
// for an etcd with a PKI of its own: CA verifies etcd's certificate, and
// Cert and Key (both or neither) are presented to it.
type EtcdTLSFiles struct {
	CA, Cert, Key string
}

// EtcdTLS is the TLS apiservers and edges reach etcd with (https://
// endpoints): etcd's certificate verified against the cluster's CA, and
// the directory's etcd client pair presented, unless files say otherwise.
// A cluster directory without that pair (made before it existed)
// presents none: an etcd that requires client certificates then refuses,
// which the caller's error says.
func (t *Trust) EtcdTLS(files EtcdTLSFiles) (*tls.Config, error) {
	if (files.Cert == "") != (files.Key == "") {
		return nil, errors.New("--etcd-cert and --etcd-key go together")
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, RootCAs: t.pool}
	if files.CA != "" {
		b, err := os.ReadFile(files.CA)
		if err != nil {
			return nil, fmt.Errorf("--etcd-ca: %w", err)
		}
		cfg.RootCAs = x509.NewCertPool()
		if !cfg.RootCAs.AppendCertsFromPEM(b) {
			return nil, fmt.Errorf("--etcd-ca %s holds no PEM certificate", files.CA)
		}
	}
	switch {
	case files.Cert != "":
		c, err := tls.LoadX509KeyPair(files.Cert, files.Key)
		if err != nil {
			return nil, fmt.Errorf("--etcd-cert/--etcd-key: %w", err)
		}
		cfg.Certificates = []tls.Certificate{c}
	default:
		if _, err := os.Stat(filepath.Join(t.dir, EtcdClientCert)); errors.Is(err, fs.ErrNotExist) {
			break
		}
		c, err := t.pair(EtcdClientCert, EtcdClientKey)
		if err != nil {
			return nil, err
		}
		cfg.Certificates = []tls.Certificate{c}
	}
	return cfg, nil
}

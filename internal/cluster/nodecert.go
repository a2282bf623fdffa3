package cluster

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/dsecproject/dsec/internal/edgeapi"
)

// Edge identities. The certificate `dsec cluster init` writes into
// DIR/edge is every edge's ("dsec-edge"): an apiserver takes whoever
// presents it for whichever node it dials. A node certificate, made by
// AddEdge for one node, names it (a URI, NodeURI) and nothing else: an
// apiserver dialing node N takes it only if it names N, so that a host
// holding node M's certificate cannot stand in for N even where it can
// rewrite N's address in the node registry. An apiserver that requires
// node certificates (APIServerClientTLS's requireNode; dsec server
// --require-node-certs) refuses the shared one: until it does, any host
// holding the shared certificate may still answer for any node. A node
// certificate is taken back with RevokeEdge (revoke.go), which also
// moves its directory aside so that AddEdge can issue the node another.

// EdgesDir is where AddEdge writes each node's --cluster directory
// (EdgesDir/NAME).
const EdgesDir = "edges"

// NodeURI is the URI a node certificate of cluster id names node by.
func NodeURI(id, node string) string {
	return (&url.URL{Scheme: "dsec", Host: id, Path: "/edge/" + node}).String()
}

// AddEdge writes dir/EdgesDir/node, the --cluster directory of one
// edge: its own certificate (NodeURI), an etcd client pair of its own
// (a user of its own, EtcdNodeUserPrefix, which dsec cluster etcd-auth
// lets write only the node's registry entry and abandoned creates), the
// CA's certificate and cluster.json. dir is the directory Init wrote (it
// needs the CA's key). It refuses a node that already has one.
func AddEdge(dir, node string) (string, error) {
	if err := edgeapi.CheckNodeName(node); err != nil {
		return "", err
	}
	iss, err := loadIssuer(dir)
	if err != nil {
		return "", err
	}
	out := filepath.Join(dir, EdgesDir, node)
	if _, err := os.Lstat(out); err == nil {
		return "", fmt.Errorf("%s exists: node %s has a certificate already (dsec cluster revoke-edge takes it back; then issue a new one)", out, node)
	} else if !errors.Is(err, fs.ErrNotExist) {
		return "", err
	}
	u, _ := url.Parse(NodeURI(iss.id, node))
	der, priv, err := iss.leaf(EdgeName+" "+node, leafNames{uris: []*url.URL{u}}, []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth})
	if err != nil {
		return "", fmt.Errorf("making node %s's certificate: %w", node, err)
	}
	// DIR/edge's files, this node's pairs instead of the shared ones. A
	// directory older than etcd's pairs has none (as DIR/edge then).
	byName := map[string]pemFile{edgeCert: {edgeCert, pemBlock("CERTIFICATE", der), 0o644}, edgeKey: {edgeKey, pemKey(priv), 0o600}}
	if _, err := os.Stat(filepath.Join(dir, etcdEdgeCert)); err == nil {
		var suffix [6]byte
		_, _ = rand.Read(suffix[:])
		der, priv, err := iss.leaf(EtcdNodeUserPrefix(iss.id)+node+"-"+hex.EncodeToString(suffix[:]), leafNames{}, []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth})
		if err != nil {
			return "", fmt.Errorf("making node %s's etcd certificate: %w", node, err)
		}
		byName[etcdEdgeCert] = pemFile{etcdEdgeCert, pemBlock("CERTIFICATE", der), 0o644}
		byName[etcdEdgeKey] = pemFile{etcdEdgeKey, pemKey(priv), 0o600}
	} else if !errors.Is(err, fs.ErrNotExist) {
		return "", err
	}
	for _, from := range RoleFiles["edge"] {
		if _, ok := byName[from]; ok || from == etcdEdgeCert || from == etcdEdgeKey {
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, from))
		if err != nil {
			return "", fmt.Errorf("%s: %w", dir, err)
		}
		byName[from] = pemFile{from, b, 0o644}
	}
	files := roleDir("edge", byName)
	if err := os.MkdirAll(filepath.Join(dir, EdgesDir), 0o700); err != nil {
		return "", err
	}
	// Written into a temporary directory renamed into place: a failure
	// leaves no half directory for the node. One a killed run left (a key
	// in it) goes first.
	ents, err := os.ReadDir(filepath.Join(dir, EdgesDir))
	if err != nil {
		return "", err
	}
	for _, e := range ents {
		// MkdirTemp's names: the pattern, then digits.
		if rest, ok := strings.CutPrefix(e.Name(), "."+node+"."); ok && rest != "" && strings.Trim(rest, "0123456789") == "" {
			if err := os.RemoveAll(filepath.Join(dir, EdgesDir, e.Name())); err != nil {
				return "", err
			}
		}
	}
	tmp, err := os.MkdirTemp(filepath.Join(dir, EdgesDir), "."+node+".")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp)
	if err := writeFiles(tmp, files); err != nil {
		return "", err
	}
	if err := os.Rename(tmp, out); err != nil {
		return "", err
	}
	return out, nil
}

// issuer makes leaf certificates from a cluster's CA.
type issuer struct {
	id          string
	ca          *x509.Certificate
	key         *ecdsa.PrivateKey
	from, until time.Time
}

// leafNames are what a leaf certificate is for besides its common name.
type leafNames struct {
	dns  []string
	ips  []net.IP
	uris []*url.URL
}

// leaf makes a certificate and its key for cn, names and usage.
func (iss *issuer) leaf(cn string, names leafNames, usage []x509.ExtKeyUsage) ([]byte, *ecdsa.PrivateKey, error) {
	priv, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	t := &x509.Certificate{
		SerialNumber: serial(), Subject: pkix.Name{CommonName: cn, Organization: []string{"dsec"}, OrganizationalUnit: []string{iss.id}},
		NotBefore: iss.from, NotAfter: iss.until, DNSNames: names.dns, IPAddresses: names.ips, URIs: names.uris, ExtKeyUsage: usage,
		KeyUsage: x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, t, iss.ca, &priv.PublicKey, iss.key)
	return der, priv, err
}

// loadIssuer reads the CA of the cluster directory dir (Init's, with
// ca-key.pem).
func loadIssuer(dir string) (*issuer, error) {
	t, err := Load(dir)
	if err != nil {
		return nil, err
	}
	certPEM, err := os.ReadFile(filepath.Join(dir, caCert))
	if err != nil {
		return nil, err
	}
	keyPEM, err := os.ReadFile(filepath.Join(dir, caKey))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%s has no %s: give the directory dsec cluster init wrote (a role's directory holds no CA key)", dir, caKey)
	} else if err != nil {
		return nil, err
	}
	cb, _ := pem.Decode(certPEM)
	kb, _ := pem.Decode(keyPEM)
	if cb == nil || kb == nil {
		return nil, fmt.Errorf("%s: %s or %s is not PEM", dir, caCert, caKey)
	}
	ca, err := x509.ParseCertificate(cb.Bytes)
	if err != nil {
		return nil, fmt.Errorf("%s: %s: %w", dir, caCert, err)
	}
	key, err := x509.ParseECPrivateKey(kb.Bytes)
	if err != nil {
		return nil, fmt.Errorf("%s: %s: %w", dir, caKey, err)
	}
	// Valid as long as the CA is (a certificate cannot outlive it).
	return &issuer{id: t.Info.ID, ca: ca, key: key, from: time.Now().Add(-time.Hour), until: ca.NotAfter}, nil
}

// NodeName is the node this directory's edge certificate names, if it is
// a node certificate (AddEdge); "" for the shared one.
func (t *Trust) NodeName() (string, error) {
	leaf, err := t.edgeLeaf()
	if err != nil {
		return "", err
	}
	for _, u := range leaf.URIs {
		if node, ok := t.nodeOf(u); ok {
			return node, nil
		}
	}
	return "", nil
}

// edgeLeaf is the directory's edge certificate (with its key: a pair an
// edge can serve with).
func (t *Trust) edgeLeaf() (*x509.Certificate, error) {
	c, err := t.pair(edgeCert, edgeKey)
	if err != nil {
		return nil, err
	}
	leaf, err := x509.ParseCertificate(c.Certificate[0])
	if err != nil {
		return nil, fmt.Errorf("--cluster %s: %s: %w", t.dir, edgeCert, err)
	}
	return leaf, nil
}

// nodeOf is the node u names if it is a NodeURI of this cluster.
func (t *Trust) nodeOf(u *url.URL) (string, bool) {
	if u.Scheme != "dsec" || u.Host != t.Info.ID || u.RawQuery != "" || u.Fragment != "" {
		return "", false
	}
	node, ok := strings.CutPrefix(u.Path, "/edge/")
	return node, ok && edgeapi.CheckNodeName(node) == nil
}

// verifyEdge checks the certificate chain an edge presented for node:
// from this cluster's CA, for serving, and either a node certificate
// naming node, or (unless requireNode) the shared edge certificate.
func (t *Trust) verifyEdge(cs tls.ConnectionState, node string, requireNode bool) error {
	if len(cs.PeerCertificates) == 0 {
		return errors.New("the edge presented no certificate")
	}
	leaf := cs.PeerCertificates[0]
	inter := x509.NewCertPool()
	for _, c := range cs.PeerCertificates[1:] {
		inter.AddCert(c)
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: t.pool, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
		return fmt.Errorf("the certificate at node %s's address is not an edge certificate of this cluster: %w", node, err)
	}
	if r, ok := t.revocationOf(leaf); ok {
		return fmt.Errorf("the certificate at node %s's address (node %s's, serial %s) was revoked at %s (%w)", node, r.Node, r.Serial, r.At.Format(time.RFC3339), edgeapi.ErrRevoked)
	}
	var named []string
	for _, u := range leaf.URIs {
		if n, ok := t.nodeOf(u); ok {
			named = append(named, n)
		}
	}
	switch {
	case slices.Contains(named, node):
		return nil
	case len(named) > 0:
		return fmt.Errorf("the certificate at node %s's address is node %s's: another host answers there (its registry entry rewritten, or an address reused)", node, named[0])
	case leaf.Subject.CommonName != EdgeName || leaf.VerifyHostname(EdgeName) != nil:
		// Not the shared one Init made (another certificate of the CA
		// for serving, such as etcd's, is not an edge's).
		return fmt.Errorf("the certificate at node %s's address is not an edge's", node)
	case requireNode:
		return fmt.Errorf("node %s presents the edges' shared certificate, and this apiserver requires node certificates (--require-node-certs): issue it one with dsec cluster add-edge --node-name %s", node, node)
	}
	return nil
}

// NodeEtcdUser is a node's own etcd user: the common name of the etcd
// certificate in its directory under EdgesDir (or RevokedDir).
type NodeEtcdUser struct {
	Node, User string
}

// NodeEtcdUsers lists the etcd users of the nodes this cluster directory
// holds directories of under EdgesDir (AddEdge's), for dsec cluster
// etcd-auth to grant, and those of the directories RevokeEdge moved to
// RevokedDir, for it to delete. A directory made before nodes had etcd
// users of their own holds the edges' shared pair and is left out; an
// unreadable one, or one whose certificate names another node, fails.
func (t *Trust) NodeEtcdUsers() (current, revoked []NodeEtcdUser, err error) {
	if current, err = t.nodeEtcdUsers(filepath.Join(t.dir, EdgesDir), false); err != nil {
		return nil, nil, err
	}
	if revoked, err = t.nodeEtcdUsers(filepath.Join(t.dir, RevokedDir), true); err != nil {
		return nil, nil, err
	}
	return current, revoked, nil
}

// nodeEtcdUsers reads the node directories under root: named NAME, or
// NAME-SERIAL if serialed (RevokeEdge's).
func (t *Trust) nodeEtcdUsers(root string, serialed bool) ([]NodeEtcdUser, error) {
	ents, err := os.ReadDir(root)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	} else if err != nil {
		return nil, err
	}
	var out []NodeEtcdUser
	for _, e := range ents {
		if !e.IsDir() || strings.HasPrefix(e.Name(), ".") {
			continue // AddEdge's temporary directories
		}
		node := e.Name()
		if serialed {
			i := strings.LastIndexByte(node, '-')
			if i <= 0 {
				return nil, fmt.Errorf("%s: not a revoked node's directory (NAME-SERIAL)", filepath.Join(root, node))
			}
			node = node[:i]
		}
		if err := edgeapi.CheckNodeName(node); err != nil {
			return nil, fmt.Errorf("%s: %w", filepath.Join(root, e.Name()), err)
		}
		p := filepath.Join(root, e.Name(), EtcdClientCert)
		b, err := os.ReadFile(p)
		if errors.Is(err, fs.ErrNotExist) {
			continue // made before etcd's pairs
		} else if err != nil {
			return nil, err
		}
		blk, _ := pem.Decode(b)
		if blk == nil {
			return nil, fmt.Errorf("%s is not PEM", p)
		}
		c, err := x509.ParseCertificate(blk.Bytes)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", p, err)
		}
		cn := c.Subject.CommonName
		switch rest, ok := strings.CutPrefix(cn, EtcdNodeUserPrefix(t.Info.ID)+node+"-"); {
		case cn == EtcdEdgeUser(t.Info.ID):
			continue // the shared pair: an older node directory
		case !ok || rest == "" || strings.Contains(rest, "-"):
			return nil, fmt.Errorf("%s names etcd user %q, not one of node %s of cluster %s", p, cn, node, t.Info.ID)
		}
		out = append(out, NodeEtcdUser{Node: node, User: cn})
	}
	return out, nil
}

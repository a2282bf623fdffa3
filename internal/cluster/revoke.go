package cluster

// Revoked node certificates. A node certificate (AddEdge) is valid as
// long as the CA; to take one back (a node's machine retired, or
// subverted), `dsec cluster revoke-edge` records its serial in etcd.
// Apiservers keep the revoked serials in memory from a watch and refuse
// them in every handshake (verifyEdge), and drop the node's kept-alive
// connections; an edge whose certificate is revoked refuses to start.

import (
	"context"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"time"

	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/store"
)

// bucketRevoked holds the revoked certificates: serial (hex) → Revocation.
const bucketRevoked = "cluster_revoked"

// RevokedDir is the subdirectory of a cluster directory where
// revoke-edge moves a revoked node's directory (NAME-SERIAL), so that
// add-edge can issue the node a new one.
const RevokedDir = "revoked"

// Revocation records a revoked certificate.
type Revocation struct {
	Serial string    `json:"serial"`
	Node   string    `json:"node"`
	At     time.Time `json:"at"`
}

// serialOf is how certificates are named in the revocation bucket.
func serialOf(c *x509.Certificate) string { return c.SerialNumber.Text(16) }

// edgeCertIn is the edge certificate of the --cluster directory dir.
func edgeCertIn(dir string) (*x509.Certificate, error) {
	t, err := Load(dir)
	if err != nil {
		return nil, err
	}
	return t.edgeLeaf()
}

// RevokeEdge revokes node's certificate, the one in dir/edges/NODE (dir:
// the cluster directory Init wrote), in st, then moves that directory to
// dir/revoked/NODE-SERIAL. It returns the revocation. Revoking again a
// node whose directory is gone already is an error (not found).
func RevokeEdge(st store.Store, dir, node string) (Revocation, error) {
	if err := edgeapi.CheckNodeName(node); err != nil {
		return Revocation{}, err
	}
	nodeDir := filepath.Join(dir, EdgesDir, node)
	cert, err := edgeCertIn(nodeDir)
	if errors.Is(err, fs.ErrNotExist) {
		return Revocation{}, errdefs.NotFound("%s does not exist: node %s has no certificate of its own in %s (dsec cluster add-edge writes one)", nodeDir, node, dir)
	}
	if err != nil {
		return Revocation{}, err
	}
	r := Revocation{Serial: serialOf(cert), Node: node, At: time.Now().UTC()}
	b, err := json.Marshal(r)
	if err != nil {
		return Revocation{}, err
	}
	if err := st.Put(bucketRevoked, r.Serial, b); err != nil {
		return Revocation{}, fmt.Errorf("recording the revocation in etcd: %w", err)
	}
	if err := os.MkdirAll(filepath.Join(dir, RevokedDir), 0o700); err != nil {
		return r, fmt.Errorf("revoked, but moving %s aside: %w", nodeDir, err)
	}
	if err := os.Rename(nodeDir, filepath.Join(dir, RevokedDir, node+"-"+r.Serial)); err != nil {
		return r, fmt.Errorf("revoked, but moving %s aside: %w", nodeDir, err)
	}
	return r, nil
}

// CheckNotRevoked returns an error naming the revocation if the edge
// certificate of the --cluster directory dir has been revoked in st; told
// is false, with the error, if it could not tell.
func CheckNotRevoked(st store.Store, dir string) (told bool, err error) {
	cert, err := edgeCertIn(dir)
	if err != nil {
		return false, err
	}
	b, err := st.Get(bucketRevoked, serialOf(cert))
	switch {
	case errors.Is(err, errdefs.ErrNotFound):
		return true, nil
	case err != nil:
		return false, fmt.Errorf("reading the revoked certificates: %w", err)
	}
	var r Revocation
	_ = json.Unmarshal(b, &r)
	return true, fmt.Errorf("--cluster %s: this edge certificate (node %s's, serial %s) was revoked at %s (dsec cluster revoke-edge); issue the node a new one with dsec cluster add-edge", dir, r.Node, r.Serial, r.At.Format(time.RFC3339))
}

// WatchRevoked keeps t's revoked serials current from st until ctx ends,
// and calls changed with the node of each revocation it learns of. It
// returns once they are read the first time (or ctx ends): an apiserver
// must not dial edges before.
func (t *Trust) WatchRevoked(ctx context.Context, st store.Store, changed func(node string)) {
	w, ok := st.(store.Watcher)
	if !ok {
		kvs, err := st.List(bucketRevoked, "")
		if err == nil {
			t.setRevoked(kvs)
		}
		return
	}
	first := make(chan struct{})
	var once bool
	w.WatchBucket(ctx, bucketRevoked, func(kvs []store.KV) {
		// Read whole (at first, and after a break in the watch): only
		// the nodes of revocations not known before are told, so that
		// a break does not drop every node's connections.
		for _, node := range t.setRevoked(kvs) {
			if changed != nil {
				changed(node)
			}
		}
		if !once {
			once = true
			close(first)
		}
	}, func(key string, val []byte) {
		r := t.revokeOne(key, val)
		if changed != nil {
			changed(r.Node)
		}
	})
	select {
	case <-first:
	case <-ctx.Done():
	}
}

// setRevoked replaces the revoked serials with those of kvs and returns
// the nodes of those that are new. A record that does not decode still
// revokes its serial.
func (t *Trust) setRevoked(kvs []store.KV) (added []string) {
	old := t.revoked.Load()
	m := map[string]Revocation{}
	for _, kv := range kvs {
		r := Revocation{Serial: kv.Key}
		_ = json.Unmarshal(kv.Value, &r)
		m[kv.Key] = r
		if old == nil || (*old)[kv.Key] == (Revocation{}) {
			added = append(added, r.Node)
		}
	}
	t.revoked.Store(&m)
	return added
}

// revokeOne adds (val nil: removes) one revoked serial.
func (t *Trust) revokeOne(serial string, val []byte) Revocation {
	var r Revocation
	m := map[string]Revocation{}
	if old := t.revoked.Load(); old != nil {
		m = maps.Clone(*old)
	}
	if val == nil {
		r = m[serial]
		delete(m, serial)
	} else {
		r.Serial = serial
		_ = json.Unmarshal(val, &r)
		m[serial] = r
	}
	t.revoked.Store(&m)
	return r
}

// revocationOf is the revocation of c, if it is revoked.
func (t *Trust) revocationOf(c *x509.Certificate) (Revocation, bool) {
	m := t.revoked.Load()
	if m == nil {
		return Revocation{}, false
	}
	r, ok := (*m)[serialOf(c)]
	return r, ok
}

package cluster

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/store"
	"github.com/dsecproject/dsec/internal/watcher"
)

// Store buckets of the cluster's membership.
const (
	bucketNodes   = "cluster_nodes"   // node name → NodeRecord, under the edge's lease
	bucketServers = "cluster_servers" // instance → ServerRecord, under the apiserver's lease
	bucketMeta    = "cluster"         // id, layers: the cluster's identity
)

// EdgeBuckets are the buckets of this package an edge reads and writes
// (its registry entry, the abandoned tokens it sweeps), EdgeReadBuckets
// those it only reads (the cluster's identity, which an apiserver writes
// first when etcd's authentication is on; the revoked certificates, so
// that an edge with one refuses to start). With it on (dsec cluster
// etcd-auth) an edge may use these, read the layer buckets
// (layer.Buckets) and the ping key, and nothing else.
var (
	EdgeBuckets     = []string{bucketNodes, bucketAbandoned}
	EdgeReadBuckets = []string{bucketMeta, bucketRevoked}
)

// sharedEdgeUserKey (in bucketMeta) says "off" when dsec cluster
// etcd-auth was told to delete the edges' shared etcd user.
const sharedEdgeUserKey = "shared_edge_user"

// SharedEdgeUser reports whether the edges' shared etcd user is to be
// kept: yes unless dsec cluster etcd-auth was told otherwise.
func SharedEdgeUser(st store.Store) (bool, error) {
	v, err := st.Get(bucketMeta, sharedEdgeUserKey)
	switch {
	case errors.Is(err, errdefs.ErrNotFound):
		return true, nil
	case err != nil:
		return false, err
	}
	return string(v) != "off", nil
}

// SetSharedEdgeUser records whether the edges' shared etcd user is kept.
func SetSharedEdgeUser(st store.Store, keep bool) error {
	if keep {
		return st.Delete(bucketMeta, sharedEdgeUserKey)
	}
	return st.Put(bucketMeta, sharedEdgeUserKey, []byte("off"))
}

// DropNodeEntry removes node's registry entry (its edge, if it runs and
// may still write, makes it again).
func DropNodeEntry(st store.Store, node string) error { return st.Delete(bucketNodes, node) }

// NodeGrants are what a node's own etcd user (Trust.NodeEtcdUsers) may do with
// this package's buckets: read EdgeReadBuckets and the registry, and
// write only its own registry entry and the abandoned creates of its
// own, so that a subverted node host can neither take another node's
// name nor sweep its creates.
func NodeGrants(node string) []store.EtcdGrant {
	var g []store.EtcdGrant
	for _, b := range append(slices.Clone(EdgeReadBuckets), bucketNodes) {
		g = append(g, store.EtcdGrant{Bucket: b})
	}
	return append(g, store.EtcdGrant{Key: bucketNodes + "/" + node, Write: true},
		store.EtcdGrant{Prefix: bucketAbandoned + "/" + node + "/", Write: true})
}

// LeaseTTL is how long a registry entry outlives its holder's last word.
const LeaseTTL = 5 * time.Second

// NodeRecord is an edge's entry in the node registry.
type NodeRecord struct {
	Name string `json:"name"`
	// Address is where its internal API listens (host:port).
	Address   string    `json:"address"`
	Instance  string    `json:"instance"`
	StartedAt time.Time `json:"started_at"`
	Hollow    bool      `json:"hollow,omitempty"`
}

// ServerRecord is an apiserver's liveness entry.
type ServerRecord struct {
	Instance  string    `json:"instance"`
	Address   string    `json:"address"`
	StartedAt time.Time `json:"started_at"`
}

// NewInstance returns a random instance id for a process.
func NewInstance() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// RegisterNode puts rec in the node registry for as long as ctx lasts. A
// name held by a live edge is refused (errdefs.ErrAlreadyExists, saying
// where that edge is). Once registered, a lost lease (the edge was cut
// off from etcd longer than LeaseTTL) is taken again in the background as
// soon as etcd answers; the edge's sandboxes keep running meanwhile.
//
// rec.Instance names the edge's state directory: an edge that restarts
// after a crash (same state dir, so same instance) takes over the entry
// its dead predecessor still holds, instead of waiting out the lease.
func RegisterNode(ctx context.Context, st store.Store, rec NodeRecord, log *slog.Logger) error {
	return hold(ctx, st, bucketNodes, rec.Name, rec, "node name "+rec.Name, log, sameInstance[NodeRecord](rec.Instance, func(r NodeRecord) string { return r.Instance }))
}

// sameInstance says whether a registry value is held by instance (an
// earlier run of the same state dir, or this process before it lost its
// lease).
func sameInstance[T any](instance string, of func(T) string) func([]byte) bool {
	return func(b []byte) bool {
		var r T
		return instance != "" && json.Unmarshal(b, &r) == nil && of(r) == instance
	}
}

// StateInstance returns the instance id kept in the state directory dir,
// or a new one (and false) if dir has none yet: the identity of an edge's
// state directory across restarts. SaveInstance keeps a new one.
func StateInstance(dir string) (string, bool) {
	b, err := os.ReadFile(filepath.Join(dir, "instance"))
	if id := strings.TrimSpace(string(b)); err == nil && id != "" {
		return id, true
	}
	return NewInstance(), false
}

// SaveInstance writes id as dir's instance (creating dir).
func SaveInstance(dir, id string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	if err := writeNew(filepath.Join(dir, "instance"), id); err != nil && !errors.Is(err, fs.ErrExist) {
		return err
	}
	return nil
}

// RegisterServer records an apiserver as alive for as long as ctx lasts.
func RegisterServer(ctx context.Context, st store.Store, rec ServerRecord, log *slog.Logger) error {
	return hold(ctx, st, bucketServers, rec.Instance, rec, "apiserver instance "+rec.Instance, log, sameInstance[ServerRecord](rec.Instance, func(r ServerRecord) string { return r.Instance }))
}

// ServerAlive reports whether the apiserver instance holds its lease.
func ServerAlive(st store.Store, instance string) (bool, error) {
	_, err := st.Get(bucketServers, instance)
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, errdefs.ErrNotFound):
		return false, nil
	}
	return false, err
}

// withoutInstance is a registry value as a refusal tells it: without its
// instance, which would let whoever reads the refusal take the entry over
// (sameInstance).
func withoutInstance(b []byte) string {
	var m map[string]json.RawMessage
	if json.Unmarshal(b, &m) != nil {
		return "(unreadable)"
	}
	delete(m, "instance")
	out, _ := json.Marshal(m)
	return string(out)
}

// hold keeps key in bucket under this process's lease while ctx lasts,
// taking the key over (atomically) when mine says its holder is this
// process's own earlier incarnation, and taking it again after a lost
// lease.
func hold(ctx context.Context, st store.Store, bucket, key string, v any, what string, log *slog.Logger, mine func([]byte) bool) error {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	l, ok := st.(store.Leaser)
	if !ok {
		return fmt.Errorf("registering %s: the store (%T) has no leases", what, st)
	}
	val, err := json.Marshal(v)
	if err != nil {
		return err
	}
	try := func() (<-chan struct{}, error) {
		// Ours from before (a crash, a lost lease): taken over in one
		// step, so no listing ever finds the key missing meanwhile.
		took := false
		lost, err := l.Hold(ctx, bucket, key, val, LeaseTTL, func(cur []byte) bool {
			took = mine(cur)
			return took
		})
		if errors.Is(err, errdefs.ErrAlreadyExists) {
			held := ""
			if b, gerr := st.Get(bucket, key); gerr == nil {
				held = ": " + withoutInstance(b)
			}
			return nil, errdefs.AlreadyExists("%s is held by another live process%s (names must be unique; stop it or pick another name)", what, held)
		}
		if err == nil && took {
			log.Info("took over the registry entry of this process's earlier run", "what", what)
		}
		return lost, err
	}
	lost, err := try()
	if errors.Is(err, errdefs.ErrAlreadyExists) {
		return err
	}
	if err != nil {
		return fmt.Errorf("registering %s: %w", what, err)
	}
	go func() {
		for {
			select {
			case <-ctx.Done():
				return
			case <-lost:
			}
			if ctx.Err() != nil {
				return
			}
			log.Warn("registry lease lost (cut off from etcd?); what this process serves keeps running; registering again", "what", what)
			for {
				select {
				case <-ctx.Done():
					return
				case <-time.After(time.Second):
				}
				var err error
				if lost, err = try(); err == nil {
					log.Info("registered again", "what", what)
					break
				}
				if errors.Is(err, errdefs.ErrAlreadyExists) {
					log.Error("cannot register again: another process holds the name", "what", what, "err", err)
				}
			}
		}
	}()
	return nil
}

// Source lists the edges of the node registry for a watcher, dialing each
// through dial (the internal API client over the cluster's TLS).
type Source struct {
	st   store.Store
	dial func(NodeRecord) edgeapi.Edge
	// Forget, if set, is told of each node that left the registry (its
	// client is dropped here too).
	Forget func(name string)

	mu    sync.Mutex
	known map[string]cached
}

type cached struct {
	rec  NodeRecord
	edge edgeapi.Edge
}

var _ watcher.Source = (*Source)(nil)

// NewSource returns the registry of st as a watcher Source.
func NewSource(st store.Store, dial func(NodeRecord) edgeapi.Edge) *Source {
	return &Source{st: st, dial: dial, known: map[string]cached{}}
}

// Members implements watcher.Source. A client is kept per node while its
// address stays the same.
func (s *Source) Members(ctx context.Context) (map[string]watcher.Member, error) {
	kvs, err := s.st.List(bucketNodes, "")
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]watcher.Member, len(kvs))
	for _, kv := range kvs {
		var rec NodeRecord
		if err := json.Unmarshal(kv.Value, &rec); err != nil || rec.Name != kv.Key || rec.Address == "" {
			continue
		}
		c, ok := s.known[rec.Name]
		if !ok || c.rec.Address != rec.Address {
			c = cached{rec: rec, edge: s.dial(rec)}
			s.known[rec.Name] = c
		}
		out[rec.Name] = watcher.Member{Edge: c.edge, Address: rec.Address, Hollow: rec.Hollow}
	}
	// Nodes gone from the registry are forgotten: names come and go
	// (anyone who may write the registry could make up many).
	for name := range s.known {
		if _, ok := out[name]; !ok {
			delete(s.known, name)
			if s.Forget != nil {
				s.Forget(name)
			}
		}
	}
	return out, nil
}

// Redial drops the client of node name ("": of every node), so that the
// next Members dials it anew: its certificate was revoked, and the
// connections of the old client must not be used again.
func (s *Source) Redial(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for n := range s.known {
		if name == "" || n == name {
			delete(s.known, n)
		}
	}
}

// layersIDFile marks a layer directory as a cluster's.
const layersIDFile = ".dsec-cluster"

// Join checks that st and the layer directory belong to the cluster of
// t, claiming either for it when it belongs to none yet: an apiserver or
// edge given another cluster's etcd, or a layer directory that is not the
// one the rest of the cluster uses (not the same shared mount), fails
// here with a clear error instead of serving layers nobody else sees.
func Join(st store.Store, t *Trust, layersDir string) error {
	id := t.Info.ID
	// Read first: an edge may only read the cluster's identity when
	// etcd's authentication is on (and etcd asks for write permission
	// for a create even where the key exists).
	got, err := st.Get(bucketMeta, "id")
	if errors.Is(err, errdefs.ErrNotFound) {
		switch err := st.Create(bucketMeta, "id", []byte(id)); {
		case err == nil:
			got = []byte(id)
		case errors.Is(err, errdefs.ErrAlreadyExists):
			if got, err = st.Get(bucketMeta, "id"); err != nil {
				return fmt.Errorf("reading the cluster id from etcd: %w", err)
			}
		default:
			return fmt.Errorf("recording the cluster id in etcd (with etcd's authentication on, an apiserver claims a new cluster, not an edge): %w", err)
		}
	} else if err != nil {
		return fmt.Errorf("reading the cluster id from etcd: %w", err)
	}
	if string(got) != id {
		return errdefs.Precondition("etcd belongs to cluster %s, but --cluster is cluster %s: give every process the same cluster directory (or another --etcd / --etcd-prefix)", got, id)
	}
	path := filepath.Join(layersDir, layersIDFile)
	local, err := readLayersID(path)
	if err != nil {
		return err
	}
	want, err := st.Get(bucketMeta, "layers")
	if errors.Is(err, errdefs.ErrNotFound) {
		// The first process: the directory becomes the cluster's.
		if local == "" {
			local = id + "/" + NewInstance()
			if err := writeNew(path, local); err != nil {
				if !errors.Is(err, fs.ErrExist) {
					return fmt.Errorf("marking the layer directory: %w", err)
				}
				if local, err = readLayersID(path); err != nil {
					return err
				}
			}
		}
		if err := st.Create(bucketMeta, "layers", []byte(local)); err != nil && !errors.Is(err, errdefs.ErrAlreadyExists) {
			return fmt.Errorf("recording the layer directory in etcd (with etcd's authentication on, an apiserver claims a new cluster, not an edge): %w", err)
		}
		if want, err = st.Get(bucketMeta, "layers"); err != nil {
			return fmt.Errorf("reading the layer directory's id from etcd: %w", err)
		}
	} else if err != nil {
		return fmt.Errorf("reading the layer directory's id from etcd: %w", err)
	}
	switch {
	case local == "":
		return errdefs.Precondition("--layers %s is not the cluster's layer directory: it has no %s, while the cluster's has %s; every server and edge must see the same directory (a shared mount in production)", layersDir, layersIDFile, want)
	case local != string(want):
		return errdefs.Precondition("--layers %s is not the cluster's layer directory: its %s says %s, the cluster's says %s; every server and edge must see the same directory", layersDir, layersIDFile, local, want)
	}
	return nil
}

func readLayersID(path string) (string, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("reading %s: %w", path, err)
	}
	return strings.TrimSpace(string(b)), nil
}

func writeNew(path, content string) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return err
	}
	if _, err := f.WriteString(content + "\n"); err != nil {
		f.Close()
		os.Remove(path)
		return err
	}
	return f.Close()
}

package store_test

import (
	"errors"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/store"
	"github.com/dsecproject/dsec/internal/store/etcdtest"
	"github.com/dsecproject/dsec/internal/store/storetest"
)

var (
	etcdCluster *etcdtest.Cluster
	etcdDir     string
)

// etcdEndpoints starts one 3-member etcd for the package's tests.
func etcdEndpoints(t *testing.T) []string {
	t.Helper()
	if etcdCluster == nil {
		if _, err := etcdtest.Binary(); err != nil {
			t.Skip(err)
		}
		dir, err := os.MkdirTemp("", "dsec-etcd-")
		if err != nil {
			t.Fatal(err)
		}
		c, err := etcdtest.Start(dir, 3)
		if err != nil {
			t.Fatal(err)
		}
		etcdCluster, etcdDir = c, dir
	}
	return etcdCluster.Endpoints()
}

func TestMain(m *testing.M) {
	code := m.Run()
	if etcdCluster != nil {
		etcdCluster.Stop()
		_ = os.RemoveAll(etcdDir)
	}
	os.Exit(code)
}

func openEtcd(t *testing.T, eps []string) func() store.Store {
	n := 0
	base := fmt.Sprintf("/test-%d/", time.Now().UnixNano())
	return func() store.Store {
		n++
		s, err := store.OpenEtcd(store.EtcdConfig{Endpoints: eps, Prefix: fmt.Sprintf("%s%d/", base, n)})
		if err != nil {
			panic(err)
		}
		return s
	}
}

func TestEtcdContract(t *testing.T) {
	storetest.Run(t, openEtcd(t, etcdEndpoints(t)))
}

func TestEtcdLeaser(t *testing.T) {
	storetest.RunLeaser(t, openEtcd(t, etcdEndpoints(t)))
}

func TestEtcdWatcher(t *testing.T) {
	storetest.RunWatcher(t, openEtcd(t, etcdEndpoints(t)))
}

func TestEtcdBatcher(t *testing.T) {
	storetest.RunBatcher(t, openEtcd(t, etcdEndpoints(t)))
}

func TestMemoryWatcher(t *testing.T) {
	storetest.RunWatcher(t, store.NewMemory)
}

func TestMemoryLeaser(t *testing.T) {
	storetest.RunLeaser(t, store.NewMemory)
}

// TestGetLocal: a local read sees what was written through the same
// member and says NotFound for what is missing, on etcd (serializable
// reads) and on the stores without replicas (plain Get).
func TestGetLocal(t *testing.T) {
	check := func(t *testing.T, st store.Store) {
		if err := st.Put("b", "k", []byte("v")); err != nil {
			t.Fatal(err)
		}
		if v, err := store.GetLocal(st, "b", "k"); err != nil || string(v) != "v" {
			t.Fatalf("GetLocal after Put: %q, %v", v, err)
		}
		if _, err := store.GetLocal(st, "b", "missing"); !errors.Is(err, errdefs.ErrNotFound) {
			t.Fatalf("GetLocal of a missing key: %v, want not found", err)
		}
		if _, err := store.GetLocal(st, "", "k"); !errors.Is(err, errdefs.ErrInvalid) {
			t.Fatalf("GetLocal with an empty bucket: %v, want invalid", err)
		}
	}
	t.Run("memory", func(t *testing.T) { check(t, store.NewMemory()) })
	t.Run("etcd", func(t *testing.T) {
		st := openEtcd(t, etcdEndpoints(t))()
		if _, ok := st.(store.LocalReader); !ok {
			t.Fatal("the etcd store has no local reads")
		}
		check(t, st)
	})
}

package store_test

import (
	"fmt"
	"os"
	"testing"
	"time"

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

func TestEtcdPager(t *testing.T) {
	storetest.RunPager(t, openEtcd(t, etcdEndpoints(t)))
}

func TestMemoryPager(t *testing.T) {
	storetest.RunPager(t, store.NewMemory)
}

func TestMemoryWatcher(t *testing.T) {
	storetest.RunWatcher(t, store.NewMemory)
}

func TestMemoryLeaser(t *testing.T) {
	storetest.RunLeaser(t, store.NewMemory)
}

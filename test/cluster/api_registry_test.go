package cluster

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/image/registrytest"
	"github.com/dsecproject/dsec/internal/layer/remote"
)

// TestRegistryLayerOnEveryNode: a layer pushed through one apiserver and
// added back by reference through the other runs on every edge, each
// reading it on demand through a layer daemon of its own; the shared
// layer directory holds no copy of it.
func TestRegistryLayerOnEveryNode(t *testing.T) {
	need(t)
	reg := registrytest.Start(t)
	big := make([]byte, 1<<20+333)
	rand.Read(big)
	sum := sha256.Sum256(big)
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, f := range []struct {
		name string
		body []byte
	}{{"reg/hello.txt", []byte("from the registry\n")}, {"reg/big.bin", big}} {
		if err := tw.WriteHeader(&tar.Header{Name: f.name, Mode: 0o644, Size: int64(len(f.body)), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		tw.Write(f.body)
	}
	tw.Close()
	const ref = "workspace/cl-registry:v1"
	l, err := c.perServer[0].BuildLayer(ctx(t), "workspace", "cl-registry", "v1", &buf)
	if err != nil {
		t.Fatal(err)
	}
	target := "oci://" + reg.Addr + "/cl/layers:ws"
	if _, err := c.perServer[1].PushLayer(ctx(t), api.LayerPushRequest{Ref: ref, Target: target, Insecure: true}); err != nil {
		t.Fatal(err)
	}
	if err := c.perServer[0].DeleteLayer(ctx(t), ref); err != nil {
		t.Fatal(err)
	}
	if _, err := c.perServer[1].AddLayer(ctx(t), api.LayerAddRequest{Ref: ref, Source: target, Insecure: true}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.client.DeleteLayer(ctx(t), ref) })
	blob := filepath.Join(c.layersDir(), "blobs", "sha256", strings.TrimPrefix(l.Digest, "sha256:")+".erofs")
	if _, err := os.Stat(blob); err == nil {
		t.Fatal("the shared layer directory holds the image")
	}
	want := "from the registry\n" + hex.EncodeToString(sum[:]) + "  /reg/big.bin\n"
	for i := 1; i <= 3; i++ {
		// A node another test's dedicated project still holds frees up
		// when that project's sandboxes are gone.
		spec := api.SandboxSpec{Base: baseRef, Workspace: ref, NodeSelector: map[string]string{"zone": fmt.Sprintf("z%d", i)}}
		var sb *api.Sandbox
		for deadline := time.Now().Add(60 * time.Second); ; {
			sb, err = c.client.CreateSandbox(ctx(t), spec)
			if err == nil || !strings.Contains(err.Error(), "dedicated") || time.Now().After(deadline) {
				break
			}
			time.Sleep(time.Second)
		}
		if err != nil {
			t.Fatalf("create on z%d: %v", i, err)
		}
		t.Cleanup(func() { _ = c.client.DeleteSandbox(context.Background(), sb.ID) })
		if got := mustExec(t, c.client, sb.ID, "cat /reg/hello.txt; sha256sum /reg/big.bin"); got != want {
			t.Fatalf("on %s: %q, want %q", sb.Node, got, want)
		}
		sock := filepath.Join(c.dir, sb.Node, "edge", "layerfs", "ctl.sock")
		if _, err := os.Stat(sock); err != nil {
			t.Fatalf("%s has no layer daemon of its own: %v", sb.Node, err)
		}
		// Each node fetched the artifact's metadata pack and served the
		// lookups from it.
		st, err := (&remote.Source{Dir: filepath.Join(c.dir, sb.Node, "edge", "layerfs")}).Stats(ctx(t))
		if err != nil {
			t.Fatalf("%s: layer daemon stats: %v", sb.Node, err)
		}
		found := false
		for _, ls := range st.Layers {
			if ls.Digest == l.Digest {
				found = true
				if ls.MetaBytes <= 0 || ls.MetaReads <= 0 {
					t.Errorf("%s: the layer's metadata pack: %d bytes, %d reads served", sb.Node, ls.MetaBytes, ls.MetaReads)
				}
			}
		}
		if !found {
			t.Errorf("%s: its layer daemon does not list %s: %+v", sb.Node, l.Digest, st.Layers)
		}
	}
}

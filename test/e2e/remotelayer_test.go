package e2e

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/image/registrytest"
	"github.com/dsecproject/dsec/internal/layer/remote"
)

// A layer pushed to a registry and added back by reference runs
// sandboxes with the same bytes: read on demand through the node's layer
// daemon (pull lazy) and fetched whole (pull full). Nothing of the image
// is in the layer directory.
func TestLayerFromRegistry(t *testing.T) {
	needDaemon(t)
	reg := registrytest.Start(t)
	big := make([]byte, 2<<20+777)
	rand.Read(big)
	sum := sha256.Sum256(big)
	tarball := tarLayer(t, layerEntry{Name: "reg/", Dir: true}, layerEntry{Name: "reg/hello.txt", Body: "hello from a registry\n"},
		layerEntry{Name: "reg/big.bin", Body: string(big)})
	const ref = "workspace/e2e-registry:v1"
	l, err := client.BuildLayer(ctx(t), "workspace", "e2e-registry", "v1", bytes.NewReader(tarball))
	if err != nil {
		t.Fatal(err)
	}
	target := "oci://" + reg.Addr + "/e2e/layers:ws"
	out, errOut, code := cli("layer", "push", "--insecure", ref, target)
	if code != 0 || !strings.Contains(out, "4 blob(s) sent") { // image, chunk index, metadata pack, config
		t.Fatalf("layer push: exit %d: %s %s", code, out, errOut)
	}
	// Drop it here, so that only the registry has it.
	if err := client.DeleteLayer(ctx(t), ref); err != nil {
		t.Fatal(err)
	}
	blob := filepath.Join(d.stateDir, "layers", "blobs", "sha256", strings.TrimPrefix(l.Digest, "sha256:")+".erofs")
	if _, err := os.Stat(blob); err == nil {
		t.Fatalf("the image is still in the layer directory: %s", blob)
	}
	out, errOut, code = cli("layer", "add", "--insecure", ref, target)
	if code != 0 || !strings.Contains(out, l.Digest) || !strings.Contains(out, "pull lazy") {
		t.Fatalf("layer add: exit %d: %s %s", code, out, errOut)
	}
	t.Cleanup(func() { client.DeleteLayer(context.Background(), ref) })
	got, err := client.GetLayer(ctx(t), ref)
	if err != nil || got.Remote == nil || got.Remote.Source != target || got.Digest != l.Digest {
		t.Fatalf("added layer: %+v %v", got, err)
	}

	check := func(ws string) {
		t.Helper()
		sb := newSandbox(t, api.SandboxSpec{Base: baseRef, Workspace: ws})
		res := sh(t, sb.ID, "cat /reg/hello.txt; sha256sum /reg/big.bin")
		want := "hello from a registry\n" + hex.EncodeToString(sum[:]) + "  /reg/big.bin\n"
		if res.ExitCode != 0 || res.Stdout != want {
			t.Fatalf("sandbox on %s: exit %d %q %q", ws, res.ExitCode, res.Stdout, res.Stderr)
		}
		if err := client.DeleteSandbox(ctx(t), sb.ID); err != nil {
			t.Fatal(err)
		}
	}
	check(ref)
	st := layerfsStats(t)
	var ls *remote.LayerStats
	for i := range st.Layers {
		if st.Layers[i].Digest == l.Digest {
			ls = &st.Layers[i]
		}
	}
	if ls == nil || ls.BytesFetched < 2<<20 || ls.BytesFetched > 2*got.SizeBytes || ls.BadChunks != 0 {
		t.Fatalf("layer daemon's figures: %+v", st)
	}
	// The edge's metrics carry the daemon's figures.
	resp, err := http.Get("http://" + d.listen + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	metrics, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if want := `dsec_layer_fetched_bytes_total{digest="` + l.Digest + `"}`; !strings.Contains(string(metrics), want) ||
		!strings.Contains(string(metrics), "dsec_layer_cache_bytes ") {
		t.Errorf("/metrics has no layer figures (want %s)", want)
	}
	t.Logf("lazy layer: %d of %d bytes fetched in %d requests, %.0f%% of chunks read", ls.BytesFetched, ls.SizeBytes, ls.Requests, 100*ls.ReadFraction)

	// The daemon runs in a cgroup of its own, beside the sandboxes'.
	dir := filepath.Join(d.stateDir, "edge", "layerfs")
	if out, err := exec.Command("pgrep", "-f", "layerfs --dir "+dir).Output(); err != nil {
		t.Errorf("finding the layer daemon: %v", err)
	} else if cg, err := os.ReadFile("/proc/" + strings.Fields(string(out))[0] + "/cgroup"); err != nil || !strings.Contains(string(cg), "-layerfs\n") {
		t.Errorf("the layer daemon's cgroups (%v):\n%s", err, cg)
	}

	// The layer daemon killed while a sandbox uses the layer: the edge
	// starts another on the same mount, and the sandbox reads on.
	sb := newSandbox(t, api.SandboxSpec{Base: baseRef, Workspace: ref})
	if res := sh(t, sb.ID, "cat /reg/hello.txt"); res.Stdout != "hello from a registry\n" {
		t.Fatalf("before the kill: %+v", res)
	}
	if killed, err := exec.Command("pkill", "-KILL", "-f", "layerfs --dir "+dir).CombinedOutput(); err != nil {
		t.Fatalf("killing the layer daemon: %v %s", err, killed)
	}
	os.WriteFile("/proc/sys/vm/drop_caches", []byte("3\n"), 0o200) // so the reads reach a daemon
	res := sh(t, sb.ID, "sha256sum /reg/big.bin")
	if res.ExitCode != 0 || res.Stdout != hex.EncodeToString(sum[:])+"  /reg/big.bin\n" {
		t.Fatalf("after the layer daemon was killed: %+v", res)
	}
	// The watchdog starts the new daemon on its own time: the reads may
	// have been served without one (passthrough to the cached file).
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		if logb, _ := os.ReadFile(d.logPath); strings.Contains(string(logb), "took_over=true") {
			break
		}
		if time.Now().After(deadline) {
			t.Error("the daemon's log does not show a layer daemon taking over the mount within 20 s")
			break
		}
	}
	if err := client.DeleteSandbox(ctx(t), sb.ID); err != nil {
		t.Fatal(err)
	}

	// The same artifact as a pull-full layer.
	const full = "workspace/e2e-registry-full:v1"
	if _, err := client.AddLayer(ctx(t), api.LayerAddRequest{Ref: full, Source: target, Insecure: true, Pull: api.PullFull}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.DeleteLayer(context.Background(), full) })
	check(full)

	// Bad input: not a dsec artifact, no such tag, a registry that is
	// not there, a source that is not oci://; none leaves a layer.
	for _, c := range []struct {
		source, code string
	}{
		{"oci://" + reg.Addr + "/e2e/layers:nope", "not_found"},
		{"oci://" + freeAddr() + "/e2e/layers:ws", "unavailable"},
		{"http://" + reg.Addr + "/e2e/layers:ws", "invalid_argument"},
	} {
		_, err := client.AddLayer(ctx(t), api.LayerAddRequest{Ref: "workspace/e2e-bad:v1", Source: c.source, Insecure: true})
		wantCode(t, err, c.code)
	}
	if _, err := client.GetLayer(ctx(t), "workspace/e2e-bad:v1"); err == nil {
		t.Error("refused adds left workspace/e2e-bad:v1")
	}
	_, err = client.PushLayer(ctx(t), api.LayerPushRequest{Ref: "workspace/e2e-none:v1", Target: target})
	wantCode(t, err, "not_found")
}

// layerfsStats asks the node's layer daemon for its figures.
func layerfsStats(t *testing.T) remote.DaemonStats {
	t.Helper()
	s, err := (&remote.Source{Dir: filepath.Join(d.stateDir, "edge", "layerfs")}).Stats(ctx(t))
	if err != nil {
		t.Fatalf("layer daemon: %v", err)
	}
	return s
}

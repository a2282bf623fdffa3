package apiserver

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/layer"
)

// TestStagedSnapshotsArePublishedByTheApiserver: an apiserver of a
// cluster asks its edge to stage a snapshot and publishes it itself,
// recording the ref, project and author it knows, whatever the edge
// claims; an apiserver that publishes nothing refuses a staged answer.
func TestStagedSnapshotsArePublishedByTheApiserver(t *testing.T) {
	bothWays(t, func(t *testing.T, f *fixture) {
		// The edge's own store on the shared layer directory.
		edgeLayers, err := layer.NewNodeStore(f.layers.Dir(), f.st, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { edgeLayers.Close() })
		var asked []bool
		lie := ""
		f.edge.SnapshotFn = func(id string, o edgeapi.SnapshotOptions) (*edgeapi.SnapshotResult, error) {
			asked = append(asked, o.Stage)
			data := []byte(strings.Repeat("image of "+id+o.Request.Ref, 100))
			name := "image-1.erofs"
			if err := os.WriteFile(filepath.Join(edgeLayers.StagingDir(), name), data, 0o600); err != nil {
				return nil, err
			}
			sum := sha256.Sum256(data)
			d := "sha256:" + hex.EncodeToString(sum[:])
			// What a lying edge says of the layer's name, owner and author.
			l := api.Layer{Ref: "snapshot/elsewhere:1", Kind: api.KindSnapshot, Digest: d, SizeBytes: int64(len(data)), Project: "victim",
				Snapshot: &api.SnapshotInfo{Sandbox: "sb-other", CreatedBy: "someone", Include: []string{"/x"}, Spec: api.SandboxSpec{Base: "base/py:1"}}}
			st := layer.Staged{Instance: filepath.Base(edgeLayers.StagingDir()), Name: name, Digest: d, Size: int64(len(data))}
			switch lie {
			case "digest":
				// Another layer's digest over these bytes.
				st.Digest, l.Digest = f.digests["base/py:1"], f.digests["base/py:1"]
			case "unstaged":
				// Said published, as an edge of an earlier version would.
				return &edgeapi.SnapshotResult{Layer: l}, nil
			}
			return &edgeapi.SnapshotResult{Layer: l, Staged: &st}, nil
		}
		id := f.sandboxFor(t)
		publishing := f.apiserverWith(t, "p", func(d *Deps) { d.PublishSnapshots = true })
		resp, b := f.doAt(t, publishing, f.admin, "", "POST", "/v1/sandboxes/"+id+"/snapshot", `{"ref":"snapshot/mine:1","exclude":["/tmp"]}`)
		if resp.StatusCode != 201 {
			t.Fatalf("snapshot: %d %s", resp.StatusCode, b)
		}
		var l api.Layer
		if err := json.Unmarshal(b, &l); err != nil {
			t.Fatal(err)
		}
		p, _ := f.iam.Authenticate(f.admin)
		if l.Ref != "snapshot/mine:1" || l.Project == "victim" || l.Snapshot == nil || l.Snapshot.Sandbox != id || l.Snapshot.CreatedBy != p.ID ||
			len(l.Snapshot.Include) != 0 || len(l.Snapshot.Exclude) != 1 || l.Snapshot.Exclude[0] != "/tmp" {
			t.Fatalf("published %+v (snapshot %+v)", l, l.Snapshot)
		}
		got, err := f.layers.Resolve("snapshot/mine:1")
		if err != nil || got.Digest != l.Digest {
			t.Fatalf("catalog: %+v %v", got, err)
		}
		if _, err := f.layers.Resolve("snapshot/elsewhere:1"); err == nil {
			t.Fatal("the edge's ref is in the catalog")
		}
		if _, err := os.Stat(f.layers.BlobPath(l.Digest)); err != nil {
			t.Fatalf("blob: %v", err)
		}
		if left, _ := edgeLayers.Staged(); len(left) != 0 {
			t.Fatalf("staged images left: %v", left)
		}

		// Refused (the reason is in the apiserver's log: callers see an
		// internal error, not theirs): an edge staging under another
		// layer's digest (its staged image goes), one saying it
		// published what the catalog does not have, and a staged answer
		// to an apiserver that publishes nothing.
		for i, tc := range []struct {
			lie    string
			srv    *httptest.Server
			staged int
		}{{"digest", publishing, 0}, {"unstaged", publishing, 1}, {"", f.srv, 1}} {
			lie = tc.lie
			ref := fmt.Sprintf("snapshot/refused:%d", i)
			resp, b = f.doAt(t, tc.srv, f.admin, "", "POST", "/v1/sandboxes/"+id+"/snapshot", `{"ref":"`+ref+`"}`)
			if resp.StatusCode != 500 || !strings.Contains(string(b), `"internal"`) {
				t.Fatalf("%q: %d %s", tc.lie, resp.StatusCode, b)
			}
			if _, err := f.layers.Resolve(ref); err == nil {
				t.Fatalf("%q: %s is in the catalog", tc.lie, ref)
			}
			if left, _ := edgeLayers.Staged(); len(left) != tc.staged {
				t.Fatalf("%q: staged images left: %v, want %d", tc.lie, left, tc.staged)
			}
			for _, n := range stagedNames(edgeLayers) {
				os.Remove(filepath.Join(edgeLayers.StagingDir(), n))
			}
		}
		if d, err := f.layers.Resolve("base/py:1"); err != nil || d.Digest != f.digests["base/py:1"] {
			t.Fatalf("base/py:1 after the forgery: %+v %v", d, err)
		}
		if want := []bool{true, true, true, false}; fmt.Sprint(asked) != fmt.Sprint(want) {
			t.Fatalf("stage asked: %v, want %v", asked, want)
		}
	})
}

func stagedNames(s *layer.Store) []string {
	l, _ := s.Staged()
	return l
}

package apiserver

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"reflect"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/layer"
	"github.com/dsecproject/dsec/internal/sandbox"
	"github.com/dsecproject/dsec/internal/store"
)

func TestImageDefaultsApplied(t *testing.T) {
	st := store.NewMemory()
	layers, err := layer.NewStore(t.TempDir(), st, nil)
	if err != nil {
		t.Fatal(err)
	}
	put := func(l api.Layer) {
		b, _ := json.Marshal(l)
		if err := st.Put("layers", l.Ref, b); err != nil {
			t.Fatal(err)
		}
	}
	put(api.Layer{Digest: "sha256:" + strings.Repeat("1", 64), Ref: "base/img:1", Kind: api.KindBase, Image: &api.ImageConfig{
		Env: []string{"A=img", "B=img", "EQ=x=y", "NOVALUE", "1BAD=x"}, WorkingDir: "/app/./src/", User: "user:staff",
	}})
	put(api.Layer{Digest: "sha256:" + strings.Repeat("2", 64), Ref: "base/odd:1", Kind: api.KindBase, Image: &api.ImageConfig{
		Env: []string{"A=odd"}, WorkingDir: "relative", User: "Not A User",
	}})
	put(api.Layer{Digest: "sha256:" + strings.Repeat("3", 64), Ref: "base/plain:1", Kind: api.KindBase})
	s := New(Deps{Layers: layers, Policy: sandbox.DefaultPolicy(), Log: slog.New(slog.NewTextHandler(io.Discard, nil))})

	callerEnv := map[string]string{"B": "spec"}
	cases := []struct {
		name string
		spec api.SandboxSpec
		env  map[string]string
		user string
		wd   string
	}{
		{"defaults", api.SandboxSpec{Base: "base/img:1", Env: callerEnv},
			map[string]string{"A": "img", "B": "spec", "EQ": "x=y"}, "user:staff", "/app/src"},
		{"image field", api.SandboxSpec{Image: "base/img:1"},
			map[string]string{"A": "img", "B": "img", "EQ": "x=y"}, "user:staff", "/app/src"},
		{"spec wins", api.SandboxSpec{Base: "base/img:1", User: "root", Workdir: "/"},
			map[string]string{"A": "img", "B": "img", "EQ": "x=y"}, "root", "/"},
		{"unusable values skipped", api.SandboxSpec{Base: "base/odd:1"}, map[string]string{"A": "odd"}, "root", "/"},
		{"no image config", api.SandboxSpec{Base: "base/plain:1", Env: callerEnv}, callerEnv, "root", "/"},
	}
	for _, c := range cases {
		spec := c.spec
		if _, err := s.prepare(context.Background(), &spec); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if !reflect.DeepEqual(spec.Env, c.env) || spec.User != c.user || spec.Workdir != c.wd {
			t.Errorf("%s: env %v user %q workdir %q; want %v %q %q", c.name, spec.Env, spec.User, spec.Workdir, c.env, c.user, c.wd)
		}
	}
	if !reflect.DeepEqual(callerEnv, map[string]string{"B": "spec"}) {
		t.Errorf("the caller's env map was changed: %v", callerEnv)
	}
}

func TestImageImportBadInput(t *testing.T) {
	bothWays(t, func(t *testing.T, f *fixture) {
		for _, c := range []struct {
			query, body string
			status      int
			code, msg   string
		}{
			{"", "x", 400, "invalid_argument", "ref is required"},
			{"ref=toolkit/x:1", "x", 400, "invalid_argument", "base layer"},
			{"ref=base/x:1&split=-1&workspace=workspace/x:1", "x", 400, "invalid_argument", "positive"},
			{"ref=base/x:1&split=1", "x", 400, "invalid_argument", "needs a workspace"},
			{"ref=base/x:1&workspace=workspace/x:1", "x", 400, "invalid_argument", "needs split"},
			{"ref=base/x:1&workspace=toolkit/x:1&split=1", "x", 400, "invalid_argument", "want workspace"},
			{"ref=base/py:1", "x", 409, "already_exists", "already exists"},
			{"ref=base/x:1&workspace=workspace/w:1&split=1", "x", 409, "already_exists", "workspace/w:1"},
			{"ref=base/x:1", "junk", 400, "invalid_argument", "archive"},
			{"ref=base/x:1&merge_under=-1", "x", 400, "invalid_argument", "merge_under"},
			{"ref=base/x:1&merge_under=3GB", "x", 400, "invalid_argument", "merge_under"},
			{"ref=base/x:1&merge_under=1000&workspace=workspace/x:1&split=1", "x", 400, "invalid_argument", "not both"},
		} {
			resp, body := f.do(t, f.admin, "POST", "/v1/images:import?"+c.query, c.body)
			e := wantError(t, resp, body, c.status, c.code)
			if !strings.Contains(e.Message, c.msg) || strings.Contains(e.Message, f.layers.StagingDir()) {
				t.Errorf("%s: message %q, want it to mention %q and no staging path", c.query, e.Message, c.msg)
			}
		}
		resp, body := f.do(t, f.viewer, "POST", "/v1/images:import?ref=base/x:1", "x")
		wantError(t, resp, body, 403, "permission_denied")
		resp, body = f.do(t, f.admin, "POST", "/v1/images:pull", `{"image":"127.0.0.1:1/x:1","ref":"base/py:1"}`)
		wantError(t, resp, body, 409, "already_exists")
		resp, body = f.do(t, f.admin, "POST", "/v1/images:pull", `{"image":"bad image","ref":"base/x:1"}`)
		wantError(t, resp, body, 400, "invalid_argument")
		resp, body = f.do(t, f.admin, "POST", "/v1/images:pull", `{"image":"127.0.0.1:1/x:1","ref":"base/x:1","merge_under":-5}`)
		wantError(t, resp, body, 400, "invalid_argument")

		if left, _ := f.layers.Staged(); len(left) > 0 {
			t.Errorf("staging not empty: %v", left)
		}
		if _, err := f.layers.Resolve("base/x:1"); err == nil {
			t.Error("base/x:1 was registered")
		}
	})
}

// A base with lowers stacks them under itself, and tells the edge how many
// layers are base, workspace and toolkits: also for a sandbox started from
// a snapshot taken on it.
func TestPrepareStacksLowers(t *testing.T) {
	st := store.NewMemory()
	layers, err := layer.NewStore(t.TempDir(), st, nil)
	if err != nil {
		t.Fatal(err)
	}
	d := func(c string) string { return "sha256:" + strings.Repeat(c, 64) }
	put := func(l api.Layer) {
		b, _ := json.Marshal(l)
		if err := st.Put("layers", l.Ref, b); err != nil {
			t.Fatal(err)
		}
	}
	put(api.Layer{Digest: d("3"), Ref: "base/merged:1", Kind: api.KindBase, Lowers: []string{d("1"), d("2")}})
	put(api.Layer{Digest: d("4"), Ref: "base/plain:1", Kind: api.KindBase})
	put(api.Layer{Digest: d("5"), Ref: "workspace/w:1", Kind: api.KindWorkspace})
	put(api.Layer{Digest: d("6"), Ref: "toolkit/t:1", Kind: api.KindToolkit})
	put(api.Layer{Digest: d("7"), Ref: "snapshot/new:1", Kind: api.KindSnapshot, Snapshot: &api.SnapshotInfo{
		Layers: []string{d("1"), d("2"), d("3"), d("5")}, Below: 4,
		Spec: api.SandboxSpec{Base: "base/merged:1", Workspace: "workspace/w:1"}}})
	put(api.Layer{Digest: d("8"), Ref: "snapshot/old:1", Kind: api.KindSnapshot, Snapshot: &api.SnapshotInfo{
		Layers: []string{d("4"), d("5"), d("7")}, Spec: api.SandboxSpec{Base: "base/plain:1", Workspace: "workspace/w:1"}}})
	put(api.Layer{Digest: d("9"), Ref: "snapshot/bad:1", Kind: api.KindSnapshot, Snapshot: &api.SnapshotInfo{
		Layers: []string{d("4")}, Below: 3, Spec: api.SandboxSpec{Base: "base/plain:1"}}})
	s := New(Deps{Layers: layers, Policy: sandbox.DefaultPolicy(), Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	for _, c := range []struct {
		spec    api.SandboxSpec
		digests []string
		below   int
	}{
		{api.SandboxSpec{Base: "base/merged:1", Workspace: "workspace/w:1", Toolkits: []string{"toolkit/t:1"}},
			[]string{d("1"), d("2"), d("3"), d("5"), d("6")}, 5},
		{api.SandboxSpec{Base: "base/plain:1", Workspace: "workspace/w:1"}, []string{d("4"), d("5")}, 0},
		{api.SandboxSpec{Snapshot: "snapshot/new:1"}, []string{d("1"), d("2"), d("3"), d("5"), d("7")}, 4},
		// A record from before lowers: one layer each.
		{api.SandboxSpec{Snapshot: "snapshot/old:1"}, []string{d("4"), d("5"), d("7"), d("8")}, 2},
	} {
		spec := c.spec
		got, err := s.prepare(context.Background(), &spec)
		if err != nil {
			t.Fatalf("%+v: %v", c.spec, err)
		}
		if !reflect.DeepEqual(got.digests, c.digests) || got.below != c.below {
			t.Errorf("%+v: digests %v below %d; want %v below %d", c.spec, got.digests, got.below, c.digests, c.below)
		}
	}
	spec := api.SandboxSpec{Snapshot: "snapshot/bad:1"}
	if _, err := s.prepare(context.Background(), &spec); err == nil {
		t.Error("a snapshot record claiming more layers below than it lists was used")
	}
}

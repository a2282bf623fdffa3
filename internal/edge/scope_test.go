package edge

import (
	"context"
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// TestScopeHidesOtherTenants attacks tenancy on a node: a call on behalf
// of team-b names team-a's sandbox in every call of the edge API that
// takes a sandbox id, found by reflection so that a call added later is
// attacked too. Each must answer not found (a delete: nothing, leaving the
// sandbox) before it touches anything; list and the by-label calls must
// not see it.
func TestScopeHidesOtherTenants(t *testing.T) {
	e := &Edge{sandboxes: map[string]*sbx{}, labels: newLabelIndex()}
	add := func(id, project, path string) {
		s := &sbx{listed: true}
		s.rec.Sandbox = api.Sandbox{ID: id, Project: project, State: api.StateRunning, Labels: map[string]string{"job": "j"}}
		s.rec.ProjectPath = path
		e.sandboxes[id] = s
		e.reindexLocked(s)
	}
	add("sb-n1-a", "team-a", "root/team-a")
	add("sb-n1-a-sub", "a-sub", "root/team-a/a-sub")
	add("sb-n1-old", "", "") // made before projects: the root's
	teamB := edgeapi.WithScope(context.Background(), "root/team-b")
	// A scope that is a string prefix of another project's path.
	teamAPrefix := edgeapi.WithScope(context.Background(), "root/team")

	for _, c := range []struct {
		ctx  context.Context
		id   string
		want bool
	}{
		{edgeapi.WithScope(context.Background(), "root/team-a"), "sb-n1-a", true},
		{edgeapi.WithScope(context.Background(), "root/team-a"), "sb-n1-a-sub", true},
		{edgeapi.WithScope(context.Background(), "root/team-a/a-sub"), "sb-n1-a", false},
		{edgeapi.WithScope(context.Background(), "root"), "sb-n1-a-sub", true},
		{edgeapi.WithScope(context.Background(), "root"), "sb-n1-old", true},
		{edgeapi.WithScope(context.Background(), "root/team-a"), "sb-n1-old", false},
		{teamAPrefix, "sb-n1-a", false},
		{teamB, "sb-n1-a", false},
		{context.Background(), "sb-n1-a", true}, // the control plane's own calls
	} {
		_, err := e.Get(c.ctx, c.id)
		if got := err == nil; got != c.want {
			t.Errorf("Get(%s) in scope %q: %v, want visible=%v", c.id, edgeapi.ScopeOf(c.ctx), err, c.want)
		}
	}

	et := reflect.TypeFor[edgeapi.Edge]()
	ev := reflect.ValueOf(edgeapi.Edge(e))
	attacked := 0
	for i := range et.NumMethod() {
		m := et.Method(i)
		ft := m.Type
		if ft.NumIn() < 2 || ft.In(1).Kind() != reflect.String || m.Name == "LayerUsers" {
			continue
		}
		for _, ctx := range []context.Context{teamB, teamAPrefix} {
			args := []reflect.Value{reflect.ValueOf(ctx), reflect.ValueOf("sb-n1-a")}
			for j := 2; j < ft.NumIn(); j++ {
				args = append(args, reflect.Zero(ft.In(j)))
			}
			// Valid requests, so that validation (which says nothing of
			// the sandbox) passes and the lookup is what answers.
			switch m.Name {
			case "DialPort":
				args[2] = reflect.ValueOf(80)
			case "Exec":
				args[2] = reflect.ValueOf(api.ExecRequest{Argv: []string{"true"}})
			case "StartProcess":
				args[2] = reflect.ValueOf(edgeapi.ProcessRequest{Argv: []string{"true"}})
			case "ConnectProcess", "ProcessInput", "CloseProcessStdin":
				args[2] = reflect.ValueOf(edgeapi.ProcessSelector{PID: 1})
			case "SignalProcess":
				args[2] = reflect.ValueOf(edgeapi.ProcessSelector{PID: 1})
				args[3] = reflect.ValueOf(15)
			case "ResizeProcess":
				args[2] = reflect.ValueOf(edgeapi.ProcessSelector{PID: 1})
				args[3] = reflect.ValueOf(edgeapi.PTYSize{Cols: 80, Rows: 24})
			case "RunInSession":
				args[3] = reflect.ValueOf(api.SessionRunRequest{Command: "true"})
			case "Snapshot":
				args[2] = reflect.ValueOf(edgeapi.SnapshotOptions{Request: api.SnapshotRequest{Ref: "snapshot/x:1"}})
			}
			var out []reflect.Value
			func() {
				defer func() {
					if v := recover(); v != nil {
						t.Errorf("%s of another tenant's sandbox went past the lookup (panicked: %v)", m.Name, v)
					}
				}()
				out = ev.MethodByName(m.Name).Call(args)
			}()
			if out == nil {
				continue
			}
			err, _ := out[len(out)-1].Interface().(error)
			if m.Name == "Delete" {
				if err != nil {
					t.Errorf("Delete of another tenant's sandbox: %v, want nil (already gone, as far as the caller can tell)", err)
				}
				if e.sandboxes["sb-n1-a"] == nil {
					t.Fatal("Delete removed another tenant's sandbox")
				}
				continue
			}
			if !errors.Is(err, errdefs.ErrNotFound) {
				t.Errorf("%s of another tenant's sandbox: %v, want not found", m.Name, err)
			} else if !strings.Contains(err.Error(), "sb-n1-a") {
				t.Errorf("%s: %v does not name the sandbox", m.Name, err)
			}
		}
		attacked++
	}
	if attacked < 20 {
		t.Fatalf("only %d per-sandbox calls found by reflection: the attack missed some", attacked)
	}

	if l := e.list(teamB, edgeapi.ListFilter{}); len(l) != 0 {
		t.Errorf("team-b lists %d sandboxes of others", len(l))
	}
	if l := e.list(edgeapi.WithScope(context.Background(), "root/team-a"), edgeapi.ListFilter{}); len(l) != 2 {
		t.Errorf("team-a lists %d sandboxes, want its 2", len(l))
	}
	for name, fn := range map[string]func(context.Context, map[string]string) (int, error){
		"DeleteByLabels": e.DeleteByLabels, "PauseByLabels": e.PauseByLabels, "ResumeByLabels": e.ResumeByLabels,
	} {
		if n, err := fn(teamB, map[string]string{"job": "j"}); n != 0 || err != nil {
			t.Errorf("%s by team-b: %d, %v; want 0, nil", name, n, err)
		}
	}
	if len(e.sandboxes) != 3 {
		t.Fatalf("%d sandboxes left of 3", len(e.sandboxes))
	}
}

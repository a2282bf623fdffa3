package apiserver

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/cluster"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/edgeapi/edgetest"
	"github.com/dsecproject/dsec/internal/watcher"
)

// lossyNodes are edges that keep the create-token contract
// (edgeapi.CreateRequest.Token: one sandbox per token) and lose the answer
// of the first create any of them gets; with downAfter, the node that lost
// it is down from then on (its connections refused).
type lossyNodes struct {
	mu        sync.Mutex
	downAfter bool
	lost      string            // the node that lost an answer
	made      map[string]string // node/token → sandbox id
	calls     map[string][]string
}

type lossyEdge struct {
	edgeapi.Edge
	name string
	n    *lossyNodes
}

func (l lossyEdge) Create(ctx context.Context, req edgeapi.CreateRequest) (*api.Sandbox, error) {
	n := l.n
	n.mu.Lock()
	n.calls[l.name] = append(n.calls[l.name], req.Token)
	if n.lost == l.name && n.downAfter {
		n.mu.Unlock()
		return nil, &edgeapi.Unreachable{Node: l.name, Err: syscall.ECONNREFUSED, NotSent: true}
	}
	if id := n.made[l.name+"/"+req.Token]; id != "" && req.Token != "" {
		n.mu.Unlock()
		return l.Edge.Get(ctx, id)
	}
	lose := n.lost == ""
	if lose {
		n.lost = l.name
	}
	n.mu.Unlock()
	sb, err := l.Edge.Create(ctx, req)
	if err != nil {
		return nil, err
	}
	n.mu.Lock()
	n.made[l.name+"/"+req.Token] = sb.ID
	n.mu.Unlock()
	if lose {
		return nil, &edgeapi.Unreachable{Node: l.name, Err: io.ErrUnexpectedEOF}
	}
	return sb, nil
}

// TestCreateResentAfterLostAnswer: a create whose answer is lost is sent
// again, with the same token, to the same node, which answers the sandbox
// it made: one sandbox, the client none the wiser. When that node is then
// down, the create goes to another node. Either way nothing fails.
func TestCreateResentAfterLostAnswer(t *testing.T) {
	for _, down := range []bool{false, true} {
		name := map[bool]string{false: "node-answers-again", true: "node-down-after"}[down]
		t.Run(name, func(t *testing.T) {
			n := &lossyNodes{downAfter: down, made: map[string]string{}, calls: map[string][]string{}}
			fakes := map[string]*edgetest.Fake{}
			var targets watcher.Static
			for _, name := range []string{"a", "b"} {
				fakes[name] = edgetest.NewFake(name)
				targets = append(targets, lossyEdge{fakes[name], name, n})
			}
			view := watcher.New(targets, watcher.Config{DownAfter: time.Hour})
			view.Sync(t.Context())
			f := newFixture(t, false)
			srv := f.apiserverWith(t, "b", func(d *Deps) { d.Nodes = view })
			resp, body := f.doAt(t, srv, f.admin, "", "POST", "/v1/sandboxes", `{"base":"base/py:1"}`)
			var sb api.Sandbox
			if resp.StatusCode != 201 || json.Unmarshal(body, &sb) != nil {
				t.Fatalf("create: %s %s, want 201", resp.Status, body)
			}
			n.mu.Lock()
			defer n.mu.Unlock()
			lost, calls := n.lost, n.calls
			if len(calls[lost]) != 2 || calls[lost][0] == "" || calls[lost][0] != calls[lost][1] {
				t.Fatalf("node %s got creates with tokens %q, want the one token twice", lost, calls[lost])
			}
			other := map[string]string{"a": "b", "b": "a"}[lost]
			held := map[string]int{}
			for name, fe := range fakes {
				l, err := fe.List(t.Context(), edgeapi.ListFilter{})
				if err != nil {
					t.Fatal(err)
				}
				held[name] = len(l)
			}
			if !down {
				if sb.Node != lost || len(calls[other]) != 0 || held[lost] != 1 || held[other] != 0 {
					t.Fatalf("sandbox on %s, calls %v, held %v; want the one sandbox on %s and nothing asked of %s", sb.Node, calls, held, lost, other)
				}
				return
			}
			// The down node's sandbox went with it; the create's is on the
			// other, under the same token.
			if sb.Node != other || len(calls[other]) != 1 || calls[other][0] != calls[lost][0] || held[other] != 1 {
				t.Fatalf("sandbox on %s, calls %v, held %v; want it on %s with the same token", sb.Node, calls, held, other)
			}
			// ... and the token is recorded as abandoned on the down node,
			// for it to delete what it made should it come back.
			var abandoned []string
			err := cluster.SweepAbandoned(f.st, lost, func(tokens []string) []string {
				abandoned = tokens
				return tokens
			}, slog.New(slog.NewTextHandler(io.Discard, nil)))
			if err != nil || len(abandoned) != 1 || abandoned[0] != calls[lost][0] {
				t.Fatalf("abandoned on %s: %q %v, want the create's token", lost, abandoned, err)
			}
			_ = cluster.SweepAbandoned(f.st, lost, func(tokens []string) []string {
				t.Fatalf("tokens %q handled once are offered again", tokens)
				return nil
			}, slog.New(slog.NewTextHandler(io.Discard, nil)))
		})
	}
}

// deadEdge refuses every connection, as a killed edge the view still
// counts healthy does.
type deadEdge struct{ edgeapi.Edge }

func (d deadEdge) Create(ctx context.Context, req edgeapi.CreateRequest) (*api.Sandbox, error) {
	return nil, &edgeapi.Unreachable{Node: d.Name(), Err: syscall.ECONNREFUSED, NotSent: true}
}

// TestCreateSkipsManyDeadNodes: when many nodes die at once, the view
// shows them healthy until their next poll; a create tries past every
// one it finds dead (a refused connection costs nothing) instead of
// giving up after three.
func TestCreateSkipsManyDeadNodes(t *testing.T) {
	var targets watcher.Static
	for i := range 12 {
		targets = append(targets, deadEdge{edgetest.NewFake(fmt.Sprintf("dead%02d", i))})
	}
	alive := edgetest.NewFake("alive")
	targets = append(targets, alive)
	for i := range 5 {
		// A fresh view each time: every dead node counts healthy again.
		f := newFixture(t, false)
		view := watcher.New(targets, watcher.Config{DownAfter: time.Hour})
		view.Sync(t.Context())
		srv := f.apiserverWith(t, fmt.Sprint("s", i), func(d *Deps) { d.Nodes = view })
		resp, body := f.doAt(t, srv, f.admin, "", "POST", "/v1/sandboxes", `{"base":"base/py:1"}`)
		if resp.StatusCode != 201 {
			t.Fatalf("create %d with 12 of 13 nodes dead: %s %s, want 201 on the live one", i, resp.Status, body)
		}
	}
	if l, _ := alive.List(t.Context(), edgeapi.ListFilter{}); len(l) != 5 {
		t.Fatalf("the live node holds %d sandboxes, want 5", len(l))
	}
}

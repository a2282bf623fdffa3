package edge

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/sandbox"
	"github.com/dsecproject/dsec/internal/sandbox/fake"
)

// BenchmarkListByLabel: a label-selected list on an edge holding 2,400
// sandboxes (the control-plane bench's load per edge at DSec's scale), as
// a takeover's search for what an earlier attempt made (one match) and a
// page of a job's listing (a tenth of them) ask it.
func BenchmarkListByLabel(b *testing.B) {
	ctx := context.Background()
	src := &testImages{dir: b.TempDir()}
	layers := src.digests(b, 1)
	e, err := New(Config{Name: "n1", StateDir: b.TempDir(), Policy: sandbox.DefaultPolicy()}, Deps{Backend: fake.New("container"), Blobs: src, Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		b.Fatal(err)
	}
	if err := e.Start(ctx); err != nil {
		b.Fatal(err)
	}
	const n = 2400
	for i := range n {
		labels := map[string]string{"job": fmt.Sprintf("j%d", i%10), "dsec.idempotency": fmt.Sprintf("%032x", i)}
		if _, err := e.Create(ctx, edgeapi.CreateRequest{Spec: api.SandboxSpec{Base: "base/x:1", Labels: labels}, Digests: layers}); err != nil {
			b.Fatal(err)
		}
	}
	for _, c := range []struct {
		name string
		f    edgeapi.ListFilter
		want int
	}{
		{"one-of-2400", edgeapi.ListFilter{Labels: map[string]string{"dsec.idempotency": fmt.Sprintf("%032x", 1234)}}, 1},
		{"job-page", edgeapi.ListFilter{Labels: map[string]string{"job": "j3"}, Limit: 1000}, n / 10},
		{"all-page", edgeapi.ListFilter{Limit: 100}, 100},
	} {
		b.Run(c.name, func(b *testing.B) {
			for b.Loop() {
				l, err := e.List(ctx, c.f)
				if err != nil || len(l) != c.want {
					b.Fatalf("%d listed (%v), want %d", len(l), err, c.want)
				}
			}
		})
	}
}

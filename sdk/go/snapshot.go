package dsec

import (
	"context"
	"net/http"

	"github.com/dsecproject/dsec/api"
)

// Snapshot packs a sandbox's writable state into a new snapshot layer
// (pack_diff). Start sandboxes from it with SandboxSpec.Snapshot.
func (c *Client) Snapshot(ctx context.Context, id string, req api.SnapshotRequest) (*api.Layer, error) {
	var l api.Layer
	if err := c.call(ctx, request{method: http.MethodPost, path: "/v1/sandboxes/" + esc(id) + "/snapshot", jsonBody: req, keyed: true}, &l); err != nil {
		return nil, err
	}
	return &l, nil
}

// Fork snapshots a sandbox's current state and starts count sandboxes from
// it; labels are added to theirs. Partial success is reported per index.
func (c *Client) Fork(ctx context.Context, id string, count int, labels map[string]string) (*api.BatchResult, error) {
	var res api.BatchResult
	body := api.ForkRequest{Count: count, Labels: labels}
	if err := c.call(ctx, request{method: http.MethodPost, path: "/v1/sandboxes/" + esc(id) + "/fork", jsonBody: body, keyed: true}, &res); err != nil {
		return nil, err
	}
	return &res, nil
}

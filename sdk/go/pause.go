package dsec

import (
	"context"
	"net/http"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// Pause freezes a sandbox and reclaims its memory; the result says how much
// was freed. Any later exec, session or files call resumes it.
func (c *Client) Pause(ctx context.Context, id string) (*api.PauseResult, error) {
	var res api.PauseResult
	if err := c.call(ctx, request{method: http.MethodPost, path: "/v1/sandboxes/" + esc(id) + "/pause"}, &res); err != nil {
		return nil, err
	}
	return &res, nil
}

// Resume thaws a paused sandbox.
func (c *Client) Resume(ctx context.Context, id string) (*api.Sandbox, error) {
	var sb api.Sandbox
	if err := c.call(ctx, request{method: http.MethodPost, path: "/v1/sandboxes/" + esc(id) + "/resume"}, &sb); err != nil {
		return nil, err
	}
	return &sb, nil
}

// PauseSandboxes pauses every running sandbox whose labels contain labels
// (e.g. a whole preempted job) and returns how many it paused. Nodes that
// could not be asked are named in a *NodesUnreachableError, with the count
// of the others (as DeleteSandboxes).
func (c *Client) PauseSandboxes(ctx context.Context, labels map[string]string) (int, error) {
	return c.countByLabels(ctx, "/v1/sandboxes:pause", "paused", labels)
}

// ResumeSandboxes resumes every paused sandbox whose labels contain labels;
// nodes that could not be asked as for PauseSandboxes.
func (c *Client) ResumeSandboxes(ctx context.Context, labels map[string]string) (int, error) {
	return c.countByLabels(ctx, "/v1/sandboxes:resume", "resumed", labels)
}

func (c *Client) countByLabels(ctx context.Context, path, done string, labels map[string]string) (int, error) {
	if len(labels) == 0 {
		return 0, errdefs.Invalid("at least one label is required")
	}
	var res api.CountResult
	if err := c.call(ctx, request{method: http.MethodPost, path: path, jsonBody: api.LabelsRequest{Labels: labels}}, &res); err != nil {
		return 0, err
	}
	return res.Count, unreachable(done, res.Count, res.UnreachableNodes)
}

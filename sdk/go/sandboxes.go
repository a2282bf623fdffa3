package dsec

import (
	"context"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// CreateSandbox creates one sandbox (POST /v1/sandboxes).
func (c *Client) CreateSandbox(ctx context.Context, spec api.SandboxSpec) (*api.Sandbox, error) {
	var sb api.Sandbox
	err := c.call(ctx, request{method: http.MethodPost, path: "/v1/sandboxes", jsonBody: spec, keyed: true}, &sb)
	if err != nil {
		return nil, err
	}
	return &sb, nil
}

// CreateSandboxes creates count sandboxes from one spec. Partial success is
// normal: the failed items are in the result's Errors, not in err.
func (c *Client) CreateSandboxes(ctx context.Context, count int, spec api.SandboxSpec) (*api.BatchResult, error) {
	var res api.BatchResult
	body := api.BatchCreateRequest{Count: count, Spec: spec}
	err := c.call(ctx, request{method: http.MethodPost, path: "/v1/sandboxes:batch", jsonBody: body, keyed: true}, &res)
	if err != nil {
		return nil, err
	}
	return &res, nil
}

// GetSandbox returns one sandbox.
func (c *Client) GetSandbox(ctx context.Context, id string) (*api.Sandbox, error) {
	var sb api.Sandbox
	if err := c.call(ctx, request{method: http.MethodGet, path: "/v1/sandboxes/" + esc(id)}, &sb); err != nil {
		return nil, err
	}
	return &sb, nil
}

// ListOptions filters GET /v1/sandboxes. Empty fields do not filter.
type ListOptions struct {
	State     string
	Labels    map[string]string // all must match
	Limit     int               // page size; 0 = server default
	PageToken string
}

// ListSandboxes returns one page; pass the result's NextPageToken back in
// opts.PageToken for the next one, or use ListAllSandboxes.
func (c *Client) ListSandboxes(ctx context.Context, opts ListOptions) (*api.SandboxList, error) {
	q := url.Values{}
	if opts.State != "" {
		q.Set("state", opts.State)
	}
	for _, k := range slices.Sorted(maps.Keys(opts.Labels)) {
		q.Add("label", k+"="+opts.Labels[k])
	}
	if opts.Limit > 0 {
		q.Set("limit", strconv.Itoa(opts.Limit))
	}
	if opts.PageToken != "" {
		q.Set("page_token", opts.PageToken)
	}
	var list api.SandboxList
	if err := c.call(ctx, request{method: http.MethodGet, path: "/v1/sandboxes", query: q}, &list); err != nil {
		return nil, err
	}
	return &list, nil
}

// ListAllSandboxes follows pagination from opts.PageToken to the last page.
// The sandboxes of nodes that could not be asked are left out, as on each
// page; ListAll also says which nodes those were.
func (c *Client) ListAllSandboxes(ctx context.Context, opts ListOptions) ([]api.Sandbox, error) {
	l, err := c.ListAll(ctx, opts)
	if err != nil {
		return nil, err
	}
	return l.Sandboxes, nil
}

// ListAll follows pagination from opts.PageToken to the last page and
// returns every page's sandboxes in one list, with UnreachableNodes the
// nodes any page could not ask (sorted; their sandboxes are missing from
// the list) and no NextPageToken.
func (c *Client) ListAll(ctx context.Context, opts ListOptions) (*api.SandboxList, error) {
	out := &api.SandboxList{}
	seen := map[string]bool{}
	down := map[string]bool{}
	for {
		page, err := c.ListSandboxes(ctx, opts)
		if err != nil {
			return nil, err
		}
		out.Sandboxes = append(out.Sandboxes, page.Sandboxes...)
		for _, n := range page.UnreachableNodes {
			if !down[n] {
				down[n] = true
				out.UnreachableNodes = append(out.UnreachableNodes, n)
			}
		}
		if page.NextPageToken == "" {
			slices.Sort(out.UnreachableNodes)
			return out, nil
		}
		// A server handing out the same token twice would loop us forever.
		if seen[page.NextPageToken] {
			return nil, errdefs.Precondition("server repeated page token %q", page.NextPageToken)
		}
		seen[page.NextPageToken] = true
		opts.PageToken = page.NextPageToken
	}
}

// DeleteSandbox destroys a sandbox. The server answers 204 for unknown ids
// too (delete is idempotent), so any error here is a real failure.
func (c *Client) DeleteSandbox(ctx context.Context, id string) error {
	return c.call(ctx, request{method: http.MethodDelete, path: "/v1/sandboxes/" + esc(id)}, nil)
}

// DeleteSandboxes destroys every sandbox carrying all of labels and returns
// how many were deleted. Empty labels are refused client-side: they would
// select every sandbox the caller can see. If some nodes could not be
// asked (down or cut off), their sandboxes are left as they are: the count
// is of the others, and the error a *NodesUnreachableError (unavailable).
func (c *Client) DeleteSandboxes(ctx context.Context, labels map[string]string) (int, error) {
	if len(labels) == 0 {
		return 0, errdefs.Invalid("delete by labels needs at least one label")
	}
	var res api.DeleteResult
	body := api.LabelsRequest{Labels: labels}
	if err := c.call(ctx, request{method: http.MethodPost, path: "/v1/sandboxes:delete", jsonBody: body}, &res); err != nil {
		return 0, err
	}
	return res.Deleted, unreachable("deleted", res.Deleted, res.UnreachableNodes)
}

// Keepalive extends a sandbox's lifetime: it then expires ttl from now.
// The API counts in whole seconds; ttl is rounded up.
func (c *Client) Keepalive(ctx context.Context, id string, ttl time.Duration) error {
	body := api.KeepaliveRequest{TTL: ceilSeconds(ttl)}
	return c.call(ctx, request{method: http.MethodPost, path: "/v1/sandboxes/" + esc(id) + "/keepalive", jsonBody: body}, nil)
}

// Stats returns a sandbox's current resource use.
func (c *Client) Stats(ctx context.Context, id string) (*api.Stats, error) {
	var st api.Stats
	if err := c.call(ctx, request{method: http.MethodGet, path: "/v1/sandboxes/" + esc(id) + "/stats"}, &st); err != nil {
		return nil, err
	}
	return &st, nil
}

func ceilSeconds(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	return int64((d + time.Second - 1) / time.Second)
}

// SetNetwork replaces a sandbox's egress policy, live.
func (c *Client) SetNetwork(ctx context.Context, id string, policy api.NetworkPolicy) (*api.Sandbox, error) {
	var sb api.Sandbox
	if err := c.call(ctx, request{method: http.MethodPut, path: "/v1/sandboxes/" + esc(id) + "/network", jsonBody: policy}, &sb); err != nil {
		return nil, err
	}
	return &sb, nil
}

// PortURL is the URL under which the API proxies HTTP to port of a sandbox
// (requests need the API key, which is not passed on to the sandbox).
func (c *Client) PortURL(id string, port int) string {
	return c.Endpoint() + "/v1/sandboxes/" + esc(id) + "/ports/" + strconv.Itoa(port) + "/"
}

package dsec

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"

	"github.com/dsecproject/dsec/api"
)

// BuildLayer uploads a tar stream (plain or gzip) and has the server build it
// into a layer named kind/name:tag. tarReader is closed when the request is
// done if it is an io.Closer.
func (c *Client) BuildLayer(ctx context.Context, kind, name, tag string, tarReader io.Reader) (*api.Layer, error) {
	q := url.Values{"kind": {kind}, "name": {name}}
	if tag != "" {
		q.Set("tag", tag)
	}
	body, ctype := sniffTar(tarReader)
	var l api.Layer
	if err := c.call(ctx, request{method: http.MethodPost, path: "/v1/layers", query: q, body: body, contentType: ctype}, &l); err != nil {
		return nil, err
	}
	return &l, nil
}

// ListLayers lists the catalog, optionally only one kind ("" = all).
func (c *Client) ListLayers(ctx context.Context, kind string) ([]api.Layer, error) {
	q := url.Values{}
	if kind != "" {
		q.Set("kind", kind)
	}
	var list api.LayerList
	if err := c.call(ctx, request{method: http.MethodGet, path: "/v1/layers", query: q}, &list); err != nil {
		return nil, err
	}
	return list.Layers, nil
}

// GetLayer looks a layer up by ref ("base/python:3.11") or digest
// ("sha256:...").
func (c *Client) GetLayer(ctx context.Context, refOrDigest string) (*api.Layer, error) {
	var l api.Layer
	if err := c.call(ctx, request{method: http.MethodGet, path: "/v1/layers/" + esc(refOrDigest)}, &l); err != nil {
		return nil, err
	}
	return &l, nil
}

// DeleteLayer removes a ref from the catalog.
func (c *Client) DeleteLayer(ctx context.Context, ref string) error {
	return c.call(ctx, request{method: http.MethodDelete, path: "/v1/layers/" + esc(ref)}, nil)
}

// GCLayers removes the layer blobs that no ref names and no sandbox uses
// (those of refs re-pointed with replace, what an interrupted build left).
// It takes a builder or admin key of the root project.
func (c *Client) GCLayers(ctx context.Context) (*api.LayerGCResult, error) {
	return c.gcLayers(ctx, false)
}

// UnusedLayers is what GCLayers would remove now; it removes nothing.
func (c *Client) UnusedLayers(ctx context.Context) (*api.LayerGCResult, error) {
	return c.gcLayers(ctx, true)
}

func (c *Client) gcLayers(ctx context.Context, dry bool) (*api.LayerGCResult, error) {
	var res api.LayerGCResult
	q := url.Values{}
	if dry {
		q.Set("dry_run", "true")
	}
	if err := c.call(ctx, request{method: http.MethodPost, path: "/v1/layers:gc", query: q}, &res); err != nil {
		return nil, err
	}
	return &res, nil
}

// PushLayer stores a layer of the catalog in an OCI registry as an
// artifact: req.Target is oci://HOST/REPO:TAG (req.Insecure for plain
// HTTP). Blobs the registry has are not sent again.
func (c *Client) PushLayer(ctx context.Context, req api.LayerPushRequest) (*api.LayerPushResult, error) {
	var res api.LayerPushResult
	if err := c.call(ctx, request{method: http.MethodPost, path: "/v1/layers:push", jsonBody: req}, &res); err != nil {
		return nil, err
	}
	return &res, nil
}

// AddLayer registers req.Ref as the layer artifact at req.Source
// (oci://HOST/REPO:TAG) without copying its image: edges read it from
// there, on demand (req.Pull "lazy", the default) or whole before first
// use ("full").
func (c *Client) AddLayer(ctx context.Context, req api.LayerAddRequest) (*api.Layer, error) {
	var l api.Layer
	if err := c.call(ctx, request{method: http.MethodPost, path: "/v1/layers:add", jsonBody: req}, &l); err != nil {
		return nil, err
	}
	return &l, nil
}

// ListNodes returns the edges the apiserver knows.
func (c *Client) ListNodes(ctx context.Context) ([]api.Node, error) {
	var list api.NodeList
	if err := c.call(ctx, request{method: http.MethodGet, path: "/v1/nodes"}, &list); err != nil {
		return nil, err
	}
	return list.Nodes, nil
}

// Health checks GET /healthz (unauthenticated) and returns nil if the server
// answers 2xx.
func (c *Client) Health(ctx context.Context) error {
	if err := c.call(ctx, request{method: http.MethodGet, path: "/healthz", accept: "*/*"}, nil); err != nil {
		return fmt.Errorf("checking health of %s: %w", c.Endpoint(), err)
	}
	return nil
}

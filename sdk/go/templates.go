package dsec

import (
	"context"
	"net/http"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// Template aliases: names the E2B API's templateID may give for a base
// layer with an optional workspace, toolkits, user and backend
// (docs/e2b.md).

// CreateTemplate makes the alias t.Name for t's layers and user. A name
// already taken is ErrAlreadyExists. It carries no Idempotency-Key: a
// create whose answer was lost is found with GetTemplate.
func (c *Client) CreateTemplate(ctx context.Context, t api.Template) (*api.Template, error) {
	if t.Name == "" || t.Base == "" {
		return nil, errdefs.Invalid("a template alias needs a name and a base layer ref")
	}
	req := api.Template{Name: t.Name, Base: t.Base, Workspace: t.Workspace, Toolkits: t.Toolkits, User: t.User, Backend: t.Backend}
	var out api.Template
	if err := c.call(ctx, request{method: http.MethodPost, path: "/v1/templates", jsonBody: req}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// ListTemplates returns the aliases the caller may see, by name.
func (c *Client) ListTemplates(ctx context.Context) ([]api.Template, error) {
	var l api.TemplateList
	if err := c.call(ctx, request{method: http.MethodGet, path: "/v1/templates"}, &l); err != nil {
		return nil, err
	}
	return l.Templates, nil
}

// GetTemplate returns one alias.
func (c *Client) GetTemplate(ctx context.Context, name string) (*api.Template, error) {
	if err := needID("template", name); err != nil {
		return nil, err
	}
	var t api.Template
	if err := c.call(ctx, request{method: http.MethodGet, path: "/v1/templates/" + esc(name)}, &t); err != nil {
		return nil, err
	}
	return &t, nil
}

// DeleteTemplate removes an alias; sandboxes made from it keep running.
func (c *Client) DeleteTemplate(ctx context.Context, name string) error {
	if err := needID("template", name); err != nil {
		return err
	}
	return c.call(ctx, request{method: http.MethodDelete, path: "/v1/templates/" + esc(name)}, nil)
}

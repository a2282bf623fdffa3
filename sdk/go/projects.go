package dsec

import (
	"context"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// Projects, keys, whoami and audit (the IAM calls). The server enforces
// the roles (viewer < member < builder < admin) and the scope rule: a key
// acts on its own project and the projects below it.

// CreateProject creates a project below req.Parent (a project ID or
// "root").
//
// Unlike sandbox creates, CreateProject and CreateKey carry no
// Idempotency-Key: the server would keep the answer for repeats, and a
// key's answer holds its secret, which must exist nowhere but in that one
// answer. Both are therefore sent again only when the first attempt never
// left; a caller whose create got no answer looks with GetProject or
// ListKeys before trying again.
func (c *Client) CreateProject(ctx context.Context, req api.CreateProjectRequest) (*api.Project, error) {
	if req.Name == "" {
		return nil, errdefs.Invalid("a project needs a name")
	}
	var p api.Project
	if err := c.call(ctx, request{method: http.MethodPost, path: "/v1/projects", jsonBody: req}, &p); err != nil {
		return nil, err
	}
	return &p, nil
}

// GetProject returns one project; its Usage counts the project and all
// its descendants.
func (c *Client) GetProject(ctx context.Context, id string) (*api.Project, error) {
	if err := needID("project", id); err != nil {
		return nil, err
	}
	var p api.Project
	if err := c.call(ctx, request{method: http.MethodGet, path: "/v1/projects/" + esc(id)}, &p); err != nil {
		return nil, err
	}
	return &p, nil
}

// ProjectListOptions selects GET /v1/projects. Empty fields do not filter.
type ProjectListOptions struct {
	// Parent lists only the children of this project; empty lists every
	// project the caller can see.
	Parent    string
	Limit     int // page size; 0 = server default
	PageToken string
}

// ListProjects returns one page; pass the result's NextPageToken back in
// opts.PageToken for the next one, or use ListAllProjects.
func (c *Client) ListProjects(ctx context.Context, opts ProjectListOptions) (*api.ProjectList, error) {
	q := url.Values{}
	if opts.Parent != "" {
		q.Set("parent", opts.Parent)
	}
	if opts.Limit > 0 {
		q.Set("limit", strconv.Itoa(opts.Limit))
	}
	if opts.PageToken != "" {
		q.Set("page_token", opts.PageToken)
	}
	var list api.ProjectList
	if err := c.call(ctx, request{method: http.MethodGet, path: "/v1/projects", query: q}, &list); err != nil {
		return nil, err
	}
	return &list, nil
}

// ListAllProjects follows pagination to the last page: every child of
// parent, or every project the caller can see when parent is empty.
func (c *Client) ListAllProjects(ctx context.Context, parent string) ([]api.Project, error) {
	var all []api.Project
	opts := ProjectListOptions{Parent: parent}
	seen := map[string]bool{}
	for {
		page, err := c.ListProjects(ctx, opts)
		if err != nil {
			return nil, err
		}
		all = append(all, page.Projects...)
		if page.NextPageToken == "" {
			return all, nil
		}
		// A server handing out the same token twice would loop us forever.
		if seen[page.NextPageToken] {
			return nil, errdefs.Precondition("server repeated page token %q", page.NextPageToken)
		}
		seen[page.NextPageToken] = true
		opts.PageToken = page.NextPageToken
	}
}

// UpdateProject changes the fields of req that are set (a nil field is
// left as it is) and returns the project as it now is.
func (c *Client) UpdateProject(ctx context.Context, id string, req api.UpdateProjectRequest) (*api.Project, error) {
	if err := needID("project", id); err != nil {
		return nil, err
	}
	var p api.Project
	if err := c.call(ctx, request{method: http.MethodPatch, path: "/v1/projects/" + esc(id), jsonBody: req}, &p); err != nil {
		return nil, err
	}
	return &p, nil
}

// DeleteProject deletes a project. With cascade the server deletes the
// projects below it too; without, it refuses a project that has any.
func (c *Client) DeleteProject(ctx context.Context, id string, cascade bool) error {
	if err := needID("project", id); err != nil {
		return err
	}
	q := url.Values{}
	if cascade {
		q.Set("cascade", "true")
	}
	return c.call(ctx, request{method: http.MethodDelete, path: "/v1/projects/" + esc(id), query: q}, nil)
}

// CreateKey mints an API key of project with req.Role (no higher than the
// caller's own). The answer's Key is the secret: it is shown only here and
// stored hashed, so the caller must keep it now.
func (c *Client) CreateKey(ctx context.Context, project string, req api.CreateKeyRequest) (*api.APIKey, error) {
	if err := needID("project", project); err != nil {
		return nil, err
	}
	if req.Role == "" {
		return nil, errdefs.Invalid("a key needs a role")
	}
	if req.ExpiresIn < 0 {
		return nil, errdefs.Invalid("a key's lifetime must not be negative")
	}
	var k api.APIKey
	if err := c.call(ctx, request{method: http.MethodPost, path: "/v1/projects/" + esc(project) + "/keys", jsonBody: req}, &k); err != nil {
		return nil, err
	}
	return &k, nil
}

// ListKeys returns the keys of project, without their secrets.
func (c *Client) ListKeys(ctx context.Context, project string) ([]api.APIKey, error) {
	if err := needID("project", project); err != nil {
		return nil, err
	}
	var list api.KeyList
	if err := c.call(ctx, request{method: http.MethodGet, path: "/v1/projects/" + esc(project) + "/keys"}, &list); err != nil {
		return nil, err
	}
	return list.Keys, nil
}

// RevokeKey deletes a key of project; calls made with it fail from then on.
func (c *Client) RevokeKey(ctx context.Context, project, keyID string) error {
	if err := needID("project", project); err != nil {
		return err
	}
	if err := needID("key", keyID); err != nil {
		return err
	}
	return c.call(ctx, request{method: http.MethodDelete, path: "/v1/projects/" + esc(project) + "/keys/" + esc(keyID)}, nil)
}

// WhoAmI describes the caller's key: its principal, project, role and
// what that role permits.
func (c *Client) WhoAmI(ctx context.Context) (*api.WhoAmI, error) {
	var w api.WhoAmI
	if err := c.call(ctx, request{method: http.MethodGet, path: "/v1/whoami"}, &w); err != nil {
		return nil, err
	}
	return &w, nil
}

// ListAudit returns the management actions the caller may see, recorded
// since a time (zero: from the oldest kept), at most limit of
// them (0: the server's default). The time is sent in whole seconds,
// rounded down, so no entry after since is missed.
func (c *Client) ListAudit(ctx context.Context, since time.Time, limit int) ([]api.AuditEntry, error) {
	q := url.Values{}
	if !since.IsZero() {
		q.Set("since", since.UTC().Truncate(time.Second).Format(time.RFC3339))
	}
	if limit > 0 {
		q.Set("limit", strconv.Itoa(limit))
	}
	var list api.AuditList
	if err := c.call(ctx, request{method: http.MethodGet, path: "/v1/audit", query: q}, &list); err != nil {
		return nil, err
	}
	return list.Entries, nil
}

// needID refuses an empty path segment, which would address the
// collection instead of one of its members.
func needID(what, id string) error {
	if id == "" {
		return errdefs.Invalid("empty %s id", what)
	}
	return nil
}

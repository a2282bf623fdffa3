package dsec

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"

	"github.com/dsecproject/dsec/api"
)

// ImportOptions name what POST /v1/images:import builds.
type ImportOptions struct {
	// Ref names the base layer, base/NAME:TAG. Required.
	Ref string
	// Workspace (workspace/NAME:TAG) and Split split the image: its first
	// Split layers make the base, the rest the workspace.
	Workspace string
	Split     int
	// MergeUnder, in bytes, cuts the image into runs of layers under it,
	// each one EROFS layer (api.ImagePullRequest.MergeUnder).
	MergeUnder int64
	// Platform picks one image of a multi-arch archive (os/arch[/variant]);
	// linux/amd64 when empty.
	Platform string
}

// ImportImage uploads an image archive (an OCI image layout tar or a
// `docker save` tar, uncompressed) and has the server build it into layers.
// If progress is not nil the answer is streamed and progress is called
// with each of the server's progress lines as it comes. archive is closed
// when the request is done if it is an io.Closer.
func (c *Client) ImportImage(ctx context.Context, archive io.Reader, opts ImportOptions, progress func(string)) (*api.ImageResult, error) {
	q := url.Values{"ref": {opts.Ref}}
	if opts.Workspace != "" {
		q.Set("workspace", opts.Workspace)
	}
	if opts.Split != 0 {
		q.Set("split", strconv.Itoa(opts.Split))
	}
	if opts.MergeUnder != 0 {
		q.Set("merge_under", strconv.FormatInt(opts.MergeUnder, 10))
	}
	if opts.Platform != "" {
		q.Set("platform", opts.Platform)
	}
	return c.imageCall(ctx, request{method: http.MethodPost, path: "/v1/images:import", query: q,
		body: archive, contentType: "application/x-tar"}, progress)
}

// PullImage has the server pull req.Image from its registry and build it
// into layers. If progress is not nil the answer is streamed and progress
// is called with each of the server's progress lines (downloads, layers
// applied, images built) as it comes.
func (c *Client) PullImage(ctx context.Context, req api.ImagePullRequest, progress func(string)) (*api.ImageResult, error) {
	return c.imageCall(ctx, request{method: http.MethodPost, path: "/v1/images:pull", jsonBody: req}, progress)
}

func (c *Client) imageCall(ctx context.Context, r request, progress func(string)) (*api.ImageResult, error) {
	if progress == nil {
		var res api.ImageResult
		if err := c.call(ctx, r, &res); err != nil {
			return nil, err
		}
		return &res, nil
	}
	r.accept = "application/x-ndjson"
	resp, err := c.send(ctx, r)
	if err != nil {
		return nil, err
	}
	res, err := readImageEvents(resp.Body, progress)
	if err != nil {
		resp.Body.Close()
		return nil, err
	}
	drainClose(resp.Body)
	return res, nil
}

// readImageEvents decodes an NDJSON image event stream up to its result.
func readImageEvents(r io.Reader, progress func(string)) (*api.ImageResult, error) {
	dec := json.NewDecoder(r)
	for {
		var ev api.ImageEvent
		if err := dec.Decode(&ev); err != nil {
			if errors.Is(err, io.EOF) {
				return nil, fmt.Errorf("image stream ended without a result: %w", io.ErrUnexpectedEOF)
			}
			return nil, fmt.Errorf("reading image stream: %w", err)
		}
		switch {
		case ev.Error != nil:
			return nil, &Error{Code: ev.Error.Code, Message: ev.Error.Message}
		case ev.Result != nil:
			return ev.Result, nil
		case ev.Progress != "":
			progress(ev.Progress)
		}
	}
}

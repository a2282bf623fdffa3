package dsec

import (
	"context"
	"net/http"
	"net/url"
	"strconv"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// ReadLog returns one page of a sandbox's command log: the entries with
// seq greater than sinceSeq, in order, at most limit (0: the server's
// default, 1000). Pass the page's NextSeq as sinceSeq to read on. An entry
// of kind api.LogTruncatedKind stands in for entries the server dropped to
// keep the log bounded.
func (c *Client) ReadLog(ctx context.Context, id string, sinceSeq int64, limit int) (*api.LogPage, error) {
	q := url.Values{}
	if sinceSeq > 0 {
		q.Set("since_seq", strconv.FormatInt(sinceSeq, 10))
	}
	if limit > 0 {
		q.Set("limit", strconv.Itoa(limit))
	}
	var page api.LogPage
	if err := c.call(ctx, request{method: http.MethodGet, path: "/v1/sandboxes/" + esc(id) + "/log", query: q}, &page); err != nil {
		return nil, err
	}
	return &page, nil
}

// ReadAllLog reads a sandbox's command log from sinceSeq to its end.
func (c *Client) ReadAllLog(ctx context.Context, id string, sinceSeq int64) ([]api.LogEntry, error) {
	var all []api.LogEntry
	for {
		page, err := c.ReadLog(ctx, id, sinceSeq, 0)
		if err != nil {
			return nil, err
		}
		if len(page.Entries) == 0 {
			return all, nil
		}
		// A server that does not move forward would loop us forever.
		if page.NextSeq <= sinceSeq {
			return nil, errdefs.Precondition("server returned next_seq %d for since_seq %d", page.NextSeq, sinceSeq)
		}
		all = append(all, page.Entries...)
		sinceSeq = page.NextSeq
	}
}

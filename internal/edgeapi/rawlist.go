package edgeapi

// A listing an apiserver passes on: each sandbox as the JSON its edge
// wrote, with its id beside it. A page of a job's listing is merged from
// several edges by id and sent on; decoding every sandbox into a struct
// and encoding it again cost the apiserver most of a large listing's CPU.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"mime"
	"net/http"
	"unicode/utf8"

	"github.com/dsecproject/dsec/api"
)

// ListLinesType is the media type of an edge's listing as lines, asked
// for with Accept: one line per sandbox, its id, a tab, its API JSON
// (compact: a raw tab or newline occurs only between the two), a newline.
// An edge that does not know it answers listBody's JSON.
const ListLinesType = "application/x-dsec-sandbox-lines"

// RawSandbox is one sandbox of a listing: its id and its API JSON
// (api.Sandbox, compact, valid).
type RawSandbox struct {
	ID   string
	JSON []byte
}

// RawLister is an Edge that lists as RawSandbox (Client does).
type RawLister interface {
	ListRaw(ctx context.Context, f ListFilter) ([]RawSandbox, error)
}

// ListRaw lists e's sandboxes matching f as RawSandbox, sorted by id.
func ListRaw(ctx context.Context, e Edge, f ListFilter) ([]RawSandbox, error) {
	if rl, ok := e.(RawLister); ok {
		return rl.ListRaw(ctx, f)
	}
	l, err := e.List(ctx, f)
	if err != nil {
		return nil, err
	}
	return EncodeRaw(l)
}

// EncodeRaw encodes each sandbox of l, into one buffer.
func EncodeRaw(l []api.Sandbox) ([]RawSandbox, error) {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	ends := make([]int, len(l))
	for i := range l {
		if err := enc.Encode(&l[i]); err != nil {
			return nil, fmt.Errorf("encoding sandbox %s: %w", l[i].ID, err)
		}
		ends[i] = buf.Len()
	}
	b := buf.Bytes()
	out := make([]RawSandbox, len(l))
	start := 0
	for i, end := range ends {
		out[i] = RawSandbox{ID: l[i].ID, JSON: b[start : end-1 : end-1]} // without Encode's newline
		start = end
	}
	return out, nil
}

// writeListLines answers a listing as ListLinesType.
func writeListLines(w http.ResponseWriter, l []api.Sandbox) {
	w.Header().Set("Content-Type", ListLinesType)
	w.WriteHeader(http.StatusOK)
	// Written in chunks of about 64 KiB: a write per line would be a TLS
	// record per few sandboxes.
	var buf bytes.Buffer
	if len(l) > 0 {
		buf.Grow(80 << 10)
	}
	enc := json.NewEncoder(&buf)
	for i := range l {
		mark := buf.Len()
		buf.WriteString(l[i].ID)
		buf.WriteByte('\t')
		if enc.Encode(&l[i]) != nil {
			// Not an api.Sandbox that encodes: the apiserver reads the
			// cut answer (no newline) as the node's failure.
			buf.Truncate(mark + len(l[i].ID) + 1)
			_, _ = w.Write(buf.Bytes())
			return
		}
		if buf.Len() >= 64<<10 {
			if _, err := w.Write(buf.Bytes()); err != nil {
				return
			}
			buf.Reset()
		}
	}
	_, _ = w.Write(buf.Bytes())
}

// wantsLines says whether a listing request asked for ListLinesType.
func wantsLines(r *http.Request) bool {
	for _, v := range r.Header.Values("Accept") {
		if mt, _, err := mime.ParseMediaType(v); err == nil && mt == ListLinesType {
			return true
		}
	}
	return false
}

// ListRaw implements RawLister. Each line's id must be a sandbox id, and
// its JSON one valid object in UTF-8 that begins with that id (as
// encoding/json writes an api.Sandbox), or the answer is the node's
// failure: a broken edge's line must not reach a client's page, nor page
// by an id it does not show. The other fields' types are not checked: an
// edge is a member of the cluster.
func (c *Client) ListRaw(ctx context.Context, f ListFilter) ([]RawSandbox, error) {
	cl := call{method: "POST", path: "/sandboxes:list", json: f, header: http.Header{"Accept": {ListLinesType}}}
	resp, err := c.do(ctx, cl)
	if err != nil {
		return nil, err
	}
	defer drain(resp.Body)
	bad := func(err error) error {
		return &Unreachable{Node: c.name, Err: fmt.Errorf("reading the answer to %s %s: %w", cl.method, cl.path, err)}
	}
	if mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type")); mt != ListLinesType {
		// An edge older than lines.
		var b listBody
		if err := json.NewDecoder(resp.Body).Decode(&b); err != nil {
			return nil, bad(err)
		}
		return EncodeRaw(b.Sandboxes)
	}
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, bad(err)
	}
	l, err := parseListLines(body)
	if err != nil {
		return nil, bad(err)
	}
	return l, nil
}

// parseListLines splits a ListLinesType body into its sandboxes, the
// JSON of each slicing body.
func parseListLines(body []byte) ([]RawSandbox, error) {
	out := make([]RawSandbox, 0, bytes.Count(body, []byte{'\n'}))
	for len(body) > 0 {
		nl := bytes.IndexByte(body, '\n')
		if nl < 0 {
			return nil, fmt.Errorf("listing line %d is cut short", len(out)+1)
		}
		line := body[:nl]
		body = body[nl+1:]
		tab := bytes.IndexByte(line, '\t')
		if tab < 0 {
			return nil, fmt.Errorf("listing line %d has no id", len(out)+1)
		}
		id, js := string(line[:tab]), line[tab+1:len(line):len(line)]
		if _, ok := NodeOf(id); !ok {
			return nil, fmt.Errorf("listing line %d: %.80q is not a sandbox id", len(out)+1, id)
		}
		if !bytes.HasPrefix(js, []byte(`{"id":"`+id+`"`)) || !utf8.Valid(js) || !json.Valid(js) {
			return nil, fmt.Errorf("listing line %d (%s): not the JSON object of that sandbox", len(out)+1, id)
		}
		out = append(out, RawSandbox{ID: id, JSON: js})
	}
	return out, nil
}

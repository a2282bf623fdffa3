package dsec

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strconv"

	"github.com/dsecproject/dsec/api"
)

// All file paths are resolved by the server inside the sandbox root.
//
// Methods that take a body reader close it when the request is done if it is
// an io.Closer, as net/http does; the body may still be read briefly after an
// early error answer.

func filesPath(id, suffix string) string { return "/v1/sandboxes/" + esc(id) + "/files" + suffix }

// ReadFile returns the content of a file in a sandbox.
func (c *Client) ReadFile(ctx context.Context, id, path string) ([]byte, error) {
	var buf bytes.Buffer
	if _, err := c.ReadFileTo(ctx, id, path, &buf); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// ReadFileTo streams a file of a sandbox into w and returns the bytes copied.
func (c *Client) ReadFileTo(ctx context.Context, id, path string, w io.Writer) (int64, error) {
	resp, err := c.send(ctx, request{
		method: http.MethodGet, path: filesPath(id, ""),
		query: url.Values{"path": {path}}, accept: "application/octet-stream",
	})
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	n, err := io.Copy(w, resp.Body)
	if err != nil {
		return n, fmt.Errorf("reading %s: %w", path, err)
	}
	return n, nil
}

// WriteFile writes r to a file in a sandbox, creating parent directories.
// mode sets the permission bits; 0 leaves the server's default.
func (c *Client) WriteFile(ctx context.Context, id, path string, r io.Reader, mode os.FileMode) error {
	q := url.Values{"path": {path}}
	if m := fileModeBits(mode); m != 0 {
		q.Set("mode", fmt.Sprintf("%04o", m))
	}
	return c.call(ctx, request{
		method: http.MethodPut, path: filesPath(id, ""), query: q,
		body: r, contentType: "application/octet-stream",
	}, nil)
}

// fileModeBits maps an os.FileMode to the Unix bits the API takes
// (permissions plus setuid, setgid, sticky).
func fileModeBits(m os.FileMode) uint32 {
	bits := uint32(m.Perm())
	if m&os.ModeSetuid != 0 {
		bits |= 0o4000
	}
	if m&os.ModeSetgid != 0 {
		bits |= 0o2000
	}
	if m&os.ModeSticky != 0 {
		bits |= 0o1000
	}
	return bits
}

// ListFiles lists a directory down to depth levels (0 = server default, 1).
func (c *Client) ListFiles(ctx context.Context, id, path string, depth int) ([]api.FileEntry, error) {
	q := url.Values{"path": {path}}
	if depth > 0 {
		q.Set("depth", strconv.Itoa(depth))
	}
	var list api.FileList
	if err := c.call(ctx, request{method: http.MethodGet, path: filesPath(id, ":list"), query: q}, &list); err != nil {
		return nil, err
	}
	return list.Entries, nil
}

// StatFile describes one path without following a final symlink.
func (c *Client) StatFile(ctx context.Context, id, path string) (*api.FileEntry, error) {
	var e api.FileEntry
	q := url.Values{"path": {path}}
	if err := c.call(ctx, request{method: http.MethodGet, path: filesPath(id, ":stat"), query: q}, &e); err != nil {
		return nil, err
	}
	return &e, nil
}

// DeleteFile removes a file, or a directory tree when recursive is set.
func (c *Client) DeleteFile(ctx context.Context, id, path string, recursive bool) error {
	q := url.Values{"path": {path}}
	if recursive {
		q.Set("recursive", "true")
	}
	return c.call(ctx, request{method: http.MethodDelete, path: filesPath(id, ""), query: q}, nil)
}

// UploadTar extracts a tar stream (plain or gzip) into path in the sandbox.
func (c *Client) UploadTar(ctx context.Context, id, path string, r io.Reader) (*api.TarResult, error) {
	body, ctype := sniffTar(r)
	var res api.TarResult
	err := c.call(ctx, request{
		method: http.MethodPut, path: filesPath(id, ":tar"),
		query: url.Values{"path": {path}}, body: body, contentType: ctype,
	}, &res)
	if err != nil {
		return nil, err
	}
	return &res, nil
}

// DownloadTar writes a tar stream of path in the sandbox to w and returns the
// bytes copied.
func (c *Client) DownloadTar(ctx context.Context, id, path string, w io.Writer) (int64, error) {
	resp, err := c.send(ctx, request{
		method: http.MethodGet, path: filesPath(id, ":tar"),
		query: url.Values{"path": {path}}, accept: "application/x-tar",
	})
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	n, err := io.Copy(w, resp.Body)
	if err != nil {
		return n, fmt.Errorf("downloading tar of %s: %w", path, err)
	}
	return n, nil
}

// sniffTar labels a tar body as gzip or plain tar from its first bytes. The
// server detects the format itself; the label only helps proxies and logs.
// The returned reader keeps r's Close so that net/http still closes it.
func sniffTar(r io.Reader) (io.Reader, string) {
	br := bufio.NewReader(r)
	ctype := "application/x-tar"
	if magic, _ := br.Peek(2); len(magic) == 2 && magic[0] == 0x1f && magic[1] == 0x8b {
		ctype = "application/gzip"
	}
	if cl, ok := r.(io.Closer); ok {
		return struct {
			io.Reader
			io.Closer
		}{br, cl}, ctype
	}
	return br, ctype
}

package apiserver

import (
	"encoding/json"
	"testing"

	"github.com/dsecproject/dsec/api"
)

func TestReadLogRoute(t *testing.T) {
	bothWays(t, func(t *testing.T, f *fixture) {
		f.do(t, f.admin, "POST", "/v1/sandboxes", `{"base":"base/py:1"}`)
		// A viewer may read the log.
		resp, body := f.do(t, f.viewer, "GET", "/v1/sandboxes/sb-n1-0001/log?since_seq=1&limit=1", "")
		var page api.LogPage
		if resp.StatusCode != 200 || json.Unmarshal(body, &page) != nil {
			t.Fatalf("got %d %s", resp.StatusCode, body)
		}
		if len(page.Entries) != 1 || page.Entries[0].Seq != 2 || page.NextSeq != 2 {
			t.Fatalf("page %+v", page)
		}
		resp, body = f.do(t, f.admin, "GET", "/v1/sandboxes/sb-n1-0001/log", "")
		if resp.StatusCode != 200 || json.Unmarshal(body, &page) != nil || len(page.Entries) != 3 {
			t.Fatalf("defaults: %d %s", resp.StatusCode, body)
		}
		for _, q := range []string{"since_seq=-1", "since_seq=x", "limit=0", "limit=10001", "limit=x"} {
			resp, body = f.do(t, f.admin, "GET", "/v1/sandboxes/sb-n1-0001/log?"+q, "")
			wantError(t, resp, body, 400, "invalid_argument")
		}
		resp, body = f.do(t, f.admin, "GET", "/v1/sandboxes/sb-n1-0999/log", "")
		wantError(t, resp, body, 404, "not_found")
		resp, body = f.do(t, "", "GET", "/v1/sandboxes/sb-n1-0001/log", "")
		wantError(t, resp, body, 401, "unauthenticated")
	})
}

package cluster

import (
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	dsec "github.com/dsecproject/dsec/sdk/go"
)

// httpDo sends a raw request to the first apiserver with the admin key.
func httpDo(t *testing.T, method, path, body string, headers map[string]string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(method, "http://"+c.servers[0].addr+path, strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+adminKey)
	for k, v := range headers {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestZZNothingLeaks runs last (its file sorts last): with every sandbox
// deleted, no edge holds a sandbox directory, a layer mount or an overlay.
func TestZZNothingLeaks(t *testing.T) {
	need(t)
	all, err := c.client.ListAllSandboxes(ctx(t), dsec.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, sb := range all {
		if err := c.client.DeleteSandbox(ctx(t), sb.ID); err != nil {
			t.Fatalf("delete %s: %v", sb.ID, err)
		}
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		left := leftovers(t)
		if len(left) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("left behind after every sandbox was deleted:\n%s", strings.Join(left, "\n"))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func leftovers(t *testing.T) []string {
	var left []string
	for _, e := range c.edges {
		dir := filepath.Join(c.dir, e.name, "edge")
		for _, sub := range []string{"sandboxes", "trash"} {
			es, _ := os.ReadDir(filepath.Join(dir, sub))
			for _, x := range es {
				left = append(left, e.name+": "+sub+"/"+x.Name())
			}
		}
	}
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		// The run dir's tmpfs, the pinned runtime binary and the layer
		// daemon's filesystem stay while an edge runs; everything else
		// is a sandbox's.
		if len(f) > 4 && strings.HasPrefix(f[4], c.dir) && !strings.HasSuffix(f[4], "/runtime") && !strings.Contains(f[4], "/bin/") &&
			!strings.HasSuffix(f[4], "/layerfs/mnt") {
			left = append(left, "mount "+f[4])
		}
	}
	return left
}

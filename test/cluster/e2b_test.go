package cluster

import (
	"bytes"
	"encoding/json"
	"io"
	"mime/multipart"
	"net/http"
	"strings"
	"testing"

	"connectrpc.com/connect"

	"github.com/dsecproject/dsec/internal/e2b/processpb"
	"github.com/dsecproject/dsec/internal/e2b/processpb/processpbconnect"
)

type envdHeaders map[string]string

func (h envdHeaders) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	for k, v := range h {
		r.Header.Set(k, v)
	}
	return http.DefaultTransport.RoundTrip(r)
}

// TestE2BAcrossServers: a sandbox made through one apiserver's E2B API is
// driven through the other's envd API with the token the first gave (the
// token secret is the cluster's, in etcd), and killed through it.
func TestE2BAcrossServers(t *testing.T) {
	need(t)
	s0, s1 := "http://"+c.servers[0].addr, "http://"+c.servers[1].addr
	req, _ := http.NewRequest("POST", s0+"/v2/sandboxes", strings.NewReader(`{"templateID":"`+baseRef+`","timeout":300}`))
	req.Header.Set("X-API-KEY", adminKey)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var sb struct{ SandboxID, EnvdAccessToken string }
	json.NewDecoder(resp.Body).Decode(&sb)
	resp.Body.Close()
	if resp.StatusCode != 201 || sb.EnvdAccessToken == "" {
		t.Fatalf("create through s0: %d %+v", resp.StatusCode, sb)
	}
	hdr := envdHeaders{"E2b-Sandbox-Id": sb.SandboxID, "X-Access-Token": sb.EnvdAccessToken}
	pc := processpbconnect.NewProcessClient(&http.Client{Transport: hdr}, s1, connect.WithProtoJSON())
	st, err := pc.Start(t.Context(), connect.NewRequest(&processpb.StartRequest{Process: &processpb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", "echo through-s1; exit 4"}}}))
	if err != nil {
		t.Fatal(err)
	}
	var out string
	code := int32(-1)
	first := ""
	for st.Receive() {
		ev := st.Msg().GetEvent()
		if first == "" {
			first = map[bool]string{true: "start", false: "other"}[ev.GetStart() != nil]
		}
		out += string(ev.GetData().GetStdout())
		if e := ev.GetEnd(); e != nil {
			code = e.GetExitCode()
		}
	}
	if st.Err() != nil || first != "start" || out != "through-s1\n" || code != 4 {
		t.Fatalf("process through s1: first %s, out %q, exit %d, %v", first, out, code, st.Err())
	}
	// Files through s1: a multipart write, then a read.
	var body bytes.Buffer
	mw := multipart.NewWriter(&body)
	fw, _ := mw.CreateFormFile("file", "/tmp/x.txt")
	fw.Write([]byte("via s1"))
	mw.Close()
	up, _ := http.NewRequest("POST", s1+"/files?path=/tmp/x.txt", &body)
	up.Header.Set("Content-Type", mw.FormDataContentType())
	resp, err = (&http.Client{Transport: hdr}).Do(up)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("upload through s1: %v %v", err, resp.Status)
	}
	resp.Body.Close()
	resp, err = (&http.Client{Transport: hdr}).Get(s1 + "/files?path=/tmp/x.txt")
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(got) != "via s1" {
		t.Fatalf("read through s1: %d %q", resp.StatusCode, got)
	}
	// A token is for its sandbox only, on every apiserver.
	bad := processpbconnect.NewProcessClient(&http.Client{Transport: envdHeaders{"E2b-Sandbox-Id": sb.SandboxID, "X-Access-Token": "x" + sb.EnvdAccessToken}}, s1, connect.WithProtoJSON())
	if _, err := bad.List(t.Context(), connect.NewRequest(&processpb.ListRequest{})); connect.CodeOf(err) != connect.CodeUnauthenticated {
		t.Errorf("a wrong token through s1: %v", err)
	}
	kill, _ := http.NewRequest("DELETE", s1+"/sandboxes/"+sb.SandboxID, nil)
	kill.Header.Set("X-API-KEY", adminKey)
	resp, err = http.DefaultClient.Do(kill)
	if err != nil || resp.StatusCode != 204 {
		t.Fatalf("kill through s1: %v %v", err, resp.Status)
	}
	resp.Body.Close()
}

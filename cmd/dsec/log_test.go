package main

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
)

func TestCLISandboxLog(t *testing.T) {
	code, size := 0, int64(2048)
	entries := []api.LogEntry{
		{Seq: 4, Kind: api.LogTruncatedKind, Result: api.LogResult{FirstSeq: 1, LastSeq: 4}},
		{Seq: 5, Kind: api.LogExec, Request: api.LogRequest{Cmd: "echo hi\necho there"}, Result: api.LogResult{ExitCode: &code, DurationMS: 7}},
		{Seq: 6, Kind: api.LogFilesRead, Request: api.LogRequest{Path: "/etc/passwd"}, Result: api.LogResult{Size: &size}},
		{Seq: 7, Kind: api.LogFilesStat, Request: api.LogRequest{Path: "/nope"},
			Result: api.LogResult{Error: &api.ErrorDetail{Code: "not_found", Message: "/nope: no such file"}}},
	}
	var sinces []string
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/sandboxes/{id}/log", func(w http.ResponseWriter, r *http.Request) {
		since := r.URL.Query().Get("since_seq")
		sinces = append(sinces, since)
		page := api.LogPage{Entries: []api.LogEntry{}}
		if since == "3" {
			page = api.LogPage{Entries: entries, NextSeq: 7}
		} else {
			page.NextSeq = 7
		}
		for i := range page.Entries {
			page.Entries[i].Time = time.Now()
		}
		jsonReply(w, 200, page)
	})
	out, err := runCLI(t, mux, "sandbox", "log", "--since", "3", "sb-e1-a")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"entries 1..4 dropped", "echo hi echo there", "exit 0, 7ms", "/etc/passwd", "2.0 KiB", "not_found: /nope: no such file"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	if strings.Join(sinces, ",") != "3,7" {
		t.Errorf("since_seq sent %v, want 3 then 7", sinces)
	}
	sinces = nil
	out, err = runCLI(t, mux, "sandbox", "log", "--json", "--since", "3", "sb-e1-a")
	if err != nil {
		t.Fatal(err)
	}
	var got []api.LogEntry
	if err := json.Unmarshal([]byte(out), &got); err != nil || len(got) != 4 || got[3].Result.Error == nil {
		t.Fatalf("json output %q: %v", out, err)
	}
}

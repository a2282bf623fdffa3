package e2e

import (
	"encoding/binary"
	"encoding/json"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
)

// envdToken is the access token of sandbox id, as E2B's connect gives it.
func envdToken(t *testing.T, id string) string {
	t.Helper()
	req, _ := http.NewRequest("POST", "http://"+d.listen+"/v2/sandboxes/"+id+"/connect", strings.NewReader(`{"timeout":300}`))
	req.Header.Set("X-API-KEY", d.key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var sb struct{ EnvdAccessToken string }
	if err := json.NewDecoder(resp.Body).Decode(&sb); err != nil || sb.EnvdAccessToken == "" || resp.StatusCode/100 != 2 {
		t.Fatalf("E2B connect %s: %d %v", id, resp.StatusCode, err)
	}
	return sb.EnvdAccessToken
}

// TestE2BStreamNeverRead starts a process that writes as fast as it can
// on a stream whose client never reads: the daemon's memory must stay
// bounded (the process is held back), and the process still ends at its
// Connect deadline.
func TestE2BStreamNeverRead(t *testing.T) {
	needDaemon(t)
	sb := newSandbox(t, api.SandboxSpec{})
	tok := envdToken(t, sb.ID)
	msg, _ := json.Marshal(map[string]any{"process": map[string]any{"cmd": "/bin/sh", "args": []string{"-c", "cat /dev/zero"}}})
	frame := make([]byte, 5+len(msg))
	binary.BigEndian.PutUint32(frame[1:5], uint32(len(msg)))
	copy(frame[5:], msg)
	conn, err := net.Dial("tcp", d.listen)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// A tiny receive buffer, never read: TCP backs up to the daemon.
	conn.(*net.TCPConn).SetReadBuffer(4096)
	req := "POST /process.Process/Start HTTP/1.1\r\nHost: " + d.listen + "\r\nContent-Type: application/connect+json\r\n" +
		"Connect-Protocol-Version: 1\r\nConnect-Timeout-Ms: 8000\r\nE2b-Sandbox-Id: " + sb.ID + "\r\nX-Access-Token: " + tok +
		"\r\nContent-Length: " + strconv.Itoa(len(frame)) + "\r\n\r\n"
	if _, err := conn.Write(append([]byte(req), frame...)); err != nil {
		t.Fatal(err)
	}
	before := daemonRSS(t)
	peak := before
	for range 25 {
		time.Sleep(200 * time.Millisecond)
		peak = max(peak, daemonRSS(t))
	}
	if grew := peak - before; grew > 64<<20 {
		t.Errorf("daemon RSS grew by %d KiB while a stream was not read (from %d KiB)", grew>>10, before>>10)
	}
	// The deadline kills the process whether or not anyone reads.
	deadline := time.Now().Add(20 * time.Second)
	for {
		res := sh(t, sb.ID, "ps -o args | grep -c '^cat /dev/zero' || true")
		if strings.TrimSpace(res.Stdout) == "0" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("cat /dev/zero outlived its Connect deadline: %s", sh(t, sb.ID, "ps -o pid,args").Stdout)
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Logf("daemon RSS %d KiB before, %d KiB at most while the stream was not read", before>>10, peak>>10)
}

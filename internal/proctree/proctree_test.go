package proctree

import (
	"os"
	"os/exec"
	"testing"
	"time"
)

func TestKillTreeKillsGrandchildren(t *testing.T) {
	cmd := exec.Command("/bin/sh", "-c", "sleep 100 & sh -c 'sleep 100 & wait' & wait")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	var before []int
	for time.Now().Before(deadline) {
		before = Descendants(cmd.Process.Pid)
		if len(before) >= 3 {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if len(before) < 2 {
		t.Fatalf("descendants = %v, want at least 2", before)
	}
	Kill(cmd.Process.Pid, true)
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("root did not exit")
	}
	for _, p := range before {
		// A killed child is a zombie until reaped by its parent; gone or
		// zombie are both fine, running is not.
		var b []byte
		var err error
		for i := 0; i < 1000; i++ {
			b, err = os.ReadFile("/proc/" + itoa(p) + "/stat")
			if err != nil || containsState(string(b), 'Z') {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		if err == nil && !containsState(string(b), 'Z') {
			t.Errorf("pid %d still alive: %s", p, b)
		}
	}
}

func TestNSPidOfSelf(t *testing.T) {
	n, ok := NSPid(os.Getpid())
	if !ok || n <= 0 {
		t.Fatalf("NSPid(self) = %d, %v", n, ok)
	}
}

func itoa(n int) string { return fmtInt(n) }

func fmtInt(n int) string {
	if n == 0 {
		return "0"
	}
	var b []byte
	for n > 0 {
		b = append([]byte{byte('0' + n%10)}, b...)
		n /= 10
	}
	return string(b)
}

func containsState(stat string, st byte) bool {
	// state is the field after the ")" that closes comm.
	for i := len(stat) - 1; i >= 0; i-- {
		if stat[i] == ')' && i+2 < len(stat) {
			return stat[i+2] == st
		}
	}
	return false
}

package remote

import (
	"net"
	"os"
	"path/filepath"
	"testing"
)

// TestExitingDaemonKeepsItsSuccessorsSocket: a daemon that exits removes
// its control socket, but not the one a daemon that replaced it made at
// the same path (which would leave that one running and unreachable).
func TestExitingDaemonKeepsItsSuccessorsSocket(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ctl.sock")
	old, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	unlinkOld := ownSocket(old, path)
	// The successor takes the path over, as a starting daemon does.
	os.Remove(path)
	next, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	unlinkNext := ownSocket(next, path)
	old.Close()
	unlinkOld()
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatalf("the successor's socket went with the old daemon: %v", err)
	}
	c.Close()
	next.Close()
	unlinkNext()
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Fatalf("a daemon's own socket stayed after it exited: %v", err)
	}
}

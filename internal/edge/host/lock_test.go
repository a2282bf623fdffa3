package host

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestLockStateDir: one holder per state directory; the next is refused,
// naming the holder, until the first lets go.
func TestLockStateDir(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "state")
	release, err := LockStateDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "lock")); strings.TrimSpace(string(b)) != fmt.Sprint(os.Getpid()) {
		t.Fatalf("lock file holds %q", b)
	}
	_, err = LockStateDir(dir)
	if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("in use by process %d", os.Getpid())) {
		t.Fatalf("a second lock: %v", err)
	}
	release()
	release, err = LockStateDir(dir)
	if err != nil {
		t.Fatalf("after the release: %v", err)
	}
	release()
	if _, err := LockStateDir(filepath.Join(dir, "lock", "below-a-file")); err == nil {
		t.Fatal("locked a state directory that cannot be made")
	}
}

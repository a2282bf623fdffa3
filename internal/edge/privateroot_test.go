package edge

import (
	"context"
	"errors"
	"os"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// statusBackend answers Status with a fixed pid; nothing else is used.
type statusBackend struct {
	sandbox.Backend
	pid int
}

func (b statusBackend) Status(context.Context, string) (sandbox.Status, error) {
	return sandbox.Status{Running: true, Pid: b.pid}, nil
}

// TestOpenPrivateRootRefusesANonOverlayRoot: if the runtime's answer
// points at a process that is not the sandbox's init (a reused pid, whose
// root is the host's "/"), the root is refused rather than handed to the
// files API.
func TestOpenPrivateRootRefusesANonOverlayRoot(t *testing.T) {
	var fs unix.Statfs_t
	if err := unix.Statfs("/", &fs); err != nil || fs.Type == unix.OVERLAYFS_SUPER_MAGIC {
		t.Skip("this host's own root is an overlay: the test cannot tell it from a sandbox's")
	}
	e := &Edge{deps: Deps{Backend: statusBackend{pid: os.Getpid()}}}
	r, err := e.openPrivateRoot(e.deps.Backend, "sb-test")
	if err == nil {
		r.Close()
		t.Fatal("opened the root of a process that is not a sandbox's init")
	}
	if !errors.Is(err, errdefs.ErrPrecondition) {
		t.Fatalf("err %v, want failed_precondition", err)
	}
}

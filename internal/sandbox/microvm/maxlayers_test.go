package microvm

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// A stack deeper than the guest's disks is refused before anything is
// made, with what to do about it.
func TestCreateRefusesMoreLayersThanDisks(t *testing.T) {
	state := t.TempDir()
	b := &Backend{cfg: Config{StateRoot: state}}
	images := make([]string, MaxLayers+1)
	for i := range images {
		images[i] = filepath.Join(state, "layer.erofs")
	}
	err := b.Create(context.Background(), sandbox.Config{ID: "sb-x", Images: images, Upper: t.TempDir()})
	if !errors.Is(err, errdefs.ErrPrecondition) {
		t.Fatalf("create with %d layers: %v", len(images), err)
	}
	if _, err := os.Stat(filepath.Join(state, "vm")); !os.IsNotExist(err) {
		t.Errorf("a refused create left %s: %v", filepath.Join(state, "vm"), err)
	}
}

package edge

import (
	"errors"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// TestTenancyAdmission: a node holds one tenancy at a time, a dedicated
// project's or the shared one, and is free for any once empty.
func TestTenancyAdmission(t *testing.T) {
	e := &Edge{}
	e.cfg.Name = "n1"
	step := func(d string, ok bool) {
		t.Helper()
		err := e.tenancyAdmitLocked(d)
		if ok && err != nil || !ok && !errors.Is(err, errdefs.ErrExhausted) {
			t.Fatalf("admit %q with %v: %v, want ok=%v", d, e.tenancy, err, ok)
		}
	}
	step("", true)
	step("", true)
	step("root/a", false) // shared sandboxes here
	e.tenancyAddLocked("", -2)
	step("root/a", true) // empty: a dedicated project may take it
	step("root/a", true)
	step("", false)
	step("root/b", false)
	// The refusal reaches root/b's caller: it names no other project.
	if err := e.tenancyAdmitLocked("root/b"); err == nil || strings.Contains(err.Error(), "root/a") {
		t.Fatalf("refusal %v", err)
	}
	if err := e.tenancyAdmitLocked(""); err == nil || strings.Contains(err.Error(), "root/a") {
		t.Fatalf("refusal %v", err)
	}
	if got := e.dedicatedToLocked(); got != "root/a" {
		t.Fatalf("dedicated to %q", got)
	}
	e.tenancyAddLocked("root/a", -2)
	if got := e.dedicatedToLocked(); got != "" || len(e.tenancy) != 0 {
		t.Fatalf("after the last one left: %q, %v", got, e.tenancy)
	}
	step("root/b", true)
}

package netpolicy

import (
	"errors"
	"fmt"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

func TestLinkGone(t *testing.T) {
	for _, tc := range []struct {
		err  error
		gone bool
	}{
		{netlink.LinkNotFoundError{}, true},
		{unix.ENODEV, true}, // LinkDel of a veth the kernel removed meanwhile
		{fmt.Errorf("wrapped: %w", unix.ENODEV), true},
		{unix.EPERM, false},
		{errors.New("no such device"), false},
	} {
		if got := linkGone(tc.err); got != tc.gone {
			t.Errorf("linkGone(%v) = %v, want %v", tc.err, got, tc.gone)
		}
	}
}

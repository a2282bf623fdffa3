//go:build linux && cgo

package layer

/*
#include "idmapns.h"
*/
import "C"

import (
	"fmt"
	"os"
	"syscall"
)

// NewIDMapNS returns an open user namespace file with mapping m (uids and
// gids alike), for idmapped mounts, made by a short-lived task that shares
// this process's memory (idmapns.c): no program is started.
func NewIDMapNS(m IDMap) (*os.File, error) {
	if m.Size == 0 {
		return nil, fmt.Errorf("creating id-mapping namespace: empty mapping")
	}
	fd := C.dsec_idmap_ns(C.uint(m.HostID), C.uint(m.Size))
	if fd < 0 {
		return nil, fmt.Errorf("creating id-mapping namespace: %w", syscall.Errno(-fd))
	}
	return os.NewFile(uintptr(fd), "userns"), nil
}

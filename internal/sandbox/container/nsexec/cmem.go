//go:build linux && cgo

package nsexec

/*
#include <stdlib.h>
*/
import "C"

import "unsafe"

// cAlloc is C memory freed in one go: what the launchers' vfork'd children
// read (cgo forbids handing them Go memory that holds pointers).
type cAlloc []unsafe.Pointer

func (a *cAlloc) alloc(n C.size_t) unsafe.Pointer {
	p := C.calloc(1, n)
	if p == nil {
		panic("sandbox launcher: out of memory")
	}
	*a = append(*a, p)
	return p
}

func (a *cAlloc) str(s string) *C.char {
	p := C.CString(s)
	*a = append(*a, unsafe.Pointer(p))
	return p
}

func (a *cAlloc) strs(ss []string) **C.char {
	arr := unsafe.Slice((**C.char)(a.alloc(C.size_t(len(ss)+1)*C.size_t(unsafe.Sizeof((*C.char)(nil))))), len(ss)+1)
	for i, s := range ss {
		arr[i] = a.str(s)
	}
	return &arr[0]
}

func (a *cAlloc) free() {
	for _, p := range *a {
		C.free(p)
	}
}

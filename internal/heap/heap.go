// Package heap gives the daemon's free heap memory back to the OS soon
// after a large response. Go's runtime returns freed memory slowly (its
// scavenger releases a little at a time, and an idle daemon may not
// collect garbage for two minutes), so a burst of large command outputs
// left the daemon's RSS at its peak for minutes. Callers that have just
// let go of a large buffer call Released; the package coalesces the
// calls and forces a collection and a release a moment later, off the
// request path. The Go heap is the process's, so the state here is too.
package heap

import (
	"runtime/debug"
	"sync"
	"time"
)

// Large is the size from which a buffer is worth a Released call.
const Large = 8 << 20

// settle is how long after the last Released call the release runs: the
// response that held the buffer has usually been written by then.
const settle = time.Second

var (
	mu    sync.Mutex
	timer *time.Timer
)

// Released notes that n bytes of buffers were just let go of; for n of at
// least Large, the heap's free memory goes back to the OS within about a
// second of the last such call.
func Released(n int64) {
	if n < Large {
		return
	}
	mu.Lock()
	defer mu.Unlock()
	if timer == nil {
		timer = time.AfterFunc(settle, debug.FreeOSMemory)
		return
	}
	timer.Reset(settle)
}

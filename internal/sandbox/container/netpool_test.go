package container

import (
	"log/slog"
	"net"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func nsIno(t *testing.T, f *os.File) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

// linksIn lists the interfaces of the network namespace f, and whether
// each is up, from a thread moved into it (and back).
func linksIn(t *testing.T, f *os.File) map[string]bool {
	t.Helper()
	type result struct {
		links map[string]bool
		err   error
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with the goroutine
		if err := unix.Setns(int(f.Fd()), unix.CLONE_NEWNET); err != nil {
			ch <- result{nil, err}
			return
		}
		ifs, err := net.Interfaces()
		links := map[string]bool{}
		for _, i := range ifs {
			links[i.Name] = i.Flags&net.FlagUp != 0
		}
		ch <- result{links, err}
	}()
	r := <-ch
	if r.err != nil {
		t.Fatal(r.err)
	}
	return r.links
}

func waitFree(t *testing.T, p *netnsPool, n int) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); p.Free() != n; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("pool has %d namespaces after 10 s, want %d", p.Free(), n)
		}
	}
}

// TestNetnsPool: the pool hands out distinct fresh namespaces, not the
// host's, with lo up and nothing else; it hands none out twice, holds
// back while busy, refills with new ones once quiet, replaces those that
// waited too long, keeps none in the process's fd table, and close lets go
// of the rest.
func TestNetnsPool(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: makes network namespaces")
	}
	host, err := os.Open("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	defer host.Close()
	seen := map[uint64]bool{nsIno(t, host): true}
	var taken []*os.File
	defer func() {
		for _, f := range taken {
			f.Close()
		}
	}()
	fdsBefore := netnsFds(t)

	// Busy for an hour: no refill after the first fill.
	p := newTestPool(t, 3, time.Hour, time.Hour)
	waitFree(t, p, 3)
	// The filler's handle on the host's namespace, and nothing else: the
	// pooled ones wait in flight on the socket.
	if n := netnsFds(t) - fdsBefore; n != 1 {
		t.Errorf("a full pool of 3 holds %d namespace fds in the process's table, want 1", n)
	}
	for range 3 {
		f := p.take()
		if f == nil {
			t.Fatal("take from a full pool gave nothing")
		}
		taken = append(taken, f)
		ino := nsIno(t, f)
		if seen[ino] {
			t.Fatalf("namespace %d handed out twice, or the host's", ino)
		}
		seen[ino] = true
		if links := linksIn(t, f); len(links) != 1 || !links["lo"] {
			t.Errorf("pooled namespace has links %v, want lo up only", links)
		}
	}
	if f := p.take(); f != nil {
		f.Close()
		t.Fatal("take from an empty pool gave a namespace")
	}
	time.Sleep(300 * time.Millisecond)
	if n := p.Free(); n != 0 {
		t.Errorf("pool refilled %d while busy", n)
	}
	p.close()
	p.close() // twice is fine

	// Quiet after 20 ms: refills with namespaces never handed out (the
	// taken ones are still open, so their inodes cannot be reused).
	p = newTestPool(t, 2, 20*time.Millisecond, time.Hour)
	waitFree(t, p, 2)
	for range 2 {
		f := p.take()
		taken = append(taken, f)
		seen[nsIno(t, f)] = true
	}
	waitFree(t, p, 2)
	for range 2 {
		f := p.take()
		if seen[nsIno(t, f)] {
			t.Errorf("refill handed out namespace %d again", nsIno(t, f))
		}
		seen[nsIno(t, f)] = true
		taken = append(taken, f)
	}
	waitFree(t, p, 2)
	p.close()
	if p.Free() != 0 {
		t.Errorf("after close: %d free", p.Free())
	}
	if n := netnsFds(t) - fdsBefore - len(taken); n != 0 {
		t.Errorf("%d namespace fds left after close", n)
	}

	// Aged out after a second: the filler replaces them. Polled, not
	// timed: on a loaded host a new namespace can take a while (the kernel
	// tears old ones down under the same lock).
	p = newTestPool(t, 2, 10*time.Millisecond, time.Second)
	waitFree(t, p, 2)
	full := time.Now()
	for deadline := full.Add(20 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if p.Free() == 2 && p.oldest() < time.Since(full) {
			break // every pooled namespace was made after the pool was full
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 20 s the oldest pooled namespace is %s old, want replaced after 1s", p.oldest())
		}
	}
	p.close()

	// A take never hands out one older than the limit, even when the
	// filler has not replaced it yet.
	p = newTestPool(t, 1, time.Hour, time.Hour)
	waitFree(t, p, 1)
	p.mu.Lock()
	p.born[0] = time.Now().Add(-2 * time.Hour)
	p.mu.Unlock()
	if f := p.take(); f != nil {
		f.Close()
		t.Error("take handed out a namespace older than the pool's limit")
	}
	if n := p.Free(); n != 0 {
		t.Errorf("the aged namespace is still pooled: %d free", n)
	}
}

func newTestPool(t *testing.T, size int, quiet, maxAge time.Duration) *netnsPool {
	t.Helper()
	p, err := startNetnsPool(size, quiet, maxAge, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.close)
	return p
}

// put sends f (which it closes) back into the pool, as the filler would.
func (p *netnsPool) put(t *testing.T, f *os.File) {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := unix.Sendmsg(p.send, []byte{0}, unix.UnixRights(int(f.Fd())), nil, unix.MSG_DONTWAIT); err != nil {
		t.Fatal(err)
	}
	p.born = append(p.born, time.Now())
	f.Close()
}

// netnsFds counts this process's open fds of network namespaces.
func netnsFds(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		if l, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && strings.HasPrefix(l, "net:[") {
			n++
		}
	}
	return n
}

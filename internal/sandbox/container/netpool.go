package container

import (
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// A netnsPool keeps fresh network namespaces for the launcher, so that a
// create joins one (setns) instead of making one (CLONE_NEWNET): creating
// a network namespace runs every network subsystem's per-namespace setup
// under shared locks, and was the largest single item (11%) of a burst's
// create CPU. One goroutine, on an OS thread of its own at nice 10, makes
// them while the pool is below its size and the backend has been quiet (no
// create took one, no destroy ran) for netnsQuiet: refilling during a
// burst only moved the same work from the creates to the filler
// (measured: a pool of 1,024 stayed full through a burst of 1,000 and the
// burst was no faster), refilling during the deletes that followed slowed
// them by 10%, and a namespace's setup takes locks (rtnl) that creates and
// deletes need too. A create finding
// the pool empty makes its namespace itself, as without a pool.
//
// A namespace from the pool is fresh: only the filler's thread was ever in
// it (to make it and bring lo up), and it goes to exactly one sandbox,
// whose init holds it from then on; the pool closes its fd once the launch
// is over. The kernel memory of the namespace's setup (~150 KiB) is
// charged to the edge's memory cgroup, not the sandbox's.
type netnsPool struct {
	free chan *os.File
	kick chan struct{}
	stop chan struct{}
	done chan struct{}
	once sync.Once
	log  *slog.Logger
	// quiet is netnsQuiet (tests shorten or lengthen it).
	quiet time.Duration
	// lastBusy is when a create last took a namespace or a destroy ran
	// (UnixNano).
	lastBusy atomic.Int64
	// err is why the filler stopped early (nil while it runs or after
	// close).
	mu  sync.Mutex
	err error
}

// netnsQuiet is how long the backend must have been quiet before the
// filler makes more.
const netnsQuiet = 200 * time.Millisecond

// newNetnsPool starts a pool of size namespaces.
func newNetnsPool(size int, log *slog.Logger) *netnsPool {
	return startNetnsPool(size, netnsQuiet, log)
}

func startNetnsPool(size int, quiet time.Duration, log *slog.Logger) *netnsPool {
	p := &netnsPool{
		quiet: quiet,
		log:   log,
		free:  make(chan *os.File, size),
		kick:  make(chan struct{}, 1),
		stop:  make(chan struct{}),
		done:  make(chan struct{}),
	}
	go p.fill()
	return p
}

// take returns a fresh namespace (the caller closes it once init holds
// it), or nil when the pool is empty.
func (p *netnsPool) take() *os.File {
	select {
	case f := <-p.free:
		p.busy()
		select {
		case p.kick <- struct{}{}:
		default:
		}
		return f
	default:
		return nil
	}
}

// busy holds the filler back for p.quiet.
func (p *netnsPool) busy() { p.lastBusy.Store(time.Now().UnixNano()) }

// Free is how many namespaces are ready.
func (p *netnsPool) Free() int { return len(p.free) }

// Err says why the pool stopped filling, if it did.
func (p *netnsPool) Err() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

// close stops the filler and lets go of the namespaces not taken.
func (p *netnsPool) close() {
	p.once.Do(func() { close(p.stop) })
	<-p.done
	for {
		select {
		case f := <-p.free:
			f.Close()
		default:
			return
		}
	}
}

// fill makes namespaces until the pool is full, then waits for a take.
// The thread is never unlocked: had a setns back failed, it would end
// with the goroutine rather than run other goroutines in a sandbox's
// namespace.
func (p *netnsPool) fill() {
	defer close(p.done)
	runtime.LockOSThread()
	_ = unix.Setpriority(unix.PRIO_PROCESS, unix.Gettid(), 10)
	home, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		p.fail(err)
		return
	}
	defer home.Close()
	for {
		for len(p.free) < cap(p.free) {
			if wait := p.quiet - time.Since(time.Unix(0, p.lastBusy.Load())); wait > 0 {
				select {
				case <-p.stop:
					return
				case <-time.After(wait):
				}
				continue
			}
			select {
			case <-p.stop:
				return
			default:
			}
			f, err := freshNetns(home)
			if err != nil {
				p.fail(err)
				return
			}
			select {
			case p.free <- f:
			default:
				f.Close()
			}
		}
		select {
		case <-p.stop:
			return
		case <-p.kick:
		}
	}
}

func (p *netnsPool) fail(err error) {
	p.log.Warn("netns pool stopped: creates make their own network namespaces", "err", err)
	p.mu.Lock()
	p.err = err
	p.mu.Unlock()
}

// freshNetns moves the calling (locked) thread into a new network
// namespace, brings its lo up, opens it and moves the thread back home.
// An error leaves the thread wherever it is: the caller must not unlock
// it.
func freshNetns(home *os.File) (*os.File, error) {
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		return nil, fmt.Errorf("netns pool: unshare(CLONE_NEWNET): %w", err)
	}
	f, err := os.Open("/proc/thread-self/ns/net")
	if err == nil {
		err = loopbackUp()
	}
	if serr := unix.Setns(int(home.Fd()), unix.CLONE_NEWNET); serr != nil {
		if f != nil {
			f.Close()
		}
		return nil, fmt.Errorf("netns pool: back to the host's namespace: %w", serr)
	}
	if err != nil {
		if f != nil {
			f.Close()
		}
		return nil, fmt.Errorf("netns pool: %w", err)
	}
	return f, nil
}

// loopbackUp brings lo up in the calling thread's network namespace.
func loopbackUp() error {
	s, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("socket for lo: %w", err)
	}
	defer unix.Close(s)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(s, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("reading lo flags: %w", err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(s, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("bringing up lo: %w", err)
	}
	return nil
}

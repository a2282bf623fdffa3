package container

import (
	"errors"
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
// create CPU.
//
// Refilling: one goroutine, on an OS thread of its own at nice 10, makes
// them while the pool is below its size and the backend has been quiet (no
// create took one, no destroy ran) for netnsQuiet. Refilling during a
// burst only moved the same work from the creates to the filler
// (measured: a pool of 1,024 stayed full through a burst of 1,000 and the
// burst was no faster); refilling during the deletes that followed slowed
// them by 10%; and a namespace's setup takes locks (rtnl) that creates and
// deletes need too. A create finding the pool empty makes its namespace
// itself, as without a pool. The filler also replaces namespaces older
// than netnsMaxAge: a new namespace copies some of the host's settings
// (IPv4 conf/all and conf/default) when it is made, and a pooled one must
// not miss a change made since by much.
//
// Where they wait: as file descriptors in flight on a Unix socket pair
// (SCM_RIGHTS), not in the edge's fd table. An init starts with a copy of
// the edge's fd table, which keeps the size the highest fd gave it for
// the sandbox's whole life: 1,024 pooled fds made every init's table
// 2,048 slots (~14 KiB of kernel memory per sandbox) instead of 256.
//
// A namespace from the pool is fresh: only the filler's thread was ever in
// it (to make it and bring lo up), and it goes to exactly one sandbox,
// whose init holds it from then on; the launch closes its fd once it is
// over. The kernel memory of the namespace (~150 KiB) is charged to the
// edge's memory cgroup, as it is when the launcher makes one.
type netnsPool struct {
	size   int
	quiet  time.Duration // netnsQuiet (tests change it)
	maxAge time.Duration // netnsMaxAge (tests change it)
	log    *slog.Logger

	// send and recv are the two ends of a SOCK_SEQPACKET pair: the
	// filler sends each namespace on send, a take receives one from recv
	// (without waiting).
	send, recv int
	// mu orders sends and receives with born, the namespaces' creation
	// times in the order they were sent (the socket's order): oldest
	// first.
	mu   sync.Mutex
	born []time.Time

	kick chan struct{}
	stop chan struct{}
	done chan struct{}
	once sync.Once
	// lastBusy is when a create last took a namespace or a destroy ran
	// (UnixNano).
	lastBusy atomic.Int64
}

const (
	// netnsQuiet is how long the backend must have been quiet before the
	// filler makes more.
	netnsQuiet = 200 * time.Millisecond
	// netnsMaxAge is how long a namespace may wait in the pool.
	netnsMaxAge = 10 * time.Minute
	// netnsRetry bounds the wait after the filler failed to make one.
	netnsRetryMax = time.Minute
)

// newNetnsPool starts a pool of size namespaces.
func newNetnsPool(size int, log *slog.Logger) (*netnsPool, error) {
	return startNetnsPool(size, netnsQuiet, netnsMaxAge, log)
}

func startNetnsPool(size int, quiet, maxAge time.Duration, log *slog.Logger) (*netnsPool, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("netns pool: socketpair: %w", err)
	}
	// Each namespace in flight takes about a kilobyte of the sender's
	// buffer; past the buffer a send fails (EAGAIN) and the pool counts
	// as full.
	_ = unix.SetsockoptInt(fds[0], unix.SOL_SOCKET, unix.SO_SNDBUFFORCE, max(1<<20, size<<11))
	p := &netnsPool{
		size: size, quiet: quiet, maxAge: maxAge, log: log,
		send: fds[0], recv: fds[1],
		kick: make(chan struct{}, 1),
		stop: make(chan struct{}),
		done: make(chan struct{}),
	}
	go p.fill()
	return p, nil
}

// take returns a fresh namespace (the caller closes it once init holds
// it), or nil when the pool has none.
func (p *netnsPool) take() *os.File {
	p.busy()
	defer func() {
		select {
		case p.kick <- struct{}{}:
		default:
		}
	}()
	p.mu.Lock()
	defer p.mu.Unlock()
	for len(p.born) > 0 {
		fd, err := p.receive()
		if err != nil {
			if !errors.Is(err, unix.EAGAIN) {
				p.log.Warn("netns pool: receiving a namespace", "err", err)
			}
			return nil
		}
		born := p.born[0]
		p.born = p.born[1:]
		if time.Since(born) > p.maxAge {
			unix.Close(fd)
			continue
		}
		return os.NewFile(uintptr(fd), "netns")
	}
	return nil
}

// receive takes the next namespace off the socket (p.mu held).
func (p *netnsPool) receive() (int, error) {
	buf := make([]byte, 1)
	oob := make([]byte, unix.CmsgSpace(4))
	_, oobn, _, _, err := unix.Recvmsg(p.recv, buf, oob, unix.MSG_DONTWAIT|unix.MSG_CMSG_CLOEXEC)
	if err != nil {
		return -1, err
	}
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil || len(msgs) != 1 {
		return -1, fmt.Errorf("no namespace in the message (%v)", err)
	}
	fds, err := unix.ParseUnixRights(&msgs[0])
	if err != nil || len(fds) != 1 {
		for _, fd := range fds {
			unix.Close(fd)
		}
		return -1, fmt.Errorf("want one namespace in the message, got %d (%v)", len(fds), err)
	}
	return fds[0], nil
}

// busy holds the filler back for p.quiet.
func (p *netnsPool) busy() { p.lastBusy.Store(time.Now().UnixNano()) }

// Free is how many namespaces are ready.
func (p *netnsPool) Free() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.born)
}

// oldest is the age of the oldest namespace in the pool (0: none).
func (p *netnsPool) oldest() time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.born) == 0 {
		return 0
	}
	return time.Since(p.born[0])
}

// close stops the filler and lets go of the namespaces not taken (closing
// the socket drops what is in flight on it). It may be called twice.
func (p *netnsPool) close() {
	p.once.Do(func() {
		close(p.stop)
		<-p.done
		p.mu.Lock()
		unix.Close(p.send)
		unix.Close(p.recv)
		p.born = nil
		p.mu.Unlock()
	})
}

// fill makes namespaces until the pool is full, then waits for a take or
// for the oldest to age out. The thread is never unlocked: had a setns
// back failed, it would end with the goroutine rather than run other
// goroutines in a sandbox's namespace (a new filler then takes over).
func (p *netnsPool) fill() {
	runtime.LockOSThread()
	_ = unix.Setpriority(unix.PRIO_PROCESS, unix.Gettid(), 10)
	handedOver := false
	defer func() {
		if !handedOver {
			close(p.done)
		}
	}()
	home, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		p.log.Warn("netns pool stopped: creates make their own network namespaces", "err", err)
		return
	}
	defer unix.Close(home)
	retry := time.Second
	for {
		// Wait to be quiet, and for room or an aged namespace.
		for {
			wait := p.quiet - time.Since(time.Unix(0, p.lastBusy.Load()))
			if wait <= 0 {
				if p.Free() < p.size {
					break
				}
				if age := p.oldest(); age > p.maxAge {
					p.dropOldest()
					continue
				} else {
					wait = p.maxAge - age + p.maxAge/100
				}
			}
			select {
			case <-p.stop:
				return
			case <-p.kick:
			case <-time.After(wait):
			}
		}
		stranded, err := p.makeOne(home)
		switch {
		case stranded:
			// This thread may be in the namespace it made: end it here,
			// with the goroutine, and carry on from a new one.
			p.log.Warn("netns pool: filler thread retired", "err", err)
			handedOver = true
			go p.fill()
			return
		case err != nil:
			p.log.Warn("netns pool: making a namespace failed; creates make their own meanwhile", "err", err, "retry_in", retry)
			select {
			case <-p.stop:
				return
			case <-time.After(retry):
			}
			retry = min(2*retry, netnsRetryMax)
		default:
			retry = time.Second
		}
	}
}

// dropOldest closes the pool's oldest namespace.
func (p *netnsPool) dropOldest() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.born) == 0 {
		return
	}
	if fd, err := p.receive(); err == nil {
		unix.Close(fd)
	}
	p.born = p.born[1:]
}

// makeOne makes a namespace on the calling (locked) thread and sends it
// into the pool. stranded: the thread could not go back to the host's
// namespace, so the caller must not unlock it.
func (p *netnsPool) makeOne(home int) (stranded bool, err error) {
	fd, err := freshNetns(home)
	if fd < 0 {
		return err != nil && errors.Is(err, errStranded), err
	}
	rights := unix.UnixRights(fd)
	p.mu.Lock()
	defer p.mu.Unlock()
	// Closed before the namespace is counted: once it is in flight, the
	// socket holds it, and the process's fd table should not.
	err = unix.Sendmsg(p.send, []byte{0}, rights, nil, unix.MSG_DONTWAIT)
	unix.Close(fd)
	if err != nil {
		if errors.Is(err, unix.EAGAIN) {
			// The socket's buffer is full: so is the pool, for now.
			p.size = len(p.born)
			return false, nil
		}
		return false, fmt.Errorf("netns pool: sending a namespace: %w", err)
	}
	p.born = append(p.born, time.Now())
	return false, nil
}

var errStranded = errors.New("thread left outside the host's network namespace")

// freshNetns moves the calling (locked) thread into a new network
// namespace, brings its lo up, opens it and moves the thread back home.
// It returns the namespace's fd, or -1 and an error (errStranded when the
// thread may not be home).
func freshNetns(home int) (int, error) {
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		return -1, fmt.Errorf("netns pool: unshare(CLONE_NEWNET): %w", err)
	}
	fd, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err == nil {
		err = loopbackUp()
	}

	if serr := unix.Setns(home, unix.CLONE_NEWNET); serr != nil {
		if fd >= 0 {
			unix.Close(fd)
		}
		return -1, fmt.Errorf("netns pool: %w: %w", errStranded, serr)
	}
	if err != nil {
		if fd >= 0 {
			unix.Close(fd)
		}
		return -1, fmt.Errorf("netns pool: %w", err)
	}
	return fd, nil
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

package apiserver

import (
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// Failed authentication is rate limited per source address: each address
// has a bucket of authFailBurst failures, refilled at authFailRate per
// second; while it is empty, requests from the address are refused
// without their key being looked at, so guessing goes no faster than the
// refill. A known key from the same address is refused too until the
// bucket refills (seconds): the price of not telling a guesser which
// guess was right. Addresses are the TCP peer's (a proxy in front makes
// them one; X-Forwarded-For is not trusted).
const (
	authFailBurst = 30
	authFailRate  = 1.0 // per second
	// authMaxTracked bounds the addresses remembered; full buckets are
	// forgotten first.
	authMaxTracked = 16384
)

type authLimiter struct {
	mu  sync.Mutex
	now func() time.Time
	m   map[string]*authBucket
}

type authBucket struct {
	tokens float64
	at     time.Time
}

func newAuthLimiter() *authLimiter {
	return &authLimiter{now: time.Now, m: map[string]*authBucket{}}
}

// level refills b to now and returns its tokens.
func (l *authLimiter) level(b *authBucket, now time.Time) float64 {
	b.tokens += now.Sub(b.at).Seconds() * authFailRate
	if b.tokens > authFailBurst {
		b.tokens = authFailBurst
	}
	b.at = now
	return b.tokens
}

// wait reports how long addr must wait before its next attempt (0: it may
// try now).
func (l *authLimiter) wait(addr string) time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	b := l.m[addr]
	if b == nil {
		return 0
	}
	t := l.level(b, l.now())
	if t >= 1 {
		return 0
	}
	return time.Duration((1 - t) / authFailRate * float64(time.Second))
}

// fail charges addr one failed authentication.
func (l *authLimiter) fail(addr string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.now()
	b := l.m[addr]
	if b == nil {
		if len(l.m) >= authMaxTracked {
			l.forgetFull(now)
		}
		b = &authBucket{tokens: authFailBurst, at: now}
		l.m[addr] = b
	}
	l.level(b, now)
	b.tokens--
}

// forgetFull drops the addresses whose bucket has refilled; if none has,
// an arbitrary half (the map cannot grow without bound under a flood of
// addresses).
func (l *authLimiter) forgetFull(now time.Time) {
	for a, b := range l.m {
		if l.level(b, now) >= authFailBurst {
			delete(l.m, a)
		}
	}
	if len(l.m) < authMaxTracked {
		return
	}
	n := 0
	for a := range l.m {
		if n%2 == 0 {
			delete(l.m, a)
		}
		n++
	}
}

// peer is the address authentication is limited by.
func peer(r *http.Request) string {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return r.RemoteAddr
	}
	return host
}

func retryAfter(d time.Duration) string {
	s := int(d.Seconds() + 0.999)
	if s < 1 {
		s = 1
	}
	return strconv.Itoa(s)
}

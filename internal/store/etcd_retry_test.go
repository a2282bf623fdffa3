package store

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// The client hands the server's own errors back as rpctypes.EtcdError, not
// as gRPC statuses: a retry that looked only at status codes would give up
// on "leader changed" and "request timed out", the errors of a failover.
func TestAgainRetriesServerErrorsOfAFailover(t *testing.T) {
	for _, failover := range []error{rpctypes.ErrLeaderChanged, rpctypes.ErrTimeout, rpctypes.ErrNoLeader,
		rpctypes.ErrTimeoutDueToLeaderFail, status.Error(codes.Unavailable, "connection reset")} {
		n := 0
		v, err := again(context.Background(), time.Second, func(context.Context) (int, error) {
			n++
			if n < 3 {
				return 0, failover
			}
			return 7, nil
		})
		if err != nil || v != 7 || n != 3 {
			t.Errorf("%v twice, then success: got %d, %v after %d tries; want 7 after 3", failover, v, err, n)
		}
		if !maybeApplied(context.Background(), failover) {
			t.Errorf("a write that failed with %v is not taken as maybe applied", failover)
		}
	}
	// Not the store's fault: no retry.
	for _, final := range []error{rpctypes.ErrCompacted, rpctypes.ErrRequestTooLarge, errors.New("boom")} {
		n := 0
		_, err := again(context.Background(), time.Second, func(context.Context) (int, error) { n++; return 0, final })
		if n != 1 || !errors.Is(err, final) {
			t.Errorf("%v: %d tries (%v), want 1", final, n, err)
		}
	}
	// A try that hangs is given up after its share and made again.
	n := 0
	start := time.Now()
	_, err := again(context.Background(), 100*time.Millisecond, func(ctx context.Context) (int, error) {
		n++
		if n == 1 {
			<-ctx.Done()
			return 0, ctx.Err()
		}
		return 1, nil
	})
	if err != nil || n != 2 || time.Since(start) > time.Second {
		t.Errorf("a hung try: %v after %d tries and %v, want success after 2", err, n, time.Since(start))
	}
	// The member gives up under the deadline the call carries and says so
	// a moment before the try's own context expires: a hung try all the
	// same, made again, and a write so ended may have been applied.
	for _, memberSaid := range []error{status.Error(codes.Unknown, context.DeadlineExceeded.Error()), status.Error(codes.DeadlineExceeded, "deadline")} {
		n = 0
		_, err = again(context.Background(), time.Hour, func(ctx context.Context) (int, error) {
			n++
			if n == 1 {
				return 0, memberSaid
			}
			return 1, nil
		})
		if err != nil || n != 2 {
			t.Errorf("a try the member said ran out (%v): %v after %d tries, want success after 2", memberSaid, err, n)
		}
		if !maybeApplied(context.Background(), memberSaid) {
			t.Errorf("a write the member said ran out (%v) is not taken as maybe applied", memberSaid)
		}
	}
	if maybeApplied(context.Background(), status.Error(codes.Unknown, "boom")) {
		t.Error("an unknown error that is not a deadline is taken as maybe applied")
	}
}

// What etcd will never take is the caller's to fix, a full database is
// exhausted; only the rest is the store being unavailable (503, retry).
func TestEtcdErrorClasses(t *testing.T) {
	e := &Etcd{}
	for _, c := range []struct {
		err  error
		want error
	}{
		{rpctypes.ErrRequestTooLarge, errdefs.ErrInvalid},
		{rpctypes.ErrDuplicateKey, errdefs.ErrInvalid},
		{rpctypes.ErrNoSpace, errdefs.ErrExhausted},
		{rpctypes.ErrTimeout, errdefs.ErrUnavailable},
		{rpctypes.ErrNoLeader, errdefs.ErrUnavailable},
		{context.DeadlineExceeded, errdefs.ErrUnavailable},
	} {
		if got := e.classify(c.err); !errors.Is(got, c.want) {
			t.Errorf("%v: classified %v, want %v", c.err, got, c.want)
		}
	}
}

// TestWatchBucketSaysItsReadFails: a watch whose first read keeps failing
// (no etcd answers) warns at once and again every watchWarnEvery, rather
// than retrying without a word.
func TestWatchBucketSaysItsReadFails(t *testing.T) {
	defer func(d time.Duration) { watchWarnEvery = d }(watchWarnEvery)
	watchWarnEvery = 2500 * time.Millisecond
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nothing answers there
	var mu sync.Mutex
	var buf bytes.Buffer
	log := slog.New(slog.NewTextHandler(lockedWriter{&mu, &buf}, nil))
	e, err := OpenEtcd(EtcdConfig{Endpoints: []string{addr}, OpTimeout: 200 * time.Millisecond, Log: log})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	start := time.Now()
	e.WatchBucket(ctx, "cluster_revoked", func([]KV) { t.Error("a read succeeded with no etcd") }, func(string, []byte) {})
	deadline := time.Now().Add(10 * time.Second)
	for {
		mu.Lock()
		out := buf.String()
		mu.Unlock()
		if n := strings.Count(out, "cannot read a store bucket to watch it"); n >= 2 {
			if !strings.Contains(out, "bucket=cluster_revoked") || !strings.Contains(out, "unreachable") {
				t.Fatalf("the warnings say too little:\n%s", out)
			}
			// The reads are a second or so apart; the warnings are not.
			if since := time.Since(start); since < watchWarnEvery {
				t.Fatalf("%d warnings within %v: not one per %v\n%s", n, since, watchWarnEvery, out)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("10 s of failed reads, warnings:\n%s", out)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

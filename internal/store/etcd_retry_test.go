package store

import (
	"context"
	"errors"
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

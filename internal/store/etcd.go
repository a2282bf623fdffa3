package store

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// EtcdConfig says how to reach an etcd cluster.
type EtcdConfig struct {
	Endpoints []string
	// Prefix namespaces every key ("/dsec/" if empty), so that one etcd
	// can serve several clusters (and tests).
	Prefix string
	// TLS, if not nil, is used to reach etcd.
	TLS *tls.Config
	// DialTimeout bounds the first connection (default 5 s); OpTimeout
	// bounds each operation (default 3 s). An etcd without quorum makes
	// operations fail after OpTimeout, classified unavailable.
	DialTimeout, OpTimeout time.Duration
	Log                    *slog.Logger
}

// Etcd is a Store in an etcd cluster: the control plane of a multi-process
// dsec (`dsec server`, `dsec edge`). Keys are <prefix><bucket>/<key>.
// Update is a compare-and-set loop on the key's revision, so concurrent
// apiservers never lose each other's writes. Reads are linearizable: an
// etcd that has lost quorum answers nothing rather than old data.
type Etcd struct {
	c      *clientv3.Client
	prefix string
	opTO   time.Duration // one operation, all its tries
	try    time.Duration // one try
	log    *slog.Logger
}

var (
	_ Store   = (*Etcd)(nil)
	_ Leaser  = (*Etcd)(nil)
	_ Watcher = (*Etcd)(nil)
	_ Batcher = (*Etcd)(nil)
	_ Pager   = (*Etcd)(nil)
)

// updateRetries bounds the compare-and-set attempts of one Update.
const updateRetries = 64

// OpenEtcd connects to etcd. It does not fail when etcd is down (the
// client reconnects); the first operation does.
func OpenEtcd(cfg EtcdConfig) (*Etcd, error) {
	if len(cfg.Endpoints) == 0 {
		return nil, errdefs.Invalid("etcd: no endpoints")
	}
	for _, ep := range cfg.Endpoints {
		if strings.TrimSpace(ep) == "" {
			return nil, errdefs.Invalid("etcd: empty endpoint in %q", strings.Join(cfg.Endpoints, ","))
		}
	}
	if cfg.Prefix == "" {
		cfg.Prefix = "/dsec/"
	}
	if !strings.HasSuffix(cfg.Prefix, "/") {
		cfg.Prefix += "/"
	}
	if cfg.DialTimeout <= 0 {
		cfg.DialTimeout = 5 * time.Second
	}
	if cfg.OpTimeout <= 0 {
		cfg.OpTimeout = 3 * time.Second
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	c, err := clientv3.New(clientv3.Config{
		Endpoints:   cfg.Endpoints,
		DialTimeout: cfg.DialTimeout,
		TLS:         cfg.TLS,
		// Keepalives notice a dead member quickly, so that the client
		// moves to another one.
		DialKeepAliveTime:    2 * time.Second,
		DialKeepAliveTimeout: 2 * time.Second,
		// The client's own log repeats, as JSON on stderr, each failed
		// try that classify reports once.
		Logger: zap.NewNop(),
	})
	if err != nil {
		return nil, fmt.Errorf("connecting to etcd %s: %w", strings.Join(cfg.Endpoints, ","), err)
	}
	return &Etcd{c: c, prefix: cfg.Prefix, opTO: cfg.OpTimeout, try: tryTimeout(cfg.OpTimeout), log: cfg.Log}, nil
}

// Ping checks that etcd answers a linearizable read now.
func (e *Etcd) Ping(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, e.opTO)
	defer cancel()
	_, err := again(ctx, e.try, func(ctx context.Context) (*clientv3.GetResponse, error) { return e.c.Get(ctx, e.prefix+EtcdPingKey) })
	return e.classify(err)
}

func (e *Etcd) key(bucket, key string) string { return e.prefix + bucket + "/" + key }

func checkEtcdName(bucket, key string) error {
	if err := checkName(bucket, key); err != nil {
		return err
	}
	if strings.Contains(bucket, "/") {
		return errdefs.Invalid("store: bucket name %q contains /", bucket)
	}
	return nil
}

// classify makes an etcd failure an errdefs class: anything that is not
// the caller's fault is unavailable (no quorum, no member reachable,
// timeout), which the API answers as 503.
func (e *Etcd) classify(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, errdefs.ErrInvalid) || errors.Is(err, errdefs.ErrNotFound) || errors.Is(err, errdefs.ErrAlreadyExists) {
		return err
	}
	switch code(err) {
	case codes.InvalidArgument: // a request etcd will never take: too large, a key twice
		return errdefs.Invalid("control-plane store (etcd) refused the request: %v", err)
	case codes.ResourceExhausted: // the database is full (its space quota)
		return errdefs.Exhausted("control-plane store (etcd) is out of space: %v", err)
	case codes.PermissionDenied, codes.Unauthenticated: // etcd's authentication: this process's user may not
		return fmt.Errorf("%w%w", errdefs.Unavailable("control-plane store (etcd) refused this process (its user's role in etcd; dsec cluster etcd-auth sets them): %v", err), errEtcdRefusedMark)
	}
	return errdefs.Unavailable("control-plane store (etcd) unreachable or without quorum: %v", err)
}

// ErrEtcdRefused is in the error of an operation etcd refused this
// process's user (its authentication: no such user, or no permission).
var ErrEtcdRefused = errors.New("etcd refused this process's user")

// errEtcdRefusedMark wraps ErrEtcdRefused without adding to the message.
var errEtcdRefusedMark = silent{ErrEtcdRefused}

type silent struct{ error }

func (silent) Error() string   { return "" }
func (s silent) Unwrap() error { return s.error }

func (e *Etcd) ctx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), e.opTO)
}

// again runs op until it succeeds, fails for a reason other than the
// connection to a member (a member that just died resets the call in
// flight; the client then moves to another), or ctx ends. Each try gets
// at most try of ctx's time: a write handed to a leader that then died is
// never answered (the member that forwarded it waits out a request
// timeout longer than ours), so a try that hangs is given up and made
// again, by then on the new leader. Only operations that are safe to
// repeat go through it: reads, puts, deletes, and creates that recognise
// their own earlier write (see maybeApplied).
func again[T any](ctx context.Context, try time.Duration, op func(context.Context) (T, error)) (T, error) {
	for {
		actx, cancel := context.WithTimeout(ctx, try)
		v, err := op(actx)
		hung := tryExpired(actx, err)
		cancel()
		if err == nil || ctx.Err() != nil || (code(err) != codes.Unavailable && !hung) {
			return v, err
		}
		if hung {
			continue
		}
		select {
		case <-ctx.Done():
			return v, err
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// maybeApplied tells whether a write that failed with err, in a try whose
// context is tctx, may have been applied all the same: its answer was lost
// with the member, or the try was given up while the write was in flight.
func maybeApplied(tctx context.Context, err error) bool {
	return err != nil && (code(err) == codes.Unavailable || tryExpired(tctx, err))
}

// tryExpired tells whether a try with context tctx ended in err because
// its time ran out. The member serving the call waits under the deadline
// the call carries and may answer first that it ran out ("rpc error:
// code = Unknown desc = context deadline exceeded", seen from etcd 3.4
// while a new leader was being elected), a moment before tctx itself
// expires here.
func tryExpired(tctx context.Context, err error) bool {
	if tctx.Err() != nil || code(err) == codes.DeadlineExceeded {
		return true
	}
	return err != nil && code(err) == codes.Unknown && strings.Contains(err.Error(), context.DeadlineExceeded.Error())
}

// code is err's gRPC code. The client turns the server's own errors
// ("etcdserver: leader changed", "request timed out", "no leader") into
// rpctypes.EtcdError, which carries its code without being a gRPC status.
func code(err error) codes.Code {
	var ee rpctypes.EtcdError
	if errors.As(err, &ee) {
		return ee.Code()
	}
	return status.Code(err)
}

// tryTimeout is the share of the operation timeout one try may take.
func tryTimeout(op time.Duration) time.Duration {
	return max(op/3, 300*time.Millisecond)
}

// Get implements Store.
func (e *Etcd) Get(bucket, key string) ([]byte, error) {
	if err := checkEtcdName(bucket, key); err != nil {
		return nil, err
	}
	ctx, cancel := e.ctx()
	defer cancel()
	r, err := again(ctx, e.try, func(ctx context.Context) (*clientv3.GetResponse, error) { return e.c.Get(ctx, e.key(bucket, key)) })
	if err != nil {
		return nil, e.classify(err)
	}
	if len(r.Kvs) == 0 {
		return nil, errdefs.NotFound("%s/%s not found", bucket, key)
	}
	return nonNil(bytes.Clone(r.Kvs[0].Value)), nil
}

// Put implements Store.
func (e *Etcd) Put(bucket, key string, val []byte) error {
	if err := checkEtcdName(bucket, key); err != nil {
		return err
	}
	ctx, cancel := e.ctx()
	defer cancel()
	_, err := again(ctx, e.try, func(ctx context.Context) (*clientv3.PutResponse, error) {
		return e.c.Put(ctx, e.key(bucket, key), string(val))
	})
	return e.classify(err)
}

// Create implements Store: a transaction that writes only if the key has
// never been created (create revision 0), as Write makes it.
func (e *Etcd) Create(bucket, key string, val []byte) error {
	err := e.Write(bucket, []KV{{Key: key, Value: val}}, nil)
	if errors.Is(err, errdefs.ErrAlreadyExists) {
		return errdefs.AlreadyExists("%s/%s already exists", bucket, key)
	}
	return err
}

// Update implements Store: read, fn, then write only if the key's
// revision is still the one read; on a conflict fn runs again. When the
// answer to a write is lost (a member died under it), the whole step runs
// again: fn may then see the value its earlier run wrote.
func (e *Etcd) Update(bucket, key string, fn func(old []byte) ([]byte, error)) error {
	if err := checkEtcdName(bucket, key); err != nil {
		return err
	}
	k := e.key(bucket, key)
	for i := range updateRetries {
		done, err := e.updateOnce(k, fn)
		if err != nil || done {
			return err
		}
		// Lost the race: wait a random while, growing with each loss,
		// so that writers of one hot key take turns instead of all
		// trying again at once.
		time.Sleep(rand.N(min(time.Millisecond<<min(i, 6), 50*time.Millisecond)) + time.Microsecond)
	}
	return errdefs.Unavailable("store: %s/%s changed under %d updates in a row", bucket, key, updateRetries)
}

func (e *Etcd) updateOnce(k string, fn func(old []byte) ([]byte, error)) (bool, error) {
	ctx, cancel := e.ctx()
	defer cancel()
	r, err := again(ctx, e.try, func(ctx context.Context) (*clientv3.GetResponse, error) { return e.c.Get(ctx, k) })
	if err != nil {
		return false, e.classify(err)
	}
	var old []byte
	var cmp clientv3.Cmp
	if len(r.Kvs) == 0 {
		cmp = clientv3.Compare(clientv3.CreateRevision(k), "=", 0)
	} else {
		old = nonNil(bytes.Clone(r.Kvs[0].Value))
		cmp = clientv3.Compare(clientv3.ModRevision(k), "=", r.Kvs[0].ModRevision)
	}
	val, err := fn(old)
	if err != nil {
		return false, err
	}
	op := clientv3.OpDelete(k)
	if val != nil {
		op = clientv3.OpPut(k, string(val))
	}
	tctx, tcancel := context.WithTimeout(ctx, e.try)
	defer tcancel()
	tr, err := e.c.Txn(tctx).If(cmp).Then(op).Commit()
	if maybeApplied(tctx, err) && ctx.Err() == nil {
		return false, nil // lost: read again and decide again
	}
	if err != nil {
		return false, e.classify(err)
	}
	return tr.Succeeded, nil
}

// Delete implements Store.
func (e *Etcd) Delete(bucket, key string) error {
	if err := checkEtcdName(bucket, key); err != nil {
		return err
	}
	ctx, cancel := e.ctx()
	defer cancel()
	_, err := again(ctx, e.try, func(ctx context.Context) (*clientv3.DeleteResponse, error) {
		return e.c.Delete(ctx, e.key(bucket, key))
	})
	return e.classify(err)
}

// List implements Store. etcd returns a prefix range in key order.
func (e *Etcd) List(bucket, prefix string) ([]KV, error) {
	if err := checkBucket(bucket); err != nil {
		return nil, err
	}
	base := e.prefix + bucket + "/"
	return e.rangeKVs(base, base+prefix, clientv3.WithPrefix())
}

// ListAfter implements Pager with a range request bounded by limit.
func (e *Etcd) ListAfter(bucket, after string, limit int) ([]KV, error) {
	if err := checkPage(bucket, limit); err != nil {
		return nil, err
	}
	base := e.prefix + bucket + "/"
	from := base
	if after != "" {
		from = base + after + "\x00"
	}
	return e.rangeKVs(base, from, clientv3.WithRange(clientv3.GetPrefixRangeEnd(base)), clientv3.WithLimit(int64(limit)))
}

// rangeKVs reads the range from key with opts, in key order, as pairs
// keyed below base.
func (e *Etcd) rangeKVs(base, key string, opts ...clientv3.OpOption) ([]KV, error) {
	ctx, cancel := e.ctx()
	defer cancel()
	opts = append(opts, clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend))
	r, err := again(ctx, e.try, func(ctx context.Context) (*clientv3.GetResponse, error) {
		return e.c.Get(ctx, key, opts...)
	})
	if err != nil {
		return nil, e.classify(err)
	}
	out := make([]KV, 0, len(r.Kvs))
	for _, kv := range r.Kvs {
		out = append(out, KV{Key: strings.TrimPrefix(string(kv.Key), base), Value: nonNil(bytes.Clone(kv.Value))})
	}
	return out, nil
}

// Hold implements Leaser with an etcd lease, kept alive by the client. A
// takeover puts the key on the new lease; the old lease, left to expire or
// revoked by its holder, no longer carries it.
func (e *Etcd) Hold(ctx context.Context, bucket, key string, val []byte, ttl time.Duration, takeover func(cur []byte) bool) (<-chan struct{}, error) {
	if err := checkEtcdName(bucket, key); err != nil {
		return nil, err
	}
	secs := int64(ttl / time.Second)
	if secs < 2 {
		secs = 2
	}
	octx, cancel := e.ctx()
	defer cancel()
	// A lease granted by a try that was given up expires unused.
	lease, err := again(octx, e.try, func(ctx context.Context) (*clientv3.LeaseGrantResponse, error) { return e.c.Grant(ctx, secs) })
	if err != nil {
		return nil, e.classify(err)
	}
	k := e.key(bucket, key)
	// The put is compared on the key's absence, or, for a takeover, on the
	// revision of the value takeover agreed to: a key changed meanwhile is
	// asked about again. A few rounds at most, then it is held by another.
	var rev int64
	for round := 0; ; round++ {
		cmp := clientv3.Compare(clientv3.CreateRevision(k), "=", 0)
		if rev != 0 {
			cmp = clientv3.Compare(clientv3.ModRevision(k), "=", rev)
		}
		var r *clientv3.TxnResponse
		r, err = again(octx, e.try, func(ctx context.Context) (*clientv3.TxnResponse, error) {
			return e.c.Txn(ctx).If(cmp).
				Then(clientv3.OpPut(k, string(val), clientv3.WithLease(lease.ID))).
				Else(clientv3.OpGet(k)).Commit()
		})
		if err != nil || r.Succeeded {
			break
		}
		kvs := r.Responses[0].GetResponseRange().GetKvs()
		if len(kvs) == 0 {
			rev = 0 // gone meanwhile: create it
			continue
		}
		if kvs[0].Lease == int64(lease.ID) {
			break // an earlier attempt's answer was lost: the key is on our lease
		}
		if takeover == nil || round >= 8 || !takeover(bytes.Clone(kvs[0].Value)) {
			err = errdefs.AlreadyExists("%s/%s is held by another process", bucket, key)
			break
		}
		rev = kvs[0].ModRevision
	}
	if err != nil {
		_, _ = e.c.Revoke(octx, lease.ID)
		return nil, e.classify(err)
	}
	kctx, kcancel := context.WithCancel(ctx)
	ka, err := e.c.KeepAlive(kctx, lease.ID)
	if err != nil {
		kcancel()
		_, _ = e.c.Revoke(octx, lease.ID)
		return nil, e.classify(err)
	}
	lost := make(chan struct{})
	go func() {
		defer close(lost)
		defer kcancel()
		for range ka {
			// Each answer renews the lease; the channel closes when the
			// lease is gone or ctx ends.
		}
		if ctx.Err() != nil {
			rctx, cancel := e.ctx()
			defer cancel()
			_, _ = e.c.Revoke(rctx, lease.ID)
		}
	}()
	return lost, nil
}

// Write implements Batcher: one transaction, compared on the create
// revision of every key of creates. After a lost answer, keys all holding
// exactly the values given are taken for the earlier attempt's write.
func (e *Etcd) Write(bucket string, creates, puts []KV) error {
	if len(creates)+len(puts) == 0 {
		return nil
	}
	cmps := make([]clientv3.Cmp, 0, len(creates))
	ops := make([]clientv3.Op, 0, len(creates)+len(puts))
	for _, kv := range creates {
		if err := checkEtcdName(bucket, kv.Key); err != nil {
			return err
		}
		k := e.key(bucket, kv.Key)
		cmps = append(cmps, clientv3.Compare(clientv3.CreateRevision(k), "=", 0))
		ops = append(ops, clientv3.OpPut(k, string(kv.Value)))
	}
	for _, kv := range puts {
		if err := checkEtcdName(bucket, kv.Key); err != nil {
			return err
		}
		ops = append(ops, clientv3.OpPut(e.key(bucket, kv.Key), string(kv.Value)))
	}
	ctx, cancel := e.ctx()
	defer cancel()
	lost := false
	r, err := again(ctx, e.try, func(ctx context.Context) (*clientv3.TxnResponse, error) {
		r, err := e.c.Txn(ctx).If(cmps...).Then(ops...).Commit()
		if maybeApplied(ctx, err) {
			lost = true
		}
		return r, err
	})
	if err != nil {
		return e.classify(err)
	}
	if r.Succeeded {
		return nil
	}
	if lost {
		mine := true
		for _, kv := range append(append([]KV(nil), creates...), puts...) {
			cur, err := e.c.Get(ctx, e.key(bucket, kv.Key))
			if err != nil || len(cur.Kvs) != 1 || !bytes.Equal(cur.Kvs[0].Value, kv.Value) {
				mine = false
				break
			}
		}
		if mine {
			return nil
		}
	}
	return errdefs.AlreadyExists("%s: one of %d keys already exists", bucket, len(creates))
}

// WatchBucket implements Watcher with an etcd watch from the revision of
// a listing, listing again whenever the watch breaks.
func (e *Etcd) WatchBucket(ctx context.Context, bucket string, reset func([]KV), change func(key string, val []byte)) {
	base := e.prefix + bucket + "/"
	go func() {
		// A read that keeps failing is said, then again every
		// watchWarnEvery, and its end too: a process waiting on it (an
		// apiserver reads the revoked certificates before it serves)
		// must not wait without a word.
		var failingSince, warned time.Time
		for ctx.Err() == nil {
			lctx, cancel := e.ctx()
			r, err := e.c.Get(lctx, base, clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend))
			cancel()
			if err != nil {
				now := time.Now()
				if failingSince.IsZero() {
					failingSince = now
				}
				if now.Sub(warned) >= watchWarnEvery {
					warned = now
					e.log.Warn("cannot read a store bucket to watch it; retrying every second", "bucket", bucket,
						"failing_for", now.Sub(failingSince).Round(time.Second).String(), "err", e.classify(err))
				}
				select {
				case <-ctx.Done():
					return
				case <-time.After(time.Second):
				}
				continue
			}
			if !failingSince.IsZero() {
				e.log.Info("reading a store bucket to watch it again", "bucket", bucket, "failed_for", time.Since(failingSince).Round(time.Second).String())
				failingSince, warned = time.Time{}, time.Time{}
			}
			kvs := make([]KV, 0, len(r.Kvs))
			for _, kv := range r.Kvs {
				kvs = append(kvs, KV{Key: strings.TrimPrefix(string(kv.Key), base), Value: nonNil(bytes.Clone(kv.Value))})
			}
			reset(kvs)
			wctx, wcancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
			for wr := range e.c.Watch(wctx, base, clientv3.WithPrefix(), clientv3.WithRev(r.Header.Revision+1)) {
				if err := wr.Err(); err != nil {
					e.log.Debug("store watch broken; listing again", "bucket", bucket, "err", err)
					break
				}
				for _, ev := range wr.Events {
					key := strings.TrimPrefix(string(ev.Kv.Key), base)
					if ev.Type == clientv3.EventTypeDelete {
						change(key, nil)
					} else {
						change(key, nonNil(bytes.Clone(ev.Kv.Value)))
					}
				}
			}
			wcancel()
		}
	}()
}

// watchWarnEvery is how often WatchBucket repeats that its read fails (a
// variable for tests).
var watchWarnEvery = 30 * time.Second

// Close implements Store.
func (e *Etcd) Close() error { return e.c.Close() }

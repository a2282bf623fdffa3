package store

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
)

// ErrEtcdRootLogin: etcd's authentication is on and root's password was
// refused.
var ErrEtcdRootLogin = errors.New("etcd's authentication is on: logging in as root")

// EtcdPingKey is the key (under the prefix) Ping reads.
const EtcdPingKey = "ping"

// EtcdGrant is a permission of an etcd role: the keys of Bucket (a bucket
// of this store), the one key Key, or the keys starting with Prefix (both
// under the store's prefix: "BUCKET/KEY"); read or read-write.
type EtcdGrant struct {
	Bucket, Key, Prefix string
	Write               bool
}

// EtcdUser is a user of etcd's authentication: its name is the common
// name of its client certificate, and a role of the same name holds its
// grants. All gives it every key of the prefix.
type EtcdUser struct {
	Name   string
	All    bool
	Grants []EtcdGrant
}

// EnsureEtcdAuth turns etcd's authentication on for users, as a role of
// each one's name holding exactly its grants under cfg.Prefix
// (permissions under it that it held before and no longer should are
// revoked; those of other prefixes are left), and a root user with
// rootPassword.
// Run again, it updates the roles: the first time it connects as cfg
// says (its client certificate), afterwards as root. Users (and their
// roles) that stale reports and that are not among users are deleted
// (stale nil: none): those of certificates taken back. It reports
// whether authentication was off before, and whom it deleted.
func EnsureEtcdAuth(cfg EtcdConfig, rootPassword string, users []EtcdUser, stale func(name string) bool) (turnedOn bool, deleted []string, err error) {
	if cfg.Prefix == "" {
		cfg.Prefix = "/dsec/"
	}
	if !strings.HasSuffix(cfg.Prefix, "/") {
		cfg.Prefix += "/" // as OpenEtcd keys them
	}
	c, err := etcdAdminClient(cfg, "", "")
	if err != nil {
		return false, nil, err
	}
	defer func() {
		if c != nil {
			_ = c.Close()
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// With authentication off anyone may list users; with it on, only
	// root.
	_, lerr := c.UserList(ctx)
	switch {
	case lerr == nil:
		turnedOn = true
	case slices.Contains([]codes.Code{codes.PermissionDenied, codes.Unauthenticated, codes.InvalidArgument, codes.FailedPrecondition}, code(lerr)):
		_ = c.Close()
		if c, err = etcdAdminClient(cfg, "root", rootPassword); err != nil {
			c = nil
			return false, nil, fmt.Errorf("%w: %w", ErrEtcdRootLogin, err)
		}
	default:
		return false, nil, fmt.Errorf("etcd %v: %w", cfg.Endpoints, lerr)
	}
	if turnedOn {
		if _, err := c.UserAdd(ctx, "root", rootPassword); errors.Is(err, rpctypes.ErrUserAlreadyExist) {
			if _, err := c.UserChangePassword(ctx, "root", rootPassword); err != nil {
				return false, nil, fmt.Errorf("setting root's password: %w", err)
			}
		} else if err != nil {
			return false, nil, fmt.Errorf("adding root: %w", err)
		}
		if _, err := c.UserGrantRole(ctx, "root", "root"); err != nil && !errors.Is(err, rpctypes.ErrRoleNotFound) {
			return false, nil, fmt.Errorf("granting root its role: %w", err)
		}
	}
	for _, u := range users {
		if err := ensureEtcdUser(ctx, c, cfg.Prefix, u); err != nil {
			return false, nil, fmt.Errorf("etcd user %s: %w", u.Name, err)
		}
	}
	if stale != nil {
		if deleted, err = deleteStaleUsers(ctx, c, users, stale); err != nil {
			return false, deleted, err
		}
	}
	if turnedOn {
		if _, err := c.AuthEnable(ctx); err != nil {
			return false, deleted, fmt.Errorf("turning etcd's authentication on: %w", err)
		}
	}
	return turnedOn, deleted, nil
}

// deleteStaleUsers deletes the users stale reports that are not among
// keep, with their roles.
func deleteStaleUsers(ctx context.Context, c *clientv3.Client, keep []EtcdUser, stale func(string) bool) ([]string, error) {
	list, err := c.UserList(ctx)
	if err != nil {
		return nil, fmt.Errorf("listing etcd's users: %w", err)
	}
	var deleted []string
	for _, name := range list.Users {
		if !stale(name) || slices.ContainsFunc(keep, func(u EtcdUser) bool { return u.Name == name }) {
			continue
		}
		if _, err := c.UserDelete(ctx, name); err != nil && !errors.Is(err, rpctypes.ErrUserNotFound) {
			return deleted, fmt.Errorf("deleting etcd user %s: %w", name, err)
		}
		if _, err := c.RoleDelete(ctx, name); err != nil && !errors.Is(err, rpctypes.ErrRoleNotFound) {
			return deleted, fmt.Errorf("deleting etcd role %s: %w", name, err)
		}
		deleted = append(deleted, name)
	}
	return deleted, nil
}

func etcdAdminClient(cfg EtcdConfig, user, password string) (*clientv3.Client, error) {
	if cfg.DialTimeout <= 0 {
		cfg.DialTimeout = 5 * time.Second
	}
	c, err := clientv3.New(clientv3.Config{Endpoints: cfg.Endpoints, DialTimeout: cfg.DialTimeout, TLS: cfg.TLS,
		Username: user, Password: password, Logger: zap.NewNop()})
	if err != nil {
		return nil, err
	}
	return c, nil
}

type etcdPerm struct {
	key, end string
	typ      clientv3.PermissionType
}

func ensureEtcdUser(ctx context.Context, c *clientv3.Client, prefix string, u EtcdUser) error {
	var want []etcdPerm
	rw, ro := clientv3.PermissionType(clientv3.PermReadWrite), clientv3.PermissionType(clientv3.PermRead)
	if u.All {
		want = append(want, etcdPerm{prefix, clientv3.GetPrefixRangeEnd(prefix), rw})
	}
	for _, g := range u.Grants {
		p := etcdPerm{typ: ro}
		if g.Write {
			p.typ = rw
		}
		switch {
		case g.Bucket != "":
			p.key = prefix + g.Bucket + "/"
			p.end = clientv3.GetPrefixRangeEnd(p.key)
		case g.Prefix != "":
			p.key = prefix + g.Prefix
			p.end = clientv3.GetPrefixRangeEnd(p.key)
		default:
			p.key = prefix + g.Key
		}
		want = append(want, p)
	}
	if _, err := c.RoleAdd(ctx, u.Name); err != nil && !errors.Is(err, rpctypes.ErrRoleAlreadyExist) {
		return err
	}
	role, err := c.RoleGet(ctx, u.Name)
	if err != nil {
		return err
	}
	for _, p := range role.Perm {
		// Another prefix's (another cluster on this etcd) are its own.
		if have := (etcdPerm{string(p.Key), string(p.RangeEnd), clientv3.PermissionType(p.PermType)}); strings.HasPrefix(have.key, prefix) && !slices.Contains(want, have) {
			if _, err := c.RoleRevokePermission(ctx, u.Name, have.key, have.end); err != nil {
				return err
			}
		}
	}
	for _, p := range want {
		if _, err := c.RoleGrantPermission(ctx, u.Name, p.key, p.end, p.typ); err != nil {
			return err
		}
	}
	// The user logs in with its certificate; the password is there
	// because etcd 3.4 wants one, and nobody knows it.
	var b [24]byte
	_, _ = rand.Read(b[:])
	if _, err := c.UserAdd(ctx, u.Name, hex.EncodeToString(b[:])); err != nil && !errors.Is(err, rpctypes.ErrUserAlreadyExist) {
		return err
	}
	if _, err := c.UserGrantRole(ctx, u.Name, u.Name); err != nil {
		return err
	}
	return nil
}

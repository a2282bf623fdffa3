package iam

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/base32"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/store"
)

// KeyPrefix starts every generated API key, so that leaked keys are easy to
// spot in logs and by secret scanners.
const KeyPrefix = "dsec_"

// Bounds on operator-supplied keys (EnsureAdminKey). Generated keys are 57
// characters. The lower bound keeps a typed-in key out of brute-force reach of
// anyone who sees a principal ID, which carries part of the key's hash.
const (
	minGivenKeyLen = 16
	maxKeyLen      = 256
)

// idHashLen is how many hex digits of the key hash a principal ID carries:
// 96 bits, enough that two keys never share an ID.
const idHashLen = 24

// lowerBase32 is RFC 4648 base32 in lower case without padding: a key is
// then one word (double-click selects it) and safe in headers and shells.
var lowerBase32 = base32.NewEncoding("abcdefghijklmnopqrstuvwxyz234567").WithPadding(base32.NoPadding)

// hashKey returns the store key for an API key. Only this digest is stored;
// the plaintext never leaves the caller.
func hashKey(key string) string {
	sum := sha256.Sum256([]byte(key))
	return hex.EncodeToString(sum[:])
}

func newKey() (string, error) {
	var b [32]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("generating key: %w", err)
	}
	return KeyPrefix + lowerBase32.EncodeToString(b[:]), nil
}

func principalID(hash string) string { return "key-" + hash[:idHashLen] }

// AdminKeyExists reports whether st holds an admin key of the root
// project. It only reads (a server checks it before it changes anything).
func AdminKeyExists(st store.Store) (bool, error) {
	kvs, err := st.List(bucketKeys, "")
	if err != nil {
		return false, fmt.Errorf("listing keys: %w", err)
	}
	for _, kv := range kvs {
		var p Principal
		if err := json.Unmarshal(kv.Value, &p); err != nil {
			return false, fmt.Errorf("decoding key %s: %w", kv.Key, err)
		}
		if p.Project == RootProject && p.Role == RoleAdmin {
			return true, nil
		}
	}
	return false, nil
}

// EnsureAdminKey makes sure the root project has an admin key, for `dsec up`
// and server start-up.
//
// If given is not empty it is registered as an admin key of the root project
// (idempotently) and returned, with created reporting whether it was new. If
// given is empty and some root admin key exists, it returns ("", false, nil):
// the caller uses the key it saved when the key was created. Otherwise it
// generates a key, registers it and returns it with created true; this is
// the only time the plaintext is available.
//
// Two servers bootstrapping one empty store at once may each create a key;
// both are valid root admin keys.
func (m *IAM) EnsureAdminKey(given string) (key string, created bool, err error) {
	if given != "" {
		return m.registerGivenAdmin(given)
	}
	if ok, err := AdminKeyExists(m.st); err != nil || ok {
		return "", false, err
	}
	key, err = newKey()
	if err != nil {
		return "", false, err
	}
	if _, err := m.register(key, RootProject, RoleAdmin); err != nil {
		return "", false, err
	}
	return key, true, nil
}

func (m *IAM) registerGivenAdmin(given string) (string, bool, error) {
	if err := checkGivenKey(given); err != nil {
		return "", false, err
	}
	_, err := m.register(given, RootProject, RoleAdmin)
	if err == nil {
		return given, true, nil
	}
	if !errors.Is(err, errdefs.ErrAlreadyExists) {
		return "", false, err
	}
	p, err := m.lookup(hashKey(given))
	if err != nil {
		return "", false, err
	}
	if p.Project != RootProject || p.Role != RoleAdmin {
		return "", false, errdefs.Precondition("the given admin key is already registered as %s of project %q", p.Role, p.Project)
	}
	return given, false, nil
}

func checkGivenKey(key string) error {
	if len(key) < minGivenKeyLen || len(key) > maxKeyLen {
		return errdefs.Invalid("admin key must be %d to %d characters long", minGivenKeyLen, maxKeyLen)
	}
	for _, c := range []byte(key) {
		if c <= ' ' || c > '~' {
			return errdefs.Invalid("admin key must be printable ASCII without spaces")
		}
	}
	return nil
}

// Authenticate returns the principal behind an API key (the bearer token,
// without "Bearer "). A missing or unknown key yields an
// errdefs.ErrUnauthenticated error. It runs on every request: known keys are
// served from memory.
//
// The key is looked up by its SHA-256 digest, so no comparison ever touches
// the secret: a timing difference can reveal at most how much of a digest
// matched, and an attacker cannot steer digest bytes without inverting
// SHA-256. That is why no constant-time comparison is needed here.
func (m *IAM) Authenticate(key string) (Principal, error) {
	if key == "" {
		return Principal{}, errdefs.Unauthenticated("missing API key")
	}
	if len(key) > maxKeyLen {
		return Principal{}, errdefs.Unauthenticated("unknown API key")
	}
	h := hashKey(key)
	now := m.now()
	m.mu.RLock()
	e, ok := m.cache[h]
	gen := m.gen
	m.mu.RUnlock()
	if ok && now.Before(e.expires) {
		return e.p, nil
	}
	p, err := m.lookup(h)
	if errors.Is(err, errdefs.ErrNotFound) {
		if ok { // revoked elsewhere after we cached it
			m.evict(h)
		}
		return Principal{}, errdefs.Unauthenticated("unknown API key")
	}
	if err != nil {
		if ok && errors.Is(err, errdefs.ErrUnavailable) {
			// The store is down (etcd without quorum): a key this
			// apiserver knew keeps working, so that running sandboxes
			// stay usable; it is checked again once the store answers.
			return e.p, nil
		}
		return Principal{}, err
	}
	m.rememberIf(h, p, gen)
	return p, nil
}

// CreateKey mints a key with role in project and returns it; this is the
// only time the plaintext is available. p must hold KeyCreate over project
// and at least role itself.
func (m *IAM) CreateKey(p Principal, project string, role Role) (string, error) {
	if err := m.mayGrant(p, project, role); err != nil {
		return "", err
	}
	key, err := newKey()
	if err != nil {
		return "", err
	}
	if _, err := m.register(key, project, role); err != nil {
		return "", err
	}
	return key, nil
}

// RevokeKey deletes the key whose principal ID is id. p must be allowed to
// create such a key (see CreateKey). Other apiservers sharing the store stop
// accepting the key within cacheTTL.
func (m *IAM) RevokeKey(p Principal, id string) error {
	hashPrefix, ok := strings.CutPrefix(id, "key-")
	if !ok || len(hashPrefix) != idHashLen {
		return errdefs.Invalid("malformed key ID %q", id)
	}
	kvs, err := m.st.List(bucketKeys, hashPrefix)
	if err != nil {
		return fmt.Errorf("looking up key %s: %w", id, err)
	}
	if len(kvs) != 1 {
		return errdefs.NotFound("key %q not found", id)
	}
	var target Principal
	if err := json.Unmarshal(kvs[0].Value, &target); err != nil {
		return fmt.Errorf("decoding key %s: %w", id, err)
	}
	if err := m.mayGrant(p, target.Project, target.Role); err != nil {
		return err
	}
	if err := m.st.Delete(bucketKeys, kvs[0].Key); err != nil {
		return fmt.Errorf("deleting key %s: %w", id, err)
	}
	m.evict(kvs[0].Key)
	return nil
}

// mayGrant checks the delegation rule for a key of role in project.
func (m *IAM) mayGrant(p Principal, project string, role Role) error {
	if _, err := ParseRole(string(role)); err != nil {
		return err
	}
	if err := authorize(p, KeyCreate); err != nil {
		return err
	}
	if err := canGrant(p.Role, role); err != nil {
		return err
	}
	_, err := m.scoped(p, project)
	return err
}

// register stores a new principal for key and caches it. It fails with
// errdefs.ErrAlreadyExists if the key is already registered.
func (m *IAM) register(key, project string, role Role) (Principal, error) {
	h := hashKey(key)
	p := Principal{ID: principalID(h), Project: project, Role: role, CreatedAt: m.now().UTC()}
	val, err := json.Marshal(p)
	if err != nil {
		return Principal{}, err
	}
	if err := m.st.Create(bucketKeys, h, val); err != nil {
		if errors.Is(err, errdefs.ErrAlreadyExists) {
			return Principal{}, err
		}
		return Principal{}, fmt.Errorf("storing key %s: %w", p.ID, err)
	}
	m.remember(h, p)
	return p, nil
}

func (m *IAM) lookup(hash string) (Principal, error) {
	val, err := m.st.Get(bucketKeys, hash)
	if err != nil {
		return Principal{}, fmt.Errorf("reading key %s: %w", principalID(hash), err)
	}
	var p Principal
	if err := json.Unmarshal(val, &p); err != nil {
		return Principal{}, fmt.Errorf("decoding key %s: %w", principalID(hash), err)
	}
	return p, nil
}

func (m *IAM) remember(hash string, p Principal) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.cache[hash] = cacheEntry{p: p, expires: m.now().Add(cacheTTL)}
}

// rememberIf caches p unless an eviction happened since gen was read: a
// lookup that raced with RevokeKey may have read the key just before its
// deletion, and must not put it back for a whole TTL.
func (m *IAM) rememberIf(hash string, p Principal, gen uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.gen != gen {
		return
	}
	m.cache[hash] = cacheEntry{p: p, expires: m.now().Add(cacheTTL)}
}

func (m *IAM) evict(hash string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.cache, hash)
	m.gen++
}

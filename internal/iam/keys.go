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
	"time"
	"unicode"
	"unicode/utf8"

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

// maxKeyNameLen bounds a key's name, in characters.
const maxKeyNameLen = 64

// idHashLen is how many hex digits of the key hash a principal ID carries:
// 96 bits, enough that two keys never share an ID.
const idHashLen = 24

// cacheTTL bounds how long a key stays cached without a store read when
// there is no mirror. Revocation through this IAM evicts at once; the TTL
// bounds how long a key deleted behind its back (another process on the
// same store, an operator) keeps working: the issue allows 2 s.
const cacheTTL = time.Second

type cacheEntry struct {
	p       Principal
	expires time.Time
}

// digest is the SHA-256 of an API key: the in-memory index of keys (an
// array, so that a lookup allocates nothing). The store key is its hex.
type digest [sha256.Size]byte

func (d digest) hex() string { return hex.EncodeToString(d[:]) }

// lowerBase32 is RFC 4648 base32 in lower case without padding: a key is
// then one word (double-click selects it) and safe in headers and shells.
var lowerBase32 = base32.NewEncoding("abcdefghijklmnopqrstuvwxyz234567").WithPadding(base32.NoPadding)

// hashKey returns the digest of an API key. Only this digest is stored;
// the plaintext never leaves the caller.
//
// It runs on every request; the copy into an array on the stack keeps the
// hash from allocating (a []byte(key) conversion escapes into SHA-256).
func hashKey(key string) digest {
	var buf [maxKeyLen]byte
	if len(key) > len(buf) {
		return sha256.Sum256([]byte(key))
	}
	n := copy(buf[:], key)
	return sha256.Sum256(buf[:n])
}

func newKey() (string, error) {
	var b [32]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("generating key: %w", err)
	}
	return KeyPrefix + lowerBase32.EncodeToString(b[:]), nil
}

func principalID(hash string) string { return "key-" + hash[:idHashLen] }

// expired reports whether p's key has expired at now.
func (p Principal) expired(now time.Time) bool {
	return p.ExpiresAt != nil && !now.Before(*p.ExpiresAt)
}

// AdminKeyExists reports whether st holds an unexpired admin key of the
// root project. It only reads (a server checks it before it changes
// anything).
func AdminKeyExists(st store.Store) (bool, error) {
	kvs, err := st.List(bucketKeys, "")
	if err != nil {
		return false, fmt.Errorf("listing keys: %w", err)
	}
	now := time.Now()
	for _, kv := range kvs {
		var p Principal
		if err := json.Unmarshal(kv.Value, &p); err != nil {
			return false, fmt.Errorf("decoding key %s: %w", kv.Key, err)
		}
		if p.Project == RootProject && p.Role == RoleAdmin && !p.expired(now) {
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
// given is empty and some unexpired root admin key exists, it returns ("",
// false, nil): the caller uses the key it saved when the key was created.
// Otherwise it generates a key, registers it and returns it with created
// true; this is the only time the plaintext is available.
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
	if _, err := m.register(key, Principal{Project: RootProject, Role: RoleAdmin}); err != nil {
		return "", false, err
	}
	return key, true, nil
}

func (m *IAM) registerGivenAdmin(given string) (string, bool, error) {
	if err := checkGivenKey(given); err != nil {
		return "", false, err
	}
	_, err := m.register(given, Principal{Project: RootProject, Role: RoleAdmin})
	if err == nil {
		return given, true, nil
	}
	if !errors.Is(err, errdefs.ErrAlreadyExists) {
		return "", false, err
	}
	p, err := m.lookup(hashKey(given).hex())
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
	if !printableKey(key) {
		return errdefs.Invalid("admin key must be printable ASCII without spaces")
	}
	if _, ok := FromE2BKey(key); ok {
		// It would name two keys on the E2B API: itself, and the one
		// it spells, which that API takes it for.
		return errdefs.Invalid("admin key must not be the E2B spelling (%s and hex digits) of another key: give that key", e2bKeyPrefix)
	}
	return nil
}

// printableKey reports whether key is printable ASCII without spaces.
func printableKey(key string) bool {
	for _, c := range []byte(key) {
		if c <= ' ' || c > '~' {
			return false
		}
	}
	return true
}

// e2bKeyPrefix starts a key's E2B spelling.
const e2bKeyPrefix = "e2b_"

// E2BKey spells key the way E2B's SDKs want an API key: "e2b_" and hex
// digits (recent SDKs refuse any other key before sending it). The digits
// are the key's bytes, so the spelling names the same key, and the E2B
// API takes it for that key (FromE2BKey).
func E2BKey(key string) string { return e2bKeyPrefix + hex.EncodeToString([]byte(key)) }

// FromE2BKey is the key that s spells (E2BKey), and whether s spells one:
// "e2b_" in either case, then hex digits whose bytes make a key of the
// shape a given key must have (16 to 256 printable ASCII characters
// without spaces), which every generated key has.
func FromE2BKey(s string) (string, bool) {
	n := len(e2bKeyPrefix)
	if len(s) < n+2*minGivenKeyLen || len(s) > n+2*maxKeyLen || !strings.EqualFold(s[:n], e2bKeyPrefix) {
		return "", false
	}
	b, err := hex.DecodeString(s[n:])
	if err != nil || !printableKey(string(b)) {
		return "", false
	}
	return string(b), true
}

// Authenticate returns the principal behind an API key (the bearer token,
// without "Bearer "). A missing, unknown or expired key yields an
// errdefs.ErrUnauthenticated error. It runs on every request: known keys
// are served from memory (the mirror, or the cache).
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
	d := hashKey(key)
	p, err := m.authenticate(d)
	if err != nil {
		return Principal{}, err
	}
	if p.ExpiresAt != nil && p.expired(m.now()) {
		return Principal{}, errdefs.Unauthenticated("API key expired")
	}
	return p, nil
}

func (m *IAM) authenticate(d digest) (Principal, error) {
	m.mu.RLock()
	if m.mirrored() {
		p, ok := m.keys[d]
		gen := m.gen
		m.mu.RUnlock()
		if ok {
			return p, nil
		}
		// Not in the mirror: maybe created on another apiserver a
		// moment ago, its watch event still on the way.
		p, err := m.lookup(d.hex())
		if errors.Is(err, errdefs.ErrNotFound) {
			return Principal{}, errdefs.Unauthenticated("unknown API key")
		}
		if err != nil {
			return Principal{}, err
		}
		m.learnKey(d, p, gen)
		return p, nil
	}
	e, ok := m.cache[d]
	gen := m.gen
	m.mu.RUnlock()
	if ok && m.now().Before(e.expires) {
		return e.p, nil
	}
	p, err := m.lookup(d.hex())
	if errors.Is(err, errdefs.ErrNotFound) {
		if ok { // revoked elsewhere after we cached it
			m.forgetKey(d)
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
	m.learnKey(d, p, gen)
	return p, nil
}

// CreateKey mints a key with role in project and returns it with its
// principal; this is the only time the plaintext is available.
//
// p must be an admin (KeyCreate) over project and hold at least role. The
// key never outlives p's: with p's key expiring, the new key expires at
// the earlier of p's expiry and now+expiresIn (expiresIn 0: no expiry of
// its own). name is a label for people, at most 64 printable characters.
func (m *IAM) CreateKey(p Principal, project string, role Role, name string, expiresIn time.Duration) (string, Principal, error) {
	if err := validKeyName(name); err != nil {
		return "", Principal{}, err
	}
	if expiresIn < 0 {
		return "", Principal{}, errdefs.Invalid("key lifetime %v: want a positive duration, or 0 for none", expiresIn)
	}
	if err := m.mayGrant(p, project, role); err != nil {
		return "", Principal{}, err
	}
	now := m.now().UTC()
	expires, err := keyExpiry(now, p.ExpiresAt, expiresIn)
	if err != nil {
		return "", Principal{}, err
	}
	key, err := newKey()
	if err != nil {
		return "", Principal{}, err
	}
	created, err := m.register(key, Principal{Name: name, Project: project, Role: role, ExpiresAt: expires})
	if err != nil {
		return "", Principal{}, err
	}
	// DeleteProject on another apiserver may have removed the project
	// between the check above and the write: it sweeps keys again after
	// deleting the project, and this read, after the write, sees that
	// deletion if the sweep may have missed the key.
	if _, err := m.readProject(project); err != nil {
		h := hashKey(key)
		if derr := m.st.Delete(bucketKeys, h.hex()); derr != nil {
			return "", Principal{}, fmt.Errorf("withdrawing key %s: %w (after: %w)", created.ID, derr, err)
		}
		m.forgetKey(h)
		return "", Principal{}, err
	}
	return key, created, nil
}

// keyExpiry is the expiry of a key created at now with lifetime expiresIn
// (0: none) by a key expiring at creator (nil: never): never later than
// creator.
func keyExpiry(now time.Time, creator *time.Time, expiresIn time.Duration) (*time.Time, error) {
	if creator != nil && !now.Before(*creator) {
		return nil, errdefs.Unauthenticated("API key expired")
	}
	var exp *time.Time
	if expiresIn > 0 {
		t := now.Add(expiresIn).UTC()
		exp = &t
	}
	if creator != nil && (exp == nil || creator.Before(*exp)) {
		t := creator.UTC()
		exp = &t
	}
	return exp, nil
}

// validKeyName accepts an empty name or up to maxKeyNameLen printable
// characters (unicode.IsPrint: no control or format characters, so a name
// cannot break a log line or reorder text around it).
func validKeyName(name string) error {
	if !utf8.ValidString(name) || utf8.RuneCountInString(name) > maxKeyNameLen {
		return errdefs.Invalid("key name %q: want at most %d printable characters", name, maxKeyNameLen)
	}
	for _, r := range name {
		if !unicode.IsPrint(r) {
			return errdefs.Invalid("key name %q: want at most %d printable characters", name, maxKeyNameLen)
		}
	}
	return nil
}

// ListKeys returns the keys of project (not those of its subprojects),
// sorted by ID, without secrets (only hashes are stored). p must be an
// admin over project.
func (m *IAM) ListKeys(p Principal, project string) ([]Principal, error) {
	if err := m.AuthorizeIn(p, KeyCreate, project); err != nil {
		return nil, err
	}
	out := []Principal{}
	m.mu.RLock()
	if m.mirrored() {
		for _, k := range m.keys {
			if k.Project == project {
				out = append(out, k)
			}
		}
		m.mu.RUnlock()
		return sortedByID(out), nil
	}
	m.mu.RUnlock()
	kvs, err := m.st.List(bucketKeys, "")
	if err != nil {
		return nil, fmt.Errorf("listing keys: %w", err)
	}
	for _, kv := range kvs {
		var k Principal
		if err := json.Unmarshal(kv.Value, &k); err != nil {
			return nil, fmt.Errorf("decoding key %s: %w", kv.Key, err)
		}
		if k.Project == project {
			out = append(out, k)
		}
	}
	return sortedByID(out), nil
}

// RevokeKey deletes the key of project whose principal ID is keyID. A key
// of another project, even one below, is not found: the project in the
// request names the key. p must be allowed to create such a key (see
// CreateKey). Other apiservers stop accepting the key when their mirror
// hears of it, or within cacheTTL without one.
func (m *IAM) RevokeKey(p Principal, project, keyID string) error {
	if err := m.AuthorizeIn(p, KeyCreate, project); err != nil {
		return err
	}
	hashPrefix, ok := strings.CutPrefix(keyID, "key-")
	if !ok || len(hashPrefix) != idHashLen {
		return errdefs.Invalid("malformed key ID %q", keyID)
	}
	kvs, err := m.st.List(bucketKeys, hashPrefix)
	if err != nil {
		return fmt.Errorf("looking up key %s: %w", keyID, err)
	}
	if len(kvs) != 1 {
		return errdefs.NotFound("key %q not found in project %q", keyID, project)
	}
	var target Principal
	if err := json.Unmarshal(kvs[0].Value, &target); err != nil {
		return fmt.Errorf("decoding key %s: %w", keyID, err)
	}
	if target.Project != project {
		return errdefs.NotFound("key %q not found in project %q", keyID, project)
	}
	if err := canGrant(p.Role, target.Role); err != nil {
		return err
	}
	if err := m.st.Delete(bucketKeys, kvs[0].Key); err != nil {
		return fmt.Errorf("deleting key %s: %w", keyID, err)
	}
	if d, ok := parseDigest(kvs[0].Key); ok {
		m.forgetKey(d)
	}
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
	return m.inScope(p, project)
}

// register stores tmpl, completed with its ID and creation time, as the
// principal of key, and puts it in memory. It fails with
// errdefs.ErrAlreadyExists if the key is already registered.
func (m *IAM) register(key string, tmpl Principal) (Principal, error) {
	d := hashKey(key)
	h := d.hex()
	p := tmpl
	p.ID, p.CreatedAt = principalID(h), m.now().UTC()
	val, err := json.Marshal(p)
	if err != nil {
		return Principal{}, err
	}
	gen := m.generation()
	if err := m.st.Create(bucketKeys, h, val); err != nil {
		if errors.Is(err, errdefs.ErrAlreadyExists) {
			return Principal{}, err
		}
		return Principal{}, fmt.Errorf("storing key %s: %w", p.ID, err)
	}
	m.learnKey(d, p, gen)
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

// deleteKeysOf deletes every key of the projects in set, reading the store
// (not the mirror, which may not hold a key created elsewhere a moment
// ago).
func (m *IAM) deleteKeysOf(set map[string]int) error {
	kvs, err := m.st.List(bucketKeys, "")
	if err != nil {
		return fmt.Errorf("listing keys: %w", err)
	}
	for _, kv := range kvs {
		var k Principal
		if json.Unmarshal(kv.Value, &k) != nil {
			continue // authenticates no one (lookup fails to decode it)
		}
		if _, ok := set[k.Project]; !ok {
			continue
		}
		if err := m.st.Delete(bucketKeys, kv.Key); err != nil {
			return fmt.Errorf("deleting key %s of project %s: %w", k.ID, k.Project, err)
		}
		if d, ok := parseDigest(kv.Key); ok {
			m.forgetKey(d)
		}
	}
	return nil
}

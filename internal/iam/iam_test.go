package iam

import (
	"bytes"
	"fmt"
	"math"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/store"
)

// spyStore records every key and value written, so a test can prove that a
// secret never reached the store.
type spyStore struct {
	store.Store
	mu      sync.Mutex
	written [][]byte
}

func (s *spyStore) record(key string, val []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.written = append(s.written, []byte(key), bytes.Clone(val))
}

func (s *spyStore) Put(bucket, key string, val []byte) error {
	s.record(key, val)
	return s.Store.Put(bucket, key, val)
}

func (s *spyStore) Create(bucket, key string, val []byte) error {
	s.record(key, val)
	return s.Store.Create(bucket, key, val)
}

func (s *spyStore) Update(bucket, key string, fn func([]byte) ([]byte, error)) error {
	return s.Store.Update(bucket, key, func(old []byte) ([]byte, error) {
		val, err := fn(old)
		s.record(key, val)
		return val, err
	})
}

func newIAM(t *testing.T, st store.Store) *IAM {
	t.Helper()
	m, err := New(st)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return m
}

var rootAdmin = Principal{ID: "key-test", Project: RootProject, Role: RoleAdmin}

// newTeams returns an IAM with projects root → team-a → a-sub and root → team-b.
func newTeams(t *testing.T) *IAM {
	t.Helper()
	return newTeamsOn(t, store.NewMemory())
}

func newTeamsOn(t *testing.T, st store.Store) *IAM {
	t.Helper()
	m := newIAM(t, st)
	for _, p := range []struct{ parent, name string }{
		{RootProject, "team-a"}, {"team-a", "a-sub"}, {RootProject, "team-b"},
	} {
		if _, err := m.CreateProject(rootAdmin, p.parent, p.name, Quota{}, false); err != nil {
			t.Fatalf("CreateProject(%s): %v", p.name, err)
		}
	}
	return m
}

// mustKey mints a key of role in project by p, without name or expiry.
func mustKey(t *testing.T, m *IAM, p Principal, project string, role Role) (string, Principal) {
	t.Helper()
	key, pr, err := m.CreateKey(p, project, role, "", 0)
	if err != nil {
		t.Fatalf("CreateKey(%s in %s): %v", role, project, err)
	}
	return key, pr
}

func TestNewCreatesRootOnce(t *testing.T) {
	st := store.NewMemory()
	m := newIAM(t, st)
	if _, err := m.CreateProject(rootAdmin, RootProject, "team-a", Quota{}, false); err != nil {
		t.Fatal(err)
	}
	m = newIAM(t, st) // a restart must neither fail nor reset the tree
	proj, err := m.GetProject(rootAdmin, RootProject)
	if err != nil || proj.ID != RootProject || proj.Parent != "" {
		t.Fatalf("GetProject(root) = %+v, %v", proj, err)
	}
	if _, err := m.GetProject(rootAdmin, "team-a"); err != nil {
		t.Fatalf("team-a lost across New: %v", err)
	}
}

func TestEnsureAdminKeyGenerates(t *testing.T) {
	st := store.NewMemory()
	m := newIAM(t, st)
	key, created, err := m.EnsureAdminKey("")
	if err != nil || !created {
		t.Fatalf("first EnsureAdminKey = %q, %v, %v; want a new key", key, created, err)
	}
	if !strings.HasPrefix(key, KeyPrefix) || len(key) != len(KeyPrefix)+52 {
		t.Errorf("key %q: want %q + 52 base32 characters", key, KeyPrefix)
	}
	p, err := m.Authenticate(key)
	if err != nil || p.Project != RootProject || p.Role != RoleAdmin || p.ID == "" {
		t.Fatalf("Authenticate(new admin key) = %+v, %v", p, err)
	}

	// Idempotent, also across a restart (a new IAM with a cold cache).
	for i, m := range []*IAM{m, newIAM(t, st)} {
		again, created, err := m.EnsureAdminKey("")
		if err != nil || created || again != "" {
			t.Errorf("EnsureAdminKey #%d = %q, %v, %v; want \"\", false, nil", i+2, again, created, err)
		}
		if _, err := m.Authenticate(key); err != nil {
			t.Errorf("Authenticate after EnsureAdminKey #%d: %v", i+2, err)
		}
	}

	// Two calls never generate two different keys in sequence.
	k2, _, _ := newIAM(t, st).EnsureAdminKey("")
	if k2 != "" {
		t.Errorf("a restart generated a second admin key")
	}
}

func TestEnsureAdminKeyGiven(t *testing.T) {
	m := newIAM(t, store.NewMemory())
	const given = "operator-chosen-admin-key"
	for i, wantCreated := range []bool{true, false, false} {
		key, created, err := m.EnsureAdminKey(given)
		if err != nil || key != given || created != wantCreated {
			t.Fatalf("EnsureAdminKey(given) #%d = %q, %v, %v; want %q, %v, nil", i+1, key, created, err, given, wantCreated)
		}
	}
	// A given admin key counts as "an admin key exists".
	if key, created, err := m.EnsureAdminKey(""); key != "" || created || err != nil {
		t.Errorf("EnsureAdminKey(\"\") after a given key = %q, %v, %v", key, created, err)
	}
	p, err := m.Authenticate(given)
	if err != nil || p.Role != RoleAdmin || p.Project != RootProject {
		t.Fatalf("Authenticate(given) = %+v, %v", p, err)
	}

	for _, bad := range []string{"short", "has a space in it, sadly", "tab\tinside-the-key-xx", strings.Repeat("k", maxKeyLen+1),
		E2BKey("a-key-of-its-own-0123")} {
		_, _, err := m.EnsureAdminKey(bad)
		wantErr(t, fmt.Sprintf("EnsureAdminKey(%.20q)", bad), err, errdefs.ErrInvalid)
	}
}

// TestE2BKey: every key has an E2B spelling ("e2b_" and hex digits, what
// recent E2B SDKs insist on) that stands for it, and nothing else spells a
// key.
func TestE2BKey(t *testing.T) {
	m := newIAM(t, store.NewMemory())
	gen, _ := mustKey(t, m, rootAdmin, RootProject, RoleMember)
	for _, key := range []string{gen, "a-given-key-0123", strings.Repeat("~", maxKeyLen)} {
		s := E2BKey(key)
		if !regexp.MustCompile(`^e2b_[0-9a-f]+$`).MatchString(s) {
			t.Fatalf("E2BKey(%.20q) = %.30q: not what E2B's SDKs take", key, s)
		}
		for _, spelt := range []string{s, "E2B_" + s[4:], "e2b_" + strings.ToUpper(s[4:])} {
			if got, ok := FromE2BKey(spelt); !ok || got != key {
				t.Errorf("FromE2BKey(%.30q) = %.20q, %v; want %.20q", spelt, got, ok, key)
			}
		}
	}
	for _, s := range []string{
		"", "e2b_", gen, "dsec_" + E2BKey(gen)[4:],
		"e2b_985895e32046e1404d05adfb33614a3026de2cb6", // an E2B key: its bytes are no key
		E2BKey("short-key-15chrs"[:15]),                // too short to be a key
		E2BKey(strings.Repeat("k", maxKeyLen+1)),       // too long
		E2BKey("a key with spaces 0123"),
		E2BKey("a-key-with-a-newline\n"),
		E2BKey("a-key-\x00-with-a-nul"),
		E2BKey("a-good-key-0123456")[:39], // an odd number of digits
		E2BKey("a-good-key-0123456") + "zz",
		"e2b-" + E2BKey("a-good-key-0123456")[4:],
	} {
		if got, ok := FromE2BKey(s); ok {
			t.Errorf("FromE2BKey(%.40q) = %.20q: spells a key", s, got)
		}
	}
}

func TestEnsureAdminKeyGivenClashesWithLesserKey(t *testing.T) {
	m := newIAM(t, store.NewMemory())
	member, _ := mustKey(t, m, rootAdmin, RootProject, RoleMember)
	_, _, err := m.EnsureAdminKey(member)
	wantErr(t, "EnsureAdminKey(member key)", err, errdefs.ErrPrecondition)
	if p, _ := m.Authenticate(member); p.Role != RoleMember {
		t.Errorf("member key became %q", p.Role)
	}
}

func TestAuthenticateRejects(t *testing.T) {
	m := newIAM(t, store.NewMemory())
	if _, _, err := m.EnsureAdminKey(""); err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"", "dsec_unknown", "Bearer x", strings.Repeat("x", 10000)} {
		_, err := m.Authenticate(key)
		wantErr(t, fmt.Sprintf("Authenticate(%.20q)", key), err, errdefs.ErrUnauthenticated)
	}
}

func TestKeysStoredOnlyHashed(t *testing.T) {
	spy := &spyStore{Store: store.NewMemory()}
	m := newIAM(t, spy)
	admin, _, err := m.EnsureAdminKey("")
	if err != nil {
		t.Fatal(err)
	}
	const given = "operator-chosen-admin-key"
	if _, _, err := m.EnsureAdminKey(given); err != nil {
		t.Fatal(err)
	}
	minted, _ := mustKey(t, m, rootAdmin, RootProject, RoleViewer)
	secrets := []string{admin, given, minted}

	// Every write, and the final contents, are free of every plaintext key
	// (and of its random part, in case of a different prefix).
	var seen [][]byte
	spy.mu.Lock()
	seen = append(seen, spy.written...)
	spy.mu.Unlock()
	for _, bucket := range []string{bucketKeys, bucketProjects} {
		kvs, err := spy.List(bucket, "")
		if err != nil {
			t.Fatal(err)
		}
		for _, kv := range kvs {
			seen = append(seen, []byte(kv.Key), kv.Value)
		}
	}
	if len(seen) == 0 {
		t.Fatal("spy saw no writes")
	}
	for _, secret := range secrets {
		needles := []string{secret, strings.TrimPrefix(secret, KeyPrefix)}
		for _, b := range seen {
			for _, n := range needles {
				if bytes.Contains(b, []byte(n)) {
					t.Errorf("plaintext key %q found in store data %q", n, b)
				}
			}
		}
	}
	// And the store does hold the hashes.
	if _, err := spy.Get(bucketKeys, hashKey(minted).hex()); err != nil {
		t.Errorf("minted key not stored under its hash: %v", err)
	}
}

// TestCreateKeyDelegation: only admins mint keys (KeyCreate), of roles they
// hold, in their scope. Members could mint keys before the four-role model;
// they no longer can.
func TestCreateKeyDelegation(t *testing.T) {
	m := newTeams(t)
	admin := Principal{ID: "key-a", Project: "team-a", Role: RoleAdmin}
	builder := Principal{ID: "key-b", Project: "team-a", Role: RoleBuilder}
	member := Principal{ID: "key-m", Project: "team-a", Role: RoleMember}
	viewer := Principal{ID: "key-v", Project: "team-a", Role: RoleViewer}
	tests := []struct {
		name    string
		by      Principal
		project string
		role    Role
		want    error
	}{
		{"admin mints admin in own project", admin, "team-a", RoleAdmin, nil},
		{"admin mints admin in subproject", admin, "a-sub", RoleAdmin, nil},
		{"admin mints builder", admin, "team-a", RoleBuilder, nil},
		{"admin mints viewer", admin, "team-a", RoleViewer, nil},
		{"admin in sibling project", admin, "team-b", RoleMember, errdefs.ErrPermissionDenied},
		{"admin in parent project", admin, RootProject, RoleViewer, errdefs.ErrPermissionDenied},
		{"admin in missing project", admin, "nope", RoleViewer, errdefs.ErrNotFound},
		{"builder mints viewer", builder, "team-a", RoleViewer, errdefs.ErrPermissionDenied},
		{"member mints member", member, "team-a", RoleMember, errdefs.ErrPermissionDenied},
		{"member mints viewer in subproject", member, "a-sub", RoleViewer, errdefs.ErrPermissionDenied},
		{"member mints admin", member, "team-a", RoleAdmin, errdefs.ErrPermissionDenied},
		{"viewer mints viewer", viewer, "team-a", RoleViewer, errdefs.ErrPermissionDenied},
		{"unknown role", admin, "team-a", "owner", errdefs.ErrInvalid},
		{"empty role", admin, "team-a", "", errdefs.ErrInvalid},
		{"root admin anywhere", rootAdmin, "a-sub", RoleAdmin, nil},
	}
	for _, tc := range tests {
		key, pr, err := m.CreateKey(tc.by, tc.project, tc.role, tc.name, 0)
		wantErr(t, tc.name, err, tc.want)
		if err != nil {
			if key != "" || pr != (Principal{}) {
				t.Errorf("%s: failed CreateKey returned a key", tc.name)
			}
			continue
		}
		p, err := m.Authenticate(key)
		if err != nil || p.Project != tc.project || p.Role != tc.role || p.Name != tc.name || p.ID != pr.ID || p.ExpiresAt != nil {
			t.Errorf("%s: Authenticate(minted) = %+v, %v; want %s in %s named %q, as returned (%+v)", tc.name, p, err, tc.role, tc.project, tc.name, pr)
		}
	}
}

func TestCreateProject(t *testing.T) {
	m := newIAM(t, store.NewMemory())
	if _, err := m.CreateProject(rootAdmin, RootProject, "team-a", Quota{Sandboxes: 100, CPU: 50, MemoryMB: 65536, DiskMB: 1 << 20}, false); err != nil {
		t.Fatal(err)
	}
	if _, err := m.CreateProject(rootAdmin, RootProject, "team-b", Quota{}, false); err != nil {
		t.Fatal(err)
	}
	adminA := Principal{Project: "team-a", Role: RoleAdmin}
	memberA := Principal{Project: "team-a", Role: RoleMember}
	tests := []struct {
		name         string
		by           Principal
		parent, proj string
		quota        Quota
		dedicated    bool
		want         error
	}{
		{"within parent's quota", adminA, "team-a", "a-1", Quota{Sandboxes: 100, CPU: 50, MemoryMB: 65536, DiskMB: 1 << 20}, true, nil},
		{"inherits", adminA, "team-a", "a-2", Quota{}, false, nil},
		{"more sandboxes than parent", adminA, "team-a", "a-3", Quota{Sandboxes: 101}, false, errdefs.ErrQuota},
		{"more cpu than parent", rootAdmin, "team-a", "a-4", Quota{CPU: 50.5}, false, errdefs.ErrQuota},
		{"grandparent still binds", adminA, "a-2", "a-2-1", Quota{MemoryMB: 65537}, false, errdefs.ErrQuota},
		{"under unlimited parent", rootAdmin, "team-b", "b-1", Quota{Sandboxes: 1 << 30}, false, nil},
		{"member may not", memberA, "team-a", "a-5", Quota{}, false, errdefs.ErrPermissionDenied},
		{"admin outside scope", adminA, "team-b", "b-2", Quota{}, false, errdefs.ErrPermissionDenied},
		{"admin above scope", adminA, RootProject, "r-1", Quota{}, false, errdefs.ErrPermissionDenied},
		{"name taken anywhere", rootAdmin, "team-b", "a-1", Quota{}, false, errdefs.ErrAlreadyExists},
		{"bad name", adminA, "team-a", "A_1", Quota{}, false, errdefs.ErrInvalid},
		{"negative quota", adminA, "team-a", "a-6", Quota{CPU: -1}, false, errdefs.ErrInvalid},
		{"NaN quota", adminA, "team-a", "a-7", Quota{CPU: math.NaN()}, false, errdefs.ErrInvalid},
		{"missing parent", rootAdmin, "nope", "a-8", Quota{}, false, errdefs.ErrNotFound},
		{"more disk than parent", adminA, "team-a", "a-9", Quota{DiskMB: 1<<20 + 1}, false, errdefs.ErrQuota},
		{"negative disk", adminA, "team-a", "a-10", Quota{DiskMB: -1}, false, errdefs.ErrInvalid},
		{"root's name", rootAdmin, "team-b", RootProject, Quota{}, false, errdefs.ErrAlreadyExists},
	}
	for _, tc := range tests {
		proj, err := m.CreateProject(tc.by, tc.parent, tc.proj, tc.quota, tc.dedicated)
		wantErr(t, tc.name, err, tc.want)
		if err != nil {
			continue
		}
		got, err := m.GetProject(tc.by, tc.proj)
		if err != nil || got != proj || got.Parent != tc.parent || got.Quota != tc.quota || got.DedicatedNodes != tc.dedicated || got.CreatedAt.IsZero() {
			t.Errorf("%s: GetProject = %+v, %v; want %+v", tc.name, got, err, proj)
		}
	}
}

// TestProjectDepthLimit: a chain of maxDepth (64) projects below the root
// can be created, and every scoped question about its deepest project
// works; a 65th level is refused.
func TestProjectDepthLimit(t *testing.T) {
	if maxDepth != 64 {
		t.Fatalf("maxDepth = %d; the issue asks for 64 levels below the root", maxDepth)
	}
	for _, mode := range storeModes {
		t.Run(mode.name, func(t *testing.T) {
			m := mode.iam(t)
			parent := RootProject
			for i := 1; i <= maxDepth; i++ {
				name := fmt.Sprintf("p%d", i)
				if _, err := m.CreateProject(rootAdmin, parent, name, Quota{}, false); err != nil {
					t.Fatalf("depth %d: %v", i, err)
				}
				parent = name
			}
			deepest := parent
			_, err := m.CreateProject(rootAdmin, deepest, "too-deep", Quota{}, false)
			wantErr(t, "beyond maxDepth", err, errdefs.ErrInvalid)

			lineage, err := m.Lineage(deepest)
			if err != nil || len(lineage) != maxDepth+1 {
				t.Fatalf("Lineage(deepest) = %d projects, %v; want %d", len(lineage), err, maxDepth+1)
			}
			path, err := m.Path(deepest)
			if err != nil || !strings.HasPrefix(path, "root/p1/p2/") || !strings.HasSuffix(path, "/p63/p64") || strings.Count(path, "/") != maxDepth {
				t.Errorf("Path(deepest) = %q, %v", path, err)
			}
			wantErr(t, "root admin in deepest", m.AuthorizeIn(rootAdmin, SandboxCreate, deepest), nil)
			deep := Principal{Project: deepest, Role: RoleAdmin}
			wantErr(t, "deepest in own", m.AuthorizeIn(deep, SandboxCreate, deepest), nil)
			wantErr(t, "deepest in parent", m.AuthorizeIn(deep, SandboxCreate, "p63"), errdefs.ErrPermissionDenied)
			if _, err := m.UpdateProject(rootAdmin, deepest, &Quota{CPU: 1}, nil); err != nil {
				t.Errorf("UpdateProject(deepest): %v", err)
			}
			ids, err := m.SubtreeIDs("p1")
			if err != nil || len(ids) != maxDepth {
				t.Errorf("SubtreeIDs(p1) = %d IDs, %v; want %d", len(ids), err, maxDepth)
			}
			deleted, err := m.DeleteProject(rootAdmin, "p1", true)
			if err != nil || len(deleted) != maxDepth || deleted[0] != deepest || deleted[maxDepth-1] != "p1" {
				t.Errorf("DeleteProject(p1, cascade) = %v, %v; want p64 … p1", deleted, err)
			}
		})
	}
}

func TestGetProjectAndChildrenScope(t *testing.T) {
	m := newTeams(t)
	viewerA := Principal{Project: "team-a", Role: RoleViewer}
	for _, tc := range []struct {
		id   string
		want error
	}{
		{"team-a", nil},
		{"a-sub", nil},
		{"team-b", errdefs.ErrPermissionDenied},
		{RootProject, errdefs.ErrPermissionDenied},
		{"nope", errdefs.ErrNotFound},
		{"", errdefs.ErrInvalid},
	} {
		_, err := m.GetProject(viewerA, tc.id)
		wantErr(t, "GetProject "+tc.id, err, tc.want)
		_, err = m.Children(viewerA, tc.id)
		wantErr(t, "Children "+tc.id, err, tc.want)
	}
	kids, err := m.Children(rootAdmin, RootProject)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, k := range kids {
		ids = append(ids, k.ID)
	}
	if got := strings.Join(ids, ","); got != "team-a,team-b" {
		t.Errorf("Children(root) = %s, want team-a,team-b", got)
	}
}

func TestAuthorizeIn(t *testing.T) {
	m := newTeams(t)
	memberA := Principal{Project: "team-a", Role: RoleMember}
	wantErr(t, "create in own", m.AuthorizeIn(memberA, SandboxCreate, "team-a"), nil)
	wantErr(t, "create in sub", m.AuthorizeIn(memberA, SandboxCreate, "a-sub"), nil)
	wantErr(t, "create in sibling", m.AuthorizeIn(memberA, SandboxCreate, "team-b"), errdefs.ErrPermissionDenied)
	wantErr(t, "admin in own", m.AuthorizeIn(memberA, ProjectAdmin, "team-a"), errdefs.ErrPermissionDenied)
}

// TestRevokeKey: admins revoke keys of their scope, named by project and
// ID. Members could revoke before (KeyCreate was member's); they no longer
// can.
func TestRevokeKey(t *testing.T) {
	m := newTeams(t)
	adminA := Principal{Project: "team-a", Role: RoleAdmin}
	memberA := Principal{Project: "team-a", Role: RoleMember}
	adminKey, adminP := mustKey(t, m, adminA, "team-a", RoleAdmin)
	memberKey, memberP := mustKey(t, m, adminA, "a-sub", RoleMember)

	wantErr(t, "member revokes member", m.RevokeKey(memberA, "a-sub", memberP.ID), errdefs.ErrPermissionDenied)
	wantErr(t, "outsider revokes", m.RevokeKey(Principal{Project: "team-b", Role: RoleAdmin}, "a-sub", memberP.ID), errdefs.ErrPermissionDenied)
	wantErr(t, "malformed ID", m.RevokeKey(adminA, "team-a", "key-xyz"), errdefs.ErrInvalid)
	wantErr(t, "unknown ID", m.RevokeKey(adminA, "team-a", "key-"+strings.Repeat("0", idHashLen)), errdefs.ErrNotFound)
	wantErr(t, "wrong project (the parent)", m.RevokeKey(adminA, "team-a", memberP.ID), errdefs.ErrNotFound)
	wantErr(t, "wrong project (a child)", m.RevokeKey(rootAdmin, "a-sub", adminP.ID), errdefs.ErrNotFound)
	wantErr(t, "missing project", m.RevokeKey(adminA, "nope", memberP.ID), errdefs.ErrNotFound)
	if _, err := m.Authenticate(memberKey); err != nil {
		t.Fatalf("refused revocations revoked: %v", err)
	}

	// The key is cached (we just authenticated it); revocation must still
	// take effect at once.
	wantErr(t, "admin revokes member in subproject", m.RevokeKey(adminA, "a-sub", memberP.ID), nil)
	_, err := m.Authenticate(memberKey)
	wantErr(t, "Authenticate(revoked)", err, errdefs.ErrUnauthenticated)
	wantErr(t, "revoke twice", m.RevokeKey(adminA, "a-sub", memberP.ID), errdefs.ErrNotFound)
	if _, err := m.Authenticate(adminKey); err != nil {
		t.Errorf("unrelated key stopped working: %v", err)
	}
	// An admin may revoke its own key.
	wantErr(t, "revoke own key", m.RevokeKey(adminP, "team-a", adminP.ID), nil)
	_, err = m.Authenticate(adminKey)
	wantErr(t, "Authenticate(self-revoked)", err, errdefs.ErrUnauthenticated)
}

func TestCacheExpiresForOutsideRevocation(t *testing.T) {
	st := store.NewMemory()
	m := newIAM(t, st)
	now := time.Unix(1_700_000_000, 0)
	m.now = func() time.Time { return now }
	key, _ := mustKey(t, m, rootAdmin, RootProject, RoleMember)
	if _, err := m.Authenticate(key); err != nil {
		t.Fatal(err)
	}

	// Another apiserver on the same store revokes the key.
	other := newIAM(t, st)
	p, err := other.Authenticate(key)
	if err != nil {
		t.Fatal(err)
	}
	if err := other.RevokeKey(rootAdmin, RootProject, p.ID); err != nil {
		t.Fatal(err)
	}

	now = now.Add(cacheTTL / 2)
	if _, err := m.Authenticate(key); err != nil {
		t.Errorf("within TTL: served from cache as designed, got %v", err)
	}
	now = now.Add(cacheTTL)
	_, err = m.Authenticate(key)
	wantErr(t, "after TTL", err, errdefs.ErrUnauthenticated)
}

func TestAuthenticateConcurrent(t *testing.T) {
	m := newIAM(t, store.NewMemory())
	key, _, err := m.EnsureAdminKey("")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 200 {
				if _, err := m.Authenticate(key); err != nil {
					t.Errorf("Authenticate: %v", err)
					return
				}
				if _, err := m.Authenticate("dsec_nope"); err == nil {
					t.Error("unknown key accepted")
					return
				}
			}
		}()
	}
	for range 20 {
		_, p := mustKey(t, m, rootAdmin, RootProject, RoleViewer)
		if err := m.RevokeKey(rootAdmin, RootProject, p.ID); err != nil {
			t.Fatal(err)
		}
	}
	wg.Wait()
}

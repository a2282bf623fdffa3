package iam

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/store"
)

// fakeClock makes m's clock settable; it returns the setter.
func fakeClock(m *IAM) func(time.Duration) time.Time {
	now := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	m.now = func() time.Time { return now }
	return func(d time.Duration) time.Time { now = now.Add(d); return now }
}

func TestKeyExpires(t *testing.T) {
	for _, mode := range storeModes {
		t.Run(mode.name, func(t *testing.T) {
			m := mode.iam(t)
			advance := fakeClock(m)
			key, p, err := m.CreateKey(rootAdmin, RootProject, RoleViewer, "short-lived", time.Hour)
			if err != nil {
				t.Fatal(err)
			}
			if p.ExpiresAt == nil || !p.ExpiresAt.Equal(advance(0).Add(time.Hour)) {
				t.Fatalf("ExpiresAt = %v, want now+1h", p.ExpiresAt)
			}
			advance(time.Hour - time.Second)
			if got, err := m.Authenticate(key); err != nil || got.ID != p.ID {
				t.Fatalf("a second before expiry: %+v, %v", got, err)
			}
			advance(time.Second)
			_, err = m.Authenticate(key)
			wantErr(t, "at expiry", err, errdefs.ErrUnauthenticated)
			if err == nil || !strings.Contains(err.Error(), "expired") {
				t.Errorf("error %v does not say the key expired", err)
			}
			// A fresh IAM (another apiserver, a cold cache) agrees.
			other := newIAM(t, m.st)
			other.now = m.now
			_, err = other.Authenticate(key)
			wantErr(t, "at expiry, cold", err, errdefs.ErrUnauthenticated)

			_, _, err = m.CreateKey(rootAdmin, RootProject, RoleViewer, "", -time.Second)
			wantErr(t, "negative lifetime", err, errdefs.ErrInvalid)
		})
	}
}

// TestKeyNeverOutlivesCreator mints keys with keys that expire, in chains.
func TestKeyNeverOutlivesCreator(t *testing.T) {
	m := newTeams(t)
	advance := fakeClock(m)
	now := advance(0)
	_, parent, err := m.CreateKey(rootAdmin, "team-a", RoleAdmin, "parent", 2*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name      string
		expiresIn time.Duration
		want      time.Time
	}{
		{"no lifetime asked", 0, now.Add(2 * time.Hour)},
		{"shorter", time.Hour, now.Add(time.Hour)},
		{"longer", 30 * 24 * time.Hour, now.Add(2 * time.Hour)},
	}
	for _, tc := range tests {
		key, child, err := m.CreateKey(parent, "a-sub", RoleMember, tc.name, tc.expiresIn)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if child.ExpiresAt == nil || !child.ExpiresAt.Equal(tc.want) {
			t.Errorf("%s: ExpiresAt = %v, want %v", tc.name, child.ExpiresAt, tc.want)
		}
		if stored, err := m.Authenticate(key); err != nil || stored.ExpiresAt == nil || !stored.ExpiresAt.Equal(tc.want) {
			t.Errorf("%s: stored %+v, %v", tc.name, stored, err)
		}
	}
	// A grandchild minted by a child that expires sooner is bound by it.
	_, child, _ := m.CreateKey(parent, "a-sub", RoleAdmin, "child", time.Hour)
	_, grandchild, err := m.CreateKey(child, "a-sub", RoleViewer, "grandchild", 0)
	if err != nil || grandchild.ExpiresAt == nil || !grandchild.ExpiresAt.Equal(now.Add(time.Hour)) {
		t.Errorf("grandchild = %+v, %v; want expiry now+1h", grandchild, err)
	}
	// Once the creator has expired, it mints nothing.
	advance(2 * time.Hour)
	_, _, err = m.CreateKey(parent, "a-sub", RoleViewer, "", 0)
	wantErr(t, "by an expired key", err, errdefs.ErrUnauthenticated)
}

func TestKeyNames(t *testing.T) {
	m := newIAM(t, store.NewMemory())
	for _, name := range []string{"", "CI — déploiement #3", "😀", strings.Repeat("n", maxKeyNameLen)} {
		key, p, err := m.CreateKey(rootAdmin, RootProject, RoleViewer, name, 0)
		if err != nil {
			t.Errorf("name %q: %v", name, err)
			continue
		}
		if got, err := m.Authenticate(key); err != nil || got.Name != name || p.Name != name {
			t.Errorf("name %q: stored %q, returned %q, %v", name, got.Name, p.Name, err)
		}
	}
	for _, name := range []string{strings.Repeat("n", maxKeyNameLen+1), "a\nb", "\u202etxt.exe", "\x00"} {
		_, _, err := m.CreateKey(rootAdmin, RootProject, RoleViewer, name, 0)
		wantErr(t, fmt.Sprintf("name %q", name), err, errdefs.ErrInvalid)
	}
}

func TestListKeys(t *testing.T) {
	for _, mode := range storeModes {
		t.Run(mode.name, func(t *testing.T) {
			m := newTeamsOn(t, mode.iam(t).st)
			adminA := Principal{Project: "team-a", Role: RoleAdmin}
			var want []string
			secrets := map[string]bool{}
			for i := range 5 {
				key, p, err := m.CreateKey(adminA, "team-a", RoleMember, fmt.Sprintf("k%d", i), 0)
				if err != nil {
					t.Fatal(err)
				}
				want = append(want, p.ID)
				secrets[key] = true
			}
			mustKey(t, m, adminA, "a-sub", RoleViewer) // a subproject's: not listed
			mustKey(t, m, rootAdmin, "team-b", RoleViewer)

			got, err := m.ListKeys(adminA, "team-a")
			if err != nil {
				t.Fatal(err)
			}
			var ids []string
			for _, p := range got {
				ids = append(ids, p.ID)
				if p.Project != "team-a" || p.Name == "" || p.CreatedAt.IsZero() {
					t.Errorf("listed %+v", p)
				}
				if secrets[p.ID] || secrets[p.Name] {
					t.Errorf("a listed key carries its secret: %+v", p)
				}
			}
			sortedWant := slices.Sorted(slices.Values(want))
			if strings.Join(ids, ",") != strings.Join(sortedWant, ",") {
				t.Errorf("ListKeys(team-a) = %v, want %v (sorted by ID)", ids, sortedWant)
			}
			if ks, err := m.ListKeys(adminA, "a-sub"); err != nil || len(ks) != 1 {
				t.Errorf("ListKeys(a-sub) = %v, %v", ks, err)
			}
			if ks, err := m.ListKeys(adminA, "a-sub"); err == nil && ks == nil {
				t.Error("ListKeys returned nil for a project with keys")
			}
			if ks, err := m.ListKeys(rootAdmin, RootProject); err != nil || ks == nil || len(ks) != 0 {
				t.Errorf("ListKeys(root) = %v, %v; want empty, not nil", ks, err)
			}
			for _, tc := range []struct {
				name    string
				by      Principal
				project string
				want    error
			}{
				{"sibling", adminA, "team-b", errdefs.ErrPermissionDenied},
				{"parent", adminA, RootProject, errdefs.ErrPermissionDenied},
				{"builder", Principal{Project: "team-a", Role: RoleBuilder}, "team-a", errdefs.ErrPermissionDenied},
				{"missing", adminA, "nope", errdefs.ErrNotFound},
			} {
				_, err := m.ListKeys(tc.by, tc.project)
				wantErr(t, tc.name, err, tc.want)
			}
		})
	}
}

func TestAdminKeyExistsIgnoresExpired(t *testing.T) {
	st := store.NewMemory()
	m := newIAM(t, st)
	if _, _, err := m.CreateKey(rootAdmin, RootProject, RoleAdmin, "", time.Millisecond); err != nil {
		t.Fatal(err)
	}
	time.Sleep(5 * time.Millisecond)
	if ok, err := AdminKeyExists(st); err != nil || ok {
		t.Errorf("AdminKeyExists with only an expired admin key = %v, %v", ok, err)
	}
	key, created, err := m.EnsureAdminKey("")
	if err != nil || !created || key == "" {
		t.Errorf("EnsureAdminKey did not replace an expired admin key: %q, %v, %v", key, created, err)
	}
}

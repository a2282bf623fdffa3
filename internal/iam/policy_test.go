package iam

import (
	"errors"
	"testing"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// wantErr fails unless err is nil (class nil) or of the given errdefs class.
func wantErr(t *testing.T, what string, err, class error) {
	t.Helper()
	switch {
	case class == nil && err != nil:
		t.Errorf("%s: unexpected error %v", what, err)
	case class != nil && !errors.Is(err, class):
		t.Errorf("%s: err = %v, want %v", what, err, class)
	}
}

func TestAuthorizeMatrix(t *testing.T) {
	// The whole matrix, spelled out: a change to minRole must change this.
	const (
		y = true
		n = false
	)
	matrix := []struct {
		action                Action
		viewer, member, admin bool
	}{
		{SandboxRead, y, y, y},
		{LayerRead, y, y, y},
		{ProjectRead, y, y, y},
		{SandboxCreate, n, y, y},
		{SandboxWrite, n, y, y},
		{LayerWrite, n, y, y},
		{KeyCreate, n, y, y},
		{ProjectAdmin, n, n, y},
		{Action("sandbox.destroy-everything"), n, n, n},
	}
	if len(matrix)-1 != len(minRole) {
		t.Fatalf("matrix covers %d actions, minRole has %d", len(matrix)-1, len(minRole))
	}
	for _, row := range matrix {
		for role, allowed := range map[Role]bool{
			RoleViewer: row.viewer, RoleMember: row.member, RoleAdmin: row.admin,
			"": false, "owner": false,
		} {
			err := authorize(Principal{Project: RootProject, Role: role}, row.action)
			if allowed {
				wantErr(t, string(role)+" "+string(row.action), err, nil)
			} else {
				wantErr(t, string(role)+" "+string(row.action), err, errdefs.ErrPermissionDenied)
			}
		}
	}
}

func TestCanGrant(t *testing.T) {
	tests := []struct {
		from, to Role
		want     error
	}{
		{RoleAdmin, RoleAdmin, nil},
		{RoleAdmin, RoleMember, nil},
		{RoleAdmin, RoleViewer, nil},
		{RoleMember, RoleAdmin, errdefs.ErrPermissionDenied},
		{RoleMember, RoleMember, nil},
		{RoleMember, RoleViewer, nil},
		{RoleViewer, RoleMember, errdefs.ErrPermissionDenied},
		{RoleViewer, RoleViewer, nil}, // allowed here; KeyCreate stops viewers earlier
		{RoleAdmin, "owner", errdefs.ErrInvalid},
		{"", RoleViewer, errdefs.ErrPermissionDenied},
	}
	for _, tc := range tests {
		wantErr(t, string(tc.from)+"→"+string(tc.to), canGrant(tc.from, tc.to), tc.want)
	}
}

func TestParseRole(t *testing.T) {
	for _, s := range []string{"admin", "member", "viewer"} {
		if r, err := ParseRole(s); err != nil || string(r) != s {
			t.Errorf("ParseRole(%q) = %q, %v", s, r, err)
		}
	}
	for _, s := range []string{"", "Admin", "owner"} {
		_, err := ParseRole(s)
		wantErr(t, "ParseRole("+s+")", err, errdefs.ErrInvalid)
	}
}

func TestEffectiveQuotaAndFits(t *testing.T) {
	lineage := func(qs ...Quota) []Project {
		var out []Project
		for _, q := range qs {
			out = append(out, Project{Quota: q})
		}
		return out
	}
	tests := []struct {
		name    string
		lineage []Project // parent first, root last
		child   Quota
		want    error
	}{
		{"unlimited root", lineage(Quota{}), Quota{Sandboxes: 1e6, CPU: 1e4, MemoryMB: 1 << 40}, nil},
		{"equal to parent", lineage(Quota{10, 4, 1024}, Quota{}), Quota{10, 4, 1024}, nil},
		{"zero inherits", lineage(Quota{10, 4, 1024}), Quota{}, nil},
		{"sandboxes over", lineage(Quota{10, 4, 1024}), Quota{Sandboxes: 11}, errdefs.ErrQuota},
		{"cpu over", lineage(Quota{10, 4, 1024}), Quota{CPU: 4.5}, errdefs.ErrQuota},
		{"memory over", lineage(Quota{10, 4, 1024}), Quota{MemoryMB: 1025}, errdefs.ErrQuota},
		// The parent sets no CPU limit, but the grandparent does.
		{"grandparent binds", lineage(Quota{Sandboxes: 5}, Quota{CPU: 2}, Quota{}), Quota{CPU: 3}, errdefs.ErrQuota},
		// The tighter limit wins, wherever it sits on the path.
		{"tightest wins", lineage(Quota{Sandboxes: 100}, Quota{Sandboxes: 5}), Quota{Sandboxes: 6}, errdefs.ErrQuota},
		{"under tightest", lineage(Quota{Sandboxes: 100}, Quota{Sandboxes: 5}), Quota{Sandboxes: 5}, nil},
	}
	for _, tc := range tests {
		wantErr(t, tc.name, tc.child.fits(effectiveQuota(tc.lineage)), tc.want)
	}
}

func TestValidName(t *testing.T) {
	for _, ok := range []string{"a", "team-a", "x9", "0", "a-b-c"} {
		wantErr(t, ok, validName(ok), nil)
	}
	long := make([]byte, 64)
	for i := range long {
		long[i] = 'a'
	}
	for _, bad := range []string{"", "-a", "a-", "Team", "a_b", "a/b", "a.b", "ä", string(long)} {
		wantErr(t, bad, validName(bad), errdefs.ErrInvalid)
	}
}

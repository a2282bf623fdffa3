package iam

import (
	"errors"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

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

// TestAuthorizeMatrix spells out the whole matrix: a change to minRole must
// change this. Changed with the four roles: LayerWrite needs a builder
// (was member), KeyCreate needs an admin (was member), AuditRead is new.
func TestAuthorizeMatrix(t *testing.T) {
	const (
		y = true
		n = false
	)
	matrix := []struct {
		action                         Action
		viewer, member, builder, admin bool
	}{
		{SandboxRead, y, y, y, y},
		{LayerRead, y, y, y, y},
		{ProjectRead, y, y, y, y},
		{SandboxCreate, n, y, y, y},
		{SandboxWrite, n, y, y, y},
		{LayerWrite, n, n, y, y},
		{KeyCreate, n, n, n, y},
		{ProjectAdmin, n, n, n, y},
		{AuditRead, n, n, n, y},
		{Action("sandbox.destroy-everything"), n, n, n, n},
		{Action(""), n, n, n, n},
	}
	if len(matrix)-2 != len(minRole) {
		t.Fatalf("matrix covers %d actions, minRole has %d", len(matrix)-2, len(minRole))
	}
	for _, row := range matrix {
		for role, allowed := range map[Role]bool{
			RoleViewer: row.viewer, RoleMember: row.member, RoleBuilder: row.builder, RoleAdmin: row.admin,
			"": false, "owner": false, "Admin": false,
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

func TestPermissions(t *testing.T) {
	tests := []struct {
		role Role
		want string
	}{
		{RoleViewer, "layer.read project.read sandbox.read"},
		{RoleMember, "layer.read project.read sandbox.create sandbox.read sandbox.write"},
		{RoleBuilder, "layer.read layer.write project.read sandbox.create sandbox.read sandbox.write"},
		{RoleAdmin, "audit.read key.create layer.read layer.write project.admin project.read sandbox.create sandbox.read sandbox.write"},
		{"owner", ""},
		{"", ""},
	}
	for _, tc := range tests {
		got := Permissions(tc.role)
		if got == nil || strings.Join(got, " ") != tc.want {
			t.Errorf("Permissions(%q) = %q, want %q", tc.role, got, tc.want)
		}
		if !slices.IsSorted(got) {
			t.Errorf("Permissions(%q) not sorted: %q", tc.role, got)
		}
		// It agrees with authorize.
		for _, a := range got {
			wantErr(t, "authorize "+a, authorize(Principal{Role: tc.role}, Action(a)), nil)
		}
	}
}

func TestCanGrant(t *testing.T) {
	tests := []struct {
		from, to Role
		want     error
	}{
		{RoleAdmin, RoleAdmin, nil},
		{RoleAdmin, RoleBuilder, nil},
		{RoleAdmin, RoleMember, nil},
		{RoleAdmin, RoleViewer, nil},
		{RoleBuilder, RoleAdmin, errdefs.ErrPermissionDenied},
		{RoleBuilder, RoleBuilder, nil}, // allowed here; KeyCreate stops builders earlier
		{RoleBuilder, RoleMember, nil},
		{RoleMember, RoleAdmin, errdefs.ErrPermissionDenied},
		{RoleMember, RoleBuilder, errdefs.ErrPermissionDenied},
		{RoleMember, RoleMember, nil},
		{RoleMember, RoleViewer, nil},
		{RoleViewer, RoleMember, errdefs.ErrPermissionDenied},
		{RoleViewer, RoleViewer, nil},
		{RoleAdmin, "owner", errdefs.ErrInvalid},
		{RoleAdmin, "", errdefs.ErrInvalid},
		{"", RoleViewer, errdefs.ErrPermissionDenied},
	}
	for _, tc := range tests {
		wantErr(t, string(tc.from)+"→"+string(tc.to), canGrant(tc.from, tc.to), tc.want)
	}
}

func TestParseRole(t *testing.T) {
	for _, s := range []string{"admin", "builder", "member", "viewer"} {
		if r, err := ParseRole(s); err != nil || string(r) != s {
			t.Errorf("ParseRole(%q) = %q, %v", s, r, err)
		}
	}
	for _, s := range []string{"", "Admin", "owner", "builder ", "viewer\x00"} {
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
	q := func(sandboxes int, cpu float64, mem, disk int64) Quota { return Quota{sandboxes, cpu, mem, disk} }
	tests := []struct {
		name    string
		lineage []Project // parent first, root last
		child   Quota
		want    error
	}{
		{"unlimited root", lineage(Quota{}), q(1e6, 1e4, 1<<40, 1<<40), nil},
		{"equal to parent", lineage(q(10, 4, 1024, 2048), Quota{}), q(10, 4, 1024, 2048), nil},
		{"zero inherits", lineage(q(10, 4, 1024, 2048)), Quota{}, nil},
		{"sandboxes over", lineage(q(10, 4, 1024, 2048)), Quota{Sandboxes: 11}, errdefs.ErrQuota},
		{"cpu over", lineage(q(10, 4, 1024, 2048)), Quota{CPU: 4.5}, errdefs.ErrQuota},
		{"memory over", lineage(q(10, 4, 1024, 2048)), Quota{MemoryMB: 1025}, errdefs.ErrQuota},
		{"disk over", lineage(q(10, 4, 1024, 2048)), Quota{DiskMB: 2049}, errdefs.ErrQuota},
		{"disk under", lineage(q(10, 4, 1024, 2048)), Quota{DiskMB: 2048}, nil},
		// The parent sets no CPU limit, but the grandparent does.
		{"grandparent binds", lineage(Quota{Sandboxes: 5}, Quota{CPU: 2}, Quota{}), Quota{CPU: 3}, errdefs.ErrQuota},
		{"great-grandparent binds disk", lineage(Quota{}, Quota{}, Quota{DiskMB: 10}, Quota{}), Quota{DiskMB: 11}, errdefs.ErrQuota},
		// The tighter limit wins, wherever it sits on the path (an
		// ancestor lowered below its child's quota since).
		{"tightest wins", lineage(Quota{Sandboxes: 100}, Quota{Sandboxes: 5}), Quota{Sandboxes: 6}, errdefs.ErrQuota},
		{"under tightest", lineage(Quota{Sandboxes: 100}, Quota{Sandboxes: 5}), Quota{Sandboxes: 5}, nil},
		{"tightest per field", lineage(q(100, 1, 0, 50), q(5, 8, 64, 0)), q(5, 1, 64, 50), nil},
		{"tightest per field, cpu over", lineage(q(100, 1, 0, 50), q(5, 8, 64, 0)), q(5, 1.5, 64, 50), errdefs.ErrQuota},
	}
	for _, tc := range tests {
		wantErr(t, tc.name, tc.child.fits(effectiveQuota(tc.lineage)), tc.want)
	}
	if got := effectiveQuota(lineage(q(100, 1, 0, 50), q(5, 8, 64, 0), Quota{})); got != q(5, 1, 64, 50) {
		t.Errorf("effectiveQuota = %+v, want the minimum per field", got)
	}
}

func TestQuotaValidate(t *testing.T) {
	for _, ok := range []Quota{{}, {1, 0.5, 1, 1}, {Sandboxes: 1 << 40}} {
		wantErr(t, "valid", ok.validate(), nil)
	}
	for _, bad := range []Quota{{Sandboxes: -1}, {CPU: -0.1}, {MemoryMB: -1}, {DiskMB: -1}, {CPU: math.NaN()}, {CPU: math.Inf(1)}} {
		wantErr(t, "invalid", bad.validate(), errdefs.ErrInvalid)
	}
}

func TestValidName(t *testing.T) {
	for _, ok := range []string{"a", "team-a", "x9", "0", "a-b-c", "a--b", strings.Repeat("a", 63)} {
		wantErr(t, ok, validName(ok), nil)
	}
	for _, bad := range []string{
		"", "-a", "a-", "-", "Team", "a_b", "a/b", "a.b", "..", ".", "ä", "a b", " a", "a\n", "a\x00b",
		"%2f", "a%2Fb", "a\\b", "a:b", "a*", "😀", "ａ", // full-width a
		"root/a", strings.Repeat("a", 64),
	} {
		wantErr(t, bad, validName(bad), errdefs.ErrInvalid)
	}
}

func TestValidKeyName(t *testing.T) {
	for _, ok := range []string{"", "ci", "CI runner #3 (prod)", "déploiement", "日本語のキー", "😀 emoji", "a b", strings.Repeat("x", 64), strings.Repeat("é", 64)} {
		wantErr(t, ok, validKeyName(ok), nil)
	}
	for _, bad := range []string{
		strings.Repeat("x", 65), strings.Repeat("é", 65),
		"line\nbreak", "tab\there", "nul\x00", "bell\a", "esc\x1b[31m",
		"rtl\u202eoverride", "zero\u200bwidth", "\xff\xfe", "del\x7f",
	} {
		wantErr(t, bad, validKeyName(bad), errdefs.ErrInvalid)
	}
}

// TestKeyExpiry: a key never outlives the key that created it.
func TestKeyExpiry(t *testing.T) {
	now := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	at := func(d time.Duration) *time.Time { t := now.Add(d); return &t }
	tests := []struct {
		name      string
		creator   *time.Time
		expiresIn time.Duration
		want      *time.Time
		err       error
	}{
		{"no expiry from a lasting creator", nil, 0, nil, nil},
		{"lifetime from a lasting creator", nil, time.Hour, at(time.Hour), nil},
		{"no expiry asked: the creator's", at(time.Hour), 0, at(time.Hour), nil},
		{"shorter than the creator's", at(time.Hour), time.Minute, at(time.Minute), nil},
		{"as long as the creator's", at(time.Hour), time.Hour, at(time.Hour), nil},
		{"longer than the creator's: cut", at(time.Hour), 48 * time.Hour, at(time.Hour), nil},
		{"creator expired", at(-time.Second), 0, nil, errdefs.ErrUnauthenticated},
		{"creator expiring now", at(0), time.Minute, nil, errdefs.ErrUnauthenticated},
	}
	for _, tc := range tests {
		got, err := keyExpiry(now, tc.creator, tc.expiresIn)
		wantErr(t, tc.name, err, tc.err)
		if (got == nil) != (tc.want == nil) || got != nil && !got.Equal(*tc.want) {
			t.Errorf("%s: expiry = %v, want %v", tc.name, got, tc.want)
		}
		if got != nil && tc.creator != nil && got.After(*tc.creator) {
			t.Errorf("%s: key outlives its creator", tc.name)
		}
	}
}

package iam

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/store"
)

func TestAudit(t *testing.T) {
	m := newTeams(t)
	advance := fakeClock(m)
	t0 := advance(0)
	adminA := Principal{ID: "key-a", Project: "team-a", Role: RoleAdmin}
	write := func(at time.Duration, p Principal, action, target string) {
		t.Helper()
		if err := m.Audit(AuditEntry{Time: t0.Add(at), Principal: p.ID, Project: p.Project, Action: action, Target: target}); err != nil {
			t.Fatal(err)
		}
	}
	// Out of time order on purpose, and 100 ms / 120 ms apart: keys must
	// sort as times do (RFC3339Nano would not).
	write(120*time.Millisecond, adminA, "key.create", "a-2")
	write(100*time.Millisecond, adminA, "key.create", "a-1")
	write(0, rootAdmin, "project.create", "team-a")
	write(time.Second, Principal{ID: "key-s", Project: "a-sub"}, "key.revoke", "s-1")
	write(2*time.Second, Principal{ID: "key-b", Project: "team-b"}, "project.update", "team-b")
	write(25*time.Hour, adminA, "project.delete", "next-day") // the next day's listing

	targets := func(es []AuditEntry) string {
		var out []string
		for _, e := range es {
			out = append(out, e.Target)
		}
		return strings.Join(out, ",")
	}
	tests := []struct {
		name  string
		by    Principal
		since time.Time
		limit int
		want  string
		err   error
	}{
		{"root, all", rootAdmin, time.Time{}, 0, "team-a,a-1,a-2,s-1,team-b,next-day", nil},
		{"root, limit", rootAdmin, time.Time{}, 2, "team-a,a-1", nil},
		{"root, since is exclusive", rootAdmin, t0.Add(100 * time.Millisecond), 2, "a-2,s-1", nil},
		{"root, since the end", rootAdmin, t0.Add(25 * time.Hour), 0, "", nil},
		{"team-a admin: own project and below", adminA, time.Time{}, 0, "a-1,a-2,s-1,next-day", nil},
		{"a-sub admin", Principal{Project: "a-sub", Role: RoleAdmin}, time.Time{}, 0, "s-1", nil},
		{"builder", Principal{Project: "team-a", Role: RoleBuilder}, time.Time{}, 0, "", errdefs.ErrPermissionDenied},
		{"member", Principal{Project: RootProject, Role: RoleMember}, time.Time{}, 0, "", errdefs.ErrPermissionDenied},
		{"negative limit", rootAdmin, time.Time{}, -1, "", errdefs.ErrInvalid},
	}
	for _, tc := range tests {
		got, err := m.ListAudit(tc.by, tc.since, tc.limit)
		wantErr(t, tc.name, err, tc.err)
		if err == nil && targets(got) != tc.want {
			t.Errorf("%s: ListAudit = %s, want %s", tc.name, targets(got), tc.want)
		}
	}
	all, _ := m.ListAudit(rootAdmin, time.Time{}, 0)
	if e := all[0]; e.Principal != rootAdmin.ID || e.Project != RootProject || e.Action != "project.create" || !e.Time.Equal(t0) {
		t.Errorf("entry = %+v", e)
	}

	// Paging by since.
	var paged []AuditEntry
	for since := (time.Time{}); ; {
		page, err := m.ListAudit(rootAdmin, since, 2)
		if err != nil {
			t.Fatal(err)
		}
		if len(page) == 0 {
			break
		}
		paged = append(paged, page...)
		since = page[len(page)-1].Time
	}
	if targets(paged) != targets(all) {
		t.Errorf("paged = %s, want %s", targets(paged), targets(all))
	}

	// Entries outlive the project they were written in: its path keeps
	// them in the scope of the projects above.
	if _, err := m.DeleteProject(rootAdmin, "a-sub", false); err != nil {
		t.Fatal(err)
	}
	if got, _ := m.ListAudit(adminA, time.Time{}, 0); targets(got) != "a-1,a-2,s-1,next-day" {
		t.Errorf("after a-sub's deletion, team-a's admin sees %s", targets(got))
	}

	// The store keys sort by time.
	kvs, _ := m.st.List(bucketAudit, "")
	var prev time.Time
	for _, kv := range kvs {
		var rec auditRecord
		if err := json.Unmarshal(kv.Value, &rec); err != nil {
			t.Fatal(err)
		}
		if rec.Time.Before(prev) {
			t.Errorf("key %s sorts after a later entry", kv.Key)
		}
		prev = rec.Time
	}
}

func TestAuditEntryBounds(t *testing.T) {
	m := newIAM(t, store.NewMemory())
	advance := fakeClock(m)
	wantErr(t, "no action", m.Audit(AuditEntry{Principal: "key-x"}), errdefs.ErrInvalid)

	long := strings.Repeat("é", maxAuditDetail) // 2 bytes each
	if err := m.Audit(AuditEntry{Principal: "key-x", Project: "gone", Action: "a", Target: long, Detail: long}); err != nil {
		t.Fatal(err)
	}
	got, err := m.ListAudit(rootAdmin, time.Time{}, 0)
	if err != nil || len(got) != 1 {
		t.Fatalf("ListAudit = %v, %v", got, err)
	}
	e := got[0]
	if !e.Time.Equal(advance(0)) {
		t.Errorf("zero Time became %v, want now", e.Time)
	}
	if len(e.Target) > maxAuditTarget || len(e.Detail) > maxAuditDetail || !utf8.ValidString(e.Target) || !utf8.ValidString(e.Detail) {
		t.Errorf("cut to %d and %d bytes (valid UTF-8: %v)", len(e.Target), len(e.Detail), utf8.ValidString(e.Detail))
	}

	// limit is capped.
	for i := range maxPageSize + 5 {
		if err := m.Audit(AuditEntry{Time: advance(time.Millisecond), Action: "a", Target: fmt.Sprint(i)}); err != nil {
			t.Fatal(err)
		}
	}
	if got, _ := m.ListAudit(rootAdmin, time.Time{}, maxPageSize*10); len(got) != maxPageSize {
		t.Errorf("ListAudit(limit 10000) = %d entries, want %d", len(got), maxPageSize)
	}
}

func TestTrimAudit(t *testing.T) {
	m := newIAM(t, store.NewMemory())
	advance := fakeClock(m)
	start := advance(0)
	for day := range 40 {
		for i := range 3 {
			at := start.Add(time.Duration(day)*24*time.Hour + time.Duration(i)*time.Hour)
			if err := m.Audit(AuditEntry{Time: at, Action: "a", Target: fmt.Sprintf("d%d-%d", day, i)}); err != nil {
				t.Fatal(err)
			}
		}
	}
	now := advance(40 * 24 * time.Hour) // the last entries are a day old

	// Entries past the retention window plus a day are not listed even
	// before a trim.
	got, err := m.ListAudit(rootAdmin, time.Time{}, maxPageSize)
	if err != nil {
		t.Fatal(err)
	}
	floor := now.Add(-AuditRetention - 24*time.Hour).Truncate(24 * time.Hour)
	for _, e := range got {
		if e.Time.Before(floor) {
			t.Fatalf("listed %s, older than the window", e.Target)
		}
	}

	cutoff := now.Add(-AuditRetention)
	n, err := m.TrimAudit(cutoff)
	if err != nil {
		t.Fatal(err)
	}
	kvs, _ := m.st.List(bucketAudit, "")
	if n+len(kvs) != 120 || n == 0 {
		t.Errorf("trimmed %d, left %d, of 120", n, len(kvs))
	}
	for _, kv := range kvs {
		var rec auditRecord
		_ = json.Unmarshal(kv.Value, &rec)
		if rec.Time.Before(cutoff) {
			t.Errorf("entry %s of %v survived the trim at %v", rec.Target, rec.Time, cutoff)
		}
	}
	if n2, err := m.TrimAudit(cutoff); err != nil || n2 != 0 {
		t.Errorf("second trim = %d, %v", n2, err)
	}
	got, _ = m.ListAudit(rootAdmin, time.Time{}, maxPageSize)
	if len(got) != len(kvs) {
		t.Errorf("after the trim ListAudit sees %d of %d entries", len(got), len(kvs))
	}
}

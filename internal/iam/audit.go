package iam

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// AuditRetention is how long audit entries are kept: the server calls
// TrimAudit(now - AuditRetention) periodically, and ListAudit looks no
// further back (plus a day of slack for a trim not yet run).
const AuditRetention = 30 * 24 * time.Hour

// Bounds on the free-text fields of an entry, which keep the bucket's
// size a function of the number of actions.
const (
	maxAuditTarget = 256
	maxAuditDetail = 1024
)

// auditTimeFormat is RFC 3339 with all nine fraction digits, so that keys
// (and day prefixes) sort as times do: time.RFC3339Nano drops trailing
// zeros.
const auditTimeFormat = "2006-01-02T15:04:05.000000000Z"

// AuditEntry is one management action. Its fields are those of
// api.AuditEntry, so the two convert into each other.
type AuditEntry struct {
	Time      time.Time `json:"time"`
	Principal string    `json:"principal"` // principal ID
	Project   string    `json:"project"`   // the principal's project
	Action    string    `json:"action"`
	Target    string    `json:"target"`
	Detail    string    `json:"detail,omitempty"`
}

// auditRecord is an entry as stored. Path is the lineage of the entry's
// project when it was written, so that scope checks still hold for entries
// of projects deleted since.
type auditRecord struct {
	AuditEntry
	Path string `json:"path,omitempty"`
}

// Audit appends entry to the audit log. A zero Time is set to now. Target
// and Detail are cut to 256 and 1024 bytes.
func (m *IAM) Audit(entry AuditEntry) error {
	if entry.Action == "" {
		return errdefs.Invalid("audit entry without an action")
	}
	if entry.Time.IsZero() {
		entry.Time = m.now()
	}
	entry.Time = entry.Time.UTC()
	entry.Target = cut(entry.Target, maxAuditTarget)
	entry.Detail = cut(entry.Detail, maxAuditDetail)
	rec := auditRecord{AuditEntry: entry}
	if entry.Project != "" {
		// Without a path (a project already gone) only the root's
		// admins see the entry.
		rec.Path, _ = m.Path(entry.Project)
	}
	val, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	var suffix [6]byte
	if _, err := rand.Read(suffix[:]); err != nil {
		return fmt.Errorf("generating audit key: %w", err)
	}
	// The random suffix keeps two entries of the same nanosecond (from two
	// apiservers) apart.
	key := entry.Time.Format(auditTimeFormat) + "-" + hex.EncodeToString(suffix[:])
	if err := m.st.Create(bucketAudit, key, val); err != nil {
		return fmt.Errorf("storing audit entry %s: %w", key, err)
	}
	return nil
}

// ListAudit returns up to limit (0: 100; at most 1000) audit entries later
// than since, oldest first, whose project is p's own or below it. p must
// hold AuditRead. To page, pass the Time of the last entry as since.
// Entries older than AuditRetention plus a day are not returned (they are
// due for trimming).
func (m *IAM) ListAudit(p Principal, since time.Time, limit int) ([]AuditEntry, error) {
	switch {
	case limit < 0:
		return nil, errdefs.Invalid("page size %d: want 0 (default %d) to %d", limit, defaultPageSize, maxPageSize)
	case limit == 0:
		limit = defaultPageSize
	case limit > maxPageSize:
		limit = maxPageSize
	}
	if err := m.AuthorizeIn(p, AuditRead, p.Project); err != nil {
		return nil, err
	}
	scope := ""
	if p.Project != RootProject {
		path, err := m.Path(p.Project)
		if err != nil {
			return nil, err
		}
		scope = path
	}
	now := m.now().UTC()
	day := since.UTC()
	if floor := now.Add(-AuditRetention - 24*time.Hour); day.Before(floor) {
		day = floor
	}
	day = day.Truncate(24 * time.Hour)
	// One listing per day, from since's: a page costs a day or two of
	// entries, not the whole log. Tomorrow is included for clocks ahead.
	out := []AuditEntry{}
	for ; !day.After(now.Add(24 * time.Hour)); day = day.Add(24 * time.Hour) {
		kvs, err := m.st.List(bucketAudit, day.Format("2006-01-02T"))
		if err != nil {
			return nil, fmt.Errorf("listing audit entries: %w", err)
		}
		for _, kv := range kvs {
			var rec auditRecord
			if json.Unmarshal(kv.Value, &rec) != nil || !rec.Time.After(since) {
				continue
			}
			if scope != "" && rec.Path != scope && !strings.HasPrefix(rec.Path, scope+"/") {
				continue
			}
			out = append(out, rec.AuditEntry)
			if len(out) == limit {
				return out, nil
			}
		}
	}
	return out, nil
}

// TrimAudit deletes the audit entries older than before and returns how
// many it deleted. It lists the whole log (the store lists by prefix only),
// so the server calls it now and then, not per request.
func (m *IAM) TrimAudit(before time.Time) (int, error) {
	kvs, err := m.st.List(bucketAudit, "")
	if err != nil {
		return 0, fmt.Errorf("listing audit entries: %w", err)
	}
	cutoff := before.UTC().Format(auditTimeFormat)
	n := 0
	for _, kv := range kvs {
		if kv.Key >= cutoff {
			break
		}
		if err := m.st.Delete(bucketAudit, kv.Key); err != nil {
			return n, fmt.Errorf("trimming audit entry %s: %w", kv.Key, err)
		}
		n++
	}
	return n, nil
}

// cut shortens s to at most n bytes, on a character boundary.
func cut(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

package iam

import (
	"math"

	"github.com/dsecproject/dsec/internal/errdefs"
)

func (q Quota) validate() error {
	if q.Sandboxes < 0 || q.CPU < 0 || q.MemoryMB < 0 || q.DiskMB < 0 ||
		math.IsNaN(q.CPU) || math.IsInf(q.CPU, 0) {
		return errdefs.Invalid("quota %+v: limits must be finite and non-negative (0 means inherit)", q)
	}
	return nil
}

// effectiveQuota folds a lineage (a project, then its ancestors) into the
// limits that actually bind the first project: per field, the smallest
// non-zero limit anywhere on the path, or zero if none sets one. It is the
// minimum, not the nearest limit, because an ancestor's quota may have been
// lowered below a descendant's since (see UpdateProject).
func effectiveQuota(lineage []Project) Quota {
	var eff Quota
	for _, proj := range lineage {
		q := proj.Quota
		eff.Sandboxes = tighter(eff.Sandboxes, q.Sandboxes)
		eff.CPU = tighter(eff.CPU, q.CPU)
		eff.MemoryMB = tighter(eff.MemoryMB, q.MemoryMB)
		eff.DiskMB = tighter(eff.DiskMB, q.DiskMB)
	}
	return eff
}

// tighter returns the smaller non-zero limit of a and b (0: no limit).
func tighter[T int | int64 | float64](a, b T) T {
	if b > 0 && (a == 0 || b < a) {
		return b
	}
	return a
}

// fits reports, as an errdefs.ErrQuota error, a field of q above the
// corresponding non-zero limit. Siblings may each take up to the whole
// limit (overcommit, as with cgroups); enforcement at sandbox create time
// must therefore count usage against every ancestor, not just the project.
func (q Quota) fits(limit Quota) error {
	if limit.Sandboxes > 0 && q.Sandboxes > limit.Sandboxes {
		return errdefs.Quota("sandboxes quota %d exceeds the parent's limit of %d", q.Sandboxes, limit.Sandboxes)
	}
	if limit.CPU > 0 && q.CPU > limit.CPU {
		return errdefs.Quota("cpu quota %g exceeds the parent's limit of %g", q.CPU, limit.CPU)
	}
	if limit.MemoryMB > 0 && q.MemoryMB > limit.MemoryMB {
		return errdefs.Quota("memory_mb quota %d exceeds the parent's limit of %d", q.MemoryMB, limit.MemoryMB)
	}
	if limit.DiskMB > 0 && q.DiskMB > limit.DiskMB {
		return errdefs.Quota("disk_mb quota %d exceeds the parent's limit of %d", q.DiskMB, limit.DiskMB)
	}
	return nil
}

package iam

import (
	"math"

	"github.com/dsecproject/dsec/internal/errdefs"
)

func (q Quota) validate() error {
	if q.Sandboxes < 0 || q.CPU < 0 || q.MemoryMB < 0 ||
		math.IsNaN(q.CPU) || math.IsInf(q.CPU, 0) {
		return errdefs.Invalid("quota %+v: limits must be finite and non-negative (0 means inherit)", q)
	}
	return nil
}

// effectiveQuota folds a lineage (a project, then its ancestors) into the
// limits that actually bind the first project: per field, the smallest
// non-zero limit anywhere on the path, or zero if none sets one.
func effectiveQuota(lineage []Project) Quota {
	var eff Quota
	for _, proj := range lineage {
		q := proj.Quota
		if q.Sandboxes > 0 && (eff.Sandboxes == 0 || q.Sandboxes < eff.Sandboxes) {
			eff.Sandboxes = q.Sandboxes
		}
		if q.CPU > 0 && (eff.CPU == 0 || q.CPU < eff.CPU) {
			eff.CPU = q.CPU
		}
		if q.MemoryMB > 0 && (eff.MemoryMB == 0 || q.MemoryMB < eff.MemoryMB) {
			eff.MemoryMB = q.MemoryMB
		}
	}
	return eff
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
	return nil
}

package iam

import "github.com/dsecproject/dsec/api"

// The wire types of api have the fields of these, so the REST layer
// converts with a plain conversion; this stops compiling if they drift.
var (
	_ = api.AuditEntry(AuditEntry{})
	_ = AuditEntry(api.AuditEntry{})
	_ = api.ProjectQuota(Quota{})
	_ = Quota(api.ProjectQuota{})
)

package iam

import (
	"slices"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// Role is what a principal may do within its project and the projects below it.
type Role string

// Roles, from least to most powerful. Each holds every permission of the ones
// before it, which is what makes "grant only what you hold" a comparison.
const (
	RoleViewer  Role = "viewer"  // reads sandboxes, layers and projects
	RoleMember  Role = "member"  // also creates and drives sandboxes
	RoleBuilder Role = "builder" // also publishes layers (snapshot, build, import, pull, delete)
	RoleAdmin   Role = "admin"   // also manages keys, subprojects and reads the audit log
)

// roleNames is for error messages.
const roleNames = "viewer, member, builder or admin"

// rank orders roles; unknown roles rank 0 and so hold nothing.
func (r Role) rank() int {
	switch r {
	case RoleViewer:
		return 1
	case RoleMember:
		return 2
	case RoleBuilder:
		return 3
	case RoleAdmin:
		return 4
	}
	return 0
}

// ParseRole returns the Role named s, or an errdefs.ErrInvalid error.
func ParseRole(s string) (Role, error) {
	r := Role(s)
	if r.rank() == 0 {
		return "", errdefs.Invalid("unknown role %q (want %s)", s, roleNames)
	}
	return r, nil
}

// Action is something a principal asks to do. The value is stable and fit
// for logs and for GET /v1/whoami.
type Action string

// Actions. SandboxWrite covers exec, file writes, lifecycle changes and
// delete of an existing sandbox; SandboxCreate is separate because quota
// applies to it. LayerWrite publishes to the shared catalog (snapshot,
// layer build, image import and pull, layer delete), which is why it takes
// a builder: runtime agents hold member keys and must not overwrite what
// others start from.
const (
	SandboxCreate Action = "sandbox.create"
	SandboxRead   Action = "sandbox.read"
	SandboxWrite  Action = "sandbox.write"
	LayerRead     Action = "layer.read"
	LayerWrite    Action = "layer.write"
	ProjectRead   Action = "project.read"
	KeyCreate     Action = "key.create"    // create, list and revoke keys of a role no higher than one's own
	ProjectAdmin  Action = "project.admin" // create, update and delete subprojects
	AuditRead     Action = "audit.read"
)

// minRole is the permission matrix: the least role allowed each action.
// Actions not listed are denied to everyone.
var minRole = map[Action]Role{
	SandboxRead:   RoleViewer,
	LayerRead:     RoleViewer,
	ProjectRead:   RoleViewer,
	SandboxCreate: RoleMember,
	SandboxWrite:  RoleMember,
	LayerWrite:    RoleBuilder,
	KeyCreate:     RoleAdmin,
	ProjectAdmin:  RoleAdmin,
	AuditRead:     RoleAdmin,
}

// Permissions returns the actions role holds, sorted (empty for an unknown
// role): the "permissions" of GET /v1/whoami.
func Permissions(role Role) []string {
	out := []string{}
	for action, need := range minRole {
		if role.rank() != 0 && role.rank() >= need.rank() {
			out = append(out, string(action))
		}
	}
	slices.Sort(out)
	return out
}

// authorize is the pure permission check behind (*IAM).Authorize.
func authorize(p Principal, action Action) error {
	need, ok := minRole[action]
	if !ok {
		return errdefs.PermissionDenied("unknown action %q", action)
	}
	if p.Role.rank() < need.rank() {
		return errdefs.PermissionDenied("role %q may not %s (needs %s)", p.Role, action, need)
	}
	return nil
}

// canGrant reports whether a holder of role from may hand out role to.
func canGrant(from, to Role) error {
	if to.rank() == 0 {
		return errdefs.Invalid("unknown role %q (want %s)", to, roleNames)
	}
	if to.rank() > from.rank() {
		return errdefs.PermissionDenied("role %q may not grant role %q", from, to)
	}
	return nil
}

package iam

import "github.com/dsecproject/dsec/internal/errdefs"

// Role is what a principal may do within its project and the projects below it.
type Role string

// Roles, from least to most powerful. Each holds every permission of the ones
// before it, which is what makes "grant only what you hold" a comparison.
const (
	RoleViewer Role = "viewer"
	RoleMember Role = "member"
	RoleAdmin  Role = "admin"
)

// rank orders roles; unknown roles rank 0 and so hold nothing.
func (r Role) rank() int {
	switch r {
	case RoleViewer:
		return 1
	case RoleMember:
		return 2
	case RoleAdmin:
		return 3
	}
	return 0
}

// ParseRole returns the Role named s, or an errdefs.ErrInvalid error.
func ParseRole(s string) (Role, error) {
	r := Role(s)
	if r.rank() == 0 {
		return "", errdefs.Invalid("unknown role %q (want admin, member or viewer)", s)
	}
	return r, nil
}

// Action is something a principal asks to do. The value is stable and fit
// for logs.
type Action string

// Actions. SandboxWrite covers exec, file writes, lifecycle changes and
// delete of an existing sandbox; SandboxCreate is separate because quota
// applies to it.
const (
	SandboxCreate Action = "sandbox.create"
	SandboxRead   Action = "sandbox.read"
	SandboxWrite  Action = "sandbox.write"
	LayerRead     Action = "layer.read"
	LayerWrite    Action = "layer.write"
	ProjectRead   Action = "project.read"
	KeyCreate     Action = "key.create"    // mint or revoke keys of a role no higher than one's own
	ProjectAdmin  Action = "project.admin" // create subprojects, set quotas
)

// minRole is the permission matrix: the least role allowed each action.
// Actions not listed are denied to everyone.
var minRole = map[Action]Role{
	SandboxRead:   RoleViewer,
	LayerRead:     RoleViewer,
	ProjectRead:   RoleViewer,
	SandboxCreate: RoleMember,
	SandboxWrite:  RoleMember,
	LayerWrite:    RoleMember,
	KeyCreate:     RoleMember,
	ProjectAdmin:  RoleAdmin,
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
		return errdefs.Invalid("unknown role %q (want admin, member or viewer)", to)
	}
	if to.rank() > from.rank() {
		return errdefs.PermissionDenied("role %q may not grant role %q", from, to)
	}
	return nil
}

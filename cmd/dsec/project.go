package main

// The IAM commands: project, key, whoami and audit. Roles are the
// server's to enforce (viewer < member < builder < admin); the CLI only
// checks that what it sends is well formed.

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"regexp"
	"strings"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/iam"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

func runProject(ctx context.Context, args []string) error {
	return dispatchGroup(ctx, "project", []subcommand{
		{"create", "create a project below another and print its id", projectCreate},
		{"list", "list projects with their usage and quota", projectList},
		{"show", "show one project", projectShow},
		{"update", "change a project's quota or dedicated nodes", projectUpdate},
		{"delete", "delete a project", projectDelete},
	}, args)
}

func runKey(ctx context.Context, args []string) error {
	return dispatchGroup(ctx, "key", []subcommand{
		{"create", "mint an API key of a project (shown once)", keyCreate},
		{"list", "list the keys of a project", keyList},
		{"revoke", "revoke a key", keyRevoke},
		{"e2b", "print a key spelled as E2B's SDKs want E2B_API_KEY", keyE2B},
	}, args)
}

// quotaFlags are the limit flags shared by project create and update.
type quotaFlags struct {
	q api.ProjectQuota
}

func (f *quotaFlags) register(fs *cmdFlags) {
	fs.IntVar(&f.q.Sandboxes, "sandboxes", 0, "most live sandboxes (0 = no limit of its own)")
	fs.Float64Var(&f.q.CPU, "cpu", 0, "most CPU cores their specs ask for together (0 = no limit of its own)")
	fs.Int64Var(&f.q.MemoryMB, "memory-mb", 0, "most memory in MiB (0 = no limit of its own)")
	fs.Int64Var(&f.q.DiskMB, "disk-mb", 0, "most disk in MiB (0 = no limit of its own)")
}

func (f *quotaFlags) check(cmd string) error {
	if f.q.Sandboxes < 0 || f.q.CPU < 0 || f.q.MemoryMB < 0 || f.q.DiskMB < 0 {
		return fmt.Errorf("%s: quota values must not be negative", cmd)
	}
	return nil
}

// quotaFlagNames are the flags quotaFlags registers.
var quotaFlagNames = map[string]bool{"sandboxes": true, "cpu": true, "memory-mb": true, "disk-mb": true}

const quotaAbout = "A project and all its descendants together may hold at most its quota;\n" +
	"a zero limit sets none of its own (the nearest ancestor's applies)."

func projectCreate(ctx context.Context, args []string) error {
	fs := newCmdFlags("project create", "NAME [--parent ID|root] [--sandboxes N] [--cpu F] [--memory-mb N] [--disk-mb N] [--dedicated-nodes]",
		"Create project NAME below --parent (default: your key's own project) and\nprint its id.\n\n"+quotaAbout)
	parent := fs.String("parent", "", "parent project `ID`, or root (default: the project of your key)")
	var qf quotaFlags
	qf.register(fs)
	dedicated := fs.Bool("dedicated-nodes", false, "place its sandboxes only on nodes dedicated to it")
	asJSON := fs.Bool("json", false, "print the API response as JSON")
	pos, err := fs.parseN(args, 1, 1)
	if err != nil {
		return err
	}
	if pos[0] == "" {
		return fmt.Errorf("project create: NAME must not be empty")
	}
	if err := qf.check("project create"); err != nil {
		return err
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	if *parent == "" {
		who, err := c.WhoAmI(ctx)
		if err != nil {
			return fmt.Errorf("finding your key's project (or pass --parent): %w", err)
		}
		*parent = who.Project
	}
	p, err := c.CreateProject(ctx, api.CreateProjectRequest{Parent: *parent, Name: pos[0], Quota: qf.q, DedicatedNodes: *dedicated})
	if err != nil {
		return err
	}
	if *asJSON {
		return printJSON(p)
	}
	printf(os.Stdout, "%s\n", p.ID)
	return nil
}

func projectList(ctx context.Context, args []string) error {
	fs := newCmdFlags("project list", "[--parent ID] [--json]",
		"List the projects you can see (all pages), or only the children of\n--parent. Usage counts each project with its descendants; USED/QUOTA\nshows - for a limit the project does not set itself.")
	parent := fs.String("parent", "", "only the children of project `ID`")
	asJSON := fs.Bool("json", false, "print a JSON array")
	if _, err := fs.parseN(args, 0, 0); err != nil {
		return err
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	all, err := c.ListAllProjects(ctx, *parent)
	if err != nil {
		return err
	}
	if *asJSON {
		return printJSONList(all)
	}
	tw := newTable()
	tw.printf("ID\tNAME\tPARENT\tSANDBOXES\tCPU\tMEMORY\tDISK\n")
	for _, p := range all {
		s, cpu, mem, disk := usageCells(p)
		tw.printf("%s\t%s\t%s\t%s\t%s\t%s\t%s\n", p.ID, orDash(p.Name), orDash(p.Parent), s, cpu, mem, disk)
	}
	return tw.Flush()
}

// usageCells renders a project's usage against its quota, "used/quota",
// with "-" for a limit it does not set itself.
func usageCells(p api.Project) (sandboxes, cpu, memory, disk string) {
	of := func(used, quota string, set bool) string {
		if !set {
			quota = "-"
		}
		return used + "/" + quota
	}
	u, q := p.Usage, p.Quota
	sandboxes = of(fmt.Sprint(u.Sandboxes), fmt.Sprint(q.Sandboxes), q.Sandboxes > 0)
	cpu = of(fmt.Sprintf("%g", u.CPU), fmt.Sprintf("%g", q.CPU), q.CPU > 0)
	memory = of(humanBytes(u.MemoryMB<<20), humanBytes(q.MemoryMB<<20), q.MemoryMB > 0)
	disk = of(humanBytes(u.DiskMB<<20), humanBytes(q.DiskMB<<20), q.DiskMB > 0)
	return sandboxes, cpu, memory, disk
}

func projectShow(ctx context.Context, args []string) error {
	fs := newCmdFlags("project show", "[--json] ID", "Show one project: its place in the tree, quota and usage (its own\nsandboxes and those of its descendants).")
	asJSON := fs.Bool("json", false, "print the API response as JSON")
	pos, err := fs.parseN(args, 1, 1)
	if err != nil {
		return err
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	p, err := c.GetProject(ctx, pos[0])
	if err != nil {
		return err
	}
	if *asJSON {
		return printJSON(p)
	}
	s, cpu, mem, disk := usageCells(*p)
	tw := newTable()
	tw.printf("ID:\t%s\n", p.ID)
	tw.printf("Name:\t%s\n", orDash(p.Name))
	tw.printf("Path:\t%s\n", orDash(p.Path))
	tw.printf("Parent:\t%s\n", orDash(p.Parent))
	tw.printf("Children:\t%s\n", orDash(strings.Join(p.Children, ", ")))
	tw.printf("Dedicated nodes:\t%s\n", yesNo(p.DedicatedNodes))
	tw.printf("Sandboxes:\t%s\n", s)
	tw.printf("CPU:\t%s\n", cpu)
	tw.printf("Memory:\t%s\n", mem)
	tw.printf("Disk:\t%s\n", disk)
	if !p.CreatedAt.IsZero() {
		tw.printf("Created:\t%s\n", p.CreatedAt.Local().Format(time.RFC3339))
	}
	return tw.Flush()
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

func projectUpdate(ctx context.Context, args []string) error {
	fs := newCmdFlags("project update", "ID [--sandboxes N] [--cpu F] [--memory-mb N] [--disk-mb N] [--dedicated-nodes=true|false]",
		"Change what the flags given say; the rest stays. The API takes a quota\n"+
			"whole, so a quota flag reads the project first and sends its quota with\n"+
			"the given limits changed.\n\n"+quotaAbout)
	var qf quotaFlags
	qf.register(fs)
	dedicated := fs.Bool("dedicated-nodes", false, "place its sandboxes only on nodes dedicated to it (--dedicated-nodes=false: anywhere)")
	asJSON := fs.Bool("json", false, "print the API response as JSON")
	pos, err := fs.parseN(args, 1, 1)
	if err != nil {
		return err
	}
	if err := qf.check("project update"); err != nil {
		return err
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	var req api.UpdateProjectRequest
	if set["dedicated-nodes"] {
		req.DedicatedNodes = dedicated
	}
	quotaSet := false
	for name := range quotaFlagNames {
		quotaSet = quotaSet || set[name]
	}
	if !quotaSet && req.DedicatedNodes == nil {
		return fmt.Errorf("project update: nothing to change (give a quota flag or --dedicated-nodes)")
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	if quotaSet {
		// Read-modify-write: a change another client makes between the
		// two calls to a limit not given here is overwritten.
		cur, err := c.GetProject(ctx, pos[0])
		if err != nil {
			return err
		}
		q := cur.Quota
		if set["sandboxes"] {
			q.Sandboxes = qf.q.Sandboxes
		}
		if set["cpu"] {
			q.CPU = qf.q.CPU
		}
		if set["memory-mb"] {
			q.MemoryMB = qf.q.MemoryMB
		}
		if set["disk-mb"] {
			q.DiskMB = qf.q.DiskMB
		}
		req.Quota = &q
	}
	p, err := c.UpdateProject(ctx, pos[0], req)
	if err != nil {
		return err
	}
	if *asJSON {
		return printJSON(p)
	}
	s, cpu, mem, disk := usageCells(*p)
	printf(os.Stdout, "%s: sandboxes %s, cpu %s, memory %s, disk %s, dedicated nodes %s\n", p.ID, s, cpu, mem, disk, yesNo(p.DedicatedNodes))
	return nil
}

func projectDelete(ctx context.Context, args []string) error {
	fs := newCmdFlags("project delete", "ID [--cascade]",
		"Delete a project. The server refuses one that has projects below it\nunless --cascade, which deletes them too.")
	cascade := fs.Bool("cascade", false, "delete the projects below it too")
	pos, err := fs.parseN(args, 1, 1)
	if err != nil {
		return err
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	if err := c.DeleteProject(ctx, pos[0], *cascade); err != nil {
		return err
	}
	printf(os.Stdout, "%s\n", pos[0])
	return nil
}

func keyCreate(ctx context.Context, args []string) error {
	fs := newCmdFlags("key create", "PROJECT --role ROLE [--name NAME] [--expires-in DURATION] [--json]",
		"Mint an API key of PROJECT and print it. The key is shown only now (the\n"+
			"server keeps its hash): store it at once. Roles: viewer < member <\n"+
			"builder < admin; a key grants no role above your own.")
	role := fs.String("role", "", "viewer | member | builder | admin (required)")
	name := fs.String("name", "", "a name to tell the key by")
	var expires secondsFlag
	fs.Var(&expires, "expires-in", "lifetime, `seconds` or a duration like 720h (default: it does not expire)")
	asJSON := fs.Bool("json", false, "print the API response (with the key) as JSON")
	pos, err := fs.parseN(args, 1, 1)
	if err != nil {
		return err
	}
	if *role == "" {
		return fmt.Errorf("key create: --role is required")
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	k, err := c.CreateKey(ctx, pos[0], api.CreateKeyRequest{Role: *role, Name: *name, ExpiresIn: int64(expires)})
	if err != nil {
		return err
	}
	if *asJSON {
		err = printJSON(k)
	} else {
		printf(os.Stdout, "%s\n", k.Key)
	}
	printf(os.Stderr, "dsec: key %s (%s in %s) is shown only this once; store it now\n", k.ID, k.Role, k.Project)
	return err
}

func keyList(ctx context.Context, args []string) error {
	fs := newCmdFlags("key list", "[--json] PROJECT", "List the keys of PROJECT (without their secrets).")
	asJSON := fs.Bool("json", false, "print a JSON array")
	pos, err := fs.parseN(args, 1, 1)
	if err != nil {
		return err
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	keys, err := c.ListKeys(ctx, pos[0])
	if err != nil {
		return err
	}
	if *asJSON {
		return printJSONList(keys)
	}
	tw := newTable()
	tw.printf("ID\tNAME\tROLE\tAGE\tEXPIRES\n")
	now := time.Now()
	for _, k := range keys {
		exp := "never"
		if k.ExpiresAt != nil {
			exp = k.ExpiresAt.Local().Format(time.RFC3339)
		}
		tw.printf("%s\t%s\t%s\t%s\t%s\n", k.ID, orDash(k.Name), k.Role, humanAge(k.CreatedAt, now), exp)
	}
	return tw.Flush()
}

func keyRevoke(ctx context.Context, args []string) error {
	fs := newCmdFlags("key revoke", "PROJECT KEY_ID", "Revoke a key of PROJECT: calls made with it fail from then on.")
	pos, err := fs.parseN(args, 2, 2)
	if err != nil {
		return err
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	if err := c.RevokeKey(ctx, pos[0], pos[1]); err != nil {
		return err
	}
	printf(os.Stdout, "%s\n", pos[1])
	return nil
}

func keyE2B(_ context.Context, args []string) error {
	fs := newCmdFlags("key e2b", "[-]",
		"Print the E2B spelling of the key this CLI uses (DSEC_API_KEY, or the config\n"+
			"file's), or with - of a key read from standard input: \"e2b_\" and hex\n"+
			"digits, the only shape recent E2B SDKs take for E2B_API_KEY. dsec's E2B API\n"+
			"takes it for the key it spells: same project, same role.\n\n"+
			"  export E2B_API_KEY=$(dsec key e2b)")
	pos, err := fs.parseN(args, 0, 1)
	if err != nil {
		return err
	}
	s, err := e2bSpelling(pos, os.Stdin, dsec.ResolveConfig)
	if err != nil {
		return err
	}
	printf(os.Stdout, "%s\n", s)
	return nil
}

// e2bKeyShape is the shape E2B's SDKs check an API key against.
var e2bKeyShape = regexp.MustCompile(`(?i)^e2b_[0-9a-f]+$`)

// e2bSpelling is key e2b's answer for its arguments pos: the E2B
// spelling of the key read from stdin ("-") or of the configured one. A
// key that already has E2B's shape is its own spelling.
func e2bSpelling(pos []string, stdin io.Reader, config func() (dsec.Config, error)) (string, error) {
	var key string
	switch {
	case len(pos) == 1 && pos[0] == "-":
		b, err := io.ReadAll(io.LimitReader(stdin, 4096))
		if err != nil {
			return "", fmt.Errorf("key e2b: reading the key: %w", err)
		}
		key = strings.TrimSpace(string(b))
		if key == "" {
			return "", fmt.Errorf("key e2b: no key on standard input")
		}
	case len(pos) == 1:
		return "", fmt.Errorf("key e2b: give the key on standard input (-), not as an argument, which other users can see")
	default:
		cfg, err := config()
		if err != nil {
			return "", err
		}
		if key = cfg.APIKey; key == "" {
			return "", fmt.Errorf("key e2b: this CLI has no key (set DSEC_API_KEY, or run dsec up, which writes one to the config file)")
		}
	}
	if e2bKeyShape.MatchString(key) {
		return key, nil
	}
	s := iam.E2BKey(key)
	if k, ok := iam.FromE2BKey(s); !ok || k != key {
		return "", fmt.Errorf("key e2b: that is not a dsec key (16 to 256 printable characters without spaces)")
	}
	return s, nil
}

func runWhoAmI(ctx context.Context, args []string) error {
	fs := newCmdFlags("whoami", "[--json]", "Show the key the CLI uses: its principal, project, role and what the\nrole permits.")
	asJSON := fs.Bool("json", false, "print the API response as JSON")
	if _, err := fs.parseN(args, 0, 0); err != nil {
		return err
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	who, err := c.WhoAmI(ctx)
	if err != nil {
		return err
	}
	if *asJSON {
		return printJSON(who)
	}
	tw := newTable()
	tw.printf("Principal:\t%s\n", who.Principal)
	tw.printf("Project:\t%s\n", who.Project)
	tw.printf("Role:\t%s\n", who.Role)
	tw.printf("Permissions:\t%s\n", orDash(strings.Join(who.Permissions, ", ")))
	tw.printf("Endpoint:\t%s\n", c.Endpoint())
	return tw.Flush()
}

func runAudit(ctx context.Context, args []string) error {
	fs := newCmdFlags("audit", "[--since DURATION|RFC3339] [--limit N] [--json]",
		"List the management actions (project and key changes) recorded in the\nprojects you can see.")
	sinceArg := fs.String("since", "", "only actions since `WHEN`: a duration back from now (1h, 30m) or an RFC 3339 time")
	limit := fs.Int("limit", 0, "at most `N` entries (0 = the server's default)")
	asJSON := fs.Bool("json", false, "print a JSON array")
	if _, err := fs.parseN(args, 0, 0); err != nil {
		return err
	}
	if *limit < 0 {
		return fmt.Errorf("audit: --limit must not be negative")
	}
	since, err := parseSince(*sinceArg, time.Now())
	if err != nil {
		return fmt.Errorf("audit: --since %w", err)
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	entries, err := c.ListAudit(ctx, since, *limit)
	if err != nil {
		return err
	}
	if *asJSON {
		return printJSONList(entries)
	}
	tw := newTable()
	tw.printf("TIME\tPRINCIPAL\tPROJECT\tACTION\tTARGET\tDETAIL\n")
	for _, e := range entries {
		tw.printf("%s\t%s\t%s\t%s\t%s\t%s\n", e.Time.Local().Format(time.RFC3339), e.Principal, orDash(e.Project),
			e.Action, orDash(e.Target), orDash(oneLine(e.Detail)))
	}
	return tw.Flush()
}

// parseSince reads --since: a duration back from now ("1h", "90m"), or an
// RFC 3339 time. Empty is the zero time (no bound).
func parseSince(s string, now time.Time) (time.Time, error) {
	if s == "" {
		return time.Time{}, nil
	}
	if d, err := time.ParseDuration(s); err == nil {
		if d < 0 {
			return time.Time{}, fmt.Errorf("%q: a duration must not be negative", s)
		}
		return now.Add(-d), nil
	}
	t, err := time.Parse(time.RFC3339, s)
	if err != nil {
		return time.Time{}, fmt.Errorf("%q is neither a duration like 1h nor an RFC 3339 time", s)
	}
	return t, nil
}

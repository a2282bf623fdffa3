package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/dsecproject/dsec/api"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

func runSandbox(ctx context.Context, args []string) error {
	return dispatchGroup(ctx, "sandbox", []subcommand{
		{"create", "create sandboxes and print their ids", sandboxCreate},
		{"list", "list sandboxes", sandboxList},
		{"get", "show one sandbox", sandboxGet},
		{"delete", "delete sandboxes by id or by label", sandboxDelete},
		{"keepalive", "extend a sandbox's lifetime", sandboxKeepalive},
		{"stats", "show a sandbox's resource use", sandboxStats},
		{"log", "show a sandbox's command log", sandboxLog},
		{"pause", "freeze sandboxes and reclaim their memory", sandboxPause},
		{"resume", "thaw paused sandboxes", sandboxResume},
		{"snapshot", "pack a sandbox's writable state into a snapshot layer", sandboxSnapshot},
		{"fork", "start sandboxes from a sandbox's current state", sandboxFork},
		{"network", "replace a sandbox's egress policy, live", sandboxNetwork},
	}, args)
}

func sandboxCreate(ctx context.Context, args []string) error {
	fs := newCmdFlags("sandbox create", "[flags]",
		"Create a sandbox and print its id; with --count N, create N in one batch\nand print one id per line.")
	var spec api.SandboxSpec
	var toolkits, allow, deny stringList
	var ttl, idle secondsFlag
	labels, env, selector := kvFlag{}, kvFlag{}, kvFlag{}
	fs.StringVar(&spec.Base, "base", "", "base layer `REF`, e.g. base/python:3.11")
	fs.StringVar(&spec.Image, "image", "", "image `REF` (instead of --base)")
	fs.StringVar(&spec.Workspace, "workspace", "", "workspace layer `REF`")
	fs.Var(&toolkits, "toolkit", "toolkit layer `REF` (repeatable, applied in order)")
	fs.StringVar(&spec.Snapshot, "snapshot", "", "start from snapshot layer `REF`")
	fs.StringVar(&spec.Backend, "backend", "", "container | gvisor | microvm (default: the platform's)")
	fs.Float64Var(&spec.CPU, "cpu", 0, "CPU cores")
	fs.Int64Var(&spec.MemoryMB, "memory-mb", 0, "memory limit in MiB")
	fs.Int64Var(&spec.DiskMB, "disk-mb", 0, "writable layer quota in MiB")
	fs.Int64Var(&spec.Pids, "pids", 0, "process limit")
	fs.Var(&ttl, "ttl", "maximum lifetime, `seconds` or a duration like 1h (0 = platform default)")
	fs.Var(&idle, "idle-timeout", "stop after this long without requests (`seconds` or duration)")
	fs.Var(labels, "label", "label `k=v` (repeatable)")
	fs.Var(selector, "node-selector", "place only on a node labelled `k=v` (repeatable; dsec edge --node-labels)")
	fs.Var(env, "env", "environment variable `K=V` (repeatable)")
	fs.StringVar(&spec.User, "user", "", "default user for commands")
	fs.StringVar(&spec.Workdir, "workdir", "", "default working directory")
	fs.StringVar(&spec.Project, "project", "", "project `ID` the sandbox belongs to (default: your key's; one below it is allowed)")
	fs.StringVar(&spec.QoS, "qos", "", "ls (latency-sensitive) | be (best-effort)")
	fs.Var(optBool{&spec.UserNS}, "userns", "run in a user namespace, root inside unprivileged on the host (left out: the node decides, a user namespace for container sandboxes where it can; --userns=false: none)")
	fs.StringVar(&spec.MemoryCgroup, "memory-cgroup", "", "own (a memory cgroup of its own, the default) | shared (charged to the node's shared one: denser, no --memory-mb)")
	fs.Var(&allow, "allow", "egress allow rule: preset, CIDR or CIDR:port/proto (repeatable)")
	fs.Var(&deny, "deny", "egress deny rule (repeatable)")
	count := fs.Int("count", 1, "number of sandboxes to create")
	asJSON := fs.Bool("json", false, "print the API response as JSON")
	if _, err := fs.parseN(args, 0, 0); err != nil {
		return err
	}
	if *count < 1 {
		return fmt.Errorf("sandbox create: --count must be at least 1")
	}
	spec.Toolkits = toolkits
	spec.TTL, spec.IdleTimeout = int64(ttl), int64(idle)
	if len(selector) > 0 {
		spec.NodeSelector = selector
	}
	if len(labels) > 0 {
		spec.Labels = labels
	}
	if len(env) > 0 {
		spec.Env = env
	}
	if len(allow) > 0 || len(deny) > 0 {
		spec.Network = &api.NetworkPolicy{Allow: allow, Deny: deny}
	}

	c, err := newClient()
	if err != nil {
		return err
	}
	if *count == 1 {
		sb, err := c.CreateSandbox(ctx, spec)
		if err != nil {
			return err
		}
		if *asJSON {
			return printJSON(sb)
		}
		printf(os.Stdout, "%s\n", sb.ID)
		return nil
	}
	res, err := c.CreateSandboxes(ctx, *count, spec)
	if err != nil {
		return err
	}
	if *asJSON {
		if err := printJSON(res); err != nil {
			return err
		}
	} else {
		for _, sb := range res.Sandboxes {
			printf(os.Stdout, "%s\n", sb.ID)
		}
		for _, e := range res.Errors {
			printf(os.Stderr, "dsec: sandbox #%d: %s: %s\n", e.Index, e.Error.Code, e.Error.Message)
		}
	}
	if len(res.Errors) > 0 {
		return fmt.Errorf("%d of %d sandboxes failed", len(res.Errors), *count)
	}
	return nil
}

func sandboxList(ctx context.Context, args []string) error {
	fs := newCmdFlags("sandbox list", "[flags]", "List sandboxes (all pages).")
	labels := kvFlag{}
	fs.Var(labels, "label", "only sandboxes with label `k=v` (repeatable; all must match)")
	state := fs.String("state", "", "only sandboxes in this state (creating, running, paused, stopped, failed)")
	asJSON := fs.Bool("json", false, "print a JSON array")
	if _, err := fs.parseN(args, 0, 0); err != nil {
		return err
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	opts := dsec.ListOptions{State: *state}
	if len(labels) > 0 {
		opts.Labels = labels
	}
	list, err := c.ListAll(ctx, opts)
	if err != nil {
		return err
	}
	all := list.Sandboxes
	if len(list.UnreachableNodes) > 0 {
		fmt.Fprintf(os.Stderr, "warning: %d node(s) could not be asked, so their sandboxes are not listed: %s\n",
			len(list.UnreachableNodes), strings.Join(list.UnreachableNodes, ", "))
	}
	if *asJSON {
		return printJSONList(all)
	}
	tw := newTable()
	tw.printf("ID\tSTATE\tBASE\tAGE\tLABELS\n")
	now := time.Now()
	for _, sb := range all {
		base := sb.Spec.Base
		if base == "" {
			base = sb.Spec.Image
		}
		tw.printf("%s\t%s\t%s\t%s\t%s\n", sb.ID, sb.State, orDash(base),
			humanAge(sb.CreatedAt, now), orDash(formatKV(sb.Labels)))
	}
	return tw.Flush()
}

func sandboxGet(ctx context.Context, args []string) error {
	fs := newCmdFlags("sandbox get", "[--json] ID", "Show one sandbox.")
	asJSON := fs.Bool("json", false, "print the API response as JSON")
	pos, err := fs.parseN(args, 1, 1)
	if err != nil {
		return err
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	sb, err := c.GetSandbox(ctx, pos[0])
	if err != nil {
		return err
	}
	if *asJSON {
		return printJSON(sb)
	}
	tw := newTable()
	row := func(k, v string) {
		if v != "" {
			tw.printf("%s:\t%s\n", k, v)
		}
	}
	row("ID", sb.ID)
	row("State", sb.State)
	row("Error", sb.Error)
	row("Project", sb.Project)
	row("Node", sb.Node)
	row("Backend", sb.Backend)
	row("Base", sb.Spec.Base)
	row("Image", sb.Spec.Image)
	row("Workspace", sb.Spec.Workspace)
	row("Toolkits", strings.Join(sb.Spec.Toolkits, ", "))
	row("Snapshot", sb.Spec.Snapshot)
	row("Labels", formatKV(sb.Labels))
	if n := sb.Spec.Network; n != nil {
		row("Network allow", strings.Join(n.Allow, ", "))
		row("Network deny", strings.Join(n.Deny, ", "))
	} else {
		row("Network", "loopback only")
	}
	if !sb.CreatedAt.IsZero() {
		row("Created", sb.CreatedAt.Local().Format(time.RFC3339))
	}
	if sb.ExpiresAt != nil {
		row("Expires", sb.ExpiresAt.Local().Format(time.RFC3339))
	}
	if sb.LastActiveAt != nil {
		row("Last active", sb.LastActiveAt.Local().Format(time.RFC3339))
	}
	var limits []string
	if sb.Spec.CPU > 0 {
		limits = append(limits, fmt.Sprintf("cpu=%g", sb.Spec.CPU))
	}
	if sb.Spec.MemoryMB > 0 {
		limits = append(limits, fmt.Sprintf("memory=%dMiB", sb.Spec.MemoryMB))
	}
	if sb.Spec.MemoryCgroup == api.MemoryCgroupShared {
		limits = append(limits, "memory=shared")
	}
	if sb.Spec.DiskMB > 0 {
		limits = append(limits, fmt.Sprintf("disk=%dMiB", sb.Spec.DiskMB))
	}
	if sb.Spec.Pids > 0 {
		limits = append(limits, fmt.Sprintf("pids=%d", sb.Spec.Pids))
	}
	row("Limits", strings.Join(limits, " "))
	return tw.Flush()
}

func sandboxDelete(ctx context.Context, args []string) error {
	fs := newCmdFlags("sandbox delete", "ID... | --label k=v ...",
		"Delete sandboxes by id, or every sandbox carrying all the given labels.\nDeleting an unknown id succeeds (delete is idempotent).")
	labels := kvFlag{}
	fs.Var(labels, "label", "delete sandboxes with label `k=v` (repeatable; all must match)")
	ids, err := fs.parseN(args, 0, -1)
	if err != nil {
		return err
	}
	if (len(ids) == 0) == (len(labels) == 0) {
		return fmt.Errorf("sandbox delete: give either ids or --label, not both or neither")
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	if len(labels) > 0 {
		n, err := c.DeleteSandboxes(ctx, labels)
		if err != nil && !nodesUnreachable(err) {
			return err
		}
		// With nodes that could not be asked: the count, then the error.
		fmt.Printf("deleted %d sandboxes\n", n)
		return err
	}
	failed := 0
	for _, id := range ids {
		if err := c.DeleteSandbox(ctx, id); err != nil {
			if ctx.Err() != nil {
				return err
			}
			printf(os.Stderr, "dsec: %s: %v\n", id, err)
			failed++
			continue
		}
		printf(os.Stdout, "%s\n", id)
	}
	if failed > 0 {
		return fmt.Errorf("%d of %d deletes failed", failed, len(ids))
	}
	return nil
}

func sandboxNetwork(ctx context.Context, args []string) error {
	fs := newCmdFlags("sandbox network", "ID [--allow RULE]... [--deny RULE]...",
		"Replace a sandbox's egress policy, live: connections the new policy does\n"+
			"not permit stop at once. No rules makes it loopback-only in effect.\n"+
			"RULE: a preset (pypi, npm, github, ...), a domain (*.example.org) or an\n"+
			"IPv4 prefix, each with optional :port[-port] and /tcp|/udp|/icmp.")
	var allow, deny stringList
	fs.Var(&allow, "allow", "egress allow `RULE` (repeatable)")
	fs.Var(&deny, "deny", "egress deny `RULE` (repeatable)")
	pos, err := fs.parseN(args, 1, 1)
	if err != nil {
		return err
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	sb, err := c.SetNetwork(ctx, pos[0], api.NetworkPolicy{Allow: allow, Deny: deny})
	if err != nil {
		return err
	}
	if sb.Spec.Network == nil {
		printf(os.Stdout, "%s: loopback only\n", sb.ID)
		return nil
	}
	printf(os.Stdout, "%s: allow [%s] deny [%s]\n", sb.ID, strings.Join(sb.Spec.Network.Allow, ", "), strings.Join(sb.Spec.Network.Deny, ", "))
	return nil
}

func sandboxKeepalive(ctx context.Context, args []string) error {
	fs := newCmdFlags("sandbox keepalive", "ID --ttl SECONDS", "Extend a sandbox's lifetime: it then expires --ttl from now.")
	var ttl secondsFlag
	fs.Var(&ttl, "ttl", "new remaining lifetime, `seconds` or a duration like 30m (required)")
	pos, err := fs.parseN(args, 1, 1)
	if err != nil {
		return err
	}
	if ttl <= 0 {
		return fmt.Errorf("sandbox keepalive: --ttl is required")
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	if err := c.Keepalive(ctx, pos[0], time.Duration(ttl)*time.Second); err != nil {
		return err
	}
	printf(os.Stdout, "%s: expires in %ds\n", pos[0], int64(ttl))
	return nil
}

func sandboxStats(ctx context.Context, args []string) error {
	fs := newCmdFlags("sandbox stats", "[--json] ID", "Show a sandbox's current resource use.")
	asJSON := fs.Bool("json", false, "print the API response as JSON")
	pos, err := fs.parseN(args, 1, 1)
	if err != nil {
		return err
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	st, err := c.Stats(ctx, pos[0])
	if err != nil {
		return err
	}
	if *asJSON {
		return printJSON(st)
	}
	mem := humanBytes(int64(st.MemoryBytes))
	if st.MemoryMaxBytes > 0 {
		mem += " / " + humanBytes(int64(st.MemoryMaxBytes))
	}
	tw := newTable()
	tw.printf("CPU time:\t%s\n", time.Duration(st.CPUUsageNS).Round(time.Millisecond))
	tw.printf("Memory:\t%s\n", mem)
	tw.printf("Pids:\t%d\n", st.Pids)
	tw.printf("Disk:\t%s\n", humanBytes(int64(st.DiskBytes)))
	return tw.Flush()
}

func sandboxPause(ctx context.Context, args []string) error {
	return pauseOrResume(ctx, args, true)
}

func sandboxResume(ctx context.Context, args []string) error {
	return pauseOrResume(ctx, args, false)
}

// pauseOrResume serves `sandbox pause` and `sandbox resume`, by id or by
// label (a whole job at once).
func pauseOrResume(ctx context.Context, args []string, pause bool) error {
	verb, about := "resume", "Thaw paused sandboxes, by id or every one carrying all the given labels."
	if pause {
		verb, about = "pause", "Freeze sandboxes (cgroup freezer) and reclaim their memory, by id or\n"+
			"every one carrying all the given labels. Any exec, session or files call\n"+
			"on a paused sandbox resumes it; its TTL does not run while paused."
	}
	fs := newCmdFlags("sandbox "+verb, "ID... | --label k=v ...", about)
	labels := kvFlag{}
	fs.Var(labels, "label", verb+" sandboxes with label `k=v` (repeatable; all must match)")
	asJSON := fs.Bool("json", false, "print the API responses as JSON")
	ids, err := fs.parseN(args, 0, -1)
	if err != nil {
		return err
	}
	if (len(ids) == 0) == (len(labels) == 0) {
		return fmt.Errorf("sandbox %s: give either ids or --label, not both or neither", verb)
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	if len(labels) > 0 {
		var n int
		if pause {
			n, err = c.PauseSandboxes(ctx, labels)
		} else {
			n, err = c.ResumeSandboxes(ctx, labels)
		}
		if err != nil && !nodesUnreachable(err) {
			return err
		}
		fmt.Printf("%sd %d sandboxes\n", verb, n)
		return err
	}
	failed := 0
	for _, id := range ids {
		var out any
		if pause {
			var res *api.PauseResult
			if res, err = c.Pause(ctx, id); err == nil {
				out = res
				if !*asJSON {
					printf(os.Stdout, "%s paused in %d ms, freed %s (%s -> %s)\n", id, res.DurationMS,
						humanBytes(int64(res.MemoryFreedBytes)), humanBytes(int64(res.MemoryBeforeBytes)), humanBytes(int64(res.MemoryAfterBytes)))
				}
			}
		} else {
			var sb *api.Sandbox
			if sb, err = c.Resume(ctx, id); err == nil {
				out = sb
				if !*asJSON {
					printf(os.Stdout, "%s %s\n", id, sb.State)
				}
			}
		}
		if err != nil {
			if ctx.Err() != nil {
				return err
			}
			printf(os.Stderr, "dsec: %s: %v\n", id, err)
			failed++
			continue
		}
		if *asJSON {
			if err := printJSON(out); err != nil {
				return err
			}
		}
	}
	if failed > 0 {
		return fmt.Errorf("%d of %d %ss failed", failed, len(ids), verb)
	}
	return nil
}

func sandboxSnapshot(ctx context.Context, args []string) error {
	fs := newCmdFlags("sandbox snapshot", "ID --ref snapshot/NAME:TAG [--include PATH]... [--exclude PATH]...",
		"Pack the sandbox's writable layer (what it changed on top of its layers)\n"+
			"into a snapshot layer. Start sandboxes from it with\n"+
			"`dsec sandbox create --snapshot REF`. --exclude scrubs paths (e.g.\n"+
			"/root/.cache); --include keeps only the given paths.")
	ref := fs.String("ref", "", "snapshot ref, snapshot/NAME:TAG (required)")
	var include, exclude stringList
	fs.Var(&include, "include", "keep only this `path` (repeatable)")
	fs.Var(&exclude, "exclude", "leave out this `path` (repeatable)")
	asJSON := fs.Bool("json", false, "print the layer as JSON")
	pos, err := fs.parseN(args, 1, 1)
	if err != nil {
		return err
	}
	if *ref == "" {
		return fmt.Errorf("sandbox snapshot: --ref is required")
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	l, err := c.Snapshot(ctx, pos[0], api.SnapshotRequest{Ref: *ref, Include: include, Exclude: exclude})
	if err != nil {
		return err
	}
	if *asJSON {
		return printJSON(l)
	}
	printf(os.Stdout, "%s %s %s\n", l.Ref, l.Digest, humanBytes(l.SizeBytes))
	return nil
}

func sandboxFork(ctx context.Context, args []string) error {
	fs := newCmdFlags("sandbox fork", "ID --count N [--label k=v]...",
		"Snapshot the sandbox's current state and start N sandboxes from it\n"+
			"(same spec; labels added). Prints one id per line.")
	count := fs.Int("count", 1, "how many sandboxes to start")
	labels := kvFlag{}
	fs.Var(labels, "label", "add label `k=v` to the forks (repeatable)")
	asJSON := fs.Bool("json", false, "print the API response as JSON")
	pos, err := fs.parseN(args, 1, 1)
	if err != nil {
		return err
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	res, err := c.Fork(ctx, pos[0], *count, labels)
	if err != nil {
		return err
	}
	if *asJSON {
		return printJSON(res)
	}
	for _, sb := range res.Sandboxes {
		printf(os.Stdout, "%s\n", sb.ID)
	}
	for _, e := range res.Errors {
		printf(os.Stderr, "dsec: fork %d: %s\n", e.Index, e.Error.Message)
	}
	if len(res.Errors) > 0 {
		return fmt.Errorf("%d of %d forks failed", len(res.Errors), *count)
	}
	return nil
}

func sandboxLog(ctx context.Context, args []string) error {
	fs := newCmdFlags("sandbox log", "[--since N] [--json] ID",
		"Show a sandbox's command log: every exec, session and files operation,\n"+
			"in order, with a summary of its request and result. Stopped and failed\n"+
			"sandboxes keep theirs while their record is kept.")
	since := fs.Int64("since", 0, "only entries with a seq greater than `N`")
	asJSON := fs.Bool("json", false, "print the entries as a JSON array")
	pos, err := fs.parseN(args, 1, 1)
	if err != nil {
		return err
	}
	if *since < 0 {
		return fmt.Errorf("sandbox log: --since must not be negative")
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	entries, err := c.ReadAllLog(ctx, pos[0], *since)
	if err != nil {
		return err
	}
	if *asJSON {
		return printJSONList(entries)
	}
	tw := newTable()
	tw.printf("SEQ\tTIME\tKIND\tREQUEST\tRESULT\n")
	for _, e := range entries {
		tw.printf("%d\t%s\t%s\t%s\t%s\n", e.Seq, e.Time.Local().Format("15:04:05.000"), e.Kind,
			orDash(oneLine(logRequestText(e))), orDash(oneLine(logResultText(e))))
	}
	return tw.Flush()
}

// logRequestText is the human summary of what a logged operation asked.
func logRequestText(e api.LogEntry) string {
	q := e.Request
	switch {
	case e.Kind == api.LogTruncatedKind:
		return ""
	case q.Cmd != "":
		return q.Cmd
	case len(q.Argv) > 0:
		return strings.Join(q.Argv, " ")
	case q.Command != "":
		return q.SessionID + ": " + q.Command
	case q.Path != "":
		s := q.Path
		if q.Mode != "" {
			s += " mode " + q.Mode
		}
		if q.Recursive {
			s += " (recursive)"
		}
		return s
	case q.SessionID != "":
		return q.SessionID
	}
	return q.Shell
}

// logResultText is the human summary of how a logged operation ended.
func logResultText(e api.LogEntry) string {
	r := e.Result
	var parts []string
	switch {
	case e.Kind == api.LogTruncatedKind:
		return fmt.Sprintf("entries %d..%d dropped (log bound)", r.FirstSeq, r.LastSeq)
	case r.Error != nil:
		parts = append(parts, r.Error.Code+": "+r.Error.Message)
	case r.ExitCode != nil:
		parts = append(parts, fmt.Sprintf("exit %d", *r.ExitCode))
		if r.TimedOut {
			parts = append(parts, "timed out")
		}
		if r.SessionEnded {
			parts = append(parts, "session ended")
		}
	case r.SessionID != "":
		parts = append(parts, r.SessionID)
	case r.Entries != nil:
		parts = append(parts, fmt.Sprintf("%d entries", *r.Entries))
	case r.Files != nil:
		parts = append(parts, fmt.Sprintf("%d files", *r.Files))
	case r.Size != nil:
		parts = append(parts, humanBytes(*r.Size))
	case r.Bytes != nil:
		parts = append(parts, humanBytes(*r.Bytes))
	default:
		parts = append(parts, "ok")
	}
	return strings.Join(append(parts, fmt.Sprintf("%dms", r.DurationMS)), ", ")
}

// oneLine keeps a table cell on one line and short.
func oneLine(s string) string {
	s = strings.Join(strings.Fields(s), " ")
	if r := []rune(s); len(r) > 60 {
		s = string(r[:59]) + "…"
	}
	return s
}

// nodesUnreachable reports whether err is a call by labels that could not
// ask some nodes (its count is still worth printing).
func nodesUnreachable(err error) bool {
	return errors.As(err, new(*dsec.NodesUnreachableError))
}

package main

import (
	"context"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/dsecproject/dsec/api"
)

// Template aliases: the names an E2B templateID may give (docs/e2b.md).

func runTemplate(ctx context.Context, args []string) error {
	return dispatchGroup(ctx, "template", []subcommand{
		{"alias", "name a layer stack for the E2B API's templateID", templateAlias},
		{"list", "list template aliases", templateList},
		{"rm", "remove a template alias", templateRemove},
	}, args)
}

func templateAlias(ctx context.Context, args []string) error {
	fs := newCmdFlags("template alias", "NAME --base REF [--workspace REF] [--toolkit REF]... [--user USER] [--backend B] [--json]",
		"Make NAME an E2B template: Sandbox.create(\"NAME\") in the E2B SDK then starts a\n"+
			"sandbox on these layers as USER (default: the base image's user). The alias\n"+
			"\"base\" is the E2B SDK's default template.")
	base := fs.String("base", "", "base layer `REF`, e.g. base/debian:12 (required)")
	workspace := fs.String("workspace", "", "workspace layer `REF`")
	var toolkits stringList
	fs.Var(&toolkits, "toolkit", "toolkit layer `REF` (repeatable, applied in order)")
	user := fs.String("user", "", "user the sandbox's processes run as, e.g. user (E2B's code expects user with home /home/user)")
	backend := fs.String("backend", "", "backend its sandboxes run on: container (the default), gvisor or microvm")
	asJSON := fs.Bool("json", false, "print the API response as JSON")
	pos, err := fs.parseN(args, 1, 1)
	if err != nil {
		return err
	}
	if *base == "" {
		return fmt.Errorf("template alias: --base is required")
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	t, err := c.CreateTemplate(ctx, api.Template{Name: pos[0], Base: *base, Workspace: *workspace, Toolkits: toolkits, User: *user, Backend: *backend})
	if err != nil {
		return err
	}
	if *asJSON {
		return printJSON(t)
	}
	if t.Backend != "" {
		printf(os.Stdout, "%s -> %s (%s)\n", t.Name, templateLayers(*t), t.Backend)
		return nil
	}
	printf(os.Stdout, "%s -> %s\n", t.Name, templateLayers(*t))
	return nil
}

// templateLayers is an alias's layers, bottom first, as "a + b + c".
func templateLayers(t api.Template) string {
	refs := []string{t.Base}
	if t.Workspace != "" {
		refs = append(refs, t.Workspace)
	}
	return strings.Join(append(refs, t.Toolkits...), " + ")
}

func templateList(ctx context.Context, args []string) error {
	fs := newCmdFlags("template list", "[--json]", "List the template aliases this key may see.")
	asJSON := fs.Bool("json", false, "print a JSON array")
	if _, err := fs.parseN(args, 0, 0); err != nil {
		return err
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	ts, err := c.ListTemplates(ctx)
	if err != nil {
		return err
	}
	if *asJSON {
		return printJSONList(ts)
	}
	tw := newTable()
	tw.printf("NAME\tLAYERS\tUSER\tBACKEND\tPROJECT\tAGE\n")
	now := time.Now()
	for _, t := range ts {
		tw.printf("%s\t%s\t%s\t%s\t%s\t%s\n", t.Name, templateLayers(t), orDash(t.User), orDash(t.Backend), orDash(t.Project), humanAge(t.CreatedAt, now))
	}
	return tw.Flush()
}

func templateRemove(ctx context.Context, args []string) error {
	fs := newCmdFlags("template rm", "NAME", "Remove a template alias. Sandboxes made from it keep running.")
	pos, err := fs.parseN(args, 1, 1)
	if err != nil {
		return err
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	return c.DeleteTemplate(ctx, pos[0])
}

package api

import (
	"bytes"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The module takes no YAML dependency, so these tests read openapi.yaml with
// a small outline parser that understands the subset the document is written
// in: block mappings, block sequences, block scalars (| and >), flow lists
// ([a, b]) and single-line scalars. Anything else is reported as an error, so
// the document stays in that subset; so is a plain (unquoted) scalar that a
// YAML parser would read otherwise (see plainScalarProblem).

// outline is the block structure of a YAML document: every mapping key and
// sequence item (named "-0", "-1", ...) by its path from the root.
type outline struct {
	values   map[string]string   // joined path -> scalar value ("" for parents)
	children map[string][]string // joined path -> child keys, in order
}

const sep = "\x00"

func join(path []string) string { return strings.Join(path, sep) }

func (o *outline) has(path ...string) bool {
	_, ok := o.values[join(path)]
	return ok
}

func (o *outline) value(path ...string) string { return o.values[join(path)] }

func (o *outline) keys(path ...string) []string {
	if len(path) == 0 {
		return o.children[""]
	}
	return o.children[join(path)]
}

// parseOutline parses doc, reporting through t every line it cannot read
// and every duplicate key.
func parseOutline(t *testing.T, doc string) *outline {
	t.Helper()
	type frame struct {
		indent int
		key    string
	}
	o := &outline{values: map[string]string{}, children: map[string][]string{}}
	var stack []frame
	items := map[string]int{}
	path := func() []string {
		p := make([]string, len(stack))
		for i, f := range stack {
			p[i] = f.key
		}
		return p
	}
	pop := func(col int) {
		for len(stack) > 0 && stack[len(stack)-1].indent >= col {
			stack = stack[:len(stack)-1]
		}
	}
	push := func(lineNo, col int, key, value string) {
		parent := join(path())
		stack = append(stack, frame{col, key})
		full := join(path())
		if _, dup := o.values[full]; dup {
			t.Errorf("openapi.yaml:%d: duplicate key %q", lineNo, strings.ReplaceAll(full, sep, "."))
		}
		o.values[full] = value
		o.children[parent] = append(o.children[parent], key)
	}

	block := -1 // indent of the key that owns the block scalar being read
	var blockKey string
	for i, line := range strings.Split(doc, "\n") {
		lineNo := i + 1
		if strings.Contains(line, "\t") {
			t.Errorf("openapi.yaml:%d: tab character", lineNo)
		}
		trimmed := strings.TrimLeft(line, " ")
		indent := len(line) - len(trimmed)
		if block >= 0 {
			if trimmed == "" || indent > block {
				o.values[blockKey] += strings.TrimSpace(line) + "\n"
				continue
			}
			block = -1
		}
		if trimmed == "" || strings.HasPrefix(trimmed, "#") {
			continue
		}
		col, rest := indent, trimmed
		isItem := false
		for rest == "-" || strings.HasPrefix(rest, "- ") {
			pop(col)
			parent := join(path())
			n := items[parent]
			items[parent]++
			push(lineNo, col, "-"+strconv.Itoa(n), "")
			after := strings.TrimLeft(rest[1:], " ")
			col += len(rest) - len(after)
			rest = after
			isItem = true
		}
		if rest == "" {
			continue
		}
		key, value, ok := splitKey(rest)
		if !ok {
			if isItem {
				if p := plainScalarProblem(rest); p != "" {
					t.Errorf("openapi.yaml:%d: %s (quote the value)", lineNo, p)
				}
				o.values[join(path())] = unquote(rest)
				continue
			}
			t.Errorf("openapi.yaml:%d: cannot read %q", lineNo, line)
			continue
		}
		if p := plainScalarProblem(value); p != "" {
			t.Errorf("openapi.yaml:%d: %s (quote the value)", lineNo, p)
		}
		value = unquote(value)
		pop(col)
		push(lineNo, col, key, value)
		switch value {
		case "|", "|-", "|+", ">", ">-", ">+":
			block, blockKey = col, join(path())
			o.values[blockKey] = ""
		}
	}
	return o
}

// splitKey splits "key: value" (key possibly quoted; value as written, quotes
// included); ok is false for a line that is not a mapping entry.
func splitKey(s string) (key, value string, ok bool) {
	if s[0] == '"' || s[0] == '\'' {
		end := strings.IndexByte(s[1:], s[0])
		if end < 0 {
			return "", "", false
		}
		key, after := s[1:end+1], s[end+2:]
		if after != ":" && !strings.HasPrefix(after, ": ") {
			return "", "", false
		}
		return key, strings.TrimSpace(after[1:]), true
	}
	if i := strings.Index(s, ": "); i >= 0 {
		return s[:i], strings.TrimSpace(s[i+2:]), true
	}
	if strings.HasSuffix(s, ":") {
		return s[:len(s)-1], "", true
	}
	return "", "", false
}

// plainScalarProblem says why the single-line value v, as written, would not
// be read by a YAML parser as the text it shows ("" when it would be): an
// unquoted ": " starts a nested mapping (an error), " #" a comment, and some
// characters may not start a plain scalar. Quoted values, flow lists and
// block scalar indicators are left alone.
func plainScalarProblem(v string) string {
	if v == "" {
		return ""
	}
	switch v[0] {
	case '"', '\'', '[', '|', '>':
		return ""
	case '{', '`', '@', '*', '&', '!', '%', ',', ']', '}':
		return fmt.Sprintf("plain scalar %q starts with %q", cutText(v), v[0])
	}
	switch {
	case strings.Contains(v, ": ") || strings.HasSuffix(v, ":"):
		return fmt.Sprintf("plain scalar %q contains \": \"", cutText(v))
	case strings.Contains(v, " #"):
		return fmt.Sprintf("plain scalar %q contains \" #\", which starts a comment", cutText(v))
	}
	return ""
}

func cutText(s string) string {
	if len(s) > 60 {
		return s[:60] + "..."
	}
	return s
}

func unquote(s string) string {
	if len(s) >= 2 && (s[0] == '"' || s[0] == '\'') && s[len(s)-1] == s[0] {
		return s[1 : len(s)-1]
	}
	return s
}

// flowList reads a flow sequence such as "[a, b]".
func flowList(s string) []string {
	s = strings.TrimSpace(s)
	if !strings.HasPrefix(s, "[") || !strings.HasSuffix(s, "]") {
		return nil
	}
	var out []string
	for _, f := range strings.Split(s[1:len(s)-1], ",") {
		if f = unquote(strings.TrimSpace(f)); f != "" {
			out = append(out, f)
		}
	}
	return out
}

func loadOutline(t *testing.T) *outline {
	t.Helper()
	if len(OpenAPI) == 0 {
		t.Fatal("OpenAPI is empty: openapi.yaml not embedded")
	}
	return parseOutline(t, string(OpenAPI))
}

func TestOpenAPIEmbedsFile(t *testing.T) {
	b, err := os.ReadFile("openapi.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(b, OpenAPI) {
		t.Error("OpenAPI differs from openapi.yaml")
	}
}

func TestOpenAPIHeader(t *testing.T) {
	o := loadOutline(t)
	if !bytes.HasPrefix(OpenAPI, []byte("openapi: 3.0.")) {
		t.Errorf("document does not start with \"openapi: 3.0.\"")
	}
	if v := o.value("openapi"); v != "3.0.3" {
		t.Errorf("openapi = %q, want 3.0.3", v)
	}
	for _, k := range []string{"title", "version", "description"} {
		if o.value("info", k) == "" {
			t.Errorf("info.%s is missing", k)
		}
	}
	if !o.has("x-dsec-planned") {
		t.Error("x-dsec-planned is missing")
	}
}

// implemented is every operation of this release; the document must
// describe exactly these (planned ones go in x-dsec-planned only).
var implemented = map[string][]string{
	"/healthz":                               {"get"},
	"/metrics":                               {"get"},
	"/v1/openapi.yaml":                       {"get"},
	"/v1/sandboxes":                          {"get", "post"},
	"/v1/sandboxes:batch":                    {"post"},
	"/v1/sandboxes:delete":                   {"post"},
	"/v1/sandboxes/{id}":                     {"delete", "get"},
	"/v1/sandboxes/{id}/keepalive":           {"post"},
	"/v1/sandboxes/{id}/stats":               {"get"},
	"/v1/sandboxes/{id}/log":                 {"get"},
	"/v1/sandboxes/{id}/pause":               {"post"},
	"/v1/sandboxes/{id}/resume":              {"post"},
	"/v1/sandboxes/{id}/network":             {"put"},
	"/v1/sandboxes/{id}/ports/{port}/{path}": {"delete", "get", "head", "options", "patch", "post", "put"},
	"/v1/sandboxes:pause":                    {"post"},
	"/v1/sandboxes:resume":                   {"post"},
	"/v1/sandboxes/{id}/snapshot":            {"post"},
	"/v1/sandboxes/{id}/fork":                {"post"},
	"/v1/sandboxes/{id}/exec":                {"post"},
	"/v1/sandboxes/{id}/sessions":            {"post"},
	"/v1/sandboxes/{id}/sessions/{sid}/run":  {"post"},
	"/v1/sandboxes/{id}/sessions/{sid}":      {"delete"},
	"/v1/sandboxes/{id}/pty":                 {"get"},
	"/v1/sandboxes/{id}/files":               {"delete", "get", "put"},
	"/v1/sandboxes/{id}/files:list":          {"get"},
	"/v1/sandboxes/{id}/files:stat":          {"get"},
	"/v1/sandboxes/{id}/files:tar":           {"get", "put"},
	"/v1/layers":                             {"get", "post"},
	"/v1/layers/{ref}":                       {"delete", "get"},
	"/v1/templates":                          {"get", "post"},
	"/v1/templates/{name}":                   {"delete", "get"},
	"/v1/images:import":                      {"post"},
	"/v1/images:pull":                        {"post"},
	"/v1/layers:push":                        {"post"},
	"/v1/layers:add":                         {"post"},
	"/v1/layers:gc":                          {"post"},
	"/v1/nodes":                              {"get"},
	"/v1/fncall":                             {"post"},
	"/v1/projects":                           {"get", "post"},
	"/v1/projects/{id}":                      {"delete", "get", "patch"},
	"/v1/projects/{id}/keys":                 {"get", "post"},
	"/v1/projects/{id}/keys/{key_id}":        {"delete"},
	"/v1/whoami":                             {"get"},
	"/v1/audit":                              {"get"},
}

var httpMethods = map[string]bool{
	"get": true, "put": true, "post": true, "delete": true,
	"options": true, "head": true, "patch": true, "trace": true,
}

func sorted(s []string) []string {
	s = append([]string(nil), s...)
	sort.Strings(s)
	return s
}

func TestOpenAPIPaths(t *testing.T) {
	o := loadOutline(t)
	documented := map[string]bool{}
	for _, p := range o.keys("paths") {
		documented[p] = true
		want, ok := implemented[p]
		if !ok {
			t.Errorf("path %s is documented but not implemented in this release", p)
			continue
		}
		var got []string
		for _, k := range o.keys("paths", p) {
			if httpMethods[k] {
				got = append(got, k)
			}
		}
		if !reflect.DeepEqual(sorted(got), sorted(want)) {
			t.Errorf("path %s: methods %v, want %v", p, sorted(got), sorted(want))
		}
	}
	for p := range implemented {
		if !documented[p] {
			t.Errorf("path %s is missing", p)
		}
	}
}

func TestOpenAPIOperations(t *testing.T) {
	o := loadOutline(t)
	if o.value("components", "securitySchemes", "bearerAuth", "type") != "http" ||
		o.value("components", "securitySchemes", "bearerAuth", "scheme") != "bearer" {
		t.Error("securitySchemes.bearerAuth must be an http bearer scheme")
	}
	if !o.has("security", "-0", "bearerAuth") {
		t.Error("bearerAuth is not the global security requirement")
	}
	opIDs := map[string]string{}
	for _, p := range o.keys("paths") {
		for _, m := range o.keys("paths", p) {
			if !httpMethods[m] {
				continue
			}
			op := []string{"paths", p, m}
			name := m + " " + p
			id := o.value(append(op, "operationId")...)
			if id == "" {
				t.Errorf("%s: no operationId", name)
			} else if prev, dup := opIDs[id]; dup {
				t.Errorf("%s: operationId %q already used by %s", name, id, prev)
			}
			opIDs[id] = name
			if o.value(append(op, "summary")...) == "" {
				t.Errorf("%s: no summary", name)
			}
			codes := o.keys(append(op, "responses")...)
			ok2xx := false
			for _, c := range codes {
				ok2xx = ok2xx || strings.HasPrefix(c, "2") || c == "101" // 101: a WebSocket
			}
			if !ok2xx {
				t.Errorf("%s: no 2xx response", name)
			}
			sec, overridden := o.values[join(append(op, "security"))]
			if strings.HasPrefix(p, "/v1/") {
				if overridden {
					t.Errorf("%s: /v1 operations must keep the global bearer auth", name)
				}
				for _, c := range []string{"401", "403", "500"} {
					if !o.has(append(op, "responses", c)...) {
						t.Errorf("%s: no %s response", name, c)
					}
				}
			} else if !overridden || sec != "[]" {
				t.Errorf("%s: must be unauthenticated (security: [])", name)
			}
			checkPathParams(t, o, p, m)
		}
	}
}

// checkPathParams checks that every {name} of path p is declared as a path
// parameter, at the path or the operation level.
func checkPathParams(t *testing.T, o *outline, p, m string) {
	t.Helper()
	declared := map[string]bool{}
	for _, level := range [][]string{{"paths", p, "parameters"}, {"paths", p, m, "parameters"}} {
		for _, item := range o.keys(level...) {
			param := append(append([]string(nil), level...), item)
			if ref := o.value(append(param, "$ref")...); ref != "" {
				param = strings.Split(strings.TrimPrefix(ref, "#/"), "/")
			}
			if o.value(append(param, "in")...) == "path" {
				declared[o.value(append(param, "name")...)] = true
				if o.value(append(param, "required")...) != "true" {
					t.Errorf("%s %s: path parameter %s not required", m, p, o.value(append(param, "name")...))
				}
			}
		}
	}
	for _, seg := range strings.Split(p, "/") {
		if strings.HasPrefix(seg, "{") && strings.HasSuffix(seg, "}") {
			if name := seg[1 : len(seg)-1]; !declared[name] {
				t.Errorf("%s %s: path parameter %s is not declared", m, p, name)
			}
		}
	}
}

func TestOpenAPIRefsResolve(t *testing.T) {
	o := loadOutline(t)
	n := 0
	for k, v := range o.values {
		path := strings.Split(k, sep)
		if path[len(path)-1] != "$ref" {
			continue
		}
		n++
		if !strings.HasPrefix(v, "#/components/") || !o.has(strings.Split(v[2:], "/")...) {
			t.Errorf("%s: $ref %q does not resolve", strings.ReplaceAll(k, sep, "."), v)
		}
	}
	if n == 0 {
		t.Error("no $ref found: the outline parser is broken")
	}
}

func TestOpenAPIErrors(t *testing.T) {
	o := loadOutline(t)
	status := map[string]string{
		"invalid_argument":    "400",
		"unauthenticated":     "401",
		"permission_denied":   "403",
		"not_found":           "404",
		"already_exists":      "409",
		"failed_precondition": "409",
		"quota_exceeded":      "429",
		"internal":            "500",
		"resource_exhausted":  "503",
	}
	enum := map[string]bool{}
	for _, item := range o.keys("components", "schemas", "ErrorCode", "enum") {
		enum[o.value("components", "schemas", "ErrorCode", "enum", item)] = true
	}
	desc := strings.Join(strings.Fields(o.value("components", "schemas", "ErrorCode", "description")), " ")
	for code, st := range status {
		if !enum[code] {
			t.Errorf("ErrorCode enum lacks %s", code)
		}
		if !strings.Contains(desc, code+" "+st) {
			t.Errorf("ErrorCode description does not give %s its status %s", code, st)
		}
	}
	for _, r := range []string{"InvalidArgument", "Unauthenticated", "PermissionDenied", "NotFound", "Conflict", "QuotaExceeded", "Internal", "Unavailable"} {
		if o.value("components", "responses", r, "content", "application/json", "schema", "$ref") != "#/components/schemas/ErrorBody" {
			t.Errorf("components.responses.%s does not return an ErrorBody", r)
		}
	}
}

// wireTypes is every exported struct of the package; TestOpenAPIWireTypesListed
// keeps the list complete.
var wireTypes = []any{
	NetworkPolicy{}, SandboxSpec{}, Sandbox{}, BatchCreateRequest{}, BatchError{},
	BatchResult{}, SandboxList{}, LabelsRequest{}, DeleteResult{}, KeepaliveRequest{},
	Stats{}, ExecRequest{}, ExecResult{}, ExecEvent{}, SessionRequest{}, Session{},
	SessionRunRequest{}, FileEntry{}, FileEvent{}, FileList{}, TarResult{}, LogEntry{}, LogRequest{},
	LogResult{}, LogPage{}, Layer{}, LayerList{}, Template{}, TemplateList{}, PauseResult{}, CountResult{},
	SnapshotInfo{}, SnapshotRequest{}, ForkRequest{},
	ImageConfig{}, ImageResult{}, ImagePullRequest{}, ImageEvent{}, LayerRemote{}, LayerPushRequest{}, LayerAddRequest{}, LayerPushResult{}, LayerGCResult{}, FnCallRequest{}, FnCallResult{},
	Node{}, Capacity{}, NodeList{}, ErrorDetail{}, ErrorBody{},
	ProjectQuota{}, ProjectUsage{}, Project{}, CreateProjectRequest{}, UpdateProjectRequest{},
	ProjectList{}, CreateKeyRequest{}, APIKey{}, KeyList{}, WhoAmI{}, AuditEntry{}, AuditList{},
}

func TestOpenAPIWireTypesListed(t *testing.T) {
	listed := map[string]bool{}
	for _, v := range wireTypes {
		listed[reflect.TypeOf(v).Name()] = true
	}
	fset := token.NewFileSet()
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(f, func(n ast.Node) bool {
			ts, ok := n.(*ast.TypeSpec)
			if !ok || !ts.Name.IsExported() {
				return true
			}
			if _, isStruct := ts.Type.(*ast.StructType); isStruct && !listed[ts.Name.Name] {
				t.Errorf("struct %s (%s) is missing from wireTypes in openapi_test.go", ts.Name.Name, name)
			}
			return true
		})
	}
}

// TestOpenAPISchemasMatchTypes checks that each wire type has a schema of
// the same name whose properties are exactly its JSON fields, each described
// and of the matching type, and whose required list is exactly the fields
// always present on the wire (no omitempty).
func TestOpenAPISchemasMatchTypes(t *testing.T) {
	o := loadOutline(t)
	for _, v := range wireTypes {
		typ := reflect.TypeOf(v)
		schema := []string{"components", "schemas", typ.Name()}
		if !o.has(schema...) {
			t.Errorf("no schema %s", typ.Name())
			continue
		}
		if o.value(append(schema, "description")...) == "" {
			t.Errorf("schema %s has no description", typ.Name())
		}
		props := append(schema, "properties")
		fields := map[string]bool{}
		var required []string
		for i := 0; i < typ.NumField(); i++ {
			f := typ.Field(i)
			if !f.IsExported() {
				continue
			}
			tag := f.Tag.Get("json")
			if tag == "-" {
				continue
			}
			name, opts, _ := strings.Cut(tag, ",")
			if name == "" {
				name = f.Name
			}
			fields[name] = true
			if !strings.Contains(","+opts+",", ",omitempty,") {
				required = append(required, name)
			}
			prop := append(append([]string(nil), props...), name)
			where := typ.Name() + "." + name
			if !o.has(prop...) {
				t.Errorf("%s (json %q) is not documented", typ.Name()+"."+f.Name, name)
				continue
			}
			if o.value(append(prop, "description")...) == "" {
				t.Errorf("%s has no description", where)
			}
			checkType(t, o, where, prop, f.Type)
		}
		for _, p := range o.keys(props...) {
			if !fields[p] {
				t.Errorf("%s.%s is documented but %s has no such JSON field", typ.Name(), p, typ.Name())
			}
		}
		got := flowList(o.value(append(schema, "required")...))
		if !reflect.DeepEqual(sorted(got), sorted(required)) {
			t.Errorf("%s: required %v, want %v (the fields without omitempty)", typ.Name(), sorted(got), sorted(required))
		}
	}
}

var timeType = reflect.TypeOf(time.Time{})

// resolve follows $ref and a single-element allOf to the schema they name.
func resolve(o *outline, schema []string) []string {
	for i := 0; i < 8; i++ {
		if ref := o.value(append(schema, "$ref")...); ref != "" {
			schema = strings.Split(strings.TrimPrefix(ref, "#/"), "/")
			continue
		}
		if !o.has(append(schema, "type")...) && o.has(append(schema, "allOf", "-0")...) {
			schema = append(append([]string(nil), schema...), "allOf", "-0")
			continue
		}
		break
	}
	return schema
}

// checkType checks that the schema at path describes Go type gt.
func checkType(t *testing.T, o *outline, where string, path []string, gt reflect.Type) {
	t.Helper()
	for gt.Kind() == reflect.Pointer {
		gt = gt.Elem()
	}
	schema := resolve(o, path)
	got := o.value(append(schema, "type")...)
	var want string
	switch {
	case gt == timeType:
		want = "string"
		if f := o.value(append(schema, "format")...); f != "date-time" {
			t.Errorf("%s: format %q, want date-time", where, f)
		}
	case gt.Kind() == reflect.String:
		want = "string"
	case gt.Kind() == reflect.Bool:
		want = "boolean"
	case gt.Kind() >= reflect.Int && gt.Kind() <= reflect.Uint64:
		want = "integer"
	case gt.Kind() == reflect.Float32 || gt.Kind() == reflect.Float64:
		want = "number"
	case gt.Kind() == reflect.Slice:
		want = "array"
		checkType(t, o, where+"[]", append(append([]string(nil), schema...), "items"), gt.Elem())
	case gt.Kind() == reflect.Map:
		want = "object"
		checkType(t, o, where+"{}", append(append([]string(nil), schema...), "additionalProperties"), gt.Elem())
	case gt.Kind() == reflect.Struct:
		want = "object"
		if len(schema) != 3 || schema[0] != "components" || schema[1] != "schemas" || schema[2] != gt.Name() {
			t.Errorf("%s: schema %s, want a reference to #/components/schemas/%s", where, strings.Join(schema, "/"), gt.Name())
		}
	default:
		t.Errorf("%s: Go type %s has no mapping in this test", where, gt)
		return
	}
	if got != want {
		t.Errorf("%s: type %q, want %q (Go %s)", where, got, want, gt)
	}
}

// TestOpenAPIDefaults pins the numbers of the contract.
func TestOpenAPIDefaults(t *testing.T) {
	o := loadOutline(t)
	s := func(p ...string) []string { return append([]string{"components", "schemas"}, p...) }
	for _, c := range []struct {
		path []string
		want string
	}{
		{s("ExecRequest", "properties", "timeout", "default"), "60"},
		{s("ExecRequest", "properties", "timeout", "maximum"), "86400"},
		{s("ExecRequest", "properties", "max_output_bytes", "default"), "1048576"},
		{s("ExecRequest", "properties", "max_output_bytes", "maximum"), "67108864"},
		{s("SessionRunRequest", "properties", "timeout", "default"), "60"},
		{s("SessionRunRequest", "properties", "timeout", "maximum"), "86400"},
		{s("SessionRunRequest", "properties", "max_output_bytes", "default"), "1048576"},
		{s("SessionRunRequest", "properties", "max_output_bytes", "maximum"), "67108864"},
		{s("SandboxSpec", "properties", "backend", "default"), "container"},
		{s("SandboxSpec", "properties", "ttl", "default"), "0"},
		{s("SandboxSpec", "properties", "idle_timeout", "default"), "0"},
		{[]string{"paths", "/v1/sandboxes", "get", "parameters", "-2", "name"}, "limit"},
		{[]string{"paths", "/v1/sandboxes", "get", "parameters", "-2", "schema", "default"}, "100"},
		{[]string{"paths", "/v1/sandboxes", "get", "parameters", "-2", "schema", "maximum"}, "1000"},
		{[]string{"paths", "/v1/sandboxes/{id}/files", "put", "parameters", "-0", "name"}, "mode"},
		{[]string{"paths", "/v1/sandboxes/{id}/files", "put", "parameters", "-0", "schema", "default"}, "0644"},
		{[]string{"paths", "/v1/projects", "get", "parameters", "-1", "name"}, "limit"},
		{[]string{"paths", "/v1/projects", "get", "parameters", "-1", "schema", "default"}, "100"},
		{[]string{"paths", "/v1/projects", "get", "parameters", "-1", "schema", "maximum"}, "1000"},
		{[]string{"paths", "/v1/audit", "get", "parameters", "-1", "name"}, "limit"},
		{[]string{"paths", "/v1/audit", "get", "parameters", "-1", "schema", "default"}, "100"},
		{[]string{"paths", "/v1/audit", "get", "parameters", "-1", "schema", "maximum"}, "1000"},
		{s("CreateKeyRequest", "properties", "expires_in", "maximum"), "315360000"},
		{s("CreateProjectRequest", "properties", "name", "maxLength"), "63"},
		{[]string{"paths", "/v1/projects/{id}/keys", "post", "responses", "201", "headers", "Cache-Control", "schema", "enum"}, "[no-store]"},
	} {
		if got := o.value(c.path...); got != c.want {
			t.Errorf("%s = %q, want %q", strings.Join(c.path, "."), got, c.want)
		}
	}
	for _, c := range []struct {
		prop []string
		want string
	}{
		{s("SandboxSpec", "properties", "ttl"), "3600"},
		{s("SandboxSpec", "properties", "disk_mb"), "failed_precondition"},
		{s("SandboxSpec", "properties", "network"), "loopback-only"},
		{s("NetworkPolicy"), "failed_precondition"},
		{s("SandboxSpec", "properties", "backend"), "`microvm` (a VM per sandbox, on nodes that have QEMU"},
		{s("SandboxSpec", "properties", "project"), "not_found"},
		{[]string{"components", "responses", "NotFound"}, "another tenant's"},
		{s("Role"), "builder"},
	} {
		if d := o.value(append(c.prop, "description")...); !strings.Contains(d, c.want) {
			t.Errorf("%s.description does not mention %q", strings.Join(c.prop, "."), c.want)
		}
	}
}

// TestOutlineParser keeps the parser honest on the constructs it claims.
func TestOutlineParser(t *testing.T) {
	o := parseOutline(t, `a:
  "/x:y":
    b: "1"
  list:
    - k: v
      l: w
    - plain item
  text: |
    line one
    line two
  flow: [p, q]
c: 2
`)
	for _, c := range []struct {
		path []string
		want string
	}{
		{[]string{"a", "/x:y", "b"}, "1"},
		{[]string{"a", "list", "-0", "k"}, "v"},
		{[]string{"a", "list", "-0", "l"}, "w"},
		{[]string{"a", "list", "-1"}, "plain item"},
		{[]string{"a", "text"}, "line one\nline two\n"},
		{[]string{"c"}, "2"},
	} {
		if got := o.value(c.path...); got != c.want {
			t.Errorf("%v = %q, want %q", c.path, got, c.want)
		}
	}
	if got := flowList(o.value("a", "flow")); !reflect.DeepEqual(got, []string{"p", "q"}) {
		t.Errorf("flow = %v", got)
	}
	if got := o.keys(); !reflect.DeepEqual(got, []string{"a", "c"}) {
		t.Errorf("root keys = %v", got)
	}
}

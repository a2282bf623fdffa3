package apiserver

// The E2B control plane (E2B-COMPAT.md; docs/e2b.md "Control plane"):
// create, connect, list, inspect, time out, pause, kill and measure
// sandboxes the way the E2B SDK asks, each call mapped onto the /v1
// machinery (create, listPage, the edge's Get, Resume, Keepalive, Pause,
// Delete and Stats) under the same IAM. What E2B names differently:
//
//   - templateID is a layer ref (base or snapshot) or a template alias
//     (templates.go); "base", the SDK's default, is the alias "base" if
//     there is one, else Deps.E2BDefaultTemplate. The sandbox records
//     the templateID it was asked for in the e2bTemplateLabel label.
//   - timeout is the TTL; metadata are labels (dsec's rules); envVars
//     are env; the egress settings map onto a network policy (e2bEgress).
//   - E2B knows running and paused sandboxes only: a stopped or failed
//     one is not found, as on E2B once a sandbox is gone.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/iam"
	"github.com/dsecproject/dsec/internal/layer"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// e2bEnvdVersion is the envd version sandboxes advertise. The SDK gates
// features on it (E2B-COMPAT.md): it is the highest whose features dsec
// serves, raised as the envd side implements more.
const e2bEnvdVersion = "0.5.7"

// e2bBaseTemplate is the SDK's default templateID.
const e2bBaseTemplate = "base"

// e2bTemplateLabel records the templateID a sandbox was created from.
const e2bTemplateLabel = "e2b.template"

// e2bAllTraffic is E2B's name for every address (its ALL_TRAFFIC).
const e2bAllTraffic = "0.0.0.0/0"

// e2bInternet is the dsec policy of a sandbox with internet access:
// every address and every name.
var e2bInternet = []string{"0.0.0.0/0", "*"}

// e2bReservedLabel reports whether a label key is dsec's or this
// dialect's own: E2B metadata may not set one, and does not show them.
func e2bReservedLabel(k string) bool {
	return strings.HasPrefix(k, "e2b.") || sandbox.IsOwnLabel(k)
}

func (s *Server) e2bControlRoutes() {
	s.e2bHandle("POST /v2/sandboxes", iam.SandboxCreate, s.e2bCreate)
	// The first version of create and connect, which E2B's Python SDK
	// and older JS SDKs call: the same bodies and answers.
	s.e2bHandle("POST /sandboxes", iam.SandboxCreate, s.e2bCreate)
	s.e2bHandle("POST /sandboxes/{id}/connect", iam.SandboxWrite, s.e2bConnect)
	s.e2bHandle("GET /v2/sandboxes", iam.SandboxRead, s.e2bList)
	s.e2bHandle("GET /sandboxes", iam.SandboxRead, s.e2bListRunning)
	s.e2bHandle("POST /v2/sandboxes/{id}/connect", iam.SandboxWrite, s.e2bConnect)
	s.e2bHandle("GET /sandboxes/{id}", iam.SandboxRead, s.e2bInfo)
	s.e2bHandle("DELETE /sandboxes/{id}", iam.SandboxWrite, s.e2bKill)
	s.e2bHandle("POST /sandboxes/{id}/timeout", iam.SandboxWrite, s.e2bSetTimeout)
	s.e2bHandle("POST /sandboxes/{id}/pause", iam.SandboxWrite, s.e2bPause)
	s.e2bHandle("POST /sandboxes/{id}/resume", iam.SandboxWrite, s.e2bResume)
	s.e2bHandle("GET /sandboxes/{id}/metrics", iam.SandboxRead, s.e2bMetrics)
	s.e2bHandle("GET /templates/aliases/{alias}", iam.LayerRead, s.e2bAlias)
	// The rest of E2B's API (fork, snapshots, network, template builds,
	// volumes, secrets) is not served: say so in E2B's shape.
	for _, prefix := range []string{"/sandboxes/", "/v2/", "/v3/", "/templates", "/templates/", "/snapshots", "/snapshots/",
		"/volumes", "/volumes/", "/volumecontent/", "/secrets", "/secrets/"} {
		s.e2bHandle(prefix, iam.SandboxRead, func(w http.ResponseWriter, r *http.Request) {
			s.e2bError(w, r, errdefs.NotFound("%s %s is not part of dsec's E2B API (docs/e2b.md)", r.Method, r.URL.Path))
		})
	}
}

// e2bSandboxBody is E2B's Sandbox: what create and connect answer.
type e2bSandboxBody struct {
	SandboxID       string `json:"sandboxID"`
	TemplateID      string `json:"templateID"`
	Alias           string `json:"alias,omitempty"`
	ClientID        string `json:"clientID"`
	EnvdVersion     string `json:"envdVersion"`
	EnvdAccessToken string `json:"envdAccessToken,omitempty"`
}

// e2bDetail is E2B's SandboxDetail (getInfo) and, without the token,
// its ListedSandbox (list).
type e2bDetail struct {
	e2bSandboxBody
	StartedAt  time.Time         `json:"startedAt"`
	EndAt      time.Time         `json:"endAt"`
	State      string            `json:"state"`
	CPUCount   int               `json:"cpuCount"`
	MemoryMB   int64             `json:"memoryMB"`
	DiskSizeMB int64             `json:"diskSizeMB"`
	Metadata   map[string]string `json:"metadata"`
}

// e2bMetric is one sample of E2B's SandboxMetric.
type e2bMetric struct {
	Timestamp     time.Time `json:"timestamp"`
	TimestampUnix int64     `json:"timestampUnix"`
	CPUCount      int       `json:"cpuCount"`
	CPUUsedPct    float64   `json:"cpuUsedPct"`
	MemUsed       uint64    `json:"memUsed"`
	MemTotal      uint64    `json:"memTotal"`
	MemCache      uint64    `json:"memCache"`
	DiskUsed      uint64    `json:"diskUsed"`
	DiskTotal     uint64    `json:"diskTotal"`
}

// e2bCreateRequest is the part of E2B's NewSandbox that dsec reads.
// Other fields (secure, mcp, autoResume, ...) are ignored.
type e2bCreateRequest struct {
	TemplateID          string             `json:"templateID"`
	Timeout             int64              `json:"timeout"`
	Metadata            map[string]string  `json:"metadata"`
	EnvVars             map[string]string  `json:"envVars"`
	AllowInternetAccess *bool              `json:"allow_internet_access"`
	Network             *e2bNetworkRequest `json:"network"`
	AutoPause           bool               `json:"autoPause"`
	VolumeMounts        []json.RawMessage  `json:"volumeMounts"`
}

// e2bNetworkRequest is E2B's SandboxNetworkConfig.
type e2bNetworkRequest struct {
	AllowOut    []string                   `json:"allowOut"`
	DenyOut     []string                   `json:"denyOut"`
	EgressProxy json.RawMessage            `json:"egressProxy"`
	Rules       map[string]json.RawMessage `json:"rules"`
}

// e2bTimeoutRequest is the body of connect and of setTimeout.
type e2bTimeoutRequest struct {
	Timeout int64 `json:"timeout"`
}

func (s *Server) e2bCreate(w http.ResponseWriter, r *http.Request) {
	var req e2bCreateRequest
	if err := decodeLoose(r, &req); err != nil {
		s.e2bError(w, r, err)
		return
	}
	spec, err := s.e2bSpec(r.Context(), req)
	if err != nil {
		s.e2bError(w, r, err)
		return
	}
	sb, err := s.create(r.Context(), spec)
	if err != nil {
		s.e2bError(w, r, err)
		return
	}
	body, err := s.e2bSandboxOf(sb)
	if err != nil {
		s.e2bError(w, r, err)
		return
	}
	writeJSON(w, http.StatusCreated, body)
}

// e2bSpec turns an E2B create request into a sandbox spec.
func (s *Server) e2bSpec(ctx context.Context, req e2bCreateRequest) (api.SandboxSpec, error) {
	switch {
	case req.AutoPause:
		return api.SandboxSpec{}, errdefs.Invalid("autoPause is not supported by dsec: a sandbox is killed when its timeout ends (pause it yourself before)")
	case len(req.VolumeMounts) > 0:
		return api.SandboxSpec{}, errdefs.Invalid("volumeMounts are not supported by dsec")
	case req.Timeout < 0:
		return api.SandboxSpec{}, errdefs.Invalid("timeout must not be negative, got %d", req.Timeout)
	}
	id := req.TemplateID
	if id == "" {
		id = e2bBaseTemplate
	}
	spec, err := s.e2bTemplate(ctx, id)
	if err != nil {
		return api.SandboxSpec{}, err
	}
	// One of the sandbox's labels keeps its template (e2bTemplateLabel).
	if max := s.deps.Policy.MaxLabels - 1; len(req.Metadata) > max {
		return api.SandboxSpec{}, errdefs.Invalid("at most %d metadata entries (one of a sandbox's %d labels keeps its template), got %d", max, s.deps.Policy.MaxLabels, len(req.Metadata))
	}
	labels := make(map[string]string, len(req.Metadata)+1)
	for k, v := range req.Metadata {
		if e2bReservedLabel(k) {
			return api.SandboxSpec{}, errdefs.Invalid("metadata key %q is reserved (keys starting e2b. or dsec. are dsec's own)", k)
		}
		if err := sandbox.ValidateLabel(k, v); err != nil {
			return api.SandboxSpec{}, fmt.Errorf("metadata: %w", err)
		}
		labels[k] = v
	}
	if err := sandbox.ValidateLabel(e2bTemplateLabel, id); err != nil {
		return api.SandboxSpec{}, errdefs.Invalid("templateID %q is not a template name or layer ref", id)
	}
	labels[e2bTemplateLabel] = id
	np, err := e2bEgress(req.AllowInternetAccess, req.Network)
	if err != nil {
		return api.SandboxSpec{}, err
	}
	spec.TTL, spec.Env, spec.Labels, spec.Network = req.Timeout, req.EnvVars, labels, np
	return spec, nil
}

// e2bTemplate resolves an E2B templateID for the caller of ctx into the
// layers and user of a spec: a base layer ref, a snapshot ref or an
// alias; "base" falls back to the configured default template.
func (s *Server) e2bTemplate(ctx context.Context, id string) (api.SandboxSpec, error) {
	spec, err := s.e2bTemplateNamed(ctx, id)
	if id != e2bBaseTemplate || !errors.Is(err, errdefs.ErrNotFound) {
		return spec, err
	}
	def := s.deps.E2BDefaultTemplate
	if def == "" || def == e2bBaseTemplate {
		return spec, errdefs.NotFound("template %s not found: there is no alias %q and no default template "+
			"(start dsec with --e2b-default-template REF, or make the alias: dsec template alias %s --base REF)", id, id, id)
	}
	spec, err = s.e2bTemplateNamed(ctx, def)
	if errors.Is(err, errdefs.ErrNotFound) {
		return spec, errdefs.NotFound("template %s not found: there is no alias %q, and the default template %s "+
			"(--e2b-default-template) is not found: %v", id, id, def, err)
	}
	return spec, err
}

// e2bTemplateNamed resolves id without the default.
func (s *Server) e2bTemplateNamed(ctx context.Context, id string) (api.SandboxSpec, error) {
	if strings.Contains(id, "/") || layer.IsDigest(id) {
		l, err := s.resolveFor(ctx, id)
		if errors.Is(err, errdefs.ErrNotFound) {
			return api.SandboxSpec{}, errdefs.NotFound("template %s not found: %v", id, err)
		}
		if err != nil {
			return api.SandboxSpec{}, fmt.Errorf("template %s: %w", id, err)
		}
		switch l.Kind {
		case api.KindBase:
			return api.SandboxSpec{Base: id}, nil
		case api.KindSnapshot:
			return api.SandboxSpec{Snapshot: id}, nil
		}
		return api.SandboxSpec{}, errdefs.Invalid("template %s is a %s layer; a template is a base layer, a snapshot or an alias", id, l.Kind)
	}
	t, err := s.template(ctx, id)
	if errors.Is(err, errdefs.ErrNotFound) {
		return api.SandboxSpec{}, errdefs.NotFound("template %s not found: it is neither an alias (dsec template list) nor a layer ref like base/debian:12", id)
	}
	if err != nil {
		return api.SandboxSpec{}, err
	}
	return api.SandboxSpec{Base: t.Base, Workspace: t.Workspace, Toolkits: t.Toolkits, User: t.User, Backend: t.Backend}, nil
}

// e2bEgress maps E2B's egress settings onto a dsec network policy. E2B
// is open unless told otherwise and lets allowOut win over denyOut; dsec
// is closed unless told otherwise and lets deny win. So:
//   - allow_internet_access false, or 0.0.0.0/0 in denyOut: closed, and
//     allowOut is the policy (the rest of denyOut is what closed means
//     already, and kept it could overrule allowOut);
//   - allow_internet_access true: every address and name, less denyOut
//     (an allowOut entry inside a denyOut range stays denied, unlike on
//     E2B);
//   - neither: dsec's default, closed, with allowOut and denyOut as given.
func e2bEgress(internet *bool, n *e2bNetworkRequest) (*api.NetworkPolicy, error) {
	var allowOut, denyOut []string
	if n != nil {
		if len(n.EgressProxy) > 0 && string(n.EgressProxy) != "null" {
			return nil, errdefs.Invalid("network.egressProxy is not supported by dsec")
		}
		if len(n.Rules) > 0 {
			return nil, errdefs.Invalid("network.rules (request transforms) are not supported by dsec")
		}
		allowOut, denyOut = n.AllowOut, n.DenyOut
	}
	np := &api.NetworkPolicy{}
	switch {
	case internet != nil && !*internet || slices.Contains(denyOut, e2bAllTraffic):
		np.Allow = allowOut
	case internet != nil && *internet:
		np.Allow, np.Deny = slices.Clone(e2bInternet), denyOut
	default:
		np.Allow, np.Deny = allowOut, denyOut
	}
	if len(np.Allow) == 0 && len(np.Deny) == 0 {
		return nil, nil
	}
	return np, nil
}

// e2bSandboxOf is the Sandbox answer for sb.
func (s *Server) e2bSandboxOf(sb *api.Sandbox) (e2bSandboxBody, error) {
	tok, err := s.envdToken(sb.ID)
	if err != nil {
		return e2bSandboxBody{}, err
	}
	b := e2bBodyOf(sb)
	b.EnvdAccessToken = tok
	return b, nil
}

// e2bBodyOf is the Sandbox fields of sb, without the token.
func e2bBodyOf(sb *api.Sandbox) e2bSandboxBody {
	tpl := sb.Labels[e2bTemplateLabel]
	if tpl == "" {
		// Made through /v1: its layers name it.
		tpl = sb.Spec.Base
		if sb.Spec.Snapshot != "" {
			tpl = sb.Spec.Snapshot
		}
	}
	b := e2bSandboxBody{SandboxID: sb.ID, TemplateID: tpl, ClientID: sb.Node, EnvdVersion: e2bEnvdVersion}
	if !strings.Contains(tpl, "/") && !layer.IsDigest(tpl) {
		b.Alias = tpl
	}
	return b
}

// e2bDetailOf is the SandboxDetail of sb; nodeCPU gives the cores of the
// nodes, for sandboxes without a CPU limit.
func e2bDetailOf(sb *api.Sandbox, nodeCPU map[string]float64) e2bDetail {
	d := e2bDetail{e2bSandboxBody: e2bBodyOf(sb), StartedAt: sb.CreatedAt.UTC(), State: e2bState(sb.State),
		CPUCount: e2bCPUCount(sb, nodeCPU), MemoryMB: sb.Spec.MemoryMB, DiskSizeMB: sb.Spec.DiskMB, Metadata: map[string]string{}}
	if sb.ExpiresAt != nil {
		d.EndAt = sb.ExpiresAt.UTC()
	} else {
		d.EndAt = d.StartedAt.Add(time.Duration(sb.Spec.TTL) * time.Second)
	}
	for k, v := range sb.Labels {
		if !e2bReservedLabel(k) {
			d.Metadata[k] = v
		}
	}
	return d
}

// e2bState is a dsec state as E2B names it: running or paused (a
// sandbox still being created counts as running).
func e2bState(st string) string {
	if st == api.StatePaused {
		return "paused"
	}
	return "running"
}

// e2bCPUCount is E2B's whole cores of sb: its CPU limit rounded up, or,
// without one, its node's cores (1 when unknown).
func e2bCPUCount(sb *api.Sandbox, nodeCPU map[string]float64) int {
	c := sb.Spec.CPU
	if c <= 0 {
		c = nodeCPU[sb.Node]
	}
	return max(1, int(math.Ceil(c)))
}

// nodeCPU is the cores of each node of the view.
func (s *Server) nodeCPU() map[string]float64 {
	out := map[string]float64{}
	for _, v := range s.deps.Nodes.Snapshot() {
		out[v.Name] = v.Capacity.CPU
	}
	return out
}

// e2bSandbox finds sandbox id for an E2B call. A stopped or failed one
// is not found: E2B's API knows only running and paused sandboxes.
func (s *Server) e2bSandbox(ctx context.Context, id string) (edgeapi.Edge, *api.Sandbox, error) {
	e, err := s.edgeOf(ctx, id)
	if err != nil {
		return nil, nil, err
	}
	sb, err := e.Get(ctx, id)
	if err != nil {
		return nil, nil, err
	}
	if sb.State == api.StateStopped || sb.State == api.StateFailed {
		return nil, nil, errdefs.NotFound("sandbox %s not found: it is %s", id, sb.State)
	}
	return e, sb, nil
}

// e2bConnect resumes a paused sandbox (201) or finds a running one
// (200), and makes it live at least timeout seconds from now.
// e2bResume is the older SDKs' resume: connect, but a sandbox that is
// not paused is a conflict (409), as on E2B.
func (s *Server) e2bResume(w http.ResponseWriter, r *http.Request) { s.connectSandbox(w, r, true) }

func (s *Server) e2bConnect(w http.ResponseWriter, r *http.Request) { s.connectSandbox(w, r, false) }

// connectSandbox resumes a paused sandbox (or, unless onlyPaused, finds a
// running one) and extends its life to the request's timeout.
func (s *Server) connectSandbox(w http.ResponseWriter, r *http.Request, onlyPaused bool) {
	var req e2bTimeoutRequest
	if err := decodeLooseOptional(r, &req); err != nil {
		s.e2bError(w, r, err)
		return
	}
	if req.Timeout < 0 {
		s.e2bError(w, r, errdefs.Invalid("timeout must not be negative, got %d", req.Timeout))
		return
	}
	id := r.PathValue("id")
	e, sb, err := s.e2bSandbox(r.Context(), id)
	if err != nil {
		s.e2bError(w, r, err)
		return
	}
	if onlyPaused && sb.State != api.StatePaused {
		s.e2bError(w, r, errdefs.Precondition("sandbox %s is %s, not paused", id, sb.State))
		return
	}
	status := http.StatusOK
	if sb.State == api.StatePaused {
		if sb, err = e.Resume(r.Context(), id); err != nil {
			s.e2bError(w, r, err)
			return
		}
		status = http.StatusCreated
	}
	until := time.Now().Add(time.Duration(req.Timeout) * time.Second)
	if req.Timeout > 0 && (sb.ExpiresAt == nil || sb.ExpiresAt.Before(until)) {
		if sb, err = e.Keepalive(r.Context(), id, req.Timeout); err != nil {
			s.e2bError(w, r, err)
			return
		}
	}
	body, err := s.e2bSandboxOf(sb)
	if err != nil {
		s.e2bError(w, r, err)
		return
	}
	writeJSON(w, status, body)
}

func (s *Server) e2bInfo(w http.ResponseWriter, r *http.Request) {
	_, sb, err := s.e2bSandbox(r.Context(), r.PathValue("id"))
	if err != nil {
		s.e2bError(w, r, err)
		return
	}
	d := e2bDetailOf(sb, s.nodeCPU())
	// The token drives the sandbox (commands, files, resume): only a key
	// that may do so through the API gets it. A viewer's getInfo has none.
	if s.deps.IAM.Authorize(principal(r.Context()), iam.SandboxWrite) == nil {
		if d.EnvdAccessToken, err = s.envdToken(sb.ID); err != nil {
			s.e2bError(w, r, err)
			return
		}
	}
	writeJSON(w, http.StatusOK, d)
}

// e2bKill deletes a sandbox: 404 when there is none (the SDK's kill then
// answers false), a stopped one included.
func (s *Server) e2bKill(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	e, err := s.edgeOf(r.Context(), id)
	if err != nil {
		s.e2bError(w, r, err)
		return
	}
	if _, err := e.Get(r.Context(), id); err != nil {
		s.e2bError(w, r, err)
		return
	}
	if err := e.Delete(r.Context(), id); err != nil {
		s.e2bError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// e2bSetTimeout makes the sandbox expire timeout seconds from now.
func (s *Server) e2bSetTimeout(w http.ResponseWriter, r *http.Request) {
	var req e2bTimeoutRequest
	if err := decodeLoose(r, &req); err != nil {
		s.e2bError(w, r, err)
		return
	}
	if req.Timeout < 1 {
		s.e2bError(w, r, errdefs.Invalid("timeout must be at least 1 second, got %d", req.Timeout))
		return
	}
	id := r.PathValue("id")
	e, _, err := s.e2bSandbox(r.Context(), id)
	if err != nil {
		s.e2bError(w, r, err)
		return
	}
	if _, err := e.Keepalive(r.Context(), id, req.Timeout); err != nil {
		s.e2bError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// e2bPause pauses a running sandbox; one already paused is 409 (the
// SDK's pause then answers false), where the edge would succeed.
func (s *Server) e2bPause(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	e, sb, err := s.e2bSandbox(r.Context(), id)
	if err != nil {
		s.e2bError(w, r, err)
		return
	}
	if sb.State == api.StatePaused {
		s.e2bError(w, r, errdefs.Precondition("sandbox %s is already paused", id))
		return
	}
	if _, err := e.Pause(r.Context(), id); err != nil {
		s.e2bError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

// e2bMetricsSlack is how far in the past a metrics range may end and
// still get the current sample (a client's "now" is a little old).
const e2bMetricsSlack = 10 * time.Second

// e2bMetrics answers one sample, taken now: the edge keeps no history.
// cpuUsedPct is the average over the sandbox's life (the edge counts CPU
// time, not a rate). A range (start, end: Unix seconds) that ends before
// now, or starts after it, gets no sample.
func (s *Server) e2bMetrics(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	var bounds [2]int64
	for i, name := range []string{"start", "end"} {
		if v := q.Get(name); v != "" {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil || n < 0 {
				s.e2bError(w, r, badQuery(name, v, "want Unix seconds"))
				return
			}
			bounds[i] = n
		}
	}
	id := r.PathValue("id")
	e, sb, err := s.e2bSandbox(r.Context(), id)
	if err != nil {
		s.e2bError(w, r, err)
		return
	}
	st, err := e.Stats(r.Context(), id)
	if err != nil {
		s.e2bError(w, r, err)
		return
	}
	now := time.Now().UTC()
	out := []e2bMetric{}
	start, end := bounds[0], bounds[1]
	if (start == 0 || start <= now.Unix()) && (end == 0 || end >= now.Add(-e2bMetricsSlack).Unix()) {
		out = append(out, e2bSample(sb, st, s.nodeCPU(), now))
	}
	writeJSON(w, http.StatusOK, out)
}

// e2bSample is the metrics sample of sb at now from its stats.
func e2bSample(sb *api.Sandbox, st *api.Stats, nodeCPU map[string]float64, now time.Time) e2bMetric {
	m := e2bMetric{Timestamp: now, TimestampUnix: now.Unix(), CPUCount: e2bCPUCount(sb, nodeCPU),
		MemUsed: st.MemoryBytes, MemTotal: st.MemoryMaxBytes, DiskUsed: st.DiskBytes, DiskTotal: st.DiskLimitBytes}
	if m.MemTotal == 0 && sb.Spec.MemoryMB > 0 {
		m.MemTotal = uint64(sb.Spec.MemoryMB) << 20
	}
	if m.DiskTotal == 0 && sb.Spec.DiskMB > 0 {
		m.DiskTotal = uint64(sb.Spec.DiskMB) << 20
	}
	if life := now.Sub(sb.CreatedAt); life > 0 {
		pct := float64(st.CPUUsageNS) / (float64(life.Nanoseconds()) * float64(m.CPUCount)) * 100
		m.CPUUsedPct = math.Round(min(pct, 100)*100) / 100
	}
	return m
}

// e2bList is GET /v2/sandboxes: a page of running and paused sandboxes
// (or those of ?state=), ?metadata= and ?template= filtering, the next
// page's token in X-Next-Token.
func (s *Server) e2bList(w http.ResponseWriter, r *http.Request) {
	s.e2bListSandboxes(w, r, true)
}

// e2bListRunning is GET /sandboxes, E2B's first list: the running
// sandboxes, all of them, in one answer (streamed: e2bStreamAll).
func (s *Server) e2bListRunning(w http.ResponseWriter, r *http.Request) {
	s.e2bListSandboxes(w, r, false)
}

func (s *Server) e2bListSandboxes(w http.ResponseWriter, r *http.Request, paged bool) {
	q := r.URL.Query()
	sel, err := e2bMetadataQuery(q.Get("metadata"))
	if err != nil {
		s.e2bError(w, r, err)
		return
	}
	if tpl := q.Get("template"); tpl != "" {
		if err := sandbox.ValidateLabel(e2bTemplateLabel, tpl); err != nil {
			s.e2bError(w, r, badQuery("template", tpl, "not a template name or layer ref"))
			return
		}
		sel[e2bTemplateLabel] = tpl
	}
	def := []string{api.StateRunning}
	if paged {
		def = append(def, api.StatePaused)
	}
	states, err := e2bStates(q["state"], def)
	if err != nil {
		s.e2bError(w, r, err)
		return
	}
	var startedAfter time.Time
	if v := q.Get("startedAfter"); v != "" {
		if startedAfter, err = time.Parse(time.RFC3339, v); err != nil {
			s.e2bError(w, r, badQuery("startedAfter", v, "want an RFC 3339 time"))
			return
		}
	}
	if !paged {
		s.e2bStreamAll(w, r, states, sel, startedAfter)
		return
	}
	limit, err := pageLimit(r)
	if err != nil {
		s.e2bError(w, r, err)
		return
	}
	if limit == 0 {
		limit = defaultPageSize
	}
	after, err := pageAfter("nextToken", q.Get("nextToken"))
	if err != nil {
		s.e2bError(w, r, err)
		return
	}
	raw, more, skipped, err := s.listPage(r.Context(), states, sel, after, limit)
	if err != nil {
		s.e2bError(w, r, err)
		return
	}
	page, bad := s.decodePage(raw)
	if len(bad) > 0 {
		skipped = append(skipped, bad...)
		slices.Sort(skipped)
	}
	if more {
		w.Header().Set("X-Next-Token", pageToken(raw[len(raw)-1].ID))
	}
	if len(skipped) > 0 {
		// E2B's answer has no place for them; say it in a header.
		w.Header().Set("X-Dsec-Unreachable-Nodes", strings.Join(skipped, ","))
	}
	cpu := s.nodeCPU()
	out := []e2bDetail{}
	for i := range page {
		if !startedAfter.IsZero() && !page[i].CreatedAt.After(startedAfter) {
			continue
		}
		out = append(out, e2bDetailOf(&page[i], cpu))
	}
	writeJSON(w, http.StatusOK, out)
}

// e2bStreamPage is how many sandboxes e2bStreamAll fetches at a time. A
// variable for tests.
var e2bStreamPage = maxPageSize

// e2bStreamAll answers every sandbox in states matching sel (and created
// after startedAfter, if set) as one JSON array, fetched and written a
// page at a time: the apiserver holds one page, not every sandbox of a
// large cluster. Nodes that could not be asked are named in the header
// X-Dsec-Unreachable-Nodes when the first page is the only one, else in
// a trailer of that name. Should a later page fail, the answer is cut
// off (the client sees a broken response), never ended short as if
// complete.
func (s *Server) e2bStreamAll(w http.ResponseWriter, r *http.Request, states []string, sel map[string]string, startedAfter time.Time) {
	cpu := s.nodeCPU()
	after, started, wrote := "", false, false
	var skipped []string
	for {
		raw, more, sk, err := s.listPage(r.Context(), states, sel, after, e2bStreamPage)
		if err != nil {
			if !started {
				s.e2bError(w, r, err)
				return
			}
			s.log.Warn("listing every sandbox: a later page failed; the answer is cut off", "after", after, "err", err)
			panic(http.ErrAbortHandler)
		}
		page, bad := s.decodePage(raw)
		for _, n := range append(sk, bad...) {
			if !slices.Contains(skipped, n) {
				skipped = append(skipped, n)
			}
		}
		if !started {
			started = true
			w.Header().Set("Content-Type", "application/json")
			if !more && len(skipped) > 0 {
				slices.Sort(skipped)
				w.Header().Set("X-Dsec-Unreachable-Nodes", strings.Join(skipped, ","))
			} else if more {
				w.Header().Set("Trailer", "X-Dsec-Unreachable-Nodes")
			}
			w.WriteHeader(http.StatusOK)
			_, _ = io.WriteString(w, "[")
		}
		for i := range page {
			if !startedAfter.IsZero() && !page[i].CreatedAt.After(startedAfter) {
				continue
			}
			b, err := json.Marshal(e2bDetailOf(&page[i], cpu))
			if err != nil {
				panic(http.ErrAbortHandler)
			}
			if wrote {
				_, _ = io.WriteString(w, ",")
			}
			_, _ = w.Write(b)
			wrote = true
		}
		if !more {
			break
		}
		if fl, ok := w.(http.Flusher); ok {
			fl.Flush()
		}
		after = raw[len(raw)-1].ID
	}
	_, _ = io.WriteString(w, "]\n")
	if w.Header().Get("Trailer") != "" && len(skipped) > 0 {
		slices.Sort(skipped)
		w.Header().Set("X-Dsec-Unreachable-Nodes", strings.Join(skipped, ","))
	}
}

// e2bStates reads the list's ?state= (comma-separated, or repeated):
// running and paused, as dsec states; def when absent.
func e2bStates(vals []string, def []string) ([]string, error) {
	var out []string
	for _, v := range vals {
		for _, st := range strings.Split(v, ",") {
			switch st = strings.TrimSpace(st); st {
			case "running", "paused":
				if !slices.Contains(out, st) {
					out = append(out, st)
				}
			case "":
			default:
				return nil, badQuery("state", v, "want running, paused or both (comma-separated)")
			}
		}
	}
	if len(out) == 0 {
		return def, nil
	}
	return out, nil
}

// e2bMetadataQuery reads the list's ?metadata=: pairs k=v joined by &,
// as a query string whose keys and values the SDK has URL-encoded once
// more (a value that does not decode again is taken as it is).
func e2bMetadataQuery(v string) (map[string]string, error) {
	sel := map[string]string{}
	if v == "" {
		return sel, nil
	}
	pairs, err := url.ParseQuery(v)
	if err != nil {
		return nil, badQuery("metadata", v, "want key=value pairs joined by &")
	}
	unescape := func(s string) string {
		if u, err := url.PathUnescape(s); err == nil {
			return u
		}
		return s
	}
	for k, vs := range pairs {
		sel[unescape(k)] = unescape(vs[len(vs)-1])
	}
	if err := sandbox.ValidateSelector(sel); err != nil {
		return nil, fmt.Errorf("metadata: %w", err)
	}
	return sel, nil
}

// e2bAlias is GET /templates/aliases/{alias}, which the SDK asks to tell
// whether a template name is taken: 200 with the template's id when an
// alias of that name exists.
func (s *Server) e2bAlias(w http.ResponseWriter, r *http.Request) {
	t, err := s.template(r.Context(), r.PathValue("alias"))
	if err != nil {
		s.e2bError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"templateID": t.Name, "public": false})
}

// Package apiserver is the only ingress of dsec: it authenticates every /v1
// call (iam), validates input, resolves layer refs through the catalog,
// places new sandboxes (placement) and forwards per-sandbox calls to the
// edge that owns them (the sandbox id names it). It keeps no per-sandbox
// state. It is the only package that knows HTTP status codes.
package apiserver

import (
	"context"
	"log/slog"
	"net/http"
	"runtime/debug"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/conns"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/iam"
	"github.com/dsecproject/dsec/internal/layer"
	"github.com/dsecproject/dsec/internal/placement"
	"github.com/dsecproject/dsec/internal/sandbox"
	"github.com/dsecproject/dsec/internal/store"
)

// Deps are the apiserver's collaborators.
type Deps struct {
	IAM    *iam.IAM
	Layers *layer.Store
	// PublishSnapshots: the edges stage the snapshots they pack and this
	// apiserver publishes them (a cluster, whose edges may not write the
	// layer catalog; Layers is then required); otherwise the edge
	// publishes them itself (dsec up).
	PublishSnapshots bool
	// Nodes is the view of the edges this apiserver places on and
	// forwards to (a watcher).
	Nodes Nodes
	// Placement is the placement policy.
	Placement placement.Config
	Log       *slog.Logger
	// Registry collects /metrics; Gatherer serves them.
	Registry prometheus.Registerer
	Gatherer prometheus.Gatherer
	// Policy bounds sandbox specs (the edges apply their own too).
	Policy sandbox.Policy
	// MaxLayerBytes bounds one layer upload (extracted size).
	MaxLayerBytes int64
	// Store keeps idempotency records (nil: Idempotency-Key ignored).
	Store store.Store
	// StateStore keeps the apiserver's own durable state: the E2B token
	// secret and template aliases (nil: Store). dsec up's Store is not
	// fsynced (records may be lost in a host crash, and are then made
	// again); what is here must not be.
	StateStore store.Store
	// QuotaStore shares quota reservations between the apiservers of a
	// cluster (etcd); nil keeps them in this process (dsec up: the only
	// apiserver).
	QuotaStore store.Store
	// Instance names this apiserver (the owner of records it runs), and
	// Alive tells whether another instance still runs (nil: only this
	// one does, as in dsec up).
	Instance string
	Alive    func(instance string) (bool, error)
	// IdempotencyTTL is how long a record answers (0: 24 h).
	IdempotencyTTL time.Duration
	// E2BDefaultTemplate is what the E2B API's template "base" (the E2B
	// SDK's default) stands for when no alias of that name exists: a
	// layer ref or an alias name ("" for none: "base" is then not found).
	E2BDefaultTemplate string
}

// Server serves the REST API.
type Server struct {
	deps     Deps
	log      *slog.Logger
	mux      *http.ServeMux
	metrics  *metrics
	inflight *inflight
	// pickMu serialises placement decisions (pick).
	pickMu sync.Mutex
	// records groups the idempotency records' writes.
	records *groupCommit
	// paths caches project paths by id (pathOf).
	paths pathCache
	// actions is the permission each route needs (the route table).
	actions map[string]iam.Action
	// authFails limits failed authentication per source address.
	authFails *authLimiter
	// quotas admits creates against project quotas (quota.go).
	quotas *quotas
	// e2bKey is the E2B access tokens' secret, once read (e2b.go).
	e2bKey e2bSecretState
}

// New builds the server and its routes.
func New(deps Deps) *Server {
	if deps.Log == nil {
		deps.Log = slog.Default()
	}
	s := &Server{deps: deps, log: deps.Log, mux: http.NewServeMux(), inflight: newInflight(), authFails: newAuthLimiter()}
	s.metrics = newMetrics(deps.Registry, deps.Nodes)
	s.quotas = newQuotas(s, deps.QuotaStore)
	if deps.Store != nil {
		s.records = newGroupCommit(deps.Store, idemBucket, deps.Log)
	}
	s.routes()
	return s
}

// Settle writes the idempotency records of answers already given that
// still wait for a transaction to ride with, and returns once they are
// written or within timeout. Call it once the HTTP server has stopped.
func (s *Server) Settle(timeout time.Duration) {
	if s.records != nil {
		s.records.settle(timeout)
	}
}

// stateStore is Deps.StateStore, or Store when there is none.
func (s *Server) stateStore() store.Store {
	if s.deps.StateStore != nil {
		return s.deps.StateStore
	}
	return s.deps.Store
}

// Run does the server's background work (expiring idempotency records)
// until ctx ends.
func (s *Server) Run(ctx context.Context) {
	go s.auditJanitor(ctx)
	if s.deps.Store != nil {
		s.idemJanitor(ctx)
	}
}

// auditJanitor trims audit entries older than iam.AuditRetention, hourly.
// Every apiserver runs one; trimming twice is harmless.
func (s *Server) auditJanitor(ctx context.Context) {
	t := time.NewTicker(time.Hour)
	defer t.Stop()
	for {
		if n, err := s.deps.IAM.TrimAudit(time.Now().Add(-iam.AuditRetention)); err != nil {
			s.log.Warn("trimming the audit log", "err", err)
		} else if n > 0 {
			s.log.Info("old audit entries removed", "count", n)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Handler returns the HTTP handler.
func (s *Server) Handler() http.Handler { return s.recoverPanics(s.mux) }

func (s *Server) routes() {
	s.mux.HandleFunc("GET /healthz", s.healthz)
	if s.deps.Gatherer != nil {
		s.mux.Handle("GET /metrics", promhttp.HandlerFor(s.deps.Gatherer, promhttp.HandlerOpts{}))
	}
	s.handle("GET /v1/openapi.yaml", "", s.openapi)

	s.handle("POST /v1/sandboxes", iam.SandboxCreate, s.idempotent(true, s.createSandbox))
	s.handle("POST /v1/sandboxes:batch", iam.SandboxCreate, s.idempotent(true, s.batchCreate))
	s.handle("GET /v1/sandboxes", iam.SandboxRead, s.listSandboxes)
	s.handle("POST /v1/sandboxes:delete", iam.SandboxWrite, s.deleteByLabels)
	s.handle("GET /v1/sandboxes/{id}", iam.SandboxRead, s.getSandbox)
	s.handle("DELETE /v1/sandboxes/{id}", iam.SandboxWrite, s.deleteSandbox)
	s.handle("POST /v1/sandboxes/{id}/keepalive", iam.SandboxWrite, s.keepalive)
	s.handle("GET /v1/sandboxes/{id}/stats", iam.SandboxRead, s.stats)
	s.handle("GET /v1/sandboxes/{id}/log", iam.SandboxRead, s.readLog)
	s.handle("POST /v1/sandboxes/{id}/pause", iam.SandboxWrite, s.pause)
	s.handle("POST /v1/sandboxes/{id}/resume", iam.SandboxWrite, s.resume)
	s.handle("POST /v1/sandboxes:pause", iam.SandboxWrite, s.pauseByLabels)
	s.handle("POST /v1/sandboxes:resume", iam.SandboxWrite, s.resumeByLabels)
	s.handle("POST /v1/sandboxes/{id}/snapshot", iam.LayerWrite, s.idempotentOnce(true, s.snapshot))
	s.handle("POST /v1/sandboxes/{id}/fork", iam.SandboxCreate, s.idempotent(true, s.fork))
	s.handle("PUT /v1/sandboxes/{id}/network", iam.SandboxWrite, s.setNetwork)
	s.handle("POST /v1/fncall", iam.SandboxCreate, s.idempotentOnce(true, s.fncall))
	s.handle("/v1/sandboxes/{id}/ports/{port}/{path...}", iam.SandboxWrite, s.proxyPort)
	s.handle("POST /v1/sandboxes/{id}/exec", iam.SandboxWrite, s.idempotentOnce(false, s.exec))
	s.handle("POST /v1/sandboxes/{id}/sessions", iam.SandboxWrite, s.openSession)
	s.handle("POST /v1/sandboxes/{id}/sessions/{sid}/run", iam.SandboxWrite, s.idempotentOnce(false, s.runSession))
	s.handle("DELETE /v1/sandboxes/{id}/sessions/{sid}", iam.SandboxWrite, s.closeSession)
	s.handle("GET /v1/sandboxes/{id}/pty", iam.SandboxWrite, s.pty)
	s.handle("GET /v1/sandboxes/{id}/files", iam.SandboxRead, s.readFile)
	s.handle("PUT /v1/sandboxes/{id}/files", iam.SandboxWrite, s.writeFile)
	s.handle("DELETE /v1/sandboxes/{id}/files", iam.SandboxWrite, s.removeFile)
	s.handle("GET /v1/sandboxes/{id}/files:list", iam.SandboxRead, s.listFiles)
	s.handle("GET /v1/sandboxes/{id}/files:stat", iam.SandboxRead, s.statFile)
	s.handle("GET /v1/sandboxes/{id}/files:tar", iam.SandboxRead, s.downloadTar)
	s.handle("PUT /v1/sandboxes/{id}/files:tar", iam.SandboxWrite, s.uploadTar)

	s.handle("POST /v1/layers", iam.LayerWrite, s.buildLayer)
	s.handle("POST /v1/layers:push", iam.LayerWrite, s.pushLayer)
	s.handle("POST /v1/layers:add", iam.LayerWrite, s.addLayer)
	s.handle("POST /v1/layers:gc", iam.LayerWrite, s.gcLayers)
	s.handle("GET /v1/layers", iam.LayerRead, s.listLayers)
	s.handle("GET /v1/layers/{ref...}", iam.LayerRead, s.getLayer)
	s.handle("DELETE /v1/layers/{ref...}", iam.LayerWrite, s.deleteLayer)
	s.handle("POST /v1/images:import", iam.LayerWrite, s.importImage)
	s.handle("POST /v1/images:pull", iam.LayerWrite, s.pullImage)
	s.handle("POST /v1/templates", iam.LayerWrite, s.createTemplate)
	s.handle("GET /v1/templates", iam.LayerRead, s.listTemplates)
	s.handle("GET /v1/templates/{name}", iam.LayerRead, s.getTemplate)
	s.handle("DELETE /v1/templates/{name}", iam.LayerWrite, s.deleteTemplate)

	s.handle("GET /v1/nodes", iam.SandboxRead, s.listNodes)

	s.handle("POST /v1/projects", iam.ProjectAdmin, s.createProject)
	s.handle("GET /v1/projects", iam.ProjectRead, s.listProjects)
	s.handle("GET /v1/projects/{id}", iam.ProjectRead, s.getProject)
	s.handle("PATCH /v1/projects/{id}", iam.ProjectAdmin, s.updateProject)
	s.handle("DELETE /v1/projects/{id}", iam.ProjectAdmin, s.deleteProject)
	s.handle("POST /v1/projects/{id}/keys", iam.KeyCreate, s.createKey)
	s.handle("GET /v1/projects/{id}/keys", iam.KeyCreate, s.listKeys)
	s.handle("DELETE /v1/projects/{id}/keys/{key_id}", iam.KeyCreate, s.revokeKey)
	s.handle("GET /v1/whoami", "", s.whoami)
	s.handle("GET /v1/audit", iam.AuditRead, s.listAudit)
	// Anything else under /v1 is a JSON 404, not the mux's text page.
	s.e2bRoutes()
	s.handle("/v1/", "", func(w http.ResponseWriter, r *http.Request) {
		s.writeError(w, r, errdefs.NotFound("no such endpoint: %s %s", r.Method, r.URL.Path))
	})
}

type principalKey struct{}

// handle registers an authenticated route that needs action ("" = any
// authenticated principal).
func (s *Server) handle(pattern string, action iam.Action, h http.HandlerFunc) {
	if s.actions == nil {
		s.actions = map[string]iam.Action{}
	}
	s.actions[pattern] = action
	s.mux.Handle(pattern, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec := &statusRecorder{ResponseWriter: w, status: http.StatusOK}
		defer func() { s.metrics.requests.WithLabelValues(pattern, strconv.Itoa(rec.status)).Inc() }()
		key, ok := bearer(r)
		ctx, ok := s.admit(rec, r, key, ok, action, `Bearer realm="dsec"`, s.writeError)
		if !ok {
			return
		}
		h(rec, r.WithContext(ctx))
	}))
}

// admit authenticates the key of a request (found: whether the request
// carried one) and authorizes action ("" = any principal), writing the
// refusal with fail. On success it returns the request's context with
// the principal and its scope: every edge call made for the request
// carries the scope, and the edges answer only about sandboxes of the
// principal's project and below (edgeapi/scope.go). challenge is the
// WWW-Authenticate value of a refusal ("" for none).
func (s *Server) admit(w http.ResponseWriter, r *http.Request, key string, found bool, action iam.Action, challenge string,
	fail func(http.ResponseWriter, *http.Request, error)) (context.Context, bool) {
	addr := peer(r)
	if d := s.authFails.wait(addr); d > 0 {
		w.Header().Set("Retry-After", retryAfter(d))
		if challenge != "" {
			w.Header().Set("WWW-Authenticate", challenge)
		}
		hangUp(w)
		fail(w, r, errdefs.Unauthenticated("too many failed authentications from %s; retry in %s s", addr, retryAfter(d)))
		return nil, false
	}
	if !found {
		if challenge != "" {
			w.Header().Set("WWW-Authenticate", challenge)
		}
		hangUp(w)
		fail(w, r, errdefs.Unauthenticated("missing API key (Authorization: Bearer <api key>, or X-API-KEY on the E2B API)"))
		return nil, false
	}
	p, err := s.deps.IAM.Authenticate(key)
	if err != nil {
		if errdefs.Code(err) == "unauthenticated" {
			s.authFails.fail(addr)
		}
		if challenge != "" {
			w.Header().Set("WWW-Authenticate", challenge+`, error="invalid_token"`)
		}
		hangUp(w)
		fail(w, r, err)
		return nil, false
	}
	// The connection has carried an authenticated request: a flood of
	// connections that have not may no longer push it out.
	conns.Trust(r.Context())
	if action != "" {
		if err := s.deps.IAM.Authorize(p, action); err != nil {
			fail(w, r, err)
			return nil, false
		}
	}
	scope, err := s.pathOf(p.Project)
	if err != nil {
		fail(w, r, err)
		return nil, false
	}
	return edgeapi.WithScope(context.WithValue(r.Context(), principalKey{}, p), scope), true
}

// hangUp makes the connection of an unauthenticated request close once
// it is answered: it is not kept alive for the next request, and what is
// left of its body is not read (the server would read up to 256 KiB of it
// to reuse the connection, with no deadline, for as long as a client
// holding it back liked).
func hangUp(w http.ResponseWriter) {
	w.Header().Set("Connection", "close")
	_ = http.NewResponseController(w).SetReadDeadline(time.Now())
}

func bearer(r *http.Request) (string, bool) {
	h := r.Header.Get("Authorization")
	const prefix = "Bearer "
	if len(h) <= len(prefix) || !equalFold(h[:len(prefix)], prefix) {
		return "", false
	}
	return h[len(prefix):], true
}

func equalFold(a, b string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := 0; i < len(a); i++ {
		ca, cb := a[i]|0x20, b[i]|0x20
		if ca != cb {
			return false
		}
	}
	return true
}

// statusRecorder remembers the status for metrics and passes Flush through
// (streaming exec needs it).
type statusRecorder struct {
	http.ResponseWriter
	status int
	wrote  bool
}

func (s *statusRecorder) WriteHeader(code int) {
	if !s.wrote {
		s.status, s.wrote = code, true
	}
	s.ResponseWriter.WriteHeader(code)
}

func (s *statusRecorder) Write(b []byte) (int, error) {
	s.wrote = true
	return s.ResponseWriter.Write(b)
}

func (s *statusRecorder) Flush() {
	if f, ok := s.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

func (s *statusRecorder) Unwrap() http.ResponseWriter { return s.ResponseWriter }

// recoverPanics turns a handler panic into a 500 with the API error shape:
// a bug in one request must never take the daemon down.
func (s *Server) recoverPanics(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer func() {
			if v := recover(); v != nil {
				if v == http.ErrAbortHandler {
					panic(v)
				}
				s.log.Error("handler panic", "method", r.Method, "path", r.URL.Path, "panic", v, "stack", string(debug.Stack()))
				writeJSON(w, http.StatusInternalServerError, api.ErrorBody{Error: api.ErrorDetail{Code: "internal", Message: "internal error (logged by the server)"}})
			}
		}()
		h.ServeHTTP(w, r)
	})
}

func (s *Server) healthz(w http.ResponseWriter, r *http.Request) {
	nodes := []string{}
	for _, t := range s.deps.Nodes.Edges() {
		nodes = append(nodes, t.Name)
	}
	writeJSON(w, http.StatusOK, map[string]any{"status": "ok", "nodes": nodes, "time": time.Now().UTC()})
}

func (s *Server) openapi(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/yaml")
	_, _ = w.Write(api.OpenAPI)
}

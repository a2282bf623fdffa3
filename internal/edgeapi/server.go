package edgeapi

import (
	"bufio"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"runtime/debug"
	"strconv"
	"sync"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// Prefix starts every path of the internal API.
const Prefix = "/internal/v1"

// Headers and the upgrade protocol of the internal API.
const (
	// headerFileEntry carries a read file's api.FileEntry (base64 JSON).
	headerFileEntry = "X-Dsec-File-Entry"
	// trailerError carries an error that struck after a streamed body
	// began (base64 JSON api.ErrorDetail).
	trailerError = "X-Dsec-Error"
	// upgradePort is the protocol of a port connection: after 101, the
	// connection carries the bytes of a TCP connection to the port.
	upgradePort = "dsec-port"
)

// maxJSONBody bounds the JSON bodies the internal API accepts. The
// apiserver bounds what it forwards; this only stops a runaway caller.
const maxJSONBody = 64 << 20

// wireEvent is one line of a streamed exec: an output event, the final
// result, or the error that ended it.
type wireEvent struct {
	Event  *api.ExecEvent   `json:"event,omitempty"`
	Result *api.ExecResult  `json:"result,omitempty"`
	Error  *api.ErrorDetail `json:"error,omitempty"`
}

type fnCallBody struct {
	Request api.FnCallRequest `json:"request"`
	Create  CreateRequest     `json:"create"`
}

type labelsBody struct {
	Labels map[string]string `json:"labels"`
}

type countBody struct {
	Count int `json:"count"`
}

type listBody struct {
	Sandboxes []api.Sandbox `json:"sandboxes"`
}

type usersBody struct {
	Users int `json:"users"`
}

// wireFileEvent is one line of a streamed watch: an event, the error
// that ended it, or End when it ended without one.
type wireFileEvent struct {
	Event *api.FileEvent   `json:"event,omitempty"`
	Error *api.ErrorDetail `json:"error,omitempty"`
	End   bool             `json:"end,omitempty"`
}

// moveBody is a files:move request.
type moveBody struct {
	Source      string `json:"source"`
	Destination string `json:"destination"`
}

type filesBody struct {
	Entries []api.FileEntry `json:"entries"`
}

type ttlBody struct {
	TTL int64 `json:"ttl"`
}

// Server serves an Edge as the internal API. Authentication is the
// listener's business (mutual TLS in a cluster): the server trusts every
// request that reaches it.
type Server struct {
	e   Edge
	log *slog.Logger
	mux *http.ServeMux
}

// NewServer returns the internal API over e.
func NewServer(e Edge, log *slog.Logger) *Server {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Server{e: e, log: log, mux: http.NewServeMux()}
	s.routes()
	return s
}

// ServeHTTP implements http.Handler. A handler panic answers 500 and is
// logged: one bad request must not take the node down.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	defer func() {
		if v := recover(); v != nil {
			if v == http.ErrAbortHandler {
				panic(v)
			}
			s.log.Error("internal API handler panic", "method", r.Method, "path", r.URL.Path, "panic", v, "stack", string(debug.Stack()))
			writeError(w, errors.New("internal error (logged by the edge)"))
		}
	}()
	s.mux.ServeHTTP(w, scopeFromRequest(r))
}

func (s *Server) routes() {
	p := Prefix
	s.mux.HandleFunc("GET "+p+"/info", s.info)
	s.mux.HandleFunc("GET "+p+"/layers/{digest}/users", s.layerUsers)
	s.mux.HandleFunc("POST "+p+"/sandboxes", s.create)
	s.mux.HandleFunc("POST "+p+"/sandboxes:list", s.list)
	s.mux.HandleFunc("POST "+p+"/sandboxes:delete", s.byLabels(Edge.DeleteByLabels))
	s.mux.HandleFunc("POST "+p+"/sandboxes:pause", s.byLabels(Edge.PauseByLabels))
	s.mux.HandleFunc("POST "+p+"/sandboxes:resume", s.byLabels(Edge.ResumeByLabels))
	s.mux.HandleFunc("POST "+p+"/fncall", s.fncall)
	s.mux.HandleFunc("GET "+p+"/sandboxes/{id}", s.get)
	s.mux.HandleFunc("DELETE "+p+"/sandboxes/{id}", s.delete)
	s.mux.HandleFunc("POST "+p+"/sandboxes/{id}/keepalive", s.keepalive)
	s.mux.HandleFunc("GET "+p+"/sandboxes/{id}/stats", s.stats)
	s.mux.HandleFunc("POST "+p+"/sandboxes/{id}/pause", s.pause)
	s.mux.HandleFunc("POST "+p+"/sandboxes/{id}/resume", s.resume)
	s.mux.HandleFunc("POST "+p+"/sandboxes/{id}/snapshot", s.snapshot)
	s.mux.HandleFunc("PUT "+p+"/sandboxes/{id}/network", s.network)
	s.mux.HandleFunc("GET "+p+"/sandboxes/{id}/ports/{port}", s.port)
	s.mux.HandleFunc("POST "+p+"/sandboxes/{id}/exec", s.exec)
	s.mux.HandleFunc("POST "+p+"/sandboxes/{id}/sessions", s.openSession)
	s.mux.HandleFunc("POST "+p+"/sandboxes/{id}/sessions/{sid}/run", s.runSession)
	s.mux.HandleFunc("DELETE "+p+"/sandboxes/{id}/sessions/{sid}", s.closeSession)
	s.mux.HandleFunc("GET "+p+"/sandboxes/{id}/files", s.readFile)
	s.mux.HandleFunc("PUT "+p+"/sandboxes/{id}/files", s.writeFile)
	s.mux.HandleFunc("DELETE "+p+"/sandboxes/{id}/files", s.removeFile)
	s.mux.HandleFunc("GET "+p+"/sandboxes/{id}/files:stat", s.statFile)
	s.mux.HandleFunc("GET "+p+"/sandboxes/{id}/files:list", s.listFiles)
	s.mux.HandleFunc("GET "+p+"/sandboxes/{id}/files:tar", s.writeTar)
	s.mux.HandleFunc("PUT "+p+"/sandboxes/{id}/files:tar", s.extractTar)
	s.mux.HandleFunc("POST "+p+"/sandboxes/{id}/files:mkdir", s.makeDir)
	s.mux.HandleFunc("POST "+p+"/sandboxes/{id}/files:move", s.moveFile)
	s.mux.HandleFunc("GET "+p+"/sandboxes/{id}/files:watch", s.watchDir)
	s.mux.HandleFunc("GET "+p+"/sandboxes/{id}/log", s.readLog)
	s.processRoutes(p)
	s.mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, errdefs.NotFound("no such internal endpoint: %s %s", r.Method, r.URL.Path))
	})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	switch v.(type) {
	case *api.ExecResult, *api.FnCallResult:
		_ = writeOutputFrame(w, status, v)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// writeError writes err as the API error body. The message goes as it is:
// the caller is an apiserver, which decides what a client may see.
func writeError(w http.ResponseWriter, err error) {
	code := errdefs.Code(err)
	writeJSON(w, errdefs.HTTPStatus(code), api.ErrorBody{Error: api.ErrorDetail{Code: code, Message: err.Error()}})
}

// answer writes v (status) or err; a nil v with no error answers 204.
func answer(w http.ResponseWriter, status int, v any, err error) {
	switch {
	case err != nil:
		writeError(w, err)
	case v == nil:
		w.WriteHeader(http.StatusNoContent)
	default:
		writeJSON(w, status, v)
	}
}

func decodeBody(r *http.Request, v any) error {
	dec := json.NewDecoder(http.MaxBytesReader(nil, r.Body, maxJSONBody))
	if err := dec.Decode(v); err != nil {
		return errdefs.Invalid("internal API: decoding request body: %v", err)
	}
	return nil
}

func intQuery(r *http.Request, name string) (int64, error) {
	v := r.URL.Query().Get(name)
	if v == "" {
		return 0, nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return 0, errdefs.Invalid("internal API: query %s=%q is not an integer", name, v)
	}
	return n, nil
}

func (s *Server) info(w http.ResponseWriter, r *http.Request) {
	n, err := s.e.Info(r.Context())
	answer(w, http.StatusOK, n, err)
}

func (s *Server) layerUsers(w http.ResponseWriter, r *http.Request) {
	n, err := s.e.LayerUsers(r.Context(), r.PathValue("digest"))
	answer(w, http.StatusOK, usersBody{Users: n}, err)
}

func (s *Server) create(w http.ResponseWriter, r *http.Request) {
	var req CreateRequest
	if err := decodeBody(r, &req); err != nil {
		writeError(w, err)
		return
	}
	sb, err := s.e.Create(r.Context(), req)
	answer(w, http.StatusCreated, sb, err)
}

func (s *Server) list(w http.ResponseWriter, r *http.Request) {
	var f ListFilter
	if err := decodeBody(r, &f); err != nil {
		writeError(w, err)
		return
	}
	l, err := s.e.List(r.Context(), f)
	if err == nil && wantsLines(r) {
		writeListLines(w, l)
		return
	}
	if l == nil {
		l = []api.Sandbox{}
	}
	answer(w, http.StatusOK, listBody{Sandboxes: l}, err)
}

func (s *Server) byLabels(fn func(Edge, context.Context, map[string]string) (int, error)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var b labelsBody
		if err := decodeBody(r, &b); err != nil {
			writeError(w, err)
			return
		}
		n, err := fn(s.e, r.Context(), b.Labels)
		// The count of what was done before an error is part of the
		// answer: the error body carries it too.
		if err != nil {
			w.Header().Set("X-Dsec-Count", strconv.Itoa(n))
		}
		answer(w, http.StatusOK, countBody{Count: n}, err)
	}
}

func (s *Server) fncall(w http.ResponseWriter, r *http.Request) {
	var b fnCallBody
	if err := decodeBody(r, &b); err != nil {
		writeError(w, err)
		return
	}
	res, err := s.e.FnCall(r.Context(), b.Request, b.Create)
	answer(w, http.StatusOK, res, err)
}

func (s *Server) get(w http.ResponseWriter, r *http.Request) {
	sb, err := s.e.Get(r.Context(), r.PathValue("id"))
	answer(w, http.StatusOK, sb, err)
}

func (s *Server) delete(w http.ResponseWriter, r *http.Request) {
	answer(w, 0, nil, s.e.Delete(r.Context(), r.PathValue("id")))
}

func (s *Server) keepalive(w http.ResponseWriter, r *http.Request) {
	var b ttlBody
	if err := decodeBody(r, &b); err != nil {
		writeError(w, err)
		return
	}
	sb, err := s.e.Keepalive(r.Context(), r.PathValue("id"), b.TTL)
	answer(w, http.StatusOK, sb, err)
}

func (s *Server) stats(w http.ResponseWriter, r *http.Request) {
	st, err := s.e.Stats(r.Context(), r.PathValue("id"))
	answer(w, http.StatusOK, st, err)
}

func (s *Server) pause(w http.ResponseWriter, r *http.Request) {
	res, err := s.e.Pause(r.Context(), r.PathValue("id"))
	answer(w, http.StatusOK, res, err)
}

func (s *Server) resume(w http.ResponseWriter, r *http.Request) {
	sb, err := s.e.Resume(r.Context(), r.PathValue("id"))
	answer(w, http.StatusOK, sb, err)
}

func (s *Server) snapshot(w http.ResponseWriter, r *http.Request) {
	var o SnapshotOptions
	if err := decodeBody(r, &o); err != nil {
		writeError(w, err)
		return
	}
	l, err := s.e.Snapshot(r.Context(), r.PathValue("id"), o)
	answer(w, http.StatusCreated, l, err)
}

func (s *Server) network(w http.ResponseWriter, r *http.Request) {
	var np api.NetworkPolicy
	if err := decodeBody(r, &np); err != nil {
		writeError(w, err)
		return
	}
	sb, err := s.e.SetNetwork(r.Context(), r.PathValue("id"), np)
	answer(w, http.StatusOK, sb, err)
}

// port connects the caller to a port of the sandbox: the request asks to
// upgrade to upgradePort, and after 101 the connection is the TCP stream.
func (s *Server) port(w http.ResponseWriter, r *http.Request) {
	if r.Header.Get("Upgrade") != upgradePort {
		writeError(w, errdefs.Invalid("internal API: a port connection must ask to upgrade to %s", upgradePort))
		return
	}
	port, err := strconv.Atoi(r.PathValue("port"))
	if err != nil {
		writeError(w, errdefs.Invalid("port %q is not a number", r.PathValue("port")))
		return
	}
	conn, done, err := s.e.DialPort(r.Context(), r.PathValue("id"), port)
	if err != nil {
		writeError(w, err)
		return
	}
	defer done()
	defer conn.Close()
	rc := http.NewResponseController(w)
	w.Header().Set("Connection", "Upgrade")
	w.Header().Set("Upgrade", upgradePort)
	w.WriteHeader(http.StatusSwitchingProtocols)
	if err := rc.Flush(); err != nil {
		return
	}
	peer, brw, err := rc.Hijack()
	if err != nil {
		s.log.Warn("port connection: hijacking", "err", err)
		return
	}
	defer peer.Close()
	splice(peer, brw.Reader, conn)
}

// spliceGrace is how long one side of a port connection may go on once
// the other has ended its own.
const spliceGrace = 5 * time.Second

// splice copies both ways between the caller's connection (with what its
// reader buffered) and the sandbox's. When either side ends, the other
// gets spliceGrace to finish, then both end: a quiet service that ignores
// the caller's close cannot hold the connection (and keep its sandbox
// from idling) for ever.
func splice(peer net.Conn, buffered *bufio.Reader, conn net.Conn) {
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		_, _ = io.Copy(conn, buffered)
		closeWrite(conn)
		_ = conn.SetReadDeadline(time.Now().Add(spliceGrace))
	}()
	_, _ = io.Copy(peer, conn)
	closeWrite(peer)
	_ = peer.SetReadDeadline(time.Now().Add(spliceGrace))
	wg.Wait()
}

func closeWrite(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	}
}

func (s *Server) exec(w http.ResponseWriter, r *http.Request) {
	var req api.ExecRequest
	if err := decodeBody(r, &req); err != nil {
		writeError(w, err)
		return
	}
	id := r.PathValue("id")
	if r.URL.Query().Get("stream") != "1" {
		res, err := s.e.Exec(r.Context(), id, req, nil)
		answer(w, http.StatusOK, res, err)
		return
	}
	ls := newLineStream(w)
	res, err := s.e.Exec(r.Context(), id, req, func(ev api.ExecEvent) error { return ls.send(wireEvent{Event: &ev}) })
	switch {
	case err != nil && !ls.begun():
		writeError(w, err)
	case err != nil:
		_ = ls.send(wireEvent{Error: errorDetail(err)})
	default:
		_ = ls.send(wireEvent{Result: res})
	}
}

// lineStream writes a streamed answer as NDJSON, each line flushed as it
// is written. The headers go out with the first line, so that an error
// found before any (a command that cannot start) still gets its own
// status. Safe for concurrent use.
type lineStream struct {
	w       http.ResponseWriter
	enc     *json.Encoder
	rc      *http.ResponseController
	mu      sync.Mutex
	started bool
}

func newLineStream(w http.ResponseWriter) *lineStream {
	return &lineStream{w: w, enc: json.NewEncoder(w), rc: http.NewResponseController(w)}
}

func (l *lineStream) send(v any) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.started {
		l.w.Header().Set("Content-Type", "application/x-ndjson")
		l.w.WriteHeader(http.StatusOK)
		l.started = true
	}
	if err := l.enc.Encode(v); err != nil {
		return err
	}
	return l.rc.Flush()
}

// begun reports whether a line has gone out (the status with it).
func (l *lineStream) begun() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.started
}

func errorDetail(err error) *api.ErrorDetail {
	return &api.ErrorDetail{Code: errdefs.Code(err), Message: err.Error()}
}

func (s *Server) openSession(w http.ResponseWriter, r *http.Request) {
	var req api.SessionRequest
	if err := decodeBody(r, &req); err != nil {
		writeError(w, err)
		return
	}
	ss, err := s.e.OpenSession(r.Context(), r.PathValue("id"), req)
	answer(w, http.StatusCreated, ss, err)
}

func (s *Server) runSession(w http.ResponseWriter, r *http.Request) {
	var req api.SessionRunRequest
	if err := decodeBody(r, &req); err != nil {
		writeError(w, err)
		return
	}
	res, err := s.e.RunInSession(r.Context(), r.PathValue("id"), r.PathValue("sid"), req)
	answer(w, http.StatusOK, res, err)
}

func (s *Server) closeSession(w http.ResponseWriter, r *http.Request) {
	answer(w, 0, nil, s.e.CloseSession(r.Context(), r.PathValue("id"), r.PathValue("sid")))
}

func encodeHeaderJSON(v any) string {
	b, _ := json.Marshal(v)
	return base64.StdEncoding.EncodeToString(b)
}

func (s *Server) readFile(w http.ResponseWriter, r *http.Request) {
	rc, fe, err := s.e.ReadFile(r.Context(), r.PathValue("id"), r.URL.Query().Get("path"))
	if err != nil {
		writeError(w, err)
		return
	}
	defer rc.Close()
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set(headerFileEntry, encodeHeaderJSON(fe))
	w.Header().Set("Content-Length", strconv.FormatInt(fe.Size, 10))
	w.WriteHeader(http.StatusOK)
	_, _ = io.Copy(w, rc) // the ResponseWriter reads from rc itself
}

func (s *Server) writeFile(w http.ResponseWriter, r *http.Request) {
	mode, err := intQuery(r, "mode")
	if err != nil {
		writeError(w, err)
		return
	}
	q := r.URL.Query()
	fe, err := s.e.WriteFile(r.Context(), r.PathValue("id"), q.Get("path"), r.Body, os.FileMode(uint32(mode)), q.Get("owner"))
	answer(w, http.StatusOK, fe, err)
}

func (s *Server) removeFile(w http.ResponseWriter, r *http.Request) {
	rec := r.URL.Query().Get("recursive") == "1"
	answer(w, 0, nil, s.e.RemoveFile(r.Context(), r.PathValue("id"), r.URL.Query().Get("path"), rec))
}

func (s *Server) statFile(w http.ResponseWriter, r *http.Request) {
	fe, err := s.e.StatFile(r.Context(), r.PathValue("id"), r.URL.Query().Get("path"))
	answer(w, http.StatusOK, fe, err)
}

func (s *Server) listFiles(w http.ResponseWriter, r *http.Request) {
	depth, err := intQuery(r, "depth")
	if err != nil {
		writeError(w, err)
		return
	}
	l, err := s.e.ListFiles(r.Context(), r.PathValue("id"), r.URL.Query().Get("path"), int(depth))
	if l == nil {
		l = []api.FileEntry{}
	}
	answer(w, http.StatusOK, filesBody{Entries: l}, err)
}

// lazyWriter sends the response headers with the first byte, so that an
// error before it can still be answered with a status.
type lazyWriter struct {
	w       http.ResponseWriter
	started bool
}

func (l *lazyWriter) Write(p []byte) (int, error) {
	if !l.started {
		l.w.Header().Set("Content-Type", "application/x-tar")
		l.w.Header().Set("Trailer", trailerError)
		l.w.WriteHeader(http.StatusOK)
		l.started = true
	}
	return l.w.Write(p)
}

func (s *Server) writeTar(w http.ResponseWriter, r *http.Request) {
	lw := &lazyWriter{w: w}
	err := s.e.WriteTar(r.Context(), r.PathValue("id"), r.URL.Query().Get("path"), lw)
	switch {
	case err == nil && !lw.started:
		_, _ = lw.Write(nil)
	case err != nil && !lw.started:
		writeError(w, err)
	case err != nil:
		// Too late for a status: the trailer says the stream is broken.
		w.Header().Set(trailerError, encodeHeaderJSON(api.ErrorDetail{Code: errdefs.Code(err), Message: err.Error()}))
	}
}

func (s *Server) extractTar(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	res, err := s.e.ExtractTar(r.Context(), r.PathValue("id"), q.Get("path"), r.Body, q.Get("owner"))
	answer(w, http.StatusOK, res, err)
}

func (s *Server) makeDir(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	fe, err := s.e.MakeDir(r.Context(), r.PathValue("id"), q.Get("path"), q.Get("owner"))
	answer(w, http.StatusOK, fe, err)
}

func (s *Server) moveFile(w http.ResponseWriter, r *http.Request) {
	var b moveBody
	if err := decodeBody(r, &b); err != nil {
		writeError(w, err)
		return
	}
	fe, err := s.e.MoveFile(r.Context(), r.PathValue("id"), b.Source, b.Destination)
	answer(w, http.StatusOK, fe, err)
}

// watchDir streams a watch as NDJSON lines (wireFileEvent), each flushed
// as it is written. The headers go out with the start event, so that an
// error setting the watch up still gets its own status.
func (s *Server) watchDir(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	ls := newLineStream(w)
	err := s.e.WatchDir(r.Context(), r.PathValue("id"), q.Get("path"), q.Get("recursive") == "1", func(ev api.FileEvent) error {
		return ls.send(wireFileEvent{Event: &ev})
	})
	switch {
	case err != nil && !ls.begun():
		writeError(w, err)
	case err != nil:
		_ = ls.send(wireFileEvent{Error: errorDetail(err)})
	default:
		_ = ls.send(wireFileEvent{End: true})
	}
}

func (s *Server) readLog(w http.ResponseWriter, r *http.Request) {
	since, err := intQuery(r, "since_seq")
	if err != nil {
		writeError(w, err)
		return
	}
	limit, err := intQuery(r, "limit")
	if err != nil {
		writeError(w, err)
		return
	}
	page, err := s.e.ReadLog(r.Context(), r.PathValue("id"), since, int(limit))
	answer(w, http.StatusOK, page, err)
}

// String names the server in logs.
func (s *Server) String() string { return fmt.Sprintf("internal API of %s", s.e.Name()) }

package apiserver

// envd's files, for the E2B SDK (docs/e2b.md, "Files (envd)"): the
// filesystem.Filesystem Connect service (Stat, MakeDir, Move, ListDir,
// Remove, WatchDir) and the plain HTTP /files (download, upload) and
// /health, all on the edge calls the /v1 files API uses. Paths are the
// sandbox's (the edge confines every one to its root); a relative path is
// taken from the user's home, as envd does.

import (
	"compress/gzip"
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"os"
	"path"
	"strconv"
	"strings"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/e2b/filesystempb"
	"github.com/dsecproject/dsec/internal/e2b/filesystempb/filesystempbconnect"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/sandbox"
)

// Bounds of the envd files API. A file's size is bounded by the edge, as
// for /v1 writes (the edge's MaxUploadBytes).
const (
	// envdMaxMessage bounds one Connect request message: they carry
	// only paths.
	envdMaxMessage = 1 << 20
	// maxUploadParts bounds the parts of one multipart upload.
	maxUploadParts = 1000
	// maxListDepth bounds ListDir's depth, as files:list's.
	maxListDepth = 64
	// maxPathLen is the kernel's PATH_MAX, which the edge enforces too.
	maxPathLen = 4096
)

func (s *Server) envdFilesRoutes() {
	pattern, h := filesystempbconnect.NewFilesystemHandler(&envdFS{s: s}, connect.WithReadMaxBytes(envdMaxMessage))
	s.envdHandle(pattern, connectOnly(h, s.connectError), s.connectError)
	// Unauthenticated: the SDK probes it with no token to tell whether a
	// sandbox is still there (envdHealth says only that much, and only
	// to its token's holder).
	s.mux.HandleFunc("GET /health", s.envdHealth)
	s.envdHandle("GET /files", http.HandlerFunc(s.envdDownload), s.envdFilesError)
	s.envdHandle("POST /files", http.HandlerFunc(s.envdUpload), s.envdFilesError)
}

// connectOnly refuses, as a Connect error, what h (connect's handler)
// would answer with a bare 405 or 415: a request that is not a POST in
// one of the protocols it speaks.
func connectOnly(h http.Handler, fail func(http.ResponseWriter, *http.Request, error)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost || !envdErrors.IsSupported(r) {
			fail(w, r, errdefs.Invalid("%s with Content-Type %q: envd's Connect API takes POST with application/json (unary calls) or application/connect+json (streams), or gRPC",
				r.Method, r.Header.Get("Content-Type")))
			return
		}
		h.ServeHTTP(w, r)
	})
}

// envdCall is one envd files request: the sandbox's edge and id, and whom
// the request acts for.
type envdCall struct {
	e  edgeapi.Edge
	id string
	// user is the user the request names ("" for the sandbox's own), and
	// home the user's home once a relative path needed it.
	user, home string
	// acting is the user the request acts for once asked (actingUser).
	acting      string
	actingKnown bool
}

// actingUser is the user the request acts for: the one it names, else
// the sandbox's own (its spec's user; "" when it has none, which is
// root). What the request creates belongs to it, as envd makes it.
func (c *envdCall) actingUser(ctx context.Context) (string, error) {
	if c.user != "" {
		return c.user, nil
	}
	if !c.actingKnown {
		sb, err := c.e.Get(ctx, c.id)
		if err != nil {
			return "", c.fail(ctx, err)
		}
		c.acting, c.actingKnown = sb.Spec.User, true
	}
	return c.acting, nil
}

// newEnvdCall starts an envd files request for user ("" for the
// sandbox's default user).
func (s *Server) newEnvdCall(ctx context.Context, user string) (*envdCall, error) {
	e, id, err := s.envdEdge(ctx)
	if errors.Is(err, errdefs.ErrNotFound) {
		// A malformed id, or a node no longer in the cluster.
		return nil, errdefs.Unavailable("sandbox %s is not running: it does not exist", id)
	}
	if err != nil {
		return nil, err
	}
	return &envdCall{e: e, id: id, user: user}, nil
}

// checkUserName validates a user name from the request with the rule
// every user name in dsec follows (sandbox.ValidateUser), a bare name or
// uid here. envd refuses a user the sandbox does not have as
// unauthenticated; names that could not be a user are refused the same way.
func checkUserName(name string) (string, error) {
	if name == "" {
		return "", nil
	}
	if sandbox.ValidateUser(name) != nil || strings.Contains(name, ":") {
		return "", errdefs.Unauthenticated("invalid username %q", name)
	}
	return name, nil
}

// basicUser is the user of Authorization: Basic base64("<user>:"), the
// way the SDK names one ("" without the header).
func basicUser(h http.Header) (string, error) {
	v := h.Get("Authorization")
	if v == "" {
		return "", nil
	}
	scheme, cred, _ := strings.Cut(v, " ")
	b, err := base64.StdEncoding.DecodeString(strings.TrimSpace(cred))
	if !strings.EqualFold(scheme, "Basic") || err != nil {
		return "", errdefs.Unauthenticated(`malformed Authorization header: want Basic base64("<user>:")`)
	}
	name, _, _ := strings.Cut(string(b), ":")
	return checkUserName(name)
}

// homeOf is the home directory of user, by the convention of E2B's
// templates: root's is /root, any other name's /home/<name>. (envd reads
// /etc/passwd; a user whose home is elsewhere passes absolute paths.) A
// numeric user has no name to go by: "/".
func homeOf(user string) string {
	name, _, _ := strings.Cut(user, ":")
	switch {
	case name == "" || name == "root" || name == "0":
		return "/root"
	case strings.Trim(name, "0123456789") == "":
		return "/"
	}
	return "/home/" + name
}

// resolve turns a request's path into the sandbox path it names: an
// absolute path as it is; "~" and "~/x" under the user's home; a relative
// path (or none) from the home. The user, when the request names none, is
// the sandbox's own (its spec's; root if it has none).
func (c *envdCall) resolve(ctx context.Context, p string) (string, error) {
	if len(p) > maxPathLen || strings.IndexByte(p, 0) >= 0 {
		return "", errdefs.Invalid("path longer than %d bytes, or holding a NUL byte", maxPathLen)
	}
	if strings.HasPrefix(p, "/") {
		return path.Clean(p), nil
	}
	if p == "~" || strings.HasPrefix(p, "~/") {
		p = strings.TrimPrefix(strings.TrimPrefix(p, "~"), "/")
	} else if strings.HasPrefix(p, "~") {
		return "", errdefs.Invalid("path %q: only the request's own user's home (~) can be named", p)
	}
	if c.home == "" {
		user, err := c.actingUser(ctx)
		if err != nil {
			return "", err
		}
		c.home = homeOf(user)
	}
	return path.Join(c.home, p), nil
}

// fail turns the error of an edge call into what envd would answer: a
// sandbox that is gone or no longer running is unavailable (the SDK's
// "sandbox is not running"), not a missing file or a failed precondition.
// Asking costs a call, made only on those errors.
func (c *envdCall) fail(ctx context.Context, err error) error {
	if !errors.Is(err, errdefs.ErrNotFound) && !errors.Is(err, errdefs.ErrPrecondition) {
		return err
	}
	sb, gerr := c.e.Get(ctx, c.id)
	switch {
	case errors.Is(gerr, errdefs.ErrNotFound):
		return errdefs.Unavailable("sandbox %s is not running: it does not exist (any more)", c.id)
	case gerr == nil && sb.State != api.StateRunning && sb.State != api.StatePaused:
		return errdefs.Unavailable("sandbox %s is not running: it is %s", c.id, sb.State)
	}
	return err
}

// connectCode maps an error class to the Connect code envd would use.
func connectCode(err error) connect.Code {
	switch {
	case errors.Is(err, context.Canceled):
		return connect.CodeCanceled
	case errors.Is(err, context.DeadlineExceeded):
		return connect.CodeDeadlineExceeded
	}
	switch errdefs.Code(err) {
	case "invalid_argument":
		return connect.CodeInvalidArgument
	case "not_found":
		return connect.CodeNotFound
	case "already_exists":
		return connect.CodeAlreadyExists
	case "failed_precondition":
		return connect.CodeFailedPrecondition
	case "resource_exhausted", "quota_exceeded":
		return connect.CodeResourceExhausted
	case "unauthenticated":
		return connect.CodeUnauthenticated
	case "permission_denied":
		return connect.CodePermissionDenied
	case "unavailable":
		return connect.CodeUnavailable
	}
	return connect.CodeInternal
}

// toConnect makes err a Connect error. An internal error's detail (host
// paths, runtime output) goes to the log under a reference; the caller
// gets the reference.
func (s *Server) toConnect(ctx context.Context, procedure string, err error) *connect.Error {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce
	}
	s.noteUnreachable(err)
	code := connectCode(err)
	msg := err.Error()
	if code == connect.CodeInternal {
		var b [6]byte
		_, _ = rand.Read(b[:])
		ref := hex.EncodeToString(b[:])
		s.log.Error("envd request failed", "ref", ref, "procedure", procedure, "sandbox_id", envdSandbox(ctx), "err", err)
		msg = "internal error (ref " + ref + "; the server log has the details)"
	}
	return connect.NewError(code, errors.New(msg))
}

// envdErrors writes errors in the Connect protocol the request speaks
// (unary JSON with the code's HTTP status, or a streaming end frame).
var envdErrors = connect.NewErrorWriter()

// connectError writes err as a Connect error: the refusals of envdHandle
// (no sandbox named, a wrong token) for the Connect routes.
func (s *Server) connectError(w http.ResponseWriter, r *http.Request, err error) {
	_ = envdErrors.Write(w, r, s.toConnect(r.Context(), r.URL.Path, err))
}

// envdFilesError writes err in the shape envd's HTTP API uses ({"code":
// <status>, "message"}), with envd's statuses where they differ from
// E2B's control plane: 507 for a full disk (the SDK's "not enough
// space"), 502 for a sandbox that is not running (the SDK's "sandbox
// timeout", as E2B's proxy answers for a sandbox that is gone).
func (s *Server) envdFilesError(w http.ResponseWriter, r *http.Request, err error) {
	switch {
	case errors.Is(err, errdefs.ErrExhausted):
		s.noteUnreachable(err)
		writeJSON(w, http.StatusInsufficientStorage, map[string]any{"code": http.StatusInsufficientStorage, "message": err.Error()})
	case errors.Is(err, errdefs.ErrUnavailable):
		s.noteUnreachable(err)
		writeJSON(w, http.StatusBadGateway, map[string]any{"code": http.StatusBadGateway, "message": err.Error()})
	default:
		s.e2bError(w, r, err)
	}
}

// envdFS implements the filesystem.Filesystem service.
type envdFS struct{ s *Server }

var _ filesystempbconnect.FilesystemHandler = (*envdFS)(nil)

// call starts a Connect request's call: the user comes from its
// Authorization header.
func (h *envdFS) call(ctx context.Context, hd http.Header) (*envdCall, error) {
	user, err := basicUser(hd)
	if err != nil {
		return nil, err
	}
	return h.s.newEnvdCall(ctx, user)
}

// entryInfo describes an entry in envd's terms.
func entryInfo(fe api.FileEntry) *filesystempb.EntryInfo {
	bits, _ := strconv.ParseUint(fe.Mode, 8, 32)
	mode := os.FileMode(bits & 0o777)
	if bits&0o4000 != 0 {
		mode |= os.ModeSetuid
	}
	if bits&0o2000 != 0 {
		mode |= os.ModeSetgid
	}
	if bits&0o1000 != 0 {
		mode |= os.ModeSticky
	}
	typ := filesystempb.FileType_FILE_TYPE_UNSPECIFIED
	switch fe.Type {
	case "file":
		typ = filesystempb.FileType_FILE_TYPE_FILE
	case "dir":
		typ, mode = filesystempb.FileType_FILE_TYPE_DIRECTORY, mode|os.ModeDir
	case "symlink":
		typ, mode = filesystempb.FileType_FILE_TYPE_SYMLINK, mode|os.ModeSymlink
	default:
		mode |= os.ModeIrregular
	}
	info := &filesystempb.EntryInfo{
		Name:        path.Base(fe.Path),
		Type:        typ,
		Path:        fe.Path,
		Size:        fe.Size,
		Mode:        uint32(bits & 0o777),
		Permissions: mode.String(),
		Owner:       idName(fe.UID),
		Group:       idName(fe.GID),
	}
	if !fe.MTime.IsZero() {
		info.ModifiedTime = timestamppb.New(fe.MTime)
	}
	if fe.Type == "symlink" {
		target := fe.LinkTarget
		info.SymlinkTarget = &target
	}
	return info
}

// idName names a uid or gid: envd gives the sandbox's user and group
// names; without reading its /etc/passwd for every entry, only 0 has a
// name known for sure, and any other ID is given as its number.
func idName(id uint32) string {
	if id == 0 {
		return "root"
	}
	return strconv.FormatUint(uint64(id), 10)
}

// Stat implements filesystempbconnect.FilesystemHandler.
func (h *envdFS) Stat(ctx context.Context, req *connect.Request[filesystempb.StatRequest]) (*connect.Response[filesystempb.StatResponse], error) {
	fe, err := h.entry(ctx, req.Header(), req.Msg.GetPath(), func(c *envdCall, p string) (api.FileEntry, error) {
		return c.e.StatFile(ctx, c.id, p)
	})
	if err != nil {
		return nil, h.s.toConnect(ctx, filesystempbconnect.FilesystemStatProcedure, err)
	}
	return connect.NewResponse(&filesystempb.StatResponse{Entry: fe}), nil
}

// MakeDir implements filesystempbconnect.FilesystemHandler.
func (h *envdFS) MakeDir(ctx context.Context, req *connect.Request[filesystempb.MakeDirRequest]) (*connect.Response[filesystempb.MakeDirResponse], error) {
	fe, err := h.entry(ctx, req.Header(), req.Msg.GetPath(), func(c *envdCall, p string) (api.FileEntry, error) {
		owner, err := c.actingUser(ctx)
		if err != nil {
			return api.FileEntry{}, err
		}
		return c.e.MakeDir(ctx, c.id, p, owner)
	})
	if err != nil {
		return nil, h.s.toConnect(ctx, filesystempbconnect.FilesystemMakeDirProcedure, err)
	}
	return connect.NewResponse(&filesystempb.MakeDirResponse{Entry: fe}), nil
}

// entry runs one edge call on a request's path and describes its entry.
func (h *envdFS) entry(ctx context.Context, hd http.Header, p string, fn func(c *envdCall, p string) (api.FileEntry, error)) (*filesystempb.EntryInfo, error) {
	c, err := h.call(ctx, hd)
	if err != nil {
		return nil, err
	}
	if p, err = c.resolve(ctx, p); err != nil {
		return nil, err
	}
	fe, err := fn(c, p)
	if err != nil {
		return nil, c.fail(ctx, err)
	}
	return entryInfo(fe), nil
}

// Move implements filesystempbconnect.FilesystemHandler.
func (h *envdFS) Move(ctx context.Context, req *connect.Request[filesystempb.MoveRequest]) (*connect.Response[filesystempb.MoveResponse], error) {
	const proc = filesystempbconnect.FilesystemMoveProcedure
	c, err := h.call(ctx, req.Header())
	if err != nil {
		return nil, h.s.toConnect(ctx, proc, err)
	}
	src, err := c.resolve(ctx, req.Msg.GetSource())
	if err != nil {
		return nil, h.s.toConnect(ctx, proc, err)
	}
	dst, err := c.resolve(ctx, req.Msg.GetDestination())
	if err != nil {
		return nil, h.s.toConnect(ctx, proc, err)
	}
	fe, err := c.e.MoveFile(ctx, c.id, src, dst)
	if err != nil {
		return nil, h.s.toConnect(ctx, proc, c.fail(ctx, err))
	}
	return connect.NewResponse(&filesystempb.MoveResponse{Entry: entryInfo(fe)}), nil
}

// ListDir implements filesystempbconnect.FilesystemHandler.
func (h *envdFS) ListDir(ctx context.Context, req *connect.Request[filesystempb.ListDirRequest]) (*connect.Response[filesystempb.ListDirResponse], error) {
	const proc = filesystempbconnect.FilesystemListDirProcedure
	depth := int(req.Msg.GetDepth())
	if depth == 0 {
		depth = 1
	}
	if depth > maxListDepth {
		return nil, h.s.toConnect(ctx, proc, errdefs.Invalid("depth %d: at most %d", depth, maxListDepth))
	}
	c, err := h.call(ctx, req.Header())
	if err != nil {
		return nil, h.s.toConnect(ctx, proc, err)
	}
	p, err := c.resolve(ctx, req.Msg.GetPath())
	if err != nil {
		return nil, h.s.toConnect(ctx, proc, err)
	}
	entries, err := c.e.ListFiles(ctx, c.id, p, depth)
	if err != nil {
		return nil, h.s.toConnect(ctx, proc, c.fail(ctx, err))
	}
	out := &filesystempb.ListDirResponse{Entries: make([]*filesystempb.EntryInfo, 0, len(entries))}
	for _, fe := range entries {
		out.Entries = append(out.Entries, entryInfo(fe))
	}
	return connect.NewResponse(out), nil
}

// Remove implements filesystempbconnect.FilesystemHandler. As envd's, it
// removes a directory with what it holds, and a path that is already
// gone is no error.
func (h *envdFS) Remove(ctx context.Context, req *connect.Request[filesystempb.RemoveRequest]) (*connect.Response[filesystempb.RemoveResponse], error) {
	const proc = filesystempbconnect.FilesystemRemoveProcedure
	c, err := h.call(ctx, req.Header())
	if err != nil {
		return nil, h.s.toConnect(ctx, proc, err)
	}
	p, err := c.resolve(ctx, req.Msg.GetPath())
	if err != nil {
		return nil, h.s.toConnect(ctx, proc, err)
	}
	if err := c.e.RemoveFile(ctx, c.id, p, true); err != nil {
		if err = c.fail(ctx, err); !errors.Is(err, errdefs.ErrNotFound) {
			return nil, h.s.toConnect(ctx, proc, err)
		}
	}
	return connect.NewResponse(&filesystempb.RemoveResponse{}), nil
}

// eventTypes maps the edge's event types to envd's.
var eventTypes = map[string]filesystempb.EventType{
	api.FileEventCreate: filesystempb.EventType_EVENT_TYPE_CREATE,
	api.FileEventWrite:  filesystempb.EventType_EVENT_TYPE_WRITE,
	api.FileEventRemove: filesystempb.EventType_EVENT_TYPE_REMOVE,
	api.FileEventRename: filesystempb.EventType_EVENT_TYPE_RENAME,
	api.FileEventChmod:  filesystempb.EventType_EVENT_TYPE_CHMOD,
}

// WatchDir implements filesystempbconnect.FilesystemHandler: the edge's
// watch, whose start event becomes the stream's first frame, with a
// keepalive frame whenever the stream has been silent for the interval
// the request names, until the client goes away (or its deadline, the
// SDK's 60 s by default, passes).
func (h *envdFS) WatchDir(ctx context.Context, req *connect.Request[filesystempb.WatchDirRequest], stream *connect.ServerStream[filesystempb.WatchDirResponse]) error {
	const proc = filesystempbconnect.FilesystemWatchDirProcedure
	c, err := h.call(ctx, req.Header())
	if err != nil {
		return h.s.toConnect(ctx, proc, err)
	}
	p, err := c.resolve(ctx, req.Msg.GetPath())
	if err != nil {
		return h.s.toConnect(ctx, proc, err)
	}
	ss := newStreamSender(ctx, req.Header(), stream.Send, func() *filesystempb.WatchDirResponse {
		return &filesystempb.WatchDirResponse{Event: &filesystempb.WatchDirResponse_Keepalive{Keepalive: &filesystempb.WatchDirResponse_KeepAlive{}}}
	})
	defer ss.Stop()
	send := ss.Send
	started := false
	emit := func(ev api.FileEvent) error {
		if ev.Type == api.FileEventStart {
			if started {
				return nil
			}
			started = true
			if err := send(&filesystempb.WatchDirResponse{Event: &filesystempb.WatchDirResponse_Start{Start: &filesystempb.WatchDirResponse_StartEvent{}}}); err != nil {
				return err
			}
			ss.Start()
			return nil
		}
		typ, ok := eventTypes[ev.Type]
		if !ok || !started {
			return nil
		}
		fsev := &filesystempb.FilesystemEvent{Name: ev.Name, Type: typ}
		if req.Msg.GetIncludeEntry() && ev.Entry != nil {
			fsev.Entry = entryInfo(*ev.Entry)
		}
		return send(&filesystempb.WatchDirResponse{Event: &filesystempb.WatchDirResponse_Filesystem{Filesystem: fsev}})
	}
	err = c.e.WatchDir(ctx, c.id, p, req.Msg.GetRecursive(), emit)
	switch {
	case ctx.Err() != nil:
		return ctx.Err() // the client went away, or its deadline passed
	case err == nil:
		return nil
	}
	if serr := ss.Err(); serr != nil {
		return serr
	}
	return h.s.toConnect(ctx, proc, c.fail(ctx, err))
}

// CreateWatcher implements filesystempbconnect.FilesystemHandler: the
// polling watchers are not served (the SDK's watchDir streams instead).
func (h *envdFS) CreateWatcher(context.Context, *connect.Request[filesystempb.CreateWatcherRequest]) (*connect.Response[filesystempb.CreateWatcherResponse], error) {
	return nil, connect.NewError(connect.CodeUnimplemented, errors.New("polling watchers are not served: use WatchDir"))
}

// GetWatcherEvents implements filesystempbconnect.FilesystemHandler.
func (h *envdFS) GetWatcherEvents(context.Context, *connect.Request[filesystempb.GetWatcherEventsRequest]) (*connect.Response[filesystempb.GetWatcherEventsResponse], error) {
	return nil, connect.NewError(connect.CodeUnimplemented, errors.New("polling watchers are not served: use WatchDir"))
}

// RemoveWatcher implements filesystempbconnect.FilesystemHandler.
func (h *envdFS) RemoveWatcher(context.Context, *connect.Request[filesystempb.RemoveWatcherRequest]) (*connect.Response[filesystempb.RemoveWatcherResponse], error) {
	return nil, connect.NewError(connect.CodeUnimplemented, errors.New("polling watchers are not served: use WatchDir"))
}

// envdHealth is GET /health: 204, as envd answers. To the holder of a
// sandbox's token it also tells whether the sandbox is gone (502, as
// E2B's proxy answers, which the SDK reads as "the sandbox was killed");
// anyone else learns nothing from it.
func (s *Server) envdHealth(w http.ResponseWriter, r *http.Request) {
	id := envdTarget(r)
	tok := r.Header.Get("X-Access-Token")
	if id != "" && tok != "" {
		if ok, err := s.checkEnvdToken(id, tok); err == nil && ok {
			if err := s.envdGone(r.Context(), id); err != nil {
				s.envdFilesError(w, r, err)
				return
			}
		}
	}
	w.WriteHeader(http.StatusNoContent)
}

// envdGone returns an unavailable error if sandbox id no longer exists
// or no longer runs, and nil if it does (or cannot be told now).
func (s *Server) envdGone(ctx context.Context, id string) error {
	e, err := s.edgeOf(ctx, id)
	if err == nil {
		var sb *api.Sandbox
		if sb, err = e.Get(ctx, id); err == nil && sb.State != api.StateRunning && sb.State != api.StatePaused {
			return errdefs.Unavailable("sandbox %s is not running: it is %s", id, sb.State)
		}
	}
	if errors.Is(err, errdefs.ErrNotFound) {
		return errdefs.Unavailable("sandbox %s is not running: it does not exist", id)
	}
	return nil
}

// queryUser is the user of a /files request: the username parameter, or
// the Authorization header's (but never for a presigned URL).
func queryUser(r *http.Request) (string, error) {
	// A presigned URL acts as the user it was signed for (the sandbox's
	// own when it names none), whatever Authorization its holder adds:
	// the signature covers the username parameter, not the headers.
	if q := r.URL.Query(); q.Has("username") || envdSigned(r.Context()) {
		return checkUserName(q.Get("username"))
	}
	return basicUser(r.Header)
}

// envdDownload is GET /files?path=&username=: the file's bytes.
func (s *Server) envdDownload(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	user, err := queryUser(r)
	if err != nil {
		s.envdFilesError(w, r, err)
		return
	}
	c, err := s.newEnvdCall(ctx, user)
	if err != nil {
		s.envdFilesError(w, r, err)
		return
	}
	q := r.URL.Query()
	if q.Get("path") == "" {
		s.envdFilesError(w, r, errdefs.Invalid("query parameter path is required"))
		return
	}
	p, err := c.resolve(ctx, q.Get("path"))
	if err != nil {
		s.envdFilesError(w, r, err)
		return
	}
	rc, fe, err := c.e.ReadFile(ctx, c.id, p)
	if err != nil {
		s.envdFilesError(w, r, c.fail(ctx, err))
		return
	}
	defer rc.Close()
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Length", strconv.FormatInt(fe.Size, 10))
	w.Header().Set("Content-Disposition", mime.FormatMediaType("attachment", map[string]string{"filename": path.Base(p)}))
	w.WriteHeader(http.StatusOK)
	// A short copy leaves the body shorter than its Content-Length: the
	// client sees a broken download, not a short file.
	_, _ = copyBuffer(w, rc)
}

// uploaded is one file of an upload's answer.
type uploaded struct {
	Name string `json:"name"`
	Type string `json:"type"`
	Path string `json:"path"`
}

// readTracker remembers the first read error of the request body (or of
// a part of it), so that an upload cut short or malformed is answered as
// such (invalid_argument), not as the failure the edge call reports for
// it (over the internal API, a broken request reads as an unreachable
// edge).
type readTracker struct {
	r   io.Reader
	err *error
}

func (t readTracker) Read(p []byte) (int, error) {
	n, err := t.r.Read(p)
	if err != nil && err != io.EOF && *t.err == nil {
		*t.err = err
	}
	return n, err
}

// envdUpload is POST /files: multipart/form-data whose "file" parts are
// written where their file names say (absolute, or from the user's
// home), or where the path parameter says; or, with ?path=, a raw
// application/octet-stream body. Either may be gzip'd (Content-Encoding).
func (s *Server) envdUpload(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	var readErr error
	files, err := s.upload(ctx, r, &readErr)
	if err != nil {
		if readErr != nil {
			err = errdefs.Invalid("reading the upload: %v", readErr)
		}
		s.envdFilesError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, files)
}

func (s *Server) upload(ctx context.Context, r *http.Request, readErr *error) ([]uploaded, error) {
	user, err := queryUser(r)
	if err != nil {
		return nil, err
	}
	c, err := s.newEnvdCall(ctx, user)
	if err != nil {
		return nil, err
	}
	var body io.Reader = readTracker{r: r.Body, err: readErr}
	switch enc := strings.ToLower(r.Header.Get("Content-Encoding")); enc {
	case "", "identity":
	case "gzip":
		zr, err := gzip.NewReader(body)
		if err != nil {
			return nil, errdefs.Invalid("Content-Encoding gzip: the body is not gzip: %v", err)
		}
		defer zr.Close()
		body = readTracker{r: zr, err: readErr}
	default:
		return nil, errdefs.Invalid("Content-Encoding %q: want gzip or none", enc)
	}
	q := r.URL.Query()
	// write writes data to the sandbox path p, as envd does: mode 0644,
	// owned by the user the request acts for.
	write := func(p string, data io.Reader) (uploaded, error) {
		owner, err := c.actingUser(ctx)
		if err != nil {
			return uploaded{}, err
		}
		fe, err := c.e.WriteFile(ctx, c.id, p, data, 0o644, owner)
		if err != nil {
			return uploaded{}, c.fail(ctx, err)
		}
		return uploaded{Name: path.Base(fe.Path), Type: "file", Path: fe.Path}, nil
	}
	mt, params, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	switch {
	case mt == "application/octet-stream":
		if q.Get("path") == "" {
			return nil, errdefs.Invalid("a raw (application/octet-stream) upload needs the path query parameter")
		}
		p, err := c.resolve(ctx, q.Get("path"))
		if err != nil {
			return nil, err
		}
		f, err := write(p, body)
		if err != nil {
			return nil, err
		}
		return []uploaded{f}, nil
	case strings.HasPrefix(mt, "multipart/"):
	default:
		return nil, errdefs.Invalid("Content-Type %q: want multipart/form-data or application/octet-stream", r.Header.Get("Content-Type"))
	}
	if params["boundary"] == "" {
		return nil, errdefs.Invalid("Content-Type %q names no multipart boundary", r.Header.Get("Content-Type"))
	}
	mr := multipart.NewReader(body, params["boundary"])
	var out []uploaded
	seen := map[string]bool{}
	for parts := 0; ; parts++ {
		part, err := mr.NextRawPart()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, errdefs.Invalid("reading the multipart body: %v", err)
		}
		if parts >= maxUploadParts {
			return nil, errdefs.Invalid("more than %d parts in one upload", maxUploadParts)
		}
		field, filename := formData(part.Header.Get("Content-Disposition"))
		if field != "file" {
			continue // skipped by the next NextRawPart
		}
		target := q.Get("path")
		if target == "" {
			if target = filename; target == "" {
				return nil, errdefs.Invalid("a file part names no target: give its path as the part's file name or in the path query parameter")
			}
			escapes, err := c.climbsAboveRoot(ctx, target)
			if err != nil {
				return nil, err
			}
			if escapes {
				return nil, errdefs.Invalid("file name %q climbs above the sandbox's / with ..", target)
			}
		}
		p, err := c.resolve(ctx, target)
		if err != nil {
			return nil, err
		}
		if seen[p] {
			return nil, errdefs.Invalid("two files for %s in one upload: only the first was written", p)
		}
		seen[p] = true
		f, err := write(p, readTracker{r: part, err: readErr})
		if err != nil {
			return nil, err
		}
		out = append(out, f)
	}
	if len(out) == 0 {
		return nil, errdefs.Invalid(`no file in the upload: the form field must be named "file"`)
	}
	return out, nil
}

// formData returns the field name and file name of a form part, from its
// Content-Disposition header, read whole: Part.FileName keeps only the
// base of the file name, and here the file name is the target path.
// Browsers and undici (the SDK's FormData) write `"` and line breaks of a
// file name as %22, %0D and %0A; they are turned back.
func formData(disposition string) (field, filename string) {
	d, params, err := mime.ParseMediaType(disposition)
	if err != nil || d != "form-data" {
		return "", ""
	}
	filename = strings.NewReplacer("%22", `"`, "%0D", "\r", "%0A", "\n", "%0d", "\r", "%0a", "\n").Replace(params["filename"])
	return params["name"], filename
}

// climbsAboveRoot reports whether the request path p (absolute, or from
// the user's home) climbs above "/" with "..".
func (c *envdCall) climbsAboveRoot(ctx context.Context, p string) (bool, error) {
	if strings.HasPrefix(p, "/") {
		return climbsAbove("", p), nil
	}
	home, err := c.resolve(ctx, "~")
	if err != nil {
		return false, err
	}
	if p == "~" || strings.HasPrefix(p, "~/") {
		p = strings.TrimPrefix(p, "~")
	}
	return climbsAbove(home, p), nil
}

// climbsAbove reports whether p, taken from the absolute directory dir
// ("" when p is absolute), climbs above "/" with "..". The edge clamps
// such a path to the sandbox's "/" anyway (so "/../../etc" is its /etc);
// an upload's file name that tries is refused rather than written
// somewhere its sender did not mean.
func climbsAbove(dir, p string) bool {
	depth := 0
	for _, seg := range strings.Split(dir, "/") {
		if seg != "" && seg != "." {
			depth++
		}
	}
	for _, seg := range strings.Split(p, "/") {
		switch seg {
		case "", ".":
		case "..":
			if depth--; depth < 0 {
				return true
			}
		default:
			depth++
		}
	}
	return false
}

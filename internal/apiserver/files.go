package apiserver

import (
	"io"
	"net/http"
	"os"
	"strconv"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// fileTarget extracts the sandbox's edge and the path query parameter.
func (s *Server) fileTarget(r *http.Request) (edgeapi.Edge, string, string, error) {
	id := r.PathValue("id")
	e, err := s.edgeOf(r.Context(), id)
	if err != nil {
		return nil, "", "", err
	}
	q := r.URL.Query()
	if !q.Has("path") {
		return nil, "", "", errdefs.Invalid("query parameter path is required")
	}
	return e, id, q.Get("path"), nil
}

func (s *Server) readFile(w http.ResponseWriter, r *http.Request) {
	e, id, p, err := s.fileTarget(r)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	rc, fe, err := e.ReadFile(r.Context(), id, p)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	defer rc.Close()
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Length", strconv.FormatInt(fe.Size, 10))
	w.Header().Set("X-Dsec-File-Mode", fe.Mode)
	w.WriteHeader(http.StatusOK)
	_, _ = copyBuffer(w, rc)
}

func (s *Server) writeFile(w http.ResponseWriter, r *http.Request) {
	e, id, p, err := s.fileTarget(r)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	mode := os.FileMode(0o644)
	if v := r.URL.Query().Get("mode"); v != "" {
		n, err := strconv.ParseUint(v, 8, 32)
		if err != nil || n > 0o7777 {
			s.writeError(w, r, badQuery("mode", v, "want octal permission bits such as 0644"))
			return
		}
		mode = os.FileMode(n & 0o777)
		if n&0o4000 != 0 {
			mode |= os.ModeSetuid
		}
		if n&0o2000 != 0 {
			mode |= os.ModeSetgid
		}
		if n&0o1000 != 0 {
			mode |= os.ModeSticky
		}
	}
	fe, err := e.WriteFile(r.Context(), id, p, r.Body, mode, r.URL.Query().Get("owner"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, fe)
}

func (s *Server) removeFile(w http.ResponseWriter, r *http.Request) {
	e, id, p, err := s.fileTarget(r)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	recursive, err := boolQuery(r, "recursive")
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	if err := e.RemoveFile(r.Context(), id, p, recursive); err != nil {
		s.writeError(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}

func (s *Server) listFiles(w http.ResponseWriter, r *http.Request) {
	e, id, p, err := s.fileTarget(r)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	depth := 1
	if v := r.URL.Query().Get("depth"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 64 {
			s.writeError(w, r, badQuery("depth", v, "want an integer from 1 to 64"))
			return
		}
		depth = n
	}
	entries, err := e.ListFiles(r.Context(), id, p, depth)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	if entries == nil {
		entries = []api.FileEntry{}
	}
	writeJSON(w, http.StatusOK, api.FileList{Entries: entries})
}

func (s *Server) statFile(w http.ResponseWriter, r *http.Request) {
	e, id, p, err := s.fileTarget(r)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	fe, err := e.StatFile(r.Context(), id, p)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, fe)
}

func (s *Server) downloadTar(w http.ResponseWriter, r *http.Request) {
	e, id, p, err := s.fileTarget(r)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	w.Header().Set("Content-Type", "application/x-tar")
	cw := &countingWriter{w: w}
	if err := e.WriteTar(r.Context(), id, p, cw); err != nil {
		if cw.n == 0 {
			// Nothing sent yet: the status can still say what went wrong.
			w.Header().Del("Content-Type")
			s.writeError(w, r, err)
			return
		}
		s.log.Warn("streaming tar", "sandbox_id", id, "err", err)
		// Abort the connection so the client sees a broken stream rather
		// than a short, valid-looking tar.
		panic(http.ErrAbortHandler)
	}
}

// countingWriter counts the bytes passed through.
type countingWriter struct {
	w io.Writer
	n int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

func (s *Server) uploadTar(w http.ResponseWriter, r *http.Request) {
	e, id, p, err := s.fileTarget(r)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	res, err := e.ExtractTar(r.Context(), id, p, r.Body, r.URL.Query().Get("owner"))
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, res)
}

func boolQuery(r *http.Request, name string) (bool, error) {
	switch v := r.URL.Query().Get(name); v {
	case "", "false", "0":
		return false, nil
	case "true", "1":
		return true, nil
	default:
		return false, badQuery(name, v, "want true or false")
	}
}

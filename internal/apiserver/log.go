package apiserver

import (
	"net/http"
	"strconv"

	"github.com/dsecproject/dsec/internal/edgeapi"
)

// readLog serves a sandbox's command log: the entries after since_seq, in
// order, one page of at most limit.
func (s *Server) readLog(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	var since int64
	if v := q.Get("since_seq"); v != "" {
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil || n < 0 {
			s.writeError(w, r, badQuery("since_seq", v, "want a non-negative integer"))
			return
		}
		since = n
	}
	limit := edgeapi.DefaultLogLimit
	if v := q.Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > edgeapi.MaxLogLimit {
			s.writeError(w, r, badQuery("limit", v, "want an integer from 1 to "+strconv.Itoa(edgeapi.MaxLogLimit)))
			return
		}
		limit = n
	}
	s.forward(w, r, http.StatusOK, func(e edgeapi.Edge, id string) (any, error) {
		return e.ReadLog(r.Context(), id, since, limit)
	})
}

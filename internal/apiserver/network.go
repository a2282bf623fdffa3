package apiserver

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httputil"
	"strconv"
	"sync"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
)

func (s *Server) setNetwork(w http.ResponseWriter, r *http.Request) {
	var req api.NetworkPolicy
	if err := decode(r, &req); err != nil {
		s.writeError(w, r, err)
		return
	}
	s.forward(w, r, http.StatusOK, func(e edgeapi.Edge, id string) (any, error) {
		return e.SetNetwork(r.Context(), id, req)
	})
}

// proxyPort forwards an HTTP request to a service listening on a port of
// the sandbox's loopback. The caller's API key is not passed on: whatever
// runs in the sandbox is untrusted. Upgrades (WebSocket) pass through.
func (s *Server) proxyPort(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	port, err := strconv.Atoi(r.PathValue("port"))
	if err != nil || port < 1 || port > 65535 {
		s.writeError(w, r, errdefs.Invalid("port must be a number from 1 to 65535, got %q", r.PathValue("port")))
		return
	}
	e, err := s.edgeOf(r.Context(), id)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	// Dial before proxying, so that a missing sandbox or a closed port is
	// answered as a dsec error rather than as a bare 502.
	conn, done, err := e.DialPort(r.Context(), id, port)
	if err != nil {
		s.writeError(w, r, err)
		return
	}
	first := &onceConn{Conn: conn, done: done}
	var mu sync.Mutex
	tr := &http.Transport{
		DisableKeepAlives:     true,
		ResponseHeaderTimeout: 10 * time.Minute,
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			mu.Lock()
			c := first
			first = nil
			mu.Unlock()
			if c != nil {
				return c, nil
			}
			c2, done2, err := e.DialPort(ctx, id, port)
			if err != nil {
				return nil, err
			}
			return &onceConn{Conn: c2, done: done2}, nil
		},
	}
	defer func() {
		mu.Lock()
		if first != nil {
			first.Close()
		}
		mu.Unlock()
	}()
	host := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	rp := &httputil.ReverseProxy{
		Transport: tr,
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.Out.URL.Scheme = "http"
			pr.Out.URL.Host = host
			pr.Out.URL.Path = "/" + r.PathValue("path")
			pr.Out.URL.RawPath = ""
			pr.Out.Host = host
			pr.Out.Header.Del("Authorization")
			pr.Out.Header.Del("Proxy-Authorization")
			pr.SetXForwarded()
		},
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			if errors.Is(err, context.Canceled) {
				return
			}
			s.writeError(w, r, errdefs.Unavailable("proxying to port %d of sandbox %s: %v", port, id, err))
		},
	}
	rp.ServeHTTP(w, r)
}

// onceConn runs done once when the connection is closed.
type onceConn struct {
	net.Conn
	once sync.Once
	done func()
}

func (c *onceConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.done)
	return err
}

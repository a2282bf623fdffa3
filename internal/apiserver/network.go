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

// Credentials never cross the ports proxy, either way. Whatever runs in
// the sandbox is untrusted, and every sandbox's ports are served from the
// API's own origin: a caller's credentials would be the sandbox's, and a
// cookie or an HSTS, Alt-Svc or Clear-Site-Data header a sandbox sets would
// apply to the API's origin, shared by every sandbox and by whatever else
// runs there (docs/guide.md "Ports" says how a browser should reach
// sandbox ports: an origin of their own).
var (
	// proxyDropRequest are the request headers that carry the caller's
	// credentials to dsec or to anything else.
	proxyDropRequest = []string{"Authorization", "Proxy-Authorization", "Cookie", "Cookie2",
		"X-Api-Key", "X-Access-Token", "X-Auth-Token", "X-Csrf-Token", "X-Xsrf-Token"}
	// proxyDropResponse are the response headers that would act on the
	// API's origin rather than on one sandbox's response.
	proxyDropResponse = []string{"Set-Cookie", "Set-Cookie2", "Strict-Transport-Security", "Alt-Svc",
		"Clear-Site-Data", "Service-Worker-Allowed", "Public-Key-Pins", "Public-Key-Pins-Report-Only",
		"Origin-Agent-Cluster", "Proxy-Authenticate", "WWW-Authenticate"}
)

// proxyPort forwards an HTTP request to a service listening on a port of
// the sandbox's loopback, with no credentials either way (above).
// Upgrades (WebSocket) pass through.
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
			for _, h := range proxyDropRequest {
				pr.Out.Header.Del(h)
			}
			pr.SetXForwarded()
		},
		ModifyResponse: func(resp *http.Response) error {
			for _, h := range proxyDropResponse {
				resp.Header.Del(h)
			}
			return nil
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

package image

import (
	"strings"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// dockerHub is the registry of references that name none.
const dockerHub = "docker.io"

// Reference names an image in a registry.
type Reference struct {
	// Registry is host[:port] as written; "docker.io" for Docker Hub.
	Registry   string
	Repository string
	// Tag is "latest" when neither tag nor digest is given.
	Tag    string
	Digest string
}

// ParseReference parses REGISTRY/REPO[:TAG][@DIGEST] the way Docker does:
// the first component is a registry if it has a dot or a port or is
// "localhost", else the reference is Docker Hub's; a one-component Docker
// Hub repository, named with "docker.io/" or not, is in "library/". Every
// part is checked against the
// distribution grammar, since they all end up in URL paths.
func ParseReference(s string) (Reference, error) {
	var r Reference
	rest := s
	if i := strings.IndexByte(rest, '@'); i >= 0 {
		r.Digest = rest[i+1:]
		rest = rest[:i]
		if err := checkDigest(r.Digest); err != nil {
			return Reference{}, errdefs.Invalid("reference %q: %v", s, err)
		}
	}
	if i := strings.LastIndexByte(rest, ':'); i >= 0 && !strings.Contains(rest[i+1:], "/") {
		r.Tag = rest[i+1:]
		rest = rest[:i]
		if !validTag(r.Tag) {
			return Reference{}, errdefs.Invalid("reference %q: bad tag %q", s, r.Tag)
		}
	}
	if first, more, ok := strings.Cut(rest, "/"); ok && (strings.ContainsAny(first, ".:") || first == "localhost") {
		r.Registry, rest = first, more
	} else {
		r.Registry = dockerHub
	}
	// Docker Hub's official images live under "library/", whether or not
	// the reference names the registry: "docker.io/alpine" is library/alpine.
	if r.Registry == dockerHub && !strings.Contains(rest, "/") {
		rest = "library/" + rest
	}
	if !validHost(r.Registry) {
		return Reference{}, errdefs.Invalid("reference %q: bad registry %q", s, r.Registry)
	}
	if !validRepository(rest) {
		return Reference{}, errdefs.Invalid("reference %q: bad repository %q", s, rest)
	}
	r.Repository = rest
	if r.Tag == "" && r.Digest == "" {
		r.Tag = "latest"
	}
	return r, nil
}

// String returns the reference in its full form.
func (r Reference) String() string {
	s := r.Registry + "/" + r.Repository
	if r.Tag != "" {
		s += ":" + r.Tag
	}
	if r.Digest != "" {
		s += "@" + r.Digest
	}
	return s
}

// endpoint is the host to talk to: Docker Hub's API lives elsewhere.
func (r Reference) endpoint() string {
	if r.Registry == dockerHub {
		return "registry-1.docker.io"
	}
	return r.Registry
}

// validRepository: slash-separated components of [a-z0-9] runs joined by
// ".", "_", "__" or dashes — so never "." or "..".
func validRepository(s string) bool {
	if s == "" || len(s) > 255 {
		return false
	}
	for _, c := range strings.Split(s, "/") {
		if c == "" || !isAlnum(c[0]) || !isAlnum(c[len(c)-1]) {
			return false
		}
		for i := 0; i < len(c); i++ {
			ch := c[i]
			if isAlnum(ch) || ch == '-' {
				continue
			}
			if ch != '.' && ch != '_' {
				return false
			}
			// separators other than dashes are single (or "__") and sit
			// between alphanumerics
			if ch == '.' && !isAlnum(c[i+1]) {
				return false
			}
			if ch == '_' && c[i+1] == '_' {
				i++
			}
			if !isAlnum(c[i+1]) {
				return false
			}
		}
	}
	return true
}

func isAlnum(c byte) bool { return 'a' <= c && c <= 'z' || '0' <= c && c <= '9' }

func validTag(s string) bool {
	if s == "" || len(s) > 128 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		ok := 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '_' || (i > 0 && (c == '.' || c == '-'))
		if !ok {
			return false
		}
	}
	return true
}

// validHost accepts host names, IPv4 addresses and [IPv6] literals, with
// an optional port.
func validHost(s string) bool {
	if s == "" || len(s) > 255 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(isAlnum(c) || 'A' <= c && c <= 'Z' || c == '.' || c == '-' || c == ':' || c == '[' || c == ']') {
			return false
		}
	}
	return true
}

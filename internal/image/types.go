package image

import (
	"encoding/json"
	"fmt"
	"strings"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// Media types of the JSON documents the package reads. Docker's v2 types
// are the OCI ones under older names; both are accepted everywhere.
const (
	mediaOCIIndex      = "application/vnd.oci.image.index.v1+json"
	mediaOCIManifest   = "application/vnd.oci.image.manifest.v1+json"
	mediaDockerList    = "application/vnd.docker.distribution.manifest.list.v2+json"
	mediaDockerV2      = "application/vnd.docker.distribution.manifest.v2+json"
	mediaDockerSchema1 = "application/vnd.docker.distribution.manifest.v1+json"
	mediaDockerSigned  = "application/vnd.docker.distribution.manifest.v1+prettyjws"
)

// acceptManifests is the Accept header of manifest requests, most wanted
// first.
var acceptManifests = strings.Join([]string{mediaOCIIndex, mediaOCIManifest, mediaDockerList, mediaDockerV2}, ", ")

// maxManifestBytes bounds every JSON document read into memory (index,
// manifest, config). Registries refuse manifests over 4 MiB; configs with a
// long history are the largest documents seen in practice.
const maxManifestBytes = 8 << 20

// Config is the part of an image's configuration a sandbox runs with: the
// API's type, so what Unpack reads is what the catalog and API keep.
type Config = api.ImageConfig

// Layer describes one layer of an unpacked image.
type Layer struct {
	// Digest names the layer blob as stored (compressed or not).
	Digest string `json:"digest"`
	// DiffID is the digest of the uncompressed tar stream.
	DiffID    string `json:"diff_id"`
	MediaType string `json:"media_type,omitempty"`
	// Size is the blob's size; UnpackedSize the uncompressed stream's.
	Size         int64 `json:"size"`
	UnpackedSize int64 `json:"unpacked_size"`
}

// Result is what Unpack and Pull report about the image they unpacked.
type Result struct {
	// Digest is the manifest's digest; empty for a `docker save` archive,
	// which carries no manifest blob.
	Digest   string  `json:"digest,omitempty"`
	Platform string  `json:"platform"`
	Config   Config  `json:"config"`
	Layers   []Layer `json:"layers"`
	// Files and Bytes count the entries and regular-file bytes written.
	Files int   `json:"files"`
	Bytes int64 `json:"bytes"`
	// Runs are the runs of layers the image was cut into (one unless
	// Options.SplitAt or MergeUnder cut it), bottom first, and Top the
	// directory holding the last run's tree (the destination, or one
	// under Options.UpperDir).
	Runs []Group `json:"runs"`
	Top  string  `json:"-"`
}

// descriptor is the OCI content descriptor, also Docker's.
type descriptor struct {
	MediaType   string            `json:"mediaType,omitempty"`
	Digest      string            `json:"digest"`
	Size        int64             `json:"size"`
	Platform    *platform         `json:"platform,omitempty"`
	Annotations map[string]string `json:"annotations,omitempty"`

	// path names the blob inside a `docker save` archive whose manifest
	// gives paths, not digests. Never set from JSON.
	path string
}

type platform struct {
	OS           string `json:"os"`
	Architecture string `json:"architecture"`
	Variant      string `json:"variant,omitempty"`
}

func (p platform) String() string {
	s := p.OS + "/" + p.Architecture
	if p.Variant != "" {
		s += "/" + p.Variant
	}
	return s
}

// manifest holds both an image manifest and an index: one JSON shape with
// either Config+Layers or Manifests set.
type manifest struct {
	SchemaVersion int          `json:"schemaVersion"`
	MediaType     string       `json:"mediaType,omitempty"`
	Config        descriptor   `json:"config"`
	Layers        []descriptor `json:"layers"`
	Manifests     []descriptor `json:"manifests"`
}

// imageConfig is the image configuration blob, in the fields we read.
type imageConfig struct {
	OS           string `json:"os"`
	Architecture string `json:"architecture"`
	Variant      string `json:"variant,omitempty"`
	Config       struct {
		Env        []string          `json:"Env"`
		WorkingDir string            `json:"WorkingDir"`
		User       string            `json:"User"`
		Entrypoint []string          `json:"Entrypoint"`
		Cmd        []string          `json:"Cmd"`
		Labels     map[string]string `json:"Labels"`
	} `json:"config"`
	RootFS struct {
		Type    string   `json:"type"`
		DiffIDs []string `json:"diff_ids"`
	} `json:"rootfs"`
}

// isIndex tells an index from a manifest: by the media type the document
// (or, failing that, the transport) states, else by its shape.
func (m *manifest) isIndex(transportType string) (bool, error) {
	mt := m.MediaType
	if mt == "" {
		mt = transportType
	}
	switch mt {
	case mediaOCIIndex, mediaDockerList:
		return true, nil
	case mediaOCIManifest, mediaDockerV2:
		return false, nil
	case mediaDockerSchema1, mediaDockerSigned:
		return false, errdefs.Invalid("docker schema 1 manifests are not supported")
	}
	if m.SchemaVersion == 1 {
		return false, errdefs.Invalid("docker schema 1 manifests are not supported")
	}
	if m.Manifests != nil {
		return true, nil
	}
	if m.Config.Digest != "" {
		return false, nil
	}
	return false, errdefs.Invalid("document is neither an image manifest nor an index (media type %q)", mt)
}

func parseManifest(b []byte) (*manifest, error) {
	var m manifest
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, errdefs.Invalid("parsing manifest: %v", err)
	}
	return &m, nil
}

func parseConfig(b []byte) (*imageConfig, error) {
	var c imageConfig
	if err := json.Unmarshal(b, &c); err != nil {
		return nil, errdefs.Invalid("parsing image config: %v", err)
	}
	return &c, nil
}

func (c *imageConfig) public() Config {
	return Config{
		Env:        c.Config.Env,
		WorkingDir: c.Config.WorkingDir,
		User:       c.Config.User,
		Entrypoint: c.Config.Entrypoint,
		Cmd:        c.Config.Cmd,
		Labels:     c.Config.Labels,
	}
}

// parsePlatform parses "os/arch[/variant]"; "" is linux/amd64.
func parsePlatform(s string) (platform, error) {
	if s == "" {
		return platform{OS: "linux", Architecture: "amd64"}, nil
	}
	parts := strings.Split(s, "/")
	if len(parts) < 2 || len(parts) > 3 || parts[0] == "" || parts[1] == "" {
		return platform{}, errdefs.Invalid("platform %q is not os/arch[/variant]", s)
	}
	p := platform{OS: parts[0], Architecture: parts[1]}
	if len(parts) == 3 {
		p.Variant = parts[2]
	}
	return p, nil
}

// matches reports whether an image for have runs as want. A missing
// variant on either side matches any: amd64 images rarely state one, and
// arm images that omit it are usually v7/v8 as asked.
func (want platform) matches(have platform) bool {
	if have.OS != want.OS || have.Architecture != want.Architecture {
		return false
	}
	return want.Variant == "" || have.Variant == "" || want.Variant == have.Variant
}

// selectPlatform picks the entry of an index that runs on want. Entries
// without a platform (attestations, or a layout's list of tags) are skipped;
// the error lists what the index offers.
func selectPlatform(ms []descriptor, want platform) (descriptor, error) {
	var avail []string
	for _, d := range ms {
		if d.Platform == nil {
			continue
		}
		if want.matches(*d.Platform) {
			return d, nil
		}
		if d.Platform.OS != "unknown" { // buildx attestation manifests
			avail = append(avail, d.Platform.String())
		}
	}
	if len(avail) == 0 {
		return descriptor{}, errdefs.NotFound("no %s image in index: it lists no platforms", want)
	}
	return descriptor{}, errdefs.NotFound("no %s image in index; available: %s", want, strings.Join(avail, ", "))
}

func (d descriptor) String() string {
	if d.Digest != "" {
		return d.Digest
	}
	return fmt.Sprintf("%q", d.path)
}

// Package imagetest builds small OCI images in memory for tests: layer
// tars from entries or from a directory tree, the image's config and
// manifest, and the image as an OCI layout or `docker save` archive, or
// pushed to a registry.
package imagetest

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"io/fs"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Media types of the images made here.
const (
	MediaManifest = "application/vnd.oci.image.manifest.v1+json"
	MediaConfig   = "application/vnd.oci.image.config.v1+json"
)

// mtime dates the entries Layer writes.
var mtime = time.Date(2024, 5, 6, 7, 8, 9, 0, time.UTC)

// Entry is one entry of a layer tar: a file with Body, or a directory.
// A whiteout is a file named .wh.NAME, an opaque directory's marker
// .wh..wh..opq.
type Entry struct {
	Name string
	Body string
	Dir  bool
}

// Layer returns a layer tar of entries, in order.
func Layer(t testing.TB, entries ...Entry) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	writeEntries(t, tw, entries)
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func writeEntries(t testing.TB, tw *tar.Writer, entries []Entry) {
	t.Helper()
	for _, e := range entries {
		h := &tar.Header{Name: e.Name, Mode: 0o644, ModTime: mtime, Typeflag: tar.TypeReg, Size: int64(len(e.Body)), Format: tar.FormatPAX}
		if e.Dir {
			h.Typeflag, h.Mode, h.Size = tar.TypeDir, 0o755, 0
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write([]byte(e.Body)); err != nil {
			t.Fatal(err)
		}
	}
}

// TreeLayer tars the directory at root as a layer (owners, modes, mtimes
// and symlinks as found), then extra.
func TreeLayer(t testing.TB, root string, extra ...Entry) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	err := filepath.WalkDir(root, func(p string, de fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if rel == "." {
			return nil
		}
		fi, err := de.Info()
		if err != nil {
			return err
		}
		link := ""
		if fi.Mode()&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		}
		h, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return err
		}
		h.Name, h.Format = rel, tar.FormatPAX
		if fi.IsDir() {
			h.Name += "/"
		}
		if st, ok := fi.Sys().(*syscall.Stat_t); ok {
			h.Uid, h.Gid = int(st.Uid), int(st.Gid)
		}
		h.Uname, h.Gname = "", ""
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if fi.Mode().IsRegular() {
			f, err := os.Open(p)
			if err != nil {
				return err
			}
			defer f.Close()
			if _, err := io.Copy(tw, f); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	writeEntries(t, tw, extra)
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// Digest is the sha256 digest of b.
func Digest(b []byte) string {
	s := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(s[:])
}

// Config is what an image's config says a container runs with.
type Config struct {
	Env        []string
	WorkingDir string
	User       string
	Entrypoint []string
	Cmd        []string
}

// Image is an OCI image held in memory.
type Image struct {
	Blobs    map[string][]byte // by digest: layers, config and manifest
	Raw      [][]byte          // the uncompressed layer tars, bottom first
	Sizes    []int64           // the layer blobs' sizes, as the manifest gives them
	Config   []byte
	Manifest []byte
}

// New builds an amd64 image of layers (uncompressed tars, bottom first),
// gzipping the blobs when compress is set.
func New(t testing.TB, compress bool, cfg Config, layers ...[]byte) *Image {
	t.Helper()
	img := &Image{Blobs: map[string][]byte{}, Raw: layers}
	type desc struct {
		MediaType string `json:"mediaType"`
		Digest    string `json:"digest"`
		Size      int64  `json:"size"`
	}
	var descs []desc
	var diffIDs []string
	for _, raw := range layers {
		blob, mt := raw, "application/vnd.oci.image.layer.v1.tar"
		if compress {
			var buf bytes.Buffer
			zw := gzip.NewWriter(&buf)
			zw.Write(raw)
			zw.Close()
			blob, mt = buf.Bytes(), "application/vnd.oci.image.layer.v1.tar+gzip"
		}
		img.Blobs[Digest(blob)] = blob
		img.Sizes = append(img.Sizes, int64(len(blob)))
		descs = append(descs, desc{mt, Digest(blob), int64(len(blob))})
		diffIDs = append(diffIDs, Digest(raw))
	}
	var err error
	img.Config, err = json.Marshal(map[string]any{
		"architecture": "amd64", "os": "linux",
		"config": map[string]any{"Env": cfg.Env, "WorkingDir": cfg.WorkingDir, "User": cfg.User,
			"Entrypoint": cfg.Entrypoint, "Cmd": cfg.Cmd},
		"rootfs": map[string]any{"type": "layers", "diff_ids": diffIDs},
	})
	if err != nil {
		t.Fatal(err)
	}
	img.Blobs[Digest(img.Config)] = img.Config
	img.Manifest, err = json.Marshal(map[string]any{
		"schemaVersion": 2, "mediaType": MediaManifest,
		"config": desc{MediaConfig, Digest(img.Config), int64(len(img.Config))},
		"layers": descs,
	})
	if err != nil {
		t.Fatal(err)
	}
	img.Blobs[Digest(img.Manifest)] = img.Manifest
	return img
}

// OCILayout writes img as an OCI image layout tar at p (tagged v1) and
// returns p.
func (img *Image) OCILayout(t testing.TB, p string) string {
	t.Helper()
	index, _ := json.Marshal(map[string]any{"schemaVersion": 2, "manifests": []map[string]any{{
		"mediaType": MediaManifest, "digest": Digest(img.Manifest), "size": len(img.Manifest),
		"annotations": map[string]string{"org.opencontainers.image.ref.name": "v1"},
	}}})
	files := map[string][]byte{"oci-layout": []byte(`{"imageLayoutVersion":"1.0.0"}`), "index.json": index}
	for d, b := range img.Blobs {
		files["blobs/sha256/"+strings.TrimPrefix(d, "sha256:")] = b
	}
	return WriteTar(t, p, files)
}

// DockerSave writes img as a `docker save` tar (uncompressed layers) at p
// and returns p.
func (img *Image) DockerSave(t testing.TB, p string) string {
	t.Helper()
	cfgName := strings.TrimPrefix(Digest(img.Config), "sha256:") + ".json"
	files := map[string][]byte{cfgName: img.Config}
	var layers []string
	for _, raw := range img.Raw {
		name := strings.TrimPrefix(Digest(raw), "sha256:") + "/layer.tar"
		files[name] = raw
		layers = append(layers, name)
	}
	files["manifest.json"], _ = json.Marshal([]map[string]any{{"Config": cfgName, "RepoTags": []string{"e2e/img:v1"}, "Layers": layers}})
	return WriteTar(t, p, files)
}

// WriteTar writes files into a tar at p, sorted by name, and returns p.
func WriteTar(t testing.TB, p string, files map[string][]byte) string {
	t.Helper()
	names := make([]string, 0, len(files))
	for n := range files {
		names = append(names, n)
	}
	sort.Strings(names)
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, n := range names {
		tw.WriteHeader(&tar.Header{Name: n, Mode: 0o644, Size: int64(len(files[n])), ModTime: time.Unix(1700000000, 0)})
		tw.Write(files[n])
	}
	tw.Close()
	if err := os.WriteFile(p, buf.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// Push uploads img to the registry at host (plain HTTP) as repo:tag.
func (img *Image) Push(t testing.TB, host, repo, tag string) {
	t.Helper()
	base := "http://" + host
	for d, b := range img.Blobs {
		if d == Digest(img.Manifest) {
			continue
		}
		resp, err := http.Post(base+"/v2/"+repo+"/blobs/uploads/", "", nil)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusAccepted {
			t.Fatalf("starting upload: %s", resp.Status)
		}
		loc, err := url.Parse(resp.Header.Get("Location"))
		if err != nil {
			t.Fatal(err)
		}
		u, _ := url.Parse(base)
		u = u.ResolveReference(loc)
		q := u.Query()
		q.Set("digest", d)
		u.RawQuery = q.Encode()
		Put(t, u.String(), "application/octet-stream", b)
	}
	Put(t, base+"/v2/"+repo+"/manifests/"+tag, MediaManifest, img.Manifest)
}

// Put sends body to u with PUT and fails t unless the answer is 201.
func Put(t testing.TB, u, contentType string, body []byte) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPut, u, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", contentType)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	msg, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("PUT %s: %s: %s", u, resp.Status, msg)
	}
}

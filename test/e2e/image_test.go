package e2e

import (
	"bytes"
	"compress/gzip"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/image/imagetest"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

// The image tests build images in Go: a base layer holding the e2e base
// tree (busybox, bash, /etc/passwd with "user"), an application layer, and
// a task layer that deletes a base file (whiteout), replaces a directory
// (opaque) and adds its own file. They are imported from OCI layouts and
// `docker save` archives and pulled from Debian's docker-registry on
// 127.0.0.1, and then run.

// The test images are built with internal/image/imagetest; these name
// its parts as the tests use them.
type (
	layerEntry = imagetest.Entry
	testImage  = imagetest.Image
)

const mediaManifest = imagetest.MediaManifest

func tarLayer(t *testing.T, entries ...layerEntry) []byte {
	t.Helper()
	return imagetest.Layer(t, entries...)
}

func tarTree(t *testing.T, root string, extra ...layerEntry) []byte {
	t.Helper()
	return imagetest.TreeLayer(t, root, extra...)
}

func sha256Digest(b []byte) string { return imagetest.Digest(b) }

func writeTar(t *testing.T, p string, files map[string][]byte) string {
	t.Helper()
	return imagetest.WriteTar(t, p, files)
}

func registryPut(t *testing.T, u, contentType string, body []byte) {
	t.Helper()
	imagetest.Put(t, u, contentType, body)
}

// newTestImage builds an image from uncompressed layer tars with the
// tests' config (imageEnv, imageWorkdir, imageUser), gzipping the blobs
// when compress is set.
func newTestImage(t *testing.T, compress bool, layers ...[]byte) *testImage {
	t.Helper()
	return imagetest.New(t, compress, imagetest.Config{Env: imageEnv, WorkingDir: imageWorkdir, User: imageUser,
		Entrypoint: []string{"/bin/sh"}, Cmd: []string{"-c", "echo hi"}}, layers...)
}

// imageEnv, imageWorkdir and imageUser are the config of every test image.
var (
	imageEnv     = []string{"PATH=/usr/bin:/bin:/sbin", "IMG_VAR=from-image", "OVERRIDE=image", "EQ=a=b"}
	imageWorkdir = "/app"
	imageUser    = "user"
)

const registryBin = "/usr/bin/docker-registry"

// startRegistry runs Debian's docker-registry on a free 127.0.0.1 port,
// storage in a temp dir, and returns its host:port.
func startRegistry(t *testing.T) string {
	t.Helper()
	if _, err := os.Stat(registryBin); err != nil {
		t.Skipf("needs %s (apt-get install docker-registry): %v", registryBin, err)
	}
	addr := freeAddr()
	dir := t.TempDir()
	cfg := fmt.Sprintf("version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: %s\nhttp:\n  addr: %s\n",
		filepath.Join(dir, "storage"), addr)
	cfgPath := filepath.Join(dir, "config.yml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	cmd := exec.Command(registryBin, "serve", cfgPath)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	deadline := time.Now().Add(15 * time.Second)
	for {
		resp, err := http.Get("http://" + addr + "/v2/")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return addr
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("registry did not come up on %s: %v\n%s", addr, err, out.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// imageLayers returns the three layer tars of the test images: the base
// tree (with /data/keep1, /data/keep2), /app/hello.txt, and the task layer
// of task: /task/id, a whiteout of /repo/base-only and /data made opaque
// with /data/new in it.
func imageLayers(t *testing.T, task string) [][]byte {
	t.Helper()
	base := tarTree(t, filepath.Join(workDir, "base"),
		layerEntry{Name: "data/", Dir: true}, layerEntry{Name: "data/keep1", Body: "1\n"}, layerEntry{Name: "data/keep2", Body: "2\n"})
	app := tarLayer(t, layerEntry{Name: "app/", Dir: true}, layerEntry{Name: "app/hello.txt", Body: "hello from the image\n"})
	tsk := tarLayer(t,
		layerEntry{Name: "task/", Dir: true}, layerEntry{Name: "task/id", Body: task + "\n"},
		layerEntry{Name: "repo/.wh.base-only"},
		layerEntry{Name: "data/", Dir: true}, layerEntry{Name: "data/.wh..wh..opq"}, layerEntry{Name: "data/new", Body: "new\n"})
	return [][]byte{base, app, tsk}
}

// checkImageSandbox runs a sandbox on base (and workspace) and checks the
// files of the task layer, the whiteout, the opaque directory and the
// config defaults.
func checkImageSandbox(t *testing.T, base, workspace, task string) {
	t.Helper()
	sb := newSandbox(t, api.SandboxSpec{Base: base, Workspace: workspace, Env: map[string]string{"OVERRIDE": "spec"}})
	res := sh(t, sb.ID, `cat /app/hello.txt /task/id; ls /data | tr '\n' ' '; echo; test -e /repo/base-only && echo base-only-visible; `+
		`echo "$IMG_VAR $OVERRIDE $EQ $PATH"; pwd; id -un; echo $HOME`)
	want := "hello from the image\n" + task + "\nnew \nfrom-image spec a=b /usr/bin:/bin:/sbin\n/app\nuser\n/home/user\n"
	if res.ExitCode != 0 || res.Stdout != want {
		t.Errorf("sandbox on %s %s: exit %d\nstdout %q\nwant   %q\nstderr %q", base, workspace, res.ExitCode, res.Stdout, want, res.Stderr)
	}
	if sb.Spec.Workdir != imageWorkdir || sb.Spec.User != imageUser || sb.Spec.Env["IMG_VAR"] != "from-image" {
		t.Errorf("sandbox spec does not show the image defaults: %+v", sb.Spec)
	}
	// The spec's own values win.
	sb2 := newSandbox(t, api.SandboxSpec{Base: base, Workspace: workspace, User: "root", Workdir: "/tmp"})
	if res := sh(t, sb2.ID, "pwd; id -u"); res.Stdout != "/tmp\n0\n" {
		t.Errorf("explicit user and workdir: %q %q", res.Stdout, res.Stderr)
	}
}

// importCLI imports an archive through the CLI and returns the layers by ref.
func importCLI(t *testing.T, archive string, args ...string) map[string]api.Layer {
	t.Helper()
	start := time.Now()
	out, errOut, code := cli(append([]string{"image", "import", "--json", archive}, args...)...)
	if code != 0 {
		t.Fatalf("image import %v: exit %d: %s %s", args, code, out, errOut)
	}
	var res api.ImageResult
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		t.Fatalf("image import output: %v: %s", err, out)
	}
	fi, _ := os.Stat(archive)
	t.Logf("imported %s (%d MiB, %d image layers) as %v in %s (server: %d ms)", filepath.Base(archive),
		fi.Size()>>20, res.ImageLayers, args, time.Since(start).Round(time.Millisecond), res.DurationMS)
	if !strings.Contains(errOut, "applied layer") {
		t.Errorf("no progress on stderr: %q", errOut)
	}
	byRef := map[string]api.Layer{}
	for _, l := range res.Layers {
		byRef[l.Ref] = l
	}
	return byRef
}

func TestImageImportOCILayout(t *testing.T) {
	needDaemon(t)
	img := newTestImage(t, true, imageLayers(t, "task-a")...)
	archive := img.OCILayout(t, filepath.Join(t.TempDir(), "img.tar"))
	ls := importCLI(t, archive, "--ref", "base/img-a:v1")
	l, ok := ls["base/img-a:v1"]
	if !ok || len(ls) != 1 {
		t.Fatalf("layers %+v", ls)
	}
	t.Cleanup(func() { client.DeleteLayer(ctx(t), "base/img-a:v1") })
	// The catalog keeps the config.
	got, err := client.GetLayer(ctx(t), "base/img-a:v1")
	if err != nil || got.Digest != l.Digest || got.Image == nil || got.Image.WorkingDir != imageWorkdir ||
		got.Image.User != imageUser || len(got.Image.Env) != len(imageEnv) || len(got.Image.Cmd) != 2 {
		t.Fatalf("catalog entry %+v (image %+v), %v", got, got.Image, err)
	}
	checkImageSandbox(t, "base/img-a:v1", "", "task-a")
	// "image" is the same as "base".
	sb, err := client.CreateSandbox(ctx(t), api.SandboxSpec{Image: "base/img-a:v1"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.DeleteSandbox(ctx(t), sb.ID) })
	if res := sh(t, sb.ID, "pwd; cat /task/id"); res.Stdout != "/app\ntask-a\n" {
		t.Errorf("spec.image: %q %q", res.Stdout, res.Stderr)
	}
}

func TestImageImportSplitSharesBase(t *testing.T) {
	needDaemon(t)
	dir := t.TempDir()
	// Two task images on the same base and app layers; one as an OCI
	// layout with gzip'd layers, the other as a docker save archive.
	a := newTestImage(t, true, imageLayers(t, "task-1")...).OCILayout(t, filepath.Join(dir, "t1.tar"))
	b := newTestImage(t, false, imageLayers(t, "task-2")...).DockerSave(t, filepath.Join(dir, "t2.tar"))
	l1 := importCLI(t, a, "--ref", "base/img-t1:v1", "--workspace", "workspace/img-t1:v1", "--split", "2")
	l2 := importCLI(t, b, "--ref", "base/img-t2:v1", "--workspace", "workspace/img-t2:v1", "--split", "2")
	t.Cleanup(func() {
		for _, r := range []string{"workspace/img-t1:v1", "workspace/img-t2:v1", "base/img-t1:v1", "base/img-t2:v1"} {
			client.DeleteLayer(ctx(t), r)
		}
	})
	b1, b2 := l1["base/img-t1:v1"], l2["base/img-t2:v1"]
	w1, w2 := l1["workspace/img-t1:v1"], l2["workspace/img-t2:v1"]
	if b1.Digest == "" || b1.Digest != b2.Digest {
		t.Errorf("bases differ: %s %s", b1.Digest, b2.Digest)
	}
	if w1.Digest == "" || w2.Digest == "" || w1.Digest == w2.Digest || w1.Kind != api.KindWorkspace {
		t.Errorf("workspaces: %+v %+v", w1, w2)
	}
	// Stored once: one blob for both bases, and each workspace holds only
	// its own layer (far smaller than the base).
	blob := filepath.Join(d.stateDir, "layers", "blobs", "sha256", strings.TrimPrefix(b1.Digest, "sha256:")+".erofs")
	if _, err := os.Stat(blob); err != nil {
		t.Errorf("base blob: %v", err)
	}
	if w1.SizeBytes*4 > b1.SizeBytes {
		t.Errorf("workspace %d bytes is not small next to base %d bytes", w1.SizeBytes, b1.SizeBytes)
	}
	t.Logf("shared base %s (%d KiB), workspaces %d KiB and %d KiB", b1.Digest[:19], b1.SizeBytes>>10, w1.SizeBytes>>10, w2.SizeBytes>>10)
	checkImageSandbox(t, "base/img-t1:v1", "workspace/img-t1:v1", "task-1")
	checkImageSandbox(t, "base/img-t2:v1", "workspace/img-t2:v1", "task-2")
	// The base alone has the base and app layers, not the task's changes.
	sb := newSandbox(t, api.SandboxSpec{Base: "base/img-t1:v1"})
	res := sh(t, sb.ID, "cat /app/hello.txt; ls /data | tr '\\n' ' '; test -e /task && echo task; cat /repo/base-only")
	if want := "hello from the image\nkeep1 keep2 only in base\n"; res.Stdout != want {
		t.Errorf("base alone: %q, want %q (stderr %q)", res.Stdout, want, res.Stderr)
	}
}

func TestImagePullFromRegistry(t *testing.T) {
	needDaemon(t)
	reg := startRegistry(t)
	img := newTestImage(t, true, imageLayers(t, "task-p")...)
	img.Push(t, reg, "e2e/img", "v1")
	ref := reg + "/e2e/img:v1"

	start := time.Now()
	out, errOut, code := cli("image", "pull", "--insecure", ref, "--ref", "base/img-pulled:v1")
	if code != 0 {
		t.Fatalf("image pull: exit %d: %s %s", code, out, errOut)
	}
	t.Logf("pulled %s in %s", ref, time.Since(start).Round(time.Millisecond))
	t.Cleanup(func() { client.DeleteLayer(ctx(t), "base/img-pulled:v1") })
	if !strings.HasPrefix(out, "base/img-pulled:v1 sha256:") || !strings.Contains(errOut, "applied layer 3/3") {
		t.Errorf("pull output %q, stderr %q", out, errOut)
	}
	checkImageSandbox(t, "base/img-pulled:v1", "", "task-p")

	// Split on pull; the blobs come from the server's cache this time.
	start = time.Now()
	out, errOut, code = cli("image", "pull", "--insecure", ref, "--ref", "base/img-pulled-split:v1",
		"--workspace", "workspace/img-pulled:v1", "--split", "2")
	if code != 0 {
		t.Fatalf("image pull --split: exit %d: %s %s", code, out, errOut)
	}
	t.Logf("pulled %s again (cached), split, in %s", ref, time.Since(start).Round(time.Millisecond))
	t.Cleanup(func() {
		client.DeleteLayer(ctx(t), "workspace/img-pulled:v1")
		client.DeleteLayer(ctx(t), "base/img-pulled-split:v1")
	})
	if !strings.Contains(errOut, "cached") {
		t.Errorf("second pull did not use the cache: %q", errOut)
	}
	checkImageSandbox(t, "base/img-pulled-split:v1", "workspace/img-pulled:v1", "task-p")

	// The SDK without a progress callback gets the plain JSON answer.
	res, err := client.PullImage(ctx(t), api.ImagePullRequest{Image: ref, Ref: "base/img-pulled-sdk:v1", Insecure: true}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.DeleteLayer(ctx(t), "base/img-pulled-sdk:v1") })
	if res.Digest != sha256Digest(img.Manifest) || res.ImageLayers != 3 || res.Config.WorkingDir != imageWorkdir || len(res.Layers) != 1 {
		t.Errorf("pull result %+v", res)
	}

	// Registry errors: unknown image, registry not listening.
	_, err = client.PullImage(ctx(t), api.ImagePullRequest{Image: reg + "/e2e/nope:v1", Ref: "base/img-nope:v1", Insecure: true}, nil)
	wantCode(t, err, "not_found")
	_, err = client.PullImage(ctx(t), api.ImagePullRequest{Image: freeAddr() + "/e2e/img:v1", Ref: "base/img-nope:v1", Insecure: true}, func(string) {})
	wantCode(t, err, "unavailable")
	if _, err := client.GetLayer(ctx(t), "base/img-nope:v1"); err == nil {
		t.Error("failed pulls left base/img-nope:v1")
	}
}

// stagingEntries lists what is left in the layer store's staging
// directories (each process on the store has one, holding its lock).
func stagingEntries(t *testing.T) []string {
	t.Helper()
	root := filepath.Join(d.stateDir, "layers", "staging")
	procs, err := os.ReadDir(root)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, p := range procs {
		es, err := os.ReadDir(filepath.Join(root, p.Name()))
		if err != nil {
			names = append(names, p.Name())
			continue
		}
		for _, e := range es {
			if e.Name() != ".lock" {
				names = append(names, p.Name()+"/"+e.Name())
			}
		}
	}
	return names
}

func TestImageBadInput(t *testing.T) {
	needDaemon(t)
	dir := t.TempDir()
	img := newTestImage(t, true, imageLayers(t, "task-bad")...)
	good := img.OCILayout(t, filepath.Join(dir, "good.tar"))
	goodBytes, _ := os.ReadFile(good)
	layersBefore, err := client.ListLayers(ctx(t), "")
	if err != nil {
		t.Fatal(err)
	}

	imp := func(query string, body []byte) wireResp {
		return wireCall(t, "POST", "/v1/images:import?"+query, body)
	}
	cases := []struct {
		what, query string
		body        []byte
		status      int
		code, msg   string
	}{
		{"missing ref", "", goodBytes, 400, "invalid_argument", "ref is required"},
		{"workspace ref as base", "ref=workspace/img-bad:v1", goodBytes, 400, "invalid_argument", "imported as a base layer"},
		{"malformed ref", "ref=base/Bad%20Name:v1", goodBytes, 400, "invalid_argument", ""},
		{"base ref as workspace", "ref=base/img-bad:v1&workspace=base/img-bad2:v1&split=1", goodBytes, 400, "invalid_argument", "want workspace/NAME:TAG"},
		{"split without workspace", "ref=base/img-bad:v1&split=1", goodBytes, 400, "invalid_argument", "needs a workspace"},
		{"workspace without split", "ref=base/img-bad:v1&workspace=workspace/img-bad:v1", goodBytes, 400, "invalid_argument", "needs split"},
		{"split not a number", "ref=base/img-bad:v1&workspace=workspace/img-bad:v1&split=x", goodBytes, 400, "invalid_argument", "split"},
		{"split past the layers", "ref=base/img-bad:v1&workspace=workspace/img-bad:v1&split=3", goodBytes, 400, "invalid_argument", "the image has 3 layers"},
		{"junk archive", "ref=base/img-bad:v1", bytes.Repeat([]byte("not an image "), 1000), 400, "invalid_argument", ""},
		{"empty archive", "ref=base/img-bad:v1", []byte{}, 400, "invalid_argument", ""},
		{"truncated archive", "ref=base/img-bad:v1", goodBytes[:len(goodBytes)/2], 400, "invalid_argument", ""},
		{"gzip'd archive", "ref=base/img-bad:v1", gzipBytes(goodBytes), 400, "invalid_argument", "decompress it first"},
		{"unknown platform", "ref=base/img-bad:v1&platform=linux/arm64", goodBytes, 404, "not_found", "linux/arm64"},
		{"existing ref", "ref=" + url.QueryEscape(baseRef), goodBytes, 409, "already_exists", "already exists"},
		{"existing workspace", "ref=base/img-bad:v1&workspace=" + url.QueryEscape(workspaceRef) + "&split=1", goodBytes, 409, "already_exists", "already exists"},
	}
	for _, c := range cases {
		r := imp(c.query, c.body)
		msg := wireWantError(t, c.what, r, c.status, c.code)
		if !strings.Contains(msg, c.msg) {
			t.Errorf("%s: message %q does not contain %q", c.what, msg, c.msg)
		}
		if strings.Contains(msg, d.stateDir) {
			t.Errorf("%s: message %q shows a host path", c.what, msg)
		}
	}
	// A corrupted layer blob (digest mismatch): found before anything is built.
	bad := bytes.Replace(goodBytes, []byte("hello from the image"), []byte("HELLO FROM THE IMAGE"), 1)
	if bytes.Equal(bad, goodBytes) {
		// The app layer is gzip'd: corrupt the first byte of a blob instead.
		bad = append([]byte(nil), goodBytes...)
		i := bytes.Index(bad, []byte{0x1f, 0x8b, 0x08})
		bad[i+100] ^= 0xff
	}
	wireWantError(t, "corrupt blob", imp("ref=base/img-bad:v1", bad), 400, "invalid_argument")

	// Streamed (NDJSON) errors come back classified through the SDK.
	_, err = client.ImportImage(ctx(t), bytes.NewReader([]byte("junk")), dsec.ImportOptions{Ref: "base/img-bad:v1"}, func(string) {})
	wantCode(t, err, "invalid_argument")
	_, err = client.ImportImage(ctx(t), bytes.NewReader(goodBytes), dsec.ImportOptions{Ref: baseRef}, func(string) {})
	wantCode(t, err, "already_exists")

	// Pull: bad requests.
	for _, c := range []struct {
		what, body string
		code, msg  string
	}{
		{"no image", `{"ref":"base/img-bad:v1"}`, "invalid_argument", "image is required"},
		{"bad image ref", `{"image":"127.0.0.1:1/UPPER/x:v1","ref":"base/img-bad:v1"}`, "invalid_argument", ""},
		{"no ref", `{"image":"127.0.0.1:1/x:v1"}`, "invalid_argument", "ref is required"},
		{"toolkit ref", `{"image":"127.0.0.1:1/x:v1","ref":"toolkit/img-bad:v1"}`, "invalid_argument", "base/NAME:TAG"},
		{"unknown field", `{"image":"127.0.0.1:1/x:v1","ref":"base/img-bad:v1","bogus":1}`, "invalid_argument", "bogus"},
		{"existing ref", `{"image":"127.0.0.1:1/x:v1","ref":"` + baseRef + `"}`, "already_exists", "already exists"},
	} {
		st := 400
		if c.code == "already_exists" {
			st = 409
		}
		msg := wireWantError(t, "pull: "+c.what, wireCall(t, "POST", "/v1/images:pull", []byte(c.body)), st, c.code)
		if !strings.Contains(msg, c.msg) {
			t.Errorf("pull: %s: message %q does not contain %q", c.what, msg, c.msg)
		}
	}
	// Unauthenticated: 401 and nothing done.
	wireWantError(t, "import without key", wireCallAuth(t, "POST", "/v1/images:import?ref=base/img-bad:v1", goodBytes, wireAuthNone), 401, "unauthenticated")
	wireWantError(t, "pull without key", wireCallAuth(t, "POST", "/v1/images:pull", []byte(`{"image":"127.0.0.1:1/x:v1","ref":"base/img-bad:v1"}`), "Bearer nope"), 401, "unauthenticated")

	// The CLI checks its flags and reports the server's errors.
	if _, errOut, code := cli("image", "import", good); code == 0 || !strings.Contains(errOut, "--ref") {
		t.Errorf("import without --ref: exit %d, %q", code, errOut)
	}
	if _, errOut, code := cli("image", "import", good, "--ref", "base/img-bad:v1", "--split", "1"); code == 0 || !strings.Contains(errOut, "go together") {
		t.Errorf("import --split without --workspace: exit %d, %q", code, errOut)
	}
	junk := filepath.Join(dir, "junk.tar")
	os.WriteFile(junk, []byte("junk"), 0o600)
	if _, errOut, code := cli("image", "import", junk, "--ref", "base/img-bad:v1"); code == 0 || !strings.Contains(errOut, "invalid_argument") {
		t.Errorf("import of junk: exit %d, %q", code, errOut)
	}

	// Nothing was left: no layer, no staging file.
	layersAfter, err := client.ListLayers(ctx(t), "")
	if err != nil {
		t.Fatal(err)
	}
	if len(layersAfter) != len(layersBefore) {
		t.Errorf("layers before %d, after %d: %+v", len(layersBefore), len(layersAfter), layersAfter)
	}
	if left := stagingEntries(t); len(left) > 0 {
		t.Errorf("staging not empty: %v", left)
	}
}

func gzipBytes(b []byte) []byte {
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	zw.Write(b)
	zw.Close()
	return buf.Bytes()
}

package main

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/dsecproject/dsec/api"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

func runImage(ctx context.Context, args []string) error {
	return dispatchGroup(ctx, "image", []subcommand{
		{"import", "build layers from an OCI layout or docker save archive", imageImport},
		{"pull", "build layers from an image in a registry", imagePull},
	}, args)
}

// splitFlags are the flags import and pull share.
type splitFlags struct {
	ref, workspace, platform *string
	split                    *int
	asJSON                   *bool
}

func addImageFlags(fs *cmdFlags) splitFlags {
	return splitFlags{
		ref:       fs.String("ref", "", "base layer to build, base/NAME:TAG (required)"),
		workspace: fs.String("workspace", "", "with --split: workspace layer for the image layers above the split, workspace/NAME:TAG"),
		split:     fs.Int("split", 0, "with --workspace: how many image layers (bottom first) make the base"),
		platform:  fs.String("platform", "", "os/arch[/variant] to pick from a multi-arch image (default linux/amd64)"),
		asJSON:    fs.Bool("json", false, "print the API response as JSON"),
	}
}

func (f splitFlags) check(cmd string) error {
	if *f.ref == "" {
		return fmt.Errorf("%s: --ref base/NAME:TAG is required", cmd)
	}
	if (*f.workspace == "") != (*f.split == 0) {
		return fmt.Errorf("%s: --workspace and --split go together", cmd)
	}
	return nil
}

const imageAbout = "The image's layers are applied in order (whiteouts and opaque directories\n" +
	"honoured) into one base layer; its config (env, workdir, user) is kept with\n" +
	"the base and used as the defaults of sandboxes created on it. With\n" +
	"--workspace and --split K, the first K image layers make the base and the\n" +
	"rest a workspace layer holding only their changes, so task images sharing\n" +
	"a base store it once. Progress goes to stderr, the layers to stdout."

func imageImport(ctx context.Context, args []string) error {
	fs := newCmdFlags("image import", "--ref base/NAME:TAG [--workspace workspace/NAME:TAG --split K] [--platform P] [--json] ARCHIVE",
		"Import an image archive: an OCI image layout tar (skopeo copy oci-archive:,\n"+
			"docker buildx --output type=oci) or a `docker save` tar, uncompressed;\n"+
			"ARCHIVE - reads standard input.\n"+imageAbout)
	f := addImageFlags(fs)
	pos, err := fs.parseN(args, 1, 1)
	if err != nil {
		return err
	}
	if err := f.check("image import"); err != nil {
		return err
	}
	var in io.ReadCloser = os.Stdin
	if pos[0] != "-" {
		file, err := os.Open(pos[0])
		if err != nil {
			return err
		}
		if fi, err := file.Stat(); err != nil || !fi.Mode().IsRegular() {
			file.Close()
			return fmt.Errorf("%s is not a regular file", pos[0])
		}
		in = file
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	// Upload progress until the server starts reporting its own.
	sent := &countingReader{r: in}
	stopUpload := sync.OnceFunc(showProgress(sent))
	start := time.Now()
	res, err := c.ImportImage(ctx, sent, dsec.ImportOptions{
		Ref: *f.ref, Workspace: *f.workspace, Split: *f.split, Platform: *f.platform,
	}, func(line string) {
		stopUpload()
		fmt.Fprintln(os.Stderr, line)
	})
	stopUpload()
	if err != nil {
		return err
	}
	return printImageResult(res, *f.asJSON, time.Since(start))
}

func imagePull(ctx context.Context, args []string) error {
	fs := newCmdFlags("image pull", "--ref base/NAME:TAG [--insecure] [--username U --password-stdin] [--docker-config PATH] [--workspace workspace/NAME:TAG --split K] [--json] IMAGE",
		"Have the server pull IMAGE (REGISTRY/REPO[:TAG][@sha256:...]; no registry\n"+
			"means Docker Hub) and build it into layers. Blobs are cached on the server\n"+
			"and verified against their digests; a broken download resumes.\n"+
			"Credentials: --username with --password-stdin, else the entry for the\n"+
			"registry in --docker-config (default $DOCKER_CONFIG/config.json or\n"+
			"~/.docker/config.json; credential helpers are not run).\n"+imageAbout)
	f := addImageFlags(fs)
	insecure := fs.Bool("insecure", false, "talk plain HTTP to the registry")
	username := fs.String("username", "", "registry user name")
	passwordStdin := fs.Bool("password-stdin", false, "read the registry password from standard input")
	dockerConfig := fs.String("docker-config", "", "docker config.json to take registry credentials from")
	pos, err := fs.parseN(args, 1, 1)
	if err != nil {
		return err
	}
	if err := f.check("image pull"); err != nil {
		return err
	}
	req := api.ImagePullRequest{
		Image: pos[0], Ref: *f.ref, Workspace: *f.workspace, Split: *f.split, Platform: *f.platform,
		Insecure: *insecure, Username: *username,
	}
	switch {
	case *passwordStdin:
		if *username == "" {
			return fmt.Errorf("image pull: --password-stdin needs --username")
		}
		b, err := io.ReadAll(io.LimitReader(os.Stdin, 64<<10))
		if err != nil {
			return fmt.Errorf("reading password: %w", err)
		}
		req.Password = strings.TrimRight(string(b), "\r\n")
	case *username != "":
		return fmt.Errorf("image pull: --username needs --password-stdin")
	default:
		u, p, err := dockerCredentials(*dockerConfig, pos[0])
		if err != nil {
			return err
		}
		req.Username, req.Password = u, p
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	start := time.Now()
	res, err := c.PullImage(ctx, req, func(line string) { fmt.Fprintln(os.Stderr, line) })
	if err != nil {
		return err
	}
	return printImageResult(res, *f.asJSON, time.Since(start))
}

func printImageResult(res *api.ImageResult, asJSON bool, took time.Duration) error {
	if asJSON {
		return printJSON(res)
	}
	fmt.Fprintf(os.Stderr, "%d image layers, %d files, %s unpacked; done in %s\n",
		res.ImageLayers, res.Files, humanBytes(res.Bytes), took.Round(100*time.Millisecond))
	for _, l := range res.Layers {
		fmt.Printf("%s %s %s\n", l.Ref, l.Digest, humanBytes(l.SizeBytes))
	}
	return nil
}

// dockerCredentials returns the credentials a docker config.json holds for
// the registry of image, or none. path "" means $DOCKER_CONFIG/config.json
// or ~/.docker/config.json, and is no error when missing.
func dockerCredentials(path, image string) (user, pass string, err error) {
	explicit := path != ""
	if !explicit {
		dir := os.Getenv("DOCKER_CONFIG")
		if dir == "" {
			home, err := os.UserHomeDir()
			if err != nil {
				return "", "", nil
			}
			dir = filepath.Join(home, ".docker")
		}
		path = filepath.Join(dir, "config.json")
	}
	b, err := os.ReadFile(path)
	if err != nil {
		if !explicit && errors.Is(err, fs.ErrNotExist) {
			return "", "", nil
		}
		return "", "", fmt.Errorf("reading docker config: %w", err)
	}
	var cfg struct {
		Auths map[string]struct {
			Auth     string `json:"auth"`
			Username string `json:"username"`
			Password string `json:"password"`
		} `json:"auths"`
	}
	if err := json.NewDecoder(bytes.NewReader(b)).Decode(&cfg); err != nil {
		return "", "", fmt.Errorf("parsing docker config %s: %w", path, err)
	}
	registry := imageRegistry(image)
	for key, a := range cfg.Auths {
		host := strings.TrimPrefix(strings.TrimPrefix(key, "https://"), "http://")
		host, _, _ = strings.Cut(host, "/")
		if host != registry && !(registry == "docker.io" && host == "index.docker.io") {
			continue
		}
		if a.Auth == "" {
			return a.Username, a.Password, nil
		}
		raw, err := base64.StdEncoding.DecodeString(a.Auth)
		if err != nil {
			return "", "", fmt.Errorf("docker config %s: auth for %s is not base64", path, key)
		}
		u, p, ok := strings.Cut(string(raw), ":")
		if !ok {
			return "", "", fmt.Errorf("docker config %s: auth for %s is not user:password", path, key)
		}
		return u, p, nil
	}
	return "", "", nil
}

// imageRegistry is the registry host of an image reference, the way
// Docker reads it: the first component if it has a dot or a port or is
// localhost, else Docker Hub.
func imageRegistry(image string) string {
	first, _, ok := strings.Cut(image, "/")
	if ok && (strings.ContainsAny(first, ".:") || first == "localhost") {
		return first
	}
	return "docker.io"
}

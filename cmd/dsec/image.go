package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/url"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/image"
	"github.com/dsecproject/dsec/internal/layer"
	"github.com/dsecproject/dsec/internal/layer/remote"
	"github.com/dsecproject/dsec/internal/mountinfo"
	"github.com/dsecproject/dsec/internal/quota"
	dsec "github.com/dsecproject/dsec/sdk/go"
)

func runImage(ctx context.Context, args []string) error {
	return dispatchGroup(ctx, "image", []subcommand{
		{"import", "build layers from an OCI layout or docker save archive", imageImport},
		{"pull", "build layers from an image in a registry", imagePull},
		{"bootstrap", "build a Debian base layer with debootstrap", imageBootstrap},
	}, args)
}

// splitFlags are the flags import and pull share.
type splitFlags struct {
	ref, workspace, platform, mergeUnder *string
	split                                *int
	asJSON                               *bool
}

func addImageFlags(fs *cmdFlags) splitFlags {
	return splitFlags{
		ref:       fs.String("ref", "", "base layer to build, base/NAME:TAG (required)"),
		workspace: fs.String("workspace", "", "with --split: workspace layer for the image layers above the split, workspace/NAME:TAG"),
		split:     fs.Int("split", 0, "with --workspace: how many image layers (bottom first) make the base"),
		mergeUnder: fs.String("merge-under", "", "cut the image into runs of consecutive layers whose sizes add up to at most this (3GB, 512MiB, bytes),\n"+
			"each one layer: the base sits on the runs below its own (default: the whole image one layer)"),
		platform: fs.String("platform", "", "os/arch[/variant] to pick from a multi-arch image (default linux/amd64)"),
		asJSON:   fs.Bool("json", false, "print the API response as JSON"),
	}
}

func (f splitFlags) check(cmd string) error {
	if *f.ref == "" {
		return fmt.Errorf("%s: --ref base/NAME:TAG is required", cmd)
	}
	if (*f.workspace == "") != (*f.split == 0) {
		return fmt.Errorf("%s: --workspace and --split go together", cmd)
	}
	if *f.mergeUnder != "" && *f.split != 0 {
		return fmt.Errorf("%s: give --merge-under or --split, not both", cmd)
	}
	if _, err := f.mergeBytes(); err != nil {
		return fmt.Errorf("%s: %w", cmd, err)
	}
	return nil
}

// mergeBytes is --merge-under in bytes (0 when not given).
func (f splitFlags) mergeBytes() (int64, error) {
	if *f.mergeUnder == "" {
		return 0, nil
	}
	n, err := quota.ParseSize(*f.mergeUnder)
	if err != nil || n == 0 || n > 1<<50 {
		return 0, fmt.Errorf("--merge-under %q: want a positive size such as 3GB, 512MiB or a byte count", *f.mergeUnder)
	}
	return int64(n), nil
}

const imageAbout = "The image's layers are applied in order (whiteouts and opaque directories\n" +
	"honoured) into one base layer; its config (env, workdir, user) is kept with\n" +
	"the base and used as the defaults of sandboxes created on it. With\n" +
	"--workspace and --split K, the first K image layers make the base and the\n" +
	"rest a workspace layer holding only their changes, so task images sharing\n" +
	"a base store it once. With --merge-under SIZE, consecutive image layers are\n" +
	"merged into runs up to SIZE, bottom first, each run one EROFS layer: the\n" +
	"base is the top run, sitting on the others, and images sharing their\n" +
	"bottom layers share those runs' layers. Progress goes to stderr, the\n" +
	"layers to stdout."

func imageImport(ctx context.Context, args []string) error {
	fs := newCmdFlags("image import", "--ref base/NAME:TAG [--workspace workspace/NAME:TAG --split K | --merge-under SIZE] [--platform P] [--json] ARCHIVE",
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
	mergeUnder, _ := f.mergeBytes() // checked
	res, err := c.ImportImage(ctx, sent, dsec.ImportOptions{
		Ref: *f.ref, Workspace: *f.workspace, Split: *f.split, MergeUnder: mergeUnder, Platform: *f.platform,
	}, func(line string) {
		stopUpload()
		printf(os.Stderr, "%s\n", line)
	})
	stopUpload()
	if err != nil {
		return err
	}
	return printImageResult(res, *f.asJSON, time.Since(start))
}

func imagePull(ctx context.Context, args []string) error {
	fs := newCmdFlags("image pull", "--ref base/NAME:TAG [--insecure] [--username U --password-stdin] [--docker-config PATH] [--workspace workspace/NAME:TAG --split K | --merge-under SIZE] [--json] IMAGE",
		"Have the server pull IMAGE (REGISTRY/REPO[:TAG][@sha256:...]; no registry\n"+
			"means Docker Hub) and build it into layers. Blobs are cached on the server\n"+
			"and verified against their digests; a broken download resumes.\n"+
			"Credentials: --username with --password-stdin, else the entry for the\n"+
			"registry in --docker-config (default $DOCKER_CONFIG/config.json or\n"+
			"~/.docker/config.json; credential helpers are not run).\n"+imageAbout)
	f := addImageFlags(fs)
	insecure := fs.Bool("insecure", false, "talk plain HTTP to the registry")
	creds := addCredFlags(fs)
	pos, err := fs.parseN(args, 1, 1)
	if err != nil {
		return err
	}
	if err := f.check("image pull"); err != nil {
		return err
	}
	mergeUnder, _ := f.mergeBytes() // checked
	req := api.ImagePullRequest{
		Image: pos[0], Ref: *f.ref, Workspace: *f.workspace, Split: *f.split, MergeUnder: mergeUnder, Platform: *f.platform,
		Insecure: *insecure,
	}
	if req.Username, req.Password, err = creds.resolve("image pull", pos[0]); err != nil {
		return err
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	start := time.Now()
	res, err := c.PullImage(ctx, req, func(line string) { printf(os.Stderr, "%s\n", line) })
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
	if res.Runs > 0 {
		fmt.Fprintf(os.Stderr, "merged into %d layers (the base's own and %d below it)\n", res.Runs, res.Runs-1)
	}
	for _, l := range res.Layers {
		printf(os.Stdout, "%s %s %s\n", l.Ref, l.Digest, humanBytes(l.SizeBytes))
	}
	return nil
}

// credFlags are the registry credential flags of the commands the server
// carries out against a registry (image pull, layer push and add).
type credFlags struct {
	username, dockerConfig *string
	passwordStdin          *bool
}

func addCredFlags(fs *cmdFlags) credFlags {
	return credFlags{
		username:      fs.String("username", "", "registry user name"),
		passwordStdin: fs.Bool("password-stdin", false, "read the registry password from standard input"),
		dockerConfig:  fs.String("docker-config", "", "docker config.json to take registry credentials from"),
	}
}

// resolve returns the credentials to send for the registry of ref
// (HOST/REPO..., or oci://HOST/REPO...): --username with a password read
// from standard input, else the registry's entry in the docker config,
// else none.
func (c credFlags) resolve(cmd, ref string) (user, pass string, err error) {
	switch {
	case *c.passwordStdin:
		if *c.username == "" {
			return "", "", fmt.Errorf("%s: --password-stdin needs --username", cmd)
		}
		b, err := io.ReadAll(io.LimitReader(os.Stdin, 64<<10))
		if err != nil {
			return "", "", fmt.Errorf("reading password: %w", err)
		}
		return *c.username, strings.TrimRight(string(b), "\r\n"), nil
	case *c.username != "":
		return "", "", fmt.Errorf("%s: --username needs --password-stdin", cmd)
	}
	if strings.HasPrefix(ref, remote.Scheme) {
		// A layer source names its registry host outright (no Docker
		// Hub default for a host without a dot or port).
		r, err := remote.ParseSource(ref)
		if err != nil {
			return "", "", err
		}
		return dockerConfigAuth(*c.dockerConfig, r.Registry)
	}
	return dockerCredentials(*c.dockerConfig, ref)
}

// dockerCredentials returns the credentials a docker config.json holds for
// the registry of imageRef, or none. path "" means $DOCKER_CONFIG/config.json
// or ~/.docker/config.json, and is no error when missing.
func dockerCredentials(path, imageRef string) (user, pass string, err error) {
	ref, err := image.ParseReference(imageRef)
	if err != nil {
		return "", "", err
	}
	return dockerConfigAuth(path, ref.Registry)
}

// dockerConfigAuth is dockerCredentials for a registry host.
func dockerConfigAuth(path, registry string) (user, pass string, err error) {
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
	if _, err := os.Stat(path); !explicit && errors.Is(err, fs.ErrNotExist) {
		return "", "", nil
	}
	return image.DockerConfigAuth(path, registry)
}

// bootstrapConfig is what `image bootstrap` was asked to do. parseBootstrap
// fills and validates it before anything is touched.
type bootstrapConfig struct {
	suite     string   // Debian suite or codename: bookworm, trixie, stable
	name, tag string   // of the base layer base/NAME:TAG
	packages  []string // extra packages (debootstrap --include)
	mirror    string   // http(s) URL of a Debian archive
	variant   string   // debootstrap --variant; "" for its default set
	cacheDir  string   // absolute; "" for no .deb cache
	asJSON    bool
}

func (b bootstrapConfig) ref() string { return api.KindBase + "/" + b.name + ":" + b.tag }

var (
	suitePattern = regexp.MustCompile(`^[a-z]+$`)
	// debPackagePattern is Debian Policy §5.6.1: lower case letters,
	// digits, '+', '-' and '.', at least two characters, starting with an
	// alphanumeric.
	debPackagePattern = regexp.MustCompile(`^[a-z0-9][a-z0-9+.-]+$`)
)

const (
	defaultDebianMirror = "http://deb.debian.org/debian"
	defaultVariant      = "minbase"
)

// bootstrapVariants are the debootstrap variants that work as root;
// "default" means debootstrap's own default (required + important).
var bootstrapVariants = []string{"minbase", "buildd", "default"}

const bootstrapAbout = "Build a Debian base layer without Docker: debootstrap SUITE from MIRROR\n" +
	"into a private temporary directory (under $TMPDIR, else /tmp; it needs\n" +
	"a few hundred MB and must allow exec and device files), clean it, and\n" +
	"build it into a base layer the way `layer build --kind base` does. The\n" +
	"directory is removed afterwards, also on failure or Ctrl-C.\n" +
	"Removed from the tree so that the layer holds no host or download\n" +
	"state: /var/lib/apt/lists/*, /var/cache/apt/*.bin, .deb files and\n" +
	"partial downloads in /var/cache/apt/archives, every file under /var/log\n" +
	"(directories stay), dpkg and debconf *-old backups and\n" +
	"/var/lib/dbus/machine-id. Emptied: /etc/machine-id and /etc/resolv.conf\n" +
	"(debootstrap copies the host's; sandboxes get theirs from dsec).\n" +
	"/etc/hostname becomes \"sandbox\"; /etc/hosts is written if missing.\n" +
	"Run `apt-get update` in a sandbox with network access before\n" +
	"installing more packages.\n" +
	"If REF already exists nothing is done (exit 0); delete it with\n" +
	"`dsec layer delete REF` to rebuild. Needs root, and installs the\n" +
	"debootstrap package with apt-get if it is missing.\n" +
	"Progress goes to stderr, the layer to stdout."

// parseBootstrap parses and validates the arguments of `image bootstrap`.
// It has no side effects.
func parseBootstrap(args []string) (bootstrapConfig, error) {
	fs := newCmdFlags("image bootstrap",
		"--suite SUITE --ref base/NAME:TAG [--packages P1,P2] [--mirror URL] [--variant V] [--keep-cache DIR] [--json]",
		bootstrapAbout)
	suite := fs.String("suite", "", "Debian suite or codename, e.g. bookworm (required)")
	ref := fs.String("ref", "", "base layer to build, base/NAME:TAG (required)")
	packages := fs.String("packages", "", "comma-separated extra packages to install, e.g. python3,git")
	mirror := fs.String("mirror", defaultDebianMirror, "Debian archive to install from (http or https URL)")
	variant := fs.String("variant", defaultVariant, "debootstrap variant: "+strings.Join(bootstrapVariants, " | "))
	cacheDir := fs.String("keep-cache", "", "keep downloaded .deb files in DIR and reuse them next time")
	asJSON := fs.Bool("json", false, "print the API response as JSON")
	if _, err := fs.parseN(args, 0, 0); err != nil {
		return bootstrapConfig{}, err
	}
	cfg := bootstrapConfig{suite: *suite, asJSON: *asJSON}
	const cmd = "image bootstrap"
	switch {
	case *suite == "":
		return cfg, fmt.Errorf("%s: --suite is required (e.g. bookworm)", cmd)
	case !suitePattern.MatchString(*suite):
		return cfg, fmt.Errorf("%s: suite %q: want lower-case letters only (bookworm, trixie, stable)", cmd, *suite)
	case *ref == "":
		return cfg, fmt.Errorf("%s: --ref base/NAME:TAG is required", cmd)
	}
	r, err := layer.ParseRef(*ref)
	if err != nil {
		return cfg, fmt.Errorf("%s: %w", cmd, err)
	}
	if r.Kind != api.KindBase {
		return cfg, fmt.Errorf("%s: --ref %s is a %s ref; a bootstrapped system is a base layer (base/NAME:TAG)", cmd, *ref, r.Kind)
	}
	cfg.name, cfg.tag = r.Name, r.Tag
	for _, p := range strings.Split(*packages, ",") {
		p = strings.TrimSpace(p)
		if p == "" {
			continue
		}
		if !debPackagePattern.MatchString(p) {
			return cfg, fmt.Errorf("%s: package %q is not a Debian package name (lower-case letters, digits, + - ., at least two characters)", cmd, p)
		}
		if !slices.Contains(cfg.packages, p) {
			cfg.packages = append(cfg.packages, p)
		}
	}
	u, err := url.Parse(*mirror)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.RawQuery != "" || u.Fragment != "" || u.User != nil {
		return cfg, fmt.Errorf("%s: --mirror %q: want an http:// or https:// URL of a Debian archive, e.g. %s", cmd, *mirror, defaultDebianMirror)
	}
	cfg.mirror = *mirror
	if !slices.Contains(bootstrapVariants, *variant) {
		return cfg, fmt.Errorf("%s: --variant %q: want one of %s", cmd, *variant, strings.Join(bootstrapVariants, ", "))
	}
	if *variant != "default" {
		cfg.variant = *variant
	}
	if *cacheDir != "" {
		if cfg.cacheDir, err = filepath.Abs(*cacheDir); err != nil {
			return cfg, fmt.Errorf("%s: --keep-cache: %w", cmd, err)
		}
	}
	return cfg, nil
}

// debootstrapArgs is the debootstrap command line for cfg and target.
func (b bootstrapConfig) debootstrapArgs(target string) []string {
	var args []string
	if b.variant != "" {
		args = append(args, "--variant="+b.variant)
	}
	if len(b.packages) > 0 {
		args = append(args, "--include="+strings.Join(b.packages, ","))
	}
	if b.cacheDir != "" {
		args = append(args, "--cache-dir="+b.cacheDir)
	}
	return append(args, b.suite, target, b.mirror)
}

func imageBootstrap(ctx context.Context, args []string) error {
	cfg, err := parseBootstrap(args)
	if err != nil {
		return err
	}
	c, err := newClient()
	if err != nil {
		return err
	}
	// An existing ref makes the command a no-op, so that scripts (make run)
	// can call it every time and pay the download once. Unlike `layer
	// build`, which fails on a taken ref, there is no --replace: the SDK
	// does not re-point refs, and a delete first says what is meant.
	switch l, err := c.GetLayer(ctx, cfg.ref()); {
	case err == nil:
		printf(os.Stderr, "image bootstrap: %s already exists (%s, %s); nothing to do. To rebuild it: dsec layer delete %s\n",
			l.Ref, shortDigest(l.Digest), humanBytes(l.SizeBytes), l.Ref)
		return printBootstrapResult(l, cfg.asJSON)
	case !errors.Is(err, dsec.ErrNotFound):
		return fmt.Errorf("image bootstrap: looking up %s: %w", cfg.ref(), err)
	}
	if os.Geteuid() != 0 {
		return fmt.Errorf("image bootstrap: needs root (debootstrap chroots into the new system, creates device nodes and sets file owners)")
	}
	start := time.Now()
	debootstrap, err := ensureDebootstrap(ctx)
	if err != nil {
		return err
	}
	if cfg.cacheDir != "" {
		if err := os.MkdirAll(cfg.cacheDir, 0o755); err != nil {
			return fmt.Errorf("image bootstrap: creating cache dir: %w", err)
		}
	}
	work, err := os.MkdirTemp("", "dsec-bootstrap-") // 0700: only root sees the tree
	if err != nil {
		return fmt.Errorf("image bootstrap: creating work dir: %w", err)
	}
	defer removeBootstrapDir(work)
	// The tree is a child of the private dir so that its own root can be
	// 0755, as a system's root directory is.
	target := filepath.Join(work, "rootfs")

	what := cfg.suite
	if cfg.variant != "" {
		what += " (" + cfg.variant + ")"
	}
	if len(cfg.packages) > 0 {
		what += " + " + strings.Join(cfg.packages, ",")
	}
	fmt.Fprintf(os.Stderr, "image bootstrap: debootstrap %s from %s into %s\n", what, cfg.mirror, target)
	t := time.Now()
	if err := runPrefixed(ctx, "  debootstrap: ", debootstrap, cfg.debootstrapArgs(target)...); err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("image bootstrap: interrupted")
		}
		showLogTail(filepath.Join(target, "debootstrap", "debootstrap.log"), 15)
		return fmt.Errorf("image bootstrap: %w; debootstrap's output above says why (mirror %s)", err, cfg.mirror)
	}
	tDebootstrap := time.Since(t)
	fmt.Fprintf(os.Stderr, "image bootstrap: debootstrap done in %s\n", tDebootstrap.Round(100*time.Millisecond))

	// debootstrap unmounts what it mounted (proc, sys, a container's /dev
	// binds); whatever is left must not be archived.
	if err := unmountUnder(target); err != nil {
		return fmt.Errorf("image bootstrap: %w", err)
	}
	t = time.Now()
	cs, err := cleanBootstrapTree(target)
	if err != nil {
		return fmt.Errorf("image bootstrap: cleaning the tree: %w", err)
	}
	tClean := time.Since(t)
	fmt.Fprintf(os.Stderr, "image bootstrap: cleaned the tree in %s: removed %d files (%s) of apt lists and caches, logs and machine ids\n",
		tClean.Round(10*time.Millisecond), cs.files, humanBytes(cs.bytes))

	fmt.Fprintf(os.Stderr, "image bootstrap: building %s\n", cfg.ref())
	t = time.Now()
	l, st, err := uploadLayer(ctx, c, api.KindBase, cfg.name, cfg.tag, target)
	if err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("image bootstrap: interrupted")
		}
		return fmt.Errorf("image bootstrap: building %s: %w", cfg.ref(), err)
	}
	tBuild := time.Since(t)
	fmt.Fprintf(os.Stderr, "image bootstrap: %s built in %s: %d entries, %s of files, layer %s\n",
		l.Ref, tBuild.Round(100*time.Millisecond), st.Entries, humanBytes(st.Bytes), humanBytes(l.SizeBytes))
	fmt.Fprintf(os.Stderr, "image bootstrap: done in %s (debootstrap %s, clean %s, build %s)\n",
		time.Since(start).Round(100*time.Millisecond), tDebootstrap.Round(100*time.Millisecond),
		tClean.Round(10*time.Millisecond), tBuild.Round(100*time.Millisecond))
	return printBootstrapResult(l, cfg.asJSON)
}

func printBootstrapResult(l *api.Layer, asJSON bool) error {
	if asJSON {
		return printJSON(l)
	}
	printf(os.Stdout, "%s %s %s\n", l.Ref, l.Digest, humanBytes(l.SizeBytes))
	return nil
}

// debianKeyring is where debian-archive-keyring puts the keys debootstrap
// checks the mirror's Release file with.
const debianKeyring = "/usr/share/keyrings/debian-archive-keyring.gpg"

// ensureDebootstrap returns the path of debootstrap, installing it (and
// the Debian archive keyring it checks Release files with) with apt-get
// when it is missing. The caller is root.
func ensureDebootstrap(ctx context.Context) (string, error) {
	find := func() (string, error) {
		if p, err := exec.LookPath("debootstrap"); err == nil {
			return p, nil
		}
		// sudo and su may leave the sbin directories out of PATH.
		for _, p := range []string{"/usr/sbin/debootstrap", "/sbin/debootstrap"} {
			if _, err := os.Stat(p); err == nil {
				return p, nil
			}
		}
		return "", errors.New("debootstrap not found")
	}
	if p, err := find(); err == nil {
		return p, nil
	}
	if _, err := exec.LookPath("apt-get"); err != nil {
		return "", errors.New("image bootstrap: debootstrap is not installed and there is no apt-get to install it; install debootstrap")
	}
	fmt.Fprintln(os.Stderr, "image bootstrap: debootstrap is not installed; installing it with apt-get")
	pkgs := []string{"debootstrap"}
	if _, err := os.Stat(debianKeyring); err != nil {
		pkgs = append(pkgs, "debian-archive-keyring") // a Recommends of debootstrap
	}
	install := func() error {
		return runPrefixed(ctx, "  apt-get: ", "apt-get", append([]string{"install", "-y", "--no-install-recommends"}, pkgs...)...)
	}
	if err := install(); err != nil {
		if ctx.Err() != nil {
			return "", fmt.Errorf("image bootstrap: interrupted")
		}
		// The host's package lists may be missing (container images ship
		// without them) or stale.
		if err := runPrefixed(ctx, "  apt-get: ", "apt-get", "update"); err != nil {
			return "", fmt.Errorf("image bootstrap: installing debootstrap: apt-get update: %w", err)
		}
		if err := install(); err != nil {
			return "", fmt.Errorf("image bootstrap: installing debootstrap: %w", err)
		}
	}
	return find()
}

// runPrefixed runs a command with its output lines copied to stderr
// behind prefix. The command gets its own process group: the terminal's
// Ctrl-C reaches only dsec, which cancels ctx, and cancelling stops the
// whole tree (debootstrap runs dpkg and maintainer scripts in a chroot)
// with SIGTERM, so that debootstrap's exit trap can unmount what it
// mounted; what is still alive 20 s later is killed.
func runPrefixed(ctx context.Context, prefix, name string, args ...string) error {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive", "LC_ALL=C")
	out := &prefixWriter{prefix: prefix, w: os.Stderr}
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGTERM) }
	cmd.WaitDelay = 20 * time.Second
	err := cmd.Run()
	if err != nil && cmd.Process != nil {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) // stragglers of the group
	}
	out.flush()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		// Not wrapped: main would take an *exec.ExitError for the status
		// of a sandboxed command and exit without a message.
		return fmt.Errorf("%s: %s", filepath.Base(name), ee.ProcessState)
	}
	return err
}

// prefixWriter writes each line written to it to w behind prefix. A
// carriage return not followed by a newline starts the line over, as on a
// terminal, so progress meters show only their last state.
type prefixWriter struct {
	prefix string
	w      io.Writer
	buf    []byte
	cr     bool // the last byte was '\r'
}

func (p *prefixWriter) Write(b []byte) (int, error) {
	for _, c := range b {
		switch {
		case c == '\n':
			p.flush()
		case c == '\r':
			p.cr = true
			continue
		case p.cr:
			p.buf = p.buf[:0]
			fallthrough
		default:
			p.buf = append(p.buf, c)
		}
		p.cr = false
	}
	return len(b), nil
}

func (p *prefixWriter) flush() {
	if len(p.buf) > 0 {
		fmt.Fprintf(p.w, "%s%s\n", p.prefix, p.buf)
		p.buf = p.buf[:0]
	}
}

// showLogTail prints the last n lines of debootstrap's log, which explains
// failures its own output only points at, before the tree is removed.
func showLogTail(path string, n int) {
	b, err := os.ReadFile(path)
	if err != nil {
		return
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	fmt.Fprintf(os.Stderr, "image bootstrap: last lines of debootstrap.log:\n")
	for _, l := range lines {
		fmt.Fprintf(os.Stderr, "  log: %s\n", l)
	}
}

// mountsUnder returns the mount points at or below dir, deepest first.
func mountsUnder(dir string) ([]string, error) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil, fmt.Errorf("reading mount table: %w", err)
	}
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		p := mountinfo.Unescape(f[4])
		if p == dir || strings.HasPrefix(p, dir+"/") {
			out = append(out, p)
		}
	}
	slices.SortFunc(out, func(a, b string) int { return len(b) - len(a) })
	return out, nil
}

// unmountUnder detaches every mount at or below dir and checks that none
// is left, so that neither the archive nor the removal of the tree can
// reach into /proc, /sys or a bind-mounted host /dev.
func unmountUnder(dir string) error {
	dir, err := filepath.EvalSymlinks(dir)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		return err
	}
	mounts, err := mountsUnder(dir)
	if err != nil {
		return err
	}
	for _, m := range mounts {
		_ = syscall.Unmount(m, syscall.MNT_DETACH)
	}
	if left, err := mountsUnder(dir); err != nil {
		return err
	} else if len(left) > 0 {
		return fmt.Errorf("unmounting %s: still mounted", strings.Join(left, ", "))
	}
	return nil
}

// removeBootstrapDir removes the work dir, after unmounting what a killed
// debootstrap may have left mounted in it. A dir that cannot be unmounted
// is left in place (and named): removing through a host /dev bind mount
// would delete the host's device nodes.
func removeBootstrapDir(dir string) {
	if err := unmountUnder(dir); err != nil {
		fmt.Fprintf(os.Stderr, "image bootstrap: leaving %s in place: %v\n", dir, err)
		return
	}
	if err := os.RemoveAll(dir); err != nil {
		fmt.Fprintf(os.Stderr, "image bootstrap: removing %s: %v\n", dir, err)
	}
}

// cleanStats counts what cleanBootstrapTree removed.
type cleanStats struct {
	files int
	bytes int64
}

// cleanBootstrapTree removes download and host state from a freshly
// bootstrapped tree; bootstrapAbout lists what. Every path is resolved
// inside root (os.Root), so an absolute symlink in the tree cannot lead
// the cleaning onto the host.
func cleanBootstrapTree(dir string) (cleanStats, error) {
	var cs cleanStats
	root, err := os.OpenRoot(dir)
	if err != nil {
		return cs, err
	}
	defer root.Close()
	fsys := root.FS()

	// remove deletes name (a file, or a tree) and counts its files.
	remove := func(name string) error {
		fi, err := root.Lstat(name)
		if err != nil {
			return fmt.Errorf("removing /%s: %w", name, err)
		}
		if !fi.IsDir() { // a symlink is removed, never followed
			cs.files++
			if fi.Mode().IsRegular() {
				cs.bytes += fi.Size()
			}
			if err := root.Remove(name); err != nil {
				return fmt.Errorf("removing /%s: %w", name, err)
			}
			return nil
		}
		err = fs.WalkDir(fsys, name, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if !d.IsDir() {
				cs.files++
				if fi, err := d.Info(); err == nil && fi.Mode().IsRegular() {
					cs.bytes += fi.Size()
				}
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("removing /%s: %w", name, err)
		}
		if err := root.RemoveAll(name); err != nil {
			return fmt.Errorf("removing /%s: %w", name, err)
		}
		return nil
	}
	// removeIn deletes the entries of dir for which match is true.
	removeIn := func(dir string, match func(fs.DirEntry) bool) error {
		entries, err := fs.ReadDir(fsys, dir)
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("listing /%s: %w", dir, err)
		}
		for _, e := range entries {
			if match(e) {
				if err := remove(path.Join(dir, e.Name())); err != nil {
					return err
				}
			}
		}
		return nil
	}
	all := func(fs.DirEntry) bool { return true }
	suffix := func(s string) func(fs.DirEntry) bool {
		return func(e fs.DirEntry) bool { return !e.IsDir() && strings.HasSuffix(e.Name(), s) }
	}
	steps := []struct {
		dir   string
		match func(fs.DirEntry) bool
	}{
		{"var/lib/apt/lists", all},
		{"var/cache/apt", suffix(".bin")},
		{"var/cache/apt/archives", suffix(".deb")},
		{"var/cache/apt/archives/partial", all},
		{"var/cache/debconf", suffix("-old")},
		{"var/lib/dpkg", suffix("-old")},
	}
	for _, s := range steps {
		if err := removeIn(s.dir, s.match); err != nil {
			return cs, err
		}
	}
	// Logs: every file goes, the directories stay (packages expect
	// /var/log/apt and the like to exist).
	var logs []string
	err = fs.WalkDir(fsys, "var/log", func(p string, d fs.DirEntry, err error) error {
		if errors.Is(err, fs.ErrNotExist) && p == "var/log" {
			return fs.SkipAll
		}
		if err != nil {
			return err
		}
		if !d.IsDir() {
			logs = append(logs, p)
		}
		return nil
	})
	if err != nil {
		return cs, fmt.Errorf("listing /var/log: %w", err)
	}
	for _, p := range logs {
		if err := remove(p); err != nil {
			return cs, err
		}
	}
	if _, err := root.Lstat("var/lib/dbus/machine-id"); err == nil {
		if err := remove("var/lib/dbus/machine-id"); err != nil {
			return cs, err
		}
	}
	// An empty /etc/machine-id is systemd's "not set yet": a system booted
	// from the layer makes its own instead of sharing the build's.
	if _, err := root.Lstat("etc/machine-id"); err == nil {
		if err := replaceFile(root, "etc/machine-id", ""); err != nil {
			return cs, err
		}
	}
	// debootstrap copies the host's resolv.conf and hostname in.
	if err := replaceFile(root, "etc/resolv.conf", ""); err != nil {
		return cs, err
	}
	if err := replaceFile(root, "etc/hostname", "sandbox\n"); err != nil {
		return cs, err
	}
	if _, err := root.Lstat("etc/hosts"); errors.Is(err, fs.ErrNotExist) {
		if err := replaceFile(root, "etc/hosts", "127.0.0.1 localhost sandbox\n::1 localhost ip6-localhost ip6-loopback\n"); err != nil {
			return cs, err
		}
	}
	return cs, nil
}

// replaceFile puts a regular file with content at name, replacing whatever
// is there (a symlink is replaced, not followed).
func replaceFile(root *os.Root, name, content string) error {
	if err := root.Remove(name); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("replacing /%s: %w", name, err)
	}
	if err := root.WriteFile(name, []byte(content), 0o644); err != nil {
		return fmt.Errorf("writing /%s: %w", name, err)
	}
	return nil
}

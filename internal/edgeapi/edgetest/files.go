package edgetest

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"path"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// The fake's file calls act on an in-memory tree per sandbox: what
// WriteFile and MakeDir put there, Stat, List, Remove and MoveFile see,
// and WatchDir reports, as the real edge would (paths must be absolute
// and are cleaned; ".." cannot climb above "/"). A write under /full
// fails as a full disk does (resource_exhausted). What a call creates
// belongs to its owner (fakeOwner): the fake's sandboxes have the users
// root (0) and user (1000), and any numeric ID.

// fakeFile is one entry of a fake tree.
type fakeFile struct {
	dir      bool
	data     []byte
	mode     os.FileMode
	mtime    time.Time
	uid, gid uint32
}

// fakeOwner resolves an owner as the edge does against a sandbox's
// /etc/passwd, for the fake's users: "" is root, and a user the fake does
// not have is invalid.
func fakeOwner(owner string) (uid, gid uint32, err error) {
	name, group, hasGroup := strings.Cut(owner, ":")
	ids := map[string]uint32{"": 0, "root": 0, "user": 1000}
	id, ok := ids[name]
	if n, err := strconv.ParseUint(name, 10, 32); err == nil {
		id, ok = uint32(n), true
	}
	if !ok {
		return 0, 0, errdefs.Invalid("user %q does not exist in the sandbox's /etc/passwd", name)
	}
	uid, gid = id, id
	if hasGroup {
		n, err := strconv.ParseUint(group, 10, 32)
		if err != nil {
			return 0, 0, errdefs.Invalid("group %q does not exist in the sandbox's /etc/group", group)
		}
		gid = uint32(n)
	}
	return uid, gid, nil
}

// fakeWatch is a WatchDir in progress.
type fakeWatch struct {
	id        string
	dir       string
	recursive bool
	ch        chan api.FileEvent
}

// watchQueue bounds the events queued for one fake watch; more are dropped.
const watchQueue = 64

func cleanPath(p string) (string, error) {
	if !strings.HasPrefix(p, "/") {
		return "", errdefs.Invalid("path %q is not absolute", p)
	}
	return path.Clean(p), nil
}

// tree returns sandbox id's tree, made on first use.
// Preconditions: f.mu held.
func (f *Fake) tree(id string) map[string]*fakeFile {
	if f.trees == nil {
		f.trees = map[string]map[string]*fakeFile{}
	}
	t := f.trees[id]
	if t == nil {
		t = map[string]*fakeFile{"/": {dir: true, mode: 0o755, mtime: time.Now()}}
		f.trees[id] = t
	}
	return t
}

// Tree returns the paths in sandbox id's tree, sorted, directories
// ending in "/": what a test checks was (not) touched.
func (f *Fake) Tree(id string) []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for p, n := range f.tree(id) {
		if n.dir && p != "/" {
			p += "/"
		}
		out = append(out, p)
	}
	sort.Strings(out)
	return out
}

// Content returns what the file p of sandbox id holds.
func (f *Fake) Content(id, p string) ([]byte, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := f.tree(id)[p]
	if n == nil || n.dir {
		return nil, false
	}
	return bytes.Clone(n.data), true
}

func entryOf(p string, n *fakeFile) api.FileEntry {
	e := api.FileEntry{Path: p, Type: "file", Size: int64(len(n.data)), Mode: fmt.Sprintf("%04o", uint32(n.mode.Perm())), MTime: n.mtime, UID: n.uid, GID: n.gid}
	if n.dir {
		e.Type, e.Size = "dir", 4096
	}
	return e
}

// mkdirs makes p and its missing parents directories owned by uid and
// gid, reporting the new ones. Preconditions: f.mu held.
func (f *Fake) mkdirs(id, p string, uid, gid uint32) error {
	t := f.tree(id)
	if n := t[p]; n != nil {
		if !n.dir {
			return errdefs.Invalid("%s: not a directory", p)
		}
		return nil
	}
	if err := f.mkdirs(id, path.Dir(p), uid, gid); err != nil {
		return err
	}
	t[p] = &fakeFile{dir: true, mode: 0o755, mtime: time.Now(), uid: uid, gid: gid}
	f.publish(id, p, api.FileEventCreate)
	return nil
}

// publish queues an event for the watches of sandbox id that see p.
// Preconditions: f.mu held.
func (f *Fake) publish(id, p, typ string) {
	for _, w := range f.watches {
		if w.id != id || !strings.HasPrefix(p, strings.TrimSuffix(w.dir, "/")+"/") {
			continue
		}
		rel := strings.TrimPrefix(p, strings.TrimSuffix(w.dir, "/")+"/")
		if !w.recursive && strings.Contains(rel, "/") {
			continue
		}
		ev := api.FileEvent{Name: rel, Type: typ}
		if n := f.tree(id)[p]; n != nil && typ != api.FileEventRemove && typ != api.FileEventRename {
			e := entryOf(p, n)
			ev.Entry = &e
		}
		select {
		case w.ch <- ev:
		default:
		}
	}
}

// ReadFile implements edgeapi.Edge.
func (f *Fake) ReadFile(ctx context.Context, id, p string) (io.ReadCloser, api.FileEntry, error) {
	if _, err := f.Get(ctx, id); err != nil {
		return nil, api.FileEntry{}, err
	}
	clean, err := cleanPath(p)
	if err != nil {
		return nil, api.FileEntry{}, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if n := f.tree(id)[clean]; n != nil {
		if n.dir {
			return nil, api.FileEntry{}, errdefs.Invalid("reading %s: is a directory", clean)
		}
		return io.NopCloser(bytes.NewReader(bytes.Clone(n.data))), entryOf(clean, n), nil
	}
	if clean == "/nope" || strings.HasPrefix(clean, "/nope/") {
		return nil, api.FileEntry{}, errdefs.NotFound("reading %s: no such file", clean)
	}
	return io.NopCloser(bytes.NewReader(f.File)), api.FileEntry{Path: p, Size: int64(len(f.File)), Mode: "0644", Type: "file"}, nil
}

// WriteFile implements edgeapi.Edge.
func (f *Fake) WriteFile(ctx context.Context, id, p string, data io.Reader, mode os.FileMode, owner string) (api.FileEntry, error) {
	if _, err := f.Get(ctx, id); err != nil {
		return api.FileEntry{}, err
	}
	clean, err := cleanPath(p)
	if err != nil {
		return api.FileEntry{}, err
	}
	uid, gid, err := fakeOwner(owner)
	if err != nil {
		return api.FileEntry{}, err
	}
	if clean == "/full" || strings.HasPrefix(clean, "/full/") {
		return api.FileEntry{}, errdefs.Exhausted("writing %s: no space left on device", clean)
	}
	b, err := io.ReadAll(data)
	if err != nil {
		return api.FileEntry{}, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.Written = b
	if err := f.mkdirs(id, path.Dir(clean), uid, gid); err != nil {
		return api.FileEntry{}, err
	}
	t := f.tree(id)
	old := t[clean]
	if old != nil && old.dir {
		return api.FileEntry{}, errdefs.Invalid("writing %s: is a directory", clean)
	}
	n := &fakeFile{data: b, mode: mode, mtime: time.Now(), uid: uid, gid: gid}
	t[clean] = n
	if old == nil {
		f.publish(id, clean, api.FileEventCreate)
	}
	f.publish(id, clean, api.FileEventWrite)
	return entryOf(clean, n), nil
}

// StatFile implements edgeapi.Edge.
func (f *Fake) StatFile(ctx context.Context, id, p string) (api.FileEntry, error) {
	if _, err := f.Get(ctx, id); err != nil {
		return api.FileEntry{}, err
	}
	clean, err := cleanPath(p)
	if err != nil {
		return api.FileEntry{}, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	n := f.tree(id)[clean]
	if n == nil {
		return api.FileEntry{}, errdefs.NotFound("stating %s: no such file or directory", clean)
	}
	return entryOf(clean, n), nil
}

// ListFiles implements edgeapi.Edge.
func (f *Fake) ListFiles(ctx context.Context, id, p string, depth int) ([]api.FileEntry, error) {
	if _, err := f.Get(ctx, id); err != nil {
		return nil, err
	}
	clean, err := cleanPath(p)
	if err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	t := f.tree(id)
	switch n := t[clean]; {
	case n == nil:
		return nil, errdefs.NotFound("listing %s: no such directory", clean)
	case !n.dir:
		return nil, errdefs.Invalid("listing %s: not a directory", clean)
	}
	prefix := strings.TrimSuffix(clean, "/") + "/"
	var out []api.FileEntry
	for q, n := range t {
		rel, ok := strings.CutPrefix(q, prefix)
		if !ok || q == clean || strings.Count(rel, "/") >= depth {
			continue
		}
		out = append(out, entryOf(q, n))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Path < out[j].Path })
	return out, nil
}

// below returns p and the paths under it in t, deepest first.
func below(t map[string]*fakeFile, p string) []string {
	var out []string
	for q := range t {
		if q == p || strings.HasPrefix(q, strings.TrimSuffix(p, "/")+"/") {
			out = append(out, q)
		}
	}
	sort.Slice(out, func(i, j int) bool { return len(out[i]) > len(out[j]) })
	return out
}

// RemoveFile implements edgeapi.Edge.
func (f *Fake) RemoveFile(ctx context.Context, id, p string, recursive bool) error {
	if _, err := f.Get(ctx, id); err != nil {
		return err
	}
	clean, err := cleanPath(p)
	if err != nil {
		return err
	}
	if clean == "/" {
		return errdefs.Invalid("removing /: refusing to remove the sandbox root")
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	t := f.tree(id)
	if t[clean] == nil {
		return errdefs.NotFound("removing %s: no such file or directory", clean)
	}
	gone := below(t, clean)
	if len(gone) > 1 && !recursive {
		return errdefs.Precondition("removing %s: directory not empty", clean)
	}
	for _, q := range gone {
		delete(t, q)
		f.publish(id, q, api.FileEventRemove)
	}
	return nil
}

// MakeDir implements edgeapi.Edge.
func (f *Fake) MakeDir(ctx context.Context, id, p, owner string) (api.FileEntry, error) {
	if _, err := f.Get(ctx, id); err != nil {
		return api.FileEntry{}, err
	}
	clean, err := cleanPath(p)
	if err != nil {
		return api.FileEntry{}, err
	}
	uid, gid, err := fakeOwner(owner)
	if err != nil {
		return api.FileEntry{}, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	t := f.tree(id)
	if n := t[clean]; n != nil {
		if n.dir {
			return api.FileEntry{}, errdefs.AlreadyExists("creating directory %s: it exists", clean)
		}
		return api.FileEntry{}, errdefs.Invalid("creating directory %s: something that is not a directory is there", clean)
	}
	if err := f.mkdirs(id, clean, uid, gid); err != nil {
		return api.FileEntry{}, err
	}
	return entryOf(clean, t[clean]), nil
}

// MoveFile implements edgeapi.Edge.
func (f *Fake) MoveFile(ctx context.Context, id, src, dst string) (api.FileEntry, error) {
	if _, err := f.Get(ctx, id); err != nil {
		return api.FileEntry{}, err
	}
	from, err := cleanPath(src)
	if err != nil {
		return api.FileEntry{}, err
	}
	to, err := cleanPath(dst)
	if err != nil {
		return api.FileEntry{}, err
	}
	if from == "/" || to == "/" || strings.HasPrefix(to, from+"/") {
		return api.FileEntry{}, errdefs.Invalid("moving %s to %s: not possible", from, to)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	t := f.tree(id)
	if t[from] == nil {
		return api.FileEntry{}, errdefs.NotFound("moving %s: no such file or directory", from)
	}
	if from == to {
		// As rename(2): nothing to do.
		return entryOf(to, t[to]), nil
	}
	if n := t[to]; n != nil && n.dir {
		if len(below(t, to)) > 1 {
			return api.FileEntry{}, errdefs.Precondition("moving %s to %s: the destination is a directory that is not empty", from, to)
		}
		if !t[from].dir {
			return api.FileEntry{}, errdefs.Invalid("moving %s to %s: the destination is a directory", from, to)
		}
	}
	if err := f.mkdirs(id, path.Dir(to), 0, 0); err != nil {
		return api.FileEntry{}, err
	}
	moved := below(t, from)
	for i := len(moved) - 1; i >= 0; i-- { // parents first
		q := moved[i]
		nq := to + strings.TrimPrefix(q, from)
		t[nq] = t[q]
		delete(t, q)
		f.publish(id, q, api.FileEventRename)
		f.publish(id, nq, api.FileEventCreate)
	}
	return entryOf(to, t[to]), nil
}

// WatchDir implements edgeapi.Edge: after the start event it reports the
// changes the fake's own file calls make below path (at most watchQueue
// waiting; more are dropped).
func (f *Fake) WatchDir(ctx context.Context, id, p string, recursive bool, emit func(api.FileEvent) error) error {
	if _, err := f.Get(ctx, id); err != nil {
		return err
	}
	clean, err := cleanPath(p)
	if err != nil {
		return err
	}
	w := &fakeWatch{id: id, dir: clean, recursive: recursive, ch: make(chan api.FileEvent, watchQueue)}
	f.mu.Lock()
	switch n := f.tree(id)[clean]; {
	case n == nil:
		f.mu.Unlock()
		return errdefs.NotFound("watching %s: no such directory", clean)
	case !n.dir:
		f.mu.Unlock()
		return errdefs.Invalid("watching %s: not a directory", clean)
	}
	f.watches = append(f.watches, w)
	f.mu.Unlock()
	defer func() {
		f.mu.Lock()
		defer f.mu.Unlock()
		for i, o := range f.watches {
			if o == w {
				f.watches = append(f.watches[:i], f.watches[i+1:]...)
				break
			}
		}
	}()
	if err := emit(api.FileEvent{Type: api.FileEventStart}); err != nil {
		return err
	}
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case ev := <-w.ch:
			if err := emit(ev); err != nil {
				return err
			}
		}
	}
}

// Watches is how many WatchDir calls are running.
func (f *Fake) Watches() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.watches)
}

// WriteTar implements edgeapi.Edge.
func (f *Fake) WriteTar(ctx context.Context, id, path string, w io.Writer) error {
	switch path {
	case "/nope":
		return errdefs.NotFound("%s: no such file", path)
	case "/broken":
		if _, err := w.Write([]byte(strings.Repeat("t", 10))); err != nil {
			return err
		}
		return errdefs.Precondition("%s changed while it was archived", path)
	}
	_, err := w.Write(f.File)
	return err
}

// ExtractTar implements edgeapi.Edge.
func (f *Fake) ExtractTar(ctx context.Context, id, path string, rd io.Reader, owner string) (api.TarResult, error) {
	if _, _, err := fakeOwner(owner); err != nil {
		return api.TarResult{}, err
	}
	b, err := io.ReadAll(rd)
	if err != nil {
		return api.TarResult{}, err
	}
	f.mu.Lock()
	f.Written = b
	f.mu.Unlock()
	return api.TarResult{Files: 1, Bytes: int64(len(b))}, nil
}

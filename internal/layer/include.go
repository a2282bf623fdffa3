package layer

import (
	"os"
	"path"
	"path/filepath"
	"strings"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// ExcludesForInclude turns an include list into the exclude list that
// leaves only the included paths (and the directories leading to them) of
// the tree at dir: every entry that is neither on nor below an included
// path, nor above one, is excluded. Paths are absolute as seen from the
// tree's root. The walk descends only into directories above an included
// path, so its cost is bounded by those directories, not the whole tree.
func ExcludesForInclude(dir string, include []string) ([]string, error) {
	var incl []string
	for _, p := range include {
		if !strings.HasPrefix(p, "/") || strings.ContainsRune(p, 0) || len(p) > 4096 {
			return nil, errdefs.Invalid("include path %q must be an absolute path", p)
		}
		incl = append(incl, path.Clean(p))
	}
	for _, p := range incl {
		if p == "/" {
			return nil, nil // everything is included
		}
	}
	var out []string
	var walk func(rel string) error
	walk = func(rel string) error {
		ents, err := os.ReadDir(filepath.Join(dir, rel))
		if err != nil {
			return err
		}
		for _, e := range ents {
			p := path.Join("/", rel, e.Name())
			switch {
			case coveredBy(p, incl):
			case e.IsDir() && leadsTo(p, incl):
				if err := walk(p); err != nil {
					return err
				}
			default:
				out = append(out, p)
			}
		}
		return nil
	}
	if err := walk("/"); err != nil {
		return nil, err
	}
	return out, nil
}

// coveredBy reports whether p is one of paths or below one.
func coveredBy(p string, paths []string) bool {
	for _, i := range paths {
		if p == i || strings.HasPrefix(p, i+"/") {
			return true
		}
	}
	return false
}

// leadsTo reports whether p is a directory above one of paths.
func leadsTo(p string, paths []string) bool {
	for _, i := range paths {
		if strings.HasPrefix(i, p+"/") {
			return true
		}
	}
	return false
}

package layer

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

// mountEntry is the part of one /proc/self/mountinfo line this package uses.
type mountEntry struct {
	ID         int
	Parent     int
	Mountpoint string
	FSType     string
	Source     string
}

// parseMountinfo parses the format described in proc(5). Paths are
// unescaped (the kernel writes space, tab, newline and backslash as \ooo).
func parseMountinfo(r io.Reader) ([]mountEntry, error) {
	var out []mountEntry
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" {
			continue
		}
		fields := strings.Fields(line)
		// id parent maj:min root mountpoint options [optional...] - fstype source superopts
		sep := -1
		for i := 6; i < len(fields); i++ {
			if fields[i] == "-" {
				sep = i
				break
			}
		}
		if len(fields) < 7 || sep < 0 || sep+2 >= len(fields) {
			return nil, fmt.Errorf("parsing mountinfo line %q: too few fields", line)
		}
		var e mountEntry
		if _, err := fmt.Sscanf(fields[0]+" "+fields[1], "%d %d", &e.ID, &e.Parent); err != nil {
			return nil, fmt.Errorf("parsing mountinfo line %q: %w", line, err)
		}
		e.Mountpoint = unescapeMountPath(fields[4])
		e.FSType = fields[sep+1]
		e.Source = unescapeMountPath(fields[sep+2])
		out = append(out, e)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("reading mountinfo: %w", err)
	}
	return out, nil
}

// unescapeMountPath undoes the kernel's octal escaping (\040 for space, ...).
func unescapeMountPath(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) && isOctal(s[i+1]) && isOctal(s[i+2]) && isOctal(s[i+3]) {
			b.WriteByte((s[i+1]-'0')<<6 | (s[i+2]-'0')<<3 | (s[i+3] - '0'))
			i += 3
			continue
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func isOctal(c byte) bool { return c >= '0' && c <= '7' }

func readMountinfo() ([]mountEntry, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, fmt.Errorf("reading mountinfo: %w", err)
	}
	defer f.Close()
	return parseMountinfo(f)
}

// isMountRoot reports whether path is the root of a mount. statx's
// STATX_ATTR_MOUNT_ROOT answers with one syscall, which matters on an edge
// whose mountinfo has thousands of lines; mountinfo is the fallback for
// filesystems or kernels that do not report the attribute.
func isMountRoot(path string) (bool, error) {
	var stx unix.Statx_t
	err := unix.Statx(unix.AT_FDCWD, path, unix.AT_SYMLINK_NOFOLLOW|unix.AT_NO_AUTOMOUNT, unix.STATX_TYPE, &stx)
	if errors.Is(err, unix.ENOENT) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("checking mount %s: %w", path, err)
	}
	if stx.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT != 0 {
		return stx.Attributes&unix.STATX_ATTR_MOUNT_ROOT != 0, nil
	}
	mounts, err := readMountinfo()
	if err != nil {
		return false, err
	}
	for _, m := range mounts {
		if m.Mountpoint == path {
			return true, nil
		}
	}
	return false, nil
}

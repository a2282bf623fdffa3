// Package mountinfo parses /proc/self/mountinfo; imported by cgroup, layer
// and edge.
package mountinfo

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
)

// Entry is one line of mountinfo (proc(5)):
//
//	36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue
//	ID Parent  Root  MountPoint Options [optional...] - FSType Source SuperOptions
//
// Root, MountPoint and Source are unescaped; Options and SuperOptions are
// kept as the kernel writes them (comma-separated, escapes intact, so that
// splitting on commas stays correct).
type Entry struct {
	ID, Parent   int
	Root         string // path of the mount's root within its filesystem
	MountPoint   string
	Options      string // per-mount options
	FSType       string
	Source       string
	SuperOptions string // per-superblock options; "" when the field is absent
}

// SuperOptionList returns SuperOptions split on commas, or nil when there
// are none.
func (e Entry) SuperOptionList() []string {
	if e.SuperOptions == "" {
		return nil
	}
	return strings.Split(e.SuperOptions, ",")
}

// Parse parses mountinfo text. Blank lines are skipped; a malformed line is
// an error. It does no I/O beyond reading r.
func Parse(r io.Reader) ([]Entry, error) {
	var out []Entry
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		if strings.TrimSpace(line) == "" {
			continue
		}
		e, err := parseLine(line)
		if err != nil {
			return nil, fmt.Errorf("parsing mountinfo line %d %q: %w", n, line, err)
		}
		out = append(out, e)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("reading mountinfo: %w", err)
	}
	return out, nil
}

func parseLine(line string) (Entry, error) {
	fields := strings.Fields(line)
	// The optional fields (zero or more) run from index 6 to the "-".
	sep := -1
	for i := 6; i < len(fields); i++ {
		if fields[i] == "-" {
			sep = i
			break
		}
	}
	if sep < 0 || len(fields) < sep+3 {
		return Entry{}, fmt.Errorf("malformed: too few fields")
	}
	id, err := strconv.Atoi(fields[0])
	if err != nil {
		return Entry{}, fmt.Errorf("mount ID: %w", err)
	}
	parent, err := strconv.Atoi(fields[1])
	if err != nil {
		return Entry{}, fmt.Errorf("parent ID: %w", err)
	}
	e := Entry{
		ID:         id,
		Parent:     parent,
		Root:       Unescape(fields[3]),
		MountPoint: Unescape(fields[4]),
		Options:    fields[5],
		FSType:     fields[sep+1],
		Source:     Unescape(fields[sep+2]),
	}
	if len(fields) > sep+3 {
		e.SuperOptions = fields[sep+3]
	}
	return e, nil
}

// Unescape undoes the kernel's \ooo escaping (space, tab, newline and
// backslash in paths). Sequences that are not three octal digits naming a
// byte are left as they are.
func Unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// Read reads and parses /proc/self/mountinfo.
func Read() ([]Entry, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, fmt.Errorf("reading mountinfo: %w", err)
	}
	defer f.Close()
	return Parse(f)
}

// Under returns, in mountinfo order, the entries whose mount point is
// prefix or below it. prefix should be clean and absolute; "/" matches
// every entry.
func Under(entries []Entry, prefix string) []Entry {
	below := prefix + "/"
	if prefix == "/" {
		below = "/"
	}
	var out []Entry
	for _, e := range entries {
		if e.MountPoint == prefix || strings.HasPrefix(e.MountPoint, below) {
			out = append(out, e)
		}
	}
	return out
}

package netpolicy

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// PoolClaimsDir is where the dsec processes of a host note their sandbox
// address pools (ClaimPool). A variable for tests.
var PoolClaimsDir = "/run/dsec/pools"

// A pool claim is a file named after its instance holding "POOL PID
// OWNER", locked (flock) by its process for as long as it runs: a file
// nobody holds is of a process gone. Pools show on the host (addresses,
// veths) only once a sandbox needs a route out, so without the claims an
// edge given another's pool would start and fail later, at the first
// networked create of one of them.
//
// The directory and its parent must be this user's and written by nobody
// else (checked, not followed through symlinks): whoever could write
// there could hold claims of its own and refuse every edge, or make root
// remove files elsewhere. Claims and the directory's lock are 0600, so
// that nobody else can lock them either. Who looks or notes holds the
// directory's lock (claimGuardWait at most), so that a look, which locks
// each claim for a moment to tell whether a process holds it, never
// meets a claim being taken.

// claimGuardWait bounds the wait for the claims directory's lock.
const claimGuardWait = 5 * time.Second

// ClaimPool notes the manager's pool under dir until Close and returns
// the running instances whose pools overlap it (what each is). Claims of
// processes gone are removed. The caller decides whether an overlap
// stops it; either way the claim is made. A second call replaces the
// first claim.
func (m *Manager) ClaimPool(dir, owner string) ([]string, error) {
	d, err := openClaimsDir(dir, true)
	if err != nil {
		return nil, fmt.Errorf("noting the sandbox address pool: %w", err)
	}
	defer d.Close()
	m.mu.Lock()
	m.releaseClaimLocked()
	m.mu.Unlock()
	overlaps, err := scanClaims(d, m.l.instance, m.l.pool, true)
	if err != nil {
		return nil, fmt.Errorf("noting the sandbox address pool: %w", err)
	}
	f, err := d.create(m.l.instance)
	if err != nil {
		return nil, fmt.Errorf("noting the sandbox address pool: %w", err)
	}
	note := fmt.Sprintf("%s %d %s\n", m.l.pool, os.Getpid(), strings.ReplaceAll(owner, "\n", " "))
	if err := f.Truncate(0); err == nil {
		_, err = f.WriteAt([]byte(note), 0)
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("noting the sandbox address pool: %w", err)
	}
	m.mu.Lock()
	m.claim = &poolClaim{dir: d.path, name: m.l.instance, f: f}
	m.mu.Unlock()
	return overlaps, nil
}

// OverlappingPools returns the running instances (other than instance)
// whose pools, as their claims under dir say, overlap pool: what a
// process may check before it claims anything (ClaimPool checks again).
// A dir that does not exist has none.
func OverlappingPools(dir, instance string, pool netip.Prefix) ([]string, error) {
	d, err := openClaimsDir(dir, false)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	defer d.Close()
	return scanClaims(d, instance, pool.Masked(), false)
}

// poolClaim is a claim this process holds.
type poolClaim struct {
	dir, name string
	f         *os.File
}

// releaseClaimLocked ends the manager's pool claim (Close).
func (m *Manager) releaseClaimLocked() {
	if c := m.claim; c != nil {
		m.claim = nil
		// The file first, then the lock: a look between the two finds
		// the name gone.
		if dfd, err := unix.Open(c.dir, unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_RDONLY|unix.O_CLOEXEC, 0); err == nil {
			_ = unix.Unlinkat(dfd, c.name, 0)
			unix.Close(dfd)
		}
		c.f.Close()
	}
}

// claimsDir is the claims directory, open and locked.
type claimsDir struct {
	path string
	fd   int
	lock int
}

// openClaimsDir checks dir and its parent (see above), opens dir (made
// if mk) and takes its lock.
func openClaimsDir(dir string, mk bool) (*claimsDir, error) {
	dir = filepath.Clean(dir)
	if mk {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, err
		}
	}
	for _, p := range []string{filepath.Dir(dir), dir} {
		if err := ownDir(p); err != nil {
			return nil, err
		}
	}
	fd, err := unix.Open(dir, unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: dir, Err: err}
	}
	lock, err := unix.Openat(fd, ".lock", unix.O_CREAT|unix.O_RDWR|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		unix.Close(fd)
		return nil, &os.PathError{Op: "open", Path: filepath.Join(dir, ".lock"), Err: err}
	}
	for deadline := time.Now().Add(claimGuardWait); ; {
		err = unix.Flock(lock, unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return &claimsDir{path: dir, fd: fd, lock: lock}, nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) || time.Now().After(deadline) {
			unix.Close(lock)
			unix.Close(fd)
			return nil, fmt.Errorf("locking %s: %w", filepath.Join(dir, ".lock"), err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// ownDir refuses a path that is not a directory of this user (a symlink
// included) or that others may write to.
func ownDir(p string) error {
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err != nil {
		return &os.PathError{Op: "lstat", Path: p, Err: err}
	}
	switch {
	case st.Mode&unix.S_IFMT != unix.S_IFDIR:
		return fmt.Errorf("%s is not a directory", p)
	case int(st.Uid) != os.Geteuid():
		return fmt.Errorf("%s belongs to uid %d, not this process's %d", p, st.Uid, os.Geteuid())
	case st.Mode&0o022 != 0:
		return fmt.Errorf("%s may be written by others (mode %o)", p, st.Mode&0o7777)
	}
	return nil
}

func (d *claimsDir) Close() {
	unix.Close(d.lock) // ends the lock
	unix.Close(d.fd)
}

// create opens (making it) this instance's claim and locks it. A holder
// of the same instance is another process on the same state dir: refused.
// A claim whose holder removed it between this open and this lock (a
// release does not take the directory's lock) is opened again.
func (d *claimsDir) create(name string) (*os.File, error) {
	for range 3 {
		fd, err := unix.Openat(d.fd, name, unix.O_CREAT|unix.O_RDWR|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return nil, &os.PathError{Op: "open", Path: filepath.Join(d.path, name), Err: err}
		}
		f := os.NewFile(uintptr(fd), filepath.Join(d.path, name))
		if err := unix.Flock(fd, unix.LOCK_EX|unix.LOCK_NB); err != nil {
			f.Close()
			return nil, fmt.Errorf("%s is held by another process of this instance: %w", f.Name(), err)
		}
		var held, named unix.Stat_t
		if unix.Fstat(fd, &held) == nil && unix.Fstatat(d.fd, name, &named, unix.AT_SYMLINK_NOFOLLOW) == nil &&
			held.Dev == named.Dev && held.Ino == named.Ino {
			return f, nil
		}
		f.Close()
	}
	return nil, fmt.Errorf("%s keeps being removed while it is claimed", filepath.Join(d.path, name))
}

// scanClaims lists the claims of running instances other than instance
// whose pools overlap pool; sweep removes the claims of processes gone.
func scanClaims(d *claimsDir, instance string, pool netip.Prefix, sweep bool) ([]string, error) {
	dup, err := unix.Dup(d.fd)
	if err != nil {
		return nil, err
	}
	df := os.NewFile(uintptr(dup), d.path)
	defer df.Close()
	names, err := df.Readdirnames(-1)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, name := range names {
		if !instanceRE.MatchString(name) || name == instance {
			continue
		}
		p, pid, who, live := d.read(name)
		switch {
		case !live && sweep:
			_ = unix.Unlinkat(d.fd, name, 0)
		case live && p.IsValid() && p.Overlaps(pool):
			out = append(out, fmt.Sprintf("%s of %s (pid %d)", p, who, pid))
		}
	}
	return out, nil
}

// read reads a claim; live reports whether a process holds it. Anything
// but a regular file of this user with one name is nobody's.
func (d *claimsDir) read(name string) (pool netip.Prefix, pid int, who string, live bool) {
	fd, err := unix.Openat(d.fd, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return pool, 0, "", false
	}
	f := os.NewFile(uintptr(fd), name)
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG || int(st.Uid) != os.Geteuid() || st.Nlink != 1 {
		return pool, 0, "", false
	}
	if err := unix.Flock(fd, unix.LOCK_SH|unix.LOCK_NB); err == nil {
		return pool, 0, "", false // nobody holds it
	}
	b := make([]byte, 4096)
	n, _ := f.ReadAt(b, 0)
	fields := strings.SplitN(strings.TrimSpace(string(b[:n])), " ", 3)
	if len(fields) == 3 {
		pool, _ = netip.ParsePrefix(fields[0])
		pid, _ = strconv.Atoi(fields[1])
		who = fields[2]
	}
	return pool, pid, who, true
}

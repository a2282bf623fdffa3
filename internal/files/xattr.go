package files

import (
	"errors"

	"golang.org/x/sys/unix"
)

// ListXattrs returns the names of the xattrs of the inode at p, never
// following p's last component ("/proc/self/fd/N/name": the directory by
// descriptor, the name as it is). None on a filesystem without xattrs.
func ListXattrs(p string) ([]string, error) {
	for {
		n, err := unix.Llistxattr(p, nil)
		if errors.Is(err, unix.ENOTSUP) || n == 0 {
			return nil, nil
		}
		if err != nil {
			return nil, err
		}
		buf := make([]byte, n)
		n, err = unix.Llistxattr(p, buf)
		if errors.Is(err, unix.ERANGE) {
			continue // grew meanwhile
		}
		if err != nil {
			return nil, err
		}
		var names []string
		start := 0
		for i, c := range buf[:n] {
			if c == 0 {
				if i > start {
					names = append(names, string(buf[start:i]))
				}
				start = i + 1
			}
		}
		return names, nil
	}
}

// GetXattr returns the value of xattr name of the inode at p (as
// ListXattrs), nil if it has none.
func GetXattr(p, name string) ([]byte, error) {
	for {
		n, err := unix.Lgetxattr(p, name, nil)
		if errors.Is(err, unix.ENODATA) || errors.Is(err, unix.ENOTSUP) {
			return nil, nil
		}
		if err != nil {
			return nil, err
		}
		buf := make([]byte, n)
		n, err = unix.Lgetxattr(p, name, buf)
		if errors.Is(err, unix.ERANGE) {
			continue
		}
		if err != nil {
			return nil, err
		}
		return buf[:n], nil
	}
}

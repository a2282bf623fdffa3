#!/bin/sh
# make_base.sh — build the base layer base/rollout-python:3.11 from the host's
# Debian Python (/usr/bin/python3.11), its shared libraries, /usr/lib/python3.11
# (minus test suites and GUI/tooling packages), busybox and /etc/passwd.
#
# usage: examples/rollout/make_base.sh [DSEC_BIN]     (default: bin/dsec, else dsec on PATH)
# Needs a running `dsec up` (the CLI reads DSEC_ENDPOINT / DSEC_API_KEY / the config file).
set -eu

REF_NAME=rollout-python
REF_TAG=3.11
PY=/usr/bin/python3.11
PYLIB=/usr/lib/python3.11
BUSYBOX=$(command -v busybox || echo /usr/bin/busybox)

DSEC=${1:-}
if [ -z "$DSEC" ]; then
	here=$(cd "$(dirname "$0")/../.." && pwd)
	if [ -x "$here/bin/dsec" ]; then DSEC=$here/bin/dsec; else DSEC=dsec; fi
fi
for f in "$PY" "$PYLIB/os.py" "$BUSYBOX"; do
	[ -e "$f" ] || { echo "make_base.sh: missing $f (apt-get install python3.11-minimal busybox)" >&2; exit 1; }
done

root=$(mktemp -d /tmp/rollout-base.XXXXXX)
trap 'rm -rf "$root"' EXIT

mkdir -p "$root/bin" "$root/sbin" "$root/usr/bin" "$root/usr/lib" "$root/etc" "$root/tmp" "$root/var/tmp" \
	"$root/root" "$root/repo" "$root/proc" "$root/sys" "$root/dev"
chmod 1777 "$root/tmp" "$root/var/tmp"

# Python and every shared library it (or one of its extension modules) links.
cp -p "$PY" "$root/usr/bin/python3.11"
ln -s python3.11 "$root/usr/bin/python3"
ln -s python3.11 "$root/usr/bin/python"
cp -a "$PYLIB" "$root/usr/lib/python3.11"
for d in test idlelib tkinter turtledemo ensurepip lib2to3 pydoc_data unittest/test \
	distutils/tests ctypes/test sqlite3/test tkinter/test config-3.11-x86_64-linux-gnu; do
	rm -rf "$root/usr/lib/python3.11/$d"
done
# Keep /usr/lib/python3.11/unittest itself (the tasks are graded with it) and the
# __pycache__ dirs (the read-only base then needs no compiling at every start).

libs=$( { ldd "$PY"; for so in "$PYLIB"/lib-dynload/*.so; do ldd "$so" 2>/dev/null || true; done; } |
	awk '/=> \// {print $3} /^[[:space:]]*\/[^ ]*ld-linux/ {print $1}' | sort -u)
for lib in $libs; do
	real=$(readlink -f "$lib")
	mkdir -p "$root$(dirname "$lib")" "$root$(dirname "$real")"
	[ -e "$root$real" ] || cp -p "$real" "$root$real"
	[ "$lib" = "$real" ] || [ -e "$root$lib" ] || ln -s "$real" "$root$lib"
done
# Debian's merged /usr: /lib64 and /lib are where the loader and libc are looked up.
[ -e "$root/lib64/ld-linux-x86-64.so.2" ] || { mkdir -p "$root/lib64"; ln -sf "$(readlink -f /lib64/ld-linux-x86-64.so.2)" "$root/lib64/ld-linux-x86-64.so.2"; }

# busybox and its applets (sh, ls, cat, grep, ...).
cp -p "$BUSYBOX" "$root/bin/busybox"
for app in $("$BUSYBOX" --list); do
	[ "$app" = busybox ] || [ -e "$root/bin/$app" ] || ln -s busybox "$root/bin/$app"
done

cat > "$root/etc/passwd" <<'PASSWD'
root:x:0:0:root:/root:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
PASSWD
cat > "$root/etc/group" <<'GROUP'
root:x:0:
nogroup:x:65534:
GROUP

"$DSEC" layer build --kind base --name "$REF_NAME" --tag "$REF_TAG" "$root"

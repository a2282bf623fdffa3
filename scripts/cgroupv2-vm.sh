#!/usr/bin/env bash
# cgroupv2-vm.sh: run dsec's root tests of internal/cgroup and
# internal/sandbox/container on a pure cgroup v2 Linux guest under QEMU
# (TCG, no KVM needed), for hosts whose own cgroups are hybrid or v1.
#
# Usage: scripts/cgroupv2-vm.sh [go test -run pattern]
#   e.g. V2VM_REV=HEAD scripts/cgroupv2-vm.sh 'TestLifecycle|TestNative'
#   Kernel of the host's series (6.18) instead of bookworm's 6.12:
#   V2VM_KERNEL_SUITE=trixie-backports \
#     V2VM_KERNEL_PKG=linux-image-6.18.15+deb13-amd64 scripts/cgroupv2-vm.sh
#
# The guest is a Debian kernel (downloaded with apt-get download, never
# installed on the host) and an initramfs holding busybox-static, the test
# binaries, runc and catatonit with their libraries and a few modules. Its
# init mounts cgroup2 alone at /sys/fs/cgroup (as systemd does: nsdelegate,
# memory_recursiveprot, / made rshared, PID 1 in /init.scope, each test
# binary in /system.slice/dsec-<pkg>-test.service), runs every test binary
# and powers off. The console goes to $V2VM_DIR/console.log; the exit
# status is non-zero if a binary failed or its result marker is missing.
#
# Environment (all optional):
#   V2VM_DIR         work dir, downloads cached there   (/tmp/dsec-v2vm)
#   V2VM_KERNEL_SUITE  take the kernel from this Debian suite instead of the
#                    host's sources, e.g. trixie-backports (private apt lists)
#   V2VM_KERNEL_META kernel metapackage  (linux-image-6.12-amd64; with a
#                    suite: linux-image-amd64)
#   V2VM_KERNEL_PKG  kernel package  (what V2VM_KERNEL_META depends on)
#   V2VM_REV         build from this commit (git archive into $V2VM_DIR/src)
#                    instead of the work tree, e.g. HEAD while the work
#                    tree is mid-edit                   (work tree)
#   V2VM_PKGS        Go packages to test (./internal/cgroup/ ./internal/sandbox/container/)
#   V2VM_MODULES     modules to load, with their dependencies
#                    (overlay erofs veth loop virtio_blk ext4)
#   V2VM_DISK_SIZE   the guest's root (and /tmp on it): a fresh ext4 disk,
#                    as on a host (tests count tmpfs mounts)  (8G)
#   V2VM_TIMEOUT     guard on the whole VM run         (45m)
#   V2VM_TEST_TIMEOUT  -test.timeout per binary        (40m)
#   V2VM_MEM, V2VM_SMP  guest memory and CPUs          (4G, 2)
#   V2VM_ACCEL       QEMU -accel (tcg,thread=single: multi-threaded TCG of
#                    QEMU 7.2 raced the kernel's live code patching here,
#                    an "Oops: int3" in the scheduler)
#   V2VM_CGROUP      "service" (default: systemd-like placement) or "root"
#                    (tests run in the root cgroup)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
V2VM_DIR=${V2VM_DIR:-/tmp/dsec-v2vm}
V2VM_PKGS=${V2VM_PKGS:-./internal/cgroup/ ./internal/sandbox/container/}
V2VM_MODULES=${V2VM_MODULES:-overlay erofs veth loop virtio_blk ext4}
V2VM_DISK_SIZE=${V2VM_DISK_SIZE:-8G}
V2VM_TIMEOUT=${V2VM_TIMEOUT:-45m}
V2VM_TEST_TIMEOUT=${V2VM_TEST_TIMEOUT:-40m}
V2VM_MEM=${V2VM_MEM:-4G}
V2VM_SMP=${V2VM_SMP:-2}
V2VM_CGROUP=${V2VM_CGROUP:-service}
V2VM_ACCEL=${V2VM_ACCEL:-tcg,thread=single}
GO=${GO:-$(command -v go || echo /usr/local/go/bin/go)}
RUN_PATTERN=${1:-}

log() { printf '[cgroupv2-vm %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[[ $(id -u) == 0 ]] || die "run as root (apt-get, mknod for the initramfs)"
[[ $# -le 1 ]] || die "usage: $0 [go test -run pattern]"
# The pattern travels on the kernel command line, which splits on blanks.
[[ $RUN_PATTERN != *[[:space:]\"\']* ]] || die "the -run pattern may not contain blanks or quotes"
[[ $V2VM_CGROUP == service || $V2VM_CGROUP == root ]] || die "V2VM_CGROUP must be service or root"

mkdir -p "$V2VM_DIR"/debs
V2VM_DIR=$(cd "$V2VM_DIR" && pwd)

# --- host tools ------------------------------------------------------------

APT_UPDATED=
apt_update() {
	if [[ -z $APT_UPDATED ]]; then
		log "apt-get update"
		apt-get update -qq >&2
		APT_UPDATED=1
	fi
}

# need_cmd CMD PACKAGE: install PACKAGE on the host if CMD is missing.
need_cmd() {
	command -v "$1" >/dev/null 2>&1 && return
	apt_update
	log "installing $2 on the host (for $1)"
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$2" >&2
	command -v "$1" >/dev/null 2>&1 || die "$2 installed but $1 still not found"
}
need_cmd qemu-system-x86_64 qemu-system-x86
need_cmd cpio cpio
need_cmd depmod kmod
need_cmd mkfs.ext4 e2fsprogs
need_cmd runc runc
need_cmd catatonit catatonit
[[ -x $GO ]] || die "go not found (set GO=)"

# Kernels from another Debian suite (V2VM_KERNEL_SUITE, e.g.
# trixie-backports) are looked up through a private apt configuration in
# the work dir: the host's sources and package lists stay as they are.
KAPT=()
if [[ -n ${V2VM_KERNEL_SUITE:-} ]]; then
	adir=$V2VM_DIR/apt-$V2VM_KERNEL_SUITE
	mkdir -p "$adir"/lists/partial "$adir"/cache/archives/partial "$adir"/parts
	echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] ${V2VM_KERNEL_MIRROR:-http://deb.debian.org/debian} $V2VM_KERNEL_SUITE main" >"$adir/sources.list"
	KAPT=(-o "Dir::Etc::SourceList=$adir/sources.list" -o "Dir::Etc::SourceParts=$adir/parts"
		-o "Dir::State::Lists=$adir/lists" -o "Dir::Cache=$adir/cache" -o "Dir::State::status=/dev/null")
	if [[ ! -e $adir/.updated ]]; then
		log "apt-get update for $V2VM_KERNEL_SUITE (private lists in $adir)"
		apt-get "${KAPT[@]}" update -qq >&2
		touch "$adir/.updated"
	fi
fi

# fetch_deb PACKAGE [APT OPTIONS...]: download PACKAGE's .deb into the
# cache (once) and print its path.
fetch_deb() {
	local pkg=$1 deb
	shift
	deb=$(find "$V2VM_DIR/debs" -maxdepth 1 -name "${pkg}_*.deb" | sort | tail -n1)
	if [[ -z $deb ]]; then
		[[ $# -gt 0 ]] || apt-cache show "$pkg" >/dev/null 2>&1 || apt_update
		log "downloading $pkg"
		# _apt cannot write to the cache dir: download as root, quietly.
		(cd "$V2VM_DIR/debs" && apt-get "$@" download -q "$pkg" 2>&1 | grep -v '^W: Download is performed unsandboxed' >&2 || true)
		deb=$(find "$V2VM_DIR/debs" -maxdepth 1 -name "${pkg}_*.deb" | sort | tail -n1)
		[[ -n $deb ]] || die "apt-get download $pkg failed"
	fi
	echo "$deb"
}

# --- 1. kernel -------------------------------------------------------------

# dsec needs Linux 6.12 (docs/operating.md): bookworm's 6.12 kernel by
# default, not its 6.1 (V2VM_KERNEL_META=linux-image-amd64 for that).
if [[ -z ${V2VM_KERNEL_PKG:-} ]]; then
	meta=${V2VM_KERNEL_META:-linux-image-6.12-amd64}
	[[ -n ${V2VM_KERNEL_SUITE:-} ]] && meta=${V2VM_KERNEL_META:-linux-image-amd64}
	[[ -n ${V2VM_KERNEL_SUITE:-} ]] || apt-cache depends "$meta" >/dev/null 2>&1 || apt_update
	V2VM_KERNEL_PKG=$(apt-cache "${KAPT[@]}" depends "$meta" | awk '$1 == "Depends:" && $2 ~ /^linux-image-/ {print $2; exit}')
	[[ -n $V2VM_KERNEL_PKG ]] || die "cannot tell which kernel $meta depends on"
fi
KROOT=$V2VM_DIR/kernel/$V2VM_KERNEL_PKG
if [[ ! -e $KROOT/.done ]]; then
	rm -rf "$KROOT"
	mkdir -p "$KROOT"
	# Newer kernels split the image, vmlinuz and modules into packages.
	for pkg in "$V2VM_KERNEL_PKG" $(apt-cache "${KAPT[@]}" depends "$V2VM_KERNEL_PKG" |
		awk '$1 == "Depends:" && $2 ~ /^linux-(binary|modules)-/ {print $2}'); do
		deb=$(fetch_deb "$pkg" "${KAPT[@]}")
		log "extracting $(basename "$deb")"
		dpkg-deb -x "$deb" "$KROOT"
	done
	# Trixie's kernels keep modules in /usr/lib/modules: depmod and
	# modprobe -d look in /lib/modules.
	[[ -d $KROOT/lib/modules || ! -d $KROOT/usr/lib/modules ]] || ln -s usr/lib "$KROOT/lib"
	kver=$(ls "$KROOT/lib/modules")
	log "depmod for $kver"
	depmod -b "$KROOT" "$kver"
	touch "$KROOT/.done"
fi
KVER=$(ls "$KROOT/lib/modules")
VMLINUZ=$KROOT/boot/vmlinuz-$KVER
[[ -f $VMLINUZ ]] || die "no $VMLINUZ"
log "kernel: $V2VM_KERNEL_PKG ($KVER)"

BBROOT=$V2VM_DIR/busybox-static
if [[ ! -e $BBROOT/.done ]]; then
	deb=$(fetch_deb busybox-static)
	rm -rf "$BBROOT"
	mkdir -p "$BBROOT"
	dpkg-deb -x "$deb" "$BBROOT"
	touch "$BBROOT/.done"
fi
BUSYBOX=$BBROOT/bin/busybox
[[ -x $BUSYBOX ]] || die "no busybox in the busybox-static package"

# --- 2. test binaries ------------------------------------------------------

SRC=$REPO
if [[ -n ${V2VM_REV:-} ]]; then
	rev=$(git -C "$REPO" rev-parse --verify "$V2VM_REV^{commit}") || die "no commit $V2VM_REV"
	SRC=$V2VM_DIR/src
	log "building from commit ${rev:0:12} ($V2VM_REV), exported to $SRC"
	rm -rf "$SRC"
	mkdir -p "$SRC"
	git -C "$REPO" archive "$rev" | tar -x -C "$SRC"
else
	log "building from the work tree $REPO"
fi

BIN=$V2VM_DIR/bin
rm -rf "$BIN"
mkdir -p "$BIN"
NAMES=()
for pkg in $V2VM_PKGS; do
	name=$(basename "$pkg")
	log "building $pkg test binary ($name.test)"
	(cd "$SRC" && CGO_ENABLED=1 "$GO" test -c -o "$BIN/$name.test" "$pkg") >&2
	[[ -x $BIN/$name.test ]] || die "no test binary for $pkg (no tests?)"
	NAMES+=("$name")
done

# --- 3. initramfs ----------------------------------------------------------

STAGE=$V2VM_DIR/stage
rm -rf "$STAGE"
mkdir -p "$STAGE"/{bin,sbin,usr/bin,usr/sbin,dev,proc,sys,tmp,run,root,etc,newroot,dsec/src}
chmod 1777 "$STAGE/tmp"

# copy_exe SRC [DEST]: SRC at DEST (default: same path) in the initramfs,
# with every library ldd names at its own path.
copy_exe() {
	local src=$1 dest=${2:-$1} lib
	mkdir -p "$STAGE$(dirname "$dest")"
	cp -L "$src" "$STAGE$dest"
	# ldd fails on static binaries: nothing to copy then.
	for lib in $(ldd "$src" 2>/dev/null | awk '/=> \// {print $3} /^[[:space:]]*\// {print $1}'); do
		if [[ ! -e $STAGE$lib ]]; then
			mkdir -p "$STAGE$(dirname "$lib")"
			cp -L "$lib" "$STAGE$lib"
		fi
	done
}

log "staging busybox, runc, catatonit, test binaries"
copy_exe "$BUSYBOX" /bin/busybox
for app in $("$BUSYBOX" --list-full); do
	[[ -e $STAGE/$app || -L $STAGE/$app ]] && continue
	mkdir -p "$STAGE/$(dirname "$app")"
	ln -s /bin/busybox "$STAGE/$app"
done
copy_exe "$(command -v runc)" /usr/sbin/runc
copy_exe "$(command -v catatonit)" /usr/bin/catatonit
for name in "${NAMES[@]}"; do
	copy_exe "$BIN/$name.test" "/dsec/$name.test"
done
# go test runs a binary in its package's directory: testdata lives there.
for pkg in $V2VM_PKGS; do
	name=$(basename "$pkg")
	mkdir -p "$STAGE/dsec/src/$name"
	if [[ -d $SRC/$pkg/testdata ]]; then
		cp -a "$SRC/$pkg/testdata" "$STAGE/dsec/src/$name/"
	fi
done

cat >"$STAGE/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
EOF
cat >"$STAGE/etc/group" <<'EOF'
root:x:0:
nogroup:x:65534:
EOF
echo dsec-v2vm >"$STAGE/etc/hostname"
printf '127.0.0.1 localhost dsec-v2vm\n::1 localhost\n' >"$STAGE/etc/hosts"
mknod -m 600 "$STAGE/dev/console" c 5 1 2>/dev/null || true
mknod -m 666 "$STAGE/dev/null" c 1 3 2>/dev/null || true

log "staging modules: $V2VM_MODULES (and dependencies)"
: >"$STAGE/etc/dsec-modules"
for mod in $V2VM_MODULES; do
	if ! deps=$(modprobe -d "$KROOT" -S "$KVER" --show-depends "$mod" 2>/dev/null); then
		log "module $mod not in $KVER: skipped"
		continue
	fi
	while read -r kind path _; do
		[[ $kind == insmod ]] || continue # builtin
		rel=${path#"$KROOT"}
		dest=${rel%.xz}
		dest=${dest%.zst}
		grep -qxF "$dest" "$STAGE/etc/dsec-modules" && continue
		mkdir -p "$STAGE$(dirname "$dest")"
		case $rel in
		*.xz) xz -dc "$path" >"$STAGE$dest" ;;
		*.zst) zstd -qdc "$path" >"$STAGE$dest" ;;
		*) cp "$path" "$STAGE$dest" ;;
		esac
		echo "$dest" >>"$STAGE/etc/dsec-modules"
	done <<<"$deps"
done

# Stage 1: the initramfs is the kernel's rootfs, which runc's and dsec's
# pivot_root refuse. Load the modules, copy everything onto the ext4 disk
# (a root filesystem like a host's: tests count tmpfs mounts, and the
# pinned catatonit and busybox are bound from it) and switch_root there.
cat >"$STAGE/init" <<'EOF'
#!/bin/busybox sh
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
for m in $(cat /etc/dsec-modules); do
	insmod "$m" || echo "DSEC-V2VM: WARNING: insmod $m failed"
done
mount -t devtmpfs devtmpfs /dev
i=0
while [ ! -b /dev/vda ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
if ! mount -t ext4 /dev/vda /newroot; then
	echo "DSEC-V2VM: WARNING: no ext4 disk: the root is a tmpfs"
	mount -t tmpfs -o mode=755 tmpfs /newroot
fi
umount /dev
for e in /* ; do
	case $e in /newroot|/proc|/sys|/dev|/init) ;; *) cp -a "$e" /newroot/ ;; esac
done
mkdir -p /newroot/proc /newroot/sys /newroot/dev
cp -a /init /newroot/init
exec switch_root /newroot /sbin/dsec-init
EOF
chmod 755 "$STAGE/init"

# Stage 2: PID 1 in the new root.
cat >"$STAGE/sbin/dsec-init" <<EOF
#!/bin/busybox sh
KVER=$KVER
TEST_TIMEOUT=$V2VM_TEST_TIMEOUT
NAMES="${NAMES[*]}"
EOF
cat >>"$STAGE/sbin/dsec-init" <<'EOF'
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root TMPDIR=/tmp TERM=dumb GOTRACEBACK=all
umask 022
mount -t proc -o nosuid,nodev,noexec proc /proc
mount -t sysfs -o nosuid,nodev,noexec sysfs /sys
mount -t devtmpfs -o nosuid,mode=755 devtmpfs /dev
exec </dev/null >/dev/console 2>&1
mkdir -p /dev/pts /dev/shm /dev/mqueue
mount -t devpts -o nosuid,noexec,gid=5,mode=620,ptmxmode=000 devpts /dev/pts
mount -t tmpfs -o nosuid,nodev tmpfs /dev/shm
mount -t mqueue -o nosuid,nodev,noexec mqueue /dev/mqueue
mount -t tmpfs -o nosuid,nodev,mode=755 tmpfs /run
uptime_s() { cut -d' ' -f1 /proc/uptime; }
say() { echo "DSEC-V2VM: $*"; }
say "INIT uptime=$(uptime_s)s kernel=$(uname -r)"

# Pure cgroup v2, mounted as systemd does; no v1 hierarchy anywhere.
mount -t cgroup2 -o nosuid,nodev,noexec,relatime,nsdelegate,memory_recursiveprot cgroup2 /sys/fs/cgroup ||
	mount -t cgroup2 -o nosuid,nodev,noexec,relatime,nsdelegate cgroup2 /sys/fs/cgroup
mount -t bpf -o nosuid,nodev,noexec,mode=700 bpf /sys/fs/bpf 2>/dev/null || true
mount --make-rshared /
hostname dsec-v2vm
ip link set lo up

say "root: $(grep ' / ' /proc/mounts | tail -n1)"

CG=/sys/fs/cgroup
enable() { # enable DIR: turn on cpu cpuset io memory pids below DIR
	for c in cpuset cpu io memory pids; do
		grep -qw "$c" "$1/cgroup.controllers" && { echo "+$c" >"$1/cgroup.subtree_control" || say "WARNING: +$c in $1 failed"; }
	done
}
enable $CG
MODE=$(sed -n 's/.*dsec\.cgroup=\([^ ]*\).*/\1/p' /proc/cmdline)
if [ "$MODE" != root ]; then
	mkdir -p $CG/init.scope $CG/system.slice
	echo $$ >$CG/init.scope/cgroup.procs
	enable $CG/system.slice
fi
say "cgroup2: $(grep cgroup /proc/mounts | tr '\n' ';')"
say "cgroup2 root subtree_control: $(cat $CG/cgroup.subtree_control); placement: ${MODE:-service}"
say "modules: $(cut -d' ' -f1 /proc/modules | tr '\n' ' ')"

RUN=$(sed -n 's/.*dsec\.run=\([^ ]*\).*/\1/p' /proc/cmdline)
say "run pattern: ${RUN:-<all>}"
set -- -test.v -test.count=1 -test.timeout=$TEST_TIMEOUT
[ -n "$RUN" ] && set -- "$@" "-test.run=$RUN"
for n in $NAMES; do
	say "BEGIN $n uptime=$(uptime_s)s"
	t0=$(date +%s)
	if [ "$MODE" != root ]; then
		svc=$CG/system.slice/dsec-$n-test.service
		mkdir -p $svc
		(cd /dsec/src/$n && echo 0 >$svc/cgroup.procs && exec /dsec/$n.test "$@")
	else
		(cd /dsec/src/$n && exec /dsec/$n.test "$@")
	fi
	rc=$?
	t1=$(date +%s)
	if [ $rc = 0 ]; then r=PASS; else r=FAIL; fi
	say "RESULT $n $r rc=$rc secs=$((t1 - t0))"
done
# What the tests left in the cgroup tree (only init.scope and system.slice
# were there before them).
say "cgroups left: $(cd $CG && find . -mindepth 1 -type d ! -path './init.scope*' ! -path './system.slice*' | sort | tr '\n' ' ')"
say "DONE uptime=$(uptime_s)s"
sync
poweroff -f
echo o >/proc/sysrq-trigger
sleep 10
EOF
chmod 755 "$STAGE/sbin/dsec-init"

INITRD=$V2VM_DIR/initramfs.cpio.gz
log "packing initramfs"
(cd "$STAGE" && find . -print0 | cpio --null -o -H newc --owner=0:0 --quiet | gzip -1) >"$INITRD.tmp"
mv "$INITRD.tmp" "$INITRD"
log "initramfs: $(du -h "$INITRD" | cut -f1)"

# --- 4. boot ---------------------------------------------------------------

CONSOLE=$V2VM_DIR/console.log
APPEND="console=ttyS0 panic=-1 quiet random.trust_cpu=on dsec.cgroup=$V2VM_CGROUP"
[[ -n $RUN_PATTERN ]] && APPEND+=" dsec.run=$RUN_PATTERN"
DISK=$V2VM_DIR/root-disk.img
rm -f "$DISK"
truncate -s "$V2VM_DISK_SIZE" "$DISK"
mkfs.ext4 -q -F -L dsec-root "$DISK" >&2

log "booting ($V2VM_SMP CPUs, $V2VM_MEM, $V2VM_ACCEL, guard $V2VM_TIMEOUT); console: $CONSOLE"
log "kernel command line: $APPEND"
start=$(date +%s)
set +e
timeout -k 30s "$V2VM_TIMEOUT" qemu-system-x86_64 \
	-accel "$V2VM_ACCEL" -cpu max -m "$V2VM_MEM" -smp "$V2VM_SMP" \
	-nographic -nic none -no-reboot \
	-drive "file=$DISK,if=virtio,format=raw,cache=unsafe" \
	-kernel "$VMLINUZ" -initrd "$INITRD" -append "$APPEND" \
	</dev/null 2>&1 | tr -d '\r' | sed -u 's/\x1b\[[0-9;?]*[A-Za-z]//g; s/\x1bc//g' | tee "$CONSOLE"
qrc=${PIPESTATUS[0]}
set -e
secs=$(($(date +%s) - start))
log "VM exited (status $qrc) after ${secs}s"
[[ $qrc == 124 || $qrc == 137 ]] && log "guard timeout $V2VM_TIMEOUT hit"

# --- 5. verdict ------------------------------------------------------------

fail=0
init=$(sed -n 's/^DSEC-V2VM: INIT uptime=\([^ ]*\).*/\1/p' "$CONSOLE")
[[ -n $init ]] && log "guest init started at uptime $init"
for name in "${NAMES[@]}"; do
	res=$(grep -E "^DSEC-V2VM: RESULT $name " "$CONSOLE" | tail -n1 || true)
	if [[ -z $res ]]; then
		log "$name: NO RESULT (marker missing: crash, hang or timeout)"
		fail=1
		continue
	fi
	log "${res#DSEC-V2VM: RESULT }"
	[[ $res == *" PASS "* ]] || fail=1
done
log "tests: $(grep -cE '^\s*--- PASS' "$CONSOLE" || true) passed, $(grep -cE '^\s*--- FAIL' "$CONSOLE" || true) failed, $(grep -cE '^\s*--- SKIP' "$CONSOLE" || true) skipped (subtests included)"
grep -E '^\s*--- (FAIL|SKIP)' "$CONSOLE" >&2 || true
if [[ $fail != 0 ]]; then
	log "FAILED: see $CONSOLE"
	exit 1
fi
log "all test binaries passed"

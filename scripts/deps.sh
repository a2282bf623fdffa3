#!/usr/bin/env bash
# Installs the host packages dsec needs, only if something is missing, and
# downloads the Go modules. Debian 12 package names. With --test, also the
# tools only the tests use.
set -euo pipefail
export PATH=/usr/local/go/bin:$PATH

need=()
have() { command -v "$1" >/dev/null 2>&1; }
have crun || need+=(crun)
have runc || need+=(runc)
have mkfs.erofs || need+=(erofs-utils)
have catatonit || need+=(catatonit)
# runsc: the gvisor backend (spec backend "gvisor"); dsec up offers it when
# runsc is installed (--gvisor auto).
have runsc || need+=(runsc)
# busybox-static: the demo and tests assemble small root filesystems from it.
bb_kind=$(ldd "$(command -v busybox || echo /nonexistent)" 2>&1 || true)
case "$bb_kind" in *"not a dynamic"*) ;; *) need+=(busybox-static) ;; esac
have ip || need+=(iproute2)
have nft || need+=(nftables)
have mkfs.ext4 || need+=(e2fsprogs)
# gcc and libc headers: the exec helper is C, built by cgo; without a C
# compiler go build turns cgo off and exec falls back to the runtime's.
have gcc || need+=(gcc)
[ -e /usr/include/linux/seccomp.h ] && [ -e /usr/include/stdio.h ] || need+=(libc6-dev linux-libc-dev)
if [ "${1:-}" = --test ]; then
	# A real OCI registry for the pull tests; skopeo writes the archives
	# other tools produce.
	[ -x /usr/bin/docker-registry ] || need+=(docker-registry)
	have skopeo || need+=(skopeo)
	# A real etcd for the store contract and the cluster suite.
	have etcd || need+=(etcd-server)
	# QEMU for the microVM tests (TCG here; the guest kernel is
	# downloaded by the tests with apt-get download, never installed).
	have qemu-system-x86_64 || need+=(qemu-system-x86)
fi

if [ ${#need[@]} -gt 0 ]; then
	if [ "$(id -u)" != 0 ]; then
		echo "deps: missing packages: ${need[*]} (run as root, or: sudo apt-get install ${need[*]})" >&2
		exit 1
	fi
	echo "deps: installing ${need[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	apt-get install -y -qq "${need[@]}" >/dev/null
fi
go mod download
echo "deps: ok (crun $(crun --version | head -1 | awk '{print $3}'), runc $(runc --version | head -1 | awk '{print $3}'), runsc $(runsc --version | head -1 | awk '{print $3}'), erofs-utils, catatonit, busybox-static)"

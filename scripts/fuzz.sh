#!/usr/bin/env bash
# Runs every Go fuzz target (func FuzzX(f *testing.F) in a _test.go file
# under internal/, api/, cmd/ or sdk/) for FUZZTIME each, one after the
# other: `go test -fuzz` takes one package and one target at a time. Prints
# one line per target and fails if any target fails.
#
#   scripts/fuzz.sh                       every target, 3s each (what `make test` runs)
#   FUZZTIME=10m scripts/fuzz.sh          the long run (also: make fuzz FUZZTIME=10m)
#   FUZZTIME=1m scripts/fuzz.sh FuzzExtractTar FuzzRootPaths   only these targets
#
# FUZZTIME takes what -fuzztime does (a duration, or "1000x" inputs). A
# failing input is written to the package's testdata/fuzz/<Target>/ and runs
# from then on as part of plain `go test`: fix the bug and commit the input.
# The inputs that widened coverage stay in Go's cache (go env GOCACHE, under
# fuzz/), so each run starts where the last one on this machine stopped.
set -uo pipefail
export PATH=/usr/local/go/bin:$PATH
cd "$(dirname "$0")/.."

FUZZTIME=${FUZZTIME:-3s}
# Minimizing each new interesting input (60s by default) would take most
# of a short run; a failing input is written whether or not it was minimized.
FUZZMINIMIZETIME=${FUZZMINIMIZETIME:-1s}

# The file-system targets build a small tree per input; on tmpfs they run
# about ten times faster than on a disk. The go command's own binaries stay
# in the default place.
if [ -z "${TMPDIR:-}" ] && [ -d /dev/shm ] && [ -w /dev/shm ]; then
	tmp=$(mktemp -d /dev/shm/dsec-fuzz.XXXXXX)
	trap 'rm -rf "$tmp"' EXIT
	export GOTMPDIR=${GOTMPDIR:-/tmp} TMPDIR=$tmp
fi

# "./pkg FuzzName" per target, found in the sources so none is forgotten.
mapfile -t targets < <(grep -rEo --include='*_test.go' '^func Fuzz[A-Za-z0-9_]*\(f \*testing\.F\)' internal api cmd sdk 2>/dev/null |
	sed -E 's|^(.*)/[^/]*_test\.go:func (Fuzz[A-Za-z0-9_]*)\(.*|./\1 \2|' | sort -u)
if [ $# -gt 0 ]; then
	picked=()
	for t in "${targets[@]}"; do
		for want in "$@"; do
			[ "${t#* }" = "$want" ] && picked+=("$t")
		done
	done
	targets=("${picked[@]}")
fi
if [ ${#targets[@]} -eq 0 ]; then
	echo "fuzz: no fuzz targets found${*:+ named $*}" >&2
	exit 1
fi

# fuzz runs one target. -timeout=0: -fuzztime bounds the run, and the
# fuzzer reports an input that hangs when it stops; go test's 10m default
# would cut a long run short.
fuzz() {
	go test -run='^$' -fuzz="^$2\$" -fuzztime="$FUZZTIME" -fuzzminimizetime="$FUZZMINIMIZETIME" -timeout=0 "$1" 2>&1
}

# deadlineRace reports whether a failed run is Go's own -fuzztime deadline
# reported as a failure (go.dev/issue/75804, fixed in Go 1.27): "context
# deadline exceeded" with no failing input written, no panic and no
# message from the target.
deadlineRace() {
	grep -q 'context deadline exceeded' <<<"$1" &&
		! grep -qE 'Failing input written|panic:|\.go:[0-9]+:' <<<"$1"
}

failed=()
for t in "${targets[@]}"; do
	pkg=${t% *} name=${t#* } note=
	start=$SECONDS
	out=$(fuzz "$pkg" "$name")
	rc=$?
	if [ $rc -ne 0 ] && deadlineRace "$out"; then
		note="  (run again after go.dev/issue/75804)"
		out=$(fuzz "$pkg" "$name")
		rc=$?
		if [ $rc -ne 0 ] && deadlineRace "$out"; then
			rc=0 note="  (stopped twice by go.dev/issue/75804, nothing found)"
		fi
	fi
	execs=$(printf '%s\n' "$out" | sed -nE 's/.*execs: ([0-9]+).*/\1/p' | tail -n 1)
	if [ $rc -eq 0 ]; then
		printf 'ok    %-20s %-22s %9s execs  %3ds%s\n' "$name" "$pkg" "${execs:-?}" $((SECONDS - start)) "$note"
	else
		printf 'FAIL  %-20s %-22s %9s execs  %3ds\n' "$name" "$pkg" "${execs:-?}" $((SECONDS - start))
		printf '%s\n' "$out" | sed 's/^/      /'
		failed+=("$name")
	fi
done
if [ ${#failed[@]} -gt 0 ]; then
	echo "fuzz: ${#failed[@]} of ${#targets[@]} targets failed: ${failed[*]}" >&2
	exit 1
fi

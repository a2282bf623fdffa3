#!/usr/bin/env bash
# The demo behind `make run`: starts `dsec up` (unless one already answers),
# builds a small base/workspace/toolkit layer set from the host's busybox and
# bash, bootstraps a Debian base (python3, git) once, and walks through a
# sandbox's life on it with the CLI, saying what it does. Without network to
# the Debian mirror it falls back to the busybox base.
set -euo pipefail
DSEC=${DSEC:-bin/dsec}
STATE_DIR=${STATE_DIR:-/var/lib/dsec}
LISTEN=${LISTEN:-127.0.0.1:7070}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
DEBIAN_REF=base/debian:12
DSEC=$(cd "$(dirname "$DSEC")" && pwd)/$(basename "$DSEC")
export DSEC_ENDPOINT="http://$LISTEN"

step() { printf '\n\033[1m==> %s\033[0m\n' "$*"; }
run() { printf '$ %s\n' "$*"; "$@"; }

if [ "$(id -u)" != 0 ]; then
	echo "demo: dsec up needs root (it mounts layers and runs containers): sudo make run" >&2
	exit 1
fi

step "Starting dsec up on $LISTEN (state in $STATE_DIR)"
mkdir -p "$STATE_DIR"
if "$DSEC" health >/dev/null 2>&1; then
	echo "a dsec already answers on $LISTEN; using it"
else
	setsid "$DSEC" up --listen "$LISTEN" --state-dir "$STATE_DIR" >>"$STATE_DIR/dsec.log" 2>&1 </dev/null &
	echo "dsec up started (pid $!), log: $STATE_DIR/dsec.log"
	for _ in $(seq 1 100); do
		"$DSEC" health >/dev/null 2>&1 && break
		sleep 0.1
	done
	"$DSEC" health || { tail -20 "$STATE_DIR/dsec.log"; exit 1; }
fi
# The admin key is in ~/.config/dsec/config.json (written by dsec up);
# the CLI reads it from there.
unset DSEC_API_KEY

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Ctrl-C stops the demo (dsec itself cleans up what it was doing).
trap 'echo; echo "demo: interrupted" >&2; exit 130' INT

step "Assembling a base root filesystem from the host's busybox and bash"
base="$work/base"
mkdir -p "$base"/{bin,etc,root,tmp,proc,sys,dev,home/user}
cp "$(command -v busybox)" "$base/bin/busybox"
for app in $("$base/bin/busybox" --list); do
	[ "$app" = busybox ] || ln -sf busybox "$base/bin/$app"
done
bash_bin=$(readlink -f "$(command -v bash)")
for f in "$bash_bin" $(ldd "$bash_bin" | grep -o '/[^ ]*'); do
	mkdir -p "$base$(dirname "$f")"
	cp -L "$f" "$base$f"
done
[ -e "$base/bin/bash" ] || ln -s "$bash_bin" "$base/bin/bash"
printf 'root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/sh\n' >"$base/etc/passwd"
printf 'root:x:0:\nuser:x:1000:\n' >"$base/etc/group"
chmod 1777 "$base/tmp"
echo "$(du -sh "$base" | cut -f1) in $base"

step "A task workspace (a tiny repo with a bug) and a grader toolkit"
mkdir -p "$work/ws/repo" "$work/tk/opt/grader"
cat >"$work/ws/repo/add.sh" <<'SH'
#!/bin/sh
# add A B: prints A+B
echo $(( $1 - $2 ))
SH
chmod +x "$work/ws/repo/add.sh"
cat >"$work/tk/opt/grader/grade.sh" <<'SH'
#!/bin/sh
got=$(/repo/add.sh 2 3)
if [ "$got" = 5 ]; then echo "PASS: add 2 3 = $got"; else echo "FAIL: add 2 3 = $got, want 5"; exit 1; fi
SH
chmod +x "$work/tk/opt/grader/grade.sh"

step "Building three EROFS layers (content-addressed; rebuilding the same content is a no-op)"
run "$DSEC" layer build --kind base --name demo --tag v1 "$base" 2>/dev/null || run "$DSEC" layer get base/demo:v1
run "$DSEC" layer build --kind workspace --name demo-task --tag v1 "$work/ws" 2>/dev/null || run "$DSEC" layer get workspace/demo-task:v1
run "$DSEC" layer build --kind toolkit --name grader --tag v1 "$work/tk" 2>/dev/null || run "$DSEC" layer get toolkit/grader:v1

step "A real Debian base: $DEBIAN_REF, bookworm with python3 and git via debootstrap"
# Built once (about 40 MB from the mirror, a minute or two); the layer then
# lives in $STATE_DIR and later runs skip this.
if "$DSEC" layer get "$DEBIAN_REF" >/dev/null 2>&1; then
	echo "$DEBIAN_REF is in the catalog already (built by an earlier run); skipping the bootstrap"
	BASE=$DEBIAN_REF
elif run "$DSEC" image bootstrap --suite bookworm --ref "$DEBIAN_REF" --packages python3,git --mirror "$DEBIAN_MIRROR"; then
	BASE=$DEBIAN_REF
else
	echo "demo: could not bootstrap $DEBIAN_REF from $DEBIAN_MIRROR (no network?);" \
		"going on with the busybox base base/demo:v1 instead" >&2
	BASE=base/demo:v1
fi
run "$DSEC" layer list

step "Creating a sandbox: $BASE + workspace + toolkit, 256 MiB, 1 CPU, 64 pids, ttl 10 min"
SB=$(run "$DSEC" sandbox create --base "$BASE" --workspace workspace/demo-task:v1 \
	--toolkit toolkit/grader:v1 --memory-mb 256 --cpu 1 --pids 64 --ttl 600 --label demo=run | tail -1)
echo "sandbox: $SB"

if [ "$BASE" = "$DEBIAN_REF" ]; then
	step "Real Debian tools in the sandbox: bash, python3, apt, git"
	run "$DSEC" exec "$SB" -- bash -c 'echo "bash $BASH_VERSION on Debian $(cat /etc/debian_version)"'
	run "$DSEC" exec "$SB" -- python3 -c 'import json, platform, sqlite3; print(json.dumps({"python": platform.python_version(), "sqlite": sqlite3.sqlite_version}))'
	run "$DSEC" exec "$SB" --cmd 'apt-cache policy git | head -3'
	run "$DSEC" exec "$SB" -- git --version
	# The agent tracks its work with git: commit the task as given.
	run "$DSEC" exec "$SB" --cmd 'cd /repo && git init -q && git add -A && git -c user.name=agent -c user.email=agent@sandbox commit -qm "task as given" && git log --oneline'
fi

step "Running the grader: the task's bug makes it fail"
run "$DSEC" exec "$SB" -- /opt/grader/grade.sh || echo "(exit $?, as expected)"

step "An agent works in a persistent session: cd and variables survive between calls"
SID=$(run "$DSEC" session open "$SB" | tail -1)
run "$DSEC" session run "$SB" "$SID" 'cd /repo && export TASK=add && echo "in $(pwd) working on $TASK"'
run "$DSEC" session run "$SB" "$SID" 'grep -n "\$1" add.sh; echo "still in $(pwd), TASK=$TASK"'

step "It writes the fix through the files API and re-runs the grader"
printf '#!/bin/sh\n# add A B: prints A+B\necho $(( $1 + $2 ))\n' | run "$DSEC" files put --mode 0755 "$SB" /repo/add.sh -
run "$DSEC" session run "$SB" "$SID" '/opt/grader/grade.sh'
run "$DSEC" session close "$SB" "$SID"
if [ "$BASE" = "$DEBIAN_REF" ]; then
	run "$DSEC" exec "$SB" -- git -C /repo diff
fi

step "Files: list the repo, and the layers underneath stay untouched"
run "$DSEC" files ls "$SB" /repo

step "A timeout kills the command's whole process tree; output is capped"
run "$DSEC" exec --timeout 1 "$SB" --cmd 'sleep 100 & sleep 100; echo never' || echo "(exit $?: timed out)"
run "$DSEC" exec --max-output-bytes 64 "$SB" --cmd 'head -c 100000 /dev/zero | tr "\\0" x'; echo

step "Batch: 8 more sandboxes from the same layers, listed by label, then deleted by label"
run "$DSEC" sandbox create --base "$BASE" --workspace workspace/demo-task:v1 --count 8 --label demo=batch >/dev/null
run "$DSEC" sandbox list --label demo=batch
run "$DSEC" sandbox delete --label demo=batch

step "Preemption and branching: pause (memory reclaimed), transparent resume, snapshot, fork"
run "$DSEC" sandbox pause "$SB"
run "$DSEC" exec "$SB" -- /opt/grader/grade.sh    # resumes the sandbox first
SNAP="snapshot/demo-fixed:$(date +%s)"
run "$DSEC" sandbox snapshot "$SB" --ref "$SNAP" --exclude /root/.cache
FORK=$(run "$DSEC" sandbox fork "$SB" --count 2 --label demo=fork | tail -1)
echo "fork: $FORK"
run "$DSEC" exec "$FORK" -- /opt/grader/grade.sh  # the fork starts with the fix applied
run "$DSEC" sandbox delete --label demo=fork

step "The command log records what the agent did"
run "$DSEC" sandbox log "$SB" | tail -6

step "Cleaning up the demo sandbox"
run "$DSEC" sandbox delete "$SB"
run "$DSEC" layer delete "$SNAP" >/dev/null

cat <<TXT

dsec keeps running on $LISTEN (state: $STATE_DIR, log: $STATE_DIR/dsec.log).
Try:   $DSEC sandbox create --base $BASE   then   $DSEC exec ID -- bash -c 'echo hi'
Bench: $DSEC bench create --state-dir $STATE_DIR ; $DSEC bench exec --state-dir $STATE_DIR
Stop:  pkill -f 'dsec up'   (sandboxes keep running and are re-adopted on the next start)
TXT

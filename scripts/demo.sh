#!/usr/bin/env bash
# The demo behind `make run`: starts `dsec up` (unless one already answers),
# builds a small base/workspace/toolkit layer set from the host's busybox and
# bash, and walks through a sandbox's life with the CLI, saying what it does.
set -euo pipefail
DSEC=${DSEC:-bin/dsec}
STATE_DIR=${STATE_DIR:-/var/lib/dsec}
LISTEN=${LISTEN:-127.0.0.1:7070}
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
run "$DSEC" layer list

step "Creating a sandbox: base + workspace + toolkit, 256 MiB, 1 CPU, 64 pids, ttl 10 min"
SB=$(run "$DSEC" sandbox create --base base/demo:v1 --workspace workspace/demo-task:v1 \
	--toolkit toolkit/grader:v1 --memory-mb 256 --cpu 1 --pids 64 --ttl 600 --label demo=run | tail -1)
echo "sandbox: $SB"

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

step "Files: list the repo, and the layers underneath stay untouched"
run "$DSEC" files ls "$SB" /repo

step "A timeout kills the command's whole process tree; output is capped"
run "$DSEC" exec --timeout 1 "$SB" --cmd 'sleep 100 & sleep 100; echo never' || echo "(exit $?: timed out)"
run "$DSEC" exec --max-output-bytes 64 "$SB" --cmd 'head -c 100000 /dev/zero | tr "\\0" x'; echo

step "Batch: 8 more sandboxes from the same layers, listed by label, then deleted by label"
run "$DSEC" sandbox create --base base/demo:v1 --workspace workspace/demo-task:v1 --count 8 --label demo=batch >/dev/null
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
Try:   $DSEC sandbox create --base base/demo:v1   then   $DSEC exec ID -- bash -c 'echo hi'
Bench: $DSEC bench create --state-dir $STATE_DIR ; $DSEC bench exec --state-dir $STATE_DIR
Stop:  pkill -f 'dsec up'   (sandboxes keep running and are re-adopted on the next start)
TXT

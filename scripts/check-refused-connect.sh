#!/usr/bin/env bash
# A Connect the target refuses is named by its real reason in every tool: perf, identify and hello_world against
# our target (nvpoll-target, debug build) asking for a subsystem it does not have must fail and say "the target
# has no subsystem NQN" (the fio engine's own test checks the same for fio). Issue 45: they said "Attempted
# Write to Read Only Range", the NVM meaning of the Fabrics code 82h.
# usage: scripts/check-refused-connect.sh   (builds the binaries in the debug profile; uses 127.0.0.1:PORT)
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "check-refused-connect: $*" >&2; exit 1; }
PORT=${PORT:-4497}
# shellcheck source=scripts/debug-bins.sh
source scripts/debug-bins.sh
work=$(mktemp -d)
"$bin/nvpoll-target" --listen "127.0.0.1:$PORT" --nqn nqn.2016-06.io.spdk:cnode1 --ram 16M > "$work/target.log" 2>&1 &
tpid=$!
trap 'kill -TERM $tpid 2>/dev/null; wait $tpid 2>/dev/null; rm -rf "$work"' EXIT
for _ in $(seq 200); do (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null && break; sleep 0.05; done
kill -0 "$tpid" 2>/dev/null || { cat "$work/target.log"; die "the target did not start"; }
nqn=nqn.2016-06.io.spdk:nothere
want="Fabrics Connect (admin queue) refused: the target has no subsystem $nqn"
trid="trtype:tcp traddr:127.0.0.1 trsvcid:$PORT subnqn:$nqn"
bad=0
for tool in identify hello_world perf; do
    args=(--trid "$trid"); [ "$tool" = perf ] && args+=(--time 1s --warmup 0s --runs 1)
    rc=0; out=$(timeout 60 "$bin/nvpoll-${tool//_/-}" "${args[@]}" 2>&1) || rc=$?
    if [ "$rc" = 0 ]; then echo "check-refused-connect: $tool succeeded against a subsystem that does not exist"; bad=1
    elif ! grep -qF -- "$want" <<< "$out"; then
        echo "check-refused-connect: $tool (exit $rc) does not say '$want':"; printf '%s\n' "$out"; bad=1
    else
        echo "check-refused-connect: $tool: $(grep -F -- "$want" <<< "$out" | head -n 1)"
    fi
done
grep -q "Connect refused (queue 0 of $nqn .*no such subsystem" "$work/target.log" ||
    { cat "$work/target.log"; echo "check-refused-connect: the target's log does not say why it refused"; bad=1; }
[ "$bad" = 0 ] || exit 1
echo "check-refused-connect: perf, identify and hello_world name the refused Connect's reason"

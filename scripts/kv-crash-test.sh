#!/usr/bin/env bash
# scripts/kv-crash-test.sh - the example engine's crash consistency (kv/: a write-ahead log with group commit
# and a key-value store over it, through nvpoll's async interface), over NVMe/TCP with TLS to our target.
#
# usage: scripts/kv-crash-test.sh
#
# Starts our target (nvpoll-target) on 127.0.0.1 with a file namespace and TLS required, then ROUNDS times:
# `nvpoll-kv load` with 16 writers appends keys, each written to an "acked" file once the log acknowledged
# it; once the file has grown by at least MIN_ACKED keys in that round (a bounded wait on the file, not a
# fixed sleep) the engine is killed with SIGKILL mid-write; `nvpoll-kv verify` then reopens the log and must
# find every acknowledged key with its value, and no value that is not whole. A last round loads to its end
# and verifies. The target, its file and the work folder go away on any exit.
#
# Knobs: KV_ROUNDS=3  KV_MIN_ACKED=300  NVPOLL_BIN_DIR (built binaries; default: builds the debug profile)
#        KV_TRID: run against this controller instead (no target started, no TLS), e.g. in the VM guest
#        'trtype:pcie traddr:0000:00:04.0' (scripts/vm-tests/80-kv-engine-pcie.sh); its first namespace's log
#        is recovered and appended to, never erased
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
PROG=kv-crash-test
die() { echo "$PROG: error: $*" >&2; exit 2; }
say() { echo "$PROG: $*"; }
ROUNDS=${KV_ROUNDS:-3}
MIN_ACKED=${KV_MIN_ACKED:-300}
[[ "$ROUNDS" =~ ^[0-9]+$ ]] || die "KV_ROUNDS must be a number"
[[ "$MIN_ACKED" =~ ^[0-9]+$ ]] || die "KV_MIN_ACKED must be a number"
command -v ss >/dev/null 2>&1 || PATH=$PATH:/usr/sbin:/sbin
command -v ss >/dev/null 2>&1 || die "'ss' not found: apt-get install iproute2"

if [ -n "${NVPOLL_BIN_DIR:-}" ]; then
    bin=$NVPOLL_BIN_DIR
else
    cd "$ROOT"
    # shellcheck source=scripts/debug-bins.sh
    . "$ROOT/scripts/debug-bins.sh"
fi
for b in nvpoll-target nvpoll-kv; do [ -x "$bin/$b" ] || die "no $b in $bin"; done

WORK=$(mktemp -d /tmp/nvpoll-kv-crash.XXXXXX)
TARGET_PID='' LOAD_PID=''
cleanup() {
    [ -z "$LOAD_PID" ] || kill -9 "$LOAD_PID" 2>/dev/null || true
    [ -z "$TARGET_PID" ] || kill "$TARGET_PID" 2>/dev/null || true
    [ -z "$TARGET_PID" ] || wait "$TARGET_PID" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

# Test vector of the NVMe TLS PSK interchange format (shared/notes/tls-psk.md); a test-only key.
KEY='NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:'
HOSTNQN=nqn.2024-01.io.nvpoll:kv-host
NQN=nqn.2024-01.io.nvpoll:kv
if [ -n "${KV_TRID:-}" ]; then
    TRID=$KV_TRID
    CONN=(--trid "$TRID")
    say "against $TRID"
else
truncate -s 64M "$WORK/ns.img"
# A free port: the kernel picks one for a listener we close at once.
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$bin/nvpoll-target" --listen "127.0.0.1:$PORT" --nqn "$NQN" --file "$WORK/ns.img" --cores 0 \
    --psk "$HOSTNQN=$KEY" --tls required > "$WORK/target.log" 2>&1 &
TARGET_PID=$!
for _ in $(seq 200); do
    [ -n "$(ss -Hltn "sport = :$PORT")" ] && break
    kill -0 "$TARGET_PID" 2>/dev/null || { cat "$WORK/target.log" >&2; die "the target exited"; }
    sleep 0.05
done
[ -n "$(ss -Hltn "sport = :$PORT")" ] || die "the target did not listen on port $PORT"
TRID="trtype:tcp traddr:127.0.0.1 trsvcid:$PORT subnqn:$NQN"
CONN=(--trid "$TRID" --hostnqn "$HOSTNQN" --psk "$KEY")
fi
kv() { "$bin/nvpoll-kv" "$1" "${CONN[@]}" "${@:2}"; }

ACKED=$WORK/acked
: > "$ACKED"
ROWS=()
for r in $(seq "$ROUNDS"); do
    before=$(wc -l < "$ACKED")
    # The binary itself in the background (not through kv(): $! would be a subshell, and SIGKILL would leave
    # the engine running).
    "$bin/nvpoll-kv" load "${CONN[@]}" --writers 16 --puts 1000000 --run "r$r-$$" --acked "$ACKED" \
        > "$WORK/load-$r.log" 2>&1 &
    LOAD_PID=$!
    # Wait for MIN_ACKED more acknowledged keys (at most 60 s), then kill the engine mid-write.
    for _ in $(seq 1200); do
        [ $(($(wc -l < "$ACKED") - before)) -ge "$MIN_ACKED" ] && break
        kill -0 "$LOAD_PID" 2>/dev/null || break
        sleep 0.05
    done
    kill -0 "$LOAD_PID" 2>/dev/null || { cat "$WORK/load-$r.log" >&2; die "round $r: the engine exited before it was killed"; }
    kill -9 "$LOAD_PID"
    wait "$LOAD_PID" 2>/dev/null || true
    LOAD_PID=''
    got=$(($(wc -l < "$ACKED") - before))
    [ "$got" -ge "$MIN_ACKED" ] || die "round $r: only $got keys acknowledged in 60 s"
    if ! out=$(kv verify --acked "$ACKED" 2>&1); then
        echo "$out" >&2
        die "round $r: verify after kill -9 failed"
    fi
    say "round $r: killed after $got more acknowledged keys; $(echo "$out" | grep -m1 '^verify:')"
    ROWS+=("| $r (kill -9) | $got | $(echo "$out" | grep -m1 'recovered' | sed 's/^nvpoll-kv: //') | ok |")
done
out=$(kv load --writers 16 --puts 50 --run "final-$$" --acked "$ACKED" 2>&1) || { echo "$out" >&2; die "the last load failed"; }
say "last round: $(echo "$out" | grep -m1 '^load:')"
out=$(kv verify --acked "$ACKED" 2>&1) || { echo "$out" >&2; die "the last verify failed"; }
say "$(echo "$out" | grep -m1 '^verify:')"
echo
echo "| round | keys acknowledged in the round | what the reopened log held | verify |"
echo "|---|---|---|---|"
printf '%s\n' "${ROWS[@]}"
say "passed: $ROUNDS kills mid-write, nothing acknowledged lost, nothing torn returned"

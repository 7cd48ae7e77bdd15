#!/usr/bin/env bash
# scripts/bench-kv-guest.sh - the example engine (kv/) on two paths to the same target, in the guest of
# scripts/vm.sh: through nvpoll's NVMe/TCP initiator and async interface, and on the kernel's NVMe/TCP block
# device (O_DIRECT, `--trid file:/dev/nvmeXn1`: pwrite and fdatasync per commit). Our target serves one RAM
# namespace; for 1, 4, 16 and 64 writers each path loads PUTS keys (64-byte values), the two paths alternating
# in every round, the log emptied before each run. Prints puts/s, commits/s and put latency per cell, and the
# ratio ours/kernel of puts/s per round.
#
# The guest runs under TCG on this machine (no KVM): its figures are emulation-bound, read the ratios.
# Plain TCP on both paths (the kernel's TLS needs tlshd).
#
# Knobs: WRITERS="1 4 16 64", PUTS=1000 (per run, shared by the writers), ROUNDS=2, NVPOLL_VM_* (scripts/vm.sh).
set -euo pipefail
PROG=bench-kv-guest
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
die() { echo "$PROG: error: $*" >&2; exit 2; }
say() { echo "$PROG: $*" >&2; }
WRITERS=${WRITERS:-1 4 16 64}
PUTS=${PUTS:-1000}
ROUNDS=${ROUNDS:-2}
for w in $WRITERS; do [[ "$w" =~ ^[1-9][0-9]*$ ]] || die "WRITERS: '$w' is not a positive number"; done
[[ "$PUTS" =~ ^[1-9][0-9]*$ ]] || die "PUTS=$PUTS is not a positive number"
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || die "ROUNDS=$ROUNDS is not a positive number"
PORT=4481
NQN=nqn.2016-06.io.nvpoll:guest-kv

if [ "${1:-}" != --in-guest ]; then
    say "building the target and the engine (release)"
    (cd "$ROOT" && cargo build -q --release --bin nvpoll-target --bin nvpoll-kv) || die "the build failed"
    meta=$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps)
    [[ "$meta" =~ \"target_directory\":\"([^\"]+)\" ]] || die "no target_directory in cargo metadata"
    BIN=${BASH_REMATCH[1]}/release
    NVPOLL_BIN_DIR=$BIN exec "$ROOT/scripts/vm.sh" -- env WRITERS="$WRITERS" PUTS="$PUTS" ROUNDS="$ROUNDS" \
        NVPOLL_BIN_DIR="$BIN" bash "$ROOT/scripts/bench-kv-guest.sh" --in-guest
fi

# ---- in the guest
BIN=${NVPOLL_BIN_DIR:?}
command -v nvme >/dev/null || die "nvme-cli is missing in the guest"
modprobe nvme-tcp 2>/dev/null || true
TPID=
cleanup() {
    nvme disconnect -n "$NQN" >/dev/null 2>&1 || true
    [ -z "$TPID" ] || kill "$TPID" 2>/dev/null || true
}
trap cleanup EXIT
"$BIN/nvpoll-target" --listen "127.0.0.1:$PORT" --nqn "$NQN" --ram 256M --cores 1 > /tmp/$PROG-target.log 2>&1 &
TPID=$!
for _ in $(seq 200); do
    [ -n "$(ss -Hltn "sport = :$PORT")" ] && break
    kill -0 "$TPID" 2>/dev/null || { cat /tmp/$PROG-target.log >&2; die "the target exited"; }
    sleep 0.1
done
nvme connect -t tcp -a 127.0.0.1 -s "$PORT" -n "$NQN" -i 1 >/dev/null || die "nvme connect failed"
DEV=
for _ in $(seq 100); do
    for c in /sys/class/nvme/nvme*; do
        [ "$(cat "$c/subsysnqn" 2>/dev/null)" = "$NQN" ] || continue
        for n in "$c"/nvme*n1 /sys/block/"$(basename "$c")"n1; do [ -e "$n" ] && DEV=/dev/$(basename "$n"); done
    done
    [ -n "$DEV" ] && [ -b "$DEV" ] && break
    DEV=; sleep 0.1
done
[ -n "$DEV" ] || die "no block device for $NQN"
say "kernel path: $DEV; ours: trtype:tcp to 127.0.0.1:$PORT"
OURS="trtype:tcp traddr:127.0.0.1 trsvcid:$PORT subnqn:$NQN"
declare -A CELL
run() {   # PATHNAME WRITERS ROUND
    local trid=$OURS
    [ "$1" = kernel ] && trid="file:$DEV"
    # An empty log: zero its first record through the kernel path (both paths reach the same namespace).
    dd if=/dev/zero of="$DEV" bs=4096 count=1 oflag=direct status=none
    local out
    out=$(taskset -c 0 "$BIN/nvpoll-kv" load --trid "$trid" --writers "$2" --puts $(( (PUTS + $2 - 1) / $2 )) \
        --run "$1-$2-$3" 2>/dev/null) || die "$1, $2 writers: the load failed"
    [[ "$out" =~ ([0-9]+)\ puts/s,\ ([0-9]+)\ commits/s\;\ put\ latency\ p50\ ([0-9.]+)\ us,\ p99\ ([0-9.]+)\ us ]] ||
        die "cannot parse: $out"
    CELL[$1,$2,$3]="${BASH_REMATCH[1]} ${BASH_REMATCH[2]} ${BASH_REMATCH[3]} ${BASH_REMATCH[4]}"
    say "round $3, $2 writers, $1: $out"
}
for r in $(seq "$ROUNDS"); do
    for w in $WRITERS; do
        if [ $((r % 2)) = 1 ]; then run ours "$w" "$r"; run kernel "$w" "$r"
        else run kernel "$w" "$r"; run ours "$w" "$r"; fi
    done
done
echo
echo "| writers | ours puts/s | ours commits/s | ours p50/p99 us | kernel puts/s | kernel commits/s | kernel p50/p99 us | ours/kernel puts/s per round |"
echo "|---|---|---|---|---|---|---|---|"
for w in $WRITERS; do
    ratios='' last_o='' last_k=''
    for r in $(seq "$ROUNDS"); do
        read -r op oc o50 o99 <<< "${CELL[ours,$w,$r]}"
        read -r kp kc k50 k99 <<< "${CELL[kernel,$w,$r]}"
        ratios="$ratios $(awk -v a="$op" -v b="$kp" 'BEGIN { printf "%.2f", a / b }')"
        last_o="$op | $oc | $o50/$o99" last_k="$kp | $kc | $k50/$k99"
    done
    echo "| $w | $last_o | $last_k |$ratios |"
done
echo "($PROG: the last round's figures; TCG guest, ratios only)"

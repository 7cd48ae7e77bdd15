#!/usr/bin/env bash
# scripts/bench-connections-guest.sh - the Linux host's view of idle connections (issue 46), in the guest of
# scripts/vm.sh: the kernel's nvme-tcp connects to a target with 1 + N I/O queues, N of them idle, and fio
# (one job, qd1, 4 KiB random reads, io_uring on the block device) measures the one that is used, against our
# target and against the kernel's nvmet in the same guest, rounds interleaved; ratios to N = 0 per target.
#
# Why poll queues: `nvme connect -i N` asks for N I/O queues, but the kernel caps it at the guest's CPU count
# (2 here), so N idle queues are made with `-i 1 -P N` (--nr-poll-queues): poll queues serve only HIPRI I/O,
# which fio does not send, so they stay connected and idle, as a 128-CPU host's unused per-CPU queues do.
# nvmet grants at most 128 I/O queues per controller (attr_qid_max), so N stays below that for it.
#
# The guest runs under TCG on this machine (no KVM): its IOPS are emulation-bound, for the ratios only.
#
# Knobs: COUNTS="0 32 127", ROUNDS=2, RUNTIME=5 (seconds per fio run), NVPOLL_VM_* (scripts/vm.sh).
set -euo pipefail
PROG=bench-connections-guest
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
die() { echo "$PROG: error: $*" >&2; exit 2; }
say() { echo "$PROG: $*" >&2; }

COUNTS=${COUNTS:-0 32 127}
ROUNDS=${ROUNDS:-2}
RUNTIME=${RUNTIME:-5}
PORT=4480
NQN=nqn.2016-06.io.nvpoll:guest-connections
for n in $COUNTS; do
    [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -le 127 ] || die "COUNTS: '$n' is not a number from 0 to 127 (nvmet's limit)"
done
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || die "ROUNDS=$ROUNDS is not a positive number"
[[ "$RUNTIME" =~ ^[1-9][0-9]*$ ]] || die "RUNTIME=$RUNTIME is not a positive number of seconds"

if [ "${1:-}" != --in-guest ]; then
    say "building the target (release)"
    (cd "$ROOT" && cargo build -q --release --example target) || die "the build failed"
    meta=$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps)
    [[ "$meta" =~ \"target_directory\":\"([^\"]+)\" ]] || die "no target_directory in cargo metadata"
    BIN=${BASH_REMATCH[1]}/release/examples
    NVPOLL_EXAMPLES_DIR=$BIN exec "$ROOT/scripts/vm.sh" -- env COUNTS="$COUNTS" ROUNDS="$ROUNDS" \
        RUNTIME="$RUNTIME" NVPOLL_EXAMPLES_DIR="$BIN" bash "$ROOT/scripts/bench-connections-guest.sh" --in-guest
fi

# ---- in the guest
BIN=${NVPOLL_EXAMPLES_DIR:?}
[ -n "${VM_NVMET_NQN:-}" ] || die "no nvmet target in the guest (NVPOLL_VM_NVMET=0?)"
command -v nvme >/dev/null || die "nvme-cli is missing in the guest"
command -v fio >/dev/null || die "fio is missing (install it on the host: the guest runs on the host's root fs)"
modprobe nvme-tcp 2>/dev/null || true
WORK=$(mktemp -d /tmp/$PROG.XXXXXX)
TPID=
cleanup() {
    nvme disconnect -n "$NQN" >/dev/null 2>&1 || true
    nvme disconnect -n "$VM_NVMET_NQN" >/dev/null 2>&1 || true
    [ -z "$TPID" ] || { kill -INT "$TPID" 2>/dev/null; wait "$TPID" 2>/dev/null || true; }
    rm -rf "$WORK"
}
trap cleanup EXIT
"$BIN/target" --listen "127.0.0.1:$PORT" --nqn "$NQN" --ram 256M --cores 1 --idle poll --io-queues 1024 \
    > "$WORK/target.log" 2>&1 &
TPID=$!
for _ in $(seq 300); do grep -q "listening on" "$WORK/target.log" && break; kill -0 "$TPID" 2>/dev/null || break; sleep 0.1; done
grep -q "listening on" "$WORK/target.log" || { cat "$WORK/target.log" >&2; die "our target did not start"; }

one() {   # who(ours|nvmet) N -> "IOPS queues" or "fail"
    local who=$1 n=$2 nqn port args=() c= dev= q
    if [ "$who" = ours ]; then nqn=$NQN port=$PORT; else nqn=$VM_NVMET_NQN port=$VM_NVMET_PORT; fi
    args=(-t tcp -a 127.0.0.1 -s "$port" -n "$nqn" --hostnqn "$VM_HOSTNQN" --hostid "$VM_HOSTID" -i 1)
    [ "$n" = 0 ] || args+=(-P "$n")
    nvme connect "${args[@]}" > "$WORK/connect.txt" 2>&1 || { say "nvme connect ($who, $n): $(cat "$WORK/connect.txt")"; echo fail; return; }
    for _ in $(seq 600); do
        for x in /sys/class/nvme/nvme*; do
            [ "$(cat "$x/subsysnqn" 2>/dev/null)" = "$nqn" ] && [ "$(cat "$x/state" 2>/dev/null)" = live ] && c=${x##*/}
        done
        if [ -n "$c" ]; then
            for b in /sys/class/nvme/"$c"/nvme*n1 /sys/class/nvme-subsystem/*/nvme*n1; do
                [ -e "$b" ] && [ "$(cat "${b%/*}/subsysnqn" 2>/dev/null)" = "$nqn" ] && [ -b "/dev/${b##*/}" ] && dev=/dev/${b##*/}
            done
        fi
        [ -n "$dev" ] && break
        sleep 0.05
    done
    if [ -z "$dev" ]; then say "no block device ($who, $n)"; nvme disconnect -n "$nqn" >/dev/null 2>&1; echo fail; return; fi
    # The admin queue and the I/O queues the controller has (fewer if the target granted fewer).
    q=$(cat "/sys/class/nvme/$c/queue_count" 2>/dev/null || echo '?')
    local out
    out=$(fio --name=one --filename="$dev" --rw=randread --bs=4k --iodepth=1 --ioengine=io_uring --direct=1 \
        --time_based --runtime="$RUNTIME" --ramp_time=1 --cpus_allowed=0 --output-format=json 2>/dev/null) || out=
    nvme disconnect -n "$nqn" >/dev/null 2>&1 || true
    local iops
    iops=$(python3 -c 'import json,sys; t=sys.stdin.read(); print(int(json.loads(t[t.index("{"):])["jobs"][0]["read"]["iops"]))' <<< "$out" 2>/dev/null) || iops=
    if [ -n "$iops" ]; then echo "$iops $q"; else echo fail; fi
}

RES=$WORK/results.txt
for round in $(seq "$ROUNDS"); do
    for n in $COUNTS; do
        for who in ours nvmet; do
            v=$(one "$who" "$n")
            echo "$round $who $n $v" >> "$RES"
            say "round $round: $who, $n idle poll queues: $v"
        done
    done
done
python3 - "$RES" <<'EOF'
import sys, statistics
cells = {}
for line in open(sys.argv[1]):
    f = line.split()
    r, who, n = int(f[0]), f[1], int(f[2])
    cells.setdefault((who, n), {})[r] = (int(f[3]), f[4]) if f[3] != "fail" else None
counts = sorted({n for _, n in cells})
print("| target | idle poll queues | queues (sysfs queue_count) | IOPS (median) | vs N = 0 (median, spread) |")
print("|---|---|---|---|---|")
for who in ("ours", "nvmet"):
    for n in counts:
        c = cells.get((who, n), {})
        base = cells.get((who, counts[0]), {})
        vals = [v[0] for v in c.values() if v]
        qs = sorted({v[1] for v in c.values() if v})
        ratios = [c[r][0] / base[r][0] for r in c if c[r] and base.get(r)]
        med = f"{statistics.median(vals):.0f}" if vals else "fail"
        rat = "1.00" if n == counts[0] else (f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-")
        print(f"| {who} | {n} | {','.join(qs)} | {med} | {rat} |")
EOF

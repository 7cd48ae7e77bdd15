#!/usr/bin/env bash
# scripts/bench-connections-guest.sh - the Linux host's view of idle connections (issue 46), in the guest of
# scripts/vm.sh: the kernel's nvme-tcp host holds N idle I/O queues on a target and fio (one job, qd1, 4 KiB
# random reads, io_uring on the block device) measures one more queue beside them, against our target and
# against the kernel's nvmet in the same guest, rounds interleaved; ratios to N = 0 per target.
#
# How the idle queues are made: `nvme connect -i N` asks for N I/O queues, but the kernel caps it (and -P, -W)
# at the guest's CPU count (2 here; seen: queue_count 4 with -i 1 -P 127). So the idle queues are N/2
# controllers of a second subsystem on the same target and port (2 I/O queues each, written to
# /dev/nvme-fabrics with a host NQN of its own: what a target serving many quiet hosts carries), and the measured controller
# (`-i 1`) is of the first subsystem.
#
# The guest runs under TCG on this machine (no KVM): its IOPS are emulation-bound, for the ratios only.
#
# Knobs: COUNTS="0 32 127", ROUNDS=2, RUNTIME=5 (seconds per fio run), NVPOLL_VM_* (scripts/vm.sh).
set -euo pipefail
PROG=bench-connections-guest
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
die() { echo "$PROG: error: $*" >&2; exit 2; }
say() { echo "$PROG: $*" >&2; }

COUNTS=${COUNTS:-0 16 64}
ROUNDS=${ROUNDS:-2}
RUNTIME=${RUNTIME:-5}
PORT=4480
NQN=nqn.2016-06.io.nvpoll:guest-connections
IDLE_NQN=nqn.2016-06.io.nvpoll:guest-idle
for n in $COUNTS; do
    [[ "$n" =~ ^[0-9]+$ ]] && [ $((n % 2)) = 0 ] || die "COUNTS: '$n' is not an even number (2 I/O queues per idle controller)"
done
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || die "ROUNDS=$ROUNDS is not a positive number"
[[ "$RUNTIME" =~ ^[1-9][0-9]*$ ]] || die "RUNTIME=$RUNTIME is not a positive number of seconds"

if [ "${1:-}" != --in-guest ]; then
    say "building the target (release)"
    (cd "$ROOT" && cargo build -q --release --bin nvpoll-target) || die "the build failed"
    meta=$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps)
    [[ "$meta" =~ \"target_directory\":\"([^\"]+)\" ]] || die "no target_directory in cargo metadata"
    BIN=${BASH_REMATCH[1]}/release
    NVPOLL_BIN_DIR=$BIN exec "$ROOT/scripts/vm.sh" -- env COUNTS="$COUNTS" ROUNDS="$ROUNDS" \
        RUNTIME="$RUNTIME" NVPOLL_BIN_DIR="$BIN" bash "$ROOT/scripts/bench-connections-guest.sh" --in-guest
fi

# ---- in the guest
BIN=${NVPOLL_BIN_DIR:?}
[ -n "${VM_NVMET_NQN:-}" ] || die "no nvmet target in the guest (NVPOLL_VM_NVMET=0?)"
command -v nvme >/dev/null || die "nvme-cli is missing in the guest"
command -v fio >/dev/null || die "fio is missing (install it on the host: the guest runs on the host's root fs)"
modprobe nvme-tcp 2>/dev/null || true
WORK=$(mktemp -d /tmp/$PROG.XXXXXX)
TPID=
CFG=/sys/kernel/config/nvmet
ISUB=$CFG/subsystems/$IDLE_NQN
cleanup() {
    nvme disconnect -n "$NQN" >/dev/null 2>&1 || true
    nvme disconnect -n "$VM_NVMET_NQN" >/dev/null 2>&1 || true
    nvme disconnect -n "$IDLE_NQN" >/dev/null 2>&1 || true
    rm -f "$CFG/ports/1/subsystems/$IDLE_NQN" 2>/dev/null
    rmdir "$ISUB/namespaces/1" "$ISUB" 2>/dev/null
    rm -f /run/nvmet/idle.img
    [ -z "$TPID" ] || { kill -INT "$TPID" 2>/dev/null; wait "$TPID" 2>/dev/null || true; }
    rm -rf "$WORK"
    true
}
trap cleanup EXIT
# nvmet: the second subsystem on the port scripts/vm.sh made (port 1, VM_NVMET_PORT).
mkdir -p /run/nvmet && truncate -s 16M /run/nvmet/idle.img
mkdir "$ISUB" && echo 1 > "$ISUB/attr_allow_any_host" && mkdir "$ISUB/namespaces/1" &&
    echo /run/nvmet/idle.img > "$ISUB/namespaces/1/device_path" && echo 1 > "$ISUB/namespaces/1/buffered_io" &&
    echo 1 > "$ISUB/namespaces/1/enable" && ln -s "$ISUB" "$CFG/ports/1/subsystems/" || die "nvmet's second subsystem"
cat > "$WORK/target.json" <<JSON
{"listeners": [{"address": "127.0.0.1:$PORT"}],
 "subsystems": [{"nqn": "$NQN", "allow_any_host": true, "namespaces": [{"ram": "256M"}]},
                {"nqn": "$IDLE_NQN", "allow_any_host": true, "namespaces": [{"ram": "16M"}]}]}
JSON
"$BIN/nvpoll-target" --config "$WORK/target.json" --cores 1 --idle poll > "$WORK/target.log" 2>&1 &
TPID=$!
for _ in $(seq 300); do grep -q "listening on" "$WORK/target.log" && break; kill -0 "$TPID" 2>/dev/null || break; sleep 0.1; done
grep -q "listening on" "$WORK/target.log" || { cat "$WORK/target.log" >&2; die "our target did not start"; }

one() {   # who(ours|nvmet) N -> "IOPS queues" or "fail"
    local who=$1 n=$2 nqn port args=() c= dev= q
    if [ "$who" = ours ]; then nqn=$NQN port=$PORT; else nqn=$VM_NVMET_NQN port=$VM_NVMET_PORT; fi
    local k
    for k in $(seq $((n / 2))); do
        # A host of its own for each (the kernel refuses a second controller of one host to one subsystem
        # on one port as "already connected", -D notwithstanding, and a host ID with two NQNs).
        local id
        id=$(cat /proc/sys/kernel/random/uuid)
        # Straight to the kernel: this nvme-cli (2.3) calls a second controller to the same address and
        # subsystem "already connected" whatever the host NQN (and -D).
        echo "transport=tcp,traddr=127.0.0.1,trsvcid=$port,nqn=$IDLE_NQN,hostnqn=nqn.2014-08.org.nvmexpress:uuid:$id,hostid=$id,nr_io_queues=2" \
            2> "$WORK/connect.txt" > /dev/nvme-fabrics || { say "idle controller $k ($who): $(cat "$WORK/connect.txt")"; break; }
    done
    # The idle I/O queues actually held: every live controller of the idle subsystem, less its admin queue.
    local idle=0
    for x in /sys/class/nvme/nvme*; do
        [ "$(cat "$x/subsysnqn" 2>/dev/null)" = "$IDLE_NQN" ] && idle=$((idle + $(cat "$x/queue_count") - 1))
    done
    args=(-t tcp -a 127.0.0.1 -s "$port" -n "$nqn" --hostnqn "$VM_HOSTNQN" --hostid "$VM_HOSTID" -i 1)
    nvme connect "${args[@]}" > "$WORK/connect.txt" 2>&1 || { say "nvme connect ($who, $n): $(cat "$WORK/connect.txt")"; nvme disconnect -n "$IDLE_NQN" >/dev/null 2>&1; echo fail; return; }
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
    if [ -z "$dev" ]; then say "no block device ($who, $n)"; nvme disconnect -n "$nqn" >/dev/null 2>&1; nvme disconnect -n "$IDLE_NQN" >/dev/null 2>&1; echo fail; return; fi
    q=$idle
    local out
    out=$(fio --name=one --filename="$dev" --rw=randread --bs=4k --iodepth=1 --ioengine=io_uring --direct=1 \
        --time_based --runtime="$RUNTIME" --ramp_time=1 --cpus_allowed=0 --output-format=json 2>/dev/null) || out=
    nvme disconnect -n "$nqn" >/dev/null 2>&1 || true
    nvme disconnect -n "$IDLE_NQN" >/dev/null 2>&1 || true
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
            say "round $round: $who, $n idle I/O queues asked: $v (IOPS, idle queues held)"
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
print("| target | idle I/O queues asked | held | IOPS (median) | vs N = 0 (median, spread) |")
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

#!/usr/bin/env bash
# scripts/bench-idle-queues.sh - what idle queue pairs cost the INITIATOR's reactor (issue 46): our perf measures
# one queue at qd1 and eight at qd32 (4 KiB random reads) on one reactor that also carries N connected idle
# queue pairs (perf --idle-queues N), with the reactor parking idle pollers (the default) and without
# (--no-parking: every queue pair read on every iteration, as before), rounds interleaved, against one nvpoll-target
# on another core (the same target for every cell; its ready group reads only ready sessions).
# tools/benches/connections.rs measures the target's side.
#
# Prints per cell the median IOPS and, per mode, the median of the per-round ratios to N = 0 with their spread.
#
# Knobs: COUNTS="0 64 256 1024", ROUNDS=3, TIME=3 (seconds per run), ICORE=0, TCORE=1, PORT=4490.
set -euo pipefail
PROG=bench-idle-queues
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
die() { echo "$PROG: error: $*" >&2; exit 2; }
say() { echo "$PROG: $*" >&2; }

COUNTS=${COUNTS:-0 64 256 1024}
ROUNDS=${ROUNDS:-3}
TIME=${TIME:-3}
ICORE=${ICORE:-0}
TCORE=${TCORE:-1}
PORT=${PORT:-4490}
NQN=nqn.2016-06.io.nvpoll:idle-queues
for n in $COUNTS; do [[ "$n" =~ ^[0-9]+$ ]] || die "COUNTS: '$n' is not a number"; done
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || die "ROUNDS=$ROUNDS is not a positive number"
[[ "$TIME" =~ ^[1-9][0-9]*$ ]] || die "TIME=$TIME is not a positive number of seconds"
command -v python3 >/dev/null 2>&1 || die "python3 is needed for the table"

say "building perf and the target (release)"
(cd "$ROOT" && cargo build -q --release --bin nvpoll-perf --bin nvpoll-target) || die "the build failed"
meta=$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps)
[[ "$meta" =~ \"target_directory\":\"([^\"]+)\" ]] || die "no target_directory in cargo metadata"
BIN=${BASH_REMATCH[1]}/release

WORK=$(mktemp -d "${TMPDIR:-/tmp}/$PROG.XXXXXX")
TPID=
cleanup() {
    [ -z "$TPID" ] || { kill -INT "$TPID" 2>/dev/null; wait "$TPID" 2>/dev/null || true; }
    rm -rf "$WORK"
}
trap cleanup EXIT

"$BIN/nvpoll-target" --listen "127.0.0.1:$PORT" --nqn "$NQN" --ram 512M --cores "$TCORE" --idle poll \
    --io-queues 1024 > "$WORK/target.log" 2>&1 &
TPID=$!
for _ in $(seq 200); do grep -q "listening on" "$WORK/target.log" && break; kill -0 "$TPID" 2>/dev/null || break; sleep 0.05; done
grep -q "listening on" "$WORK/target.log" || { cat "$WORK/target.log" >&2; die "the target did not start"; }

run() {   # idle-queues qd jobs parking(on|off) -> IOPS or "fail"
    local n=$1 qd=$2 jobs=$3 mode=$4 trids=() extra=()
    # The jobs and the idle queues share controllers of up to 1024 I/O queues: one more --trid per 1024.
    local ctrls=$(( (n + jobs + 1023) / 1024 ))
    for _ in $(seq "$ctrls"); do trids+=(--trid "trtype:tcp traddr:127.0.0.1 trsvcid:$PORT subnqn:$NQN"); done
    [ "$mode" = off ] && extra=(--no-parking)
    local out
    out=$(timeout -k 5 $((TIME + 120)) "$BIN/nvpoll-perf" "${trids[@]}" --cores "$ICORE" --qd "$qd" --jobs "$jobs" \
        --idle-queues "$n" "${extra[@]}" --workload randread --time "${TIME}s" --warmup 500ms --runs 1 \
        --send-mode deferred --json --quiet 2>"$WORK/perf.err") || { tail -n 3 "$WORK/perf.err" >&2; echo fail; return; }
    python3 -c 'import json,sys; print(int(json.load(sys.stdin)["rows"][0]["median"]["iops"]))' <<< "$out" 2>/dev/null || echo fail
}

say "initiator core $ICORE, target core $TCORE; $ROUNDS round(s) of ${TIME} s per cell; counts: $COUNTS"
RES=$WORK/results.txt
for round in $(seq "$ROUNDS"); do
    for n in $COUNTS; do
        for shape in "1 1" "32 8"; do
            read -r qd jobs <<< "$shape"
            for mode in on off; do
                v=$(run "$n" "$qd" "$jobs" "$mode")
                echo "$round $n qd${qd}x${jobs} $mode $v" >> "$RES"
                say "round $round: $n idle, qd$qd x $jobs, parking $mode: $v"
            done
        done
    done
done

python3 - "$RES" <<'EOF'
import sys, statistics
rows = [l.split() for l in open(sys.argv[1])]
cells = {}
for r, n, shape, mode, v in rows:
    cells.setdefault((int(n), shape, mode), {})[int(r)] = None if v == "fail" else int(v)
counts = sorted({k[0] for k in cells})
shapes = ["qd1x1", "qd32x8"]
print("| idle queues | " + " | ".join(f"{s} parking {m} | vs 0" for s in shapes for m in ("on", "off")) + " |")
print("|---" * (1 + 4 * len(shapes)) + "|")
for n in counts:
    out = [str(n)]
    for s in shapes:
        for m in ("on", "off"):
            c = cells.get((n, s, m), {})
            base = cells.get((counts[0], s, m), {})
            vals = [v for v in c.values() if v is not None]
            fails = sum(1 for v in c.values() if v is None)
            med = f"{statistics.median(vals):.0f}" if vals else "fail"
            if fails:
                med += f" (+{fails}fail)"
            ratios = [c[r] / base[r] for r in c if c[r] and base.get(r)]
            if n == counts[0] or not ratios:
                rat = "1.00" if n == counts[0] else "-"
            else:
                rat = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
            out += [med, rat]
    print("| " + " | ".join(out) + " |")
EOF

#!/usr/bin/env bash
# scripts/bench-spdk.sh - nvpoll and SPDK side by side, both pairings, in one run, on loopback.
#
# usage: SPDK_DIR=/path/to/spdk scripts/bench-spdk.sh
#
# SPDK_DIR is an SPDK build (v26.05 is the version we measure against) made by its own instructions; this
# script never builds one. Without SPDK_DIR it says so and exits 0.
#
# In each of BENCH_RUNS rounds, each target (SPDK's nvmf_tgt, then ours: a fresh process, one at a time on the
# target core) runs every cell with SPDK's spdk_nvme_perf and then our perf against it, on one queue pair; the
# median IOPS over the rounds is kept. Alternating the targets round by round spreads the machine's drift
# over both. Then one table with the four pairings side by side and two
# ratios:
#   initiator ratio = our perf / spdk_nvme_perf, both against SPDK's target
#   target ratio    = our target / SPDK's target, both driven by spdk_nvme_perf
# (and, for reference, ours against ours over SPDK against SPDK).
# Both targets serve a RAM namespace (SPDK: a malloc bdev) with 512-byte blocks, plain on one port and TLS
# (PSK, v0 identity) on another; our target is one process with both listeners (--config).
#
# Knobs (environment):
#   SPDK_DIR                 the SPDK build (required)
#   SPDK_RPC_PYTHON          the python3 that runs rpc.py (default /usr/bin/python3)
#   NVPOLL_EXAMPLES_DIR      folder with our built perf and target (default: cargo build --release)
#   BENCH_TIME=3             seconds per run
#   BENCH_RUNS=3             rounds: runs per target, initiator and cell (the median is printed)
#   BENCH_CELLS              workload:size:qd list, default
#                            randread:4k:128,randwrite:4k:128,read:128k:16,write:128k:16,read:1m:4,write:1m:4
#   BENCH_SECURITY           plain,tls
#   BENCH_PORT=4560          first TCP port on 127.0.0.1 (four are used)
#   BENCH_TARGET_CORE=0      the target's core; BENCH_INITIATOR_CORE=1 the initiator's
set -euo pipefail

PROG=bench-spdk
# shellcheck source=scripts/spdk-common.sh
. "$(dirname "${BASH_SOURCE[0]}")/spdk-common.sh"

TIME=${BENCH_TIME:-3}
RUNS=${BENCH_RUNS:-3}
[[ "$TIME" =~ ^[0-9]+$ ]] && [ "$TIME" -gt 0 ] || die "BENCH_TIME must be a whole number of seconds"
[[ "$RUNS" =~ ^[0-9]+$ ]] && [ "$RUNS" -gt 0 ] || die "BENCH_RUNS must be a whole number"
IFS=, read -r -a CELLS <<< "${BENCH_CELLS:-randread:4k:128,randwrite:4k:128,read:128k:16,write:128k:16,read:1m:4,write:1m:4}"
IFS=, read -r -a SECURITY <<< "${BENCH_SECURITY:-plain,tls}"
PORT=${BENCH_PORT:-4560}
TCORE=${BENCH_TARGET_CORE:-0}
ICORE=${BENCH_INITIATOR_CORE:-1}

SIZES_VAR=BENCH_CELLS
for c in "${CELLS[@]}"; do
    IFS=: read -r w s q <<< "$c"
    case "$w" in randread|randwrite|read|write) ;; *) die "BENCH_CELLS: unknown workload '$w' in '$c'" ;; esac
    bytes "$s" >/dev/null
    [[ "$q" =~ ^[0-9]+$ ]] && [ "$q" -gt 0 ] || die "BENCH_CELLS: bad queue depth in '$c'"
done
for s in "${SECURITY[@]}"; do case "$s" in plain|tls) ;; *) die "unknown security '$s'" ;; esac; done

our_binaries

SUBNQN=nqn.2016-06.io.spdk:bench
SUBNQN_TLS=nqn.2016-06.io.spdk:bench-tls
make_work nvpoll-bench-spdk
PLAIN_PORT=$PORT
TLS_PORT=$((PORT + 1))
TGT_PID=
# shellcheck disable=SC2317  # invoked by the traps
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    [ -z "$TGT_PID" ] || stop_pid "$TGT_PID"
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

start_spdk() {
    spdk_tgt_launch
    TGT_PID=$SPDK_TGT_PID
    spdk_tgt_configure "$PLAIN_PORT" "$TLS_PORT"
}

start_ours() {
    cat > "$WORK/target.json" <<JSON
{
  "listeners": [
    { "address": "127.0.0.1:$PLAIN_PORT", "tls": "off" },
    { "address": "127.0.0.1:$TLS_PORT", "tls": "required" }
  ],
  "send_mode": "adaptive",
  "subsystems": [
    { "nqn": "$SUBNQN", "allow_any_host": true, "listeners": ["127.0.0.1:$PLAIN_PORT"],
      "namespaces": [ { "ram": "256M", "block_size": 512 } ] },
    { "nqn": "$SUBNQN_TLS", "hosts": [ { "nqn": "$HOSTNQN", "psk_file": "$KEYFILE" } ],
      "listeners": ["127.0.0.1:$TLS_PORT"],
      "namespaces": [ { "ram": "256M", "block_size": 512 } ] }
  ]
}
JSON
    "$BIN/target" --config "$WORK/target.json" --cores "$TCORE" > "$WORK/target.log" 2>&1 &
    TGT_PID=$!
    wait_listen "$PLAIN_PORT" "$TGT_PID" "$WORK/target.log"
    wait_listen "$TLS_PORT" "$TGT_PID" "$WORK/target.log"
}

spdk_run() {   # sec workload bytes qd -> IOPS (or "fail")
    local sec=$1 w=$2 b=$3 q=$4 port=$PLAIN_PORT sub=$SUBNQN args=() out
    [ "$sec" = tls ] && { port=$TLS_PORT; sub=$SUBNQN_TLS; args=(-S ssl --psk-path "$KEYFILE"); }
    out=$(timeout -k 2 $((TIME + 15)) "$SPDK_PERF" --no-huge -s 512 -c "$((1 << ICORE))" -q "$q" -o "$b" -w "$w" \
        -t "$TIME" -r "trtype:tcp adrfam:IPv4 traddr:127.0.0.1 trsvcid:$port subnqn:$sub hostnqn:$HOSTNQN" \
        "${args[@]}" 2>&1) || true
    awk -F: '/^[[:space:]]*Total[[:space:]]*:/ { split($2, a, " "); v = a[1] } END { if (v == "") print "fail"; else printf "%d\n", v }' <<< "$out"
}

our_run() {   # sec workload bytes qd -> IOPS (or "fail")
    local sec=$1 w=$2 b=$3 q=$4 port=$PLAIN_PORT sub=$SUBNQN args=() out
    [ "$sec" = tls ] && { port=$TLS_PORT; sub=$SUBNQN_TLS; args=(--psk "$KEY" --psk-identity-version 0); }
    out=$(timeout -k 2 $((TIME + 15)) "$BIN/perf" --trid "trtype:tcp adrfam:IPv4 traddr:127.0.0.1 trsvcid:$port subnqn:$sub" \
        --hostnqn "$HOSTNQN" --workload "$w" --io-size "$b" --qd "$q" --jobs 1 --time "${TIME}s" --warmup 0s --runs 1 \
        --send-mode adaptive --cores "$ICORE" --json --quiet "${args[@]}" 2>&1) || true
    if [[ "$out" =~ \"iops\":([0-9.]+) ]]; then echo "${BASH_REMATCH[1]%.*}"; else echo fail; fi
}

median() {   # values... (a "fail" makes the median "fail")
    local v
    for v in "$@"; do [ "$v" != fail ] || { echo fail; return; }; done
    printf '%s\n' "$@" | sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'
}

declare -A RUNS_OF   # [target/initiator/sec/cell] = the IOPS of each round, space-separated
declare -A RESULT    # [target/initiator/sec/cell] = their median
measure_round() {   # spdk|ours round
    local tgt=$1 round=$2 sec cell w s q b a o
    for sec in "${SECURITY[@]}"; do
        for cell in "${CELLS[@]}"; do
            IFS=: read -r w s q <<< "$cell"
            b=$(bytes "$s")
            a=$(spdk_run "$sec" "$w" "$b" "$q")
            o=$(our_run "$sec" "$w" "$b" "$q")
            RUNS_OF[$tgt/spdk/$sec/$cell]+="$a "
            RUNS_OF[$tgt/ours/$sec/$cell]+="$o "
            say "round $round/$RUNS, $tgt target, $sec $w $s qd$q: spdk_nvme_perf $a, our perf $o"
        done
    done
}

say "SPDK at $SPDK_DIR; ours from $BIN; target core $TCORE, initiator core $ICORE; ${RUNS} round(s) of ${TIME}s per initiator and cell"
# Rounds alternate the targets (SPDK's, then ours, then SPDK's again ...), each target a fresh process that
# runs every cell in order, so a drift of the machine over the minutes a run takes falls on both targets
# alike instead of on whichever ran second.
for round in $(seq "$RUNS"); do
    start_spdk
    measure_round spdk "$round"
    stop_pid "$TGT_PID"; TGT_PID=
    start_ours
    measure_round ours "$round"
    stop_pid "$TGT_PID"; TGT_PID=
done
for k in "${!RUNS_OF[@]}"; do
    # shellcheck disable=SC2086 # the runs are space-separated on purpose
    RESULT[$k]=$(median ${RUNS_OF[$k]})
done

ratio() { if [ "$1" = fail ] || [ "$2" = fail ] || [ "$2" = 0 ]; then echo -; else awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a / b }'; fi; }
echo
echo "$PROG: median IOPS, 1 queue pair, loopback (initiator -> target)"
printf '| %-5s | %-20s | %12s | %12s | %12s | %12s | %10s | %10s | %10s |\n' sec cell "spdk->spdk" "ours->spdk" "spdk->ours" "ours->ours" "init ratio" "tgt ratio" "ours/spdk"
echo "|-------|----------------------|--------------|--------------|--------------|--------------|------------|------------|------------|"
for sec in "${SECURITY[@]}"; do
    for cell in "${CELLS[@]}"; do
        ss=${RESULT[spdk/spdk/$sec/$cell]}; os=${RESULT[spdk/ours/$sec/$cell]}
        so=${RESULT[ours/spdk/$sec/$cell]}; oo=${RESULT[ours/ours/$sec/$cell]}
        printf '| %-5s | %-20s | %12s | %12s | %12s | %12s | %10s | %10s | %10s |\n' "$sec" "$cell" "$ss" "$os" "$so" "$oo" \
            "$(ratio "$os" "$ss")" "$(ratio "$so" "$ss")" "$(ratio "$oo" "$ss")"
    done
done
echo "init ratio: our perf / spdk_nvme_perf against SPDK's target; tgt ratio: our target / SPDK's target with"
echo "spdk_nvme_perf; ours/spdk: ours against ours over SPDK against SPDK"

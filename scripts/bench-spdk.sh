#!/usr/bin/env bash
# scripts/bench-spdk.sh - nvpoll and SPDK side by side, both pairings, in one run, on loopback.
#
# usage: SPDK_DIR=/path/to/spdk scripts/bench-spdk.sh
#
# SPDK_DIR is an SPDK build (v26.05 is the version we measure against) made by its own instructions; this
# script never builds one. Without SPDK_DIR it says so and exits 0.
#
# In each of BENCH_RUNS rounds, for each cell, SPDK's nvmf_tgt and then ours (each a fresh process, one at a
# time on the target core) serve the cell to SPDK's spdk_nvme_perf and then to our perf, on one queue pair.
# The four runs of a cell follow each other within seconds: this VM's speed drifts over minutes (the same
# binary gives 11K or 30K 128 KiB reads depending on the minute), so only runs close in time compare. The
# table shows the median IOPS over the rounds of each pairing and three ratios, each the median over the
# rounds of the ratio within a round (paired, so the drift between rounds cancels):
#   initiator ratio = our perf / spdk_nvme_perf, both against SPDK's target
#   target ratio    = our target / SPDK's target, both driven by spdk_nvme_perf
#   ours/spdk       = ours against ours over SPDK against SPDK
# BENCH_ORDER=round runs every cell on one target process per round instead (fewer restarts, more drift).
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
#   BENCH_ORDER=cell         cell: both targets per cell, back to back; round: each target once per round
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
ORDER=${BENCH_ORDER:-cell}
case "$ORDER" in cell|round) ;; *) die "BENCH_ORDER must be cell or round, not '$ORDER'" ;; esac
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
    # Polling, as SPDK's nvmf_tgt does: the comparison is of two polled targets (the binary's default is hybrid).
    "$BIN/target" --config "$WORK/target.json" --cores "$TCORE" --idle poll > "$WORK/target.log" 2>&1 &
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
measure_cell() {   # spdk|ours round sec cell
    local tgt=$1 round=$2 sec=$3 cell=$4 w s q b a o
    IFS=: read -r w s q <<< "$cell"
    b=$(bytes "$s")
    a=$(spdk_run "$sec" "$w" "$b" "$q")
    o=$(our_run "$sec" "$w" "$b" "$q")
    RUNS_OF[$tgt/spdk/$sec/$cell]+="$a "
    RUNS_OF[$tgt/ours/$sec/$cell]+="$o "
    say "round $round/$RUNS, $tgt target, $sec $w $s qd$q: spdk_nvme_perf $a, our perf $o"
}
with_target() {   # spdk|ours: start it (a fresh process)
    if [ "$1" = spdk ]; then start_spdk; else start_ours; fi
}
stop_target() { stop_pid "$TGT_PID"; TGT_PID=; }

say "SPDK at $SPDK_DIR; ours from $BIN; target core $TCORE, initiator core $ICORE; ${RUNS} round(s) of ${TIME}s per initiator and cell"
for round in $(seq "$RUNS"); do
    if [ "$ORDER" = cell ]; then
        for sec in "${SECURITY[@]}"; do
            for cell in "${CELLS[@]}"; do
                for tgt in spdk ours; do
                    with_target "$tgt"
                    measure_cell "$tgt" "$round" "$sec" "$cell"
                    stop_target
                done
            done
        done
    else
        for tgt in spdk ours; do
            with_target "$tgt"
            for sec in "${SECURITY[@]}"; do
                for cell in "${CELLS[@]}"; do measure_cell "$tgt" "$round" "$sec" "$cell"; done
            done
            stop_target
        done
    fi
done
for k in "${!RUNS_OF[@]}"; do
    # shellcheck disable=SC2086 # the runs are space-separated on purpose
    RESULT[$k]=$(median ${RUNS_OF[$k]})
done

# The median over the rounds of a/b within each round: paired_ratio "a1 a2 ..." "b1 b2 ..."
paired_ratio() {
    local -a a b r=()
    local i
    read -r -a a <<< "$1"
    read -r -a b <<< "$2"
    for i in "${!a[@]}"; do
        if [ "${a[$i]}" = fail ] || [ "${b[$i]:-fail}" = fail ] || [ "${b[$i]}" = 0 ]; then echo -; return; fi
        r+=("$(awk -v x="${a[$i]}" -v y="${b[$i]}" 'BEGIN { printf "%.4f", x / y }')")
    done
    printf '%s\n' "${r[@]}" | sort -g | awk '{ v[NR] = $1 } END { printf "%.2f", v[int((NR + 1) / 2)] }'
}
echo
echo "$PROG: median IOPS, 1 queue pair, loopback (initiator -> target)"
printf '| %-5s | %-20s | %12s | %12s | %12s | %12s | %10s | %10s | %10s |\n' sec cell "spdk->spdk" "ours->spdk" "spdk->ours" "ours->ours" "init ratio" "tgt ratio" "ours/spdk"
echo "|-------|----------------------|--------------|--------------|--------------|--------------|------------|------------|------------|"
for sec in "${SECURITY[@]}"; do
    for cell in "${CELLS[@]}"; do
        ss=${RESULT[spdk/spdk/$sec/$cell]}; os=${RESULT[spdk/ours/$sec/$cell]}
        so=${RESULT[ours/spdk/$sec/$cell]}; oo=${RESULT[ours/ours/$sec/$cell]}
        base=${RUNS_OF[spdk/spdk/$sec/$cell]}
        printf '| %-5s | %-20s | %12s | %12s | %12s | %12s | %10s | %10s | %10s |\n' "$sec" "$cell" "$ss" "$os" "$so" "$oo" \
            "$(paired_ratio "${RUNS_OF[spdk/ours/$sec/$cell]}" "$base")" \
            "$(paired_ratio "${RUNS_OF[ours/spdk/$sec/$cell]}" "$base")" \
            "$(paired_ratio "${RUNS_OF[ours/ours/$sec/$cell]}" "$base")"
    done
done
echo "init ratio: our perf / spdk_nvme_perf against SPDK's target; tgt ratio: our target / SPDK's target with"
echo "spdk_nvme_perf; ours/spdk: ours against ours over SPDK against SPDK. Each ratio is the median over the"
echo "rounds of the ratio within a round; the IOPS columns are medians over the rounds."

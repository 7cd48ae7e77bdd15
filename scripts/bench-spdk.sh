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

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
PROG=bench-spdk
die() { echo "$PROG: error: $*" >&2; exit 2; }
say() { echo "$PROG: $*"; }

if [ -z "${SPDK_DIR:-}" ]; then
    say "SKIPPED: SPDK_DIR is not set. Point it at an SPDK build (v26.05) that has build/bin/nvmf_tgt,"
    say "build/bin/spdk_nvme_perf and scripts/rpc.py; this script never builds SPDK."
    exit 0
fi
NVMF_TGT=$SPDK_DIR/build/bin/nvmf_tgt
SPDK_PERF=$SPDK_DIR/build/bin/spdk_nvme_perf
RPC_PY=$SPDK_DIR/scripts/rpc.py
for f in "$NVMF_TGT" "$SPDK_PERF"; do [ -x "$f" ] || die "$f is missing or not executable (SPDK_DIR=$SPDK_DIR)"; done
[ -f "$RPC_PY" ] || die "$RPC_PY is missing (SPDK_DIR=$SPDK_DIR)"
RPC_PYTHON=${SPDK_RPC_PYTHON:-$(command -v /usr/bin/python3 || command -v python3 || true)}
[ -n "$RPC_PYTHON" ] || die "python3 not found (rpc.py needs it): apt-get install python3"

TIME=${BENCH_TIME:-3}
RUNS=${BENCH_RUNS:-3}
[[ "$TIME" =~ ^[0-9]+$ ]] && [ "$TIME" -gt 0 ] || die "BENCH_TIME must be a whole number of seconds"
[[ "$RUNS" =~ ^[0-9]+$ ]] && [ "$RUNS" -gt 0 ] || die "BENCH_RUNS must be a whole number"
IFS=, read -r -a CELLS <<< "${BENCH_CELLS:-randread:4k:128,randwrite:4k:128,read:128k:16,write:128k:16,read:1m:4,write:1m:4}"
IFS=, read -r -a SECURITY <<< "${BENCH_SECURITY:-plain,tls}"
PORT=${BENCH_PORT:-4560}
TCORE=${BENCH_TARGET_CORE:-0}
ICORE=${BENCH_INITIATOR_CORE:-1}

bytes() {   # 4k | 128k | 1m | 512 -> bytes
    local v=${1,,}
    case "$v" in
        *k) echo $(( ${v%k} * 1024 )) ;;
        *m) echo $(( ${v%m} * 1024 * 1024 )) ;;
        *[!0-9]*|'') die "bad size '$1' in BENCH_CELLS" ;;
        *) echo "$v" ;;
    esac
}
for c in "${CELLS[@]}"; do
    IFS=: read -r w s q <<< "$c"
    case "$w" in randread|randwrite|read|write) ;; *) die "BENCH_CELLS: unknown workload '$w' in '$c'" ;; esac
    bytes "$s" >/dev/null
    [[ "$q" =~ ^[0-9]+$ ]] && [ "$q" -gt 0 ] || die "BENCH_CELLS: bad queue depth in '$c'"
done
for s in "${SECURITY[@]}"; do case "$s" in plain|tls) ;; *) die "unknown security '$s'" ;; esac; done

if [ -n "${NVPOLL_EXAMPLES_DIR:-}" ]; then
    BIN=$NVPOLL_EXAMPLES_DIR
else
    say "building our perf and target (release)"
    (cd "$ROOT" && cargo build -q --release --example perf --example target) || die "the build failed"
    meta=$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps) || die "cargo metadata failed"
    [[ "$meta" =~ \"target_directory\":\"([^\"]+)\" ]] || die "no target_directory in cargo metadata"
    BIN=${BASH_REMATCH[1]}/release/examples
fi
[ -x "$BIN/perf" ] && [ -x "$BIN/target" ] || die "no perf and target in $BIN"

# Test vector of the NVMe TLS PSK interchange format (shared/notes/tls-psk.md): a test-only key.
KEY='NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:'
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:f81d4fae-7dec-11d0-a765-00a0c91e6bf6
SUBNQN=nqn.2016-06.io.spdk:bench
SUBNQN_TLS=nqn.2016-06.io.spdk:bench-tls
WORK=$(mktemp -d "${TMPDIR:-/tmp}/nvpoll-bench-spdk.XXXXXX")
chmod 700 "$WORK"
KEYFILE=$WORK/psk.key
( umask 077; printf '%s' "$KEY" > "$KEYFILE" )
RPC_SOCK=$WORK/spdk.sock
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

stop_pid() {   # PID: SIGTERM, then SIGKILL after 5 s
    local p=$1 i
    kill -TERM "$p" 2>/dev/null || true
    for i in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null || true
    { wait "$p"; } 2>/dev/null || true
}

wait_listen() {   # PORT LOG
    local i
    for i in $(seq 200); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
        kill -0 "$TGT_PID" 2>/dev/null || break
        sleep 0.05
    done
    tail -n 30 "$2" >&2
    die "nothing listens on 127.0.0.1:$1"
}

rpc() { "$RPC_PYTHON" "$RPC_PY" -s "$RPC_SOCK" "$@" >> "$WORK/rpc.log" 2>&1 || die "rpc.py $* failed: $(tail -n 3 "$WORK/rpc.log")"; }

start_spdk() {
    rm -f "$RPC_SOCK"   # a killed predecessor leaves its socket behind
    "$NVMF_TGT" -m "$((1 << TCORE))" --no-huge -s 1024 -r "$RPC_SOCK" > "$WORK/nvmf_tgt.log" 2>&1 &
    TGT_PID=$!
    local i
    for i in $(seq 200); do [ -S "$RPC_SOCK" ] && break; kill -0 "$TGT_PID" 2>/dev/null || break; sleep 0.05; done
    [ -S "$RPC_SOCK" ] || { tail -n 30 "$WORK/nvmf_tgt.log" >&2; die "nvmf_tgt did not open its RPC socket"; }
    rpc framework_wait_init
    rpc nvmf_create_transport -t TCP -i 1048576 -c 8192
    rpc bdev_malloc_create -b Malloc0 256 512
    rpc bdev_malloc_create -b Malloc1 256 512
    rpc keyring_file_add_key key0 "$KEYFILE"
    rpc nvmf_create_subsystem "$SUBNQN" -a -s SPDK00000000000001 -m 4
    rpc nvmf_subsystem_add_ns "$SUBNQN" Malloc0
    rpc nvmf_subsystem_add_listener "$SUBNQN" -t tcp -a 127.0.0.1 -s "$PLAIN_PORT"
    rpc nvmf_create_subsystem "$SUBNQN_TLS" -s SPDK00000000000002 -m 4
    rpc nvmf_subsystem_add_ns "$SUBNQN_TLS" Malloc1
    rpc nvmf_subsystem_add_listener "$SUBNQN_TLS" -t tcp -a 127.0.0.1 -s "$TLS_PORT" --secure-channel
    rpc nvmf_subsystem_add_host "$SUBNQN_TLS" "$HOSTNQN" --psk key0
    wait_listen "$PLAIN_PORT" "$WORK/nvmf_tgt.log"
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
    wait_listen "$PLAIN_PORT" "$WORK/target.log"
    wait_listen "$TLS_PORT" "$WORK/target.log"
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

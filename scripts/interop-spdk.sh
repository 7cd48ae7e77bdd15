#!/usr/bin/env bash
# scripts/interop-spdk.sh - nvpoll against SPDK, the reference peer, in both directions, on loopback.
#
# usage: SPDK_DIR=/path/to/spdk scripts/interop-spdk.sh
#
# SPDK_DIR is an SPDK build (v26.05 is the version we measure against) made by its own instructions; this
# script never builds one. It needs $SPDK_DIR/build/bin/nvmf_tgt, $SPDK_DIR/build/bin/spdk_nvme_perf and
# $SPDK_DIR/scripts/rpc.py. Without SPDK_DIR it says so and exits 0 (CI has no SPDK).
#
# Two directions, each a matrix of cells:
#   ours -> SPDK   our perf --verify (randrw, every block stamped and checked) against SPDK's nvmf_tgt
#   SPDK -> ours   spdk_nvme_perf (randrw) against our target: one process with a plain and a TLS listener and
#                  two subsystems, configured by a file (--config), as an operator would run it
# cells: plain and TLS (PSK, NVMeTLSkey-1:01), without and with header+data digests, I/O sizes 512 B, 4 KiB,
# 128 KiB and 1 MiB, queue depth 1 and 128, 1 and 16 queue pairs. The queue depth counts the commands
# outstanding on the namespace in all, as spdk_nvme_perf -q does (-q 128 -P 16: 8 per queue pair); our perf
# runs --jobs P --qd max(1, QD/P) to match.
# A cell fails on: an I/O error or verify mismatch, a refused connect, a peer that does not exit by itself
# within its run time plus 10 s, a target that died or logged a connection closed on the host's account.
# It prints one table (IOPS, MiB/s, result per cell) and exits non-zero if any cell failed.
#
# Then SPDK's fuzzer against our target: nvme_fuzz (SPDK_DIR/test/app/fuzz/nvme_fuzz/nvme_fuzz, built with
# `make -C test/app/fuzz`) with admin and I/O commands, once per seed. It sends Fabrics Disconnect on I/O queues
# and more commands behind it, and waits for every answer: a run fails when nvme_fuzz does not end by itself
# within its time plus 15 s (a command left unanswered), or when our target died or logged an internal error.
#
# Knobs (environment):
#   SPDK_DIR                 the SPDK build (required)
#   SPDK_RPC_PYTHON          the python3 that runs rpc.py (default /usr/bin/python3)
#   NVPOLL_BIN_DIR      folder with our built perf and target (default: cargo build --release)
#   INTEROP_TIME=2           seconds per cell
#   INTEROP_KEY_UPDATE       TLS cells renew their keys after this many records (our perf's --tls-key-update,
#                            our target's tls_key_update); default: ours renew at 2^23 and SPDK's never start
#   INTEROP_WORKLOAD=randrw  randrw (50% reads) | randread | randwrite | read | write
#   INTEROP_DIRECTIONS       ours-spdk,spdk-ours (default both; "" runs only nvme_fuzz)
#   INTEROP_SIZES            512,4k,128k,1m
#   INTEROP_QDS              1,128
#   INTEROP_QPAIRS           1,16
#   INTEROP_SECURITY         plain,tls
#   INTEROP_DIGESTS          none,hd   (hd: header and data digests)
#   INTEROP_PORT=4520        first TCP port used on 127.0.0.1 (four are used)
#   INTEROP_TARGET_CORE=0    core of the target under test (ours or SPDK's); the initiator gets the other
#   INTEROP_INITIATOR_CORE=1
#   INTEROP_FUZZ_SEEDS       seeds for nvme_fuzz against our target (default "1234 1 7 42 2026"; "" skips it)
#   INTEROP_FUZZ_TIME=10     seconds per nvme_fuzz run
#   INTEROP_KEEP=0           1: keep the work folder (logs of every cell)
set -euo pipefail

PROG=interop-spdk
# shellcheck source=scripts/spdk-common.sh
. "$(dirname "${BASH_SOURCE[0]}")/spdk-common.sh"
command -v timeout >/dev/null 2>&1 || die "timeout not found: apt-get install coreutils"

TIME=${INTEROP_TIME:-2}
KEY_UPDATE=${INTEROP_KEY_UPDATE:-}
[ -z "$KEY_UPDATE" ] || [[ "$KEY_UPDATE" =~ ^[0-9]+$ ]] || die "INTEROP_KEY_UPDATE must be a number of records"
WORKLOAD=${INTEROP_WORKLOAD:-randrw}
case "$WORKLOAD" in randrw|randread|randwrite|read|write) ;; *) die "INTEROP_WORKLOAD: unknown workload '$WORKLOAD'" ;; esac
[[ "$TIME" =~ ^[0-9]+$ ]] && [ "$TIME" -gt 0 ] || die "INTEROP_TIME must be a whole number of seconds"
IFS=, read -r -a DIRECTIONS <<< "${INTEROP_DIRECTIONS-ours-spdk,spdk-ours}"
IFS=, read -r -a SIZES <<< "${INTEROP_SIZES:-512,4k,128k,1m}"
IFS=, read -r -a QDS <<< "${INTEROP_QDS:-1,128}"
IFS=, read -r -a QPAIRS <<< "${INTEROP_QPAIRS:-1,16}"
IFS=, read -r -a SECURITY <<< "${INTEROP_SECURITY:-plain,tls}"
IFS=, read -r -a DIGESTS <<< "${INTEROP_DIGESTS:-none,hd}"
PORT=${INTEROP_PORT:-4520}
FUZZ_SEEDS=${INTEROP_FUZZ_SEEDS-1234 1 7 42 2026}
FUZZ_TIME=${INTEROP_FUZZ_TIME:-10}
[[ "$FUZZ_TIME" =~ ^[0-9]+$ ]] && [ "$FUZZ_TIME" -gt 0 ] || die "INTEROP_FUZZ_TIME must be a whole number of seconds"
for seed in $FUZZ_SEEDS; do [[ "$seed" =~ ^[0-9]+$ ]] || die "INTEROP_FUZZ_SEEDS: '$seed' is not a number"; done
TCORE=${INTEROP_TARGET_CORE:-0}
ICORE=${INTEROP_INITIATOR_CORE:-1}

SIZES_VAR=INTEROP_SIZES
for d in "${DIRECTIONS[@]}"; do case "$d" in ours-spdk|spdk-ours) ;; *) die "unknown direction '$d'" ;; esac; done
for s in "${SECURITY[@]}"; do case "$s" in plain|tls) ;; *) die "unknown security '$s'" ;; esac; done
for g in "${DIGESTS[@]}"; do case "$g" in none|hd) ;; *) die "unknown digests '$g'" ;; esac; done
for s in "${SIZES[@]}"; do bytes "$s" >/dev/null; done

# ---------------------------------------------------------------------------------------------------------------
# our binaries
# ---------------------------------------------------------------------------------------------------------------
our_binaries

# ---------------------------------------------------------------------------------------------------------------
# keys, work folder, cleanup
# ---------------------------------------------------------------------------------------------------------------
SUBNQN=nqn.2016-06.io.spdk:interop        # plain: any host
SUBNQN_TLS=nqn.2016-06.io.spdk:interop-tls # TLS: HOSTNQN with the PSK (KEY, in spdk-common.sh)
make_work nvpoll-interop
PIDS=()
# shellcheck disable=SC2317  # invoked by the traps
cleanup() {
    local rc=$? p
    trap - EXIT INT TERM
    for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do
        for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$p" 2>/dev/null || true
        { wait "$p"; } 2>/dev/null || true
    done
    if [ "${INTEROP_KEEP:-0}" = 1 ]; then echo "$PROG: kept $WORK" >&2; else rm -rf "$WORK"; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

stop_target() {   # PID: stop_pid, and no longer stop it on exit
    local p=$1 i keep=()
    stop_pid "$p"
    for i in "${PIDS[@]}"; do [ "$i" = "$p" ] || keep+=("$i"); done
    PIDS=("${keep[@]}")
}

# Runs CMD with a deadline of the run time plus 10 s; its status is 124 when it had to be killed.
run_bounded() {   # LOG CMD...
    local log=$1; shift
    local rc=0
    timeout -k 2 $((TIME + 10)) "$@" > "$log" 2>&1 || rc=$?
    return "$rc"
}

# ---------------------------------------------------------------------------------------------------------------
# SPDK's target (once, with every listener the cells need)
# ---------------------------------------------------------------------------------------------------------------
SPDK_PLAIN_PORT=$PORT
SPDK_TLS_PORT=$((PORT + 1))
OUR_PLAIN_PORT=$((PORT + 2))
OUR_TLS_PORT=$((PORT + 3))

start_spdk_target() {
    say "starting SPDK's nvmf_tgt on core $TCORE (ports $SPDK_PLAIN_PORT plain, $SPDK_TLS_PORT TLS)"
    spdk_tgt_launch
    PIDS+=("$SPDK_TGT_PID")
    spdk_tgt_configure "$SPDK_PLAIN_PORT" "$SPDK_TLS_PORT"
}

# Our target: one process, configured by a file (a plain and a TLS listener, two subsystems: the one the cells
# use, open to any host and holding HOSTNQN's key, and one only another host may use, which must not get in the way).
start_our_target() {
    local conf=$WORK/our-target.json
    cat > "$conf" <<JSON
{
  ${KEY_UPDATE:+\"tls_key_update\": $KEY_UPDATE,}
  "listeners": [
    { "address": "127.0.0.1:$OUR_PLAIN_PORT", "tls": "off" },
    { "address": "127.0.0.1:$OUR_TLS_PORT", "tls": "required" }
  ],
  "subsystems": [
    { "nqn": "$SUBNQN", "allow_any_host": true,
      "hosts": [ { "nqn": "$HOSTNQN", "psk_file": "$KEYFILE" } ],
      "namespaces": [ { "ram": "256M", "block_size": 512 } ] },
    { "nqn": "$SUBNQN.other", "hosts": [ { "nqn": "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-0000000000ff" } ],
      "namespaces": [ { "ram": "16M", "block_size": 4096 } ] }
  ]
}
JSON
    "$BIN/nvpoll-target" --config "$conf" --cores "$TCORE" > "$WORK/our-target.log" 2>&1 &
    OUR_TGT_PID=$!
    PIDS+=("$OUR_TGT_PID")
    wait_listen "$OUR_PLAIN_PORT" "$OUR_TGT_PID" "$WORK/our-target.log"
    wait_listen "$OUR_TLS_PORT" "$OUR_TGT_PID" "$WORK/our-target.log"
}

# ---------------------------------------------------------------------------------------------------------------
# cells
# ---------------------------------------------------------------------------------------------------------------
ROWS=()
FAILED=0
record() {   # direction security digests size qd qpairs iops mibs result
    ROWS+=("$(printf '| %-9s | %-5s | %-7s | %5s | %3s | %6s | %10s | %9s | %-28s |' "$@")")
    echo "${ROWS[-1]}"
    [ "$9" = ok ] || FAILED=$((FAILED + 1))
}

ours_to_spdk() {   # sec dg size qd qp
    local sec=$1 dg=$2 size=$3 qd=$4 qp=$5 port=$SPDK_PLAIN_PORT sub=$SUBNQN args=()
    local per=$(( qd / qp )); [ "$per" -ge 1 ] || per=1
    [ "$sec" = tls ] && { port=$SPDK_TLS_PORT; sub=$SUBNQN_TLS; args+=(--psk "$KEY" --psk-identity-version 0 ${KEY_UPDATE:+--tls-key-update "$KEY_UPDATE"}); }
    [ "$dg" = hd ] && args+=(--header-digest --data-digest)
    local log=$WORK/ours-spdk-$sec-$dg-$size-$qd-$qp.log rc=0
    run_bounded "$log" "$BIN/nvpoll-perf" --trid "trtype:tcp adrfam:IPv4 traddr:127.0.0.1 trsvcid:$port subnqn:$sub" \
        --hostnqn "$HOSTNQN" --workload "$WORKLOAD" --rwmix 50 --io-size "$size" --qd "$per" --jobs "$qp" \
        --time "${TIME}s" --warmup 0s --runs 1 --send-mode adaptive --cores "$ICORE" --verify --json --quiet \
        "${args[@]}" || rc=$?
    local result=ok iops=- mibs=-
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then result="did not exit in ${TIME}+10 s"
    elif [ "$rc" != 0 ]; then result="exit status $rc"
    fi
    if [[ "$(cat "$log")" =~ \"iops\":([0-9.]+) ]]; then iops=${BASH_REMATCH[1]%.*}; fi
    if [ "$iops" != - ]; then mibs=$(awk -v i="$iops" -v b="$(bytes "$size")" 'BEGIN { printf "%.1f", i * b / 1048576 }'); fi
    if [ "$result" = ok ]; then
        grep -qE '"errors":[1-9]|"mismatches":[1-9]' "$log" && result="I/O errors or mismatches"
        [ "$iops" = - ] && result="no IOPS in perf's output"
    fi
    kill -0 "$SPDK_TGT_PID" 2>/dev/null || result="SPDK's target died"
    [ "$result" = ok ] || { echo "---- $log ----"; tail -n 15 "$log"; }
    record ours-spdk "$sec" "$dg" "$size" "$qd" "$qp" "$iops" "$mibs" "$result"
}

spdk_to_ours() {   # sec dg size qd qp
    local sec=$1 dg=$2 size=$3 qd=$4 qp=$5 port=$OUR_PLAIN_PORT args=()
    [ "$sec" = tls ] && { port=$OUR_TLS_PORT; args+=(-S ssl --psk-path "$KEYFILE"); }
    [ "$dg" = hd ] && args+=(-H -I)
    local tlog="$WORK/our-target.log"
    local before; before=$(wc -l < "$tlog")
    local log=$WORK/spdk-ours-$sec-$dg-$size-$qd-$qp.log rc=0
    run_bounded "$log" "$SPDK_PERF" --no-huge -s 512 -c "$((1 << ICORE))" -q "$qd" -P "$qp" -o "$(bytes "$size")" \
        -w "$WORKLOAD" -M 50 -t "$TIME" \
        -r "trtype:tcp adrfam:IPv4 traddr:127.0.0.1 trsvcid:$port subnqn:$SUBNQN hostnqn:$HOSTNQN" \
        "${args[@]}" || rc=$?
    local result=ok iops=- mibs=-
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then result="did not exit in ${TIME}+10 s"
    elif [ "$rc" != 0 ]; then result="exit status $rc"
    fi
    # spdk_nvme_perf's last line: "Total : IOPS MiB/s avg min max"
    local tot; tot=$(grep -E '^\s*Total\s*:' "$log" | tail -n 1 || true)
    if [ -n "$tot" ]; then
        read -r iops mibs < <(awk -F: '{ split($2, a, " "); printf "%d %s\n", a[1], a[2] }' <<< "$tot")
    fi
    if [ "$result" = ok ]; then
        # Its exit status says little (0 even when no controller attached), so its output decides. Every run,
        # also against SPDK's own target, ends with "CQ transport error -6 (No such device or address)" on
        # the admin queue's disconnect: that line alone is not a failure.
        local errs; errs=$(grep -iE 'error|fail|No valid NVMe controllers' "$log" | grep -vE 'CQ transport error -6 \(No such device or address\)' || true)
        [ -z "$errs" ] || result="spdk_nvme_perf: $(head -n 1 <<< "$errs" | sed 's/^.*\] //' | cut -c1-40)"
        [ "$iops" = - ] && [ "$result" = ok ] && result="no Total line from spdk_nvme_perf"
    fi
    kill -0 "$OUR_TGT_PID" 2>/dev/null || result="our target died"
    # what our target said during the cell: refusals and closes on the host's account fail it
    local said; said=$(tail -n +"$((before + 1))" "$tlog" | grep -E 'refused|closed: ' | grep -vE 'closed: (closed by the host|host sent Disconnect)' || true)
    if [ -n "$said" ] && [ "$result" = ok ]; then result="target: $(head -n 1 <<< "$said" | cut -c1-60)"; fi
    [ "$result" = ok ] || { echo "---- $log ----"; tail -n 15 "$log"; [ -z "$said" ] || echo "$said"; }
    record spdk-ours "$sec" "$dg" "$size" "$qd" "$qp" "$iops" "$mibs" "$result"
}

# ---------------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------------
say "SPDK at $SPDK_DIR ($(cd "$SPDK_DIR" && git describe --tags 2>/dev/null || echo 'version unknown')); ours from $BIN; $WORKLOAD, ${TIME}s per cell"
header='| direction | sec   | digests |  size |  qd | qpairs |       IOPS |     MiB/s | result                       |'
rule='|-----------|-------|---------|-------|-----|--------|------------|-----------|------------------------------|'
echo "$header"; echo "$rule"
for dir in "${DIRECTIONS[@]}"; do
    # one busy-polling target on the target core at a time: two would halve each other
    if [ "$dir" = ours-spdk ]; then start_spdk_target; else start_our_target; fi
    for sec in "${SECURITY[@]}"; do
        for dg in "${DIGESTS[@]}"; do
            for size in "${SIZES[@]}"; do
                for qd in "${QDS[@]}"; do
                    for qp in "${QPAIRS[@]}"; do
                        if [ "$dir" = ours-spdk ]; then ours_to_spdk "$sec" "$dg" "$size" "$qd" "$qp"
                        else spdk_to_ours "$sec" "$dg" "$size" "$qd" "$qp"; fi
                    done
                done
            done
        done
    done
    if [ "$dir" = ours-spdk ]; then stop_target "$SPDK_TGT_PID"; else stop_target "$OUR_TGT_PID"; fi
done

# ---------------------------------------------------------------------------------------------------------------
# SPDK's nvme_fuzz against our target: it must end by itself (every command answered)
# ---------------------------------------------------------------------------------------------------------------
FUZZ_ROWS=()
NVME_FUZZ=$SPDK_DIR/test/app/fuzz/nvme_fuzz/nvme_fuzz
if [ -z "$FUZZ_SEEDS" ]; then
    say "nvme_fuzz: skipped (INTEROP_FUZZ_SEEDS is empty)"
elif [ ! -x "$NVME_FUZZ" ]; then
    say "nvme_fuzz: NOT RUN: $NVME_FUZZ is not built (make -C \$SPDK_DIR/test/app/fuzz); a failed check"
    FAILED=$((FAILED + 1))
    FUZZ_ROWS+=("| nvme_fuzz | -    | not built: make -C test/app/fuzz |")
else
    start_our_target
    for seed in $FUZZ_SEEDS; do
        log=$WORK/nvme-fuzz-$seed.log rc=0 t0=$SECONDS
        before=$(wc -l < "$WORK/our-target.log")
        timeout -k 2 $((FUZZ_TIME + 15)) "$NVME_FUZZ" -m "$((1 << ICORE))" --no-huge -s 512 -S "$seed" \
            -t "$FUZZ_TIME" -a -U -F "trtype:tcp adrfam:IPv4 traddr:127.0.0.1 trsvcid:$OUR_PLAIN_PORT subnqn:$SUBNQN" \
            > "$log" 2>&1 || rc=$?
        took=$((SECONDS - t0))
        result=ok
        if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then result="did not end in ${FUZZ_TIME}+15 s"; fi
        kill -0 "$OUR_TGT_PID" 2>/dev/null || result="our target died"
        bug=$(tail -n +"$((before + 1))" "$WORK/our-target.log" | grep -iE 'panicked|internal error' || true)
        [ -z "$bug" ] || result="target: $(head -n 1 <<< "$bug" | cut -c1-50)"
        [ "$result" = ok ] || { FAILED=$((FAILED + 1)); echo "---- $log ----"; tail -n 15 "$log"; }
        FUZZ_ROWS+=("$(printf '| nvme_fuzz | %5s | exit %3s in %3s s | %-28s |' "$seed" "$rc" "$took" "$result")")
        echo "${FUZZ_ROWS[-1]}"
    done
    stop_target "$OUR_TGT_PID"
fi

echo
echo "$PROG: results ($WORKLOAD, ${TIME}s per cell, loopback, target on core $TCORE, initiator on core $ICORE)"
echo "$header"; echo "$rule"
printf '%s\n' "${ROWS[@]}"
if [ "${#FUZZ_ROWS[@]}" -gt 0 ]; then
    echo
    echo "$PROG: SPDK's nvme_fuzz -a (admin and I/O commands) against our target, ${FUZZ_TIME}s per seed"
    echo "| fuzzer    | seed  | ended             | result                       |"
    echo "|-----------|-------|-------------------|------------------------------|"
    printf '%s\n' "${FUZZ_ROWS[@]}"
fi
echo "$PROG: ${#ROWS[@]} cells and ${#FUZZ_ROWS[@]} fuzz runs, $FAILED failed"
[ "$FAILED" = 0 ]

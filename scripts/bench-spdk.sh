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
# pairings are A (spdk_nvme_perf -> nvmf_tgt), B (our perf -> nvmf_tgt), C (spdk_nvme_perf -> our target)
# and D (our perf -> our target). The table shows the median IOPS over the rounds of each pairing, three
# ratios, each the median over the rounds of the ratio within a round (paired, so the drift between rounds
# cancels) with its lowest and highest, and each pair's spread (highest / lowest IOPS over the rounds):
#   B/A  initiator ratio: our perf / spdk_nvme_perf, both against SPDK's target
#   C/A  target ratio: our target / SPDK's target, both driven by spdk_nvme_perf
#   D/A  ours against ours over SPDK against SPDK
# A second table gives each initiator's CPU time per I/O against SPDK's target (user+system, from
# /proc/PID/task/*/stat, the same way for both), and the header names the machine's CPU model.
# BENCH_ORDER=round runs every cell on one target process per round instead (fewer restarts, more drift).
# Both targets serve a RAM namespace (SPDK: a malloc bdev) with 512-byte blocks, plain on one port and TLS
# (PSK, v0 identity) on another; our target is one process with both listeners (--config).
#
# Knobs (environment):
#   SPDK_DIR                 the SPDK build (required)
#   SPDK_RPC_PYTHON          the python3 that runs rpc.py (default /usr/bin/python3)
#   NVPOLL_BIN_DIR      folder with our built perf and target (default: cargo build --release)
#   BENCH_TIME=3             seconds per run
#   BENCH_RUNS=3             rounds: runs per target, initiator and cell (the median is printed)
#   BENCH_CELLS              workload:size:qd list, default
#                            randread:4k:128,randwrite:4k:128,randwrite:4k:1,read:128k:16,write:128k:16,read:1m:4,write:1m:4
#   BENCH_SECURITY           plain,tls
#   BENCH_ORDER=cell         cell: both targets per cell, back to back; round: each target once per round
#   BENCH_PORT=4560          first TCP port on 127.0.0.1 (four are used)
#   BENCH_TARGET_CORE=0      the target's core; BENCH_INITIATOR_CORE=1 the initiator's
#   BENCH_TARGET_SEND_MODE   our target's send mode: adaptive (default), inline or deferred
#   BENCH_CONGESTION=cubic   the TCP congestion control of every socket in the run, SPDK's and ours: the run
#                            goes into a network namespace of its own (unshare -n, root) whose default is
#                            this algorithm, and the machine's default stays as it is. Under BBR, this
#                            VM's default, a loopback connection runs fast or slow by the round trip it
#                            measured first (docs/performance.md): nvpoll moves its own loopback connections
#                            to cubic, SPDK cannot, and a ratio against a target that drew a slow
#                            connection says nothing of either. 'system' runs in the machine's namespace
#                            with its default (SPDK's sockets keep it, ours move to cubic).
#   BENCH_CONTROL=0          1: in each round and cell, after C and D, SPDK's pair runs once more (A', a fresh
#                            nvmf_tgt), and a table gives A'/A: SPDK against itself over the same seconds
#                            as the ratios, the machine's own noise, which no ratio can be trusted beyond,
#                            and B, C and D over the geometric mean of A and A' (a drift across the cell's
#                            runs then weighs on the reference too) (BENCH_ORDER=cell only; one run more
#                            per cell and round)
set -euo pipefail

PROG=bench-spdk
# shellcheck source=scripts/spdk-common.sh
. "$(dirname "${BASH_SOURCE[0]}")/spdk-common.sh"

TIME=${BENCH_TIME:-3}
RUNS=${BENCH_RUNS:-3}
[[ "$TIME" =~ ^[0-9]+$ ]] && [ "$TIME" -gt 0 ] || die "BENCH_TIME must be a whole number of seconds"
[[ "$RUNS" =~ ^[0-9]+$ ]] && [ "$RUNS" -gt 0 ] || die "BENCH_RUNS must be a whole number"
IFS=, read -r -a CELLS <<< "${BENCH_CELLS:-randread:4k:128,randwrite:4k:128,randwrite:4k:1,read:128k:16,write:128k:16,read:1m:4,write:1m:4}"
IFS=, read -r -a SECURITY <<< "${BENCH_SECURITY:-plain,tls}"
PORT=${BENCH_PORT:-4560}
ORDER=${BENCH_ORDER:-cell}
case "$ORDER" in cell|round) ;; *) die "BENCH_ORDER must be cell or round, not '$ORDER'" ;; esac
CONTROL=${BENCH_CONTROL:-0}
case "$CONTROL" in 0|1) ;; *) die "BENCH_CONTROL must be 0 or 1, not '$CONTROL'" ;; esac
[ "$CONTROL" = 0 ] || [ "$ORDER" = cell ] || die "BENCH_CONTROL=1 needs BENCH_ORDER=cell (the control runs within each cell's seconds)"
TCORE=${BENCH_TARGET_CORE:-0}
ICORE=${BENCH_INITIATOR_CORE:-1}
TARGET_SEND_MODE=${BENCH_TARGET_SEND_MODE:-adaptive}
case "$TARGET_SEND_MODE" in adaptive|inline|deferred) ;;
    *) die "BENCH_TARGET_SEND_MODE must be adaptive, inline or deferred, not '$TARGET_SEND_MODE'" ;; esac

SIZES_VAR=BENCH_CELLS
for c in "${CELLS[@]}"; do
    IFS=: read -r w s q <<< "$c"
    case "$w" in randread|randwrite|read|write) ;; *) die "BENCH_CELLS: unknown workload '$w' in '$c'" ;; esac
    bytes "$s" >/dev/null
    [[ "$q" =~ ^[0-9]+$ ]] && [ "$q" -gt 0 ] || die "BENCH_CELLS: bad queue depth in '$c'"
done
for s in "${SECURITY[@]}"; do case "$s" in plain|tls) ;; *) die "unknown security '$s'" ;; esac; done

our_binaries

CONGESTION=${BENCH_CONGESTION:-cubic}
[[ "$CONGESTION" =~ ^[a-z0-9_]+$ ]] || die "BENCH_CONGESTION must be an algorithm's name or 'system', not '$CONGESTION'"
if [ "$CONGESTION" != system ] && [ -z "${BENCH_SPDK_NETNS:-}" ]; then
    # Into a namespace of our own, whose loopback and default congestion control serve this run alone.
    [ "$(id -u)" = 0 ] || die "BENCH_CONGESTION=$CONGESTION needs root (a network namespace of its own); BENCH_CONGESTION=system runs without one"
    command -v unshare >/dev/null || die "unshare (util-linux) is missing; BENCH_CONGESTION=system runs without it"
    command -v ip >/dev/null || die "ip (iproute2) is missing; BENCH_CONGESTION=system runs without it"
    grep -qw -- "$CONGESTION" /proc/sys/net/ipv4/tcp_available_congestion_control 2>/dev/null ||
        modprobe -q "tcp_$CONGESTION" 2>/dev/null || true
    grep -qw -- "$CONGESTION" /proc/sys/net/ipv4/tcp_available_congestion_control 2>/dev/null ||
        die "the kernel has no TCP congestion control '$CONGESTION' (available: $(cat /proc/sys/net/ipv4/tcp_available_congestion_control 2>/dev/null))"
    # A namespace may only default to an algorithm the machine allows to all: add it for the run, then put
    # the list back as it was.
    ALLOWED=/proc/sys/net/ipv4/tcp_allowed_congestion_control
    allowed_before=$(cat "$ALLOWED")
    restore_allowed() {
        if [ "$(cat "$ALLOWED")" != "$allowed_before" ]; then
            echo "$allowed_before" > "$ALLOWED" || say "WARNING: could not put $ALLOWED back to: $allowed_before"
        fi
    }
    trap restore_allowed EXIT
    if ! grep -qw -- "$CONGESTION" "$ALLOWED"; then
        say "allowing $CONGESTION in $ALLOWED for this run (it was: $allowed_before)"
        echo "$allowed_before $CONGESTION" > "$ALLOWED" || die "could not add $CONGESTION to $ALLOWED"
    fi
    rc=0
    BENCH_SPDK_NETNS=1 NVPOLL_BIN_DIR=$BIN unshare -n -- bash "${BASH_SOURCE[0]}" "$@" || rc=$?
    exit "$rc"
fi
if [ -n "${BENCH_SPDK_NETNS:-}" ]; then
    ip link set lo up || die "could not bring up the namespace's loopback"
    echo "$CONGESTION" > /proc/sys/net/ipv4/tcp_congestion_control ||
        die "could not make $CONGESTION the namespace's TCP congestion control"
fi

SUBNQN=nqn.2016-06.io.spdk:bench
SUBNQN_TLS=nqn.2016-06.io.spdk:bench-tls
make_work nvpoll-bench-spdk
PLAIN_PORT=$PORT
TLS_PORT=$((PORT + 1))
TGT_PID=
on_exit_stop TGT_PID

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
  "send_mode": "$TARGET_SEND_MODE",
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
    "$BIN/nvpoll-target" --config "$WORK/target.json" --cores "$TCORE" --idle poll > "$WORK/target.log" 2>&1 &
    TGT_PID=$!
    wait_listen "$PLAIN_PORT" "$TGT_PID" "$WORK/target.log"
    wait_listen "$TLS_PORT" "$TGT_PID" "$WORK/target.log"
}

# CPU time per completed I/O of an initiator, the same way for both: its threads' user and system time
# (/proc/PID/task/*/stat, clock ticks) read twice while it measures (CPU_FROM s after it printed that it
# starts, and CPU_SPAN s later), over the I/Os it completed in that span at the rate it reports. A polled
# initiator spins its core whatever it does, so this is close to 1/IOPS; the user/system split says where
# the time went (system: the socket calls).
CPU_FROM=1
CPU_SPAN=$((TIME >= 3 ? TIME - 2 : 0))
cpu_ticks() {   # PID -> "user system" ticks summed over its threads
    cat /proc/"$1"/task/*/stat 2>/dev/null | awk '{ sub(/^.*\) /, ""); u += $12; s += $13 } END { print u + 0, s + 0 }'
}
TICK=$(getconf CLK_TCK)
# run_sampled MARKER CMD... : runs CMD in the background, output in $WORK/run.out; once MARKER shows in it,
# waits CPU_FROM s and samples the CPU ticks, then again CPU_SPAN s later. Sets CPU0 CPU1 (user system).
run_sampled() {
    local marker=$1 pid child i
    shift
    "$@" > "$WORK/run.out" 2>&1 &
    pid=$!
    CPU0=; CPU1=
    for ((i = 0; i < 400; i++)); do
        grep -q -- "$marker" "$WORK/run.out" 2>/dev/null && break
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.05
    done
    # The initiator is timeout's child.
    child=$(pgrep -P "$pid" | head -n 1 || true)
    if [ -n "$child" ] && [ "$CPU_SPAN" -gt 0 ]; then
        sleep "$CPU_FROM"; CPU0=$(cpu_ticks "$child")
        sleep "$CPU_SPAN"; CPU1=$(cpu_ticks "$child")
    fi
    wait "$pid" || true
}
cpu_per_io() {   # IOPS -> "user+sys" microseconds per I/O over the sampled span, or "-"
    local iops=$1
    if [ -z "$CPU0" ] || [ -z "$CPU1" ] || [ "$iops" = fail ] || [ "$iops" = 0 ]; then echo -; return; fi
    awk -v a="$CPU0" -v b="$CPU1" -v t="$TICK" -v span="$CPU_SPAN" -v iops="$iops" 'BEGIN {
        split(a, x, " "); split(b, y, " "); ios = iops * span
        printf "%.2f+%.2f\n", (y[1] - x[1]) / t * 1e6 / ios, (y[2] - x[2]) / t * 1e6 / ios }'
}

spdk_run() {   # sec workload bytes qd -> "IOPS CPU" (IOPS "fail" when it failed)
    local sec=$1 w=$2 b=$3 q=$4 port=$PLAIN_PORT sub=$SUBNQN args=() iops
    [ "$sec" = tls ] && { port=$TLS_PORT; sub=$SUBNQN_TLS; args=(-S ssl --psk-path "$KEYFILE"); }
    # stdbuf: its progress goes to stdout, which is a file here (block-buffered without it).
    run_sampled "Initialization complete" timeout -k 2 $((TIME + 15)) stdbuf -oL "$SPDK_PERF" --no-huge -s 512 -c "$((1 << ICORE))" \
        -q "$q" -o "$b" -w "$w" -t "$TIME" \
        -r "trtype:tcp adrfam:IPv4 traddr:127.0.0.1 trsvcid:$port subnqn:$sub hostnqn:$HOSTNQN" "${args[@]}"
    iops=$(awk -F: '/^[[:space:]]*Total[[:space:]]*:/ { split($2, a, " "); v = a[1] } END { if (v == "") print "fail"; else printf "%d\n", v }' "$WORK/run.out")
    echo "$iops $(cpu_per_io "$iops")"
}

our_run() {   # sec workload bytes qd -> "IOPS CPU" (IOPS "fail" when it failed)
    local sec=$1 w=$2 b=$3 q=$4 port=$PLAIN_PORT sub=$SUBNQN args=() out iops
    [ "$sec" = tls ] && { port=$TLS_PORT; sub=$SUBNQN_TLS; args=(--psk "$KEY" --psk-identity-version 0); }
    run_sampled "run(s) per row" timeout -k 2 $((TIME + 15)) "$BIN/nvpoll-perf" \
        --trid "trtype:tcp adrfam:IPv4 traddr:127.0.0.1 trsvcid:$port subnqn:$sub" \
        --hostnqn "$HOSTNQN" --workload "$w" --io-size "$b" --qd "$q" --jobs 1 --time "${TIME}s" --warmup 0s --runs 1 \
        --send-mode adaptive --cores "$ICORE" --json "${args[@]}"
    out=$(cat "$WORK/run.out")
    if [[ "$out" =~ \"iops\":([0-9.]+) ]]; then iops=${BASH_REMATCH[1]%.*}; else iops=fail; fi
    echo "$iops $(cpu_per_io "$iops")"
}

median() {   # values... (a "fail" makes the median "fail")
    local v
    for v in "$@"; do [ "$v" != fail ] || { echo fail; return; }; done
    printf '%s\n' "$@" | sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'
}

declare -A RUNS_OF   # [target/initiator/sec/cell] = the IOPS of each round, space-separated
declare -A CPU_OF    # [target/initiator/sec/cell] = the CPU per I/O of each round ("user+sys" us), space-separated
declare -A RESULT    # [target/initiator/sec/cell] = their median
measure_cell() {   # spdk|ours round sec cell
    local tgt=$1 round=$2 sec=$3 cell=$4 w s q b a o ac oc
    IFS=: read -r w s q <<< "$cell"
    b=$(bytes "$s")
    read -r a ac <<< "$(spdk_run "$sec" "$w" "$b" "$q")"
    read -r o oc <<< "$(our_run "$sec" "$w" "$b" "$q")"
    RUNS_OF[$tgt/spdk/$sec/$cell]+="$a "
    RUNS_OF[$tgt/ours/$sec/$cell]+="$o "
    CPU_OF[$tgt/spdk/$sec/$cell]+="$ac "
    CPU_OF[$tgt/ours/$sec/$cell]+="$oc "
    say "round $round/$RUNS, $tgt target, $sec $w $s qd$q: spdk_nvme_perf $a (CPU $ac us/IO), our perf $o (CPU $oc us/IO)"
}
# BENCH_CONTROL: SPDK's pair once more (A'), on a fresh nvmf_tgt, after the cell's other runs.
measure_control() {   # round sec cell
    local round=$1 sec=$2 cell=$3 w s q b a ac
    IFS=: read -r w s q <<< "$cell"
    b=$(bytes "$s")
    read -r a ac <<< "$(spdk_run "$sec" "$w" "$b" "$q")"
    RUNS_OF[control/spdk/$sec/$cell]+="$a "
    say "round $round/$RUNS, control, $sec $w $s qd$q: spdk_nvme_perf -> nvmf_tgt again $a (CPU $ac us/IO)"
}
# The cache-line round trip between the target's core and the initiator's (nvpoll-core-rtt), measured
# while nothing runs there: on a VM the hypervisor moves the virtual CPUs, and this round trip (70, 110 or
# 500 ns on the development VM) moved our pair's 4 KiB qd128 reads between 1M and 0.5M IOPS (issue 47). It
# is taken before each target starts and after the last stops, and printed with the round.
rtt() {
    local out
    if [ -x "$BIN/nvpoll-core-rtt" ] && out=$("$BIN/nvpoll-core-rtt" "$TCORE" "$ICORE" --rounds 5000 2>/dev/null) &&
        [[ "$out" =~ round\ trip\ ([0-9]+)\ ns ]]; then
        echo "${BASH_REMATCH[1]}"
    else
        echo "?"
    fi
}
declare -A RTT_OF   # [sec/cell] = each round's round trips, "r1a/r1b/r1c r2a/..."
RTT_CHANGED=()      # "round N, sec cell: a/b/c ns" where the round trip moved by more than half within a cell
note_rtt() {   # round sec cell "a b c"
    local round=$1 sec=$2 cell=$3 v lo=0 hi=0 joined
    read -r -a v <<< "$4"
    joined=$(IFS=/; echo "${v[*]}")
    RTT_OF[$sec/$cell]+="$joined "
    for x in "${v[@]}"; do
        [ "$x" != "?" ] || return 0
        if [ "$lo" = 0 ] || [ "$x" -lt "$lo" ]; then lo=$x; fi
        if [ "$x" -gt "$hi" ]; then hi=$x; fi
    done
    if [ $((hi * 2)) -gt $((lo * 3)) ]; then RTT_CHANGED+=("round $round, $sec $cell: $joined ns"); fi
}

with_target() {   # spdk|ours: start it (a fresh process)
    if [ "$1" = spdk ]; then start_spdk; else start_ours; fi
}
stop_target() { stop_pid "$TGT_PID"; TGT_PID=; }

CPU_MODEL=$(awk -F: '/^model name/ { sub(/^[ \t]+/, "", $2); print $2; exit }' /proc/cpuinfo 2>/dev/null)
CC=$(cat /proc/sys/net/ipv4/tcp_congestion_control 2>/dev/null || echo unknown)
if [ -n "${BENCH_SPDK_NETNS:-}" ]; then
    say "machine: ${CPU_MODEL:-unknown CPU}, $(nproc) CPUs, Linux $(uname -r); this run in a network namespace of its own, every socket (SPDK's and ours) on TCP congestion control $CC (BENCH_CONGESTION; the machine's default is not changed)"
else
    say "machine: ${CPU_MODEL:-unknown CPU}, $(nproc) CPUs, Linux $(uname -r), TCP congestion control $CC (the system's: BENCH_CONGESTION=system)"
    if [ "$CC" = bbr ]; then
        say "SPDK's sockets keep the system's bbr; ours move loopback connections to cubic (nvpoll's default: under bbr a loopback connection's speed depends on the round trip it measured first)"
    fi
fi
say "SPDK at $SPDK_DIR; ours from $BIN; target core $TCORE, initiator core $ICORE; ${RUNS} round(s) of ${TIME}s per initiator and cell; our target sends $TARGET_SEND_MODE"
CONTROL_RTT=
if [ "$CONTROL" = 1 ]; then
    say "control: SPDK's pair runs again after C and D in every cell and round (A')"
    CONTROL_RTT=", after the control"
fi
for round in $(seq "$RUNS"); do
    if [ "$ORDER" = cell ]; then
        for sec in "${SECURITY[@]}"; do
            for cell in "${CELLS[@]}"; do
                rtts=$(rtt)
                for tgt in spdk ours; do
                    with_target "$tgt"
                    measure_cell "$tgt" "$round" "$sec" "$cell"
                    stop_target
                    rtts+=" $(rtt)"
                done
                if [ "$CONTROL" = 1 ]; then
                    with_target spdk
                    measure_control "$round" "$sec" "$cell"
                    stop_target
                    rtts+=" $(rtt)"
                fi
                note_rtt "$round" "$sec" "$cell" "$rtts"
                say "round $round/$RUNS, $sec $cell: core $TCORE <-> core $ICORE cache-line round trip ${rtts// //} ns (before, between, after the targets${CONTROL_RTT})"
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

# The ratio x / sqrt(a * c) within each round, over the rounds: bracket_ratio "x1 x2 ..." "a1 ..." "c1 ..." ->
# "median (min-max)". With BENCH_CONTROL, a is the cell's first run (A) and c its last (A'); a plain ratio x/a
# is paired_ratio.
bracket_ratio() {
    local -a x a c r=()
    local i
    read -r -a x <<< "$1"
    read -r -a a <<< "$2"
    read -r -a c <<< "$3"
    for i in "${!x[@]}"; do
        if [ "${x[$i]}" = fail ] || [ "${a[$i]:-fail}" = fail ] || [ "${a[$i]}" = 0 ] ||
            [ "${c[$i]:-fail}" = fail ] || [ "${c[$i]}" = 0 ]; then echo -; return; fi
        r+=("$(awk -v x="${x[$i]}" -v y="${a[$i]}" -v z="${c[$i]}" 'BEGIN { printf "%.4f", x / sqrt(y * z) }')")
    done
    printf '%s\n' "${r[@]}" | sort -g | awk '{ v[NR] = $1 } END { printf "%.2f (%.2f-%.2f)", v[int((NR + 1) / 2)], v[1], v[NR] }'
}
# The ratio a/b within each round, over the rounds: paired_ratio "a1 a2 ..." "b1 b2 ..." -> "median (min-max)"
paired_ratio() { bracket_ratio "$1" "$2" "$2"; }
# The spread of one pairing's IOPS over the rounds: highest / lowest.
spread() {
    local v
    for v in $1; do [ "$v" != fail ] && [ "$v" != 0 ] || { echo -; return; }; done
    # shellcheck disable=SC2086 # the runs are space-separated on purpose
    printf '%s\n' $1 | sort -n | awk '{ v[NR] = $1 } END { printf "%.2f", v[NR] / v[1] }'
}
# The median CPU per I/O over the rounds: "user+sys" values -> "total (user+sys)".
cpu_median() {
    local v
    for v in $1; do [ "$v" != - ] || { echo -; return; }; done
    # shellcheck disable=SC2086 # the runs are space-separated on purpose
    printf '%s\n' $1 | awk -F+ '{ printf "%.4f %s %s\n", $1 + $2, $1, $2 }' | sort -g |
        awk '{ t[NR] = $1; u[NR] = $2; s[NR] = $3 } END { m = int((NR + 1) / 2); printf "%.2f (%.2f+%.2f)", t[m], u[m], s[m] }'
}
echo
echo "$PROG: median IOPS over $RUNS round(s), 1 queue pair, loopback (initiator -> target); ${CPU_MODEL:-unknown CPU}"
printf '| %-5s | %-18s | %11s | %11s | %11s | %11s | %-17s | %-17s | %-17s | %7s | %7s |\n' sec cell "A spdk>spdk" "B ours>spdk" "C spdk>ours" "D ours>ours" "B/A" "C/A" "D/A" "A hi/lo" "D hi/lo"
echo "|-------|--------------------|-------------|-------------|-------------|-------------|-------------------|-------------------|-------------------|---------|---------|"
for sec in "${SECURITY[@]}"; do
    for cell in "${CELLS[@]}"; do
        base=${RUNS_OF[spdk/spdk/$sec/$cell]}
        printf '| %-5s | %-18s | %11s | %11s | %11s | %11s | %-17s | %-17s | %-17s | %7s | %7s |\n' "$sec" "$cell" \
            "${RESULT[spdk/spdk/$sec/$cell]}" "${RESULT[spdk/ours/$sec/$cell]}" \
            "${RESULT[ours/spdk/$sec/$cell]}" "${RESULT[ours/ours/$sec/$cell]}" \
            "$(paired_ratio "${RUNS_OF[spdk/ours/$sec/$cell]}" "$base")" \
            "$(paired_ratio "${RUNS_OF[ours/spdk/$sec/$cell]}" "$base")" \
            "$(paired_ratio "${RUNS_OF[ours/ours/$sec/$cell]}" "$base")" \
            "$(spread "$base")" "$(spread "${RUNS_OF[ours/ours/$sec/$cell]}")"
    done
done
if [ "$ORDER" = cell ]; then
    echo
    echo "$PROG: core $TCORE <-> core $ICORE cache-line round trip (ns) around each cell, by round"
    for sec in "${SECURITY[@]}"; do
        for cell in "${CELLS[@]}"; do
            printf '  %-5s %-18s %s\n' "$sec" "$cell" "${RTT_OF[$sec/$cell]}"
        done
    done
    if [ "${#RTT_CHANGED[@]}" -gt 0 ]; then
        echo "WARNING: the machine changed during these cells (the round trip moved by more than half): their"
        echo "runs did not all run on the same machine, and their ratios mix two machines:"
        printf '  %s\n' "${RTT_CHANGED[@]}"
    fi
fi
echo "A: spdk_nvme_perf against SPDK's nvmf_tgt, B: our perf against nvmf_tgt, C: spdk_nvme_perf against our"
echo "target, D: our perf against our target. Each ratio is the median over the rounds of the ratio within a"
echo "round, with its lowest and highest; the IOPS columns are medians over the rounds; hi/lo is a pairing's"
echo "highest IOPS over its lowest."
if [ "$CONTROL" = 1 ]; then
    echo
    echo "$PROG: control, SPDK's pair against itself: A' (spdk_nvme_perf -> a fresh nvmf_tgt, after C and D) over A"
    printf '| %-5s | %-18s | %11s | %11s | %-17s | %8s | %-17s | %-17s | %-17s |\n' sec cell "A" "A'" "A'/A" "A' hi/lo" \
        "B/bracket" "C/bracket" "D/bracket"
    echo "|-------|--------------------|-------------|-------------|-------------------|----------|-------------------|-------------------|-------------------|"
    for sec in "${SECURITY[@]}"; do
        for cell in "${CELLS[@]}"; do
            base=${RUNS_OF[spdk/spdk/$sec/$cell]}
            ctl=${RUNS_OF[control/spdk/$sec/$cell]}
            printf '| %-5s | %-18s | %11s | %11s | %-17s | %8s | %-17s | %-17s | %-17s |\n' "$sec" "$cell" \
                "${RESULT[spdk/spdk/$sec/$cell]}" "${RESULT[control/spdk/$sec/$cell]}" \
                "$(paired_ratio "$ctl" "$base")" "$(spread "$ctl")" \
                "$(bracket_ratio "${RUNS_OF[spdk/ours/$sec/$cell]}" "$base" "$ctl")" \
                "$(bracket_ratio "${RUNS_OF[ours/spdk/$sec/$cell]}" "$base" "$ctl")" \
                "$(bracket_ratio "${RUNS_OF[ours/ours/$sec/$cell]}" "$base" "$ctl")"
        done
    done
    echo "The same binaries, the same pairing, seconds apart: how far a ratio moves on this machine with no change"
    echo "in either stack. A ratio above (or a round of one below) this range says something; one within it does not."
    echo "X/bracket: each pairing over the geometric mean of A (the cell's first run) and A' (its last) in the same"
    echo "round, so that a drift of the machine across the cell's runs weighs on the reference as on them."
fi
if [ "$CPU_SPAN" -gt 0 ]; then
    echo
    echo "$PROG: initiator CPU per I/O against SPDK's target, microseconds (user+system), median over the rounds"
    printf '| %-5s | %-18s | %-22s | %-22s |\n' sec cell "spdk_nvme_perf" "our perf"
    echo "|-------|--------------------|------------------------|------------------------|"
    for sec in "${SECURITY[@]}"; do
        for cell in "${CELLS[@]}"; do
            printf '| %-5s | %-18s | %-22s | %-22s |\n' "$sec" "$cell" \
                "$(cpu_median "${CPU_OF[spdk/spdk/$sec/$cell]}")" "$(cpu_median "${CPU_OF[spdk/ours/$sec/$cell]}")"
        done
    done
    echo "Each initiator's threads' CPU time (/proc/PID/task/*/stat) over ${CPU_SPAN} s of its run, from ${CPU_FROM} s after"
    echo "it started measuring, per I/O at the rate it reported. A polled initiator spins its core, so this"
    echo "is near 1/IOPS; the split says how much went to the kernel."
else
    echo "(CPU per I/O needs BENCH_TIME of 3 s or more.)"
fi

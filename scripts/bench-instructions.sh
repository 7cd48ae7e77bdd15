#!/usr/bin/env bash
# scripts/bench-instructions.sh - user-space instructions per I/O of our perf and spdk_nvme_perf, counted by
# callgrind, against one SPDK nvmf_tgt on loopback.
#
# usage: SPDK_DIR=/path/to/spdk scripts/bench-instructions.sh
#
# Where a VM gives no hardware counters (perf stat's instructions), callgrind counts every instruction an
# initiator executes in user space. Only each initiator's measuring loop counts, with everything it calls:
# SPDK perf's work_fn; our perf's job poll and flush (the reactor's own loop around them, about a tenth of
# ours, is left out), so that start-up does not. Each initiator runs twice under callgrind per cell, for
# INSN_SHORT and INSN_LONG seconds, and the figure is (the loop's instructions in the long run - in the short
# one) / (I/Os of the long run - of the short one): what the loop does once per run cancels. Under callgrind
# an initiator runs about 50 times slower, so the target always has room: this is the initiator-bound case,
# where what an initiator spends per I/O decides its IOPS. Kernel time is not in those instructions; where
# `perf stat` has the syscall tracepoints, the same difference counts the initiator's socket and polling
# system calls per I/O (recvfrom, sendto, recvmsg, sendmsg, readv, writev, read, write, epoll_wait,
# epoll_pwait, poll, ppoll, io_uring_enter; the whole process) in the same runs. Both initiators run against
# SPDK's target, which completes a read with its C2HData (SUCCESS flag) for both, so each receives the same
# PDUs. Our perf runs with a minute per connect step and no keep-alive (see run_cg).
#
# Knobs (environment): SPDK_DIR (required; without it the script says SKIPPED and exits 0), NVPOLL_BIN_DIR,
# INSN_CELLS (sec:workload:size:qd list, default plain:randread:4k:128,plain:randwrite:4k:128,
# plain:randread:4k:1,tls:randread:4k:128,tls:randwrite:4k:128), INSN_SHORT=2, INSN_LONG=6, INSN_PORT=4570,
# BENCH_TARGET_CORE=0, BENCH_INITIATOR_CORE=1, INSN_TOP=0 (N > 0: also each initiator's N costliest
# functions of the long run of the last cell, self instructions per I/O).
set -euo pipefail

PROG=bench-instructions
# shellcheck source=scripts/spdk-common.sh
. "$(dirname "${BASH_SOURCE[0]}")/spdk-common.sh"

command -v valgrind >/dev/null 2>&1 || die "valgrind is missing: apt-get install valgrind"
command -v callgrind_annotate >/dev/null 2>&1 || die "callgrind_annotate is missing: apt-get install valgrind"
SHORT=${INSN_SHORT:-2}
LONG=${INSN_LONG:-6}
TOP=${INSN_TOP:-0}
for v in "$SHORT" "$LONG" "$TOP"; do [[ "$v" =~ ^[0-9]+$ ]] || die "INSN_SHORT, INSN_LONG and INSN_TOP are whole numbers"; done
[ "$LONG" -gt "$SHORT" ] && [ "$SHORT" -gt 0 ] || die "INSN_LONG must be above INSN_SHORT, and INSN_SHORT above 0"
IFS=, read -r -a CELLS <<< "${INSN_CELLS:-plain:randread:4k:128,plain:randwrite:4k:128,plain:randread:4k:1,tls:randread:4k:128,tls:randwrite:4k:128}"
SIZES_VAR=INSN_CELLS
for c in "${CELLS[@]}"; do
    IFS=: read -r sec w s q <<< "$c"
    case "$sec" in plain|tls) ;; *) die "INSN_CELLS: '$c' must start with plain: or tls:" ;; esac
    case "$w" in randread|randwrite|read|write) ;; *) die "INSN_CELLS: unknown workload '$w' in '$c'" ;; esac
    bytes "$s" >/dev/null
    [[ "$q" =~ ^[0-9]+$ ]] && [ "$q" -gt 0 ] || die "INSN_CELLS: bad queue depth in '$c'"
done
PORT=${INSN_PORT:-4570}
TCORE=${BENCH_TARGET_CORE:-0}
ICORE=${BENCH_INITIATOR_CORE:-1}

our_binaries
SUBNQN=nqn.2016-06.io.spdk:insn
SUBNQN_TLS=nqn.2016-06.io.spdk:insn-tls
make_work nvpoll-bench-instructions
PLAIN_PORT=$PORT
TLS_PORT=$((PORT + 1))
SPDK_TGT_PID=
on_exit_stop SPDK_TGT_PID

spdk_tgt_launch
spdk_tgt_configure "$PLAIN_PORT" "$TLS_PORT"

SYSCALLS=(recvfrom sendto recvmsg sendmsg readv writev read write epoll_wait epoll_pwait poll ppoll io_uring_enter)
SYSCALL_EVENTS=$(printf 'syscalls:sys_enter_%s,' "${SYSCALLS[@]}")
SYSCALL_EVENTS=${SYSCALL_EVENTS%,}
COUNT=()
if command -v perf >/dev/null 2>&1 && perf stat -x, -o /dev/null -e "$SYSCALL_EVENTS" -- true 2>/dev/null; then
    COUNT=(perf stat -x, -o "$WORK/syscalls" -e "$SYSCALL_EVENTS" --)
else
    say "perf stat has no syscall tracepoints here: the sys/IO columns stay empty"
fi

# run_cg WHO SEC W BYTES QD SECONDS -> "instructions ios syscalls", the callgrind output in $WORK/cg.WHO.SECONDS
run_cg() {
    local who=$1 sec=$2 w=$3 b=$4 q=$5 t=$6 port=$PLAIN_PORT sub=$SUBNQN out iops ir sc=-
    [ "$sec" = tls ] && { port=$TLS_PORT; sub=$SUBNQN_TLS; }
    out=$WORK/cg.$who.$t
    rm -f "$WORK/syscalls"
    local vg=("${COUNT[@]}" timeout -k 5 $((t * 3 + 120)) valgrind --tool=callgrind --callgrind-out-file="$out")
    if [ "$who" = spdk ]; then
        local args=()
        [ "$sec" = tls ] && args=(-S ssl --psk-path "$KEYFILE")
        "${vg[@]}" "$SPDK_PERF" --no-huge -s 512 -c "$((1 << ICORE))" -q "$q" -o "$b" -w "$w" -t "$t" \
            -r "trtype:tcp adrfam:IPv4 traddr:127.0.0.1 trsvcid:$port subnqn:$sub hostnqn:$HOSTNQN" \
            "${args[@]}" > "$WORK/run.out" 2> "$WORK/vg.log" || true
        iops=$(awk -F: '/^[[:space:]]*Total[[:space:]]*:/ { split($2, a, " "); v = a[1] } END { print v }' "$WORK/run.out")
    else
        local args=()
        # Under callgrind a TLS handshake's key generation takes seconds, and valgrind runs one thread at a time,
        # which can starve the thread that sends keep-alives: a minute per connect step, and no keep-alive.
        args=(--connect-timeout 60s --kato 0)
        [ "$sec" = tls ] && args+=(--psk "$KEY" --psk-identity-version 0)
        "${vg[@]}" "$BIN/nvpoll-perf" --trid "trtype:tcp adrfam:IPv4 traddr:127.0.0.1 trsvcid:$port subnqn:$sub" \
            --hostnqn "$HOSTNQN" --workload "$w" --io-size "$b" --qd "$q" --jobs 1 --time "${t}s" --warmup 0s \
            --runs 1 --send-mode adaptive --cores "$ICORE" --json "${args[@]}" > "$WORK/run.out" 2> "$WORK/vg.log" || true
        iops=$(grep -o '"iops":[0-9.]*' "$WORK/run.out" | head -n 1 | cut -d: -f2)
    fi
    # Only each initiator's measuring loop counts, inclusive of what it calls: SPDK perf's work_fn, our
    # perf's job poll and flush (the queue pair's receive and completions, and the end-of-pass send with its
    # TLS sealing); not start-up, where a reactor may spin while a queue connects on another thread that
    # valgrind runs slowly. (callgrind's --toggle-collect missed our job's flush: summed from the profile.)
    local loop='app/spdk_nvme_perf/perf.c:work_fn \['
    [ "$who" = ours ] && loop='loadgen::Job<Q> as nvpoll::reactor::Poller>::(poll|flush) \['
    ir=$(callgrind_annotate --inclusive=yes "$out" 2>/dev/null |
        awk -v re="$loop" '$0 ~ re { v = $1; gsub(",", "", v); n += v; k++ } END { if (k) printf "%.0f\n", n }')
    [ -s "$WORK/syscalls" ] && sc=$(awk -F, '$3 ~ /^syscalls:/ { n += $1 } END { print n + 0 }' "$WORK/syscalls")
    if [ -z "$iops" ] || [ -z "$ir" ]; then
        echo "---- $who $sec $w $b qd$q ${t}s ----" >&2; tail -n 15 "$WORK/run.out" "$WORK/vg.log" >&2
        echo "fail fail -"; return
    fi
    awk -v ir="$ir" -v iops="$iops" -v t="$t" -v sc="$sc" 'BEGIN { printf "%.0f %.0f %s\n", ir, iops * t, sc }'
}

per_io() {   # FIELD "ir ios syscalls" (short) "ir ios syscalls" (long) -> FIELD (0: instructions, 2: syscalls) per I/O
    local f=$1 a b
    read -r -a a <<< "$2"; read -r -a b <<< "$3"
    if [ "${a[0]}" = fail ] || [ "${b[0]}" = fail ] || [ "${a[$f]}" = - ] || [ "${b[1]}" -le "${a[1]}" ]; then
        echo -; return
    fi
    awk -v i0="${a[$f]}" -v n0="${a[1]}" -v i1="${b[$f]}" -v n1="${b[1]}" -v f="$f" 'BEGIN {
        v = (i1 - i0) / (n1 - n0); if (v < 0) print "-"; else if (f == 0) printf "%d\n", v; else printf "%.2f\n", v }'
}

say "$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), $(nproc) CPUs, $(uname -r); nvmf_tgt on core $TCORE, initiator on core $ICORE; callgrind runs of ${SHORT} s and ${LONG} s"
printf '\n| %-5s | %-16s | %12s | %12s | %9s | %12s | %12s | %12s | %12s |\n' sec cell "spdk insn/IO" "ours insn/IO" "ours/spdk" \
    "spdk sys/IO" "ours sys/IO" "spdk IOPS cg" "ours IOPS cg"
printf '|%s|%s|%s|%s|%s|%s|%s|%s|%s|\n' "-------" "------------------" "--------------" "--------------" "-----------" \
    "--------------" "--------------" "--------------" "--------------"
for c in "${CELLS[@]}"; do
    IFS=: read -r sec w s q <<< "$c"
    b=$(bytes "$s")
    declare -A PER=() SYS=() RATE=()
    for who in spdk ours; do
        # A pair whose difference says nothing (a run failed, or the long one counted fewer instructions than
        # the short: a slow start under callgrind) is run once more, and said.
        for try in 1 2; do
            short=$(run_cg "$who" "$sec" "$w" "$b" "$q" "$SHORT")
            long=$(run_cg "$who" "$sec" "$w" "$b" "$q" "$LONG")
            PER[$who]=$(per_io 0 "$short" "$long")
            SYS[$who]=$(per_io 2 "$short" "$long")
            [[ "${PER[$who]}" =~ ^[0-9]+$ ]] && break
            say "$who, $sec $w:$s:$q: no figure from runs of ${SHORT} s ($short) and ${LONG} s ($long)$([ "$try" = 1 ] && echo ", once more")"
        done
        read -r -a l <<< "$long"
        if [ "${l[1]}" = fail ]; then RATE[$who]=fail; else RATE[$who]=$((l[1] / LONG)); fi
    done
    ratio=$(awk -v a="${PER[spdk]}" -v o="${PER[ours]}" 'BEGIN { if (a + 0 > 0 && o + 0 > 0) printf "%.2f", o / a; else print "-" }')
    printf '| %-5s | %-16s | %12s | %12s | %9s | %12s | %12s | %12s | %12s |\n' "$sec" "$w:$s:$q" "${PER[spdk]}" \
        "${PER[ours]}" "$ratio" "${SYS[spdk]}" "${SYS[ours]}" "${RATE[spdk]}" "${RATE[ours]}"
done
echo
say "insn/IO: user-space instructions per I/O (callgrind); sys/IO: socket and polling system calls per I/O;"
say "IOPS cg: the IOPS of each initiator under callgrind (about 50x slower than without), for the record"
if [ "$TOP" -gt 0 ]; then
    for who in spdk ours; do
        read -r -a l <<< "$(run_cg "$who" "$sec" "$w" "$b" "$q" "$LONG")"
        [ "${l[1]}" != fail ] || continue
        echo
        say "$who, $sec $w:$s:$q, the $TOP costliest functions of a ${LONG} s run, self instructions per I/O:"
        callgrind_annotate "$WORK/cg.$who.$LONG" 2>/dev/null |
            awk -v n="$TOP" -v ios="${l[1]}" '/^-+$/ { dash++; next } dash >= 3 && /^ *[0-9,]+ / && !/PROGRAM TOTALS/ {
                v = $1; gsub(",", "", v); f = $0; sub(/^ *[0-9,]+ +(\([^)]*\) +)?/, "", f); sub(/ \[.*$/, "", f)
                sub(/^[^:]*:/, "", f); printf "  %8.1f  %s\n", v / ios, f; if (++k >= n) exit }'
    done
fi

#!/usr/bin/env bash
# scripts/vm-tests/25-kernel-multipath-our-target.sh - the Linux kernel host's
# native NVMe multipath against nvpoll's target (nvpoll-target) reporting
# ANA, inside the guest of scripts/vm.sh (scripts/vm-test.sh runs it there).
#
#  1. starts nvpoll-target (--config, --rpc-socket, --idle hybrid) with
#     one subsystem on two listeners, 127.0.0.1:4440 and 127.0.0.1:4441, open
#     to any host, with one 64 MiB file namespace in ANA group 1;
#  2. the kernel must have native multipath (nvme_core multipath=Y);
#  3. nvme connect to both listeners: nvme list-subsys must show the two
#     controllers live, the namespace must be ONE block device (the multipath
#     head nvmeXnY; the paths nvmeXcYnZ have no device node), and each path's
#     ana_state must be "optimized" in ANA group 1; with no I/O running, a
#     change made over the control socket (4441 non-optimized, then back)
#     must reach the kernel (the ANA change event, then the ANA log page);
#  4. with the subsystem's iopolicy set to round-robin (so both optimized
#     paths carry I/O), fio randwrite 4k (libaio, direct, iodepth 16) with
#     --verify=crc32c --verify_backlog runs time-based on the head device
#     while, through ana_state_set: I/O must flow on both paths; 4440 goes
#     inaccessible: the kernel's ana_state of that path must follow within a
#     bounded time, its I/O counters must stop while the other path's grow;
#     4440 back to optimized: both paths carry I/O again; the same with 4441;
#     both restored; fio must then finish with exit status 0 and no error;
#  5. nvme disconnect (both controllers), then SIGINT: the target must exit 0
#     having sent no C2HTermReq and hit no internal error.
#
# Exits non-zero with a message naming the failed step. Knobs: NVPOLL_MP_FIO_SECS
# (fio's runtime, default 40), NVPOLL_MP_WAIT_SECS (the bound of each wait,
# default 30).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)
ADDR=127.0.0.1
PORT_A=4440
PORT_B=4441
NQN=nqn.2024-01.io.nvpoll:vm-multipath
EXAMPLES=${NVPOLL_BIN_DIR:-$ROOT/target/debug}
BIN=$EXAMPLES/nvpoll-target
RPC=$EXAMPLES/nvpoll-rpc
FIO_SECS=${NVPOLL_MP_FIO_SECS:-40}
WAIT_SECS=${NVPOLL_MP_WAIT_SECS:-30}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/nvpoll-kernel-multipath.XXXXXX")
LOG=$WORK/target.log
SOCK=$WORK/rpc.sock
FIOLOG=$WORK/fio.log
TPID=
FPID=
T0=$EPOCHREALTIME
DMESG0=$(dmesg 2>/dev/null | wc -l)

say()  { echo "kernel-multipath: [+$(since "$T0")s] $*"; }
fail() { echo "kernel-multipath: FAIL $*" >&2; exit 1; }
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
# the kernel's NVMe lines since the script started
kernel_lines() { dmesg 2>/dev/null | tail -n +"$((DMESG0 + 1))" | grep -Ei 'nvme|ana' || true; }

# shellcheck disable=SC2317  # invoked by the EXIT trap
cleanup() {
    local rc=$?
    if [ -n "$FPID" ] && kill -0 "$FPID" 2>/dev/null; then
        kill -TERM "$FPID" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$FPID" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$FPID" 2>/dev/null || true
    fi
    nvme disconnect -n "$NQN" >/dev/null 2>&1 || true
    if [ -n "$TPID" ] && kill -0 "$TPID" 2>/dev/null; then
        kill -INT "$TPID" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$TPID" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$TPID" 2>/dev/null || true
    fi
    if [ "$rc" != 0 ]; then
        [ ! -f "$LOG" ] || { echo "---- target log"; cat "$LOG"; }
        [ ! -f "$FIOLOG" ] || { echo "---- fio log"; cat "$FIOLOG"; }
        echo "---- kernel log (NVMe lines since the start)"; kernel_lines; echo "----"
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT

host_args=()
[ -n "${VM_HOSTNQN:-}" ] && host_args+=(--hostnqn "$VM_HOSTNQN")
[ -n "${VM_HOSTID:-}" ] && host_args+=(--hostid "$VM_HOSTID")

# Polls COMMAND... every 0.1 s until it succeeds, for at most WAIT_SECS.
wait_for() {
    local deadline
    deadline=$(awk -v a="$EPOCHREALTIME" -v s="$WAIT_SECS" 'BEGIN { printf "%.3f", a + s }')
    while ! "$@"; do
        awk -v a="$EPOCHREALTIME" -v d="$deadline" 'BEGIN { exit !(a < d) }' || return 1
        sleep 0.1
    done
}

subsys_dir() {   # the kernel's nvme-subsystem folder of NQN
    local d
    for d in /sys/class/nvme-subsystem/*; do
        [ "$(cat "$d/subsysnqn" 2>/dev/null)" = "$NQN" ] && { echo "$d"; return 0; }
    done
    return 1
}

ctrl_of() {   # PORT -> the controller (nvmeN) of NQN connected through it
    local d
    for d in /sys/class/nvme/nvme*; do
        [ "$(cat "$d/subsysnqn" 2>/dev/null)" = "$NQN" ] || continue
        [[ "$(cat "$d/address" 2>/dev/null)" =~ (^|,)trsvcid=$1(,|$) ]] && { echo "${d##*/}"; return 0; }
    done
    return 1
}

path_of() {   # CTRL -> its path namespace of namespace 1 (nvmeXcYn1)
    local p
    for p in /sys/class/nvme/"$1"/nvme*c*n1; do
        [ -f "$p/ana_state" ] && { echo "${p##*/}"; return 0; }
    done
    return 1
}

# the path (nvmeXcYn1) through PORT, once both exist
path_ready() { local c; c=$(ctrl_of "$1") && path_of "$c" >/dev/null; }
ana_of() { cat "/sys/class/nvme/${CTRL[$1]}/${PATH_NS[$1]}/ana_state" 2>/dev/null; }
ana_is() { [ "$(ana_of "$1")" = "$2" ]; }
# I/Os the path through PORT completed: reads + writes of its stat file
ios_of() {
    local r w
    read -r r _ _ _ w _ < "/sys/class/nvme/${CTRL[$1]}/${PATH_NS[$1]}/stat" || return 1
    echo $((r + w))
}
grown() { [ $(($(ios_of "$1") - $2)) -ge "$3" ]; }   # PORT BASE MIN
fio_running() { [ -n "$FPID" ] && kill -0 "$FPID" 2>/dev/null; }

set_ana() {   # STEP PORT STATE
    local out
    out=$("$RPC" -s "$SOCK" ana_state_set nqn="$NQN" listener="$ADDR:$2" group=1 state="$3" 2>&1) \
        || fail "$1: ana_state_set $ADDR:$2 $3: $out"
    grep -q "\"state\": \"$3\"" <<< "$out" || fail "$1: ana_state_set $ADDR:$2 $3 answered: $out"
}

# STEP PORT STATE: the kernel's ana_state of PORT's path must become STATE within WAIT_SECS
kernel_follows() {
    local t=$EPOCHREALTIME
    wait_for ana_is "$2" "$3" \
        || fail "$1: the kernel's ana_state of the path through $2 (${PATH_NS[$2]}) is still '$(ana_of "$2")' after ${WAIT_SECS}s, not $3"
    say "kernel: ${PATH_NS[$2]} (port $2) ana_state $3 after $(since "$t")s"
}

# STEP: I/O flows on both paths (each completes at least 64 I/Os)
both_flow() {
    local a b
    fio_running || fail "$1: fio is no longer running (NVPOLL_MP_FIO_SECS=$FIO_SECS too short here?)"
    a=$(ios_of $PORT_A) b=$(ios_of $PORT_B)
    wait_for grown $PORT_A "$a" 64 || fail "$1: no I/O on the path through $PORT_A (${PATH_NS[$PORT_A]}): $a -> $(ios_of $PORT_A) in ${WAIT_SECS}s"
    wait_for grown $PORT_B "$b" 64 || fail "$1: no I/O on the path through $PORT_B (${PATH_NS[$PORT_B]}): $b -> $(ios_of $PORT_B) in ${WAIT_SECS}s"
    say "ok: I/O on both paths: $PORT_A $a -> $(ios_of $PORT_A), $PORT_B $b -> $(ios_of $PORT_B)"
}

# STEP LIVE DEAD: after a first 64 I/Os on LIVE (what DEAD had in flight is
# done by then), LIVE completes 256 more while DEAD completes none
only_flows() {
    local live=$2 dead=$3 l d l2 d2
    fio_running || fail "$1: fio is no longer running (NVPOLL_MP_FIO_SECS=$FIO_SECS too short here?)"
    l=$(ios_of "$live")
    wait_for grown "$live" "$l" 64 || fail "$1: I/O did not move to the path through $live: $l -> $(ios_of "$live") in ${WAIT_SECS}s"
    l=$(ios_of "$live") d=$(ios_of "$dead")
    wait_for grown "$live" "$l" 256 || fail "$1: I/O stalled on the path through $live: $l -> $(ios_of "$live") in ${WAIT_SECS}s"
    l2=$(ios_of "$live") d2=$(ios_of "$dead")
    [ "$d2" = "$d" ] || fail "$1: the inaccessible path through $dead still completes I/O: $d -> $d2 (while $live: $l -> $l2)"
    say "ok: I/O only on $live: $live $l -> $l2, inaccessible $dead $d -> $d2"
}

# ---- 1. the target -----------------------------------------------------------
[ -x "$BIN" ] || fail "step 1: no nvpoll-target at $BIN (build it: cargo build --bins)"
[ -x "$RPC" ] || fail "step 1: no nvpoll-rpc at $RPC (build it: cargo build --bins)"
command -v fio >/dev/null || fail "step 1: no fio in the guest"
command -v nvme >/dev/null || fail "step 1: no nvme-cli in the guest"
truncate -s 64M "$WORK/ns1.img" || fail "step 1: cannot make the namespace's file"
cat > "$WORK/target.json" <<EOF
{
  "listeners": [ {"address": "$ADDR:$PORT_A"}, {"address": "$ADDR:$PORT_B"} ],
  "subsystems": [ {
      "nqn": "$NQN", "allow_any_host": true,
      "namespaces": [ {"nsid": 1, "file": "$WORK/ns1.img", "block_size": 512, "ana_group": 1} ]
  } ]
}
EOF
core=$(( $(nproc) - 1 ))
"$BIN" --config "$WORK/target.json" --rpc-socket "$SOCK" --idle hybrid --cores "$core" > "$LOG" 2>&1 &
TPID=$!
for _ in $(seq 100); do grep -q "^control socket:" "$LOG" && break; kill -0 "$TPID" 2>/dev/null || break; sleep 0.1; done
grep -q "^control socket:" "$LOG" || fail "step 1: the target did not start"
for p in $PORT_A $PORT_B; do
    grep -q "^listener $ADDR:$p " "$LOG" || fail "step 1: the target does not listen on $ADDR:$p"
done
say "target running (pid $TPID, reactor on core $core): $NQN on $ADDR:$PORT_A and $ADDR:$PORT_B"

# ---- 2. native multipath ---------------------------------------------------------
modprobe nvme-tcp 2>/dev/null || true
mp=$(cat /sys/module/nvme_core/parameters/multipath 2>/dev/null) \
    || fail "step 2: /sys/module/nvme_core/parameters/multipath is missing: this kernel ($(uname -r)) has no native NVMe multipath (CONFIG_NVME_MULTIPATH)"
[ "$mp" = Y ] || fail "step 2: native NVMe multipath is off in this kernel ($(uname -r)): nvme_core multipath=$mp, want Y"
say "ok: native multipath on (kernel $(uname -r))"

# ---- 3. two paths, one block device, both optimized ----------------------------------
declare -A CTRL PATH_NS
for p in $PORT_A $PORT_B; do
    out=$(nvme connect -t tcp -a "$ADDR" -s "$p" -n "$NQN" "${host_args[@]}" 2>&1) \
        || fail "step 3: nvme connect to $ADDR:$p: $out"
    wait_for path_ready "$p" || fail "step 3: no controller with a path namespace appeared for $ADDR:$p"
    CTRL[$p]=$(ctrl_of "$p"); PATH_NS[$p]=$(path_of "${CTRL[$p]}")
done
[ "${CTRL[$PORT_A]}" != "${CTRL[$PORT_B]}" ] || fail "step 3: both connections gave one controller, ${CTRL[$PORT_A]}"
sub=$(subsys_dir) || fail "step 3: the kernel has no nvme-subsystem for $NQN"
nctrl=0
for c in "$sub"/nvme*; do [[ "${c##*/}" =~ ^nvme[0-9]+$ ]] && nctrl=$((nctrl + 1)); done
[ "$nctrl" = 2 ] || fail "step 3: ${sub##*/} holds $nctrl controllers, not 2: $(ls "$sub")"
heads=()
for h in "$sub"/nvme*n*; do [[ "${h##*/}" =~ ^nvme[0-9]+n[0-9]+$ ]] && heads+=("${h##*/}"); done
[ "${#heads[@]}" = 1 ] || fail "step 3: ${sub##*/} has ${#heads[@]} namespace heads, not 1: ${heads[*]}"
dev=/dev/${heads[0]}
wait_for test -b "$dev" || fail "step 3: no block device $dev"
for p in $PORT_A $PORT_B; do
    [ ! -e "/dev/${PATH_NS[$p]}" ] || fail "step 3: the path ${PATH_NS[$p]} is a device of its own: two block devices for one namespace"
    [ "$(cat "/sys/class/nvme/${CTRL[$p]}/${PATH_NS[$p]}/ana_grpid")" = 1 ] \
        || fail "step 3: ${PATH_NS[$p]} is in ANA group $(cat "/sys/class/nvme/${CTRL[$p]}/${PATH_NS[$p]}/ana_grpid"), not 1"
    wait_for ana_is "$p" optimized || fail "step 3: ${PATH_NS[$p]} (port $p) reports ana_state '$(ana_of "$p")', not optimized"
done
ls=$(nvme list-subsys "$dev" 2>&1) || fail "step 3: nvme list-subsys $dev: $ls"
for p in $PORT_A $PORT_B; do
    line=$(grep -E "${CTRL[$p]} tcp .*trsvcid=$p([, ]|$)" <<< "$ls") \
        || fail "step 3: nvme list-subsys does not show ${CTRL[$p]} through $p: $ls"
    grep -q " live" <<< "$line" || fail "step 3: ${CTRL[$p]} (port $p) is not live: $line"
    if grep -Eq "(optimized|inaccessible|persistent-loss|change)" <<< "$line"; then
        grep -Eq " optimized" <<< "$line" || fail "step 3: nvme list-subsys: ${CTRL[$p]} is not optimized: $line"
    fi
done
echo "$ls"
say "ok: two live paths, one block device $dev ($(cat "/sys/block/${dev#/dev/}/size") sectors): $PORT_A ${CTRL[$PORT_A]}/${PATH_NS[$PORT_A]} $(ana_of $PORT_A), $PORT_B ${CTRL[$PORT_B]}/${PATH_NS[$PORT_B]} $(ana_of $PORT_B)"
# no I/O runs: only the ANA change event (and the log page it makes the host read) can tell the kernel
set_ana "step 3" $PORT_B non-optimized
kernel_follows "step 3 (ANA change event, no I/O)" $PORT_B non-optimized
set_ana "step 3" $PORT_B optimized
kernel_follows "step 3 (ANA change event, no I/O)" $PORT_B optimized

# ---- 4. fio with verify while paths go inaccessible and come back -------------------
policy=$sub/iopolicy
[ -w "$policy" ] || fail "step 4: no iopolicy in ${sub##*/}"
echo round-robin > "$policy" || fail "step 4: cannot set ${sub##*/}'s iopolicy to round-robin"
[ "$(cat "$policy")" = round-robin ] || fail "step 4: ${sub##*/}'s iopolicy is $(cat "$policy"), not round-robin"
fio --name=multipath-verify --filename="$dev" --direct=1 --ioengine=libaio --iodepth=16 --rw=randwrite --bs=4k \
    --verify=crc32c --verify_backlog=512 --verify_fatal=1 --serialize_overlap=1 --verify_state_save=0 \
    --randrepeat=0 --time_based --runtime="$FIO_SECS" > "$FIOLOG" 2>&1 &
FPID=$!
tfio=$EPOCHREALTIME
say "fio running (pid $FPID, ${FIO_SECS}s) on $dev, iopolicy round-robin"
both_flow "step 4 (both optimized)"
for round in "$PORT_A $PORT_B" "$PORT_B $PORT_A"; do
    read -r dead live <<< "$round"
    set_ana "step 4" "$dead" inaccessible
    say "target: $ADDR:$dead group 1 inaccessible"
    kernel_follows "step 4" "$dead" inaccessible
    ana_is "$live" optimized || fail "step 4: the path through $live turned '$(ana_of "$live")' too"
    only_flows "step 4 ($dead inaccessible)" "$live" "$dead"
    set_ana "step 4" "$dead" optimized
    say "target: $ADDR:$dead group 1 optimized"
    kernel_follows "step 4" "$dead" optimized
    both_flow "step 4 ($dead optimized again)"
done
say "paths done $(since "$tfio")s after fio started; waiting for fio"
for p in $PORT_A $PORT_B; do ana_is "$p" optimized || fail "step 4: the path through $p is '$(ana_of "$p")' at the end"; done
limit=$(( FIO_SECS + 120 ))
for _ in $(seq $((limit * 10))); do fio_running || break; sleep 0.1; done
fio_running && fail "step 4: fio still running ${limit}s after it started"
frc=0
wait "$FPID" || frc=$?
FPID=
[ "$frc" = 0 ] || fail "step 4: fio exited with status $frc: $(cat "$FIOLOG")"
grep -Eq "err= *0" "$FIOLOG" || fail "step 4: fio reported errors: $(cat "$FIOLOG")"
# fio counts its verify reads in "issued rwts" (its read: line may be missing or show a made-up runtime)
[[ "$(cat "$FIOLOG")" =~ issued\ rwts:\ total=([0-9]+),([0-9]+) ]] || fail "step 4: no issued I/O counts in fio's output: $(cat "$FIOLOG")"
vreads=${BASH_REMATCH[1]} writes=${BASH_REMATCH[2]}
[ "$vreads" -gt 0 ] || fail "step 4: fio read nothing back: no verification ran: $(cat "$FIOLOG")"
say "ok: fio finished after $(since "$tfio")s, exit 0, no verify error: $writes writes, $vreads verify reads"
say "path I/O totals: $PORT_A ${PATH_NS[$PORT_A]} $(ios_of $PORT_A), $PORT_B ${PATH_NS[$PORT_B]} $(ios_of $PORT_B)"

# ---- 5. disconnect, clean stop ----------------------------------------------------------
out=$(nvme disconnect -n "$NQN" 2>&1) || fail "step 5: nvme disconnect: $out"
grep -q "disconnected 2 controller" <<< "$out" || fail "step 5: nvme disconnect did not disconnect both controllers: $out"
gone() { ! subsys_dir >/dev/null; }
wait_for gone || fail "step 5: the kernel still has the subsystem after disconnect"
kill -INT "$TPID"
rc=0
wait "$TPID" || rc=$?
TPID=
[ "$rc" = 0 ] || fail "step 5: the target exited with status $rc"
grep -q "^stats:" "$LOG" || fail "step 5: no stats line"
grep -q "C2HTermReq 0;" "$LOG" || fail "step 5: the target sent termination requests: $(grep '^stats:' "$LOG")"
grep -q "internal errors 0" "$LOG" || fail "step 5: the target hit internal errors: $(grep '^stats:' "$LOG")"
say "$(grep '^stats:' "$LOG")"
say "kernel log (NVMe lines):"
kernel_lines
say "all checks passed"

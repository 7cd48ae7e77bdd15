#!/usr/bin/env bash
# scripts/vm-tests/62-multipath-kernel-nvmet.sh - our multipath initiator (perf --multipath) over two paths
# to one kernel nvmet-tcp subsystem, against the kernel target's ANA support, inside the scripts/vm.sh guest
# (run by scripts/vm-test.sh: NVPOLL_VM_SCRIPTS=62- NVPOLL_VM_TEST_FILTER=@none scripts/vm-test.sh runs it
# alone; or scripts/vm.sh bash scripts/vm-tests/62-multipath-kernel-nvmet.sh after cargo build --bins).
#
# Setup: a second nvmet port (a new ports/N: tcp, ipv4, $VM_NVMET_ADDR, the first free trsvcid above
# $VM_NVMET_PORT) with $VM_NVMET_NQN linked to it, so that the subsystem is on two ports; its namespaces
# must be in ANA group 1 and group 1 optimized on both ports. The kernel host's Identify Controller through
# the new port tells the Command Quiesce Time (CQT) nvmet reports (for the failover expected after a loss).
#
# Then perf --verify --faults --multipath (qd 16 x 2 jobs, randrw, --kato 2s, --reconnect-delay 200ms,
# --io-timeout 15s, --ctrl-loss-tmo 20s, queue-depth path policy) over the first port (path 1) and the new
# one (path 2), one run per scenario, the fault injected on path 1 two seconds after perf is connected:
#   a) ANA inaccessible  group 1's ana_state on the first port is inaccessible for 3 s, then optimized:
#                        refused commands (ANA Inaccessible, a path status) go to path 2 at once;
#   b) ANA change        the same with ana_state change (ANA Transition) for 2 s;
#   c) path lost         the subsystem's link under the first port is removed for 3 s (nvmet drops that
#                        port's controllers and stops listening there), then made again: path 1's commands
#                        are held KATO + CQT, then sent on path 2; path 1 reconnects after the link is back;
#   d) blackhole         nft drops the first port's TCP traffic both ways for 4 s (past the 2 s KATO), then
#                        lets it through again (skipped, loudly, without nft or nf_tables).
# Every run must exit 0, lose nothing, find no verify mismatch, fail no I/O and complete some. Besides:
# a) and b) must have retried commands, or else have kept I/O going (longest stall under 2 s); c) must
# have retried commands and a failover of at least KATO + CQT (CQT 0 where Identify could not be read);
# d) must have retried commands (the blackhole hit outstanding I/O). In every run path 1 must carry I/O
# again once the fault is undone (failback: ANA state optimized again, or a reconnect), before the run ends.
# A final table shows each run. Every fault and every configfs change (the new port and its link, the ANA
# state, the first port's link) and the kernel host's controller are undone on any exit. Exits non-zero on
# any failure.
# Knob: NVPOLL_MP_WAIT_SECS (the bound of each polling wait: perf connected, listening, failback; 60).
set -euo pipefail

PROG=62-multipath
bin=${NVPOLL_BIN_DIR:-target/debug}
KATO_S=2
WAIT_SECS=${NVPOLL_MP_WAIT_SECS:-60}   # the bound of each polling wait
NFT_TABLE=nvpoll_mp_fault
die() { echo "$PROG: FAIL: $*" >&2; exit 1; }
say() { echo "$PROG: [+$(since "$T0")s] $*"; }
loud() {
    echo "$PROG: ======================================================================================="
    echo "$PROG: $*"
    echo "$PROG: ======================================================================================="
}
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
T0=$EPOCHREALTIME

[ -n "${VM_NVMET_NQN:-}" ] || die "VM_NVMET_NQN is not set: no nvmet-tcp target in this guest (NVPOLL_VM_NVMET=0?)"
[ -x "$bin/nvpoll-perf" ] || die "no nvpoll-perf in $bin (cargo build --bins)"
command -v ss >/dev/null || die "no ss in the guest (install iproute2 on the host: the guest runs on the host's root fs)"
cfg=/sys/kernel/config/nvmet
sub=$cfg/subsystems/$VM_NVMET_NQN
[ -d "$sub" ] || die "no nvmet subsystem $sub"
port1=''
for p in "$cfg"/ports/*; do
    if [ "$(cat "$p/addr_trsvcid" 2>/dev/null)" = "$VM_NVMET_PORT" ] && [ -L "$p/subsystems/$VM_NVMET_NQN" ]; then
        port1=$p
        break
    fi
done
[ -n "$port1" ] || die "no nvmet port with trsvcid $VM_NVMET_PORT linking $VM_NVMET_NQN under $cfg/ports"
ana1=$port1/ana_groups/1/ana_state

# What this script changed, for the cleanup: the new port (its folder, its link), the first port's group 1
# state and link, the nft table, the kernel host's controller, perf.
port2='' port2_linked=0 ana_changed=0 unlinked=0 nft_table=0 kctrl='' perf_pid=''
DMESG0=$(dmesg 2>/dev/null | wc -l) || DMESG0=0
# shellcheck disable=SC2317  # invoked by the traps
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [ -n "$perf_pid" ]; then   # timeout(1), which passes SIGTERM on to perf
        kill -TERM "$perf_pid" 2>/dev/null || true
        { wait "$perf_pid"; } 2>/dev/null || true
    fi
    if [ -n "$kctrl" ]; then nvme disconnect -d "$kctrl" >/dev/null 2>&1 || true; fi
    if [ "$nft_table" = 1 ]; then nft delete table inet "$NFT_TABLE" 2>/dev/null || true; fi
    if [ "$ana_changed" = 1 ]; then echo optimized > "$ana1" 2>/dev/null || true; fi
    if [ "$unlinked" = 1 ]; then ln -s "$sub" "$port1/subsystems/" 2>/dev/null || true; fi
    if [ "$port2_linked" = 1 ]; then rm -f "$port2/subsystems/$VM_NVMET_NQN" 2>/dev/null || true; fi
    if [ -n "$port2" ]; then rmdir "$port2" 2>/dev/null || echo "$PROG: could not remove $port2" >&2; fi
    if [ "$rc" != 0 ]; then
        echo "---- kernel log (nvme lines since the start)"
        dmesg 2>/dev/null | tail -n +"$((DMESG0 + 1))" | grep -Ei 'nvme' | tail -n 40 || true
        echo "----"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Polls COMMAND... every 0.1 s until it succeeds, for at most WAIT_SECS.
wait_for() {
    local deadline
    deadline=$(awk -v a="$EPOCHREALTIME" -v s="$WAIT_SECS" 'BEGIN { printf "%.3f", a + s }')
    while ! "$@"; do
        awk -v a="$EPOCHREALTIME" -v d="$deadline" 'BEGIN { exit !(a < d) }' || return 1
        sleep 0.1
    done
}
listening() { [ -n "$(ss -Hltn "( sport = :$1 )" 2>/dev/null)" ]; }
conns_to() { ss -Htn state established "( dport = :$1 )" 2>/dev/null | wc -l; }

# ---- setup: the subsystem on a second port ---------------------------------------------------------------
n=1
while [ -e "$cfg/ports/$n" ]; do n=$((n + 1)); done
svc2=$((VM_NVMET_PORT + 1))
used() {
    local p
    for p in "$cfg"/ports/*; do [ "$(cat "$p/addr_trsvcid" 2>/dev/null)" = "$1" ] && return 0; done
    listening "$1"
}
while used "$svc2"; do
    svc2=$((svc2 + 1))
    [ "$svc2" -lt $((VM_NVMET_PORT + 100)) ] || die "no free TCP port in $((VM_NVMET_PORT + 1))..$((VM_NVMET_PORT + 99))"
done
port2=$cfg/ports/$n
mkdir "$port2" || { port2=''; die "mkdir $cfg/ports/$n"; }
echo tcp > "$port2/addr_trtype"
echo ipv4 > "$port2/addr_adrfam"
echo "$VM_NVMET_ADDR" > "$port2/addr_traddr"
echo "$svc2" > "$port2/addr_trsvcid"
ln -s "$sub" "$port2/subsystems/"
port2_linked=1
wait_for listening "$svc2" || die "nvmet is not listening on $VM_NVMET_ADDR:$svc2 after linking the subsystem to ${port2#"$cfg"/}"
say "setup: $VM_NVMET_NQN on ${port1#"$cfg"/} ($VM_NVMET_ADDR:$VM_NVMET_PORT, path 1) and ${port2#"$cfg"/} ($VM_NVMET_ADDR:$svc2, path 2, new)"
nns=0
for ns in "$sub"/namespaces/*; do
    [ -d "$ns" ] || continue
    nns=$((nns + 1))
    g=$(cat "$ns/ana_grpid")
    [ "$g" = 1 ] || die "namespace ${ns##*/} of $VM_NVMET_NQN is in ANA group $g, not 1"
done
[ "$nns" -gt 0 ] || die "$VM_NVMET_NQN has no namespace"
for p in "$port1" "$port2"; do
    [ -f "$p/ana_groups/1/ana_state" ] || die "${p#"$cfg"/} has no ana_groups/1: no ANA support in this nvmet ($(uname -r))"
    st=$(cat "$p/ana_groups/1/ana_state")
    [ "$st" = optimized ] || die "ANA group 1 is $st on ${p#"$cfg"/}, not optimized"
done
say "setup: $nns namespace(s), all in ANA group 1; group 1 optimized on both ports"

# What CQT nvmet reports (Identify Controller bytes 386-387, ms), read through the kernel host; informational.
CQT_MS=unknown
ctrl_of_port() {   # the kernel host's controller (nvmeN) of the subsystem through TCP port $1
    local d
    for d in /sys/class/nvme/nvme*; do
        [ "$(cat "$d/subsysnqn" 2>/dev/null)" = "$VM_NVMET_NQN" ] || continue
        [[ "$(cat "$d/address" 2>/dev/null)" =~ (^|,)trsvcid=$1(,|$) ]] && { echo "${d##*/}"; return 0; }
    done
    return 1
}
kctrl_ready() { local c; c=$(ctrl_of_port "$svc2") && [ -c "/dev/$c" ]; }
kctrl_gone() { [ ! -e "/sys/class/nvme/$1" ]; }
host_args=()
[ -n "${VM_HOSTNQN:-}" ] && host_args+=(--hostnqn "$VM_HOSTNQN")
[ -n "${VM_HOSTID:-}" ] && host_args+=(--hostid "$VM_HOSTID")
if ! command -v nvme >/dev/null || ! modprobe nvme-tcp 2>/dev/null; then
    say "NOTE: no nvme-cli or nvme-tcp in the guest: CQT not read"
elif ! out=$(nvme connect -t tcp -a "$VM_NVMET_ADDR" -s "$svc2" -n "$VM_NVMET_NQN" "${host_args[@]}" 2>&1); then
    say "NOTE: the kernel host could not connect to read Identify ($out): CQT not read"
elif ! wait_for kctrl_ready; then
    say "NOTE: the kernel host's controller through port $svc2 did not appear: CQT not read"
else
    kctrl=$(ctrl_of_port "$svc2")
    # SQES (byte 512) is 0x66 on every NVMe over Fabrics controller: a check that the bytes are Identify's
    if v=$(nvme id-ctrl -b "/dev/$kctrl" | od -An -tu2 -j386 -N2 | tr -d ' ') && [[ "$v" =~ ^[0-9]+$ ]] &&
        [ "$(nvme id-ctrl -b "/dev/$kctrl" | od -An -tu1 -j512 -N1 | tr -d ' ')" = 102 ]; then
        CQT_MS=$v
    fi
    nvme disconnect -d "$kctrl" >/dev/null 2>&1 || say "NOTE: nvme disconnect -d $kctrl failed"
    wait_for kctrl_gone "$kctrl" || die "the kernel host's $kctrl did not go away after nvme disconnect"
    kctrl=''
    say "setup: Identify Controller through the kernel host: CQT $CQT_MS ms (failover after a loss: KATO $KATO_S s + CQT)"
fi
MIN_FAILOVER=$KATO_S
[[ "$CQT_MS" =~ ^[0-9]+$ ]] && MIN_FAILOVER=$(awk -v k="$KATO_S" -v c="$CQT_MS" 'BEGIN { printf "%.3f", k + c / 1000 }')

# ---- the runs -------------------------------------------------------------------------------------------------
ROWS=() FAILS=0 RAN=0 SKIPPED=0 JOBS=2
row() { ROWS+=("$(printf '| %-36s | %9s | %7s | %6s | %7s | %4s | %10s | %17s | %12s | %12s | %-6s |' "$@")"); }
ge() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a >= b) }'; }

run_scenario() {   # LABEL EXPECT INJECT SECONDS: perf in the background, INJECT here, then the checks
    local label=$1 expect=$2 inject=$3 secs=$4 log rc=0 t0=$EPOCHREALTIME d0
    RAN=$((RAN + 1))
    log=$(mktemp)
    d0=$(dmesg 2>/dev/null | wc -l) || d0=0
    say "---- $label: $secs s run"
    timeout -k 5 $((secs + 90)) "$bin/nvpoll-perf" \
        --trid "trtype:tcp traddr:$VM_NVMET_ADDR trsvcid:$VM_NVMET_PORT subnqn:$VM_NVMET_NQN" \
        --trid "trtype:tcp traddr:$VM_NVMET_ADDR trsvcid:$svc2 subnqn:$VM_NVMET_NQN" --multipath \
        --verify --faults --quiet --qd 16 --jobs "$JOBS" --time "${secs}s" --warmup 0s --runs 1 --workload randrw \
        --send-mode deferred --kato "${KATO_S}s" --reconnect-delay 200ms --io-timeout 15s --ctrl-loss-tmo 20s \
        --drain-timeout 30s > "$log" 2>&1 &
    perf_pid=$!
    local injected=1
    FAILBACK=-
    if wait_for perf_connected && kill -0 "$perf_pid" 2>/dev/null; then
        say "  perf connected on both paths after $(since "$t0") s"
        "$inject"
    else
        injected=0
    fi
    wait "$perf_pid" || rc=$?
    perf_pid=''
    local line why=()
    [ "$injected" = 1 ] || why+=("perf did not connect $((JOBS + 1)) queues on each path (or exited) within $WAIT_SECS s: no fault injected")
    line=$(grep -m1 '^faults: ' "$log" || true)
    if [ -z "$line" ]; then
        why+=("perf printed no faults line (exit status $rc)")
        row "$label" - - - - - - - - - FAIL
    else
        echo "  $line"
        local re='submitted ([0-9]+), ok ([0-9]+), failed ([0-9]+), refused ([0-9]+), retried ([0-9]+), lost ([0-9]+), mismatches ([0-9]+), longest stall ([0-9.]+) s, failover ([0-9.]+) s'
        [[ "$line" =~ $re ]] || die "cannot parse: $line"
        local sub_n=${BASH_REMATCH[1]} ok=${BASH_REMATCH[2]} failed=${BASH_REMATCH[3]} retried=${BASH_REMATCH[5]}
        local lost=${BASH_REMATCH[6]} mism=${BASH_REMATCH[7]} stall=${BASH_REMATCH[8]} failover=${BASH_REMATCH[9]}
        [ "$rc" = 0 ] || why+=("perf exit status $rc")
        [ "$lost" = 0 ] || why+=("$lost I/Os lost")
        [ "$mism" = 0 ] || why+=("$mism verify mismatches")
        [ "$failed" = 0 ] || why+=("$failed I/Os failed: the other path was up all along")
        [ "$sub_n" = $((ok + failed + lost)) ] || why+=("submitted $sub_n != ok + failed + lost")
        [ "$ok" -gt 0 ] || why+=("no I/O completed")
        case "$expect" in
            ana)   # refused commands retried at once; if none was refused, I/O must have gone on
                if [ "$retried" = 0 ]; then
                    say "  nothing was retried: no command reached path 1 while refused; I/O must have gone on"
                    awk -v s="$stall" 'BEGIN { exit !(s < 2) }' || why+=("nothing retried and the longest stall was ${stall} s (>= 2 s)")
                fi ;;
            lost)
                [ "$retried" -gt 0 ] || why+=("nothing was retried: did the loss hit?")
                ge "$failover" "$(awk -v m="$MIN_FAILOVER" 'BEGIN { print m - 0.05 }')" \
                    || why+=("failover ${failover} s, shorter than KATO + CQT = $MIN_FAILOVER s: a command may have been resent while its old copy could still run") ;;
            retried) [ "$retried" -gt 0 ] || why+=("nothing was retried: did the fault hit?") ;;
        esac
        [ "$FAILBACK" != - ] || why+=("path 1 carried no I/O again after the fault was undone, before the run ended")
        local verdict=ok
        [ ${#why[@]} = 0 ] || verdict=FAIL
        row "$label" "$sub_n" "$ok" "$failed" "$retried" "$lost" "$mism" "$stall" "$failover" "$FAILBACK" "$verdict"
    fi
    say "  run took $(since "$t0") s"
    # the kernel's nvme lines of the run; nvmet_tcp's 'failed cmd' lines (one per command it refused before
    # taking its data: the ANA refusals) are counted, not shown
    local klines nrefused
    klines=$(dmesg 2>/dev/null | tail -n +"$((d0 + 1))" | grep -Ei 'nvme' || true)
    nrefused=$(grep -c 'nvmet_tcp: failed cmd' <<< "$klines" || true)
    klines=$(grep -v 'nvmet_tcp: failed cmd' <<< "$klines" || true)
    [ "$nrefused" = 0 ] || echo "  kernel log: $nrefused 'nvmet_tcp: failed cmd' line(s) (commands nvmet refused)"
    if [ -n "$klines" ]; then
        echo "  kernel log, the other nvme lines ($(wc -l <<< "$klines"), the last 12):"
        tail -n 12 <<< "$klines" | sed 's/^/    /'
    fi
    if [ ${#why[@]} -gt 0 ]; then
        FAILS=$((FAILS + 1))
        local w
        for w in "${why[@]}"; do echo "$PROG: FAIL $label: $w" >&2; done
        echo "---- perf output ----" >&2; tail -n 30 "$log" >&2
    fi
    rm -f "$log"
}

# perf's admin queue and every job's I/O queue are up on both paths (its connections on lo, by destination)
perf_connected() {
    kill -0 "$perf_pid" 2>/dev/null || return 0   # gone: no use waiting (the caller tells)
    [ "$(conns_to "$VM_NVMET_PORT")" -ge $((JOBS + 1)) ] && [ "$(conns_to "$svc2")" -ge $((JOBS + 1)) ]
}

# Bytes through perf's connections to the first port, both ways (ss -i: bytes_acked + bytes_received).
path1_bytes() {
    ss -Htin state established "( dport = :$VM_NVMET_PORT )" 2>/dev/null \
        | { grep -Eo 'bytes_(acked|received):[0-9]+' || true; } | awk -F: '{ n += $2 } END { print n + 0 }'
}
FAILBACK=- FB_BASE=0
path1_moving() {   # path 1 carried 1 MiB since FB_BASE (lowered when connections go away), or perf is gone
    kill -0 "$perf_pid" 2>/dev/null || return 0
    local b
    b=$(path1_bytes)
    [ "$b" -ge "$FB_BASE" ] || FB_BASE=$b
    [ $((b - FB_BASE)) -ge 1048576 ]
}
await_failback() {   # after the fault is undone: how long until path 1 carries I/O again (FAILBACK)
    local t0=$EPOCHREALTIME
    FB_BASE=$(path1_bytes)
    if wait_for path1_moving && kill -0 "$perf_pid" 2>/dev/null; then
        FAILBACK=$(since "$t0")
        say "  path 1 carries I/O again after $FAILBACK s"
    else
        say "  path 1 carried no I/O again before perf finished"
    fi
}

ana_set() {   # STATE: group 1's state on the first port
    [ "$1" = optimized ] || ana_changed=1
    echo "$1" > "$ana1"
    [ "$1" != optimized ] || ana_changed=0
}
inject_ana() {   # STATE SECONDS
    sleep 2
    say "  ANA group 1 $1 on ${port1#"$cfg"/} (path 1) for $2 s"
    ana_set "$1"
    sleep "$2"
    ana_set optimized
    say "  ANA group 1 optimized on ${port1#"$cfg"/} again"
    await_failback
}
inject_inaccessible() { inject_ana inaccessible 3; }
inject_change() { inject_ana change 2; }
inject_unlink() {
    sleep 2
    say "  unlink $VM_NVMET_NQN from ${port1#"$cfg"/} (path 1) for 3 s"
    rm "$port1/subsystems/$VM_NVMET_NQN"
    unlinked=1
    sleep 3
    ln -s "$sub" "$port1/subsystems/"
    unlinked=0
    wait_for listening "$VM_NVMET_PORT" || die "nvmet does not listen on port $VM_NVMET_PORT again after the link was made again"
    say "  linked again; nvmet listens on port $VM_NVMET_PORT"
    await_failback
}

have_nft() { command -v nft >/dev/null && modprobe nf_tables 2>/dev/null && nft list tables >/dev/null 2>&1; }
inject_blackhole() {
    sleep 2
    say "  blackhole on port $VM_NVMET_PORT (path 1) for 4 s (KATO $KATO_S s); port $svc2 stays up"
    nft -f - <<EOF
table inet $NFT_TABLE {
    chain input { type filter hook input priority 0; policy accept; tcp dport $VM_NVMET_PORT drop; tcp sport $VM_NVMET_PORT drop; }
}
EOF
    nft_table=1
    sleep 4
    nft delete table inet "$NFT_TABLE"
    nft_table=0
    say "  blackhole off"
    await_failback
}

run_scenario "a) ANA inaccessible 3 s, back" ana inject_inaccessible 10
run_scenario "b) ANA change 2 s, back" ana inject_change 10
run_scenario "c) path lost: unlinked 3 s, back" lost inject_unlink 10
if have_nft; then
    run_scenario "d) blackhole one path 4 s (KATO 2 s)" retried inject_blackhole 12
else
    loud "SKIP d) blackhole: no nft in the guest (apt-get install nftables on the host) or no nf_tables"
    SKIPPED=$((SKIPPED + 1))
fi

echo
echo "| fault (kernel nvmet-tcp, 2 paths)    | submitted |      ok | failed | retried | lost | mismatches | longest stall (s) | failover (s) | failback (s) | result |"
echo "|--------------------------------------|-----------|---------|--------|---------|------|------------|-------------------|--------------|--------------|--------|"
[ ${#ROWS[@]} = 0 ] || printf '%s\n' "${ROWS[@]}"
echo
echo "$PROG: longest stall = no completion while I/O was outstanding; failover = the longest a command waited"
echo "$PROG: between the failure that took it off path 1 and its send on path 2 (KATO $KATO_S s + CQT $CQT_MS ms"
echo "$PROG: after a lost connection, ~0 after an ANA refusal); failback = from the fault undone until path 1 carried"
echo "$PROG: I/O again (1 MiB more through its connections); $(since "$T0") s in all"
[ "$SKIPPED" = 0 ] || echo "$PROG: $SKIPPED scenario(s) SKIPPED (see above)"
echo "$PROG: $((RAN - FAILS)) passed, $FAILS failed"
[ "$FAILS" = 0 ]

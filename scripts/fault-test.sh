#!/usr/bin/env bash
# scripts/fault-test.sh - fault injection against nvpoll's NVMe/TCP initiator and target (host side, needs root).
#
# usage: scripts/fault-test.sh
#
# Creates a network namespace nvpoll-fault-<pid> joined to this one by a veth pair (a /30 in 10.201.0.0/16),
# runs our target (nvpoll-target) inside it on a file namespace, and runs `perf --verify --faults`
# from here against it, one scenario at a time. Each scenario is one perf run of 8 to 12 s; the fault is
# injected a few seconds in, and every fault is undone by the script itself:
#   kill -9 + restart   the target is killed and started again 1 s later on the same file (twice: with
#                       --recovery retry, and with --recovery fail-fast, where failed I/O is expected)
#   kill -9, never back the target is killed for good: with --ctrl-loss-tmo 3s every outstanding and later
#                       I/O must fail (not hang, not be lost) and perf must finish by itself
#   tcp reset           an nft/iptables rule in the namespace answers the target's port with TCP resets for 1 s,
#                       and the target's own sockets are destroyed with ss -K (closing them from the target)
#   blackhole           all traffic of the target's port is dropped for 4 s, longer than a 2 s KATO
#   lossy link          netem delay 5ms loss 2% on the namespace's veth for the whole run (without netem in the
#                       kernel: 2% random loss with nft/iptables and a 40 Mbit/s tbf instead, said loudly)
#   TLS                 kill -9 + restart, kill -9 never back, tcp reset, blackhole (and, on request, the lossy
#                       link) again with a TLS PSK required, and both sides renewing their TLS keys every
#                       NVPOLL_FAULT_KEY_UPDATE records (1,000): the reconnects redo the handshake, KeyUpdates
#                       cross the faults, and each TLS run must have renewed keys in both directions
# and, with `perf --multipath` over two paths (two target processes on ports 4420 and 4421 in the namespace,
# exporting one subsystem from the same file, with disjoint controller IDs):
#   multipath kill -9   the first target is killed mid-run and restarted 1 s later: its commands wait KATO
#                       plus CQT and go to the other path, which carries the I/O meanwhile; none fails
#   multipath ANA       the first target's path turns inaccessible (ana_state_set over its control socket)
#                       for 3 s, then optimized again: refused commands go to the other path at once
#   multipath blackhole the first path's port is dropped for 4 s (KATO 2 s): its commands go to the other path
# Then it prints one table and exits non-zero if any run lost an I/O, found a verify mismatch, failed I/O
# under the retry policy, or did not see its fault. Traffic goes only to the namespace this script creates;
# the namespace, the veth pair, the processes and the temporary files go away on any exit.
#
# Knobs (environment):
#   NVPOLL_BIN_DIR      folder with the built nvpoll-perf and nvpoll-target (default: builds them, see below)
#   NVPOLL_FAULT_PROFILE     debug | release: the profile to build when NVPOLL_BIN_DIR is unset (debug)
#   NVPOLL_FAULT_KEEP=0      1: keep the work folder (perf and target logs)
#   NVPOLL_FAULT_SCENARIOS   comma-separated subset of: kill, kill-fail-fast, gone, reset, blackhole, lossy,
#                            kill-tls, gone-tls, reset-tls, blackhole-tls, lossy-tls, mp-kill, mp-ana,
#                            mp-blackhole (default: all but lossy-tls, in that order)
#   NVPOLL_FAULT_KEY_UPDATE=1000  TLS scenarios: records under one key before a KeyUpdate, on both sides
#                            (perf and target --tls-key-update); 0: the built-in default (2^23 records or an
#                            hour, never reached here), and no renewal is required
#   NVPOLL_FAULT_NETEM=any   require: a missing sch_netem is an error instead of the nft + tbf substitute
# Needs: root, ip (iproute2, with network namespace and veth support), tc, nft (nftables) or iptables.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
PROG=fault-test
PORT=4420
NQN=nqn.2024-01.io.nvpoll:fault-test
# Test vector of the NVMe TLS PSK interchange format (shared/notes/tls-psk.md); a test-only key.
PSK='NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:'
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:$(cat /proc/sys/kernel/random/uuid)
KEY_UPDATE=${NVPOLL_FAULT_KEY_UPDATE:-1000}

die() { echo "$PROG: error: $*" >&2; exit 2; }
say() { echo "$PROG: $*"; }

PATH=$PATH:/usr/sbin:/sbin   # ip, tc, nft live there
[[ "$KEY_UPDATE" =~ ^[0-9]+$ ]] || die "NVPOLL_FAULT_KEY_UPDATE must be a number of records, not '$KEY_UPDATE'"
[ "$(id -u)" = 0 ] || die "must run as root (it creates a network namespace and a veth pair)"
for c in ip tc ss; do command -v "$c" >/dev/null 2>&1 || die "'$c' not found: apt-get install iproute2"; done
command -v timeout >/dev/null 2>&1 || die "'timeout' not found: apt-get install coreutils"
if command -v nft >/dev/null; then FW=nft
elif command -v iptables >/dev/null; then FW=iptables
else die "neither nft (apt-get install nftables) nor iptables found"
fi

# ---------------------------------------------------------------------------------------------------------------
# the binaries
# ---------------------------------------------------------------------------------------------------------------
if [ -n "${NVPOLL_BIN_DIR:-}" ]; then
    BIN=$NVPOLL_BIN_DIR
else
    profile=${NVPOLL_FAULT_PROFILE:-debug}
    case "$profile" in
        debug) flags=() ;;
        release) flags=(--release) ;;
        *) die "NVPOLL_FAULT_PROFILE must be debug or release, not '$profile'" ;;
    esac
    say "building nvpoll-perf, nvpoll-target and nvpoll-rpc ($profile)"
    (cd "$ROOT" && cargo build -q "${flags[@]}" --bin nvpoll-perf --bin nvpoll-target --bin nvpoll-rpc) || die "the build failed"
    meta=$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps)
    [[ "$meta" =~ \"target_directory\":\"([^\"]+)\" ]] || die "no target_directory in cargo metadata"
    BIN=${BASH_REMATCH[1]}/$profile
fi
for b in perf target rpc; do [ -x "$BIN/nvpoll-$b" ] || die "no nvpoll-$b in $BIN"; done

# ---------------------------------------------------------------------------------------------------------------
# namespace, veth pair, cleanup
# ---------------------------------------------------------------------------------------------------------------
NS=nvpoll-fault-$$
VETH_OUT=nvpf$$o    # stays here
VETH_IN=nvpf$$i     # moves into the namespace
WORK=$(mktemp -d "${TMPDIR:-/tmp}/nvpoll-fault.XXXXXX")
TARGET_PID='' TARGET2_PID='' PERF_PID=''
PORT2=$((PORT + 1))

# shellcheck disable=SC2317  # invoked by the traps
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [ -n "$PERF_PID" ]; then
        # PERF_PID is timeout(1): it passes SIGTERM on to perf, and SIGKILLs it 5 s later if need be
        kill -TERM "$PERF_PID" 2>/dev/null || true
        { wait "$PERF_PID"; } 2>/dev/null || true
    fi
    [ -z "$TARGET_PID" ] || kill -9 "$TARGET_PID" 2>/dev/null || true
    [ -z "$TARGET2_PID" ] || kill -9 "$TARGET2_PID" 2>/dev/null || true
    if [ -e "/run/netns/$NS" ]; then
        # anything still running in our namespace was started by this script
        local p
        for p in $(ip netns pids "$NS" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
        ip netns del "$NS" 2>/dev/null || true
    fi
    ip link del "$VETH_OUT" 2>/dev/null || true
    if [ "${NVPOLL_FAULT_KEEP:-0}" = 1 ]; then echo "$PROG: kept $WORK" >&2; else rm -rf "$WORK"; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# A free /30 in 10.201.0.0/16, picked from our pid so that parallel runs do not collide.
net=''
addrs=$(ip -o -4 addr show) || die "ip -o -4 addr show failed"
for i in $(seq 0 63); do
    n=$(( ($$ + i) % 16384 ))
    cand=10.201.$((n / 64)).$(( (n % 64) * 4 ))
    if ! grep -q " 10\.201\.$((n / 64))\.$(( (n % 64) * 4 + 1 ))/" <<< "$addrs"; then net=$cand; break; fi
done
[ -n "$net" ] || die "no free /30 in 10.201.0.0/16"
HOST_IP=${net%.*}.$(( ${net##*.} + 1 ))
TARGET_IP=${net%.*}.$(( ${net##*.} + 2 ))

ip netns add "$NS" || die "ip netns add failed (no network namespaces?)"
ip link add "$VETH_OUT" type veth peer name "$VETH_IN" || die "ip link add type veth failed (no veth in this kernel?)"
ip link set "$VETH_IN" netns "$NS"
ip addr add "$HOST_IP/30" dev "$VETH_OUT"
ip link set "$VETH_OUT" up
ip -n "$NS" addr add "$TARGET_IP/30" dev "$VETH_IN"
ip -n "$NS" link set "$VETH_IN" up
ip -n "$NS" link set lo up
in_ns() { ip netns exec "$NS" "$@"; }

IMG=$WORK/ns.img
truncate -s 64M "$IMG"
say "namespace $NS: target at $TARGET_IP:$PORT (veth $VETH_IN), initiator at $HOST_IP ($VETH_OUT); firewall: $FW"

# ---------------------------------------------------------------------------------------------------------------
# target, firewall rules, link faults
# ---------------------------------------------------------------------------------------------------------------
TLS_ARGS=()
MP=0   # 1: multipath scenarios, two targets from configuration files (mp_config)
mp_config() {   # PORT CNTLID_MIN: one subsystem on one listener, the shared file, its own controller IDs
    cat <<EOF
{ "listeners": [ {"address": "$TARGET_IP:$1"} ],
  "subsystems": [ { "nqn": "$NQN", "allow_any_host": true, "cntlid_min": $2, "cntlid_max": $(($2 + 998)),
                    "namespaces": [ {"file": "$IMG"} ] } ] }
EOF
}
wait_listening() {   # PORT PID LOG
    local i
    for i in $(seq 100); do
        if [ -n "$(in_ns ss -Hltn "sport = :$1" 2>/dev/null)" ]; then return 0; fi
        kill -0 "$2" 2>/dev/null || break
        sleep 0.05
    done
    echo "---- target log ----" >&2; tail -n 20 "$3" >&2
    die "the target did not start listening on $TARGET_IP:$1"
}
start_target() {   # starts the target (with MP=1: the first of the two) in the namespace; waits until it listens
    # not through in_ns: a backgrounded function is a subshell, and $! must be the target itself
    if [ "$MP" = 1 ]; then
        mp_config "$PORT" 1 > "$WORK/target1.json"
        rm -f "$WORK/rpc1.sock"
        ip netns exec "$NS" "$BIN/nvpoll-target" --config "$WORK/target1.json" --rpc-socket "$WORK/rpc1.sock" --cores 1 \
            >> "$WORK/target.log" 2>&1 &
    else
        ip netns exec "$NS" "$BIN/nvpoll-target" --listen "$TARGET_IP:$PORT" --nqn "$NQN" --file "$IMG" --cores 1 "${TLS_ARGS[@]}" \
            >> "$WORK/target.log" 2>&1 &
    fi
    TARGET_PID=$!
    wait_listening "$PORT" "$TARGET_PID" "$WORK/target.log"
}
start_target2() {   # the second multipath target, on PORT2
    mp_config "$PORT2" 1000 > "$WORK/target2.json"
    ip netns exec "$NS" "$BIN/nvpoll-target" --config "$WORK/target2.json" --cores 1 >> "$WORK/target2.log" 2>&1 &
    TARGET2_PID=$!
    wait_listening "$PORT2" "$TARGET2_PID" "$WORK/target2.log"
}
stop_target2() {
    [ -n "$TARGET2_PID" ] || return 0
    kill -TERM "$TARGET2_PID" 2>/dev/null || true
    local i
    for i in $(seq 100); do kill -0 "$TARGET2_PID" 2>/dev/null || break; sleep 0.05; done
    kill -9 "$TARGET2_PID" 2>/dev/null || true
    { wait "$TARGET2_PID"; } 2>/dev/null || true
    TARGET2_PID=''
}
ana() {   # STATE: the first target's path, ANA group 1
    "$BIN/nvpoll-rpc" -s "$WORK/rpc1.sock" ana_state_set nqn="$NQN" listener="$TARGET_IP:$PORT" group=1 state="$1" \
        > /dev/null || die "ana_state_set $1 failed"
}
stop_target() {   # SIGNAL
    [ -n "$TARGET_PID" ] || return 0
    kill "-$1" "$TARGET_PID" 2>/dev/null || true
    local i
    for i in $(seq 100); do kill -0 "$TARGET_PID" 2>/dev/null || break; sleep 0.05; done
    kill -9 "$TARGET_PID" 2>/dev/null || true
    { wait "$TARGET_PID"; } 2>/dev/null || true   # (quietly: no "Killed" job message)
    TARGET_PID=''
}

fw() {   # reset | blackhole | loss | clear [PORT]: rules in the namespace for the target's port
    local what=$1 PORT=${2:-$PORT}
    if [ "$FW" = nft ]; then
        in_ns nft delete table inet nvpoll_fault 2>/dev/null || true
        local in='' out=''
        case "$what" in
            reset) in="tcp dport $PORT reject with tcp reset" ;;
            blackhole) in="tcp dport $PORT drop"; out="tcp sport $PORT drop" ;;
            loss) in="tcp dport $PORT numgen random mod 100 < 2 drop"; out="tcp sport $PORT numgen random mod 100 < 2 drop" ;;
            clear) return 0 ;;
        esac
        in_ns nft -f - <<EOF
table inet nvpoll_fault {
    chain input { type filter hook input priority 0; policy accept; $in; }
    chain output { type filter hook output priority 0; policy accept; $out; }
}
EOF
    else
        in_ns iptables -F INPUT; in_ns iptables -F OUTPUT
        case "$what" in
            reset) in_ns iptables -A INPUT -p tcp --dport "$PORT" -j REJECT --reject-with tcp-reset ;;
            blackhole)
                in_ns iptables -A INPUT -p tcp --dport "$PORT" -j DROP
                in_ns iptables -A OUTPUT -p tcp --sport "$PORT" -j DROP ;;
            loss)
                in_ns iptables -A INPUT -p tcp --dport "$PORT" -m statistic --mode random --probability 0.02 -j DROP
                in_ns iptables -A OUTPUT -p tcp --sport "$PORT" -m statistic --mode random --probability 0.02 -j DROP ;;
            clear) ;;
        esac
    fi
}

LOSSY_LABEL=''
lossy_on() {   # the whole-run link fault: netem if the kernel has it, else firewall loss plus a rate limit
    modprobe sch_netem 2>/dev/null || true
    if in_ns tc qdisc add dev "$VETH_IN" root netem delay 5ms loss 2% 2>"$WORK/netem.err"; then
        LOSSY_LABEL="netem delay 5ms loss 2%"
        return
    fi
    if [ "${NVPOLL_FAULT_NETEM:-any}" = require ]; then
        die "tc netem is not available ($(tr -d '\n' < "$WORK/netem.err")) and NVPOLL_FAULT_NETEM=require"
    fi
    cat >&2 <<EOF
$PROG: ======================================================================================================
$PROG: NOTE: tc netem is not available here ($(tr -d '\n' < "$WORK/netem.err")): this kernel
$PROG: lacks sch_netem (CONFIG_NET_SCH_NETEM). Instead: 2% random loss each way with $FW, and a 40 Mbit/s
$PROG: token bucket (tbf) on the target's veth for queueing delay. No fixed 5 ms delay is added.
$PROG: ======================================================================================================
EOF
    fw loss
    in_ns tc qdisc add dev "$VETH_IN" root tbf rate 40mbit burst 32kb latency 200ms ||
        die "tc qdisc add tbf failed as well"
    LOSSY_LABEL="loss 2% ($FW) + tbf 40mbit"
}
lossy_off() {
    in_ns tc qdisc del dev "$VETH_IN" root 2>/dev/null || true
    fw clear
}

# ---------------------------------------------------------------------------------------------------------------
# one scenario: perf in the background, the fault from here, then checks
# ---------------------------------------------------------------------------------------------------------------
ROWS=() FAILS=0 RUNS=0
row() { ROWS+=("$(printf '| %-42s | %9s | %9s | %6s | %7s | %4s | %10s | %9s | %19s | %12s | %11s | %-6s |' "$@")"); }
FAULT_T0='' FAULT_SECS=''
fault_begin() { FAULT_T0=$EPOCHREALTIME; }
fault_end() { FAULT_SECS=$(awk -v a="$FAULT_T0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.2f", b - a }'); }

run_scenario() {   # LABEL POLICY EXPECT SECONDS INJECT [perf args...]
    # EXPECT: what must be seen besides lost 0 / mismatches 0 / perf exit 0:
    #   retried  retry policy: no failed I/O, and some commands were retried (the fault hit outstanding I/O)
    #   failed   fail-fast policy: some I/O failed or was refused
    #   stall    retry policy: no failed I/O, and a stall of at least 1.5 s (the blackhole was seen)
    #   clean    retry policy: no failed I/O
    #   reconnected  retry policy: no failed I/O, and the initiator connected again (the target saw a second
    #            admin queue): a reset may hit while no command is outstanding, so nothing needs a retry
    local label=$1 policy=$2 expect=$3 secs=$4 inject=$5; shift 5
    [[ " $* " == *" --io-timeout "* ]] || set -- --io-timeout 5s "$@"
    [[ " $* " == *" --ctrl-loss-tmo "* ]] || set -- --ctrl-loss-tmo 20s "$@"
    RUNS=$((RUNS + 1))
    local log=$WORK/perf-$RUNS.log
    say "---- $label ($policy): ${secs}s run"
    echo "---- $label ($policy)" >> "$WORK/target.log"
    local log_from
    log_from=$(wc -l < "$WORK/target.log")
    local trids=(--trid "trtype:tcp traddr:$TARGET_IP trsvcid:$PORT subnqn:$NQN")
    [ "$MP" = 0 ] || trids+=(--trid "trtype:tcp traddr:$TARGET_IP trsvcid:$PORT2 subnqn:$NQN" --multipath)
    timeout -k 5 $((secs + 60)) "$BIN/nvpoll-perf" \
        "${trids[@]}" --hostnqn "$HOSTNQN" \
        --verify --faults --quiet --qd 16 --time "${secs}s" --warmup 0s --runs 1 --workload randrw \
        --send-mode deferred --cores 0 --reconnect-delay 200ms --drain-timeout 30s \
        --recovery "$policy" "$@" > "$log" 2>&1 &
    PERF_PID=$!
    FAULT_SECS=-
    "$inject"
    local rc=0
    wait "$PERF_PID" || rc=$?
    PERF_PID=''
    local line
    line=$(grep -m1 '^faults: ' "$log" || true)
    local why=()
    if [ -z "$line" ]; then
        why+=("perf printed no faults line (exit status $rc)")
        row "$label ($policy)" - - - - - - - - - - FAIL
    else
        echo "  $line"
        local re='submitted ([0-9]+), ok ([0-9]+), failed ([0-9]+), refused ([0-9]+), retried ([0-9]+), lost ([0-9]+), mismatches ([0-9]+), longest stall ([0-9.]+) s'
        [[ "$line" =~ $re ]] || die "cannot parse: $line"
        local sub=${BASH_REMATCH[1]} ok=${BASH_REMATCH[2]} failed=${BASH_REMATCH[3]} refused=${BASH_REMATCH[4]}
        local retried=${BASH_REMATCH[5]} lost=${BASH_REMATCH[6]} mism=${BASH_REMATCH[7]} stall=${BASH_REMATCH[8]}
        local failover=-
        if [ "$MP" = 1 ] && [[ "$line" =~ failover\ ([0-9.]+)\ s ]]; then failover=${BASH_REMATCH[1]}; fi
        local updates=- ku_sent=0 ku_recv=0
        if [[ "$line" =~ key\ updates\ ([0-9]+)/([0-9]+) ]]; then
            ku_sent=${BASH_REMATCH[1]} ku_recv=${BASH_REMATCH[2]}
            [ ${#PERF_TLS[@]} = 0 ] || updates=$ku_sent/$ku_recv
        fi
        [ "$rc" = 0 ] || why+=("perf exit status $rc")
        [ "$lost" = 0 ] || why+=("$lost I/Os lost")
        [ "$mism" = 0 ] || why+=("$mism verify mismatches")
        [ "$sub" = $((ok + failed + lost)) ] || why+=("submitted $sub != ok + failed + lost")
        [ "$ok" -gt 0 ] || why+=("no I/O completed")
        if [ ${#PERF_TLS[@]} -gt 0 ] && [ "$KEY_UPDATE" != 0 ]; then
            # Both directions renewed: ours sent, and the target's received (it asks on its own count).
            [ "$ku_sent" -gt 0 ] || why+=("perf sent no TLS KeyUpdate (renewal every $KEY_UPDATE records)")
            [ "$ku_recv" -gt 0 ] || why+=("perf received no TLS KeyUpdate from the target")
        fi
        case "$expect" in
            failed) [ $((failed + refused)) -gt 0 ] || why+=("fail-fast failed no I/O: did the fault hit?") ;;
            *) [ "$failed" = 0 ] || why+=("$failed I/Os failed under the retry policy") ;;
        esac
        case "$expect" in
            retried) [ "$retried" -gt 0 ] || why+=("nothing was retried: did the fault hit?") ;;
            stall) awk -v s="$stall" 'BEGIN { exit !(s >= 1.5) }' || why+=("longest stall ${stall}s: the blackhole was not seen") ;;
            reconnected)
                local admins
                admins=$(tail -n +"$((log_from + 1))" "$WORK/target.log" | grep -c 'admin queue of controller' || true)
                [ "$admins" -ge 2 ] || why+=("the initiator never reconnected ($admins admin queue(s)): did the fault hit?") ;;
        esac
        local verdict=ok
        [ ${#why[@]} = 0 ] || verdict=FAIL
        row "$label ($policy)" "$sub" "$ok" "$failed" "$retried" "$lost" "$mism" "$FAULT_SECS" "$stall" "$failover" "$updates" "$verdict"
    fi
    if [ ${#why[@]} -gt 0 ]; then
        FAILS=$((FAILS + 1))
        local w
        for w in "${why[@]}"; do echo "$PROG: FAIL $label ($policy): $w" >&2; done
        echo "---- perf output ----" >&2; tail -n 30 "$log" >&2
        echo "---- target log ----" >&2; tail -n 20 "$WORK/target.log" >&2
    fi
    # the next scenario starts a clean target (the fault may have left this one stopped or stuck)
    fw clear
    stop_target TERM
    stop_target2
}

# The injections (run in the foreground while perf runs in the background).
inject_kill_restart() {
    sleep 3
    say "  kill -9 the target (pid $TARGET_PID); restart it in 1 s"
    fault_begin
    stop_target KILL
    sleep 1
    start_target
    fault_end
}
inject_reset() {
    sleep 3
    say "  TCP resets on port $PORT for 1 s, and the target's sockets to it destroyed (ss -K)"
    fault_begin
    fw reset
    # The rule resets what the initiator sends; the target's side of each connection is closed from the target
    # (ss -K, CONFIG_INET_DIAG_DESTROY), so that neither side is left holding a dead connection.
    local killed=1
    in_ns ss -K -tn state established "( sport = :$PORT )" > /dev/null 2>&1 || killed=0
    sleep 1
    if [ "$killed" = 0 ] || [ "$(in_ns ss -Htn state established "( sport = :$PORT )" | wc -l)" != 0 ]; then
        # No socket destroy in this kernel: keep the rule until every connection has been reset.
        say "  (ss -K did not close the target's sockets: keeping the rule until they are gone, up to 6 s)"
        for _ in $(seq 50); do
            [ "$(in_ns ss -Htn state established "( sport = :$PORT )" | wc -l)" = 0 ] && break
            sleep 0.1
        done
    fi
    fw clear
    fault_end
}
inject_kill_for_good() {
    sleep 3
    say "  kill -9 the target (pid $TARGET_PID) for good (ctrl-loss-tmo 3 s)"
    fault_begin
    stop_target KILL
    FAULT_SECS=forever
}
inject_blackhole() {
    sleep 3
    say "  blackhole on port $PORT for 4 s (KATO 2 s)"
    fault_begin
    fw blackhole
    sleep 4
    fw clear
    fault_end
}
inject_none() { :; }
inject_ana() {
    sleep 3
    say "  ANA group 1 inaccessible on $TARGET_IP:$PORT for 3 s"
    fault_begin
    ana inaccessible
    sleep 3
    ana optimized
    fault_end
}
inject_blackhole_path() {
    sleep 3
    say "  blackhole on port $PORT for 4 s (KATO 2 s); port $PORT2 stays up"
    fault_begin
    fw blackhole "$PORT"
    sleep 4
    fw clear
    fault_end
}

# ---------------------------------------------------------------------------------------------------------------
# the scenarios
# ---------------------------------------------------------------------------------------------------------------
ALL_SCENARIOS='kill, kill-fail-fast, gone, reset, blackhole, lossy, kill-tls, gone-tls, reset-tls, blackhole-tls, lossy-tls, mp-kill, mp-ana, mp-blackhole'
SCENARIOS=${NVPOLL_FAULT_SCENARIOS:-kill,kill-fail-fast,gone,reset,blackhole,lossy,kill-tls,gone-tls,reset-tls,blackhole-tls,mp-kill,mp-ana,mp-blackhole}
for sc in ${SCENARIOS//,/ }; do
    case ", $ALL_SCENARIOS, " in
        *", $sc, "*) ;;
        *) die "NVPOLL_FAULT_SCENARIOS: unknown scenario '$sc' ($ALL_SCENARIOS)" ;;
    esac
done
T0=$SECONDS
for sc in ${SCENARIOS//,/ }; do
    case "$sc" in
        *-tls)
            TLS_ARGS=(--psk "$HOSTNQN=$PSK" --tls required); PERF_TLS=(--psk "$PSK")
            if [ "$KEY_UPDATE" != 0 ]; then
                TLS_ARGS+=(--tls-key-update "$KEY_UPDATE"); PERF_TLS+=(--tls-key-update "$KEY_UPDATE")
            fi ;;
        *) TLS_ARGS=(); PERF_TLS=() ;;
    esac
    case "$sc" in mp-*) MP=1 ;; *) MP=0 ;; esac
    start_target
    [ "$MP" = 0 ] || start_target2
    case "$sc" in
        kill) run_scenario "kill -9 + restart" retry retried 10 inject_kill_restart ;;
        kill-fail-fast) run_scenario "kill -9 + restart" fail-fast failed 10 inject_kill_restart ;;
        gone) run_scenario "kill -9, never back" retry failed 10 inject_kill_for_good --ctrl-loss-tmo 3s ;;
        reset) run_scenario "tcp resets" retry reconnected 10 inject_reset ;;
        blackhole) run_scenario "blackhole 4 s, KATO 2 s" retry stall 12 inject_blackhole --kato 2s --io-timeout 15s ;;
        kill-tls) run_scenario "kill -9 + restart, TLS" retry retried 10 inject_kill_restart "${PERF_TLS[@]}" ;;
        gone-tls) run_scenario "kill -9, never back, TLS" retry failed 10 inject_kill_for_good --ctrl-loss-tmo 3s "${PERF_TLS[@]}" ;;
        reset-tls) run_scenario "tcp resets, TLS" retry reconnected 10 inject_reset "${PERF_TLS[@]}" ;;
        blackhole-tls)
            run_scenario "blackhole 4 s, KATO 2 s, TLS" retry stall 12 inject_blackhole --kato 2s --io-timeout 15s "${PERF_TLS[@]}" ;;
        mp-kill) run_scenario "multipath: kill -9 one target" retry retried 10 inject_kill_restart --kato 2s ;;
        mp-ana) run_scenario "multipath: ANA inaccessible 3 s" retry retried 10 inject_ana --kato 2s ;;
        mp-blackhole) run_scenario "multipath: blackhole one path 4 s" retry retried 12 inject_blackhole_path --kato 2s --io-timeout 15s ;;
        lossy | lossy-tls)
            lossy_on
            label=$LOSSY_LABEL
            [ "$sc" = lossy ] || label="$label, TLS"
            run_scenario "$label" retry clean 8 inject_none "${PERF_TLS[@]}"
            lossy_off ;;
    esac
    stop_target TERM
    stop_target2
done

echo
echo "| fault                                      | submitted |        ok | failed | retried | lost | mismatches | fault (s) | time to recover (s) | failover (s) | key updates | result |"
echo "|--------------------------------------------|-----------|-----------|--------|---------|------|------------|-----------|---------------------|--------------|-------------|--------|"
printf '%s\n' "${ROWS[@]}"
echo
echo "fault-test: $((SECONDS - T0)) s; fault = how long the fault lasted (kill to listening again, reset or blackhole"
echo "fault-test: rule on to off; '-': the whole run); time to recover = perf's longest stall (no completion while"
echo "fault-test: I/O was outstanding), which includes the fault itself; failover (multipath) = the longest a command"
echo "fault-test: waited between the failure that took it off a path and its send on the other (KATO + CQT after a"
echo "fault-test: lost connection, ~0 after an ANA refusal)"
[ "$KEY_UPDATE" = 0 ] || echo "fault-test: key updates (TLS) = KeyUpdates perf sent / received over the run, both sides renewing every $KEY_UPDATE records"
echo "fault-test: $((RUNS - FAILS)) passed, $FAILS failed"
[ "$FAILS" = 0 ]

#!/usr/bin/env bash
# scripts/vm-tests/60-faults-kernel-nvmet.sh - fault injection between our NVMe/TCP initiator and the kernel's
# nvmet-tcp target, inside the scripts/vm.sh guest (run by scripts/vm-test.sh, or alone:
# scripts/vm.sh bash scripts/vm-tests/60-faults-kernel-nvmet.sh after cargo build --bins).
#
# perf --verify --faults (qd 8, 7 s runs, retry policy) against $VM_NVMET_ADDR:$VM_NVMET_PORT while:
#   a) port unlinked   the subsystem's link under the nvmet port is removed for 1 s (nvmet drops the
#                      subsystem's controllers on that port and stops listening), then made again; and
#                      removed for the rest of a run with --ctrl-loss-tmo 3s: every I/O must then fail
#                      (not hang, not be lost), and perf finish by itself;
#   b) tcp resets      nft rejects the initiator's packets to the port with TCP resets for 2 s;
#   c) blackhole       nft drops the port's traffic both ways for 4 s, longer than a 2 s KATO;
#   d) lossy lo        tc netem delay 5ms loss 2% on lo for the whole run (needs sch_netem; without it,
#                      2% loss with nft if nf_tables is there, else the scenario is skipped, loudly).
# Every run must lose nothing and find no verify mismatch, and fail no I/O except the target gone for good
# (where some must fail); the other a) to c) runs must also have retried commands (the fault hit outstanding
# I/O).
# At least one scenario must run. Every fault is undone on any exit.
set -euo pipefail

PROG=60-faults
bin=${NVPOLL_BIN_DIR:-target/debug}
die() { echo "$PROG: FAIL: $*" >&2; exit 1; }
say() { echo "$PROG: $*"; }
loud() {
    echo "$PROG: ======================================================================================="
    echo "$PROG: $*"
    echo "$PROG: ======================================================================================="
}

[ -n "${VM_NVMET_NQN:-}" ] || die "VM_NVMET_NQN is not set: no nvmet-tcp target in this guest (NVPOLL_VM_NVMET=0?)"
[ -x "$bin/nvpoll-perf" ] || die "no nvpoll-perf in $bin (cargo build --bins)"
cfg=/sys/kernel/config/nvmet
port=''
for p in "$cfg"/ports/*; do
    if [ "$(cat "$p/addr_trsvcid" 2>/dev/null)" = "$VM_NVMET_PORT" ] && [ -L "$p/subsystems/$VM_NVMET_NQN" ]; then
        port=$p
        break
    fi
done

unlinked=0 lo_qdisc=0 nft_table=0 perf_pid=''
# shellcheck disable=SC2317  # invoked by the traps
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [ -n "$perf_pid" ]; then   # timeout(1), which passes SIGTERM on to perf
        kill -TERM "$perf_pid" 2>/dev/null || true
        { wait "$perf_pid"; } 2>/dev/null || true
    fi
    if [ "$unlinked" = 1 ]; then ln -s "$cfg/subsystems/$VM_NVMET_NQN" "$port/subsystems/" 2>/dev/null || true; fi
    if [ "$lo_qdisc" = 1 ]; then tc qdisc del dev lo root 2>/dev/null || true; fi
    if [ "$nft_table" = 1 ]; then nft delete table inet nvpoll_fault 2>/dev/null || true; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

ROWS=() FAILS=0 RAN=0 SKIPPED=0
row() { ROWS+=("$(printf '| %-30s | %9s | %7s | %6s | %7s | %4s | %10s | %19s | %-6s |' "$@")"); }

run_scenario() {   # LABEL EXPECT INJECT SECONDS [PERF ARGS...]: perf in the background, INJECT here, checks
    local label=$1 expect=$2 inject=$3 secs=$4 log rc=0
    shift 4
    [[ " $* " == *" --io-timeout "* ]] || set -- --io-timeout 10s "$@"
    [[ " $* " == *" --ctrl-loss-tmo "* ]] || set -- --ctrl-loss-tmo 20s "$@"
    RAN=$((RAN + 1))
    log=$(mktemp)
    say "---- $label: $secs s run"
    timeout -k 5 90 "$bin/nvpoll-perf" \
        --trid "trtype:tcp traddr:$VM_NVMET_ADDR trsvcid:$VM_NVMET_PORT subnqn:$VM_NVMET_NQN" \
        --verify --faults --quiet --qd 8 --time "${secs}s" --warmup 0s --runs 1 --workload randrw --send-mode deferred \
        --reconnect-delay 200ms --drain-timeout 30s --recovery retry "$@" \
        > "$log" 2>&1 &
    perf_pid=$!
    "$inject"
    wait "$perf_pid" || rc=$?
    perf_pid=''
    local line why=()
    line=$(grep -m1 '^faults: ' "$log" || true)
    if [ -z "$line" ]; then
        why+=("perf printed no faults line (exit status $rc)")
        row "$label" - - - - - - - FAIL
    else
        echo "  $line"
        local re='submitted ([0-9]+), ok ([0-9]+), failed ([0-9]+), refused ([0-9]+), retried ([0-9]+), lost ([0-9]+), mismatches ([0-9]+), longest stall ([0-9.]+) s'
        [[ "$line" =~ $re ]] || die "cannot parse: $line"
        local sub=${BASH_REMATCH[1]} ok=${BASH_REMATCH[2]} failed=${BASH_REMATCH[3]} retried=${BASH_REMATCH[5]}
        local lost=${BASH_REMATCH[6]} mism=${BASH_REMATCH[7]} stall=${BASH_REMATCH[8]}
        [ "$rc" = 0 ] || why+=("perf exit status $rc")
        [ "$lost" = 0 ] || why+=("$lost I/Os lost")
        [ "$mism" = 0 ] || why+=("$mism verify mismatches")
        if [ "$expect" = failed ]; then
            [ "$failed" -gt 0 ] || why+=("no I/O failed: was the target gone?")
        else
            [ "$failed" = 0 ] || why+=("$failed I/Os failed under the retry policy")
        fi
        [ "$sub" = $((ok + failed + lost)) ] || why+=("submitted $sub != ok + failed + lost")
        [ "$ok" -gt 0 ] || why+=("no I/O completed")
        if [ "$expect" = retried ] && [ "$retried" = 0 ]; then why+=("nothing was retried: did the fault hit?"); fi
        local verdict=ok
        [ ${#why[@]} = 0 ] || verdict=FAIL
        row "$label" "$sub" "$ok" "$failed" "$retried" "$lost" "$mism" "$stall" "$verdict"
    fi
    if [ ${#why[@]} -gt 0 ]; then
        FAILS=$((FAILS + 1))
        local w
        for w in "${why[@]}"; do echo "$PROG: FAIL $label: $w" >&2; done
        echo "---- perf output ----" >&2; tail -n 30 "$log" >&2
    fi
    rm -f "$log"
}

inject_unlink() {
    sleep 2
    say "  unlink $VM_NVMET_NQN from ${port#"$cfg"/} for 1 s"
    rm "$port/subsystems/$VM_NVMET_NQN"
    unlinked=1
    sleep 1
    ln -s "$cfg/subsystems/$VM_NVMET_NQN" "$port/subsystems/"
    unlinked=0
}
inject_unlink_for_good() {
    sleep 2
    say "  unlink $VM_NVMET_NQN from ${port#"$cfg"/} until the run is over (ctrl-loss-tmo 3 s)"
    rm "$port/subsystems/$VM_NVMET_NQN"
    unlinked=1
}
relink() {
    if [ "$unlinked" = 1 ]; then ln -s "$cfg/subsystems/$VM_NVMET_NQN" "$port/subsystems/"; unlinked=0; fi
}
inject_none() { :; }

have_nft() { command -v nft >/dev/null && modprobe nf_tables 2>/dev/null && nft list tables >/dev/null 2>&1; }
nft_rules() {   # RULES: a table whose input chain (on lo) holds RULES
    modprobe nft_reject_inet 2>/dev/null || true
    nft -f - <<EOF
table inet nvpoll_fault {
    chain input { type filter hook input priority 0; policy accept; $1 }
}
EOF
    nft_table=1
}
nft_clear() { nft delete table inet nvpoll_fault; nft_table=0; }
inject_reset() {
    sleep 2
    say "  TCP resets to the initiator's packets for port $VM_NVMET_PORT for 2 s"
    nft_rules "tcp dport $VM_NVMET_PORT reject with tcp reset;"
    sleep 2
    nft_clear
}
inject_blackhole() {
    sleep 2
    say "  blackhole on port $VM_NVMET_PORT for 4 s (KATO 2 s)"
    nft_rules "tcp dport $VM_NVMET_PORT drop; tcp sport $VM_NVMET_PORT drop;"
    sleep 4
    nft_clear
}

# a) the port loses the subsystem for a second
if [ -z "$port" ]; then
    loud "SKIP port unlinked: no nvmet port with trsvcid $VM_NVMET_PORT linking $VM_NVMET_NQN under $cfg/ports"
    SKIPPED=$((SKIPPED + 1))
else
    run_scenario "port unlinked 1 s" retried inject_unlink 7
    # the target gone for good: every I/O must complete (failed) once ctrl-loss-tmo passes, none lost
    run_scenario "port unlinked for good" failed inject_unlink_for_good 8 --ctrl-loss-tmo 3s
    relink
fi

# b) TCP resets, and c) a blackhole longer than KATO
if have_nft; then
    run_scenario "tcp resets 2 s" retried inject_reset 8
    run_scenario "blackhole 4 s, KATO 2 s" retried inject_blackhole 10 --kato 2s --io-timeout 15s
else
    loud "SKIP tcp resets and blackhole: no nft in the guest (apt-get install nftables on the host) or no nf_tables"
    SKIPPED=$((SKIPPED + 2))
fi

# d) a slow, lossy lo for the whole run
lossy=''
if ! command -v tc >/dev/null; then
    loud "SKIP lossy lo: no tc in the guest (install iproute2 on the host: the guest runs on the host's root fs)"
elif modprobe sch_netem 2>/dev/null && tc qdisc add dev lo root netem delay 5ms loss 2%; then
    lo_qdisc=1
    lossy="netem delay 5ms loss 2% on lo"
elif command -v nft >/dev/null && modprobe nf_tables 2>/dev/null && nft -f - <<EOF
table inet nvpoll_fault {
    chain input { type filter hook input priority 0; policy accept; tcp dport $VM_NVMET_PORT numgen random mod 100 < 2 drop; tcp sport $VM_NVMET_PORT numgen random mod 100 < 2 drop; }
}
EOF
then
    nft_table=1
    lossy="loss 2% (nft) on lo"
    loud "NOTE lossy lo: no sch_netem in the guest kernel: 2% random loss with nft instead, and no delay"
else
    loud "SKIP lossy lo: the guest kernel has neither sch_netem nor nf_tables (or no nft: apt-get install nftables on the host)"
    SKIPPED=$((SKIPPED + 1))
fi
if [ -n "$lossy" ]; then
    run_scenario "$lossy" clean inject_none 7
    if [ "$lo_qdisc" = 1 ]; then tc qdisc del dev lo root; lo_qdisc=0; fi
    if [ "$nft_table" = 1 ]; then nft delete table inet nvpoll_fault; nft_table=0; fi
fi

echo
echo "| fault (kernel nvmet-tcp)       | submitted |      ok | failed | retried | lost | mismatches | time to recover (s) | result |"
echo "|--------------------------------|-----------|---------|--------|---------|------|------------|---------------------|--------|"
[ ${#ROWS[@]} = 0 ] || printf '%s\n' "${ROWS[@]}"
echo
[ "$RAN" -gt 0 ] || die "no scenario could run (see the SKIP lines above)"
[ "$SKIPPED" = 0 ] || echo "$PROG: $SKIPPED scenario(s) SKIPPED (see above)"
echo "$PROG: $((RAN - FAILS)) passed, $FAILS failed"
[ "$FAILS" = 0 ]

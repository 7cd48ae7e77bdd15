#!/usr/bin/env bash
# scripts/vm-tests/70-pcie-faults.sh - fault injection against our NVMe/PCIe driver and QEMU's emulated NVMe
# controller bound to vfio-pci, inside the scripts/vm.sh guest (run by scripts/vm-test.sh, or alone:
# scripts/vm.sh bash scripts/vm-tests/70-pcie-faults.sh after cargo build --bins --bins).
#
# perf --verify --faults (qd 8 x 2 jobs, randrw) on $VM_VFIO_BDF while, from outside the process:
#   a) function reset, retry       echo 1 > /sys/bus/pci/devices/$VM_VFIO_BDF/reset (the kernel's FLR of the
#                                  vfio-bound function: memory decoding off for ~100 ms, the controller comes
#                                  back disabled with no queues). The driver's health check finds it disabled,
#                                  resets and brings it up, the queue pairs re-create their queues and submit
#                                  their outstanding commands again: nothing may fail, be lost or mismatch, and
#                                  commands must have been retried;
#   b) function reset, fail-fast   the same with --recovery fail-fast: the outstanding commands fail (once
#                                  each), nothing is lost or mismatched, I/O goes on after the reset;
#   c) hot removal                 echo 1 > /sys/bus/pci/devices/$VM_VFIO_BDF/remove under timeout(1): vfio-pci
#                                  asks perf for the device (the VFIO device request eventfd), the driver
#                                  releases it (BAR cut off, DMA unmapped, fds closed) and fails every command
#                                  as removed. The remove must finish in the kernel within seconds, perf must
#                                  exit by itself (no signal, no panic) naming the removal, with nothing lost.
#                                  Then the device is rescanned and bound to vfio-pci again, and a short
#                                  perf --verify run checks it works, so later tests still have it.
# The reset is the real one the PCI core does for the sysfs attribute (reset_method must list flr or another
# method); if the function has no reset method the reset scenarios FAIL rather than fall back to a weaker
# injection.
set -euo pipefail

PROG=70-pcie-faults
bin=${NVPOLL_BIN_DIR:-target/debug}
setup=${NVPOLL_SETUP:-$bin/nvpoll-setup}
die() { echo "$PROG: FAIL: $*" >&2; exit 1; }
say() { echo "$PROG: $*"; }

bdf=${VM_VFIO_BDF:?not in the scripts/vm.sh guest}
dev=/sys/bus/pci/devices/$bdf
[ -x "$bin/nvpoll-perf" ] || die "no nvpoll-perf in $bin (cargo build --bins)"
[ -x "$setup" ] || die "no nvpoll-setup at $setup (cargo build -p nvpoll-tools --bins)"
[ -d "$dev" ] || die "no PCI device $bdf"
driver() { basename "$(readlink -f "/sys/bus/pci/devices/$1/driver" 2>/dev/null)" 2>/dev/null || true; }
[ "$(driver "$bdf")" = vfio-pci ] || die "$bdf is bound to '$(driver "$bdf")', not vfio-pci"

perf_pid='' removed=0
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }

# Rescans the bus (with automatic probing off, so that the kernel's nvme driver need not take the controller
# first) and binds it to vfio-pci with nvpoll-setup bind, which also takes it from nvme if that got it.
restore_device() {
    local auto=/sys/bus/pci/drivers_autoprobe was
    was=$(cat "$auto")
    echo 0 > "$auto"
    echo 1 > /sys/bus/pci/rescan
    for _ in $(seq 50); do [ -d "$dev" ] && break; sleep 0.1; done
    local rc=0
    [ -d "$dev" ] && "$setup" bind "$bdf" || rc=1
    echo "$was" > "$auto"
    return $rc
}

# shellcheck disable=SC2317  # invoked by the traps
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [ -n "$perf_pid" ]; then
        kill -TERM "$perf_pid" 2>/dev/null || true
        { wait "$perf_pid"; } 2>/dev/null || true
    fi
    if [ "$removed" = 1 ] || [ ! -d "$dev" ]; then restore_device >/dev/null 2>&1 || true; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

ROWS=() FAILS=0 NOTES=()
row() { ROWS+=("$(printf '| %-28s | %9s | %7s | %6s | %7s | %4s | %10s | %19s | %-6s |' "$@")"); }

LOG='' RC=0 INJECT_S=''
run_perf() {   # INJECT SECONDS RECOVERY: perf in the background, INJECT (a function) here
    local inject=$1 time=$2 recovery=$3
    LOG=$(mktemp) RC=0
    timeout -k 5 120 "$bin/nvpoll-perf" --trid "trtype:pcie traddr:$bdf" \
        --verify --faults --quiet --qd 8 --time "${time}s" --warmup 0s --runs 1 --workload randrw \
        --send-mode deferred --io-timeout 5s --drain-timeout 30s --recovery "$recovery" > "$LOG" 2>&1 &
    perf_pid=$!
    "$inject"
    wait "$perf_pid" || RC=$?
    perf_pid=''
}

# Parses perf's faults line into F_* variables; 1 when there is none.
parse_faults() {
    local line re='submitted ([0-9]+), ok ([0-9]+), failed ([0-9]+), refused ([0-9]+), retried ([0-9]+), lost ([0-9]+), mismatches ([0-9]+), longest stall ([0-9.]+) s'
    line=$(grep -m1 '^faults: ' "$LOG" || true)
    [ -n "$line" ] || return 1
    echo "  $line"
    [[ "$line" =~ $re ]] || die "cannot parse: $line"
    F_SUB=${BASH_REMATCH[1]} F_OK=${BASH_REMATCH[2]} F_FAILED=${BASH_REMATCH[3]} F_RETRIED=${BASH_REMATCH[5]}
    F_LOST=${BASH_REMATCH[6]} F_MISM=${BASH_REMATCH[7]} F_STALL=${BASH_REMATCH[8]}
}

verdict() {   # LABEL RECOVER-COLUMN WHY...: adds the row, prints the reasons and the log on failure
    local label=$1 recover=$2
    shift 2
    if [ $# = 0 ]; then
        row "$label" "$F_SUB" "$F_OK" "$F_FAILED" "$F_RETRIED" "$F_LOST" "$F_MISM" "$recover" ok
    else
        FAILS=$((FAILS + 1))
        row "$label" "${F_SUB:--}" "${F_OK:--}" "${F_FAILED:--}" "${F_RETRIED:--}" "${F_LOST:--}" "${F_MISM:--}" "$recover" FAIL
        local w
        for w in "$@"; do echo "$PROG: FAIL $label: $w" >&2; done
        echo "---- perf output ----" >&2; tail -n 30 "$LOG" >&2
    fi
    rm -f "$LOG"
}

common_checks() {   # appends to WHY: what every scenario needs
    if grep -q 'panicked' "$LOG"; then WHY+=("perf panicked"); fi
    [ "$RC" -lt 128 ] || WHY+=("perf was killed by signal $((RC - 128)) (124/137: timeout)")
    [ "$F_LOST" = 0 ] || WHY+=("$F_LOST I/Os lost")
    [ "$F_MISM" = 0 ] || WHY+=("$F_MISM verify mismatches")
    [ "$F_SUB" = $((F_OK + F_FAILED + F_LOST)) ] || WHY+=("submitted $F_SUB != ok + failed + lost")
}

inject_reset() {
    sleep 2
    local t0 t1
    t0=$(now)
    if ! timeout 20 sh -c "echo 1 > $dev/reset"; then
        INJECT_S=refused
        say "  the function reset was refused or hung"
        return
    fi
    t1=$(now)
    INJECT_S=$(secs "$t0" "$t1")
    say "  function reset of $bdf ($(cat "$dev/reset_method")) took $INJECT_S s"
}

scenario_reset() {   # LABEL RECOVERY
    local label=$1 recovery=$2
    F_SUB='' F_OK='' F_FAILED='' F_RETRIED='' F_LOST='' F_MISM='' F_STALL=''
    WHY=()
    say "---- $label: 7 s run, function reset after 2 s"
    run_perf inject_reset 7 "$recovery"
    if [ "$INJECT_S" = refused ]; then WHY+=("echo 1 > $dev/reset failed"); fi
    if ! parse_faults; then
        WHY+=("perf printed no faults line (exit status $RC)")
        verdict "$label" - "${WHY[@]}"
        return
    fi
    common_checks
    [ "$RC" = 0 ] || WHY+=("perf exit status $RC")
    [ "$F_OK" -gt 0 ] || WHY+=("no I/O completed")
    if [ "$recovery" = retry ]; then
        [ "$F_FAILED" = 0 ] || WHY+=("$F_FAILED I/Os failed under the retry policy")
        [ "$F_RETRIED" -gt 0 ] || WHY+=("nothing was retried: did the reset hit outstanding I/O?")
    else
        [ "$F_RETRIED" = 0 ] || WHY+=("$F_RETRIED I/Os retried under fail-fast")
        [ "$F_FAILED" -gt 0 ] || NOTES+=("$label: no I/O failed (nothing was outstanding at the reset?)")
    fi
    # The longest time without a completion while I/O was outstanding: the reset and the recovery. Below
    # the 5 s I/O timeout means the health check found the reset, not the queue pairs' timeout.
    awk -v s="$F_STALL" 'BEGIN { exit !(s < 5) }' ||
        WHY+=("recovery took $F_STALL s: found by the I/O timeout, not by the health check")
    verdict "$label" "$F_STALL" "${WHY[@]}"
}

REMOVE_S=''
inject_remove() {
    sleep 2
    local t0 t1 rc=0
    t0=$(now)
    removed=1
    timeout 30 sh -c "echo 1 > $dev/remove" || rc=$?
    t1=$(now)
    REMOVE_S=$(secs "$t0" "$t1")
    if [ "$rc" = 0 ]; then
        say "  remove of $bdf finished in $REMOVE_S s"
    else
        say "  remove of $bdf did not finish (exit status $rc after $REMOVE_S s)"
        REMOVE_S="hung ($rc)"
    fi
}

scenario_remove() {
    local label="hot removal (sysfs remove)"
    F_SUB='' F_OK='' F_FAILED='' F_RETRIED='' F_LOST='' F_MISM='' F_STALL=''
    WHY=()
    say "---- $label: 8 s run, remove after 2 s"
    local before
    before=$(dmesg | wc -l)
    run_perf inject_remove 8 retry
    [[ "$REMOVE_S" != hung* ]] || WHY+=("the remove did not finish within 30 s: the device was not released")
    if [[ "$REMOVE_S" != hung* ]] && ! awk -v s="$REMOVE_S" 'BEGIN { exit !(s < 5) }'; then
        WHY+=("the remove took $REMOVE_S s (perf should release the device at once)")
    fi
    [ ! -d "$dev" ] || WHY+=("$dev still exists after the remove")
    local k
    k=$(dmesg | tail -n +"$((before + 1))")
    if grep -q 'blocked until released by user' <<<"$k"; then
        WHY+=("vfio-pci found no device request channel")
    fi
    grep -q 'Relaying device request to user' <<<"$k" && say "  kernel: $(grep -m1 'Relaying device request' <<<"$k" | sed 's/^\[[^]]*\] //')"
    if ! parse_faults; then
        WHY+=("perf printed no faults line (exit status $RC)")
    else
        common_checks
        [ "$RC" -lt 124 ] || WHY+=("perf did not exit by itself (exit status $RC)")
        grep -qi 'removed' "$LOG" || WHY+=("perf did not say the controller was removed")
        [ "$F_FAILED" -gt 0 ] || NOTES+=("$label: no I/O failed (was nothing outstanding?)")
        say "  perf exit status $RC; it said: $(grep -m1 -i 'removed' "$LOG" || true)"
    fi
    restore_device || WHY+=("could not rescan and bind $bdf to vfio-pci again")
    removed=0
    [ "$(driver "$bdf")" = vfio-pci ] || WHY+=("$bdf is bound to '$(driver "$bdf")' after the rescan, not vfio-pci")
    local group
    group=$(basename "$(readlink -f "$dev/iommu_group" 2>/dev/null)" 2>/dev/null || true)
    [ "$group" = "${VM_VFIO_GROUP:-$group}" ] || NOTES+=("$bdf is in IOMMU group $group after the rescan (was $VM_VFIO_GROUP)")
    verdict "$label" "${REMOVE_S} (remove)" "${WHY[@]}"

    # The device works again after the rescan.
    label="after rescan + bind"
    F_SUB='' F_OK='' F_FAILED='' F_RETRIED='' F_LOST='' F_MISM='' F_STALL=''
    WHY=()
    say "---- $label: 2 s run"
    run_perf : 2 retry
    if ! parse_faults; then
        WHY+=("perf printed no faults line (exit status $RC)")
    else
        common_checks
        [ "$RC" = 0 ] || WHY+=("perf exit status $RC")
        [ "$F_FAILED" = 0 ] || WHY+=("$F_FAILED I/Os failed")
        [ "$F_OK" -gt 0 ] || WHY+=("no I/O completed")
    fi
    verdict "$label" "${F_STALL:--}" "${WHY[@]}"
}

[ -e "$dev/reset" ] || die "$bdf has no reset attribute: the kernel knows no reset method for it"
say "$bdf reset methods: $(cat "$dev/reset_method" 2>/dev/null || echo unknown)"
scenario_reset "function reset, retry" retry
scenario_reset "function reset, fail-fast" fail-fast
scenario_remove

echo
echo "| fault (PCIe, $bdf)   | submitted |      ok | failed | retried | lost | mismatches | time to recover (s) | result |"
echo "|------------------------------|-----------|---------|--------|---------|------|------------|---------------------|--------|"
printf '%s\n' "${ROWS[@]}"
echo
echo "time to recover: the longest time without a completion while I/O was outstanding (reset rows); for the"
echo "removal, the time the kernel's remove took until the driver had released the device."
[ ${#NOTES[@]} = 0 ] || printf "$PROG: note: %s\n" "${NOTES[@]}"
[ "$FAILS" = 0 ] || die "$FAILS scenario(s) failed"
echo "pcie-faults: OK"

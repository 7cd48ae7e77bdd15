#!/usr/bin/env bash
# scripts/vm-test.sh - nvpoll's VM test runner.
#
# usage: scripts/vm-test.sh
#
#  1. builds the workspace's test executables and binaries on this machine
#     (debug profile; NVPOLL_VM_PROFILE=release for release);
#  2. boots ONE throw-away guest with scripts/vm.sh;
#  3. in the guest, with NVPOLL_VM=1, runs every test executable that has
#     tests matching the libtest filter (default "vm_": a test whose name
#     contains vm_ is a VM test) with --test-threads=1, then every script
#     scripts/vm-tests/*.sh (they must be executable);
#  4. prints each result and a last line "vm-tests: N passed, N failed".
#
# Exit status: 0 when everything passed; 1 when a test failed, a test went
# missing (crash, timeout), no test ran at all, or the guest did not finish;
# 2 when the build failed.
#
# Knobs (environment):
#   NVPOLL_VM_PROFILE=debug        debug | release
#   NVPOLL_VM_TEST_FILTER=vm_      libtest filter for the Rust tests
#   NVPOLL_VM_SCRIPTS=*            which scripts/vm-tests scripts run: a shell
#                                  pattern for the start of the name (e.g. 70-,
#                                  or '[67]0-'); with NVPOLL_VM_TEST_FILTER=@none,
#                                  which matches no test name, only those run
#   NVPOLL_VM_TEST_TIMEOUT=600     seconds for one test executable or script
#   NVPOLL_VM_KEEP=0               1: keep the results folder (and vm.sh's run folder)
#   NVPOLL_BIN_DIR                 set for the guest to the built binaries' folder
#                                  (e.g. target/debug) unless already set
#   every other NVPOLL_VM_* knob of scripts/vm.sh (cache, memory, timeout,
#   verbosity, ...), and every NVPOLL_* variable reaches the guest.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
FILTER=${NVPOLL_VM_TEST_FILTER:-vm_}
SCRIPTS=${NVPOLL_VM_SCRIPTS:-*}
ITEM_TIMEOUT=${NVPOLL_VM_TEST_TIMEOUT:-600}
TAB=$'\t'

# ===========================================================================
# guest side: scripts/vm-test.sh --in-guest WORKDIR
#   WORKDIR/executables  (input)  exe TAB package-dir TAB label, one a line
#   WORKDIR/results      (output) STATUS TAB name, one per test/script
#   WORKDIR/counts       (output) label TAB expected TAB passed TAB failed TAB ignored
# ===========================================================================
record() { printf '%s\t%s\n' "$1" "$2" >> "$WORK/results"; }
# An item (a test executable or a script) that an earlier guest of this run finished is not run again.
done_before() { [ -f "$WORK/done" ] && grep -qxF -- "$1" "$WORK/done"; }
mark_done() { printf '%s\n' "$1" >> "$WORK/done"; }

run_test_executable() {   # exe pkgdir label
    local exe=$1 dir=$2 label=$3 list rc=0 log expected passed=0 failed=0 ignored=0 summaries=0 line
    if ! list=$(cd "$dir" && timeout 120 "$exe" --list --format terse "$FILTER" 2>&1); then
        echo "vm-test: FAIL $label: listing its tests failed:"; echo "$list"
        record FAIL "$label (could not list tests)"
        printf '%s\t1\t0\t1\t0\n' "$label" >> "$WORK/counts"
        return
    fi
    expected=$(grep -c ': test$' <<< "$list" || true)
    [ "$expected" -gt 0 ] || return 0
    echo "==== $label: $expected test(s) matching '$FILTER'"
    echo "$label" > "$WORK/current"
    log=$(mktemp)
    set +e
    (cd "$dir" && CARGO_MANIFEST_DIR=$dir timeout -k 10 "$ITEM_TIMEOUT" "$exe" "$FILTER" --test-threads=1 2>&1) | tee "$log"
    rc=${PIPESTATUS[0]}
    set -e
    # per-test lines, then the summary line(s) libtest prints; a test that
    # takes the process down leaves "test NAME ... " as the last line
    local crashed='' lp=0 lf=0 li=0
    while IFS= read -r line || [ -n "$line" ]; do
        if [[ "$line" =~ ^test\ ([^ ]+)\ \.\.\.\ ?$ ]]; then
            crashed=${BASH_REMATCH[1]}
        elif [[ "$line" =~ ^test\ (.+)\ \.\.\.\ (ok|FAILED|ignored) ]]; then
            crashed=''
            case "${BASH_REMATCH[2]}" in
                ok) record PASS "$label: ${BASH_REMATCH[1]}"; lp=$((lp + 1)) ;;
                FAILED) record FAIL "$label: ${BASH_REMATCH[1]}"; lf=$((lf + 1)) ;;
                ignored) record IGNORED "$label: ${BASH_REMATCH[1]}"; li=$((li + 1)) ;;
            esac
        elif [[ "$line" =~ ^test\ result:\ [A-Za-z]+\.\ ([0-9]+)\ passed\;\ ([0-9]+)\ failed\;\ ([0-9]+)\ ignored ]]; then
            summaries=$((summaries + 1))
            passed=$((passed + BASH_REMATCH[1]))
            failed=$((failed + BASH_REMATCH[2]))
            ignored=$((ignored + BASH_REMATCH[3]))
        fi
    done < "$log"
    rm -f "$log"
    local seen=$((passed + failed + ignored))
    if [ "$summaries" = 0 ]; then
        local why="exit status $rc"
        if [ "$rc" = 124 ]; then why="timed out after ${ITEM_TIMEOUT}s"
        elif [ "$rc" = 137 ]; then why="SIGKILL: timeout or out of memory"
        elif [ "$rc" -gt 128 ]; then why="killed by signal $((rc - 128))"
        fi
        # no summary: count what the per-test lines said
        passed=$lp failed=$lf ignored=$li seen=$((lp + lf + li))
        echo
        echo "vm-test: FAIL $label: ended without a libtest summary ($why${crashed:+, during $crashed})"
        if [ -n "$crashed" ]; then record FAIL "$label: $crashed ($why)"; fi
        record FAIL "$label ($why; $((expected - seen)) of $expected test(s) did not report)"
        failed=$((failed + expected - seen)); [ "$failed" -gt 0 ] || failed=1
    elif [ "$seen" -lt "$expected" ]; then
        echo "vm-test: FAIL $label: $expected test(s) listed, $seen reported"
        record FAIL "$label ($((expected - seen)) test(s) missing)"
        failed=$((failed + expected - seen))
    elif [ "$rc" != 0 ] && [ "$failed" = 0 ]; then
        echo "vm-test: FAIL $label: all tests passed but it exited with status $rc"
        record FAIL "$label (exit status $rc)"
        failed=1
    fi
    printf '%s\t%s\t%s\t%s\t%s\n' "$label" "$expected" "$passed" "$failed" "$ignored" >> "$WORK/counts"
}

run_script() {   # path
    local f=$1 name=${1#"$ROOT"/} rc=0 t0=$EPOCHREALTIME
    if [ ! -x "$f" ]; then
        echo "vm-test: FAIL $name: not executable (chmod +x it)"
        record FAIL "$name (not executable)"
        printf '%s\t1\t0\t1\t0\n' "$name" >> "$WORK/counts"
        return
    fi
    echo "==== $name"
    echo "$name" > "$WORK/current"
    (cd "$ROOT" && timeout -k 10 "$ITEM_TIMEOUT" "$f" 2>&1) || rc=$?
    local secs; secs=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
    if [ "$rc" = 0 ]; then
        echo "vm-test: PASS $name (${secs}s)"
        record PASS "$name"
        printf '%s\t1\t1\t0\t0\n' "$name" >> "$WORK/counts"
    else
        echo "vm-test: FAIL $name: exit status $rc$([ "$rc" = 124 ] && echo ", timed out after ${ITEM_TIMEOUT}s") (${secs}s)"
        record FAIL "$name (exit status $rc)"
        printf '%s\t1\t0\t1\t0\n' "$name" >> "$WORK/counts"
    fi
}

guest_main() {
    WORK=$1
    export NVPOLL_VM=1
    # (the host made results and counts empty before the first guest; a second guest adds to them)
    echo "vm-test: guest kernel ${VM_KERNEL_VERSION:-$(uname -r)}, vfio $VM_VFIO_BDF (group $VM_VFIO_GROUP), nvme ${VM_KNVME_DEV:-?}, nvmet ${VM_NVMET_NQN:-off}"
    local exe dir label f
    while IFS="$TAB" read -r exe dir label; do
        [ -n "$exe" ] || continue
        done_before "$label" && continue
        run_test_executable "$exe" "$dir" "$label"
        mark_done "$label"
    done < "$WORK/executables"
    shopt -s nullglob
    # shellcheck disable=SC2231  # the pattern is meant to glob
    for f in "$ROOT"/scripts/vm-tests/$SCRIPTS*.sh; do
        done_before "$f" && continue
        run_script "$f"
        mark_done "$f"
    done
    echo finished > "$WORK/finished"
    ! grep -q '^FAIL' "$WORK/results"
}

if [ "${1:-}" = --in-guest ]; then
    [ -n "${2:-}" ] || { echo "usage: $0 --in-guest WORKDIR" >&2; exit 2; }
    guest_main "$2"
    exit
fi

# ===========================================================================
# host side
# ===========================================================================
case "${1:-}" in
    "") ;;
    -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
    *) echo "usage: $0   (no arguments; see --help for the knobs)" >&2; exit 2 ;;
esac

T0=$EPOCHREALTIME
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
PROFILE=${NVPOLL_VM_PROFILE:-debug}
case "$PROFILE" in
    debug) CARGO_PROFILE=() ;;
    release) CARGO_PROFILE=(--release) ;;
    *) echo "vm-test: NVPOLL_VM_PROFILE must be debug or release, not '$PROFILE'" >&2; exit 2 ;;
esac
cd "$ROOT"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/nvpoll-vm-test.XXXXXX")
# shellcheck disable=SC2317  # invoked by the EXIT trap
cleanup() { if [ "${NVPOLL_VM_KEEP:-0}" = 1 ]; then echo "vm-test: kept $WORK" >&2; else rm -rf "$WORK"; fi; }
trap cleanup EXIT

echo "vm-test: building test executables and binaries ($PROFILE)"
if ! cargo test --workspace --no-run "${CARGO_PROFILE[@]}" --message-format=json-render-diagnostics > "$WORK/cargo.json"; then
    echo "vm-test: the build failed" >&2; exit 2
fi
while IFS= read -r line; do
    [[ "$line" == *'"reason":"compiler-artifact"'* ]] || continue
    [[ "$line" =~ \"profile\":\{[^}]*\"test\":true ]] || continue
    [[ "$line" =~ \"executable\":\"([^\"]+)\" ]] || continue
    exe=${BASH_REMATCH[1]}
    [[ "$line" =~ \"manifest_path\":\"([^\"]+)\" ]] || continue
    dir=$(dirname "${BASH_REMATCH[1]}")
    label=${exe##*/}
    [[ "$line" =~ \"src_path\":\"([^\"]+)\" ]] && label=${BASH_REMATCH[1]#"$ROOT"/}
    printf '%s\t%s\t%s\n' "$exe" "$dir" "$label"
done < "$WORK/cargo.json" | sort -t "$TAB" -k3 > "$WORK/executables"
# --lib too: the fio ioengine (libnvpoll_fio.so) is a library no test links, used by scripts/vm-tests/75-*
if ! cargo build --workspace --lib --bins "${CARGO_PROFILE[@]}"; then
    echo "vm-test: the build failed" >&2; exit 2
fi
# where the binaries are, for the scripts in scripts/vm-tests
if [ -z "${NVPOLL_BIN_DIR:-}" ]; then
    meta=$(cargo metadata --format-version 1 --no-deps)
    [[ "$meta" =~ \"target_directory\":\"([^\"]+)\" ]] || { echo "vm-test: no target_directory in cargo metadata" >&2; exit 2; }
    export NVPOLL_BIN_DIR=${BASH_REMATCH[1]}/$PROFILE
fi
shopt -s nullglob
# shellcheck disable=SC2206  # the pattern is meant to glob
scripts=("$ROOT"/scripts/vm-tests/$SCRIPTS*.sh)
shopt -u nullglob
echo "vm-test: built in $(since "$T0")s: $(wc -l < "$WORK/executables") test executable(s), ${#scripts[@]} script(s) in scripts/vm-tests"

# A guest that stops answering (under TCG its kernel has been seen to stall for good, RCU stalls on every
# vCPU, while a controller went back from vfio-pci to nvme) is killed by vm.sh's timeout. Then ONE fresh guest
# runs the item it hung in and every item not yet run; the items finished before are not run again. A second
# hang fails the run, and a hang is always named in the report below.
hangs=()
: > "$WORK/results"; : > "$WORK/counts"; rm -f "$WORK/done" "$WORK/finished"
for attempt in 1 2; do
    T1=$EPOCHREALTIME
    vmrc=0
    : > "$WORK/current"
    NVPOLL_VM_OUT=$WORK "$ROOT/scripts/vm.sh" -- bash "$ROOT/scripts/vm-test.sh" --in-guest "$WORK" || vmrc=$?
    echo "vm-test: guest run took $(since "$T1")s (vm.sh exit status $vmrc)"
    [ ! -f "$WORK/finished" ] || break
    # Only a guest that hung inside an item is given a second chance: one that never started is broken.
    if [ "$attempt" = 1 ] && [ -s "$WORK/current" ] && [ "$vmrc" != 0 ]; then
        hung=$(cat "$WORK/current")
        hangs+=("$hung")
        echo "vm-test: the guest stopped during $hung (vm.sh exit status $vmrc); running it and the items" \
             "after it once more in a fresh guest"
        # (an item records its results when it ends, so the hung one left none)
        continue
    fi
    break
done

# ---- report ----------------------------------------------------------------
passed=0 failed=0 ignored=0
if [ -f "$WORK/counts" ]; then
    while IFS="$TAB" read -r _ _ p f i; do
        passed=$((passed + p)); failed=$((failed + f)); ignored=$((ignored + i))
    done < "$WORK/counts"
fi
echo
echo "vm-tests: results"
if [ -s "$WORK/results" ]; then
    while IFS="$TAB" read -r status name; do printf '  %-7s %s\n' "$status" "$name"; done < "$WORK/results"
fi
problems=0
if [ ! -f "$WORK/finished" ]; then
    echo "vm-tests: the guest did not finish the run (vm.sh exit status $vmrc; 125: setup failure, crash or timeout)"
    [ ! -s "$WORK/current" ] || echo "vm-tests: it was running $(cat "$WORK/current")"
    failed=$((failed + 1)); problems=1
fi
if [ $((passed + failed)) = 0 ]; then
    echo "vm-tests: no test ran (no test matches '$FILTER' and scripts/vm-tests has no script matching '$SCRIPTS*.sh')"
    problems=1
fi
[ "$ignored" = 0 ] || echo "vm-tests: $ignored ignored"
for h in "${hangs[@]}"; do
    echo "vm-tests: NOTE: a guest stopped answering during $h and was replaced; see its console above"
done
echo "vm-tests: total time $(since "$T0")s"
echo "vm-tests: $passed passed, $failed failed"
if [ "$failed" = 0 ] && [ "$problems" = 0 ] && [ "$vmrc" != 0 ]; then
    # The guest finished every item and each passed (the verdict is the items'), yet its command's status was
    # not 0. Seen in a full run on 2026-12-06 (and once in an earlier session) and not explained yet: the
    # guest's last command is a grep of the results for FAIL. Said loudly, not hidden.
    echo "vm-tests: NOTE: every item passed and the guest finished, but its command exited with status $vmrc" \
         "(unexplained; see the guest's output above)"
    exit 0
fi
[ "$failed" = 0 ] && [ "$problems" = 0 ] && [ "$vmrc" = 0 ]

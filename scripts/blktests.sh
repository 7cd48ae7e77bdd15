#!/usr/bin/env bash
# scripts/blktests.sh - the Linux kernel's own NVMe tests (blktests' nvme group)
# against nvpoll's target and against the kernel's nvmet, in one guest of
# scripts/vm.sh, side by side.
#
# usage: BLKTESTS_DIR=/path/to/blktests scripts/blktests.sh [TEST ...]
#        (default: the whole nvme group; e.g. nvme/019 nvme/054)
#
# BLKTESTS_DIR is a checkout of linux-blktests/blktests built with `make`.
# Nothing here fetches it: without it the script says so and exits 0 (CI has
# no copy). In the guest:
#  1. nvpoll's target runs with an empty configuration and a control socket,
#     and `./check` runs the tests with NVME_TARGET_CONTROL pointing at
#     scripts/blktests-control.sh, which adds and removes each test's subsystem
#     (a file namespace with the test's UUID) through the socket;
#  2. the same tests run against nvmet (NVMET_TRTYPES=tcp, blktests' own
#     configfs setup), in a fresh copy of the checkout;
#  3. a table prints each test's result against both, and the two full
#     outputs are kept in NVPOLL_BT_OUT (default: a folder under /tmp, named at
#     the end).
#
# Knobs: NVPOLL_BT_IMG_SIZE=256M (blktests' NVME_IMG_SIZE for both runs: the
# guest's root is a tmpfs of half its 2 GiB, and nvme/010 fills its image, so
# blktests' 1G default runs out of space against nvmet and us alike),
# NVPOLL_BT_NVME_CLI=/path/to/nvme (a newer nvme-cli, e.g. 2.16 built
# statically, put first on the guest's PATH; the guest's own is Debian's 2.3),
# NVPOLL_BT_TIMEOUT=5400 (seconds for the whole guest run), every NVPOLL_VM_*
# knob of scripts/vm.sh (NVPOLL_VM_TLSHD for the TLS tests, for one).
# Exit status: 0 when every test that passed against nvmet passed against
# nvpoll too; 1 otherwise (the table says which); 2 on a setup failure.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)

# ---- guest side: scripts/blktests.sh --in-guest OUT TEST... --------------------
if [ "${1:-}" = --in-guest ]; then
    OUT=$2; shift 2
    TESTS=("$@")
    EX=$ROOT/target/debug
    export NVME_IMG_SIZE=${NVPOLL_BT_IMG_SIZE:-256M}
    if [ -n "${NVPOLL_BT_NVME_CLI:-}" ]; then
        mkdir -p /tmp/bt-bin && cp "$NVPOLL_BT_NVME_CLI" /tmp/bt-bin/nvme && export PATH=/tmp/bt-bin:$PATH
    fi
    # The guest's minimal /dev has no /dev/fd, which bash's process substitution (blktests uses it) needs.
    [ -e /dev/fd ] || ln -s /proc/self/fd /dev/fd
    # blktests reads the kernel's options (CONFIG_NVME_AUTH, ...) from /boot/config-RELEASE: the guest's
    # kernel package has one beside the modules vm.sh links in.
    kcfg="$(readlink -f "/lib/modules/$(uname -r)")/../../../boot/config-$(uname -r)"
    if [ ! -e "/boot/config-$(uname -r)" ] && [ -r "$kcfg" ]; then
        mkdir -p /boot && cp "$kcfg" "/boot/config-$(uname -r)"
    fi
    echo "blktests: nvme-cli $(nvme version 2>/dev/null | head -1), kernel $(uname -r)"
    modprobe nvme-tcp 2>/dev/null || true
    # --- 1. nvpoll's target
    cp -a "$NVPOLL_BT_DIR" /tmp/bt-ours || exit 2
    printf '{"listeners": [{"address": "127.0.0.1:4420"}], "subsystems": []}\n' > /tmp/bt-empty.json
    "$EX/nvpoll-target" --config /tmp/bt-empty.json --rpc-socket /run/nvpoll-blktests.sock \
        > "$OUT/target.log" 2>&1 &
    tpid=$!
    for _ in $(seq 100); do grep -q "control socket" "$OUT/target.log" && break; sleep 0.1; done
    grep -q "control socket" "$OUT/target.log" || { echo "blktests: the target did not start"; cat "$OUT/target.log"; exit 2; }
    echo "blktests: against nvpoll's target (pid $tpid): ${TESTS[*]}"
    (cd /tmp/bt-ours && NVME_TARGET_CONTROL=$ROOT/scripts/blktests-control.sh NVPOLL_BT_RPC=$EX/nvpoll-rpc \
        NVPOLL_BT_PORT=4420 ./check "${TESTS[@]}") > "$OUT/nvpoll.txt" 2>&1
    kill -INT "$tpid"; wait "$tpid"
    echo "blktests: the target exited with status $? ($(grep '^stats:' "$OUT/target.log"))"
    # --- 2. nvmet
    cp -a "$NVPOLL_BT_DIR" /tmp/bt-nvmet || exit 2
    echo "blktests: against nvmet: ${TESTS[*]}"
    (cd /tmp/bt-nvmet && NVMET_TRTYPES=tcp ./check "${TESTS[@]}") > "$OUT/nvmet.txt" 2>&1
    dmesg > "$OUT/dmesg.txt" 2>&1 || true
    echo done > "$OUT/finished"
    exit 0
fi

# ---- host side ------------------------------------------------------------------
case "${1:-}" in -h | --help) sed -n '2,/^set -uo/{/^set -uo/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;; esac
if [ -z "${BLKTESTS_DIR:-}" ]; then
    echo "blktests: skipped: set BLKTESTS_DIR to a blktests checkout built with make" \
         "(https://github.com/linux-blktests/blktests); CI has none"
    exit 0
fi
[ -x "$BLKTESTS_DIR/check" ] || { echo "blktests: $BLKTESTS_DIR has no ./check" >&2; exit 2; }
# The guest runs on this machine's root file system: blktests' own needs must be installed here.
for tool in gawk udevadm; do
    command -v "$tool" >/dev/null || { echo "blktests: needs $tool here (apt-get install gawk udev)" >&2; exit 2; }
done
BLKTESTS_DIR=$(cd "$BLKTESTS_DIR" && pwd -P)
# The guest gets the NVPOLL_* variables.
export NVPOLL_BT_DIR=$BLKTESTS_DIR
[ $# -gt 0 ] || set -- nvme
OUT=${NVPOLL_BT_OUT:-$(mktemp -d "${TMPDIR:-/tmp}/nvpoll-blktests.XXXXXX")}
mkdir -p "$OUT"
cd "$ROOT"
cargo build --bins --quiet || exit 2
# nvmet's tests set up their own ports: the guest's standing nvmet target would be in their way.
NVPOLL_VM_NVMET=0 NVPOLL_VM_TIMEOUT=${NVPOLL_BT_TIMEOUT:-5400} NVPOLL_VM_OUT=$OUT \
    "$ROOT/scripts/vm.sh" -- bash "$ROOT/scripts/blktests.sh" --in-guest "$OUT" "$@"
vmrc=$?
[ -f "$OUT/finished" ] || { echo "blktests: the guest did not finish (vm.sh exit status $vmrc); outputs so far in $OUT" >&2; exit 2; }

# ---- table ------------------------------------------------------------------------
# blktests prints "nvme/019 (tr=tcp bd=file) (description) [passed]" and, for
# a test that did not run, "[not run]" followed by its reasons.
results() {
    sed 's/\x1b\[[0-9;]*[A-Za-z]//g; s/\r/\n/g' "$1" | awk '
        /^nvme\/[0-9]+/ && /\[(passed|failed|not run)\]/ {
            t = $1; r = $0; sub(/.*\[/, "", r); sub(/\].*/, "", r); res[t] = r; last = t; next }
        /^[ \t]+[a-zA-Z]/ && !/^[ \t]+runtime/ && last != "" && res[last] == "not run" && !(last in why) {
            w = $0; sub(/^[ \t]+/, "", w); why[last] = w }
        END { for (t in res) printf "%s\t%s\t%s\n", t, res[t], why[t] }' | sort
}
results "$OUT/nvpoll.txt" > "$OUT/nvpoll.tsv"
results "$OUT/nvmet.txt" > "$OUT/nvmet.tsv"
printf '| %-9s | %-8s | %-8s | %s\n' test nvpoll nvmet "why not run (nvpoll)"
printf '|-----------|----------|----------|------\n'
bad=0
while IFS=$'\t' read -r t ours why; do
    theirs=$(awk -F '\t' -v t="$t" '$1 == t { print $2 }' "$OUT/nvmet.tsv")
    printf '| %-9s | %-8s | %-8s | %s\n' "$t" "$ours" "${theirs:-?}" "${why:0:70}"
    if [ "$theirs" = passed ] && [ "$ours" != passed ]; then bad=$((bad + 1)); fi
done < <(join -t $'\t' -a 1 -a 2 -o 0,1.2,1.3 "$OUT/nvpoll.tsv" "$OUT/nvmet.tsv")
echo
echo "blktests: nvpoll passed $(grep -c $'\tpassed' "$OUT/nvpoll.tsv"), nvmet passed $(grep -c $'\tpassed' "$OUT/nvmet.tsv");" \
     "$bad passed against nvmet but not against nvpoll; full outputs in $OUT"
[ "$bad" = 0 ]

#!/usr/bin/env bash
# scripts/vm-tests/22-kernel-dsm-our-target.sh - the Linux host's discard and
# Dataset Management against nvpoll's target, in the guest of scripts/vm.sh
# (blktests nvme/019 and nvme/025 check the same against nvmet).
#
#  1. starts nvpoll-target with a RAM namespace (1) and a file namespace
#     (2), 4 KiB blocks, and connects the kernel host;
#  2. Identify: ONCS has Dataset Management, each namespace's DLFEAT says
#     deallocated blocks read as zeroes; the block devices take discards;
#  3. the Commands Supported and Effects log page (05h) marks Dataset
#     Management (09h) and Write supported and changing content;
#  4. on each namespace: a 4 MiB random pattern (dd, O_DIRECT), then blkdiscard
#     of 1 MiB and `nvme dsm --ad` of 8 blocks elsewhere: those read back as
#     zeroes and every other byte as written; the file namespace's file holds
#     fewer allocated blocks after the discard (a punched hole);
#  5. disconnects and stops the target: it exits 0 with no internal error.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)
PORT=4432
ADDR=127.0.0.1
NQN=nqn.2024-01.io.nvpoll:vm-dsm
EXAMPLES=${NVPOLL_BIN_DIR:-$ROOT/target/debug}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/nvpoll-dsm.XXXXXX")
LOG=$WORK/target.log
TPID=

say()  { echo "kernel-dsm: $*"; }
fail() { echo "kernel-dsm: FAIL $*" >&2; [ ! -s "$LOG" ] || tail -n 20 "$LOG" >&2; exit 1; }
cleanup() {
    nvme disconnect -n "$NQN" >/dev/null 2>&1 || true
    [ -z "$TPID" ] || { kill -INT "$TPID" 2>/dev/null; wait "$TPID" 2>/dev/null; }
    rm -rf "$WORK"
}
trap cleanup EXIT

[ "${NVPOLL_VM:-}" = 1 ] || { echo "kernel-dsm: skipped: not in the scripts/vm.sh guest (run scripts/vm-test.sh)"; exit 0; }
for tool in nvme blkdiscard dd cmp; do
    command -v "$tool" >/dev/null || fail "$tool is missing in the guest"
done
modprobe nvme-tcp 2>/dev/null || true

# ---- 1. target and connection ----------------------------------------------------
truncate -s 64M "$WORK/ns.img"
"$EXAMPLES/nvpoll-target" --listen "$ADDR:$PORT" --nqn "$NQN" --ram 64M --file "$WORK/ns.img" --block-size 4096 \
    > "$LOG" 2>&1 &
TPID=$!
for _ in $(seq 100); do grep -q "listening on" "$LOG" && break; kill -0 "$TPID" 2>/dev/null || break; sleep 0.1; done
grep -q "listening on" "$LOG" || fail "step 1: the target did not start"
host_args=(--hostnqn "$VM_HOSTNQN" --hostid "$VM_HOSTID")
out=$(nvme connect -t tcp -a "$ADDR" -s "$PORT" -n "$NQN" "${host_args[@]}" 2>&1) || fail "step 1: nvme connect: $out"
# The controller (nvmeX) and the block device of each namespace (nvmeYnZ; with native multipath the head
# node sits under the subsystem).
ctrl= devs=()
for _ in $(seq 300); do
    ctrl= devs=()
    for c in /sys/class/nvme/nvme*; do
        [ "$(cat "$c/subsysnqn" 2>/dev/null)" = "$NQN" ] && ctrl=${c##*/}
    done
    for nsid in 1 2; do
        for d in /sys/class/nvme-subsystem/* /sys/class/nvme/*; do
            [ "$(cat "$d/subsysnqn" 2>/dev/null)" = "$NQN" ] || continue
            for b in "$d"/nvme*; do
                # By the namespace's ID (sysfs nsid), not by the device's name: the kernel scans namespaces
                # concurrently and numbers their nodes in the order they come, so nvmeXn1 may be NSID 2.
                [[ "${b##*/}" =~ ^nvme[0-9]+n[0-9]+$ ]] && [ -b "/dev/${b##*/}" ] || continue
                [ "$(cat "$b/nsid" 2>/dev/null)" = "$nsid" ] && { devs+=("/dev/${b##*/}"); break 2; }
            done
        done
    done
    [ -n "$ctrl" ] && [ "${#devs[@]}" = 2 ] && break
    sleep 0.1
done
[ -n "$ctrl" ] && [ "${#devs[@]}" = 2 ] || fail "step 1: controller '$ctrl', block devices '${devs[*]}' for $NQN"
say "connected: /dev/$ctrl, namespaces ${devs[*]}"

# ---- 2. Identify and the block layer ---------------------------------------------
oncs=$(nvme id-ctrl "/dev/$ctrl" | awk '$1 == "oncs" { print $3 }')
[ -n "$oncs" ] && (( oncs & 4 )) || fail "step 2: ONCS $oncs has no Dataset Management"
for d in "${devs[@]}"; do
    dlfeat=$(nvme id-ns "$d" | awk '$1 == "dlfeat" { print $3 }')
    [ "$dlfeat" = 9 ] || fail "step 2: $d DLFEAT is '$dlfeat', not 9 (reads zeroes, Write Zeroes deallocates)"
    max=$(cat "/sys/block/${d#/dev/}/queue/discard_max_bytes")
    [ "$max" -gt 0 ] || fail "step 2: $d takes no discards (discard_max_bytes 0)"
done
say "ok: ONCS $oncs, DLFEAT 9 on both namespaces, discards on (discard_max_bytes $max)"

# ---- 3. the effects log ------------------------------------------------------------
# (Debian's nvme-cli 2.3 `effects-log` prints nothing, for QEMU's controller too: read the page raw.)
out=$(nvme get-log "/dev/$ctrl" --log-id=5 --log-len=4096 --raw-binary 2>&1 > "$WORK/effects") \
    || fail "step 3: nvme get-log 05h: $out"
[ "$(stat -c %s "$WORK/effects")" = 4096 ] || fail "step 3: the effects log is not 4096 bytes"
effect() { od -An -tu4 -j "$1" -N4 "$WORK/effects" | tr -d ' '; }
# I/O opcodes from byte 1024: Read 02h supported (1), Write 01h and Dataset Management 09h supported and
# changing logical block content (3); admin Identify 06h supported (1).
for check in "1024+4*2 1 Read" "1024+4*1 3 Write" "1024+4*9 3 Dataset-Management" "4*6 1 Identify"; do
    set -- $check
    got=$(effect $(($1)))
    [ "$got" = "$2" ] || fail "step 3: effects log: $3 has $got, not $2"
done
say "ok: the effects log (05h) marks Read, Identify supported, Write and Dataset Management changing content"

# ---- 4. discard and DSM read back as zeroes ------------------------------------------
head -c $((4 << 20)) /dev/urandom > "$WORK/pattern"
for d in "${devs[@]}"; do
    dd if="$WORK/pattern" of="$d" bs=1M oflag=direct conv=fsync status=none || fail "step 4: dd to $d"
    [ "$d" != "${devs[1]}" ] || before=$(du -k "$WORK/ns.img" | cut -f1)
    blkdiscard -o $((1 << 20)) -l $((1 << 20)) "$d" || fail "step 4: blkdiscard on $d"
    # 8 blocks (32 KiB) at block 768 (3 MiB).
    nsid=$(cat "/sys/block/${d#/dev/}/nsid") || fail "step 4: no nsid in sysfs for $d"
    out=$(nvme dsm "$d" --namespace-id="$nsid" --ad --slbs=768 --blocks=8 2>&1) || fail "step 4: nvme dsm on $d (NSID $nsid): $out"
    cp "$WORK/pattern" "$WORK/want"
    dd if=/dev/zero of="$WORK/want" bs=1M seek=1 count=1 conv=notrunc status=none
    dd if=/dev/zero of="$WORK/want" bs=4096 seek=768 count=8 conv=notrunc status=none
    dd if="$d" of="$WORK/got" bs=1M count=4 iflag=direct status=none || fail "step 4: reading $d"
    cmp -s "$WORK/want" "$WORK/got" || fail "step 4: $d does not read back as written with the discarded ranges zeroed ($(cmp "$WORK/want" "$WORK/got" | head -1))"
    say "ok: $d: blkdiscard 1 MiB and nvme dsm --ad 8 blocks read back as zeroes, the rest as written"
done
after=$(du -k "$WORK/ns.img" | cut -f1)
[ "$after" -lt "$before" ] || fail "step 4: the file namespace's file did not shrink on disk: ${before}K -> ${after}K"
say "ok: the file namespace's file went from ${before}K to ${after}K allocated"

# ---- 5. clean stop --------------------------------------------------------------------
out=$(nvme disconnect -n "$NQN" 2>&1) || fail "step 5: nvme disconnect: $out"
kill -INT "$TPID"; rc=0; wait "$TPID" || rc=$?; TPID=
[ "$rc" = 0 ] || fail "step 5: the target exited with status $rc"
grep -q "internal errors 0" "$LOG" || fail "step 5: internal errors: $(grep '^stats:' "$LOG")"
say "$(grep '^stats:' "$LOG")"
say "all checks passed"

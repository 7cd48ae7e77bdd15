#!/usr/bin/env bash
# scripts/vm-tests/20-kernel-initiator-vs-our-target.sh - the Linux kernel's
# NVMe/TCP host against nvpoll's target (nvpoll-target), inside the guest of
# scripts/vm.sh (scripts/vm-test.sh runs it there).
#
#  1. starts nvpoll-target on 127.0.0.1:4430 with a 96 MiB RAM namespace;
#  2. nvme discover must list its subsystem;
#  3. without digests, then with --hdr-digest --data-digest: nvme connect, fio
#     randwrite of 32 MiB with --verify=crc32c at bs 4k and 128k (writes go
#     in-capsule and through R2T), nvme disconnect;
#  4. the kernel writes a random 4 MiB pattern (dd, O_DIRECT), disconnects,
#     and our initiator reads it back (the vm_check_pattern_from_env test of
#     nvmf-target/tests/target_vm.rs) from the same running target;
#  5. stops the target with SIGINT: it must exit 0 having sent no C2HTermReq
#     and hit no internal error.
#
# Exits non-zero with a message naming the failed step.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)
PORT=4430
ADDR=127.0.0.1
NQN=nqn.2024-01.io.nvpoll:vmtest
EXAMPLES=${NVPOLL_BIN_DIR:-$ROOT/target/debug}
BIN=$EXAMPLES/nvpoll-target
WORK=$(mktemp -d "${TMPDIR:-/tmp}/nvpoll-kernel-vs-target.XXXXXX")
LOG=$WORK/target.log
TPID=

say()  { echo "kernel-vs-target: $*"; }
fail() { echo "kernel-vs-target: FAIL $*" >&2; exit 1; }

# shellcheck disable=SC2317  # invoked by the EXIT trap
cleanup() {
    local rc=$?
    nvme disconnect -n "$NQN" >/dev/null 2>&1 || true
    if [ -n "$TPID" ] && kill -0 "$TPID" 2>/dev/null; then
        kill -INT "$TPID" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$TPID" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$TPID" 2>/dev/null || true
    fi
    if [ "$rc" != 0 ] && [ -f "$LOG" ]; then
        echo "---- target log"; cat "$LOG"; echo "----"
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT

host_args=()
[ -n "${VM_HOSTNQN:-}" ] && host_args+=(--hostnqn "$VM_HOSTNQN")
[ -n "${VM_HOSTID:-}" ] && host_args+=(--hostid "$VM_HOSTID")

# The block device of our subsystem's namespace 1, once the kernel made it.
block_device() {
    local d c name
    for _ in $(seq 300); do
        for d in /sys/class/nvme-subsystem/* /sys/class/nvme/*; do
            [ "$(cat "$d/subsysnqn" 2>/dev/null)" = "$NQN" ] || continue
            for c in "$d"/nvme*; do
                name=${c##*/}
                if [[ "$name" =~ ^nvme[0-9]+n1$ ]] && [ -b "/dev/$name" ]; then
                    echo "/dev/$name"; return 0
                fi
            done
        done
        sleep 0.1
    done
    return 1
}

gone() {
    local d
    for _ in $(seq 100); do
        local found=0
        for d in /sys/class/nvme/*; do
            [ "$(cat "$d/subsysnqn" 2>/dev/null)" = "$NQN" ] && found=1
        done
        [ "$found" = 0 ] && return 0
        sleep 0.1
    done
    return 1
}

# ---- 1. the target -----------------------------------------------------------
[ -x "$BIN" ] || fail "no nvpoll-target at $BIN (build it: cargo build --bins)"
core=$(( $(nproc) - 1 ))
"$BIN" --listen "$ADDR:$PORT" --nqn "$NQN" --ram 96M --block-size 512 --cores "$core" > "$LOG" 2>&1 &
TPID=$!
for _ in $(seq 100); do grep -q "listening on" "$LOG" && break; kill -0 "$TPID" 2>/dev/null || break; sleep 0.1; done
grep -q "listening on" "$LOG" || fail "step 1: the target did not start"
say "target running (pid $TPID, reactor on core $core)"
modprobe nvme-tcp 2>/dev/null || true

# ---- 2. discovery ------------------------------------------------------------
disc=$(nvme discover -t tcp -a "$ADDR" -s "$PORT" "${host_args[@]}" 2>&1) || fail "step 2: nvme discover: $disc"
grep -Eq "^subnqn:[[:space:]]+$NQN\$" <<< "$disc" || fail "step 2: nvme discover does not list $NQN: $disc"
grep -Eq "^trsvcid:[[:space:]]+$PORT\$" <<< "$disc" || fail "step 2: wrong trsvcid: $disc"
say "ok: nvme discover lists $NQN"

# ---- 3. fio with verify, without and with digests ------------------------------
for mode in plain digests; do
    args=()
    [ "$mode" = digests ] && args=(--hdr-digest --data-digest)
    out=$(nvme connect -t tcp -a "$ADDR" -s "$PORT" -n "$NQN" "${host_args[@]}" "${args[@]}" 2>&1) \
        || fail "step 3 ($mode): nvme connect: $out"
    dev=$(block_device) || fail "step 3 ($mode): no block device appeared for $NQN"
    if [ "$mode" = digests ]; then
        grep -q "digests header+data" "$LOG" || fail "step 3: the target did not negotiate both digests"
    fi
    say "connected ($mode): $dev, $(cat "/sys/block/${dev#/dev/}/size") sectors"
    offset=0
    for bs in 4k 128k; do
        if ! out=$(fio --name="verify-$mode-$bs" --filename="$dev" --direct=1 --ioengine=libaio --iodepth=16 \
            --rw=randwrite --bs="$bs" --size=32M --offset="$offset" --verify=crc32c --do_verify=1 \
            --verify_fatal=1 --randrepeat=0 --norandommap=0 2>&1); then
            fail "step 3 ($mode): fio bs=$bs: $out"
        fi
        grep -Eq "err= *0" <<< "$out" || fail "step 3 ($mode): fio bs=$bs reported errors: $out"
        say "ok: fio randwrite + crc32c verify, bs $bs, 32 MiB ($mode)"
        offset=$((offset + (32 << 20)))
    done
    out=$(nvme disconnect -n "$NQN" 2>&1) || fail "step 3 ($mode): nvme disconnect: $out"
    gone || fail "step 3 ($mode): the controller did not go away after disconnect"
done

# ---- 4. the kernel writes, our initiator reads ----------------------------------
head -c $((4 << 20)) /dev/urandom > "$WORK/pattern"
out=$(nvme connect -t tcp -a "$ADDR" -s "$PORT" -n "$NQN" "${host_args[@]}" 2>&1) || fail "step 4: nvme connect: $out"
dev=$(block_device) || fail "step 4: no block device appeared"
seek_mib=64
dd if="$WORK/pattern" of="$dev" bs=1M seek=$seek_mib oflag=direct conv=fsync status=none \
    || fail "step 4: dd to $dev failed"
out=$(nvme disconnect -n "$NQN" 2>&1) || fail "step 4: nvme disconnect: $out"
gone || fail "step 4: the controller did not go away"
deps=$EXAMPLES/deps
checker=
for f in "$deps"/target_vm-*; do   # the newest build of the test executable
    [[ "$f" == *.d ]] && continue
    if [ -x "$f" ] && { [ -z "$checker" ] || [ "$f" -nt "$checker" ]; }; then checker=$f; fi
done
if [ -z "$checker" ] || [ ! -x "$checker" ]; then
    fail "step 4: no target_vm test executable in $deps (cargo test --no-run builds it)"
fi
if ! out=$(NVPOLL_TARGET_CHECK="$ADDR:$PORT $NQN $WORK/pattern $((seek_mib << 20))" \
    "$checker" vm_check_pattern_from_env --exact --test-threads=1 --nocapture 2>&1); then
    fail "step 4: our initiator did not read back what the kernel wrote: $out"
fi
grep -q "match" <<< "$out" || fail "step 4: the check did not run: $out"
say "ok: our initiator reads back the 4 MiB the kernel wrote"

# ---- 5. clean stop ----------------------------------------------------------------
kill -INT "$TPID"
rc=0
wait "$TPID" || rc=$?
TPID=
[ "$rc" = 0 ] || fail "step 5: the target exited with status $rc"
grep -q "^stats:" "$LOG" || fail "step 5: no stats line"
grep -q "C2HTermReq 0;" "$LOG" || fail "step 5: the target sent termination requests: $(grep '^stats:' "$LOG")"
grep -q "internal errors 0" "$LOG" || fail "step 5: the target hit internal errors: $(grep '^stats:' "$LOG")"
say "$(grep '^stats:' "$LOG")"
say "all checks passed"

#!/usr/bin/env bash
# scripts/vm-tests/24-kernel-queue-count-our-target.sh - the Linux host's queue
# count follows our target's I/O queue grant across a reconnect, in the guest of
# scripts/vm.sh (what blktests nvme/048 checks with nvmet's attr_qid_max, a
# configfs file it cannot find on our target).
#
#  1. starts nvpoll-target with a control socket; nvme connect with
#     --keep-alive-tmo 1 --reconnect-delay 2: the controller is live with the
#     guest's CPU count of I/O queues (the target grants more);
#  2. rpc subsystem_set_max_io_queues 1: the target tears the controller down,
#     the host reconnects, and /sys/class/nvme-fabrics/ctl/nvmeX/queue_count
#     becomes 2 (admin + 1) with the controller live;
#  3. the same with 2 (queue_count 3), and a write and read through the device;
#  4. disconnects; the target exits 0 with no internal error.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)
PORT=4436
ADDR=127.0.0.1
NQN=nqn.2024-01.io.nvpoll:vm-qcount
EXAMPLES=${NVPOLL_BIN_DIR:-$ROOT/target/debug}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/nvpoll-qcount.XXXXXX")
LOG=$WORK/target.log
SOCK=$WORK/ctl.sock
TPID=

say()  { echo "kernel-qcount: $*"; }
fail() { echo "kernel-qcount: FAIL $*" >&2; [ ! -s "$LOG" ] || tail -n 20 "$LOG" >&2; exit 1; }
cleanup() {
    nvme disconnect -n "$NQN" >/dev/null 2>&1 || true
    [ -z "$TPID" ] || { kill -INT "$TPID" 2>/dev/null; wait "$TPID" 2>/dev/null; }
    rm -rf "$WORK"
}
trap cleanup EXIT

[ "${NVPOLL_VM:-}" = 1 ] || { echo "kernel-qcount: skipped: not in the scripts/vm.sh guest (run scripts/vm-test.sh)"; exit 0; }
command -v nvme >/dev/null || fail "nvme-cli is missing in the guest"
modprobe nvme-tcp 2>/dev/null || true

"$EXAMPLES/nvpoll-target" --listen "$ADDR:$PORT" --nqn "$NQN" --ram 64M --rpc-socket "$SOCK" > "$LOG" 2>&1 &
TPID=$!
for _ in $(seq 100); do grep -q "control socket" "$LOG" && break; kill -0 "$TPID" 2>/dev/null || break; sleep 0.1; done
grep -q "control socket" "$LOG" || fail "step 1: the target did not start"

out=$(nvme connect -t tcp -a "$ADDR" -s "$PORT" -n "$NQN" --hostnqn "$VM_HOSTNQN" --hostid "$VM_HOSTID" \
    --keep-alive-tmo 1 --reconnect-delay 2 2>&1) || fail "step 1: nvme connect: $out"
ctrl=
for _ in $(seq 100); do
    for c in /sys/class/nvme/nvme*; do
        [ "$(cat "$c/subsysnqn" 2>/dev/null)" = "$NQN" ] && ctrl=${c##*/}
    done
    [ -n "$ctrl" ] && break
    sleep 0.1
done
[ -n "$ctrl" ] || fail "step 1: no controller for $NQN"
state() { cat "/sys/class/nvme/$ctrl/state" 2>/dev/null; }
count() { cat "/sys/class/nvme-fabrics/ctl/$ctrl/queue_count" 2>/dev/null; }
say "connected: /dev/$ctrl, state $(state), queue_count $(count)"

# Sets the grant to $1 and waits (30 s at most) for the controller to be live again with $1 + 1 queues.
grant() {
    local want=$(($1 + 1)) t0=$EPOCHREALTIME out
    out=$("$EXAMPLES/nvpoll-rpc" -s "$SOCK" subsystem_set_max_io_queues nqn="$NQN" max_io_queues="$1" 2>&1) \
        || fail "subsystem_set_max_io_queues $1: $out"
    for _ in $(seq 300); do
        [ "$(count)" = "$want" ] && [ "$(state)" = live ] && break
        sleep 0.1
    done
    [ "$(count)" = "$want" ] && [ "$(state)" = live ] \
        || fail "grant $1: queue_count $(count), state $(state); wanted $want and live"
    say "ok: grant $1 ($out): the host reconnected with queue_count $want, live after $(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')s"
}
grant 1
grant 2

dev=
for b in /sys/class/nvme/"$ctrl"/nvme*n1 /sys/class/nvme-subsystem/*/nvme*n1; do
    [ -b "/dev/${b##*/}" ] && [ "$(cat "${b%/*}/subsysnqn" 2>/dev/null)" = "$NQN" ] && dev=/dev/${b##*/}
done
[ -n "$dev" ] || fail "step 3: no block device"
head -c $((1 << 20)) /dev/urandom > "$WORK/pattern"
dd if="$WORK/pattern" of="$dev" bs=1M oflag=direct status=none || fail "step 3: write to $dev"
dd if="$dev" of="$WORK/back" bs=1M count=1 iflag=direct status=none || fail "step 3: read $dev"
cmp -s "$WORK/pattern" "$WORK/back" || fail "step 3: $dev did not read back what was written"
say "ok: 1 MiB written and read back through $dev over the new queues"

out=$(nvme disconnect -n "$NQN" 2>&1) || fail "step 4: nvme disconnect: $out"
kill -INT "$TPID"; rc=0; wait "$TPID" || rc=$?; TPID=
[ "$rc" = 0 ] || fail "step 4: the target exited with status $rc"
grep -q "internal errors 0" "$LOG" || fail "step 4: internal errors: $(grep '^stats:' "$LOG")"
say "$(grep '^stats:' "$LOG")"
say "all checks passed"

#!/usr/bin/env bash
# scripts/vm-tests/27-kernel-namespace-remap-our-target.sh - what blktests nvme/058 (rapid namespace
# remapping) and nvme/051 (concurrent namespace enable/disable) check with nvmet's configfs, which they write
# directly even when NVME_TARGET_CONTROL names another target, done against our target through its control
# socket, in the guest of scripts/vm.sh:
#
#  1. our target serves one subsystem with three file namespaces, each in its own ANA group, on two
#     listeners; the Linux host connects through both (native multipath);
#  2. eleven times, the three namespaces are removed in random order and added again in random order with new
#     UUIDs and a rotated ANA group (nvme/058's "unmap on one cluster node, remap on another");
#  3. meanwhile two loops remove and add a fourth namespace concurrently, 40 times each (nvme/051);
#  4. the host ends with the three namespaces under their last UUIDs, 1 MiB written and read back through
#     each, the kernel logged no warning or oops, and the target exits 0 with no internal error.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)
PROG=kernel-ns-remap
P1=4439
P2=4440
ADDR=127.0.0.1
NQN=nqn.2024-01.io.nvpoll:vm-remap
EXAMPLES=${NVPOLL_BIN_DIR:-$ROOT/target/debug}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/nvpoll-remap.XXXXXX")
LOG=$WORK/target.log
SOCK=$WORK/ctl.sock
TPID=''

say()  { echo "$PROG: $*"; }
fail() { echo "$PROG: FAIL $*" >&2; [ ! -s "$LOG" ] || tail -n 20 "$LOG" >&2; exit 1; }
cleanup() {
    nvme disconnect -n "$NQN" >/dev/null 2>&1 || true
    [ -z "$TPID" ] || { kill -INT "$TPID" 2>/dev/null; wait "$TPID" 2>/dev/null; }
    rm -rf "$WORK"
}
trap cleanup EXIT

[ "${NVPOLL_VM:-}" = 1 ] || { echo "$PROG: skipped: not in the scripts/vm.sh guest (run scripts/vm-test.sh)"; exit 0; }
command -v nvme >/dev/null || fail "nvme-cli is missing in the guest"
modprobe nvme-tcp 2>/dev/null || true
DMESG0=$(dmesg 2>/dev/null | wc -l) || DMESG0=0

uuid() { cat /proc/sys/kernel/random/uuid; }
for n in 1 2 3; do truncate -s 64M "$WORK/ns$n.img"; done
declare -A UUID
for n in 1 2 3; do UUID[$n]=$(uuid); done
cat > "$WORK/config.json" <<EOF
{"listeners": [{"address": "$ADDR:$P1"}, {"address": "$ADDR:$P2"}],
 "subsystems": [{"nqn": "$NQN", "allow_any_host": true, "namespaces": [
   {"nsid": 1, "file": "$WORK/ns1.img", "ana_group": 1, "uuid": "${UUID[1]}"},
   {"nsid": 2, "file": "$WORK/ns2.img", "ana_group": 2, "uuid": "${UUID[2]}"},
   {"nsid": 3, "file": "$WORK/ns3.img", "ana_group": 3, "uuid": "${UUID[3]}"}]}]}
EOF
"$EXAMPLES/nvpoll-target" --config "$WORK/config.json" --rpc-socket "$SOCK" > "$LOG" 2>&1 &
TPID=$!
for _ in $(seq 100); do grep -q "control socket" "$LOG" && break; kill -0 "$TPID" 2>/dev/null || break; sleep 0.1; done
grep -q "control socket" "$LOG" || fail "step 1: the target did not start"
rpc() { "$EXAMPLES/nvpoll-rpc" -s "$SOCK" "$@"; }

for p in "$P1" "$P2"; do
    out=$(nvme connect -t tcp -a "$ADDR" -s "$p" -n "$NQN" --hostnqn "$VM_HOSTNQN" --hostid "$VM_HOSTID" 2>&1) ||
        fail "step 1: nvme connect on port $p: $out"
done
say "connected through ports $P1 and $P2"

# step 3, in the background: two loops on namespace 4.
churn() {
    local i ok=0
    for i in $(seq 40); do
        rpc namespace_remove nqn="$NQN" nsid=4 >/dev/null 2>&1 && ok=$((ok + 1))
        rpc namespace_add nqn="$NQN" nsid=4 ram=16M >/dev/null 2>&1 && ok=$((ok + 1))
    done
    echo "$ok" > "$WORK/churn.$1"
}
churn a & C1=$!
churn b & C2=$!

# step 2: remap.
for i in $(seq 0 10); do
    for n in $(printf '%s\n' 1 2 3 | shuf); do
        rpc namespace_remove nqn="$NQN" nsid="$n" >/dev/null || fail "remap $i: namespace_remove $n"
    done
    for n in $(printf '%s\n' 1 2 3 | shuf); do
        UUID[$n]=$(uuid)
        g=$(( (n + i) % 3 + 1 ))
        rpc namespace_add nqn="$NQN" nsid="$n" file="$WORK/ns$n.img" ana_group="$g" uuid="${UUID[$n]}" >/dev/null ||
            fail "remap $i: namespace_add $n"
    done
done
say "ok: 11 remaps of namespaces 1-3 (new UUIDs, rotated ANA groups)"
wait "$C1"; wait "$C2"
say "ok: two concurrent loops removed and added namespace 4 ($(cat "$WORK/churn.a") and $(cat "$WORK/churn.b") calls succeeded of 80 each)"
kill -0 "$TPID" 2>/dev/null || fail "step 3: the target died"
n4=$(rpc subsystem_list | grep -c '"nsid": 4') || n4=0
[ "$n4" -le 1 ] || fail "step 3: namespace 4 is listed $n4 times"
rpc namespace_remove nqn="$NQN" nsid=4 >/dev/null 2>&1 || true

# step 4: the host sees the last UUIDs, and I/O goes through each.
dev_of_uuid() {
    local b
    for b in /sys/block/nvme*n*; do
        [ -e "$b/uuid" ] || continue
        [ "$(cat "$b/uuid" 2>/dev/null)" = "$1" ] && [ -b "/dev/${b##*/}" ] && { echo "/dev/${b##*/}"; return; }
    done
}
head -c $((1 << 20)) /dev/urandom > "$WORK/pattern"
for n in 1 2 3; do
    d=''
    for _ in $(seq 200); do d=$(dev_of_uuid "${UUID[$n]}"); [ -n "$d" ] && break; sleep 0.1; done
    [ -n "$d" ] || fail "step 4: no block device with namespace $n's last UUID ${UUID[$n]} ($(cat /sys/block/nvme*n*/uuid 2>/dev/null | tr '\n' ' '))"
    dd if="$WORK/pattern" of="$d" bs=1M oflag=direct status=none || fail "step 4: write to $d"
    dd if="$d" of="$WORK/back" bs=1M count=1 iflag=direct status=none || fail "step 4: read $d"
    cmp -s "$WORK/pattern" "$WORK/back" || fail "step 4: $d did not read back what was written"
    say "ok: namespace $n is $d with UUID ${UUID[$n]}; 1 MiB read back"
done

out=$(nvme disconnect -n "$NQN" 2>&1) || fail "nvme disconnect: $out"
bad=$(dmesg 2>/dev/null | tail -n +"$((DMESG0 + 1))" | grep -E 'WARNING:|BUG:|Oops|general protection' || true)
[ -z "$bad" ] || fail "the kernel logged: $bad"
kill -INT "$TPID"; rc=0; wait "$TPID" || rc=$?; TPID=
[ "$rc" = 0 ] || fail "the target exited with status $rc"
grep -q "internal errors 0" "$LOG" || fail "internal errors: $(grep '^stats:' "$LOG")"
say "$(grep '^stats:' "$LOG")"
say "all checks passed"

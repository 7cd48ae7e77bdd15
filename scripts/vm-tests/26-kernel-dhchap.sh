#!/usr/bin/env bash
# scripts/vm-tests/26-kernel-dhchap.sh - DH-HMAC-CHAP with the Linux kernel, both ways, in the guest of
# scripts/vm.sh (issue 34):
#
#  A. the Linux host (nvme connect --dhchap-secret [--dhchap-ctrl-secret]) against our target: for each hash
#     (sha256, sha384, sha512) and DH group (null, ffdhe2048, ffdhe8192), host-only and bidirectional, the
#     target allowing only that pair (rpc subsystem_set_dhchap): the controller goes live, fio writes and
#     verifies 1 MiB, and the target's log names the pair; a wrong host key is refused (the kernel's connect
#     fails, our log says why); re-authentication of the live controller after the target's key changed
#     (rpc dhchap_key_set, then the new secret written to the kernel's sysfs dhchap_secret);
#  B. our initiator (perf --verify --dhchap-secret [--dhchap-ctrl-secret]) against nvmet with the host's
#     dhchap_key, dhchap_ctrl_key, dhchap_hash and dhchap_dhgroup in configfs, the same matrix; a wrong key
#     refused.
# Keys come from the guest's nvme-cli (gen-dhchap-key). NVPOLL_DHCHAP_QUICK=1 runs sha256 and sha512 only.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)
PROG=kernel-dhchap
PORT=4437
NVMET_PORT=4438
ADDR=127.0.0.1
NQN=nqn.2024-01.io.nvpoll:vm-dhchap
TNQN=nqn.2024-01.io.nvpoll:vm-dhchap-nvmet
EXAMPLES=${NVPOLL_BIN_DIR:-$ROOT/target/debug}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/nvpoll-dhchap.XXXXXX")
LOG=$WORK/target.log
SOCK=$WORK/ctl.sock
CFG=/sys/kernel/config/nvmet
TPID='' NVMET_MADE=0

say()  { echo "$PROG: $*"; }
fail() {
    echo "$PROG: FAIL $*" >&2
    [ ! -s "$LOG" ] || tail -n 20 "$LOG" >&2
    dmesg 2>/dev/null | grep -iE 'nvme|auth' | tail -n 15 >&2
    exit 1
}
cleanup() {
    nvme disconnect -n "$NQN" >/dev/null 2>&1 || true
    [ -z "$TPID" ] || { kill -INT "$TPID" 2>/dev/null; wait "$TPID" 2>/dev/null; }
    if [ "$NVMET_MADE" = 1 ]; then
        rm -f "$CFG/ports/9/subsystems/$TNQN" "$CFG/subsystems/$TNQN/allowed_hosts/$VM_HOSTNQN" 2>/dev/null
        rmdir "$CFG/ports/9" "$CFG/subsystems/$TNQN/namespaces/1" "$CFG/subsystems/$TNQN" \
            "$CFG/hosts/$VM_HOSTNQN" 2>/dev/null
    fi
    rm -rf "$WORK" /run/nvpoll-dhchap-nvmet.img
}
trap cleanup EXIT

[ "${NVPOLL_VM:-}" = 1 ] || { echo "$PROG: skipped: not in the scripts/vm.sh guest (run scripts/vm-test.sh)"; exit 0; }
command -v nvme >/dev/null || fail "nvme-cli is missing in the guest"
command -v fio >/dev/null || fail "fio is missing (install it on the host: the guest runs on the host's root fs)"
modprobe nvme-tcp 2>/dev/null || true
nvme gen-dhchap-key -n nqn.2014-08.org.nvmexpress:probe >/dev/null 2>&1 || fail "this nvme-cli has no gen-dhchap-key"

HASHES=(sha256 sha384 sha512)
[ "${NVPOLL_DHCHAP_QUICK:-0}" = 1 ] && HASHES=(sha256 sha512)
GROUPS_=(null ffdhe2048 ffdhe8192)
KEY=$(nvme gen-dhchap-key -m 1 -n "$VM_HOSTNQN") || fail "gen-dhchap-key"
KEY2=$(nvme gen-dhchap-key -m 2 -l 48 -n "$VM_HOSTNQN") || fail "gen-dhchap-key"
CKEY=$(nvme gen-dhchap-key -m 3 -l 64 -n "$NQN") || fail "gen-dhchap-key"
BAD=$(nvme gen-dhchap-key -m 0 -n "$VM_HOSTNQN") || fail "gen-dhchap-key"

# ---- A. the Linux host against our target
cat > "$WORK/config.json" <<EOF
{"listeners": [{"address": "$ADDR:$PORT"}],
 "subsystems": [{"nqn": "$NQN", "hosts": [{"nqn": "$VM_HOSTNQN", "dhchap_key": "$KEY", "dhchap_ctrl_key": "$CKEY"}],
                 "namespaces": [{"ram": "64M"}]}]}
EOF
"$EXAMPLES/nvpoll-target" --config "$WORK/config.json" --rpc-socket "$SOCK" > "$LOG" 2>&1 &
TPID=$!
for _ in $(seq 100); do grep -q "control socket" "$LOG" && break; kill -0 "$TPID" 2>/dev/null || break; sleep 0.1; done
grep -q "control socket" "$LOG" || fail "A: the target did not start"
grep -q -- "${KEY:10:16}" "$LOG" && fail "A: the target logged key material"

rpc() { "$EXAMPLES/nvpoll-rpc" -s "$SOCK" "$@" >/dev/null || fail "rpc $*"; }
ctrl_of() {
    local c
    for c in /sys/class/nvme/nvme*; do
        [ "$(cat "$c/subsysnqn" 2>/dev/null)" = "$1" ] && [ "$(cat "$c/state" 2>/dev/null)" = live ] && { echo "${c##*/}"; return; }
    done
}
dev_of() {
    local b
    for b in /sys/class/nvme/"$1"/nvme*n1 /sys/class/nvme-subsystem/*/nvme*n1; do
        [ -e "$b" ] || continue
        [ "$(cat "${b%/*}/subsysnqn" 2>/dev/null)" = "$2" ] && [ -b "/dev/${b##*/}" ] && { echo "/dev/${b##*/}"; return; }
    done
}
connect_ours() {   # $1 host key, $2 controller key or ''
    local args=(-t tcp -a "$ADDR" -s "$PORT" -n "$NQN" --hostnqn "$VM_HOSTNQN" --hostid "$VM_HOSTID" --dhchap-secret "$1")
    [ -z "$2" ] || args+=(--dhchap-ctrl-secret "$2")
    nvme connect "${args[@]}" 2>&1
}
fio_verify() {
    fio --name=dhchap --filename="$1" --rw=write --bs=4k --size=1M --verify=crc32c --direct=1 \
        --ioengine=psync --output="$WORK/fio.txt" >/dev/null 2>&1 || { cat "$WORK/fio.txt" >&2; return 1; }
}

A_ROWS=()
for h in "${HASHES[@]}"; do
    for g in "${GROUPS_[@]}"; do
        rpc subsystem_set_dhchap nqn="$NQN" "hashes=[\"$h\"]" "dhgroups=[\"$g\"]"
        for dir in host bidirectional; do
            ck=''; [ "$dir" = bidirectional ] && ck=$CKEY; want="$h, $g, $([ "$dir" = host ] && echo "host only" || echo bidirectional)"
            before=$(grep -c "authenticated (DH-HMAC-CHAP, $want)" "$LOG")
            t0=$EPOCHREALTIME
            out=$(connect_ours "$KEY" "$ck") || fail "A: nvme connect ($want): $out"
            c=''; for _ in $(seq 600); do c=$(ctrl_of "$NQN"); [ -n "$c" ] && break; sleep 0.05; done
            [ -n "$c" ] || fail "A: no live controller ($want)"
            secs=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.2f", b - a }')
            d=''; for _ in $(seq 600); do d=$(dev_of "$c" "$NQN"); [ -n "$d" ] && break; sleep 0.05; done
            [ -n "$d" ] || fail "A: no block device ($want)"
            fio_verify "$d" || fail "A: fio verify on $d ($want)"
            after=$(grep -c "authenticated (DH-HMAC-CHAP, $want)" "$LOG")
            [ "$after" -gt "$before" ] || fail "A: our log has no authentication with ($want)"
            nvme disconnect -n "$NQN" >/dev/null 2>&1 || fail "A: disconnect"
            A_ROWS+=("$h $g $dir ${secs}s queues=$((after - before))")
            say "ok A: Linux host -> ours: $want: live in ${secs}s, $((after - before)) queue(s) authenticated, fio verify passed"
        done
    done
done
rpc subsystem_set_dhchap nqn="$NQN"

out=$(connect_ours "$BAD" '') && fail "A: a wrong host key was accepted: $out"
grep -q "not authenticated: DH-HMAC-CHAP: authentication failed (wrong key)" "$LOG" || fail "A: the refusal is not in our log"
say "ok A: a wrong host key is refused (nvme connect: $(echo "$out" | tail -1)); our log says: wrong key"

# Re-authentication: the target's key changes, then the kernel host is given the new secret.
out=$(connect_ours "$KEY" '') || fail "A: nvme connect for re-authentication: $out"
c=''; for _ in $(seq 600); do c=$(ctrl_of "$NQN"); [ -n "$c" ] && break; sleep 0.05; done
[ -n "$c" ] || fail "A: no live controller"
rpc dhchap_key_set nqn="$NQN" host="$VM_HOSTNQN" key="$KEY2"
before=$(grep -c "queue 0 of .* authenticated" "$LOG")
echo "$KEY2" > "/sys/class/nvme/$c/dhchap_secret" || fail "A: writing the new secret to sysfs"
for _ in $(seq 1200); do [ "$(grep -c "queue 0 of .* authenticated" "$LOG")" -gt "$before" ] && break; sleep 0.05; done
[ "$(grep -c "queue 0 of .* authenticated" "$LOG")" -gt "$before" ] || fail "A: no re-authentication in our log"
[ "$(cat "/sys/class/nvme/$c/state")" = live ] || fail "A: the controller is not live after re-authentication"
d=''; for _ in $(seq 600); do d=$(dev_of "$c" "$NQN"); [ -n "$d" ] && break; sleep 0.05; done
[ -n "$d" ] || fail "A: no block device after re-authentication"
fio_verify "$d" || fail "A: fio verify after re-authentication"
nvme disconnect -n "$NQN" >/dev/null 2>&1
say "ok A: re-authentication of the live controller with the target's new key (sysfs dhchap_secret), fio verify after"
kill -INT "$TPID"; rc=0; wait "$TPID" || rc=$?; TPID=
[ "$rc" = 0 ] || fail "A: the target exited with status $rc"
grep -q "internal errors 0" "$LOG" || fail "A: internal errors: $(grep '^stats:' "$LOG")"
grep -q -- "${KEY:10:16}\|${CKEY:10:16}\|${KEY2:10:16}" "$LOG" && fail "A: key material in our log"
say "$(grep '^stats:' "$LOG")"

# ---- B. our initiator against nvmet
[ -d "$CFG" ] || fail "B: no nvmet configfs"
modprobe nvmet-tcp 2>/dev/null || true
NVMET_MADE=1
mkdir -p "$CFG/subsystems/$TNQN" || fail "B: nvmet subsystem"
# On /run's tmpfs, as scripts/vm.sh's own nvmet namespace (nvmet takes its block size from the file's inode,
# which the root's overlay does not give).
NVMET_IMG=/run/nvpoll-dhchap-nvmet.img
truncate -s 64M "$NVMET_IMG"
mkdir "$CFG/subsystems/$TNQN/namespaces/1" && echo "$NVMET_IMG" > "$CFG/subsystems/$TNQN/namespaces/1/device_path" &&
    echo 1 > "$CFG/subsystems/$TNQN/namespaces/1/buffered_io" &&
    echo 1 > "$CFG/subsystems/$TNQN/namespaces/1/enable" || fail "B: nvmet namespace"
echo 0 > "$CFG/subsystems/$TNQN/attr_allow_any_host"
mkdir -p "$CFG/hosts/$VM_HOSTNQN" || fail "B: nvmet host"
ln -s "$CFG/hosts/$VM_HOSTNQN" "$CFG/subsystems/$TNQN/allowed_hosts/" || fail "B: allowed host"
mkdir "$CFG/ports/9" && echo tcp > "$CFG/ports/9/addr_trtype" && echo ipv4 > "$CFG/ports/9/addr_adrfam" &&
    echo "$ADDR" > "$CFG/ports/9/addr_traddr" && echo "$NVMET_PORT" > "$CFG/ports/9/addr_trsvcid" || fail "B: nvmet port"
ln -s "$CFG/subsystems/$TNQN" "$CFG/ports/9/subsystems/" || fail "B: nvmet port link"
HOSTDIR=$CFG/hosts/$VM_HOSTNQN
TCKEY=$(nvme gen-dhchap-key -m 2 -l 48 -n "$TNQN") || fail "gen-dhchap-key"
echo "$KEY" > "$HOSTDIR/dhchap_key" || fail "B: dhchap_key"
perf_nvmet() {   # extra perf args...
    "$EXAMPLES/nvpoll-perf" --trid "trtype:tcp traddr:$ADDR trsvcid:$NVMET_PORT subnqn:$TNQN" --hostnqn "$VM_HOSTNQN" \
        --qd 4 --time 1s --warmup 0s --runs 1 --workload randrw --verify --quiet "$@" > "$WORK/perf.txt" 2>&1
}
B_ROWS=()
for h in "${HASHES[@]}"; do
    for g in "${GROUPS_[@]}"; do
        echo "hmac($h)" > "$HOSTDIR/dhchap_hash" || fail "B: dhchap_hash $h"
        echo "$g" > "$HOSTDIR/dhchap_dhgroup" || fail "B: dhchap_dhgroup $g"
        for dir in host bidirectional; do
            if [ "$dir" = bidirectional ]; then
                echo "$TCKEY" > "$HOSTDIR/dhchap_ctrl_key"; extra=(--dhchap-secret "$KEY" --dhchap-ctrl-secret "$TCKEY")
            else
                echo "" > "$HOSTDIR/dhchap_ctrl_key" 2>/dev/null; extra=(--dhchap-secret "$KEY")
            fi
            t0=$EPOCHREALTIME
            perf_nvmet "${extra[@]}" || { cat "$WORK/perf.txt" >&2; fail "B: perf --verify against nvmet ($h, $g, $dir)"; }
            grep -q "errors 0, verify mismatches 0" "$WORK/perf.txt" || { cat "$WORK/perf.txt" >&2; fail "B: errors ($h $g $dir)"; }
            secs=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
            B_ROWS+=("$h $g $dir")
            say "ok B: ours -> nvmet: $h, $g, $dir: perf --verify clean (${secs}s with the run)"
        done
    done
done
echo "" > "$HOSTDIR/dhchap_ctrl_key" 2>/dev/null
perf_nvmet --dhchap-secret "$BAD" && fail "B: nvmet accepted a wrong key"
grep -qi "refused\|DH-HMAC-CHAP" "$WORK/perf.txt" || { cat "$WORK/perf.txt" >&2; fail "B: the refusal gives no reason"; }
say "ok B: a wrong key is refused by nvmet: $(grep -i 'DH-HMAC-CHAP' "$WORK/perf.txt" | head -1)"
# A controller key the host does not expect: our host refuses nvmet.
echo "$TCKEY" > "$HOSTDIR/dhchap_ctrl_key"
perf_nvmet --dhchap-secret "$KEY" --dhchap-ctrl-secret "$CKEY" && fail "B: our host accepted a controller with the wrong key"
grep -q "failed to prove its key" "$WORK/perf.txt" || { cat "$WORK/perf.txt" >&2; fail "B: no reason for refusing the controller"; }
say "ok B: a controller that cannot prove the expected key is refused by our host"
say "A: ${#A_ROWS[@]} Linux-host cells, B: ${#B_ROWS[@]} nvmet cells"
say "all checks passed"

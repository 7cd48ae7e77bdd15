#!/usr/bin/env bash
# scripts/vm-tests/23-kernel-reservations-our-target.sh - two Linux hosts fence
# each other with NVMe persistent reservations on nvpoll's target, in the guest
# of scripts/vm.sh (what blktests nvme/054 checks against nvmet's configfs).
#
#  1. starts nvpoll-target with a file namespace on two listeners;
#     connects two kernel hosts (two host NQNs and host IDs: one controller
#     each, one through each listener);
#  2. one host alone walks the sequence of blktests nvme/054 (which only knows
#     nvmet's configfs and so skips against us): register, replace,
#     unregister, register + acquire, preempt itself to another type, release,
#     acquire, clear; each report's generation, type and registrants (status,
#     key) must be what nvmet gives;
#     then A registers with PTPL on, B registers; A takes Write Exclusive: B's write
#     (io-passthru on its controller) is refused with Reservation Conflict, its
#     read is not; resv-report lists both, A holding;
#  3. B preempts A and takes Exclusive Access: A can neither read nor write, B
#     writes;
#  4. the target restarts on the same file; both hosts reconnect; the
#     reservation is as it was (B holds Exclusive Access, A is not registered
#     and stays fenced);
#  5. B releases and clears; A writes again; disconnects; the target exits 0.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)
PORT=4434
ADDR=127.0.0.1
NQN=nqn.2024-01.io.nvpoll:vm-resv
EXAMPLES=${NVPOLL_BIN_DIR:-$ROOT/target/debug}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/nvpoll-resv.XXXXXX")
LOG=$WORK/target.log
TPID=
HOST_A=nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-1111-4000-8000-000000000001
ID_A=aaaaaaaa-1111-4000-8000-000000000001
HOST_B=nqn.2014-08.org.nvmexpress:uuid:bbbbbbbb-2222-4000-8000-000000000002
ID_B=bbbbbbbb-2222-4000-8000-000000000002

say()  { echo "kernel-resv: $*"; }
fail() { echo "kernel-resv: FAIL $*" >&2; [ ! -s "$LOG" ] || tail -n 20 "$LOG" >&2; exit 1; }
cleanup() {
    nvme disconnect -n "$NQN" >/dev/null 2>&1 || true
    [ -z "$TPID" ] || { kill -INT "$TPID" 2>/dev/null; wait "$TPID" 2>/dev/null; }
    rm -rf "$WORK"
}
trap cleanup EXIT

[ "${NVPOLL_VM:-}" = 1 ] || { echo "kernel-resv: skipped: not in the scripts/vm.sh guest (run scripts/vm-test.sh)"; exit 0; }
command -v nvme >/dev/null || fail "nvme-cli is missing in the guest"
modprobe nvme-tcp 2>/dev/null || true

start_target() {
    : > "$LOG"
    "$EXAMPLES/nvpoll-target" --listen "$ADDR:$PORT" --listener "$ADDR:$((PORT + 1))" --nqn "$NQN" --file "$WORK/ns.img" \
        > "$LOG" 2>&1 &
    TPID=$!
    for _ in $(seq 100); do grep -q "listening on" "$LOG" && break; kill -0 "$TPID" 2>/dev/null || break; sleep 0.1; done
    grep -q "listening on" "$LOG" || fail "the target did not start"
    ! grep -q "reservations off" "$LOG" || fail "the target has no reservations: $(grep 'reservations off' "$LOG")"
}

# The controller (nvmeX) host $1 has on $NQN.
ctrl_of() {
    local c
    for c in /sys/class/nvme/nvme*; do
        [ "$(cat "$c/subsysnqn" 2>/dev/null)" = "$NQN" ] && [ "$(cat "$c/hostnqn" 2>/dev/null)" = "$1" ] \
            && [ "$(cat "$c/state" 2>/dev/null)" = live ] && { echo "${c##*/}"; return 0; }
    done
    return 1
}
wait_ctrl() {
    local c
    for _ in $(seq 300); do c=$(ctrl_of "$1") && { echo "$c"; return 0; }; sleep 0.1; done
    return 1
}

# io-passthru on a controller: $1 ctrl, $2 write|read. Prints nvme-cli's output; exit status as nvme-cli's.
io() {
    if [ "$2" = write ]; then
        nvme io-passthru "/dev/$1" --opcode=0x01 --namespace-id=1 --data-len=512 --write \
            --input-file="$WORK/block" --cdw10=16 --cdw12=0 2>&1
    else
        nvme io-passthru "/dev/$1" --opcode=0x02 --namespace-id=1 --data-len=512 --read \
            --cdw10=16 --cdw12=0 2>&1 >/dev/null
    fi
}
expect_ok() { local out; out=$(io "$1" "$2") || fail "$3: $1 $2 failed: $out"; }
expect_conflict() {
    local out
    if out=$(io "$1" "$2"); then fail "$3: $1 $2 went through a reservation"; fi
    grep -qi "reservation.conflict\|RESERVATION_CONFLICT" <<< "$out" || fail "$3: $1 $2 failed otherwise: $out"
}
# resv-report as "rtype registrants holder-keys": $1 ctrl
report() {
    local out
    out=$(nvme resv-report "/dev/$1" --namespace-id=1 --eds -o json 2>&1) || fail "resv-report on $1: $out"
    python3 - "$out" <<'PY'
import json, sys
r = json.loads(sys.argv[1])
regs = r.get("regctlext") or r.get("regctl") or []
if isinstance(regs, int):
    regs = []
held = sorted(hex(int(e["rkey"])) for e in regs if int(e["rcsts"]) & 1)
print(r["rtype"], len(regs), ",".join(held) or "-")
PY
}

# resv-report as "gen rtype regctl rcsts:rkey ...": $1 ctrl
full_report() {
    local out
    out=$(nvme resv-report "/dev/$1" --namespace-id=1 --eds -o json 2>&1) || fail "resv-report on $1: $out"
    python3 - "$out" <<'PY'
import json, sys
r = json.loads(sys.argv[1])
regs = r.get("regctlext") or []
if isinstance(regs, int):
    regs = []
print(r["gen"], r["rtype"], r["regctl"], *("%d:%x" % (int(e["rcsts"]), int(e["rkey"])) for e in regs))
PY
}

head -c 512 /dev/urandom > "$WORK/block"
truncate -s 64M "$WORK/ns.img"
start_target
# Each host through its own listener (nvme-cli 2.3 calls a second host on the same address "already connected").
for h in A B; do
    hn=HOST_$h; id=ID_$h; port=$PORT; [ "$h" = B ] && port=$((PORT + 1))
    out=$(nvme connect -t tcp -a "$ADDR" -s "$port" -n "$NQN" --hostnqn "${!hn}" --hostid "${!id}" \
        --reconnect-delay=1 --ctrl-loss-tmo=60 2>&1) || fail "step 1: nvme connect ($h): $out"
done
A=$(wait_ctrl "$HOST_A") || fail "step 1: no controller for host A"
B=$(wait_ctrl "$HOST_B") || fail "step 1: no controller for host B"
say "host A on /dev/$A, host B on /dev/$B"

# ---- 2. blktests nvme/054's sequence on one host, then two hosts ---------------------
step054() {   # what, expected report, nvme-cli command...
    local what=$1 want=$2 out got
    shift 2
    if [ $# -gt 0 ]; then out=$("$@" 2>&1) || fail "step 2 ($what): $*: $out"; fi
    got=$(full_report "$A")
    [ "$got" = "$want" ] || fail "step 2 ($what): report '$got', nvmet gives '$want'"
}
step054 start "0 0 0"
step054 register "1 0 1 0:4" nvme resv-register "/dev/$A" --namespace-id=1 --nrkey=4 --rrega=0
step054 replace "2 0 1 0:5" nvme resv-register "/dev/$A" --namespace-id=1 --crkey=4 --nrkey=5 --rrega=2
step054 unregister "3 0 0" nvme resv-register "/dev/$A" --namespace-id=1 --crkey=5 --rrega=1
nvme resv-register "/dev/$A" --namespace-id=1 --nrkey=4 --rrega=0 >/dev/null || fail "step 2: register again"
step054 acquire "4 1 1 1:4" nvme resv-acquire "/dev/$A" --namespace-id=1 --crkey=4 --rtype=1 --racqa=0
step054 preempt "5 2 1 1:4" nvme resv-acquire "/dev/$A" --namespace-id=1 --crkey=4 --prkey=4 --rtype=2 --racqa=1
step054 release "5 0 1 0:4" nvme resv-release "/dev/$A" --namespace-id=1 --crkey=4 --rtype=2 --rrela=0
step054 acquire-again "5 1 1 1:4" nvme resv-acquire "/dev/$A" --namespace-id=1 --crkey=4 --rtype=1 --racqa=0
step054 clear "6 0 0" nvme resv-release "/dev/$A" --namespace-id=1 --crkey=4 --rrela=1
say "ok: blktests nvme/054's sequence on one host gives nvmet's generations, types and registrants"

out=$(nvme resv-register "/dev/$A" --namespace-id=1 --nrkey=0xaaaa --rrega=0 --cptpl=3 2>&1) || fail "step 2: A register: $out"
out=$(nvme resv-register "/dev/$B" --namespace-id=1 --nrkey=0xbbbb --rrega=0 2>&1) || fail "step 2: B register: $out"
out=$(nvme resv-acquire "/dev/$A" --namespace-id=1 --crkey=0xaaaa --rtype=1 --racqa=0 2>&1) || fail "step 2: A acquire: $out"
expect_ok "$A" write "step 2"
expect_conflict "$B" write "step 2"
expect_ok "$B" read "step 2"
r=$(report "$B"); [ "$r" = "1 2 0xaaaa" ] || fail "step 2: resv-report says '$r', not '1 2 0xaaaa'"
say "ok: A holds Write Exclusive; B's write is refused (Reservation Conflict), its read is not; report: $r"

# ---- 3. B preempts A ------------------------------------------------------------------
out=$(nvme resv-acquire "/dev/$B" --namespace-id=1 --crkey=0xbbbb --prkey=0xaaaa --rtype=2 --racqa=1 2>&1) \
    || fail "step 3: B preempt: $out"
expect_conflict "$A" read "step 3"
expect_conflict "$A" write "step 3"
expect_ok "$B" write "step 3"
r=$(report "$B"); [ "$r" = "2 1 0xbbbb" ] || fail "step 3: resv-report says '$r', not '2 1 0xbbbb'"
say "ok: B preempted A with Exclusive Access: A can neither read nor write; report: $r"

# ---- 4. restart -------------------------------------------------------------------------
kill -INT "$TPID"; wait "$TPID" 2>/dev/null; TPID=
start_target
A=$(wait_ctrl "$HOST_A") || fail "step 4: host A did not reconnect"
B=$(wait_ctrl "$HOST_B") || fail "step 4: host B did not reconnect"
r=$(report "$A"); [ "$r" = "2 1 0xbbbb" ] || fail "step 4: after the restart resv-report says '$r', not '2 1 0xbbbb'"
expect_conflict "$A" read "step 4"
expect_ok "$B" write "step 4"
say "ok: after a target restart both hosts reconnected and the reservation is as it was: $r"

# ---- 5. release, clear ------------------------------------------------------------------
out=$(nvme resv-release "/dev/$B" --namespace-id=1 --crkey=0xbbbb --rtype=2 --rrela=0 2>&1) || fail "step 5: B release: $out"
expect_ok "$A" write "step 5"
out=$(nvme resv-release "/dev/$B" --namespace-id=1 --crkey=0xbbbb --rrela=1 2>&1) || fail "step 5: B clear: $out"
r=$(report "$A"); [ "$r" = "0 0 -" ] || fail "step 5: after clear resv-report says '$r'"
say "ok: released and cleared; A writes again"
out=$(nvme disconnect -n "$NQN" 2>&1) || fail "step 5: nvme disconnect: $out"
kill -INT "$TPID"; rc=0; wait "$TPID" || rc=$?; TPID=
[ "$rc" = 0 ] || fail "step 5: the target exited with status $rc"
grep -q "internal errors 0" "$LOG" || fail "step 5: internal errors: $(grep '^stats:' "$LOG")"
say "all checks passed"

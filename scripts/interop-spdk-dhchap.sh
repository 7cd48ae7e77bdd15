#!/usr/bin/env bash
# DH-HMAC-CHAP between nvpoll and SPDK, both ways (issue 34):
#   ours -> SPDK: our perf --verify with --dhchap-secret [--dhchap-ctrl-secret], offering one hash and one DH
#                 group at a time, against SPDK's nvmf_tgt (nvmf_subsystem_add_host --dhchap-key
#                 --dhchap-ctrlr-key, keys in its keyring);
#   SPDK -> ours: spdk_nvme_perf --dhchap-key FILE [--dhchap-ctrlr-key FILE] against our target, which allows
#                 one hash and one group at a time (rpc subsystem_set_dhchap) and logs what was agreed;
# each hash (sha256, sha384, sha512) with null, ffdhe2048 and ffdhe8192, host-only and bidirectional; then a
# wrong key each way, which must be refused.
#
# usage: SPDK_DIR=/path/to/spdk scripts/interop-spdk-dhchap.sh
# SPDK_DIR is an SPDK build (v26.05) made by its own instructions; this script never builds one, and without
# SPDK_DIR it says so and exits 0. Knobs: NVPOLL_BIN_DIR (our perf, target and rpc; default a release
# build), TCORE/ICORE (cores of the target and the initiator; default 0 and 1), TIME (seconds per cell, 2),
# PORT (first of two ports, 4460), DHCHAP_HASHES and DHCHAP_GROUPS (space-separated subsets).
# Exit status: 0 when every cell passed and both wrong keys were refused, 1 otherwise, 2 on a setup failure.
set -euo pipefail

PROG=interop-spdk-dhchap
. "$(dirname "${BASH_SOURCE[0]}")/spdk-common.sh"

TCORE=${TCORE:-0}
ICORE=${ICORE:-1}
TIME=${TIME:-2}
PORT=${PORT:-4460}
read -r -a HASHES <<< "${DHCHAP_HASHES:-sha256 sha384 sha512}"
read -r -a GROUPS_ <<< "${DHCHAP_GROUPS:-null ffdhe2048 ffdhe8192}"
SUBNQN=nqn.2016-06.io.spdk:dhchap
OURNQN=nqn.2024-01.io.nvpoll:dhchap

our_binaries
if [ ! -x "$BIN/nvpoll-rpc" ] && [ -z "${NVPOLL_BIN_DIR:-}" ]; then
    (cd "$ROOT" && cargo build -q --release --bin nvpoll-rpc) || die "building nvpoll-rpc failed"
fi
RPC_BIN=$BIN/nvpoll-rpc
[ -x "$RPC_BIN" ] || die "no nvpoll-rpc in $BIN"
make_work nvpoll-dhchap
PIDS=()
# shellcheck disable=SC2317  # invoked by the traps
cleanup() {
    local rc=$? p
    trap - EXIT INT TERM
    for p in "${PIDS[@]}"; do stop_pid "$p"; done
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Test-only keys: nvme-cli's gen-dhchap-key when it is here, else fixed ones.
gen() {   # HMAC LEN NQN
    nvme gen-dhchap-key -m "$1" -l "$2" -n "$3" 2>/dev/null ||
        case "$1" in
            1) echo 'DHHC-1:01:WulleCBkG4oCs0iIC3Cit9gBDCLWiZ9PNXuhqytWkBIZkvGy:' ;;
            *) echo 'DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:' ;;
        esac
}
HK=$(gen 1 32 "$HOSTNQN"); CK=$(gen 3 64 "$SUBNQN")
BAD='DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:'
[ "$HK" != "$BAD" ] || BAD=$(gen 2 48 "$HOSTNQN")
( umask 077; printf '%s\n' "$HK" > "$WORK/hk"; printf '%s\n' "$CK" > "$WORK/ck"; printf '%s\n' "$BAD" > "$WORK/bad" )

ROWS=()
FAILED=0
record() {   # direction hash group mode seconds result
    ROWS+=("$(printf '| %-9s | %-6s | %-9s | %-13s | %7s | %-40s |' "$@")")
    echo "${ROWS[-1]}"
    [ "$6" = ok ] || FAILED=$((FAILED + 1))
}

# ---- SPDK's target
spdk_tgt_launch
PIDS+=("$SPDK_TGT_PID")
for _ in $(seq 200); do [ -S "$RPC_SOCK" ] && break; kill -0 "$SPDK_TGT_PID" 2>/dev/null || break; sleep 0.05; done
[ -S "$RPC_SOCK" ] || { tail -n 30 "$WORK/nvmf_tgt.log" >&2; die "nvmf_tgt did not open its RPC socket"; }
rpc framework_wait_init
rpc nvmf_create_transport -t TCP -i 1048576 -c 8192
rpc bdev_malloc_create -b Malloc0 256 512
rpc keyring_file_add_key hk "$WORK/hk"
rpc keyring_file_add_key ck "$WORK/ck"
rpc nvmf_create_subsystem "$SUBNQN" -s SPDK00000000000009 -m 4
rpc nvmf_subsystem_add_ns "$SUBNQN" Malloc0
rpc nvmf_subsystem_add_listener "$SUBNQN" -t tcp -a 127.0.0.1 -s "$PORT"
rpc nvmf_subsystem_add_host "$SUBNQN" "$HOSTNQN" --dhchap-key hk --dhchap-ctrlr-key ck
wait_listen "$PORT" "$SPDK_TGT_PID" "$WORK/nvmf_tgt.log"
say "SPDK's nvmf_tgt on port $PORT: $SUBNQN requires DH-HMAC-CHAP of $HOSTNQN"

ours_to_spdk() {   # hash group mode
    local h=$1 g=$2 mode=$3 args=(--dhchap-secret "$WORK/hk" --dhchap-hashes "$1" --dhchap-dhgroups "$2")
    [ "$mode" = bidirectional ] && args+=(--dhchap-ctrl-secret "$WORK/ck")
    local log=$WORK/ours-spdk-$h-$g-$mode.log rc=0 t0=$EPOCHREALTIME
    timeout -k 2 $((TIME + 30)) "$BIN/nvpoll-perf" --trid "trtype:tcp traddr:127.0.0.1 trsvcid:$PORT subnqn:$SUBNQN" \
        --hostnqn "$HOSTNQN" --workload randrw --qd 4 --time "${TIME}s" --warmup 0s --runs 1 --cores "$ICORE" \
        --verify --quiet -vv "${args[@]}" > "$log" 2>&1 || rc=$?
    local secs; secs=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
    local result=ok
    [ "$rc" = 0 ] || result="perf exit status $rc"
    [ "$result" != ok ] || grep -q "errors 0, verify mismatches 0" "$log" || result="I/O errors or mismatches"
    [ "$result" != ok ] || grep -q "queue 0: authenticated with DH-HMAC-CHAP ($h, $g" "$log" ||
        result="no '$h, $g' authentication in perf's log"
    kill -0 "$SPDK_TGT_PID" 2>/dev/null || result="SPDK's target died"
    [ "$result" = ok ] || { echo "---- $log ----"; tail -n 15 "$log"; }
    record ours-spdk "$h" "$g" "$mode" "$secs" "$result"
}
for h in "${HASHES[@]}"; do for g in "${GROUPS_[@]}"; do for m in host-only bidirectional; do
    ours_to_spdk "$h" "$g" "$m"
done; done; done
rc=0
timeout 30 "$BIN/nvpoll-perf" --trid "trtype:tcp traddr:127.0.0.1 trsvcid:$PORT subnqn:$SUBNQN" --hostnqn "$HOSTNQN" \
    --time 1s --warmup 0s --runs 1 --cores "$ICORE" --quiet --dhchap-secret "$WORK/bad" > "$WORK/bad-ours.log" 2>&1 || rc=$?
if [ "$rc" != 0 ] && grep -q "DH-HMAC-CHAP" "$WORK/bad-ours.log"; then
    record ours-spdk wrong-key - - - ok
    say "wrong key refused by SPDK: $(grep -o 'DH-HMAC-CHAP: .*' "$WORK/bad-ours.log" | head -1)"
else
    cat "$WORK/bad-ours.log"; record ours-spdk wrong-key - - - "not refused"
fi
stop_pid "$SPDK_TGT_PID"

# ---- our target
cat > "$WORK/ours.json" <<JSON
{"listeners": [{"address": "127.0.0.1:$((PORT + 1))"}],
 "subsystems": [{"nqn": "$OURNQN", "hosts": [{"nqn": "$HOSTNQN", "dhchap_key": "$HK", "dhchap_ctrl_key": "$(gen 3 64 "$OURNQN" | tee "$WORK/ck2")"}],
                 "namespaces": [{"ram": "256M"}]}]}
JSON
chmod 600 "$WORK/ck2"
"$BIN/nvpoll-target" --config "$WORK/ours.json" --cores "$TCORE" --rpc-socket "$WORK/ours.sock" > "$WORK/ours.log" 2>&1 &
OUR_PID=$!
PIDS+=("$OUR_PID")
wait_listen "$((PORT + 1))" "$OUR_PID" "$WORK/ours.log"

spdk_to_ours() {   # hash group mode
    local h=$1 g=$2 mode=$3 args=(--dhchap-key "$WORK/hk")
    [ "$mode" = bidirectional ] && args+=(--dhchap-ctrlr-key "$WORK/ck2")
    "$RPC_BIN" -s "$WORK/ours.sock" subsystem_set_dhchap nqn="$OURNQN" "hashes=[\"$h\"]" "dhgroups=[\"$g\"]" >/dev/null ||
        die "rpc subsystem_set_dhchap"
    local want; want="authenticated (DH-HMAC-CHAP, $h, $g, $([ "$mode" = bidirectional ] && echo bidirectional || echo host only))"
    local before; before=$(grep -c -F "$want" "$WORK/ours.log" || true)
    local log=$WORK/spdk-ours-$h-$g-$mode.log rc=0 t0=$EPOCHREALTIME
    timeout -k 2 $((TIME + 30)) "$SPDK_PERF" --no-huge -s 512 -c "$((1 << ICORE))" -q 4 -o 4096 -w randrw -M 50 \
        -t "$TIME" -r "trtype:tcp adrfam:IPv4 traddr:127.0.0.1 trsvcid:$((PORT + 1)) subnqn:$OURNQN hostnqn:$HOSTNQN" \
        "${args[@]}" > "$log" 2>&1 || rc=$?
    local secs; secs=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
    local after; after=$(grep -c -F "$want" "$WORK/ours.log" || true)
    local result=ok
    [ "$rc" = 0 ] || result="spdk_nvme_perf exit status $rc"
    grep -qE '^\s*Total\s*:' "$log" || result="no Total line from spdk_nvme_perf"
    [ "$after" -gt "$before" ] || result="our log has no '$want'"
    kill -0 "$OUR_PID" 2>/dev/null || result="our target died"
    [ "$result" = ok ] || { echo "---- $log ----"; tail -n 15 "$log"; tail -n 5 "$WORK/ours.log"; }
    record spdk-ours "$h" "$g" "$mode" "$secs" "$result"
}
for h in "${HASHES[@]}"; do for g in "${GROUPS_[@]}"; do for m in host-only bidirectional; do
    spdk_to_ours "$h" "$g" "$m"
done; done; done
"$RPC_BIN" -s "$WORK/ours.sock" subsystem_set_dhchap nqn="$OURNQN" >/dev/null
timeout 30 "$SPDK_PERF" --no-huge -s 512 -c "$((1 << ICORE))" -q 4 -o 4096 -w randread -t 1 \
    -r "trtype:tcp adrfam:IPv4 traddr:127.0.0.1 trsvcid:$((PORT + 1)) subnqn:$OURNQN hostnqn:$HOSTNQN" \
    --dhchap-key "$WORK/bad" > "$WORK/bad-spdk.log" 2>&1 || true
if grep -q "not authenticated: DH-HMAC-CHAP: authentication failed (wrong key)" "$WORK/ours.log"; then
    record spdk-ours wrong-key - - - ok
    say "wrong key refused by ours: $(grep -o 'not authenticated: .*' "$WORK/ours.log" | head -1)"
else
    tail -n 20 "$WORK/bad-spdk.log"; record spdk-ours wrong-key - - - "not refused"
fi
if grep -qF -e "${HK:10:20}" -e "${CK:10:20}" "$WORK/ours.log"; then
    record spdk-ours key-in-log - - - "our log holds key material"
fi

echo
echo "| direction | hash   | DH group  | mode          | seconds | result                                   |"
echo "|-----------|--------|-----------|---------------|---------|------------------------------------------|"
printf '%s\n' "${ROWS[@]}"
say "$FAILED cell(s) failed"
[ "$FAILED" = 0 ]

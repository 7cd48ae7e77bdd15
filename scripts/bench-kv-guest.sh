#!/usr/bin/env bash
# scripts/bench-kv-guest.sh - the example engine (kv/) through nvpoll and through the kernel, in the guest of
# scripts/vm.sh, each pair of paths to the same device:
#   ours / kernel            NVMe/TCP to our target (a RAM namespace), plain: nvpoll's initiator and async
#                            interface, against the kernel's nvme-tcp block device (O_DIRECT,
#                            `--trid file:/dev/nvmeXn1`: pwrite and fdatasync per commit);
#   ours-tls / kernel-tls    the same with TLS 1.3 (a second subsystem of the same target, on a listener that
#                            requires TLS); the kernel's side needs tlshd: NVPOLL_VM_TLSHD=/path/to/tlshd
#                            (ktls-utils, built locally), else its row says so and only ours runs;
#   ours-pcie / kernel-pcie  the guest's two emulated NVMe controllers, twins: nvpoll's PCIe driver on the
#                            vfio-pci one, the kernel's nvme driver on the other (O_DIRECT on its namespace).
# For 1, 4, 16 and 64 writers each path loads PUTS keys (64-byte values) into a fresh log (`load --fresh`),
# the paths of a pair alternating in every round. Prints puts/s, commits/s and put latency per cell and the
# ratio ours/kernel of puts/s per round.
#
# The guest runs under TCG on this machine (no KVM): its figures are emulation-bound, read the ratios.
#
# Knobs: WRITERS="1 4 16 64", PUTS=1000 (per run, shared by the writers), ROUNDS=2, PAIRS="tcp tls pcie",
# NVPOLL_VM_TLSHD and the other NVPOLL_VM_* of scripts/vm.sh.
set -euo pipefail
PROG=bench-kv-guest
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
die() { echo "$PROG: error: $*" >&2; exit 2; }
say() { echo "$PROG: $*" >&2; }
WRITERS=${WRITERS:-1 4 16 64}
PUTS=${PUTS:-1000}
ROUNDS=${ROUNDS:-2}
PAIRS=${PAIRS:-tcp tls pcie}
for p in $PAIRS; do case $p in tcp|tls|pcie) ;; *) die "PAIRS: '$p' is not tcp, tls or pcie" ;; esac; done
for w in $WRITERS; do [[ "$w" =~ ^[1-9][0-9]*$ ]] || die "WRITERS: '$w' is not a positive number"; done
[[ "$PUTS" =~ ^[1-9][0-9]*$ ]] || die "PUTS=$PUTS is not a positive number"
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || die "ROUNDS=$ROUNDS is not a positive number"
PORT=4481
TLS_PORT=4482
NQN=nqn.2016-06.io.nvpoll:guest-kv
TLS_NQN=nqn.2016-06.io.nvpoll:guest-kv-tls
# Test vector of the NVMe TLS PSK interchange format (shared/notes/tls-psk.md); a test-only key.
KEY='NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:'

if [ "${1:-}" != --in-guest ]; then
    say "building the target and the engine (release)"
    (cd "$ROOT" && cargo build -q --release --bin nvpoll-target --bin nvpoll-kv --bin nvpoll-setup) ||
        die "the build failed"
    meta=$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps)
    [[ "$meta" =~ \"target_directory\":\"([^\"]+)\" ]] || die "no target_directory in cargo metadata"
    BIN=${BASH_REMATCH[1]}/release
    [[ " $PAIRS " != *" tls "* ]] || [ -n "${NVPOLL_VM_TLSHD:-}" ] ||
        say "NVPOLL_VM_TLSHD is not set: the kernel's TLS row will be missing (build tlshd from ktls-utils 1.4.0)"
    NVPOLL_BIN_DIR=$BIN exec "$ROOT/scripts/vm.sh" -- env WRITERS="$WRITERS" PUTS="$PUTS" ROUNDS="$ROUNDS" \
        PAIRS="$PAIRS" NVPOLL_BIN_DIR="$BIN" bash "$ROOT/scripts/bench-kv-guest.sh" --in-guest
fi

# ---- in the guest
BIN=${NVPOLL_BIN_DIR:?}
command -v nvme >/dev/null || die "nvme-cli is missing in the guest"
modprobe nvme-tcp 2>/dev/null || true
HOSTNQN=${VM_HOSTNQN:-$(cat /etc/nvme/hostnqn)}
HOSTID=${VM_HOSTID:-$(cat /etc/nvme/hostid)}
WORK=$(mktemp -d)
TPID=
cleanup() {
    nvme disconnect -n "$NQN" >/dev/null 2>&1 || true
    nvme disconnect -n "$TLS_NQN" >/dev/null 2>&1 || true
    [ -z "$TPID" ] || kill "$TPID" 2>/dev/null || true
}
trap cleanup EXIT
# One target, two subsystems (so that the kernel's plain and TLS controllers are not two paths of one
# namespace): the plain one on a plain listener, the TLS one on a listener that requires TLS.
printf '%s\n' "$KEY" > "$WORK/host.key"; chmod 600 "$WORK/host.key"
cat > "$WORK/target.json" <<JSON
{
  "listeners": [ {"address": "127.0.0.1:$PORT", "tls": "off"}, {"address": "127.0.0.1:$TLS_PORT", "tls": "required"} ],
  "subsystems": [
    {"nqn": "$NQN", "allow_any_host": true, "listeners": ["127.0.0.1:$PORT"], "namespaces": [ {"ram": "256M"} ]},
    {"nqn": "$TLS_NQN", "hosts": [ {"nqn": "$HOSTNQN", "psk_file": "$WORK/host.key"} ],
     "listeners": ["127.0.0.1:$TLS_PORT"], "namespaces": [ {"ram": "256M"} ]}
  ]
}
JSON
"$BIN/nvpoll-target" --config "$WORK/target.json" --cores 1 > "$WORK/target.log" 2>&1 &
TPID=$!
for _ in $(seq 200); do
    [ -n "$(ss -Hltn "sport = :$TLS_PORT")" ] && break
    kill -0 "$TPID" 2>/dev/null || { cat "$WORK/target.log" >&2; die "the target exited"; }
    sleep 0.1
done
# The block device of subsystem $1 (after a connect).
disk_of() {
    local dev=
    for _ in $(seq 300); do
        for c in /sys/class/nvme/nvme*; do
            [ "$(cat "$c/subsysnqn" 2>/dev/null)" = "$1" ] || continue
            for n in "$c"/nvme*n1 /sys/block/"$(basename "$c")"n1; do [ -e "$n" ] && dev=/dev/$(basename "$n"); done
        done
        [ -n "$dev" ] && [ -b "$dev" ] && { echo "$dev"; return 0; }
        dev=; sleep 0.1
    done
    return 1
}
declare -A TRID   # path -> the engine's --trid
declare -A EXTRA  # path -> more connection flags (no spaces inside a value)
declare -A WHY    # path -> why it does not run
if [[ " $PAIRS " == *" tcp "* ]]; then
    nvme connect -t tcp -a 127.0.0.1 -s "$PORT" -n "$NQN" -i 1 >/dev/null || die "nvme connect failed"
    dev=$(disk_of "$NQN") || die "no block device for $NQN"
    TRID[ours]="trtype:tcp traddr:127.0.0.1 trsvcid:$PORT subnqn:$NQN"
    TRID[kernel]="file:$dev"
    say "tcp: kernel $dev; ours to 127.0.0.1:$PORT"
fi
if [[ " $PAIRS " == *" tls "* ]]; then
    TRID[ours-tls]="trtype:tcp traddr:127.0.0.1 trsvcid:$TLS_PORT subnqn:$TLS_NQN"
    EXTRA[ours-tls]="--hostnqn $HOSTNQN --psk $KEY"
    if [ -n "${VM_TLSHD:-}" ]; then
        serial=$("$BIN/nvpoll-setup" kernel-psk --hostnqn "$HOSTNQN" --subnqn "$TLS_NQN" --key-file "$WORK/host.key") ||
            die "nvpoll-setup kernel-psk failed"
        echo "transport=tcp,traddr=127.0.0.1,trsvcid=$TLS_PORT,nqn=$TLS_NQN,hostnqn=$HOSTNQN,hostid=$HOSTID,nr_io_queues=1,tls,tls_key=$serial" \
            > /dev/nvme-fabrics || die "the kernel's TLS connect failed (see VM_OUT/tlshd.log)"
        dev=$(disk_of "$TLS_NQN") || die "no block device for $TLS_NQN"
        TRID[kernel-tls]="file:$dev"
        say "tls: kernel $dev (tlshd); ours to 127.0.0.1:$TLS_PORT"
    else
        WHY[kernel-tls]="no tlshd (NVPOLL_VM_TLSHD)"
    fi
fi
if [[ " $PAIRS " == *" pcie "* ]]; then
    TRID[ours-pcie]="trtype:pcie traddr:${VM_VFIO_BDF:?not in the scripts/vm.sh guest}"
    TRID[kernel-pcie]="file:${VM_KNVME_DEV:?not in the scripts/vm.sh guest}"
    say "pcie: ours on $VM_VFIO_BDF (vfio-pci), the kernel on $VM_KNVME_DEV"
fi
declare -A CELL
run() {   # PATH WRITERS ROUND
    [ -n "${TRID[$1]:-}" ] || return 0
    local out
    # shellcheck disable=SC2086 # EXTRA holds flags, split on purpose
    out=$(taskset -c 0 "$BIN/nvpoll-kv" load --trid "${TRID[$1]}" ${EXTRA[$1]:-} --fresh --writers "$2" --puts $(( (PUTS + $2 - 1) / $2 )) \
        --run "$1-$2-$3" 2>"$WORK/kv.err") || { cat "$WORK/kv.err" >&2; die "$1, $2 writers: the load failed"; }
    [[ "$out" =~ ([0-9]+)\ puts/s,\ ([0-9]+)\ commits/s\;\ put\ latency\ p50\ ([0-9.]+)\ us,\ p99\ ([0-9.]+)\ us ]] ||
        die "cannot parse: $out"
    CELL[$1,$2,$3]="${BASH_REMATCH[1]} ${BASH_REMATCH[2]} ${BASH_REMATCH[3]} ${BASH_REMATCH[4]}"
    say "round $3, $2 writers, $1: $out"
}
pairs=()
for p in $PAIRS; do
    case $p in tcp) pairs+=("ours kernel") ;; tls) pairs+=("ours-tls kernel-tls") ;; pcie) pairs+=("ours-pcie kernel-pcie") ;; esac
done
for r in $(seq "$ROUNDS"); do
    for w in $WRITERS; do
        for pair in "${pairs[@]}"; do
            read -r a b <<< "$pair"
            if [ $((r % 2)) = 1 ]; then run "$a" "$w" "$r"; run "$b" "$w" "$r"
            else run "$b" "$w" "$r"; run "$a" "$w" "$r"; fi
        done
    done
done
echo
echo "| path | writers | ours puts/s | ours commits/s | ours p50/p99 us | kernel puts/s | kernel commits/s | kernel p50/p99 us | ours/kernel puts/s per round |"
echo "|---|---|---|---|---|---|---|---|---|"
for pair in "${pairs[@]}"; do
    read -r a b <<< "$pair"
    for w in $WRITERS; do
        ratios='' last_o='- | - | -' last_k='- | - | -'
        for r in $(seq "$ROUNDS"); do
            op='' kp=''
            [ -z "${CELL[$a,$w,$r]:-}" ] || { read -r op oc o50 o99 <<< "${CELL[$a,$w,$r]}"; last_o="$op | $oc | $o50/$o99"; }
            [ -z "${CELL[$b,$w,$r]:-}" ] || { read -r kp kc k50 k99 <<< "${CELL[$b,$w,$r]}"; last_k="$kp | $kc | $k50/$k99"; }
            [ -n "$op" ] && [ -n "$kp" ] && ratios="$ratios $(awk -v a="$op" -v b="$kp" 'BEGIN { printf "%.2f", a / b }')"
        done
        [ -n "$ratios" ] || ratios=" - (${WHY[$b]:-${WHY[$a]:-not run}})"
        label=${a#ours-}; [ "$label" = ours ] && label=tcp
        echo "| $label | $w | $last_o | $last_k |$ratios |"
    done
done
echo "($PROG: the last round's figures; TCG guest, ratios only)"

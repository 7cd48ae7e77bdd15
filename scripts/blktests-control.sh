#!/usr/bin/env bash
# scripts/blktests-control.sh - blktests' NVME_TARGET_CONTROL script for nvpoll's
# target: blktests' nvme group calls it to learn where the target is and to add
# and remove the subsystems its tests use, through the target's control socket
# (nvpoll-rpc). See blktests' Documentation/running-tests.md.
#
#   config --show-blkdev-type | --show-trtype | --show-hostnqn | --show-hostid |
#          --show-host-traddr | --show-traddr | --show-trsvid |
#          --show-subsys-uuid | --show-subsysnqn
#   setup --subsysnqn NQN --subsys-uuid UUID --hostnqn NQN [--hostkey K] [--ctrlkey K]
#   add-ports --ports N --subsysnqn NQN ...      (one listener serves them all)
#   cleanup --subsysnqn NQN
#
# A subsystem gets one namespace: a sparse file of NVME_IMG_SIZE (default 1G)
# in NVPOLL_BT_STATE, with the UUID blktests gives; only the given host may
# connect, and with --hostkey (and --ctrlkey) that host must authenticate with
# DH-HMAC-CHAP (the subsystem's host entry gets dhchap_key, dhchap_ctrl_key).
#
# Environment (scripts/blktests.sh sets these in the guest):
#   NVPOLL_BT_RPC     nvpoll-rpc                 (required for setup/cleanup)
#   NVPOLL_BT_SOCKET  the target's control socket (default /run/nvpoll-blktests.sock)
#   NVPOLL_BT_PORT    its listener's port         (default 4420)
#   NVPOLL_BT_STATE   where namespace files go    (default /tmp/nvpoll-blktests)
set -uo pipefail

SOCKET=${NVPOLL_BT_SOCKET:-/run/nvpoll-blktests.sock}
PORT=${NVPOLL_BT_PORT:-4420}
STATE=${NVPOLL_BT_STATE:-/tmp/nvpoll-blktests}
SUBSYSNQN=${NVPOLL_BT_SUBSYSNQN:-nqn.2014-08.org.nvmexpress:blktests-subsystem-1}
SUBSYS_UUID=${NVPOLL_BT_SUBSYS_UUID:-91fdba0d-f87b-4c25-b80f-db7be1418b9e}

die() { echo "blktests-control: $*" >&2; exit 1; }

host_file() { [ -r "$1" ] && tr -d '\n' < "$1"; }

rpc() {
    [ -n "${NVPOLL_BT_RPC:-}" ] && [ -x "$NVPOLL_BT_RPC" ] || die "NVPOLL_BT_RPC must name nvpoll-rpc"
    "$NVPOLL_BT_RPC" -s "$SOCKET" "$@"
}

image() { printf '%s/%s.img' "$STATE" "$(printf %s "$1" | tr -c 'A-Za-z0-9._-' '_')"; }

cmd=${1:-}
[ -n "$cmd" ] || die "usage: $0 config|setup|add-ports|cleanup ARGS"
shift
case "$cmd" in
config)
    case "${1:-}" in
        --show-blkdev-type) echo file ;;
        --show-trtype) echo tcp ;;
        --show-hostnqn) host_file /etc/nvme/hostnqn || echo "${VM_HOSTNQN:?no /etc/nvme/hostnqn}" ;;
        --show-hostid) host_file /etc/nvme/hostid || echo "${VM_HOSTID:?no /etc/nvme/hostid}" ;;
        --show-host-traddr | --show-traddr) echo 127.0.0.1 ;;
        --show-trsvid) echo "$PORT" ;;
        --show-subsys-uuid) echo "$SUBSYS_UUID" ;;
        --show-subsysnqn) echo "$SUBSYSNQN" ;;
        *) die "config: unknown query '${1:-}'" ;;
    esac
    ;;
setup)
    subsys='' uuid='' host='' hostkey='' ctrlkey=''
    while [ $# -gt 0 ]; do
        case "$1" in
            --subsysnqn) subsys=$2; shift 2 ;;
            --subsys-uuid) uuid=$2; shift 2 ;;
            --hostnqn) host=$2; shift 2 ;;
            --hostkey) hostkey=$2; shift 2 ;;
            --ctrlkey | --ctrkey) ctrlkey=$2; shift 2 ;;
            *) die "setup: unknown argument '$1'" ;;
        esac
    done
    [ -n "$subsys" ] || die "setup: no --subsysnqn"
    [ -z "$ctrlkey" ] || [ -n "$hostkey" ] || die "setup $subsys: a controller key without a host key"
    [ -z "$hostkey" ] || [ -n "$host" ] || die "setup $subsys: a DH-HMAC-CHAP key without --hostnqn"
    mkdir -p "$STATE"
    img=$(image "$subsys")
    truncate -s "${NVME_IMG_SIZE:-1G}" "$img" || die "setup: cannot make $img"
    ns="{\"file\": \"$img\"${uuid:+, \"uuid\": \"$uuid\"}}"
    hosts=''
    keys=''
    [ -z "$hostkey" ] || keys=", \"dhchap_key\": \"$hostkey\""
    [ -z "$ctrlkey" ] || keys="$keys, \"dhchap_ctrl_key\": \"$ctrlkey\""
    [ -z "$host" ] || hosts=", \"hosts\": [{\"nqn\": \"$host\"$keys}]"
    rpc subsystem_add "{\"nqn\": \"$subsys\", \"namespaces\": [$ns]$hosts}" >/dev/null \
        || die "setup: subsystem_add $subsys refused"
    ;;
add-ports)
    # One listener serves every subsystem.
    ;;
cleanup)
    subsys=''
    while [ $# -gt 0 ]; do
        case "$1" in
            --subsysnqn) subsys=$2; shift 2 ;;
            *) shift ;;
        esac
    done
    [ -n "$subsys" ] || die "cleanup: no --subsysnqn"
    rpc subsystem_remove "{\"nqn\": \"$subsys\"}" >/dev/null 2>&1 || true
    rm -f "$(image "$subsys")" "$(image "$subsys").nvpoll-resv" "$(image "$subsys").nvpoll-resv.lock"
    ;;
*)
    die "unknown command '$cmd'"
    ;;
esac

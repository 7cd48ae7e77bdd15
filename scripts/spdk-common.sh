# scripts/spdk-common.sh - what scripts/bench-spdk.sh, bench-instructions.sh and interop-spdk.sh share: finding the SPDK build
# (or skipping without one), building our perf and target, the work folder with the test key, and starting and
# configuring SPDK's nvmf_tgt. Sourced, not run:
#
#   PROG=name
#   . "$(dirname "${BASH_SOURCE[0]}")/spdk-common.sh"
#
# Sourcing it defines ROOT, die, say, KEY and HOSTNQN, and, when SPDK_DIR is set, NVMF_TGT, SPDK_PERF, RPC_PY and
# RPC_PYTHON; when SPDK_DIR is not set it says SKIPPED and exits 0. The sourcing script sets SIZES_VAR (the knob
# that bytes names in its error) before calling bytes, and TCORE, SUBNQN and SUBNQN_TLS before
# spdk_tgt_launch and spdk_tgt_configure. on_exit_stop VAR sets the exit cleanup (the PID in VAR, and WORK).
# shellcheck shell=bash

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    echo "spdk-common.sh: source it from bench-spdk.sh or interop-spdk.sh, do not run it" >&2
    exit 2
fi

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
die() { echo "$PROG: error: $*" >&2; exit 2; }
say() { echo "$PROG: $*"; }

if [ -z "${SPDK_DIR:-}" ]; then
    say "SKIPPED: SPDK_DIR is not set. Point it at an SPDK build (v26.05) that has build/bin/nvmf_tgt,"
    say "build/bin/spdk_nvme_perf and scripts/rpc.py; this script never builds SPDK."
    exit 0
fi
NVMF_TGT=$SPDK_DIR/build/bin/nvmf_tgt
SPDK_PERF=$SPDK_DIR/build/bin/spdk_nvme_perf
RPC_PY=$SPDK_DIR/scripts/rpc.py
for f in "$NVMF_TGT" "$SPDK_PERF"; do [ -x "$f" ] || die "$f is missing or not executable (SPDK_DIR=$SPDK_DIR)"; done
[ -f "$RPC_PY" ] || die "$RPC_PY is missing (SPDK_DIR=$SPDK_DIR)"
# rpc.py wants a python3 with SPDK's modules' dependencies: Debian's by default (a pyenv one may lack them)
RPC_PYTHON=${SPDK_RPC_PYTHON:-$(command -v /usr/bin/python3 || command -v python3 || true)}
[ -n "$RPC_PYTHON" ] || die "python3 not found (rpc.py needs it): apt-get install python3"

# Test vector of the NVMe TLS PSK interchange format (shared/notes/tls-psk.md): a test-only key.
KEY='NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:'
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:f81d4fae-7dec-11d0-a765-00a0c91e6bf6

bytes() {   # 512 | 4k | 128k | 1m -> bytes
    local v=${1,,}
    case "$v" in
        *k) echo $(( ${v%k} * 1024 )) ;;
        *m) echo $(( ${v%m} * 1024 * 1024 )) ;;
        *[!0-9]*|'') die "bad size '$1' in $SIZES_VAR" ;;
        *) echo "$v" ;;
    esac
}

our_binaries() {   # sets BIN: NVPOLL_BIN_DIR, or a release build of our perf, target and core_rtt
    if [ -n "${NVPOLL_BIN_DIR:-}" ]; then
        BIN=$NVPOLL_BIN_DIR
    else
        say "building our perf, target and core_rtt (release)"
        (cd "$ROOT" && cargo build -q --release --bin nvpoll-perf --bin nvpoll-target --bin nvpoll-core-rtt) ||
            die "the build failed"
        local meta
        meta=$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps) || die "cargo metadata failed"
        [[ "$meta" =~ \"target_directory\":\"([^\"]+)\" ]] || die "no target_directory in cargo metadata"
        BIN=${BASH_REMATCH[1]}/release
    fi
    [ -x "$BIN/nvpoll-perf" ] && [ -x "$BIN/nvpoll-target" ] || die "no perf and target in $BIN"
}

make_work() {   # NAME: sets WORK (a fresh private folder), KEYFILE (KEY in it, mode 600) and RPC_SOCK
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/$1.XXXXXX")
    chmod 700 "$WORK"
    KEYFILE=$WORK/psk.key
    ( umask 077; printf '%s' "$KEY" > "$KEYFILE" )
    RPC_SOCK=$WORK/spdk.sock
}

# on_exit_stop VAR: at exit (and on INT or TERM), stops the process whose PID the variable named VAR holds
# then, if any, and removes WORK.
on_exit_stop() {
    EXIT_PID_VAR=$1
    trap exit_cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
}
# shellcheck disable=SC2317  # invoked by the traps
exit_cleanup() {
    local rc=$? pid
    trap - EXIT INT TERM
    pid=${!EXIT_PID_VAR:-}
    [ -z "$pid" ] || stop_pid "$pid"
    rm -rf "$WORK"
    exit "$rc"
}

stop_pid() {   # PID: SIGTERM, then SIGKILL after 5 s (SPDK's perf does not always exit on SIGTERM)
    local p=$1 i
    kill -TERM "$p" 2>/dev/null || true
    for i in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null || true
    { wait "$p"; } 2>/dev/null || true
}

wait_listen() {   # PORT PID LOG: until something listens on 127.0.0.1:PORT
    local i
    for i in $(seq 200); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
        kill -0 "$2" 2>/dev/null || break
        sleep 0.05
    done
    echo "---- $3 ----" >&2; tail -n 30 "$3" >&2
    die "nothing listens on 127.0.0.1:$1"
}

rpc() { "$RPC_PYTHON" "$RPC_PY" -s "$RPC_SOCK" "$@" >> "$WORK/rpc.log" 2>&1 || die "rpc.py $* failed (see below)$(echo; tail -n 5 "$WORK/rpc.log")"; }

# SPDK's target, in two steps so that the caller can note SPDK_TGT_PID (for its cleanup) before anything can fail.
spdk_tgt_launch() {   # nvmf_tgt on core TCORE, in the background: sets SPDK_TGT_PID
    rm -f "$RPC_SOCK"   # a killed predecessor leaves its socket behind
    "$NVMF_TGT" -m "$((1 << TCORE))" --no-huge -s 1024 -r "$RPC_SOCK" > "$WORK/nvmf_tgt.log" 2>&1 &
    SPDK_TGT_PID=$!
}

spdk_tgt_configure() {   # PLAIN_PORT TLS_PORT: a RAM namespace for SUBNQN on the one, SUBNQN_TLS on the other
    local i
    for i in $(seq 200); do [ -S "$RPC_SOCK" ] && break; kill -0 "$SPDK_TGT_PID" 2>/dev/null || break; sleep 0.05; done
    [ -S "$RPC_SOCK" ] || { tail -n 30 "$WORK/nvmf_tgt.log" >&2; die "nvmf_tgt did not open its RPC socket"; }
    rpc framework_wait_init
    # 1 MiB I/O in one command (max_io_size), 8 KiB of in-capsule data like ours
    rpc nvmf_create_transport -t TCP -i 1048576 -c 8192
    rpc bdev_malloc_create -b Malloc0 256 512
    rpc bdev_malloc_create -b Malloc1 256 512
    rpc keyring_file_add_key key0 "$KEYFILE"
    # plain: any host; TLS: only HOSTNQN, with the key (SPDK accepts the v0 identity only)
    rpc nvmf_create_subsystem "$SUBNQN" -a -s SPDK00000000000001 -m 4
    rpc nvmf_subsystem_add_ns "$SUBNQN" Malloc0
    rpc nvmf_subsystem_add_listener "$SUBNQN" -t tcp -a 127.0.0.1 -s "$1"
    rpc nvmf_create_subsystem "$SUBNQN_TLS" -s SPDK00000000000002 -m 4
    rpc nvmf_subsystem_add_ns "$SUBNQN_TLS" Malloc1
    rpc nvmf_subsystem_add_listener "$SUBNQN_TLS" -t tcp -a 127.0.0.1 -s "$2" --secure-channel
    rpc nvmf_subsystem_add_host "$SUBNQN_TLS" "$HOSTNQN" --psk key0
    wait_listen "$1" "$SPDK_TGT_PID" "$WORK/nvmf_tgt.log"
}

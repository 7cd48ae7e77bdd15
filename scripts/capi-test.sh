#!/usr/bin/env bash
# The C interface (capi/, libnvpoll) from C: builds the library (debug), compiles capi/examples/hello.c against
# the static library with -Wall -Wextra -Werror (and once against the shared one), starts our target
# (nvpoll-target, a RAM namespace; a plain listener and one that requires TLS), runs the example over both,
# and then under valgrind, which must find no error and no leak (definite, indirect or possible). The target
# is stopped on any exit. Valgrind is installed with apt-get when missing and we are root; otherwise the
# script says why it cannot run and fails.
# usage: scripts/capi-test.sh   (uses 127.0.0.1:PORT and PORT+1; PORT defaults to 4498)
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "capi-test: $*" >&2; exit 1; }
PORT=${PORT:-4498}
TLS_PORT=$((PORT + 1))
NQN=nqn.2024-01.io.nvpoll:capi
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-00000000c0de
# A public test vector (also in the TLS docs and tests), never a real key.
KEY='NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:'

if ! command -v valgrind >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || die "valgrind is missing and we are not root to install it: apt-get install valgrind"
    command -v apt-get >/dev/null 2>&1 || die "valgrind is missing and there is no apt-get: install valgrind by hand"
    echo "capi-test: installing valgrind"
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=300 update -qq || die "apt-get update failed (needed for valgrind)"
    apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends valgrind >/dev/null ||
        die "could not install valgrind: apt-get install valgrind"
fi
command -v cc >/dev/null 2>&1 || die "no C compiler (cc)"

# shellcheck source=scripts/debug-bins.sh
source scripts/debug-bins.sh   # builds the binaries (nvpoll-target among them); sets $bin
cargo build -q -p nvpoll-capi || die "the C interface did not build"
lib=$bin   # libnvpoll.a and libnvpoll.so sit beside the binaries
[ -f "$lib/libnvpoll.a" ] && [ -f "$lib/libnvpoll.so" ] || die "no libnvpoll.a or libnvpoll.so in $lib"
# The system libraries the static library needs, as rustc names them (-lgcc_s -lutil -lrt ... on glibc).
native=$(cargo rustc -q -p nvpoll-capi --crate-type staticlib -- --print native-static-libs 2>&1 |
    sed -n 's/.*native-static-libs: //p' | tail -n 1)
[ -n "$native" ] || die "rustc did not print the static library's native libraries"

work=$(mktemp -d)
tpid=
cleanup() {
    if [ -n "$tpid" ]; then kill -TERM "$tpid" 2>/dev/null || true; wait "$tpid" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT
cflags=(-std=c11 -D_POSIX_C_SOURCE=200809L -Wall -Wextra -Werror -g -Icapi/include)
# shellcheck disable=SC2086 # $native is a list of -l flags
cc "${cflags[@]}" capi/examples/hello.c "$lib/libnvpoll.a" $native -o "$work/hello" ||
    die "hello.c does not compile against libnvpoll.a"
cc "${cflags[@]}" capi/examples/hello.c -L"$lib" -lnvpoll -o "$work/hello-shared" ||
    die "hello.c does not compile against libnvpoll.so"
echo "capi-test: hello.c compiles cleanly against libnvpoll.a and libnvpoll.so"

"$bin/nvpoll-target" --listen "127.0.0.1:$TLS_PORT" --tls required --psk "$HOSTNQN=$KEY" \
    --listener "127.0.0.1:$PORT,tls=off" --nqn "$NQN" --ram 16M > "$work/target.log" 2>&1 &
tpid=$!
up=
for _ in $(seq 200); do
    if ss -ltn | grep -q "127.0.0.1:$PORT " && ss -ltn | grep -q "127.0.0.1:$TLS_PORT "; then up=1; break; fi
    kill -0 "$tpid" 2>/dev/null || break
    sleep 0.05
done
[ -n "$up" ] || { cat "$work/target.log"; die "the target is not listening on $PORT and $TLS_PORT"; }

plain="trtype:tcp traddr:127.0.0.1 trsvcid:$PORT subnqn:$NQN hostnqn:$HOSTNQN"
tls="trtype:tcp traddr:127.0.0.1 trsvcid:$TLS_PORT subnqn:$NQN hostnqn:$HOSTNQN"
run() { # NAME COMMAND...: runs the example, prints its line, fails with its output
    local name=$1 out rc=0; shift
    out=$(timeout 120 "$@" 2>&1) || rc=$?
    [ "$rc" = 0 ] || { printf '%s\n' "$out"; die "$name failed (exit $rc)"; }
    grep -E '^hello: .*: OK$' <<< "$out" | sed "s/^/capi-test: $name: /"
}
run "static, no TLS" "$work/hello" "$plain"
run "static, TLS" "$work/hello" "$tls" "$KEY"
LD_LIBRARY_PATH=$lib run "shared, TLS" "$work/hello-shared" "$tls" "$KEY"
# The TLS listener refuses a host without the key: the example must fail and say so.
rc=0; out=$(timeout 60 "$work/hello" "$tls" 2>&1) || rc=$?
[ "$rc" != 0 ] || die "the example connected without the key to a listener that requires TLS"
echo "capi-test: without the key: $out"

# Valgrind: no error, no definite, indirect or possible leak. What stays reachable at exit (the Rust runtime's
# thread-locals and the stdout buffer) is not a leak and not counted. No suppression is needed.
for mode in plain tls; do
    args=("$plain"); [ "$mode" = tls ] && args=("$tls" "$KEY")
    rc=0
    timeout 300 valgrind --leak-check=full --errors-for-leak-kinds=definite,indirect,possible \
        --error-exitcode=1 --log-file="$work/valgrind-$mode.log" "$work/hello" "${args[@]}" > "$work/out-$mode" 2>&1 || rc=$?
    if [ "$rc" != 0 ]; then
        cat "$work/out-$mode" "$work/valgrind-$mode.log"
        die "valgrind ($mode): exit $rc"
    fi
    echo "capi-test: valgrind ($mode): $(grep -o 'ERROR SUMMARY: [0-9]* errors' "$work/valgrind-$mode.log");" \
        "$(grep -o -e 'definitely lost: .*' -e 'All heap blocks were freed.*' "$work/valgrind-$mode.log")"
done
echo "capi-test: the C example runs plain and with TLS, statically and dynamically linked, clean under valgrind"

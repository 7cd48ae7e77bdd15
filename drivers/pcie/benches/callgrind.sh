#!/usr/bin/env bash
# Instructions per I/O of the PCIe queue pair against the memory-backed stand-in, counted by callgrind:
# runs examples/fake_loop with two I/O counts and divides the difference in instructions by the difference
# in I/Os, so set-up and tear-down cancel out. Needs valgrind (apt-get install valgrind).
#
# usage: drivers/pcie/benches/callgrind.sh [qd1|batch32 ...]
set -euo pipefail
cd "$(dirname "$0")/../../.."
command -v valgrind >/dev/null || { echo "callgrind.sh: valgrind is missing (apt-get install valgrind)" >&2; exit 2; }
cargo build --release -q -p nvpoll-pcie --example fake_loop
exe=$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')/release/examples/fake_loop
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
instructions() {   # ios mode
    valgrind --tool=callgrind --callgrind-out-file="$out/cg.$1.$2" "$exe" "$1" "$2" >/dev/null 2>&1
    sed -n 's/^summary: *//p' "$out/cg.$1.$2" | awk '{print $1}'
}
# Inclusive instructions of the stand-in (its register writes run the fake controller), in one run.
standin() {   # ios mode
    callgrind_annotate --inclusive=yes --threshold=100 "$out/cg.$1.$2" 2>/dev/null |
        awk '/FakeDevice as nvpoll_pcie::(device::)?Device>::write32/ { gsub(",", "", $1); if ($1 + 0 > m + 0) m = $1 + 0 } END { print m + 0 }'
}
small=2000 big=22000
for m in ${@:-qd1 batch32}; do
    a=$(instructions $small "$m")
    b=$(instructions $big "$m")
    sa=$(standin $small "$m")
    sb=$(standin $big "$m")
    total=$(( (b - a) / (big - small) ))
    fake=$(( (sb - sa) / (big - small) ))
    echo "pcie fake $m: $total instructions per I/O: driver $((total - fake)) (submit, PRPs, doorbells, reap, hand-back, loop) + stand-in $fake"
done

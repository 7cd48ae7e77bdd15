#!/usr/bin/env bash
# Runs every cargo-fuzz target for a while (FUZZ_SECONDS each, default 20) and fails on the first crash.
# Needs the nightly toolchain (cargo-fuzz builds with sanitizer flags; installed with rustup if missing),
# cargo-fuzz (installed with cargo if missing) and a C++ compiler (libFuzzer is C++; apt-get install g++).
#   scripts/fuzz.sh                 # all targets, 20 s each
#   FUZZ_SECONDS=600 scripts/fuzz.sh pdu_decode
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${FUZZ_SECONDS:-20}
die() { echo "fuzz: error: $*" >&2; exit 1; }
[[ "$secs" =~ ^[0-9]+$ ]] || die "FUZZ_SECONDS must be a number of seconds, not '$secs'"

who=fuzz
# shellcheck source=scripts/nightly.sh
source scripts/nightly.sh
command -v c++ >/dev/null 2>&1 || die "no C++ compiler (c++) found: libFuzzer needs one; install it: apt-get install g++"
if ! command -v cargo-fuzz >/dev/null 2>&1; then
    echo "fuzz: installing cargo-fuzz (cargo install cargo-fuzz --locked; about 1-2 min)"
    cargo install cargo-fuzz --locked ||
        die "could not install cargo-fuzz; install it by hand: cargo install cargo-fuzz --locked"
fi

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    list=$(cargo +nightly fuzz list) || die "cargo fuzz list failed"
    mapfile -t targets <<< "$list"
fi
[ -n "${targets[0]:-}" ] || die "no fuzz targets found (cargo fuzz list printed nothing)"
for t in "${targets[@]}"; do
    echo "fuzz: $t for ${secs}s"
    log=$(mktemp)
    rc=0
    cargo +nightly fuzz run "$t" -- -max_total_time="$secs" > "$log" 2>&1 || rc=$?
    grep -E '^(Done|SUMMARY)|ERROR' "$log" || true
    if [ "$rc" != 0 ]; then
        # A crash makes cargo fuzz exit non-zero and leaves its input under fuzz/artifacts/.
        tail -40 "$log"; rm -f "$log"
        echo "fuzz: $t failed (exit $rc)"; exit 1
    fi
    rm -f "$log"
done
echo "fuzz: ${#targets[@]} targets, no crash"

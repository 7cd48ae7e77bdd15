#!/usr/bin/env bash
# Runs every cargo-fuzz target for a while (FUZZ_SECONDS each, default 20) and fails on the first crash.
# Needs the nightly toolchain (cargo-fuzz builds with sanitizer flags) and cargo-fuzz (installed if missing).
#   scripts/fuzz.sh                 # all targets, 20 s each
#   FUZZ_SECONDS=600 scripts/fuzz.sh pdu_decode
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${FUZZ_SECONDS:-20}
if ! rustup run nightly rustc --version >/dev/null 2>&1; then
    echo "fuzz: installing the nightly toolchain (cargo-fuzz needs it)"
    rustup toolchain install nightly --profile minimal
fi
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
targets=("$@")
[ ${#targets[@]} -gt 0 ] || mapfile -t targets < <(cargo +nightly fuzz list)
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

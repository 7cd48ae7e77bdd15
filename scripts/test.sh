#!/usr/bin/env bash
# The whole test suite: formatting, lints, host tests, then the VM tests (real NVMe controller model behind a
# vIOMMU, and the kernel's nvmet-tcp, in a QEMU guest). This is what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n=== %s\n' "$*"; }

step "cargo fmt --check"
cargo fmt --all -- --check
step "cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
step "cargo test (host)"
cargo test --workspace
step "fuzz (briefly)"
FUZZ_SECONDS=${FUZZ_SECONDS:-15} scripts/fuzz.sh
step "fault injection"
scripts/fault-test.sh
step "VM tests"
scripts/vm-test.sh

#!/usr/bin/env bash
# Runs the unit tests of the unsafe modules' pure logic under Miri (undefined behaviour, aliasing, data races):
# the DMA pool and buffers (src/mem.rs: size classes, windows, splits, the free list across threads, the
# non-temporal copy), the io_uring buffer ring's entries and tail (src/uring.rs) and the PCIe driver's shared queue memory and test device (drivers/pcie/src/mmio.rs). What
# needs the kernel (mlock, BAR mappings of a device or file, mremap) is not Miri's to run: the pool takes its
# "could not mlock" path there, and the BAR test runs natively only.
# Needs the nightly toolchain with the miri and rust-src components (installed with rustup if missing).
#   scripts/miri.sh
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "miri: error: $*" >&2; exit 1; }

who=miri
# shellcheck source=scripts/nightly.sh
source scripts/nightly.sh
if ! cargo +nightly miri --version >/dev/null 2>&1; then
    echo "miri: installing Miri (rustup component add --toolchain nightly miri rust-src)"
    rustup component add --toolchain nightly miri rust-src ||
        die "could not add Miri; add it by hand: rustup component add --toolchain nightly miri rust-src"
fi
cargo +nightly miri setup >/dev/null 2>&1 || cargo +nightly miri setup || die "cargo miri setup failed (above)"

echo "miri: nvpoll::mem"
cargo +nightly miri test -p nvpoll --lib mem::
# The test device translates IOVAs to addresses as a device does, from integers (exposed provenance).
echo "miri: nvpoll::uring (the provided-buffer ring; what needs io_uring itself runs natively only)"
cargo +nightly miri test -p nvpoll --lib uring::tests::pure_
echo "miri: nvpoll_pcie::mmio"
MIRIFLAGS="${MIRIFLAGS:-} -Zmiri-permissive-provenance" cargo +nightly miri test -p nvpoll-pcie --lib mmio::
echo "miri: no undefined behaviour found"

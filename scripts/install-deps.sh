#!/usr/bin/env bash
# Installs what the test suite (scripts/test.sh) needs on the host and is missing, with apt-get; run as root.
# What a fresh machine must already have: Debian 12, a Rust toolchain by rustup (with a C compiler for its
# linker), root. The VM tests' own packages (QEMU from bookworm-backports, busybox-static, nvme-cli, fio, ...)
# and the guest kernel come with scripts/vm.sh on first use; cargo-fuzz and the nightly toolchain with
# scripts/fuzz.sh.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
export PATH=$PATH:/usr/sbin:/sbin   # ip, tc, nft live there
die() { echo "install-deps: error: $*" >&2; exit 1; }

command -v cargo >/dev/null 2>&1 || die "cargo not found: install a Rust toolchain with rustup (https://rustup.rs)"
command -v cc >/dev/null 2>&1 || die "no C compiler (cc) for the Rust linker: apt-get install gcc"

# Every probe is a condition: a missing tool is collected here, never a reason for the script to stop.
need=()
command -v openssl >/dev/null 2>&1 || need+=(openssl)             # TLS interop tests
command -v gnutls-cli >/dev/null 2>&1 || need+=(gnutls-bin)       # TLS interop tests
command -v c++ >/dev/null 2>&1 || need+=(g++)                     # libFuzzer (scripts/fuzz.sh)
# scripts/fault-test.sh: network namespaces, veth, tc (iproute2) and firewall rules (nftables)
{ command -v ip && command -v tc && command -v ss; } >/dev/null 2>&1 || need+=(iproute2)
command -v nft >/dev/null 2>&1 || need+=(nftables)
command -v valgrind >/dev/null 2>&1 || need+=(valgrind)         # the C interface's example (scripts/capi-test.sh)
# The fio ioengine (fio-engine/): fio itself, libclang for bindgen, dpkg-dev for `apt-get source fio`
# (scripts/fio-source.sh brings fio's source).
command -v fio >/dev/null 2>&1 || need+=(fio)
command -v dpkg-source >/dev/null 2>&1 || need+=(dpkg-dev)
# bindgen needs libclang itself and clang's own headers (stddef.h): libclang-dev brings both.
{ compgen -G '/usr/lib/llvm-*/lib/libclang.so' && compgen -G '/usr/lib/llvm-*/lib/clang/*/include/stddef.h'; } \
    >/dev/null 2>&1 || need+=(libclang-dev)
if [ ${#need[@]} -gt 0 ]; then
    [ "$(id -u)" = 0 ] || die "missing ${need[*]}: run as root, or install them: apt-get install ${need[*]}"
    command -v apt-get >/dev/null 2>&1 || die "apt-get not found; install these by hand: ${need[*]}"
    echo "install-deps: installing ${need[*]}"
    apt-get -o DPkg::Lock::Timeout=300 update -qq || die "apt-get update failed (needed for: ${need[*]})"
    apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends "${need[@]}" >/dev/null ||
        die "could not install ${need[*]}; install them by hand: apt-get install ${need[*]}"
fi
if ! cargo fmt --version >/dev/null 2>&1 || ! cargo clippy --version >/dev/null 2>&1; then
    command -v rustup >/dev/null 2>&1 || die "cargo fmt or cargo clippy is missing and rustup is not there to add them"
    rustup component add rustfmt clippy || die "could not add rustfmt and clippy; try: rustup component add rustfmt clippy"
fi

# Sourced (not run) by the scripts that need the nightly toolchain (fuzz.sh, miri.sh): installs it with rustup
# where it is missing. The caller defines `die MESSAGE` and sets `who` (its name, for the progress line) first.
# Every probe is in a condition, so a missing tool reaches its install step (or its one-line error).
command -v rustup >/dev/null 2>&1 ||
    die "rustup not found: the nightly toolchain comes from rustup (https://rustup.rs)"
if ! rustup run nightly rustc --version >/dev/null 2>&1; then
    echo "$who: installing the nightly toolchain (about 30 s)"
    rustup toolchain install nightly --profile minimal ||
        die "could not install the nightly toolchain; install it by hand: rustup toolchain install nightly --profile minimal"
fi

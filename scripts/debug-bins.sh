# Sourced (not run) by the checks that run the workspace's binaries: builds them in the debug profile and
# sets `meta` (cargo metadata of the workspace, without dependencies) and `bin` (the folder the binaries are
# in). The caller defines `die MESSAGE` first.
cargo build -q --workspace --bins || die "the build failed"
meta=$(cargo metadata --format-version 1 --no-deps) || die "cargo metadata failed"
[[ "$meta" =~ \"target_directory\":\"([^\"]+)\" ]] || die "no target_directory in cargo metadata"
bin=${BASH_REMATCH[1]}/debug

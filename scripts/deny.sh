#!/usr/bin/env bash
# cargo-deny over the workspace's dependency graph, by deny.toml: licences (permissive only), bans (no
# wildcard requirements; duplicate versions warned), sources (crates.io only), and RustSec's advisories.
# Installs cargo-deny with cargo if it is missing (about 5 min on 2 cores).
#   scripts/deny.sh
#   NVPOLL_ADVISORY_DB=/path/to/advisory-db scripts/deny.sh   # a local clone of RustSec's advisory-db
# The advisory database comes from GitHub (cargo deny fetches it). Where GitHub cannot be reached and no
# local clone is given, the advisories are not checked, and the script says so (the other checks still run).
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "deny: error: $*" >&2; exit 1; }

# Every probe is in a condition, so a missing tool reaches its install step (or its one-line error).
if ! command -v cargo-deny >/dev/null 2>&1; then
    echo "deny: installing cargo-deny (cargo install cargo-deny --locked; about 5 min)"
    cargo install cargo-deny --locked ||
        die "could not install cargo-deny; install it by hand: cargo install cargo-deny --locked"
fi

cargo deny check licenses bans sources

if [ -n "${NVPOLL_ADVISORY_DB:-}" ]; then
    [ -d "$NVPOLL_ADVISORY_DB/crates" ] ||
        die "NVPOLL_ADVISORY_DB=$NVPOLL_ADVISORY_DB is not a clone of RustSec's advisory-db (no crates/ in it)"
    # cargo-deny reads a database from db-path/<name cargo-deny 0.20 derives from the default URL>; give it the
    # local clone there, offline (a cargo-deny that names it otherwise fails here, loudly: database not found).
    db=$(mktemp -d)
    trap 'rm -rf "$db"' EXIT
    cfg="$db/deny.toml"
    sed 's|^\[advisories\]|[advisories]\ndb-path = "'"$db"'"|' deny.toml > "$cfg"
    cp -r "$NVPOLL_ADVISORY_DB" "$db/advisory-db-3157b0e258782691"
    echo "deny: advisories from $NVPOLL_ADVISORY_DB ($(git -C "$NVPOLL_ADVISORY_DB" log -1 --format=%cs 2>/dev/null || echo "date unknown"))"
    cargo deny --offline --config "$cfg" check advisories
elif out=$(cargo deny fetch db 2>&1); then
    cargo deny check advisories
else
    printf '%s\n' "$out" | tail -3 >&2
    echo "deny: advisories NOT checked: RustSec's database could not be fetched (above); give a local clone" \
         "with NVPOLL_ADVISORY_DB=PATH"
fi

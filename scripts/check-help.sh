#!/usr/bin/env bash
# Checks that the first line of every binary's --help says what that binary does: not a crate's
# description (clap's `about` with no value takes the package's), and not empty.
# usage: scripts/check-help.sh   (builds the binaries in the debug profile)
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "check-help: $*" >&2; exit 1; }
# shellcheck source=scripts/debug-bins.sh
source scripts/debug-bins.sh
# every package's description, one a line
descs=$(grep -o '"description":"[^"]*"' <<< "$meta" | sed 's/^"description":"//; s/"$//')
bad=0 n=0
for exe in "$bin"/nvpoll-{perf,identify,hello-world,target,rpc,setup,core-rtt,kv}; do
    [ -x "$exe" ] || die "$exe was not built"
    help=$("$exe" --help) || die "$exe --help failed"
    first=$(head -n 1 <<< "$help")
    n=$((n + 1))
    if [ -z "$first" ] || [[ "$first" == Usage:* ]]; then
        echo "check-help: ${exe##*/}: --help has no description line"; bad=1
    elif grep -qxF -- "$first" <<< "$descs"; then
        echo "check-help: ${exe##*/}: --help opens with a crate's description: $first"; bad=1
    else
        printf 'check-help: %-19s %s\n' "${exe##*/}" "$first"
    fi
done
[ "$bad" = 0 ] || exit 1
echo "check-help: $n binaries, each --help says what it does"

#!/usr/bin/env bash
# Proves that the commands README.md and docs/*.md show still exist as written, so the docs cannot rot:
#  - in ```sh blocks, every `cargo run [--release] [-p PKG] --bin NAME -- ARGS` (continuation lines joined):
#    NAME is a binary of the workspace, and every --flag in ARGS is in `NAME --help` (for nvpoll-setup and nvpoll-kv, in
#    `nvpoll-setup SUBCOMMAND --help`, the subcommand being the first word after `--`);
#  - anywhere (blocks and inline code), every `cargo bench [-p PKG] --bench NAME` names a bench target of the
#    workspace, and every `scripts/...` path that ends in .sh is a file of the repository.
# Running the commands themselves is what the suite's other steps do (perf with no arguments, the target in
# the fault and VM tests, the benches briefly); this check catches a renamed binary, flag, bench or script.
# usage: scripts/check-doc-commands.sh   (builds the binaries in the debug profile)
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "check-doc-commands: $*" >&2; exit 1; }
# shellcheck source=scripts/debug-bins.sh
source scripts/debug-bins.sh
benches=$(grep -o '"kind":\["bench"\],"crate_types":\["bin"\],"name":"[^"]*"' <<< "$meta" | sed 's/.*"name":"//; s/"$//')
[ -n "$benches" ] || die "cargo metadata lists no bench targets (has its format changed?)"
docs=(README.md docs/*.md)
bad=0 runs=0 flags=0 nbench=0 nscripts=0
declare -A helps=()

help_of() {   # the --help text of binary $1 (subcommand $2 if given), cached
    local key="$1 ${2:-}"
    if [ -z "${helps[$key]+x}" ]; then
        if [ -n "${2:-}" ]; then helps[$key]=$("$bin/$1" "$2" --help 2>&1) || helps[$key]=""
        else helps[$key]=$("$bin/$1" --help 2>&1) || helps[$key]=""; fi
    fi
    printf '%s' "${helps[$key]}"
}

# the ```sh blocks, one command a line, continuations joined, as "FILE:LINE<TAB>COMMAND"
sh_commands() {
    local f n line in_sh cont start
    for f in "${docs[@]}"; do
        n=0 in_sh=0 cont="" start=0
        while IFS= read -r line || [ -n "$line" ]; do
            n=$((n + 1))
            if [[ "$line" =~ ^\`\`\` ]]; then
                if [ "$in_sh" = 1 ]; then in_sh=0; elif [[ "$line" =~ ^\`\`\`(sh|bash|console)$ ]]; then in_sh=1; fi
                continue
            fi
            [ "$in_sh" = 1 ] || continue
            [ -n "$cont" ] || start=$n
            if [[ "$line" =~ \\$ ]]; then cont+="${line%\\} "; continue; fi
            printf '%s:%s\t%s\n' "$f" "$start" "$cont$line"
            cont=""
        done < "$f"
    done
}

while IFS=$'\t' read -r where cmd; do
    [[ "$cmd" =~ (^|[[:space:]])cargo\ run([^|;&]*)--bin\ ([A-Za-z0-9_-]+)(.*)$ ]] || continue
    name=${BASH_REMATCH[3]} rest=${BASH_REMATCH[4]}
    runs=$((runs + 1))
    if [ ! -x "$bin/$name" ]; then
        echo "check-doc-commands: $where: no binary $name: $cmd"; bad=1; continue
    fi
    args=""
    [[ "$rest" =~ ^[[:space:]]*--[[:space:]](.*)$ ]] && args=${BASH_REMATCH[1]}
    sub=""
    if { [ "$name" = nvpoll-setup ] || [ "$name" = nvpoll-kv ]; } && [[ "$args" =~ ^[[:space:]]*([a-z][a-z-]*) ]]; then sub=${BASH_REMATCH[1]}; fi
    help=$(help_of "$name" "$sub")
    [ -n "$help" ] || { echo "check-doc-commands: $where: $name ${sub:+$sub }--help failed"; bad=1; continue; }
    # the flags: words that start with -- outside quotes (a quoted argument may hold anything)
    unquoted=$(sed -E "s/'[^']*'//g; s/\"[^\"]*\"//g" <<< "$args")
    for word in $unquoted; do
        [[ "$word" =~ ^(--[a-z][a-z0-9-]*) ]] || continue
        flag=${BASH_REMATCH[1]}
        flags=$((flags + 1))
        grep -qE -- "(^|[[:space:],])$flag([=[:space:],]|$)" <<< "$help" ||
            { echo "check-doc-commands: $where: $name has no $flag (not in its --help): $cmd"; bad=1; }
    done
done < <(sh_commands)

for f in "${docs[@]}"; do
    while IFS= read -r b; do
        nbench=$((nbench + 1))
        grep -qxF -- "$b" <<< "$benches" || { echo "check-doc-commands: $f: no bench target '$b' (cargo bench --bench $b)"; bad=1; }
    done < <(grep -oE 'cargo bench( -p [a-z0-9-]+)? --bench [A-Za-z0-9_-]+' "$f" | sed 's/.*--bench //')
    while IFS= read -r s; do
        nscripts=$((nscripts + 1))
        [ -f "$s" ] || { echo "check-doc-commands: $f: no script $s"; bad=1; }
    done < <(grep -oE '(^|[^A-Za-z0-9_./-])(\./)?scripts/[A-Za-z0-9_./*-]*\.sh' "$f" | sed -E 's/^[^s.]*//; s/^\.\///' | grep -v '\*')
done

[ "$runs" -gt 0 ] || die "found no 'cargo run --bin' command in the docs (has their form changed?)"
[ "$bad" = 0 ] || exit 1
echo "check-doc-commands: OK: $runs cargo run commands ($flags flags found in --help), $nbench bench and $nscripts script names, all present"

#!/usr/bin/env bash
# Checks the documentation's links: every docs/*.md page is linked from README.md, and every relative link in
# README.md and docs/*.md points to a file that exists and, where it names a #anchor in a Markdown file, to a
# heading of that file (GitHub's slugs: lowercase, spaces to '-', punctuation but '-' and '_' dropped, a
# repeated heading's slug suffixed -1, -2, ...). Links inside fenced code blocks and inline code are not links.
# Prints what is wrong and exits 1, or prints one OK line. Pure bash: it needs no other tool.
# usage: scripts/check-docs.sh
set -euo pipefail
case $0 in */*) cd "${0%/*}/.." ;; *) cd .. ;; esac
shopt -s nullglob

bad=0 links=0
declare -A anchors=() scanned=()

problem() { echo "check-docs: $*"; bad=1; }

# slug TEXT: the anchor GitHub gives a heading with this text
slug() {
    local s=${1,,}
    s=${s//[^[:alnum:] _-]/}
    REPLY=${s// /-}
}

# scan FILE: record FILE's headings (outside code fences) as anchors["FILE#slug"]
scan() {
    local file=$1 line fence="" text
    local -A seen=()
    scanned[$file]=1
    while IFS= read -r line || [ -n "$line" ]; do
        if [[ $line =~ ^[[:space:]]{0,3}(\`\`\`|~~~) ]]; then
            if [ -z "$fence" ]; then fence=${BASH_REMATCH[1]}; elif [ "$fence" = "${BASH_REMATCH[1]}" ]; then fence=""; fi
            continue
        fi
        [ -z "$fence" ] || continue
        if [[ $line =~ ^[[:space:]]{0,3}#{1,6}[[:space:]]+(.*)$ ]]; then
            text=${BASH_REMATCH[1]}
            # a closing run of #s is not part of the heading
            [[ $text =~ ^(.*[^#[:space:]])[[:space:]]+#+[[:space:]]*$ ]] && text=${BASH_REMATCH[1]}
            slug "$text"
            if [ -n "${seen[$REPLY]:-}" ]; then
                anchors["$file#$REPLY-${seen[$REPLY]}"]=1
                seen[$REPLY]=$((seen[$REPLY] + 1))
            else
                anchors["$file#$REPLY"]=1
                seen[$REPLY]=1
            fi
        elif [[ $line =~ \<a[[:space:]][^\>]*(name|id)=\"([^\"]+)\" ]]; then
            anchors["$file#${BASH_REMATCH[2]}"]=1
        fi
    done < "$file"
    return 0
}

# normalize PATH: PATH without ./ and dir/../ parts
normalize() {
    local -a parts=() out=()
    local p
    IFS=/ read -r -a parts <<< "$1"
    for p in "${parts[@]}"; do
        case $p in
            "" | .) ;;
            ..) if [ ${#out[@]} -gt 0 ] && [ "${out[-1]}" != .. ]; then unset 'out[-1]'; else out+=(..); fi ;;
            *) out+=("$p") ;;
        esac
    done
    local IFS=/
    REPLY="${out[*]}"
}

# check FILE: every relative link in FILE resolves; README.md's links to docs pages are collected in linked[]
declare -A linked=()
check() {
    local file=$1 dir line fence="" n=0 rest target path anchor resolved
    dir=${file%/*}; [ "$dir" = "$file" ] && dir=.
    while IFS= read -r line || [ -n "$line" ]; do
        n=$((n + 1))
        if [[ $line =~ ^[[:space:]]{0,3}(\`\`\`|~~~) ]]; then
            if [ -z "$fence" ]; then fence=${BASH_REMATCH[1]}; elif [ "$fence" = "${BASH_REMATCH[1]}" ]; then fence=""; fi
            continue
        fi
        [ -z "$fence" ] || continue
        # drop inline code spans, then walk the links' targets: ](target) or ](target "title")
        rest=$line
        while [[ $rest =~ ^([^\`]*)\`[^\`]*\`(.*)$ ]]; do rest="${BASH_REMATCH[1]}${BASH_REMATCH[2]}"; done
        while [[ $rest =~ \]\(([^\)]*)\) ]]; do
            target=${BASH_REMATCH[1]}
            rest=${rest#*"${BASH_REMATCH[0]}"}
            target=${target%% *}
            target=${target#<}; target=${target%>}
            case $target in
                "" | *://* | mailto:*) continue ;;
            esac
            links=$((links + 1))
            path=${target%%#*}
            anchor=""
            [[ $target == *"#"* ]] && anchor=${target#*#}
            if [ -z "$path" ]; then
                resolved=$file
            else
                normalize "$dir/$path"; resolved=$REPLY
            fi
            if [ ! -e "$resolved" ]; then
                problem "$file:$n: link $target: no file $resolved"
                continue
            fi
            [ "$file" = README.md ] && linked[$resolved]=1
            if [ -n "$anchor" ] && [[ $resolved == *.md ]]; then
                [ -n "${scanned[$resolved]:-}" ] || scan "$resolved"
                [ -n "${anchors["$resolved#$anchor"]:-}" ] || problem "$file:$n: link $target: no heading #$anchor in $resolved"
            fi
        done
    done < "$file"
    return 0
}

[ -f README.md ] || { echo "check-docs: no README.md in $PWD" >&2; exit 1; }
pages=(docs/*.md)
for f in README.md "${pages[@]}"; do
    check "$f"
done
for f in "${pages[@]}"; do
    [ -n "${linked[$f]:-}" ] || problem "$f is not linked from README.md"
done
[ "$bad" = 0 ] || exit 1
echo "check-docs: OK: README.md links all ${#pages[@]} docs pages; $links relative links, every file and heading found"

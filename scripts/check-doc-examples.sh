#!/usr/bin/env bash
# Checks that the API an embedder meets keeps its examples (issue 37): every public function, method, type,
# trait and trait method defined in the files listed below carries a compiled example (a Rust code block in
# its rustdoc; `cargo test --doc` builds and runs them), or its doc says where one is: it links to an item
# whose doc has an example and mentions "example". Prints each item that has neither and exits 1, or prints
# one OK line per crate.
#
# It reads nightly rustdoc's JSON output (`-Z unstable-options --output-format json`). rustdoc's own
# `--show-coverage` is not used: it counts only items whose path is public, so the items of a private module
# that the crate re-exports (nvpoll's Error, the TCP host's types, the PCIe controller) are not counted at
# all, and it has no notion of an example given once for a type and linked from its small methods.
#
# Needs the nightly toolchain (scripts/fuzz.sh and scripts/miri.sh install it) and python3; without either it
# says so and skips (exit 0). Set NVPOLL_DOC_EXAMPLES_REQUIRED=1 to make their absence a failure.
# usage: scripts/check-doc-examples.sh
set -euo pipefail
cd "$(dirname "$0")/.."

skip() {
    if [ "${NVPOLL_DOC_EXAMPLES_REQUIRED:-0}" = 1 ]; then
        echo "check-doc-examples: $* (NVPOLL_DOC_EXAMPLES_REQUIRED=1)" >&2
        exit 1
    fi
    echo "check-doc-examples: SKIPPED: $*"
    exit 0
}
command -v python3 >/dev/null 2>&1 || skip "python3 not found"
rustup run nightly rustdoc --version >/dev/null 2>&1 ||
    skip "no nightly toolchain (rustup toolchain install nightly --profile minimal)"

# crate, its JSON file's stem, and the files whose public items must have examples (paths from the root).
checks=(
    "nvpoll|nvpoll|src/api.rs src/aio.rs src/completion_fd.rs src/mem.rs src/error.rs src/reactor.rs src/trid.rs src/send.rs src/units.rs"
    "nvpoll-tcp|nvpoll_tcp|drivers/tcp/src/host/*.rs drivers/tcp/src/multipath.rs"
    "nvpoll-pcie|nvpoll_pcie|drivers/pcie/src/ctrl.rs drivers/pcie/src/qpair.rs"
)

target=${CARGO_TARGET_DIR:-target}
bad=0
for check in "${checks[@]}"; do
    IFS='|' read -r crate stem globs <<< "$check"
    # The JSON lands in the target directory's doc/; a stale one must not pass for a fresh one.
    rm -f "$target/doc/$stem.json"
    if ! out=$(cargo +nightly rustdoc -q -p "$crate" --lib -- -Z unstable-options --output-format json 2>&1); then
        printf '%s\n' "$out" >&2
        echo "check-doc-examples: nightly rustdoc failed for $crate" >&2
        exit 1
    fi
    # shellcheck disable=SC2086 # the globs are meant to expand
    files=$(ls $globs)
    python3 - "$target/doc/$stem.json" "$crate" $files <<'EOF' || bad=1
import json, re, sys

path, crate, files = sys.argv[1], sys.argv[2], set(sys.argv[3:])
doc = json.load(open(path))
index = doc["index"]
root = doc["root"]
local = index[str(root)]["crate_id"] if str(root) in index else 0

def kind(item):
    return next(iter(item["inner"]))

# A fenced block that rustdoc compiles: no language, `rust`, or only rustdoc's attributes.
ATTRS = {"rust", "no_run", "should_panic", "compile_fail", "edition2015", "edition2018", "edition2021",
         "edition2024"}
def has_example(docs):
    for m in re.finditer(r"^\s*```([^\n`]*)$", docs or "", re.M):
        words = {w.strip() for w in m.group(1).split(",") if w.strip()}
        if words <= ATTRS:
            return True
    return False

# Which items need an example: public functions, methods of inherent impls, structs, enums, unions, traits,
# type aliases, and the methods of local traits. Methods of trait impls do not (the trait's carry them).
need = {}
def consider(i):
    item = index.get(str(i))
    if item is None or item["crate_id"] != local or not item.get("span"):
        return
    if item["span"]["filename"] not in files:
        return
    need[str(i)] = item
for i, item in index.items():
    if item["crate_id"] != local:
        continue
    k = kind(item)
    if k in ("struct", "enum", "union", "trait", "type_alias") and item["visibility"] == "public":
        consider(i)
    elif k == "module":
        for c in item["inner"]["module"]["items"]:
            ci = index.get(str(c))
            if ci and kind(ci) == "function" and ci["visibility"] == "public":
                consider(c)
    elif k == "impl":
        imp = item["inner"]["impl"]
        if imp.get("trait") is None and not imp.get("is_synthetic") and imp.get("blanket_impl") is None:
            for c in imp["items"]:
                ci = index.get(str(c))
                if ci and kind(ci) == "function" and ci["visibility"] == "public":
                    consider(c)
    if k == "trait" and item["visibility"] == "public":
        for c in item["inner"]["trait"]["items"]:
            ci = index.get(str(c))
            if ci and kind(ci) == "function":
                consider(c)

own = {i for i, item in need.items() if has_example(item.get("docs"))}
def example_of(i):
    item = index.get(str(i))
    return item is not None and has_example(item.get("docs"))
linked = set()
for i, item in need.items():
    if i in own:
        continue
    docs = item.get("docs") or ""
    if "example" in docs and any(example_of(t) for t in (item.get("links") or {}).values()):
        linked.add(i)
missing = sorted((need[i]["span"]["filename"], need[i]["span"]["begin"][0], need[i]["name"] or "?")
                 for i in need if i not in own and i not in linked)
for f, line, name in missing:
    print(f"check-doc-examples: {f}:{line}: `{name}` has no example and links to none")
if missing:
    print(f"check-doc-examples: {crate}: {len(missing)} of {len(need)} items without an example")
    sys.exit(1)
print(f"check-doc-examples: OK: {crate}: {len(need)} items in {len(files)} files, "
      f"{len(own)} with an example of their own, {len(linked)} linking to one")
EOF
done
[ "$bad" = 0 ] || exit 1

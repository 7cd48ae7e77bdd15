#!/usr/bin/env bash
# Brings the source of the installed fio, configured, for the fio ioengine (fio/; its build.rs generates the
# bindings from these headers) and for SPDK's fio plugin (SPDK's ./configure --with-fio=DIR).
#
# fio is GPL-2.0: its source is downloaded here at build time and never committed. It comes from Debian's
# source package of the installed fio version (`apt-get source fio`, after adding a deb-src entry for the
# release if there is none), into ${NVPOLL_FIO_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/nvpoll-fio}/fio-VERSION,
# where fio/build.rs looks by default. FIO_DIR names another checkout instead (it is only configured here).
#
# Prints the directory on its last line. Exits 0 when the source is ready, 1 when it cannot be had (the
# reason on stderr): the engine is then skipped by cargo with a warning. Root is needed only to add the deb-src
# entry.
set -euo pipefail
die() { echo "fio-source: error: $*" >&2; exit 1; }
say() { echo "fio-source: $*" >&2; }

configure() {
    local dir=$1
    if [ -f "$dir/config-host.h" ]; then return 0; fi
    say "configuring $dir (fio's ./configure, as Debian builds it)"
    # Debian's configure line minus --enable-gfio/--enable-libnbd (their GTK and libnbd headers are not
    # needed: neither changes the structures an ioengine sees).
    (cd "$dir" && ./configure --disable-native --prefix=/usr >"$dir/.nvpoll-configure.log" 2>&1) ||
        die "fio's ./configure failed in $dir: see $dir/.nvpoll-configure.log"
}

if [ -n "${FIO_DIR:-}" ]; then
    [ -f "$FIO_DIR/ioengines.h" ] || die "FIO_DIR=$FIO_DIR holds no fio source (no ioengines.h)"
    configure "$FIO_DIR"
    echo "$FIO_DIR"
    exit 0
fi

command -v fio >/dev/null 2>&1 || die "fio is not installed (apt-get install fio), and FIO_DIR is not set"
ver=$(fio --version 2>/dev/null | sed -n 's/^fio-\([0-9][0-9.]*\).*/\1/p')
[ -n "$ver" ] || die "cannot tell the installed fio's version from \`fio --version\`"
cache=${NVPOLL_FIO_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/nvpoll-fio}
dir=$cache/fio-$ver
if [ -f "$dir/ioengines.h" ]; then
    configure "$dir"
    echo "$dir"
    exit 0
fi

command -v apt-get >/dev/null 2>&1 || die "no apt-get: set FIO_DIR to a fio-$ver checkout"
command -v dpkg-source >/dev/null 2>&1 || {
    [ "$(id -u)" = 0 ] || die "dpkg-source is missing (apt-get install dpkg-dev), or set FIO_DIR"
    apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends dpkg-dev >/dev/null ||
        die "could not install dpkg-dev (for apt-get source)"
}
mkdir -p "$cache"
work=$(mktemp -d "$cache/.fetch.XXXXXX")
trap 'rm -rf "$work"' EXIT
fetch() { (cd "$work" && apt-get source -qq "fio=$(dpkg-query -W -f='${Version}' fio)" >"$work/.log" 2>&1); }
if ! fetch; then
    # No deb-src entry yet: add one for this release, next to the binary sources, and try again.
    [ "$(id -u)" = 0 ] || die "apt-get source fio failed and adding a deb-src entry needs root (or set FIO_DIR): $(tail -2 "$work/.log")"
    . /etc/os-release
    codename=${VERSION_CODENAME:-}
    [ -n "$codename" ] || die "cannot tell this release's codename for a deb-src entry"
    list=/etc/apt/sources.list.d/nvpoll-deb-src.sources
    say "adding $list (Types: deb-src, $codename) for apt-get source fio"
    cat >"$list" <<EOF
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: $codename
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    apt-get -o DPkg::Lock::Timeout=300 update -qq >/dev/null 2>&1 || die "apt-get update failed"
    fetch || die "apt-get source fio failed: $(tail -3 "$work/.log")"
fi
src=$(find "$work" -mindepth 1 -maxdepth 1 -type d -name 'fio-*' | head -1)
[ -n "$src" ] && [ -f "$src/ioengines.h" ] || die "apt-get source fio left no fio source tree"
rm -rf "$dir"
mv "$src" "$dir"
configure "$dir"
say "fio $ver source in $dir"
echo "$dir"

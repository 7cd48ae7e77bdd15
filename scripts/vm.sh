#!/usr/bin/env bash
# scripts/vm.sh - run one command inside a throw-away QEMU guest built for
# nvpoll's integration tests.
#
# usage: scripts/vm.sh [--] COMMAND [ARGS...]
#
# COMMAND runs as root under bash in the guest, in the caller's current
# directory. Its stdout and stderr stream to this script's stdout and stderr,
# and this script exits with COMMAND's exit status; 125 means the guest never
# reported one (setup failure, boot failure or timeout: the end of the guest
# console is printed).
#
# The guest (q35 machine, emulated Intel VT-d IOMMU, TCG by default):
#   * sees this machine's root filesystem read-only over virtio-9p, with an
#     in-RAM overlay on top (writes are thrown away), so binaries built here
#     run there unchanged at the same path;
#   * has two emulated NVMe controllers: 0000:00:04.0 bound to vfio-pci (for
#     the userspace driver) and 0000:00:05.0 bound to the kernel nvme driver;
#   * runs the kernel NVMe/TCP target (nvmet-tcp) on port 4420 with one
#     file-backed namespace and allow_any_host, has the nvme-tcp host module
#     loaded, nvme-cli and fio;
#   * has hugetlbfs mounted at /dev/hugepages with some 2 MiB pages reserved.
#
# Variables COMMAND sees in the guest:
#   VM_VFIO_BDF      PCI address of the vfio-pci controller (0000:00:04.0)
#   VM_VFIO_GROUP    its IOMMU group (/dev/vfio/$VM_VFIO_GROUP)
#   VM_KNVME_DEV     namespace block device of the kernel-driven controller
#   VM_NVMET_NQN VM_NVMET_ADDR VM_NVMET_PORT   the nvmet-tcp subsystem
#                    (unset when NVPOLL_VM_NVMET=0)
#   VM_HOSTNQN VM_HOSTID   host NQN and host ID, as nvme-cli uses them
#   VM_KERNEL_VERSION      the guest kernel's release (uname -r)
#   VM_HUGEPAGES     number of 2 MiB hugepages actually reserved
#   VM_OUT           a folder shared read-write with this machine
#   NVPOLL_VM_GUEST=1
# and, copied from the caller: PATH HOME RUST_LOG RUST_BACKTRACE
# CARGO_TARGET_DIR and every variable whose name starts with NVPOLL_.
#
# Knobs (environment, all optional):
#   NVPOLL_VM_DIR=${XDG_CACHE_HOME:-$HOME/.cache}/nvpoll-vm
#                          cache (kernel, initramfs, per-run folders)
#   NVPOLL_VM_MEM=2G  NVPOLL_VM_SMP=2      guest size
#   NVPOLL_VM_TIMEOUT=900  seconds before the guest is killed
#   NVPOLL_VM_STALL_KILL=120  kill the guest earlier once its kernel reports
#                          RCU stalls and the command printed nothing for
#                          this many seconds (0: off)
#   NVPOLL_VM_NVMET=1      0: no nvmet-tcp target
#   NVPOLL_VM_NVMET_SIZE=256M  size of the target's namespace (guest RAM)
#   NVPOLL_VM_NVME_SIZE=1G size of each emulated controller's namespace
#   NVPOLL_VM_HUGEPAGES=64 2 MiB hugepages to reserve in the guest
#   NVPOLL_VM_HOSTFWD=     e.g. 14420: forward 127.0.0.1:14420 here to the
#                          guest's port 4420 (user-mode NIC, restrict=on)
#   NVPOLL_VM_OUT=         host folder to share as VM_OUT (kept afterwards);
#                          default: a fresh folder, removed at the end
#   NVPOLL_VM_ACCEL=tcg    tcg | kvm (kvm needs real VT-x/AMD-V)
#   NVPOLL_VM_KERNEL_PKG=  Debian kernel package; default: the newest
#                          linux-image-*-amd64-unsigned apt knows (bookworm-
#                          backports or bookworm-security on bookworm)
#   NVPOLL_VM_KEEP=0       1: keep the per-run folder (console log, ...)
#   NVPOLL_VM_VERBOSE=0    1: progress and timings on stderr
#   NVPOLL_VM_TLSHD=       a tlshd binary (ktls-utils, built locally: not
#                          packaged for bookworm): the guest loads tls.ko,
#                          starts it for the kernel's NVMe/TCP TLS handshakes
#                          (host and nvmet) with keys from the .nvme keyring,
#                          and exports VM_TLSHD (its path) to COMMAND; its log
#                          goes to VM_OUT/tlshd.log. Needs keyutils (keyctl).
#
# Needs root and Debian (apt-get installs what is missing: QEMU >= 9 from
# bookworm-backports on bookworm, busybox-static, kmod, cpio, xz-utils,
# zstd, nvme-cli, fio). The kernel package is downloaded and unpacked into
# the cache, never installed.
set -euo pipefail

PROG=vm.sh
SHARED_VM_DIR=${VM_DIR:-}   # the run-in-vm.sh reference script's cache knob
: "${XDG_CACHE_HOME:=${HOME:-/root}/.cache}"
VM_DIR=${NVPOLL_VM_DIR:-$XDG_CACHE_HOME/nvpoll-vm}
MEM=${NVPOLL_VM_MEM:-2G}
SMP=${NVPOLL_VM_SMP:-2}
TIMEOUT=${NVPOLL_VM_TIMEOUT:-900}
STALL_KILL=${NVPOLL_VM_STALL_KILL:-120}
NVMET=${NVPOLL_VM_NVMET:-1}
NVMET_SIZE=${NVPOLL_VM_NVMET_SIZE:-256M}
NVME_SIZE=${NVPOLL_VM_NVME_SIZE:-1G}
HUGEPAGES=${NVPOLL_VM_HUGEPAGES:-64}
HOSTFWD=${NVPOLL_VM_HOSTFWD:-}
USER_OUT=${NVPOLL_VM_OUT:-}
ACCEL=${NVPOLL_VM_ACCEL:-tcg}
KERNEL_PKG=${NVPOLL_VM_KERNEL_PKG:-}
KEEP=${NVPOLL_VM_KEEP:-0}
VERBOSE=${NVPOLL_VM_VERBOSE:-0}
TLSHD=${NVPOLL_VM_TLSHD:-}

QEMU_MIN_MAJOR=9
CACHE_LAYOUT=1          # bump when the cache layout or initramfs changes
# Modules the guest loads at setup; they and their dependencies are stored
# uncompressed (decompressing .ko.xz under TCG costs seconds per boot).
GUEST_MODULES="configfs vfio vfio_iommu_type1 vfio-pci nvme nvme-tcp nvmet nvmet-tcp virtio_net"
# Modules the initramfs needs to reach the host's root filesystem.
INITRD_MODULES="9pnet_virtio 9p overlay"

T0=$EPOCHREALTIME
say() { [ "$VERBOSE" = 1 ] || return 0; printf '[%s +%.1fs] %s\n' "$PROG" "$(bc_sub "$EPOCHREALTIME" "$T0")" "$*" >&2; }
bc_sub() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", a - b }'; }
die() { echo "$PROG: error: $*" >&2; exit 125; }
# First-use steps (installs, downloads) say what they do even when not verbose: they take a while.
tell() { echo "$PROG: $*" >&2; }

usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; }
case "${1:-}" in
    --) shift ;;
    -h|--help) usage; exit 0 ;;
esac
[ $# -gt 0 ] || { usage >&2; exit 2; }

# ---------------------------------------------------------------------------
# preconditions
# ---------------------------------------------------------------------------
[ "$(id -u)" = 0 ] || die "must run as root (it installs packages with apt-get and shares / with the guest over 9p); try: sudo $0 $*"
case "$ACCEL" in tcg|kvm) ;; *) die "NVPOLL_VM_ACCEL must be tcg or kvm, not '$ACCEL'" ;; esac
[[ "$HUGEPAGES" =~ ^[0-9]+$ ]] || die "NVPOLL_VM_HUGEPAGES must be a number"
[[ "$TIMEOUT" =~ ^[0-9]+$ ]] || die "NVPOLL_VM_TIMEOUT must be a number of seconds"
[[ "$STALL_KILL" =~ ^[0-9]+$ ]] || die "NVPOLL_VM_STALL_KILL must be a number of seconds (0: off)"
[ -z "$HOSTFWD" ] || [[ "$HOSTFWD" =~ ^[0-9]+$ ]] || die "NVPOLL_VM_HOSTFWD must be a port number"
if [ -n "$TLSHD" ]; then
    [ -x "$TLSHD" ] || die "NVPOLL_VM_TLSHD=$TLSHD is not an executable (build tlshd from ktls-utils 1.4.0)"
    TLSHD=$(realpath "$TLSHD")
fi

OS_ID='' OS_CODENAME=''
if [ -r /etc/os-release ]; then
    # shellcheck disable=SC1091
    OS_ID=$(. /etc/os-release && echo "${ID:-}")
    # shellcheck disable=SC1091
    OS_CODENAME=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
fi
need_debian() {   # called only when something has to come from apt
    [ "$OS_ID" = debian ] ||
        die "this needs Debian (found '${OS_ID:-unknown}' in /etc/os-release): it gets $* with apt-get"
    command -v apt-get >/dev/null || die "apt-get not found"
}

# The cache must be our own: never the shared /tmp/run-in-vm folder of the
# team's reference script (different layout), never a random folder.
VM_DIR=$(realpath -m "$VM_DIR")
for other in /tmp/run-in-vm "${TMPDIR:-/tmp}/run-in-vm" ${SHARED_VM_DIR:+"$SHARED_VM_DIR"}; do
    if [ "$(realpath -m "$other")" = "$VM_DIR" ]; then
        die "NVPOLL_VM_DIR=$VM_DIR is the cache of the team's run-in-vm.sh; give nvpoll-vm a folder of its own"
    fi
done
# paths go into QEMU options (comma-separated) and onto the kernel command line
case "$VM_DIR" in *[[:space:],]*) die "NVPOLL_VM_DIR must not contain spaces or commas: '$VM_DIR'" ;; esac
mkdir -p "$VM_DIR"
if [ ! -f "$VM_DIR/.nvpoll-vm-cache" ]; then
    [ -z "$(ls -A "$VM_DIR")" ] || die "NVPOLL_VM_DIR=$VM_DIR is not empty and is not an nvpoll-vm cache; pick another folder"
    echo "nvpoll-vm cache (scripts/vm.sh); safe to delete" > "$VM_DIR/.nvpoll-vm-cache"
fi

# Serialise first-run setup between concurrent callers.
exec 9>"$VM_DIR/.setup.lock"
flock 9

# ---------------------------------------------------------------------------
# host packages
# ---------------------------------------------------------------------------
APT_FRESH=0
apt_refresh() {
    [ "$APT_FRESH" = 1 ] && return
    say "apt-get update"
    apt-get -o DPkg::Lock::Timeout=300 update -qq >/dev/null ||
        die "apt-get update failed: apt cannot reach its mirrors, and QEMU, busybox-static, nvme-cli, fio and the guest kernel come from there"
    APT_FRESH=1
}
apt_install() {   # [-t SUITE] PKG...
    tell "installing $* with apt-get (first use)"
    local log
    log=$(mktemp)
    if ! DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends "$@" \
            >"$log" 2>&1; then
        local why
        why=$(grep -E '^(E|W): ' "$log" | tail -n 1)
        rm -f "$log"
        die "could not install $* with apt-get (${why:-see the output of apt-get}); install it by hand: apt-get install $*"
    fi
    rm -f "$log"
}

# On bookworm, QEMU >= 9 (48-bit vIOMMU address width, the version the team
# validated) and recent kernels live in bookworm-backports. Add that suite,
# using the mirror and keyring of the existing Debian entry.
BACKPORTS=
ensure_backports() {
    [ "$OS_CODENAME" = bookworm ] || return 0
    BACKPORTS=bookworm-backports
    if have_backports; then return; fi
    local deb822=/etc/apt/sources.list.d/debian.sources
    if [ -f "$deb822" ]; then
        awk -v RS= -v ORS='\n\n' '/(^|\n)Suites:[^\n]*[ \t]bookworm([ \t]|\n|$)/ { print; exit }' "$deb822" |
            sed -e 's/^Suites:.*/Suites: bookworm-backports/' -e 's/^Components:.*/Components: main/' \
            > /etc/apt/sources.list.d/nvpoll-bookworm-backports.sources
    else
        awk '$1 == "deb" { for (i = 2; i < NF; i++) if ($i == "bookworm") { $i = "bookworm-backports"; $(i + 1) = "main"; NF = i + 1; print; exit } }' \
            /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
            > /etc/apt/sources.list.d/nvpoll-bookworm-backports.list
    fi
    say "added bookworm-backports to apt's sources"
    APT_FRESH=0; apt_refresh
    have_backports || die "could not enable bookworm-backports in apt's sources (see /etc/apt/sources.list.d/nvpoll-bookworm-backports.*); QEMU >= $QEMU_MIN_MAJOR comes from there"
}

# Probes never fail: under `set -euo pipefail` a missing tool would otherwise end the script (status 127)
# before the step that installs it. Each prints what it found, or nothing.
qemu_major() {
    command -v qemu-system-x86_64 >/dev/null 2>&1 || return 0
    local v
    v=$(qemu-system-x86_64 --version 2>/dev/null) || return 0
    sed -n '1s/^QEMU emulator version \([0-9]*\)\..*/\1/p' <<< "$v"
}
# Whether apt knows bookworm-backports. (Not `apt-cache policy | grep -q`: with pipefail, grep quitting
# early can fail the pipeline with SIGPIPE and read as "not there".)
have_backports() {
    local policy
    policy=$(apt-cache policy 2>/dev/null) || return 1
    grep -q ' bookworm-backports/' <<< "$policy"
}

BUSYBOX=
find_static_busybox() {
    local b
    for b in /bin/busybox /usr/bin/busybox /usr/lib/initramfs-tools/bin/busybox; do
        if [ -x "$b" ] && ! ldd "$b" >/dev/null 2>&1; then BUSYBOX=$b; return 0; fi
    done
    return 1
}

ensure_packages() {
    local missing=() qemu_old=0 major
    major=$(qemu_major)
    if [ -z "$major" ] || [ "$major" -lt $QEMU_MIN_MAJOR ]; then qemu_old=1; fi
    find_static_busybox || missing+=(busybox-static)
    command -v cpio   >/dev/null || missing+=(cpio)
    command -v depmod >/dev/null || missing+=(kmod)
    command -v xz     >/dev/null || missing+=(xz-utils)
    command -v zstd   >/dev/null || missing+=(zstd)
    command -v nvme   >/dev/null || missing+=(nvme-cli)
    command -v fio    >/dev/null || missing+=(fio)
    command -v flock  >/dev/null || missing+=(util-linux)
    [ -z "$TLSHD" ] || command -v keyctl >/dev/null || missing+=(keyutils)
    if [ ${#missing[@]} -eq 0 ] && [ $qemu_old = 0 ]; then return; fi
    local missing_desc=''
    [ ${#missing[@]} -eq 0 ] || missing_desc=" ${missing[*]}"
    [ $qemu_old = 0 ] || missing_desc="$missing_desc qemu-system-x86>=$QEMU_MIN_MAJOR"
    need_debian "the packages$missing_desc"
    apt_refresh
    [ ${#missing[@]} -eq 0 ] || apt_install "${missing[@]}"
    if [ $qemu_old = 1 ]; then
        ensure_backports
        apt_install ${BACKPORTS:+-t "$BACKPORTS"} qemu-system-x86
        major=$(qemu_major)
        if [ -z "$major" ] || [ "$major" -lt $QEMU_MIN_MAJOR ]; then
            die "need QEMU >= $QEMU_MIN_MAJOR, have '$(qemu-system-x86_64 --version 2>&1 | head -1)'"
        fi
    fi
    find_static_busybox || die "no static busybox found after installing busybox-static"
}

# ---------------------------------------------------------------------------
# guest kernel: a Debian kernel package unpacked into the cache
# ---------------------------------------------------------------------------
# A bzImage carries the compressed ELF kernel as its "payload"; the boot
# protocol header says where (setup_sects at 0x1f1, payload_offset/length at
# 0x248/0x24c, relative to the protected-mode code after the setup sectors).
# The last 4 bytes of the payload are the uncompressed size. QEMU boots the
# ELF through its PVH entry point, which skips the in-guest decompression
# (slow under TCG).
bzimage_to_elf() {   # $1 bzImage, $2 output ELF
    local img=$1 out=$2 setup_sects off len start magic
    setup_sects=$(od -An -tu1 -j $((0x1f1)) -N1 "$img" | tr -d ' ')
    [ "$setup_sects" != 0 ] || setup_sects=4
    read -r off len < <(od -An -tu4 -j $((0x248)) -N8 "$img")
    start=$(( (setup_sects + 1) * 512 + off ))
    magic=$(od -An -tx1 -j "$start" -N4 "$img" | tr -d ' \n')
    local unpack
    case "$magic" in
        28b52ffd) unpack="zstd -dcq" ;;
        fd377a58) unpack="xz -dc --single-stream" ;;
        1f8b*)    unpack="gzip -dc" ;;
        *) die "unknown compression (magic $magic) in $img" ;;
    esac
    dd if="$img" iflag=skip_bytes,count_bytes skip="$start" count=$((len - 4)) bs=1M status=none | $unpack > "$out.part" ||
        die "could not decompress the kernel in $img"
    [ "$(od -An -tx1 -N4 "$out.part" | tr -d ' \n')" = 7f454c46 ] || die "the payload of $img is not an ELF file"
    mv "$out.part" "$out"
}

unpack_module() {   # decompress one .ko.xz/.ko.zst in place
    case "$1" in
        *.ko.xz)  xz -d "$1" ;;
        *.ko.zst) zstd -dq --rm "$1" ;;
    esac
}

module_files() {    # $1 module tree, $2 release, $3... module names -> files in load order
    local root=$1 rel=$2; shift 2
    local m
    for m in "$@"; do
        modprobe -d "$root" -S "$rel" --show-depends "$m" || die "module $m not found in $rel"
    done | awk '$1 == "insmod" { print $2 }' | awk '!seen[$0]++'
}

KREL='' KDIR=''
ensure_kernel() {
    if [ -z "$KERNEL_PKG" ] && [ -s "$VM_DIR/kernel-pkg" ]; then
        KERNEL_PKG=$(cat "$VM_DIR/kernel-pkg")
    fi
    if [ -z "$KERNEL_PKG" ]; then
        need_debian "a Debian kernel package"
        ensure_backports
        KERNEL_PKG=$(apt-cache search --names-only '^linux-image-[0-9][0-9.]*\+[a-z0-9.]+-amd64-unsigned$' |
                     awk '{ print $1 }' | sort -V | tail -1)
        if [ -z "$KERNEL_PKG" ]; then
            apt_refresh
            KERNEL_PKG=$(apt-cache search --names-only '^linux-image-[0-9][0-9.]*\+[a-z0-9.]+-amd64-unsigned$' |
                         awk '{ print $1 }' | sort -V | tail -1)
        fi
        [ -n "$KERNEL_PKG" ] || die "apt knows no linux-image-*-amd64-unsigned package"
    fi
    KREL=${KERNEL_PKG#linux-image-}; KREL=${KREL%-unsigned}
    KDIR=$VM_DIR/kernel/$KREL
    if [ ! -s "$KDIR/vmlinux" ] || [ ! -f "$KDIR/ready" ]; then
        need_debian "$KERNEL_PKG"
        tell "downloading $KERNEL_PKG for the guest (first use; about 100 MB) into $KDIR"
        rm -rf "$KDIR"; mkdir -p "$KDIR/dl"
        if ! (cd "$KDIR/dl" && apt-get -o APT::Sandbox::User=root download -qq "$KERNEL_PKG" >/dev/null 2>&1); then
            apt_refresh
            (cd "$KDIR/dl" && apt-get -o APT::Sandbox::User=root download -qq "$KERNEL_PKG" >/dev/null) ||
                die "apt-get download $KERNEL_PKG failed"
        fi
        say "unpacking $KERNEL_PKG"
        dpkg-deb -x "$KDIR"/dl/*.deb "$KDIR/root"
        rm -rf "$KDIR/dl"
        [ -d "$KDIR/root/lib/modules/$KREL" ] || die "$KERNEL_PKG has no /lib/modules/$KREL"
        depmod -b "$KDIR/root" "$KREL"
        local f
        # shellcheck disable=SC2086
        for f in $(module_files "$KDIR/root" "$KREL" $GUEST_MODULES $INITRD_MODULES); do unpack_module "$f"; done
        # the rest of the NVMe and VFIO drivers, for tests that load them
        find "$KDIR/root/lib/modules/$KREL/kernel/drivers/nvme" "$KDIR/root/lib/modules/$KREL/kernel/drivers/vfio" \
            \( -name '*.ko.xz' -o -name '*.ko.zst' \) -print0 | while IFS= read -r -d '' f; do unpack_module "$f"; done
        depmod -b "$KDIR/root" "$KREL"
        say "extracting the ELF kernel for PVH boot"
        bzimage_to_elf "$KDIR/root/boot/vmlinuz-$KREL" "$KDIR/vmlinux"
        touch "$KDIR/ready"
    fi
    echo "$KERNEL_PKG" > "$VM_DIR/kernel-pkg"
}

# ---------------------------------------------------------------------------
# initramfs: static busybox and the modules needed to mount the host's root
# ---------------------------------------------------------------------------
ensure_initramfs() {
    INITRD=$KDIR/initramfs-v$CACHE_LAYOUT.cpio.gz
    [ -s "$INITRD" ] && return
    say "building the initramfs"
    local d f
    d=$(mktemp -d "$VM_DIR/initramfs.XXXXXX")
    mkdir -p "$d"/{bin,dev,proc,sys,lower,rw,root,modules}
    cp "$BUSYBOX" "$d/bin/busybox"
    # shellcheck disable=SC2086
    for f in $(module_files "$KDIR/root" "$KREL" $INITRD_MODULES); do
        cp "$f" "$d/modules/"
        basename "$f" >> "$d/modules/order"
    done
    cat > "$d/init" <<'INIT'
#!/bin/busybox sh
# shellcheck disable=SC2013,SC2015
# nvpoll-vm stage 1: host root (9p, read-only) + tmpfs overlay, the two
# read-write shares, then stage 2 (bash from the host root) as PID 1.
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
fatal() { echo "nvpoll-vm stage1: $*" > /dev/console; poweroff -f; }
for m in $(cat /modules/order); do insmod "/modules/$m" || fatal "insmod $m"; done
RUN=
for arg in $(cat /proc/cmdline); do
    case "$arg" in nvpoll.run=*) RUN=${arg#nvpoll.run=} ;; nvpoll.out=*) OUT=${arg#nvpoll.out=} ;; esac
done
[ -n "$RUN" ] && [ -n "$OUT" ] || fatal "nvpoll.run= or nvpoll.out= missing from the kernel command line"
opts=trans=virtio,version=9p2000.L,msize=524288
mount -t 9p -o "$opts,ro,cache=loose" hostroot /lower || fatal "mounting the host root"
mount -t tmpfs -o mode=0755 rw /rw
mkdir -p /rw/upper /rw/work
mount -t overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work root /root || fatal "overlay"
mkdir -p "/root$RUN/ctl" "/root$OUT"
mount -t 9p -o "$opts" ctl "/root$RUN/ctl" || fatal "mounting the control share"
mount -t 9p -o "$opts" out "/root$OUT" || fatal "mounting the output share"
for m in proc sys dev; do mount --move "/$m" "/root/$m"; done
exec switch_root /root /bin/bash "$RUN/guest-init.sh"
INIT
    chmod 755 "$d/init"
    (cd "$d" && find . | cpio -o -H newc --quiet | gzip -1) > "$INITRD.part"
    mv "$INITRD.part" "$INITRD"
    rm -rf "$d"
}

# ---------------------------------------------------------------------------
# stage 2, run by the guest as PID 1 (with the host's bash)
# ---------------------------------------------------------------------------
write_guest_init() {   # $1 file
    cat > "$1" <<'GUEST'
#!/bin/bash
# shellcheck disable=SC1091,SC2015
# nvpoll-vm stage 2 (guest PID 1): devices, targets, then the command.
RUN=$(dirname "$(readlink -f "$0")")
CTL=$RUN/ctl
source "$RUN/params"
exec </dev/null >/dev/console 2>&1
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
note() { echo "[guest $(cut -d' ' -f1 /proc/uptime)] $*"; }
halt() { echo "$1" > "$CTL/exitcode"; sync; note "exit status $1, powering off"; /bin/busybox poweroff -f; sleep 30; }
broken() { note "setup failed: $*"; echo "vm.sh: guest setup failed: $*" >> "$CTL/stderr"; halt 125; }
note "stage 2"

mount -t tmpfs -o mode=0755 run /run
mkdir -p /dev/pts /dev/shm /dev/hugepages
mount -t devpts devpts /dev/pts
mount -t tmpfs shm /dev/shm
mount -t hugetlbfs -o pagesize=2M hugetlbfs /dev/hugepages || broken "mounting hugetlbfs"
echo "$HUGEPAGES" > /proc/sys/vm/nr_hugepages
export VM_HUGEPAGES; VM_HUGEPAGES=$(cat /proc/sys/vm/nr_hugepages)
[ "$VM_HUGEPAGES" = "$HUGEPAGES" ] || note "warning: asked for $HUGEPAGES hugepages, got $VM_HUGEPAGES"
export VM_KERNEL_VERSION; VM_KERNEL_VERSION=$(uname -r)
echo "$VM_KERNEL_VERSION" > "$CTL/kernel-version"
mkdir -p /lib/modules && ln -sfn "$KROOT/lib/modules/$VM_KERNEL_VERSION" "/lib/modules/$VM_KERNEL_VERSION"
modprobe configfs && mount -t configfs configfs /sys/kernel/config || broken "configfs"
hostname nvpoll-vm
/bin/busybox ip link set lo up

# Controller at 00:04.0 -> vfio-pci. driver_override is set before the nvme
# driver exists, so the kernel never touches it.
export VM_VFIO_BDF=0000:00:04.0
dev=/sys/bus/pci/devices/$VM_VFIO_BDF
[ -d "$dev" ] || broken "no PCI device $VM_VFIO_BDF"
echo vfio-pci > "$dev/driver_override"
modprobe vfio_iommu_type1 && modprobe vfio-pci || broken "modprobe vfio-pci"
[ -e "$dev/driver" ] || echo "$VM_VFIO_BDF" > /sys/bus/pci/drivers_probe
[ "$(basename "$(readlink -f "$dev/driver")")" = vfio-pci ] || broken "$VM_VFIO_BDF is not bound to vfio-pci"
export VM_VFIO_GROUP; VM_VFIO_GROUP=$(basename "$(readlink -f "$dev/iommu_group")")
[ -c "/dev/vfio/$VM_VFIO_GROUP" ] || broken "/dev/vfio/$VM_VFIO_GROUP is missing"
note "vfio-pci: $VM_VFIO_BDF, IOMMU group $VM_VFIO_GROUP"

# Controller at 00:05.0 -> kernel nvme driver.
modprobe nvme || broken "modprobe nvme"
export VM_KNVME_DEV=
for _ in $(seq 100); do
    # with native multipath the controller holds the path device nvmeXcYnZ
    # and the block device is nvmeXnZ; without it, nvmeXnZ directly
    for ns in /sys/bus/pci/devices/0000:00:05.0/nvme/nvme*/nvme*n1; do
        ns=${ns##*/}
        [[ "$ns" =~ ^nvme([0-9]+)c[0-9]+n([0-9]+)$ ]] && ns=nvme${BASH_REMATCH[1]}n${BASH_REMATCH[2]}
        [ -b "/dev/$ns" ] && VM_KNVME_DEV=/dev/$ns && break 2
    done
    sleep 0.1
done
[ -n "$VM_KNVME_DEV" ] || broken "the kernel-driven NVMe namespace did not appear"
note "nvme: $VM_KNVME_DEV"

if [ -n "$HOSTFWD" ]; then
    modprobe virtio_net || broken "modprobe virtio_net"
    for _ in $(seq 100); do [ -e /sys/class/net/eth0 ] && break; sleep 0.1; done
    /bin/busybox ip link set eth0 up && /bin/busybox ip addr add 10.0.2.15/24 dev eth0 || broken "eth0"
fi

# NVMe/TCP host side. Identity files are written in the overlay when the
# host has none, so the host's /etc is never changed.
modprobe nvme-tcp || broken "modprobe nvme-tcp"
mkdir -p /etc/nvme
[ -s /etc/nvme/hostnqn ] || nvme gen-hostnqn > /etc/nvme/hostnqn
[ -s /etc/nvme/hostid ] || sed -n 's/.*:uuid:\(.*\)$/\1/p' /etc/nvme/hostnqn > /etc/nvme/hostid
[ -s /etc/nvme/hostid ] || cat /proc/sys/kernel/random/uuid > /etc/nvme/hostid
export VM_HOSTNQN VM_HOSTID
VM_HOSTNQN=$(cat /etc/nvme/hostnqn); VM_HOSTID=$(cat /etc/nvme/hostid)

# NVMe/TCP with TLS (kernel >= 6.7): the kernel asks tlshd over the handshake
# netlink family to run the TLS 1.3 handshake with a PSK from the .nvme
# keyring, then uses kTLS on the socket; for host and nvmet alike.
if [ -n "$TLSHD" ]; then
    modprobe tls || broken "modprobe tls"
    grep -q ' \.nvme: ' /proc/keys || broken "no .nvme keyring in this kernel"
    printf '[debug]\nloglevel=0\ntls=0\nnl=0\n[authenticate]\nkeyrings=.nvme\n' > /run/tlshd.conf
    "$TLSHD" -s -c /run/tlshd.conf > "$OUT/tlshd.log" 2>&1 &
    export VM_TLSHD=$TLSHD
    note "tlshd: pid $!"
fi

# NVMe/TCP target: one subsystem, one file-backed namespace, port 4420.
if [ "$NVMET" = 1 ]; then
    export VM_NVMET_NQN=nqn.2024-01.io.nvpoll:vm-target VM_NVMET_ADDR=127.0.0.1 VM_NVMET_PORT=4420
    modprobe nvmet-tcp || broken "modprobe nvmet-tcp"
    cfg=/sys/kernel/config/nvmet
    sub=$cfg/subsystems/$VM_NVMET_NQN port=$cfg/ports/1
    mkdir -p /run/nvmet && truncate -s "$NVMET_SIZE" /run/nvmet/ns1.img || broken "nvmet backing file"
    mkdir "$sub" && echo 1 > "$sub/attr_allow_any_host" || broken "nvmet subsystem"
    mkdir "$sub/namespaces/1" && echo /run/nvmet/ns1.img > "$sub/namespaces/1/device_path" &&
        echo 1 > "$sub/namespaces/1/buffered_io" && echo 1 > "$sub/namespaces/1/enable" || broken "nvmet namespace"
    mkdir "$port" && echo tcp > "$port/addr_trtype" && echo ipv4 > "$port/addr_adrfam" &&
        echo 0.0.0.0 > "$port/addr_traddr" && echo "$VM_NVMET_PORT" > "$port/addr_trsvcid" || broken "nvmet port"
    ln -s "$sub" "$port/subsystems/" || broken "nvmet port link"
    note "nvmet-tcp: $VM_NVMET_NQN on port $VM_NVMET_PORT"
fi

export VM_OUT=$OUT NVPOLL_VM_GUEST=1
source "$RUN/env"
note "setup done; kernel $VM_KERNEL_VERSION, $VM_HUGEPAGES hugepages; running the command"
cut -d' ' -f1 /proc/uptime > "$CTL/t-start"
cd "$CWD" 2>/dev/null || cd /
bash "$RUN/cmd" >> "$CTL/stdout" 2>> "$CTL/stderr"
rc=$?
cut -d' ' -f1 /proc/uptime > "$CTL/t-end"
halt $rc
GUEST
}

# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------
ensure_packages
ensure_kernel
ensure_initramfs
exec 9>&-   # setup done: release the lock (QEMU must not inherit it)
say "kernel $KREL ready"

mkdir -p "$VM_DIR/runs"
find "$VM_DIR/runs" -mindepth 1 -maxdepth 1 -mmin +1440 -exec rm -rf {} + 2>/dev/null || true
RUN=$(mktemp -d "$VM_DIR/runs/run.XXXXXX")
QPID=''
# shellcheck disable=SC2317  # invoked by the EXIT trap
cleanup() {
    [ -z "$QPID" ] || kill "$QPID" 2>/dev/null || true
    if [ "$KEEP" = 1 ]; then echo "$PROG: kept $RUN" >&2; else rm -rf "$RUN"; fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

mkdir -p "$RUN/ctl"
: > "$RUN/ctl/stdout"; : > "$RUN/ctl/stderr"
if [ -n "$USER_OUT" ]; then
    mkdir -p "$USER_OUT"; OUT=$(cd "$USER_OUT" && pwd -P)
else
    OUT=$RUN/out; mkdir -p "$OUT"
fi
case "$OUT" in *[[:space:],]*) die "NVPOLL_VM_OUT must not contain spaces or commas: '$OUT'" ;; esac
truncate -s "$NVME_SIZE" "$RUN/nvme-vfio.img" "$RUN/nvme-kernel.img"
write_guest_init "$RUN/guest-init.sh"
printf 'KROOT=%q\nNVMET=%q\nNVMET_SIZE=%q\nHUGEPAGES=%q\nHOSTFWD=%q\nTLSHD=%q\nOUT=%q\nCWD=%q\n' \
    "$KDIR/root" "$NVMET" "$NVMET_SIZE" "$HUGEPAGES" "$HOSTFWD" "$TLSHD" "$OUT" "$PWD" > "$RUN/params"
{
    for v in PATH HOME RUST_LOG RUST_BACKTRACE CARGO_TARGET_DIR $(compgen -e | grep '^NVPOLL_' || true); do
        [ -n "${!v+set}" ] && printf 'export %s=%q\n' "$v" "${!v}"
    done
    true
} > "$RUN/env"
printf '%q ' "$@" > "$RUN/cmd"; echo >> "$RUN/cmd"

if [ "$ACCEL" = kvm ]; then
    MACHINE=(-machine "q35,accel=kvm,kernel-irqchip=split" -cpu host)
else
    MACHINE=(-machine q35 -accel "tcg,thread=multi" -cpu max)
fi
NET=(-nic none)
if [ -n "$HOSTFWD" ]; then
    # user-mode NIC: restrict=on keeps the guest off every outside network;
    # only the forwarded loopback port reaches it
    NET=(-netdev "user,id=net0,restrict=on,hostfwd=tcp:127.0.0.1:$HOSTFWD-:4420"
         -device "virtio-net-pci,netdev=net0,romfile=")
fi
QEMU=(qemu-system-x86_64 -nodefaults -no-user-config "${MACHINE[@]}" -smp "$SMP" -m "$MEM"
    # the vIOMMU must come before the devices it translates for
    -device "intel-iommu,intremap=on,aw-bits=48"
    -blockdev "driver=file,filename=$RUN/nvme-vfio.img,node-name=nvme-vfio,cache.no-flush=on"
    -device "nvme,serial=NVPOLLVFIO,drive=nvme-vfio,bus=pcie.0,addr=0x4"
    -blockdev "driver=file,filename=$RUN/nvme-kernel.img,node-name=nvme-kernel,cache.no-flush=on"
    -device "nvme,serial=NVPOLLKERN,drive=nvme-kernel,bus=pcie.0,addr=0x5"
    -fsdev "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap"
    -device "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot"
    -fsdev "local,id=ctl,path=$RUN/ctl,security_model=none"
    -device "virtio-9p-pci,fsdev=ctl,mount_tag=ctl"
    -fsdev "local,id=out,path=$OUT,security_model=none"
    -device "virtio-9p-pci,fsdev=out,mount_tag=out"
    "${NET[@]}"
    -kernel "$KDIR/vmlinux" -initrd "$INITRD"
    -append "console=ttyS0 loglevel=4 panic=-1 intel_iommu=on iommu=pt nvpoll.run=$RUN nvpoll.out=$OUT"
    -serial "file:$RUN/console.log" -display none -monitor none -no-reboot)

say "booting: ${QEMU[*]}"
timeout -k 10 "$TIMEOUT" "${QEMU[@]}" </dev/null >"$RUN/qemu.log" 2>&1 &
QPID=$!
# Stream the command's output. --pid makes tail read the file one last time
# after QEMU is gone, so nothing at the end is lost.
tail --pid="$QPID" -n +1 -F "$RUN/ctl/stdout" 2>/dev/null &
T1=$!
tail --pid="$QPID" -n +1 -F "$RUN/ctl/stderr" >&2 2>/dev/null &
T2=$!
# A guest whose kernel reports RCU stalls and whose command has printed nothing for STALL_KILL seconds is
# stuck for good (seen under TCG: a vCPU that never comes back while a controller leaves vfio-pci); it is
# killed then rather than at the timeout.
stall_watch() {
    local last='' quiet=0 now
    while kill -0 "$QPID" 2>/dev/null; do
        sleep 5
        now=$(cat "$RUN/ctl/stdout" "$RUN/ctl/stderr" 2>/dev/null | wc -c)
        if [ "$now" = "$last" ]; then quiet=$((quiet + 5)); else quiet=0; last=$now; fi
        if [ "$quiet" -ge "$STALL_KILL" ] && grep -q 'rcu: INFO: rcu_[a-z]* detected stalls' "$RUN/console.log" 2>/dev/null; then
            echo "$PROG: the guest kernel reports RCU stalls and its command printed nothing for ${quiet}s: killing it" >&2
            echo stalled > "$RUN/stalled"
            kill "$QPID" 2>/dev/null || true
            return
        fi
    done
}
W=
if [ "$STALL_KILL" -gt 0 ]; then stall_watch & W=$!; fi
qrc=0
wait "$QPID" || qrc=$?
QPID=
wait "$T1" "$T2" 2>/dev/null || true
[ -z "$W" ] || { kill "$W" 2>/dev/null; wait "$W" 2>/dev/null || true; }

if [ -s "$RUN/ctl/exitcode" ]; then
    rc=$(cat "$RUN/ctl/exitcode")
else
    rc=125
    {
        echo "$PROG: the guest reported no exit status (qemu exit status $qrc$([ "$qrc" = 124 ] && echo ", killed after ${TIMEOUT}s")$([ -f "$RUN/stalled" ] && echo ", killed as stalled"))"
        echo "---- qemu ----"; tail -n 20 "$RUN/qemu.log"
        echo "---- guest console (last 40 lines) ----"; tail -n 40 "$RUN/console.log"
    } >&2
fi
if [ "$VERBOSE" = 1 ]; then
    sed -n 's/^\[guest /  [guest /p' "$RUN/console.log" >&2 || true
    [ ! -s "$RUN/ctl/t-start" ] ||
        say "guest kernel $(cat "$RUN/ctl/kernel-version" 2>/dev/null); command ran from guest uptime $(cat "$RUN/ctl/t-start")s to $(cat "$RUN/ctl/t-end" 2>/dev/null || echo '?')s"
    say "exit status $rc"
fi
exit "$rc"

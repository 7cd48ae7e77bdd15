#!/usr/bin/env bash
# nvpoll-setup and the PCIe tools in the guest (run by scripts/vm-test.sh):
#  - status lists both emulated controllers with driver, IOMMU group and state;
#  - bind refuses the kernel-driven twin while its namespace is mounted, then binds it once unmounted;
#  - identify and hello_world drive the twin through VFIO (trtype:pcie);
#  - unbind gives it back to nvme, and the filesystem written before is intact;
#  - hugepages reserves pages and reports what it got.
set -euo pipefail
bin=${NVPOLL_BIN_DIR:-target/debug}
setup=${NVPOLL_SETUP:-$bin/nvpoll-setup}
twin=0000:00:05.0
dev=${VM_KNVME_DEV:?not in the scripts/vm.sh guest}
mnt=$(mktemp -d)
fail() { echo "pcie-setup: FAIL $*" >&2; exit 1; }
driver() { basename "$(readlink -f "/sys/bus/pci/devices/$1/driver")"; }
trap 'umount "$mnt" 2>/dev/null || true; [ "$(driver $twin)" = nvme ] || "$setup" unbind $twin >/dev/null 2>&1 || true' EXIT

for tool in mkfs.ext4 mount umount; do
    command -v "$tool" >/dev/null || fail "$tool is missing in the guest (apt-get install e2fsprogs mount on the host)"
done

out=$("$setup" status); echo "$out"
grep -Eq "^  $VM_VFIO_BDF +vfio-pci +$VM_VFIO_GROUP .*ready for nvpoll" <<<"$out" || fail "status: $VM_VFIO_BDF not listed as ready"
grep -Eq "^  $twin +nvme +[0-9]+ .*QEMU NVMe Ctrl: ${dev#/dev/} .*free" <<<"$out" || fail "status: the twin is not listed as free on nvme"
grep -q "^IOMMU: on" <<<"$out" || fail "status: IOMMU not on"

# A filesystem on the twin, mounted: bind must refuse.
mkfs.ext4 -q -F "$dev"
mount "$dev" "$mnt"
echo "written before the bind" > "$mnt/marker"
sync
out=$("$setup" status)
grep -Eq "^  $twin .*in use: ${dev#/dev/} is mounted on $mnt" <<<"$out" || { echo "$out"; fail "status does not show the mount"; }
if out=$("$setup" bind $twin 2>&1); then fail "bind took a mounted device: $out"; fi
echo "$out"
grep -q "refusing.*mounted on $mnt" <<<"$out" || fail "bind refused without saying why"
[ "$(driver $twin)" = nvme ] || fail "the twin left nvme although bind refused"
# 'all' skips it too (the other controller is already on vfio-pci).
out=$("$setup" bind all 2>&1); echo "$out"
grep -q "Skipping $twin: in use" <<<"$out" || fail "bind all did not skip the mounted twin"
umount "$mnt"

"$setup" bind $twin
[ "$(driver $twin)" = vfio-pci ] || fail "the twin is not on vfio-pci after bind"
group=$(basename "$(readlink -f /sys/bus/pci/devices/$twin/iommu_group)")
[ -c "/dev/vfio/$group" ] || fail "/dev/vfio/$group is missing"
out=$("$setup" status)
grep -Eq "^  $twin +vfio-pci +$group .*ready for nvpoll" <<<"$out" || { echo "$out"; fail "status after bind"; }

# Our driver on the twin: its serial is the kernel one's.
out=$("$bin/nvpoll-identify" --trid "trtype:pcie traddr:$twin"); echo "$out"
grep -q "^sn *: NVPOLLKERN" <<<"$out" || fail "identify over PCIe: wrong serial"
grep -q "^mn *: QEMU NVMe Ctrl" <<<"$out" || fail "identify over PCIe: wrong model"
grep -q "^namespace 1: .* blocks of 512 bytes" <<<"$out" || fail "identify over PCIe: namespace"
# Far from the filesystem's blocks (the namespace is 1 GiB; ext4 uses the start and its groups sparsely).
"$bin/nvpoll-hello-world" --trid "trtype:pcie traddr:$twin" --lba 2097000
"$bin/nvpoll-hello-world" --trid "trtype:pcie traddr:$VM_VFIO_BDF" --lba 100

"$setup" unbind $twin
[ "$(driver $twin)" = nvme ] || fail "the twin is not back on nvme"
for _ in $(seq 100); do [ -b "$dev" ] && break; sleep 0.1; done
mount "$dev" "$mnt"
grep -q "written before the bind" "$mnt/marker" || fail "the filesystem did not survive the round trip"
umount "$mnt"

want=$((VM_HUGEPAGES + 8))
out=$("$setup" hugepages $want); echo "$out"
grep -q "holds $want pages of 2M" <<<"$out" || fail "hugepages did not report $want pages"
[ "$(cat /proc/sys/vm/nr_hugepages)" = $want ] || fail "nr_hugepages is not $want"
"$setup" hugepages "$VM_HUGEPAGES" >/dev/null
echo "pcie-setup: all checks passed"

#!/usr/bin/env bash
# scripts/vm-tests/00-smoke.sh - checks that the guest is what the VM tests
# expect (run by scripts/vm-test.sh inside the guest of scripts/vm.sh).
set -uo pipefail

fails=0
ok()   { echo "smoke: ok   $*"; }
fail() { echo "smoke: FAIL $*" >&2; fails=$((fails + 1)); }

for v in VM_VFIO_BDF VM_VFIO_GROUP VM_KNVME_DEV; do
    [ -n "${!v:-}" ] || { echo "smoke: FAIL $v is not set: not running in the scripts/vm.sh guest?" >&2; exit 1; }
done

# 1. the VFIO group of the userspace-driver controller
if [ -c "/dev/vfio/$VM_VFIO_GROUP" ]; then
    ok "/dev/vfio/$VM_VFIO_GROUP exists"
else
    fail "/dev/vfio/$VM_VFIO_GROUP (group of $VM_VFIO_BDF) is missing"
fi
group=$(basename "$(readlink -f "/sys/bus/pci/devices/$VM_VFIO_BDF/iommu_group")")
[ "$group" = "$VM_VFIO_GROUP" ] || fail "$VM_VFIO_BDF is in IOMMU group '$group', VM_VFIO_GROUP says $VM_VFIO_GROUP"

# 2. that controller is bound to vfio-pci
drv=$(basename "$(readlink -f "/sys/bus/pci/devices/$VM_VFIO_BDF/driver" 2>/dev/null)" 2>/dev/null)
if [ "$drv" = vfio-pci ]; then
    ok "$VM_VFIO_BDF is bound to vfio-pci"
else
    fail "$VM_VFIO_BDF is bound to '${drv:-nothing}', expected vfio-pci"
fi

# 3. the kernel-driven controller is visible to nvme-cli
if ! list=$(nvme list 2>&1); then
    fail "nvme list failed: $list"
elif grep -q "^$VM_KNVME_DEV " <<< "$list"; then
    ok "nvme list shows $VM_KNVME_DEV"
else
    fail "nvme list does not show $VM_KNVME_DEV:"; echo "$list" >&2
fi

# 4. the kernel NVMe/TCP target answers discovery
if [ -z "${VM_NVMET_NQN:-}" ]; then
    echo "smoke: skip nvme discover (no nvmet-tcp target: NVPOLL_VM_NVMET=0)"
elif ! disc=$(nvme discover -t tcp -a "${VM_NVMET_ADDR:-127.0.0.1}" -s "${VM_NVMET_PORT:-4420}" 2>&1); then
    fail "nvme discover -t tcp -a ${VM_NVMET_ADDR:-127.0.0.1} -s ${VM_NVMET_PORT:-4420} failed: $disc"
elif grep -Eq "^subnqn:[[:space:]]+$VM_NVMET_NQN\$" <<< "$disc"; then
    ok "nvme discover lists $VM_NVMET_NQN"
else
    fail "nvme discover does not list $VM_NVMET_NQN:"; echo "$disc" >&2
fi

[ "$fails" = 0 ] || { echo "smoke: $fails check(s) failed" >&2; exit 1; }
echo "smoke: all checks passed"

#!/usr/bin/env bash
# The kernel nvme driver's 4 KiB random-read IOPS on the twin controller at queue depth 1 and 128 (fio,
# libaio, direct), printed next to what vm_pcie_queue_pairs_on_two_reactors_at_qd1_and_qd128 prints for
# nvpoll's PCIe driver on the vfio-bound one. A sanity check only: the guest runs under TCG emulation, so
# both are bound by QEMU, not by the drivers. Fails only if fio fails.
set -euo pipefail
dev=${VM_KNVME_DEV:?not in the scripts/vm.sh guest}
secs=${NVPOLL_VM_FIO_SECONDS:-5}
command -v fio >/dev/null || { echo "kernel-baseline: fio is missing" >&2; exit 1; }
for qd in 1 128; do
    out=$(fio --name=kbase --filename="$dev" --rw=randread --bs=4k --direct=1 --ioengine=libaio \
        --iodepth=$qd --numjobs=1 --time_based --runtime="$secs" --ramp_time=1 --size=256M \
        --group_reporting --output-format=terse --terse-version=3)
    # terse v3: field 8 is read IOPS.
    iops=$(cut -d';' -f8 <<<"$out")
    echo "kernel nvme qd$qd: fio 4 KiB random reads on $dev: $iops IOPS (guest, TCG: sanity check only)"
done

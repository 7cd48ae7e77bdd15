#!/usr/bin/env bash
# perf --verify for a few seconds against the vfio-bound controller (our PCIe driver) and against the kernel's
# nvmet-tcp target (our initiator), and once more over PCIe with hybrid reactors: every row must finish with no I/O error and no verify mismatch.
set -euo pipefail
bin=${NVPOLL_BIN_DIR:-target/debug}
common=(--qd 1 --qd 32 --time 2s --warmup 500ms --runs 1 --workload randrw --verify --send-mode all --quiet)
echo "perf-verify: PCIe $VM_VFIO_BDF"
"$bin/nvpoll-perf" --trid "trtype:pcie traddr:$VM_VFIO_BDF" "${common[@]}"
echo "perf-verify: PCIe $VM_VFIO_BDF, hybrid idle reactors on MSI-X completion interrupts"
"$bin/nvpoll-perf" --trid "trtype:pcie traddr:$VM_VFIO_BDF" --idle hybrid:100us --qd 1 --qd 32 --time 2s --warmup 500ms \
    --runs 1 --workload randrw --verify --send-mode deferred --quiet
echo "perf-verify: NVMe/TCP $VM_NVMET_NQN (kernel target)"
"$bin/nvpoll-perf" --trid "trtype:tcp traddr:$VM_NVMET_ADDR trsvcid:$VM_NVMET_PORT subnqn:$VM_NVMET_NQN" "${common[@]}"
echo "perf-verify: OK"

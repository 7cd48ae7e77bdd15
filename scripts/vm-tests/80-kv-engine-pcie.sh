#!/usr/bin/env bash
# The example engine (kv/: write-ahead log with group commit, key-value store, through the async interface)
# over PCIe in the guest: scripts/kv-crash-test.sh against the vfio-bound controller, killed with SIGKILL
# mid-write twice, then a load to its end; every acknowledged key must come back whole after each kill.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)
echo "kv-engine: PCIe $VM_VFIO_BDF"
KV_TRID="trtype:pcie traddr:$VM_VFIO_BDF" KV_ROUNDS=2 KV_MIN_ACKED=100 \
    NVPOLL_BIN_DIR=${NVPOLL_BIN_DIR:-$ROOT/target/debug} "$ROOT/scripts/kv-crash-test.sh"
echo "kv-engine: OK"

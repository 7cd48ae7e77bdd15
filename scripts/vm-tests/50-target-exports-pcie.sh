#!/usr/bin/env bash
# Our NVMe/TCP target exports the vfio-bound controller's namespace (driven by our PCIe driver), and the
# kernel's NVMe/TCP initiator reads back, over TCP, what our PCIe path wrote; then writes through TCP land on
# the SSD, as our PCIe path reads them.
set -euo pipefail
bin=${NVPOLL_BIN_DIR:-target/debug}
nqn=nqn.2024-01.io.nvpoll:pcie-export
port=4431
fail() { echo "export-pcie: FAIL: $*"; exit 1; }

pcie_io() {   # write|check FILE OFFSET: our PCIe path writes FILE at OFFSET, or checks it is there
    local exe
    exe=$(ls -t target/*/deps/vm_pcie-* 2>/dev/null | grep -Ev '\.d$' | head -1)
    [ -x "$exe" ] || fail "the vm_pcie test binary is not built (run through scripts/vm-test.sh)"
    NVPOLL_VM=1 NVPOLL_PCIE_OP=$1 NVPOLL_PCIE_FILE=$2 NVPOLL_PCIE_OFFSET=$3 \
        "$exe" vm_pcie_file_io_from_env --exact --nocapture --test-threads=1 > /tmp/pcie_io.log 2>&1 ||
        { cat /tmp/pcie_io.log; return 1; }
    grep -q "ok$" /tmp/pcie_io.log || { cat /tmp/pcie_io.log; return 1; }
}

# 1. Our PCIe path writes 64 KiB of random bytes at byte offset 1 MiB.
head -c 65536 /dev/urandom > /tmp/expect.bin
pcie_io write /tmp/expect.bin $((1 << 20)) || fail "our PCIe path could not write"

# 2. Export it over NVMe/TCP and connect the kernel initiator.
"$bin/nvpoll-target" --listen 127.0.0.1:$port --nqn $nqn --pcie "$VM_VFIO_BDF" --cores 1 > /tmp/export.log 2>&1 &
tpid=$!
trap 'kill $tpid 2>/dev/null || true; nvme disconnect -n $nqn >/dev/null 2>&1 || true' EXIT
for _ in $(seq 100); do nvme discover -t tcp -a 127.0.0.1 -s $port >/dev/null 2>&1 && break; sleep 0.1; done
nvme connect -t tcp -a 127.0.0.1 -s $port -n $nqn >/dev/null || fail "nvme connect"
dev=
for _ in $(seq 300); do
    # With native multipath the namespace's block device hangs under the subsystem (nvmeXnY), the
    # controller only has the path node (nvmeXcYnZ).
    for d in /sys/class/nvme-subsystem/* /sys/class/nvme/*; do
        [ "$(cat "$d/subsysnqn" 2>/dev/null)" = "$nqn" ] || continue
        for c in "$d"/nvme*; do
            name=${c##*/}
            [[ "$name" =~ ^nvme[0-9]+n1$ ]] && [ -b "/dev/$name" ] && dev=/dev/$name
        done
    done
    [ -n "$dev" ] && break
    sleep 0.1
done
[ -b "$dev" ] || fail "no block device for $nqn"
bs=$(cat /sys/block/$(basename "$dev")/queue/logical_block_size)
echo "export-pcie: $VM_VFIO_BDF exported as $dev ($bs-byte blocks)"

# 3. The kernel reads those 64 KiB through TCP: they must be what the PCIe path wrote.
dd if="$dev" of=/tmp/got.bin bs=65536 skip=16 count=1 iflag=direct status=none
cmp -s /tmp/got.bin /tmp/expect.bin || fail "the kernel read something else than what our PCIe path wrote"
echo "export-pcie: ok: the kernel initiator reads what our PCIe path wrote"

# 4. The kernel writes 1 MiB through TCP; after disconnecting, our PCIe path reads it from the SSD.
head -c 1048576 /dev/urandom > /tmp/kw.bin
dd if=/tmp/kw.bin of="$dev" bs=1M seek=16 oflag=direct conv=fsync status=none
nvme disconnect -n $nqn >/dev/null
kill -INT $tpid; wait $tpid || true
trap - EXIT
pcie_io check /tmp/kw.bin $((16 << 20)) || fail "our PCIe path does not read what the kernel wrote through TCP"
echo "export-pcie: ok: our PCIe path reads what the kernel wrote through TCP"

#!/usr/bin/env bash
# The fio ioengine (fio-engine/, libnvpoll_fio.so) in the guest (run by scripts/vm-test.sh):
#  1. over PCIe: fio's crc32c verify through VFIO against QEMU's NVMe (filename trtype=PCIe traddr=0000.00.04.0,
#     dots as in SPDK's plugin), and the seed's qd128 x 8 shape briefly;
#  2. against the kernel's nvmet-tcp: both seed shapes (qd1 x 128, qd128 x 8 jobs of 4 KiB random writes on
#     ONE controller) and a verify job; with TLS in drivers/tcp/tests/vm_tls_kernel.rs when tlshd runs;
#  3. a fault run: our target exports the same PCIe namespace, is killed (SIGKILL) mid-job and started again;
#     fio's verify must still pass: nothing was reported written that was not.
# fio exits non-zero on any I/O error or verify mismatch; each job's report must say err= 0.
set -euo pipefail
bin=${NVPOLL_BIN_DIR:-target/debug}
so=$(cd "$bin" && pwd -P)/libnvpoll_fio.so
fail() { echo "fio-engine: FAIL: $*" >&2; exit 1; }
[ -f "$so" ] || fail "$so is not built (scripts/vm-test.sh builds it; it needs fio's source: scripts/fio-source.sh)"
pcie=${VM_VFIO_BDF:?not in the scripts/vm.sh guest}

run() {   # NAME FIO-ARGS...: fio through the engine; the job must end with err= 0
    local name=$1; shift
    echo "fio-engine: $name"
    if ! timeout -k 10 400 fio --thread=1 --ioengine="external:$so" --name="$name" "$@" > "/tmp/fio-$name.log" 2>&1; then
        cat "/tmp/fio-$name.log"; fail "$name: fio failed"
    fi
    grep -q "err= 0" "/tmp/fio-$name.log" || { cat "/tmp/fio-$name.log"; fail "$name: an error in the report"; }
    grep -E "^ +(read|write): IOPS" "/tmp/fio-$name.log" | sed "s/^/fio-engine:   /"
}

# 1. PCIe through VFIO.
pf="trtype=PCIe traddr=${pcie//:/.} ns=1"
run pcie-verify --filename="$pf" --rw=randwrite --bs=4k --iodepth=16 --size=8M --verify=crc32c
run pcie-qd128x8 --filename="$pf" --rw=randwrite --bs=4k --iodepth=128 --numjobs=8 --time_based --runtime=2 \
    --group_reporting

# 2. The kernel's nvmet-tcp (one controller for every job of a run).
nf="trtype=tcp adrfam=IPv4 traddr=$VM_NVMET_ADDR trsvcid=$VM_NVMET_PORT subnqn=${VM_NVMET_NQN//:/\\:} ns=1"
host=(--hostnqn="$VM_HOSTNQN")
run nvmet-verify --filename="$nf" "${host[@]}" --rw=randwrite --bs=4k --iodepth=16 --size=8M --verify=crc32c
run nvmet-qd1x128 --filename="$nf" "${host[@]}" --rw=randwrite --bs=4k --iodepth=1 --numjobs=128 \
    --time_based --runtime=2 --group_reporting
run nvmet-qd128x8 --filename="$nf" "${host[@]}" --rw=randwrite --bs=4k --iodepth=128 --numjobs=8 \
    --time_based --runtime=2 --group_reporting

# 3. Our target on the PCIe namespace, killed mid-job and started again.
nqn=nqn.2024-01.io.nvpoll:fio-fault
port=4432
start_target() {
    "$bin/nvpoll-target" --listen 127.0.0.1:$port --nqn $nqn --pcie "$pcie" --cores 1 >> /tmp/fio-fault-target.log 2>&1 &
    tpid=$!
    for _ in $(seq 300); do
        grep -q "listening on 127.0.0.1:$port" /tmp/fio-fault-target.log 2>/dev/null && return 0
        kill -0 $tpid 2>/dev/null || { cat /tmp/fio-fault-target.log; fail "the target did not start"; }
        sleep 0.1
    done
    fail "the target did not listen"
}
: > /tmp/fio-fault-target.log
start_target
trap 'kill -9 $tpid 2>/dev/null || true' EXIT
ff="trtype=tcp traddr=127.0.0.1 trsvcid=$port subnqn=${nqn//:/\\:} ns=1"
echo "fio-engine: fault: verify job against our target (PCIe namespace), killed with SIGKILL mid-job"
timeout -k 10 400 fio --thread=1 --ioengine="external:$so" --name=fault --filename="$ff" --rw=randwrite --bs=4k \
    --iodepth=8 --size=16M --rate_iops=500 --verify=crc32c --output-format=json > /tmp/fio-fault.json \
    2> /tmp/fio-fault.err &
fpid=$!
# Wait until the job's I/O queue is connected (the target logs it), let it write for a second (at 500
# writes a second the job lasts 8 s or more), and check it still runs: the kill must land mid-job.
for _ in $(seq 600); do
    kill -0 $fpid 2>/dev/null || { cat /tmp/fio-fault.err; fail "fio ended before the fault"; }
    grep -q "I/O queue" /tmp/fio-fault-target.log 2>/dev/null && break
    sleep 0.1
done
sleep 1
kill -0 $fpid 2>/dev/null || fail "fio ended before the fault: it must be killed mid-job"
kill -9 $tpid; wait $tpid 2>/dev/null || true
echo "fio-engine: fault: target killed; starting it again"
start_target
rc=0; wait $fpid || rc=$?
[ "$rc" = 0 ] || { cat /tmp/fio-fault.err /tmp/fio-fault.json; fail "fault: fio failed (status $rc)"; }
python3 - /tmp/fio-fault.json <<'PY' || fail "fault: the report is wrong"
import json, sys
t = open(sys.argv[1]).read()
j = json.loads(t[t.index('{'):])["jobs"][0]
assert j["error"] == 0, j["error"]
assert j["write"]["io_bytes"] == 16 << 20, j["write"]["io_bytes"]
assert j["read"]["io_bytes"] == 16 << 20, j["read"]["io_bytes"]   # every block verified
print("fio-engine:   fault: 16 MiB written across the kill, all read back and verified")
PY
kill -INT $tpid; wait $tpid 2>/dev/null || true
trap - EXIT
echo "fio-engine: OK"

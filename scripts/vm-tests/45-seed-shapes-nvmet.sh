#!/usr/bin/env bash
# The seed's two shapes, 4 KiB random writes at qd1 x 128 jobs and at qd128 x 8 jobs, from our perf against ONE
# controller of the kernel's nvmet-tcp (it grants 128 I/O queues; our host asks for up to 1024), in every send
# mode: each row must finish with no I/O error (perf exits non-zero otherwise). With TLS the same shapes run in
# drivers/tcp/tests/vm_tls_kernel.rs (vm_tls_seed_shapes_against_nvmet), where the guest has tlshd.
set -euo pipefail
bin=${NVPOLL_BIN_DIR:-target/debug}
trid="trtype:tcp traddr:$VM_NVMET_ADDR trsvcid:$VM_NVMET_PORT subnqn:$VM_NVMET_NQN"
for shape in "1 128" "128 8"; do
    read -r qd jobs <<< "$shape"
    echo "seed-shapes: qd$qd x $jobs randwrite against $VM_NVMET_NQN (one controller)"
    "$bin/nvpoll-perf" --trid "$trid" --qd "$qd" --jobs "$jobs" --workload randwrite --time 1s --warmup 200ms --runs 1 \
        --send-mode all --quiet
done
echo "seed-shapes: OK"

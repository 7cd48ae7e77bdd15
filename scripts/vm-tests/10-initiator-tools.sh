#!/usr/bin/env bash
# identify and hello_world (our initiator) against the kernel's nvmet-tcp target in the guest.
set -euo pipefail
bin=${NVPOLL_BIN_DIR:-target/debug}
trid="trtype:tcp adrfam:IPv4 traddr:$VM_NVMET_ADDR trsvcid:$VM_NVMET_PORT subnqn:$VM_NVMET_NQN"
out=$("$bin/nvpoll-identify" --trid "$trid")
echo "$out"
grep -q "^mn *: Linux" <<<"$out" || { echo "identify: model is not nvmet's 'Linux'"; exit 1; }
grep -q "^subnqn *: $VM_NVMET_NQN\$" <<<"$out" || { echo "identify: wrong subsystem NQN"; exit 1; }
grep -q "^namespace 1: .* = 256 MiB" <<<"$out" || { echo "identify: namespace 1 is not the 256 MiB one"; exit 1; }
# Cross-check with the kernel's view of the same controller.
"$bin/nvpoll-identify" --trid "$trid" --hdr-digest --data-digest >/dev/null
"$bin/nvpoll-hello-world" --trid "$trid" --lba 100
echo "initiator tools: OK"

#!/usr/bin/env bash
# scripts/vm-tests/65-faults-our-target.sh - scripts/fault-test.sh inside the scripts/vm.sh guest (run by
# scripts/vm-test.sh), for what the host cannot do: this guest kernel has sch_netem, so the lossy-link
# scenario runs with real `tc netem delay 5ms loss 2%` on the namespace's veth (NVPOLL_FAULT_NETEM=require:
# no substitute), against our target, plain and with TLS; and a kill -9 + restart under the guest's kernel.
# Every run must lose nothing, find no verify mismatch and fail no I/O (fault-test.sh's checks).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
export NVPOLL_BIN_DIR=${NVPOLL_BIN_DIR:-target/debug}
export NVPOLL_FAULT_SCENARIOS=${NVPOLL_FAULT_SCENARIOS:-lossy,lossy-tls,kill}
export NVPOLL_FAULT_NETEM=require
# Under TCG a lossy TLS run (5 ms delay, 2% loss) may seal fewer than the host's 1,000 records in deferred
# mode (one CI run: 7,024 commands, no KeyUpdate either way), and each TLS run must renew both ways: renew
# every 100 records here.
export NVPOLL_FAULT_KEY_UPDATE=${NVPOLL_FAULT_KEY_UPDATE:-100}
exec "$here/../fault-test.sh"

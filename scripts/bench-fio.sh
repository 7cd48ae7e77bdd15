#!/usr/bin/env bash
# scripts/bench-fio.sh - the seed's fio jobs (fio-engine/jobs/seed-qd1x128.fio and seed-qd128x8.fio, 4 KiB
# random writes) side by side in one run, against the same target, and the ratios:
#
#   engine        fio + our ioengine (libnvpoll_fio.so), each job idling with sched_yield (the default)
#   engine-spin   the same with idle=spin (each job polls without pause, as SPDK's plugin does; with more jobs
#                 than ICORE holds, as qd1x128, the engine yields instead and says so)
#   spdk-plugin   fio + SPDK's fio plugin (SPDK_DIR/build/fio/spdk_nvme, ioengine=spdk; SPDK built with
#                 --with-fio against the same fio source: scripts/fio-source.sh); plain only: SPDK's nvme
#                 plugin has no TLS option
#   perf          our perf, the same shape (qd x jobs) on one reactor
#   fio-null      fio's null engine on the same core: fio's own ceiling for the job (no I/O at all)
#
# against our target and, with SPDK_DIR, SPDK's nvmf_tgt, plain and with TLS. The initiator side runs on ONE
# core (ICORE: fio's cpus_allowed, perf's reactor) and the target on another (TCORE), so IOPS are IOPS per
# initiator core. The kernel's nvme-tcp block device (io_uring and libaio) is only in a guest here (this
# machine's kernel has no nvme-tcp): BENCH_GUEST=1 runs the same jobs there through the kernel, our engine
# and our perf against our target in the guest (TCG: emulation-bound numbers, for the ratios only).
#
# Knobs: RUNTIME=10 (seconds per run; the seed used 30), ROUNDS=3 (each cell is the median of ROUNDS runs, the
# initiators taking turns within a round; the table also prints the spread, min-max), ICORE=0, TCORE=1, PORT=4460, SPDK_DIR (optional),
# BENCH_GUEST=0, SHAPES="qd1x128 qd128x8", SECURITY="plain tls", INITIATORS (a subset of the rows above),
# TARGETS_ONLY ("ours" or "spdk"). Needs root (hugepages for SPDK's plugin,
# which cannot run without them; they are reserved for the run and released after it).
set -euo pipefail
PROG=bench-fio
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
die() { echo "$PROG: error: $*" >&2; exit 2; }
say() { echo "$PROG: $*" >&2; }

RUNTIME=${RUNTIME:-10}
ROUNDS=${ROUNDS:-3}
ICORE=${ICORE:-0}
TCORE=${TCORE:-1}
PORT=${PORT:-4460}
SHAPES=${SHAPES:-qd1x128 qd128x8}
SECURITY=${SECURITY:-plain tls}
KEY="NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:"
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-0000000b3f10
SUBNQN=nqn.2016-06.io.spdk:fio
SUBNQN_TLS=nqn.2016-06.io.spdk:fio-tls
JOBS=$ROOT/fio-engine/jobs

command -v fio >/dev/null 2>&1 || die "fio is not installed (apt-get install fio)"
[[ "$RUNTIME" =~ ^[0-9]+$ ]] && [ "$RUNTIME" -gt 0 ] || die "RUNTIME=$RUNTIME is not a number of seconds"
[[ "$ROUNDS" =~ ^[0-9]+$ ]] && [ "$ROUNDS" -gt 0 ] || die "ROUNDS=$ROUNDS is not a positive number"

# --- in the guest: the kernel's block device against our target -------------------------------------------
if [ "${1:-}" = --in-guest ]; then
    BIN=${NVPOLL_BIN_DIR:?}
    SO=$BIN/libnvpoll_fio.so
    "$BIN/nvpoll-target" --listen 127.0.0.1:$PORT --nqn $SUBNQN --ram 512M --cores "$TCORE" --idle poll \
        > /tmp/bench-target.log 2>&1 &
    tpid=$!
    trap 'nvme disconnect -n $SUBNQN >/dev/null 2>&1 || true; kill $tpid 2>/dev/null || true' EXIT
    for _ in $(seq 200); do grep -q "listening on" /tmp/bench-target.log && break; sleep 0.1; done
    nvme connect -t tcp -a 127.0.0.1 -s $PORT -n $SUBNQN -i 8 >/dev/null || die "nvme connect"
    dev=
    for _ in $(seq 300); do
        for d in /sys/class/nvme-subsystem/*; do
            [ "$(cat "$d/subsysnqn" 2>/dev/null)" = "$SUBNQN" ] || continue
            for c in "$d"/nvme*n1; do [ -b "/dev/${c##*/}" ] && dev=/dev/${c##*/}; done
        done
        [ -n "$dev" ] && break; sleep 0.1
    done
    [ -b "$dev" ] || die "no block device for $SUBNQN"
    f="trtype=tcp traddr=127.0.0.1 trsvcid=$PORT subnqn=${SUBNQN//:/\\:} ns=1"
    printf '%-10s %-12s %10s\n' shape initiator IOPS
    for shape in $SHAPES; do
        for who in engine io_uring libaio; do
            case $who in
                engine) fn=$f; eng=(--ioengine="external:$SO") ;;
                *) fn=$dev; eng=(--ioengine=$who) ;;
            esac
            out=$(FILENAME=$fn RUNTIME=$RUNTIME timeout -k 5 $((RUNTIME + 120)) fio "${eng[@]}" \
                --cpus_allowed="$ICORE" --output-format=json "$JOBS/seed-$shape.fio" 2>/dev/null) || out=
            iops=$(python3 -c 'import json,sys; t=sys.stdin.read(); print(int(json.loads(t[t.index("{"):])["jobs"][0]["write"]["iops"]))' <<< "$out" 2>/dev/null || echo fail)
            printf '%-10s %-12s %10s\n' "$shape" "$who" "$iops"
        done
    done
    exit 0
fi

# --- on this machine ---------------------------------------------------------------------------------------
say "building the engine, perf and target (release)"
(cd "$ROOT" && cargo build -q --release -p nvpoll-fio --lib && cargo build -q --release --bin nvpoll-perf --bin nvpoll-target) ||
    die "the build failed"
meta=$(cd "$ROOT" && cargo metadata --format-version 1 --no-deps)
[[ "$meta" =~ \"target_directory\":\"([^\"]+)\" ]] || die "no target_directory in cargo metadata"
REL=${BASH_REMATCH[1]}/release
BIN=$REL
SO=$REL/libnvpoll_fio.so
[ -f "$SO" ] || die "$SO was not built: the engine needs fio's source (scripts/fio-source.sh)"

if [ "${BENCH_GUEST:-0}" = 1 ]; then
    say "in the guest: the kernel's nvme-tcp (io_uring, libaio) and our engine against our target"
    NVPOLL_BIN_DIR=$BIN "$ROOT/scripts/vm.sh" -- env RUNTIME="$RUNTIME" ICORE=0 TCORE=1 PORT="$PORT" \
        SHAPES="$SHAPES" NVPOLL_BIN_DIR="$BIN" bash "$ROOT/scripts/bench-fio.sh" --in-guest
    exit $?
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/bench-fio.XXXXXX")
chmod 700 "$WORK"
KEYFILE=$WORK/psk.key
( umask 077; printf '%s' "$KEY" > "$KEYFILE" )
TGT_PID=
HUGE_BEFORE=$(cat /proc/sys/vm/nr_hugepages)
MOUNTED_HUGE=0
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    [ -z "$TGT_PID" ] || { kill -TERM "$TGT_PID" 2>/dev/null; sleep 0.5; kill -KILL "$TGT_PID" 2>/dev/null || true; }
    [ "$MOUNTED_HUGE" = 0 ] || umount /dev/hugepages 2>/dev/null || true
    echo "$HUGE_BEFORE" > /proc/sys/vm/nr_hugepages 2>/dev/null || true
    rm -rf "$WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

wait_listen() {   # PORT
    for _ in $(seq 200); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.05; done
    tail -n 20 "$WORK"/*.log >&2; die "nothing listens on 127.0.0.1:$1"
}

start_ours() {
    cat > "$WORK/target.json" <<JSON
{
  "listeners": [ { "address": "127.0.0.1:$PORT", "tls": "off" }, { "address": "127.0.0.1:$((PORT + 1))", "tls": "required" } ],
  "send_mode": "adaptive",
  "subsystems": [
    { "nqn": "$SUBNQN", "allow_any_host": true, "listeners": ["127.0.0.1:$PORT"], "max_io_queues": 256,
      "namespaces": [ { "ram": "256M", "block_size": 512 } ] },
    { "nqn": "$SUBNQN_TLS", "hosts": [ { "nqn": "$HOSTNQN", "psk_file": "$KEYFILE" } ], "max_io_queues": 256,
      "listeners": ["127.0.0.1:$((PORT + 1))"], "namespaces": [ { "ram": "256M", "block_size": 512 } ] }
  ]
}
JSON
    "$BIN/nvpoll-target" --config "$WORK/target.json" --cores "$TCORE" --idle poll --rpc-socket "$WORK/ours.sock" \
        > "$WORK/target.log" 2>&1 &
    TGT_PID=$!
    wait_listen "$PORT"; wait_listen $((PORT + 1))
}

rpc() { /usr/bin/python3 "$SPDK_DIR/scripts/rpc.py" -s "$WORK/spdk.sock" "$@" >> "$WORK/rpc.log" 2>&1 || die "rpc.py $* failed"; }
start_spdk() {
    rm -f "$WORK/spdk.sock"   # the last nvmf_tgt's, which would answer nothing
    # 4 GiB, as tools/benches/scale.rs gives it: with 1 GiB, the two 256 MiB RAM disks and 128 queue pairs of 128
    # requests with 8 KiB in-capsule buffers did not fit, and nvmf_tgt reset the 128th Connect ("Unable to
    # allocate bufs on tqpair"), which failed our perf's qd1 x 128 cell.
    "$SPDK_DIR/build/bin/nvmf_tgt" -m "$((1 << TCORE))" --no-huge -s 4096 -r "$WORK/spdk.sock" > "$WORK/nvmf_tgt.log" 2>&1 &
    TGT_PID=$!
    for _ in $(seq 200); do [ -S "$WORK/spdk.sock" ] && break; sleep 0.05; done
    rpc framework_wait_init
    # -m: I/O queue pairs per controller (max_io_qpairs_per_ctrlr; 127 without it): the qd1 x 128 shape takes
    # 128, and one to spare.
    rpc nvmf_create_transport -t TCP -i 1048576 -c 8192 -m 129
    rpc bdev_malloc_create -b Malloc0 256 512
    rpc bdev_malloc_create -b Malloc1 256 512
    rpc keyring_file_add_key key0 "$KEYFILE"
    rpc nvmf_create_subsystem "$SUBNQN" -a -s SPDK00000000000001
    rpc nvmf_subsystem_add_ns "$SUBNQN" Malloc0
    rpc nvmf_subsystem_add_listener "$SUBNQN" -t tcp -a 127.0.0.1 -s "$PORT"
    rpc nvmf_create_subsystem "$SUBNQN_TLS" -s SPDK00000000000002
    rpc nvmf_subsystem_add_ns "$SUBNQN_TLS" Malloc1
    rpc nvmf_subsystem_add_listener "$SUBNQN_TLS" -t tcp -a 127.0.0.1 -s $((PORT + 1)) --secure-channel
    rpc nvmf_subsystem_add_host "$SUBNQN_TLS" "$HOSTNQN" --psk key0
    wait_listen "$PORT"
}

stop_target() { kill -TERM "$TGT_PID" 2>/dev/null || true; for _ in $(seq 50); do kill -0 "$TGT_PID" 2>/dev/null || break; sleep 0.1; done; kill -KILL "$TGT_PID" 2>/dev/null || true; wait "$TGT_PID" 2>/dev/null || true; TGT_PID=; }

# What the target served: a sampler on the initiator's core asks the target once a second how many writes it
# has completed (ours: stats_get's "writes"; nvmf_tgt: bdev_get_iostat's num_write_ops), and the cell is the
# median of those per-second rates over the run (its first and last second, partly idle, left out). fio's
# own figure for a group of jobs is the sum of every job's I/Os over the longest single job's runtime, which
# is right only when the jobs run at the same time: SPDK's plugin connects its qd1 x 128 jobs one at a time
# under its controller's lock while the connected ones already spin on the same core, so their windows were
# spread over 20 s and more and fio reported 250-310K where nvmf_tgt served 84-97K a second (docs/fio.md).
served_start() {   # target -> starts the sampler ($SAMPLER_PID), which writes $WORK/served.txt
    local sock=$WORK/ours.sock kind=ours
    [ "$1" = spdk ] && { sock=$WORK/spdk.sock; kind=spdk; }
    taskset -c "$ICORE" python3 - "$kind" "$sock" > "$WORK/served.txt" 2>"$WORK/sampler.err" <<'PY' &
import json, socket, sys, time
kind, path = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_UNIX)
s.connect(path)
dec = json.JSONDecoder()
def writes():
    method = "stats_get" if kind == "ours" else "bdev_get_iostat"
    s.sendall(json.dumps({"jsonrpc": "2.0", "id": 1, "method": method}).encode() + b"\n")
    buf = ""
    while True:
        chunk = s.recv(1 << 16)
        if not chunk:
            raise SystemExit("the target closed its control socket")
        buf += chunk.decode()
        try:
            v, _ = dec.raw_decode(buf.lstrip())
        except ValueError:
            continue
        r = v["result"]
        return r["writes"] if kind == "ours" else sum(b["num_write_ops"] for b in r["bdevs"])
prev = writes()
t = time.monotonic()
while True:
    t += 1.0
    time.sleep(max(0.0, t - time.monotonic()))
    now = writes()
    print(now - prev, flush=True)
    prev = now
PY
    SAMPLER_PID=$!
}
served_stop() {   # -> the median writes/s the target served while the run was on, or "fail"
    kill "$SAMPLER_PID" 2>/dev/null || true
    wait "$SAMPLER_PID" 2>/dev/null || true
    SAMPLER_PID=
    python3 -c 'import sys
v = [int(x) for x in open(sys.argv[1]).read().split()]
busy = [x for x in v if x > 0]
busy = busy[1:-1] if len(busy) > 3 else busy
busy.sort()
print(busy[len(busy) // 2] if busy else "fail")' "$WORK/served.txt" 2>/dev/null || echo fail
}

fio_iops() {   # JSON on stdin -> write IOPS (integer) or "fail", saying why from fio's stderr
    local v
    v=$(python3 -c 'import json,sys
t=sys.stdin.read()
j=json.loads(t[t.index("{"):])["jobs"][0]
print("fail" if j["error"] else int(j["write"]["iops"]))' 2>/dev/null) || v=fail
    [ "$v" != fail ] || say "fio failed: $(tail -n 3 "$WORK/fio.err" 2>/dev/null | tr '\n' ' ')" >&2
    echo "$v"
}

run_one() {   # who shape sec -> "fio's IOPS" "writes/s the target served" (see served_start)
    local v srv=-
    if [ "$1" = fio-null ] || { [ "$1" = spdk-plugin ] && [ "$3" != plain ]; }; then
        v=$(fio_one "$@"); [ "$v" = n/a ] && srv=n/a
        echo "$v $srv"; return
    fi
    served_start "$t"
    v=$(fio_one "$@")
    srv=$(served_stop)   # kept when fio failed too: what the target served while the jobs that did run ran
    echo "$v $srv"
}

fio_one() {   # who shape sec -> fio's IOPS
    local who=$1 shape=$2 sec=$3 port=$PORT sub=$SUBNQN qd jobs out
    [ "$sec" = tls ] && { port=$((PORT + 1)); sub=$SUBNQN_TLS; }
    qd=${shape#qd}; jobs=${qd#*x}; qd=${qd%x*}
    local fn="trtype=tcp adrfam=IPv4 traddr=127.0.0.1 trsvcid=$port subnqn=${sub//:/\\:} ns=1"
    local tls=()
    case $who in
        engine|engine-spin)
            [ "$sec" = tls ] && tls=(--psk_path="$KEYFILE")
            local idle=yield; [ "$who" = engine-spin ] && idle=spin
            out=$(FILENAME=$fn RUNTIME=$RUNTIME timeout -k 5 $((RUNTIME + 120)) fio --ioengine="external:$SO" \
                --hostnqn="$HOSTNQN" --idle=$idle "${tls[@]}" --cpus_allowed="$ICORE" --output-format=json \
                "$JOBS/seed-$shape.fio" 2>"$WORK/fio.err") || true
            fio_iops <<< "$out" ;;
        spdk-plugin)
            [ "$sec" = plain ] || { echo "n/a"; return; }
            out=$(FILENAME=$fn RUNTIME=$RUNTIME timeout -k 5 $((RUNTIME + 120)) env LD_PRELOAD="$SPDK_DIR/build/fio/spdk_nvme" \
                fio --ioengine=spdk --hostnqn="$HOSTNQN" --cpus_allowed="$ICORE" --output-format=json \
                "$JOBS/seed-$shape.fio" 2>"$WORK/fio.err") || true
            fio_iops <<< "$out" ;;
        fio-null)
            [ "$t" = ours ] || { echo "-"; return; }
            out=$(FILENAME=null RUNTIME=$RUNTIME timeout -k 5 $((RUNTIME + 60)) fio --ioengine=null --size=1g \
                --cpus_allowed="$ICORE" --output-format=json "$JOBS/seed-$shape.fio" 2>"$WORK/fio.err") || true
            fio_iops <<< "$out" ;;
        perf)
            [ "$sec" = tls ] && tls=(--psk "$KEY" --psk-identity-version 0)
            out=$(timeout -k 5 $((RUNTIME + 60)) "$BIN/nvpoll-perf" --trid "trtype:tcp traddr:127.0.0.1 trsvcid:$port subnqn:$sub" \
                --hostnqn "$HOSTNQN" --workload randwrite --io-size 4k --qd "$qd" --jobs "$jobs" --time "${RUNTIME}s" \
                --warmup 2s --runs 1 --send-mode adaptive --cores "$ICORE" --json --quiet "${tls[@]}" 2>&1) || true
            if [[ "$out" =~ \"iops\":([0-9.]+) ]]; then echo "${BASH_REMATCH[1]%.*}"
            else echo fail; say "perf failed ($t $shape $sec): $(tail -n 3 <<< "$out" | tr '\n' ' ')" >&2; fi ;;
    esac
}

WHO=(engine engine-spin perf fio-null)
TARGETS=(ours)
if [ -n "${SPDK_DIR:-}" ]; then
    [ -f "$SPDK_DIR/build/fio/spdk_nvme" ] || die "SPDK_DIR=$SPDK_DIR has no build/fio/spdk_nvme (configure SPDK --with-fio=<fio source>)"
    WHO+=(spdk-plugin)
    TARGETS+=(spdk)
    # SPDK's plugin needs hugepages (DPDK's EAL): 1 GiB of 2 MiB pages, and hugetlbfs mounted.
    echo 512 > /proc/sys/vm/nr_hugepages
    if ! grep -q " /dev/hugepages hugetlbfs" /proc/mounts; then
        mkdir -p /dev/hugepages && mount -t hugetlbfs nodev /dev/hugepages && MOUNTED_HUGE=1
    fi
else
    say "SPDK_DIR is not set: no SPDK target and no SPDK plugin rows (point it at an SPDK v26.05 build with --with-fio)"
fi

[ -z "${INITIATORS:-}" ] || read -r -a WHO <<< "$INITIATORS"
[ -z "${TARGETS_ONLY:-}" ] || read -r -a TARGETS <<< "$TARGETS_ONLY"
median() {   # values... -> the median of the numeric ones, "+Nfail" when N runs failed; "fail" when all did
    local nums=() v fails=0
    for v in "$@"; do
        if [[ "$v" =~ ^[0-9]+$ ]]; then nums+=("$v"); elif [ "$v" = fail ]; then fails=$((fails + 1)); fi
    done
    if [ "${#nums[@]}" = 0 ]; then [ "$fails" -gt 0 ] && echo fail || echo "$1"; return; fi
    printf '%s\n' "${nums[@]}" | sort -n | awk -v f="$fails" '{ v[NR] = $1 } END {
        m = (NR % 2) ? v[(NR + 1) / 2] : int((v[NR / 2] + v[NR / 2 + 1]) / 2); printf "%d%s\n", m, f ? "+" f "fail" : "" }'
}
spread() {   # values... -> min-max of the numeric ones
    printf '%s\n' "$@" | grep -E '^[0-9]+$' | sort -n | awk 'NR == 1 { lo = $1 } { hi = $1 } END { if (NR > 1) printf "%d-%d\n", lo, hi; else print "-" }'
}

say "$ROUNDS round(s) of ${RUNTIME} s per cell; the initiators take turns within each round"
say "served/s: the median writes a second the target completed during the run, as it counts them (the compared figure);"
say "fio IOPS: what fio reported, which over-counts when the jobs do not run at the same time (see served_start)"
printf '%-6s %-9s %-6s %-12s %10s %10s %9s %9s %s\n' target shape sec initiator served/s "fio IOPS" "vs perf" "vs spdk" "spread (min-max)"
for t in "${TARGETS[@]}"; do
    for shape in $SHAPES; do
        for sec in $SECURITY; do
            declare -A ALL=() SRV=() R=() RS=()
            [ "$t" = ours ] && start_ours || start_spdk
            for round in $(seq "$ROUNDS"); do
                for who in "${WHO[@]}"; do
                    read -r v srv <<< "$(t=$t run_one "$who" "$shape" "$sec")"
                    ALL[$who]="${ALL[$who]:-} $v"
                    SRV[$who]="${SRV[$who]:-} $srv"
                    [ "$ROUNDS" = 1 ] || say "$t $shape $sec round $round: $who served $srv/s, fio $v IOPS"
                done
            done
            stop_target
            # shellcheck disable=SC2086 # the values are words
            for who in "${WHO[@]}"; do R[$who]=$(median ${ALL[$who]}); RS[$who]=$(median ${SRV[$who]}); done
            for who in "${WHO[@]}"; do
                ratio() { local a=${RS[$who]%%+*} b=${RS[$1]:-}; b=${b%%+*}
                    [[ "$a" =~ ^[0-9]+$ && "$b" =~ ^[0-9]+$ && "$b" -gt 0 ]] &&
                    awk -v a="$a" -v b="$b" 'BEGIN { printf "%.2f", a / b }' || echo -; }
                # shellcheck disable=SC2086
                printf '%-6s %-9s %-6s %-12s %10s %10s %9s %9s %s\n' "$t" "$shape" "$sec" "$who" "${RS[$who]}" \
                    "${R[$who]}" "$(ratio perf)" "$(ratio spdk-plugin)" "$(spread ${SRV[$who]})"
            done
            unset R RS ALL SRV
        done
    done
done

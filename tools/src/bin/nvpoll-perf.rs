//! `perf`: an I/O load generator in the spirit of fio and spdk_nvme_perf.
//!
//! With no `--trid`, it starts our NVMe/TCP target in-process on 127.0.0.1 with a RAM namespace and runs the
//! seed matrix in miniature: 4 KiB random writes and reads at `qd1 x jobs` and `qd128 x jobs`, in each send
//! mode, without and with TLS 1.3, printed as one table.
//! With `--trid`, it drives the given controllers with the given workload.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use nvpoll::api::Controller;
use nvpoll::mem::DmaPool;
use nvpoll::reactor::{CoreList, IdlePolicy, Reactors};
use nvpoll::send::SendMode;
use nvpoll::trid::TransportId;
use nvpoll_pcie::PcieOptions;
use nvpoll_tcp::host::{ConnectOptions, Recovery};
use nvpoll_tcp::multipath::{MultipathController, PathPolicy};
use nvpoll_tcp::tls::{ConfiguredKey, IdentityVersion};
use nvpoll_tcp::KeyRenewal;
use nvpoll_tools::loadgen::{self, LoadGen, Phase, Row, RunSpec};

use nvpoll_tools::cli as common;

/// I/O load generator for NVMe over TCP and PCIe (VFIO).
///
/// Without --trid it starts the embedded NVMe/TCP target on 127.0.0.1 (RAM namespace) and runs the default
/// matrix: 4 KiB random writes and reads at qd1 x jobs and qd128 x jobs, in each send mode, without and with
/// TLS 1.3.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Transport ID of a controller to drive, e.g. 'trtype:tcp traddr:127.0.0.1 trsvcid:4420 subnqn:NQN'.
    /// May be given several times; jobs are spread over them. Without it, the embedded target is used.
    #[arg(long = "trid")]
    trids: Vec<String>,
    /// When queue pairs send what they posted: inline (from submit), deferred (at the reactor's end-of-poll
    /// flush), adaptive (inline while idle, deferred under load, except writes whose 32 KiB or more wait for an
    /// R2T), or all three side by side. The embedded target answers in the same mode.
    #[arg(long, default_value = "all", value_parser = ["inline", "deferred", "adaptive", "all"])]
    send_mode: String,
    /// Queue depth per job. May be given several times (the embedded default runs 1 and 128).
    #[arg(long = "qd")]
    qds: Vec<u16>,
    /// I/O size (e.g. 512, 4k, 128k, 1m); a multiple of the namespace's block size.
    #[arg(long, default_value = "4k", value_parser = loadgen::parse_size)]
    io_size: u64,
    /// Access pattern; may be given several times. Default: randwrite and randread with the embedded target,
    /// randwrite with --trid. randtrim and trim deallocate --io-size at a time (Dataset Management) and move
    /// no data; the controller must have Dataset Management, and --verify cannot check them.
    #[arg(long = "workload", value_enum)]
    workloads: Vec<loadgen::Workload>,
    /// Percentage of reads for randrw.
    #[arg(long, default_value_t = 70, value_parser = clap::value_parser!(u8).range(0..=100))]
    rwmix: u8,
    /// Measured time per run (e.g. 10s, 500ms).
    #[arg(long, default_value = "500ms", value_parser = loadgen::parse_duration)]
    time: Duration,
    /// Warm-up before each run, not measured.
    #[arg(long, default_value = "250ms", value_parser = loadgen::parse_duration)]
    warmup: Duration,
    /// Number of jobs (queue pairs), spread round-robin over the initiator reactors and over the controllers
    /// (--trid). Default: 2 per reactor. Each job is one I/O queue of its controller: past what a controller
    /// granted, perf stops before the run and says so (give the same --trid again to open one more controller
    /// of that subsystem). The embedded target grants as many as the jobs need.
    #[arg(long)]
    jobs: Option<usize>,
    /// Connected I/O queues that send nothing, held for the whole session beside the jobs (spread over the
    /// initiator reactors and the controllers after them): what many quiet queue pairs cost the reactors that
    /// carry them, and the target that serves them. The embedded target then opens as many controllers as the
    /// jobs and these need (1024 I/O queues each).
    #[arg(long, default_value_t = 0)]
    idle_queues: usize,
    /// Poll every queue pair on every iteration of its reactor, idle or not (as before issue 46), instead of
    /// parking the idle ones until their socket has something: for comparisons.
    #[arg(long)]
    no_parking: bool,
    /// NVMe/TCP: I/O queues to ask each controller for (Set Features, Number of Queues); it may grant fewer.
    #[arg(long, default_value_t = nvpoll_tcp::host::DEFAULT_IO_QUEUES,
          value_parser = clap::value_parser!(u16).range(1..))]
    io_queues: u16,
    /// Cores for the initiator reactors: a list (0,1 or 0-3) or a mask (0x3). Default: core 0.
    #[arg(long, default_value = "0")]
    cores: String,
    /// Cores for the embedded target's reactors (ignored with --trid). Default: the last core.
    #[arg(long)]
    target_cores: Option<String>,
    /// What the reactors (the initiator's and the embedded target's) do with nothing to do: poll (spin; the
    /// lowest latency) or hybrid[:QUIET] (poll while there is work, sleep after QUIET, 1 ms by default, with
    /// none). Under load a reactor rarely sleeps; hybrid matters between runs and for slow devices. With
    /// hybrid, PCIe controllers get MSI-X completion interrupts, so a reactor may sleep while commands are
    /// outstanding.
    #[arg(long, default_value = "poll", value_name = "poll|hybrid[:QUIET]")]
    idle: IdlePolicy,
    /// Runs per table row; the median run is reported. With several send modes the runs alternate between
    /// them (inline, deferred, adaptive, inline, ...), so that a drift of the machine weighs on each alike.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Print the results as JSON on stdout (progress and tables go to stderr).
    #[arg(long)]
    json: bool,
    /// Stamp written blocks (LBA, generation, CRC) and check them on every read; count mismatches.
    #[arg(long)]
    verify: bool,
    /// No progress line every second.
    #[arg(long)]
    quiet: bool,
    /// Host NQN (default: /etc/nvme/hostnqn, or one derived from the machine's UUID).
    #[arg(long)]
    hostnqn: Option<String>,
    /// TLS 1.3 PSK in the NVMe interchange format (NVMeTLSkey-1:01:...:): every queue does the TLS handshake
    /// before ICReq, with the identity derived from this key, the host NQN and the subsystem NQN.
    #[arg(long)]
    psk: Option<String>,
    /// The TLS PSK identity version to derive: 0 (NVMe0R0x) or 1 (NVMe1R0x, with the digest).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=1))]
    psk_identity_version: u8,
    /// DH-HMAC-CHAP host secret (DHHC-1:hh:...:, as nvme-cli's gen-dhchap-key writes it), or a file holding
    /// it: every queue authenticates in band when the controller asks. With the embedded target, the target
    /// requires it of this host.
    #[arg(long, short = 'S')]
    dhchap_secret: Option<String>,
    /// With --dhchap-secret: the controller's secret (or a file holding it), to authenticate the controller
    /// too (bidirectional).
    #[arg(long, short = 'C', requires = "dhchap_secret")]
    dhchap_ctrl_secret: Option<String>,
    /// With --dhchap-secret: the hashes to offer, comma-separated, preferred first (default
    /// sha512,sha384,sha256).
    #[arg(long, requires = "dhchap_secret")]
    dhchap_hashes: Option<String>,
    /// With --dhchap-secret: the DH groups to offer, comma-separated, preferred first (default
    /// ffdhe8192,...,ffdhe2048,null).
    #[arg(long, requires = "dhchap_secret")]
    dhchap_dhgroups: Option<String>,
    /// With --dhchap-secret: secure channel concatenation (as nvme-cli's --concat): the admin queue
    /// authenticates without TLS and generates a TLS PSK, and every queue then runs TLS 1.3 with it. With the
    /// embedded target, the target requires it of this host.
    #[arg(long, requires = "dhchap_secret")]
    concat: bool,
    /// With the embedded target: run the table without TLS, with TLS, or both (default both). With --trid,
    /// TLS is on exactly when --psk is given.
    #[arg(long, default_value = "both", value_parser = ["off", "on", "both"])]
    tls: String,
    /// With TLS: renew each queue's keys after this many records under one key (a KeyUpdate that asks the
    /// target to renew too; 1 to 8388608, default 8388608 = 2^23, or an hour, whichever comes first). The
    /// embedded target renews at the same count. A target that ends the connection at our KeyUpdate is said
    /// once, and its queues renew by reconnecting instead. With renewals, the table gains a column of the
    /// KeyUpdates sent/received.
    #[arg(long, value_name = "RECORDS", value_parser = common::parse_key_update)]
    tls_key_update: Option<u64>,
    /// NVMe/TCP: ask for header digests (CRC32C of every PDU header) in ICReq.
    #[arg(long)]
    header_digest: bool,
    /// NVMe/TCP: ask for data digests (CRC32C of every PDU's data) in ICReq.
    #[arg(long)]
    data_digest: bool,
    /// After a lost connection, wait this long between reconnect attempts (nvme-cli's --reconnect-delay).
    #[arg(long, default_value = "2s", value_parser = loadgen::parse_duration)]
    reconnect_delay: Duration,
    /// Keep Alive Timeout asked for at connect (a Keep Alive goes out every half of it; one unanswered for a
    /// whole KATO means the target stopped answering). 0 turns keep-alive off.
    #[arg(long, default_value = "10s", value_parser = loadgen::parse_duration)]
    kato: Duration,
    /// NVMe/TCP: time allowed for each step of connecting a queue (TCP connect, TLS handshake, ICResp, each
    /// bring-up command); raise it for a slow path or a host running under a profiler.
    #[arg(long, default_value = "5s", value_parser = loadgen::parse_duration)]
    connect_timeout: Duration,
    /// Give a lost controller up after this long (nvme-cli's --ctrl-loss-tmo); then its I/O fails.
    #[arg(long, default_value = "60s", value_parser = loadgen::parse_duration)]
    ctrl_loss_tmo: Duration,
    /// Abort a command outstanding this long; fail it if it is still outstanding half as long again. Over
    /// PCIe: a queue pair whose commands make no progress this long has the controller reset.
    #[arg(long, default_value = "30s", value_parser = loadgen::parse_duration)]
    io_timeout: Duration,
    /// What a lost connection does to its outstanding commands: retry them after the reconnect, or fail them
    /// (over PCIe: what a controller reset does to them).
    #[arg(long, default_value = "retry", value_parser = ["retry", "fail-fast"])]
    recovery: String,
    /// After each run, wait this long for outstanding commands; what is left is reported as lost.
    #[arg(long, default_value = "30s", value_parser = loadgen::parse_duration)]
    drain_timeout: Duration,
    /// Print the fault accounting of every run (submitted, OK, failed, refused, retried, lost, longest stall)
    /// and exit 0 as long as nothing was lost or corrupted, even if I/O failed (for fault injection).
    #[arg(long)]
    faults: bool,
    /// NVMe/TCP: the --trid transport IDs that name one subsystem NQN are paths to one multipath controller
    /// (in the order given), and every job's queue pair spans all its paths. A request goes to an optimized
    /// path before a non-optimized one (by ANA state); a path status sends it at once to another path; a
    /// lost connection holds its requests for the path's KATO plus its Command Quiesce Time, then sends them
    /// on a live path. Paths fail fast (--recovery does not apply to them); retried counts the resends.
    #[arg(long)]
    multipath: bool,
    /// With --multipath: among paths of the same ANA state, send each request to the one with the fewest
    /// commands outstanding (queue-depth: follows each path's speed) or to the next one in turn
    /// (round-robin: a slow path collects the commands).
    #[arg(long, default_value = "queue-depth", value_parser = ["queue-depth", "round-robin"])]
    path_policy: String,
    /// NVMe/TCP: the TCP congestion control of our connections (e.g. cubic; 'system' keeps the system's), and
    /// of the embedded target's listener. Default: the system's (net.ipv4.tcp_congestion_control), except
    /// that a loopback connection under BBR gets cubic (said at start): there BBR keeps a window of a few
    /// segments, and a connection's speed depends on the round trip it measured first.
    #[arg(long, value_name = "NAME")]
    tcp_congestion: Option<String>,
    /// NVMe/TCP: keep SQ flow control on the I/O queues. Default: each I/O queue's Connect asks the
    /// controller to disable it, so that a read can complete with its last C2HData (one PDU instead of two)
    /// where the controller agrees; a controller that refuses gets the queue connected again with it on.
    #[arg(long)]
    sq_flow_control: bool,
    /// Size of the embedded target's RAM namespace.
    #[arg(long, default_value = "256m", value_parser = loadgen::parse_size)]
    ram: u64,
    #[command(flatten)]
    verbosity: common::Verbosity,
}

fn main() {
    let args = Args::parse();
    common::run_main("nvpoll-perf", args.verbosity.verbose, || run(args));
}

/// The rows to run: every workload x queue depth x send mode.
struct Matrix<'a> {
    workloads: &'a [loadgen::Workload],
    qds: &'a [u16],
    modes: &'a [SendMode],
    jobs: usize,
    idle_queues: usize,
    io_size: u64,
    rwmix: u8,
    verify: bool,
    warmup: Duration,
    time: Duration,
    runs: usize,
    quiet: bool,
    max_qd: u16,
    drain_timeout: Duration,
    faults: bool,
}

/// What the runs measured, and the failures after them (a controller's shutdown): said after the results.
#[derive(Default)]
struct Outcome {
    rows: Vec<Row>,
    late: Vec<String>,
}

/// Runs the matrix on one set of controllers (their queue pairs kept across runs), appending a row per cell
/// to `out`, then shuts the controllers down (a failed shutdown goes to `out.late`). `suffix` tags the
/// workload label (" tls").
fn run_matrix<C>(
    ctrls: Vec<C>,
    reactors: &Reactors,
    pool: &DmaPool,
    m: &Matrix<'_>,
    suffix: &str,
    target: Option<&embedded_target::Embedded>,
    out: &mut Outcome,
) -> Result<(), String>
where
    C: Controller,
    C::QueuePair: Send + 'static,
{
    check_queue_grants(&ctrls, m.jobs + m.idle_queues)?;
    if let Some(w) = m.workloads.iter().find(|w| w.trims()) {
        if let Some(c) = ctrls
            .iter()
            .find(|c| c.identify().oncs & nvpoll::spec::IdentifyController::ONCS_DSM == 0)
        {
            return Err(format!(
                "--workload {}: {} has no Dataset Management (Identify Controller ONCS bit 2), so it cannot \
                 deallocate",
                w.name(),
                c.identify().subnqn
            ));
        }
    }
    let ctrls = std::cell::RefCell::new(ctrls);
    // With --faults, a controller whose health check failed for good (removed, or lost) is reported once and
    // the run goes on: its queue pairs fail their I/O, which the fault accounting counts.
    let mut given_up = vec![false; ctrls.borrow().len()];
    let mut gen: LoadGen<C::QueuePair> = LoadGen::new(pool.clone(), m.max_qd, m.quiet);
    let idle = if m.idle_queues > 0 {
        // Queue pair jobs + i goes where job jobs + i would: controller (jobs + i) % n, reactor likewise.
        let mut qps = Vec::with_capacity(m.idle_queues);
        {
            let mut ctrls = ctrls.borrow_mut();
            let n = ctrls.len();
            for i in 0..m.idle_queues {
                let c = &mut ctrls[(m.jobs + i) % n];
                qps.push(
                    c.create_queue_pair(32)
                        .map_err(|e| format!("idle queue {i}: {e}"))?,
                );
            }
        }
        let held = loadgen::IdleQueues::hold(reactors, qps, m.jobs % reactors.len())
            .map_err(|e| e.to_string())?;
        if !m.quiet {
            eprintln!(
                "nvpoll-perf: {} idle I/O queues connected and held",
                held.len()
            );
        }
        Some(held)
    } else {
        None
    };
    for &workload in m.workloads {
        for &qd in m.qds {
            // Runs alternate between the send modes (inline, deferred, adaptive, inline, ...) so that a drift of
            // the machine over the session weighs on every mode alike instead of on the last one.
            let label = format!("qd{qd} x {} {}{suffix}", m.jobs, workload.name());
            let mut by_mode: Vec<Vec<loadgen::RunResult>> = vec![Vec::new(); m.modes.len()];
            for i in 0..m.runs {
                for (k, &mode) in m.modes.iter().enumerate() {
                    let spec = RunSpec {
                        send_mode: mode,
                        qd,
                        jobs: m.jobs,
                        io_size: m.io_size,
                        workload,
                        rwmix: m.rwmix,
                        verify: m.verify,
                        warmup: m.warmup,
                        time: m.time,
                        drain_timeout: m.drain_timeout,
                    };
                    if let Some(t) = target {
                        t.set_send_mode(mode);
                    }
                    if !m.quiet {
                        eprintln!("run {}/{}: {label} {mode}", i + 1, m.runs);
                    }
                    let mut connect = |j: usize, depth: u16| {
                        let mut ctrls = ctrls.borrow_mut();
                        let n = ctrls.len();
                        let ctrl = &mut ctrls[j % n];
                        let ns = ctrl.namespaces().first().cloned().ok_or_else(|| {
                            nvpoll::Error::InvalidArgument("the controller has no namespace".into())
                        })?;
                        Ok((ctrl.create_queue_pair(depth)?, ns))
                    };
                    // Keep the admin queues alive (keep-alive, health checks, recovery) while the jobs run.
                    let mut tick = |_: Phase| -> nvpoll::Result<()> {
                        for (i, c) in ctrls.borrow_mut().iter_mut().enumerate() {
                            match c.poll_admin() {
                                Ok(()) => {}
                                Err(e) if m.faults => {
                                    if !std::mem::replace(&mut given_up[i], true) {
                                        eprintln!("nvpoll-perf: controller {i}: {e}");
                                    }
                                }
                                Err(e) => return Err(e),
                            }
                        }
                        Ok(())
                    };
                    let r = gen
                        .run(reactors, spec, &mut connect, &mut tick)
                        .map_err(|e| e.to_string())?;
                    if !m.quiet {
                        eprintln!(
                            "  {:.0} IOPS, mean {:.1} us, p99 {:.1} us",
                            r.iops, r.mean_us, r.p99_us
                        );
                    }
                    if m.faults {
                        println!(
                            "faults: {label} {mode}: submitted {}, ok {}, failed {}, refused {}, retried {}, lost {}, \
                             mismatches {}, longest stall {:.3} s, failover {:.3} s, reconnects {}, \
                             key updates {}/{}",
                            r.submitted,
                            r.completed_ok,
                            r.errors,
                            r.rejected,
                            r.retried,
                            r.lost,
                            r.mismatches,
                            r.max_stall.as_secs_f64(),
                            r.failover.as_secs_f64(),
                            r.reconnects,
                            r.key_updates_sent,
                            r.key_updates_received
                        );
                    }
                    for f in &r.failures {
                        eprintln!("nvpoll-perf: {label} {mode}: {f}");
                    }
                    by_mode[k].push(r);
                }
            }
            for (&mode, runs) in m.modes.iter().zip(by_mode) {
                out.rows.push(Row {
                    workload: label.clone(),
                    mode: mode.name(),
                    result: loadgen::median(runs.clone()),
                    runs,
                });
            }
        }
    }
    gen.release_queue_pairs();
    if let Some(idle) = idle {
        idle.release(reactors).map_err(|e| e.to_string())?;
    }
    for c in ctrls.into_inner() {
        match c.shutdown() {
            Ok(()) => {}
            // Fault injection may leave the controller mid-recovery: report it, the I/O accounting stands.
            Err(e) if m.faults => eprintln!("nvpoll-perf: shutdown after fault injection: {e}"),
            // The runs are measured: their rows are printed, and the failure after them ends perf non-zero.
            Err(e) => out.late.push(format!("shutdown: {e}")),
        }
    }
    Ok(())
}

/// Fails before any run if a controller granted fewer I/O queues than the jobs spread round-robin onto it need.
fn check_queue_grants<C: Controller>(ctrls: &[C], jobs: usize) -> Result<(), String> {
    let n = ctrls.len();
    // Job j goes to controller j % n, so controller i carries the jobs below `jobs` that are i modulo n: at
    // most its grant g while jobs <= g * n + i.
    let most = ctrls
        .iter()
        .enumerate()
        .filter_map(|(i, c)| c.io_queues_granted().map(|g| usize::from(g) * n + i))
        .min();
    let Some(most) = most.filter(|&m| jobs > m) else {
        return Ok(());
    };
    let (i, c) = ctrls
        .iter()
        .enumerate()
        .find(|(i, c)| {
            c.io_queues_granted()
                .is_some_and(|g| usize::from(g) * n + i < jobs)
        })
        .expect("the controller that sets the limit");
    let need = jobs / n + usize::from(i < jobs % n);
    let granted = c.io_queues_granted().unwrap_or(0);
    Err(format!(
        "--jobs {jobs}: controller {} ({}) would carry {need} jobs, one I/O queue each, but it granted {granted} \
         I/O queues; run at most {most} jobs over these {n} controller(s), or give a --trid more than once to \
         open more controllers of a subsystem (jobs are spread round-robin over them)",
        i + 1,
        c.identify().subnqn,
    ))
}

/// The embedded target's PSK when perf makes its own (TLS on, no --psk): fixed, for the demo only.
const DEMO_KEY: &str = "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:";

fn run(args: Args) -> Result<(), String> {
    let cores = CoreList::parse(&args.cores).map_err(|e| format!("--cores: {e}"))?;
    let embedded = args.trids.is_empty();
    let jobs = args.jobs.unwrap_or(2 * cores.len());
    if args.verify {
        if let Some(w) = args.workloads.iter().find(|w| w.trims()) {
            return Err(format!(
                "--verify checks what was written, and --workload {} leaves blocks whose content the \
                 controller decides (its DLFEAT): run it without --verify",
                w.name()
            ));
        }
    }
    if jobs == 0 {
        return Err("--jobs must be at least 1".into());
    }
    let version = if args.psk_identity_version == 0 {
        IdentityVersion::V0
    } else {
        IdentityVersion::V1
    };
    let key = args
        .psk
        .as_deref()
        .map(|k| ConfiguredKey::parse(k).map_err(|e| format!("--psk: {e}")))
        .transpose()?;
    let tls_settings: Vec<bool> = match (embedded, args.tls.as_str()) {
        (true, "off") => vec![false],
        (true, "on") => vec![true],
        (true, _) => vec![false, true],
        (false, _) => vec![key.is_some()],
    };
    let mut embedded_target = None;
    let mut pcie: Vec<nvpoll::trid::PciAddress> = Vec::new();
    let mut machine_note: Option<String> = None;
    let targets: Vec<ConnectOptions> = if embedded {
        let tcores = match &args.target_cores {
            Some(c) => CoreList::parse(c).map_err(|e| format!("--target-cores: {e}"))?,
            None => {
                let all = CoreList::all();
                let last = *all.cores().last().ok_or("no cores")?;
                CoreList::parse(&last.to_string()).map_err(|e| e.to_string())?
            }
        };
        let trid = TransportId::Tcp {
            addr: "127.0.0.1:0".parse().expect("address literal"),
            subnqn: Some(embedded_target::NQN.to_string()),
            hostnqn: None,
        };
        let mut o =
            ConnectOptions::from_trid(&trid, args.hostnqn.as_deref()).map_err(|e| e.to_string())?;
        let demo_key = ConfiguredKey::parse(DEMO_KEY).expect("the demo key parses");
        let target_key = key.clone().unwrap_or(demo_key);
        o = common::with_dhchap(o, dhchap_args(&args))?;
        if let Some(n) = args.tls_key_update {
            o.tls_key_renewal = KeyRenewal::after(n);
        }
        // Before anything spins there: what one cache line costs between the initiator's core and the
        // target's, which decides loopback results on a VM and can change under it (nvpoll_tools::machine).
        if let (Some(&i), Some(&t)) = (cores.cores().first(), tcores.cores().first()) {
            if i != t {
                machine_note = Some(nvpoll_tools::machine::describe_round_trip(i, t));
            }
        }
        // One controller per 1024 I/O queues (the target's limit per controller).
        let queues = jobs + args.idle_queues;
        let controllers = queues.div_ceil(1024);
        let t = embedded_target::start(
            &tcores,
            args.idle,
            args.ram,
            queues.div_ceil(controllers),
            args.tcp_congestion.clone(),
            &o,
            &target_key,
        )?;
        eprintln!(
            "nvpoll-perf: embedded NVMe/TCP target {} on {} (cores {tcores}), RAM namespace of {} MiB, TLS optional",
            t.nqn,
            t.addr,
            args.ram >> 20
        );
        o.addr = t.addr;
        embedded_target = Some((t, target_key));
        vec![o; controllers]
    } else {
        let mut tcp = Vec::new();
        for t in &args.trids {
            let trid: TransportId = t.parse().map_err(|e| format!("--trid '{t}': {e}"))?;
            match trid {
                TransportId::Pcie { bdf } => pcie.push(bdf),
                _ => tcp.push(common::with_dhchap(
                    ConnectOptions::from_trid(&trid, args.hostnqn.as_deref())
                        .map_err(|e| format!("--trid '{t}': {e}"))?,
                    dhchap_args(&args),
                )?),
            }
        }
        if !tcp.is_empty() && !pcie.is_empty() {
            return Err(
                "--trid: give either NVMe/TCP or PCIe controllers, not both in one run".into(),
            );
        }
        tcp
    };
    let qds = if args.qds.is_empty() {
        if embedded {
            vec![1, 128]
        } else {
            vec![128]
        }
    } else {
        args.qds.clone()
    };
    if let Some(&bad) = qds.iter().find(|&&q| q == 0) {
        return Err(format!("--qd {bad}: the queue depth must be at least 1"));
    }
    if args.runs == 0 {
        return Err("--runs must be at least 1".into());
    }
    let modes: Vec<SendMode> = match args.send_mode.as_str() {
        "all" => SendMode::ALL.to_vec(),
        m => vec![m.parse().map_err(|e| format!("--send-mode: {e}"))?],
    };
    let max_qd = *qds.iter().max().expect("at least one qd") as usize;
    let bufs_needed = jobs * max_qd + 64;
    let class = (args.io_size as usize).next_power_of_two().max(4096);
    let pool = DmaPool::builder()
        .class(4096, 256)
        .class(class, bufs_needed)
        .build()
        .map_err(|e| format!("DMA pool: {e}"))?;
    let reactors = Reactors::builder()
        .idle(args.idle)
        .parking(!args.no_parking)
        .start(&cores)
        .map_err(|e| format!("starting reactors: {e}"))?;
    let quiet = args.quiet || args.json;
    let mut machine = format!("{} cores, initiator cores {cores}", CoreList::all().len());
    if let Some(note) = &machine_note {
        eprintln!("nvpoll-perf: machine: {note} (measured before the reactors started)");
        machine.push_str(&format!("; {note}"));
    }
    if args.tcp_congestion.is_none()
        && targets
            .iter()
            .any(|o| o.addr.ip().to_canonical().is_loopback())
        && nvpoll_tools::machine::system_congestion().as_deref() == Some("bbr")
    {
        eprintln!(
            "nvpoll-perf: machine: the system's TCP congestion control is bbr: loopback connections use cubic \
             instead (under bbr their speed depends on the round trip they measured first); --tcp-congestion \
             system keeps bbr"
        );
        machine.push_str("; loopback TCP under cubic (the system's: bbr)");
    }
    let workloads: Vec<loadgen::Workload> = if !args.workloads.is_empty() {
        args.workloads.clone()
    } else if embedded {
        vec![loadgen::Workload::Randwrite, loadgen::Workload::Randread]
    } else {
        vec![loadgen::Workload::Randwrite]
    };
    let names: Vec<&str> = workloads.iter().map(|w| w.name()).collect();
    eprintln!(
        "nvpoll-perf: {} {} B, {} job(s) on {} reactor(s), warm-up {:?}, {:?} x {} run(s) per row{}",
        names.join(" and "),
        args.io_size,
        jobs,
        cores.len(),
        args.warmup,
        args.time,
        args.runs,
        if args.verify { ", verifying" } else { "" }
    );
    let matrix = Matrix {
        workloads: &workloads,
        qds: &qds,
        modes: &modes,
        jobs,
        idle_queues: args.idle_queues,
        io_size: args.io_size,
        rwmix: args.rwmix,
        verify: args.verify,
        warmup: args.warmup,
        time: args.time,
        runs: args.runs,
        quiet,
        max_qd: max_qd as u16,
        drain_timeout: args.drain_timeout,
        faults: args.faults,
    };
    let mut out = Outcome::default();
    if !pcie.is_empty() {
        let mut ctrls = Vec::new();
        for bdf in &pcie {
            let opts = PcieOptions {
                recovery: if args.recovery == "fail-fast" {
                    nvpoll_pcie::Recovery::FailFast
                } else {
                    nvpoll_pcie::Recovery::Retry
                },
                io_timeout: args.io_timeout,
                // A hybrid reactor may sleep with commands outstanding only on completion interrupts.
                interrupts: args.idle != IdlePolicy::Poll,
                ..PcieOptions::default()
            };
            ctrls.push(common::open_pcie(*bdf, &pool, opts)?);
        }
        run_matrix(ctrls, &reactors, &pool, &matrix, "", None, &mut out)?;
    }
    if args.multipath && (embedded || !pcie.is_empty()) {
        return Err("--multipath: give the paths as NVMe/TCP --trid transport IDs".into());
    }
    for &tls in tls_settings.iter().filter(|_| pcie.is_empty()) {
        // One set of controllers (and queue pairs, kept across runs) per TLS setting.
        let mut opts = Vec::new();
        for o in &targets {
            let mut o = o.clone();
            if tls {
                let k = match (&key, &embedded_target) {
                    (Some(k), _) => k,
                    (None, Some((_, k))) => k,
                    (None, None) => unreachable!("TLS without --psk only with the embedded target"),
                };
                o = o.with_tls_key(k, version);
            }
            if let Some(n) = args.tls_key_update {
                o.tls_key_renewal = KeyRenewal::after(n);
            }
            o.kato = args.kato;
            o.timeout = args.connect_timeout;
            o.io_queues = args.io_queues;
            o.tcp_congestion.clone_from(&args.tcp_congestion);
            o.sq_flow_control = args.sq_flow_control;
            o.header_digest = args.header_digest;
            o.data_digest = args.data_digest;
            o.reconnect_delay = args.reconnect_delay;
            o.ctrl_loss_tmo = args.ctrl_loss_tmo;
            o.io_timeout = args.io_timeout;
            o.recovery = if args.recovery == "fail-fast" {
                Recovery::FailFast
            } else {
                Recovery::Retry
            };
            opts.push(o);
        }
        let target = embedded_target.as_ref().map(|(t, _)| t);
        let suffix = if tls { " tls" } else { "" };
        if args.multipath {
            let policy: PathPolicy = args
                .path_policy
                .parse()
                .map_err(|e: nvpoll_tcp::multipath::UnknownPathPolicy| e.to_string())?;
            let mut groups: Vec<Vec<ConnectOptions>> = Vec::new();
            for o in opts {
                match groups.iter_mut().find(|g| g[0].subnqn == o.subnqn) {
                    Some(g) => g.push(o),
                    None => groups.push(vec![o]),
                }
            }
            let mut ctrls = Vec::new();
            for g in groups {
                let (nqn, n) = (g[0].subnqn.clone(), g.len());
                let c = MultipathController::connect(g, pool.clone(), policy)
                    .map_err(|e| format!("--multipath {nqn}: {e}"))?;
                eprintln!("nvpoll-perf: {nqn}: {n} path(s), policy {policy}");
                ctrls.push(c);
            }
            run_matrix(ctrls, &reactors, &pool, &matrix, suffix, target, &mut out)?;
        } else {
            let mut ctrls = Vec::new();
            for o in opts {
                ctrls.push(common::connect_tcp(o, &pool)?);
            }
            run_matrix(ctrls, &reactors, &pool, &matrix, suffix, target, &mut out)?;
        }
    }
    let stats = reactors.stop().map_err(|e| e.to_string())?;
    let Outcome { rows, late } = out;
    let total_errors: u64 = rows
        .iter()
        .flat_map(|r| r.runs.iter())
        .map(|r| r.errors)
        .sum();
    let total_mismatches: u64 = rows
        .iter()
        .flat_map(|r| r.runs.iter())
        .map(|r| r.mismatches)
        .sum();
    if args.json {
        println!("{}", loadgen::json(&rows, &machine));
    } else {
        println!("{}", loadgen::table(&rows));
        let polls: u64 = stats.iter().map(|s| s.busy + s.idle).sum();
        let busy: u64 = stats.iter().map(|s| s.busy).sum();
        let sleeps: u64 = stats.iter().map(|s| s.sleeps).sum();
        let slept: f64 = stats.iter().map(|s| s.slept.as_secs_f64()).sum();
        println!(
            "initiator reactors: {polls} polls, {:.1}% busy, {sleeps} sleeps ({slept:.2} s asleep, idle {}); errors \
             {total_errors}, verify mismatches {total_mismatches}",
            100.0 * busy as f64 / polls.max(1) as f64,
            args.idle
        );
    }
    let all = || rows.iter().flat_map(|r| r.runs.iter());
    let lost: u64 = all().map(|r| r.lost).sum();
    let failures: usize = all().map(|r| r.failures.len()).sum();
    if lost > 0 || total_mismatches > 0 {
        return Err(format!(
            "{lost} I/Os lost and {total_mismatches} verify mismatches"
        ));
    }
    if !args.faults && (total_errors > 0 || failures > 0) {
        return Err(format!(
            "{total_errors} I/O errors and {failures} jobs that ended early"
        ));
    }
    if !late.is_empty() {
        return Err(late.join("; "));
    }
    Ok(())
}

/// The embedded target: our NVMe/TCP target on 127.0.0.1, on its own reactors.
fn dhchap_args(args: &Args) -> common::DhchapArgs<'_> {
    common::DhchapArgs {
        secret: args.dhchap_secret.as_deref(),
        ctrl: args.dhchap_ctrl_secret.as_deref(),
        hashes: args.dhchap_hashes.as_deref(),
        groups: args.dhchap_dhgroups.as_deref(),
        concat: args.concat,
    }
}

mod embedded_target {
    use super::*;
    use nvpoll_target::{Backing, SubsystemConfig, Target, TargetConfig, TargetHandle, TargetTls};

    pub(crate) const NQN: &str = "nqn.2024-01.io.nvpoll:perf";

    pub(crate) struct Embedded {
        pub addr: SocketAddr,
        pub nqn: String,
        handle: TargetHandle,
        reactors: Option<Reactors>,
    }

    /// Starts the target with TLS optional: `host`'s NQN may connect in the clear or with `key`, and must
    /// authenticate with its DH-HMAC-CHAP keys if it has some.
    pub(crate) fn start(
        cores: &CoreList,
        idle: IdlePolicy,
        ram: u64,
        jobs: usize,
        tcp_congestion: Option<String>,
        host: &ConnectOptions,
        key: &ConfiguredKey,
    ) -> Result<Embedded, String> {
        let hostnqn = host.hostnqn.as_str();
        let nqn = NQN.to_string();
        let listen: SocketAddr = "127.0.0.1:0".parse().expect("address literal");
        // As many I/O queues as the jobs need: the target's default (128) at least, its limit (1024) at most.
        let mut subsystem = SubsystemConfig::new(nqn.clone()).namespace(Backing::Ram(ram), 4096);
        subsystem.limits.max_io_queues = Some(jobs.clamp(128, 1024) as u16);
        if let Some(a) = &host.dhchap {
            subsystem.dhchap_keys.push(nvpoll_target::DhchapKey {
                hostnqn: hostnqn.to_string(),
                key: a.secret.clone(),
                ctrl_key: a.ctrl_secret.clone(),
                concat: a.concat,
            });
        }
        let mut config = TargetConfig::new(listen).subsystem(subsystem);
        config.tcp_congestion = tcp_congestion;
        // Both sides renew at the same count.
        config.tls_key_renewal = host.tls_key_renewal;
        config.tls = Some(TargetTls::with_host_keys(
            false,
            &[(hostnqn.to_string(), key.clone())],
            std::slice::from_ref(&nqn),
        ));
        let target = Target::bind(config).map_err(|e| format!("embedded target: {e}"))?;
        let reactors = Reactors::builder()
            .idle(idle)
            .start(cores)
            .map_err(|e| format!("embedded target reactors: {e}"))?;
        let handle = target
            .start(&reactors)
            .map_err(|e| format!("embedded target: {e}"))?;
        Ok(Embedded {
            addr: handle.local_addr(),
            nqn,
            handle,
            reactors: Some(reactors),
        })
    }

    impl Embedded {
        /// Makes the target answer with the same send mode as the initiator's run.
        pub(crate) fn set_send_mode(&self, mode: SendMode) {
            self.handle.set_send_mode(mode);
        }
    }

    impl Drop for Embedded {
        fn drop(&mut self) {
            self.handle.stop();
            if let Some(r) = self.reactors.take() {
                if let Err(e) = r.stop() {
                    eprintln!("nvpoll-perf: embedded target reactors: {e}");
                }
            }
        }
    }
}

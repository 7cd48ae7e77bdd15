//! A well-behaved host's throughput against our target, alone and while hostile hosts hammer the same target.
//!
//! The good host is our initiator: one queue pair, qd32 4 KiB random reads, driven by `nvpoll_tools::loadgen` on its
//! own reactor core; the target runs on another. The hostile hosts are plain threads (not pinned, so on a small
//! machine they compete with both reactors for the same cores):
//!
//! - a connection flood: connections that never send ICReq, each held until the target's connect timeout;
//! - slowloris hosts: ICReq one byte every 50 ms, until the connect timeout closes them;
//! - a capsule flooder: an I/O queue of 4 entries that receives 1004 write capsules at once, again and again;
//! - TLS garbage: a ClientHello record of garbage (the target's TLS is optional), again and again.
//!
//! Phases, interleaved run by run and reported as medians: alone; with the hostile hosts unpaced (as fast as
//! they can: up to 200 flood connections open, 50 slowloris hosts, the flooder and the garbage sender back to
//! back); paced (20 flood connections per second, 4 slowloris hosts, a capsule flood every 500 ms and a garbage
//! handshake every 100 ms); and after each hostile phase its **noise control**: one thread per hostile host
//! that uses the same CPU time in as many wakeups per second as its twin just did, without touching the
//! network. On a machine where the hostile hosts share the reactors' cores, part of what the good host loses
//! is simply CPU and preemptions that any neighbour would cost it; the noise phase measures that part, and
//! "vs noise" (hostile IOPS / noise IOPS) is what is left: the target's own cost of its hostile clients.
//! Each row also gives the cores' worth of CPU the initiator's reactor, the target's reactor and every other
//! thread got, and the other threads' voluntary context switches per second.
//!
//! `cargo bench --bench hostile` (NVPOLL_BENCH_TIME=3s, NVPOLL_BENCH_WARMUP=500ms, NVPOLL_BENCH_RUNS=5,
//! NVPOLL_BENCH_PHASES=unpaced,paced: the hostile phases to run besides the alone phase).
//! The machine's load average is printed before and after: other work on the same cores moves the numbers.

mod common;
use nvpoll_testkit::target as target_common;

use std::cell::RefCell;
use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use nvpoll::api::Controller;
use nvpoll::mem::DmaPool;
use nvpoll::reactor::Reactors;
use nvpoll::send::SendMode;
use nvpoll::spec::{SglDescriptor, Sqe};
use nvpoll_tcp::host::{ConnectOptions, TcpController, TcpQueuePair};
use nvpoll_tcp::pdu::{self, Digests};
use nvpoll_tcp::tls::ConfiguredKey;
use nvpoll_tools::loadgen::{self, LoadGen, Phase, RunResult, Workload};
use target_common::{fill_pattern, RawHost, HOSTNQN, NQN};

const KEY: &str = "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:";
/// The target's time for ICReq and Connect: what bounds how long a stalled hostile connection lives.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
/// A slowloris host's pace.
const PACE: Duration = Duration::from_millis(50);

/// How hard the hostile hosts push.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pace {
    /// As fast as they can.
    Unpaced,
    /// Bounded rates.
    Paced,
}

impl Pace {
    /// Flood connections open at once at most, and new ones per second (None: no limit).
    fn flood(self) -> (usize, Option<u32>) {
        match self {
            Pace::Unpaced => (200, None),
            Pace::Paced => (20, Some(20)),
        }
    }

    fn slowloris_hosts(self) -> usize {
        match self {
            Pace::Unpaced => 50,
            Pace::Paced => 4,
        }
    }

    /// The time between two capsule floods, and between two garbage handshakes.
    fn gaps(self) -> (Duration, Duration) {
        match self {
            Pace::Unpaced => (Duration::ZERO, Duration::ZERO),
            Pace::Paced => (Duration::from_millis(500), Duration::from_millis(100)),
        }
    }
}

/// What runs beside the good host in a phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Load {
    Alone,
    Hostile(Pace),
    /// The control for the hostile phase before it: the same CPU time and wakeups, no network.
    Noise(Pace),
}

/// What the hostile hosts did.
#[derive(Default)]
struct HostileCounts {
    flood: AtomicU64,
    slowloris: AtomicU64,
    capsule_floods: AtomicU64,
    garbage: AtomicU64,
}

/// What one thread cost the machine: CPU time and how often it blocked or slept (voluntary context switches:
/// each is followed by a wakeup that preempts whatever runs on that core, here a reactor).
#[derive(Clone, Copy, Debug, Default)]
struct Footprint {
    cpu: Duration,
    switches: u64,
    secs: f64,
}

impl Footprint {
    /// The calling thread's CPU time and voluntary context switches (/proc/thread-self/status), since it
    /// started.
    fn of_this_thread(started: Instant) -> Footprint {
        let cpu = cpu_time::ThreadTime::now().as_duration();
        let switches = std::fs::read_to_string("/proc/thread-self/status")
            .map(|s| {
                s.lines()
                    .filter(|l| l.starts_with("voluntary_ctxt_switches:"))
                    .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                    .sum()
            })
            .unwrap_or(0);
        Footprint {
            cpu,
            switches,
            secs: started.elapsed().as_secs_f64(),
        }
    }
}

/// The hostile hosts, one thread each, until dropped.
struct Hostile {
    stop: Arc<AtomicBool>,
    counts: Arc<HostileCounts>,
    threads: Vec<JoinHandle<Footprint>>,
    started: Instant,
}

impl Hostile {
    fn start(addr: SocketAddr, pace: Pace) -> Hostile {
        let stop = Arc::new(AtomicBool::new(false));
        let counts = Arc::new(HostileCounts::default());
        let kinds: [fn(SocketAddr, Pace, &AtomicBool, &HostileCounts); 4] =
            [flood, slowloris, capsule_flooder, tls_garbage];
        let threads = kinds
            .into_iter()
            .map(|f| {
                let (stop, counts) = (Arc::clone(&stop), Arc::clone(&counts));
                thread::spawn(move || {
                    let t0 = Instant::now();
                    f(addr, pace, &stop, &counts);
                    Footprint::of_this_thread(t0)
                })
            })
            .collect();
        Hostile {
            stop,
            counts,
            threads,
            started: Instant::now(),
        }
    }

    /// Stops the threads; returns connections per second of each kind, and each thread's footprint.
    fn finish(mut self) -> ([f64; 4], Vec<Footprint>) {
        self.stop.store(true, Ordering::Release);
        let prints = self
            .threads
            .drain(..)
            .map(|t| t.join().expect("hostile host thread"))
            .collect();
        let secs = self.started.elapsed().as_secs_f64();
        let c = &self.counts;
        let rates = [&c.flood, &c.slowloris, &c.capsule_floods, &c.garbage]
            .map(|a| a.load(Ordering::Relaxed) as f64 / secs);
        (rates, prints)
    }
}

/// The control for a hostile phase: one thread per hostile host that costs the machine what its twin did (the
/// same CPU time, in as many wakeups per second) but never touches the network. What the good host loses to
/// the noise is what any process sharing its cores would cost it; what it loses to the hostile hosts beyond
/// that is the target's doing.
struct Noise {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<Footprint>>,
}

impl Noise {
    fn start(twins: &[Footprint]) -> Noise {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = twins
            .iter()
            .map(|twin| {
                let stop = Arc::clone(&stop);
                let wakeups = (twin.switches as f64 / twin.secs.max(1e-3)).max(1.0);
                let gap = Duration::from_secs_f64(1.0 / wakeups);
                // Cores' worth of CPU the twin used; the thread keeps its own total (sleeping included) at that.
                let share = twin.cpu.as_secs_f64() / twin.secs.max(1e-3);
                thread::spawn(move || {
                    let t0 = Instant::now();
                    let cpu0 = cpu_time::ThreadTime::now();
                    let mut next = Instant::now();
                    while !stop.load(Ordering::Acquire) {
                        // CPU time, not wall time: a spin that is preempted must not count the time it lost.
                        let budget = Duration::from_secs_f64(share * t0.elapsed().as_secs_f64());
                        while cpu0.elapsed() < budget {
                            std::hint::spin_loop();
                        }
                        next += gap;
                        let now = Instant::now();
                        if next > now {
                            thread::sleep(next - now);
                        } else {
                            next = now;
                        }
                    }
                    Footprint::of_this_thread(t0)
                })
            })
            .collect();
        Noise { stop, threads }
    }

    fn finish(mut self) -> Vec<Footprint> {
        self.stop.store(true, Ordering::Release);
        self.threads
            .drain(..)
            .map(|t| t.join().expect("noise thread"))
            .collect()
    }
}

/// Sleeps `gap` in small steps, returning early once `stop` is set.
fn pause(gap: Duration, stop: &AtomicBool) {
    let end = Instant::now() + gap;
    while Instant::now() < end && !stop.load(Ordering::Acquire) {
        thread::sleep(Duration::from_millis(10).min(end - Instant::now()));
    }
}

/// Reads and drops what the target sends until it closes the connection (or `limit` passes).
fn until_closed(s: &mut TcpStream, limit: Duration) {
    let _ = s.set_read_timeout(Some(limit));
    let mut sink = [0u8; 16384];
    while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
}

/// Connections that never send ICReq, each held a little longer than the connect timeout (by then the target
/// has closed it).
fn flood(addr: SocketAddr, pace: Pace, stop: &AtomicBool, counts: &HostileCounts) {
    let (max_open, per_second) = pace.flood();
    let gap = per_second.map_or(Duration::ZERO, |n| Duration::from_secs(1) / n);
    let mut open: VecDeque<(TcpStream, Instant)> = VecDeque::new();
    let mut next = Instant::now();
    while !stop.load(Ordering::Acquire) {
        let now = Instant::now();
        while open
            .front()
            .is_some_and(|(_, t)| now - *t > CONNECT_TIMEOUT + Duration::from_millis(100))
        {
            open.pop_front();
        }
        if open.len() < max_open && now >= next {
            if let Ok(s) = TcpStream::connect(addr) {
                counts.flood.fetch_add(1, Ordering::Relaxed);
                open.push_back((s, now));
            }
            next = now + gap;
        } else {
            thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Hosts that send ICReq one byte every `PACE`; each is replaced when the target closes it.
fn slowloris(addr: SocketAddr, pace: Pace, stop: &AtomicBool, counts: &HostileCounts) {
    let mut icreq = Vec::new();
    pdu::encode_ic_req(&mut icreq, &pdu::IcReq::default());
    let mut hosts: Vec<Option<(TcpStream, usize)>> =
        (0..pace.slowloris_hosts()).map(|_| None).collect();
    while !stop.load(Ordering::Acquire) {
        for h in hosts.iter_mut() {
            if h.is_none() {
                *h = TcpStream::connect(addr).ok().map(|s| (s, 0));
                counts.slowloris.fetch_add(1, Ordering::Relaxed);
            }
            let Some((s, sent)) = h else { continue };
            // A write fails once the target has closed the connection (the byte before drew a reset).
            if *sent >= icreq.len() || s.write_all(&icreq[*sent..*sent + 1]).is_err() {
                *h = None;
            } else {
                *sent += 1;
            }
        }
        pause(PACE, stop);
    }
}

/// An admin queue, then again and again: an I/O queue of 4 entries and 1004 writes at once (waiting for R2T,
/// the first four fill it; the fifth is a protocol error), until the target terminates the connection.
fn capsule_flooder(addr: SocketAddr, pace: Pace, stop: &AtomicBool, counts: &HostileCounts) {
    let (_admin, cntlid) = RawHost::admin_queue(addr, NQN, 0);
    let mut batch = Vec::new();
    for cid in 0..1004u16 {
        let mut sqe = Sqe::write(1, u64::from(cid % 64) * 8, 7);
        sqe.cid = cid;
        sqe.set_sgl(&SglDescriptor::transport_data_block(32768));
        pdu::encode_capsule_cmd(&mut batch, &sqe, &[], Digests::NONE, 0);
    }
    let (gap, _) = pace.gaps();
    let mut qid = 0u16;
    while !stop.load(Ordering::Acquire) {
        // A closed queue's ID is released when its session is dropped: take turns over several.
        qid = qid % 32 + 1;
        let (mut q, cqe) = RawHost::io_queue(addr, cntlid, qid, 3, 0, Digests::NONE);
        if cqe.status().is_success() {
            let _ = q.s.write_all(&batch);
            until_closed(&mut q.s, Duration::from_secs(5));
            counts.capsule_floods.fetch_add(1, Ordering::Relaxed);
        }
        pause(gap, stop);
    }
}

/// A ClientHello record of garbage, then waiting for the target to close the connection, again and again.
fn tls_garbage(addr: SocketAddr, pace: Pace, stop: &AtomicBool, counts: &HostileCounts) {
    let (_, gap) = pace.gaps();
    let mut seed = 0u64;
    while !stop.load(Ordering::Acquire) {
        seed += 1;
        let mut junk = vec![0u8; 261];
        fill_pattern(&mut junk, seed);
        junk[..5].copy_from_slice(&[0x16, 0x03, 0x01, 0x01, 0x00]);
        if let Ok(mut s) = TcpStream::connect(addr) {
            let _ = s.write_all(&junk);
            until_closed(&mut s, Duration::from_secs(5));
            counts.garbage.fetch_add(1, Ordering::Relaxed);
        }
        pause(gap, stop);
    }
}

/// CPU seconds used so far: by the initiator's reactor, the target's reactor, and every other thread of the
/// process (the hostile hosts or the noise, and the main thread, which sleeps while a run lasts). Kernel work
/// done in softirq context lands on whichever thread was running.
fn cpu_split(initiator: &Reactors, target: &Reactors) -> [f64; 3] {
    let ini = initiator.stats()[0].cpu_time.as_secs_f64();
    let tgt = target.stats()[0].cpu_time.as_secs_f64();
    let all = cpu_time::ProcessTime::now().as_duration().as_secs_f64();
    [ini, tgt, (all - ini - tgt).max(0.0)]
}

/// The first three fields of /proc/loadavg.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

fn main() {
    let knobs = common::knobs("3s", "500ms", 5);
    let common::Knobs { time, warmup, runs } = knobs;
    let (icore, tcore, icores, tcores) = common::cores();

    // TLS optional: the good host speaks plain TCP, and garbage that starts like a record reaches the handshake.
    let key = ConfiguredKey::parse(KEY).expect("key");
    let mut config = common::ram_target(NQN, Some((HOSTNQN, &key)));
    config.connect_timeout = CONNECT_TIMEOUT;
    let (target_reactors, target) = common::start_target(config, &tcores);
    let addr = target.local_addr();
    let pool = DmaPool::builder()
        .class(4096, 256)
        .build()
        .expect("DMA pool");
    let reactors = Reactors::start(&icores).expect("initiator reactors");
    let mut ctrl = TcpController::connect(ConnectOptions::new(addr, NQN, HOSTNQN), pool.clone())
        .expect("connect to our target");
    let ns = ctrl.namespaces()[0].clone();
    let mut gen: LoadGen<TcpQueuePair> = LoadGen::new(pool.clone(), 32, true);
    let spec = knobs.spec(Workload::Randread, 4096, 32, 1, SendMode::Deferred);
    println!(
        "hostile: initiator core {icore}, target core {tcore}, qd32 x 1 4 KiB randread, median of {runs} x \
         {time:?} (after {warmup:?}) per phase, phases interleaved; target connect timeout {CONNECT_TIMEOUT:?}; \
         load average before: {}",
        load_average()
    );
    // NVPOLL_BENCH_PHASES=unpaced (say) runs the alone phase and that one only (and its noise control), e.g.
    // under a profiler.
    let wanted = std::env::var("NVPOLL_BENCH_PHASES").unwrap_or_else(|_| "unpaced,paced".into());
    let mut phases = vec![Load::Alone];
    for w in wanted.split(',').map(str::trim).filter(|w| !w.is_empty()) {
        let pace = match w {
            "unpaced" => Pace::Unpaced,
            "paced" => Pace::Paced,
            other => panic!("NVPOLL_BENCH_PHASES: unknown phase {other:?} (unpaced, paced)"),
        };
        phases.push(Load::Hostile(pace));
        phases.push(Load::Noise(pace));
    }
    let mut results: Vec<Vec<RunResult>> = vec![Vec::new(); phases.len()];
    let mut rates: Vec<Vec<[f64; 4]>> = vec![Vec::new(); phases.len()];
    // Cores' worth of CPU per phase: initiator reactor, target reactor, other threads (the hostile hosts).
    let mut cpu: Vec<Vec<[f64; 3]>> = vec![Vec::new(); phases.len()];
    // Context switches per second of the other threads.
    let mut switches: Vec<Vec<f64>> = vec![Vec::new(); phases.len()];
    let mut twins: Vec<Footprint> = Vec::new();
    let ctrl_cell = RefCell::new(&mut ctrl);
    for _ in 0..runs {
        for (i, load) in phases.iter().enumerate() {
            let (t0, cpu0) = (Instant::now(), cpu_split(&reactors, &target_reactors));
            let hostile = match load {
                Load::Hostile(p) => Some(Hostile::start(addr, *p)),
                _ => None,
            };
            let noise = match load {
                // Runs right after its hostile phase, with the footprints that phase just measured.
                Load::Noise(_) => Some(Noise::start(&twins)),
                _ => None,
            };
            let mut connect = |_: usize, depth: u16| -> nvpoll::Result<_> {
                Ok((ctrl_cell.borrow_mut().connect_io_queue(depth)?, ns.clone()))
            };
            let mut tick =
                |_: Phase| -> nvpoll::Result<()> { Ok(ctrl_cell.borrow_mut().poll_admin()?) };
            let r = gen
                .run(&reactors, spec, &mut connect, &mut tick)
                .expect("run");
            let (cpu1, secs) = (
                cpu_split(&reactors, &target_reactors),
                t0.elapsed().as_secs_f64(),
            );
            cpu[i].push([0, 1, 2].map(|k| (cpu1[k] - cpu0[k]) / secs));
            let prints = match (hostile, noise) {
                (Some(h), _) => {
                    let (r, prints) = h.finish();
                    rates[i].push(r);
                    twins = prints.clone();
                    prints
                }
                (_, Some(n)) => n.finish(),
                _ => Vec::new(),
            };
            if !prints.is_empty() {
                switches[i].push(prints.iter().map(|f| f.switches as f64 / f.secs).sum());
            }
            assert!(
                r.failures.is_empty() && r.errors == 0 && r.lost == 0,
                "the good host failed: {:?}",
                r.failures
            );
            results[i].push(r);
        }
    }
    let spread: Vec<(f64, f64)> = results
        .iter()
        .map(|runs| {
            let iops = runs.iter().map(|r| r.iops);
            (
                iops.clone().fold(f64::MAX, f64::min),
                iops.fold(0.0, f64::max),
            )
        })
        .collect();
    let medians: Vec<RunResult> = results.into_iter().map(loadgen::median).collect();
    let alone = medians[0].iops;
    println!("load average after: {}", load_average());
    println!(
        "\n| {:<18} | {:>9} | {:>17} | {:>8} | {:>7} | {:>9} | {:>35} | {:>20} | {:>10} |",
        "phase",
        "IOPS",
        "min - max",
        "p99 us",
        "ratio",
        "vs noise",
        "hostile conn/s: flood/slow/caps/tls",
        "cores: ini/tgt/other",
        "other cs/s"
    );
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    for (i, load) in phases.iter().enumerate() {
        let m = &medians[i];
        let (lo, hi) = spread[i];
        let c = &cpu[i];
        let mean_cpu = |k: usize| mean(&c.iter().map(|x| x[k]).collect::<Vec<_>>());
        let label = match load {
            Load::Alone => "alone",
            Load::Hostile(Pace::Unpaced) => "hostile, unpaced",
            Load::Noise(Pace::Unpaced) => "noise like unpaced",
            Load::Hostile(Pace::Paced) => "hostile, paced",
            Load::Noise(Pace::Paced) => "noise like paced",
        };
        let rate = if rates[i].is_empty() {
            "-".to_string()
        } else {
            let r = &rates[i];
            let k = |k: usize| mean(&r.iter().map(|x| x[k]).collect::<Vec<_>>());
            format!("{:.0}/{:.0}/{:.1}/{:.0}", k(0), k(1), k(2), k(3))
        };
        // A hostile phase against its noise control (the phase after it).
        let vs_noise = match (load, medians.get(i + 1), phases.get(i + 1)) {
            (Load::Hostile(_), Some(n), Some(Load::Noise(_))) => format!("{:.3}", m.iops / n.iops),
            _ => "-".into(),
        };
        let cs = if switches[i].is_empty() {
            "-".to_string()
        } else {
            format!("{:.0}", mean(&switches[i]))
        };
        println!(
            "| {:<18} | {:>9.0} | {:>17} | {:>8.1} | {:>7.3} | {:>9} | {:>35} | {:>20} | {:>10} |",
            label,
            m.iops,
            format!("{lo:.0} - {hi:.0}"),
            m.p99_us,
            m.iops / alone,
            vs_noise,
            rate,
            format!("{:.2}/{:.2}/{:.2}", mean_cpu(0), mean_cpu(1), mean_cpu(2)),
            cs
        );
    }
    gen.release_queue_pairs();
    ctrl.shutdown().expect("controller shutdown");
    reactors.stop().expect("stop initiator reactors");
    // Every hostile connection was closed again and none hit a bug in the target.
    let deadline = Instant::now() + Duration::from_secs(10);
    let c = loop {
        let c = target.counters();
        if c.closed == c.accepted || Instant::now() > deadline {
            break c;
        }
        thread::sleep(Duration::from_millis(10));
    };
    println!("\ntarget: {c}");
    assert_eq!(c.closed, c.accepted, "connections left open");
    assert_eq!(c.internal_errors, 0, "the target panicked");
    target.stop();
    target_reactors.stop().expect("stop target reactors");
}

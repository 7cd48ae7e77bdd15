//! Idle policies side by side: poll against hybrid, for our initiator and our target over loopback (one
//! reactor core each side, one queue pair).
//!
//! 1. **Idle CPU**: a connected controller and an idle queue pair (keep-alive on), for a window: the share of a
//!    core each reactor thread used (its own CPU clock, read on the reactor).
//! 2. **Latency after a sleep**: after 20 ms with nothing to do (a hybrid reactor sleeps after its 1 ms quiet
//!    time), one 4 KiB read, then ten more back to back, issued by a poller on the initiator's reactor at its
//!    own deadline. The first read's latency counts from the moment it was due (so the initiator's wake-up
//!    is in it), the others' from their submission. The medians of the first and of the rest, and what hybrid
//!    adds to each.
//! 3. **Loaded IOPS**: 4 KiB random reads and writes at qd1 and qd128, plain and TLS. Both policies run each
//!    round back to back on fresh reactors; the ratio is the median of the rounds' hybrid/poll ratios.
//!
//! `cargo bench --bench idle` (NVPOLL_BENCH_TIME, NVPOLL_BENCH_WARMUP and NVPOLL_BENCH_RUNS as for the
//! loopback bench; the idle window is NVPOLL_BENCH_IDLE, 3 s by default).

mod common;

use std::cell::RefCell;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nvpoll::api::{Controller, IoOp, IoRequest, QueuePair};
use nvpoll::mem::{DmaBuf, DmaPool};
use nvpoll::reactor::{IdlePolicy, PollStatus, Poller, ReactorContext, Reactors, WakeSources};
use nvpoll::send::SendMode;
use nvpoll_target::TargetHandle;
use nvpoll_tcp::host::{ConnectOptions, TcpController, TcpQueuePair};
use nvpoll_tcp::tls::{ConfiguredKey, IdentityVersion};
use nvpoll_tools::loadgen::{self, LoadGen, Phase, Workload};

const KEY: &str = "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:";
const NQN: &str = "nqn.2024-01.io.nvpoll:bench";
const HOSTNQN: &str = "nqn.2024-01.io.nvpoll:bench-host";

/// Reads on a queue pair, in bursts: every [`BURST_GAP`] one read, then ten back to back. Each read's
/// latency is taken on the reactor: the first from the moment it was due (so the reactor's own wake-up from a
/// sleep counts), the others from their submission.
struct Pinger {
    qp: TcpQueuePair,
    buf: Option<DmaBuf>,
    /// When the next burst is due.
    next: Instant,
    /// When the read in flight was due or submitted, and its number in the burst.
    inflight: Option<(Instant, usize)>,
    first: Vec<f64>,
    rest: Vec<f64>,
    done: Option<mpsc::Sender<(Vec<f64>, Vec<f64>)>>,
}

const BURST_GAP: Duration = Duration::from_millis(20);
const BURSTS: usize = 30;

impl Pinger {
    fn submit(&mut self, since: Instant, k: usize) {
        let req = IoRequest {
            op: IoOp::Read,
            nsid: 1,
            lba: 0,
            blocks: 1,
            buf: self.buf.take(),
            tag: 0,
        };
        if let Err(r) = self.qp.submit(req) {
            panic!("submit: {}", r.error);
        }
        self.inflight = Some((since, k));
    }
}

impl Poller for Pinger {
    fn poll(&mut self, _: &mut ReactorContext) -> PollStatus {
        if self.done.is_none() {
            return PollStatus::Idle;
        }
        let mut busy = false;
        if self.inflight.is_none() && Instant::now() >= self.next {
            let due = self.next;
            self.submit(due, 0);
            busy = true;
        }
        self.qp.poll(16).expect("poll");
        if let Some(c) = self.qp.pop_completion() {
            busy = true;
            let now = Instant::now();
            c.result.expect("read");
            self.buf = c.buf;
            let (since, k) = self.inflight.take().expect("a read in flight");
            let us = (now - since).as_secs_f64() * 1e6;
            if k == 0 {
                self.first.push(us);
            } else {
                self.rest.push(us);
            }
            if k < 10 {
                self.submit(now, k + 1);
            } else if self.first.len() == BURSTS {
                let results = (
                    std::mem::take(&mut self.first),
                    std::mem::take(&mut self.rest),
                );
                self.done
                    .take()
                    .expect("running")
                    .send(results)
                    .expect("results");
            } else {
                self.next = now + BURST_GAP;
            }
        }
        PollStatus::busy_if(busy)
    }

    fn flush(&mut self, _: &mut ReactorContext) {
        self.qp.flush().expect("flush");
    }

    fn wake_sources<'a>(&'a self, w: &mut WakeSources<'a>) -> bool {
        if self.done.is_some() && self.inflight.is_none() {
            w.deadline(self.next);
        }
        self.qp.wake_sources(w)
    }
}

/// Both sides' reactors under one policy, our target on its side.
struct Sides {
    target: TargetHandle,
    target_reactors: Reactors,
    reactors: Reactors,
}

impl Sides {
    /// The initiator's reactor with policy `idle.0`, the target's with `idle.1`.
    fn start(idle: (IdlePolicy, IdlePolicy), key: &ConfiguredKey) -> Sides {
        let (_, _, icores, tcores) = common::cores();
        let config = common::ram_target(NQN, Some((HOSTNQN, key)));
        let (target_reactors, target) = common::start_target_idle(config, &tcores, idle.1);
        let reactors = Reactors::builder()
            .idle(idle.0)
            .start(&icores)
            .expect("initiator reactors");
        Sides {
            target,
            target_reactors,
            reactors,
        }
    }

    fn connect(&self, pool: &DmaPool, key: &ConfiguredKey, tls: bool) -> TcpController {
        let mut o = ConnectOptions::new(self.target.local_addr(), NQN, HOSTNQN);
        if tls {
            o = o.with_tls_key(key, IdentityVersion::V0);
        }
        TcpController::connect(o, pool.clone()).expect("connect to our target")
    }

    /// Each side's reactor CPU time, read on the reactor itself (exact, unlike the stats' sampled value).
    fn cpu(&self) -> (Duration, Duration) {
        let one = |r: &Reactors| r.run_on_all(|ctx| ctx.cpu_time()).expect("cpu time")[0];
        (one(&self.reactors), one(&self.target_reactors))
    }

    /// Stops the initiator's reactors (dropping the queue pairs on them), then `ctrl`, then the target.
    fn stop(self, ctrl: Option<TcpController>) {
        self.reactors.stop().expect("stop initiator reactors");
        if let Some(c) = ctrl {
            c.shutdown().expect("controller shutdown");
        }
        self.target.stop();
        self.target_reactors.stop().expect("stop target reactors");
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

struct IdleResult {
    initiator_pct: f64,
    target_pct: f64,
    sleeps: (u64, u64),
    first_us: f64,
    rest_us: f64,
}

/// Parts 1 and 2 under one policy.
fn idle_and_wake(
    idle: (IdlePolicy, IdlePolicy),
    key: &ConfiguredKey,
    pool: &DmaPool,
    window: Duration,
) -> IdleResult {
    let sides = Sides::start(idle, key);
    let mut ctrl = sides.connect(pool, key, false);
    // The reads start after the idle window, by the poller's own deadline.
    let qp = ctrl.create_queue_pair(16).expect("queue pair");
    let buf = pool.alloc(4096).expect("buffer");
    let (done_tx, done) = mpsc::channel();
    let first_due = Instant::now() + window + Duration::from_millis(200);
    sides
        .reactors
        .send(0, move |ctx| {
            ctx.add_poller(Pinger {
                qp,
                buf: Some(buf),
                next: first_due,
                inflight: None,
                first: Vec::new(),
                rest: Vec::new(),
                done: Some(done_tx),
            });
        })
        .expect("register");
    // 1. Idle CPU over the window; the admin queue is kept alive from here, as perf does.
    let stats_before = (sides.reactors.stats()[0], sides.target_reactors.stats()[0]);
    let (i0, t0) = sides.cpu();
    let start = Instant::now();
    while start.elapsed() < window {
        ctrl.poll_admin().expect("admin");
        std::thread::sleep(Duration::from_millis(100));
    }
    let (i1, t1) = sides.cpu();
    let elapsed = start.elapsed().as_secs_f64();
    let stats_after = (sides.reactors.stats()[0], sides.target_reactors.stats()[0]);
    // 2. Then the bursts: a read after 20 ms of nothing, and ten back to back.
    let (first, rest) = loop {
        ctrl.poll_admin().expect("admin");
        match done.recv_timeout(Duration::from_millis(100)) {
            Ok(r) => break r,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(e) => panic!("the reads stopped: {e}"),
        }
    };
    sides.stop(Some(ctrl));
    IdleResult {
        initiator_pct: 100.0 * (i1 - i0).as_secs_f64() / elapsed,
        target_pct: 100.0 * (t1 - t0).as_secs_f64() / elapsed,
        sleeps: (
            stats_after.0.sleeps - stats_before.0.sleeps,
            stats_after.1.sleeps - stats_before.1.sleeps,
        ),
        first_us: median(first),
        rest_us: median(rest),
    }
}

/// Part 3: one run of each cell under one policy; IOPS by cell.
fn loaded(
    idle: IdlePolicy,
    key: &ConfiguredKey,
    pool: &DmaPool,
    knobs: &common::Knobs,
    cells: &[(bool, Workload, u16)],
) -> Vec<(f64, u64)> {
    let sides = Sides::start((idle, idle), key);
    let mut out = Vec::new();
    for tls in [false, true] {
        let mut ctrl = sides.connect(pool, key, tls);
        let ns = ctrl.namespaces()[0].clone();
        let mut gen: LoadGen<TcpQueuePair> = LoadGen::new(pool.clone(), 128, true);
        for &(_, workload, qd) in cells.iter().filter(|c| c.0 == tls) {
            let spec = knobs.spec(workload, 4096, qd, 1, SendMode::Adaptive);
            let ctrl_cell = RefCell::new(&mut ctrl);
            let mut connect = |_: usize, depth: u16| -> nvpoll::Result<_> {
                Ok((ctrl_cell.borrow_mut().connect_io_queue(depth)?, ns.clone()))
            };
            // Sleeps while measuring (a run's start and end may sleep: connecting, draining).
            let sleeps =
                || sides.reactors.stats()[0].sleeps + sides.target_reactors.stats()[0].sleeps;
            let (start, end) = (std::cell::Cell::new(None), std::cell::Cell::new(None));
            let mut tick = |phase: Phase| -> nvpoll::Result<()> {
                match phase {
                    Phase::Measuring if start.get().is_none() => start.set(Some(sleeps())),
                    Phase::Draining if end.get().is_none() => end.set(Some(sleeps())),
                    _ => {}
                }
                Ok(ctrl_cell.borrow_mut().poll_admin()?)
            };
            let r = gen
                .run(&sides.reactors, spec, &mut connect, &mut tick)
                .expect("run");
            assert!(r.failures.is_empty() && r.errors == 0, "{:?}", r.failures);
            let slept = match (start.get(), end.get()) {
                (Some(a), Some(b)) => b - a,
                _ => 0,
            };
            out.push((r.iops, slept));
        }
        gen.release_queue_pairs();
        ctrl.shutdown().expect("controller shutdown");
    }
    sides.stop(None);
    out
}

/// The platform's floor under the first read after a sleep: how long a thread asleep in `poll(2)` on an
/// eventfd, pinned to the target's core, takes to run again after a thread on the initiator's core writes the
/// eventfd (median of 200, us). With `spin`, the writer busy-polls between writes, as a polling initiator
/// does.
fn wake_floor(spin: bool) -> f64 {
    use rustix::event::{eventfd, poll, EventfdFlags, PollFd, PollFlags};
    let (icore, tcore, _, _) = common::cores();
    let fd = std::sync::Arc::new(eventfd(0, EventfdFlags::NONBLOCK).expect("eventfd"));
    let (tx, rx) = mpsc::channel::<Instant>();
    let sleeper = {
        let fd = std::sync::Arc::clone(&fd);
        std::thread::spawn(move || {
            core_affinity::set_for_current(core_affinity::CoreId { id: tcore });
            for _ in 0..200 {
                let mut fds = [PollFd::new(&*fd, PollFlags::IN)];
                poll(&mut fds, None).expect("poll");
                let woke = Instant::now();
                let mut count = [0u8; 8];
                rustix::io::read(&*fd, &mut count).expect("read the eventfd");
                tx.send(woke).expect("report");
            }
        })
    };
    let writer = std::thread::spawn(move || {
        core_affinity::set_for_current(core_affinity::CoreId { id: icore });
        let mut samples = Vec::new();
        for _ in 0..200 {
            // Long enough for the sleeper to be back in poll, and its core idle.
            let pause = Instant::now();
            while pause.elapsed() < Duration::from_millis(5) {
                if spin {
                    std::hint::spin_loop();
                } else {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            let t0 = Instant::now();
            rustix::io::write(&*fd, &1u64.to_ne_bytes()).expect("write the eventfd");
            let woke = loop {
                // The writer keeps its core busy (or not) while it waits, as it did before.
                match rx.try_recv() {
                    Ok(w) => break w,
                    Err(_) if spin => std::hint::spin_loop(),
                    Err(_) => std::thread::yield_now(),
                }
            };
            samples.push((woke - t0).as_secs_f64() * 1e6);
        }
        samples
    });
    let samples = writer.join().expect("writer");
    sleeper.join().expect("sleeper");
    median(samples)
}

fn main() {
    let knobs = common::knobs("1s", "300ms", 3);
    let window = std::env::var("NVPOLL_BENCH_IDLE")
        .map(|v| loadgen::parse_duration(&v).unwrap_or_else(|e| panic!("NVPOLL_BENCH_IDLE: {e}")))
        .unwrap_or(Duration::from_secs(3));
    let (icore, tcore, _, _) = common::cores();
    let key = ConfiguredKey::parse(KEY).expect("key");
    let pool = DmaPool::builder()
        .class(4096, 1024)
        .build()
        .expect("DMA pool");
    let policies = [IdlePolicy::Poll, IdlePolicy::hybrid()];
    println!(
        "idle: initiator core {icore}, target core {tcore}, 1 queue pair; idle window {window:?}; \
         {} rounds of {:?} (after {:?}) per loaded cell",
        knobs.runs, knobs.time, knobs.warmup
    );

    println!("\n| initiator / target policy | initiator CPU, % of a core | target CPU, % of a core | sleeps (initiator / target) | first read after 20 ms idle, us | next reads, us |");
    println!("|---|---|---|---|---|---|");
    let mut idle_results = Vec::new();
    let (poll, hybrid) = (IdlePolicy::Poll, IdlePolicy::hybrid());
    // Both polling, both hybrid, then each side hybrid alone (to show where the wake-up is paid).
    for p in [
        (poll, poll),
        (hybrid, hybrid),
        (hybrid, poll),
        (poll, hybrid),
    ] {
        let r = idle_and_wake(p, &key, &pool, window);
        println!(
            "| {} / {} | {:.2} | {:.2} | {} / {} | {:.1} | {:.1} |",
            p.0, p.1, r.initiator_pct, r.target_pct, r.sleeps.0, r.sleeps.1, r.first_us, r.rest_us
        );
        idle_results.push(r);
    }
    let (quiet_floor, busy_floor) = (wake_floor(false), wake_floor(true));
    println!(
        "\nthis machine's own wake-up, for scale: a thread asleep in poll(2) on the target's core runs again \
         {quiet_floor:.1} us after a thread on the initiator's core writes its eventfd, and {busy_floor:.1} us \
         when that thread busy-polls (medians of 200)"
    );
    let (poll, hybrid) = (&idle_results[0], &idle_results[1]);
    println!(
        "\nhybrid adds {:+.1} us to the first read after a sleep and {:+.1} us to the reads after it \
         (goal: at most 20 us and none); idle CPU: {:.2}% and {:.2}% of a core (goal: at most 1%)",
        hybrid.first_us - poll.first_us,
        hybrid.rest_us - poll.rest_us,
        hybrid.initiator_pct,
        hybrid.target_pct
    );

    if knobs.runs == 0 {
        return;
    }
    let cells: Vec<(bool, Workload, u16)> = [false, true]
        .into_iter()
        .flat_map(|tls| {
            [Workload::Randread, Workload::Randwrite]
                .into_iter()
                .flat_map(move |w| [1u16, 128].map(move |qd| (tls, w, qd)))
        })
        .collect();
    // rounds[r][policy][cell]
    let mut rounds = Vec::new();
    for round in 0..knobs.runs {
        eprintln!("idle: loaded round {} of {}", round + 1, knobs.runs);
        let order: Vec<usize> = if round % 2 == 0 {
            vec![0, 1]
        } else {
            vec![1, 0]
        };
        let mut by_policy = vec![Vec::new(), Vec::new()];
        for i in order {
            by_policy[i] = loaded(policies[i], &key, &pool, &knobs, &cells);
        }
        rounds.push(by_policy);
    }
    println!("\n| cell | poll IOPS (median) | hybrid IOPS (median) | hybrid / poll (median of the rounds' ratios) | the rounds' ratios | hybrid sleeps while measuring (both sides, all rounds) |");
    println!("|---|---|---|---|---|---|");
    for (c, &(tls, w, qd)) in cells.iter().enumerate() {
        let poll: Vec<f64> = rounds.iter().map(|r| r[0][c].0).collect();
        let hyb: Vec<f64> = rounds.iter().map(|r| r[1][c].0).collect();
        let slept: u64 = rounds.iter().map(|r| r[1][c].1).sum();
        let ratios: Vec<f64> = poll.iter().zip(&hyb).map(|(p, h)| h / p).collect();
        let list: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
        println!(
            "| qd{qd} {}{} | {:.0} | {:.0} | {:.2} | {} | {slept} |",
            w.name(),
            if tls { " tls" } else { "" },
            median(poll),
            median(hyb),
            median(ratios.clone()),
            list.join(", ")
        );
    }
}

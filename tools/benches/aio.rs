//! What the async interface (`nvpoll::aio`) costs per I/O against the raw queue-pair API, side by side:
//! 4 KiB random reads over loopback from our initiator (one thread, pinned to the first core) to our target
//! (on the last core), at qd1 and at qd128, the raw loop (submit, flush, poll, resubmit from the completion)
//! and the same work as futures (qd tasks, each `read(..).await` in a loop) on a `LocalExecutor`. Each round
//! runs both, order alternating, on a fresh queue pair of one controller; the table gives the medians and, per
//! round, async/raw IOPS and the time per I/O the adapter adds at qd1 (1/IOPS, async minus raw), as median
//! (lowest-highest). The bar: at most 0.3 us more at qd1 and at most 5% fewer IOPS at qd128.
//!
//! Before that, the adapter alone, without a network to add its noise: the same two loops over a queue pair
//! that completes every command at its next poll (no I/O, no buffers copied), nanoseconds per I/O each,
//! and what the futures add.
//!
//! `cargo bench --bench aio` (NVPOLL_BENCH_TIME per run, 2s; NVPOLL_BENCH_RUNS rounds, 5;
//! NVPOLL_AIO_ADAPTER_ONLY=1 stops after the adapter alone, for profiling it).

mod common;

use std::cell::Cell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use cpu_time::ThreadTime;
use nvpoll::aio::{AsyncQueue, LocalExecutor};
use nvpoll::api::{Completion, Controller, IoOp, IoRequest, QueuePair, Rejected};
use nvpoll::mem::DmaPool;
use nvpoll_tcp::host::{ConnectOptions, TcpController, TcpQueuePair};

const NQN: &str = "nqn.2024-01.io.nvpoll:bench";
const HOSTNQN: &str = "nqn.2024-01.io.nvpoll:bench-host";
/// Blocks of 4 KiB the reads spread over (the namespace has 65,536).
const SPAN: u64 = 60_000;

struct Run {
    iops: f64,
    cpu_us_per_io: f64,
}

fn lba(i: u64) -> u64 {
    // A cheap spread over the span (the RAM namespace does not care; the pattern just is not sequential).
    i.wrapping_mul(2_654_435_761) % SPAN
}

fn raw(qp: &mut TcpQueuePair, pool: &DmaPool, qd: usize, time: Duration) -> Run {
    let mut n = 0u64;
    for _ in 0..qd {
        let req = IoRequest {
            op: IoOp::Read,
            nsid: 1,
            lba: lba(n),
            blocks: 1,
            buf: Some(pool.alloc(4096).expect("a buffer")),
            tag: 0,
        };
        qp.submit(req).map_err(|r| r.error).expect("submit");
        n += 1;
    }
    qp.flush().expect("flush");
    let cpu0 = ThreadTime::now();
    let start = Instant::now();
    let deadline = start + time;
    let mut ios = 0u64;
    let mut stop = false;
    while !stop || qp.outstanding() > 0 {
        qp.poll(64).expect("poll");
        while let Some(c) = qp.pop_completion() {
            c.result.expect("a read");
            if stop {
                continue;
            }
            ios += 1;
            let req = IoRequest {
                op: IoOp::Read,
                nsid: 1,
                lba: lba(n),
                blocks: 1,
                buf: c.buf,
                tag: 0,
            };
            qp.submit(req).map_err(|r| r.error).expect("submit");
            n += 1;
        }
        qp.flush().expect("flush");
        if !stop && Instant::now() >= deadline {
            stop = true;
        }
    }
    let cpu = cpu0.elapsed();
    let secs = start.elapsed().as_secs_f64().min(time.as_secs_f64());
    Run {
        iops: ios as f64 / secs,
        cpu_us_per_io: cpu.as_secs_f64() * 1e6 / ios.max(1) as f64,
    }
}

fn with_futures(
    qp: TcpQueuePair,
    pool: &DmaPool,
    qd: usize,
    time: Duration,
) -> (Run, TcpQueuePair) {
    let q = AsyncQueue::new(qp);
    let mut ex = LocalExecutor::new();
    ex.drive(&q);
    let stop = Rc::new(Cell::new(false));
    let ios = Rc::new(Cell::new(0u64));
    for t in 0..qd as u64 {
        let (q, stop, ios) = (q.clone(), Rc::clone(&stop), Rc::clone(&ios));
        let mut buf = pool.alloc(4096).expect("a buffer");
        ex.spawn(async move {
            let mut i = t;
            while !stop.get() {
                let c = q.read(1, lba(i), 1, buf).await;
                c.result.expect("a read");
                buf = c.buf.expect("the buffer back");
                if !stop.get() {
                    ios.set(ios.get() + 1);
                }
                i += qd as u64;
            }
        });
    }
    let cpu0 = ThreadTime::now();
    let start = Instant::now();
    let deadline = start + time;
    while ex.tasks() > 0 {
        ex.pass();
        if !stop.get() && Instant::now() >= deadline {
            stop.set(true);
        }
    }
    let cpu = cpu0.elapsed();
    assert!(ex.take_error().is_none());
    let n = ios.get();
    let run = Run {
        iops: n as f64 / time.as_secs_f64(),
        cpu_us_per_io: cpu.as_secs_f64() * 1e6 / n.max(1) as f64,
    };
    drop(ex);
    let qp = q
        .into_queue_pair()
        .unwrap_or_else(|_| panic!("another handle to the queue is still alive"));
    (run, qp)
}

/// A queue pair that completes what was flushed at its next poll, successfully, with no I/O.
struct Instant0 {
    depth: usize,
    queued: Vec<IoRequest>,
    sent: Vec<IoRequest>,
    done: std::collections::VecDeque<Completion>,
}

impl QueuePair for Instant0 {
    fn submit(&mut self, req: IoRequest) -> Result<(), Rejected> {
        if self.queued.len() + self.sent.len() + self.done.len() >= self.depth {
            return Err(Rejected {
                error: nvpoll::Error::QueueFull,
                request: req,
            });
        }
        self.queued.push(req);
        Ok(())
    }
    fn flush(&mut self) -> nvpoll::Result<()> {
        self.sent.append(&mut self.queued);
        Ok(())
    }
    fn poll(&mut self, max: usize) -> nvpoll::Result<usize> {
        let n = self.sent.len().min(max);
        for r in self.sent.drain(..n) {
            self.done.push_back(Completion {
                tag: r.tag,
                buf: r.buf,
                result: Ok(()),
            });
        }
        Ok(n)
    }
    fn pop_completion(&mut self) -> Option<Completion> {
        self.done.pop_front()
    }
    fn outstanding(&self) -> usize {
        self.queued.len() + self.sent.len() + self.done.len()
    }
    fn depth(&self) -> usize {
        self.depth
    }
}

fn instant0(depth: usize) -> Instant0 {
    Instant0 {
        depth,
        queued: Vec::with_capacity(depth),
        sent: Vec::with_capacity(depth),
        done: std::collections::VecDeque::with_capacity(depth),
    }
}

/// Nanoseconds per I/O of the raw loop over [`Instant0`], `n` I/Os at `qd`.
fn raw_ns(qd: usize, n: u64) -> f64 {
    let mut qp = instant0(qd);
    let req = |tag| IoRequest {
        op: IoOp::Flush,
        nsid: 1,
        lba: 0,
        blocks: 0,
        buf: None,
        tag,
    };
    for t in 0..qd as u64 {
        qp.submit(req(t)).map_err(|r| r.error).expect("submit");
    }
    let start = Instant::now();
    let mut done = 0;
    while done < n {
        qp.flush().expect("flush");
        qp.poll(64).expect("poll");
        while let Some(c) = qp.pop_completion() {
            done += 1;
            qp.submit(req(c.tag)).map_err(|r| r.error).expect("submit");
        }
    }
    start.elapsed().as_nanos() as f64 / done as f64
}

/// Nanoseconds per I/O of `qd` tasks awaiting commands on [`Instant0`] through the adapter.
fn async_ns(qd: usize, n: u64) -> f64 {
    let q = AsyncQueue::new(instant0(qd));
    let mut ex = LocalExecutor::new();
    ex.drive(&q);
    let done = Rc::new(Cell::new(0u64));
    for _ in 0..qd {
        let (q, done) = (q.clone(), Rc::clone(&done));
        ex.spawn(async move {
            while done.get() < n {
                q.flush(1).await.result.expect("a command");
                done.set(done.get() + 1);
            }
        });
    }
    let start = Instant::now();
    while ex.tasks() > 0 {
        ex.pass();
    }
    start.elapsed().as_nanos() as f64 / done.get() as f64
}

fn adapter_alone(rounds: usize) {
    println!("the adapter alone (a queue pair that completes at its next poll; ns per I/O):");
    println!("| qd | raw ns/IO | async ns/IO | async adds (ns) |");
    println!("| --- | --- | --- | --- |");
    for qd in [1usize, 128] {
        let n = 2_000_000;
        let (mut r, mut a, mut d) = (vec![], vec![], vec![]);
        for round in 0..rounds {
            let (x, y) = if round % 2 == 0 {
                let x = raw_ns(qd, n);
                (x, async_ns(qd, n))
            } else {
                let y = async_ns(qd, n);
                (raw_ns(qd, n), y)
            };
            r.push(x);
            a.push(y);
            d.push(y - x);
        }
        println!(
            "| {qd} | {:.1} | {:.1} | {} |",
            median(r),
            median(a),
            spread(&d)
        );
    }
    println!();
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn spread(v: &[f64]) -> String {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{:.3} ({lo:.3}-{hi:.3})", median(v.to_vec()))
}

fn main() {
    let knobs = common::knobs("2s", "0s", 5);
    let (icore, _tcore, _ione, tone) = common::cores();
    core_affinity::set_for_current(core_affinity::CoreId { id: icore });
    adapter_alone(knobs.runs);
    if std::env::var_os("NVPOLL_AIO_ADAPTER_ONLY").is_some() {
        return;
    }
    let (_reactors, target) = common::start_target(common::ram_target(NQN, None), &tone);
    core_affinity::set_for_current(core_affinity::CoreId { id: icore });
    let pool = DmaPool::builder()
        .class(4096, 1024)
        .build()
        .expect("DMA pool");
    let opts = ConnectOptions::new(target.local_addr(), NQN, HOSTNQN);
    let mut ctrl = TcpController::connect(opts, pool.clone()).expect("connect");
    println!(
        "aio bench: initiator on core {icore}, target on {tone}, {} s per run, {} rounds",
        knobs.time.as_secs_f64(),
        knobs.runs
    );
    // A short warm-up of both paths.
    let qp = ctrl.create_queue_pair(128).expect("queue pair");
    let (_, mut qp) = with_futures(qp, &pool, 8, Duration::from_millis(300));
    raw(&mut qp, &pool, 8, Duration::from_millis(300));
    drop(qp);
    println!(
        "| qd | raw IOPS | async IOPS | async/raw IOPS | time added per I/O (us) | raw CPU us/IO | async CPU us/IO |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for qd in [1usize, 128] {
        let (mut r_iops, mut a_iops, mut ratio, mut added, mut r_cpu, mut a_cpu) =
            (vec![], vec![], vec![], vec![], vec![], vec![]);
        for round in 0..knobs.runs {
            let mut qp = ctrl.create_queue_pair(128).expect("queue pair");
            let (r, a) = if round % 2 == 0 {
                let r = raw(&mut qp, &pool, qd, knobs.time);
                let (a, _) = with_futures(qp, &pool, qd, knobs.time);
                (r, a)
            } else {
                let (a, mut qp) = with_futures(qp, &pool, qd, knobs.time);
                (raw(&mut qp, &pool, qd, knobs.time), a)
            };
            ctrl.poll_admin().expect("admin queue");
            eprintln!(
                "  qd{qd} round {round}: raw {:.0} IOPS, async {:.0} IOPS",
                r.iops, a.iops
            );
            ratio.push(a.iops / r.iops);
            added.push(1e6 / a.iops - 1e6 / r.iops);
            r_iops.push(r.iops);
            a_iops.push(a.iops);
            r_cpu.push(r.cpu_us_per_io);
            a_cpu.push(a.cpu_us_per_io);
        }
        println!(
            "| {qd} | {:.0} | {:.0} | {} | {} | {:.3} | {:.3} |",
            median(r_iops),
            median(a_iops),
            spread(&ratio),
            spread(&added),
            median(r_cpu),
            median(a_cpu)
        );
    }
    ctrl.shutdown().expect("shutdown");
}

//! Is our target as fast after thousands of connections as when fresh? One target, one reactor core; the
//! same measurement (128 KiB sequential reads at qd16 and 4 KiB random reads at qd32, one queue pair,
//! adaptive) when fresh and after each round of churn: sessions of our initiator that attach, do a little I/O
//! and shut down, admin queues that vanish, and TCP connections that say nothing. Prints each round's median,
//! its ratio to the fresh one, the reactor's pollers and the process's resident memory.
//!
//! `cargo bench --bench soak` (NVPOLL_BENCH_TIME, NVPOLL_BENCH_WARMUP, NVPOLL_BENCH_RUNS as for loopback;
//! NVPOLL_SOAK_ROUNDS=3 rounds of NVPOLL_SOAK_SESSIONS=1000 sessions).

mod common;
use std::cell::RefCell;
use std::io::Write;
use std::net::{SocketAddr, TcpStream};

use nvpoll::api::Controller;
use nvpoll::mem::DmaPool;
use nvpoll::reactor::Reactors;
use nvpoll::send::SendMode;
use nvpoll_tcp::host::{ConnectOptions, TcpController, TcpQueuePair};
use nvpoll_tools::loadgen::{self, LoadGen, RunResult, Workload};

const NQN: &str = "nqn.2024-01.io.nvpoll:soak";
const HOSTNQN: &str = "nqn.2024-01.io.nvpoll:soak-host";

fn env_usize(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .map(|v| v.parse().unwrap_or_else(|e| panic!("{key}={v}: {e}")))
        .unwrap_or(default)
}

fn rss_mib() -> f64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: f64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("resident pages");
    pages * 4096.0 / f64::from(1 << 20)
}

/// The median of `runs` runs of `size`-byte `workload` at `qd` on a fresh connection.
fn measure(
    addr: SocketAddr,
    pool: &DmaPool,
    reactors: &Reactors,
    knobs: &common::Knobs,
    (workload, size, qd): (Workload, u64, u16),
) -> RunResult {
    let mut ctrl = TcpController::connect(ConnectOptions::new(addr, NQN, HOSTNQN), pool.clone())
        .expect("attach");
    let ns = ctrl.namespaces()[0].clone();
    let mut gen: LoadGen<TcpQueuePair> = LoadGen::new(pool.clone(), qd, false);
    let spec = knobs.spec(workload, size, qd, 1, SendMode::Adaptive);
    let mut results = Vec::new();
    for _ in 0..knobs.runs {
        let cell = RefCell::new(&mut ctrl);
        let mut connect = |_: usize, depth: u16| -> nvpoll::Result<_> {
            Ok((cell.borrow_mut().connect_io_queue(depth)?, ns.clone()))
        };
        let mut tick = |_| -> nvpoll::Result<()> { Ok(cell.borrow_mut().poll_admin()?) };
        let r = gen
            .run(reactors, spec, &mut connect, &mut tick)
            .expect("run");
        assert!(r.failures.is_empty() && r.errors == 0, "{:?}", r.failures);
        results.push(r);
    }
    gen.release_queue_pairs();
    ctrl.shutdown().expect("shutdown");
    loadgen::median(results)
}

/// `n` sessions of three kinds, round robin.
fn churn(addr: SocketAddr, pool: &DmaPool, n: usize) {
    for i in 0..n {
        match i % 3 {
            0 => {
                let mut c =
                    TcpController::connect(ConnectOptions::new(addr, NQN, HOSTNQN), pool.clone())
                        .expect("attach");
                let qp = c.create_queue_pair(4).expect("I/O queue");
                drop(qp);
                c.shutdown().expect("shutdown");
            }
            1 => {
                // ICReq, then gone.
                let mut s = TcpStream::connect(addr).expect("connect");
                let mut icreq = Vec::new();
                nvpoll_tcp::pdu::encode_ic_req(
                    &mut icreq,
                    &nvpoll_tcp::pdu::IcReq {
                        pfv: 0,
                        hpda: 0,
                        digests: nvpoll_tcp::pdu::Digests::NONE,
                        maxr2t: 0,
                    },
                );
                s.write_all(&icreq).expect("ICReq");
            }
            _ => drop(TcpStream::connect(addr).expect("connect")),
        }
    }
}

fn main() {
    let knobs = common::knobs("1s", "250ms", 5);
    let rounds = env_usize("NVPOLL_SOAK_ROUNDS", 3);
    let sessions = env_usize("NVPOLL_SOAK_SESSIONS", 1000);
    let (icore, tcore, icores, tcores) = common::cores();
    let pool = DmaPool::builder()
        .class(4096, 1024)
        .class(128 << 10, 64)
        .build()
        .expect("DMA pool");
    let (target_reactors, target) = common::start_target(common::ram_target(NQN, None), &tcores);
    let addr = target.local_addr();
    let reactors = Reactors::start(&icores).expect("initiator reactor");
    println!(
        "soak: initiator core {icore}, target core {tcore}; median of {} x {:?} per cell; {rounds} rounds of \
         {sessions} sessions",
        knobs.runs, knobs.time
    );
    let cells = [
        (Workload::Read, 128u64 << 10, 16u16),
        (Workload::Randread, 4096, 32),
    ];
    println!(
        "| {:<16} | {:>9} | {:>11} | {:>9} | {:>11} | {:>7} | {:>8} |",
        "after sessions", "128k read", "vs fresh", "4k rread", "vs fresh", "pollers", "RSS MiB"
    );
    println!("|------------------|-----------|-------------|-----------|-------------|---------|----------|");
    let mut fresh = None;
    for round in 0..=rounds {
        if round > 0 {
            churn(addr, &pool, sessions);
        }
        let r: Vec<f64> = cells
            .iter()
            .map(|&c| measure(addr, &pool, &reactors, &knobs, c).iops)
            .collect();
        let base = fresh.get_or_insert_with(|| r.clone()).clone();
        println!(
            "| {:<16} | {:>9.0} | {:>11.3} | {:>9.0} | {:>11.3} | {:>7} | {:>8.1} |",
            round * sessions,
            r[0],
            r[0] / base[0],
            r[1],
            r[1] / base[1],
            target_reactors.stats()[0].pollers,
            rss_mib()
        );
    }
    println!("target: {}", target.counters());
    target.stop();
    reactors.stop().expect("stop");
    target_reactors.stop().expect("stop");
}

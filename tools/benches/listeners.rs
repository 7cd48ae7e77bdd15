//! One target process serving a plain and a TLS listener on one core, against today's single-listener target
//! and against two single-listener targets sharing that core (what a user had to run before: two busy-polling
//! processes on one core halve each other).
//!
//! Side by side in one run, 4 KiB random reads at qd32 per connection, adaptive mode, one initiator reactor and
//! one target core; each row is the median of several rounds (every round runs every row once, in turn):
//! - a plain connection alone, and a TLS connection alone, to a single-listener target (TLS optional) and to
//!   the plain or the TLS listener of a two-listener target: a second listener must cost a connection nothing;
//! - a plain and a TLS connection at once, to the single-listener target, to the two-listener target, and to
//!   two single-listener targets whose reactors share the target core.
//!
//! `cargo bench --bench listeners` (NVPOLL_BENCH_TIME, NVPOLL_BENCH_WARMUP, NVPOLL_BENCH_RUNS as for loopback).

mod common;
use std::cell::RefCell;
use std::net::SocketAddr;

use nvpoll::api::Controller;
use nvpoll::mem::DmaPool;
use nvpoll::reactor::{CoreList, Reactors};
use nvpoll::send::SendMode;
use nvpoll_target::{Backing, SubsystemConfig, TargetConfig, TargetHandle, TargetTls, TlsMode};
use nvpoll_tcp::host::{ConnectOptions, TcpController, TcpQueuePair};
use nvpoll_tcp::tls::{ConfiguredKey, IdentityVersion};
use nvpoll_tools::loadgen::{self, LoadGen, Row, RunResult, Workload};

const KEY: &str = "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:";
const NQN: &str = "nqn.2024-01.io.nvpoll:bench";
const HOSTNQN: &str = "nqn.2024-01.io.nvpoll:bench-host";

fn subsystem() -> SubsystemConfig {
    SubsystemConfig::new(NQN).namespace(Backing::Ram(64 << 20), 4096)
}

fn key() -> ConfiguredKey {
    ConfiguredKey::parse(KEY).expect("key")
}

/// A target on its own reactor on `core`; `tls` is the first listener's mode, `second` an extra listener's.
fn target(
    core: &CoreList,
    tls: TlsMode,
    second: Option<TlsMode>,
) -> (Reactors, TargetHandle, Vec<SocketAddr>) {
    let any: SocketAddr = "127.0.0.1:0".parse().expect("address literal");
    let mut config = TargetConfig::new(any).subsystem(subsystem().host_key(HOSTNQN, key()));
    config.send_mode = SendMode::Adaptive;
    if tls != TlsMode::Off {
        config.tls = Some(TargetTls::with_host_keys(
            tls == TlsMode::Required,
            &[],
            &[],
        ));
    }
    if let Some(mode) = second {
        config = config.listener(any, mode);
    }
    let (reactors, handle) = common::start_target(config, core);
    let addrs = handle.listeners().iter().map(|l| l.address).collect();
    (reactors, handle, addrs)
}

/// One connection per (address, TLS) pair, one job each, run together once.
fn measure(
    reactors: &Reactors,
    pool: &DmaPool,
    conns: &[(SocketAddr, bool)],
    knobs: &common::Knobs,
) -> RunResult {
    let mut ctrls: Vec<TcpController> = conns
        .iter()
        .map(|&(addr, tls)| {
            let mut o = ConnectOptions::new(addr, NQN, HOSTNQN);
            if tls {
                o = o.with_tls_key(&key(), IdentityVersion::V1);
            }
            TcpController::connect(o, pool.clone()).expect("connect")
        })
        .collect();
    let ns = ctrls[0].namespaces()[0].clone();
    let mut gen: LoadGen<TcpQueuePair> = LoadGen::new(pool.clone(), 32, false);
    let spec = knobs.spec(
        Workload::Randread,
        4096,
        32,
        conns.len(),
        SendMode::Adaptive,
    );
    let r = {
        let cell = RefCell::new(&mut ctrls);
        let mut connect = |job: usize, depth: u16| -> nvpoll::Result<_> {
            Ok((cell.borrow_mut()[job].connect_io_queue(depth)?, ns.clone()))
        };
        let mut tick = |_| -> nvpoll::Result<()> {
            for c in cell.borrow_mut().iter_mut() {
                c.poll_admin()?;
            }
            Ok(())
        };
        let r = gen
            .run(reactors, spec, &mut connect, &mut tick)
            .expect("run");
        assert!(r.failures.is_empty() && r.errors == 0, "{:?}", r.failures);
        r
    };
    gen.release_queue_pairs();
    for c in ctrls {
        c.shutdown().expect("shutdown");
    }
    r
}

fn main() {
    let knobs = common::knobs("1s", "250ms", 3);
    let (icore, tcore, icores, tcores) = common::cores();
    let pool = DmaPool::builder()
        .class(4096, 1024)
        .build()
        .expect("DMA pool");
    let reactors = Reactors::start(&icores).expect("initiator reactor");
    println!(
        "listeners: initiator core {icore}, target core {tcore}, 4 KiB randread, qd32 per connection, adaptive, \
         median of {} x {:?} (after {:?}) per row",
        knobs.runs, knobs.time, knobs.warmup
    );
    // Rounds, each with every target and row once, so that a drift of the machine hits all rows alike.
    let mut runs: Vec<(&str, Vec<RunResult>)> = Vec::new();
    let mut add =
        |label: &'static str, r: RunResult| match runs.iter_mut().find(|(l, _)| *l == label) {
            Some((_, v)) => v.push(r),
            None => runs.push((label, vec![r])),
        };
    for _ in 0..knobs.runs {
        // Today's single-listener target, TLS optional (it serves both kinds of host on one port).
        let (r1, h1, a1) = target(&tcores, TlsMode::Optional, None);
        add(
            "1 listener: plain alone",
            measure(&reactors, &pool, &[(a1[0], false)], &knobs),
        );
        add(
            "1 listener: TLS alone",
            measure(&reactors, &pool, &[(a1[0], true)], &knobs),
        );
        add(
            "1 listener: plain + TLS",
            measure(&reactors, &pool, &[(a1[0], false), (a1[0], true)], &knobs),
        );
        h1.stop();
        r1.stop().expect("stop");

        // One process, a plain and a TLS listener, one reactor.
        let (r2, h2, a2) = target(&tcores, TlsMode::Off, Some(TlsMode::Required));
        add(
            "2 listeners: plain alone",
            measure(&reactors, &pool, &[(a2[0], false)], &knobs),
        );
        add(
            "2 listeners: TLS alone",
            measure(&reactors, &pool, &[(a2[1], true)], &knobs),
        );
        add(
            "2 listeners: plain + TLS",
            measure(&reactors, &pool, &[(a2[0], false), (a2[1], true)], &knobs),
        );
        h2.stop();
        r2.stop().expect("stop");

        // What a user ran before: two single-listener targets, two busy-polling reactors on the one core.
        let (r3, h3, a3) = target(&tcores, TlsMode::Off, None);
        let (r4, h4, a4) = target(&tcores, TlsMode::Required, None);
        add(
            "2 targets, 1 core: plain + TLS",
            measure(&reactors, &pool, &[(a3[0], false), (a4[0], true)], &knobs),
        );
        h3.stop();
        h4.stop();
        r3.stop().expect("stop");
        r4.stop().expect("stop");
    }
    let rows: Vec<(String, RunResult)> = runs
        .into_iter()
        .map(|(l, v)| (l.to_string(), loadgen::median(v)))
        .collect();

    let table: Vec<Row> = rows
        .iter()
        .map(|(label, r)| Row {
            workload: label.clone(),
            mode: "adaptive",
            result: r.clone(),
            runs: Vec::new(),
        })
        .collect();
    print!("{}", loadgen::table(&table));
    let get = |label: &str| {
        rows.iter()
            .find(|(l, _)| l == label)
            .map(|(_, r)| r)
            .expect("row")
    };
    let iops = |label: &str| get(label).iops;
    println!();
    println!(
        "plain connection: 2 listeners / 1 listener = {:.3} IOPS",
        iops("2 listeners: plain alone") / iops("1 listener: plain alone")
    );
    println!(
        "TLS connection:   2 listeners / 1 listener = {:.3} IOPS",
        iops("2 listeners: TLS alone") / iops("1 listener: TLS alone")
    );
    println!(
        "plain + TLS at once: 2 listeners / 1 listener = {:.3} IOPS",
        iops("2 listeners: plain + TLS") / iops("1 listener: plain + TLS")
    );
    let (one, two) = (
        get("2 listeners: plain + TLS"),
        get("2 targets, 1 core: plain + TLS"),
    );
    println!(
        "plain + TLS at once: 2 targets on 1 core / 1 target with 2 listeners = {:.3} IOPS, p99 {:.1}x, p99.9 {:.1}x \
         (two busy-polling reactors on one core take turns in scheduler slices)",
        two.iops / one.iops,
        two.p99_us / one.p99_us,
        two.p999_us / one.p999_us
    );
    reactors.stop().expect("stop initiator reactor");
}

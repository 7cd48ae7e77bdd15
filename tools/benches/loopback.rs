//! Our NVMe/TCP initiator against our NVMe/TCP target over loopback, one reactor core per side, one queue pair.
//!
//! Prints, for 4 KiB random reads and writes at qd1 and qd128, without and with TLS, each send mode side by side
//! (both ends in the same mode): the median of several runs with IOPS, latency, TLS records, writes and
//! syscalls per I/O, and CPU time per I/O on the initiator's and on the target's reactor. Then the ratios the
//! send-mode design is judged by.
//!
//! Then large I/O: 128 KiB (qd16) and 1 MiB (qd4) sequential reads and writes, plain and TLS, adaptive, with
//! GB/s and the CPU time each side spends per GB.
//!
//! `cargo bench --bench loopback` (NVPOLL_BENCH_TIME=5s NVPOLL_BENCH_RUNS=5 for longer runs); `-- small` or
//! `-- large` runs only the 4 KiB or only the large-I/O part.

mod common;
use std::cell::{Cell, RefCell};

use nvpoll::api::Controller;
use nvpoll::mem::DmaPool;
use nvpoll::reactor::Reactors;
use nvpoll::send::SendMode;
use nvpoll_tcp::host::{ConnectOptions, TcpController, TcpQueuePair};
use nvpoll_tcp::tls::{ConfiguredKey, IdentityVersion};
use nvpoll_tools::loadgen::{self, LoadGen, Phase, Row, RunResult, RunSpec, Workload};

const KEY: &str = "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:";
const NQN: &str = "nqn.2024-01.io.nvpoll:bench";
const HOSTNQN: &str = "nqn.2024-01.io.nvpoll:bench-host";

struct Cell2 {
    row: Row,
    target_cpu_us: f64,
}

fn main() {
    // `cargo bench` passes --bench; a filter argument picks the part (see the top of the file).
    let knobs = common::knobs("2s", "500ms", 3);
    let common::Knobs { time, warmup, runs } = knobs;
    let (icore, tcore, icores, tcores) = common::cores();
    let key = ConfiguredKey::parse(KEY).expect("key");

    let config = common::ram_target(NQN, Some((HOSTNQN, &key)));
    let (target_reactors, target) = common::start_target(config, &tcores);
    let pool = DmaPool::builder()
        .class(4096, 1024)
        .class(128 << 10, 64)
        .class(1 << 20, 16)
        .build()
        .expect("DMA pool");
    let reactors = Reactors::start(&icores).expect("initiator reactors");

    println!(
        "loopback: initiator core {icore}, target core {tcore}, 4 KiB, 1 queue pair, median of {runs} x {time:?} \
         (after {warmup:?}) per row"
    );
    // `cargo bench --bench loopback -- large` (or `-- small`) runs one part only.
    let only = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let (small, large) = match only.as_deref() {
        None => (true, true),
        Some("small") => (true, false),
        Some("large") => (false, true),
        Some(other) => {
            eprintln!("loopback: unknown part {other:?}: give small, large or nothing (both)");
            std::process::exit(2);
        }
    };
    let mut cells = Vec::new();
    for tls in [false, true].into_iter().filter(|_| small) {
        let mut o = ConnectOptions::new(target.local_addr(), NQN, HOSTNQN);
        if tls {
            o = o.with_tls_key(&key, IdentityVersion::V0);
        }
        let mut ctrl = TcpController::connect(o, pool.clone()).expect("connect to our target");
        let ns = ctrl.namespaces()[0].clone();
        let mut gen: LoadGen<TcpQueuePair> = LoadGen::new(pool.clone(), 128, true);
        for workload in [Workload::Randread, Workload::Randwrite] {
            for qd in [1u16, 128] {
                for send_mode in SendMode::ALL {
                    let spec = knobs.spec(workload, 4096, qd, 1, send_mode);
                    target.set_send_mode(send_mode);
                    let (results, tcpu) = measure(
                        &mut gen,
                        &mut ctrl,
                        &ns,
                        spec,
                        &reactors,
                        &target_reactors,
                        runs,
                    );
                    let label = format!(
                        "qd{qd} x 1 {}{}",
                        workload.name(),
                        if tls { " tls" } else { "" }
                    );
                    let row = Row {
                        workload: label,
                        mode: send_mode.name(),
                        result: loadgen::median(results.clone()),
                        runs: results,
                    };
                    cells.push(Cell2 {
                        row,
                        target_cpu_us: tcpu,
                    });
                }
            }
        }
        gen.release_queue_pairs();
        ctrl.shutdown().expect("controller shutdown");
    }
    let rows: Vec<Row> = cells
        .iter()
        .map(|c| Row {
            runs: Vec::new(),
            ..clone_row(&c.row)
        })
        .collect();
    if small {
        print!("{}", loadgen::table(&rows));
        println!(
            "\n| {:<24} | {:<8} | {:>15} | {:>12} |",
            "workload", "mode", "initiator us/IO", "target us/IO"
        );
        for c in &cells {
            println!(
                "| {:<24} | {:<8} | {:>15.2} | {:>12.2} |",
                c.row.workload, c.row.mode, c.row.result.cpu_us_per_io, c.target_cpu_us
            );
        }
        ratios(&cells);
    }
    if large {
        large_io(&target, &key, &pool, &reactors, &target_reactors, &knobs);
    }
    reactors.stop().expect("stop initiator reactors");
    target.stop();
    target_reactors.stop().expect("stop target reactors");
}

/// `runs` measured runs of `spec` on one queue pair of `ctrl`: the results, and the target reactor's median CPU
/// time per I/O (us) across the measured windows.
#[allow(clippy::too_many_arguments)]
fn measure(
    gen: &mut LoadGen<TcpQueuePair>,
    ctrl: &mut TcpController,
    ns: &nvpoll::api::Namespace,
    spec: RunSpec,
    reactors: &Reactors,
    target_reactors: &Reactors,
    runs: usize,
) -> (Vec<RunResult>, f64) {
    let mut results = Vec::new();
    let mut tcpu = Vec::new();
    for _ in 0..runs {
        // The target reactor's CPU time across the measured window.
        let cpu_at = || target_reactors.stats()[0].cpu_time;
        let (start, end) = (Cell::new(None), Cell::new(None));
        let ctrl_cell = RefCell::new(&mut *ctrl);
        let mut connect = |_: usize, depth: u16| -> nvpoll::Result<_> {
            Ok((ctrl_cell.borrow_mut().connect_io_queue(depth)?, ns.clone()))
        };
        let mut tick = |phase: Phase| -> nvpoll::Result<()> {
            match phase {
                Phase::Measuring if start.get().is_none() => start.set(Some(cpu_at())),
                Phase::Draining if end.get().is_none() && start.get().is_some() => {
                    end.set(Some(cpu_at()))
                }
                _ => {}
            }
            Ok(ctrl_cell.borrow_mut().poll_admin()?)
        };
        let r = gen
            .run(reactors, spec, &mut connect, &mut tick)
            .expect("run");
        assert!(r.failures.is_empty() && r.errors == 0, "{:?}", r.failures);
        let t = match (start.get(), end.get()) {
            (Some(s), Some(e)) if r.iops > 0.0 => {
                e.saturating_sub(s).as_secs_f64() * 1e6 / (r.iops * spec.time.as_secs_f64())
            }
            _ => f64::NAN,
        };
        tcpu.push(t);
        results.push(r);
    }
    tcpu.sort_by(f64::total_cmp);
    (results, tcpu[tcpu.len() / 2])
}

/// Large I/O: 128 KiB at qd16 and 1 MiB at qd4, sequential reads and writes, plain and TLS, adaptive: GB/s and
/// CPU time per GB on each side.
#[allow(clippy::too_many_arguments)]
fn large_io(
    target: &nvpoll_target::TargetHandle,
    key: &ConfiguredKey,
    pool: &DmaPool,
    reactors: &Reactors,
    target_reactors: &Reactors,
    knobs: &common::Knobs,
) {
    let runs = knobs.runs;
    println!(
        "\n| {:<24} | {:>9} | {:>7} | {:>8} | {:>8} | {:>17} | {:>14} |",
        "large I/O (adaptive)",
        "IOPS",
        "GB/s",
        "p50 us",
        "p99 us",
        "initiator CPU s/GB",
        "target CPU s/GB"
    );
    println!(
        "|--------------------------|-----------|---------|----------|----------|--------------------|-----------------|"
    );
    target.set_send_mode(SendMode::Adaptive);
    let mut gbps = Vec::new();
    for tls in [false, true] {
        let mut o = ConnectOptions::new(target.local_addr(), NQN, HOSTNQN);
        if tls {
            o = o.with_tls_key(key, IdentityVersion::V0);
        }
        let mut ctrl = TcpController::connect(o, pool.clone()).expect("connect to our target");
        let ns = ctrl.namespaces()[0].clone();
        for (size, qd) in [(128u64 << 10, 16u16), (1 << 20, 4)] {
            let mut gen: LoadGen<TcpQueuePair> = LoadGen::new(pool.clone(), 16, false);
            for workload in [Workload::Read, Workload::Write] {
                let spec = knobs.spec(workload, size, qd, 1, SendMode::Adaptive);
                let (results, tcpu) = measure(
                    &mut gen,
                    &mut ctrl,
                    &ns,
                    spec,
                    reactors,
                    target_reactors,
                    runs,
                );
                let r = loadgen::median(results);
                let per_gb = 1e9 / size as f64 / 1e6; // I/Os per GB, in millions: us/IO -> s/GB
                let label = format!(
                    "{} {} qd{qd}{}",
                    if size >= 1 << 20 { "1m" } else { "128k" },
                    workload.name(),
                    if tls { " tls" } else { "" }
                );
                let gb_s = r.iops * size as f64 / 1e9;
                println!(
                    "| {:<24} | {:>9.0} | {:>7.2} | {:>8.1} | {:>8.1} | {:>18.3} | {:>15.3} |",
                    label,
                    r.iops,
                    gb_s,
                    r.p50_us,
                    r.p99_us,
                    r.cpu_us_per_io * per_gb,
                    tcpu * per_gb
                );
                gbps.push((label, gb_s));
            }
            gen.release_queue_pairs();
        }
        ctrl.shutdown().expect("controller shutdown");
    }
    for (label, plain) in gbps.iter().filter(|(l, _)| !l.ends_with(" tls")) {
        if let Some((_, tls)) = gbps.iter().find(|(l, _)| *l == format!("{label} tls")) {
            println!("{label}: TLS reaches {:.0}% of plain", 100.0 * tls / plain);
        }
    }
}

fn clone_row(r: &Row) -> Row {
    Row {
        workload: r.workload.clone(),
        mode: r.mode,
        result: r.result.clone(),
        runs: Vec::new(),
    }
}

fn find<'a>(cells: &'a [Cell2], workload: &str, mode: &str) -> &'a RunResult {
    &cells
        .iter()
        .find(|c| c.row.workload == workload && c.row.mode == mode)
        .expect("row")
        .row
        .result
}

/// The comparisons the send modes are judged by, as ratios.
fn ratios(cells: &[Cell2]) {
    println!();
    for w in ["randread", "randwrite"] {
        let tls = format!("qd128 x 1 {w} tls");
        let (inl, def, ada) = (
            find(cells, &tls, "inline"),
            find(cells, &tls, "deferred"),
            find(cells, &tls, "adaptive"),
        );
        println!(
            "{tls}: deferred vs inline: records/IO {:.2}x fewer, CPU/IO {:.0}% lower, IOPS {:.2}x; adaptive/best IOPS {:.2}",
            inl.records_per_io / def.records_per_io.max(1e-9),
            100.0 * (1.0 - def.cpu_us_per_io / inl.cpu_us_per_io),
            def.iops / inl.iops,
            ada.iops / inl.iops.max(def.iops)
        );
        let plain = format!("qd128 x 1 {w}");
        let best = |wl: &str| {
            SendMode::ALL
                .iter()
                .map(|m| find(cells, wl, m.name()).iops)
                .fold(0.0, f64::max)
        };
        println!(
            "{w} qd128: TLS reaches {:.0}% of the IOPS without TLS (best mode each)",
            100.0 * best(&tls) / best(&plain)
        );
        for suffix in ["", " tls"] {
            let q1 = format!("qd1 x 1 {w}{suffix}");
            let (inl, def, ada) = (
                find(cells, &q1, "inline"),
                find(cells, &q1, "deferred"),
                find(cells, &q1, "adaptive"),
            );
            println!(
                "{q1}: mean us inline {:.2} / deferred {:.2} / adaptive {:.2}; p99 us {:.1} / {:.1} / {:.1}",
                inl.mean_us, def.mean_us, ada.mean_us, inl.p99_us, def.p99_us, ada.p99_us
            );
        }
    }
}

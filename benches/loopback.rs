//! Our NVMe/TCP initiator against our NVMe/TCP target over loopback, one reactor core per side.
//!
//! Prints, for 4 KiB random reads and writes at qd1 and qd128 (one queue pair), the median of several runs:
//! IOPS, latency, and CPU time per I/O on the initiator's and the target's reactor. This is the figure issue 4
//! asks for (a C userspace stack reaches about 840K IOPS at qd128 randread and about 9 us at qd1 here).
//!
//! `cargo bench --bench loopback` (set NVPOLL_BENCH_TIME=5s, NVPOLL_BENCH_RUNS=5 for longer runs).

use std::cell::{Cell, RefCell};
use std::net::SocketAddr;
use std::time::Duration;

use nvpoll::api::Controller;
use nvpoll::loadgen::{self, LoadGen, Phase, Row, RunSpec, Workload};
use nvpoll::mem::DmaPool;
use nvpoll::reactor::{CoreList, Reactors};
use nvpoll::send::SendMode;
use nvpoll_tcp::host::{ConnectOptions, TcpController, TcpQueuePair};
use nvpoll_tcp::target::{Backing, SubsystemConfig, Target, TargetConfig};

fn env_duration(key: &str, default: &str) -> Duration {
    let v = std::env::var(key).unwrap_or_else(|_| default.to_string());
    loadgen::parse_duration(&v).unwrap_or_else(|e| panic!("{key}: {e}"))
}

fn main() {
    // `cargo bench` passes --bench; a filter argument, if any, is ignored.
    let time = env_duration("NVPOLL_BENCH_TIME", "2s");
    let warmup = env_duration("NVPOLL_BENCH_WARMUP", "500ms");
    let runs: usize = std::env::var("NVPOLL_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let all = CoreList::all();
    let (icore, tcore) = match all.cores() {
        [only] => (*only, *only),
        cores => (cores[0], cores[cores.len() - 1]),
    };
    let icores = CoreList::parse(&icore.to_string()).expect("initiator core");
    let tcores = CoreList::parse(&tcore.to_string()).expect("target core");

    let nqn = "nqn.2024-01.io.nvpoll:bench";
    let listen: SocketAddr = "127.0.0.1:0".parse().expect("address literal");
    let config = TargetConfig::new(listen)
        .subsystem(SubsystemConfig::new(nqn).namespace(Backing::Ram(256 << 20), 4096));
    let target_reactors = Reactors::start(&tcores).expect("target reactors");
    let target = Target::bind(config)
        .expect("bind target")
        .start(&target_reactors)
        .expect("start target");

    let pool = DmaPool::builder()
        .class(4096, 1024)
        .build()
        .expect("DMA pool");
    let hostnqn = "nqn.2024-01.io.nvpoll:bench-host";
    let mut ctrl = TcpController::connect(
        ConnectOptions::new(target.local_addr(), nqn, hostnqn),
        pool.clone(),
    )
    .expect("connect to our target");
    let ns = ctrl.namespaces()[0].clone();
    let reactors = Reactors::start(&icores).expect("initiator reactors");
    let mut gen: LoadGen<TcpQueuePair> = LoadGen::new(pool, 128, true);

    println!(
        "loopback: initiator core {icore}, target core {tcore}, 4 KiB, 1 queue pair, {runs} x {time:?} (after {warmup:?}) per row"
    );
    let mut rows = Vec::new();
    let mut target_cpu = Vec::new();
    for workload in [Workload::Randread, Workload::Randwrite] {
        for (qd, send_mode) in [1u16, 128]
            .into_iter()
            .flat_map(|q| SendMode::ALL.map(|m| (q, m)))
        {
            let spec = RunSpec {
                qd,
                jobs: 1,
                io_size: 4096,
                workload,
                rwmix: 0,
                verify: false,
                warmup,
                time,
                send_mode,
                drain_timeout: Duration::from_secs(30),
            };
            target.set_send_mode(send_mode);
            let mut results = Vec::new();
            let mut tcpu = Vec::new();
            for _ in 0..runs {
                // The target reactor's CPU time across the measured window.
                let cpu_at = || target_reactors.stats()[0].cpu_time;
                let start = Cell::new(None);
                let end = Cell::new(None);
                let ctrl_cell = RefCell::new(&mut ctrl);
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
                    ctrl_cell.borrow_mut().poll_admin()?;
                    Ok(())
                };
                let r = gen
                    .run(&reactors, spec, &mut connect, &mut tick)
                    .expect("run");
                let t = match (start.get(), end.get()) {
                    (Some(s), Some(e)) if r.iops > 0.0 => {
                        e.saturating_sub(s).as_secs_f64() * 1e6 / (r.iops * time.as_secs_f64())
                    }
                    _ => f64::NAN,
                };
                tcpu.push(t);
                results.push(r);
            }
            let median = loadgen::median(results.clone());
            let mut sorted = tcpu.clone();
            sorted.sort_by(f64::total_cmp);
            target_cpu.push(sorted[sorted.len() / 2]);
            rows.push(Row {
                workload: format!("qd{qd} x 1 {}", workload.name()),
                mode: send_mode.name(),
                result: median,
                runs: results,
            });
        }
    }
    print!("{}", loadgen::table(&rows));
    println!(
        "| {:<22} | {:>16} | {:>16} |",
        "workload", "initiator us/IO", "target us/IO"
    );
    for (row, t) in rows.iter().zip(&target_cpu) {
        println!(
            "| {:<22} | {:>16.2} | {:>16.2} |",
            row.workload, row.result.cpu_us_per_io, t
        );
    }
    gen.release_queue_pairs();
    reactors.stop().expect("stop initiator reactors");
    ctrl.shutdown().expect("controller shutdown");
    target.stop();
    target_reactors.stop().expect("stop target reactors");
}

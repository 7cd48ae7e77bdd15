//! What the loopback benches (loopback, hostile, listeners, soak) share: their NVPOLL_BENCH_* knobs, the run
//! they measure, the choice of cores and our target on its own reactors.
#![allow(dead_code)] // each bench compiles this module on its own and uses only some of it

use std::net::SocketAddr;
use std::time::Duration;

use nvpoll::reactor::{CoreList, IdlePolicy, Reactors};
use nvpoll::send::SendMode;
use nvpoll_target::{Backing, SubsystemConfig, Target, TargetConfig, TargetHandle, TargetTls};
use nvpoll_tcp::tls::ConfiguredKey;
use nvpoll_tools::loadgen::{self, RunSpec, Workload};

/// How long and how often each measured run goes.
pub(crate) struct Knobs {
    /// NVPOLL_BENCH_TIME: the measured part of a run.
    pub time: Duration,
    /// NVPOLL_BENCH_WARMUP: before it.
    pub warmup: Duration,
    /// NVPOLL_BENCH_RUNS: runs per cell (the median is reported).
    pub runs: usize,
}

impl Knobs {
    /// One measured run: `jobs` jobs of `workload` in `io_size`-byte I/O at `qd` each, sending in `send_mode`,
    /// measured for the knobs' time after their warm-up; no reads mixed in, no verify, 30 s to drain.
    pub(crate) fn spec(
        &self,
        workload: Workload,
        io_size: u64,
        qd: u16,
        jobs: usize,
        send_mode: SendMode,
    ) -> RunSpec {
        RunSpec {
            qd,
            jobs,
            io_size,
            workload,
            rwmix: 0,
            verify: false,
            warmup: self.warmup,
            time: self.time,
            send_mode,
            drain_timeout: Duration::from_secs(30),
        }
    }
}

/// Reads the knobs from the environment, with these defaults.
pub(crate) fn knobs(time: &str, warmup: &str, runs: usize) -> Knobs {
    let duration = |key: &str, default: &str| {
        let v = std::env::var(key).unwrap_or_else(|_| default.to_string());
        loadgen::parse_duration(&v).unwrap_or_else(|e| panic!("{key}: {e}"))
    };
    Knobs {
        time: duration("NVPOLL_BENCH_TIME", time),
        warmup: duration("NVPOLL_BENCH_WARMUP", warmup),
        runs: std::env::var("NVPOLL_BENCH_RUNS")
            .ok()
            .map(|v| {
                v.parse()
                    .unwrap_or_else(|e| panic!("NVPOLL_BENCH_RUNS={v}: {e}"))
            })
            .unwrap_or(runs),
    }
}

/// The initiator's core (the first) and the target's (the last), each also as a one-core list.
pub(crate) fn cores() -> (usize, usize, CoreList, CoreList) {
    let all = CoreList::all();
    let (icore, tcore) = match all.cores() {
        [only] => (*only, *only),
        cores => (cores[0], cores[cores.len() - 1]),
    };
    let one = |c: usize| CoreList::parse(&c.to_string()).expect("a core number");
    (icore, tcore, one(icore), one(tcore))
}

/// A target on 127.0.0.1 (a free port) serving subsystem `nqn` with one 256 MiB RAM namespace of 4 KiB blocks;
/// with `tls`, (HOSTNQN, KEY), TLS is optional and that host may also connect with that key.
pub(crate) fn ram_target(nqn: &str, tls: Option<(&str, &ConfiguredKey)>) -> TargetConfig {
    let listen: SocketAddr = "127.0.0.1:0".parse().expect("address literal");
    let mut config = TargetConfig::new(listen)
        .subsystem(SubsystemConfig::new(nqn).namespace(Backing::Ram(256 << 20), 4096));
    if let Some((hostnqn, key)) = tls {
        config.tls = Some(TargetTls::with_host_keys(
            false,
            &[(hostnqn.to_string(), key.clone())],
            &[nqn.to_string()],
        ));
    }
    config
}

/// Starts reactors on `cores`, and our target with `config` on them.
pub(crate) fn start_target(config: TargetConfig, cores: &CoreList) -> (Reactors, TargetHandle) {
    start_target_idle(config, cores, IdlePolicy::Poll)
}

/// As [`start_target`], with reactors of the given idle policy.
pub(crate) fn start_target_idle(
    config: TargetConfig,
    cores: &CoreList,
    idle: IdlePolicy,
) -> (Reactors, TargetHandle) {
    let reactors = Reactors::builder()
        .idle(idle)
        .start(cores)
        .expect("target reactors");
    let target = Target::bind(config)
        .expect("bind target")
        .start(&reactors)
        .expect("start target");
    (reactors, target)
}

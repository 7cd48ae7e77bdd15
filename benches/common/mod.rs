//! What the loopback benches (loopback, hostile) share: their NVPOLL_BENCH_* knobs and the choice of cores.

use std::time::Duration;

use nvpoll::reactor::CoreList;
use nvpoll_tools::loadgen;

/// How long and how often each measured run goes.
pub struct Knobs {
    /// NVPOLL_BENCH_TIME: the measured part of a run.
    pub time: Duration,
    /// NVPOLL_BENCH_WARMUP: before it.
    pub warmup: Duration,
    /// NVPOLL_BENCH_RUNS: runs per cell (the median is reported).
    pub runs: usize,
}

/// Reads the knobs from the environment, with these defaults.
pub fn knobs(time: &str, warmup: &str, runs: usize) -> Knobs {
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
pub fn cores() -> (usize, usize, CoreList, CoreList) {
    let all = CoreList::all();
    let (icore, tcore) = match all.cores() {
        [only] => (*only, *only),
        cores => (cores[0], cores[cores.len() - 1]),
    };
    let one = |c: usize| CoreList::parse(&c.to_string()).expect("a core number");
    (icore, tcore, one(icore), one(tcore))
}

//! The stateful session fuzzer at length: `cargo bench -p nvpoll-target --bench exactly_once`.
//!
//! Runs rounds against a target on its own reactor for NVPOLL_EXACTLY_ONCE_SECS seconds (default 60), each
//! round from a new seed (printed, so that a failure repeats with `NVPOLL_EXACTLY_ONCE_SEED=... cargo test
//! -p nvpoll-target --test target_exactly_once`). Exits 1 at the first command answered twice or never.

use nvpoll_testkit::exactly_once;
use nvpoll_testkit::target as target_common;

use std::time::{Duration, Instant};

fn main() {
    let secs: u64 = match std::env::var("NVPOLL_EXACTLY_ONCE_SECS") {
        Ok(s) => s.parse().unwrap_or_else(|_| {
            eprintln!("NVPOLL_EXACTLY_ONCE_SECS must be a number of seconds, not '{s}'");
            std::process::exit(2)
        }),
        Err(_) => 60,
    };
    // `cargo bench` passes --bench; nothing else is taken.
    let t = target_common::TestTarget::start(|c| c);
    let start = Instant::now();
    let end = start + Duration::from_secs(secs);
    let mut seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1);
    let mut total = exactly_once::Tally::default();
    let mut last_report = start;
    eprintln!("exactly_once: {secs} s of rounds against a target on one reactor");
    while Instant::now() < end {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        match exactly_once::run(t.addr, seed, 1, 1000, None) {
            Ok(tally) => {
                total.rounds += tally.rounds;
                total.commands += tally.commands;
                total.answers += tally.answers;
                total.r2ts += tally.r2ts;
                total.h2c_pdus += tally.h2c_pdus;
                total.ended += tally.ended;
                total.held_aers += tally.held_aers;
            }
            Err(e) => {
                eprintln!("exactly_once: FAIL (seed {seed:#x}; repeat with NVPOLL_EXACTLY_ONCE_SEED={seed:x}):\n{e}");
                std::process::exit(1);
            }
        }
        if last_report.elapsed() >= Duration::from_secs(10) {
            last_report = Instant::now();
            eprintln!(
                "exactly_once: {:.0} s: {total}",
                start.elapsed().as_secs_f64()
            );
        }
    }
    let c = t.counters();
    if c.internal_errors != 0 {
        eprintln!("exactly_once: FAIL: the target hit internal errors: {c}");
        std::process::exit(1);
    }
    println!(
        "exactly_once: {:.0} s, {total}; {:.0} commands/s; target: {c}",
        start.elapsed().as_secs_f64(),
        total.commands as f64 / start.elapsed().as_secs_f64()
    );
}

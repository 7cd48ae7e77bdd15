//! The machine under a benchmark: how long two cores take to pass a cache line back and forth, and the
//! system's TCP congestion control.
//!
//! On loopback, every I/O moves its data and the PDUs around it from the target's core to the initiator's,
//! so what one line costs to cross decides the result as much as either program does. On a VM it is not a
//! constant: the hypervisor places the virtual CPUs on physical cores as it likes and moves them. On the
//! 2-vCPU development VM (AMD EPYC), the round trip measured here was about 110 ns for minutes, then about
//! 500 ns (and sometimes 70 ns: two hyperthreads of one core), and our perf against our target read 4 KiB at
//! qd128 at 0.85-1.0M IOPS in the first state and 0.45-0.6M in the second, flipping with it from one run to
//! the next (issue 47). A benchmark that does not say which machine it ran on compares two machines.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The line the two threads pass: alone in its cache line.
#[repr(align(128))]
struct Line(AtomicU32);

/// Batches measured; the median one is reported (a batch a preemption hit is an outlier, not the machine).
const BATCHES: usize = 5;

/// Why [`core_round_trip`] measured nothing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RoundTripError {
    /// Zero rounds were asked for.
    #[error("the round trip needs at least one round")]
    NoRounds,
    /// A core is not among those this process may run on.
    #[error("core {core} is not among the cores this process may run on ({allowed})")]
    CoreNotAllowed {
        /// The core asked for.
        core: usize,
        /// The cores this process may use.
        allowed: nvpoll::reactor::CoreList,
    },
    /// A measuring thread could not be started.
    #[error("starting a thread: {0}")]
    Spawn(#[source] std::io::Error),
    /// A measuring thread could not be pinned to its core.
    #[error("could not pin a thread to core {0}")]
    Pin(usize),
    /// The echo thread stopped before the measurement was done.
    #[error("the other thread stopped")]
    EchoStopped,
    /// A measuring thread panicked.
    #[error("the {0} thread panicked")]
    Panicked(&'static str),
}

/// The system's default TCP congestion control (`net.ipv4.tcp_congestion_control`), or `None` where it cannot
/// be read. Our connections keep it, but a loopback connection under BBR gets cubic
/// (`nvpoll_wire::conn::loopback_congestion`), which the binaries say at start.
///
/// ```
/// if let Some(cc) = nvpoll_tools::machine::system_congestion() {
///     assert!(!cc.is_empty() && !cc.contains(char::is_whitespace));
/// }
/// ```
pub fn system_congestion() -> Option<String> {
    let cc = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control").ok()?;
    let cc = cc.trim();
    (!cc.is_empty()).then(|| cc.to_string())
}

/// The round trip of a cache line between cores `a` and `b`: one thread pinned to each, passing a flag back
/// and forth `rounds` times in each of five batches; the median batch's mean round trip.
///
/// Run it while nothing else spins on those cores (a busy-polling reactor there shares its core with the
/// measuring thread, and the result is the scheduler's time slice, not the machine). `a == b` measures
/// two threads taking turns on one core.
pub fn core_round_trip(a: usize, b: usize, rounds: u32) -> Result<Duration, RoundTripError> {
    if rounds == 0 {
        return Err(RoundTripError::NoRounds);
    }
    let all = nvpoll::reactor::CoreList::all();
    for core in [a, b] {
        if !all.cores().contains(&core) {
            return Err(RoundTripError::CoreNotAllowed { core, allowed: all });
        }
    }
    let line = Arc::new(Line(AtomicU32::new(0)));
    // Two threads on one core take turns only when the spinning one yields.
    let same = a == b;
    let wait = move || {
        if same {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    };
    let total = rounds as usize * BATCHES;
    let echo = {
        let line = Arc::clone(&line);
        std::thread::Builder::new()
            .name("core-rtt-echo".into())
            .spawn(move || -> Result<(), RoundTripError> {
                if !core_affinity::set_for_current(core_affinity::CoreId { id: b }) {
                    // Tell the other side, which waits for the first pass.
                    line.0.store(u32::MAX, Ordering::Release);
                    return Err(RoundTripError::Pin(b));
                }
                for _ in 0..total {
                    loop {
                        match line.0.load(Ordering::Acquire) {
                            1 => break,
                            u32::MAX => return Ok(()),
                            _ => wait(),
                        }
                    }
                    line.0.store(0, Ordering::Release);
                }
                Ok(())
            })
            .map_err(RoundTripError::Spawn)?
    };
    let ping = {
        let line = Arc::clone(&line);
        std::thread::Builder::new()
            .name("core-rtt-ping".into())
            .spawn(move || -> Result<Vec<Duration>, RoundTripError> {
                if !core_affinity::set_for_current(core_affinity::CoreId { id: a }) {
                    line.0.store(u32::MAX, Ordering::Release);
                    return Err(RoundTripError::Pin(a));
                }
                let mut batches = Vec::with_capacity(BATCHES);
                for _ in 0..BATCHES {
                    let start = Instant::now();
                    for _ in 0..rounds {
                        if line
                            .0
                            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
                            .is_err()
                        {
                            // The echo thread gave up (u32::MAX).
                            return Err(RoundTripError::EchoStopped);
                        }
                        loop {
                            match line.0.load(Ordering::Acquire) {
                                0 => break,
                                u32::MAX => return Err(RoundTripError::EchoStopped),
                                _ => wait(),
                            }
                        }
                    }
                    batches.push(start.elapsed() / rounds);
                }
                Ok(batches)
            })
            .map_err(RoundTripError::Spawn)?
    };
    let pinged = ping
        .join()
        .map_err(|_| RoundTripError::Panicked("measuring"))?;
    if pinged.is_err() {
        // Release the echo thread if it still waits.
        line.0.store(u32::MAX, Ordering::Release);
    }
    let echoed = echo.join().map_err(|_| RoundTripError::Panicked("echo"))?;
    echoed?;
    let mut batches = pinged?;
    batches.sort();
    Ok(batches[BATCHES / 2])
}

/// The round trip between `a` and `b` said in words for a report, or why it could not be measured.
pub fn describe_round_trip(a: usize, b: usize) -> String {
    match core_round_trip(a, b, 20_000) {
        Ok(d) => format!(
            "cores {a} and {b} pass a cache line back and forth in {} ns",
            d.as_nanos()
        ),
        Err(e) => format!("cores {a} and {b}: round trip not measured ({e})"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measures_a_round_trip_between_two_cores_or_on_one() {
        let all = nvpoll::reactor::CoreList::all();
        let a = all.cores()[0];
        let b = *all.cores().last().unwrap();
        let d = core_round_trip(a, b, 200).unwrap();
        assert!(d > Duration::ZERO, "a round trip takes time");
        assert!(d < Duration::from_secs(1), "{d:?}");
    }

    #[test]
    fn refuses_a_core_it_may_not_use_and_zero_rounds() {
        let e = core_round_trip(0, 100_000, 10).unwrap_err();
        assert!(
            matches!(e, RoundTripError::CoreNotAllowed { core: 100_000, .. }),
            "{e:?}"
        );
        assert!(e.to_string().contains("core 100000 is not among"), "{e}");
        assert!(matches!(
            core_round_trip(0, 0, 0),
            Err(RoundTripError::NoRounds)
        ));
    }
}

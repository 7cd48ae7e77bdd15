//! `core_rtt`: how long two cores take to pass a cache line back and forth, the machine fact that decides
//! loopback benchmarks on a VM (see `nvpoll_tools::machine`). The bench scripts run it between runs.

use clap::Parser;

/// Measure the cache-line round trip between two cores (run it while nothing spins on them).
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// The first core.
    #[arg(default_value_t = 0)]
    a: usize,
    /// The second core.
    #[arg(default_value_t = 1)]
    b: usize,
    /// Round trips in each of the five batches (the median batch is reported).
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
}

fn main() {
    let args = Args::parse();
    match nvpoll_tools::machine::core_round_trip(args.a, args.b, args.rounds) {
        Ok(d) => println!(
            "core {} <-> core {}: cache-line round trip {} ns",
            args.a,
            args.b,
            d.as_nanos()
        ),
        Err(e) => {
            eprintln!("nvpoll-core-rtt: {e}");
            std::process::exit(1);
        }
    }
}

//! nvpoll's tools. The perf engine ([`loadgen`]), the binaries' logger ([`logging`]) and `nvpoll-setup` live
//! here rather than in the core crate or a driver, so an embedder of `nvpoll` and a transport compiles neither
//! clap, histograms, JSON nor a logger; `perf`, `identify`, the target and the benchmarks use this crate.
#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub mod loadgen;
pub mod logging;
pub mod machine;

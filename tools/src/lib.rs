//! nvpoll's tools. The perf engine ([`loadgen`]) lives here rather than in the core crate, so an embedder of
//! `nvpoll` and a transport compiles neither its histograms nor its JSON; `perf` and the benchmarks use it.
#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub mod loadgen;

//! nvpoll's tools: the products a user installs (`cargo install --path tools` gives `nvpoll-perf`,
//! `nvpoll-target`, `nvpoll-identify`, `nvpoll-rpc`, `nvpoll-setup`, `nvpoll-hello-world` and
//! `nvpoll-core-rtt`), and what they share: the perf engine ([`loadgen`]), the command line and controller
//! opening ([`cli`]), the logger ([`logging`]) and the machine checks ([`machine`]). They live here rather than
//! in the core crate or a driver, so an embedder of `nvpoll` or a transport compiles neither clap, histograms,
//! JSON nor a logger. The loopback, idle, scaling and connection benchmarks are this crate's benches.
#![forbid(unsafe_code)]

pub mod cli;
pub mod loadgen;
pub mod logging;
pub mod machine;

/// The embedding guide, docs/embedding.md: its Rust examples compile as this crate's doctests, so that the
/// guide cannot drift from the API.
#[cfg(doctest)]
#[doc = include_str!("../../docs/embedding.md")]
pub struct EmbeddingGuide;

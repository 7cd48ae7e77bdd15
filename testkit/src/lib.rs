//! What nvpoll's tests and benches share, as a crate of its own (`publish = false`) instead of files pulled in
//! by `#[path]`:
//!
//! - [`target`]: our target on its own reactor, a DMA pool for our initiator, and a raw host that speaks
//!   NVMe/TCP PDU by PDU (to script good and hostile hosts); [`target::kernel`] drives the Linux host in the
//!   guest;
//! - [`exactly_once`]: the stateful fuzzer that checks every command gets exactly one answer;
//! - [`tls`]: TLS peers (OpenSSL, GnuTLS) as child processes, and blocking drivers for our sans-IO TLS.
//!
//! Test code: it panics with a message where a test would fail anyway.
#![forbid(unsafe_code)]

pub mod exactly_once;
pub mod target;
pub mod tls;

//! # nvpoll
//!
//! A polled-mode userspace NVMe stack. This root crate holds what every transport shares:
//!
//! - [`mem`]: pinned DMA memory from hugepages (or ordinary pages, with a warning), handed out as [`mem::DmaBuf`]s;
//! - [`reactor`]: run-to-completion reactor threads, one pinned per core, with pollers, cross-core messages,
//!   timed pollers and an end-of-iteration flush hook;
//! - [`spec`]: NVMe data structures (SQE, CQE, status codes, Identify pages, controller registers), the crate
//!   `nvpoll-spec` re-exported;
//! - [`api`]: the controller / namespace / queue-pair API that the transports (`nvpoll-tcp`, `nvpoll-pcie`)
//!   implement and that an embedding storage engine uses;
//! - [`trid`]: SPDK-style transport ID strings;
//! - [`units`]: sizes and durations as users write them (`4k`, `1G`, `500ms`);
//! - [`Error`]: the one error type of the crate.
//!
//! The flow of one I/O: the application, running on reactor N, calls [`api::QueuePair::submit`] on a queue pair
//! that reactor N owns. The transport builds the command and either sends it at once or queues it for the
//! reactor's end-of-poll flush. The reactor's poller calls [`api::QueuePair::process_completions`], which hands
//! each finished request back, with its buffer, to the application's callback.
// Unsafe code lives in `mem` (pinned DMA memory) and `uring` (the buffer ring shared with io_uring) only, each of
// which allows it for itself.
#![deny(unsafe_code)]

pub mod aio;
pub mod api;
mod completion_fd;
mod error;
pub mod mem;
pub mod reactor;
pub mod send;
pub mod trid;
pub mod units;
pub mod uring;

/// NVMe data structures: the crate [`nvpoll_spec`], re-exported so that `nvpoll::spec::Sqe` names the same type.
pub use nvpoll_spec as spec;

pub use error::{BoxError, Error, ErrorClass, Fault, Result, Retry, TransportError};

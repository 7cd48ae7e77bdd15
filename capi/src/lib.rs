//! # libnvpoll: nvpoll's C interface
//!
//! A cdylib (`libnvpoll.so`) and a staticlib (`libnvpoll.a`) for engines written in C or C++, with the header
//! `include/nvpoll.h` generated from this crate by cbindgen (`tests/header.rs` regenerates it and fails when
//! the committed one differs). Every function is `nvpoll_*`, `extern "C"`, and returns an `int`: 0 or a
//! count on success, a negative [`NvpollError`] on failure, whose words `nvpoll_last_error_message()` gives.
//!
//! The handles are opaque: a DMA pool ([`NvpollPool`]), a controller opened from a transport ID string
//! ([`NvpollCtrl`]: NVMe/TCP, with TLS when a PSK is given, or PCIe through VFIO), its queue pairs
//! ([`NvpollQpair`]) and DMA buffers ([`NvpollBuf`]). A request submitted on a queue pair completes exactly
//! once, through its callback (run from `nvpoll_qpair_process_completions` or `nvpoll_qpair_reap`, on the
//! caller's thread) or, submitted without one, as an entry `nvpoll_qpair_reap` hands back. The buffer of a
//! request belongs to the queue pair from the submit until that completion.
//!
//! The Rust side of the interface is the [`ffi`] module (its functions are what the header declares); the
//! rest of the crate is the safe state behind the handles. docs/embedding.md ("From C") has the guide.

// Unsafe code lives in `ffi` (the C functions: raw pointers, callbacks, one epoll call), which allows it for
// itself.
#![deny(unsafe_code)]

mod error;
pub mod ffi;
mod handles;

pub use error::{NvpollError, NvpollFault, NvpollRetry};
pub use ffi::{NvpollCb, NvpollCompletion, NvpollCtrlOpts, NvpollNsInfo};
pub use handles::{NvpollBuf, NvpollCtrl, NvpollPool, NvpollQpair};

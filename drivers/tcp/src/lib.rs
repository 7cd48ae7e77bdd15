//! NVMe/TCP host for nvpoll: PDUs, TLS 1.3 PSK, the connection and the initiator (the target is crate nvpoll-target).
#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub mod conn;
pub mod dhchap;
mod error;
pub mod host;
pub mod multipath;
pub mod pdu;
pub mod queue;
pub mod tls;

pub use error::Error;

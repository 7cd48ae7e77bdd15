//! NVMe/TCP for nvpoll: PDUs, initiator and target.
#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub mod conn;
mod error;
pub mod host;
pub mod pdu;
pub mod queue;
pub mod target;
pub mod tls;

pub use error::Error;

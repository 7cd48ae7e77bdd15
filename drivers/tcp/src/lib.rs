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

pub use error::Error;

/// TLS 1.3 with external PSKs: the crate [`nvpoll_tls`], re-exported so that `nvpoll_tcp::tls::Psk` names the
/// same type.
pub use nvpoll_tls as tls;

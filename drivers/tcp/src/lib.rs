//! The NVMe/TCP host of nvpoll: the controller and its queue pairs ([`host`], [`queue`]), and multipath with
//! ANA ([`multipath`]), on the wire layer `nvpoll-wire` (PDUs, the connection, DH-HMAC-CHAP) and
//! `nvpoll-tls`, which it re-exports for its users. The target, crate `nvpoll-target`, sits on the same
//! wire layer, not on this crate.
#![forbid(unsafe_code)]

pub mod host;
pub mod multipath;
pub mod queue;

pub use nvpoll_wire::{
    conn, dhchap, keyring, pdu, ConnectRefusal, Error, KeyRenewal, RekeyCause, RenewBy,
};

/// TLS 1.3 with external PSKs: the crate [`nvpoll_tls`], re-exported so that `nvpoll_tcp::tls::Psk` names the
/// same type.
pub use nvpoll_tls as tls;

//! The NVMe/TCP wire layer that nvpoll's host (`nvpoll-tcp`) and target (`nvpoll-target`) share:
//!
//! - [`pdu`]: the PDUs of NVMe/TCP 1.0 (ICReq/ICResp, capsules, data, R2T, termination requests), their
//!   header and data digests, encoded and decoded without panics;
//! - [`conn`]: one connection, plain or TLS 1.3 (through `nvpoll-tls`), with its receive buffer and its send
//!   path (inline, or gathered and coalesced at the reactor's flush);
//! - [`dhchap`]: NVMe in-band authentication (DH-HMAC-CHAP), the host's and the controller's side;
//! - [`KeyRenewal`]: when a TLS connection renews its keys (KeyUpdate, or connecting again);
//! - [`keyring`]: a configured TLS key's PSK handed to the Linux kernel's `.nvme` keyring;
//! - [`Error`]: what can go wrong on the wire, for both sides.
#![forbid(unsafe_code)]
// Wire and parse code, where a silent truncation corrupts a field.
#![deny(clippy::cast_possible_truncation)]

/// A wire enum: `#[repr]` with the spec's values, and `FROM(v)`, the variant with wire value `v` if there is one.
/// Attributes before the name (its documentation, more derives) go on the enum.
macro_rules! wire_enum {
    ($(#[$attr:meta])* $name:ident: $repr:ident, $from:ident; $($(#[doc = $doc:literal])* $variant:ident = $value:literal,)*) => {
        $(#[$attr])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr($repr)]
        pub enum $name {
            $($(#[doc = $doc])* $variant = $value,)*
        }

        impl $name {
            /// The variant with wire value `v`, if there is one.
            pub const fn $from(v: $repr) -> Option<$name> {
                $(if v == $value {
                    return Some($name::$variant);
                })*
                None
            }
        }
    };
}

pub mod conn;
pub mod dhchap;
mod error;
pub mod keyring;
pub mod pdu;
mod rekey;

pub use error::{ConnectRefusal, Error, RekeyCause};
pub use rekey::{KeyRenewal, RenewBy};

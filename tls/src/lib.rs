//! TLS 1.3 with external PSKs, as NVMe/TCP uses it (NVMe/TCP 1.1 §3.6): sans-IO client and server
//! handshakes, the record layer, and the NVMe PSK interchange format, identities and derivation.
//!
//! Nothing here touches a socket. The caller moves bytes:
//!
//! 1. [`Handshake::client`] returns the ClientHello to send; [`Handshake::server`] waits for one.
//! 2. Feed received bytes to [`Handshake::read`]; send what it appends to `out`; drop the
//!    [`Progress::consumed`] bytes from the receive buffer and keep the rest. Repeat until
//!    [`Progress::done`]. On error the fatal alert is already in `out`: send it and close.
//! 3. [`Handshake::into_session`], then [`Session::seal`] plaintext (PDUs, gathered from several slices)
//!    into records and [`Session::open`] received records into a plaintext reassembly buffer, starting
//!    with the bytes the handshake did not consume. After each `open`, send what
//!    [`Session::write_pending`] appends (a KeyUpdate reply, or the fatal alert after an error).
//!
//! On the hot path prefer [`Session::seal_to_slice`] and [`Session::open_to_slice`]: they write into the
//! caller's (reused) buffers, while the Vec forms zero-fill the room they grow first, since safe Rust
//! cannot hand uninitialized memory to the AEAD. The bench `tls` measures both against raw AES-GCM.
//!
//! In a non-blocking socket loop (one connection, `rx` the receive buffer, `tx` the send buffer):
//!
//! ```text
//! connect:   (hs, first) = Handshake::client(cfg)?;  tx.extend(first)
//! readable:  read(fd) into rx;  p = hs.read(&rx, &mut tx)?;  rx.drain(..p.consumed)
//!            if p.done { session = hs.into_session()?;  then open(&rx, ..) what is left }
//! writable:  write(fd, &tx); drop what was written (the handshake never needs more than tx)
//! deadline:  hs.state() says what is awaited; the caller closes the socket
//! ```
//!
//! What is supported: TLS_AES_128_GCM_SHA256 and TLS_AES_256_GCM_SHA384 (the suite follows the PSK's
//! hash), psk_dhe_ke over x25519 or secp256r1 with HelloRetryRequest, psk_ke only where both sides enable
//! it, the "ext binder" of an external PSK, middlebox-compatibility ChangeCipherSpec, KeyUpdate both ways,
//! NewSessionTicket absorbed by the client. The server never sends tickets, never accepts 0-RTT data, and
//! never offers certificates. A handshake deadline is the caller's: [`Handshake::state`] says where it
//! stands.
//!
//! Keys renew on their own ([`KeyLimits`], RFC 8446 §5.5): a session sends KeyUpdate (asking the peer to
//! update too) once its sending key has sealed 2^23 records or the peer's key has opened as many, and never
//! seals past 2^24 records under one key ([`TlsError::KeyLimitReached`]: connect again). Peers differ in
//! what they take: OpenSSL answers every request; GnuTLS 3.7 ends the session with internal_error when
//! more than about eight KeyUpdates arrive at once, so a caller that sets a low threshold spaces them out.
//!
//! Key material is zeroized on drop and never printed (Debug says `<redacted>`).
//!
//! # Example
//!
//! ```
//! use nvpoll_tls::{
//!     ClientConfig, ConfiguredKey, Derivation, Handshake, IdentityVersion, ServerConfig,
//! };
//!
//! let key = ConfiguredKey::parse("NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:")?;
//! let (identity, psk) = key.derive(
//!     IdentityVersion::V0,
//!     "nqn.psk-test-host",
//!     "nqn.psk-test-subsys",
//!     Derivation::Rfc8446,
//! );
//! assert_eq!(identity, "NVMe0R01 nqn.psk-test-host nqn.psk-test-subsys");
//!
//! // The two ends, with a Vec standing in for each direction of the TCP connection.
//! let (mut client, mut to_server) = Handshake::client(ClientConfig::new(identity.clone(), psk.clone()))?;
//! let mut server = Handshake::server(ServerConfig::with_psk(identity, psk));
//! let mut to_client = Vec::new();
//!
//! while !(client.is_done() && server.is_done()) {
//!     // What a socket loop does on readable: read, feed, drop what was consumed, send the output.
//!     let p = server.read(&to_server, &mut to_client)?;
//!     to_server.drain(..p.consumed);
//!     let p = client.read(&to_client, &mut to_server)?;
//!     to_client.drain(..p.consumed);
//! }
//! let mut client = client.into_session()?;
//! let mut server = server.into_session()?;
//! assert_eq!(server.psk_identity(), b"NVMe0R01 nqn.psk-test-host nqn.psk-test-subsys");
//!
//! // A PDU header and its data, gathered into records of at most 16 KiB.
//! let header = [4u8; 24];
//! let data = vec![0x5a; 20000];
//! let records = client.seal(&[&header, &data], &mut to_server)?;
//! assert_eq!(records, 2);
//!
//! // The receive side decrypts whole records into a reassembly buffer.
//! let mut plain = Vec::new();
//! let consumed = server.open(&to_server, &mut plain)?;
//! to_server.drain(..consumed);
//! assert_eq!(plain.len(), 24 + 20000);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![forbid(unsafe_code)]
// Wire and parse code, where a silent truncation corrupts a field.
#![deny(clippy::cast_possible_truncation)]

mod client;
mod common;
mod error;
mod handshake;
mod keys;
mod kx;
mod msgs;
mod record;
mod schedule;
mod server;
mod session;

pub use client::ClientConfig;
pub use common::{HandshakeState, Negotiated, Role};
pub use error::{AlertDescription, TlsError};
pub use handshake::{Handshake, Progress};
pub use keys::{
    ConfiguredKey, Derivation, IdentityVersion, KeyError, KeyHmac, ParsedIdentity, Psk, RetainedKey,
};
pub use kx::Group;
pub use record::{CipherSuite, MAX_CIPHERTEXT, MAX_PLAINTEXT, RECORD_OVERHEAD};
pub use schedule::HashAlg;
pub use server::{PskLookup, ServerConfig};
pub use session::{KeyLimits, Session, SessionStats, KEY_UPDATE_LEN};

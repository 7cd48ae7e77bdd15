//! What the handshake driver ([`super::handshake`]), the two sides' state machines ([`super::client`],
//! [`super::server`]) and the established session ([`super::session`]) share: the record-level state of a
//! handshake, where it stands, what it agreed on, and which end we are. It depends on none of them.

use super::error::{AlertDescription, TlsError};
use super::kx::Group;
use super::msgs::TLS12;
use super::record::{ct, write_plain, CipherSuite, Traffic, MAX_PLAINTEXT};

/// Where a handshake stands (for the caller's deadline handling and logs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum HandshakeState {
    /// Client: ClientHello sent (again, after a HelloRetryRequest), waiting for ServerHello.
    ClientWaitServerHello,
    /// Client: waiting for EncryptedExtensions.
    ClientWaitEncryptedExtensions,
    /// Client: waiting for the server's Finished.
    ClientWaitFinished,
    /// Server: waiting for ClientHello.
    ServerWaitClientHello,
    /// Server: HelloRetryRequest sent, waiting for the second ClientHello.
    ServerWaitSecondClientHello,
    /// Server: its flight sent, waiting for the client's Finished.
    ServerWaitFinished,
    /// Complete.
    Done,
    /// Failed; the error was returned and the alert written.
    Failed,
}

/// Which end of the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// The initiator (NVMe host).
    Client,
    /// The target.
    Server,
}

/// What the handshake agreed on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Negotiated {
    /// The cipher suite.
    pub suite: CipherSuite,
    /// The (EC)DHE group, None for psk_ke.
    pub group: Option<Group>,
    /// The PSK identity the client used.
    pub identity: Vec<u8>,
    /// Whether a HelloRetryRequest was needed.
    pub hello_retry: bool,
}

/// The record-level state both sides share.
pub(crate) struct Core {
    /// Keys for what the peer sends (None: plaintext).
    pub read: Option<Traffic>,
    /// Keys for what we send (None: plaintext).
    pub write: Option<Traffic>,
    /// Handshake bytes not yet forming a whole message.
    pub hs_buf: Vec<u8>,
    /// Whether a dummy ChangeCipherSpec is tolerated now.
    pub ccs_allowed: bool,
    /// Server: bytes of undecryptable records still to skip as rejected 0-RTT data.
    pub early_skip: usize,
    /// Server: skip application-data records before keys (0-RTT data after a HelloRetryRequest).
    pub skip_plain_app: bool,
    pub scratch: Vec<u8>,
}

impl Core {
    pub(crate) fn new(ccs_allowed: bool) -> Core {
        Core {
            read: None,
            write: None,
            hs_buf: Vec::new(),
            ccs_allowed,
            early_skip: 0,
            skip_plain_app: false,
            scratch: Vec::new(),
        }
    }

    /// Writes handshake messages: plaintext before our handshake keys, protected after.
    pub(crate) fn write_handshake(
        &mut self,
        msgs: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), TlsError> {
        self.write_handshake_as(msgs, TLS12, out)
    }

    /// As [`Core::write_handshake`], with the legacy record version for plaintext (0x0301 for the first
    /// ClientHello, as middleboxes expect).
    pub(crate) fn write_handshake_as(
        &mut self,
        msgs: &[u8],
        legacy_version: u16,
        out: &mut Vec<u8>,
    ) -> Result<(), TlsError> {
        match &mut self.write {
            None => write_plain(ct::HANDSHAKE, legacy_version, msgs, out),
            Some(t) => {
                for chunk in msgs.chunks(MAX_PLAINTEXT) {
                    t.seal(ct::HANDSHAKE, chunk, out)?;
                }
            }
        }
        Ok(())
    }

    /// Writes the dummy ChangeCipherSpec of middlebox compatibility mode.
    pub(crate) fn write_ccs(&mut self, out: &mut Vec<u8>) {
        write_plain(ct::CHANGE_CIPHER_SPEC, TLS12, &[1], out);
    }

    pub(crate) fn write_alert(&mut self, alert: AlertDescription, out: &mut Vec<u8>) {
        let body = [2, alert.code()];
        match &mut self.write {
            None => write_plain(ct::ALERT, TLS12, &body, out),
            Some(t) => {
                // Best effort: the connection is failing anyway.
                let _ = t.seal(ct::ALERT, &body, out);
            }
        }
    }
}

/// Checks that a handshake message is of the type `want` the state waits for; `expected` is the error's
/// words for another.
pub(crate) fn expect(typ: u8, want: u8, expected: &'static str) -> Result<(), TlsError> {
    if typ == want {
        Ok(())
    } else {
        Err(TlsError::UnexpectedMessage(expected))
    }
}

/// What either side says to a handshake message after its handshake is done.
pub(crate) const AFTER_FINISHED: TlsError =
    TlsError::UnexpectedMessage("handshake message after Finished");

/// An alert record's body as an error (any alert during the handshake ends it).
pub(crate) fn alert_error(body: &[u8]) -> TlsError {
    if body.len() != 2 {
        return TlsError::Decode("alert");
    }
    TlsError::PeerAlert(AlertDescription::from_code(body[1]))
}

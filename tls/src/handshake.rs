//! The sans-IO handshake driver shared by client and server: record framing, handshake-message
//! reassembly, ChangeCipherSpec tolerance, key changes, and fatal alerts.
//!
//! Invariants kept here for both sides:
//! - a handshake message never spans a key change (else unexpected_message);
//! - plaintext handshake records are accepted only before the peer's handshake keys, protected ones only
//!   after;
//! - a dummy ChangeCipherSpec (one byte, 0x01) is ignored between the first ClientHello and the peer's
//!   Finished, and is unexpected_message anywhere else;
//! - after a failure every call returns the same error and nothing more is read.

use std::fmt;

use super::client::{ClientConfig, ClientHs};
use super::common::{alert_error, Core, HandshakeState, Negotiated, Role};
use super::error::TlsError;
use super::msgs::next_message;
use super::record::{ct, header, HEADER_LEN, MAX_CIPHERTEXT, MAX_PLAINTEXT};
use super::server::{ServerConfig, ServerHs};
use super::session::Session;

/// What one [`Handshake::read`] call did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// Bytes of `input` used (whole records only). The caller drops them and keeps the rest; after `done`,
    /// the rest belongs to [`Session::open`].
    pub consumed: usize,
    /// The handshake is complete: call [`Handshake::into_session`].
    pub done: bool,
}

/// The per-side logic: consume one whole handshake message.
pub(crate) enum Side {
    Client(Box<ClientHs>),
    Server(Box<ServerHs>),
}

/// A TLS 1.3 PSK handshake in progress, client or server, driven by bytes (no I/O inside).
///
/// Feed it whatever the socket gave with [`Handshake::read`], send whatever it appends to `out`, and when
/// [`Progress::done`] is set, turn it into a [`Session`] and hand it the unconsumed bytes. On error the
/// alert has already been appended to `out`: send it, then close the socket.
pub struct Handshake {
    core: Core,
    side: Side,
    failed: Option<TlsError>,
}

impl Handshake {
    /// Starts a client handshake: returns the handshake and the first flight (the ClientHello record) to
    /// send.
    pub fn client(cfg: ClientConfig) -> Result<(Handshake, Vec<u8>), TlsError> {
        let mut core = Core::new(true);
        let mut out = Vec::new();
        let hs = ClientHs::start(cfg, &mut core, &mut out)?;
        Ok((
            Handshake {
                core,
                side: Side::Client(Box::new(hs)),
                failed: None,
            },
            out,
        ))
    }

    /// Starts a server handshake, waiting for a ClientHello.
    pub fn server(cfg: ServerConfig) -> Handshake {
        Handshake {
            core: Core::new(false),
            side: Side::Server(Box::new(ServerHs::new(cfg))),
            failed: None,
        }
    }

    /// Consumes the whole records at the start of `input` (stopping after the one that completes the
    /// handshake) and appends what must be sent to `out`. A partial record is left unconsumed: call again
    /// with it and more bytes. On a fatal error the alert is appended to `out` and the error returned, now
    /// and on every later call.
    pub fn read(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<Progress, TlsError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let mut pos = 0;
        match self.read_records(input, &mut pos, out) {
            Ok(()) => Ok(Progress {
                consumed: pos,
                done: self.is_done(),
            }),
            Err(e) => {
                if let Some(alert) = e.alert() {
                    self.core.write_alert(alert, out);
                }
                self.core.read = None;
                self.core.write = None;
                self.failed = Some(e.clone());
                Err(e)
            }
        }
    }

    fn read_records(
        &mut self,
        input: &[u8],
        pos: &mut usize,
        out: &mut Vec<u8>,
    ) -> Result<(), TlsError> {
        while !self.is_done() {
            let Some((typ, len)) = header(&input[*pos..]) else {
                break;
            };
            // What the header alone rules out fails at once, without waiting for the body.
            match typ {
                ct::APPLICATION_DATA if len > MAX_CIPHERTEXT => {
                    return Err(TlsError::RecordOverflow)
                }
                ct::HANDSHAKE | ct::ALERT | ct::CHANGE_CIPHER_SPEC if len > MAX_PLAINTEXT => {
                    return Err(TlsError::RecordOverflow)
                }
                ct::APPLICATION_DATA | ct::HANDSHAKE | ct::ALERT | ct::CHANGE_CIPHER_SPEC => {}
                _ => return Err(TlsError::UnexpectedMessage("unknown record content type")),
            }
            if input.len() - *pos < HEADER_LEN + len {
                break;
            }
            let record = &input[*pos..*pos + HEADER_LEN + len];
            *pos += HEADER_LEN + len;
            self.read_record(record, out)?;
        }
        Ok(())
    }

    fn read_record(&mut self, record: &[u8], out: &mut Vec<u8>) -> Result<(), TlsError> {
        let body = &record[HEADER_LEN..];
        match record[0] {
            ct::CHANGE_CIPHER_SPEC => {
                if !self.core.ccs_allowed || !self.core.hs_buf.is_empty() {
                    return Err(TlsError::UnexpectedMessage("change_cipher_spec"));
                }
                if body != [1] {
                    return Err(TlsError::UnexpectedMessage("change_cipher_spec value"));
                }
                Ok(())
            }
            ct::ALERT => Err(alert_error(body)),
            ct::HANDSHAKE => {
                if self.core.read.is_some() {
                    return Err(TlsError::UnexpectedMessage(
                        "plaintext handshake record after keys",
                    ));
                }
                if body.is_empty() {
                    return Err(TlsError::Decode("empty handshake record"));
                }
                self.core.hs_buf.extend_from_slice(body);
                self.process(out)
            }
            _ => {
                let Some(read) = self.core.read.as_mut() else {
                    if self.core.skip_plain_app {
                        return Ok(());
                    }
                    return Err(TlsError::UnexpectedMessage(
                        "protected record before handshake keys",
                    ));
                };
                let mut scratch = std::mem::take(&mut self.core.scratch);
                scratch.clear();
                let r = match read.open(record, &mut scratch) {
                    Err(TlsError::BadRecordMac) if self.core.early_skip >= record.len() => {
                        // Rejected 0-RTT data under keys we never derived: skip it.
                        self.core.early_skip -= record.len();
                        Ok(())
                    }
                    Err(e) => Err(e),
                    Ok(inner) => {
                        self.core.early_skip = 0;
                        match inner {
                            ct::HANDSHAKE if scratch.is_empty() => {
                                Err(TlsError::Decode("empty handshake record"))
                            }
                            ct::HANDSHAKE => {
                                self.core.hs_buf.extend_from_slice(&scratch);
                                self.process(out)
                            }
                            ct::ALERT => Err(alert_error(&scratch)),
                            ct::APPLICATION_DATA => Err(TlsError::UnexpectedMessage(
                                "application data during the handshake",
                            )),
                            _ => Err(TlsError::UnexpectedMessage("unknown inner content type")),
                        }
                    }
                };
                self.core.scratch = scratch;
                r
            }
        }
    }

    /// Handles every whole message in the reassembly buffer.
    fn process(&mut self, out: &mut Vec<u8>) -> Result<(), TlsError> {
        while let Some((typ, len)) = next_message(&self.core.hs_buf)? {
            let msg: Vec<u8> = self.core.hs_buf.drain(..len).collect();
            let keys_changed = match &mut self.side {
                Side::Client(c) => c.handle(&mut self.core, typ, &msg, out)?,
                Side::Server(s) => s.handle(&mut self.core, typ, &msg, out)?,
            };
            if keys_changed && !self.core.hs_buf.is_empty() {
                return Err(TlsError::UnexpectedMessage(
                    "handshake message spans a key change",
                ));
            }
        }
        Ok(())
    }

    /// Whether the handshake is complete.
    pub fn is_done(&self) -> bool {
        self.failed.is_none() && self.state() == HandshakeState::Done
    }

    /// Where the handshake stands.
    pub fn state(&self) -> HandshakeState {
        if self.failed.is_some() {
            return HandshakeState::Failed;
        }
        match &self.side {
            Side::Client(c) => c.state(),
            Side::Server(s) => s.state(),
        }
    }

    /// Client or server.
    pub fn role(&self) -> Role {
        match &self.side {
            Side::Client(_) => Role::Client,
            Side::Server(_) => Role::Server,
        }
    }

    /// The PSK identity in use: the client's configured one, or on the server the one the client chose
    /// (once its ClientHello was accepted).
    pub fn psk_identity(&self) -> Option<&[u8]> {
        match &self.side {
            Side::Client(c) => Some(c.identity()),
            Side::Server(s) => s.identity(),
        }
    }

    /// What was agreed, once done.
    pub fn negotiated(&self) -> Option<Negotiated> {
        if !self.is_done() {
            return None;
        }
        match &self.side {
            Side::Client(c) => Some(c.negotiated()),
            Side::Server(s) => s.negotiated(),
        }
    }

    /// The session for application data, once done (else `InvalidUse`, or the handshake's error).
    pub fn into_session(self) -> Result<Session, TlsError> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        let negotiated = self
            .negotiated()
            .ok_or(TlsError::InvalidUse("handshake not complete"))?;
        let role = self.role();
        let (Some(read), Some(write)) = (self.core.read, self.core.write) else {
            return Err(TlsError::InvalidUse("handshake not complete"));
        };
        Ok(Session::new(role, negotiated, read, write))
    }
}

impl fmt::Debug for Handshake {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Handshake")
            .field("role", &self.role())
            .field("state", &self.state())
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

//! TLS errors and alert descriptions.

use std::fmt;

/// A TLS alert description (RFC 8446 §6).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AlertDescription {
    /// 0: orderly shutdown of one direction.
    CloseNotify,
    /// 10
    UnexpectedMessage,
    /// 20
    BadRecordMac,
    /// 22
    RecordOverflow,
    /// 40
    HandshakeFailure,
    /// 47
    IllegalParameter,
    /// 50
    DecodeError,
    /// 51
    DecryptError,
    /// 70
    ProtocolVersion,
    /// 71
    InsufficientSecurity,
    /// 80
    InternalError,
    /// 90
    UserCanceled,
    /// 109
    MissingExtension,
    /// 110
    UnsupportedExtension,
    /// 115
    UnknownPskIdentity,
    /// Any other code.
    Other(u8),
}

impl AlertDescription {
    /// The wire code.
    pub fn code(self) -> u8 {
        use AlertDescription::*;
        match self {
            CloseNotify => 0,
            UnexpectedMessage => 10,
            BadRecordMac => 20,
            RecordOverflow => 22,
            HandshakeFailure => 40,
            IllegalParameter => 47,
            DecodeError => 50,
            DecryptError => 51,
            ProtocolVersion => 70,
            InsufficientSecurity => 71,
            InternalError => 80,
            UserCanceled => 90,
            MissingExtension => 109,
            UnsupportedExtension => 110,
            UnknownPskIdentity => 115,
            Other(c) => c,
        }
    }

    /// From the wire code.
    pub fn from_code(code: u8) -> AlertDescription {
        use AlertDescription::*;
        match code {
            0 => CloseNotify,
            10 => UnexpectedMessage,
            20 => BadRecordMac,
            22 => RecordOverflow,
            40 => HandshakeFailure,
            47 => IllegalParameter,
            50 => DecodeError,
            51 => DecryptError,
            70 => ProtocolVersion,
            71 => InsufficientSecurity,
            80 => InternalError,
            90 => UserCanceled,
            109 => MissingExtension,
            110 => UnsupportedExtension,
            115 => UnknownPskIdentity,
            c => Other(c),
        }
    }
}

impl fmt::Display for AlertDescription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AlertDescription::Other(c) => write!(f, "alert {c}"),
            a => write!(f, "{a:?} ({})", a.code()),
        }
    }
}

/// Everything that ends a TLS handshake or session. [`TlsError::alert`] is the alert we send for it
/// (the handshake and the session already queue that alert themselves).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// The PSK binder did not verify: the client holds a different key for this identity.
    #[error("PSK binder does not verify (wrong PSK for the identity)")]
    BadBinder,
    /// The peer's Finished did not verify (wrong PSK or a tampered handshake).
    #[error("peer's Finished does not verify")]
    BadFinished,
    /// None of the client's PSK identities is known here.
    #[error("unknown PSK identity")]
    UnknownIdentity,
    /// A record failed authentication (bad tag, wrong key, tampered or truncated).
    #[error("record failed authentication (bad record MAC)")]
    BadRecordMac,
    /// A record longer than TLS allows.
    #[error("record too long")]
    RecordOverflow,
    /// A message or record that is not allowed in this state.
    #[error("unexpected message: {0}")]
    UnexpectedMessage(&'static str),
    /// A malformed message.
    #[error("decode error: {0}")]
    Decode(&'static str),
    /// A well-formed message with a value that is not allowed.
    #[error("illegal parameter: {0}")]
    IllegalParameter(&'static str),
    /// No acceptable set of parameters (suite, group, key exchange mode, PSK).
    #[error("handshake failure: {0}")]
    HandshakeFailure(&'static str),
    /// The peer does not speak TLS 1.3.
    #[error("peer does not offer TLS 1.3")]
    ProtocolVersion,
    /// A required extension is missing.
    #[error("missing extension: {0}")]
    MissingExtension(&'static str),
    /// The server sent an extension the client did not offer.
    #[error("unsupported extension {0:#06x} from server")]
    UnsupportedExtension(u16),
    /// The peer sent a fatal alert.
    #[error("peer sent alert {0}")]
    PeerAlert(AlertDescription),
    /// The peer closed its side with close_notify (no more data will come).
    #[error("peer closed the TLS session (close_notify)")]
    Closed,
    /// A caller error: a bad configuration or a call in the wrong state.
    #[error("invalid use: {0}")]
    InvalidUse(&'static str),
    /// Sealing would take our sending key past its hard limit ([`crate::KeyLimits::hard_limit`]): nothing
    /// was sealed. The session stays usable for close_notify; connect again with a fresh handshake.
    #[error("the sending key reached its record limit; a new session is needed")]
    KeyLimitReached,
    /// The crypto provider failed (key generation, RNG, or the sequence numbers ran out).
    #[error("internal error: {0}")]
    Internal(&'static str),
}

impl TlsError {
    /// The alert to send to the peer for this error, if any (none for a peer's alert, close_notify or a
    /// caller error).
    pub fn alert(&self) -> Option<AlertDescription> {
        use AlertDescription as A;
        Some(match self {
            TlsError::BadBinder | TlsError::BadFinished => A::DecryptError,
            TlsError::UnknownIdentity => A::UnknownPskIdentity,
            TlsError::BadRecordMac => A::BadRecordMac,
            TlsError::RecordOverflow => A::RecordOverflow,
            TlsError::UnexpectedMessage(_) => A::UnexpectedMessage,
            TlsError::Decode(_) => A::DecodeError,
            TlsError::IllegalParameter(_) => A::IllegalParameter,
            TlsError::HandshakeFailure(_) => A::HandshakeFailure,
            TlsError::ProtocolVersion => A::ProtocolVersion,
            TlsError::MissingExtension(_) => A::MissingExtension,
            TlsError::UnsupportedExtension(_) => A::UnsupportedExtension,
            TlsError::Internal(_) => A::InternalError,
            TlsError::PeerAlert(_)
            | TlsError::Closed
            | TlsError::InvalidUse(_)
            | TlsError::KeyLimitReached => return None,
        })
    }
}

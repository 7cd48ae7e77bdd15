//! The error type of the NVMe/TCP crate.

use nvpoll::spec::Status;

/// Everything that can go wrong in NVMe/TCP, initiator or target.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A socket call failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The peer closed the connection.
    #[error("connection closed by peer")]
    Closed,
    /// The connection is gone and will not come back for this command: the controller was given up (its
    /// loss timeout expired).
    #[error("{0}")]
    Lost(&'static str),
    /// The peer sent a malformed PDU.
    #[error("malformed PDU from peer: {0}")]
    Pdu(#[from] crate::pdu::PduError),
    /// The peer sent a well-formed PDU that breaks the protocol here (unknown command ID, data beyond the
    /// command's buffer, an R2T for a read, ...).
    #[error("protocol violation by peer: {0}")]
    Protocol(String),
    /// The peer ended the connection with a termination request.
    #[error("peer sent a termination request: fes {fes:#x}, fei {fei:#x}")]
    TermReq {
        /// Fatal error status.
        fes: u16,
        /// Fatal error information.
        fei: u32,
    },
    /// A command completed with an error status where the caller needed success (e.g. Fabrics Connect).
    #[error("{what} failed with NVMe status {status}")]
    Command {
        /// Which command.
        what: &'static str,
        /// Its status.
        status: Status,
    },
    /// The TLS handshake or a record failed (wrong PSK, unknown identity, bad record MAC, ...).
    #[error("TLS: {0}")]
    Tls(#[from] crate::tls::TlsError),
    /// In-band authentication (DH-HMAC-CHAP) failed or was required without a key.
    #[error("DH-HMAC-CHAP: {0}")]
    Auth(String),
    /// Something did not happen in time.
    #[error("timed out waiting for {0}")]
    Timeout(&'static str),
    /// The caller asked for something invalid.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The queue is full.
    #[error("queue full")]
    QueueFull,
}

impl Error {
    /// Wraps an OS error with a short description.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}

/// The `what` of the [`Error::Command`] a host gets when Fabrics Connect fails: the target refused it.
pub const FABRICS_CONNECT: &str = "Fabrics Connect";

impl nvpoll::TransportError for Error {
    fn class(&self) -> nvpoll::ErrorClass {
        use nvpoll::ErrorClass;
        match self {
            Error::Io { .. } | Error::Closed | Error::Lost(_) => ErrorClass::ConnectionLost,
            Error::Pdu(_) | Error::Protocol(_) | Error::TermReq { .. } => ErrorClass::PeerProtocol,
            Error::Command { what, status } if *what == FABRICS_CONNECT => {
                ErrorClass::Refused(*status)
            }
            Error::Command { status, .. } => ErrorClass::Nvme(*status),
            Error::Tls(_) => ErrorClass::Tls,
            Error::Timeout(_) => ErrorClass::Timeout,
            Error::InvalidArgument(s) => ErrorClass::InvalidArgument(s.clone()),
            Error::QueueFull => ErrorClass::QueueFull,
            Error::Auth(_) => ErrorClass::Other,
        }
    }
}

impl From<Error> for nvpoll::Error {
    fn from(e: Error) -> Self {
        nvpoll::Error::from_transport(e)
    }
}

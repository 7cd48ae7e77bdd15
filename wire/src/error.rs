//! The error type of the NVMe/TCP crate.

use std::net::SocketAddr;
use std::sync::Arc;

use nvpoll::spec::{CommandKind, InvalidParameter, Status};

/// Everything that can go wrong in NVMe/TCP, initiator or target.
///
/// It is `Clone`, so that one failure can be both returned and kept: a failed host queue completes every
/// command it held, and refuses every later one, with [`Error::QueueFailed`] naming the same cause.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A socket call failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error (shared, so that the error can be cloned).
        #[source]
        source: Arc<std::io::Error>,
    },
    /// The peer closed the connection.
    #[error("connection closed by peer")]
    Closed,
    /// The connection is gone for a reason of the host's, not the peer's: the host closed or reset it (the
    /// controller reconnected, its admin connection went down), or gave the controller up (its loss timeout
    /// expired). The words say which.
    #[error("{0}")]
    Lost(&'static str),
    /// A host queue had failed when this command was outstanding or submitted on it: `cause` is what failed
    /// the queue (the same for every command it held), and classes this error.
    #[error("queue {qid} failed: {cause}")]
    QueueFailed {
        /// The queue (0: the admin queue).
        qid: u16,
        /// What failed it: the socket, the peer closing it, a TLS alert, a protocol violation, a timeout, or
        /// the host closing it.
        #[source]
        cause: Arc<Error>,
    },
    /// One path of a multipath subsystem could not be attached.
    #[error("path {addr} of {subnqn}: attach failed: {cause}")]
    PathAttach {
        /// The path's address.
        addr: SocketAddr,
        /// The subsystem.
        subnqn: String,
        /// Why its controller could not be attached; it classes this error.
        #[source]
        cause: Box<Error>,
    },
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
    /// A command completed with an error status where the caller needed success.
    #[error("{what} failed with NVMe status {}", status.named_in(*kind))]
    Command {
        /// Which command.
        what: &'static str,
        /// Its command set, which names the status (command-specific codes differ between them).
        kind: CommandKind,
        /// Its status.
        status: Status,
    },
    /// The target refused Fabrics Connect: which parameter and why.
    #[error("{0}")]
    Refused(Box<ConnectRefusal>),
    /// The TLS handshake or a record failed (wrong PSK, unknown identity, bad record MAC, ...).
    #[error("TLS: {0}")]
    Tls(#[from] nvpoll_tls::TlsError),
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
    /// The connection ended so that its TLS keys are renewed by a new one (see [`crate::KeyRenewal`]): the
    /// owner connects again. Not the peer's fault when `cause` is [`RekeyCause::Planned`].
    #[error("TLS keys renewed by connecting again: {0}")]
    Rekey(RekeyCause),
    /// The peer ended the connection after our TLS KeyUpdate, having never sent one itself: a peer that cannot
    /// take a KeyUpdate (kernel TLS without re-keying). `cause` is how it ended; the host renews this
    /// controller's keys by reconnecting from then on.
    #[error(
        "the peer ended the connection after our TLS KeyUpdate (it may not take one): {cause}"
    )]
    KeyUpdateRefused {
        /// How the connection ended (an alert, a close, a reset).
        #[source]
        cause: Box<Error>,
    },
    /// A failure inside this side, not the peer's: a background step (a connect or a reconnect thread)
    /// ended without its result, which only a panic there does (the log has it).
    #[error("internal error: {0}")]
    Internal(&'static str),
}

impl Error {
    /// Wraps an OS error with a short description.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source: Arc::new(source),
        }
    }
}

/// Why a connection ended to renew its TLS keys ([`Error::Rekey`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RekeyCause {
    /// A key protected the records [`crate::KeyRenewal::records`] allows, and the peer takes no KeyUpdate.
    #[error("a key reached its record count and the peer takes no KeyUpdate")]
    Planned,
    /// The peer's key protected twice the count without the peer renewing it, though we asked.
    #[error("the peer did not renew its key when asked")]
    PeerDidNotRenew,
    /// Our sending key reached its hard limit before a KeyUpdate could go out.
    #[error("our sending key reached its hard limit")]
    HardLimit,
}

/// A Fabrics Connect the target refused: its status, the parameter the completion points at (IATTR and
/// IPO), and what the host sent, so that the refusal can be said in words.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectRefusal {
    /// The Connect's status (command-specific ones are the Fabrics codes).
    pub status: Status,
    /// For Connect Invalid Parameters, the parameter the target refused.
    pub invalid: Option<InvalidParameter>,
    /// The queue the Connect was for (0: the admin queue).
    pub qid: u16,
    /// The queue size asked for (0-based, as SQSIZE).
    pub sqsize: u16,
    /// The subsystem NQN sent.
    pub subnqn: String,
    /// The host NQN sent.
    pub hostnqn: String,
    /// The controller ID sent (0xffff: any, for an admin queue).
    pub cntlid: u16,
}

impl ConnectRefusal {
    /// Why, in words, from the status and the parameter the completion names.
    pub fn reason(&self) -> String {
        let (sub, host) = (&self.subnqn, &self.hostnqn);
        match self.invalid {
            Some(InvalidParameter::SUBNQN) => format!("the target has no subsystem {sub}"),
            Some(InvalidParameter::HOSTNQN) if self.status.is(Status::CONNECT_INVALID_HOST) => {
                format!("subsystem {sub} does not allow host {host}")
            }
            Some(InvalidParameter::HOSTNQN) => format!("the target refused the host NQN {host}"),
            Some(InvalidParameter::CNTLID) => format!(
                "subsystem {sub} has no controller {} for host {host} (it may have been deleted)",
                self.cntlid
            ),
            Some(InvalidParameter::QID) => format!(
                "queue {} is beyond the I/O queues the controller granted",
                self.qid
            ),
            Some(InvalidParameter::SQSIZE) => format!(
                "a queue of {} entries is more than the controller allows",
                u32::from(self.sqsize) + 1
            ),
            Some(p) => format!("the target refused {p}"),
            None if self.status.is(Status::CONNECT_INVALID_HOST) => {
                format!("subsystem {sub} does not allow host {host}")
            }
            None if self.status.is(Status::CONNECT_CONTROLLER_BUSY) => {
                format!("subsystem {sub} has no controller or queue to spare")
            }
            None if self.status.is(Status::CONNECT_INCOMPATIBLE_FORMAT) => {
                "the target does not support this Connect format".into()
            }
            None if self.status.is(Status::CONNECT_RESTART_DISCOVERY) => {
                format!("subsystem {sub} moved: the target asks the host to restart discovery")
            }
            None => format!("subsystem {sub} refused host {host}"),
        }
    }
}

/// "Fabrics Connect (admin queue) refused: the target has no subsystem nqn.x: Connect Invalid Parameters
/// (sct 0x1 sc 0x82), invalid parameter: the subsystem NQN (IATTR 1, IPO 256)".
impl std::fmt::Display for ConnectRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let queue = if self.qid == 0 {
            "admin queue".to_string()
        } else {
            format!("I/O queue {}", self.qid)
        };
        write!(
            f,
            "Fabrics Connect ({queue}) refused: {}: {}",
            self.reason(),
            self.status.named_in(CommandKind::Fabrics)
        )?;
        if let Some(p) = self.invalid {
            write!(f, ", invalid parameter: {p}")?;
        }
        Ok(())
    }
}

impl nvpoll::TransportError for Error {
    fn class(&self) -> nvpoll::ErrorClass {
        use nvpoll::ErrorClass;
        match self {
            Error::Io { .. }
            | Error::Closed
            | Error::Lost(_)
            | Error::Rekey(_)
            | Error::KeyUpdateRefused { .. } => ErrorClass::ConnectionLost,
            Error::Pdu(_) | Error::Protocol(_) | Error::TermReq { .. } => ErrorClass::PeerProtocol,
            Error::Refused(r) => ErrorClass::Refused(r.status),
            Error::Command { status, kind, .. } => ErrorClass::Nvme(status.named_in(*kind)),
            Error::Tls(_) => ErrorClass::Tls,
            Error::Timeout(_) => ErrorClass::Timeout,
            Error::InvalidArgument(s) => ErrorClass::InvalidArgument(s.clone()),
            Error::QueueFull => ErrorClass::QueueFull,
            Error::Internal(_) => ErrorClass::Local,
            Error::Auth(_) => ErrorClass::Other,
            Error::QueueFailed { cause, .. } => cause.class(),
            Error::PathAttach { cause, .. } => cause.class(),
        }
    }
}

impl From<Error> for nvpoll::Error {
    fn from(e: Error) -> Self {
        nvpoll::Error::from_transport(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nvpoll::{Fault, Retry};

    #[test]
    fn a_failure_of_this_side_is_not_the_peer_s() {
        let api = nvpoll::Error::from(Error::Internal("the connect thread ended without a result"));
        assert!(matches!(api, nvpoll::Error::Local(_)), "{api:?}");
        assert_eq!((api.retry(), api.fault()), (Retry::Never, Fault::Ours));
        let reset = Error::io(
            "read",
            std::io::Error::from(std::io::ErrorKind::ConnectionReset),
        );
        let api = nvpoll::Error::from(reset);
        assert_eq!((api.retry(), api.fault()), (Retry::Elsewhere, Fault::Path));
    }
}

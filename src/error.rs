use crate::spec::{Status, StatusIn};

/// A lower layer's error, kept whole as the [`std::error::Error::source`] of an [`Error`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The error type of the `nvpoll` crate and of the queue-pair API.
///
/// Transports have their own richer error enums and convert into this one at the API boundary, through
/// [`Error::from_transport`]: the variant says what a caller can act on (retry elsewhere, reconnect, fix
/// the keys, give up), and the transport's own error stays the source, with its whole chain.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The controller completed the command with a non-success status, named for the kind of command it
    /// answered (an I/O command of the queue-pair API is [`crate::spec::CommandKind::Nvm`]).
    #[error("NVMe status {0}")]
    Nvme(StatusIn),
    /// The peer (a controller or a target) broke the protocol: a malformed PDU or completion, a termination
    /// request, a completion for a command that was not outstanding. The connection or queue is not usable.
    ///
    /// It reads as its source, which says the peer broke the protocol and how (every transport error of this
    /// class does), so that the words are said once.
    #[error("{0}")]
    PeerProtocol(#[source] BoxError),
    /// The connection (or the controller) is gone: closed or reset by the peer, removed, given up after its
    /// loss timeout. The command did not complete; another path or a reconnect may serve it.
    #[error("connection lost: {0}")]
    ConnectionLost(#[source] BoxError),
    /// The target refused the host: Fabrics Connect completed with `status` (an unknown subsystem, a host it
    /// does not allow, no queue left). Trying again unchanged will not help.
    #[error("{reason}")]
    Refused {
        /// The Connect's status.
        status: Status,
        /// Why, in words: which parameter the target refused (the completion's IATTR and IPO) and the value
        /// the host sent.
        reason: String,
    },
    /// The TLS layer failed: an alert from the peer or sent to it (a wrong or missing PSK, a bad record).
    ///
    /// It reads as its source, which names TLS (every transport error of this class does).
    #[error("{0}")]
    Tls(#[source] BoxError),
    /// Any other failure of the transport; the command did not complete.
    #[error("transport error: {0}")]
    Transport(#[source] BoxError),
    /// The command did not complete in time.
    #[error("command timed out")]
    Timeout,
    /// The command was aborted before it completed (queue torn down, controller reset).
    #[error("command aborted: {0}")]
    Aborted(&'static str),
    /// The queue is full; try again after processing completions.
    #[error("queue full")]
    QueueFull,
    /// A caller passed an invalid argument; the message says which and why.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Memory could not be allocated or pinned.
    #[error("memory: {0}")]
    Memory(String),
    /// A reactor could not be started, reached or stopped.
    #[error("reactor: {0}")]
    Reactor(String),
    /// An operating-system call failed.
    #[error("{context}: {source}")]
    Os {
        /// What was being done.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// Wraps an OS error with a short description of what was being done.
    pub fn os(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Os {
            context: context.into(),
            source,
        }
    }
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a transport's error means to a caller of the queue API ([`TransportError::class`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorClass {
    /// A command completed with this status: [`Error::Nvme`].
    Nvme(StatusIn),
    /// Fabrics Connect completed with this status: [`Error::Refused`], with the error's words as the reason.
    Refused(Status),
    /// [`Error::Timeout`].
    Timeout,
    /// [`Error::QueueFull`].
    QueueFull,
    /// [`Error::InvalidArgument`], with the message.
    InvalidArgument(String),
    /// [`Error::PeerProtocol`].
    PeerProtocol,
    /// [`Error::ConnectionLost`].
    ConnectionLost,
    /// [`Error::Tls`].
    Tls,
    /// [`Error::Transport`].
    Other,
}

/// A transport's error type: it says once what each of its errors means ([`ErrorClass`]), and
/// [`Error::from_transport`] is the one conversion every transport uses.
pub trait TransportError: std::error::Error + Send + Sync + 'static {
    /// What this error means to a caller of the queue API.
    fn class(&self) -> ErrorClass;
}

impl Error {
    /// The API error for a transport's error, which stays the source where the variant has one.
    pub fn from_transport<E: TransportError>(e: E) -> Error {
        match e.class() {
            ErrorClass::Nvme(status) => Error::Nvme(status),
            ErrorClass::Refused(status) => Error::Refused {
                status,
                reason: e.to_string(),
            },
            ErrorClass::Timeout => Error::Timeout,
            ErrorClass::QueueFull => Error::QueueFull,
            ErrorClass::InvalidArgument(msg) => Error::InvalidArgument(msg),
            ErrorClass::PeerProtocol => Error::PeerProtocol(Box::new(e)),
            ErrorClass::ConnectionLost => Error::ConnectionLost(Box::new(e)),
            ErrorClass::Tls => Error::Tls(Box::new(e)),
            ErrorClass::Other => Error::Transport(Box::new(e)),
        }
    }
}

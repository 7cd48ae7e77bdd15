use crate::spec::{Status, StatusIn};

/// A lower layer's error, kept whole as the [`std::error::Error::source`] of an [`Error`].
///
/// # Examples
///
/// ```
/// use std::error::Error as _;
/// use nvpoll::{BoxError, Error};
///
/// let cause: BoxError = "the peer sent a PDU of an unknown type".into();
/// let err = Error::PeerProtocol(cause);
/// assert_eq!(err.source().map(|s| s.to_string()).as_deref(), Some("the peer sent a PDU of an unknown type"));
/// ```
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The error type of the `nvpoll` crate and of the queue-pair API.
///
/// Transports have their own richer error enums and convert into this one at the API boundary, through
/// [`Error::from_transport`]: the variant says what a caller can act on (retry elsewhere, reconnect, fix
/// the keys, give up), and the transport's own error stays the source, with its whole chain.
///
/// # Examples
///
/// What an engine does with a failed request: [`Error::retry`] says what may be done with it,
/// [`Error::fault`] whose the failure is.
///
/// ```
/// use nvpoll::spec::{CommandKind, Status};
/// use nvpoll::{Error, Fault, Retry};
///
/// fn on_failure(e: &Error) -> &'static str {
///     match e.retry() {
///         Retry::AfterCompletions => "process completions, then submit it again",
///         Retry::Later => "submit it again in a while",
///         Retry::Elsewhere => "send it on another path (reads, or writes of the same data)",
///         Retry::Never if e.fault() == Fault::Caller => "a bug: fix the request",
///         _ => "fail the operation",
///     }
/// }
///
/// assert_eq!(on_failure(&Error::QueueFull), "process completions, then submit it again");
/// assert_eq!(on_failure(&Error::Timeout), "send it on another path (reads, or writes of the same data)");
/// assert_eq!(on_failure(&Error::InvalidArgument("0 blocks".into())), "a bug: fix the request");
/// let dnr = Error::Nvme(Status::LBA_OUT_OF_RANGE.with_dnr().named_in(CommandKind::Nvm));
/// assert_eq!(on_failure(&dnr), "fail the operation");
/// assert_eq!(dnr.fault(), Fault::Peer);
/// ```
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
    /// A transport failed on this side, not the peer's or the path's: a VFIO or IOMMU call, setting up the
    /// device's interrupts, a sysfs file. The transport's error, the source, says which.
    #[error("{0}")]
    Local(#[source] BoxError),
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
    ///
    /// # Examples
    ///
    /// ```
    /// use nvpoll::{Error, Fault, Retry};
    ///
    /// let err = std::fs::read("/nonexistent/nvpoll").map_err(|e| Error::os("reading /nonexistent/nvpoll", e));
    /// let err = err.unwrap_err();
    /// assert!(err.to_string().contains("reading /nonexistent/nvpoll"));
    /// assert_eq!((err.retry(), err.fault()), (Retry::Never, Fault::Ours));
    /// ```
    pub fn os(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Os {
            context: context.into(),
            source,
        }
    }
}

/// `Result` with [`Error`].
///
/// # Examples
///
/// ```
/// fn block_bytes(blocks: u32) -> nvpoll::Result<u32> {
///     blocks.checked_mul(512).ok_or_else(|| nvpoll::Error::InvalidArgument(format!("{blocks} blocks")))
/// }
/// assert_eq!(block_bytes(8)?, 4096);
/// assert!(block_bytes(u32::MAX).is_err());
/// # Ok::<(), nvpoll::Error>(())
/// ```
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a transport's error means to a caller of the queue API ([`TransportError::class`]).
///
/// See [`TransportError`] for an example.
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
    /// [`Error::Local`]: the failure is on this side.
    Local,
    /// [`Error::Transport`].
    Other,
}

/// A transport's error type: it says once what each of its errors means ([`ErrorClass`]), and
/// [`Error::from_transport`] is the one conversion every transport uses.
///
/// # Examples
///
/// A transport's error says what each of its cases means once; the conversion keeps it as the source:
///
/// ```
/// use std::error::Error as _;
/// use nvpoll::{Error, ErrorClass, Retry, TransportError};
///
/// #[derive(Debug, thiserror::Error)]
/// enum LinkError {
///     #[error("the link went down")]
///     Down,
///     #[error("transfer of {0} bytes is too large")]
///     TooLarge(u32),
/// }
///
/// impl TransportError for LinkError {
///     fn class(&self) -> ErrorClass {
///         match self {
///             LinkError::Down => ErrorClass::ConnectionLost,
///             LinkError::TooLarge(_) => ErrorClass::InvalidArgument(self.to_string()),
///         }
///     }
/// }
///
/// let lost = Error::from_transport(LinkError::Down);
/// assert!(matches!(lost, Error::ConnectionLost(_)));
/// assert_eq!(lost.retry(), Retry::Elsewhere);
/// assert_eq!(lost.source().map(|s| s.to_string()).as_deref(), Some("the link went down"));
///
/// let big = Error::from_transport(LinkError::TooLarge(1 << 30));
/// assert!(matches!(big, Error::InvalidArgument(ref m) if m.contains("too large")));
/// ```
pub trait TransportError: std::error::Error + Send + Sync + 'static {
    /// What this error means to a caller of the queue API. See [`TransportError`]'s example.
    fn class(&self) -> ErrorClass;
}

impl Error {
    /// The API error for a transport's error, which stays the source where the variant has one.
    /// See [`TransportError`]'s example.
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
            ErrorClass::Local => Error::Local(Box::new(e)),
            ErrorClass::Other => Error::Transport(Box::new(e)),
        }
    }

    /// What a caller may do about the failed request: submit it again (and when), send it on another path or
    /// after a reconnect, or give it up. See [`Retry`], and [`Error`]'s example.
    ///
    /// # Examples
    ///
    /// ```
    /// use nvpoll::spec::{CommandKind, Status};
    /// use nvpoll::{Error, Retry};
    ///
    /// let nvme = |st: Status| Error::Nvme(st.named_in(CommandKind::Nvm));
    /// assert_eq!(nvme(Status::NS_NOT_READY).retry(), Retry::Later);
    /// assert_eq!(nvme(Status::NS_NOT_READY.with_dnr()).retry(), Retry::Never);
    /// assert_eq!(nvme(Status::TRANSIENT_TRANSPORT_ERROR).retry(), Retry::Elsewhere);
    /// assert_eq!(Error::Memory("pool exhausted".into()).retry(), Retry::Later);
    /// ```
    pub fn retry(&self) -> Retry {
        match self {
            Error::QueueFull => Retry::AfterCompletions,
            Error::Nvme(st) if is_path_status(st.status) => Retry::Elsewhere,
            Error::Nvme(st) if st.status.dnr() => Retry::Never,
            Error::Nvme(_) | Error::Memory(_) => Retry::Later,
            Error::ConnectionLost(_)
            | Error::Timeout
            | Error::Aborted(_)
            | Error::PeerProtocol(_)
            | Error::Tls(_) => Retry::Elsewhere,
            Error::Refused { .. }
            | Error::Transport(_)
            | Error::InvalidArgument(_)
            | Error::Reactor(_)
            | Error::Local(_)
            | Error::Os { .. } => Retry::Never,
        }
    }

    /// Whose the failure is, as far as this side can tell. See [`Fault`].
    ///
    /// # Examples
    ///
    /// ```
    /// use nvpoll::spec::{CommandKind, Status};
    /// use nvpoll::{Error, Fault};
    ///
    /// assert_eq!(Error::QueueFull.fault(), Fault::Caller);
    /// assert_eq!(Error::Memory("pool exhausted".into()).fault(), Fault::Ours);
    /// assert_eq!(Error::Nvme(Status::INTERNAL_ERROR.named_in(CommandKind::Nvm)).fault(), Fault::Peer);
    /// assert_eq!(Error::Timeout.fault(), Fault::Path);
    /// assert_eq!(Error::Tls("bad record".into()).fault(), Fault::Unknown);
    /// ```
    pub fn fault(&self) -> Fault {
        match self {
            Error::InvalidArgument(_) | Error::QueueFull => Fault::Caller,
            Error::Memory(_) | Error::Reactor(_) | Error::Os { .. } | Error::Local(_) => {
                Fault::Ours
            }
            Error::Nvme(st) if is_path_status(st.status) => Fault::Path,
            Error::Nvme(_) | Error::PeerProtocol(_) | Error::Refused { .. } => Fault::Peer,
            Error::ConnectionLost(_) | Error::Timeout | Error::Aborted(_) => Fault::Path,
            Error::Tls(_) | Error::Transport(_) => Fault::Unknown,
        }
    }
}

/// A path-related status (SCT 3: ANA inaccessible or in transition, an internal path error) or the generic
/// Transient Transport Error, without Do Not Retry: the command did not run, and another path may take it.
fn is_path_status(st: crate::spec::Status) -> bool {
    !st.dnr()
        && (st.sct() == crate::spec::sct::PATH
            || st == crate::spec::Status::TRANSIENT_TRANSPORT_ERROR)
}

/// What a caller may do with a request that failed ([`Error::retry`]).
///
/// See [`Error`]'s example (a handler that decides by it) and [`Error::retry`]'s.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Retry {
    /// Submit it again once completions have been processed: the queue was full ([`Error::QueueFull`]).
    AfterCompletions,
    /// Submit it again later, on the same queue: the controller answered a status without Do Not Retry (it
    /// may name a Command Retry Delay), or DMA memory was short and comes back as buffers are dropped.
    Later,
    /// Send it on another path, or on this one after it reconnects: the connection or the controller went
    /// away, the peer broke the protocol, TLS failed on a connected queue (a bad record or an alert: the
    /// handshake had succeeded, so the keys are right), the command timed out or was aborted by a reset, or
    /// the status is path-related (ANA inaccessible or in transition, a transient transport error). The
    /// command may or may not have run; a write sent again lands the same data.
    Elsewhere,
    /// Sending it again unchanged fails again: a status with Do Not Retry, a refused Connect, a failed
    /// DH-HMAC-CHAP or another transport failure no class fits, an
    /// invalid request, a failure on this side.
    Never,
}

/// Whose a failure is, as far as this side can tell ([`Error::fault`]).
///
/// See [`Error::fault`]'s example.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// The caller's: an invalid request, or more submitted than the queue holds.
    Caller,
    /// This side's: DMA memory, a reactor, an operating-system or VFIO call.
    Ours,
    /// The peer's: the controller answered with an error status or refused the Connect, or it broke the
    /// protocol.
    Peer,
    /// The path's, or the peer's while it is unreachable (no way to tell them apart from here): the
    /// connection was lost or reset, the command timed out or was aborted, or the status is path-related.
    Path,
    /// Either side's: a TLS failure (an alert sent or received: a wrong key on one side, or a bad record)
    /// or a transport failure no class above fits.
    Unknown,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{CommandKind, Status};

    fn nvme(status: Status) -> Error {
        Error::Nvme(status.named_in(CommandKind::Nvm))
    }

    #[test]
    fn each_error_says_what_to_do_and_whose_it_is() {
        let io = || std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        let cases: Vec<(Error, Retry, Fault)> = vec![
            (Error::QueueFull, Retry::AfterCompletions, Fault::Caller),
            (
                Error::InvalidArgument("x".into()),
                Retry::Never,
                Fault::Caller,
            ),
            (
                nvme(Status::ANA_INACCESSIBLE),
                Retry::Elsewhere,
                Fault::Path,
            ),
            (
                nvme(Status::TRANSIENT_TRANSPORT_ERROR),
                Retry::Elsewhere,
                Fault::Path,
            ),
            (
                nvme(Status::ANA_INACCESSIBLE.with_dnr()),
                Retry::Never,
                Fault::Peer,
            ),
            (nvme(Status::LBA_OUT_OF_RANGE), Retry::Later, Fault::Peer),
            (
                nvme(Status::LBA_OUT_OF_RANGE.with_dnr()),
                Retry::Never,
                Fault::Peer,
            ),
            (
                Error::ConnectionLost(io().into()),
                Retry::Elsewhere,
                Fault::Path,
            ),
            (Error::Timeout, Retry::Elsewhere, Fault::Path),
            (Error::Aborted("reset"), Retry::Elsewhere, Fault::Path),
            (
                Error::PeerProtocol("bad PDU".into()),
                Retry::Elsewhere,
                Fault::Peer,
            ),
            (Error::Tls("alert".into()), Retry::Elsewhere, Fault::Unknown),
            (
                Error::Transport("other".into()),
                Retry::Never,
                Fault::Unknown,
            ),
            (Error::Local("VFIO".into()), Retry::Never, Fault::Ours),
            (Error::Memory("pool".into()), Retry::Later, Fault::Ours),
            (Error::Reactor("gone".into()), Retry::Never, Fault::Ours),
            (Error::os("open", io()), Retry::Never, Fault::Ours),
        ];
        for (e, retry, fault) in cases {
            assert_eq!((e.retry(), e.fault()), (retry, fault), "{e:?}");
        }
    }

    #[test]
    fn a_transport_error_of_class_local_stays_the_source() {
        #[derive(Debug, thiserror::Error)]
        #[error("VFIO_IOMMU_MAP_DMA: no memory")]
        struct MapFailed;
        impl TransportError for MapFailed {
            fn class(&self) -> ErrorClass {
                ErrorClass::Local
            }
        }
        let e = Error::from_transport(MapFailed);
        assert!(matches!(e, Error::Local(_)), "{e:?}");
        assert_eq!(e.to_string(), "VFIO_IOMMU_MAP_DMA: no memory");
        assert_eq!((e.retry(), e.fault()), (Retry::Never, Fault::Ours));
    }
}

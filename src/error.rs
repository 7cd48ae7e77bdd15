use crate::spec::Status;

/// The error type of the `nvpoll` crate and of the queue-pair API.
///
/// Transports have their own richer error enums and convert into this one at the API boundary.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The controller completed the command with a non-success status.
    #[error("NVMe status {0}")]
    Nvme(Status),
    /// The transport failed (connection lost, protocol violation by the peer, ...); the command did not complete.
    #[error("transport error: {0}")]
    Transport(String),
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

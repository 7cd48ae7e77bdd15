//! The error type of the target: what it refused (a configuration or a change it cannot take) and what failed
//! underneath it (a socket, a file, the wire).
//!
//! Each variant names one failure and carries what the operator needs to act on it; an OS or library error is
//! kept as the [`source`](std::error::Error::source). No variant ever holds key material: a key file is named,
//! never quoted.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::limits::{ANA_GROUP_MAX, DISCOVERY_NQN, MAX_CNTLID, MAX_NAMESPACES, MAX_NQN_LEN};

/// Everything the target refuses or fails at.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A configuration file (or a control socket request's params) the target would not take.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A name that is not a usable NQN.
    #[error("NQN {nqn:?} {fault}")]
    BadNqn {
        /// The name given.
        nqn: String,
        /// What is wrong with it.
        fault: NqnFault,
    },
    /// A number outside what the target allows.
    #[error("{setting} {value}: must be {}", setting.allowed())]
    OutOfRange {
        /// Which number.
        setting: Setting,
        /// The value given.
        value: u64,
    },
    /// A TLS mode other than `off`, `optional` or `required`.
    #[error("TLS mode {0:?}: must be off, optional or required")]
    TlsMode(String),
    /// A controller ID range that is empty or reaches beyond the IDs the dynamic controller model hands out.
    #[error("controller IDs {min}-{max}: must lie within 1-{MAX_CNTLID}, lowest first")]
    BadCntlidRange {
        /// The lowest ID given.
        min: u16,
        /// The highest ID given.
        max: u16,
    },
    /// A serial or model number that does not fit its Identify field.
    #[error("{what} {value:?}: must be at most {max} printable ASCII characters")]
    BadText {
        /// Which field (`serial number`, `model number`).
        what: &'static str,
        /// The text given.
        value: String,
        /// Its longest length.
        max: usize,
    },
    /// The discovery subsystem's NQN was given for an NVM subsystem.
    #[error("{} is the discovery subsystem's NQN", DISCOVERY_NQN)]
    DiscoveryNqn,
    /// Something only NVM subsystems have was asked of the discovery subsystem.
    #[error("the discovery subsystem has no {0}")]
    NotOnDiscovery(&'static str),
    /// A subsystem is listed twice in a target's configuration.
    #[error("subsystem {nqn} is configured twice")]
    DuplicateSubsystem {
        /// Its NQN.
        nqn: String,
    },
    /// A listener is listed twice in a target's configuration.
    #[error("listener {address} is configured twice")]
    DuplicateListener {
        /// Its address.
        address: SocketAddr,
    },
    /// The target has this subsystem already.
    #[error("subsystem {nqn} exists already")]
    SubsystemExists {
        /// Its NQN.
        nqn: String,
    },
    /// The target listens on this address already.
    #[error("listener {address} exists already")]
    ListenerExists {
        /// Its address.
        address: SocketAddr,
    },
    /// The subsystem has this namespace already.
    #[error("namespace {nsid} of {nqn} exists already")]
    NamespaceExists {
        /// The subsystem.
        nqn: String,
        /// The namespace ID.
        nsid: u32,
    },
    /// The host is on the subsystem's list already.
    #[error("host {host} is allowed on {nqn} already")]
    HostAllowedAlready {
        /// The subsystem.
        nqn: String,
        /// The Host NQN.
        host: String,
    },
    /// The target has no such (NVM) subsystem.
    #[error("no subsystem {nqn}")]
    NoSubsystem {
        /// The NQN asked for.
        nqn: String,
    },
    /// The subsystem has no such namespace.
    #[error("{nqn} has no namespace {nsid}")]
    NoNamespace {
        /// The subsystem.
        nqn: String,
        /// The namespace ID asked for.
        nsid: u32,
    },
    /// The target does not listen on this address.
    #[error("{address} is not a listener of the target")]
    NoListener {
        /// The address asked for.
        address: SocketAddr,
    },
    /// The subsystem is not reachable through this listener.
    #[error("{nqn} is not exported on listener {listener}")]
    NotExported {
        /// The subsystem.
        nqn: String,
        /// The listener.
        listener: SocketAddr,
    },
    /// The host is not on the subsystem's list.
    #[error("host {host} is not among the allowed hosts of {nqn}")]
    HostNotAllowed {
        /// The subsystem.
        nqn: String,
        /// The Host NQN.
        host: String,
    },
    /// The host has no TLS PSK for the subsystem.
    #[error("host {host} has no key for {nqn}")]
    NoHostKey {
        /// The subsystem.
        nqn: String,
        /// The Host NQN.
        host: String,
    },
    /// The host has no DH-HMAC-CHAP keys for the subsystem.
    #[error("host {host} has no DH-HMAC-CHAP key for {nqn}")]
    NoDhchapKey {
        /// The subsystem.
        nqn: String,
        /// The Host NQN.
        host: String,
    },
    /// Listing hosts on a subsystem that lets any host in would silently lock every other host out.
    #[error("{nqn} lets any host in; turn allow-any-host off first to list its hosts")]
    AnyHostAllowed {
        /// The subsystem.
        nqn: String,
    },
    /// Every namespace ID of the subsystem is taken.
    #[error("{nqn} has {MAX_NAMESPACES} namespaces already")]
    NamespacesFull {
        /// The subsystem.
        nqn: String,
    },
    /// A namespace's device has another block size than the one asked for.
    #[error("namespace {nsid}: {device} has {device_block_size}-byte blocks, not {block_size}")]
    DeviceBlockSize {
        /// The namespace ID.
        nsid: u32,
        /// The device, as it describes itself.
        device: String,
        /// The device's block size.
        device_block_size: u32,
        /// The block size asked for.
        block_size: u32,
    },
    /// A namespace's backing holds less than one block.
    #[error("namespace {nsid} ({backing}) is smaller than one {block_size}-byte block")]
    NamespaceTooSmall {
        /// The namespace ID.
        nsid: u32,
        /// Its backing, described.
        backing: String,
        /// The block size.
        block_size: u32,
    },
    /// A namespace's file or block device cannot be opened.
    #[error("open namespace file {}: {source}", path.display())]
    OpenNamespace {
        /// The path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The reservation state kept beside a namespace's file cannot be read or written.
    #[error("reservation state of {}: {source}", path.display())]
    ReservationState {
        /// The namespace's file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A check of one namespace failed.
    #[error("namespace {nsid}: {source}")]
    InNamespace {
        /// The namespace ID.
        nsid: u32,
        /// What failed.
        #[source]
        source: Box<Error>,
    },
    /// A check of one subsystem failed.
    #[error("subsystem {nqn}: {source}")]
    InSubsystem {
        /// The subsystem.
        nqn: String,
        /// What failed.
        #[source]
        source: Box<Error>,
    },
    /// A key file cannot be read (the OS error names why).
    #[error("{}: {source}", path.display())]
    KeyFileUnreadable {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A key file that was read but is refused; what it holds is never shown.
    #[error("{} {fault}", path.display())]
    KeyFile {
        /// The file.
        path: PathBuf,
        /// Why it is refused.
        fault: KeyFileFault,
    },
    /// A `pcie` namespace, but the program has no PCIe driver ([`crate::config::no_pcie`]).
    #[error("{bdf}: this program has no PCIe driver to open a controller with")]
    NoPcieDriver {
        /// The PCI address given.
        bdf: String,
    },
    /// The NVMe controller behind a `pcie` namespace cannot be opened.
    #[error("{bdf}: {source}")]
    Pcie {
        /// The PCI address given.
        bdf: String,
        /// What the PCIe driver said.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A listening socket cannot be opened.
    #[error("listen on {address}: {source}")]
    Bind {
        /// The address.
        address: SocketAddr,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The target is stopping and takes no new listener.
    #[error("the target is stopping")]
    Stopping,
    /// The reactors refused what the target asked of them.
    #[error("{what}: {source}")]
    Reactor {
        /// What was asked.
        what: &'static str,
        /// The reactors' error.
        #[source]
        source: nvpoll::Error,
    },
    /// The control socket's path holds something other than a socket.
    #[error("{} exists and is not a socket", path.display())]
    NotASocket {
        /// The path.
        path: PathBuf,
    },
    /// Another server answers on the control socket's path.
    #[error("a control socket is already served at {}", path.display())]
    SocketInUse {
        /// The path.
        path: PathBuf,
    },
    /// The control socket refused a request.
    #[error(transparent)]
    Rpc(#[from] RpcError),
    /// The control socket's server sent what is not a JSON-RPC answer to the request.
    #[error("protocol violation by peer: {0}")]
    RpcAnswer(String),
    /// The control socket's server sent what is not JSON.
    #[error("protocol violation by peer: the server sent bad JSON: {0}")]
    RpcJson(#[source] serde_json::Error),
    /// The control socket's server closed the connection before it answered.
    #[error("connection closed by peer")]
    RpcClosed,
    /// The control socket's server did not answer in time.
    #[error("timed out waiting for the control socket's answer")]
    RpcTimeout,
    /// NVMe/TCP below the target (a socket option, a connection) failed.
    #[error(transparent)]
    Wire(#[from] nvpoll_wire::Error),
    /// A system call failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

impl Error {
    /// Wraps an OS error with a short description of what was being done.
    pub fn io(context: impl Into<String>, source: io::Error) -> Error {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// The controller behind `pcie` namespace `bdf` could not be opened, because of `source` (the PCIe
    /// driver's error, or a sentence): what a [`crate::config::PcieResolver`] returns when it fails.
    pub fn pcie(
        bdf: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Error {
        Error::Pcie {
            bdf: bdf.into(),
            source: source.into(),
        }
    }

    pub(crate) fn out_of_range(setting: Setting, value: impl Into<u64>) -> Error {
        Error::OutOfRange {
            setting,
            value: value.into(),
        }
    }

    pub(crate) fn in_subsystem(nqn: &str, source: Error) -> Error {
        Error::InSubsystem {
            nqn: nqn.to_string(),
            source: Box::new(source),
        }
    }
}

/// What is wrong with an NQN.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum NqnFault {
    /// It is empty.
    Empty,
    /// It is longer than [`MAX_NQN_LEN`] bytes.
    TooLong(usize),
    /// It does not start with `nqn.yyyy-mm.`.
    NotDated,
    /// It has whitespace or control characters (a NUL included).
    Whitespace,
}

impl fmt::Display for NqnFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NqnFault::Empty => write!(f, "is empty; an NQN is 1 to {MAX_NQN_LEN} bytes"),
            NqnFault::TooLong(n) => write!(f, "is {n} bytes; at most {MAX_NQN_LEN}"),
            NqnFault::NotDated => f.write_str("is not of the form nqn.yyyy-mm.reverse.domain:name"),
            NqnFault::Whitespace => f.write_str("has whitespace or control characters"),
        }
    }
}

/// A number the target checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Setting {
    /// MDTS (the largest transfer, in 4 KiB pages, as a power of two).
    Mdts,
    /// Entries per queue.
    QueueSize,
    /// I/O queues per controller.
    IoQueues,
    /// MAXH2CDATA (the largest H2CData PDU).
    MaxH2cData,
    /// In-capsule data bytes.
    InCapsuleData,
    /// A namespace's logical block size.
    BlockSize,
    /// A namespace ID.
    NamespaceId,
    /// An ANA group ID.
    AnaGroup,
    /// Records under one TLS key before the keys are renewed.
    TlsKeyUpdate,
}

impl Setting {
    /// What the target allows, in words.
    pub fn allowed(self) -> String {
        match self {
            Setting::Mdts => "1 (8 KiB) to 10 (4 MiB)".into(),
            Setting::QueueSize => "2 to 1024 entries".into(),
            Setting::IoQueues => "1 to 1024".into(),
            Setting::MaxH2cData => "a multiple of 4 from 4096 to 16 MiB".into(),
            Setting::InCapsuleData => "a multiple of 16 from 1024 to 1 MiB".into(),
            Setting::BlockSize => "512 or 4096".into(),
            Setting::NamespaceId => format!("1 to {MAX_NAMESPACES}"),
            Setting::AnaGroup => format!("1 to {ANA_GROUP_MAX}"),
            Setting::TlsKeyUpdate => {
                format!("1 to {} records", nvpoll_wire::KeyRenewal::DEFAULT_RECORDS)
            }
        }
    }
}

impl fmt::Display for Setting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Setting::Mdts => "MDTS",
            Setting::QueueSize => "queue size",
            Setting::IoQueues => "I/O queues",
            Setting::MaxH2cData => "MAXH2CDATA",
            Setting::InCapsuleData => "in-capsule data",
            Setting::BlockSize => "block size",
            Setting::NamespaceId => "namespace ID",
            Setting::AnaGroup => "ANA group",
            Setting::TlsKeyUpdate => "TLS key update count",
        })
    }
}

/// Why a key file is refused (its contents are never quoted).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyFileFault {
    /// It is not a regular file.
    NotAFile,
    /// Its group or others may access it.
    OpenToOthers {
        /// Its permission bits.
        mode: u32,
    },
    /// It is larger than any key file.
    TooLarge {
        /// Its size.
        bytes: u64,
    },
    /// It is not text.
    NotText,
    /// It is text, but not an `NVMeTLSkey-1` interchange key: why, in our words.
    NotAKey(&'static str),
}

impl fmt::Display for KeyFileFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyFileFault::NotAFile => f.write_str("is not a regular file"),
            KeyFileFault::OpenToOthers { mode } => write!(
                f,
                "is accessible to group or others (mode {mode:04o}); chmod 600 it"
            ),
            KeyFileFault::TooLarge { bytes } => {
                write!(f, "is {bytes} bytes: too large for a key file")
            }
            KeyFileFault::NotText => f.write_str("does not hold a TLS key (it is not text)"),
            KeyFileFault::NotAKey(why) => write!(
                f,
                "does not hold a valid NVMeTLSkey-1 interchange key: {why}"
            ),
        }
    }
}

/// What is wrong with a configuration (or an RPC's params), and where. Where the target's own check refused
/// the value (a key file, an NQN, a `pcie` namespace the resolver could not open), that error is the
/// [`source`](std::error::Error::source).
#[derive(Debug, Clone, thiserror::Error)]
pub struct ConfigError {
    pub(crate) origin: Option<PathBuf>,
    pub(crate) line: Option<usize>,
    pub(crate) column: Option<usize>,
    pub(crate) field: String,
    pub(crate) message: String,
    #[source]
    pub(crate) cause: Option<Arc<Error>>,
}

/// Equal when they say the same thing at the same place (the causes are not compared: OS errors cannot be).
impl PartialEq for ConfigError {
    fn eq(&self, other: &ConfigError) -> bool {
        (
            &self.origin,
            self.line,
            self.column,
            &self.field,
            &self.message,
        ) == (
            &other.origin,
            other.line,
            other.column,
            &other.field,
            &other.message,
        )
    }
}

impl Eq for ConfigError {}

impl ConfigError {
    /// The file, if the error is in one.
    pub fn origin(&self) -> Option<&Path> {
        self.origin.as_deref()
    }

    /// The line (from 1) of the offending field, when the error is in a file.
    pub fn line(&self) -> Option<usize> {
        self.line
    }

    /// The column (from 1), when the JSON parser gave one (syntax and type errors).
    pub fn column(&self) -> Option<usize> {
        self.column
    }

    /// The offending field, as a path like `subsystems[1].namespaces[0].ram` (empty: the whole document).
    pub fn field(&self) -> &str {
        &self.field
    }

    /// What is wrong, without the position.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The target's error that refused the field, where one did (a key file, an NQN, a number out of range, a
    /// `pcie` namespace); `None` where the schema or a check of the file itself did.
    pub fn cause(&self) -> Option<&Error> {
        self.cause.as_deref()
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(origin) = &self.origin {
            write!(f, "{}:", origin.display())?;
            if let Some(line) = self.line {
                write!(f, "{line}:")?;
            }
            if let Some(column) = self.column {
                write!(f, "{column}:")?;
            }
            f.write_str(" ")?;
        }
        if !self.field.is_empty() {
            write!(f, "{}: ", self.field)?;
        }
        f.write_str(&self.message)
    }
}

/// A JSON-RPC error: its code and message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message} (JSON-RPC error {code})")]
pub struct RpcError {
    /// One of the codes of [`crate::rpc`] ([`INVALID_PARAMS`](crate::rpc::INVALID_PARAMS), ...), or another server's.
    pub code: i64,
    /// What went wrong.
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn errors_cross_threads() {
        fn send_sync<T: Send + Sync + 'static>() {}
        send_sync::<Error>();
    }

    #[test]
    fn a_listener_that_cannot_bind_names_its_address_and_keeps_the_os_error() {
        let e = Error::Bind {
            address: "127.0.0.1:4420".parse().unwrap(),
            source: io::Error::from(io::ErrorKind::AddrInUse),
        };
        assert!(
            e.to_string().starts_with("listen on 127.0.0.1:4420: "),
            "{e}"
        );
        let source = e.source().expect("the OS error");
        let os = source.downcast_ref::<io::Error>().expect("an io::Error");
        assert_eq!(os.kind(), io::ErrorKind::AddrInUse);
    }

    #[test]
    fn a_key_file_is_named_with_why_and_a_check_inside_a_subsystem_says_which() {
        let e = Error::KeyFile {
            path: "/etc/nvpoll/h1.key".into(),
            fault: KeyFileFault::OpenToOthers { mode: 0o644 },
        };
        assert_eq!(
            e.to_string(),
            "/etc/nvpoll/h1.key is accessible to group or others (mode 0644); chmod 600 it"
        );
        let e = Error::in_subsystem(
            "nqn.2024-01.io.nvpoll:a",
            Error::out_of_range(Setting::Mdts, 11u8),
        );
        assert_eq!(
            e.to_string(),
            "subsystem nqn.2024-01.io.nvpoll:a: MDTS 11: must be 1 (8 KiB) to 10 (4 MiB)"
        );
        let inner = e.source().expect("the check that failed");
        // The source is the boxed error (what thiserror hands out for a `Box<Error>` field).
        let inner = inner.downcast_ref::<Box<Error>>().expect("a target error");
        assert!(matches!(
            **inner,
            Error::OutOfRange {
                setting: Setting::Mdts,
                value: 11
            }
        ));
    }
}

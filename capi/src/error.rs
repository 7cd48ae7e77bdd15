//! Error codes: one negative code per variant of `nvpoll::Error` (and three of the C interface's own), the
//! retry and fault classes of `Error::retry()` and `Error::fault()`, and the calling thread's last error.

use std::cell::RefCell;
use std::ffi::{c_int, CStr, CString};

use nvpoll_core::{Error, Fault, Retry};

/// The codes a function of the C interface returns: 0 for success, a negative value for each failure. The
/// first fourteen mirror the variants of nvpoll's Rust error (`nvpoll::Error`); the last three are the C
/// interface's own.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NvpollError {
    /// Success.
    NvpollOk = 0,
    /// The controller completed the command with a non-success NVMe status (the completion's `nvme_status`
    /// holds it).
    NvpollErrNvme = -1,
    /// The peer broke the NVMe/TCP protocol; the connection is not usable.
    NvpollErrPeerProtocol = -2,
    /// The connection or controller is gone; another path or a reconnect may serve the command.
    NvpollErrConnectionLost = -3,
    /// The target refused the host (Fabrics Connect failed): an unknown subsystem, a host it does not allow.
    NvpollErrRefused = -4,
    /// TLS failed: a wrong or missing PSK, a bad record, an alert.
    NvpollErrTls = -5,
    /// Another failure of the transport (for example DH-HMAC-CHAP).
    NvpollErrTransport = -6,
    /// The command did not complete in time.
    NvpollErrTimeout = -7,
    /// The command was aborted before it completed (queue torn down, controller reset).
    NvpollErrAborted = -8,
    /// The queue pair is full: process completions, then submit again.
    NvpollErrQueueFull = -9,
    /// An invalid argument: a null pointer, a malformed transport ID or PSK, blocks beyond the namespace.
    NvpollErrInvalidArgument = -10,
    /// DMA memory could not be allocated (the pool's size class is empty) or pinned.
    NvpollErrMemory = -11,
    /// A reactor could not be started, reached or stopped.
    NvpollErrReactor = -12,
    /// A failure on this side: VFIO, the IOMMU, interrupts, sysfs.
    NvpollErrLocal = -13,
    /// An operating-system call failed.
    NvpollErrOs = -14,
    /// The handle is in use: a buffer in flight, a controller with open queue pairs, or a call a completion
    /// callback may not make on its own queue pair (process, reap, free).
    NvpollErrBusy = -15,
    /// nvpoll panicked inside the call (a bug; the message says where). The handle may be unusable.
    NvpollErrInternal = -16,
    /// An error of a kind this version of the C interface does not name.
    NvpollErrUnknown = -17,
}

/// What a caller may do with a request that failed: nvpoll's `Error::retry()`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NvpollRetry {
    /// Submit it again once completions have been processed (the queue was full, the buffer was in use).
    NvpollRetryAfterCompletions = 0,
    /// Submit it again later on the same queue pair (a status without Do Not Retry, DMA memory short).
    NvpollRetryLater = 1,
    /// Send it on another path, or on this one after it reconnects; it may or may not have run.
    NvpollRetryElsewhere = 2,
    /// Sending it again unchanged fails again.
    NvpollRetryNever = 3,
}

/// Whose a failure is, as far as this side can tell: nvpoll's `Error::fault()`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NvpollFault {
    /// The caller's: an invalid request, or more submitted than the queue holds.
    NvpollFaultCaller = 0,
    /// This side's: DMA memory, a reactor, an operating-system or VFIO call.
    NvpollFaultOurs = 1,
    /// The peer's: an error status, a refused Connect, a protocol violation.
    NvpollFaultPeer = 2,
    /// The path's (or the peer's while unreachable): a lost connection, a timeout, a path status.
    NvpollFaultPath = 3,
    /// Either side's: a TLS failure or a transport failure no class above fits.
    NvpollFaultUnknown = 4,
}

/// A failure of a call of the C interface.
#[derive(Debug)]
pub(crate) enum Failure {
    /// nvpoll's error.
    Api(Error),
    /// The handle is in use ([`NvpollError::NvpollErrBusy`]).
    Busy(String),
    /// A panic caught at the boundary.
    Internal(String),
}

impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        Failure::Api(e)
    }
}

/// An invalid argument, as a [`Failure`].
pub(crate) fn invalid(msg: impl Into<String>) -> Failure {
    Failure::Api(Error::InvalidArgument(msg.into()))
}

impl Failure {
    /// The code that names this failure.
    pub(crate) fn code(&self) -> NvpollError {
        let e = match self {
            Failure::Busy(_) => return NvpollError::NvpollErrBusy,
            Failure::Internal(_) => return NvpollError::NvpollErrInternal,
            Failure::Api(e) => e,
        };
        match e {
            Error::Nvme(_) => NvpollError::NvpollErrNvme,
            Error::PeerProtocol(_) => NvpollError::NvpollErrPeerProtocol,
            Error::ConnectionLost(_) => NvpollError::NvpollErrConnectionLost,
            Error::Refused { .. } => NvpollError::NvpollErrRefused,
            Error::Tls(_) => NvpollError::NvpollErrTls,
            Error::Transport(_) => NvpollError::NvpollErrTransport,
            Error::Timeout => NvpollError::NvpollErrTimeout,
            Error::Aborted(_) => NvpollError::NvpollErrAborted,
            Error::QueueFull => NvpollError::NvpollErrQueueFull,
            Error::InvalidArgument(_) => NvpollError::NvpollErrInvalidArgument,
            Error::Memory(_) => NvpollError::NvpollErrMemory,
            Error::Reactor(_) => NvpollError::NvpollErrReactor,
            Error::Local(_) => NvpollError::NvpollErrLocal,
            Error::Os { .. } => NvpollError::NvpollErrOs,
            _ => NvpollError::NvpollErrUnknown,
        }
    }

    /// The NVMe status (SCT, SC, DNR and the rest of the 15-bit field) of an NVMe error or a refused
    /// Connect; 0 otherwise.
    pub(crate) fn nvme_status(&self) -> u16 {
        match self {
            Failure::Api(Error::Nvme(s)) => s.status.raw(),
            Failure::Api(Error::Refused { status, .. }) => status.raw(),
            _ => 0,
        }
    }

    /// `Error::retry()`, with the C interface's own failures placed.
    pub(crate) fn retry(&self) -> NvpollRetry {
        match self {
            Failure::Busy(_) => NvpollRetry::NvpollRetryAfterCompletions,
            Failure::Internal(_) => NvpollRetry::NvpollRetryNever,
            Failure::Api(e) => match e.retry() {
                Retry::AfterCompletions => NvpollRetry::NvpollRetryAfterCompletions,
                Retry::Later => NvpollRetry::NvpollRetryLater,
                Retry::Elsewhere => NvpollRetry::NvpollRetryElsewhere,
                _ => NvpollRetry::NvpollRetryNever,
            },
        }
    }

    /// `Error::fault()`, with the C interface's own failures placed.
    pub(crate) fn fault(&self) -> NvpollFault {
        match self {
            Failure::Busy(_) => NvpollFault::NvpollFaultCaller,
            Failure::Internal(_) => NvpollFault::NvpollFaultOurs,
            Failure::Api(e) => match e.fault() {
                Fault::Caller => NvpollFault::NvpollFaultCaller,
                Fault::Ours => NvpollFault::NvpollFaultOurs,
                Fault::Peer => NvpollFault::NvpollFaultPeer,
                Fault::Path => NvpollFault::NvpollFaultPath,
                _ => NvpollFault::NvpollFaultUnknown,
            },
        }
    }

    /// The full text: the error and its chain of sources.
    pub(crate) fn message(&self) -> String {
        match self {
            Failure::Busy(m) => format!("busy: {m}"),
            Failure::Internal(m) => format!("internal error (a bug in nvpoll): {m}"),
            Failure::Api(e) => {
                let mut s = e.to_string();
                let mut source = std::error::Error::source(e);
                while let Some(cause) = source {
                    let more = cause.to_string();
                    // Variants that read as their source would say it twice.
                    if !s.ends_with(&more) {
                        s.push_str(": ");
                        s.push_str(&more);
                    }
                    source = cause.source();
                }
                s
            }
        }
    }
}

/// The calling thread's last failure, as the C side reads it.
struct Last {
    message: CString,
    retry: NvpollRetry,
    fault: NvpollFault,
    nvme_status: u16,
}

thread_local! {
    static LAST: RefCell<Last> = RefCell::new(Last {
        message: CString::default(),
        retry: NvpollRetry::NvpollRetryNever,
        fault: NvpollFault::NvpollFaultUnknown,
        nvme_status: 0,
    });
}

/// Records `f` as the calling thread's last error and returns its code.
pub(crate) fn record(f: &Failure) -> c_int {
    let text = f.message().replace('\0', " ");
    // Cannot fail: the NULs were replaced.
    let message = CString::new(text).unwrap_or_default();
    LAST.with(|l| {
        *l.borrow_mut() = Last {
            message,
            retry: f.retry(),
            fault: f.fault(),
            nvme_status: f.nvme_status(),
        }
    });
    f.code() as c_int
}

/// The calling thread's last error message; valid until the thread's next failing call.
pub(crate) fn last_message() -> *const std::ffi::c_char {
    LAST.with(|l| l.borrow().message.as_ptr())
}

/// The calling thread's last error's retry class, fault class and NVMe status.
pub(crate) fn last_classes() -> (NvpollRetry, NvpollFault, u16) {
    LAST.with(|l| {
        let l = l.borrow();
        (l.retry, l.fault, l.nvme_status)
    })
}

/// The words for `code`, as a static C string.
pub(crate) fn describe(code: c_int) -> &'static CStr {
    match code {
        0 => c"success",
        -1 => c"the controller completed the command with an NVMe error status",
        -2 => c"the peer broke the NVMe/TCP protocol",
        -3 => c"connection lost",
        -4 => c"the target refused the connection",
        -5 => c"TLS failed",
        -6 => c"transport error",
        -7 => c"command timed out",
        -8 => c"command aborted",
        -9 => c"queue full",
        -10 => c"invalid argument",
        -11 => c"out of DMA memory",
        -12 => c"reactor error",
        -13 => c"local failure (VFIO, IOMMU, interrupts, sysfs)",
        -14 => c"operating-system call failed",
        -15 => c"handle busy",
        -16 => c"internal error (a bug in nvpoll)",
        -17 => c"unknown error",
        _ => c"not an nvpoll error code",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nvpoll_core::spec::{CommandKind, Status};

    #[test]
    fn every_code_has_words_and_the_classes_follow_nvpoll() {
        for code in -17..=0 {
            assert_ne!(describe(code), c"not an nvpoll error code", "{code}");
        }
        assert_eq!(describe(-18), c"not an nvpoll error code");
        assert_eq!(describe(1), c"not an nvpoll error code");
        let nvme = Failure::Api(Error::Nvme(
            Status::LBA_OUT_OF_RANGE
                .with_dnr()
                .named_in(CommandKind::Nvm),
        ));
        assert_eq!(nvme.code(), NvpollError::NvpollErrNvme);
        assert_eq!(nvme.retry(), NvpollRetry::NvpollRetryNever);
        assert_eq!(nvme.fault(), NvpollFault::NvpollFaultPeer);
        assert_eq!(
            nvme.nvme_status(),
            Status::LBA_OUT_OF_RANGE.with_dnr().raw()
        );
        let full = Failure::Api(Error::QueueFull);
        assert_eq!(full.code() as c_int, -9);
        assert_eq!(full.retry(), NvpollRetry::NvpollRetryAfterCompletions);
        assert_eq!(full.fault(), NvpollFault::NvpollFaultCaller);
        let lost = Failure::Api(Error::ConnectionLost("reset by peer".into()));
        assert_eq!(
            (lost.code(), lost.retry(), lost.fault()),
            (
                NvpollError::NvpollErrConnectionLost,
                NvpollRetry::NvpollRetryElsewhere,
                NvpollFault::NvpollFaultPath
            )
        );
        assert_eq!(lost.message(), "connection lost: reset by peer");
        let tls = Failure::Api(Error::Tls("TLS: alert decrypt_error".into()));
        // Read as its source: said once.
        assert_eq!(tls.message(), "TLS: alert decrypt_error");
    }

    #[test]
    fn the_last_error_is_per_thread_and_nul_safe() {
        let text = || LAST.with(|l| l.borrow().message.clone());
        let code = record(&invalid("a\0b"));
        assert_eq!(code, -10);
        assert_eq!(text().to_str().unwrap(), "invalid argument: a b");
        assert_eq!(
            last_classes(),
            (
                NvpollRetry::NvpollRetryNever,
                NvpollFault::NvpollFaultCaller,
                0
            )
        );
        let other = std::thread::spawn(move || text().to_bytes().len())
            .join()
            .unwrap();
        assert_eq!(other, 0);
    }
}

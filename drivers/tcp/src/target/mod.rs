//! The NVMe/TCP target: NVM subsystems served to Linux hosts and to our own initiator, polled on nvpoll's
//! reactors.
//!
//! - [`Target::bind`] opens the namespaces and the listening socket; [`Target::start`] registers the listener
//!   as a poller on reactor 0. Each accepted connection goes to the next reactor, round robin, and stays
//!   there: one owner per queue, no locks on the I/O path. Until Fabrics Connect succeeds it sits in that
//!   reactor's setup set (idle half-open connections are looked at once per millisecond by a timed poller,
//!   and cost nothing in between); then it becomes a session poller of its own, polled on every iteration.
//! - A session (`session`) speaks NVMe/TCP: ICReq/ICResp, Fabrics Connect, and then commands: admin and
//!   fabrics ones (`admin`), NVM I/O (`io`), and the discovery log (`discovery`) for the well-known
//!   discovery subsystem, which every target serves.
//! - A controller (`controller`) is created by an admin-queue Connect (dynamic controller IDs) and torn down
//!   with its admin connection, or when its keep-alive timeout passes without a command on any of its queues.
//! - Namespaces (`subsystem`) are backed by RAM or by a file or block device (`store`).
//!
//! What hosts get: NVMe 1.3 controllers with MDTS 1 MiB, 8 KiB of in-capsule data (IOCCSZ 516), 128-entry
//! queues, SGLs (offset and transport data blocks), header and data digests as asked in ICReq, MAXH2CDATA
//! 128 KiB, one R2T per write at a time (so any MAXR2T is respected), the C2H success optimization when the host
//! disables SQ flow control, keep-alive enforcement (traffic based), held Asynchronous Event Requests, and the
//! Identify, feature and log pages the Linux host reads at connect. Not implemented: TLS (the connection's
//! byte transport, `crate::conn::Conn`, is where it goes), in-band authentication, reservations, Dataset
//! Management, ANA; asynchronous events never fire because namespaces never change while the target runs.
//!
//! Sending follows nvpoll's split of *queue* and *kick*: handlers only append PDUs to a connection's send
//! buffer, and the reactor's end-of-iteration flush writes each connection's buffer with one `write`.
//!
//! # Example
//! ```no_run
//! use nvpoll::reactor::{CoreList, Reactors};
//! use nvpoll_tcp::target::{Backing, SubsystemConfig, Target, TargetConfig};
//!
//! let subsys = SubsystemConfig::new("nqn.2024-01.io.nvpoll:demo").namespace(Backing::Ram(64 << 20), 512);
//! let config = TargetConfig::new("127.0.0.1:4420".parse().unwrap()).subsystem(subsys);
//! let target = Target::bind(config)?;
//! let reactors = Reactors::start(&"0".parse::<CoreList>()?)?;
//! let handle = target.start(&reactors)?;
//! // ... serve until told to stop ...
//! handle.stop();
//! reactors.stop()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![forbid(unsafe_code)]

mod admin;
mod controller;
mod device;
mod discovery;
mod io;
mod session;
mod store;
mod subsystem;

pub use device::{BlockDevice, QueuePairDevice};
pub use subsystem::{
    Backing, HostAccess, NamespaceConfig, SubsystemConfig, DISCOVERY_NQN, MAX_NQN_LEN,
};

use std::cell::{Cell, RefCell};
use std::fmt;
use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvpoll::reactor::{PollStatus, Poller, PollerId, ReactorContext, Reactors};
use nvpoll::send::SendMode;

use crate::pdu::Digests;
use crate::Error;
use session::{Progress, Session};
use subsystem::Subsystem;

/// Something that happened on the target, for logging.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub enum TargetEvent<'a> {
    /// A TCP connection was accepted and handed to a reactor.
    Accepted {
        /// The host's address.
        peer: SocketAddr,
        /// The reactor (index) that owns the connection.
        reactor: usize,
    },
    /// A connection became a queue with Fabrics Connect.
    QueueConnected {
        /// The host's address.
        peer: SocketAddr,
        /// The subsystem.
        subnqn: &'a str,
        /// The host NQN.
        hostnqn: &'a str,
        /// The controller.
        cntlid: u16,
        /// Queue ID (0: admin queue).
        qid: u16,
        /// Queue size (entries).
        depth: u32,
        /// Digests negotiated in ICReq/ICResp.
        digests: Digests,
    },
    /// A Fabrics Connect was refused.
    ConnectRefused {
        /// The host's address.
        peer: SocketAddr,
        /// The subsystem NQN the host asked for.
        subnqn: &'a str,
        /// The host NQN it gave (may be empty).
        hostnqn: &'a str,
        /// The queue it asked to connect (0: admin queue).
        qid: u16,
        /// Why, in words (which parameter was wrong, and how).
        reason: &'a str,
    },
    /// A controller's keep-alive timeout passed without a command: it is torn down.
    KeepAliveExpired {
        /// The address of its admin connection's host.
        peer: SocketAddr,
        /// The subsystem.
        subnqn: &'a str,
        /// The controller.
        cntlid: u16,
        /// Its timeout.
        kato_ms: u32,
    },
    /// A connection closed.
    Closed {
        /// The host's address.
        peer: SocketAddr,
        /// Its queue ID, if it got as far as Connect.
        qid: Option<u16>,
        /// Its controller, if it got as far as Connect.
        cntlid: Option<u16>,
        /// Why.
        reason: &'a str,
    },
}

impl fmt::Display for TargetEvent<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            TargetEvent::Accepted { peer, reactor } => {
                write!(f, "{peer}: accepted on reactor {reactor}")
            }
            TargetEvent::QueueConnected {
                peer,
                subnqn,
                hostnqn,
                cntlid,
                qid,
                depth,
                digests,
            } => {
                let kind = if qid == 0 {
                    "admin queue".to_string()
                } else {
                    format!("I/O queue {qid}")
                };
                let dg = match (digests.header, digests.data) {
                    (false, false) => "none",
                    (true, false) => "header",
                    (false, true) => "data",
                    (true, true) => "header+data",
                };
                write!(
                    f,
                    "{peer}: {kind} of controller {cntlid} on {subnqn} for {hostnqn}, depth {depth}, digests {dg}"
                )
            }
            TargetEvent::ConnectRefused {
                peer,
                subnqn,
                hostnqn,
                qid,
                reason,
            } => {
                let hostnqn = if hostnqn.is_empty() {
                    "(empty)"
                } else {
                    hostnqn
                };
                write!(
                    f,
                    "{peer}: Connect refused (queue {qid} of {subnqn} for host {hostnqn}): {reason}"
                )
            }
            TargetEvent::KeepAliveExpired {
                peer,
                subnqn,
                cntlid,
                kato_ms,
            } => {
                write!(f, "{peer}: controller {cntlid} on {subnqn}: no command for {kato_ms} ms, torn down")
            }
            TargetEvent::Closed {
                peer,
                qid,
                cntlid,
                reason,
            } => match (qid, cntlid) {
                (Some(q), Some(c)) => {
                    write!(f, "{peer}: queue {q} of controller {c} closed: {reason}")
                }
                _ => write!(f, "{peer}: closed: {reason}"),
            },
        }
    }
}

/// A callback that hears about [`TargetEvent`]s. It runs on the reactors: keep it short.
pub type EventHook = Arc<dyn Fn(&TargetEvent<'_>) + Send + Sync>;

/// Everything a target serves and how.
#[derive(Clone)]
pub struct TargetConfig {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// The NVM subsystems (the discovery subsystem is always added).
    pub subsystems: Vec<SubsystemConfig>,
    /// MAXH2CDATA announced in ICResp: the largest H2CData PDU hosts send (default 128 KiB).
    pub maxh2cdata: u32,
    /// In-capsule data accepted per command (default 8 KiB; Identify IOCCSZ is this plus the 64-byte command).
    pub incapsule_data: u32,
    /// Maximum Data Transfer Size as a power of two of 4 KiB pages (default 8: 1 MiB).
    pub mdts: u8,
    /// Entries per queue, admin and I/O (CAP.MQES + 1, default 128).
    pub queue_entries: u16,
    /// I/O queues per controller (default 128, as nvmet and SPDK grant).
    pub max_io_queues: u16,
    /// Time a new connection has for ICReq and Fabrics Connect (default 10 s).
    pub connect_timeout: Duration,
    /// Who hears about connections.
    pub events: Option<EventHook>,
    /// When responses leave (see [`nvpoll::send`]): inline as each is made, at the end-of-iteration flush, or
    /// adaptive (inline while the connection has nothing else to answer). Deferred by default.
    pub send_mode: SendMode,
    /// TLS 1.3 with external PSKs (NVMe/TCP 1.1 §3.6); `None` serves plain TCP only.
    pub tls: Option<TargetTls>,
}

/// The target's TLS settings.
#[derive(Clone, Debug)]
pub struct TargetTls {
    /// Refuse hosts that do not start with a TLS handshake. When `false` (optional), the first bytes decide:
    /// a TLS record (0x16) starts the handshake, a plain ICReq proceeds without TLS.
    pub required: bool,
    /// The handshake settings, including the PSK of every known identity.
    pub server: crate::tls::ServerConfig,
}

impl TargetTls {
    /// TLS with one configured PSK (`NVMeTLSkey-1:...`) per host NQN. The target accepts, for each host and
    /// each of `subnqns`, the v0 and v1 identities derived from that host's key (RFC 8446 derivation).
    pub fn with_host_keys(
        required: bool,
        keys: &[(String, crate::tls::ConfiguredKey)],
        subnqns: &[String],
    ) -> TargetTls {
        use crate::tls::{Derivation, IdentityVersion, Psk};
        let mut table: Vec<(Vec<u8>, Psk)> = Vec::new();
        for (host, key) in keys {
            for sub in subnqns {
                for v in [IdentityVersion::V0, IdentityVersion::V1] {
                    let (identity, psk) = key.derive(v, host, sub, Derivation::Rfc8446);
                    table.push((identity.into_bytes(), psk));
                }
            }
        }
        let server = crate::tls::ServerConfig::new(move |id| {
            table
                .iter()
                .find(|(i, _)| i.as_slice() == id)
                .map(|(_, p)| p.clone())
        });
        TargetTls { required, server }
    }
}

impl fmt::Debug for TargetConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TargetConfig")
            .field("listen", &self.listen)
            .field("subsystems", &self.subsystems)
            .field("maxh2cdata", &self.maxh2cdata)
            .field("incapsule_data", &self.incapsule_data)
            .field("mdts", &self.mdts)
            .field("queue_entries", &self.queue_entries)
            .field("max_io_queues", &self.max_io_queues)
            .field("connect_timeout", &self.connect_timeout)
            .finish_non_exhaustive()
    }
}

impl TargetConfig {
    /// A target on `listen` with the defaults and no subsystem yet.
    pub fn new(listen: SocketAddr) -> TargetConfig {
        TargetConfig {
            listen,
            subsystems: Vec::new(),
            maxh2cdata: 128 * 1024,
            incapsule_data: 8192,
            mdts: 8,
            queue_entries: 128,
            max_io_queues: 128,
            connect_timeout: Duration::from_secs(10),
            events: None,
            send_mode: SendMode::Deferred,
            tls: None,
        }
    }

    /// Adds a subsystem.
    pub fn subsystem(mut self, s: SubsystemConfig) -> TargetConfig {
        self.subsystems.push(s);
        self
    }

    /// Sets the event callback.
    pub fn on_event(
        mut self,
        f: impl Fn(&TargetEvent<'_>) + Send + Sync + 'static,
    ) -> TargetConfig {
        self.events = Some(Arc::new(f));
        self
    }

    fn limits(&self) -> Result<Limits, Error> {
        let bad = |what: String| Err(Error::InvalidArgument(what));
        if self.maxh2cdata < crate::pdu::MIN_MAXH2CDATA
            || self.maxh2cdata % 4 != 0
            || self.maxh2cdata > 16 << 20
        {
            return bad(format!(
                "MAXH2CDATA {}: must be a multiple of 4 from 4096 to 16 MiB",
                self.maxh2cdata
            ));
        }
        if self.incapsule_data < 1024
            || self.incapsule_data % 16 != 0
            || self.incapsule_data > 1 << 20
        {
            return bad(format!(
                "in-capsule data {}: must be a multiple of 16 from 1024 to 1 MiB",
                self.incapsule_data
            ));
        }
        if !(1..=10).contains(&self.mdts) {
            return bad(format!(
                "MDTS {}: must be 1 (8 KiB) to 10 (4 MiB)",
                self.mdts
            ));
        }
        if !(2..=1024).contains(&self.queue_entries) {
            return bad(format!(
                "queue size {}: must be 2 to 1024 entries",
                self.queue_entries
            ));
        }
        if !(1..=1024).contains(&self.max_io_queues) {
            return bad(format!(
                "I/O queues {}: must be 1 to 1024",
                self.max_io_queues
            ));
        }
        Ok(Limits {
            maxh2cdata: self.maxh2cdata,
            incapsule_data: self.incapsule_data,
            mdts: self.mdts,
            queue_entries: self.queue_entries,
            max_io_queues: self.max_io_queues,
            connect_timeout: self.connect_timeout,
        })
    }
}

/// The checked numbers of a [`TargetConfig`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub maxh2cdata: u32,
    pub incapsule_data: u32,
    pub mdts: u8,
    pub queue_entries: u16,
    pub max_io_queues: u16,
    pub connect_timeout: Duration,
}

impl Limits {
    /// The largest transfer of one command in bytes (MDTS in 4 KiB pages).
    pub fn max_transfer(&self) -> u32 {
        4096 << self.mdts
    }
}

/// Running totals of a target, updated by the sessions (each publishes its counters when it is idle or closes).
#[derive(Debug, Default)]
pub(crate) struct TargetStats {
    pub accepted: AtomicU64,
    pub closed: AtomicU64,
    pub commands: AtomicU64,
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub bytes_read: AtomicU64,
    pub bytes_written: AtomicU64,
    pub errors: AtomicU64,
    pub r2ts: AtomicU64,
    pub term_reqs: AtomicU64,
    pub connects_rejected: AtomicU64,
    pub keep_alive_expired: AtomicU64,
    pub dropped: AtomicU64,
    pub internal_errors: AtomicU64,
    pub aers_retired: AtomicU64,
}

/// A snapshot of a target's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TargetCounters {
    /// TCP connections accepted.
    pub accepted: u64,
    /// Connections closed (for any reason, dropped ones included).
    pub closed: u64,
    /// Commands received.
    pub commands: u64,
    /// Read commands completed successfully.
    pub reads: u64,
    /// Write commands completed successfully.
    pub writes: u64,
    /// Bytes read by hosts.
    pub bytes_read: u64,
    /// Bytes written by hosts.
    pub bytes_written: u64,
    /// Commands completed with an error status.
    pub errors: u64,
    /// R2T PDUs sent.
    pub r2ts: u64,
    /// C2HTermReq PDUs sent (protocol errors by hosts).
    pub term_reqs: u64,
    /// Fabrics Connects refused.
    pub connects_rejected: u64,
    /// Controllers torn down because their keep-alive timeout passed.
    pub keep_alive_expired: u64,
    /// Connections dropped because no reactor could take them or a session failed to start.
    pub dropped: u64,
    /// Connections closed because the target hit a bug (a panic, caught so that the reactor goes on).
    pub internal_errors: u64,
    /// Held Asynchronous Event Requests retired without a completion because the host gave up on them (it
    /// reused their command ID, as SPDK does at detach, or their queue entry).
    pub aers_retired: u64,
}

impl fmt::Display for TargetCounters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        write!(
            f,
            "connections {} accepted, {} closed, {} dropped; commands {} ({} errors); reads {} ({:.1} MiB); \
             writes {} ({:.1} MiB); R2T {}; C2HTermReq {}; connects refused {}; keep-alive expiries {}; \
             internal errors {}; AERs retired {}",
            self.accepted,
            self.closed,
            self.dropped,
            self.commands,
            self.errors,
            self.reads,
            mib(self.bytes_read),
            self.writes,
            mib(self.bytes_written),
            self.r2ts,
            self.term_reqs,
            self.connects_rejected,
            self.keep_alive_expired,
            self.internal_errors,
            self.aers_retired
        )
    }
}

/// What every session and the listener share.
pub(crate) struct TargetShared {
    pub limits: Limits,
    pub subsystems: Vec<Arc<Subsystem>>,
    /// The address actually listened on.
    pub listen: SocketAddr,
    pub stats: TargetStats,
    epoch: Instant,
    stop: AtomicBool,
    events: Option<EventHook>,
    /// The send mode every session applies, switchable while the target runs.
    send_mode: AtomicU8,
    /// TLS settings, if any.
    pub tls: Option<TargetTls>,
}

fn mode_to_u8(m: SendMode) -> u8 {
    match m {
        SendMode::Inline => 0,
        SendMode::Deferred => 1,
        SendMode::Adaptive => 2,
    }
}

fn mode_from_u8(v: u8) -> SendMode {
    match v {
        0 => SendMode::Inline,
        2 => SendMode::Adaptive,
        _ => SendMode::Deferred,
    }
}

impl TargetShared {
    /// The send mode sessions apply now.
    pub fn send_mode(&self) -> SendMode {
        mode_from_u8(self.send_mode.load(Ordering::Relaxed))
    }

    /// The subsystem named `nqn`.
    pub fn subsystem(&self, nqn: &str) -> Option<Arc<Subsystem>> {
        self.subsystems.iter().find(|s| s.nqn == nqn).cloned()
    }

    /// Milliseconds since the target started (the clock of keep-alive timeouts).
    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Whether the target was asked to stop.
    pub fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// Tells the event callback, if there is one.
    pub fn emit(&self, e: &TargetEvent<'_>) {
        if let Some(f) = &self.events {
            f(e);
        }
    }

    fn counters(&self) -> TargetCounters {
        let s = &self.stats;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        TargetCounters {
            accepted: l(&s.accepted),
            closed: l(&s.closed),
            commands: l(&s.commands),
            reads: l(&s.reads),
            writes: l(&s.writes),
            bytes_read: l(&s.bytes_read),
            bytes_written: l(&s.bytes_written),
            errors: l(&s.errors),
            r2ts: l(&s.r2ts),
            term_reqs: l(&s.term_reqs),
            connects_rejected: l(&s.connects_rejected),
            keep_alive_expired: l(&s.keep_alive_expired),
            dropped: l(&s.dropped),
            internal_errors: l(&s.internal_errors),
            aers_retired: l(&s.aers_retired),
        }
    }
}

/// A bound target, not serving yet.
pub struct Target {
    shared: Arc<TargetShared>,
    listener: TcpListener,
}

impl fmt::Debug for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Target")
            .field("listen", &self.shared.listen)
            .finish_non_exhaustive()
    }
}

impl Target {
    /// Checks the configuration, opens every namespace and binds the listening socket.
    pub fn bind(config: TargetConfig) -> Result<Target, Error> {
        let limits = config.limits()?;
        let mut subsystems = vec![Arc::new(Subsystem::discovery())];
        for s in &config.subsystems {
            if subsystems.iter().any(|t| t.nqn == s.nqn) {
                return Err(Error::InvalidArgument(format!(
                    "subsystem {} is configured twice",
                    s.nqn
                )));
            }
            subsystems.push(Arc::new(Subsystem::open(s)?));
        }
        let listener = TcpListener::bind(config.listen)
            .map_err(|e| Error::io(format!("listen on {}", config.listen), e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("set O_NONBLOCK on the listener", e))?;
        let listen = listener
            .local_addr()
            .map_err(|e| Error::io("listener address", e))?;
        let shared = Arc::new(TargetShared {
            limits,
            subsystems,
            listen,
            stats: TargetStats::default(),
            epoch: Instant::now(),
            stop: AtomicBool::new(false),
            events: config.events,
            send_mode: AtomicU8::new(mode_to_u8(config.send_mode)),
            tls: config.tls,
        });
        Ok(Target { shared, listener })
    }

    /// The address the target listens on (with the real port if the configuration said 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.shared.listen
    }

    /// A one-line description of each subsystem and namespace, for logs.
    pub fn describe(&self) -> Vec<String> {
        let mut out = Vec::new();
        for s in self
            .shared
            .subsystems
            .iter()
            .filter(|s| s.kind == subsystem::Kind::Nvm)
        {
            let hosts = match &s.hosts {
                HostAccess::AnyHost => "any host may connect".to_string(),
                HostAccess::Only(h) => format!("allowed hosts: {}", h.join(", ")),
            };
            out.push(format!(
                "subsystem {} (serial {}, model {}); {hosts}",
                s.nqn, s.serial, s.model
            ));
            for ns in &s.namespaces {
                out.push(format!(
                    "  namespace {}: {} blocks of {} bytes ({} MiB) on {}",
                    ns.nsid,
                    ns.blocks,
                    ns.block_size,
                    (ns.blocks * u64::from(ns.block_size)) >> 20,
                    ns.store.describe()
                ));
            }
        }
        out
    }

    /// Starts serving: the listener becomes a poller on reactor 0, and connections are spread over all
    /// reactors.
    pub fn start(self, reactors: &Reactors) -> Result<TargetHandle, Error> {
        let handle = TargetHandle {
            shared: Arc::clone(&self.shared),
        };
        let Target { shared, listener } = self;
        reactors
            .send(0, move |ctx| {
                let id = Rc::new(Cell::new(None));
                // Accepting is not latency-critical: polling the listener every iteration would cost one
                // accept4() system call per poll of the busiest reactor, as much as the I/O sockets' reads.
                let pid = ctx.add_timed_poller(
                    LISTEN_POLL_PERIOD,
                    ListenerPoller {
                        listener,
                        shared,
                        next: 0,
                        id: Rc::clone(&id),
                    },
                );
                id.set(Some(pid));
            })
            .map_err(|e| {
                Error::InvalidArgument(format!("cannot start the listener on reactor 0: {e}"))
            })?;
        Ok(handle)
    }
}

/// A running target.
#[derive(Clone)]
pub struct TargetHandle {
    shared: Arc<TargetShared>,
}

impl fmt::Debug for TargetHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TargetHandle")
            .field("listen", &self.shared.listen)
            .finish_non_exhaustive()
    }
}

impl TargetHandle {
    /// The address the target listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.shared.listen
    }

    /// The counters as they are now (sessions publish theirs when idle, so a busy one may lag a little).
    pub fn counters(&self) -> TargetCounters {
        self.shared.counters()
    }

    /// Switches every connection's send mode; each session applies it at its next poll.
    pub fn set_send_mode(&self, mode: SendMode) {
        self.shared
            .send_mode
            .store(mode_to_u8(mode), Ordering::Relaxed);
    }

    /// Stops accepting and closes every connection, on each reactor's next poll.
    pub fn stop(&self) {
        self.shared.stop.store(true, Ordering::Release);
    }
}

/// Accepts connections and hands each to a reactor, round robin.
struct ListenerPoller {
    listener: TcpListener,
    shared: Arc<TargetShared>,
    next: usize,
    id: Rc<Cell<Option<PollerId>>>,
}

/// How often the listener looks for new connections.
const LISTEN_POLL_PERIOD: Duration = Duration::from_millis(1);

/// Connections accepted per poll at most, so that a connect storm does not starve the other pollers.
const ACCEPT_BATCH: usize = 16;

impl Poller for ListenerPoller {
    fn poll(&mut self, ctx: &mut ReactorContext) -> PollStatus {
        if self.shared.stopping() {
            if let Some(id) = self.id.take() {
                ctx.remove_poller(id);
            }
            return PollStatus::Idle;
        }
        let mut status = PollStatus::Idle;
        for _ in 0..ACCEPT_BATCH {
            let stream = match self.listener.accept() {
                Ok((stream, _)) => stream,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e)
                    if e.kind() == ErrorKind::Interrupted
                        || e.kind() == ErrorKind::ConnectionAborted =>
                {
                    continue
                }
                // Out of file descriptors and the like: try again on a later poll.
                Err(_) => break,
            };
            status = PollStatus::Busy;
            self.shared.stats.accepted.fetch_add(1, Ordering::Relaxed);
            let reactor = self.next % ctx.reactor_count();
            self.next = self.next.wrapping_add(1);
            let shared = Arc::clone(&self.shared);
            if ctx
                .send(reactor, move |ctx| start_session(ctx, stream, shared))
                .is_err()
            {
                // The reactor's ring is full or it stopped: the connection is closed (dropped with the message).
                self.shared.stats.dropped.fetch_add(1, Ordering::Relaxed);
                self.shared.stats.closed.fetch_add(1, Ordering::Relaxed);
            }
        }
        status
    }
}

/// Runs on the reactor that will own the connection: the session starts in that reactor's setup poller.
fn start_session(ctx: &mut ReactorContext, stream: std::net::TcpStream, shared: Arc<TargetShared>) {
    let peer = stream.peer_addr();
    match Session::new(stream, Arc::clone(&shared)) {
        Ok(session) => {
            shared.emit(&TargetEvent::Accepted {
                peer: session.peer(),
                reactor: ctx.index(),
            });
            SetupPoller::adopt(ctx, &shared, session);
        }
        Err(e) => {
            shared.stats.dropped.fetch_add(1, Ordering::Relaxed);
            shared.stats.closed.fetch_add(1, Ordering::Relaxed);
            if let Ok(peer) = peer {
                let reason = format!("could not start a session: {e}");
                shared.emit(&TargetEvent::Closed {
                    peer,
                    qid: None,
                    cntlid: None,
                    reason: &reason,
                });
            }
        }
    }
}

/// How often a session that has not finished Fabrics Connect, and had nothing to do when last looked at, is
/// looked at again.
const SETUP_POLL_PERIOD: Duration = Duration::from_millis(1);

/// One reactor's sessions before Ready (or closing before they got there), for one target.
#[derive(Default)]
struct SetupSet {
    /// Busy when last looked at (or new): polled on every iteration.
    hot: Vec<Session>,
    /// Idle when last looked at: polled once per [`SETUP_POLL_PERIOD`].
    cold: Vec<Session>,
}

/// The setup sets of this reactor's thread, keyed by target.
type SetupSets = Vec<(usize, Rc<RefCell<SetupSet>>)>;

thread_local! {
    static SETUP_SETS: RefCell<SetupSets> = const { RefCell::new(Vec::new()) };
}

/// Where a setup session goes after a look.
enum Next {
    Hot,
    Cold,
    Gone,
    Ready,
}

/// Polls one setup session (and sends what it queued); panics are caught: a bug closes that connection only.
fn look_at(session: &mut Session) -> Next {
    let progress = catch_unwind(AssertUnwindSafe(|| {
        let p = session.poll();
        if !matches!(p, Progress::Finished) {
            session.flush();
        }
        p
    }));
    match progress {
        Ok(Progress::Finished) => Next::Gone,
        Err(_) => {
            session.note_internal_error();
            Next::Gone
        }
        Ok(_) if session.is_ready() => Next::Ready,
        Ok(Progress::Busy) => Next::Hot,
        Ok(Progress::Idle) => Next::Cold,
    }
}

/// Connections that have not finished Fabrics Connect, per reactor and target: the handshakes in progress, and
/// whatever a hostile host leaves half-open (connection floods, slowloris ICReqs, TLS garbage). Two pollers
/// share the set: [`SetupPoller::Hot`] polls, on every iteration, the sessions that were busy when last looked
/// at (nothing when there are none: no clock read, no system call), and the timed [`SetupPoller::Cold`] looks
/// at the idle ones once per [`SETUP_POLL_PERIOD`] and moves those with something to do to the hot list. A
/// session that reaches Ready becomes its own [`SessionPoller`], polled on every iteration.
struct SetupPoller {
    key: usize,
    cold: bool,
    shared: Arc<TargetShared>,
    set: Rc<RefCell<SetupSet>>,
    /// Both pollers' ids (to unregister both once the target stopped and the set is empty).
    ids: Rc<Cell<Option<(PollerId, PollerId)>>>,
}

impl SetupPoller {
    /// Hands `session` to this reactor's setup set for `shared`, registering its pollers on first use.
    fn adopt(ctx: &mut ReactorContext, shared: &Arc<TargetShared>, session: Session) {
        let key = Arc::as_ptr(shared) as usize;
        SETUP_SETS.with(|sets| {
            let mut sets = sets.borrow_mut();
            if let Some((_, set)) = sets.iter().find(|(k, _)| *k == key) {
                set.borrow_mut().hot.push(session);
                return;
            }
            let set = Rc::new(RefCell::new(SetupSet {
                hot: vec![session],
                cold: Vec::new(),
            }));
            sets.push((key, Rc::clone(&set)));
            let ids = Rc::new(Cell::new(None));
            let poller = |cold| SetupPoller {
                key,
                cold,
                shared: Arc::clone(shared),
                set: Rc::clone(&set),
                ids: Rc::clone(&ids),
            };
            let hot = ctx.add_poller(poller(false));
            let cold = ctx.add_timed_poller(SETUP_POLL_PERIOD, poller(true));
            ids.set(Some((hot, cold)));
        });
    }

    /// Unregisters both pollers (once the target stopped and its last setup session is gone).
    fn retire(&mut self, ctx: &mut ReactorContext) {
        SETUP_SETS.with(|sets| sets.borrow_mut().retain(|(k, _)| *k != self.key));
        if let Some((hot, cold)) = self.ids.take() {
            ctx.remove_poller(hot);
            ctx.remove_poller(cold);
        }
    }
}

impl Poller for SetupPoller {
    fn poll(&mut self, ctx: &mut ReactorContext) -> PollStatus {
        let set = Rc::clone(&self.set);
        let mut set = set.borrow_mut();
        let SetupSet { hot, cold } = &mut *set;
        if self.shared.stopping() {
            // Every session looks at the flag (and closes) on every iteration until it is gone.
            hot.append(cold);
            if hot.is_empty() {
                self.retire(ctx);
                return PollStatus::Idle;
            }
        }
        let (list, other) = if self.cold { (cold, hot) } else { (hot, cold) };
        if list.is_empty() {
            return PollStatus::Idle;
        }
        let mut busy = false;
        let mut i = 0;
        while i < list.len() {
            let next = look_at(&mut list[i]);
            busy |= !matches!(next, Next::Cold);
            match next {
                Next::Hot if !self.cold => i += 1,
                Next::Cold if self.cold => i += 1,
                Next::Hot | Next::Cold => other.push(list.swap_remove(i)),
                Next::Gone => {
                    let gone = list.swap_remove(i);
                    let _ = catch_unwind(AssertUnwindSafe(|| drop(gone)));
                }
                Next::Ready => {
                    // Connected: from now on polled on every iteration, by its own poller.
                    let id = Rc::new(Cell::new(None));
                    let pid = ctx.add_poller(SessionPoller {
                        session: Some(list.swap_remove(i)),
                        id: Rc::clone(&id),
                    });
                    id.set(Some(pid));
                }
            }
        }
        if busy {
            PollStatus::Busy
        } else {
            PollStatus::Idle
        }
    }
}

/// A connection that finished Fabrics Connect, as a reactor poller. A panic inside the session (a bug, never the
/// host's input) closes that connection only: it must not take the reactor and every other connection down
/// with it.
struct SessionPoller {
    session: Option<Session>,
    id: Rc<Cell<Option<PollerId>>>,
}

impl SessionPoller {
    /// The session panicked (the default hook printed where): count it and close the connection.
    fn internal_error(&mut self, ctx: &mut ReactorContext) {
        if let Some(s) = self.session.as_mut() {
            s.note_internal_error();
        }
        self.finish(ctx);
    }

    fn finish(&mut self, ctx: &mut ReactorContext) {
        // Dropping the session closes the socket and releases its queue or controller.
        let _ = catch_unwind(AssertUnwindSafe(|| drop(self.session.take())));
        if let Some(id) = self.id.take() {
            ctx.remove_poller(id);
        }
    }
}

impl Poller for SessionPoller {
    fn poll(&mut self, ctx: &mut ReactorContext) -> PollStatus {
        let Some(session) = self.session.as_mut() else {
            return PollStatus::Idle;
        };
        match catch_unwind(AssertUnwindSafe(|| session.poll())) {
            Ok(Progress::Busy) => PollStatus::Busy,
            Ok(Progress::Idle) => PollStatus::Idle,
            Ok(Progress::Finished) => {
                self.finish(ctx);
                PollStatus::Busy
            }
            Err(_) => {
                self.internal_error(ctx);
                PollStatus::Busy
            }
        }
    }

    fn flush(&mut self, ctx: &mut ReactorContext) {
        let Some(session) = self.session.as_mut() else {
            return;
        };
        if catch_unwind(AssertUnwindSafe(|| session.flush())).is_err() {
            self.internal_error(ctx);
        }
    }
}

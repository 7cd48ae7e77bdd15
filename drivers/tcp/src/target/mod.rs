//! The NVMe/TCP target: NVM subsystems served to Linux hosts and to our own initiator, polled on nvpoll's
//! reactors.
//!
//! - [`Target::bind`] opens the namespaces and the listening sockets (one or more, each plain, TLS optional or
//!   TLS required); [`Target::start`] registers the acceptor as a poller on reactor 0. Each accepted
//!   connection goes to the next reactor, round robin, and stays there: one owner per queue, no locks on the
//!   I/O path. Until Fabrics Connect succeeds it sits in that reactor's setup set (idle half-open connections
//!   are looked at once per millisecond by a timed poller, and cost nothing in between); then it becomes a
//!   session poller of its own, polled on every iteration.
//! - A session (`session`) speaks NVMe/TCP: TLS 1.3 with a PSK where the listener asks for it, ICReq/ICResp,
//!   Fabrics Connect, and then commands: admin and fabrics ones (`admin`), NVM I/O (`io`), and the discovery
//!   log (`discovery`) for the well-known discovery subsystem, which every target serves.
//! - A controller (`controller`) is created by an admin-queue Connect (dynamic controller IDs) and torn down
//!   with its admin connection, or when its keep-alive timeout passes without a command on any of its queues.
//! - Subsystems (`subsystem`) have their own namespaces (RAM, a file or block device, or another NVMe
//!   namespace: `store`, `device`), limits, allowed hosts and host PSKs, and may be limited to some listeners.
//! - While the target runs, a [`TargetHandle`] adds and removes subsystems, namespaces, listeners, allowed
//!   hosts and keys. A namespace change raises a Namespace Attribute Changed event on every controller of its
//!   subsystem; I/O queues see the new namespace table at their next poll (one atomic load per poll when
//!   nothing changed).
//!
//! Who gets in: a host is authenticated by the TLS identity it proved, not by what it claims in Connect: the
//! identity's host and subsystem NQNs must be those of the Connect. A subsystem lets in any host, or only the
//! hosts it lists.
//!
//! What hosts get: NVMe 1.3 controllers with MDTS 1 MiB, 8 KiB of in-capsule data (IOCCSZ 516), 128-entry
//! queues and 128 I/O queues (per subsystem, by default), SGLs (offset and transport data blocks), header and
//! data digests as asked in ICReq, MAXH2CDATA 128 KiB, one R2T per write at a time (so any MAXR2T is
//! respected), the C2H success optimization when the host disables SQ flow control, keep-alive enforcement
//! (traffic based), Asynchronous Event Requests (Namespace Attribute Changed), and the Identify, feature and
//! log pages the Linux host reads at connect. Not implemented: in-band authentication, reservations, Dataset
//! Management, ANA.
//!
//! Sending follows nvpoll's split of *queue* and *kick*: handlers append PDUs to a connection's send buffer,
//! and the send mode decides when it leaves (at once, or with the reactor's end-of-iteration flush, one `write`
//! per connection). Read data of 16 KiB or more from a RAM namespace is the exception: it leaves at once,
//! behind what is queued, with one `writev` straight from the namespace's memory (or sealed straight from it
//! into TLS records), instead of being copied into the send buffer first.
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
pub mod config;
mod controller;
mod device;
mod discovery;
mod io;
pub mod rpc;
mod session;
mod store;
mod subsystem;

pub use device::{BlockDevice, QueuePairDevice};
pub use subsystem::{
    Backing, HostAccess, HostKey, NamespaceConfig, SubsystemConfig, SubsystemLimits, DISCOVERY_NQN,
    MAX_NAMESPACES, MAX_NQN_LEN,
};

use std::cell::{Cell, RefCell};
use std::fmt;
use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use nvpoll::reactor::{PollStatus, Poller, PollerId, ReactorContext, Reactors};
use nvpoll::send::SendMode;

use crate::pdu::Digests;
use crate::Error;
use session::{Progress, Session};
use subsystem::{lock, Subsystem};

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

/// Whether a listener speaks TLS.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TlsMode {
    /// Plain TCP only.
    #[default]
    Off,
    /// The first bytes decide: a TLS record (0x16) starts the handshake, a plain ICReq proceeds without TLS.
    Optional,
    /// Every host must start with a TLS handshake.
    Required,
}

impl TlsMode {
    /// The name used on command lines and in configuration files.
    pub fn as_str(self) -> &'static str {
        match self {
            TlsMode::Off => "off",
            TlsMode::Optional => "optional",
            TlsMode::Required => "required",
        }
    }
}

impl std::str::FromStr for TlsMode {
    type Err = String;

    fn from_str(s: &str) -> Result<TlsMode, String> {
        match s {
            "off" => Ok(TlsMode::Off),
            "optional" => Ok(TlsMode::Optional),
            "required" => Ok(TlsMode::Required),
            _ => Err(format!("TLS mode {s:?}: must be off, optional or required")),
        }
    }
}

impl fmt::Display for TlsMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One address the target listens on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ListenerConfig {
    /// Address and port (port 0: any free port).
    pub address: SocketAddr,
    /// Plain, TLS optional or TLS required.
    pub tls: TlsMode,
}

/// Everything a target serves and how.
#[derive(Clone)]
pub struct TargetConfig {
    /// The first address to listen on; its TLS mode follows [`TargetConfig::tls`].
    pub listen: SocketAddr,
    /// More listeners, each with its own TLS mode, all served by the same reactors.
    pub listeners: Vec<ListenerConfig>,
    /// The NVM subsystems (the discovery subsystem is always added).
    pub subsystems: Vec<SubsystemConfig>,
    /// MAXH2CDATA announced in ICResp: the largest H2CData PDU hosts send (default 128 KiB).
    pub maxh2cdata: u32,
    /// In-capsule data accepted per command (default 8 KiB; Identify IOCCSZ is this plus the 64-byte command).
    pub incapsule_data: u32,
    /// Maximum Data Transfer Size as a power of two of 4 KiB pages (default 8: 1 MiB), for subsystems that do
    /// not set their own.
    pub mdts: u8,
    /// Entries per queue, admin and I/O (CAP.MQES + 1, default 128), for subsystems that do not set their own.
    pub queue_entries: u16,
    /// I/O queues per controller (default 128, as nvmet and SPDK grant), for subsystems that do not set their
    /// own.
    pub max_io_queues: u16,
    /// Time a new connection has for ICReq and Fabrics Connect (default 10 s).
    pub connect_timeout: Duration,
    /// Who hears about connections.
    pub events: Option<EventHook>,
    /// When responses leave (see [`nvpoll::send`]): inline as each is made, at the end-of-iteration flush, or
    /// adaptive (inline while the connection has nothing else to answer). Deferred by default.
    pub send_mode: SendMode,
    /// TLS on the first listener ([`TargetConfig::listen`]) and PSKs valid for several subsystems; `None`:
    /// that listener is plain. Subsystems carry their own host keys too ([`SubsystemConfig::host_keys`]).
    pub tls: Option<TargetTls>,
}

/// TLS of the first listener, and host keys shared by several subsystems.
#[derive(Clone, Debug)]
pub struct TargetTls {
    /// Refuse hosts that do not start with a TLS handshake. When `false` (optional), the first bytes decide:
    /// a TLS record (0x16) starts the handshake, a plain ICReq proceeds without TLS.
    pub required: bool,
    /// Host keys, each valid for every subsystem of `subnqns`.
    pub keys: Vec<HostKey>,
    /// The subsystems (the discovery subsystem among them if wanted) the keys are valid for.
    pub subnqns: Vec<String>,
}

impl TargetTls {
    /// TLS with one configured PSK (`NVMeTLSkey-1:...`) per host NQN. The target accepts, for each host and
    /// each of `subnqns`, the v0 and v1 identities derived from that host's key (RFC 8446 derivation).
    pub fn with_host_keys(
        required: bool,
        keys: &[(String, crate::tls::ConfiguredKey)],
        subnqns: &[String],
    ) -> TargetTls {
        TargetTls {
            required,
            keys: keys
                .iter()
                .map(|(h, k)| HostKey {
                    hostnqn: h.clone(),
                    key: k.clone(),
                })
                .collect(),
            subnqns: subnqns.to_vec(),
        }
    }

    fn mode(&self) -> TlsMode {
        if self.required {
            TlsMode::Required
        } else {
            TlsMode::Optional
        }
    }
}

impl fmt::Debug for TargetConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TargetConfig")
            .field("listen", &self.listen)
            .field("listeners", &self.listeners)
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
            listeners: Vec::new(),
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

    /// Adds a listener.
    pub fn listener(mut self, address: SocketAddr, tls: TlsMode) -> TargetConfig {
        self.listeners.push(ListenerConfig { address, tls });
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
        let defaults = subsystem::Limits {
            max_io_queues: self.max_io_queues,
            queue_entries: self.queue_entries,
            mdts: self.mdts,
        };
        defaults.check()?;
        Ok(Limits {
            maxh2cdata: self.maxh2cdata,
            incapsule_data: self.incapsule_data,
            connect_timeout: self.connect_timeout,
            defaults,
        })
    }
}

/// The checked numbers of a [`TargetConfig`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub maxh2cdata: u32,
    pub incapsule_data: u32,
    pub connect_timeout: Duration,
    /// What subsystems get unless they say otherwise.
    pub defaults: subsystem::Limits,
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

/// A listener as the target runs it.
#[derive(Debug)]
pub(crate) struct Listener {
    /// Port ID in the discovery log page.
    pub port_id: u16,
    /// The address actually listened on.
    pub addr: SocketAddr,
    pub tls: TlsMode,
    /// Removed at run time: the acceptor closes its socket (connections made through it stay).
    removed: AtomicBool,
}

/// The subsystems and keys, shared with the TLS PSK lookup (which runs inside handshakes).
pub(crate) struct Registry {
    subsystems: RwLock<Vec<Arc<Subsystem>>>,
    /// Keys of [`TargetTls`]: valid for the subsystems they list.
    target_keys: Vec<HostKey>,
    target_key_subnqns: Vec<String>,
    /// The discovery log's generation counter: moves with every change a discovery host could see.
    pub generation: AtomicU64,
}

impl Registry {
    fn subsystem(&self, nqn: &str) -> Option<Arc<Subsystem>> {
        let list = self.subsystems.read().unwrap_or_else(|e| e.into_inner());
        list.iter().find(|s| s.nqn == nqn).cloned()
    }

    /// The subsystem list, to change it.
    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Vec<Arc<Subsystem>>> {
        self.subsystems.write().unwrap_or_else(|e| e.into_inner())
    }

    fn all(&self) -> Vec<Arc<Subsystem>> {
        self.subsystems
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The TLS PSK of an NVMe identity: the identity names its host and subsystem, and one of the keys that
    /// host has for that subsystem (for the discovery subsystem: for any subsystem) must derive exactly it.
    fn psk_for(&self, identity: &[u8]) -> Option<crate::tls::Psk> {
        use crate::tls::{Derivation, ParsedIdentity};
        let p = ParsedIdentity::parse(identity)?;
        let mut candidates = Vec::new();
        if self.target_key_subnqns.contains(&p.subnqn) {
            candidates.extend(
                self.target_keys
                    .iter()
                    .filter(|k| k.hostnqn == p.hostnqn)
                    .map(|k| k.key.clone()),
            );
        }
        if p.subnqn == DISCOVERY_NQN {
            for s in self.all() {
                candidates.extend(s.keys_of(&p.hostnqn));
            }
        } else if let Some(s) = self.subsystem(&p.subnqn) {
            candidates.extend(s.keys_of(&p.hostnqn));
        }
        candidates.into_iter().find_map(|key| {
            let (id, psk) = key.derive(p.version, &p.hostnqn, &p.subnqn, Derivation::Rfc8446);
            (id.as_bytes() == identity).then_some(psk)
        })
    }
}

/// What every session and the listener share.
pub(crate) struct TargetShared {
    pub limits: Limits,
    pub registry: Arc<Registry>,
    listeners: Mutex<Vec<Arc<Listener>>>,
    /// Sockets bound at run time, for the acceptor to adopt.
    new_listeners: Mutex<Vec<(Arc<Listener>, TcpListener)>>,
    /// Moves when a listener is added or removed (the acceptor looks at it once per poll).
    listeners_gen: AtomicU64,
    next_port_id: AtomicU16,
    pub stats: TargetStats,
    epoch: Instant,
    stop: AtomicBool,
    events: Option<EventHook>,
    /// The send mode every session applies, switchable while the target runs.
    send_mode: AtomicU8,
    /// The TLS server settings (the PSK lookup reads the registry).
    pub tls_server: crate::tls::ServerConfig,
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

    /// The subsystem named `nqn` (the discovery subsystem included), if it is in service.
    pub fn subsystem(&self, nqn: &str) -> Option<Arc<Subsystem>> {
        self.registry.subsystem(nqn)
    }

    /// Every subsystem in service, the discovery subsystem first.
    pub fn subsystems(&self) -> Vec<Arc<Subsystem>> {
        self.registry.all()
    }

    /// Something a discovery host could see changed.
    fn discovery_changed(&self) {
        self.registry.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Binds a listener; the acceptor on reactor 0 adopts it at its next poll (connections wait in the
    /// socket's backlog until then).
    fn bind_listener(&self, cfg: ListenerConfig) -> Result<(Arc<Listener>, TcpListener), Error> {
        let socket = TcpListener::bind(cfg.address)
            .map_err(|e| Error::io(format!("listen on {}", cfg.address), e))?;
        socket
            .set_nonblocking(true)
            .map_err(|e| Error::io("set O_NONBLOCK on the listener", e))?;
        let addr = socket
            .local_addr()
            .map_err(|e| Error::io("listener address", e))?;
        let listener = Arc::new(Listener {
            port_id: self.next_port_id.fetch_add(1, Ordering::Relaxed),
            addr,
            tls: cfg.tls,
            removed: AtomicBool::new(false),
        });
        Ok((listener, socket))
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
    sockets: Vec<(Arc<Listener>, TcpListener)>,
}

impl fmt::Debug for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Target")
            .field("listen", &self.local_addr())
            .finish_non_exhaustive()
    }
}

impl Target {
    /// Checks the configuration, opens every namespace and binds the listening sockets.
    pub fn bind(config: TargetConfig) -> Result<Target, Error> {
        let limits = config.limits()?;
        let mut subsystems = vec![Arc::new(Subsystem::discovery(limits.defaults))];
        for s in &config.subsystems {
            if subsystems.iter().any(|t| t.nqn == s.nqn) {
                return Err(Error::InvalidArgument(format!(
                    "subsystem {} is configured twice",
                    s.nqn
                )));
            }
            subsystems.push(Arc::new(Subsystem::open(s, limits.defaults)?));
        }
        let (target_keys, target_key_subnqns) = match &config.tls {
            Some(t) => (t.keys.clone(), t.subnqns.clone()),
            None => (Vec::new(), Vec::new()),
        };
        let registry = Arc::new(Registry {
            subsystems: RwLock::new(subsystems),
            target_keys,
            target_key_subnqns,
            generation: AtomicU64::new(1),
        });
        let lookup = Arc::clone(&registry);
        let shared = Arc::new(TargetShared {
            limits,
            registry,
            listeners: Mutex::new(Vec::new()),
            new_listeners: Mutex::new(Vec::new()),
            listeners_gen: AtomicU64::new(0),
            next_port_id: AtomicU16::new(1),
            stats: TargetStats::default(),
            epoch: Instant::now(),
            stop: AtomicBool::new(false),
            events: config.events,
            send_mode: AtomicU8::new(mode_to_u8(config.send_mode)),
            tls_server: crate::tls::ServerConfig::new(move |id| lookup.psk_for(id)),
        });
        let first = ListenerConfig {
            address: config.listen,
            tls: config.tls.as_ref().map_or(TlsMode::Off, TargetTls::mode),
        };
        let mut sockets: Vec<(Arc<Listener>, TcpListener)> = Vec::new();
        for cfg in std::iter::once(first).chain(config.listeners.iter().copied()) {
            if sockets.iter().any(|(l, _)| l.addr == cfg.address) {
                return Err(Error::InvalidArgument(format!(
                    "listener {} is configured twice",
                    cfg.address
                )));
            }
            sockets.push(shared.bind_listener(cfg)?);
        }
        *lock(&shared.listeners) = sockets.iter().map(|(l, _)| Arc::clone(l)).collect();
        Ok(Target { shared, sockets })
    }

    /// The address of the first listener (with the real port if the configuration said 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.sockets[0].0.addr
    }

    /// Every listener's address and TLS mode, in configuration order.
    pub fn listeners(&self) -> Vec<ListenerConfig> {
        self.handle().listeners()
    }

    fn handle(&self) -> TargetHandle {
        TargetHandle {
            shared: Arc::clone(&self.shared),
        }
    }

    /// A one-line description of each listener, subsystem and namespace, for logs.
    pub fn describe(&self) -> Vec<String> {
        let mut out = Vec::new();
        for l in self.listeners() {
            out.push(format!("listener {} (TLS {})", l.address, l.tls));
        }
        for s in self.handle().subsystems() {
            out.extend(s.describe());
        }
        out
    }

    /// Starts serving: the acceptor becomes a poller on reactor 0, and connections are spread over all
    /// reactors.
    pub fn start(self, reactors: &Reactors) -> Result<TargetHandle, Error> {
        let handle = self.handle();
        let Target { shared, sockets } = self;
        let seen = shared.listeners_gen.load(Ordering::Acquire);
        reactors
            .send(0, move |ctx| {
                let id = Rc::new(Cell::new(None));
                // Accepting is not latency-critical: polling the listeners every iteration would cost one
                // accept4() system call each per poll of the busiest reactor, as much as the I/O sockets' reads.
                let pid = ctx.add_timed_poller(
                    LISTEN_POLL_PERIOD,
                    Acceptor {
                        sockets,
                        shared,
                        seen,
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

/// A subsystem as [`TargetHandle::subsystems`] reports it: no key material, only which hosts have a key.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SubsystemInfo {
    /// Its NQN.
    pub nqn: String,
    /// Serial number.
    pub serial: String,
    /// Model number.
    pub model: String,
    /// Who may connect.
    pub hosts: HostAccess,
    /// The hosts that have a TLS PSK for it.
    pub hosts_with_keys: Vec<String>,
    /// Its namespaces.
    pub namespaces: Vec<NamespaceInfo>,
    /// The listeners it is reachable on (`None`: all).
    pub listeners: Option<Vec<SocketAddr>>,
    /// I/O queues per controller.
    pub max_io_queues: u16,
    /// Entries per queue.
    pub queue_entries: u16,
    /// MDTS (a power of two of 4 KiB pages).
    pub mdts: u8,
    /// Controllers connected now.
    pub controllers: usize,
}

impl SubsystemInfo {
    fn describe(&self) -> Vec<String> {
        let hosts = match &self.hosts {
            HostAccess::AnyHost => "any host may connect".to_string(),
            HostAccess::Only(h) if h.is_empty() => "no host may connect".to_string(),
            HostAccess::Only(h) => format!("allowed hosts: {}", h.join(", ")),
        };
        let keys = if self.hosts_with_keys.is_empty() {
            String::new()
        } else {
            format!("; TLS keys for {}", self.hosts_with_keys.join(", "))
        };
        let on = match &self.listeners {
            None => String::new(),
            Some(l) => {
                let l: Vec<String> = l.iter().map(SocketAddr::to_string).collect();
                format!("; only on {}", l.join(", "))
            }
        };
        let mut out = vec![format!(
            "subsystem {} (serial {}, model {}); {hosts}{keys}{on}",
            self.nqn, self.serial, self.model
        )];
        for ns in &self.namespaces {
            out.push(format!(
                "  namespace {}: {} blocks of {} bytes ({} MiB) on {}",
                ns.nsid,
                ns.blocks,
                ns.block_size,
                (ns.blocks * u64::from(ns.block_size)) >> 20,
                ns.backing
            ));
        }
        out
    }
}

/// A namespace as [`TargetHandle::subsystems`] reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct NamespaceInfo {
    /// Namespace ID.
    pub nsid: u32,
    /// Logical block size.
    pub block_size: u32,
    /// Number of blocks.
    pub blocks: u64,
    /// What backs it, in words.
    pub backing: String,
}

fn info(s: &Subsystem) -> SubsystemInfo {
    let (table, _) = s.ns_table();
    SubsystemInfo {
        nqn: s.nqn.clone(),
        serial: s.serial.clone(),
        model: s.model.clone(),
        hosts: s.hosts(),
        hosts_with_keys: s.key_hosts(),
        namespaces: table
            .iter()
            .map(|ns| NamespaceInfo {
                nsid: ns.nsid,
                block_size: ns.block_size,
                blocks: ns.blocks,
                backing: ns.store.describe(),
            })
            .collect(),
        listeners: s.listeners.clone(),
        max_io_queues: s.limits.max_io_queues,
        queue_entries: s.limits.queue_entries,
        mdts: s.limits.mdts,
        controllers: s.controller_count(),
    }
}

/// A running target. Every method may be called from any thread while the reactors serve hosts; a change
/// touches only what it names, so no host of another subsystem notices.
#[derive(Clone)]
pub struct TargetHandle {
    shared: Arc<TargetShared>,
}

impl fmt::Debug for TargetHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TargetHandle").finish_non_exhaustive()
    }
}

impl TargetHandle {
    /// The address of the first listener still open (the first configured one unless it was removed).
    pub fn local_addr(&self) -> SocketAddr {
        let l = lock(&self.shared.listeners);
        l.first()
            .map_or(SocketAddr::from(([0, 0, 0, 0], 0)), |l| l.addr)
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

    /// The listeners, in the order they were added.
    pub fn listeners(&self) -> Vec<ListenerConfig> {
        lock(&self.shared.listeners)
            .iter()
            .map(|l| ListenerConfig {
                address: l.addr,
                tls: l.tls,
            })
            .collect()
    }

    /// Opens a listener; returns the address it listens on (the real port if `cfg` said 0).
    pub fn add_listener(&self, cfg: ListenerConfig) -> Result<SocketAddr, Error> {
        if self.shared.stopping() {
            return Err(Error::InvalidArgument("the target is stopping".into()));
        }
        let mut listeners = lock(&self.shared.listeners);
        if cfg.address.port() != 0 && listeners.iter().any(|l| l.addr == cfg.address) {
            return Err(Error::InvalidArgument(format!(
                "listener {} exists already",
                cfg.address
            )));
        }
        let (listener, socket) = self.shared.bind_listener(cfg)?;
        let addr = listener.addr;
        listeners.push(Arc::clone(&listener));
        lock(&self.shared.new_listeners).push((listener, socket));
        self.shared.listeners_gen.fetch_add(1, Ordering::AcqRel);
        self.shared.discovery_changed();
        Ok(addr)
    }

    /// Closes the listener on `addr`. Connections made through it stay until their hosts end them.
    pub fn remove_listener(&self, addr: SocketAddr) -> Result<(), Error> {
        let mut listeners = lock(&self.shared.listeners);
        let Some(i) = listeners.iter().position(|l| l.addr == addr) else {
            return Err(Error::InvalidArgument(format!("no listener on {addr}")));
        };
        let l = listeners.remove(i);
        l.removed.store(true, Ordering::Release);
        self.shared.listeners_gen.fetch_add(1, Ordering::AcqRel);
        self.shared.discovery_changed();
        Ok(())
    }

    /// Every NVM subsystem, as it is now (no key material).
    pub fn subsystems(&self) -> Vec<SubsystemInfo> {
        self.shared
            .subsystems()
            .iter()
            .filter(|s| s.kind == subsystem::Kind::Nvm)
            .map(|s| info(s))
            .collect()
    }

    /// Adds a subsystem (its namespaces are opened first; nothing changes if one fails).
    pub fn add_subsystem(&self, cfg: &SubsystemConfig) -> Result<(), Error> {
        let s = Arc::new(Subsystem::open(cfg, self.shared.limits.defaults)?);
        let mut list = self.shared.registry.write();
        if list.iter().any(|t| t.nqn == cfg.nqn) {
            return Err(Error::InvalidArgument(format!(
                "subsystem {} exists already",
                cfg.nqn
            )));
        }
        list.push(s);
        self.shared.discovery_changed();
        Ok(())
    }

    /// Removes a subsystem: no host can connect to it any more, and its controllers are torn down. Their
    /// queues complete what they hold (commands waiting for data or a flush, held AERs) with Command Aborted
    /// due to SQ Deletion, then close.
    pub fn remove_subsystem(&self, nqn: &str) -> Result<(), Error> {
        let mut list = self.shared.registry.write();
        let Some(i) = list
            .iter()
            .position(|s| s.nqn == nqn && s.kind == subsystem::Kind::Nvm)
        else {
            return Err(no_subsystem(nqn));
        };
        let s = list.remove(i);
        drop(list);
        s.remove();
        self.shared.discovery_changed();
        Ok(())
    }

    fn nvm_subsystem(&self, nqn: &str) -> Result<Arc<Subsystem>, Error> {
        self.shared
            .subsystem(nqn)
            .filter(|s| s.kind == subsystem::Kind::Nvm)
            .ok_or_else(|| no_subsystem(nqn))
    }

    /// Adds a namespace to subsystem `nqn`; returns its ID. Connected hosts get a Namespace Attribute Changed
    /// event.
    pub fn add_namespace(&self, nqn: &str, ns: &NamespaceConfig) -> Result<u32, Error> {
        self.nvm_subsystem(nqn)?.add_namespace(ns)
    }

    /// Removes namespace `nsid` of subsystem `nqn`. Commands already running on it finish with it; later ones
    /// get Invalid Namespace. Connected hosts get a Namespace Attribute Changed event.
    pub fn remove_namespace(&self, nqn: &str, nsid: u32) -> Result<(), Error> {
        self.nvm_subsystem(nqn)?.remove_namespace(nsid)
    }

    /// Lets `hostnqn` connect to subsystem `nqn`. A subsystem that lets any host in refuses this (turn that off
    /// first with [`TargetHandle::set_allow_any_host`]): silently closing it to every other host would be a
    /// surprise, and SPDK users expect adding a host never to lock anyone out.
    pub fn allow_host(&self, nqn: &str, hostnqn: &str) -> Result<(), Error> {
        let s = self.nvm_subsystem(nqn)?;
        let hosts = match s.hosts() {
            HostAccess::AnyHost => {
                let why = "lets any host in; turn allow-any-host off first to list its hosts";
                return Err(Error::InvalidArgument(format!("{nqn} {why}")));
            }
            HostAccess::Only(mut h) => {
                if h.iter().any(|x| x == hostnqn) {
                    return Err(Error::InvalidArgument(format!(
                        "host {hostnqn} is allowed on {nqn} already"
                    )));
                }
                h.push(hostnqn.to_string());
                HostAccess::Only(h)
            }
        };
        s.set_hosts(hosts)?;
        self.shared.discovery_changed();
        Ok(())
    }

    /// No longer lets `hostnqn` connect to subsystem `nqn` (its connected controllers stay).
    pub fn disallow_host(&self, nqn: &str, hostnqn: &str) -> Result<(), Error> {
        let s = self.nvm_subsystem(nqn)?;
        match s.hosts() {
            HostAccess::Only(mut h) if h.iter().any(|x| x == hostnqn) => {
                h.retain(|x| x != hostnqn);
                s.set_hosts(HostAccess::Only(h))?;
                self.shared.discovery_changed();
                Ok(())
            }
            _ => Err(Error::InvalidArgument(format!(
                "host {hostnqn} is not among the allowed hosts of {nqn}"
            ))),
        }
    }

    /// Lets any host connect to subsystem `nqn` (`true`), or only the hosts listed so far (`false`).
    pub fn set_allow_any_host(&self, nqn: &str, any: bool) -> Result<(), Error> {
        let s = self.nvm_subsystem(nqn)?;
        match (s.hosts(), any) {
            (HostAccess::AnyHost, true) | (HostAccess::Only(_), false) => return Ok(()),
            (HostAccess::Only(_), true) => s.set_hosts(HostAccess::AnyHost)?,
            (HostAccess::AnyHost, false) => s.set_hosts(HostAccess::Only(Vec::new()))?,
        }
        self.shared.discovery_changed();
        Ok(())
    }

    /// Sets (or replaces) a host's TLS PSK for subsystem `nqn`. New handshakes use it at once.
    pub fn set_host_key(&self, nqn: &str, key: HostKey) -> Result<(), Error> {
        self.nvm_subsystem(nqn)?.set_key(key)
    }

    /// Removes a host's TLS PSK for subsystem `nqn` (sessions already made stay).
    pub fn remove_host_key(&self, nqn: &str, hostnqn: &str) -> Result<(), Error> {
        if self.nvm_subsystem(nqn)?.remove_key(hostnqn) {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "host {hostnqn} has no key for {nqn}"
            )))
        }
    }
}

fn no_subsystem(nqn: &str) -> Error {
    Error::InvalidArgument(format!("no subsystem {nqn}"))
}

/// Accepts connections on every listener and hands each to a reactor, round robin.
struct Acceptor {
    sockets: Vec<(Arc<Listener>, TcpListener)>,
    shared: Arc<TargetShared>,
    /// The listener generation the sockets reflect.
    seen: u64,
    next: usize,
    id: Rc<Cell<Option<PollerId>>>,
}

/// How often the listeners are looked at for new connections.
const LISTEN_POLL_PERIOD: Duration = Duration::from_millis(1);

/// Connections accepted per listener and poll at most, so that a connect storm does not starve the other
/// pollers.
const ACCEPT_BATCH: usize = 16;

impl Acceptor {
    fn sync_listeners(&mut self) {
        let generation = self.shared.listeners_gen.load(Ordering::Acquire);
        if generation == self.seen {
            return;
        }
        self.seen = generation;
        self.sockets
            .extend(lock(&self.shared.new_listeners).drain(..));
        // Dropping a socket closes it: the port is free again.
        self.sockets
            .retain(|(l, _)| !l.removed.load(Ordering::Acquire));
    }
}

impl Poller for Acceptor {
    fn poll(&mut self, ctx: &mut ReactorContext) -> PollStatus {
        if self.shared.stopping() {
            self.sockets.clear();
            if let Some(id) = self.id.take() {
                ctx.remove_poller(id);
            }
            return PollStatus::Idle;
        }
        self.sync_listeners();
        let mut status = PollStatus::Idle;
        for (listener, socket) in &self.sockets {
            for _ in 0..ACCEPT_BATCH {
                let stream = match socket.accept() {
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
                let listener = Arc::clone(listener);
                if ctx
                    .send(reactor, move |ctx| {
                        start_session(ctx, stream, shared, listener)
                    })
                    .is_err()
                {
                    // The reactor's ring is full or it stopped: the connection is closed (dropped with the
                    // message).
                    self.shared.stats.dropped.fetch_add(1, Ordering::Relaxed);
                    self.shared.stats.closed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        status
    }
}

/// Runs on the reactor that will own the connection: the session starts in that reactor's setup poller.
fn start_session(
    ctx: &mut ReactorContext,
    stream: std::net::TcpStream,
    shared: Arc<TargetShared>,
    listener: Arc<Listener>,
) {
    let peer = stream.peer_addr();
    match Session::new(stream, Arc::clone(&shared), listener) {
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

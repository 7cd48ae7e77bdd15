//! What every reactor of a running target shares: the listeners, the registry of subsystems and keys, the
//! limits, the event hook and the running totals ([`TargetShared`]).

use std::fmt;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use nvpoll::send::SendMode;

use crate::events::{EventHook, TargetEvent};
use crate::options::{Limits, ListenerConfig, TlsMode};
use crate::subsystem::{HostKey, Subsystem, DISCOVERY_NQN};
use nvpoll_tcp::Error;

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
    pub(crate) removed: AtomicBool,
}

/// The subsystems and keys, shared with the TLS PSK lookup (which runs inside handshakes).
pub(crate) struct Registry {
    pub(crate) subsystems: RwLock<Vec<Arc<Subsystem>>>,
    /// Keys of [`TargetTls`]: valid for the subsystems they list.
    pub(crate) target_keys: Vec<HostKey>,
    pub(crate) target_key_subnqns: Vec<String>,
    /// The discovery log's generation counter: moves with every change a discovery host could see.
    pub generation: AtomicU64,
}

impl Registry {
    fn subsystem(&self, nqn: &str) -> Option<Arc<Subsystem>> {
        let list = self.subsystems.read().unwrap_or_else(|e| e.into_inner());
        list.iter().find(|s| s.nqn == nqn).cloned()
    }

    /// The subsystem list, to change it.
    pub(crate) fn write(&self) -> std::sync::RwLockWriteGuard<'_, Vec<Arc<Subsystem>>> {
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
    pub(crate) fn psk_for(&self, identity: &[u8]) -> Option<nvpoll_tcp::tls::Psk> {
        use nvpoll_tcp::tls::{Derivation, ParsedIdentity};
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
    pub(crate) listeners: Mutex<Vec<Arc<Listener>>>,
    /// Sockets bound at run time, for the acceptor to adopt.
    pub(crate) new_listeners: Mutex<Vec<(Arc<Listener>, TcpListener)>>,
    /// Moves when a listener is added or removed (the acceptor looks at it once per poll).
    pub(crate) listeners_gen: AtomicU64,
    pub(crate) next_port_id: AtomicU16,
    pub stats: TargetStats,
    pub(crate) epoch: Instant,
    pub(crate) stop: AtomicBool,
    pub(crate) events: Option<EventHook>,
    /// The send mode every session applies, switchable while the target runs.
    pub(crate) send_mode: AtomicU8,
    /// The TLS server settings (the PSK lookup reads the registry).
    pub tls_server: nvpoll_tcp::tls::ServerConfig,
}

pub(crate) fn mode_to_u8(m: SendMode) -> u8 {
    match m {
        SendMode::Inline => 0,
        SendMode::Deferred => 1,
        SendMode::Adaptive => 2,
    }
}

pub(crate) fn mode_from_u8(v: u8) -> SendMode {
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
    pub(crate) fn discovery_changed(&self) {
        self.registry.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Binds a listener; the acceptor on reactor 0 adopts it at its next poll (connections wait in the
    /// socket's backlog until then).
    pub(crate) fn bind_listener(
        &self,
        cfg: ListenerConfig,
    ) -> Result<(Arc<Listener>, TcpListener), Error> {
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

    pub(crate) fn counters(&self) -> TargetCounters {
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

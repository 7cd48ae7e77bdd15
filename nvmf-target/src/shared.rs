//! What every reactor of a running target shares: the listeners, the registry of subsystems and keys, the
//! limits, the event hook and the running totals ([`TargetShared`]).

use std::fmt;
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::Instant;

use nvpoll::reactor::ReactorWaker;
use nvpoll::send::SendMode;

use crate::error::Error;
use crate::events::{EventHook, TargetEvent};
use crate::options::{Limits, ListenerConfig, TlsMode};
use crate::subsystem::{lock, HostKey, Subsystem, DISCOVERY_NQN};

/// Declares the target's counters once. Each becomes a field of [`TargetCounters`] (the public snapshot) and
/// an atomic of `TargetStats` (the running totals every reactor adds to); the `session` ones are also counted
/// by each session on its own, in a `SessionStats`, and published to the totals now and then.
macro_rules! counters {
    (
        session { $( $(#[doc = $sdoc:literal])* $sname:ident, )* }
        target { $( $(#[doc = $tdoc:literal])* $tname:ident, )* }
    ) => {
        /// Running totals of a target, updated by the sessions (each publishes its counters when it is idle
        /// or closes) and by the acceptors.
        ///
        /// The sessions' counters are kept in shards, one per reactor thread ([`shard_index`]), each on cache
        /// lines of its own: a session publishes whenever it is idle, which under load is most polls, and
        /// totals written by every reactor would bounce their line between the cores on each of them.
        #[derive(Debug)]
        pub(crate) struct TargetStats {
            shards: Box<[SessionShard]>,
            $( pub $tname: AtomicU64, )*
        }

        /// The session counters published from one reactor thread.
        #[derive(Debug, Default)]
        #[repr(align(128))]
        struct SessionShard {
            $( $sname: AtomicU64, )*
        }

        impl Default for TargetStats {
            fn default() -> Self {
                TargetStats {
                    shards: (0..STAT_SHARDS).map(|_| SessionShard::default()).collect(),
                    $( $tname: AtomicU64::new(0), )*
                }
            }
        }

        /// A snapshot of a target's counters.
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
        #[non_exhaustive]
        pub struct TargetCounters {
            $( $(#[doc = $sdoc])* pub $sname: u64, )*
            $( $(#[doc = $tdoc])* pub $tname: u64, )*
        }

        /// One session's counters, published to the target's totals now and then.
        #[derive(Clone, Copy, Debug, Default)]
        pub(crate) struct SessionStats {
            $( pub $sname: u64, )*
        }

        impl TargetStats {
            /// The totals now.
            pub(crate) fn snapshot(&self) -> TargetCounters {
                TargetCounters {
                    $( $sname: self.shards.iter().map(|s| s.$sname.load(Ordering::Relaxed)).sum(), )*
                    $( $tname: self.$tname.load(Ordering::Relaxed), )*
                }
            }
        }

        impl SessionStats {
            /// Adds what was counted since `published` to the totals, in the calling thread's shard.
            pub(crate) fn publish(&self, published: &SessionStats, totals: &TargetStats) {
                let shard = &totals.shards[shard_index()];
                $( shard.$sname.fetch_add(self.$sname - published.$sname, Ordering::Relaxed); )*
            }
        }
    };
}

/// Shards of the session counters: threads beyond this many share shards (correct, only slower).
const STAT_SHARDS: usize = 64;

/// This thread's shard of the session counters: threads take the next shard the first time they publish.
fn shard_index() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SHARD: usize = NEXT.fetch_add(1, Ordering::Relaxed) % STAT_SHARDS;
    }
    SHARD.with(|s| *s)
}

counters! {
    session {
        /// Commands received.
        commands,
        /// Read commands completed successfully.
        reads,
        /// Write commands completed successfully.
        writes,
        /// Bytes read by hosts.
        bytes_read,
        /// Bytes written by hosts.
        bytes_written,
        /// Commands completed with an error status.
        errors,
        /// R2T PDUs sent.
        r2ts,
        /// Held Asynchronous Event Requests retired without a completion because the host gave up on them
        /// (it reused their command ID, as SPDK does at detach, or their queue entry).
        aers_retired,
        /// Commands that arrived on an I/O queue after its Disconnect, answered with Command Aborted due to
        /// SQ Deletion.
        aborted_after_disconnect,
        /// TLS KeyUpdates sent (a connection's sending key renewed).
        key_updates_sent,
        /// TLS KeyUpdates received (a host renewed its key).
        key_updates_received,
        /// Times a session stopped taking commands because its host was not reading its responses (more
        /// than a few MiB of them waited to be sent); it goes on when the host reads.
        held_back,
    }
    target {
        /// TCP connections accepted.
        accepted,
        /// Connections closed (for any reason, dropped ones included).
        closed,
        /// C2HTermReq PDUs sent (protocol errors by hosts).
        term_reqs,
        /// Fabrics Connects refused.
        connects_rejected,
        /// Controllers torn down because their keep-alive timeout passed.
        keep_alive_expired,
        /// Connections dropped because no reactor could take them or a session failed to start.
        dropped,
        /// Connections closed because the target hit a bug (a panic, caught so that the reactor goes on).
        internal_errors,
        /// Queues whose host authenticated with DH-HMAC-CHAP (re-authentications included).
        authentications,
        /// DH-HMAC-CHAP refusals: wrong keys, broken or late transactions, commands before authentication.
        auth_failures,
    }
}

impl fmt::Display for TargetCounters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        write!(
            f,
            "connections {} accepted, {} closed, {} dropped; commands {} ({} errors); reads {} ({:.1} MiB); \
             writes {} ({:.1} MiB); R2T {}; C2HTermReq {}; connects refused {}; keep-alive expiries {}; \
             internal errors {}; AERs retired {}; aborted after Disconnect {}; authenticated {}, \
             authentication failures {}; TLS key updates {} sent, {} received; held back for unread \
             responses {}",
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
            self.aers_retired,
            self.aborted_after_disconnect,
            self.authentications,
            self.auth_failures,
            self.key_updates_sent,
            self.key_updates_received,
            self.held_back
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
    pub(crate) fn psk_for(&self, identity: &[u8]) -> Option<nvpoll_tls::Psk> {
        use nvpoll_tls::{Derivation, ParsedIdentity};
        let p = ParsedIdentity::parse(identity)?;
        if p.generated {
            // Generated by a secure channel concatenation with this subsystem, never configured.
            return self.subsystem(&p.subnqn)?.generated_psk(identity);
        }
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
    /// The congestion control set on every listener (accepted connections inherit it); `None`: the system's,
    /// except that a loopback connection under BBR moves to cubic (`nvpoll_wire::conn::loopback_congestion`).
    pub(crate) tcp_congestion: Option<String>,
    /// The TLS server settings (the PSK lookup reads the registry).
    pub tls_server: nvpoll_tls::ServerConfig,
    /// Wakes the reactors the target runs on (set when it starts): after any change that sessions or the
    /// acceptor read from here, so that a reactor asleep in hybrid idle mode sees it now.
    pub(crate) wakers: OnceLock<Vec<ReactorWaker>>,
    /// How TLS connections renew their keys; the count is switchable while the target runs (new
    /// connections take it).
    pub(crate) key_renewal: nvpoll_wire::KeyRenewal,
    pub(crate) key_update_records: AtomicU64,
    /// Hosts that ended a connection at our KeyUpdate: their connections renew by being closed at the count.
    pub(crate) no_key_update_hosts: Mutex<std::collections::HashSet<String>>,
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
    /// How a connection renews its TLS keys: by KeyUpdate, or, for a host known not to take one
    /// (`hostnqn`, once Connect named it), by being closed at the count.
    pub(crate) fn key_renewal(&self, hostnqn: Option<&str>) -> nvpoll_wire::KeyRenewal {
        let mut r = nvpoll_wire::KeyRenewal {
            records: self.key_update_records.load(Ordering::Relaxed),
            ..self.key_renewal
        };
        if hostnqn.is_some_and(|h| lock(&self.no_key_update_hosts).contains(h)) {
            r.method = nvpoll_wire::RenewBy::Reconnect;
        }
        r
    }

    /// A connection of `hostnqn` ended with `cause`: if that was the host ending it at our KeyUpdate, its
    /// connections renew by closing from now on, and the log says so once per host.
    pub(crate) fn note_conn_failure(
        &self,
        cause: &nvpoll_wire::Error,
        hostnqn: &str,
        peer: SocketAddr,
    ) {
        if !matches!(cause, nvpoll_wire::Error::KeyUpdateRefused { .. }) {
            return;
        }
        if lock(&self.no_key_update_hosts).insert(hostnqn.to_string()) {
            let reason = match cause {
                nvpoll_wire::Error::KeyUpdateRefused { cause } => cause.to_string(),
                e => e.to_string(),
            };
            self.emit(&TargetEvent::KeyUpdateRefused {
                peer,
                hostnqn,
                records: self.key_update_records.load(Ordering::Relaxed),
                reason: &reason,
            });
        }
    }

    /// The send mode sessions apply now.
    pub(crate) fn send_mode(&self) -> SendMode {
        mode_from_u8(self.send_mode.load(Ordering::Relaxed))
    }

    /// The subsystem named `nqn` (the discovery subsystem included), if it is in service.
    pub(crate) fn subsystem(&self, nqn: &str) -> Option<Arc<Subsystem>> {
        self.registry.subsystem(nqn)
    }

    /// Every subsystem in service, the discovery subsystem first.
    pub(crate) fn subsystems(&self) -> Vec<Arc<Subsystem>> {
        self.registry.all()
    }

    /// Something a discovery host could see changed.
    pub(crate) fn discovery_changed(&self) {
        self.registry.generation.fetch_add(1, Ordering::AcqRel);
        self.wake_all();
    }

    /// Wakes every reactor of the target that sleeps (hybrid idle mode), to look at a change.
    pub(crate) fn wake_all(&self) {
        for w in self.wakers.get().into_iter().flatten() {
            w.wake();
        }
    }

    /// Binds a listener; the acceptor on reactor 0 adopts it at its next poll (connections wait in the
    /// socket's backlog until then).
    pub(crate) fn bind_listener(
        &self,
        cfg: ListenerConfig,
    ) -> Result<(Arc<Listener>, TcpListener), Error> {
        let socket = TcpListener::bind(cfg.address).map_err(|source| Error::Bind {
            address: cfg.address,
            source,
        })?;
        if let Some(cc) = &self.tcp_congestion {
            nvpoll_wire::conn::set_congestion(&socket, cc)?;
        }
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
    pub(crate) fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Whether the target was asked to stop.
    pub(crate) fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// Tells the event callback, if there is one.
    pub(crate) fn emit(&self, e: &TargetEvent<'_>) {
        if let Some(f) = &self.events {
            f(e);
        }
    }

    pub(crate) fn counters(&self) -> TargetCounters {
        self.stats.snapshot()
    }
}

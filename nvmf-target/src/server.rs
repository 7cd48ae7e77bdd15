//! A target bound and served: [`Target`] binds the listeners, [`TargetHandle`] changes it while it runs, and
//! the pollers that accept connections, watch half-open ones and run sessions.

use std::cell::{Cell, RefCell};
use std::fmt;
use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use nvpoll::reactor::{PollStatus, Poller, PollerId, ReactorContext, Reactors, WakeSources};
use nvpoll::send::SendMode;

use crate::error::{Error, Setting};
use crate::events::TargetEvent;
use crate::options::{ListenerConfig, TargetConfig, TargetTls, TlsMode};
use crate::session::{Progress, Session};
use crate::shared::{mode_to_u8, Listener, Registry, TargetCounters, TargetShared, TargetStats};
use crate::subsystem::{
    self, lock, AnaSetting, HostAccess, HostKey, NamespaceConfig, Subsystem, SubsystemConfig,
};

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
                return Err(Error::DuplicateSubsystem { nqn: s.nqn.clone() });
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
            tls_server: nvpoll_tls::ServerConfig::new(move |id| lookup.psk_for(id)),
            wakers: std::sync::OnceLock::new(),
            tcp_congestion: config.tcp_congestion,
            key_renewal: config.tls_key_renewal,
            key_update_records: AtomicU64::new(config.tls_key_renewal.records),
            no_key_update_hosts: Mutex::new(Default::default()),
        });
        let first = ListenerConfig {
            address: config.listen,
            tls: config.tls.as_ref().map_or(TlsMode::Off, TargetTls::mode),
        };
        let mut sockets: Vec<(Arc<Listener>, TcpListener)> = Vec::new();
        for cfg in std::iter::once(first).chain(config.listeners.iter().copied()) {
            if sockets.iter().any(|(l, _)| l.addr == cfg.address) {
                return Err(Error::DuplicateListener {
                    address: cfg.address,
                });
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
        let wakers = (0..reactors.len())
            .map(|i| reactors.waker(i))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|source| Error::Reactor {
                what: "reactor wakers",
                source,
            })?;
        // Started once: a target is consumed by `start`.
        let _ = shared.wakers.set(wakers);
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
                        failing: false,
                        told: false,
                    },
                );
                id.set(Some(pid));
            })
            .map_err(|source| Error::Reactor {
                what: "cannot start the listener on reactor 0",
                source,
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
    /// ANA states other than optimized, by listener and group.
    pub ana: Vec<AnaSetting>,
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
                "  namespace {}: {} blocks of {} bytes ({} MiB) on {}{}",
                ns.nsid,
                ns.blocks,
                ns.block_size,
                (ns.blocks * u64::from(ns.block_size)) >> 20,
                ns.backing,
                ns.reservations_off
                    .as_ref()
                    .map_or_else(String::new, |why| format!("; reservations off: {why}"))
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
    /// Its ANA group.
    pub ana_group: u32,
    /// Why it has no reservations in this process, if it has none.
    pub reservations_off: Option<String>,
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
                ana_group: ns.anagrpid,
                reservations_off: ns.resv.off().map(str::to_string),
            })
            .collect(),
        listeners: s.listeners.clone(),
        max_io_queues: s.max_io_queues(),
        queue_entries: s.limits.queue_entries,
        mdts: s.limits.mdts,
        controllers: s.controller_count(),
        ana: s.ana_settings(),
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
        self.shared.wake_all();
    }

    /// With TLS: connections accepted from now on renew their keys after `records` records under one key
    /// (1 to 8388608); those already open keep their count.
    pub fn set_tls_key_update(&self, records: u64) -> Result<(), Error> {
        nvpoll_wire::KeyRenewal::after(records)
            .check()
            .map_err(|_| Error::out_of_range(Setting::TlsKeyUpdate, records))?;
        self.shared
            .key_update_records
            .store(records, Ordering::Relaxed);
        Ok(())
    }

    /// Stops accepting and closes every connection, on each reactor's next poll.
    pub fn stop(&self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.wake_all();
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
            return Err(Error::Stopping);
        }
        let mut listeners = lock(&self.shared.listeners);
        if cfg.address.port() != 0 && listeners.iter().any(|l| l.addr == cfg.address) {
            return Err(Error::ListenerExists {
                address: cfg.address,
            });
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
            return Err(Error::NoListener { address: addr });
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
            return Err(Error::SubsystemExists {
                nqn: cfg.nqn.clone(),
            });
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
        let nsid = self.nvm_subsystem(nqn)?.add_namespace(ns)?;
        self.shared.wake_all();
        Ok(nsid)
    }

    /// Sets the ANA state of group `group` of subsystem `nqn` on listener `listener`, and returns the state
    /// before. Hosts that came through that listener get an ANA change event and see the state on their
    /// next command: accessible states run commands, the others fail them with the state's path status, which
    /// tells a multipath host to use another path.
    pub fn set_ana_state(
        &self,
        nqn: &str,
        listener: SocketAddr,
        group: u32,
        state: nvpoll::spec::AnaState,
    ) -> Result<nvpoll::spec::AnaState, Error> {
        let subsys = self.nvm_subsystem(nqn)?;
        if !self.listeners().iter().any(|l| l.address == listener) {
            return Err(Error::NoListener { address: listener });
        }
        let before = subsys.set_ana_state(listener, group, state)?;
        self.shared.wake_all();
        Ok(before)
    }

    /// Removes namespace `nsid` of subsystem `nqn`. Commands already running on it finish with it; later ones
    /// get Invalid Namespace. Connected hosts get a Namespace Attribute Changed event.
    pub fn remove_namespace(&self, nqn: &str, nsid: u32) -> Result<(), Error> {
        self.nvm_subsystem(nqn)?.remove_namespace(nsid)?;
        self.shared.wake_all();
        Ok(())
    }

    /// Lets `hostnqn` connect to subsystem `nqn`. A subsystem that lets any host in refuses this (turn that off
    /// first with [`TargetHandle::set_allow_any_host`]): silently closing it to every other host would be a
    /// surprise, and SPDK users expect adding a host never to lock anyone out.
    pub fn allow_host(&self, nqn: &str, hostnqn: &str) -> Result<(), Error> {
        let s = self.nvm_subsystem(nqn)?;
        let hosts = match s.hosts() {
            HostAccess::AnyHost => {
                return Err(Error::AnyHostAllowed {
                    nqn: nqn.to_string(),
                })
            }
            HostAccess::Only(mut h) => {
                if h.iter().any(|x| x == hostnqn) {
                    return Err(Error::HostAllowedAlready {
                        nqn: nqn.to_string(),
                        host: hostnqn.to_string(),
                    });
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
            _ => Err(Error::HostNotAllowed {
                nqn: nqn.to_string(),
                host: hostnqn.to_string(),
            }),
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

    /// Grants new controllers of subsystem `nqn` `n` I/O queues and tears down its live controllers, so that
    /// their hosts reconnect with the new count. Returns how many were torn down.
    pub fn set_max_io_queues(&self, nqn: &str, n: u16) -> Result<usize, Error> {
        self.nvm_subsystem(nqn)?.set_max_io_queues(n)
    }

    /// Sets (or replaces) a host's TLS PSK for subsystem `nqn`. New handshakes use it at once.
    pub fn set_host_key(&self, nqn: &str, key: HostKey) -> Result<(), Error> {
        self.nvm_subsystem(nqn)?.set_key(key)
    }

    /// Removes a host's TLS PSK for subsystem `nqn` (sessions already made stay).
    pub fn remove_host_key(&self, nqn: &str, hostnqn: &str) -> Result<(), Error> {
        let removed = self.nvm_subsystem(nqn)?.remove_key(hostnqn);
        key_removed(removed, nqn, hostnqn, |nqn, host| Error::NoHostKey {
            nqn,
            host,
        })
    }
}

impl TargetHandle {
    /// Sets (or replaces) a host's DH-HMAC-CHAP keys on subsystem `nqn`: its next authentication (a new
    /// queue, or a re-authentication of a live one) uses them; live queues stay authenticated.
    pub fn set_dhchap_key(&self, nqn: &str, key: crate::DhchapKey) -> Result<(), Error> {
        self.nvm_subsystem(nqn)?.set_dhchap_key(key)
    }

    /// Removes a host's DH-HMAC-CHAP keys on subsystem `nqn`: its new queues no longer authenticate.
    pub fn remove_dhchap_key(&self, nqn: &str, hostnqn: &str) -> Result<(), Error> {
        let removed = self.nvm_subsystem(nqn)?.remove_dhchap_key(hostnqn);
        key_removed(removed, nqn, hostnqn, |nqn, host| Error::NoDhchapKey {
            nqn,
            host,
        })
    }

    /// Sets the DH-HMAC-CHAP hashes and groups subsystem `nqn` allows (empty lists: all), for the next
    /// transactions.
    pub fn set_dhchap_policy(&self, nqn: &str, policy: crate::DhchapPolicy) -> Result<(), Error> {
        self.nvm_subsystem(nqn)?.set_dhchap_allowed(policy);
        Ok(())
    }
}

/// `Ok` where a key of host `hostnqn` on subsystem `nqn` was removed, else the error `none` makes of the two.
fn key_removed(
    removed: bool,
    nqn: &str,
    hostnqn: &str,
    none: fn(String, String) -> Error,
) -> Result<(), Error> {
    if removed {
        Ok(())
    } else {
        Err(none(nqn.to_string(), hostnqn.to_string()))
    }
}

fn no_subsystem(nqn: &str) -> Error {
    Error::NoSubsystem {
        nqn: nqn.to_string(),
    }
}

/// Accepts connections on every listener and hands each to a reactor, round robin.
struct Acceptor {
    sockets: Vec<(Arc<Listener>, TcpListener)>,
    shared: Arc<TargetShared>,
    /// The listener generation the sockets reflect.
    seen: u64,
    next: usize,
    id: Rc<Cell<Option<PollerId>>>,
    /// The last accept failed with something other than "nothing to accept" (out of file descriptors, say):
    /// the listener stays readable, so a sleeping reactor would wake at once; retry once per period instead.
    failing: bool,
    /// Said why accepting fails, in this streak of failures (said once, again after an accept succeeds).
    told: bool,
}

/// Raises the process's soft limit on open descriptors (RLIMIT_NOFILE) to its hard limit: each connection the
/// target serves holds one (its socket), so the soft limit, often 1024, caps the connections. Returns the
/// soft limit in force afterwards (`None`: unlimited).
pub fn raise_descriptor_limit() -> std::io::Result<Option<u64>> {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut lim = getrlimit(Resource::Nofile);
    if lim.current != lim.maximum {
        lim.current = lim.maximum;
        setrlimit(Resource::Nofile, lim)?;
    }
    Ok(lim.current)
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
    /// Every listening socket (listeners added at run time wake the reactor through the target's wakers).
    fn wake_sources<'a>(&'a self, w: &mut WakeSources<'a>) -> bool {
        if self.failing {
            return false;
        }
        for (_, socket) in &self.sockets {
            w.readable(socket);
        }
        true
    }

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
        self.failing = false;
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
                    Err(e) => {
                        if !self.told {
                            self.told = true;
                            let limit =
                                rustix::process::getrlimit(rustix::process::Resource::Nofile)
                                    .current
                                    .map_or("unlimited".to_string(), |n| n.to_string());
                            eprintln!(
                                "nvpoll-target: {}: cannot accept connections: {e}; the process may hold \
                                 {limit} descriptors (RLIMIT_NOFILE) and each connection takes one: raise \
                                 it (ulimit -n, systemd's LimitNOFILE=); retrying",
                                listener.addr
                            );
                        }
                        self.failing = true;
                        break;
                    }
                };
                self.told = false;
                status = PollStatus::Busy;
                if self.shared.tcp_congestion.is_none() {
                    // Nothing configured: a loopback connection under BBR moves to cubic (said once).
                    nvpoll_wire::conn::apply_loopback_congestion(&stream);
                }
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

/// Sessions handed to a reactor's [`SetupPoller`] for one target, waiting for its next poll.
type Incoming = Rc<RefCell<Vec<Session>>>;

/// The setup pollers' (or ready groups') inboxes on this reactor's thread, keyed by target, with the poller's
/// id: whoever adds to an inbox wakes the poller ([`ReactorContext::wake_poller`]), which may be parked.
type SetupSets = Vec<(usize, Incoming, Rc<Cell<Option<PollerId>>>)>;

thread_local! {
    static SETUP_SETS: RefCell<SetupSets> = const { RefCell::new(Vec::new()) };
}

/// Hands `session` to this reactor's poller of one kind for `shared` (`sets`: the setup pollers' or the
/// ready groups' inboxes): into its inbox, waking it if it is parked; or, the first time on this reactor,
/// registers the poller `make` builds from the target's key, the new inbox (already holding `session`, taken
/// over at its first poll) and the cell its id goes in.
fn hand_over<P: Poller + 'static>(
    sets: &'static std::thread::LocalKey<RefCell<SetupSets>>,
    ctx: &mut ReactorContext,
    shared: &Arc<TargetShared>,
    session: Session,
    make: impl FnOnce(usize, Incoming, Rc<Cell<Option<PollerId>>>) -> P,
) {
    let key = Arc::as_ptr(shared) as usize;
    sets.with(|sets| {
        let mut sets = sets.borrow_mut();
        if let Some((_, incoming, id)) = sets.iter().find(|(k, _, _)| *k == key) {
            incoming.borrow_mut().push(session);
            if let Some(id) = id.get() {
                ctx.wake_poller(id);
            }
            return;
        }
        let incoming = Rc::new(RefCell::new(vec![session]));
        let id = Rc::new(Cell::new(None));
        sets.push((key, Rc::clone(&incoming), Rc::clone(&id)));
        let pid = ctx.add_poller(make(key, incoming, Rc::clone(&id)));
        id.set(Some(pid));
    });
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
/// whatever a hostile host leaves half-open (connection floods, slowloris ICReqs, TLS garbage). The sessions
/// that were busy when last looked at are polled on every iteration (nothing when there are none: no clock
/// read, no system call); the idle ones once per [`SETUP_POLL_PERIOD`], and those with something to do move
/// to the hot list. A session that reaches Ready moves to the reactor's [`ReadyGroup`] for the target.
struct SetupPoller {
    key: usize,
    shared: Arc<TargetShared>,
    /// New sessions (from the acceptor's messages), taken over at the next poll.
    incoming: Incoming,
    /// Busy when last looked at (or new).
    hot: Vec<Session>,
    /// Idle when last looked at.
    cold: Vec<Session>,
    /// When the cold list is looked at next.
    next_cold: Instant,
    id: Rc<Cell<Option<PollerId>>>,
}

impl SetupPoller {
    /// Hands `session` to this reactor's setup poller for `shared`, registering it on first use.
    fn adopt(ctx: &mut ReactorContext, shared: &Arc<TargetShared>, session: Session) {
        hand_over(&SETUP_SETS, ctx, shared, session, |key, incoming, id| {
            SetupPoller {
                key,
                shared: Arc::clone(shared),
                incoming,
                hot: Vec::new(),
                cold: Vec::new(),
                next_cold: Instant::now(),
                id,
            }
        });
    }

    /// Unregisters the poller (once the target stopped and its last setup session is gone).
    fn retire(&mut self, ctx: &mut ReactorContext) {
        SETUP_SETS.with(|sets| sets.borrow_mut().retain(|(k, _, _)| *k != self.key));
        if let Some(id) = self.id.take() {
            ctx.remove_poller(id);
        }
    }

    /// Looks at every session of one list; returns whether one was busy.
    fn look_at_list(
        ctx: &mut ReactorContext,
        shared: &Arc<TargetShared>,
        cold: bool,
        list: &mut Vec<Session>,
        other: &mut Vec<Session>,
    ) -> bool {
        let mut busy = false;
        let mut i = 0;
        while i < list.len() {
            let next = look_at(&mut list[i]);
            busy |= !matches!(next, Next::Cold);
            match next {
                Next::Hot if !cold => i += 1,
                Next::Cold if cold => i += 1,
                Next::Hot | Next::Cold => other.push(list.swap_remove(i)),
                Next::Gone => {
                    let gone = list.swap_remove(i);
                    let _ = catch_unwind(AssertUnwindSafe(|| drop(gone)));
                }
                Next::Ready => {
                    // Connected: from now on in the reactor's ready group for this target.
                    ReadyGroup::adopt(ctx, shared, list.swap_remove(i));
                }
            }
        }
        busy
    }
}

impl Poller for SetupPoller {
    fn poll(&mut self, ctx: &mut ReactorContext) -> PollStatus {
        if let Ok(mut incoming) = self.incoming.try_borrow_mut() {
            self.hot.append(&mut incoming);
        }
        if self.shared.stopping() {
            // Every session looks at the flag (and closes) on every iteration until it is gone.
            self.hot.append(&mut self.cold);
            if self.hot.is_empty() {
                self.retire(ctx);
                return PollStatus::Idle;
            }
        }
        let mut busy = false;
        if !self.hot.is_empty() {
            busy |= Self::look_at_list(ctx, &self.shared, false, &mut self.hot, &mut self.cold);
        }
        if !self.cold.is_empty() {
            let now = Instant::now();
            // After a sleep at once: the wake may be one of these sessions' sockets.
            if now >= self.next_cold || ctx.woke_up() {
                self.next_cold = now + SETUP_POLL_PERIOD;
                busy |= Self::look_at_list(ctx, &self.shared, true, &mut self.cold, &mut self.hot);
            }
        }
        PollStatus::busy_if(busy)
    }

    /// Every session's socket and timers. A cold session whose socket wakes the reactor is looked at once its
    /// period is up, which after a sleep longer than the period is at once.
    fn wake_sources<'a>(&'a self, w: &mut WakeSources<'a>) -> bool {
        if !self.incoming.try_borrow().is_ok_and(|v| v.is_empty()) {
            return false;
        }
        self.hot.iter().chain(&self.cold).all(|s| s.wake_sources(w))
    }
}

/// How often a ready group looks at its quiet sessions (timers, notices, a stop) when nothing woke them: each
/// look costs a few clock reads and checks per session, which beside a thousand idle sessions every 5 ms
/// still cost a qd1 host a tenth of its IOPS (benches/connections.rs); their timers (keep-alive, a
/// Disconnect's linger) are seconds long, and a notice or a controller's death may wait this long.
const READY_SWEEP_PERIOD: Duration = Duration::from_millis(20);

/// Up to this many connected sessions, a ready group reads every one on every iteration instead of asking
/// epoll: a `recv` on each costs about what one `epoll_wait` does when most of them have something, and the
/// extra system call cost all-active loads (qd128 x 8 on one core) an eighth of their IOPS.
const READY_DIRECT_MAX: usize = 8;

thread_local! {
    /// The ready groups' inboxes on this reactor's thread, keyed by target.
    static READY_SETS: RefCell<SetupSets> = const { RefCell::new(Vec::new()) };
}

/// One connected session in a [`ReadyGroup`].
struct Member {
    session: Session,
    /// Its socket is not in the group's epoll set (adding it failed): read on every iteration.
    unwatched: bool,
    /// The iteration that last put it on the group's `active` list (each session is looked at once per
    /// iteration at most).
    active_at: u64,
    /// The iteration whose end put it on the `hot` list for the next one.
    hot_at: u64,
}

/// The sessions that finished Fabrics Connect, per reactor and target, as one poller. One `epoll_wait` with a
/// zero timeout per iteration says whose socket has bytes; only those are read. A session that was busy, or
/// has work of its own (a close, flushes, authentication, unsent bytes), is looked at on the next iteration
/// without a read; the quiet rest once per [`READY_SWEEP_PERIOD`] (their timers, notices and the stop flag)
/// and at once after the reactor slept. Between sweeps an iteration's work follows the sessions that are
/// ready, not the sessions connected: the lists it walks hold only those.
///
/// Why: one poller per connection, each with a `recv` on every iteration, made the reactor's loop as long as
/// its connection count: beside 256 idle connections a queue-depth-1 host got a fourteenth of its IOPS, beside
/// 1024 a fiftieth (benches/connections.rs), where a sock group like SPDK's costs one system call.
struct ReadyGroup {
    key: usize,
    shared: Arc<TargetShared>,
    incoming: Incoming,
    members: Vec<Option<Member>>,
    free: Vec<usize>,
    count: usize,
    /// The readiness set (None when epoll_create failed: every session is then unwatched).
    epoll: Option<std::os::fd::OwnedFd>,
    events: Vec<rustix::event::epoll::Event>,
    /// Slots whose sockets are not in the readiness set: read on every iteration.
    unwatched: Vec<usize>,
    /// This iteration's sessions, with whether to read their sockets: polled, then flushed.
    active: Vec<(usize, bool)>,
    /// Sessions to look at on the next iteration without a read (busy, or with work of their own).
    hot: Vec<usize>,
    /// The previous iteration's `hot`, walked by this one (kept to reuse its allocation).
    was_hot: Vec<usize>,
    iteration: u64,
    next_sweep: Instant,
    id: Rc<Cell<Option<PollerId>>>,
}

impl ReadyGroup {
    /// Hands a connected `session` to this reactor's group for `shared`, registering the group on first use.
    fn adopt(ctx: &mut ReactorContext, shared: &Arc<TargetShared>, session: Session) {
        let index = ctx.index();
        hand_over(&READY_SETS, ctx, shared, session, |key, incoming, id| {
            let epoll = match rustix::event::epoll::create(
                rustix::event::epoll::CreateFlags::CLOEXEC,
            ) {
                Ok(fd) => Some(fd),
                Err(e) => {
                    eprintln!(
                    "nvpoll-target: reactor {}: no epoll set for connected sessions ({e}); each is read on every iteration",
                    index
                );
                    None
                }
            };
            ReadyGroup {
                key,
                shared: Arc::clone(shared),
                incoming,
                members: Vec::new(),
                free: Vec::new(),
                count: 0,
                epoll,
                events: Vec::new(),
                unwatched: Vec::new(),
                active: Vec::new(),
                hot: Vec::new(),
                was_hot: Vec::new(),
                iteration: 1,
                next_sweep: Instant::now(),
                id,
            }
        });
    }

    /// Takes over the sessions handed over since the last poll; each is looked at on this iteration.
    fn take_incoming(&mut self) {
        let Ok(mut incoming) = self.incoming.try_borrow_mut() else {
            return;
        };
        for session in incoming.drain(..) {
            let slot = self.free.pop().unwrap_or_else(|| {
                self.members.push(None);
                self.members.len() - 1
            });
            // Level-triggered, not edge-triggered: a socket stays in the ready list for as long as it has
            // unread bytes, so a session that stops reading part-way (its send buffer is full, or a PDU's
            // handling waits) is reported again on the next `epoll_wait` and nothing is lost. Edge-triggered
            // would report only new arrivals, and every path that leaves bytes unread would have to remember
            // the session itself; the price of level-triggered is only that a session that deliberately leaves
            // bytes in the socket is reported (and looked at) on every iteration until it reads them.
            let unwatched = match &self.epoll {
                Some(ep) => rustix::event::epoll::add(
                    ep,
                    session.socket(),
                    rustix::event::epoll::EventData::new_u64(slot as u64),
                    rustix::event::epoll::EventFlags::IN,
                )
                .map_err(|e| {
                    eprintln!(
                        "nvpoll-target: connection from {}: not in the reactor's epoll set ({e}); read on every iteration",
                        session.peer()
                    )
                })
                .is_err(),
                None => true,
            };
            if unwatched {
                self.unwatched.push(slot);
            }
            self.members[slot] = Some(Member {
                session,
                unwatched,
                active_at: 0,
                hot_at: 0,
            });
            self.hot.push(slot);
            self.count += 1;
        }
    }

    /// Closes and forgets the session in `slot` (finished, or it panicked).
    fn remove(&mut self, slot: usize) {
        let Some(m) = self.members[slot].take() else {
            return;
        };
        if m.unwatched {
            self.unwatched.retain(|&s| s != slot);
        } else if let Some(ep) = &self.epoll {
            // Closing the socket would remove it too; an error here changes nothing.
            let _ = rustix::event::epoll::delete(ep, m.session.socket());
        }
        // Dropping the session closes the socket and releases its queue or controller.
        let _ = catch_unwind(AssertUnwindSafe(|| drop(m)));
        self.free.push(slot);
        self.count -= 1;
    }

    /// Puts `slot` on this iteration's list, once; `read`: its socket is to be read.
    fn activate(&mut self, slot: usize, read: bool) {
        let iteration = self.iteration;
        if let Some(Some(m)) = self.members.get_mut(slot) {
            if m.active_at != iteration {
                m.active_at = iteration;
                self.active.push((slot, read));
            }
        }
    }

    /// Puts `slot` on the next iteration's list, once.
    fn keep_hot(&mut self, slot: usize) {
        let iteration = self.iteration;
        if let Some(Some(m)) = self.members.get_mut(slot) {
            if m.hot_at != iteration {
                m.hot_at = iteration;
                self.hot.push(slot);
            }
        }
    }

    /// Activates the members whose sockets are readable (one `epoll_wait`, no waiting), to be read.
    fn collect_readable(&mut self) {
        let Some(ep) = &self.epoll else {
            return;
        };
        // More ready than fit: the rest stay ready (level-triggered) and come with the next call.
        let n = nvpoll::reactor::epoll_ready_now(ep, &mut self.events, self.count);
        for i in 0..n {
            let slot = self.events[i].data.u64() as usize;
            self.activate(slot, true);
        }
    }
}

impl Poller for ReadyGroup {
    fn poll(&mut self, ctx: &mut ReactorContext) -> PollStatus {
        self.iteration += 1;
        self.active.clear();
        self.take_incoming();
        let stopping = self.shared.stopping();
        if stopping && self.count == 0 {
            READY_SETS.with(|sets| sets.borrow_mut().retain(|(k, _, _)| *k != self.key));
            if let Some(id) = self.id.take() {
                ctx.remove_poller(id);
            }
            return PollStatus::Idle;
        }
        if self.count == 0 {
            self.hot.clear();
            return PollStatus::Idle;
        }
        // Readable sockets and unwatched ones are read (all of them, in a small group); last iteration's hot
        // ones, and on a sweep every one, are looked at without a read (a session on two lists is taken once,
        // with a read if either says so).
        if self.count <= READY_DIRECT_MAX {
            for slot in 0..self.members.len() {
                self.activate(slot, true);
            }
        } else {
            self.collect_readable();
            for i in 0..self.unwatched.len() {
                let slot = self.unwatched[i];
                self.activate(slot, true);
            }
        }
        std::mem::swap(&mut self.hot, &mut self.was_hot);
        self.hot.clear();
        for i in 0..self.was_hot.len() {
            let slot = self.was_hot[i];
            self.activate(slot, false);
        }
        let sweep = stopping || ctx.woke_up() || {
            let now = Instant::now();
            if now >= self.next_sweep {
                self.next_sweep = now + READY_SWEEP_PERIOD;
                true
            } else {
                false
            }
        };
        if sweep {
            for slot in 0..self.members.len() {
                self.activate(slot, false);
            }
        }
        let mut busy = false;
        for i in 0..self.active.len() {
            let (slot, read) = self.active[i];
            let Some(m) = self.members[slot].as_mut() else {
                continue;
            };
            let session = &mut m.session;
            let progress = catch_unwind(AssertUnwindSafe(|| {
                if read {
                    session.poll()
                } else {
                    session.tick()
                }
            }));
            match progress {
                Ok(Progress::Finished) => {
                    self.remove(slot);
                    busy = true;
                }
                Err(_) => {
                    // The session panicked (the default hook printed where): count it and close the
                    // connection; the other sessions go on.
                    m.session.note_internal_error();
                    self.remove(slot);
                    busy = true;
                }
                Ok(p) => {
                    let b = matches!(p, Progress::Busy);
                    busy |= b;
                    if b || m.session.needs_poll() {
                        self.keep_hot(slot);
                    }
                }
            }
        }
        PollStatus::busy_if(busy)
    }

    /// Sends what this iteration's sessions queued.
    fn flush(&mut self, _ctx: &mut ReactorContext) {
        for i in 0..self.active.len() {
            let (slot, _) = self.active[i];
            let Some(m) = self.members[slot].as_mut() else {
                continue;
            };
            let session = &mut m.session;
            if catch_unwind(AssertUnwindSafe(|| session.flush())).is_err() {
                m.session.note_internal_error();
                self.remove(slot);
                continue;
            }
            // Bytes the socket did not take, or a close the flush started: look again next iteration.
            if m.session.needs_poll() {
                self.keep_hot(slot);
            }
        }
    }

    /// The group's epoll set as one descriptor (readable when a member's socket is), the sockets of members
    /// outside it, and every member's timers: a sleeping reactor (or a parked group) watches one descriptor,
    /// not a thousand.
    fn wake_sources<'a>(&'a self, w: &mut WakeSources<'a>) -> bool {
        if !self.incoming.try_borrow().is_ok_and(|v| v.is_empty()) || !self.hot.is_empty() {
            return false;
        }
        if let Some(ep) = &self.epoll {
            w.readable(ep);
        }
        self.members.iter().flatten().all(|m| {
            if m.unwatched {
                m.session.wake_sources(w)
            } else {
                m.session.wake_timers(w)
            }
        })
    }
}

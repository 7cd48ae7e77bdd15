//! NVM subsystems and their namespaces: what the target serves, and the controllers hosts created in them.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use crate::controller::Controller;
use crate::error::{Error, NqnFault, Setting};
use crate::store::Store;
use nvpoll::spec::{AnaGroupDescriptor, AnaLog, AnaState};
use nvpoll_tls::ConfiguredKey;

pub use crate::limits::{ANA_GROUP_MAX, DISCOVERY_NQN, MAX_CNTLID, MAX_NAMESPACES, MAX_NQN_LEN};

/// What backs a namespace.
#[derive(Clone, Debug)]
pub enum Backing {
    /// Memory of this many bytes, zeroed, lost when the target stops.
    Ram(u64),
    /// An existing regular file or block device, read and written through the page cache.
    File(PathBuf),
    /// Another NVMe namespace, for instance a local SSD through nvpoll-pcie (see [`crate::QueuePairDevice`]).
    /// The exported namespace's block size must be the device's.
    Device(std::sync::Arc<dyn crate::device::BlockDevice>),
}

impl PartialEq for Backing {
    fn eq(&self, other: &Backing) -> bool {
        match (self, other) {
            (Backing::Ram(a), Backing::Ram(b)) => a == b,
            (Backing::File(a), Backing::File(b)) => a == b,
            (Backing::Device(a), Backing::Device(b)) => std::sync::Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

impl Eq for Backing {}

/// One namespace of a subsystem.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamespaceConfig {
    /// Where the blocks live.
    pub backing: Backing,
    /// Logical block size: 512 or 4096.
    pub block_size: u32,
    /// Its namespace ID; `None` takes the lowest free one.
    pub nsid: Option<u32>,
    /// Its ANA group (1 to [`ANA_GROUP_MAX`]); the group's state on each listener decides whether hosts
    /// that came through it may run commands on the namespace.
    pub ana_group: u32,
    /// Its UUID (Namespace Identification Descriptor); `None`: one derived from the subsystem NQN and the
    /// namespace ID, stable across restarts.
    pub uuid: Option<[u8; 16]>,
}

/// One ANA state set for a subsystem: group `group` is in `state` for hosts that connect through `listener`.
/// Groups and listeners without one are optimized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AnaSetting {
    /// The listener (a path to the subsystem).
    pub listener: SocketAddr,
    /// The ANA group.
    pub group: u32,
    /// Its state on that path.
    pub state: AnaState,
}

/// The controller IDs a subsystem hands out: two target processes that export one subsystem (sharing a file
/// namespace) must give disjoint ranges, since a host refuses two controllers of one subsystem with the same
/// ID (Linux: "Duplicate cntlid").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CntlidRange {
    /// The lowest, at least 1.
    pub min: u16,
    /// The highest, at most [`MAX_CNTLID`].
    pub max: u16,
}

impl Default for CntlidRange {
    fn default() -> CntlidRange {
        CntlidRange {
            min: 1,
            max: MAX_CNTLID,
        }
    }
}

impl CntlidRange {
    /// Checks `1 <= min <= max <= MAX_CNTLID`.
    pub fn check(&self) -> Result<(), Error> {
        if self.min == 0 || self.min > self.max || self.max > MAX_CNTLID {
            return Err(Error::BadCntlidRange {
                min: self.min,
                max: self.max,
            });
        }
        Ok(())
    }
}

/// Checks an ANA group ID.
pub(crate) fn check_ana_group(group: u32) -> Result<(), Error> {
    if !(1..=ANA_GROUP_MAX).contains(&group) {
        return Err(Error::out_of_range(Setting::AnaGroup, group));
    }
    Ok(())
}

/// The generated TLS PSKs a subsystem keeps per host (secure channel concatenation).
pub(crate) const GENERATED_PER_HOST: usize = 8;

/// A host's TLS PSK, for one subsystem (or, in [`crate::TargetTls`], for every subsystem).
#[derive(Clone, PartialEq, Eq)]
pub struct HostKey {
    /// The host it belongs to.
    pub hostnqn: String,
    /// The configured PSK (`NVMeTLSkey-1:...`); its Debug form shows no key material.
    pub key: ConfiguredKey,
}

impl std::fmt::Debug for HostKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostKey({}, <redacted>)", self.hostnqn)
    }
}

/// A host's DH-HMAC-CHAP keys for one subsystem (nvmet's `dhchap_key` and `dhchap_ctrl_key`, SPDK's
/// `--dhchap-key` and `--dhchap-ctrlr-key`). With one, every queue of that host must authenticate.
#[derive(Clone, PartialEq, Eq)]
pub struct DhchapKey {
    /// The host it belongs to.
    pub hostnqn: String,
    /// The host's secret: the host proves it.
    pub key: nvpoll_wire::dhchap::Secret,
    /// The controller's secret, which the controller proves to a host that asks (bidirectional).
    pub ctrl_key: Option<nvpoll_wire::dhchap::Secret>,
    /// Secure channel concatenation required of this host: its admin queue authenticates without TLS, and
    /// generates a TLS PSK that every queue then uses (the listener must take TLS, `optional`).
    pub concat: bool,
}

impl std::fmt::Debug for DhchapKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DhchapKey({}, <redacted>{})",
            self.hostnqn,
            if self.ctrl_key.is_some() {
                ", controller key <redacted>"
            } else {
                ""
            }
        )
    }
}

/// The DH-HMAC-CHAP hashes and groups a subsystem allows (empty: all), strongest first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DhchapPolicy {
    /// Hash functions.
    pub hashes: Vec<nvpoll_wire::dhchap::Hash>,
    /// DH groups.
    pub groups: Vec<nvpoll_wire::dhchap::DhGroup>,
}

/// Limits of one subsystem's controllers; `None` takes the target's default ([`crate::TargetConfig`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SubsystemLimits {
    /// I/O queues per controller (Set Features Number of Queues grants this many).
    pub max_io_queues: Option<u16>,
    /// Entries per queue (CAP.MQES + 1): the deepest queue a host may connect.
    pub queue_entries: Option<u16>,
    /// Maximum Data Transfer Size, as a power of two of 4 KiB pages (1 to 10).
    pub mdts: Option<u8>,
}

/// The limits of a subsystem once the target's defaults filled the gaps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Limits {
    pub max_io_queues: u16,
    pub queue_entries: u16,
    pub mdts: u8,
}

impl Limits {
    /// The largest transfer of one command in bytes (MDTS in 4 KiB pages).
    pub(crate) fn max_transfer(&self) -> u32 {
        4096 << self.mdts
    }

    pub(crate) fn check(&self) -> Result<(), Error> {
        if !(1..=10).contains(&self.mdts) {
            return Err(Error::out_of_range(Setting::Mdts, self.mdts));
        }
        if !(2..=1024).contains(&self.queue_entries) {
            return Err(Error::out_of_range(Setting::QueueSize, self.queue_entries));
        }
        if !(1..=1024).contains(&self.max_io_queues) {
            return Err(Error::out_of_range(Setting::IoQueues, self.max_io_queues));
        }
        Ok(())
    }
}

/// Which hosts may connect to a subsystem (by the Host NQN of Fabrics Connect; with TLS, the host the TLS
/// identity proved must be that one too).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum HostAccess {
    /// Any host, an empty Host NQN included (SPDK's allow-any-host, nvmet's `attr_allow_any_host`).
    #[default]
    AnyHost,
    /// Only these Host NQNs (SPDK's and nvmet's allowed hosts).
    Only(Vec<String>),
}

impl HostAccess {
    /// Whether `hostnqn` may connect.
    pub fn allows(&self, hostnqn: &str) -> bool {
        match self {
            HostAccess::AnyHost => true,
            HostAccess::Only(hosts) => hosts.iter().any(|h| h == hostnqn),
        }
    }
}

/// One NVM subsystem.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubsystemConfig {
    /// Its NQN, which hosts name in Fabrics Connect.
    pub nqn: String,
    /// Serial number reported by Identify Controller (at most 20 ASCII characters).
    pub serial: String,
    /// Model number reported by Identify Controller (at most 40 ASCII characters).
    pub model: String,
    /// Its namespaces; namespace IDs are given in order from 1.
    pub namespaces: Vec<NamespaceConfig>,
    /// Which hosts may connect (default: any host).
    pub hosts: HostAccess,
    /// TLS PSKs of hosts, for this subsystem (a host may present the v0 or v1 identity derived from its key).
    pub host_keys: Vec<HostKey>,
    /// DH-HMAC-CHAP keys of hosts: those hosts must authenticate in band.
    pub dhchap_keys: Vec<DhchapKey>,
    /// The DH-HMAC-CHAP hashes and groups allowed.
    pub dhchap: DhchapPolicy,
    /// Limits of its controllers.
    pub limits: SubsystemLimits,
    /// The listeners (by address) it is reachable on; `None`: every listener of the target.
    pub listeners: Option<Vec<SocketAddr>>,
    /// ANA states other than optimized, by listener and group.
    pub ana: Vec<AnaSetting>,
    /// The controller IDs it hands out.
    pub cntlids: CntlidRange,
}

impl SubsystemConfig {
    /// A subsystem with model "nvpoll", a serial number derived from the NQN, and no namespace yet.
    pub fn new(nqn: impl Into<String>) -> SubsystemConfig {
        let nqn = nqn.into();
        let serial = format!("nvpoll{:08x}", crc32c::crc32c(nqn.as_bytes()));
        SubsystemConfig {
            nqn,
            serial,
            model: "nvpoll".to_string(),
            namespaces: Vec::new(),
            hosts: HostAccess::AnyHost,
            host_keys: Vec::new(),
            dhchap_keys: Vec::new(),
            dhchap: DhchapPolicy::default(),
            limits: SubsystemLimits::default(),
            listeners: None,
            ana: Vec::new(),
            cntlids: CntlidRange::default(),
        }
    }

    /// Gives `hostnqn` a TLS PSK for this subsystem.
    pub fn host_key(mut self, hostnqn: impl Into<String>, key: ConfiguredKey) -> SubsystemConfig {
        self.host_keys.push(HostKey {
            hostnqn: hostnqn.into(),
            key,
        });
        self
    }

    /// Lets `hostnqn` connect; the first call turns "any host" into "only the hosts allowed so far".
    pub fn allow_host(mut self, hostnqn: impl Into<String>) -> SubsystemConfig {
        match &mut self.hosts {
            HostAccess::Only(hosts) => hosts.push(hostnqn.into()),
            HostAccess::AnyHost => self.hosts = HostAccess::Only(vec![hostnqn.into()]),
        }
        self
    }

    /// Adds a namespace.
    pub fn namespace(mut self, backing: Backing, block_size: u32) -> SubsystemConfig {
        self.namespaces.push(NamespaceConfig {
            backing,
            block_size,
            nsid: None,
            ana_group: 1,
            uuid: None,
        });
        self
    }
}

/// An active namespace.
#[derive(Debug)]
pub(crate) struct Namespace {
    pub nsid: u32,
    pub block_size: u32,
    /// LBA data size as a power of two (9 or 12).
    pub lbads: u8,
    pub blocks: u64,
    pub nguid: [u8; 16],
    pub uuid: [u8; 16],
    /// Its ANA group.
    pub anagrpid: u32,
    pub store: Store,
    /// Its reservations, shared by every controller of the subsystem.
    pub resv: crate::resv::Reservations,
}

impl Namespace {
    fn open(subnqn: &str, nsid: u32, cfg: &NamespaceConfig) -> Result<Namespace, Error> {
        let lbads = match cfg.block_size {
            512 => 9,
            4096 => 12,
            other => return Err(Error::out_of_range(Setting::BlockSize, other)),
        };
        let store = match &cfg.backing {
            Backing::Ram(bytes) => Store::ram(*bytes),
            Backing::File(path) => Store::open(path).map_err(|source| Error::OpenNamespace {
                path: path.clone(),
                source,
            })?,
            Backing::Device(d) => {
                if d.block_size() != cfg.block_size {
                    return Err(Error::DeviceBlockSize {
                        nsid,
                        device: d.describe(),
                        device_block_size: d.block_size(),
                        block_size: cfg.block_size,
                    });
                }
                Store::Device(std::sync::Arc::clone(d))
            }
        };
        let blocks = store.len() / u64::from(cfg.block_size);
        if blocks == 0 {
            return Err(Error::NamespaceTooSmall {
                nsid,
                backing: store.describe(),
                block_size: cfg.block_size,
            });
        }
        check_ana_group(cfg.ana_group).map_err(|e| Error::InNamespace {
            nsid,
            source: Box::new(e),
        })?;
        let (nguid, derived_uuid) = namespace_ids(subnqn, nsid);
        let uuid = cfg.uuid.unwrap_or(derived_uuid);
        let resv = match &cfg.backing {
            Backing::File(path) => crate::resv::Reservations::for_file(path).map_err(|source| {
                Error::ReservationState {
                    path: path.clone(),
                    source,
                }
            })?,
            _ => crate::resv::Reservations::in_memory(),
        };
        Ok(Namespace {
            resv,
            anagrpid: cfg.ana_group,
            nsid,
            block_size: cfg.block_size,
            lbads,
            blocks,
            nguid,
            uuid,
            store,
        })
    }

    /// Byte offset and length of `nlb` blocks from `slba`, if they lie inside the namespace.
    pub(crate) fn byte_range(&self, slba: u64, nlb: u64) -> Option<(u64, u64)> {
        let end = slba.checked_add(nlb)?;
        (end <= self.blocks).then(|| (slba << self.lbads, nlb << self.lbads))
    }
}

/// NGUID and UUID for a namespace, derived from the subsystem NQN and the namespace ID, so that they are
/// stable across restarts and differ between subsystems (Linux refuses namespaces with duplicate IDs).
fn namespace_ids(subnqn: &str, nsid: u32) -> ([u8; 16], [u8; 16]) {
    let mut words = [0u32; 8];
    let mut crc = crc32c::crc32c(subnqn.as_bytes());
    for (i, w) in words.iter_mut().enumerate() {
        crc = crc32c::crc32c_append(
            crc,
            &[nsid.to_le_bytes(), (i as u32).to_le_bytes()].concat(),
        );
        *w = crc;
    }
    let mut nguid = [0u8; 16];
    let mut uuid = [0u8; 16];
    for i in 0..4 {
        nguid[4 * i..4 * i + 4].copy_from_slice(&words[i].to_be_bytes());
        uuid[4 * i..4 * i + 4].copy_from_slice(&words[4 + i].to_be_bytes());
    }
    // RFC 4122 version 4 (random) layout, since these are as good as random.
    uuid[6] = (uuid[6] & 0x0f) | 0x40;
    uuid[8] = (uuid[8] & 0x3f) | 0x80;
    (nguid, uuid)
}

/// Whether a subsystem serves storage or is the discovery subsystem.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Nvm,
    Discovery,
}

/// The active namespaces of a subsystem at one moment, indexed by `nsid - 1`. Queues keep a copy (an `Arc`)
/// and look it up without a lock; a change installs a new table and moves the subsystem's generation.
#[derive(Debug, Default)]
pub(crate) struct NsTable {
    slots: Vec<Option<Arc<Namespace>>>,
}

impl NsTable {
    /// The active namespace `nsid`.
    pub(crate) fn get(&self, nsid: u32) -> Option<&Arc<Namespace>> {
        let index = nsid.checked_sub(1)? as usize;
        self.slots.get(index)?.as_ref()
    }

    /// Every active namespace, by ascending ID.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Arc<Namespace>> {
        self.slots.iter().flatten()
    }

    /// The number of active namespaces.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.iter().count()
    }

    fn with(&self, ns: Arc<Namespace>) -> NsTable {
        let mut slots = self.slots.clone();
        let index = ns.nsid as usize - 1;
        if slots.len() <= index {
            slots.resize(index + 1, None);
        }
        slots[index] = Some(ns);
        NsTable { slots }
    }

    fn without(&self, nsid: u32) -> NsTable {
        let mut slots = self.slots.clone();
        if let Some(s) = slots.get_mut(nsid as usize - 1) {
            *s = None;
        }
        while matches!(slots.last(), Some(None)) {
            slots.pop();
        }
        NsTable { slots }
    }

    fn lowest_free(&self) -> Option<u32> {
        (1..=MAX_NAMESPACES).find(|&id| self.get(id).is_none())
    }
}

/// A subsystem as the target runs it.
#[derive(Debug)]
pub(crate) struct Subsystem {
    pub kind: Kind,
    pub nqn: String,
    pub serial: String,
    pub model: String,
    pub limits: Limits,
    /// The listeners it is reachable on (`None`: all).
    pub listeners: Option<Vec<SocketAddr>>,
    namespaces: Mutex<Arc<NsTable>>,
    /// Moves whenever the namespaces change; queues compare it with their copy's once per poll.
    ns_gen: AtomicU64,
    hosts: RwLock<HostAccess>,
    keys: RwLock<Vec<HostKey>>,
    dhchap_keys: RwLock<Vec<DhchapKey>>,
    dhchap: RwLock<DhchapPolicy>,
    /// TLS PSKs generated by secure channel concatenation: (identity, host NQN, TLS PSK), newest last.
    generated: Mutex<Vec<(String, String, nvpoll_tls::Psk)>>,
    /// Removed from the target: no Connect finds it, and its controllers are torn down.
    removed: AtomicBool,
    controllers: Mutex<Controllers>,
    /// The controller IDs it hands out.
    cntlids: CntlidRange,
    /// ANA states other than optimized, and when each group last changed.
    ana: Mutex<AnaTable>,
    /// The ANA change count: moves with every state change; queues compare it with their copy's.
    ana_gen: AtomicU64,
    /// I/O queues a new controller is granted (starts as `limits.max_io_queues`; the control socket may
    /// change it, which takes effect when hosts reconnect).
    io_queues: std::sync::atomic::AtomicU16,
}

/// The ANA states of a subsystem's paths.
#[derive(Debug, Default)]
struct AnaTable {
    /// States other than optimized, by listener and group.
    set: Vec<AnaSetting>,
    /// The change count at each group's last change (index: group ID).
    changed: Vec<u64>,
}

impl AnaTable {
    fn state(&self, listener: SocketAddr, group: u32) -> AnaState {
        self.set
            .iter()
            .find(|a| a.listener == listener && a.group == group)
            .map_or(AnaState::Optimized, |a| a.state)
    }
}

/// The ANA states one path (listener) sees, indexed by group ID: what a queue checks its commands against.
#[derive(Clone, Debug)]
pub(crate) struct AnaView {
    states: [AnaState; ANA_GROUP_MAX as usize + 1],
}

impl AnaView {
    /// The status a command on a namespace of `group` gets on this path; `None` when it may run.
    pub(crate) fn refusal(&self, group: u32) -> Option<nvpoll::spec::Status> {
        self.states
            .get(group as usize)
            .copied()
            .unwrap_or(AnaState::Inaccessible)
            .refusal()
    }
}

#[derive(Debug, Default)]
struct Controllers {
    next_cntlid: u16,
    live: HashMap<u16, Arc<Controller>>,
}

/// Locks `m`, taking the data of a poisoned lock as it is (a panic elsewhere must not stop the target).
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Subsystem {
    pub(crate) fn open(cfg: &SubsystemConfig, defaults: Limits) -> Result<Subsystem, Error> {
        check_nqn(&cfg.nqn)?;
        if cfg.nqn == DISCOVERY_NQN {
            return Err(Error::DiscoveryNqn);
        }
        check_ascii("serial number", &cfg.serial, 20)?;
        check_ascii("model number", &cfg.model, 40)?;
        let limits = Limits {
            max_io_queues: cfg.limits.max_io_queues.unwrap_or(defaults.max_io_queues),
            queue_entries: cfg.limits.queue_entries.unwrap_or(defaults.queue_entries),
            mdts: cfg.limits.mdts.unwrap_or(defaults.mdts),
        };
        limits
            .check()
            .map_err(|e| Error::in_subsystem(&cfg.nqn, e))?;
        if let HostAccess::Only(hosts) = &cfg.hosts {
            for h in hosts {
                check_nqn(h)?;
            }
        }
        for k in &cfg.host_keys {
            check_nqn(&k.hostnqn)?;
        }
        for k in &cfg.dhchap_keys {
            check_nqn(&k.hostnqn)?;
        }
        let mut s = Subsystem::new(
            Kind::Nvm,
            cfg.nqn.clone(),
            cfg.serial.clone(),
            cfg.model.clone(),
            limits,
        );
        s.listeners.clone_from(&cfg.listeners);
        cfg.cntlids
            .check()
            .map_err(|e| Error::in_subsystem(&cfg.nqn, e))?;
        s.cntlids = cfg.cntlids;
        for a in &cfg.ana {
            s.set_ana_state(a.listener, a.group, a.state)?;
        }
        *s.hosts.get_mut().unwrap_or_else(|e| e.into_inner()) = cfg.hosts.clone();
        *s.keys.get_mut().unwrap_or_else(|e| e.into_inner()) = cfg.host_keys.clone();
        *s.dhchap_keys.get_mut().unwrap_or_else(|e| e.into_inner()) = cfg.dhchap_keys.clone();
        *s.dhchap.get_mut().unwrap_or_else(|e| e.into_inner()) = cfg.dhchap.clone();
        for ns in &cfg.namespaces {
            s.add_namespace(ns)?;
        }
        Ok(s)
    }

    pub(crate) fn discovery(defaults: Limits) -> Subsystem {
        let serial = format!("nvpoll{:08x}", crc32c::crc32c(DISCOVERY_NQN.as_bytes()));
        Subsystem::new(
            Kind::Discovery,
            DISCOVERY_NQN.to_string(),
            serial,
            "nvpoll".to_string(),
            defaults,
        )
    }

    fn new(kind: Kind, nqn: String, serial: String, model: String, limits: Limits) -> Subsystem {
        let controllers = Mutex::new(Controllers {
            next_cntlid: 1,
            live: HashMap::new(),
        });
        Subsystem {
            kind,
            nqn,
            serial,
            model,
            limits,
            listeners: None,
            namespaces: Mutex::new(Arc::new(NsTable::default())),
            ns_gen: AtomicU64::new(0),
            hosts: RwLock::new(HostAccess::AnyHost),
            keys: RwLock::new(Vec::new()),
            dhchap_keys: RwLock::new(Vec::new()),
            dhchap: RwLock::new(DhchapPolicy::default()),
            generated: Mutex::new(Vec::new()),
            removed: AtomicBool::new(false),
            controllers,
            cntlids: CntlidRange::default(),
            ana: Mutex::new(AnaTable::default()),
            ana_gen: AtomicU64::new(0),
            io_queues: std::sync::atomic::AtomicU16::new(limits.max_io_queues),
        }
    }

    /// I/O queues a new controller is granted.
    pub(crate) fn max_io_queues(&self) -> u16 {
        self.io_queues.load(Ordering::Relaxed)
    }

    /// Grants new controllers `n` I/O queues (1 to 1024) and tears down the live controllers, whose hosts
    /// reconnect and get the new count (as nvmet does when its attr_qid_max changes). Returns how many
    /// controllers were torn down.
    pub(crate) fn set_max_io_queues(&self, n: u16) -> Result<usize, Error> {
        if !(1..=1024).contains(&n) {
            return Err(Error::out_of_range(Setting::IoQueues, n));
        }
        self.io_queues.store(n, Ordering::Relaxed);
        let live = lock(&self.controllers);
        for c in live.live.values() {
            c.kill();
        }
        Ok(live.live.len())
    }

    /// Every ANA state set (the rest are optimized).
    pub(crate) fn ana_settings(&self) -> Vec<AnaSetting> {
        lock(&self.ana).set.clone()
    }

    /// The ANA change count (cheap: queues read it once per poll).
    pub(crate) fn ana_gen(&self) -> u64 {
        self.ana_gen.load(Ordering::Acquire)
    }

    /// What the path through `listener` sees now, and the change count it belongs to.
    pub(crate) fn ana_view(&self, listener: SocketAddr) -> (AnaView, u64) {
        let t = lock(&self.ana);
        let mut states = [AnaState::Optimized; ANA_GROUP_MAX as usize + 1];
        for a in t.set.iter().filter(|a| a.listener == listener) {
            states[a.group as usize] = a.state;
        }
        (AnaView { states }, self.ana_gen.load(Ordering::Acquire))
    }

    /// Sets the state of `group` on `listener`. Every controller that came through that listener hears of it
    /// (an ANA change notice) and its queues see it on their next poll: commands to the group's namespaces
    /// then run or fail with the state's status. Returns the state before.
    pub(crate) fn set_ana_state(
        &self,
        listener: SocketAddr,
        group: u32,
        state: AnaState,
    ) -> Result<AnaState, Error> {
        check_ana_group(group)?;
        if self.kind == Kind::Discovery {
            return Err(Error::NotOnDiscovery("ANA groups"));
        }
        if !self.exported_on(listener) {
            return Err(Error::NotExported {
                nqn: self.nqn.clone(),
                listener,
            });
        }
        let before = {
            let mut t = lock(&self.ana);
            let before = t.state(listener, group);
            t.set
                .retain(|a| !(a.listener == listener && a.group == group));
            if state != AnaState::Optimized {
                t.set.push(AnaSetting {
                    listener,
                    group,
                    state,
                });
            }
            let gen = self.ana_gen.fetch_add(1, Ordering::AcqRel) + 1;
            if t.changed.len() <= group as usize {
                t.changed.resize(group as usize + 1, 0);
            }
            t.changed[group as usize] = gen;
            before
        };
        for c in lock(&self.controllers).live.values() {
            if c.listener == listener {
                c.ana_changed();
            }
        }
        Ok(before)
    }

    /// The ANA log page as a controller on `listener` reads it: a descriptor for every group that has a
    /// namespace or a state set, with its namespaces unless `groups_only` (RGO).
    pub(crate) fn ana_log(&self, listener: SocketAddr, groups_only: bool) -> AnaLog {
        let (table, _) = self.ns_table();
        let t = lock(&self.ana);
        let mut groups: Vec<u32> = table.iter().map(|n| n.anagrpid).collect();
        groups.extend(
            t.set
                .iter()
                .filter(|a| a.listener == listener)
                .map(|a| a.group),
        );
        groups.sort_unstable();
        groups.dedup();
        AnaLog {
            change_count: self.ana_gen.load(Ordering::Acquire),
            groups: groups
                .into_iter()
                .map(|g| AnaGroupDescriptor {
                    grpid: g,
                    change_count: t.changed.get(g as usize).copied().unwrap_or(0),
                    state: t.state(listener, g),
                    nsids: if groups_only {
                        Vec::new()
                    } else {
                        table
                            .iter()
                            .filter(|n| n.anagrpid == g)
                            .map(|n| n.nsid)
                            .collect()
                    },
                })
                .collect(),
        }
    }

    /// The namespaces as they are now, and the generation they belong to.
    pub(crate) fn ns_table(&self) -> (Arc<NsTable>, u64) {
        let t = lock(&self.namespaces);
        (Arc::clone(&t), self.ns_gen.load(Ordering::Acquire))
    }

    /// The generation of the namespace table (cheap: queues read it once per poll).
    pub(crate) fn ns_gen(&self) -> u64 {
        self.ns_gen.load(Ordering::Acquire)
    }

    /// Opens a namespace and makes it active; returns its ID. Every controller hears of it (Namespace
    /// Attribute Changed).
    pub(crate) fn add_namespace(&self, cfg: &NamespaceConfig) -> Result<u32, Error> {
        if self.kind == Kind::Discovery {
            return Err(Error::NotOnDiscovery("namespaces"));
        }
        let nsid = {
            let t = lock(&self.namespaces);
            match cfg.nsid {
                Some(id) if id == 0 || id > MAX_NAMESPACES => {
                    return Err(Error::out_of_range(Setting::NamespaceId, id))
                }
                Some(id) if t.get(id).is_some() => {
                    return Err(Error::NamespaceExists {
                        nqn: self.nqn.clone(),
                        nsid: id,
                    })
                }
                Some(id) => id,
                None => t.lowest_free().ok_or_else(|| Error::NamespacesFull {
                    nqn: self.nqn.clone(),
                })?,
            }
        };
        // Opening a file may take a while: not under the lock.
        let ns = Arc::new(Namespace::open(&self.nqn, nsid, cfg)?);
        {
            let mut t = lock(&self.namespaces);
            if t.get(nsid).is_some() {
                return Err(Error::NamespaceExists {
                    nqn: self.nqn.clone(),
                    nsid,
                });
            }
            *t = Arc::new(t.with(ns));
            self.ns_gen.fetch_add(1, Ordering::AcqRel);
        }
        self.namespace_changed(nsid);
        Ok(nsid)
    }

    /// Deactivates namespace `nsid`. Commands already running on it (data still arriving, a flush) finish
    /// with it; new ones get Invalid Namespace. Every controller hears of it.
    pub(crate) fn remove_namespace(&self, nsid: u32) -> Result<(), Error> {
        {
            let mut t = lock(&self.namespaces);
            if t.get(nsid).is_none() {
                return Err(Error::NoNamespace {
                    nqn: self.nqn.clone(),
                    nsid,
                });
            }
            *t = Arc::new(t.without(nsid));
            self.ns_gen.fetch_add(1, Ordering::AcqRel);
        }
        self.namespace_changed(nsid);
        Ok(())
    }

    fn namespace_changed(&self, nsid: u32) {
        for c in lock(&self.controllers).live.values() {
            c.namespace_changed(nsid);
        }
    }

    /// A reservation change on namespace `nsid` concerns host `hostid`: each of its controllers logs a
    /// notice of `kind` (unless it masked that kind) for an Asynchronous Event Request to announce.
    pub(crate) fn reservation_notice(&self, hostid: &[u8; 16], nsid: u32, kind: u8) {
        for c in lock(&self.controllers).live.values() {
            if c.hostid == *hostid {
                c.reservation_notice(nsid, kind);
            }
        }
    }

    /// Which hosts may connect.
    pub(crate) fn hosts(&self) -> HostAccess {
        self.hosts.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Whether `hostnqn` may connect.
    pub(crate) fn allows(&self, hostnqn: &str) -> bool {
        self.hosts
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .allows(hostnqn)
    }

    /// Replaces who may connect (hosts already connected stay).
    pub(crate) fn set_hosts(&self, hosts: HostAccess) -> Result<(), Error> {
        if let HostAccess::Only(list) = &hosts {
            for h in list {
                check_nqn(h)?;
            }
        }
        *self.hosts.write().unwrap_or_else(|e| e.into_inner()) = hosts;
        Ok(())
    }

    /// The hosts that have a TLS PSK for this subsystem.
    pub(crate) fn key_hosts(&self) -> Vec<String> {
        let keys = self.keys.read().unwrap_or_else(|e| e.into_inner());
        keys.iter().map(|k| k.hostnqn.clone()).collect()
    }

    /// The PSKs configured for `hostnqn`.
    pub(crate) fn keys_of(&self, hostnqn: &str) -> Vec<ConfiguredKey> {
        let keys = self.keys.read().unwrap_or_else(|e| e.into_inner());
        keys.iter()
            .filter(|k| k.hostnqn == hostnqn)
            .map(|k| k.key.clone())
            .collect()
    }

    /// Sets (or replaces) `hostnqn`'s PSK.
    pub(crate) fn set_key(&self, key: HostKey) -> Result<(), Error> {
        set_host_entry(&self.keys, key, |k| &k.hostnqn)
    }

    /// Removes `hostnqn`'s PSK; `false` if it had none. Connections already made stay.
    pub(crate) fn remove_key(&self, hostnqn: &str) -> bool {
        remove_host_entry(&self.keys, hostnqn, |k| &k.hostnqn)
    }

    /// What `hostnqn` must prove in band, if it has DH-HMAC-CHAP keys here (read at each transaction, so a
    /// new key applies to the next authentication).
    pub(crate) fn dhchap_policy(
        &self,
        hostnqn: &str,
    ) -> Option<nvpoll_wire::dhchap::controller::Policy> {
        let keys = self.dhchap_keys.read().unwrap_or_else(|e| e.into_inner());
        let k = keys.iter().find(|k| k.hostnqn == hostnqn)?;
        let p = self.dhchap.read().unwrap_or_else(|e| e.into_inner());
        Some(nvpoll_wire::dhchap::controller::Policy {
            secret: k.key.clone(),
            ctrl_secret: k.ctrl_key.clone(),
            hashes: p.hashes.clone(),
            groups: p.groups.clone(),
            concat: k.concat,
        })
    }

    /// Sets (or replaces) a host's DH-HMAC-CHAP keys; live queues keep their authentication, and the host's
    /// next transaction (a re-authentication or a new queue) uses the new keys.
    pub(crate) fn set_dhchap_key(&self, key: DhchapKey) -> Result<(), Error> {
        set_host_entry(&self.dhchap_keys, key, |k| &k.hostnqn)
    }

    /// Removes a host's DH-HMAC-CHAP keys (its new queues no longer authenticate); `false` if it had none.
    pub(crate) fn remove_dhchap_key(&self, hostnqn: &str) -> bool {
        remove_host_entry(&self.dhchap_keys, hostnqn, |k| &k.hostnqn)
    }

    /// Keeps the TLS PSK a secure channel concatenation of `hostnqn` generated; returns its identity. A host
    /// keeps its [`GENERATED_PER_HOST`] newest (queues of an older transaction may still reconnect with theirs).
    pub(crate) fn add_generated_key(
        &self,
        hostnqn: &str,
        hash: nvpoll_wire::dhchap::Hash,
        generated: &[u8],
    ) -> Option<String> {
        let (identity, psk) = nvpoll_wire::dhchap::concat_tls(hash, generated, hostnqn, &self.nqn)?;
        let mut g = self.generated.lock().unwrap_or_else(|e| e.into_inner());
        g.retain(|(id, _, _)| *id != identity);
        g.push((identity.clone(), hostnqn.to_string(), psk));
        let mine = g.iter().filter(|(_, h, _)| h == hostnqn).count();
        if mine > GENERATED_PER_HOST {
            let oldest = g
                .iter()
                .position(|(_, h, _)| h == hostnqn)
                .expect("counted above");
            g.remove(oldest);
        }
        Some(identity)
    }

    /// The TLS PSK of a generated identity.
    pub(crate) fn generated_psk(&self, identity: &[u8]) -> Option<nvpoll_tls::Psk> {
        let g = self.generated.lock().unwrap_or_else(|e| e.into_inner());
        g.iter()
            .find(|(id, _, _)| id.as_bytes() == identity)
            .map(|(_, _, psk)| psk.clone())
    }

    /// Sets the hashes and groups allowed (for the next transactions).
    pub(crate) fn set_dhchap_allowed(&self, p: DhchapPolicy) {
        *self.dhchap.write().unwrap_or_else(|e| e.into_inner()) = p;
    }

    /// Whether hosts may reach it on the listener at `addr`.
    pub(crate) fn exported_on(&self, addr: SocketAddr) -> bool {
        self.listeners.as_ref().is_none_or(|l| l.contains(&addr))
    }

    /// Whether it was removed from the target.
    pub(crate) fn is_removed(&self) -> bool {
        self.removed.load(Ordering::Acquire)
    }

    /// Takes it out of service: every controller is torn down (their queues complete what they hold with an
    /// abort status and close).
    pub(crate) fn remove(&self) {
        self.removed.store(true, Ordering::Release);
        for c in lock(&self.controllers).live.values() {
            c.kill();
        }
    }

    /// The number of live controllers.
    pub(crate) fn controller_count(&self) -> usize {
        lock(&self.controllers).live.len()
    }

    /// Registers a new controller under a fresh controller ID; `None` if all IDs are taken.
    pub(crate) fn add_controller(
        &self,
        make: impl FnOnce(u16) -> Controller,
    ) -> Option<Arc<Controller>> {
        let mut c = lock(&self.controllers);
        let CntlidRange { min, max } = self.cntlids;
        for _ in min..=max {
            let id = c.next_cntlid.clamp(min, max);
            c.next_cntlid = if id >= max { min } else { id + 1 };
            if let std::collections::hash_map::Entry::Vacant(slot) = c.live.entry(id) {
                let ctrl = Arc::new(make(id));
                slot.insert(Arc::clone(&ctrl));
                return Some(ctrl);
            }
        }
        None
    }

    /// The live controller `cntlid`.
    pub(crate) fn controller(&self, cntlid: u16) -> Option<Arc<Controller>> {
        lock(&self.controllers).live.get(&cntlid).cloned()
    }

    /// Forgets controller `cntlid` (its ID may be handed out again).
    pub(crate) fn remove_controller(&self, cntlid: u16) {
        lock(&self.controllers).live.remove(&cntlid);
    }
}

/// Puts `entry` in a list of one entry a host (`host` names its host), in place of the host's old one.
fn set_host_entry<T>(
    list: &RwLock<Vec<T>>,
    entry: T,
    host: fn(&T) -> &String,
) -> Result<(), Error> {
    check_nqn(host(&entry))?;
    let mut list = list.write().unwrap_or_else(|e| e.into_inner());
    list.retain(|e| host(e) != host(&entry));
    list.push(entry);
    Ok(())
}

/// Removes `hostnqn`'s entry from a list of one entry a host; `false` if it had none.
fn remove_host_entry<T>(list: &RwLock<Vec<T>>, hostnqn: &str, host: fn(&T) -> &String) -> bool {
    let mut list = list.write().unwrap_or_else(|e| e.into_inner());
    let before = list.len();
    list.retain(|e| host(e) != hostnqn);
    list.len() != before
}

/// The least a subsystem asks of an NQN given in code: it fits the Connect field (the configuration file and the
/// control socket ask for the dated form too, `config::check_nqn`).
fn check_nqn(nqn: &str) -> Result<(), Error> {
    let fault = if nqn.is_empty() {
        NqnFault::Empty
    } else if nqn.len() > MAX_NQN_LEN {
        NqnFault::TooLong(nqn.len())
    } else if nqn.contains('\0') {
        NqnFault::Whitespace
    } else {
        return Ok(());
    };
    Err(Error::BadNqn {
        nqn: nqn.to_string(),
        fault,
    })
}

fn check_ascii(what: &'static str, s: &str, max: usize) -> Result<(), Error> {
    if s.len() > max || !s.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return Err(Error::BadText {
            what,
            value: s.to_string(),
            max,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        max_io_queues: 4,
        queue_entries: 128,
        mdts: 8,
    };

    #[test]
    fn namespaces_come_and_go_with_the_generation() {
        let cfg = SubsystemConfig::new("nqn.x").namespace(Backing::Ram(1 << 20), 512);
        let s = Subsystem::open(&cfg, LIMITS).unwrap();
        let (t, g) = s.ns_table();
        assert_eq!(t.len(), 1);
        let ns = NamespaceConfig {
            backing: Backing::Ram(1 << 20),
            block_size: 512,
            nsid: Some(5),
            ana_group: 1,
            uuid: None,
        };
        assert_eq!(s.add_namespace(&ns).unwrap(), 5);
        assert!(s.add_namespace(&ns).is_err());
        assert!(s.ns_gen() > g);
        let free = NamespaceConfig { nsid: None, ..ns };
        assert_eq!(s.add_namespace(&free).unwrap(), 2);
        s.remove_namespace(1).unwrap();
        assert!(s.remove_namespace(1).is_err());
        let (t, _) = s.ns_table();
        assert_eq!(t.iter().map(|n| n.nsid).collect::<Vec<_>>(), vec![2, 5]);
        assert!(t.get(1).is_none());
        // The table a queue held before still has what it had.
        assert_eq!(s.add_namespace(&free).unwrap(), 1);
    }

    #[test]
    fn ids_are_stable_and_differ_between_subsystems() {
        let a = namespace_ids("nqn.a", 1);
        assert_eq!(a, namespace_ids("nqn.a", 1));
        assert_ne!(a, namespace_ids("nqn.b", 1));
        assert_ne!(a, namespace_ids("nqn.a", 2));
        assert_eq!(a.1[6] >> 4, 4);
    }

    #[test]
    fn byte_range_checks_the_end() {
        let cfg = NamespaceConfig {
            backing: Backing::Ram(1 << 20),
            block_size: 4096,
            nsid: None,
            ana_group: 1,
            uuid: None,
        };
        let ns = Namespace::open("nqn.x", 1, &cfg).unwrap();
        assert_eq!(ns.blocks, 256);
        assert_eq!(ns.byte_range(255, 1), Some((255 * 4096, 4096)));
        assert_eq!(ns.byte_range(255, 2), None);
        assert_eq!(ns.byte_range(u64::MAX, 2), None);
        assert!(Namespace::open(
            "nqn.x",
            1,
            &NamespaceConfig {
                backing: Backing::Ram(100),
                block_size: 512,
                nsid: None,
                ana_group: 1,
                uuid: None,
            }
        )
        .is_err());
    }

    #[test]
    fn controller_ids_are_reused_only_when_free() {
        let s = Subsystem::discovery(LIMITS);
        let make = |id| Controller::new_for_test(id);
        let a = s.add_controller(make).unwrap();
        let b = s.add_controller(make).unwrap();
        assert_ne!(a.cntlid, b.cntlid);
        s.remove_controller(a.cntlid);
        assert!(s.controller(a.cntlid).is_none());
        assert!(s.controller(b.cntlid).is_some());
    }
}

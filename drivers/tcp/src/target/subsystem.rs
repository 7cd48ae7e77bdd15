//! NVM subsystems and their namespaces: what the target serves, and the controllers hosts created in them.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use super::controller::Controller;
use super::store::Store;
use crate::Error;

/// The NQN of the well-known discovery subsystem, which every target serves.
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";

/// The longest NQN the spec allows, in bytes (223; the field is 256 bytes with a terminating NUL).
pub const MAX_NQN_LEN: usize = 223;

/// What backs a namespace.
#[derive(Clone, Debug)]
pub enum Backing {
    /// Memory of this many bytes, zeroed, lost when the target stops.
    Ram(u64),
    /// An existing regular file or block device, read and written through the page cache.
    File(PathBuf),
    /// Another NVMe namespace, for instance a local SSD through nvpoll-pcie (see [`super::QueuePairDevice`]).
    /// The exported namespace's block size must be the device's.
    Device(std::sync::Arc<dyn super::device::BlockDevice>),
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
        }
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
    pub store: Store,
}

impl Namespace {
    fn open(subnqn: &str, nsid: u32, cfg: &NamespaceConfig) -> Result<Namespace, Error> {
        let lbads = match cfg.block_size {
            512 => 9,
            4096 => 12,
            other => {
                return Err(Error::InvalidArgument(format!(
                    "block size {other}: must be 512 or 4096"
                )))
            }
        };
        let store = match &cfg.backing {
            Backing::Ram(bytes) => Store::ram(*bytes),
            Backing::File(path) => Store::open(path)
                .map_err(|e| Error::io(format!("open namespace file {}", path.display()), e))?,
            Backing::Device(d) => {
                if d.block_size() != cfg.block_size {
                    return Err(Error::InvalidArgument(format!(
                        "namespace {nsid}: {} has {}-byte blocks, not {}",
                        d.describe(),
                        d.block_size(),
                        cfg.block_size
                    )));
                }
                Store::Device(std::sync::Arc::clone(d))
            }
        };
        let blocks = store.len() / u64::from(cfg.block_size);
        if blocks == 0 {
            return Err(Error::InvalidArgument(format!(
                "namespace {nsid} ({}) is smaller than one {}-byte block",
                store.describe(),
                cfg.block_size
            )));
        }
        let (nguid, uuid) = namespace_ids(subnqn, nsid);
        Ok(Namespace {
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
    pub fn byte_range(&self, slba: u64, nlb: u64) -> Option<(u64, u64)> {
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

/// A subsystem as the target runs it.
#[derive(Debug)]
pub(crate) struct Subsystem {
    pub kind: Kind,
    pub nqn: String,
    pub serial: String,
    pub model: String,
    pub namespaces: Vec<Arc<Namespace>>,
    pub hosts: HostAccess,
    controllers: Mutex<Controllers>,
}

#[derive(Debug, Default)]
struct Controllers {
    next_cntlid: u16,
    live: HashMap<u16, Arc<Controller>>,
}

/// The highest controller ID the dynamic controller model hands out (0xFFF0 and up are reserved).
const MAX_CNTLID: u16 = 0xffef;

impl Subsystem {
    pub fn open(cfg: &SubsystemConfig) -> Result<Subsystem, Error> {
        check_nqn(&cfg.nqn)?;
        if cfg.nqn == DISCOVERY_NQN {
            return Err(Error::InvalidArgument(format!(
                "{DISCOVERY_NQN} is the discovery subsystem's NQN"
            )));
        }
        check_ascii("serial number", &cfg.serial, 20)?;
        check_ascii("model number", &cfg.model, 40)?;
        let mut namespaces = Vec::with_capacity(cfg.namespaces.len());
        for (i, ns) in cfg.namespaces.iter().enumerate() {
            namespaces.push(Arc::new(Namespace::open(&cfg.nqn, i as u32 + 1, ns)?));
        }
        if let HostAccess::Only(hosts) = &cfg.hosts {
            for h in hosts {
                check_nqn(h)?;
            }
        }
        let mut s = Subsystem::new(
            Kind::Nvm,
            cfg.nqn.clone(),
            cfg.serial.clone(),
            cfg.model.clone(),
            namespaces,
        );
        s.hosts = cfg.hosts.clone();
        Ok(s)
    }

    pub fn discovery() -> Subsystem {
        let serial = format!("nvpoll{:08x}", crc32c::crc32c(DISCOVERY_NQN.as_bytes()));
        Subsystem::new(
            Kind::Discovery,
            DISCOVERY_NQN.to_string(),
            serial,
            "nvpoll".to_string(),
            Vec::new(),
        )
    }

    fn new(
        kind: Kind,
        nqn: String,
        serial: String,
        model: String,
        namespaces: Vec<Arc<Namespace>>,
    ) -> Subsystem {
        let controllers = Mutex::new(Controllers {
            next_cntlid: 1,
            live: HashMap::new(),
        });
        Subsystem {
            kind,
            nqn,
            serial,
            model,
            namespaces,
            hosts: HostAccess::AnyHost,
            controllers,
        }
    }

    /// The active namespace `nsid`.
    pub fn namespace(&self, nsid: u32) -> Option<&Arc<Namespace>> {
        let index = nsid.checked_sub(1)? as usize;
        self.namespaces.get(index)
    }

    /// The highest namespace ID (Identify Controller NN).
    pub fn max_nsid(&self) -> u32 {
        self.namespaces.len() as u32
    }

    /// Registers a new controller under a fresh controller ID; `None` if all IDs are taken.
    pub fn add_controller(&self, make: impl FnOnce(u16) -> Controller) -> Option<Arc<Controller>> {
        let mut c = self.controllers.lock().unwrap_or_else(|e| e.into_inner());
        for _ in 0..MAX_CNTLID {
            let id = c.next_cntlid;
            c.next_cntlid = if id >= MAX_CNTLID { 1 } else { id + 1 };
            if let std::collections::hash_map::Entry::Vacant(slot) = c.live.entry(id) {
                let ctrl = Arc::new(make(id));
                slot.insert(Arc::clone(&ctrl));
                return Some(ctrl);
            }
        }
        None
    }

    /// The live controller `cntlid`.
    pub fn controller(&self, cntlid: u16) -> Option<Arc<Controller>> {
        self.controllers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .live
            .get(&cntlid)
            .cloned()
    }

    /// Forgets controller `cntlid` (its ID may be handed out again).
    pub fn remove_controller(&self, cntlid: u16) {
        self.controllers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .live
            .remove(&cntlid);
    }
}

fn check_nqn(nqn: &str) -> Result<(), Error> {
    if nqn.is_empty() || nqn.len() > MAX_NQN_LEN || nqn.contains('\0') {
        return Err(Error::InvalidArgument(format!(
            "NQN {nqn:?}: must be 1 to {MAX_NQN_LEN} bytes without NUL"
        )));
    }
    Ok(())
}

fn check_ascii(what: &str, s: &str, max: usize) -> Result<(), Error> {
    if s.len() > max || !s.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return Err(Error::InvalidArgument(format!(
            "{what} {s:?}: must be at most {max} printable ASCII characters"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
                block_size: 512
            }
        )
        .is_err());
    }

    #[test]
    fn controller_ids_are_reused_only_when_free() {
        let s = Subsystem::discovery();
        let make = |id| Controller::new_for_test(id);
        let a = s.add_controller(make).unwrap();
        let b = s.add_controller(make).unwrap();
        assert_ne!(a.cntlid, b.cntlid);
        s.remove_controller(a.cntlid);
        assert!(s.controller(a.cntlid).is_none());
        assert!(s.controller(b.cntlid).is_some());
    }
}

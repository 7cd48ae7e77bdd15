//! The target's configuration file: listeners, target-wide defaults and subsystems, in JSON.
//!
//! ```json
//! {
//!   "listeners": [ {"address": "127.0.0.1:4420", "tls": "off"}, {"address": "127.0.0.1:4421", "tls": "required"} ],
//!   "max_io_queues": 128, "queue_size": 128, "mdts": 8,
//!   "send_mode": "deferred", "tcp_congestion": "cubic", "tls_key_update": 8388608,
//!   "subsystems": [ {
//!       "nqn": "nqn.2024-01.io.nvpoll:a", "serial": "A0001", "model": "nvpoll",
//!       "allow_any_host": false,
//!       "hosts": [ {"nqn": "nqn.2024-01.io.nvpoll:h1", "psk_file": "/etc/nvpoll/h1.key"}, {"nqn": "nqn.2024-01.io.nvpoll:h2"} ],
//!       "listeners": ["127.0.0.1:4421"],
//!       "max_io_queues": 16, "queue_size": 64, "mdts": 5,
//!       "namespaces": [ {"nsid": 1, "ram": "1G", "block_size": 512}, {"file": "/srv/img"}, {"pcie": "0000:00:04.0"} ]
//!   } ]
//! }
//! ```
//!
//! Why JSON: a subsystem object here is exactly the params of the control socket's `subsystem_add`
//! ([`crate::rpc`]), so one schema serves both; SPDK's users know JSON configurations; and serde_json reports
//! the line and column of what it could not read.
//!
//! The schema:
//! - `listeners` (at least one): `address` (IP and port) and `tls` (`off`, the default, `optional` or
//!   `required`). The first is [`TargetConfig::listen`].
//! - `max_io_queues`, `queue_size`, `mdts`, `send_mode` (`inline`, `deferred` or `adaptive`): optional
//!   target-wide defaults; `tcp_congestion`: the TCP congestion control of every listener (`system`: the
//!   system's everywhere; default: the system's, cubic for loopback connections under BBR), see
//!   [`crate::TargetConfig::tcp_congestion`]; `tls_key_update`: with TLS, the records
//!   one key protects before the connection renews its keys (1 to 8388608, the default; see
//!   [`crate::TargetConfig::tls_key_renewal`]).
//! - `subsystems`: `nqn`; optional `serial` and `model`; `allow_any_host` (default `false`: only `hosts` may
//!   connect; with `true`, `hosts` only give keys); `hosts`, each with `nqn` and optionally `psk_file`, a file
//!   holding the host's `NVMeTLSkey-1:...:` interchange key, readable by its owner only (mode 0600, as SPDK's
//!   keyring asks), `dhchap_key` (the host's DH-HMAC-CHAP secret, `DHHC-1:hh:...:` as nvme-cli's
//!   `gen-dhchap-key` writes it: that host must then authenticate every queue) and `dhchap_ctrl_key` (the
//!   controller's secret, for hosts that authenticate the controller too); `dhchap_hashes` (of `sha256`,
//!   `sha384`, `sha512`) and `dhchap_dhgroups` (of `null`, `ffdhe2048` ... `ffdhe8192`), the ones allowed,
//!   strongest preferred (default: all); `listeners`, the addresses it is reachable on (default: every listener); per-subsystem
//!   `max_io_queues`, `queue_size` and `mdts`; `namespaces`, each with exactly one of `ram` (a size: bytes, or
//!   a string with a K, M, G or T suffix), `file` (an existing file or block device) or `pcie` (the PCI
//!   address of a local NVMe controller, opened by the program's resolver), and optionally `nsid`,
//!   `block_size` (512 or 4096; default 512, or the device's for `pcie`) and `uuid` (its Namespace UUID,
//!   8-4-4-4-12 hex; default: one derived from the subsystem NQN and the namespace ID).
//!
//! Relative paths (`file`, `psk_file`) are taken from the configuration file's folder. Unknown fields are
//! errors, and so is every value the target would refuse: each [`ConfigError`] names the field (a path such as
//! `subsystems[1].namespaces[0].ram`) and its line. No error ever shows what a key file or secret holds.

use std::fmt;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;
use zeroize::Zeroizing;

pub use crate::error::ConfigError;
use crate::error::{Error, KeyFileFault, NqnFault};
use crate::options::{TargetConfig, TargetTls, TlsMode};
use crate::subsystem::{
    Backing, HostAccess, HostKey, Limits, NamespaceConfig, SubsystemConfig, SubsystemLimits,
    DISCOVERY_NQN, MAX_NAMESPACES, MAX_NQN_LEN,
};
use nvpoll_tls::{ConfiguredKey, KeyError};

/// Opens the namespace of a local NVMe controller given by its PCI address (`pcie` in a namespace object).
/// The target cannot open one itself: the program supplies this (the `nvpoll-target` tool uses nvpoll-pcie),
/// or [`no_pcie`]. Its error is best [`Error::pcie`] (the PCI address and the driver's error).
pub type PcieResolver<'a> = dyn Fn(&str) -> Result<Backing, Error> + Send + Sync + 'a;

/// A [`PcieResolver`] for programs without a PCIe driver: every `pcie` namespace is refused.
pub fn no_pcie(bdf: &str) -> Result<Backing, Error> {
    Err(Error::NoPcieDriver {
        bdf: bdf.to_string(),
    })
}

impl ConfigError {
    fn unread(origin: &Path, what: String) -> ConfigError {
        ConfigError {
            origin: Some(origin.to_path_buf()),
            line: None,
            column: None,
            field: String::new(),
            message: what,
            cause: None,
        }
    }
}

/// Reads and checks the configuration file at `path`. `pcie` opens the `pcie` namespaces.
pub fn load(path: &Path, pcie: &PcieResolver<'_>) -> Result<TargetConfig, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError::unread(path, format!("cannot read it: {e}")))?;
    parse(&text, path, pcie)
}

/// Parses and checks a configuration; `origin` is the file it came from (named in errors; relative paths in
/// it are taken from its folder).
pub fn parse(
    text: &str,
    origin: &Path,
    pcie: &PcieResolver<'_>,
) -> Result<TargetConfig, ConfigError> {
    let doc: TargetDoc = from_text(text, origin)?;
    let ctx = Ctx {
        base: origin.parent(),
        listeners: &[],
        pcie,
    };
    target(&doc, &ctx).map_err(|p| p.in_text(text, origin))
}

/// Parses one subsystem object, as in the file's `subsystems` (the params of the RPC `subsystem_add`), for a
/// target whose listeners are `listeners`. Relative paths are taken from the current folder. Errors have no
/// line: the field alone says where.
pub fn parse_subsystem(
    object: &serde_json::Value,
    listeners: &[SocketAddr],
    pcie: &PcieResolver<'_>,
) -> Result<SubsystemConfig, ConfigError> {
    let doc: SubsystemDoc = from_value(object)?;
    let ctx = Ctx {
        base: None,
        listeners,
        pcie,
    };
    subsystem(&doc, &FieldPath::default(), &ctx).map_err(Problem::detached)
}

/// Parses one namespace object (`{"nsid"?, "ram"|"file"|"pcie", "block_size"?}`).
pub(super) fn parse_namespace(
    object: &serde_json::Value,
    pcie: &PcieResolver<'_>,
) -> Result<NamespaceConfig, ConfigError> {
    let doc: NamespaceDoc = from_value(object)?;
    let ctx = Ctx {
        base: None,
        listeners: &[],
        pcie,
    };
    namespace(&doc, &FieldPath::default(), &ctx).map_err(Problem::detached)
}

/// The largest key file read (an interchange key is about 70 bytes).
const MAX_KEY_FILE: u64 = 4096;

/// Reads a host's TLS PSK from `path`: an `NVMeTLSkey-1:...:` interchange key, whitespace around it ignored.
/// A file that its group or others may access is refused, as SPDK's keyring does. Errors name the path, never
/// what the file holds.
pub(super) fn read_key_file(path: &Path) -> Result<ConfiguredKey, Error> {
    let unreadable = |source| Error::KeyFileUnreadable {
        path: path.to_path_buf(),
        source,
    };
    let refused = |fault| Error::KeyFile {
        path: path.to_path_buf(),
        fault,
    };
    let meta = std::fs::metadata(path).map_err(unreadable)?;
    if !meta.is_file() {
        return Err(refused(KeyFileFault::NotAFile));
    }
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(refused(KeyFileFault::OpenToOthers { mode }));
    }
    if meta.len() > MAX_KEY_FILE {
        return Err(refused(KeyFileFault::TooLarge { bytes: meta.len() }));
    }
    let bytes = Zeroizing::new(std::fs::read(path).map_err(unreadable)?);
    let text = std::str::from_utf8(&bytes).map_err(|_| refused(KeyFileFault::NotText))?;
    ConfiguredKey::parse(text.trim()).map_err(|e| {
        // KeyError's messages may quote fields of the string: say what is wrong in our words instead.
        let why = match e {
            KeyError::Prefix => "it does not start with \"NVMeTLSkey-\"",
            KeyError::Version(_) => "its version is not 1",
            KeyError::HashField(_) => "its hash field is not 00, 01 or 02",
            KeyError::Base64 => "its key field is not valid base64",
            KeyError::Length { .. } => "its key has the wrong length for its hash field",
            KeyError::Crc { .. } => "its CRC does not match the key",
            KeyError::Terminator => "it does not end with ':' after the key field",
            _ => "it is not in the interchange format",
        };
        refused(KeyFileFault::NotAKey(why))
    })
}

/// Checks the form of an NQN: `nqn.` then a `yyyy-mm.` date and a name, at most 223 bytes, no whitespace or
/// control characters (what SPDK asks of the names it is given).
pub(super) fn check_nqn(nqn: &str) -> Result<(), Error> {
    let bad = |fault| {
        Err(Error::BadNqn {
            nqn: nqn.to_string(),
            fault,
        })
    };
    if nqn.len() > MAX_NQN_LEN {
        return bad(NqnFault::TooLong(nqn.len()));
    }
    let dated = nqn.strip_prefix("nqn.").and_then(|rest| {
        let b = rest.as_bytes();
        let ok = b.len() > 8
            && b[..4].iter().all(u8::is_ascii_digit)
            && b[4] == b'-'
            && b[5..7].iter().all(u8::is_ascii_digit)
            && b[7] == b'.';
        ok.then_some(())
    });
    if dated.is_none() {
        return bad(NqnFault::NotDated);
    }
    if nqn.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return bad(NqnFault::Whitespace);
    }
    Ok(())
}

// ---- The schema ----

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TargetDoc {
    listeners: Vec<ListenerDoc>,
    max_io_queues: Option<u16>,
    queue_size: Option<u16>,
    mdts: Option<u8>,
    send_mode: Option<Parsed<nvpoll::send::SendMode>>,
    tcp_congestion: Option<String>,
    tls_key_update: Option<u64>,
    #[serde(default)]
    subsystems: Vec<SubsystemDoc>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListenerDoc {
    address: Address,
    tls: Option<Parsed<TlsMode>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SubsystemDoc {
    nqn: String,
    serial: Option<String>,
    model: Option<String>,
    #[serde(default)]
    allow_any_host: bool,
    #[serde(default)]
    hosts: Vec<HostDoc>,
    listeners: Option<Vec<Address>>,
    max_io_queues: Option<u16>,
    queue_size: Option<u16>,
    mdts: Option<u8>,
    #[serde(default)]
    namespaces: Vec<NamespaceDoc>,
    #[serde(default)]
    ana: Vec<AnaDoc>,
    cntlid_min: Option<u16>,
    cntlid_max: Option<u16>,
    dhchap_hashes: Option<Vec<String>>,
    dhchap_dhgroups: Option<Vec<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AnaDoc {
    listener: Address,
    group: Option<u32>,
    state: Parsed<nvpoll::spec::AnaState>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HostDoc {
    nqn: String,
    psk_file: Option<PathBuf>,
    dhchap_key: Option<String>,
    dhchap_ctrl_key: Option<String>,
    #[serde(default)]
    dhchap_concat: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NamespaceDoc {
    nsid: Option<u32>,
    ram: Option<Size>,
    file: Option<PathBuf>,
    pcie: Option<String>,
    block_size: Option<u32>,
    ana_group: Option<u32>,
    uuid: Option<String>,
}

/// A value read from a string with `FromStr` (TLS and send modes).
pub(super) struct Parsed<T>(pub T);

impl<'de, T> Deserialize<'de> for Parsed<T>
where
    T: FromStr,
    T::Err: fmt::Display,
{
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map(Parsed).map_err(de::Error::custom)
    }
}

/// A listener address: an IP address and a port.
#[derive(Clone, Copy)]
pub(super) struct Address(pub SocketAddr);

impl<'de> Deserialize<'de> for Address {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map(Address).map_err(|_| {
            de::Error::custom(format!(
                "{s:?} is not an IP address and port such as 127.0.0.1:4420 or [::1]:4420"
            ))
        })
    }
}

/// A size in bytes: a number, or a string with a K, M, G or T suffix (powers of 1024).
struct Size(u64);

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Size;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size: a number of bytes, or a string such as \"1G\" or \"512M\"")
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Size, E> {
                if v == 0 {
                    return Err(E::custom("a size of zero bytes"));
                }
                Ok(Size(v))
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Size, E> {
                nvpoll::units::parse_size(v).map(Size).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

// ---- From the schema to the target's configuration ----

/// One step of a field path.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Seg {
    Key(String),
    Index(usize),
}

/// Where a field is, from the document's root.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct FieldPath(Vec<Seg>);

impl FieldPath {
    fn key(&self, k: &str) -> FieldPath {
        let mut p = self.clone();
        p.0.push(Seg::Key(k.to_string()));
        p
    }

    fn index(&self, i: usize) -> FieldPath {
        let mut p = self.clone();
        p.0.push(Seg::Index(i));
        p
    }
}

impl fmt::Display for FieldPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, seg) in self.0.iter().enumerate() {
            match seg {
                Seg::Key(k) if i == 0 => f.write_str(k)?,
                Seg::Key(k) => write!(f, ".{k}")?,
                Seg::Index(n) => write!(f, "[{n}]")?,
            }
        }
        Ok(())
    }
}

/// A value the schema accepts but the target would not, and its field.
#[derive(Debug)]
struct Problem {
    at: FieldPath,
    message: String,
    cause: Option<Box<Error>>,
}

impl Problem {
    fn new(at: FieldPath, message: impl Into<String>) -> Problem {
        Problem {
            at,
            message: message.into(),
            cause: None,
        }
    }

    /// The target's own check refused the field: its error says why.
    fn because(at: FieldPath, e: Error) -> Problem {
        Problem {
            at,
            message: e.to_string(),
            cause: Some(Box::new(e)),
        }
    }

    /// The error, with the line of the field in `text`.
    fn in_text(self, text: &str, origin: &Path) -> ConfigError {
        let offset = locate(text, &self.at.0);
        ConfigError {
            origin: Some(origin.to_path_buf()),
            line: Some(line_of(text, offset)),
            column: None,
            field: self.at.to_string(),
            message: self.message,
            cause: self.cause.map(|e| Arc::new(*e)),
        }
    }

    /// The error, for params that came without a text.
    fn detached(self) -> ConfigError {
        ConfigError {
            origin: None,
            line: None,
            column: None,
            field: self.at.to_string(),
            message: self.message,
            cause: self.cause.map(|e| Arc::new(*e)),
        }
    }
}

/// What the checks need besides the document.
struct Ctx<'a> {
    /// The folder relative paths start from (`None`: the current one).
    base: Option<&'a Path>,
    /// The target's listeners, which a subsystem may name (a file's own listeners while it is read).
    listeners: &'a [SocketAddr],
    pcie: &'a PcieResolver<'a>,
}

impl Ctx<'_> {
    fn resolve(&self, p: &Path) -> PathBuf {
        match self.base {
            Some(base) if p.is_relative() && !base.as_os_str().is_empty() => base.join(p),
            _ => p.to_path_buf(),
        }
    }
}

fn from_text<T: de::DeserializeOwned>(text: &str, origin: &Path) -> Result<T, ConfigError> {
    let mut de = serde_json::Deserializer::from_str(text);
    let value = serde_path_to_error::deserialize(&mut de)
        .map_err(|e| serde_error(Some(e.path()), e.inner(), Some(origin)))?;
    // Anything after the document (a second one, a stray brace) is an error too.
    de.end().map_err(|e| serde_error(None, &e, Some(origin)))?;
    Ok(value)
}

fn from_value<T: de::DeserializeOwned>(value: &serde_json::Value) -> Result<T, ConfigError> {
    serde_path_to_error::deserialize(value)
        .map_err(|e| serde_error(Some(e.path()), e.inner(), None))
}

fn serde_error(
    path: Option<&serde_path_to_error::Path>,
    inner: &serde_json::Error,
    origin: Option<&Path>,
) -> ConfigError {
    use serde_path_to_error::Segment;
    let mut at = FieldPath::default();
    for seg in path.into_iter().flat_map(|p| p.iter()) {
        match seg {
            Segment::Seq { index } => at.0.push(Seg::Index(*index)),
            Segment::Map { key } => at.0.push(Seg::Key(key.clone())),
            Segment::Enum { variant } => at.0.push(Seg::Key(variant.clone())),
            // A syntax error has no field (serde_path_to_error says "?").
            Segment::Unknown => {}
        }
    }
    let (line, column) = (inner.line(), inner.column());
    let mut message = inner.to_string();
    // serde_json ends its message with the position, which the error carries apart.
    let suffix = format!(" at line {line} column {column}");
    if let Some(m) = message.strip_suffix(&suffix) {
        message = m.to_string();
    }
    ConfigError {
        origin: origin.map(Path::to_path_buf),
        line: (line > 0).then_some(line),
        column: (line > 0).then_some(column),
        field: at.to_string(),
        message,
        cause: None,
    }
}

/// Checks one of the three limits alone (the target's own check, the others at their defaults).
fn check_limit(at: FieldPath, set: impl FnOnce(&mut Limits)) -> Result<(), Problem> {
    let mut limits = Limits {
        max_io_queues: 128,
        queue_entries: 128,
        mdts: 8,
    };
    set(&mut limits);
    limits.check().map_err(|e| Problem::because(at, e))
}

fn limits(
    at: &FieldPath,
    max_io_queues: Option<u16>,
    queue_size: Option<u16>,
    mdts: Option<u8>,
) -> Result<SubsystemLimits, Problem> {
    if let Some(v) = max_io_queues {
        check_limit(at.key("max_io_queues"), |l| l.max_io_queues = v)?;
    }
    if let Some(v) = queue_size {
        check_limit(at.key("queue_size"), |l| l.queue_entries = v)?;
    }
    if let Some(v) = mdts {
        check_limit(at.key("mdts"), |l| l.mdts = v)?;
    }
    Ok(SubsystemLimits {
        max_io_queues,
        queue_entries: queue_size,
        mdts,
    })
}

fn target(doc: &TargetDoc, ctx: &Ctx<'_>) -> Result<TargetConfig, Problem> {
    let root = FieldPath::default();
    let Some(first) = doc.listeners.first() else {
        return Err(Problem::new(
            root.key("listeners"),
            "at least one listener is needed",
        ));
    };
    let mut addresses: Vec<SocketAddr> = Vec::new();
    for (i, l) in doc.listeners.iter().enumerate() {
        if l.address.0.port() != 0 && addresses.contains(&l.address.0) {
            return Err(Problem::new(
                root.key("listeners").index(i).key("address"),
                format!("listener {} is configured twice", l.address.0),
            ));
        }
        addresses.push(l.address.0);
    }
    let mode = |l: &ListenerDoc| l.tls.as_ref().map_or(TlsMode::Off, |t| t.0);
    let mut cfg = TargetConfig::new(first.address.0);
    if mode(first) != TlsMode::Off {
        cfg.tls = Some(TargetTls {
            required: mode(first) == TlsMode::Required,
            keys: Vec::new(),
            subnqns: Vec::new(),
        });
    }
    for l in &doc.listeners[1..] {
        cfg = cfg.listener(l.address.0, mode(l));
    }
    let defaults = limits(&root, doc.max_io_queues, doc.queue_size, doc.mdts)?;
    cfg.max_io_queues = defaults.max_io_queues.unwrap_or(cfg.max_io_queues);
    cfg.queue_entries = defaults.queue_entries.unwrap_or(cfg.queue_entries);
    cfg.mdts = defaults.mdts.unwrap_or(cfg.mdts);
    if let Some(m) = &doc.send_mode {
        cfg.send_mode = m.0;
    }
    cfg.tcp_congestion.clone_from(&doc.tcp_congestion);
    if let Some(n) = doc.tls_key_update {
        let renewal = nvpoll_wire::KeyRenewal::after(n);
        renewal
            .check()
            .map_err(|why| Problem::new(root.key("tls_key_update"), format!("{n}: {why}")))?;
        cfg.tls_key_renewal = renewal;
    }
    let ctx = Ctx {
        listeners: &addresses,
        ..*ctx
    };
    for (i, s) in doc.subsystems.iter().enumerate() {
        let at = root.key("subsystems").index(i);
        if cfg.subsystems.iter().any(|t| t.nqn == s.nqn) {
            return Err(Problem::new(
                at.key("nqn"),
                format!("subsystem {} is configured twice", s.nqn),
            ));
        }
        cfg.subsystems.push(subsystem(s, &at, &ctx)?);
    }
    Ok(cfg)
}

/// The things `list` (the field at `at`) names, each as `from_name` reads it; an empty list is refused
/// (`none` says what it lacks), as leaving the field out is how to allow all.
fn named<T, E: std::fmt::Display>(
    at: &FieldPath,
    list: &[String],
    from_name: fn(&str) -> Result<T, E>,
    none: &str,
) -> Result<Vec<T>, Problem> {
    let mut out = Vec::with_capacity(list.len());
    for (i, n) in list.iter().enumerate() {
        out.push(from_name(n).map_err(|e| Problem::new(at.index(i), e.to_string()))?);
    }
    if out.is_empty() {
        return Err(Problem::new(
            at.clone(),
            format!("{none}: leave the field out to allow all"),
        ));
    }
    Ok(out)
}

fn check_text(at: FieldPath, what: &str, s: &str, max: usize) -> Result<(), Problem> {
    if s.is_empty() || s.len() > max || !s.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return Err(Problem::new(
            at,
            format!("{what} {s:?}: must be 1 to {max} printable ASCII characters"),
        ));
    }
    Ok(())
}

fn subsystem(
    doc: &SubsystemDoc,
    at: &FieldPath,
    ctx: &Ctx<'_>,
) -> Result<SubsystemConfig, Problem> {
    check_nqn(&doc.nqn).map_err(|e| Problem::because(at.key("nqn"), e))?;
    if doc.nqn == DISCOVERY_NQN {
        return Err(Problem::new(
            at.key("nqn"),
            "the discovery subsystem is always served; it cannot be configured",
        ));
    }
    let mut cfg = SubsystemConfig::new(doc.nqn.clone());
    if let Some(serial) = &doc.serial {
        check_text(at.key("serial"), "serial number", serial, 20)?;
        cfg.serial = serial.clone();
    }
    if let Some(model) = &doc.model {
        check_text(at.key("model"), "model number", model, 40)?;
        cfg.model = model.clone();
    }
    let mut hosts: Vec<String> = Vec::new();
    for (i, h) in doc.hosts.iter().enumerate() {
        let hat = at.key("hosts").index(i);
        check_nqn(&h.nqn).map_err(|e| Problem::because(hat.key("nqn"), e))?;
        if hosts.contains(&h.nqn) {
            return Err(Problem::new(
                hat.key("nqn"),
                format!("host {} is listed twice", h.nqn),
            ));
        }
        hosts.push(h.nqn.clone());
        if let Some(p) = &h.psk_file {
            let key = read_key_file(&ctx.resolve(p))
                .map_err(|e| Problem::because(hat.key("psk_file"), e))?;
            cfg.host_keys.push(HostKey {
                hostnqn: h.nqn.clone(),
                key,
            });
        }
        let secret = |field: &str, v: &str| {
            nvpoll_wire::dhchap::Secret::parse(v)
                .map_err(|e| Problem::new(hat.key(field), e.to_string()))
        };
        match (&h.dhchap_key, &h.dhchap_ctrl_key) {
            (Some(k), c) => {
                let key = secret("dhchap_key", k)?;
                let ctrl_key = c
                    .as_deref()
                    .map(|c| secret("dhchap_ctrl_key", c))
                    .transpose()?;
                cfg.dhchap_keys.push(crate::subsystem::DhchapKey {
                    hostnqn: h.nqn.clone(),
                    key,
                    ctrl_key,
                    concat: h.dhchap_concat,
                });
            }
            (None, Some(_)) => {
                return Err(Problem::new(
                    hat.key("dhchap_ctrl_key"),
                    "a controller key needs the host's dhchap_key too",
                ))
            }
            (None, None) => {}
        }
    }
    if let Some(list) = &doc.dhchap_hashes {
        let at = at.key("dhchap_hashes");
        cfg.dhchap.hashes = named(&at, list, nvpoll_wire::dhchap::Hash::from_name, "no hash")?;
    }
    if let Some(list) = &doc.dhchap_dhgroups {
        let at = at.key("dhchap_dhgroups");
        cfg.dhchap.groups = named(
            &at,
            list,
            nvpoll_wire::dhchap::DhGroup::from_name,
            "no group",
        )?;
    }
    cfg.hosts = if doc.allow_any_host {
        HostAccess::AnyHost
    } else {
        HostAccess::Only(hosts)
    };
    if let Some(list) = &doc.listeners {
        let mut named = Vec::new();
        for (i, a) in list.iter().enumerate() {
            let lat = at.key("listeners").index(i);
            if a.0.port() == 0 {
                return Err(Problem::new(
                    lat,
                    format!(
                        "{}: a listener on port 0 gets its port when it opens; name a fixed port",
                        a.0
                    ),
                ));
            }
            if !ctx.listeners.contains(&a.0) {
                let known: Vec<String> = ctx.listeners.iter().map(|l| l.to_string()).collect();
                return Err(Problem::new(
                    lat,
                    format!(
                        "{} is not a listener of the target (they are: {})",
                        a.0,
                        known.join(", ")
                    ),
                ));
            }
            if named.contains(&a.0) {
                return Err(Problem::new(lat, format!("{} is named twice", a.0)));
            }
            named.push(a.0);
        }
        cfg.listeners = Some(named);
    }
    cfg.limits = limits(at, doc.max_io_queues, doc.queue_size, doc.mdts)?;
    let defaults = crate::subsystem::CntlidRange::default();
    cfg.cntlids = crate::subsystem::CntlidRange {
        min: doc.cntlid_min.unwrap_or(defaults.min),
        max: doc.cntlid_max.unwrap_or(defaults.max),
    };
    if let Err(e) = cfg.cntlids.check() {
        let field = if doc.cntlid_min.is_some() {
            "cntlid_min"
        } else {
            "cntlid_max"
        };
        return Err(Problem::because(at.key(field), e));
    }
    for (i, a) in doc.ana.iter().enumerate() {
        let aat = at.key("ana").index(i);
        let exported = cfg.listeners.as_ref().map_or_else(
            || ctx.listeners.contains(&a.listener.0),
            |l| l.contains(&a.listener.0),
        );
        if !exported {
            return Err(Problem::new(
                aat.key("listener"),
                format!("{} is not a listener of this subsystem", a.listener.0),
            ));
        }
        let group = a.group.unwrap_or(1);
        crate::subsystem::check_ana_group(group)
            .map_err(|e| Problem::because(aat.key("group"), e))?;
        if cfg
            .ana
            .iter()
            .any(|b| b.listener == a.listener.0 && b.group == group)
        {
            return Err(Problem::new(
                aat.clone(),
                format!("group {group} on {} is set twice", a.listener.0),
            ));
        }
        cfg.ana.push(crate::subsystem::AnaSetting {
            listener: a.listener.0,
            group,
            state: a.state.0,
        });
    }
    for (i, n) in doc.namespaces.iter().enumerate() {
        let nat = at.key("namespaces").index(i);
        let ns = namespace(n, &nat, ctx)?;
        if ns.nsid.is_some() && cfg.namespaces.iter().any(|m| m.nsid == ns.nsid) {
            return Err(Problem::new(
                nat.key("nsid"),
                format!("namespace ID {} is used twice", ns.nsid.unwrap_or(0)),
            ));
        }
        cfg.namespaces.push(ns);
    }
    Ok(cfg)
}

fn namespace(
    doc: &NamespaceDoc,
    at: &FieldPath,
    ctx: &Ctx<'_>,
) -> Result<NamespaceConfig, Problem> {
    let given: Vec<&str> = [
        ("ram", doc.ram.is_some()),
        ("file", doc.file.is_some()),
        ("pcie", doc.pcie.is_some()),
    ]
    .into_iter()
    .filter_map(|(name, set)| set.then_some(name))
    .collect();
    match given[..] {
        [] => {
            return Err(Problem::new(
                at.clone(),
                "a namespace needs one of ram, file or pcie",
            ))
        }
        [_] => {}
        [first, second, ..] => {
            return Err(Problem::new(
                at.key(second),
                format!("a namespace has one of ram, file or pcie; this one has {first} already"),
            ))
        }
    }
    if let Some(nsid) = doc.nsid {
        if !(1..=MAX_NAMESPACES).contains(&nsid) {
            return Err(Problem::new(
                at.key("nsid"),
                format!("namespace ID {nsid}: must be 1 to {MAX_NAMESPACES}"),
            ));
        }
    }
    if let Some(bs) = doc.block_size {
        if bs != 512 && bs != 4096 {
            return Err(Problem::new(
                at.key("block_size"),
                format!("block size {bs}: must be 512 or 4096"),
            ));
        }
    }
    let (backing, block_size) = if let Some(Size(bytes)) = doc.ram {
        let bs = doc.block_size.unwrap_or(512);
        if bytes % u64::from(bs) != 0 {
            return Err(Problem::new(
                at.key("ram"),
                format!("{bytes} bytes is not a multiple of the {bs}-byte block size"),
            ));
        }
        (Backing::Ram(bytes), bs)
    } else if let Some(file) = &doc.file {
        let path = ctx.resolve(file);
        match std::fs::metadata(&path) {
            Ok(m) if m.is_dir() => {
                return Err(Problem::new(
                    at.key("file"),
                    format!("{} is a folder", path.display()),
                ))
            }
            Ok(_) => {}
            Err(e) => {
                return Err(Problem::new(
                    at.key("file"),
                    format!("{}: {e}", path.display()),
                ))
            }
        }
        (Backing::File(path), doc.block_size.unwrap_or(512))
    } else {
        let bdf = doc.pcie.as_deref().unwrap_or_default();
        let backing = (ctx.pcie)(bdf).map_err(|e| Problem::because(at.key("pcie"), e))?;
        let native = match &backing {
            Backing::Device(d) => d.block_size(),
            _ => 512,
        };
        if doc.block_size.is_some_and(|bs| bs != native) {
            return Err(Problem::new(
                at.key("block_size"),
                format!("{bdf} has {native}-byte blocks; leave block_size out or make it {native}"),
            ));
        }
        (backing, native)
    };
    let ana_group = doc.ana_group.unwrap_or(1);
    crate::subsystem::check_ana_group(ana_group)
        .map_err(|e| Problem::because(at.key("ana_group"), e))?;
    let uuid = match &doc.uuid {
        None => None,
        Some(s) => Some(parse_uuid(s).ok_or_else(|| {
            Problem::new(
                at.key("uuid"),
                format!("{s:?} is not a UUID (32 hex digits, with or without dashes in the 8-4-4-4-12 form)"),
            )
        })?),
    };
    Ok(NamespaceConfig {
        backing,
        block_size,
        nsid: doc.nsid,
        ana_group,
        uuid,
    })
}

/// A UUID as text: 8-4-4-4-12 hex digits, or 32 without dashes.
fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let groups: Vec<&str> = s.split('-').collect();
    let dashed_ok = groups.len() == 1
        || (groups.len() == 5 && groups.iter().map(|g| g.len()).eq([8, 4, 4, 4, 12]));
    let hex: String = groups.concat();
    if !dashed_ok || hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

// ---- Finding a field's line ----

/// The line (from 1) of byte `offset`.
fn line_of(text: &str, offset: usize) -> usize {
    1 + text.as_bytes()[..offset.min(text.len())]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
}

/// The byte offset in `text` (JSON that parsed) of the field at `path`: of its key for a member, of the value
/// for an element; of the deepest part of the path found if the rest is not there.
fn locate(text: &str, path: &[Seg]) -> usize {
    let mut scan = Scan {
        b: text.as_bytes(),
        i: 0,
    };
    let mut best = 0;
    scan.find(path, &mut best);
    best
}

/// A cursor over JSON text that is known to be valid.
struct Scan<'a> {
    b: &'a [u8],
    i: usize,
}

impl Scan<'_> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }

    /// At a value: goes past it.
    fn skip_value(&mut self) {
        self.ws();
        match self.peek() {
            Some(b'"') => self.skip_string(),
            Some(open @ (b'{' | b'[')) => {
                let close = if open == b'{' { b'}' } else { b']' };
                self.i += 1;
                loop {
                    self.ws();
                    match self.peek() {
                        None => return,
                        Some(c) if c == close => {
                            self.i += 1;
                            return;
                        }
                        Some(b',' | b':') => self.i += 1,
                        Some(_) => self.skip_value(),
                    }
                }
            }
            Some(_) => {
                while !matches!(
                    self.peek(),
                    None | Some(b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r')
                ) {
                    self.i += 1;
                }
            }
            None => {}
        }
    }

    /// At a `"`: goes past the string.
    fn skip_string(&mut self) {
        self.i += 1;
        while let Some(c) = self.peek() {
            self.i += 1;
            match c {
                b'\\' => self.i += 1,
                b'"' => return,
                _ => {}
            }
        }
    }

    /// At a `"`: the decoded string, and goes past it.
    fn string(&mut self) -> String {
        let start = self.i;
        self.skip_string();
        let raw = &self.b[start..self.i.min(self.b.len())];
        serde_json::from_slice(raw).unwrap_or_default()
    }

    fn find(&mut self, path: &[Seg], best: &mut usize) {
        self.ws();
        *best = (*best).max(self.i);
        let Some(seg) = path.first() else {
            return;
        };
        match (seg, self.peek()) {
            (Seg::Key(want), Some(b'{')) => {
                self.i += 1;
                loop {
                    self.ws();
                    match self.peek() {
                        Some(b'"') => {}
                        Some(b',') => {
                            self.i += 1;
                            continue;
                        }
                        _ => return,
                    }
                    let key_at = self.i;
                    let key = self.string();
                    self.ws();
                    if self.peek() == Some(b':') {
                        self.i += 1;
                    }
                    if key == *want {
                        *best = key_at;
                        if path.len() > 1 {
                            self.find(&path[1..], best);
                        }
                        return;
                    }
                    self.skip_value();
                }
            }
            (Seg::Index(want), Some(b'[')) => {
                self.i += 1;
                let mut n = 0;
                loop {
                    self.ws();
                    match self.peek() {
                        None | Some(b']') => return,
                        Some(b',') => {
                            self.i += 1;
                            n += 1;
                            continue;
                        }
                        _ => {}
                    }
                    if n == *want {
                        self.find(&path[1..], best);
                        return;
                    }
                    self.skip_value();
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(path: &[Seg]) -> usize {
        let text = "{\n \"a\": [1, {\"b\": \"x\\\"}\"},\n  {\"c\": 2,\n   \"d\": [true, null]}],\n \"e\": {}\n}";
        line_of(text, locate(text, path))
    }

    #[test]
    fn fields_are_found_on_their_line() {
        let k = |s: &str| Seg::Key(s.into());
        assert_eq!(at(&[k("a")]), 2);
        assert_eq!(at(&[k("a"), Seg::Index(1), k("b")]), 2);
        assert_eq!(at(&[k("a"), Seg::Index(2)]), 3);
        assert_eq!(at(&[k("a"), Seg::Index(2), k("d"), Seg::Index(1)]), 4);
        assert_eq!(at(&[k("e")]), 5);
        // What is not there: the deepest part that is.
        assert_eq!(at(&[k("a"), Seg::Index(2), k("zz")]), 3);
    }

    #[test]
    fn nqns_need_the_dated_form() {
        assert!(check_nqn("nqn.2024-01.io.nvpoll:a").is_ok());
        assert!(check_nqn("nqn.2014-08.org.nvmexpress:uuid:0-1").is_ok());
        for bad in [
            "",
            "nqn.",
            "io.nvpoll:a",
            "nqn.24-01.io:a",
            "nqn.2024-01.io nvpoll",
        ] {
            assert!(check_nqn(bad).is_err(), "{bad:?}");
        }
        assert!(check_nqn(&format!("nqn.2024-01.{}", "x".repeat(220))).is_err());
    }
}

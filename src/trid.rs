//! Transport IDs: SPDK-style strings that name an NVMe controller, and the host's default identity.
//!
//! A transport ID is a whitespace-separated list of `key:value` (or `key=value`) pairs:
//!
//! ```text
//! trtype:tcp adrfam:IPv4 traddr:127.0.0.1 trsvcid:4420 subnqn:nqn.2014-08.org.nvmexpress.discovery
//! trtype:tcp adrfam:IPv6 traddr:::1 subnqn:nqn.2024-01.io.example:ssd hostnqn:nqn.2014-08.org.nvmexpress:uuid:...
//! trtype:pcie traddr:0000:00:04.0
//! ```
//!
//! Keys are case-insensitive, and so are the values of `trtype` and `adrfam`; other values are taken as written.
//! A pair splits at its first `:` or `=`, so addresses may contain colons. For TCP, `traddr` is an IP address
//! (`adrfam` defaults to the address's family and must match it if given), `trsvcid` defaults to 4420, and
//! `subnqn` and `hostnqn` are optional. For PCIe, `traddr` is the device's `[domain:]bus:device.function`.
//!
//! ```
//! use nvpoll::trid::TransportId;
//!
//! let t: TransportId = "trtype:TCP traddr:127.0.0.1".parse().unwrap();
//! assert_eq!(t.to_string(), "trtype:tcp adrfam:IPv4 traddr:127.0.0.1 trsvcid:4420");
//! let err = "trtype:tcp traddr:localhost".parse::<TransportId>().unwrap_err();
//! assert!(err.to_string().contains("traddr"));
//! ```

use std::fmt;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::str::FromStr;
use std::sync::OnceLock;

/// The NVMe/TCP port used when a transport ID gives no `trsvcid` (the IANA port for NVMe/TCP I/O).
pub const DEFAULT_TCP_PORT: u16 = 4420;
/// The longest NQN the specification allows, in bytes.
pub use nvpoll_spec::fabrics::MAX_NQN_LEN;

/// A parsed transport ID.
///
/// # Examples
///
/// ```
/// use nvpoll::trid::{PciAddress, TransportId};
///
/// let tcp: TransportId = "trtype:tcp traddr:192.0.2.7 trsvcid:4421 subnqn:nqn.2024-01.io.example:ssd".parse()?;
/// assert_eq!(tcp.trtype(), "tcp");
/// assert_eq!(tcp.subnqn(), Some("nqn.2024-01.io.example:ssd"));
/// assert_eq!(tcp.hostnqn(), None, "the connection presents default_hostnqn()");
/// let TransportId::Tcp { addr, .. } = &tcp else { unreachable!() };
/// assert_eq!(addr.to_string(), "192.0.2.7:4421");
///
/// let pcie: TransportId = "trtype:PCIe traddr:0000:00:04.0".parse()?;
/// assert_eq!(pcie.trtype(), "pcie");
/// assert_eq!(pcie, TransportId::Pcie { bdf: PciAddress { domain: 0, bus: 0, device: 4, function: 0 } });
/// assert_eq!(pcie.subnqn(), None);
/// assert_eq!(pcie.to_string().parse::<TransportId>()?, pcie, "Display gives back what parses");
/// # Ok::<(), nvpoll::trid::TridError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum TransportId {
    /// NVMe over TCP.
    Tcp {
        /// Target address and port.
        addr: SocketAddr,
        /// Subsystem NQN to connect to; `None` leaves the choice to the caller (e.g. the discovery NQN).
        subnqn: Option<String>,
        /// Host NQN to present; `None` for [`default_hostnqn`].
        hostnqn: Option<String>,
    },
    /// A local PCIe controller.
    Pcie {
        /// The controller's PCI address.
        bdf: PciAddress,
    },
}

impl TransportId {
    /// The transport's name as `trtype` spells it: "tcp" or "pcie". See [`TransportId`]'s example.
    pub fn trtype(&self) -> &'static str {
        match self {
            TransportId::Tcp { .. } => "tcp",
            TransportId::Pcie { .. } => "pcie",
        }
    }

    /// The subsystem NQN, if the transport ID names one. See [`TransportId`]'s example.
    pub fn subnqn(&self) -> Option<&str> {
        match self {
            TransportId::Tcp { subnqn, .. } => subnqn.as_deref(),
            TransportId::Pcie { .. } => None,
        }
    }

    /// The host NQN, if the transport ID names one.
    ///
    /// # Examples
    ///
    /// ```
    /// use nvpoll::trid::TransportId;
    ///
    /// let t: TransportId = "trtype:tcp traddr:::1 hostnqn:nqn.2024-01.io.example:host-a".parse()?;
    /// assert_eq!(t.hostnqn(), Some("nqn.2024-01.io.example:host-a"));
    /// # Ok::<(), nvpoll::trid::TridError>(())
    /// ```
    pub fn hostnqn(&self) -> Option<&str> {
        match self {
            TransportId::Tcp { hostnqn, .. } => hostnqn.as_deref(),
            TransportId::Pcie { .. } => None,
        }
    }
}

/// Why a transport ID (or a PCI address) could not be parsed. Each variant names the key at fault.
///
/// # Examples
///
/// ```
/// use nvpoll::trid::{TransportId, TridError};
///
/// let parse = |s: &str| s.parse::<TransportId>().unwrap_err();
/// assert_eq!(parse("trtype:tcp"), TridError::MissingKey("traddr"));
/// assert_eq!(parse("trtype:tcp traddr:10.0.0.1 color:blue"), TridError::UnknownKey("color".into()));
/// assert!(matches!(parse("trtype:tcp traddr:10.0.0.1 trsvcid:x"), TridError::BadValue { key: "trsvcid", .. }));
/// assert!(matches!(parse("trtype:pcie traddr:0000:00:04.0 subnqn:nqn.x"), TridError::NotApplicable { .. }));
/// ```
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TridError {
    /// A word is not of the form `key:value` or `key=value`.
    #[error("transport ID: `{0}` is not a key:value pair")]
    NotKeyValue(String),
    /// A key this parser does not know.
    #[error(
        "transport ID: unknown key `{0}` (known: trtype, adrfam, traddr, trsvcid, subnqn, hostnqn)"
    )]
    UnknownKey(String),
    /// A key given twice.
    #[error("transport ID: `{0}` is given more than once")]
    DuplicateKey(&'static str),
    /// A key the transport needs is missing.
    #[error("transport ID: `{0}` is missing")]
    MissingKey(&'static str),
    /// A value is malformed or unsupported.
    #[error("transport ID: bad {key} `{value}`: {reason}")]
    BadValue {
        /// The key.
        key: &'static str,
        /// The value as given.
        value: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A key that means nothing for this transport.
    #[error("transport ID: `{key}` does not apply to trtype {trtype}")]
    NotApplicable {
        /// The key.
        key: &'static str,
        /// The transport.
        trtype: &'static str,
    },
}

const KEYS: [&str; 6] = ["trtype", "adrfam", "traddr", "trsvcid", "subnqn", "hostnqn"];

/// The values of a transport ID string, by key, before they are interpreted.
#[derive(Default)]
struct Pairs<'a> {
    values: [Option<&'a str>; KEYS.len()],
}

impl<'a> Pairs<'a> {
    fn parse(s: &'a str) -> Result<Pairs<'a>, TridError> {
        let mut pairs = Pairs::default();
        for word in s.split_ascii_whitespace() {
            let (key, value) = word
                .split_once([':', '='])
                .filter(|(k, v)| !k.is_empty() && !v.is_empty())
                .ok_or_else(|| TridError::NotKeyValue(word.to_string()))?;
            let index = KEYS
                .iter()
                .position(|k| k.eq_ignore_ascii_case(key))
                .ok_or_else(|| TridError::UnknownKey(key.to_string()))?;
            if pairs.values[index].replace(value).is_some() {
                return Err(TridError::DuplicateKey(KEYS[index]));
            }
        }
        Ok(pairs)
    }

    fn get(&self, key: &'static str) -> Option<&'a str> {
        KEYS.iter()
            .position(|k| *k == key)
            .and_then(|i| self.values[i])
    }

    fn require(&self, key: &'static str) -> Result<&'a str, TridError> {
        self.get(key).ok_or(TridError::MissingKey(key))
    }

    fn nqn(&self, key: &'static str) -> Result<Option<String>, TridError> {
        match self.get(key) {
            Some(v) if v.len() > MAX_NQN_LEN => Err(TridError::BadValue {
                key,
                value: v.to_string(),
                reason: "longer than 223 bytes",
            }),
            v => Ok(v.map(str::to_string)),
        }
    }
}

fn bad(key: &'static str, value: &str, reason: &'static str) -> TridError {
    TridError::BadValue {
        key,
        value: value.to_string(),
        reason,
    }
}

impl FromStr for TransportId {
    type Err = TridError;

    fn from_str(s: &str) -> Result<TransportId, TridError> {
        let pairs = Pairs::parse(s)?;
        let trtype = pairs.require("trtype")?;
        if trtype.eq_ignore_ascii_case("tcp") {
            parse_tcp(&pairs)
        } else if trtype.eq_ignore_ascii_case("pcie") {
            for key in ["adrfam", "trsvcid", "subnqn", "hostnqn"] {
                if pairs.get(key).is_some() {
                    return Err(TridError::NotApplicable {
                        key,
                        trtype: "pcie",
                    });
                }
            }
            let traddr = pairs.require("traddr")?;
            let bdf = traddr.parse().map_err(|_| {
                bad(
                    "traddr",
                    traddr,
                    "expected a PCI address [domain:]bus:device.function",
                )
            })?;
            Ok(TransportId::Pcie { bdf })
        } else {
            Err(bad(
                "trtype",
                trtype,
                "supported transports are tcp and pcie",
            ))
        }
    }
}

fn parse_tcp(pairs: &Pairs<'_>) -> Result<TransportId, TridError> {
    let traddr = pairs.require("traddr")?;
    let literal = traddr
        .strip_prefix('[')
        .and_then(|a| a.strip_suffix(']'))
        .unwrap_or(traddr);
    let ip: IpAddr = literal
        .parse()
        .map_err(|_| bad("traddr", traddr, "expected an IPv4 or IPv6 address"))?;
    if let Some(adrfam) = pairs.get("adrfam") {
        let want_v6 = if adrfam.eq_ignore_ascii_case("ipv4") {
            false
        } else if adrfam.eq_ignore_ascii_case("ipv6") {
            true
        } else {
            return Err(bad("adrfam", adrfam, "expected IPv4 or IPv6"));
        };
        if ip.is_ipv6() != want_v6 {
            return Err(bad(
                "traddr",
                traddr,
                "the address is not of the family adrfam names",
            ));
        }
    }
    let port = match pairs.get("trsvcid") {
        None => DEFAULT_TCP_PORT,
        Some(v) => v
            .parse()
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| bad("trsvcid", v, "expected a TCP port, 1 to 65535"))?,
    };
    Ok(TransportId::Tcp {
        addr: SocketAddr::new(ip, port),
        subnqn: pairs.nqn("subnqn")?,
        hostnqn: pairs.nqn("hostnqn")?,
    })
}

/// Formats in the canonical form, which parses back to the same value: lower-case `trtype`, `adrfam` as
/// `IPv4`/`IPv6`, `traddr` without brackets, and `trsvcid` always present for TCP.
impl fmt::Display for TransportId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TransportId::Tcp {
                addr,
                subnqn,
                hostnqn,
            } => {
                let adrfam = if addr.is_ipv6() { "IPv6" } else { "IPv4" };
                write!(
                    f,
                    "trtype:tcp adrfam:{adrfam} traddr:{} trsvcid:{}",
                    addr.ip(),
                    addr.port()
                )?;
                if let Some(n) = subnqn {
                    write!(f, " subnqn:{n}")?;
                }
                if let Some(n) = hostnqn {
                    write!(f, " hostnqn:{n}")?;
                }
                Ok(())
            }
            TransportId::Pcie { bdf } => write!(f, "trtype:pcie traddr:{bdf}"),
        }
    }
}

/// A PCI address: domain, bus, device and function.
///
/// # Examples
///
/// ```
/// use nvpoll::trid::PciAddress;
///
/// let a: PciAddress = "0000:3b:00.1".parse()?;
/// assert_eq!((a.domain, a.bus, a.device, a.function), (0, 0x3b, 0, 1));
/// assert_eq!(a.to_string(), "0000:3b:00.1");
/// assert_eq!("3b:00.1".parse::<PciAddress>()?, a, "the domain defaults to 0");
/// # Ok::<(), nvpoll::trid::PciAddressError>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PciAddress {
    /// PCI domain (segment).
    pub domain: u32,
    /// Bus number.
    pub bus: u8,
    /// Device number, 0 to 31.
    pub device: u8,
    /// Function number, 0 to 7.
    pub function: u8,
}

/// A string that is not a PCI address.
///
/// # Examples
///
/// ```
/// use nvpoll::trid::{PciAddress, PciAddressError};
///
/// let err = "00:40.0".parse::<PciAddress>().unwrap_err(); // device 0x40 is past 31
/// assert_eq!(err, PciAddressError("00:40.0".into()));
/// ```
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("bad PCI address `{0}`: expected [domain:]bus:device.function in hex, e.g. 0000:00:04.0")]
pub struct PciAddressError(pub String);

/// Parses `dddd:bb:dd.f` or the short form `bb:dd.f` (domain 0), in hexadecimal.
impl FromStr for PciAddress {
    type Err = PciAddressError;

    fn from_str(s: &str) -> Result<PciAddress, PciAddressError> {
        let err = || PciAddressError(s.to_string());
        let hex = |part: &str, max_digits: usize| {
            let ok = !part.is_empty()
                && part.len() <= max_digits
                && part.bytes().all(|b| b.is_ascii_hexdigit());
            ok.then(|| u32::from_str_radix(part, 16).ok()).flatten()
        };
        let (rest, function) = s.rsplit_once('.').ok_or_else(err)?;
        let mut parts = rest.rsplit(':');
        let device = parts
            .next()
            .and_then(|p| hex(p, 2))
            .filter(|d| *d < 32)
            .ok_or_else(err)?;
        let bus = parts.next().and_then(|p| hex(p, 2)).ok_or_else(err)?;
        let domain = match parts.next() {
            None => 0,
            Some(p) => hex(p, 8).ok_or_else(err)?,
        };
        let function = hex(function, 1).filter(|f| *f < 8).ok_or_else(err)?;
        if parts.next().is_some() {
            return Err(err());
        }
        // The checks above bound every value to its field.
        Ok(PciAddress {
            domain,
            bus: bus as u8,
            device: device as u8,
            function: function as u8,
        })
    }
}

/// Formats as `dddd:bb:dd.f`, as sysfs names devices.
impl fmt::Display for PciAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

const HOSTNQN_PATH: &str = "/etc/nvme/hostnqn";
const HOSTID_PATH: &str = "/etc/nvme/hostid";
const RANDOM_UUID_PATH: &str = "/proc/sys/kernel/random/uuid";

/// The host NQN this machine uses: the contents of `/etc/nvme/hostnqn` (as nvme-cli keeps it) when that file
/// holds one, else `nqn.2014-08.org.nvmexpress:uuid:<uuid>` with a random UUID from the kernel, generated once
/// per process so that every connection presents the same NQN.
///
/// # Examples
///
/// ```
/// use nvpoll::trid::default_hostnqn;
///
/// let nqn = default_hostnqn()?;
/// assert!(nqn.starts_with("nqn."));
/// assert_eq!(default_hostnqn()?, nqn, "the same for every connection of the process");
/// # Ok::<(), std::io::Error>(())
/// ```
pub fn default_hostnqn() -> io::Result<String> {
    static GENERATED: OnceLock<String> = OnceLock::new();
    if let Some(nqn) = read_trimmed(Path::new(HOSTNQN_PATH)) {
        return Ok(nqn);
    }
    if let Some(nqn) = GENERATED.get() {
        return Ok(nqn.clone());
    }
    let nqn = generated_hostnqn(Path::new(RANDOM_UUID_PATH))?;
    Ok(GENERATED.get_or_init(|| nqn).clone())
}

/// The host identifier this machine uses: the UUID in `/etc/nvme/hostid` when that file holds one, else the
/// UUID of [`default_hostnqn`] when it is of the `uuid:` form. The bytes are in the UUID's text order.
///
/// # Examples
///
/// ```no_run
/// use nvpoll::trid::default_hostid;
///
/// // Fails where /etc/nvme/hostnqn holds an NQN without a UUID and /etc/nvme/hostid is missing.
/// let id = default_hostid()?;
/// println!("host ID {id:02x?}");
/// # Ok::<(), std::io::Error>(())
/// ```
pub fn default_hostid() -> io::Result<[u8; 16]> {
    if let Some(id) = read_trimmed(Path::new(HOSTID_PATH))
        .as_deref()
        .and_then(parse_uuid)
    {
        return Ok(id);
    }
    let nqn = default_hostnqn()?;
    hostid_from_hostnqn(&nqn).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            format!("no host ID: {HOSTID_PATH} holds no UUID and the host NQN `{nqn}` has none"),
        )
    })
}

/// The UUID at the end of a host NQN of the form `nqn.2014-08.org.nvmexpress:uuid:<uuid>`.
///
/// # Examples
///
/// ```
/// use nvpoll::trid::{hostid_from_hostnqn, parse_uuid};
///
/// let nqn = "nqn.2014-08.org.nvmexpress:uuid:123e4567-e89b-12d3-a456-426614174000";
/// assert_eq!(hostid_from_hostnqn(nqn), parse_uuid("123e4567-e89b-12d3-a456-426614174000"));
/// assert_eq!(hostid_from_hostnqn("nqn.2024-01.io.example:host-a"), None);
/// ```
pub fn hostid_from_hostnqn(nqn: &str) -> Option<[u8; 16]> {
    nqn.rsplit_once(":uuid:")
        .and_then(|(_, uuid)| parse_uuid(uuid))
}

/// Parses a UUID in its text form (`8-4-4-4-12` hex digits, either case) into its 16 bytes, in text order.
///
/// # Examples
///
/// ```
/// use nvpoll::trid::parse_uuid;
///
/// let id = parse_uuid("123E4567-e89b-12d3-a456-426614174000").ok_or("not a UUID")?;
/// assert_eq!(id[..4], [0x12, 0x3e, 0x45, 0x67]);
/// assert_eq!(parse_uuid("123e4567e89b12d3a456426614174000"), None, "the dashes are needed");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let groups: Vec<&str> = s.split('-').collect();
    let lens: Vec<usize> = groups.iter().map(|g| g.len()).collect();
    if lens != [8, 4, 4, 4, 12] {
        return None;
    }
    let digits = groups.concat();
    let mut out = [0u8; 16];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(digits.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

fn read_trimmed(path: &Path) -> Option<String> {
    let s = std::fs::read_to_string(path).ok()?;
    let s = s.trim();
    (!s.is_empty()).then(|| s.to_string())
}

fn generated_hostnqn(uuid_source: &Path) -> io::Result<String> {
    let uuid = std::fs::read_to_string(uuid_source)?;
    let uuid = uuid.trim();
    if parse_uuid(uuid).is_none() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} gave `{uuid}`, not a UUID", uuid_source.display()),
        ));
    }
    Ok(format!(
        "nqn.2014-08.org.nvmexpress:uuid:{}",
        uuid.to_ascii_lowercase()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    fn tcp(s: &str) -> (SocketAddr, Option<String>, Option<String>) {
        match s.parse::<TransportId>().unwrap() {
            TransportId::Tcp {
                addr,
                subnqn,
                hostnqn,
            } => (addr, subnqn, hostnqn),
            other => panic!("not tcp: {other:?}"),
        }
    }

    #[test]
    fn tcp_forms() {
        let s = "trtype:tcp adrfam:IPv4 traddr:127.0.0.1 trsvcid:4420 subnqn:nqn.2014-08.org.nvmexpress.discovery";
        let (addr, subnqn, hostnqn) = tcp(s);
        assert_eq!(addr, SocketAddr::new(Ipv4Addr::LOCALHOST.into(), 4420));
        assert_eq!(
            subnqn.as_deref(),
            Some("nqn.2014-08.org.nvmexpress.discovery")
        );
        assert_eq!(hostnqn, None);
        assert_eq!(s.parse::<TransportId>().unwrap().to_string(), s);

        // Keys and trtype/adrfam in any case, '=' as separator, extra whitespace, default port.
        let (addr, subnqn, _) = tcp("  TRTYPE=TCP\tAdrFam:ipv6  TrAddr:fe80::1 SUBNQN:nqn.a:B ");
        assert_eq!(
            addr,
            SocketAddr::new(
                "fe80::1".parse::<Ipv6Addr>().unwrap().into(),
                DEFAULT_TCP_PORT
            )
        );
        assert_eq!(subnqn.as_deref(), Some("nqn.a:B"));

        // Brackets, an inferred family, and hostnqn.
        let t: TransportId = "trtype:tcp traddr:[::1] trsvcid:8009 hostnqn:nqn.h:x"
            .parse()
            .unwrap();
        assert_eq!(
            t.to_string(),
            "trtype:tcp adrfam:IPv6 traddr:::1 trsvcid:8009 hostnqn:nqn.h:x"
        );
        assert_eq!(t.to_string().parse::<TransportId>().unwrap(), t);
        assert_eq!(
            (t.trtype(), t.subnqn(), t.hostnqn()),
            ("tcp", None, Some("nqn.h:x"))
        );
    }

    #[test]
    fn pcie_forms() {
        let t: TransportId = "trtype:PCIe traddr:0000:00:04.0".parse().unwrap();
        let bdf = PciAddress {
            domain: 0,
            bus: 0,
            device: 4,
            function: 0,
        };
        assert_eq!(t, TransportId::Pcie { bdf });
        assert_eq!(t.to_string(), "trtype:pcie traddr:0000:00:04.0");
        assert_eq!(
            "trtype:pcie traddr:00:04.0".parse::<TransportId>().unwrap(),
            t
        );
        assert_eq!(
            "trtype:pcie traddr:0000:00:04.0 subnqn:x".parse::<TransportId>(),
            Err(TridError::NotApplicable {
                key: "subnqn",
                trtype: "pcie"
            })
        );
    }

    #[test]
    fn errors_name_the_key() {
        let err = |s: &str| s.parse::<TransportId>().unwrap_err();
        assert_eq!(err(""), TridError::MissingKey("trtype"));
        assert_eq!(err("trtype:tcp"), TridError::MissingKey("traddr"));
        assert_eq!(
            err("trtype:tcp traddr"),
            TridError::NotKeyValue("traddr".into())
        );
        assert_eq!(
            err("trtype:tcp traddr:"),
            TridError::NotKeyValue("traddr:".into())
        );
        assert_eq!(
            err("trtype:tcp foo:bar"),
            TridError::UnknownKey("foo".into())
        );
        assert_eq!(
            err("trtype:tcp TRTYPE:tcp"),
            TridError::DuplicateKey("trtype")
        );
        assert!(matches!(
            err("trtype:rdma traddr:1.2.3.4"),
            TridError::BadValue { key: "trtype", .. }
        ));
        assert!(matches!(
            err("trtype:tcp traddr:host.example"),
            TridError::BadValue { key: "traddr", .. }
        ));
        assert!(matches!(
            err("trtype:tcp adrfam:ib traddr:1.2.3.4"),
            TridError::BadValue { key: "adrfam", .. }
        ));
        assert!(matches!(
            err("trtype:tcp adrfam:ipv6 traddr:1.2.3.4"),
            TridError::BadValue { key: "traddr", .. }
        ));
        assert!(matches!(
            err("trtype:tcp traddr:1.2.3.4 trsvcid:0"),
            TridError::BadValue { key: "trsvcid", .. }
        ));
        assert!(matches!(
            err("trtype:tcp traddr:1.2.3.4 trsvcid:70000"),
            TridError::BadValue { key: "trsvcid", .. }
        ));
        let long = format!("trtype:tcp traddr:1.2.3.4 subnqn:{}", "n".repeat(224));
        assert!(matches!(
            err(&long),
            TridError::BadValue { key: "subnqn", .. }
        ));
        assert!(matches!(
            err("trtype:pcie traddr:00:20.0"),
            TridError::BadValue { key: "traddr", .. }
        ));
        assert_eq!(
            err("trtype:tcp traddr:10.0.0.1 trsvcid:http").to_string(),
            "transport ID: bad trsvcid `http`: expected a TCP port, 1 to 65535"
        );
    }

    #[test]
    fn pci_addresses() {
        let p: PciAddress = "10000:3a:1f.7".parse().unwrap();
        assert_eq!(
            p,
            PciAddress {
                domain: 0x10000,
                bus: 0x3a,
                device: 0x1f,
                function: 7
            }
        );
        assert_eq!(p.to_string(), "10000:3a:1f.7");
        assert_eq!(
            "0:1:2.3".parse::<PciAddress>().unwrap().to_string(),
            "0000:01:02.3"
        );
        for bad in [
            "",
            "00:04",
            "00:04.8",
            "00:20.0",
            "000:00:04.0.1",
            "0:0:0:04.0",
            "g0:04.0",
            "00:04.00",
            "+1:04.0",
        ] {
            assert!(bad.parse::<PciAddress>().is_err(), "{bad}");
        }
    }

    #[test]
    fn uuids_and_host_identity() {
        let u = parse_uuid("1B4E28BA-2fa1-11d2-883f-0016d3cca427").unwrap();
        assert_eq!(u[..4], [0x1b, 0x4e, 0x28, 0xba]);
        assert_eq!(u[15], 0x27);
        assert_eq!(parse_uuid("1b4e28ba2fa111d2883f0016d3cca427"), None);
        assert_eq!(parse_uuid("1b4e28ba-2fa1-11d2-883f-0016d3cca42g"), None);
        assert_eq!(parse_uuid("1b4e28ba-2fa1-11d2-883f-0016d3cca4é"), None);
        assert_eq!(
            hostid_from_hostnqn(
                "nqn.2014-08.org.nvmexpress:uuid:1b4e28ba-2fa1-11d2-883f-0016d3cca427"
            ),
            Some(u)
        );
        assert_eq!(hostid_from_hostnqn("nqn.2024-01.io.example:host"), None);

        let dir = std::env::temp_dir().join(format!("nvpoll-trid-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("uuid");
        std::fs::write(&src, "1B4E28BA-2FA1-11D2-883F-0016D3CCA427\n").unwrap();
        assert_eq!(
            generated_hostnqn(&src).unwrap(),
            "nqn.2014-08.org.nvmexpress:uuid:1b4e28ba-2fa1-11d2-883f-0016d3cca427"
        );
        std::fs::write(&src, "garbage").unwrap();
        assert_eq!(
            generated_hostnqn(&src).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
        assert!(generated_hostnqn(&dir.join("missing")).is_err());
        assert_eq!(read_trimmed(&src).as_deref(), Some("garbage"));
        std::fs::write(&src, " \n").unwrap();
        assert_eq!(read_trimmed(&src), None);
        std::fs::remove_dir_all(&dir).unwrap();

        // Whatever this machine has, the defaults agree with each other and stay the same.
        let nqn = default_hostnqn().unwrap();
        assert!(nqn.starts_with("nqn."));
        assert_eq!(default_hostnqn().unwrap(), nqn);
        if read_trimmed(Path::new(HOSTID_PATH)).is_none() {
            assert_eq!(default_hostid().ok(), hostid_from_hostnqn(&nqn));
        }
    }
}

//! fio's `filename` for this engine: a controller and a namespace in the form SPDK's fio plugin reads, so that
//! an SPDK user changes only the `ioengine` line of a job file.
//!
//! ```text
//! filename=trtype=tcp adrfam=IPv4 traddr=127.0.0.1 trsvcid=4420 subnqn=nqn.2016-06.io.spdk:cnode1 ns=1
//! filename=trtype=PCIe traddr=0000.04.00.0 ns=1
//! ```
//!
//! fio splits a `filename` list at every `:` that is not escaped, so in a job file an NQN's colons are written
//! `\:` (`subnqn=nqn.2016-06.io.spdk\:cnode1`; fio removes the backslash) and a PCI address with dots
//! (`0000.04.00.0`, as SPDK's plugin has it). The pairs are nvpoll's transport ID keys (`trtype`, `adrfam`,
//! `traddr`, `trsvcid`, `subnqn`, `hostnqn`, with `=` or `:`) and `ns`, the namespace ID (default: the
//! controller's first active namespace).

use nvpoll::trid::TransportId;

use crate::error::Error;

/// One fio file: a controller and the namespace on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileTarget {
    /// The controller.
    pub trid: TransportId,
    /// The namespace; `None`: the first active one.
    pub nsid: Option<u32>,
}

/// Reads a fio filename. The error says what is wrong and shows the form expected.
pub fn parse(name: &str) -> Result<FileTarget, Error> {
    let mut nsid = None;
    let mut words = Vec::new();
    let mut pcie = false;
    for word in name.split_ascii_whitespace() {
        let (key, value) = word.split_once(['=', ':']).unwrap_or((word, ""));
        if key.eq_ignore_ascii_case("ns") {
            if nsid.is_some() {
                return Err(Error::NsTwice { name: name.into() });
            }
            let n: u32 = value
                .parse()
                .ok()
                .filter(|&n| n != 0 && n != u32::MAX)
                .ok_or_else(|| Error::BadNsid {
                    name: name.into(),
                    value: value.into(),
                })?;
            nsid = Some(n);
            continue;
        }
        if key.eq_ignore_ascii_case("trtype") && value.eq_ignore_ascii_case("pcie") {
            pcie = true;
        }
        words.push((key, value));
    }
    let mut trid = String::new();
    for (key, value) in words {
        let value = if pcie && key.eq_ignore_ascii_case("traddr") {
            pci_address(value)
        } else {
            value.to_string()
        };
        if !trid.is_empty() {
            trid.push(' ');
        }
        trid.push_str(key);
        trid.push('=');
        trid.push_str(&value);
    }
    if trid.is_empty() {
        return Err(Error::NoController { name: name.into() });
    }
    let trid: TransportId = trid.parse().map_err(|source| Error::BadTransportId {
        name: name.into(),
        source,
    })?;
    match trid.subnqn() {
        None if matches!(trid, TransportId::Tcp { .. }) => {
            return Err(Error::NoSubnqn { name: name.into() })
        }
        None => {}
        Some(nqn) if !is_nqn(nqn) => {
            // Most likely fio cut the filename at the NQN's first unescaped colon, and the Connect would go
            // to a subsystem nobody meant.
            return Err(Error::NotAnNqn {
                name: name.into(),
                nqn: nqn.into(),
            });
        }
        Some(_) => {}
    }
    Ok(FileTarget { trid, nsid })
}

/// Whether `s` has the form of an NQN (NVMe Base 2.0, "NVM Qualified Names"): `nqn.`, a `yyyy-mm` date, `.`,
/// a reverse domain name, then `:` and a name the domain's owner picks; or the well-known discovery NQN, the
/// one NQN without a colon.
fn is_nqn(s: &str) -> bool {
    if s == nvpoll::spec::fabrics::DISCOVERY_NQN {
        return true;
    }
    let Some(rest) = s.strip_prefix("nqn.") else {
        return false;
    };
    let b = rest.as_bytes();
    let dated = b.len() > 8
        && b[..4].iter().all(u8::is_ascii_digit)
        && b[4] == b'-'
        && b[5..7].iter().all(u8::is_ascii_digit)
        && b[7] == b'.';
    dated
        && rest[8..]
            .split_once(':')
            .is_some_and(|(domain, name)| !domain.is_empty() && !name.is_empty())
}

/// A PCI address as fio lets one be written (`0000.04.00.0`, dots for colons) in the usual form.
fn pci_address(v: &str) -> String {
    if v.contains(':') || v.matches('.').count() < 2 {
        return v.to_string();
    }
    // domain.bus.device.function or bus.device.function: every dot but the last is a colon.
    let last = v.rfind('.').expect("counted above");
    let (head, tail) = v.split_at(last);
    format!("{}{tail}", head.replace('.', ":"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use nvpoll::trid::PciAddress;

    #[test]
    fn spdk_plugin_filenames_parse() {
        let t = parse(
            "trtype=tcp adrfam=IPv4 traddr=127.0.0.1 trsvcid=4420 subnqn=nqn.2016-06.io.spdk:cnode1 ns=1",
        )
        .unwrap();
        assert_eq!(t.nsid, Some(1));
        assert_eq!(t.trid.subnqn(), Some("nqn.2016-06.io.spdk:cnode1"));
        assert_eq!(
            t.trid.to_string(),
            "trtype:tcp adrfam:IPv4 traddr:127.0.0.1 trsvcid:4420 subnqn:nqn.2016-06.io.spdk:cnode1"
        );
        let p = parse("trtype=PCIe traddr=0000.04.00.0 ns=2").unwrap();
        let bdf: PciAddress = "0000:04:00.0".parse().unwrap();
        assert_eq!(p.trid, TransportId::Pcie { bdf });
        assert_eq!(p.nsid, Some(2));
        assert_eq!(
            parse("trtype=pcie traddr=04.00.0").unwrap().trid,
            TransportId::Pcie { bdf }
        );
        // nvpoll's own form works too, and ns may be left out.
        let n = parse("trtype:tcp traddr:127.0.0.1 subnqn:nqn.2024-01.io.nvpoll:x").unwrap();
        assert_eq!(n.nsid, None);
    }

    #[test]
    fn bad_filenames_say_what_is_wrong() {
        let e = parse("/dev/nvme0n1").unwrap_err().to_string();
        assert!(e.contains("expected e.g."), "{e}");
        let e = parse("trtype=tcp traddr=127.0.0.1 ns=1")
            .unwrap_err()
            .to_string();
        assert!(e.contains("subnqn is missing"), "{e}");
        let e = parse("trtype=tcp traddr=127.0.0.1 subnqn=x ns=0")
            .unwrap_err()
            .to_string();
        assert!(e.contains("ns=0"), "{e}");
        let e = parse("trtype=tcp traddr=127.0.0.1 subnqn=x ns=1 ns=2")
            .unwrap_err()
            .to_string();
        assert!(e.contains("twice"), "{e}");
        let e = parse("trtype=tcp traddr=localhost subnqn=x")
            .unwrap_err()
            .to_string();
        assert!(e.contains("traddr"), "{e}");
        let e = parse("").unwrap_err().to_string();
        assert!(e.contains("names no controller"), "{e}");
        // What fio hands over when a job file leaves an NQN's colon unescaped: the part before it.
        let e = parse(
            "trtype=tcp adrfam=IPv4 traddr=127.0.0.1 trsvcid=4420 subnqn=nqn.2016-06.io.spdk",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("'nqn.2016-06.io.spdk' is not an NQN")
                && e.contains("fio splits filenames at every ':'")
                && e.contains("subnqn=nqn.2016-06.io.spdk\\:name"),
            "{e}"
        );
        // The discovery NQN has no colon and is one.
        parse("trtype=tcp traddr=127.0.0.1 subnqn=nqn.2014-08.org.nvmexpress.discovery").unwrap();
    }

    #[test]
    fn nqn_forms() {
        for ok in [
            "nqn.2016-06.io.spdk:cnode1",
            "nqn.2014-08.org.nvmexpress:uuid:f81d4fae-7dec-11d0-a765-00a0c91e6bf6",
            "nqn.2014-08.org.nvmexpress.discovery",
        ] {
            assert!(is_nqn(ok), "{ok}");
        }
        for bad in [
            "nqn.2016-06.io.spdk",
            "nqn.x",
            "cnode1",
            "nqn.2016-06.io.spdk:",
            "nqn.2016-6.io.spdk:x",
            "nqn.2016-06.:x",
        ] {
            assert!(!is_nqn(bad), "{bad}");
        }
    }
}

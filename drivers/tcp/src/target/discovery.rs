//! The discovery log page: one entry per NVM subsystem, at the address the host reached us on.
#![forbid(unsafe_code)]

use std::net::SocketAddr;

use nvpoll::spec::{DiscoveryLog, DiscoveryLogEntry};

use super::subsystem::Kind;
use super::TargetShared;

/// Port ID of our one listener.
const PORT_ID: u16 = 1;
/// Admin queue size hosts should ask for (as Linux's target announces).
const ASQSZ: u16 = 32;

/// The log page as the discovery controller reached at `local` reports it to `hostnqn`: only the subsystems
/// that host may connect to. The generation counter never moves: the subsystems do not change while the
/// target runs.
pub(crate) fn log_page(target: &TargetShared, local: SocketAddr, hostnqn: &str) -> Vec<u8> {
    // A listener on the unspecified address is reachable at whatever address this host used.
    let addr = if target.listen.ip().is_unspecified() {
        local
    } else {
        target.listen
    };
    let adrfam = if addr.is_ipv4() {
        DiscoveryLogEntry::ADRFAM_IPV4
    } else {
        DiscoveryLogEntry::ADRFAM_IPV6
    };
    // treq bits 1:0 say whether a secure channel is required; tsas.tcp.sectype names TLS 1.3 when we offer it.
    let (secure, sectype) = match &target.tls {
        Some(t) if t.required => (
            DiscoveryLogEntry::TREQ_SECURE_REQUIRED,
            DiscoveryLogEntry::TCP_SECTYPE_TLS13,
        ),
        Some(_) => (
            DiscoveryLogEntry::TREQ_SECURE_NOT_REQUIRED,
            DiscoveryLogEntry::TCP_SECTYPE_TLS13,
        ),
        None => (
            DiscoveryLogEntry::TREQ_SECURE_NOT_SPECIFIED,
            DiscoveryLogEntry::TCP_SECTYPE_NONE,
        ),
    };
    let entries = target
        .subsystems
        .iter()
        .filter(|s| s.kind == Kind::Nvm && s.hosts.allows(hostnqn))
        .map(|s| DiscoveryLogEntry {
            trtype: DiscoveryLogEntry::TRTYPE_TCP,
            adrfam,
            subtype: DiscoveryLogEntry::SUBTYPE_NVME,
            // Hosts may disable SQ flow control (we support it).
            treq: secure | DiscoveryLogEntry::TREQ_DISABLE_SQFLOW,
            portid: PORT_ID,
            cntlid: nvpoll::spec::fabrics::CNTLID_DYNAMIC,
            asqsz: ASQSZ,
            eflags: 0,
            trsvcid: addr.port().to_string(),
            traddr: addr.ip().to_string(),
            tsas: vec![sectype],
            subnqn: s.nqn.clone(),
        })
        .collect();
    DiscoveryLog {
        genctr: 1,
        recfmt: 0,
        entries,
    }
    .to_bytes()
}

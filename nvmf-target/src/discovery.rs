//! The discovery log page: one entry per NVM subsystem the host may use on the listener it reached us on.

use std::net::SocketAddr;

use nvpoll::spec::{DiscoveryLog, DiscoveryLogEntry};

use crate::options::TlsMode;
use crate::shared::{Listener, TargetShared};
use crate::subsystem::Kind;

/// Admin queue size hosts should ask for (as Linux's target announces).
const ASQSZ: u16 = 32;

/// The log page as the discovery controller reached through `listener` (at `local`) reports it to
/// `hostnqn`: the subsystems exported on that listener that the host may connect to.
pub(crate) fn log_page(
    target: &TargetShared,
    listener: &Listener,
    local: SocketAddr,
    hostnqn: &str,
) -> Vec<u8> {
    // A listener on the unspecified address is reachable at whatever address this host used.
    let addr = if listener.addr.ip().is_unspecified() {
        local
    } else {
        listener.addr
    };
    let adrfam = if addr.is_ipv4() {
        DiscoveryLogEntry::ADRFAM_IPV4
    } else {
        DiscoveryLogEntry::ADRFAM_IPV6
    };
    // treq bits 1:0 say whether a secure channel is required; tsas.tcp.sectype names TLS 1.3 when we offer it.
    let (secure, sectype) = match listener.tls {
        TlsMode::Required => (
            DiscoveryLogEntry::TREQ_SECURE_REQUIRED,
            DiscoveryLogEntry::TCP_SECTYPE_TLS13,
        ),
        TlsMode::Optional => (
            DiscoveryLogEntry::TREQ_SECURE_NOT_REQUIRED,
            DiscoveryLogEntry::TCP_SECTYPE_TLS13,
        ),
        TlsMode::Off => (
            DiscoveryLogEntry::TREQ_SECURE_NOT_SPECIFIED,
            DiscoveryLogEntry::TCP_SECTYPE_NONE,
        ),
    };
    let subsystems = target.subsystems();
    let entries = subsystems
        .iter()
        .filter(|s| s.kind == Kind::Nvm && s.exported_on(listener.addr) && s.allows(hostnqn))
        .map(|s| DiscoveryLogEntry {
            trtype: DiscoveryLogEntry::TRTYPE_TCP,
            adrfam,
            subtype: DiscoveryLogEntry::SUBTYPE_NVME,
            // Hosts may disable SQ flow control (we support it).
            treq: secure | DiscoveryLogEntry::TREQ_DISABLE_SQFLOW,
            portid: listener.port_id,
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
        genctr: target
            .registry
            .generation
            .load(std::sync::atomic::Ordering::Acquire),
        recfmt: 0,
        entries,
    }
    .to_bytes()
}

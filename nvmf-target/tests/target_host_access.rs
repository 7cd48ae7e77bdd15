//! Host access control per subsystem: allowed hosts or any host, Connect refusals that name HOSTNQN and say
//! why, a discovery log that lists only what the asking host may use, and the I/O queues a controller grants.

use nvpoll_testkit::target as target_common;

use nvpoll::spec::{
    fabrics, feature, log_page, ConnectData, ConnectResponse, DiscoveryLog, InvalidParameter, Sqe,
    Status,
};
use nvpoll_target::{Backing, SubsystemConfig, TargetConfig, DISCOVERY_NQN};
use nvpoll_tcp::host::{ConnectOptions, TcpController};
use nvpoll_tcp::pdu::Digests;
use target_common::{pool, RawHost, TestTarget};

const OPEN: &str = "nqn.2024-01.io.nvpoll:open";
const CLOSED: &str = "nqn.2024-01.io.nvpoll:closed";
const HOST1: &str = "nqn.2014-08.org.nvmexpress:uuid:11111111-1111-1111-1111-111111111111";
const HOST2: &str = "nqn.2014-08.org.nvmexpress:uuid:22222222-2222-2222-2222-222222222222";

/// OPEN lets any host in, CLOSED only HOST1.
fn two_subsystems() -> TestTarget {
    let open = SubsystemConfig::new(OPEN).namespace(Backing::Ram(8 << 20), 512);
    let closed = SubsystemConfig::new(CLOSED)
        .namespace(Backing::Ram(8 << 20), 512)
        .allow_host(HOST1);
    TestTarget::start_with(
        TargetConfig::new("127.0.0.1:0".parse().unwrap())
            .subsystem(open)
            .subsystem(closed),
    )
}

fn admin_connect(t: &TestTarget, subnqn: &str, hostnqn: &str) -> ConnectResponse {
    let mut h = RawHost::connect(t.addr);
    h.icreq(Digests::NONE);
    let cd = ConnectData {
        hostid: [5; 16],
        cntlid: fabrics::CNTLID_DYNAMIC,
        subnqn: subnqn.into(),
        hostnqn: hostnqn.into(),
    };
    ConnectResponse::from_cqe(&h.fabrics_connect(0, 31, 0, 0, &cd))
}

/// A host the subsystem does not allow: Connect Invalid Host, pointing at the host NQN (as nvmet and SPDK).
fn refused_hostnqn() -> ConnectResponse {
    ConnectResponse::Rejected {
        status: Status::CONNECT_INVALID_HOST.with_dnr(),
        invalid: Some(InvalidParameter::HOSTNQN),
    }
}

#[test]
fn only_allowed_hosts_connect_and_every_refusal_says_why() {
    let t = two_subsystems();
    assert!(matches!(
        admin_connect(&t, CLOSED, HOST1),
        ConnectResponse::Accepted { .. }
    ));
    assert_eq!(admin_connect(&t, CLOSED, HOST2), refused_hostnqn());
    assert_eq!(admin_connect(&t, CLOSED, ""), refused_hostnqn());
    // The open subsystem takes anyone, an empty Host NQN included.
    assert!(matches!(
        admin_connect(&t, OPEN, HOST2),
        ConnectResponse::Accepted { .. }
    ));
    assert!(matches!(
        admin_connect(&t, OPEN, ""),
        ConnectResponse::Accepted { .. }
    ));
    let refused = t.events_matching("Connect refused");
    assert_eq!(refused.len(), 2, "{refused:?}");
    assert!(
        refused[0].contains(HOST2)
            && refused[0].contains("not among the subsystem's allowed hosts"),
        "{}",
        refused[0]
    );
    assert!(refused[1].contains("empty Host NQN"), "{}", refused[1]);
    assert_eq!(t.counters().connects_rejected, 2);
    // Our initiator sees a refused Connect as such.
    match TcpController::connect(ConnectOptions::new(t.addr, CLOSED, HOST2), pool()) {
        Err(nvpoll_tcp::Error::Refused(r)) => {
            assert!(r.status.is(Status::CONNECT_INVALID_HOST), "{r:?}");
            assert!(
                r.to_string()
                    .contains(&format!("subsystem {CLOSED} does not allow host {HOST2}")),
                "{r}"
            );
        }
        other => panic!("expected a refused Connect, got {other:?}"),
    }
}

/// The subsystem NQNs the discovery log shows `hostnqn`.
fn discovered(t: &TestTarget, hostnqn: &str) -> Vec<String> {
    discovery_log(t, hostnqn).1
}

/// The discovery log `hostnqn` reads: its generation counter and subsystem NQNs.
fn discovery_log(t: &TestTarget, hostnqn: &str) -> (u64, Vec<String>) {
    let mut h = RawHost::connect(t.addr);
    h.icreq(Digests::NONE);
    let cd = ConnectData {
        hostid: [5; 16],
        cntlid: fabrics::CNTLID_DYNAMIC,
        subnqn: DISCOVERY_NQN.into(),
        hostnqn: hostnqn.into(),
    };
    let cqe = h.fabrics_connect(0, 31, 0, 0, &cd);
    assert!(
        cqe.status().is_success(),
        "discovery Connect: {:?}",
        cqe.status()
    );
    let (cqe, page) = h.run(
        Sqe::get_log_page(log_page::DISCOVERY, 0, 3 * 1024, 0),
        &[],
        3 * 1024,
        &[],
    );
    assert!(cqe.status().is_success());
    let log = DiscoveryLog::parse(&page).unwrap();
    let mut nqns: Vec<String> = log.entries.iter().map(|e| e.subnqn.clone()).collect();
    nqns.sort();
    (log.genctr, nqns)
}

/// What blktests nvme/030 checks with nvmet's configfs: the discovery log's generation counter moves with each
/// change a discovery host could see (a subsystem added, the host allowed, disallowed, the subsystem removed).
#[test]
fn the_discovery_generation_counter_moves_with_every_change() {
    let t = two_subsystems();
    let third = "nqn.2024-01.io.nvpoll:third";
    let (g0, _) = discovery_log(&t, HOST2);
    let mut cfg = SubsystemConfig::new(third).namespace(Backing::Ram(1 << 20), 512);
    cfg = cfg.allow_host(HOST1);
    t.handle.add_subsystem(&cfg).unwrap();
    let (g1, _) = discovery_log(&t, HOST2);
    assert!(g1 > g0, "adding a subsystem: {g0} -> {g1}");
    t.handle.allow_host(third, HOST2).unwrap();
    let (g2, seen) = discovery_log(&t, HOST2);
    assert!(g2 > g1, "allowing the host: {g1} -> {g2}");
    assert!(seen.iter().any(|n| n == third));
    t.handle.disallow_host(third, HOST2).unwrap();
    let (g3, seen) = discovery_log(&t, HOST2);
    assert!(g3 > g2, "disallowing the host: {g2} -> {g3}");
    assert!(!seen.iter().any(|n| n == third));
    t.handle.remove_subsystem(third).unwrap();
    let (g4, _) = discovery_log(&t, HOST2);
    assert!(g4 > g3, "removing the subsystem: {g3} -> {g4}");
    let (g5, _) = discovery_log(&t, HOST2);
    assert_eq!(g5, g4, "no change, no move");
}

#[test]
fn the_discovery_log_lists_only_what_the_host_may_use() {
    let t = two_subsystems();
    assert_eq!(discovered(&t, HOST1), [CLOSED, OPEN]);
    assert_eq!(discovered(&t, HOST2), [OPEN]);
    assert_eq!(discovered(&t, ""), [OPEN]);
}

#[test]
fn a_controller_grants_128_io_queues_by_default() {
    let t = two_subsystems();
    let (mut h, _) = RawHost::admin_queue(t.addr, OPEN, 0);
    // Ask for 1024 submission and completion queues (0's based): the grant is what the controller allows.
    let (cqe, _) = h.run(
        Sqe::set_features(feature::NUMBER_OF_QUEUES, 1023 << 16 | 1023),
        &[],
        0,
        &[],
    );
    assert!(cqe.status().is_success());
    assert_eq!(cqe.dw0 & 0xffff, 127, "NSQA (0's based)");
    assert_eq!(cqe.dw0 >> 16, 127, "NCQA (0's based)");
}

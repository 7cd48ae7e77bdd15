//! Asymmetric Namespace Access on our target: one subsystem on two listeners (two paths), ANA groups per
//! namespace, states per listener, the ANA log page, the ANA change event, and I/O refused on a path whose
//! group is not accessible while the other path serves it.

use nvpoll_testkit::target as target_common;

use std::net::SocketAddr;

use nvpoll::spec::{
    cns, feature, log_page, AnaLog, AnaState, Cqe, IdentifyController, IdentifyNamespace, Sqe,
    Status,
};
use nvpoll_target::{Backing, SubsystemConfig, TargetConfig, TlsMode};
use nvpoll_tcp::pdu::Digests;
use target_common::{RawHost, Resp, TestTarget, HOSTNQN, NQN};

/// A target with `NQN` on two listeners: namespace 1 in ANA group 1, namespace 2 in group 2, and group 2
/// non-optimized on the second listener.
fn two_paths() -> (TestTarget, SocketAddr, SocketAddr) {
    let a = free_addr();
    let b = free_addr();
    let mut subsys = SubsystemConfig::new(NQN)
        .namespace(Backing::Ram(8 << 20), 512)
        .namespace(Backing::Ram(8 << 20), 512);
    subsys.namespaces[1].ana_group = 2;
    subsys.ana.push(nvpoll_target::AnaSetting {
        listener: b,
        group: 2,
        state: AnaState::NonOptimized,
    });
    let config = TargetConfig::new(a)
        .listener(b, TlsMode::Off)
        .subsystem(subsys);
    (TestTarget::start_with(config), a, b)
}

fn free_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

fn ana_log(h: &mut RawHost, rgo: bool) -> AnaLog {
    let mut sqe = Sqe::get_log_page(log_page::ANA, 0, 4096, 0);
    if rgo {
        sqe.cdw10 |= u32::from(nvpoll::spec::ANA_LSP_RGO) << 8;
    }
    let (cqe, page) = h.run(sqe, &[], 4096, &[]);
    assert!(cqe.status().is_success(), "ANA log: {:?}", cqe.status());
    AnaLog::parse(&page).expect("a well-formed ANA log page")
}

fn next_cqe(h: &mut RawHost) -> Cqe {
    match h.recv() {
        Some(Resp::Cqe(c)) => c,
        other => panic!("expected a completion, got {other:?}"),
    }
}

/// A one-block write to `nsid` on an I/O queue; returns its status.
fn write_status(q: &mut RawHost, nsid: u32) -> Status {
    let data = [0x5au8; 512];
    let (cqe, _) = q.run(Sqe::write(nsid, 3, 0), &data, 512, &[]);
    cqe.status()
}

fn io_queue(addr: SocketAddr, cntlid: u16) -> RawHost {
    let (q, cqe) = RawHost::io_queue(addr, cntlid, 1, 31, 0, Digests::NONE);
    assert!(cqe.status().is_success(), "I/O connect: {:?}", cqe.status());
    q
}

#[test]
fn identify_reports_ana_and_the_groups() {
    let (_t, a, _) = two_paths();
    let (mut h, _) = RawHost::admin_queue(a, NQN, 0);
    let (cqe, page) = h.run(Sqe::identify(cns::CONTROLLER, 0), &[], 4096, &[]);
    assert!(cqe.status().is_success());
    let id = IdentifyController::parse(&page).unwrap();
    assert_ne!(id.cmic & IdentifyController::CMIC_ANA, 0, "ANA reporting");
    assert_ne!(id.cmic & IdentifyController::CMIC_MULTI_CONTROLLER, 0);
    assert_ne!(id.oaes & IdentifyController::OAES_ANA_CHANGE, 0);
    for bit in [
        IdentifyController::ANACAP_OPTIMIZED,
        IdentifyController::ANACAP_NON_OPTIMIZED,
        IdentifyController::ANACAP_INACCESSIBLE,
        IdentifyController::ANACAP_PERSISTENT_LOSS,
        IdentifyController::ANACAP_CHANGE,
    ] {
        assert_ne!(id.anacap & bit, 0, "ANACAP bit {bit:#x}");
    }
    assert_eq!(id.anagrpmax, nvpoll_target::ANA_GROUP_MAX);
    assert_eq!(id.nanagrpid, nvpoll_target::ANA_GROUP_MAX);
    assert!(id.anatt > 0);
    assert!(id.cqt > 0, "the Command Quiesce Time is reported");
    assert!(
        id.mnan > 0 && id.mnan <= id.nn,
        "Linux sizes its ANA log by MNAN"
    );
    for (nsid, group) in [(1, 1), (2, 2)] {
        let (cqe, page) = h.run(Sqe::identify(cns::NAMESPACE, nsid), &[], 4096, &[]);
        assert!(cqe.status().is_success());
        assert_eq!(IdentifyNamespace::parse(&page).unwrap().anagrpid, group);
    }
}

#[test]
fn each_listener_reports_its_own_states() {
    let (_t, a, b) = two_paths();
    let (mut ha, _) = RawHost::admin_queue(a, NQN, 0);
    let (mut hb, _) = RawHost::admin_queue(b, NQN, 0);
    let la = ana_log(&mut ha, false);
    let lb = ana_log(&mut hb, false);
    assert_eq!(la.groups.len(), 2);
    assert_eq!(la.state_of(1), Some(AnaState::Optimized));
    assert_eq!(la.state_of(2), Some(AnaState::Optimized));
    assert_eq!(lb.state_of(1), Some(AnaState::Optimized));
    assert_eq!(lb.state_of(2), Some(AnaState::NonOptimized));
    let groups_only = ana_log(&mut hb, true);
    assert_eq!(groups_only.groups.len(), 2);
    assert!(groups_only.groups.iter().all(|g| g.nsids.is_empty()));
    assert_eq!(groups_only.groups[1].state, AnaState::NonOptimized);
}

#[test]
fn an_inaccessible_path_refuses_io_and_says_so_with_an_event() {
    let (t, a, b) = two_paths();
    let (mut ha, ca) = RawHost::admin_queue(a, NQN, 0);
    let (_hb, cb) = RawHost::admin_queue(b, NQN, 0);
    let (cqe, _) = ha.run(
        Sqe::set_features(feature::ASYNC_EVENT_CONFIG, feature::AEC_ANA_CHANGE),
        &[],
        0,
        &[],
    );
    assert!(cqe.status().is_success());
    let mut aer = Sqe::async_event_request();
    aer.cid = ha.cid();
    ha.send_cmd(aer, &[], 0);
    let mut qa = io_queue(a, ca);
    let mut qb = io_queue(b, cb);
    assert!(write_status(&mut qa, 1).is_success());
    let before_count = ana_log(&mut ha, true).change_count;

    let before = t
        .handle
        .set_ana_state(NQN, a, 1, AnaState::Inaccessible)
        .unwrap();
    assert_eq!(before, AnaState::Optimized);
    let event = next_cqe(&mut ha);
    assert_eq!(event.cid, aer.cid, "the held AER carries the news");
    let ev = nvpoll::spec::AsyncEvent::from_dw0(event.dw0);
    assert_eq!(ev.info, nvpoll::spec::AsyncEvent::NOTICE_ANA_CHANGE);
    assert_eq!(ev.log_page, log_page::ANA);
    let log = ana_log(&mut ha, false);
    assert_eq!(log.state_of(1), Some(AnaState::Inaccessible));
    assert!(log.change_count > before_count, "the change count moves");

    // Path A refuses namespace 1, with the path status and without DNR: another path may take it.
    let st = write_status(&mut qa, 1);
    assert_eq!(st.sct(), Status::ANA_INACCESSIBLE.sct());
    assert_eq!(st.sc(), Status::ANA_INACCESSIBLE.sc());
    assert!(!st.dnr(), "retryable elsewhere");
    let (cqe, _) = qa.run(Sqe::read(1, 3, 0), &[], 512, &[]);
    assert_eq!(cqe.status().sc(), Status::ANA_INACCESSIBLE.sc());
    // Group 2 on path A, and both groups on path B, still serve.
    assert!(write_status(&mut qa, 2).is_success());
    assert!(write_status(&mut qb, 1).is_success());

    for (state, status) in [
        (AnaState::Change, Status::ANA_TRANSITION),
        (AnaState::PersistentLoss, Status::ANA_PERSISTENT_LOSS),
    ] {
        t.handle.set_ana_state(NQN, a, 1, state).unwrap();
        assert_eq!(write_status(&mut qa, 1).sc(), status.sc(), "{state}");
    }
    t.handle
        .set_ana_state(NQN, a, 1, AnaState::Optimized)
        .unwrap();
    assert!(write_status(&mut qa, 1).is_success(), "back to optimized");
    let list = t.handle.subsystems();
    let info = list.iter().find(|s| s.nqn == NQN).unwrap();
    assert_eq!(
        info.ana.len(),
        1,
        "only group 2 on B is set: {:?}",
        info.ana
    );
}

#[test]
fn bad_ana_requests_are_refused() {
    let (t, a, _) = two_paths();
    let other = free_addr();
    assert!(t
        .handle
        .set_ana_state(NQN, a, 0, AnaState::Inaccessible)
        .is_err());
    assert!(t
        .handle
        .set_ana_state(
            NQN,
            a,
            nvpoll_target::ANA_GROUP_MAX + 1,
            AnaState::Inaccessible
        )
        .is_err());
    assert!(
        t.handle
            .set_ana_state(NQN, other, 1, AnaState::Inaccessible)
            .is_err(),
        "not a listener of the subsystem"
    );
    assert!(t
        .handle
        .set_ana_state("nqn.2024-01.io.nvpoll:none", a, 1, AnaState::Inaccessible)
        .is_err());
    let _ = HOSTNQN;
}

#[test]
fn controller_ids_stay_in_the_configured_range() {
    let a = free_addr();
    let mut subsys = SubsystemConfig::new(NQN).namespace(Backing::Ram(1 << 20), 512);
    subsys.cntlids = nvpoll_target::CntlidRange { min: 100, max: 101 };
    let t = TestTarget::start_with(TargetConfig::new(a).subsystem(subsys));
    let (_h1, c1) = RawHost::admin_queue(t.addr, NQN, 0);
    let (_h2, c2) = RawHost::admin_queue(t.addr, NQN, 0);
    let mut ids = [c1, c2];
    ids.sort_unstable();
    assert_eq!(ids, [100, 101]);
    // A third controller finds no free ID.
    let mut h = RawHost::connect(t.addr);
    h.icreq(Digests::NONE);
    let cd = nvpoll::spec::ConnectData {
        hostid: [7; 16],
        cntlid: nvpoll::spec::fabrics::CNTLID_DYNAMIC,
        subnqn: NQN.into(),
        hostnqn: HOSTNQN.into(),
    };
    let cqe = h.fabrics_connect(0, 31, 0, 0, &cd);
    assert_eq!(cqe.status(), Status::CONNECT_CONTROLLER_BUSY);
}

//! Hosts that are sloppy at the edges of a session, as real ones are, scripted PDU by PDU: an empty Host NQN
//! (what `spdk_nvme_perf` sends without `hostnqn:` in its transport ID), and a detach that reuses the command
//! IDs of Asynchronous Event Requests the host completed on its own (what SPDK's host does). Strict where it
//! protects data (a reused ID of a command still moving data ends the session), tolerant where it only costs a
//! clean shutdown.

use nvpoll_testkit::target as target_common;

use nvpoll::spec::{
    fabrics, reg, Cc, ConnectData, ConnectResponse, Csts, InvalidParameter, Sqe, Status,
};
use nvpoll_tcp::pdu::{Digests, Fes};
use target_common::{RawHost, Resp, TestTarget, HOSTNQN, NQN};

fn connect_data(hostnqn: &str, cntlid: u16) -> ConnectData {
    ConnectData {
        hostid: [9; 16],
        cntlid,
        subnqn: NQN.into(),
        hostnqn: hostnqn.into(),
    }
}

#[test]
fn an_empty_host_nqn_is_accepted_where_any_host_may_connect() {
    let t = TestTarget::start(|c| c);
    let mut admin = RawHost::connect(t.addr);
    admin.icreq(Digests::NONE);
    let cqe = admin.fabrics_connect(0, 31, 0, 0, &connect_data("", fabrics::CNTLID_DYNAMIC));
    let ConnectResponse::Accepted { cntlid, .. } = ConnectResponse::from_cqe(&cqe) else {
        panic!(
            "admin Connect with an empty Host NQN: {}",
            ConnectResponse::from_cqe(&cqe)
        );
    };
    admin.enable();
    // Its I/O queues give the same empty Host NQN, and work.
    let mut q = RawHost::connect(t.addr);
    q.icreq(Digests::NONE);
    let cqe = q.fabrics_connect(1, 15, 0, 0, &connect_data("", cntlid));
    assert_eq!(
        ConnectResponse::from_cqe(&cqe),
        ConnectResponse::Accepted { cntlid, authreq: 0 }
    );
    let (cqe, _) = q.run(Sqe::write(1, 0, 0), &[0x5a; 512], 0, &[]);
    assert!(cqe.status().is_success());
    let (cqe, data) = q.run(Sqe::read(1, 0, 0), &[], 512, &[]);
    assert!(cqe.status().is_success() && data == [0x5a; 512]);
    // A host with a name cannot take an I/O queue of that controller, and the refusal says why.
    let mut other = RawHost::connect(t.addr);
    other.icreq(Digests::NONE);
    let cqe = other.fabrics_connect(2, 15, 0, 0, &connect_data(HOSTNQN, cntlid));
    assert_eq!(
        ConnectResponse::from_cqe(&cqe),
        ConnectResponse::Rejected {
            status: Status::CONNECT_INVALID_PARAMETERS.with_dnr(),
            invalid: Some(InvalidParameter::HOSTNQN)
        }
    );
    let refused = t.events_matching("Connect refused");
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert!(
        refused[0].contains(HOSTNQN) && refused[0].contains("belongs to host ''"),
        "the log says who was refused and why: {}",
        refused[0]
    );
}

#[test]
fn every_refused_connect_is_logged_with_its_reason() {
    let t = TestTarget::start(|c| c);
    let mut h = RawHost::connect(t.addr);
    h.icreq(Digests::NONE);
    let mut cd = connect_data(HOSTNQN, fabrics::CNTLID_DYNAMIC);
    cd.subnqn = "nqn.2024-01.io.nvpoll:nope".into();
    let cqe = h.fabrics_connect(0, 31, 0, 0, &cd);
    assert!(cqe.status().is(Status::CONNECT_INVALID_PARAMETERS));
    let cqe = h.fabrics_connect(
        0,
        4000,
        0,
        0,
        &connect_data(HOSTNQN, fabrics::CNTLID_DYNAMIC),
    );
    assert!(cqe.status().is(Status::CONNECT_INVALID_PARAMETERS));
    let events = t.events_matching("Connect refused");
    assert_eq!(events.len(), 2, "{events:?}");
    assert!(
        events[0].contains("nqn.2024-01.io.nvpoll:nope") && events[0].contains("no such subsystem"),
        "{}",
        events[0]
    );
    assert!(events[1].contains("SQSIZE 4000"), "{}", events[1]);
    assert_eq!(t.counters().connects_rejected, 2);
}

/// SPDK's host at detach: its AERs are completed locally, and the shutdown reuses their command IDs.
#[test]
fn a_detach_that_reuses_held_aer_command_ids_shuts_down_cleanly() {
    let t = TestTarget::start(|c| c);
    let (mut h, _) = RawHost::admin_queue(t.addr, NQN, 0);
    let aer_cids: Vec<u16> = (0..4)
        .map(|_| {
            let mut sqe = Sqe::async_event_request();
            sqe.cid = h.cid();
            h.send_cmd(sqe, &[], 0);
            sqe.cid
        })
        .collect();
    // A command between proves the AERs are held (an answer to one would come first).
    let (cqe, _) = h.run(Sqe::keep_alive(), &[], 0, &[]);
    assert!(cqe.status().is_success());

    // Shutdown notification, then CSTS polled, each on the command ID of an AER.
    let mut cc = Cc(0);
    cc.set_en(true);
    cc.set_iosqes(6);
    cc.set_iocqes(4);
    cc.set_shn(Cc::SHN_NORMAL);
    let mut sqe = Sqe::property_set(reg::CC, false, u64::from(cc.0));
    sqe.cid = aer_cids[0];
    let (cqe, _) = h.run_as(sqe, &[], 0, &[]);
    assert_eq!(cqe.cid, aer_cids[0]);
    assert!(cqe.status().is_success(), "{:?}", cqe.status());
    let mut sqe = Sqe::property_get(reg::CSTS, false);
    sqe.cid = aer_cids[1];
    let (cqe, _) = h.run_as(sqe, &[], 0, &[]);
    assert!(cqe.status().is_success());
    assert_eq!(
        Csts(cqe.property_value() as u32).shst(),
        Csts::SHST_COMPLETE
    );
    // An AER ID reused by a new AER holds the new one in its place.
    let mut sqe = Sqe::async_event_request();
    sqe.cid = aer_cids[2];
    h.send_cmd(sqe, &[], 0);
    let mut sqe = Sqe::keep_alive();
    sqe.cid = aer_cids[3];
    let (cqe, _) = h.run_as(sqe, &[], 0, &[]);
    assert!(cqe.status().is_success());
    assert_eq!(cqe.cid, aer_cids[3], "the re-held AER did not complete");

    // The host closes the admin queue, as SPDK's does after the shutdown: no termination request came first.
    h.s.shutdown(std::net::Shutdown::Write).unwrap();
    assert_eq!(h.expect_close(), None, "closed without a C2HTermReq");
    let c = t.wait_counters("4 retired AERs", |c| c.aers_retired == 4 && c.closed == 1);
    assert_eq!(c.term_reqs, 0);
    assert!(t.events_matching("already outstanding").is_empty());
}

/// A host that fills a small admin queue with AERs and then sends one more has given up on one of them.
#[test]
fn a_full_queue_of_held_aers_makes_room_instead_of_failing() {
    let t = TestTarget::start(|c| c);
    let mut h = RawHost::connect(t.addr);
    h.icreq(Digests::NONE);
    // Two entries (SQSIZE 1), both taken by AERs, then a third.
    let cqe = h.fabrics_connect(0, 1, 0, 0, &connect_data(HOSTNQN, fabrics::CNTLID_DYNAMIC));
    assert!(cqe.status().is_success());
    h.enable();
    for _ in 0..3 {
        let mut sqe = Sqe::async_event_request();
        sqe.cid = h.cid();
        h.send_cmd(sqe, &[], 0);
    }
    let (cqe, _) = h.run(Sqe::keep_alive(), &[], 0, &[]);
    assert!(cqe.status().is_success());
    t.wait_counters("1 retired AER", |c| c.aers_retired == 1);
    assert_eq!(t.counters().term_reqs, 0);
}

/// A reused command ID of a command that still moves data is a protocol error: the data could land in the
/// wrong command.
#[test]
fn a_reused_id_of_a_command_awaiting_data_still_ends_the_session() {
    let t = TestTarget::start(|c| c);
    let (_admin, cntlid) = RawHost::admin_queue(t.addr, NQN, 0);
    let (mut q, cqe) = RawHost::io_queue(t.addr, cntlid, 1, 15, 0, Digests::NONE);
    assert!(cqe.status().is_success());
    // A 64 KiB write: the target asks for its data with R2T.
    let mut w = Sqe::write(1, 0, 127);
    w.cid = 77;
    q.send_cmd(w, &[], 64 << 10);
    match q.recv() {
        Some(Resp::R2T(r)) => assert_eq!(r.cccid, 77),
        other => panic!("expected an R2T, got {other:?}"),
    }
    let mut r = Sqe::read(1, 0, 0);
    r.cid = 77;
    q.send_cmd(r, &[], 512);
    let term = q.expect_close();
    assert_eq!(
        term.map(|(fes, _)| fes),
        Some(Fes::InvalidHeaderField as u16),
        "termination request for the reused command ID"
    );
    let closed = t.wait_event("already outstanding");
    assert_eq!(closed.len(), 1, "{closed:?}");
}

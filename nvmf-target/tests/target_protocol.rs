//! The target at the PDU level, driven by a scripted host: discovery, Connect rules, the CC/CSTS state machine,
//! keep-alive enforcement, the C2H success optimization, NVMe statuses for bad commands, and data digests.

use nvpoll_testkit::target as target_common;

use std::time::Duration;

use nvpoll::spec::{
    cns, fabrics, io as io_op, log_page, reg, ConnectData, ConnectResponse, Csts, DiscoveryLog,
    DiscoveryLogEntry, IdentifyController, InvalidParameter, Sqe, Status,
};
use nvpoll_target::DISCOVERY_NQN;
use nvpoll_tcp::pdu::{self, Digests};
use target_common::{fill_pattern, RawHost, Resp, TestTarget, HOSTNQN, NQN};

fn connect_data(nqn: &str, cntlid: u16) -> ConnectData {
    ConnectData {
        hostid: [7; 16],
        cntlid,
        subnqn: nqn.into(),
        hostnqn: HOSTNQN.into(),
    }
}

#[test]
fn discovery_log_lists_the_subsystem() {
    let t = TestTarget::start(|c| c);
    let (mut h, cntlid) = RawHost::admin_queue(t.addr, DISCOVERY_NQN, 0);
    let (cqe, page) = h.run(Sqe::identify(cns::CONTROLLER, 0), &[], 0, &[]);
    assert_eq!(cqe.status(), Status::SUCCESS);
    let page = {
        // Identify without a data pointer moves no data; ask again with a 4 KiB transfer.
        assert!(page.is_empty());
        h.run(Sqe::identify(cns::CONTROLLER, 0), &[], 4096, &[]).1
    };
    let id = IdentifyController::parse(&page).unwrap();
    assert_eq!(id.cntrltype, IdentifyController::CNTRLTYPE_DISCOVERY);
    assert_eq!(id.subnqn, DISCOVERY_NQN);
    assert_eq!(id.cntlid, cntlid);
    // Header first, as nvme-cli does, then the whole log.
    let (cqe, header) = h.run(
        Sqe::get_log_page(log_page::DISCOVERY, 0, 1024, 0),
        &[],
        1024,
        &[],
    );
    assert!(cqe.status().is_success());
    let numrec = u64::from_le_bytes(header[8..16].try_into().unwrap());
    assert_eq!(numrec, 1);
    let len = 1024 * (1 + numrec as u32);
    let (cqe, all) = h.run(
        Sqe::get_log_page(log_page::DISCOVERY, 0, len, 0),
        &[],
        len,
        &[],
    );
    assert!(cqe.status().is_success());
    let log = DiscoveryLog::parse(&all).unwrap();
    let e = &log.entries[0];
    assert_eq!(e.subnqn, NQN);
    assert_eq!(e.trtype, DiscoveryLogEntry::TRTYPE_TCP);
    assert_eq!(e.adrfam, DiscoveryLogEntry::ADRFAM_IPV4);
    assert_eq!(e.subtype, DiscoveryLogEntry::SUBTYPE_NVME);
    assert_eq!(e.traddr, "127.0.0.1");
    assert_eq!(e.trsvcid, t.addr.port().to_string());
    assert_eq!(e.cntlid, 0xffff);
    // A discovery controller has no namespaces and no I/O queues.
    let (cqe, _) = h.run(Sqe::identify(cns::ACTIVE_NS_LIST, 0), &[], 4096, &[]);
    assert!(cqe.status().is(Status::INVALID_FIELD));
    let (cqe, _) = h.run(
        Sqe::set_features(nvpoll::spec::feature::NUMBER_OF_QUEUES, 0),
        &[],
        0,
        &[],
    );
    assert!(cqe.status().is(Status::INVALID_FIELD));
}

#[test]
fn unknown_subsystem_is_refused_with_the_offending_field() {
    let t = TestTarget::start(|c| c);
    let mut h = RawHost::connect(t.addr);
    h.icreq(Digests::NONE);
    let cqe = h.fabrics_connect(
        0,
        31,
        0,
        0,
        &connect_data("nqn.2024-01.io.nvpoll:nope", 0xffff),
    );
    match ConnectResponse::from_cqe(&cqe) {
        ConnectResponse::Rejected { status, invalid } => {
            assert!(status.is(Status::CONNECT_INVALID_PARAMETERS), "{status:?}");
            assert!(status.dnr());
            assert_eq!(invalid, Some(InvalidParameter::SUBNQN));
        }
        other => panic!("connect to an unknown NQN: {other}"),
    }
    // Our initiator reports it as a failed Connect.
    let o = nvpoll_tcp::host::ConnectOptions::new(t.addr, "nqn.2024-01.io.nvpoll:nope", HOSTNQN);
    match nvpoll_tcp::host::TcpController::connect(o, target_common::pool()) {
        Err(e @ nvpoll_tcp::Error::Refused(_)) => {
            let nvpoll_tcp::Error::Refused(r) = &e else {
                unreachable!()
            };
            assert!(r.status.is(Status::CONNECT_INVALID_PARAMETERS));
            assert_eq!(r.invalid, Some(InvalidParameter::SUBNQN));
            // Named for a Fabrics Connect, with the parameter in words.
            assert_eq!(
                e.to_string(),
                "Fabrics Connect (admin queue) refused: the target has no subsystem \
                 nqn.2024-01.io.nvpoll:nope: Connect Invalid Parameters (sct 0x1 sc 0x82), invalid \
                 parameter: the subsystem NQN (IATTR 1, IPO 256)"
            );
            // The API error says the same.
            let api = nvpoll::Error::from(e);
            assert!(
                matches!(&api, nvpoll::Error::Refused { status, .. } if status.is(Status::CONNECT_INVALID_PARAMETERS))
            );
            assert!(api
                .to_string()
                .contains("the target has no subsystem nqn.2024-01.io.nvpoll:nope"));
        }
        other => panic!("expected a refused Connect, got {other:?}"),
    }
    assert!(t.counters().connects_rejected >= 2);
}

#[test]
fn io_queue_connect_rules() {
    let t = TestTarget::start(|mut c| {
        c.max_io_queues = 2;
        c
    });
    let (_admin, cntlid) = RawHost::admin_queue(t.addr, NQN, 0);
    // Wrong controller ID, wrong host, queue ID beyond Number of Queues, oversized queue.
    let (_h, cqe) = RawHost::io_queue(t.addr, cntlid + 100, 1, 7, 0, Digests::NONE);
    assert_eq!(
        ConnectResponse::from_cqe(&cqe),
        ConnectResponse::Rejected {
            status: Status::CONNECT_INVALID_PARAMETERS.with_dnr(),
            invalid: Some(InvalidParameter::CNTLID)
        }
    );
    let mut h = RawHost::connect(t.addr);
    h.icreq(Digests::NONE);
    let mut cd = connect_data(NQN, cntlid);
    cd.hostnqn = "nqn.2014-08.org.nvmexpress:uuid:someone-else".into();
    let cqe = h.fabrics_connect(1, 7, 0, 0, &cd);
    assert!(matches!(
        ConnectResponse::from_cqe(&cqe),
        ConnectResponse::Rejected {
            invalid: Some(InvalidParameter::HOSTNQN),
            ..
        }
    ));
    let (_h, cqe) = RawHost::io_queue(t.addr, cntlid, 3, 7, 0, Digests::NONE);
    assert!(matches!(
        ConnectResponse::from_cqe(&cqe),
        ConnectResponse::Rejected {
            invalid: Some(InvalidParameter::QID),
            ..
        }
    ));
    let (_h, cqe) = RawHost::io_queue(t.addr, cntlid, 1, 128, 0, Digests::NONE);
    assert!(matches!(
        ConnectResponse::from_cqe(&cqe),
        ConnectResponse::Rejected {
            invalid: Some(InvalidParameter::SQSIZE),
            ..
        }
    ));
    // The good one, then the same queue ID again.
    let (_q1, cqe) = RawHost::io_queue(t.addr, cntlid, 1, 7, 0, Digests::NONE);
    assert_eq!(
        ConnectResponse::from_cqe(&cqe),
        ConnectResponse::Accepted { cntlid, authreq: 0 }
    );
    let (_h, cqe) = RawHost::io_queue(t.addr, cntlid, 1, 7, 0, Digests::NONE);
    assert!(matches!(
        ConnectResponse::from_cqe(&cqe),
        ConnectResponse::Rejected {
            invalid: Some(InvalidParameter::QID),
            ..
        }
    ));
}

#[test]
fn cc_and_csts_state_machine() {
    let t = TestTarget::start(|c| c);
    let mut h = RawHost::connect(t.addr);
    h.icreq(Digests::NONE);
    let cqe = h.fabrics_connect(0, 31, 0, 0, &connect_data(NQN, 0xffff));
    let cntlid = cqe.dw0 as u16;
    let get = |h: &mut RawHost, off: u32, size8: bool| {
        let (cqe, _) = h.run(Sqe::property_get(off, size8), &[], 0, &[]);
        assert!(
            cqe.status().is_success(),
            "property get {off:#x}: {:?}",
            cqe.status()
        );
        cqe.property_value()
    };
    let cap = nvpoll::spec::Cap(get(&mut h, reg::CAP, true));
    assert_eq!(cap.mqes(), 127);
    assert!(cap.cqr());
    assert_eq!(get(&mut h, reg::VS, false) as u32, nvpoll::spec::Vs::V1_3.0);
    assert!(!Csts(get(&mut h, reg::CSTS, false) as u32).rdy());
    // An I/O queue cannot connect before CC.EN.
    let (_q, cqe) = RawHost::io_queue(t.addr, cntlid, 1, 7, 0, Digests::NONE);
    assert!(cqe.status().is(Status::COMMAND_SEQUENCE_ERROR));
    // Enable with bad entry sizes: fatal status.
    let (cqe, _) = h.run(Sqe::property_set(reg::CC, false, 1), &[], 0, &[]);
    assert!(cqe.status().is_success());
    assert!(Csts(get(&mut h, reg::CSTS, false) as u32).cfs());
    // Disable, then enable properly.
    h.run(Sqe::property_set(reg::CC, false, 0), &[], 0, &[]);
    let cc = 1 | 6 << 16 | 4 << 20;
    h.run(Sqe::property_set(reg::CC, false, cc), &[], 0, &[]);
    let csts = Csts(get(&mut h, reg::CSTS, false) as u32);
    assert!(csts.rdy() && !csts.cfs(), "{csts:?}");
    assert_eq!(get(&mut h, reg::CC, false), cc);
    let (_q, cqe) = RawHost::io_queue(t.addr, cntlid, 1, 7, 0, Digests::NONE);
    assert!(cqe.status().is_success());
    // Shutdown notification: SHST complete.
    h.run(Sqe::property_set(reg::CC, false, cc | 1 << 14), &[], 0, &[]);
    assert_eq!(
        Csts(get(&mut h, reg::CSTS, false) as u32).shst(),
        Csts::SHST_COMPLETE
    );
    // Properties that do not exist, and writes to read-only ones.
    let (cqe, _) = h.run(Sqe::property_get(0x40, false), &[], 0, &[]);
    assert!(cqe.status().is(Status::INVALID_FIELD));
    let (cqe, _) = h.run(Sqe::property_set(reg::CAP, true, 0), &[], 0, &[]);
    assert!(cqe.status().is(Status::INVALID_FIELD));
}

#[test]
fn keep_alive_timeout_tears_the_controller_down() {
    let t = TestTarget::start(|c| c);
    let (mut admin, cntlid) = RawHost::admin_queue(t.addr, NQN, 300);
    let (mut q, cqe) = RawHost::io_queue(t.addr, cntlid, 1, 7, 0, Digests::NONE);
    assert!(cqe.status().is_success());
    // Keep-alives (and I/O) keep it up well past the timeout.
    for _ in 0..8 {
        std::thread::sleep(Duration::from_millis(100));
        let (cqe, _) = admin.run(Sqe::keep_alive(), &[], 0, &[]);
        assert!(cqe.status().is_success());
    }
    // Silence on every queue: the controller goes, with its I/O queue.
    assert_eq!(
        admin.expect_close(),
        None,
        "closed without a termination request"
    );
    assert_eq!(q.expect_close(), None);
    let c = t.wait_counters("the expiry to be counted", |c| c.keep_alive_expired == 1);
    assert_eq!(c.keep_alive_expired, 1);
    assert_eq!(t.events_matching("no command for").len(), 1);
    // The controller ID is gone.
    let (_h, cqe) = RawHost::io_queue(t.addr, cntlid, 2, 7, 0, Digests::NONE);
    assert!(!cqe.status().is_success());
}

#[test]
fn io_commands_on_one_queue_keep_the_controller_alive() {
    let t = TestTarget::start(|c| c);
    let (mut admin, cntlid) = RawHost::admin_queue(t.addr, NQN, 300);
    let (mut q, _) = RawHost::io_queue(t.addr, cntlid, 1, 7, 0, Digests::NONE);
    for _ in 0..10 {
        std::thread::sleep(Duration::from_millis(100));
        let (cqe, _) = q.run(Sqe::read(1, 0, 0), &[], 512, &[]);
        assert!(cqe.status().is_success());
    }
    assert!(
        admin.still_open_after(Duration::from_millis(50)),
        "traffic-based keep-alive"
    );
}

#[test]
fn aer_is_held_and_limited() {
    let t = TestTarget::start(|c| c);
    let (mut h, _) = RawHost::admin_queue(t.addr, NQN, 0);
    for _ in 0..4 {
        let mut sqe = Sqe::async_event_request();
        sqe.cid = h.cid();
        h.send_cmd(sqe, &[], 0);
    }
    // The fifth exceeds AERL; the first four never complete.
    let (cqe, _) = h.run(Sqe::async_event_request(), &[], 0, &[]);
    assert!(cqe.status().is(Status::ASYNC_EVENT_LIMIT_EXCEEDED));
    let (cqe, _) = h.run(Sqe::keep_alive(), &[], 0, &[]);
    assert!(cqe.status().is_success());
    assert!(h.still_open_after(Duration::from_millis(200)));
}

#[test]
fn bad_io_commands_get_the_right_status() {
    let t = TestTarget::start(|c| c);
    let (_admin, cntlid) = RawHost::admin_queue(t.addr, NQN, 0);
    let (mut q, _) = RawHost::io_queue(t.addr, cntlid, 1, 15, 0, Digests::NONE);
    let blocks = target_common::NS1_BYTES / 512;
    let (cqe, data) = q.run(Sqe::read(1, blocks - 1, 1), &[], 1024, &[]);
    assert!(cqe.status().is(Status::LBA_OUT_OF_RANGE) && data.is_empty());
    let (cqe, _) = q.run(Sqe::write(1, blocks, 0), &[0u8; 512], 0, &[]);
    assert!(cqe.status().is(Status::LBA_OUT_OF_RANGE));
    // A large write out of range is refused before any R2T.
    let (cqe, _) = q.run(Sqe::write(1, blocks - 1, 63), &[], 32768, &[]);
    assert!(cqe.status().is(Status::LBA_OUT_OF_RANGE));
    let (cqe, _) = q.run(Sqe::write_zeroes(1, blocks - 2, 2), &[], 0, &[]);
    assert!(cqe.status().is(Status::LBA_OUT_OF_RANGE));
    let (cqe, _) = q.run(Sqe::read(3, 0, 0), &[], 512, &[]);
    assert!(cqe.status().is(Status::INVALID_NAMESPACE));
    let (cqe, _) = q.run(Sqe::flush(9), &[], 0, &[]);
    assert!(cqe.status().is(Status::INVALID_NAMESPACE));
    let (cqe, _) = q.run(
        Sqe {
            opcode: io_op::COMPARE,
            nsid: 1,
            ..Default::default()
        },
        &[],
        512,
        &[],
    );
    assert!(cqe.status().is(Status::INVALID_OPCODE));
    // The data pointer must describe exactly the blocks.
    let (cqe, _) = q.run(Sqe::read(1, 0, 1), &[], 512, &[]);
    assert!(cqe.status().is(Status::DATA_SGL_LENGTH_INVALID));
    // Beyond MDTS (1 MiB).
    let (cqe, _) = q.run(Sqe::read(2, 0, 511), &[], 2 << 20, &[]);
    assert!(cqe.status().is(Status::INVALID_FIELD));
    // Admin commands on an I/O queue, fabrics property commands on an I/O queue.
    let (cqe, _) = q.run(Sqe::property_get(reg::CAP, true), &[], 0, &[]);
    assert!(cqe.status().is(Status::INVALID_FIELD));
    // The queue still works.
    let (cqe, _) = q.run(Sqe::read(1, 0, 0), &[], 512, &[]);
    assert!(cqe.status().is_success());
}

#[test]
fn c2h_success_only_when_sq_flow_control_is_disabled() {
    let t = TestTarget::start(|c| c);
    let (_admin, cntlid) = RawHost::admin_queue(t.addr, NQN, 0);
    for (qid, cattr) in [(1u16, 0u8), (2, fabrics::CATTR_DISABLE_SQFLOW)] {
        let (mut q, cqe) = RawHost::io_queue(t.addr, cntlid, qid, 7, cattr, Digests::NONE);
        assert!(cqe.status().is_success());
        let mut sqe = Sqe::read(1, 0, 7);
        sqe.cid = 42;
        q.send_cmd(sqe, &[], 4096);
        let Some(Resp::C2H { hdr, data }) = q.recv() else {
            panic!("expected C2HData")
        };
        assert_eq!((hdr.cccid, hdr.datal, data.len()), (42, 4096, 4096));
        assert!(hdr.last);
        if cattr == 0 {
            assert!(!hdr.success, "SUCCESS needs SQ flow control disabled");
            let Some(Resp::Cqe(cqe)) = q.recv() else {
                panic!("expected CapsuleResp")
            };
            assert_eq!(cqe.cid, 42);
            assert!(cqe.status().is_success());
            assert_ne!(cqe.sqhd, 0xffff);
        } else {
            assert!(hdr.success, "C2H success optimization");
            // The next response is for the next command: no CapsuleResp for the read.
            let (cqe, _) = q.run(Sqe::flush(1), &[], 0, &[]);
            assert!(cqe.status().is_success());
        }
    }
}

#[test]
fn data_digest_error_fails_only_that_command() {
    let t = TestTarget::start(|c| c);
    let (_admin, cntlid) = RawHost::admin_queue(t.addr, NQN, 0);
    let (mut q, cqe) = RawHost::io_queue(t.addr, cntlid, 1, 7, 0, Digests::BOTH);
    assert!(cqe.status().is_success());
    // An in-capsule write with a corrupted data digest.
    let mut sqe = Sqe::write(1, 8, 0);
    sqe.cid = 5;
    sqe.set_sgl(&nvpoll::spec::SglDescriptor::in_capsule(0, 512));
    let mut b = Vec::new();
    pdu::encode_capsule_cmd(&mut b, &sqe, &[0xaa; 512], Digests::BOTH, 0);
    let n = b.len();
    b[n - 1] ^= 0xff;
    q.send(&b);
    let Some(Resp::Cqe(cqe)) = q.recv() else {
        panic!("expected a completion")
    };
    assert_eq!(cqe.cid, 5);
    assert!(cqe.status().is(Status::TRANSIENT_TRANSPORT_ERROR));
    // An R2T write whose H2CData has a bad digest.
    let mut sqe = Sqe::write(1, 16, 31);
    sqe.cid = 6;
    q.send_cmd(sqe, &[], 16384);
    let Some(Resp::R2T(r)) = q.recv() else {
        panic!("expected R2T")
    };
    let mut data = vec![0u8; 16384];
    fill_pattern(&mut data, 1);
    let mut b = Vec::new();
    let hdr = pdu::H2CDataHdr {
        cccid: 6,
        ttag: r.ttag,
        datao: 0,
        datal: 16384,
        last: true,
    };
    pdu::encode_h2c_data(&mut b, &hdr, &data, Digests::BOTH, 0);
    let n = b.len();
    b[n - 2] ^= 0x01;
    q.send(&b);
    let Some(Resp::Cqe(cqe)) = q.recv() else {
        panic!("expected a completion")
    };
    assert_eq!(cqe.cid, 6);
    assert!(cqe.status().is(Status::TRANSIENT_TRANSPORT_ERROR));
    // The connection goes on.
    let (cqe, _) = q.run(Sqe::write(1, 16, 31), &[], 16384, &data);
    assert!(cqe.status().is_success());
    let (cqe, back) = q.run(Sqe::read(1, 16, 31), &[], 16384, &[]);
    assert!(cqe.status().is_success());
    assert_eq!(back, data);
}

/// Dataset Management on a RAM namespace at the PDU level: ranges in the capsule and fetched with R2T,
/// several ranges in one command, hints without Deallocate changing nothing, ranges checked whole before any
/// is deallocated, and too little data refused.
#[test]
fn dataset_management_deallocates_ranges() {
    use nvpoll::spec::DsmRange;
    let t = TestTarget::start(|c| c);
    let (_admin, cntlid) = RawHost::admin_queue(t.addr, NQN, 0);
    let (mut q, _) = RawHost::io_queue(t.addr, cntlid, 1, 15, 0, Digests::NONE);
    // Namespace 2: 4 KiB blocks. 64 blocks of a pattern over four 64 KiB segments.
    let mut data = vec![0u8; 64 * 4096];
    fill_pattern(&mut data, 5);
    for (i, chunk) in data.chunks(4 * 4096).enumerate() {
        let sqe = Sqe::write(2, 4 * i as u64, 3);
        let (cqe, _) = q.run(sqe, &[], chunk.len() as u32, chunk);
        assert!(cqe.status().is_success());
    }
    let read_all = |q: &mut RawHost| {
        let (cqe, got) = q.run(Sqe::read(2, 0, 63), &[], 64 * 4096, &[]);
        assert!(cqe.status().is_success());
        got
    };
    let ranges = |rs: &[(u64, u32)]| -> Vec<u8> {
        rs.iter()
            .flat_map(|&(slba, nlb)| {
                DsmRange {
                    attributes: 0,
                    nlb,
                    slba,
                }
                .to_bytes()
            })
            .collect()
    };
    // Hints only (no AD): success, nothing changes.
    let mut hint = Sqe::dsm_deallocate(2, 0);
    hint.cdw11 = 1; // IDR
    let (cqe, _) = q.run(hint, &ranges(&[(0, 64)]), 0, &[]);
    assert!(cqe.status().is_success());
    assert!(read_all(&mut q) == data, "a hint changed data");
    // One range out of range: nothing is deallocated.
    let (cqe, _) = q.run(
        Sqe::dsm_deallocate(2, 1),
        &ranges(&[(0, 8), (8190, 3)]),
        0,
        &[],
    );
    assert!(cqe.status().is(Status::LBA_OUT_OF_RANGE));
    assert!(read_all(&mut q) == data, "a refused command deallocated");
    // Fewer bytes than the ranges NR names.
    let (cqe, _) = q.run(Sqe::dsm_deallocate(2, 1), &ranges(&[(0, 8)]), 0, &[]);
    assert!(cqe.status().is(Status::DATA_SGL_LENGTH_INVALID));
    // Two ranges in the capsule (a part of a segment, and segment 1 whole), one fetched with R2T.
    let (cqe, _) = q.run(
        Sqe::dsm_deallocate(2, 1),
        &ranges(&[(3, 2), (16, 16)]),
        0,
        &[],
    );
    assert!(cqe.status().is_success(), "{:?}", cqe.status());
    let r2t = ranges(&[(40, 1)]);
    let (cqe, _) = q.run(Sqe::dsm_deallocate(2, 0), &[], r2t.len() as u32, &r2t);
    assert!(cqe.status().is_success(), "{:?}", cqe.status());
    let mut want = data.clone();
    for (slba, nlb) in [(3usize, 2usize), (16, 16), (40, 1)] {
        want[slba * 4096..(slba + nlb) * 4096].fill(0);
    }
    assert!(
        read_all(&mut q) == want,
        "deallocated blocks do not read as zeroes, or others changed"
    );
    // An inactive namespace.
    let (cqe, _) = q.run(Sqe::dsm_deallocate(9, 0), &ranges(&[(0, 1)]), 0, &[]);
    assert!(cqe.status().is(Status::INVALID_NAMESPACE));
}

/// Every command the target reads gets one answer, those behind a Disconnect too (SPDK's nvme_fuzz sends
/// them): a write still waiting for its data and the commands sent after the Disconnect end with Command
/// Aborted due to SQ Deletion, the Disconnect succeeds, and the target closes the queue once the host falls
/// silent.
#[test]
fn commands_behind_a_disconnect_are_answered() {
    let t = TestTarget::start(|c| c);
    let (_admin, cntlid) = RawHost::admin_queue(t.addr, NQN, 0);
    let (mut h, cqe) = RawHost::io_queue(t.addr, cntlid, 1, 31, 0, Digests::NONE);
    assert!(cqe.status().is_success());
    // A write whose data the target asks for and never gets.
    let mut write = Sqe::write(1, 0, 0);
    write.cid = 0x100;
    h.send_cmd(write, &[], 512);
    match h.recv() {
        Some(Resp::R2T(r)) => assert_eq!(r.cccid, 0x100),
        other => panic!("expected an R2T, got {other:?}"),
    }
    // Disconnect, then more commands in the same write.
    let mut bytes = Vec::new();
    let mut disconnect = Sqe::fabrics_disconnect();
    disconnect.cid = 0x101;
    disconnect.set_sgl(&nvpoll::spec::SglDescriptor::transport_data_block(0));
    pdu::encode_capsule_cmd(&mut bytes, &disconnect, &[], Digests::NONE, 0);
    let behind = [0x102u16, 0x103, 0x104];
    for &cid in &behind {
        let mut read = Sqe::read(1, 0, 0);
        read.cid = cid;
        read.set_sgl(&nvpoll::spec::SglDescriptor::transport_data_block(512));
        pdu::encode_capsule_cmd(&mut bytes, &read, &[], Digests::NONE, 0);
    }
    h.send(&bytes);
    let mut answers = Vec::new();
    for _ in 0..2 + behind.len() {
        match h.recv() {
            Some(Resp::Cqe(cqe)) => answers.push((cqe.cid, cqe.status())),
            other => panic!("expected a completion, got {other:?} after {answers:?}"),
        }
    }
    let status = |cid| {
        let got: Vec<_> = answers.iter().filter(|a| a.0 == cid).collect();
        assert_eq!(
            got.len(),
            1,
            "command {cid:#x}: one answer, got {answers:?}"
        );
        got[0].1
    };
    assert!(status(0x100).is(Status::ABORTED_SQ_DELETION));
    assert!(!status(0x100).dnr());
    assert!(status(0x101).is_success());
    for cid in behind {
        assert!(status(cid).is(Status::ABORTED_SQ_DELETION), "{answers:?}");
    }
    // The Disconnect's answer comes after what the queue held, before what came behind it.
    assert_eq!(answers[0].0, 0x100);
    assert_eq!(answers[1].0, 0x101);
    // One more, a while later: still answered.
    let mut flush = Sqe::flush(1);
    flush.cid = 0x105;
    h.send_cmd(flush, &[], 0);
    match h.recv() {
        Some(Resp::Cqe(cqe)) => {
            assert_eq!(cqe.cid, 0x105);
            assert!(cqe.status().is(Status::ABORTED_SQ_DELETION));
        }
        other => panic!("expected a completion, got {other:?}"),
    }
    // Silent host: the target closes the queue by itself, without a termination request.
    assert_eq!(h.expect_close(), None);
    let c = t.wait_counters("the aborted commands counted", |c| {
        c.aborted_after_disconnect == 4
    });
    assert_eq!(c.term_reqs, 0);
}

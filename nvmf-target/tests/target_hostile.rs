//! Hosts that misbehave: garbage, PDUs out of order, a stop in the middle of a PDU, more commands than the queue
//! holds, duplicate command IDs, bad transfer tags, bad header digests, hosts that vanish. Each gets a C2HTermReq
//! or a clean close, and the target keeps serving everyone else (checked with our initiator after each case).

use nvpoll_testkit::target as target_common;

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use nvpoll::api::{Controller, IoOp, IoRequest, QueuePair};
use nvpoll::spec::{Sqe, Status};
use nvpoll_tcp::host::{ConnectOptions, TcpController};
use nvpoll_tcp::pdu::{self, Digests, Fes};
use target_common::{fill_pattern, pool, RawHost, Resp, TestTarget, HOSTNQN, NQN};

/// A full bring-up and one verified write/read through our initiator: the target still serves.
fn still_serves(t: &TestTarget) {
    let mut ctrl =
        TcpController::connect(ConnectOptions::new(t.addr, NQN, HOSTNQN), pool()).expect("attach");
    let mut qp = ctrl.create_queue_pair(4).expect("I/O queue");
    let p = ctrl.pool().clone();
    let mut w = p.alloc(16384).unwrap();
    fill_pattern(w.as_mut_slice(), 5);
    let expect = w.as_slice().to_vec();
    for (op, buf) in [(IoOp::Write, w), (IoOp::Read, p.alloc(16384).unwrap())] {
        qp.submit(IoRequest {
            op,
            nsid: 1,
            lba: 64,
            blocks: 32,
            buf: Some(buf),
            tag: 0,
        })
        .map_err(|r| r.error)
        .unwrap();
        qp.flush().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let c = loop {
            qp.poll(8).unwrap();
            if let Some(c) = qp.pop_completion() {
                break c;
            }
            assert!(Instant::now() < deadline, "I/O timed out");
        };
        c.result.expect("I/O");
        if op == IoOp::Read {
            assert_eq!(c.buf.unwrap().as_slice(), &expect[..]);
        }
    }
    drop(qp);
    ctrl.shutdown().unwrap();
}

#[test]
fn garbage_gets_a_termination_request() {
    let t = TestTarget::start(|c| c);
    let mut h = RawHost::connect(t.addr);
    let mut junk = vec![0u8; 300];
    fill_pattern(&mut junk, 3);
    junk[0] = 0x42; // not a PDU type
    h.send(&junk);
    let (fes, fei) = h.expect_close().expect("a C2HTermReq before the close");
    assert_eq!(fes, Fes::InvalidHeaderField as u16);
    assert_eq!(fei, 0, "the PDU type byte is at fault");
    still_serves(&t);
    assert!(t.counters().term_reqs >= 1);
}

#[test]
fn a_command_before_icreq_is_a_sequence_error() {
    let t = TestTarget::start(|c| c);
    let mut h = RawHost::connect(t.addr);
    h.send_cmd(Sqe::keep_alive(), &[], 0);
    assert_eq!(
        h.expect_close().map(|t| t.0),
        Some(Fes::PduSequenceError as u16)
    );
    // And a second ICReq after the first.
    let mut h = RawHost::connect(t.addr);
    h.icreq(Digests::NONE);
    let mut b = Vec::new();
    pdu::encode_ic_req(&mut b, &pdu::IcReq::default());
    h.send(&b);
    assert_eq!(
        h.expect_close().map(|t| t.0),
        Some(Fes::PduSequenceError as u16)
    );
    still_serves(&t);
}

#[test]
fn a_host_that_stops_mid_pdu_is_closed_after_the_connect_timeout() {
    let t = TestTarget::start(|mut c| {
        c.connect_timeout = Duration::from_millis(400);
        c
    });
    let mut h = RawHost::connect(t.addr);
    let mut b = Vec::new();
    pdu::encode_ic_req(&mut b, &pdu::IcReq::default());
    h.send(&b[..50]);
    // Others are served meanwhile.
    still_serves(&t);
    let start = Instant::now();
    assert_eq!(
        h.expect_close(),
        None,
        "closed without a termination request"
    );
    assert!(start.elapsed() < Duration::from_secs(3));
    // A connected queue that stops mid-PDU only loses its own connection, when its controller goes.
    let (mut admin, cntlid) = RawHost::admin_queue(t.addr, NQN, 0);
    let (mut q, _) = RawHost::io_queue(t.addr, cntlid, 1, 7, 0, Digests::NONE);
    let mut sqe = Sqe::write(1, 0, 0);
    sqe.set_sgl(&nvpoll::spec::SglDescriptor::in_capsule(0, 512));
    let mut b = Vec::new();
    pdu::encode_capsule_cmd(&mut b, &sqe, &[1u8; 512], Digests::NONE, 0);
    q.send(&b[..100]);
    still_serves(&t);
    let (cqe, _) = admin.run(Sqe::keep_alive(), &[], 0, &[]);
    assert!(cqe.status().is_success());
    drop(admin);
    assert_eq!(
        q.expect_close(),
        None,
        "the I/O queue closes with its controller"
    );
}

#[test]
fn more_commands_than_the_queue_holds() {
    let t = TestTarget::start(|c| c);
    let (_admin, cntlid) = RawHost::admin_queue(t.addr, NQN, 0);
    // Queue of 4 entries: 4 writes waiting for their data fill it, the fifth is one too many.
    let (mut q, cqe) = RawHost::io_queue(t.addr, cntlid, 1, 3, 0, Digests::NONE);
    assert!(cqe.status().is_success());
    for cid in 0..4u16 {
        let mut sqe = Sqe::write(1, u64::from(cid) * 64, 63);
        sqe.cid = cid;
        q.send_cmd(sqe, &[], 32768);
        assert!(matches!(q.recv(), Some(Resp::R2T(r)) if r.cccid == cid));
    }
    let mut sqe = Sqe::write(1, 1024, 63);
    sqe.cid = 9;
    q.send_cmd(sqe, &[], 32768);
    assert_eq!(
        q.expect_close().map(|t| t.0),
        Some(Fes::PduSequenceError as u16)
    );
    still_serves(&t);
}

#[test]
fn duplicate_command_ids_and_bad_transfer_tags() {
    let t = TestTarget::start(|c| c);
    let (_admin, cntlid) = RawHost::admin_queue(t.addr, NQN, 0);
    let (mut q, _) = RawHost::io_queue(t.addr, cntlid, 1, 7, 0, Digests::NONE);
    let mut sqe = Sqe::write(1, 0, 63);
    sqe.cid = 3;
    q.send_cmd(sqe, &[], 32768);
    assert!(matches!(q.recv(), Some(Resp::R2T(_))));
    q.send_cmd(sqe, &[], 32768);
    assert_eq!(q.expect_close(), Some((Fes::InvalidHeaderField as u16, 10)));

    let (mut q, _) = RawHost::io_queue(t.addr, cntlid, 2, 7, 0, Digests::NONE);
    q.send_cmd(sqe, &[], 32768);
    let Some(Resp::R2T(r)) = q.recv() else {
        panic!("expected R2T")
    };
    let mut b = Vec::new();
    let hdr = pdu::H2CDataHdr {
        cccid: 3,
        ttag: r.ttag + 1,
        datao: 0,
        datal: 512,
        last: false,
    };
    pdu::encode_h2c_data(&mut b, &hdr, &[0u8; 512], Digests::NONE, 0);
    q.send(&b);
    assert_eq!(q.expect_close(), Some((Fes::InvalidHeaderField as u16, 10)));

    // Data beyond what the R2T asked for.
    let (mut q, _) = RawHost::io_queue(t.addr, cntlid, 3, 7, 0, Digests::NONE);
    q.send_cmd(sqe, &[], 32768);
    let Some(Resp::R2T(r)) = q.recv() else {
        panic!("expected R2T")
    };
    let mut b = Vec::new();
    let hdr = pdu::H2CDataHdr {
        cccid: 3,
        ttag: r.ttag,
        datao: 32768 - 512,
        datal: 1024,
        last: true,
    };
    pdu::encode_h2c_data(&mut b, &hdr, &[0u8; 1024], Digests::NONE, 0);
    q.send(&b);
    assert_eq!(
        q.expect_close().map(|t| t.0),
        Some(Fes::DataOutOfRange as u16)
    );
    still_serves(&t);
}

#[test]
fn header_digest_error_terminates() {
    let t = TestTarget::start(|c| c);
    let (_admin, cntlid) = RawHost::admin_queue(t.addr, NQN, 0);
    let (mut q, _) = RawHost::io_queue(
        t.addr,
        cntlid,
        1,
        7,
        0,
        Digests {
            header: true,
            data: false,
        },
    );
    let mut sqe = Sqe::read(1, 0, 0);
    sqe.set_sgl(&nvpoll::spec::SglDescriptor::transport_data_block(512));
    let mut b = Vec::new();
    pdu::encode_capsule_cmd(&mut b, &sqe, &[], q.digests, 0);
    b[72] ^= 1; // first byte of the header digest
    q.send(&b);
    assert_eq!(
        q.expect_close().map(|t| t.0),
        Some(Fes::HeaderDigestError as u16)
    );
    still_serves(&t);
}

#[test]
fn vanishing_hosts_release_their_controllers() {
    let t = TestTarget::start(|c| c);
    // A host that disappears in the middle of writes, leaving R2Ts unanswered.
    let mut ctrl =
        TcpController::connect(ConnectOptions::new(t.addr, NQN, HOSTNQN), pool()).unwrap();
    let cntlid = ctrl.cntlid();
    let mut qp = ctrl.create_queue_pair(16).unwrap();
    let p = ctrl.pool().clone();
    for i in 0..16u64 {
        let b = p.alloc(65536).unwrap();
        qp.submit(IoRequest {
            op: IoOp::Write,
            nsid: 1,
            lba: i * 128,
            blocks: 128,
            buf: Some(b),
            tag: i,
        })
        .map_err(|r| r.error)
        .unwrap();
    }
    qp.flush().unwrap();
    let accepted = t.counters().accepted;
    drop(qp);
    drop(ctrl);
    t.wait_counters("both connections to close", |c| c.closed >= accepted);
    // Its controller ID no longer takes I/O queues.
    let (h, cqe) = RawHost::io_queue(t.addr, cntlid, 2, 7, 0, Digests::NONE);
    assert!(cqe.status().is(Status::CONNECT_INVALID_PARAMETERS));
    drop(h);
    // Raw sockets that connect and close at every stage.
    drop(TcpStream::connect(t.addr).unwrap());
    let mut s = TcpStream::connect(t.addr).unwrap();
    s.write_all(&[0u8; 7]).unwrap();
    drop(s);
    let mut h = RawHost::connect(t.addr);
    h.icreq(Digests::BOTH);
    drop(h);
    still_serves(&t);
    let c = t.wait_counters("every connection to close", |c| c.closed == c.accepted);
    assert_eq!(c.dropped, 0);
}

#[test]
fn many_hostile_clients_at_once_while_a_good_one_works() {
    let t = TestTarget::start(|mut c| {
        c.connect_timeout = Duration::from_millis(500);
        c
    });
    let addr = t.addr;
    let bad: Vec<_> = (0..8u64)
        .map(|i| {
            std::thread::spawn(move || {
                for round in 0..5u64 {
                    let mut h = RawHost::connect(addr);
                    let mut junk = vec![0u8; 200 + (i * 37 + round * 11) as usize % 900];
                    fill_pattern(&mut junk, i * 100 + round);
                    if round % 2 == 0 {
                        // Start well, then derail.
                        h.icreq(Digests::NONE);
                    }
                    let _ = h.s.write_all(&junk);
                    h.expect_close();
                }
            })
        })
        .collect();
    for _ in 0..3 {
        still_serves(&t);
    }
    for b in bad {
        b.join().expect("hostile client thread");
    }
    let c = t.wait_counters("every connection to close", |c| c.closed == c.accepted);
    assert!(c.term_reqs >= 30, "{c}");
}

#[test]
fn a_host_that_does_not_read_its_responses() {
    let t = TestTarget::start(|c| c);
    let (_admin, cntlid) = RawHost::admin_queue(t.addr, NQN, 0);
    let (mut q, _) = RawHost::io_queue(t.addr, cntlid, 1, 127, 0, Digests::NONE);
    // 200 reads of 1 MiB, sent without reading anything back: the target stops taking commands once a few MiB
    // wait to be sent, and goes on when the host reads.
    let mut batch = Vec::new();
    for cid in 0..200u16 {
        let mut sqe = Sqe::read(1, u64::from(cid) * 2048 % 100_000, 2047);
        sqe.cid = cid;
        sqe.set_sgl(&nvpoll::spec::SglDescriptor::transport_data_block(1 << 20));
        pdu::encode_capsule_cmd(&mut batch, &sqe, &[], Digests::NONE, 0);
    }
    let held_before = t.wait_counters("the connects to be counted", |c| c.commands >= 3);
    let before = held_before.commands;
    q.send(&batch);
    // The session says when it stops taking commands; it must have stopped well short of all 200, and
    // still be stopped once another host has been served meanwhile.
    let held = t.wait_counters("the session to hold back", |c| c.held_back > 0);
    let taken = held.commands - before;
    assert!(
        taken < 100,
        "the target took {taken} of 200 commands from a host that reads nothing"
    );
    still_serves(&t);
    // Reads answered into the send buffer: the held host's, and the one read of still_serves.
    let c = t.counters();
    let answered = c.reads - held_before.reads - 1;
    assert!(
        answered < 100,
        "the target went on taking reads from a host that reads nothing ({answered}): {c}"
    );
    let mut done = 0;
    let mut bytes = 0usize;
    while done < 200 {
        match q.recv() {
            Some(Resp::C2H { data, .. }) => bytes += data.len(),
            Some(Resp::Cqe(cqe)) => {
                assert!(cqe.status().is_success());
                done += 1;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(bytes, 200 << 20);
}

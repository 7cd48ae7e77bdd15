//! Our initiator against our target over loopback: bring-up and Identify, write/read/verify of many sizes
//! (in-capsule and R2T), with and without digests, several queues at once, write zeroes and flush, a file-backed
//! namespace, and admin commands.

use nvpoll_testkit::target as target_common;

use std::time::{Duration, Instant};

use nvpoll::api::{Completion, Controller, IoOp, IoRequest, QueuePair};
use nvpoll::mem::DmaPool;
use nvpoll::spec::{self, log_page, Sqe};
use nvpoll_target::{Backing, SubsystemConfig, TargetConfig};
use nvpoll_tcp::host::{ConnectOptions, TcpController, TcpQueuePair};
use target_common::{fill_pattern, pool, wait_one, TestTarget, HOSTNQN, NQN, NS1_BYTES, NS2_BYTES};

fn attach(
    t: &TestTarget,
    nqn: &str,
    header_digest: bool,
    data_digest: bool,
    pool: DmaPool,
) -> TcpController {
    let mut o = ConnectOptions::new(t.addr, nqn, HOSTNQN);
    o.header_digest = header_digest;
    o.data_digest = data_digest;
    TcpController::connect(o, pool).expect("attach to our target")
}

fn run_one(qp: &mut TcpQueuePair, req: IoRequest) -> Completion {
    qp.submit(req).map_err(|r| r.error).expect("submit");
    qp.flush().expect("flush");
    wait_one(qp)
}

fn io(op: IoOp, nsid: u32, lba: u64, blocks: u32, buf: Option<nvpoll::mem::DmaBuf>) -> IoRequest {
    IoRequest {
        op,
        nsid,
        lba,
        blocks,
        buf,
        tag: 0,
    }
}

#[test]
fn identify_controller_and_namespaces() {
    let t = TestTarget::start(|c| c);
    let ctrl = attach(&t, NQN, false, false, pool());
    let id = ctrl.identify();
    assert_eq!(id.model, "nvpoll");
    assert_eq!(id.subnqn, NQN);
    assert_eq!(id.cntlid, ctrl.cntlid());
    assert_eq!(id.cntrltype, spec::IdentifyController::CNTRLTYPE_IO);
    assert_eq!(id.mdts, 8, "1 MiB transfers");
    assert_eq!(id.ioccsz, (8192 + 64) / 16, "8 KiB of in-capsule data");
    assert_eq!(id.iorcsz, 1);
    assert_eq!(id.icdoff, 0);
    assert!(id.supports_sgls());
    assert!(
        id.sgls & (1 << 20) != 0 && id.sgls & (1 << 21) != 0,
        "offset and transport SGL data blocks"
    );
    assert!(id.kas > 0, "keep-alive is supported");
    assert_eq!(id.maxcmd, 128);
    assert_eq!(
        id.nn,
        nvpoll_target::MAX_NAMESPACES,
        "namespaces may be added at run time"
    );
    assert!(!id.serial.is_empty() && !id.firmware.is_empty());
    assert!(ctrl.vs().0 >= spec::Vs::V1_3.0);
    assert_eq!(ctrl.cap().mqes(), 127);
    assert_eq!(ctrl.max_transfer(), Some(1 << 20));
    let ns = ctrl.namespaces();
    assert_eq!(ns.len(), 2);
    assert_eq!(
        (ns[0].nsid, ns[0].block_size, ns[0].capacity_bytes()),
        (1, 512, NS1_BYTES)
    );
    assert_eq!(
        (ns[1].nsid, ns[1].block_size, ns[1].capacity_bytes()),
        (2, 4096, NS2_BYTES)
    );
    assert!(ctrl.io_queues_allowed() >= 1);
    ctrl.shutdown().expect("CC.SHN shutdown completes");
    let lines = t.events_matching("admin queue of controller");
    assert_eq!(lines.len(), 1, "one line per connection: {lines:?}");
}

/// Writes then reads back `blocks` at a few places with each size, checking the data.
fn write_read_verify(header_digest: bool, data_digest: bool) {
    let t = TestTarget::start(|c| c);
    let mut ctrl = attach(&t, NQN, header_digest, data_digest, pool());
    let mut qp = ctrl.create_queue_pair(32).expect("I/O queue");
    let p = ctrl.pool().clone();
    // 512-byte blocks: 1 block, 4 KiB and 8 KiB in the capsule, then R2T from 8 KiB + 512 up to 1 MiB.
    for (nsid, bs) in [(1u32, 512u32), (2, 4096)] {
        for blocks in [1u32, 8, 16, 17, 64, 255, 256, 2048 * 512 / bs] {
            let len = (blocks * bs) as usize;
            if len > 1 << 20 {
                continue;
            }
            let lba = u64::from(blocks) * 3 + u64::from(nsid);
            let mut w = p.alloc(len).unwrap();
            fill_pattern(
                w.as_mut_slice(),
                lba ^ u64::from(blocks) << 20 ^ u64::from(nsid),
            );
            let expect = w.as_slice().to_vec();
            let c = run_one(&mut qp, io(IoOp::Write, nsid, lba, blocks, Some(w)));
            c.result
                .unwrap_or_else(|e| panic!("write ns {nsid} {blocks} blocks: {e}"));
            let r = p.alloc(len).unwrap();
            let c = run_one(&mut qp, io(IoOp::Read, nsid, lba, blocks, Some(r)));
            c.result
                .unwrap_or_else(|e| panic!("read ns {nsid} {blocks} blocks: {e}"));
            assert!(
                c.buf.unwrap().as_slice() == &expect[..],
                "ns {nsid}: {blocks} blocks read back differ"
            );
        }
    }
    let counters = t.wait_counters("the writes to be counted", |c| c.writes >= 14);
    assert!(
        counters.r2ts > 0,
        "large writes went through R2T: {counters}"
    );
    drop(qp);
    ctrl.shutdown().unwrap();
}

/// Reads of every size answered by a C2HData that says SUCCESS and nothing more, where our host disables SQ
/// flow control (the default), and by C2HData and a response capsule where it keeps it (`sq_flow_control`):
/// the PDUs the host receives per read tell which, and the data is right either way.
fn reads_and_pdus_received(sq_flow_control: bool) -> Vec<(u32, u64)> {
    let t = TestTarget::start(|c| c);
    let mut o = ConnectOptions::new(t.addr, NQN, HOSTNQN);
    o.sq_flow_control = sq_flow_control;
    let mut ctrl = TcpController::connect(o, pool()).expect("attach to our target");
    let mut qp = ctrl.create_queue_pair(32).expect("I/O queue");
    let p = ctrl.pool().clone();
    let mut seen = Vec::new();
    // 512-byte blocks: one C2HData up to the target's 128 KiB per PDU, several beyond.
    for blocks in [1u32, 8, 256, 2048] {
        let len = blocks as usize * 512;
        let mut w = p.alloc(len).unwrap();
        fill_pattern(w.as_mut_slice(), u64::from(blocks) << 7);
        let expect = w.as_slice().to_vec();
        let c = run_one(&mut qp, io(IoOp::Write, 1, 0, blocks, Some(w)));
        c.result
            .unwrap_or_else(|e| panic!("write {blocks} blocks: {e}"));
        let before = qp.conn_stats().pdus_rx;
        let c = run_one(
            &mut qp,
            io(IoOp::Read, 1, 0, blocks, Some(p.alloc(len).unwrap())),
        );
        c.result
            .unwrap_or_else(|e| panic!("read {blocks} blocks: {e}"));
        assert!(
            c.buf.unwrap().as_slice() == &expect[..],
            "{blocks} blocks read back differ"
        );
        seen.push((blocks, qp.conn_stats().pdus_rx - before));
    }
    drop(qp);
    ctrl.shutdown().unwrap();
    seen
}

#[test]
fn reads_complete_on_their_last_c2hdata_without_sq_flow_control() {
    let off = reads_and_pdus_received(false);
    let on = reads_and_pdus_received(true);
    for ((blocks, without), (_, with)) in off.iter().zip(&on) {
        assert!(*without >= 1, "{blocks} blocks: at least one C2HData");
        assert_eq!(
            *with,
            without + 1,
            "{blocks} blocks: flow control on adds the response capsule (off: {without} PDUs, on: {with})"
        );
    }
    assert_eq!(
        off[0].1, 1,
        "a 512-byte read is one PDU without flow control: {off:?}"
    );
}

/// A write whose R2T the host answers in many H2CData PDUs (MAXH2CDATA small against the write): the host
/// gathers up to eight into one send, and sends a short one (below the direct-send size) through its send
/// buffer after what it gathered. Every byte must land where it belongs, with data digests checked on the way.
#[test]
fn writes_answered_in_many_h2cdata_pdus_land_whole() {
    for maxh2cdata in [4096u32, 16 << 10, 20 << 10, 128 << 10] {
        let t = TestTarget::start(|mut c| {
            c.maxh2cdata = maxh2cdata;
            c
        });
        for data_digest in [false, true] {
            let mut ctrl = attach(&t, NQN, data_digest, data_digest, pool());
            let mut qp = ctrl.create_queue_pair(8).expect("I/O queue");
            let p = ctrl.pool().clone();
            // 1 MiB: whole PDUs only; 1 MiB - 512 and 136 KiB: a last PDU of another size.
            for (k, len) in [1usize << 20, (1 << 20) - 512, 136 << 10]
                .into_iter()
                .enumerate()
            {
                let blocks = (len / 512) as u32;
                let lba = 4096 * k as u64 + 7;
                let mut w = p.alloc(len).unwrap();
                fill_pattern(w.as_mut_slice(), u64::from(maxh2cdata) << 8 ^ len as u64);
                let expect = w.as_slice().to_vec();
                let c = run_one(&mut qp, io(IoOp::Write, 1, lba, blocks, Some(w)));
                c.result.unwrap_or_else(|e| {
                    panic!("MAXH2CDATA {maxh2cdata}, digest {data_digest}: write of {len}: {e}")
                });
                let c = run_one(
                    &mut qp,
                    io(IoOp::Read, 1, lba, blocks, Some(p.alloc(len).unwrap())),
                );
                c.result.unwrap_or_else(|e| panic!("read of {len}: {e}"));
                assert!(
                    c.buf.unwrap().as_slice() == &expect[..],
                    "MAXH2CDATA {maxh2cdata}, digest {data_digest}: {len} bytes read back differ"
                );
            }
            drop(qp);
            ctrl.shutdown().unwrap();
        }
        let counters = t.counters();
        assert_eq!(
            (
                counters.term_reqs,
                counters.internal_errors,
                counters.errors
            ),
            (0, 0, 0),
            "MAXH2CDATA {maxh2cdata}: {counters}"
        );
    }
}

#[test]
fn write_read_verify_no_digests() {
    write_read_verify(false, false);
}

#[test]
fn write_read_verify_header_digest() {
    write_read_verify(true, false);
}

#[test]
fn write_read_verify_both_digests() {
    write_read_verify(true, true);
}

#[test]
fn many_outstanding_on_two_queues() {
    let t = TestTarget::start(|c| c);
    let mut ctrl = attach(&t, NQN, false, true, pool());
    let p = ctrl.pool().clone();
    let mut qps = [
        ctrl.create_queue_pair(64).unwrap(),
        ctrl.create_queue_pair(64).unwrap(),
    ];
    assert_ne!(qps[0].qid(), qps[1].qid());
    // Queue q writes 64 distinct 16 KiB extents (R2T) at once, on its own half of namespace 1.
    let blocks = 32u32;
    let extent = |q: usize, i: u64| (q as u64 * 64 + i) * u64::from(blocks);
    for (q, qp) in qps.iter_mut().enumerate() {
        for i in 0..64u64 {
            let mut b = p.alloc(16384).unwrap();
            fill_pattern(b.as_mut_slice(), extent(q, i));
            qp.submit(IoRequest {
                op: IoOp::Write,
                nsid: 1,
                lba: extent(q, i),
                blocks,
                buf: Some(b),
                tag: i,
            })
            .map_err(|r| r.error)
            .unwrap();
        }
        qp.flush().unwrap();
    }
    for qp in qps.iter_mut() {
        for _ in 0..64 {
            wait_one(qp).result.expect("write");
        }
        assert_eq!(qp.outstanding(), 0);
    }
    for (q, qp) in qps.iter_mut().enumerate() {
        for i in 0..64u64 {
            let b = p.alloc(16384).unwrap();
            qp.submit(IoRequest {
                op: IoOp::Read,
                nsid: 1,
                lba: extent(q, i),
                blocks,
                buf: Some(b),
                tag: i,
            })
            .map_err(|r| r.error)
            .unwrap();
        }
        qp.flush().unwrap();
        for _ in 0..64 {
            let c = wait_one(qp);
            c.result.expect("read");
            let mut want = vec![0u8; 16384];
            fill_pattern(&mut want, extent(q, c.tag));
            assert!(
                c.buf.unwrap().as_slice() == &want[..],
                "queue {q} extent {} differs",
                c.tag
            );
        }
    }
    drop(qps);
    ctrl.shutdown().unwrap();
}

#[test]
fn write_zeroes_and_flush() {
    let t = TestTarget::start(|c| c);
    let mut ctrl = attach(&t, NQN, false, false, pool());
    let mut qp = ctrl.create_queue_pair(8).unwrap();
    let p = ctrl.pool().clone();
    let mut w = p.alloc(8 * 4096).unwrap();
    fill_pattern(w.as_mut_slice(), 99);
    let expect = w.as_slice().to_vec();
    run_one(&mut qp, io(IoOp::Write, 2, 100, 8, Some(w)))
        .result
        .unwrap();
    run_one(&mut qp, io(IoOp::WriteZeroes, 2, 102, 3, None))
        .result
        .unwrap();
    run_one(&mut qp, io(IoOp::Flush, 2, 0, 0, None))
        .result
        .unwrap();
    let c = run_one(
        &mut qp,
        io(IoOp::Read, 2, 100, 8, Some(p.alloc(8 * 4096).unwrap())),
    );
    c.result.unwrap();
    let got = c.buf.unwrap();
    assert_eq!(&got.as_slice()[..2 * 4096], &expect[..2 * 4096]);
    assert!(
        got.as_slice()[2 * 4096..5 * 4096].iter().all(|&b| b == 0),
        "zeroed blocks read as zeroes"
    );
    assert_eq!(&got.as_slice()[5 * 4096..], &expect[5 * 4096..]);
    drop(qp);
    ctrl.shutdown().unwrap();
}

#[test]
fn file_backed_namespace_holds_the_data() {
    let dir = std::env::temp_dir().join(format!("nvpoll-target-file-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("ns.img");
    std::fs::File::create(&path)
        .unwrap()
        .set_len(8 << 20)
        .unwrap();
    let nqn = "nqn.2024-01.io.nvpoll:file";
    let subsys = SubsystemConfig::new(nqn).namespace(Backing::File(path.clone()), 4096);
    let t =
        TestTarget::start_with(TargetConfig::new("127.0.0.1:0".parse().unwrap()).subsystem(subsys));
    let mut ctrl = attach(&t, nqn, false, false, pool());
    assert_eq!(ctrl.namespaces()[0].capacity_bytes(), 8 << 20);
    let mut qp = ctrl.create_queue_pair(4).unwrap();
    let p = ctrl.pool().clone();
    let mut w = p.alloc(64 * 1024).unwrap();
    fill_pattern(w.as_mut_slice(), 7);
    let expect = w.as_slice().to_vec();
    run_one(&mut qp, io(IoOp::Write, 1, 10, 16, Some(w)))
        .result
        .unwrap();
    run_one(&mut qp, io(IoOp::Flush, 1, 0, 0, None))
        .result
        .expect("flush waits for fdatasync");
    let on_disk = std::fs::read(&path).unwrap();
    assert!(
        on_disk[10 * 4096..26 * 4096] == expect[..],
        "the file holds what was written"
    );
    drop(qp);
    ctrl.shutdown().unwrap();
    drop(t);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn admin_log_pages_and_features() {
    let t = TestTarget::start(|c| c);
    let mut ctrl = attach(&t, NQN, false, false, pool());
    let p = ctrl.pool().clone();
    let (cqe, buf) = ctrl
        .admin(
            Sqe::get_log_page(log_page::SMART, 0xffff_ffff, 512, 0),
            Some(p.alloc(512).unwrap()),
        )
        .unwrap();
    assert!(cqe.status().is_success());
    let smart = spec::SmartLog::parse(buf.unwrap().as_slice()).unwrap();
    assert_eq!(smart.available_spare, 100);
    assert!(smart.temperature > 273);
    // Commands Supported and Effects (blktests nvme/025 reads it with `nvme effects-log`), announced in LPA:
    // every command the target runs is marked supported, only the writes change block content, and what it
    // refuses (Format NVM, Dataset Management for now) is not.
    assert_eq!(
        ctrl.identify().lpa & 1 << 1,
        1 << 1,
        "LPA announces the page"
    );
    let (cqe, buf) = ctrl
        .admin(
            Sqe::get_log_page(log_page::COMMANDS_SUPPORTED_AND_EFFECTS, 0, 4096, 0),
            Some(p.alloc(4096).unwrap()),
        )
        .unwrap();
    assert!(cqe.status().is_success());
    let page = buf.unwrap();
    let effects = |at: usize| u32::from_le_bytes(page.as_slice()[at..at + 4].try_into().unwrap());
    let admin = |op: u8| effects(4 * usize::from(op));
    let io = |op: u8| effects(1024 + 4 * usize::from(op));
    for op in [
        spec::admin::GET_LOG_PAGE,
        spec::admin::IDENTIFY,
        spec::admin::ABORT,
        spec::admin::SET_FEATURES,
        spec::admin::GET_FEATURES,
        spec::admin::ASYNC_EVENT_REQUEST,
        spec::admin::KEEP_ALIVE,
    ] {
        assert_eq!(admin(op), 1, "admin opcode {op:#x}: supported, no effects");
    }
    assert_eq!(admin(spec::admin::FORMAT_NVM), 0);
    assert_eq!((io(spec::io::READ), io(spec::io::FLUSH)), (1, 1));
    assert_eq!((io(spec::io::WRITE), io(spec::io::WRITE_ZEROES)), (3, 3));
    assert_eq!(
        io(spec::io::DSM),
        3,
        "Dataset Management deallocates: it changes content"
    );
    assert_eq!(io(spec::io::COMPARE), 0);
    let (cqe, _) = ctrl
        .admin(Sqe::get_features(spec::feature::NUMBER_OF_QUEUES), None)
        .unwrap();
    assert!(cqe.status().is_success());
    // 128 by default, as nvmet and SPDK grant (issue 14: 64 stopped a qd1 x 128 jobs run).
    assert_eq!(spec::feature::num_queues_granted(cqe.dw0), (128, 128));
    let (cqe, _) = ctrl
        .admin(Sqe::get_features(spec::feature::KEEP_ALIVE_TIMER), None)
        .unwrap();
    assert_eq!(cqe.dw0, 10_000, "KATO from Connect");
    let (cqe, _) = ctrl
        .admin(
            Sqe::set_features(spec::feature::VOLATILE_WRITE_CACHE, 0),
            None,
        )
        .unwrap();
    assert!(cqe.status().is_success());
    let (cqe, _) = ctrl
        .admin(Sqe::get_features(spec::feature::VOLATILE_WRITE_CACHE), None)
        .unwrap();
    assert_eq!(cqe.dw0, 0);
    let (cqe, _) = ctrl.admin(Sqe::keep_alive(), None).unwrap();
    assert!(cqe.status().is_success());
    let (cqe, _) = ctrl.admin(Sqe::abort(1, 5), None).unwrap();
    assert!(cqe.status().is_success());
    assert_eq!(cqe.dw0 & 1, 1, "nothing is ever aborted");
    let (cqe, _) = ctrl
        .admin(
            Sqe {
                opcode: 0x7e,
                ..Default::default()
            },
            None,
        )
        .unwrap();
    assert!(cqe.status().is(spec::Status::INVALID_OPCODE));
    let (cqe, _) = ctrl
        .admin(
            Sqe::get_log_page(0x42, 0, 512, 0),
            Some(p.alloc(512).unwrap()),
        )
        .unwrap();
    assert!(cqe.status().is(spec::Status::INVALID_LOG_PAGE));
    // Namespace identification descriptors: NGUID, UUID and CSI, stable for the subsystem.
    let (cqe, buf) = ctrl
        .admin(
            Sqe::identify(spec::cns::NS_ID_DESCRIPTORS, 1),
            Some(p.alloc(4096).unwrap()),
        )
        .unwrap();
    assert!(cqe.status().is_success());
    let descs = spec::NsIdDescriptor::decode_list(buf.unwrap().as_slice()).unwrap();
    assert_eq!(
        descs.iter().map(|d| d.nidt()).collect::<Vec<_>>(),
        vec![2, 3, 4]
    );
    ctrl.shutdown().unwrap();
}

#[test]
fn keep_alive_from_the_initiator_keeps_the_controller() {
    let t = TestTarget::start(|c| c);
    let mut o = ConnectOptions::new(t.addr, NQN, HOSTNQN);
    o.kato = Duration::from_millis(600);
    let mut ctrl = TcpController::connect(o, pool()).unwrap();
    let mut qp = ctrl.create_queue_pair(4).unwrap();
    let end = Instant::now() + Duration::from_millis(1500);
    while Instant::now() < end {
        ctrl.poll_admin().expect("admin queue stays up");
        std::thread::sleep(Duration::from_millis(20));
    }
    let c = run_one(
        &mut qp,
        io(IoOp::Read, 1, 0, 1, Some(ctrl.pool().alloc(512).unwrap())),
    );
    c.result.expect("the I/O queue still works");
    assert_eq!(t.counters().keep_alive_expired, 0);
    drop(qp);
    ctrl.shutdown().unwrap();
}

#[test]
fn queues_of_one_controller_on_different_reactors() {
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        eprintln!("skipping: needs two cores");
        return;
    }
    let subsys = SubsystemConfig::new(NQN).namespace(Backing::Ram(NS1_BYTES), 512);
    let config = TargetConfig::new("127.0.0.1:0".parse().unwrap()).subsystem(subsys);
    let t = TestTarget::start_on("0,1", config);
    let mut ctrl = attach(&t, NQN, false, false, pool());
    let p = ctrl.pool().clone();
    let mut qps = [
        ctrl.create_queue_pair(8).unwrap(),
        ctrl.create_queue_pair(8).unwrap(),
    ];
    for (i, qp) in qps.iter_mut().enumerate() {
        let mut w = p.alloc(65536).unwrap();
        fill_pattern(w.as_mut_slice(), i as u64);
        let expect = w.as_slice().to_vec();
        let lba = 1000 * i as u64;
        run_one(qp, io(IoOp::Write, 1, lba, 128, Some(w)))
            .result
            .unwrap();
        let c = run_one(
            qp,
            io(IoOp::Read, 1, lba, 128, Some(p.alloc(65536).unwrap())),
        );
        c.result.unwrap();
        assert!(c.buf.unwrap().as_slice() == &expect[..]);
    }
    // Admin on reactor 0, the I/O queues on 1 and 0: connections go round robin.
    let accepted = t.events_matching("accepted on reactor");
    assert_eq!(accepted.len(), 3, "{accepted:?}");
    assert!(
        accepted[0].ends_with("reactor 0") && accepted[1].ends_with("reactor 1"),
        "{accepted:?}"
    );
    // The admin queue's controller state is seen from the other reactor: shutting down works.
    drop(qps);
    ctrl.shutdown().unwrap();
}

/// `QueuePair::poll(max)` moves at most `max` completions per call; what it leaves in the receive buffer is
/// handed out by later polls, none lost.
#[test]
fn poll_moves_at_most_max_completions() {
    let t = TestTarget::start(|c| c);
    let mut ctrl = attach(&t, NQN, false, false, pool());
    let mut qp = ctrl.create_queue_pair(32).expect("I/O queue");
    let p = ctrl.pool().clone();
    const N: usize = 16;
    for i in 0..N {
        let r = p.alloc(4096).unwrap();
        qp.submit(io(IoOp::Read, 1, i as u64 * 8, 8, Some(r)))
            .map_err(|r| r.error)
            .expect("submit");
    }
    qp.flush().expect("flush");
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut done = 0;
    while done < N {
        let moved = qp.poll(1).expect("poll");
        assert!(moved <= 1, "poll(1) moved {moved} completions");
        while let Some(c) = qp.pop_completion() {
            c.result.expect("read");
            done += 1;
        }
        assert!(
            Instant::now() < deadline,
            "{done} of {N} reads completed in 20 s"
        );
    }
    assert_eq!(qp.outstanding(), 0);
}

/// The host asks for the I/O queues its options name and takes what the controller grants: by default every
/// queue our target allows (128 here, as the seed's 128-job shape needs), with `io_queues` fewer; past the
/// grant, connecting one more queue fails and says so, and the queues already connected still work.
#[test]
fn io_queues_asked_for_and_granted() {
    let t = TestTarget::start(|c| c);
    let mut ctrl = attach(&t, NQN, false, false, pool());
    assert_eq!(
        ctrl.io_queues_allowed(),
        128,
        "the default asks for more than our target's 128"
    );
    assert_eq!(Controller::io_queues_granted(&ctrl), Some(128));
    let mut qps: Vec<TcpQueuePair> = (0..128)
        .map(|i| {
            ctrl.create_queue_pair(2)
                .unwrap_or_else(|e| panic!("I/O queue {}: {e}", i + 1))
        })
        .collect();
    let err = ctrl.create_queue_pair(2).expect_err("a 129th queue");
    assert!(err.to_string().contains("granted 128 I/O queues"), "{err}");
    let p = ctrl.pool().clone();
    for qp in [0, 127] {
        run_one(
            &mut qps[qp],
            io(IoOp::Read, 1, 0, 8, Some(p.alloc(4096).unwrap())),
        )
        .result
        .expect("read on a granted queue");
    }
    drop(qps);
    ctrl.shutdown().unwrap();

    let mut o = ConnectOptions::new(t.addr, NQN, HOSTNQN);
    o.io_queues = 3;
    let mut ctrl = TcpController::connect(o, pool()).expect("attach");
    assert_eq!(ctrl.io_queues_allowed(), 3, "never more than asked for");
    let qps: Vec<TcpQueuePair> = (0..3).map(|_| ctrl.create_queue_pair(2).unwrap()).collect();
    let err = ctrl.create_queue_pair(2).expect_err("a 4th queue");
    assert!(
        err.to_string()
            .contains("granted 3 I/O queues (of 3 asked for)"),
        "{err}"
    );
    drop(qps);
    ctrl.shutdown().unwrap();

    let mut o = ConnectOptions::new(t.addr, NQN, HOSTNQN);
    o.io_queues = 0;
    let err = TcpController::connect(o, pool()).expect_err("zero queues");
    assert!(err.to_string().contains("io_queues 0"), "{err}");
}

/// The initiator's deallocate against RAM and file namespaces: the range reads back as zeroes, its
/// neighbours are intact, the file gets a hole, and Identify says so (ONCS, DLFEAT).
#[test]
fn deallocate_reads_back_zeroes_on_ram_and_file() {
    use std::os::unix::fs::MetadataExt;
    let dir = std::env::temp_dir().join(format!("nvpoll-target-trim-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("ns.img");
    std::fs::File::create(&path)
        .unwrap()
        .set_len(8 << 20)
        .unwrap();
    let nqn = "nqn.2024-01.io.nvpoll:trim";
    let subsys = SubsystemConfig::new(nqn)
        .namespace(Backing::Ram(8 << 20), 4096)
        .namespace(Backing::File(path.clone()), 4096);
    let t =
        TestTarget::start_with(TargetConfig::new("127.0.0.1:0".parse().unwrap()).subsystem(subsys));
    let mut ctrl = attach(&t, nqn, false, false, pool());
    assert_ne!(
        ctrl.identify().oncs & spec::IdentifyController::ONCS_DSM,
        0,
        "ONCS announces Dataset Management"
    );
    let mut qp = ctrl.create_queue_pair(8).unwrap();
    let p = ctrl.pool().clone();
    for nsid in [1u32, 2] {
        // 512 blocks (2 MiB) of a pattern, then blocks 5..300 deallocated.
        let mut w = p.alloc(1 << 20).unwrap();
        for half in 0..2u64 {
            fill_pattern(w.as_mut_slice(), u64::from(nsid) * 10 + half);
            let c = run_one(&mut qp, io(IoOp::Write, nsid, half * 256, 256, Some(w)));
            c.result.unwrap();
            w = c.buf.unwrap();
        }
        if nsid == 2 {
            run_one(&mut qp, io(IoOp::Flush, 2, 0, 0, None))
                .result
                .unwrap();
        }
        let before = std::fs::metadata(&path).unwrap().blocks();
        let c = run_one(
            &mut qp,
            io(IoOp::Deallocate, nsid, 5, 295, Some(p.alloc(4096).unwrap())),
        );
        c.result.unwrap();
        if nsid == 2 {
            let after = std::fs::metadata(&path).unwrap().blocks();
            assert!(
                after < before,
                "the file has no hole: {before} -> {after} 512-byte blocks"
            );
        }
        for half in 0..2u64 {
            let c = run_one(
                &mut qp,
                io(
                    IoOp::Read,
                    nsid,
                    half * 256,
                    256,
                    Some(p.alloc(1 << 20).unwrap()),
                ),
            );
            c.result.unwrap();
            let got = c.buf.unwrap();
            let mut want = vec![0u8; 1 << 20];
            fill_pattern(&mut want, u64::from(nsid) * 10 + half);
            for lba in half * 256..half * 256 + 256 {
                if (5..300).contains(&lba) {
                    want[(lba - half * 256) as usize * 4096..][..4096].fill(0);
                }
            }
            assert!(
                got.as_slice() == &want[..],
                "namespace {nsid}, blocks {}..{}",
                half * 256,
                half * 256 + 256
            );
        }
    }
    // The API's own checks: a range past the end, no blocks, no buffer for the range.
    for (lba, blocks, buf) in [(2040u64, 9u32, true), (0, 0, true), (0, 1, false)] {
        let buf = buf.then(|| p.alloc(4096).unwrap());
        let r = qp.submit(io(IoOp::Deallocate, 1, lba, blocks, buf));
        assert!(
            matches!(r, Err(ref e) if matches!(e.error, nvpoll::Error::InvalidArgument(_))),
            "lba {lba} blocks {blocks}: {r:?}"
        );
    }
    drop(qp);
    ctrl.shutdown().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

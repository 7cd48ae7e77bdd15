//! Send modes: what each mode puts on the wire, and that no mode reorders, duplicates or loses a PDU, even when
//! the peer stops reading and the socket pushes back.

use nvpoll_testkit::target as target_common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use nvpoll::api::{Controller, IoOp, IoRequest, QueuePair};
use nvpoll::mem::DmaPool;
use nvpoll::send::SendMode;
use nvpoll::spec::Sqe;
use nvpoll_tcp::host::{ConnectOptions, TcpController};
use nvpoll_tcp::pdu::{self, Decoded, Pdu};
use nvpoll_tcp::queue::{DataDir, HostQueue, QueueParams};
use target_common::{fill_pattern, TestTarget, HOSTNQN, NQN};

const COMMANDS: usize = 1024;
const DATA: usize = 16 * 1024;

/// The host submits 1024 writes of 16 KiB in-capsule data to a peer that reads nothing until told to, so the
/// socket fills and the host's writes come back short or with EAGAIN. Then the peer reads everything and checks
/// that the byte stream is exactly the 1024 capsules, in submission order, each with its own data.
fn stream_survives_backpressure(mode: SendMode) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let (start_reading, go) = mpsc::channel::<()>();
    let peer = thread::spawn(move || -> Vec<(u16, u64)> {
        let (mut s, _) = l.accept().unwrap();
        let mut icreq = [0u8; 128];
        s.read_exact(&mut icreq).unwrap();
        let mut resp = Vec::new();
        let ic = pdu::IcResp {
            pfv: 0,
            cpda: 0,
            digests: pdu::Digests::NONE,
            maxh2cdata: 128 * 1024,
        };
        pdu::encode_ic_resp(&mut resp, &ic);
        s.write_all(&resp).unwrap();
        go.recv().unwrap();
        let cfg = pdu::DecodeConfig::new(
            pdu::Direction::ToController,
            pdu::Digests::NONE,
            DATA as u32,
        );
        let mut buf = Vec::new();
        let mut seen = Vec::new();
        let mut chunk = vec![0u8; 1 << 16];
        while seen.len() < COMMANDS {
            let n = s.read(&mut chunk).unwrap();
            assert!(n > 0, "the host closed after {} capsules", seen.len());
            buf.extend_from_slice(&chunk[..n]);
            let mut off = 0;
            while let Decoded::Pdu { pdu, len } =
                pdu::decode(&buf[off..], &cfg).expect("a well-formed PDU")
            {
                let Pdu::CapsuleCmd { sqe, data } = pdu else {
                    panic!("expected only command capsules")
                };
                assert_eq!(data.len(), DATA);
                let seed = u64::from_le_bytes(data[..8].try_into().unwrap());
                let mut expect = vec![0u8; DATA];
                fill_pattern(&mut expect, seed);
                assert!(
                    data[8..] == expect[8..],
                    "capsule {} carries someone else's data",
                    seen.len()
                );
                seen.push((sqe.cid, sqe.cdw10 as u64));
                off += len;
            }
            buf.drain(..off);
        }
        seen
    });

    let pool = DmaPool::builder().class(DATA, COMMANDS).build().unwrap();
    let mut q = HostQueue::connect(&QueueParams {
        addr,
        qid: 1,
        depth: COMMANDS as u16,
        header_digest: false,
        data_digest: false,
        max_transfer: DATA as u32,
        connect_timeout: Duration::from_secs(5),
        tls: None,
        key_renewal: Default::default(),
        tcp_congestion: None,
    })
    .unwrap();
    q.set_incapsule_max(DATA as u32);
    q.set_send_mode(mode);
    let mut pushed_back = false;
    for i in 0..COMMANDS {
        let mut buf = pool.alloc(DATA).unwrap();
        let seed = 1000 + i as u64;
        fill_pattern(buf.as_mut_slice(), seed);
        buf.as_mut_slice()[..8].copy_from_slice(&seed.to_le_bytes());
        // The LBA (cdw10) records the submission order.
        q.submit(
            Sqe::write(1, i as u64, 31),
            DataDir::ToController,
            Some(buf),
            DATA as u32,
            i as u64,
        )
        .map_err(|(e, _)| e)
        .unwrap();
        if i % 16 == 15 && !q.flush().unwrap() {
            pushed_back = true;
        }
    }
    pushed_back |= !q.flush().unwrap();
    assert!(
        pushed_back,
        "16 MiB should not fit in the socket buffers: the test did not exercise backpressure"
    );
    start_reading.send(()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !q.flush().unwrap() {
        assert!(
            Instant::now() < deadline,
            "the send buffer did not drain in 30 s"
        );
        thread::yield_now();
    }
    let seen = peer.join().expect("the peer saw a correct stream");
    let order: Vec<u64> = seen.iter().map(|&(_, lba)| lba).collect();
    assert_eq!(
        order,
        (0..COMMANDS as u64).collect::<Vec<_>>(),
        "capsules arrive once each, in order"
    );
    assert_eq!(q.outstanding(), COMMANDS);
    assert_eq!(
        q.conn_stats().pdus_tx,
        COMMANDS as u64 + 1,
        "1024 capsules and the ICReq"
    );
}

#[test]
fn inline_stream_survives_backpressure() {
    stream_survives_backpressure(SendMode::Inline);
}

#[test]
fn deferred_stream_survives_backpressure() {
    stream_survives_backpressure(SendMode::Deferred);
}

#[test]
fn adaptive_stream_survives_backpressure() {
    stream_survives_backpressure(SendMode::Adaptive);
}

/// Against our target: each mode on both sides moves and verifies data, and its write counts are what the mode
/// promises (inline: a write per command; deferred: one per batch).
#[test]
fn modes_against_our_target() {
    let target = TestTarget::start(|c| c);
    let pool = DmaPool::builder().class(4096, 512).build().unwrap();
    let mut ctrl =
        TcpController::connect(ConnectOptions::new(target.addr, NQN, HOSTNQN), pool.clone())
            .expect("connect");
    let ns = ctrl.namespaces()[0].clone();
    let blocks = 4096 / ns.block_size;
    for mode in SendMode::ALL {
        target.handle.set_send_mode(mode);
        let mut qp = ctrl.create_queue_pair(64).unwrap();
        qp.set_send_mode(mode).unwrap();
        let before = qp.stats();
        for op in [IoOp::Write, IoOp::Read] {
            // One batch of 64 commands, submitted back to back, then reaped.
            for i in 0..64u64 {
                let mut buf = pool.alloc(4096).unwrap();
                if op == IoOp::Write {
                    fill_pattern(buf.as_mut_slice(), i + 7);
                }
                let lba = i * u64::from(blocks);
                qp.submit(IoRequest {
                    op,
                    nsid: ns.nsid,
                    lba,
                    blocks,
                    buf: Some(buf),
                    tag: i,
                })
                .map_err(|r| r.error)
                .unwrap();
            }
            qp.flush().unwrap();
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut done = 0;
            while done < 64 {
                qp.poll(64).unwrap();
                while let Some(c) = qp.pop_completion() {
                    c.result
                        .unwrap_or_else(|e| panic!("{mode}: {op:?} {}: {e}", c.tag));
                    if op == IoOp::Read {
                        let mut expect = vec![0u8; 4096];
                        fill_pattern(&mut expect, c.tag + 7);
                        assert!(
                            c.buf.unwrap().as_slice() == &expect[..],
                            "{mode}: read {} mismatches",
                            c.tag
                        );
                    }
                    done += 1;
                }
                assert!(
                    Instant::now() < deadline,
                    "{mode}: completions did not arrive"
                );
            }
        }
        let s = qp.stats().since(&before);
        assert_eq!(s.commands, 128);
        match mode {
            SendMode::Inline => assert!(s.writes >= 120, "inline writes each command: {s:?}"),
            SendMode::Deferred => assert!(s.writes <= 4, "deferred writes each batch once: {s:?}"),
            // Adaptive: the first command of a batch goes inline (the queue is idle), the rest wait.
            SendMode::Adaptive => assert!(
                s.writes <= 8,
                "adaptive defers once work is in flight: {s:?}"
            ),
        }
    }
}

/// The peer resets the connection while the host still has megabytes queued: the flush fails with a typed
/// error, and every outstanding command completes exactly once, with an error, in every mode.
fn reset_mid_flush(mode: SendMode) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let peer = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut icreq = [0u8; 128];
        s.read_exact(&mut icreq).unwrap();
        let mut resp = Vec::new();
        let ic = pdu::IcResp {
            pfv: 0,
            cpda: 0,
            digests: pdu::Digests::NONE,
            maxh2cdata: 128 * 1024,
        };
        pdu::encode_ic_resp(&mut resp, &ic);
        s.write_all(&resp).unwrap();
        // Take a little of the stream, then reset (RST, not FIN) with the rest unread.
        let mut some = vec![0u8; 64 * 1024];
        s.read_exact(&mut some).unwrap();
        socket2::SockRef::from(&s)
            .set_linger(Some(Duration::ZERO))
            .unwrap();
        drop(s);
    });
    let pool = DmaPool::builder().class(DATA, COMMANDS).build().unwrap();
    let mut q = HostQueue::connect(&QueueParams {
        addr,
        qid: 1,
        depth: COMMANDS as u16,
        header_digest: false,
        data_digest: false,
        max_transfer: DATA as u32,
        connect_timeout: Duration::from_secs(5),
        tls: None,
        key_renewal: Default::default(),
        tcp_congestion: None,
    })
    .unwrap();
    q.set_incapsule_max(DATA as u32);
    q.set_send_mode(mode);
    let mut accepted = 0u64;
    let mut failed_at_submit = 0u64;
    let mut first_err = None;
    for i in 0..COMMANDS {
        let buf = pool.alloc(DATA).unwrap();
        match q.submit(
            Sqe::write(1, i as u64, 31),
            DataDir::ToController,
            Some(buf),
            DATA as u32,
            i as u64,
        ) {
            Ok(()) => accepted += 1,
            Err((_, buf)) => {
                assert!(buf.is_some(), "a refused command hands its buffer back");
                failed_at_submit += 1;
            }
        }
        if i % 16 == 15 {
            if let Err(e) = q.flush() {
                first_err.get_or_insert(e);
            }
        }
    }
    peer.join().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let err = loop {
        if let Some(e) = first_err.take() {
            break e;
        }
        // Keep flushing and polling until the reset surfaces.
        if let Err(e) = q.flush() {
            break e;
        }
        if let Err(e) = q.poll() {
            break e;
        }
        assert!(Instant::now() < deadline, "the reset never surfaced");
        thread::yield_now();
    };
    assert!(
        matches!(
            err,
            nvpoll_tcp::Error::Io { .. }
                | nvpoll_tcp::Error::Closed
                | nvpoll_tcp::Error::Protocol(_)
        ),
        "{mode}: {err:?}"
    );
    let mut completed = 0u64;
    let mut tags = std::collections::HashSet::new();
    while let Some(d) = q.pop_done() {
        assert!(
            d.result.is_err(),
            "{mode}: no write is reported done after a reset"
        );
        assert!(
            tags.insert(d.tag),
            "{mode}: command {} completed twice",
            d.tag
        );
        completed += 1;
    }
    assert_eq!(
        completed, accepted,
        "{mode}: every accepted command completes once ({failed_at_submit} refused)"
    );
    assert_eq!(q.outstanding(), 0);
}

#[test]
fn inline_reset_mid_flush() {
    reset_mid_flush(SendMode::Inline);
}

#[test]
fn deferred_reset_mid_flush() {
    reset_mid_flush(SendMode::Deferred);
}

#[test]
fn adaptive_reset_mid_flush() {
    reset_mid_flush(SendMode::Adaptive);
}

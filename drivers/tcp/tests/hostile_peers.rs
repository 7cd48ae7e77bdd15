//! Hostile peers on both sides of a connection (issue 8).
//!
//! Against our initiator, a scripted target in the test sends TLS garbage where a ServerHello belongs, garbage
//! records after a completed handshake, or its answers one byte at a time (a slowloris target), before ICResp or
//! in the middle of I/O. Each must end in a typed error within the configured timeout, with no panic, and no
//! outstanding command may complete successfully.
//!
//! Against our target, hostile hosts open hundreds of connections and never send ICReq, send ICReq or Connect
//! one byte at a time, send a thousand capsules beyond their queue size, or send TLS garbage to a target that
//! requires TLS. Each is closed (by the connect timeout where the host just stalls), a well-behaved host keeps
//! working meanwhile, every accepted connection is closed again (no leak), no panic is counted, and the
//! reactors stop cleanly when the target is dropped.
//!
//! Every wait is bounded; the only sleeps are the slowloris peers' pacing, which is the behaviour under test.

use nvpoll_testkit::target as target_common;
use nvpoll_testkit::tls as tls_common;

use std::collections::HashSet;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use nvpoll::api::{Completion, Controller, IoOp, IoRequest, QueuePair};
use nvpoll::spec::{ConnectData, Cqe, SglDescriptor, Sqe};
use nvpoll_target::TargetTls;
use nvpoll_tcp::host::{ConnectOptions, Recovery, TcpController};
use nvpoll_tcp::pdu::{self, Digests, Fes};
use nvpoll_tcp::queue::{DataDir, HostQueue, QueueParams};
use nvpoll_tcp::tls::{
    ClientConfig, ConfiguredKey, Derivation, Handshake, IdentityVersion, ServerConfig, Session,
};
use nvpoll_tcp::Error;
use target_common::{fill_pattern, pool, RawHost, Resp, TestTarget, HOSTNQN, NQN};

const KEY: &str = "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:";
/// The initiator's step timeout (TCP connect, TLS handshake, ICResp, each bring-up command).
const HOST_TIMEOUT: Duration = Duration::from_secs(1);
/// The target's time for ICReq and Connect.
const TARGET_CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
/// What a step may take beyond its timeout on a loaded two-core machine before the test calls it a hang.
const SLACK: Duration = Duration::from_secs(2);
/// The outer bound of any wait in these tests.
const BOUND: Duration = Duration::from_secs(10);
/// A slowloris peer's pace: one byte per this (one byte per second, as slow as the slowloris).
const PACE: Duration = Duration::from_secs(1);

fn tls_configs() -> (ClientConfig, ServerConfig) {
    let key = ConfiguredKey::parse(KEY).unwrap();
    let (identity, psk) = key.derive(IdentityVersion::V0, HOSTNQN, NQN, Derivation::Rfc8446);
    (
        ClientConfig::new(identity.clone(), psk.clone()),
        ServerConfig::with_psk(identity, psk),
    )
}

/// Options for our initiator with the short step timeout, and TLS if asked.
fn host_options(addr: SocketAddr, tls: bool) -> ConnectOptions {
    let mut o = ConnectOptions::new(addr, NQN, HOSTNQN);
    o.timeout = HOST_TIMEOUT;
    if tls {
        o = o.with_tls_key(&ConfiguredKey::parse(KEY).unwrap(), IdentityVersion::V0);
    }
    o
}

// ---------------------------------------------------------------------------------------------------------
// Hostile targets against our initiator.
// ---------------------------------------------------------------------------------------------------------

/// A scripted target: accepts one connection, runs `script` on it, then reads (and drops) what the host still
/// sends until the host closes, so that the host's own verdict, not a close by the peer, ends each exchange.
fn scripted_target(
    script: impl FnOnce(&mut TcpStream) + Send + 'static,
) -> (SocketAddr, JoinHandle<()>) {
    let (port, peer) = tls_common::accept_one(move |mut s| {
        script(&mut s);
        s.set_read_timeout(Some(BOUND)).unwrap();
        let mut sink = [0u8; 4096];
        while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
    });
    (SocketAddr::from(([127, 0, 0, 1], port)), peer)
}

/// Reads one TLS record (header and body) as the host sent it.
fn read_record(s: &mut TcpStream) -> Vec<u8> {
    s.set_read_timeout(Some(BOUND)).unwrap();
    let mut rec = vec![0u8; 5];
    s.read_exact(&mut rec)
        .expect("a record header from the host");
    let len = usize::from(u16::from_be_bytes([rec[3], rec[4]]));
    rec.resize(5 + len, 0);
    s.read_exact(&mut rec[5..])
        .expect("a record body from the host");
    rec
}

/// Writes `bytes` one at a time, `PACE` apart, until they are out or the host has gone. Returns how many went.
fn dribble(s: &mut TcpStream, bytes: &[u8]) -> usize {
    for (i, b) in bytes.iter().enumerate() {
        if s.write_all(std::slice::from_ref(b)).is_err() {
            return i;
        }
        thread::sleep(PACE);
    }
    bytes.len()
}

/// Attaches our initiator; returns the outcome and how long it took.
fn attach(opts: ConnectOptions) -> (Result<TcpController, Error>, Duration) {
    let start = Instant::now();
    let r = TcpController::connect(opts, pool());
    (r, start.elapsed())
}

fn plain_icresp() -> Vec<u8> {
    let mut b = Vec::new();
    pdu::encode_ic_resp(
        &mut b,
        &pdu::IcResp {
            pfv: 0,
            cpda: 0,
            digests: Digests::NONE,
            maxh2cdata: 128 * 1024,
        },
    );
    b
}

fn random(len: usize, seed: u64) -> Vec<u8> {
    let mut b = vec![0u8; len];
    fill_pattern(&mut b, seed);
    b
}

#[test]
fn initiator_tls_garbage_instead_of_server_hello_is_a_tls_error() {
    let mut not_a_record = random(600, 1);
    not_a_record[0] = 0x42;
    let mut handshake_of_garbage = vec![0x16, 0x03, 0x03, 0x01, 0x00];
    handshake_of_garbage.extend(random(256, 2));
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("bytes that are no TLS record", not_a_record),
        ("random bytes (seed 3)", random(600, 3)),
        ("random bytes (seed 4)", random(600, 4)),
        ("a plaintext ICResp", plain_icresp()),
        ("a handshake record of garbage", handshake_of_garbage),
        (
            "a record longer than TLS allows",
            vec![0x16, 0x03, 0x03, 0xff, 0xff],
        ),
        (
            "an application-data record before any key",
            [&[0x17u8, 0x03, 0x03, 0x00, 0x40][..], &random(64, 5)].concat(),
        ),
    ];
    for (what, garbage) in cases {
        let (addr, peer) = scripted_target(move |s| {
            read_record(s); // the ClientHello
            s.write_all(&garbage).unwrap();
        });
        let (r, took) = attach(host_options(addr, true));
        let e = r.expect_err(what);
        assert!(matches!(e, Error::Tls(_)), "{what}: {e:?}");
        assert!(
            took < HOST_TIMEOUT,
            "{what}: refused at once, not by a timeout ({took:?})"
        );
        peer.join().expect("scripted target");
    }
}

#[test]
fn initiator_stalled_or_slowloris_tls_handshake_times_out() {
    let (_, server_cfg) = tls_configs();
    // A record header that promises 200 bytes, 10 of them, then silence.
    let stalled = [&[0x16u8, 0x03, 0x03, 0x00, 0xc8][..], &random(10, 6)].concat();
    let (addr, stall) = scripted_target(move |s| {
        read_record(s);
        s.write_all(&stalled).unwrap();
    });
    // The server's real flight (ServerHello to Finished), one byte every 50 ms.
    let (addr2, slow) = scripted_target(move |s| {
        let mut hs = Handshake::server(server_cfg);
        let mut flight = Vec::new();
        let p = hs
            .read(&read_record(s), &mut flight)
            .expect("our ClientHello");
        assert!(
            !p.done && flight.len() > 100,
            "a whole server flight to dribble"
        );
        let sent = dribble(s, &flight);
        assert!(
            sent < flight.len(),
            "the host gave up before the flight was out"
        );
    });
    for (what, addr) in [("stalled record", addr), ("slowloris flight", addr2)] {
        let (r, took) = attach(host_options(addr, true));
        let e = r.expect_err(what);
        assert!(
            matches!(e, Error::Timeout("TLS handshake")),
            "{what}: {e:?}"
        );
        assert!(
            took >= HOST_TIMEOUT && took < HOST_TIMEOUT + SLACK,
            "{what}: gave up after {took:?}"
        );
    }
    stall.join().expect("stalled target");
    slow.join().expect("slowloris target");
}

#[test]
fn initiator_slowloris_icresp_times_out() {
    let (addr, peer) = scripted_target(|s| {
        let mut icreq = [0u8; 128];
        s.set_read_timeout(Some(BOUND)).unwrap();
        s.read_exact(&mut icreq).expect("ICReq");
        let icresp = plain_icresp();
        let sent = dribble(s, &icresp);
        assert!(
            sent < icresp.len(),
            "the host gave up before ICResp was out"
        );
    });
    let (r, took) = attach(host_options(addr, false));
    let e = r.expect_err("a slowloris ICResp");
    assert!(matches!(e, Error::Timeout("ICResp")), "{e:?}");
    assert!(
        took >= HOST_TIMEOUT && took < HOST_TIMEOUT + SLACK,
        "gave up after {took:?}"
    );
    peer.join().expect("scripted target");
}

/// A scripted TLS target that completes the handshake, answers ICReq, reads the host's first command capsule
/// and then sends what `garbage` makes of the session and that command's ID.
fn tls_target_then(
    garbage: impl FnOnce(&mut Session, u16) -> Vec<u8> + Send + 'static,
) -> (SocketAddr, JoinHandle<()>) {
    let (_, server_cfg) = tls_configs();
    scripted_target(move |s| {
        let (mut session, mut pending) =
            tls_common::server_handshake(s, server_cfg).expect("handshake with our initiator");
        let mut plain = Vec::new();
        tls_common::recv(s, &mut session, &mut pending, &mut plain, 128).expect("ICReq");
        tls_common::send(s, &mut session, &[&plain_icresp()]);
        tls_common::recv(s, &mut session, &mut pending, &mut plain, 128 + 72).expect("a command");
        let cid = u16::from_le_bytes([plain[128 + 10], plain[128 + 11]]);
        s.write_all(&garbage(&mut session, cid)).unwrap();
    })
}

/// A read is outstanding when the garbage comes: the queue fails with a TLS error, the read completes exactly
/// once and with an error, and the queue refuses further commands.
fn outstanding_read_fails(addr: SocketAddr, what: &str) {
    let (client_cfg, _) = tls_configs();
    let mut q = HostQueue::connect(&QueueParams {
        addr,
        qid: 1,
        depth: 4,
        header_digest: false,
        data_digest: false,
        max_transfer: 64 * 1024,
        connect_timeout: HOST_TIMEOUT,
        tls: Some(client_cfg),
        key_renewal: Default::default(),
        tcp_congestion: None,
    })
    .expect("TLS and ICReq with the scripted target");
    let p = pool();
    let submit_read = |q: &mut HostQueue, tag| {
        let buf = p.alloc(4096).unwrap();
        q.submit(
            Sqe::read(1, 0, 7),
            DataDir::FromController,
            Some(buf),
            4096,
            tag,
        )
        .map_err(|(e, _)| e)
    };
    submit_read(&mut q, 7).unwrap();
    q.flush().unwrap();
    let deadline = Instant::now() + BOUND;
    let e = loop {
        if let Err(e) = q.poll() {
            break e;
        }
        assert!(q.done_len() == 0, "{what}: a command completed on garbage");
        assert!(
            Instant::now() < deadline,
            "{what}: the queue neither failed nor completed"
        );
    };
    assert!(matches!(e, Error::Tls(_)), "{what}: {e:?}");
    let d = q.pop_done().expect("the outstanding read is completed");
    assert_eq!(d.tag, 7);
    assert!(
        d.result.is_err(),
        "{what}: completed as successful: {:?}",
        d.result
    );
    assert!(q.pop_done().is_none(), "{what}: completed twice");
    assert!(
        submit_read(&mut q, 8).is_err(),
        "{what}: a failed queue takes no more commands"
    );
}

#[test]
fn initiator_tls_garbage_records_after_the_handshake() {
    // Instead of ICResp: a record that does not decrypt.
    let (_, server_cfg) = tls_configs();
    let (addr, peer) = scripted_target(move |s| {
        let (_session, _) = tls_common::server_handshake(s, server_cfg).expect("handshake");
        let mut junk = vec![0x17, 0x03, 0x03, 0x00, 0x80];
        junk.extend(random(0x80, 7));
        s.write_all(&junk).unwrap();
    });
    let (r, took) = attach(host_options(addr, true));
    let e = r.expect_err("a garbage record instead of ICResp");
    assert!(matches!(e, Error::Tls(_)), "{e:?}");
    assert!(took < HOST_TIMEOUT, "refused at once ({took:?})");
    peer.join().unwrap();

    // With a read outstanding.
    type Garbage = Box<dyn FnOnce(&mut Session, u16) -> Vec<u8> + Send>;
    let cases: Vec<(&str, Garbage)> = vec![
        (
            "an application-data record of random bytes",
            Box::new(|_, _| [&[0x17u8, 0x03, 0x03, 0x00, 0x40][..], &random(64, 8)].concat()),
        ),
        (
            "the real CapsuleResp (success) with one bit flipped",
            Box::new(|session, cid| {
                let mut cqe = Vec::new();
                pdu::encode_capsule_resp(
                    &mut cqe,
                    &Cqe {
                        cid,
                        sqid: 1,
                        ..Default::default()
                    },
                    Digests::NONE,
                );
                let mut rec = Vec::new();
                session.seal(&[&cqe], &mut rec).unwrap();
                rec[12] ^= 0x10;
                rec
            }),
        ),
        (
            "bytes that are no TLS record",
            Box::new(|_, _| {
                let mut b = random(300, 9);
                b[0] = 0x42;
                b
            }),
        ),
        (
            "a record longer than TLS allows",
            Box::new(|_, _| vec![0x17, 0x03, 0x03, 0xff, 0xff]),
        ),
        (
            "a plaintext handshake record",
            Box::new(|_, _| [&[0x16u8, 0x03, 0x03, 0x00, 0x20][..], &random(32, 10)].concat()),
        ),
    ];
    for (what, garbage) in cases {
        let (addr, peer) = tls_target_then(garbage);
        outstanding_read_fails(addr, what);
        peer.join().expect(what);
    }
}

/// A proxy in front of our target. Connection number `slow` (in accept order) passes its first `fast_bytes`
/// from the target at full speed and the rest one byte every `PACE`: a target that turned slowloris in the
/// middle of I/O. The others pass untouched. It accepts for `BOUND`.
fn slowloris_proxy(upstream: SocketAddr, slow: usize, fast_bytes: usize) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    l.set_nonblocking(true).unwrap();
    thread::spawn(move || {
        let end = Instant::now() + BOUND;
        let mut n = 0;
        while Instant::now() < end {
            let host = match l.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    thread::sleep(Duration::from_millis(2));
                    continue;
                }
                Err(e) => panic!("proxy accept: {e}"),
            };
            host.set_nonblocking(false).unwrap();
            let target = TcpStream::connect(upstream).unwrap();
            for s in [&host, &target] {
                s.set_nodelay(true).unwrap();
            }
            let (h2, t2) = (host.try_clone().unwrap(), target.try_clone().unwrap());
            thread::spawn(move || pipe(host, target, usize::MAX));
            let fast = if n == slow { fast_bytes } else { usize::MAX };
            thread::spawn(move || pipe(t2, h2, fast));
            n += 1;
        }
    });
    addr
}

/// Copies `from` to `to`: `fast` bytes at once, the rest one at a time. Closes both when either side ends.
fn pipe(mut from: TcpStream, mut to: TcpStream, fast: usize) {
    let mut buf = vec![0u8; 65536];
    let mut passed = 0usize;
    'copy: while let Ok(n) = from.read(&mut buf) {
        if n == 0 {
            break;
        }
        let quick = n.min(fast.saturating_sub(passed));
        if to.write_all(&buf[..quick]).is_err() {
            break;
        }
        passed += quick;
        for b in &buf[quick..n] {
            thread::sleep(PACE);
            if to.write_all(std::slice::from_ref(b)).is_err() {
                break 'copy;
            }
        }
    }
    let _ = from.shutdown(std::net::Shutdown::Both);
    let _ = to.shutdown(std::net::Shutdown::Both);
}

#[test]
fn initiator_slowloris_target_mid_io_never_completes_a_command_as_successful() {
    let t = TestTarget::start(|c| c);
    for recovery in [Recovery::FailFast, Recovery::Retry] {
        // Connection 1 is the I/O queue: its ICResp (128 bytes) and Connect response (24) pass, then every
        // completion crawls, so each write the target performed is acknowledged far too late.
        let proxy = slowloris_proxy(t.addr, 1, 128 + 24);
        let mut o = host_options(proxy, false);
        o.io_timeout = Duration::from_millis(300);
        o.reconnect_delay = Duration::from_millis(50);
        o.recovery = recovery;
        let mut ctrl = TcpController::connect(o, pool()).expect("attach through the proxy");
        let mut qp = ctrl.create_queue_pair(8).expect("I/O queue");
        let p = ctrl.pool().clone();
        for tag in 0..8u64 {
            let mut buf = p.alloc(4096).unwrap();
            fill_pattern(buf.as_mut_slice(), tag);
            qp.submit(IoRequest {
                op: IoOp::Write,
                nsid: 1,
                lba: tag * 8,
                blocks: 8,
                buf: Some(buf),
                tag,
            })
            .map_err(|r| r.error)
            .unwrap();
        }
        qp.flush().unwrap();
        let done = collect(&mut ctrl, &mut qp, 8);
        let timed_out: Vec<_> = done
            .iter()
            .filter(|c| matches!(c.result, Err(nvpoll::Error::Timeout)))
            .map(|c| c.tag)
            .collect();
        assert!(
            !timed_out.is_empty(),
            "{recovery:?}: a command timed out: {done:?}"
        );
        for c in &done {
            // Fail-fast fails the others with the connection; retry submits them again on a new connection (which
            // the proxy passes at full speed), where the target's acknowledgement is real.
            let ok_allowed = recovery == Recovery::Retry && !timed_out.contains(&c.tag);
            assert!(
                c.result.is_err() || ok_allowed,
                "{recovery:?}: command {} completed as successful on the slowloris connection",
                c.tag
            );
        }
        assert!(qp.recovery_stats().timeouts >= 1);
        // The queue pair recovers on a new connection and works.
        let deadline = Instant::now() + BOUND;
        while !qp.is_connected() {
            ctrl.poll_admin().expect("the controller reconnects");
            qp.poll(64).unwrap();
            assert!(
                Instant::now() < deadline,
                "{recovery:?}: the queue pair never reconnected"
            );
        }
        let buf = p.alloc(4096).unwrap();
        qp.submit(IoRequest {
            op: IoOp::Read,
            nsid: 1,
            lba: 0,
            blocks: 8,
            buf: Some(buf),
            tag: 100,
        })
        .map_err(|r| r.error)
        .unwrap();
        let read = collect(&mut ctrl, &mut qp, 1);
        read[0].result.as_ref().expect("a read after recovery");
        drop(qp);
        ctrl.shutdown().expect("shutdown");
    }
    assert_clean(&t);
}

/// Polls the controller and the queue pair until `n` completions arrived (each tag at most once).
fn collect(ctrl: &mut TcpController, qp: &mut impl QueuePair, n: usize) -> Vec<Completion> {
    let deadline = Instant::now() + BOUND;
    let mut out: Vec<Completion> = Vec::new();
    while out.len() < n {
        ctrl.poll_admin().expect("the controller is not given up");
        qp.flush().unwrap();
        qp.poll(64).unwrap();
        while let Some(c) = qp.pop_completion() {
            assert!(
                out.iter().all(|o| o.tag != c.tag),
                "command {} completed twice",
                c.tag
            );
            out.push(c);
        }
        assert!(
            Instant::now() < deadline,
            "{} of {n} completions",
            out.len()
        );
    }
    out
}

// ---------------------------------------------------------------------------------------------------------
// Hostile hosts against our target.
// ---------------------------------------------------------------------------------------------------------

fn short_timeout_target(tls_required: bool) -> TestTarget {
    TestTarget::start(|mut c| {
        c.connect_timeout = TARGET_CONNECT_TIMEOUT;
        if tls_required {
            let key = ConfiguredKey::parse(KEY).unwrap();
            c.tls = Some(TargetTls::with_host_keys(
                true,
                &[(HOSTNQN.to_string(), key)],
                &[NQN.to_string()],
            ));
        }
        c
    })
}

/// Every accepted connection is closed again, none was dropped, and no session panicked.
fn assert_clean(t: &TestTarget) {
    let c = t.wait_counters("every connection to close", |c| c.closed == c.accepted);
    assert_eq!(c.internal_errors, 0, "{c}");
    assert_eq!(c.dropped, 0, "{c}");
}

/// A well-behaved host on its own thread while hostile ones work: it attaches, then writes and reads back 16 KiB
/// until `stop` is set (at least once), and returns the rounds it verified. Any failure fails the test at join.
fn good_host(opts: ConnectOptions, stop: Arc<AtomicBool>) -> JoinHandle<u64> {
    thread::spawn(move || {
        let mut ctrl = TcpController::connect(opts, pool()).expect("a good host attaches");
        let mut qp = ctrl.create_queue_pair(4).expect("I/O queue");
        let p = ctrl.pool().clone();
        let mut rounds = 0u64;
        while rounds == 0 || !stop.load(Ordering::Acquire) {
            let mut w = p.alloc(16384).unwrap();
            fill_pattern(w.as_mut_slice(), rounds);
            let expect = w.as_slice().to_vec();
            for (op, buf) in [(IoOp::Write, w), (IoOp::Read, p.alloc(16384).unwrap())] {
                let lba = 64 + (rounds % 64) * 32;
                qp.submit(IoRequest {
                    op,
                    nsid: 1,
                    lba,
                    blocks: 32,
                    buf: Some(buf),
                    tag: rounds,
                })
                .map_err(|r| r.error)
                .unwrap();
                let c = collect(&mut ctrl, &mut qp, 1).pop().unwrap();
                c.result.expect("the good host's I/O");
                if op == IoOp::Read {
                    assert!(c.buf.unwrap().as_slice() == &expect[..], "data read back");
                }
            }
            rounds += 1;
        }
        drop(qp);
        ctrl.shutdown().expect("the good host detaches");
        rounds
    })
}

/// Waits (bounded) until the target reports closing the connection from `local` and returns the reason.
fn close_reason(t: &TestTarget, local: SocketAddr) -> String {
    let needle = format!("{local}: closed: ");
    let deadline = Instant::now() + BOUND;
    loop {
        if let Some(line) = t.events_matching(&needle).pop() {
            return line[needle.len()..].to_string();
        }
        assert!(Instant::now() < deadline, "no close event for {local}");
        thread::sleep(Duration::from_millis(5));
    }
}

/// Reads until the target closes the connection (dropping what it sends); returns when that happened.
fn wait_closed(s: &mut TcpStream) -> Instant {
    s.set_read_timeout(Some(BOUND)).unwrap();
    let mut sink = [0u8; 4096];
    loop {
        match s.read(&mut sink) {
            Ok(0) => return Instant::now(),
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return Instant::now(),
            Err(e) => panic!("the target did not close the connection: {e}"),
        }
    }
}

#[test]
fn target_connection_flood_without_icreq_is_reaped_and_does_not_leak() {
    let t = short_timeout_target(false);
    let flood: Vec<(TcpStream, Instant)> = (0..200)
        .map(|_| {
            // Stamped before the connect: the target's clock for the connection starts after it.
            let opened = Instant::now();
            (TcpStream::connect(t.addr).expect("flood connect"), opened)
        })
        .collect();
    // The good host works while 200 connections sit there without ICReq.
    let stop = Arc::new(AtomicBool::new(false));
    let good = good_host(host_options(t.addr, false), Arc::clone(&stop));
    let last = flood.last().unwrap().1;
    for (mut s, opened) in flood {
        let closed = wait_closed(&mut s);
        assert!(
            closed >= opened + TARGET_CONNECT_TIMEOUT,
            "closed after {:?}, before the connect timeout",
            closed - opened
        );
        let local = s.local_addr().unwrap();
        assert!(close_reason(&t, local).starts_with("no ICReq and Connect within"));
    }
    assert!(
        last.elapsed() < TARGET_CONNECT_TIMEOUT + SLACK,
        "the flood was reaped within the connect timeout"
    );
    stop.store(true, Ordering::Release);
    assert!(good.join().expect("the good host") > 0);
    let c = t.counters();
    assert!(c.accepted >= 200, "{c}");
    assert_clean(&t);
}

/// Sends `bytes` one at a time, `PACE` apart, until the target closes the connection; returns how many it took
/// and how long after the start the close came.
fn slowloris_host(addr: SocketAddr, prefix: &[u8], bytes: &[u8]) -> (usize, Duration, SocketAddr) {
    let mut s = TcpStream::connect(addr).unwrap();
    let start = Instant::now();
    let local = s.local_addr().unwrap();
    s.write_all(prefix).unwrap();
    let mut skip = if prefix.is_empty() { 0 } else { 128 }; // the ICResp to a complete ICReq
                                                            // The read timeout is the pace: each byte waits for a close that way.
    s.set_read_timeout(Some(PACE)).unwrap();
    let mut sink = [0u8; 256];
    for (i, b) in bytes.iter().enumerate() {
        if s.write_all(std::slice::from_ref(b)).is_err() {
            return (i, start.elapsed(), local);
        }
        match s.read(&mut sink) {
            Ok(0) => return (i + 1, start.elapsed(), local),
            Ok(n) if n <= skip => skip -= n,
            Ok(n) => panic!("{n} unexpected bytes from the target"),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => return (i + 1, start.elapsed(), local),
        }
    }
    panic!("the target took the whole slow message");
}

#[test]
fn target_slowloris_icreq_and_connect_are_closed_by_the_connect_timeout() {
    let t = short_timeout_target(false);
    let addr = t.addr;
    let mut icreq = Vec::new();
    pdu::encode_ic_req(&mut icreq, &pdu::IcReq::default());
    let mut connect = Vec::new();
    let mut sqe = Sqe::fabrics_connect(0, 31, 0, 0);
    let cd = ConnectData {
        hostid: [7; 16],
        cntlid: 0xffff,
        subnqn: NQN.into(),
        hostnqn: HOSTNQN.into(),
    }
    .to_bytes();
    sqe.set_sgl(&SglDescriptor::in_capsule(0, cd.len() as u32));
    pdu::encode_capsule_cmd(&mut connect, &sqe, &cd, Digests::NONE, 0);
    let stop = Arc::new(AtomicBool::new(false));
    let good = good_host(host_options(addr, false), Arc::clone(&stop));
    let slow: Vec<_> = (0..4)
        .map(|i| {
            let (icreq, connect) = (icreq.clone(), connect.clone());
            thread::spawn(move || {
                if i % 2 == 0 {
                    slowloris_host(addr, &[], &icreq)
                } else {
                    slowloris_host(addr, &icreq, &connect)
                }
            })
        })
        .collect();
    for h in slow {
        let (sent, took, local) = h.join().expect("slowloris host");
        assert!(
            took >= TARGET_CONNECT_TIMEOUT && took < TARGET_CONNECT_TIMEOUT + SLACK,
            "closed after {took:?} and {sent} bytes"
        );
        assert!(close_reason(&t, local).starts_with("no ICReq and Connect within"));
    }
    stop.store(true, Ordering::Release);
    assert!(good.join().expect("the good host") > 0);
    assert_clean(&t);
}

#[test]
fn target_capsule_flood_beyond_the_queue_size() {
    let t = TestTarget::start(|c| c);
    let stop = Arc::new(AtomicBool::new(false));
    let good = good_host(host_options(t.addr, false), Arc::clone(&stop));
    let (admin, cntlid) = RawHost::admin_queue(t.addr, NQN, 0);

    // 1004 writes on a queue of 4 entries: the first four wait for their data (R2T) and fill the queue; the
    // rest are beyond it.
    let (mut q, cqe) = RawHost::io_queue(t.addr, cntlid, 1, 3, 0, Digests::NONE);
    assert!(cqe.status().is_success());
    let mut batch = Vec::new();
    for cid in 0..1004u16 {
        let mut sqe = Sqe::write(1, u64::from(cid % 64) * 8, 7);
        sqe.cid = cid;
        sqe.set_sgl(&SglDescriptor::transport_data_block(4096));
        pdu::encode_capsule_cmd(&mut batch, &sqe, &[], Digests::NONE, 0);
    }
    // The target may close while the batch is still going out: that is one of the allowed answers.
    let _ = q.s.write_all(&batch);
    let (mut r2ts, mut term) = (0, None);
    while let Some(r) = q.recv() {
        match r {
            Resp::R2T(r) => {
                assert!(r.cccid < 4, "R2T for command {} beyond the queue", r.cccid);
                r2ts += 1;
            }
            Resp::TermReq { fes, .. } => term = Some(fes),
            other => panic!("{other:?} for a command beyond the queue"),
        }
    }
    assert!(r2ts <= 4);
    if let Some(fes) = term {
        assert_eq!(fes, Fes::PduSequenceError as u16);
    }
    assert!(t.counters().term_reqs >= 1);

    // 1004 reads on a queue of 4 entries, sent before reading any answer. The target completes reads at once,
    // so it may serve them all; it must answer each at most once and never lose the connection's framing.
    let (mut q, _) = RawHost::io_queue(t.addr, cntlid, 2, 3, 0, Digests::NONE);
    let mut batch = Vec::new();
    for cid in 0..1004u16 {
        let mut sqe = Sqe::read(1, u64::from(cid), 0);
        sqe.cid = cid;
        sqe.set_sgl(&SglDescriptor::transport_data_block(512));
        pdu::encode_capsule_cmd(&mut batch, &sqe, &[], Digests::NONE, 0);
    }
    let _ = q.s.write_all(&batch);
    let mut answered = HashSet::new();
    let mut term = None;
    while answered.len() < 1004 && term.is_none() {
        match q.recv() {
            Some(Resp::Cqe(cqe)) => {
                assert!(cqe.status().is_success(), "{:?}", cqe.status());
                assert!(
                    answered.insert(cqe.cid),
                    "command {} answered twice",
                    cqe.cid
                );
            }
            Some(Resp::C2H { hdr, data }) => {
                assert!(!answered.contains(&hdr.cccid) && data.len() == 512);
            }
            Some(Resp::TermReq { fes, .. }) => term = Some(fes),
            Some(other) => panic!("unexpected {other:?}"),
            None => break,
        }
    }
    eprintln!(
        "read flood beyond the queue size: {} of 1004 answered, termination request {term:?}",
        answered.len()
    );
    drop(q);
    stop.store(true, Ordering::Release);
    assert!(good.join().expect("the good host") > 0);
    drop(admin);
    assert_clean(&t);
}

#[test]
fn target_tls_garbage_is_closed() {
    let t = short_timeout_target(true);
    let stop = Arc::new(AtomicBool::new(false));
    let good = good_host(host_options(t.addr, true), Arc::clone(&stop));
    let (client_cfg, _) = tls_configs();
    let mut plaintext = random(400, 11);
    plaintext[0] = 0x42;
    // Before the handshake: (what, bytes, the close reason it must give).
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("plaintext garbage", plaintext, "TLS is required"),
        (
            "a ClientHello record of garbage",
            [&[0x16u8, 0x03, 0x01, 0x01, 0x00][..], &random(256, 12)].concat(),
            "TLS handshake failed",
        ),
        (
            "a record longer than TLS allows",
            vec![0x16, 0x03, 0x01, 0xff, 0xff],
            "TLS handshake failed",
        ),
        (
            "a record header promising 16 KiB, then silence",
            vec![0x16, 0x03, 0x01, 0x40, 0x00],
            "no ICReq and Connect within",
        ),
    ];
    for (what, bytes, reason) in cases {
        let mut s = TcpStream::connect(t.addr).unwrap();
        let _ = s.write_all(&bytes);
        wait_closed(&mut s);
        let why = close_reason(&t, s.local_addr().unwrap());
        assert!(why.starts_with(reason), "{what}: closed with {why:?}");
    }
    // After a completed handshake (and, in the second case, a working ICReq/ICResp): garbage records.
    for after_icreq in [false, true] {
        let mut s = TcpStream::connect(t.addr).unwrap();
        let (mut session, mut pending) =
            tls_common::client_handshake(&mut s, client_cfg.clone()).expect("handshake");
        if after_icreq {
            let mut icreq = Vec::new();
            pdu::encode_ic_req(&mut icreq, &pdu::IcReq::default());
            tls_common::send(&mut s, &mut session, &[&icreq]);
            let mut plain = Vec::new();
            tls_common::recv(&mut s, &mut session, &mut pending, &mut plain, 128).expect("ICResp");
            assert_eq!(plain[0], 0x01, "an ICResp");
        }
        let mut junk = vec![0x17, 0x03, 0x03, 0x00, 0x80];
        junk.extend(random(0x80, 13));
        let _ = s.write_all(&junk);
        wait_closed(&mut s);
        let why = close_reason(&t, s.local_addr().unwrap());
        assert!(why.contains("bad record MAC"), "closed with {why:?}");
    }
    stop.store(true, Ordering::Release);
    assert!(good.join().expect("the good host") > 0);
    assert_clean(&t);
}

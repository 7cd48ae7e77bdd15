//! A scripted peer (a small TCP server in this test) answers the initiator's ICReq properly and then sends a
//! malformed or hostile PDU. Each case must give a typed error, fail the outstanding command with an error (never
//! a success), and neither panic nor hang.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::thread;
use std::time::{Duration, Instant};

use nvpoll::mem::DmaPool;
use nvpoll::spec::Sqe;
use nvpoll::{ErrorClass, TransportError};
use nvpoll_tcp::queue::{DataDir, HostQueue, QueueParams};
use nvpoll_tcp::tls::{ClientConfig, HashAlg, Psk, ServerConfig, Session};
use nvpoll_tcp::Error;
use nvpoll_testkit::tls;

fn icresp(hdgst: bool) -> Vec<u8> {
    let mut b = vec![0u8; 128];
    b[..8].copy_from_slice(&[0x01, 0x00, 128, 0, 128, 0, 0, 0]);
    b[11] = u8::from(hdgst);
    b[12..16].copy_from_slice(&(128u32 * 1024).to_le_bytes());
    b
}

fn header(ty: u8, flags: u8, hlen: u8, pdo: u8, plen: u32) -> Vec<u8> {
    let mut b = vec![ty, flags, hlen, pdo];
    b.extend_from_slice(&plen.to_le_bytes());
    b
}

fn capsule_resp(cid: u16, status: u16) -> Vec<u8> {
    let mut b = header(0x05, 0, 24, 0, 24);
    b.extend_from_slice(&[0u8; 12]);
    b.extend_from_slice(&cid.to_le_bytes());
    b.extend_from_slice(&(status << 1).to_le_bytes());
    b
}

fn c2h_data(cid: u16, datao: u32, data: &[u8], flags: u8) -> Vec<u8> {
    let mut b = header(0x07, flags, 24, 24, 24 + data.len() as u32);
    b.extend_from_slice(&cid.to_le_bytes());
    b.extend_from_slice(&[0, 0]);
    b.extend_from_slice(&datao.to_le_bytes());
    b.extend_from_slice(&(data.len() as u32).to_le_bytes());
    b.extend_from_slice(&[0u8; 4]);
    b.extend_from_slice(data);
    b
}

fn r2t(cid: u16, ttag: u16, r2to: u32, r2tl: u32) -> Vec<u8> {
    let mut b = header(0x09, 0, 24, 0, 24);
    b.extend_from_slice(&cid.to_le_bytes());
    b.extend_from_slice(&ttag.to_le_bytes());
    b.extend_from_slice(&r2to.to_le_bytes());
    b.extend_from_slice(&r2tl.to_le_bytes());
    b.extend_from_slice(&[0u8; 4]);
    b
}

/// Starts a peer that answers ICReq, reads the first command capsule (whose CID it passes to `script`), then
/// writes whatever `script` returns and keeps the socket open until the host closes it (unless `close` is set).
fn peer(
    hdgst: bool,
    close: bool,
    script: impl FnOnce(u16) -> Vec<u8> + Send + 'static,
) -> std::net::SocketAddr {
    peer_with(hdgst, false, close, script)
}

fn peer_with(
    hdgst: bool,
    ddgst: bool,
    close: bool,
    script: impl FnOnce(u16) -> Vec<u8> + Send + 'static,
) -> std::net::SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut icreq = [0u8; 128];
        s.read_exact(&mut icreq).unwrap();
        assert_eq!(
            &icreq[..8],
            &[0, 0, 128, 0, 128, 0, 0, 0],
            "a well-formed ICReq"
        );
        let mut resp = icresp(hdgst);
        resp[11] |= u8::from(ddgst) << 1;
        s.write_all(&resp).unwrap();
        let mut cmd = vec![0u8; 72 + if hdgst { 4 } else { 0 }];
        s.read_exact(&mut cmd).unwrap();
        let cid = u16::from_le_bytes([cmd[10], cmd[11]]);
        s.write_all(&script(cid)).unwrap();
        if close {
            return;
        }
        let mut sink = [0u8; 4096];
        while let Ok(n) = s.read(&mut sink) {
            if n == 0 {
                break;
            }
        }
    });
    addr
}

fn queue(addr: std::net::SocketAddr, hdgst: bool) -> HostQueue {
    queue_with(addr, hdgst, false)
}

fn queue_with(addr: std::net::SocketAddr, hdgst: bool, ddgst: bool) -> HostQueue {
    queue_over(addr, hdgst, ddgst, None)
}

/// A queue to the scripted peer at `addr`, over TLS when `tls` is given.
fn queue_over(
    addr: std::net::SocketAddr,
    hdgst: bool,
    ddgst: bool,
    tls: Option<ClientConfig>,
) -> HostQueue {
    HostQueue::connect(&QueueParams {
        addr,
        qid: 1,
        depth: 4,
        header_digest: hdgst,
        data_digest: ddgst,
        max_transfer: 64 * 1024,
        connect_timeout: Duration::from_secs(5),
        tls,
        key_renewal: Default::default(),
        tcp_congestion: None,
    })
    .expect("(TLS,) ICReq and ICResp with the scripted peer")
}

/// Submits a command (a 4 KiB read unless `write`), runs the queue until it fails, and returns the queue's
/// error. Asserts that the command completed exactly once, with an error.
fn expect_failure(addr: std::net::SocketAddr, hdgst: bool, write: bool) -> Error {
    expect_failures(addr, hdgst, write).poll
}

/// What a failing queue hands out: the error its poll returned, the error the outstanding command completed
/// with, and the error a later submit was refused with.
struct Failures {
    poll: Error,
    outstanding: Error,
    later: Error,
}

/// As [`expect_failure`], returning all three errors.
fn expect_failures(addr: std::net::SocketAddr, hdgst: bool, write: bool) -> Failures {
    expect_failures_on(queue(addr, hdgst), write)
}

/// As [`expect_failures`], on a queue already connected.
fn expect_failures_on(mut q: HostQueue, write: bool) -> Failures {
    let pool = DmaPool::builder().class(4096, 16).build().unwrap();
    let mut buf = pool.alloc(4096).unwrap();
    buf.set_len(4096).unwrap();
    let (sqe, dir) = if write {
        (Sqe::write(1, 0, 7), DataDir::ToController)
    } else {
        (Sqe::read(1, 0, 7), DataDir::FromController)
    };
    // A write larger than the in-capsule limit (1 KiB before IOCCSZ is known) waits for an R2T.
    q.submit(sqe, dir, Some(buf), 4096, 7)
        .map_err(|(e, _)| e)
        .unwrap();
    q.flush().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let err = loop {
        match q.poll() {
            Err(e) => break e,
            Ok(_) => {
                if let Some(d) = q.pop_done() {
                    panic!("command completed before the queue failed: {:?}", d.result);
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "the queue neither failed nor completed in 10 s"
        );
    };
    let d = q
        .pop_done()
        .expect("the outstanding command is completed when the queue fails");
    assert_eq!(d.tag, 7);
    assert!(d.buf.is_some(), "the buffer is handed back");
    let Err(outstanding) = d.result else {
        panic!("a failed queue never completes a command successfully");
    };
    assert!(q.pop_done().is_none(), "exactly one completion");
    assert_eq!(q.outstanding(), 0);
    // Later submits are refused with an error, not queued forever.
    let buf = pool.alloc(4096).unwrap();
    let (later, _) = q
        .submit(
            Sqe::read(1, 0, 7),
            DataDir::FromController,
            Some(buf),
            4096,
            8,
        )
        .expect_err("a failed queue refuses submits");
    Failures {
        poll: err,
        outstanding,
        later,
    }
}

/// Asserts that `msg` says nothing twice: no run of three words appears in it twice (as in "protocol
/// violation by the peer: protocol violation by peer: ...").
fn said_once(msg: &str) {
    let words: Vec<String> = msg
        .split(|c: char| !c.is_alphanumeric() && c != '-')
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect();
    let mut seen = std::collections::HashSet::new();
    for w in words.windows(3) {
        assert!(seen.insert(w), "{msg:?} says {:?} twice", w.join(" "));
    }
}

/// Asserts that the errors of a failed queue are classed `class` and read as `outstanding` (the
/// command's error) and, through the queue API, as `api`; the later submit is refused with the same words.
fn classed(f: Failures, class: ErrorClass, outstanding: &str, api: &str) {
    assert_eq!(f.poll.class(), class, "{:?}", f.poll);
    assert_eq!(f.outstanding.class(), class, "{:?}", f.outstanding);
    assert_eq!(f.later.class(), class, "{:?}", f.later);
    assert_eq!(f.outstanding.to_string(), outstanding);
    assert_eq!(f.later.to_string(), outstanding);
    let cause = std::error::Error::source(&f.outstanding).expect("the cause is the source");
    assert_eq!(cause.to_string(), f.poll.to_string());
    let e = nvpoll::Error::from(f.outstanding);
    assert_eq!(e.to_string(), api);
    said_once(&e.to_string());
}

/// A controller that closes the connection for good with a command outstanding: the command fails as a lost
/// connection (it may be retried elsewhere), not as the peer's protocol violation, and says so once.
#[test]
fn peer_closing_for_good_fails_the_command_as_a_lost_connection() {
    let addr = peer(false, true, |_| Vec::new());
    let f = expect_failures(addr, false, false);
    assert!(matches!(f.poll, Error::Closed), "{:?}", f.poll);
    classed(
        f,
        ErrorClass::ConnectionLost,
        "queue 1 failed: connection closed by peer",
        "connection lost: queue 1 failed: connection closed by peer",
    );
}

/// A malformed PDU is the peer's protocol violation, for the command outstanding too, said once.
#[test]
fn malformed_pdu_fails_the_command_as_the_peers_protocol_violation() {
    // A CapsuleCmd (type 4) travels only to the controller.
    let addr = peer(false, false, |_| {
        let mut b = header(0x04, 0, 72, 0, 72);
        b.resize(72, 0);
        b
    });
    let f = expect_failures(addr, false, false);
    let pdu = f.poll.to_string();
    assert!(pdu.starts_with("malformed PDU from peer: "), "{pdu}");
    classed(
        f,
        ErrorClass::PeerProtocol,
        &format!("queue 1 failed: {pdu}"),
        &format!("queue 1 failed: {pdu}"),
    );
}

/// A well-formed PDU that breaks the protocol (a completion for no outstanding command) is the peer's too.
#[test]
fn protocol_violation_fails_the_command_as_the_peers_and_says_it_once() {
    let addr = peer(false, false, |cid| capsule_resp(cid ^ 0x100, 0));
    let f = expect_failures(addr, false, false);
    let why = f.poll.to_string();
    assert!(why.starts_with("protocol violation by peer: "), "{why}");
    classed(
        f,
        ErrorClass::PeerProtocol,
        &format!("queue 1 failed: {why}"),
        &format!("queue 1 failed: {why}"),
    );
}

const TLS_ID: &[u8] =
    b"NVMe0R01 nqn.2014-08.org.nvmexpress:uuid:test-host nqn.2024-01.io.nvpoll:hostile";

fn tls_psk() -> Psk {
    Psk::new(&[0x5a; 32], HashAlg::Sha256)
}

/// A scripted controller over TLS: completes the handshake, answers ICReq, reads the first command capsule,
/// then writes `raw` as it is (no record of its own around it) and keeps the socket open until the host
/// closes it.
fn tls_peer(raw: impl FnOnce(&mut Session) -> Vec<u8> + Send + 'static) -> std::net::SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let (mut session, mut pending) =
            tls::server_handshake(&mut s, ServerConfig::with_psk(TLS_ID, tls_psk()))
                .expect("peer: handshake");
        let mut plain = Vec::new();
        tls::recv(&mut s, &mut session, &mut pending, &mut plain, 128).expect("peer: ICReq");
        assert_eq!(plain[0], 0x00, "an ICReq first");
        plain.drain(..128);
        tls::send(&mut s, &mut session, &[&icresp(false)]);
        tls::recv(&mut s, &mut session, &mut pending, &mut plain, 72).expect("peer: a command");
        s.write_all(&raw(&mut session)).unwrap();
        let mut sink = [0u8; 4096];
        while let Ok(n) = s.read(&mut sink) {
            if n == 0 {
                break;
            }
        }
    });
    addr
}

fn tls_queue(addr: std::net::SocketAddr) -> HostQueue {
    queue_over(
        addr,
        false,
        false,
        Some(ClientConfig::new(TLS_ID, tls_psk())),
    )
}

/// TLS failing on a connected queue (a record that does not open: the handshake succeeded, so the keys are
/// right) fails the outstanding command as a TLS error, said once, which may be retried on another path.
#[test]
fn a_record_that_does_not_open_fails_the_command_as_tls() {
    let addr = tls_peer(|_| {
        let mut junk = vec![0x17, 0x03, 0x03, 0x00, 0x40];
        junk.extend((0..0x40u8).map(|i| i.wrapping_mul(37)));
        junk
    });
    let f = expect_failures_on(tls_queue(addr), false);
    let why = f.poll.to_string();
    assert!(why.contains("bad record MAC"), "{why}");
    classed(
        f,
        ErrorClass::Tls,
        &format!("queue 1 failed: {why}"),
        &format!("queue 1 failed: {why}"),
    );
}

/// A fatal alert from the peer on a connected queue: the same.
#[test]
fn an_alert_from_the_peer_fails_the_command_as_tls() {
    let addr = tls_peer(|session| {
        // internal_error (80), fatal, sealed as the peer's next record.
        let mut out = Vec::new();
        session
            .dangerous_seal_raw(21, &[2, 80], &mut out)
            .expect("peer: seal an alert");
        out
    });
    let f = expect_failures_on(tls_queue(addr), false);
    let why = f.poll.to_string();
    assert!(why.starts_with("TLS: peer sent alert"), "{why}");
    let e = nvpoll::Error::from(f.outstanding);
    assert!(matches!(e, nvpoll::Error::Tls(_)), "{e:?}");
    assert_eq!(e.retry(), nvpoll::Retry::Elsewhere);
}

#[test]
fn wrong_pdu_type_for_host() {
    // A CapsuleCmd (type 4) travels only to the controller.
    let addr = peer(false, false, |_| {
        let mut b = header(0x04, 0, 72, 0, 72);
        b.resize(72, 0);
        b
    });
    let e = expect_failure(addr, false, false);
    assert!(matches!(e, Error::Pdu(_)), "{e:?}");
}

#[test]
fn unknown_pdu_type() {
    let addr = peer(false, false, |_| {
        header(0x0f, 0, 24, 0, 24)
            .into_iter()
            .chain([0u8; 16])
            .collect()
    });
    let e = expect_failure(addr, false, false);
    assert!(matches!(e, Error::Pdu(_)), "{e:?}");
}

#[test]
fn hlen_out_of_range() {
    let addr = peer(false, false, |cid| {
        let mut b = capsule_resp(cid, 0);
        b[2] = 30;
        b
    });
    let e = expect_failure(addr, false, false);
    assert!(matches!(e, Error::Pdu(_)), "{e:?}");
}

#[test]
fn plen_smaller_than_header() {
    let addr = peer(false, false, |cid| {
        let mut b = capsule_resp(cid, 0);
        b[4..8].copy_from_slice(&8u32.to_le_bytes());
        b
    });
    let e = expect_failure(addr, false, false);
    assert!(matches!(e, Error::Pdu(_)), "{e:?}");
}

#[test]
fn plen_huge_is_rejected_without_waiting() {
    // 4 GiB - 1: the host must not wait for (or allocate) that much.
    let addr = peer(false, false, |cid| {
        let mut b = c2h_data(cid, 0, &[], 0);
        b[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        b
    });
    let e = expect_failure(addr, false, false);
    assert!(matches!(e, Error::Pdu(_)), "{e:?}");
}

#[test]
fn c2h_data_beyond_the_buffer() {
    let addr = peer(false, false, |cid| {
        c2h_data(cid, 4096 - 512, &[0xab; 1024], 0x04)
    });
    let e = expect_failure(addr, false, false);
    assert!(matches!(e, Error::Protocol(_)), "{e:?}");
}

#[test]
fn c2h_success_without_all_data() {
    let addr = peer(false, false, |cid| {
        c2h_data(cid, 0, &[0xab; 512], 0x04 | 0x08)
    });
    let e = expect_failure(addr, false, false);
    assert!(matches!(e, Error::Protocol(_)), "{e:?}");
}

/// Authentication Receive is the exception: its allocation length is a bound, and SPDK's target sends just
/// the message with SUCCESS. The command completes successfully with what came (a read never does: above).
#[test]
fn authentication_receive_may_end_short() {
    let addr = peer(false, false, |cid| {
        c2h_data(cid, 0, &[0x5a; 48], 0x04 | 0x08)
    });
    let pool = DmaPool::builder().class(4096, 16).build().unwrap();
    let mut q = queue(addr, false);
    let buf = pool.alloc(4096).unwrap();
    let sqe = nvpoll::spec::fabrics::FabricsCommand::AuthReceive {
        secp: 0xe9,
        spsp0: 1,
        spsp1: 1,
        al: 4096,
    }
    .to_sqe();
    q.submit(sqe, DataDir::FromController, Some(buf), 4096, 9)
        .map_err(|(e, _)| e)
        .unwrap();
    q.flush().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let d = loop {
        q.poll().expect("the queue stays up");
        if let Some(d) = q.pop_done() {
            break d;
        }
        assert!(Instant::now() < deadline, "no completion in 10 s");
    };
    assert_eq!(d.tag, 9);
    assert!(d.result.is_ok(), "{:?}", d.result);
    assert_eq!(&d.buf.unwrap().as_slice()[..48], &[0x5a; 48]);
}

#[test]
fn r2t_for_unknown_command() {
    let addr = peer(false, false, |cid| r2t(cid.wrapping_add(1), 1, 0, 4096));
    let e = expect_failure(addr, false, true);
    assert!(matches!(e, Error::Protocol(_)), "{e:?}");
}

#[test]
fn r2t_beyond_the_length() {
    let addr = peer(false, false, |cid| r2t(cid, 1, 0, 8192));
    let e = expect_failure(addr, false, true);
    assert!(matches!(e, Error::Protocol(_)), "{e:?}");
}

#[test]
fn r2t_for_a_read() {
    let addr = peer(false, false, |cid| r2t(cid, 1, 0, 4096));
    let e = expect_failure(addr, false, false);
    assert!(matches!(e, Error::Protocol(_)), "{e:?}");
}

#[test]
fn capsule_resp_with_unknown_cid() {
    let addr = peer(false, false, |cid| capsule_resp(cid ^ 0x100, 0));
    let e = expect_failure(addr, false, false);
    assert!(matches!(e, Error::Protocol(_)), "{e:?}");
}

#[test]
fn bad_header_digest() {
    let addr = peer(true, false, |cid| {
        let mut b = capsule_resp(cid, 0);
        b[1] = 0x01; // HDGSTF
        b[4..8].copy_from_slice(&28u32.to_le_bytes());
        b.extend_from_slice(&[0xde, 0xad, 0xbe, 0xef]);
        b
    });
    let e = expect_failure(addr, true, false);
    assert!(matches!(e, Error::Pdu(_)), "{e:?}");
}

#[test]
fn peer_closes_mid_pdu() {
    let addr = peer(false, true, |cid| capsule_resp(cid, 0)[..13].to_vec());
    let e = expect_failure(addr, false, false);
    assert!(matches!(e, Error::Closed), "{e:?}");
}

#[test]
fn term_req_from_controller() {
    let addr = peer(false, false, |_| {
        let mut b = header(0x03, 0, 24, 0, 24);
        b.extend_from_slice(&1u16.to_le_bytes());
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(&[0u8; 10]);
        b
    });
    let e = expect_failure(addr, false, false);
    assert!(matches!(e, Error::TermReq { fes: 1, fei: 2 }), "{e:?}");
}

/// Flushes what was submitted and polls (unwrapping every poll) until the first completion, for 10 s at most.
fn submitted_completion(q: &mut HostQueue) -> nvpoll_tcp::queue::Done {
    q.flush().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        q.poll().unwrap();
        if let Some(d) = q.pop_done() {
            return d;
        }
        assert!(Instant::now() < deadline, "no completion in 10 s");
    }
}

#[test]
fn error_status_is_an_error_not_a_success() {
    // A CapsuleResp with LBA Out of Range completes the command with that status; the queue stays usable.
    let addr = peer(false, false, |cid| capsule_resp(cid, 0x80));
    let pool = DmaPool::builder().class(4096, 16).build().unwrap();
    let mut q = queue(addr, false);
    let buf = pool.alloc(4096).unwrap();
    q.submit(
        Sqe::read(1, 0, 7),
        DataDir::FromController,
        Some(buf),
        4096,
        1,
    )
    .map_err(|(e, _)| e)
    .unwrap();
    let d = submitted_completion(&mut q);
    let cqe = d.result.unwrap();
    assert_eq!(cqe.status().sc(), 0x80);
    assert!(!cqe.status().is_success());
}

/// The first command (tag 1) failed its data digest and so is not a success; the second (tag 2) succeeded.
fn assert_digest_failure_then_success(done: &[nvpoll_tcp::queue::Done]) {
    assert_eq!(done[0].tag, 1);
    assert!(
        done[0].result.is_err(),
        "a read whose data failed its digest is not a success"
    );
    assert_eq!(done[1].tag, 2);
    assert!(done[1].result.as_ref().unwrap().status().is_success());
}

#[test]
fn bad_data_digest_fails_only_that_command() {
    // C2HData with SUCCESS and a wrong data digest: the command fails, the queue stays up and the next
    // PDU (a CapsuleResp for a second command) is still processed.
    let addr = peer_with(false, true, false, |cid| {
        let data = [0x5au8; 4096];
        let mut b = c2h_data(cid, 0, &data, 0x04 | 0x08 | 0x02);
        let plen = u32::from_le_bytes(b[4..8].try_into().unwrap()) + 4;
        b[4..8].copy_from_slice(&plen.to_le_bytes());
        b.extend_from_slice(&[1, 2, 3, 4]);
        b.extend_from_slice(&capsule_resp(cid + 1, 0));
        b
    });
    let pool = DmaPool::builder().class(4096, 16).build().unwrap();
    let mut q = queue_with(addr, false, true);
    for tag in [1, 2] {
        let buf = pool.alloc(4096).unwrap();
        let (sqe, dir, len) = if tag == 1 {
            (Sqe::read(1, 0, 7), DataDir::FromController, 4096)
        } else {
            (Sqe::flush(1), DataDir::None, 0)
        };
        q.submit(sqe, dir, Some(buf), len, tag)
            .map_err(|(e, _)| e)
            .unwrap();
    }
    q.flush().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut done = Vec::new();
    while done.len() < 2 {
        q.poll()
            .expect("a data digest error is not fatal for the queue");
        while let Some(d) = q.pop_done() {
            done.push(d);
        }
        assert!(
            Instant::now() < deadline,
            "completions did not arrive in 10 s"
        );
    }
    assert_digest_failure_then_success(&done);
}

#[test]
fn large_c2h_data_arriving_in_pieces_lands_in_the_buffer_and_is_checked() {
    // Two 64 KiB reads answered with C2HData (data digests on) that reach the host in pieces cut inside the
    // header, the data and the digest, each piece sent only after the host has read the one before. The first
    // carries a wrong digest: that read fails, the stream goes on, and the second read completes with every
    // byte in place.
    const LEN: usize = 64 * 1024;
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let (cut_tx, cut_rx) = std::sync::mpsc::channel::<usize>();
    let data: Vec<u8> = (0..LEN).map(|i| (i * 31 + 7) as u8).collect();
    let expected = data.clone();
    let peer = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut icreq = [0u8; 128];
        s.read_exact(&mut icreq).unwrap();
        let mut resp = icresp(false);
        resp[11] |= 2;
        s.write_all(&resp).unwrap();
        let mut cids = Vec::new();
        for _ in 0..2 {
            let mut cmd = [0u8; 72];
            s.read_exact(&mut cmd).unwrap();
            cids.push(u16::from_le_bytes([cmd[10], cmd[11]]));
        }
        let pdu = |cid: u16, digest: [u8; 4]| {
            let mut b = c2h_data(cid, 0, &data, 0x04 | 0x08 | 0x02);
            let plen = u32::from_le_bytes(b[4..8].try_into().unwrap()) + 4;
            b[4..8].copy_from_slice(&plen.to_le_bytes());
            b.extend_from_slice(&digest);
            b
        };
        let good = crc32c::crc32c(&data).to_le_bytes();
        let mut stream = pdu(cids[0], [good[0] ^ 1, good[1], good[2], good[3]]);
        let first = stream.len();
        stream.extend_from_slice(&pdu(cids[1], good));
        let cuts = [
            24 + 100,
            24 + 30_000,
            first - 2,
            first + 10,
            first + 24 + 50_000,
            stream.len() - 1,
            stream.len(),
        ];
        let mut at = 0;
        for cut in cuts {
            s.write_all(&stream[at..cut]).unwrap();
            at = cut;
            cut_tx.send(cut).unwrap();
            if go_rx.recv().is_err() {
                return;
            }
        }
        let mut sink = [0u8; 4096];
        while let Ok(n) = s.read(&mut sink) {
            if n == 0 {
                break;
            }
        }
    });
    let pool = DmaPool::builder().class(LEN, 4).build().unwrap();
    let mut q = queue_with(addr, false, true);
    for tag in [1, 2] {
        let mut buf = pool.alloc(LEN).unwrap();
        buf.set_len(LEN).unwrap();
        q.submit(
            Sqe::read(1, 0, (LEN / 512 - 1) as u16),
            DataDir::FromController,
            Some(buf),
            LEN as u32,
            tag,
        )
        .map_err(|(e, _)| e)
        .unwrap();
    }
    q.flush().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut done = Vec::new();
    for _ in 0..7 {
        let cut = cut_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the peer sends its next piece");
        // 128 bytes of ICResp came first.
        while q.conn_stats().bytes_rx < 128 + cut as u64 {
            q.poll()
                .expect("a data digest error is not fatal for the queue");
            assert!(
                Instant::now() < deadline,
                "the pieces did not arrive in 10 s"
            );
        }
        while let Some(d) = q.pop_done() {
            done.push(d);
        }
        let _ = go_tx.send(());
    }
    assert!(
        q.conn_stats().bytes_rx_direct > 30_000,
        "most of the data went straight into the buffers"
    );
    drop(q);
    peer.join().unwrap();
    assert_eq!(done.len(), 2, "both reads completed");
    assert_digest_failure_then_success(&done);
    assert_eq!(
        &done[1].buf.as_ref().unwrap().as_slice()[..LEN],
        &expected[..]
    );
}

#[test]
fn response_right_behind_its_r2t_still_gets_the_data_first() {
    // The peer asks for a 32 KiB write's data and answers the command in the same segment, before the data
    // could have arrived. The host sends the data it held for that poll before the buffer leaves the slot,
    // completes the command once, with the peer's status, and hands the buffer back intact.
    const LEN: usize = 32 * 1024;
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut icreq = [0u8; 128];
        s.read_exact(&mut icreq).unwrap();
        s.write_all(&icresp(false)).unwrap();
        let mut cmd = [0u8; 72];
        s.read_exact(&mut cmd).unwrap();
        let cid = u16::from_le_bytes([cmd[10], cmd[11]]);
        let mut script = r2t(cid, 3, 0, LEN as u32);
        script.extend_from_slice(&capsule_resp(cid, 0));
        s.write_all(&script).unwrap();
        let mut h2c = vec![0u8; 24 + LEN];
        s.read_exact(&mut h2c).unwrap();
        tx.send(h2c).unwrap();
    });
    let pool = DmaPool::builder().class(LEN, 4).build().unwrap();
    let mut q = queue(addr, false);
    let mut buf = pool.alloc(LEN).unwrap();
    buf.set_len(LEN).unwrap();
    for (i, b) in buf.as_mut_slice().iter_mut().enumerate() {
        *b = (i * 13 + 1) as u8;
    }
    let want: Vec<u8> = buf.as_slice().to_vec();
    q.submit(
        Sqe::write(1, 0, 7),
        DataDir::ToController,
        Some(buf),
        LEN as u32,
        9,
    )
    .map_err(|(e, _)| e)
    .unwrap();
    let d = submitted_completion(&mut q);
    assert_eq!(d.tag, 9);
    assert!(d.result.unwrap().status().is_success());
    assert_eq!(
        d.buf.expect("the buffer is handed back").as_slice(),
        &want[..]
    );
    assert!(q.pop_done().is_none(), "exactly one completion");
    let h2c = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the peer got the H2CData");
    assert_eq!(h2c[0], 0x06, "an H2CData PDU");
    assert_eq!(&h2c[24..], &want[..], "the data as the buffer held it");
}

/// Reads one PDU whole (common header, then the rest by PLEN).
fn read_pdu(s: &mut std::net::TcpStream) -> Vec<u8> {
    let mut ch = [0u8; 8];
    s.read_exact(&mut ch).unwrap();
    let plen = u32::from_le_bytes([ch[4], ch[5], ch[6], ch[7]]) as usize;
    let mut rest = vec![0u8; plen - 8];
    s.read_exact(&mut rest).unwrap();
    let mut pdu = ch.to_vec();
    pdu.extend_from_slice(&rest);
    pdu
}

/// A controller that asks for DH-HMAC-CHAP in Connect's response, then closes the connection when the host
/// starts it: what Linux nvmet does after refusing a host's response (it tears the controller down before
/// the host reads AUTH_Failure1). The host must say it in words of authentication, not as a lost
/// connection (vm-tests/26 saw "connection closed by peer").
#[test]
fn a_controller_that_closes_during_authentication_is_reported_as_an_authentication_failure() {
    use nvpoll_tcp::dhchap::host::HostAuth;
    use nvpoll_tcp::dhchap::Secret;
    use nvpoll_tcp::host::{ConnectOptions, TcpController};

    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let server = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut icreq = [0u8; 128];
        s.read_exact(&mut icreq).unwrap();
        s.write_all(&icresp(false)).unwrap();
        let connect = read_pdu(&mut s);
        assert_eq!(connect[0], 0x04, "a command capsule");
        assert_eq!(connect[8], 0x7f, "Fabrics");
        let cid = u16::from_le_bytes([connect[10], connect[11]]);
        let mut resp = capsule_resp(cid, 0);
        // CQE dword 0: AUTHREQ (bits 31:16) with ATR, an authentication transaction is required.
        resp[8..12].copy_from_slice(&(1u32 << 17).to_le_bytes());
        s.write_all(&resp).unwrap();
        let auth = read_pdu(&mut s);
        assert_eq!(
            auth[8], 0x7f,
            "the host starts authentication with a Fabrics command"
        );
        // Close without answering.
    });
    let pool = DmaPool::builder().class(4096, 16).build().unwrap();
    let mut o = ConnectOptions::new(
        addr,
        "nqn.2016-06.io.spdk:cnode1",
        "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000001".to_string(),
    );
    o.dhchap = Some(HostAuth::new(
        Secret::parse("DHHC-1:01:WulleCBkG4oCs0iIC3Cit9gBDCLWiZ9PNXuhqytWkBIZkvGy:").unwrap(),
        None,
    ));
    o.timeout = Duration::from_secs(10);
    let e = TcpController::connect(o, pool).expect_err("the controller closed the connection");
    server.join().unwrap();
    assert!(matches!(e, Error::Auth(_)), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains("closed the connection during DH-HMAC-CHAP authentication")
            && msg.contains("refused"),
        "{msg}"
    );
}

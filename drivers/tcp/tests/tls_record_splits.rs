//! Large transfers over TLS from a peer that cuts its records the way SPDK's OpenSSL socket does: every piece
//! of a PDU (the header, each data chunk, the completion) is its own TLS record in its own `write`, on a socket
//! with Nagle's algorithm on. Such a peer holds each piece back until the previous one is acknowledged; if we
//! leave our ACKs to the kernel's delayed-ACK timer (40 ms and more on Linux), every large transfer waits it
//! out. (SPDK itself sets TCP_NODELAY and its one-record-per-call TLS sends stalled on our ACKs all the same,
//! at 17-26 IOPS for 128 KiB; Nagle is how this script makes a peer wait for ACKs deterministically.)
//!
//! Both directions: our initiator reading 128 KiB C2HData from a scripted controller, and our target taking
//! 128 KiB H2CData from a scripted host. Every byte is checked. The stall is a hang in all but name: the bound
//! below is half the delayed-ACK timer's floor, for the median read or write, on loopback where a healthy
//! transfer takes well under a millisecond of wire time, compared with the same transfers from a peer with
//! TCP_NODELAY. Without `Conn::ack_partial` the reads here take 45 ms each, and the target's 4 KiB-record
//! writes as long. `ack_partial` asks once the socket runs dry; a target with more than eight connections on a
//! reactor reads them by readiness, and there a poll without a read is the dry read (without it, the writes
//! beside ten idle queues took 44-46 ms in two runs of three).

use nvpoll_testkit::target as target_common;

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use nvpoll::mem::DmaPool;
use nvpoll::spec::{fabrics, reg, Cc, ConnectData, Cqe, SglDescriptor, Sqe};
use nvpoll_target::TargetTls;
use nvpoll_tcp::conn::Conn;
use nvpoll_tcp::pdu::{self, Decoded, Digests, Pdu};
use nvpoll_tcp::queue::{DataDir, HostQueue, QueueParams};
use nvpoll_tcp::tls::{
    ClientConfig, ConfiguredKey, Derivation, Handshake, HashAlg, IdentityVersion, Psk, ServerConfig,
};
use target_common::{TestTarget, HOSTNQN, NQN};

const XFER: usize = 128 << 10;
const IOS: usize = 48;
/// Half of Linux's smallest delayed-ACK timeout (TCP_DELACK_MIN, 40 ms): what the median may grow by when the
/// peer turns Nagle's algorithm on.
const STALL: Duration = Duration::from_millis(20);
const KEY: &str = "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:";
const ID: &[u8] =
    b"NVMe0R01 nqn.2014-08.org.nvmexpress:uuid:test-host nqn.2024-01.io.nvpoll:splits";

fn pattern(i: usize) -> Vec<u8> {
    (0..XFER).map(|b| (b.wrapping_mul(31) ^ i) as u8).collect()
}

/// The tests run one at a time: each has a busy-polling side (our initiator, or the target's reactor), and two
/// at once on a 2-core machine would measure each other.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The scripted peers wait politely (a short sleep, not a spin), so that they leave the cores to our side.
fn backoff() {
    thread::sleep(Duration::from_micros(20));
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Wraps `s` in a `Conn`; with `nagle`, Nagle's algorithm stays on, as on a socket nobody set TCP_NODELAY on
/// (`Conn` sets it).
fn peer_conn(s: TcpStream, nagle: bool) -> Conn {
    let raw = s.try_clone().unwrap();
    let conn = Conn::from_stream(s, 1 << 20).unwrap();
    raw.set_nodelay(!nagle).unwrap();
    conn
}

/// The stall is what Nagle's algorithm adds: the same transfers with TCP_NODELAY on the peer are the baseline,
/// measured in the same test, so that a slow or loaded machine slows both alike.
fn assert_no_stall(what: &str, nagle: Duration, nodelay: Duration) {
    assert!(
        nagle < nodelay + STALL,
        "{what} stall: median {nagle:?} with Nagle's algorithm on at the peer, {nodelay:?} without (the \
         difference is the delayed-ACK timer, 40 ms and more)"
    );
}

/// Queues one piece and writes it as its own record(s) in its own `write` calls, waiting out EAGAIN.
fn send_piece(conn: &mut Conn, piece: impl FnOnce(&mut Vec<u8>)) {
    piece(conn.tx_buf());
    conn.pdu_queued();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !conn.flush().expect("peer: send") {
        assert!(Instant::now() < deadline, "peer: send stuck");
        backoff();
    }
}

/// Receives the next PDU and hands it to `f` (with its data), then consumes it.
fn recv_pdu<R>(
    conn: &mut Conn,
    cfg: &pdu::DecodeConfig,
    f: impl FnOnce(Pdu<'_>) -> R,
) -> Option<R> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match pdu::decode(conn.rx_data(), cfg).expect("valid PDUs") {
            Decoded::Pdu { pdu, len } => {
                let r = f(pdu);
                conn.consume(len);
                return Some(r);
            }
            Decoded::Incomplete { .. } => {
                if conn.fill().is_err() {
                    return None;
                }
                assert!(Instant::now() < deadline, "peer: receive stuck");
                backoff();
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// our initiator reads from a scripted controller
// ---------------------------------------------------------------------------------------------------------

fn controller_psk() -> Psk {
    Psk::new(&[0x42; 32], HashAlg::Sha256)
}

/// A scripted NVMe/TCP controller with SPDK's record cuts: answers ICReq, then each read command with
/// `chunk`-byte pieces: C2HData header, data chunks, CapsuleResp, one record and one write each.
fn controller(chunk: usize, nagle: bool) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        let mut conn = peer_conn(s, nagle);
        let mut hs = Some(Handshake::server(ServerConfig::with_psk(
            ID,
            controller_psk(),
        )));
        let mut inb = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !conn.tls_step(&mut hs, &mut inb).expect("peer: handshake") {
            assert!(Instant::now() < deadline, "peer: handshake stuck");
            backoff();
        }
        let cfg = pdu::DecodeConfig::new(pdu::Direction::ToController, Digests::NONE, 8192);
        let got = recv_pdu(&mut conn, &cfg, |p| matches!(p, Pdu::IcReq(_)));
        assert_eq!(got, Some(true), "ICReq first");
        send_piece(&mut conn, |tx| {
            let ic = pdu::IcResp {
                pfv: pdu::PFV_1_0,
                cpda: 0,
                digests: Digests::NONE,
                maxh2cdata: 128 << 10,
            };
            pdu::encode_ic_resp(tx, &ic);
        });
        for i in 0.. {
            let cmd = recv_pdu(&mut conn, &cfg, |p| match p {
                Pdu::CapsuleCmd { sqe, .. } => sqe.cid,
                other => panic!("peer: unexpected {}", other.pdu_type()),
            });
            let Some(cid) = cmd else { return }; // the host is done
            send_piece(&mut conn, |tx| {
                let hdr = pdu::C2HDataHdr {
                    cccid: cid,
                    datao: 0,
                    datal: XFER as u32,
                    last: true,
                    success: false,
                };
                pdu::encode_c2h_data_header(tx, &hdr, Digests::NONE, 0);
            });
            for piece in pattern(i).chunks(chunk) {
                send_piece(&mut conn, |tx| tx.extend_from_slice(piece));
            }
            send_piece(&mut conn, |tx| {
                let cqe = Cqe {
                    cid,
                    sqid: 1,
                    ..Default::default()
                };
                pdu::encode_capsule_resp(tx, &cqe, Digests::NONE);
            });
        }
    });
    addr
}

/// Reads `IOS` x 128 KiB at queue depth 1 through a scripted controller; checks every byte; returns the
/// median read time and our connection's counters.
fn initiator_reads(chunk: usize, nagle: bool) -> (Duration, nvpoll_tcp::conn::ConnStats) {
    let addr = controller(chunk, nagle);
    let mut q = HostQueue::connect(&QueueParams {
        addr,
        qid: 1,
        depth: 4,
        header_digest: false,
        data_digest: false,
        max_transfer: XFER as u32,
        connect_timeout: Duration::from_secs(10),
        tls: Some(ClientConfig::new(ID, controller_psk())),
        key_renewal: Default::default(),
        tcp_congestion: None,
    })
    .expect("TLS, ICReq and ICResp with the scripted controller");
    let pool = DmaPool::builder().class(XFER, 2).build().unwrap();
    let mut took = Vec::new();
    for i in 0..IOS {
        let mut buf = pool.alloc(XFER).unwrap();
        buf.set_len(XFER).unwrap();
        let t0 = Instant::now();
        let (cqe, buf) = q
            .run(
                Sqe::read(1, 0, (XFER / 512 - 1) as u16),
                DataDir::FromController,
                Some(buf),
                XFER as u32,
                Duration::from_secs(10),
            )
            .expect("the read completes");
        took.push(t0.elapsed());
        assert!(cqe.status().is_success());
        assert!(
            buf.unwrap().as_slice() == pattern(i).as_slice(),
            "read {i}: data differs"
        );
    }
    (median(took), q.conn_stats())
}

fn initiator_reads_without_stall(chunk: usize) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (nodelay, _) = initiator_reads(chunk, false);
    let (nagle, stats) = initiator_reads(chunk, true);
    assert_no_stall(
        &format!("128 KiB reads in {chunk}-byte records"),
        nagle,
        nodelay,
    );
    assert!(stats.quick_acks > 0, "{stats:?}");
}

#[test]
fn our_initiator_reads_c2h_data_cut_into_16k_records() {
    initiator_reads_without_stall(16 << 10);
}

#[test]
fn our_initiator_reads_c2h_data_cut_into_4k_records() {
    initiator_reads_without_stall(4 << 10);
}

// ---------------------------------------------------------------------------------------------------------
// our target takes writes from a scripted host
// ---------------------------------------------------------------------------------------------------------

/// A TLS connection to the target as `HOSTNQN`, ICReq done.
fn host_conn(t: &TestTarget, nagle: bool) -> (Conn, pdu::DecodeConfig) {
    let key = ConfiguredKey::parse(KEY).unwrap();
    let (identity, psk) = key.derive(IdentityVersion::V0, HOSTNQN, NQN, Derivation::Rfc8446);
    let mut conn = peer_conn(TcpStream::connect(t.addr).unwrap(), nagle);
    conn.tls_client_handshake(ClientConfig::new(identity, psk), Duration::from_secs(10))
        .expect("TLS with the target");
    let ic = pdu::IcReq {
        pfv: pdu::PFV_1_0,
        hpda: 0,
        digests: Digests::NONE,
        maxr2t: 0,
    };
    send_piece(&mut conn, |tx| {
        pdu::encode_ic_req(tx, &ic);
    });
    let cfg = pdu::DecodeConfig::new(pdu::Direction::ToHost, Digests::NONE, 1 << 20);
    let got = recv_pdu(&mut conn, &cfg, |p| matches!(p, Pdu::IcResp(_)));
    assert_eq!(got, Some(true), "ICResp");
    (conn, cfg)
}

/// Sends a command (in-capsule data if any) and returns its completion; answers no R2T.
fn command(conn: &mut Conn, cfg: &pdu::DecodeConfig, mut sqe: Sqe, data: &[u8]) -> Cqe {
    if !data.is_empty() {
        sqe.set_sgl(&SglDescriptor::in_capsule(0, data.len() as u32));
    }
    send_piece(conn, |tx| {
        pdu::encode_capsule_cmd(tx, &sqe, data, Digests::NONE, 0);
    });
    recv_pdu(conn, cfg, |p| match p {
        Pdu::CapsuleResp { cqe } => cqe,
        other => panic!("unexpected {}", other.pdu_type()),
    })
    .expect("a completion")
}

/// Writes `IOS` x 128 KiB at queue depth 1 into our target from a scripted host, reads them back and checks
/// them; returns the median write time. With `crowd`, that many idle I/O queues connect first, so that the
/// target's reactor reads its connections by readiness (more than eight) instead of reading every one on
/// every pass.
fn target_takes_writes(chunk: usize, nagle: bool, crowd: u16) -> Duration {
    let key = ConfiguredKey::parse(KEY).unwrap();
    let t = TestTarget::start(|mut c| {
        c.tls = Some(TargetTls::with_host_keys(
            true,
            &[(HOSTNQN.to_string(), key)],
            &[NQN.to_string()],
        ));
        c
    });
    let cd = |cntlid| ConnectData {
        hostid: [3; 16],
        cntlid,
        subnqn: NQN.into(),
        hostnqn: HOSTNQN.into(),
    };
    let (mut admin, acfg) = host_conn(&t, false);
    let cqe = command(
        &mut admin,
        &acfg,
        Sqe::fabrics_connect(0, 31, 0, 0),
        &cd(fabrics::CNTLID_DYNAMIC).to_bytes(),
    );
    assert!(
        cqe.status().is_success(),
        "admin Connect: {:?}",
        cqe.status()
    );
    let cntlid = cqe.dw0 as u16;
    let mut cc = Cc(0);
    cc.set_en(true);
    cc.set_iosqes(6);
    cc.set_iocqes(4);
    let cqe = command(
        &mut admin,
        &acfg,
        Sqe::property_set(reg::CC, false, u64::from(cc.0)),
        &[],
    );
    assert!(cqe.status().is_success());

    let mut idle = Vec::new();
    for qid in 2..2 + crowd {
        let (mut q, qcfg) = host_conn(&t, false);
        let cqe = command(
            &mut q,
            &qcfg,
            Sqe::fabrics_connect(qid, 15, 0, 0),
            &cd(cntlid).to_bytes(),
        );
        assert!(
            cqe.status().is_success(),
            "idle I/O queue {qid} Connect: {:?}",
            cqe.status()
        );
        idle.push(q);
    }

    let (mut io, cfg) = host_conn(&t, nagle);
    let cqe = command(
        &mut io,
        &cfg,
        Sqe::fabrics_connect(1, 15, 0, 0),
        &cd(cntlid).to_bytes(),
    );
    assert!(cqe.status().is_success(), "I/O Connect: {:?}", cqe.status());

    let blocks = (XFER / 512) as u64;
    let mut took = Vec::new();
    for i in 0..IOS {
        let data = pattern(i);
        let mut sqe = Sqe::write(1, i as u64 * blocks, (blocks - 1) as u16);
        sqe.cid = i as u16;
        sqe.set_sgl(&SglDescriptor::transport_data_block(XFER as u32));
        let t0 = Instant::now();
        send_piece(&mut io, |tx| {
            pdu::encode_capsule_cmd(tx, &sqe, &[], Digests::NONE, 0);
        });
        let mut sent = 0usize;
        let cqe = loop {
            let got = recv_pdu(&mut io, &cfg, |p| match p {
                Pdu::R2T(r) => Err(r),
                Pdu::CapsuleResp { cqe } => Ok(cqe),
                other => panic!("unexpected {}", other.pdu_type()),
            });
            match got.expect("the target answers") {
                Ok(cqe) => break cqe,
                Err(r) => {
                    let (off, len) = (r.r2to as usize, r.r2tl as usize);
                    // SPDK's cut: the H2CData header, then each chunk of data, one record and one write each.
                    send_piece(&mut io, |tx| {
                        let hdr = pdu::H2CDataHdr {
                            cccid: r.cccid,
                            ttag: r.ttag,
                            datao: r.r2to,
                            datal: r.r2tl,
                            last: true,
                        };
                        pdu::encode_h2c_data_header(tx, &hdr, Digests::NONE, 0);
                    });
                    for piece in data[off..off + len].chunks(chunk) {
                        send_piece(&mut io, |tx| tx.extend_from_slice(piece));
                    }
                    sent += len;
                }
            }
        };
        took.push(t0.elapsed());
        assert!(cqe.status().is_success(), "write {i}: {:?}", cqe.status());
        assert_eq!(
            sent, XFER,
            "write {i}: the target asked for all of its data"
        );
    }
    // Read everything back (whole PDUs: no stall to avoid) and compare.
    for i in 0..IOS {
        let mut sqe = Sqe::read(1, i as u64 * blocks, (blocks - 1) as u16);
        sqe.cid = 1000 + i as u16;
        sqe.set_sgl(&SglDescriptor::transport_data_block(XFER as u32));
        send_piece(&mut io, |tx| {
            pdu::encode_capsule_cmd(tx, &sqe, &[], Digests::NONE, 0);
        });
        let mut back = Vec::new();
        loop {
            let done = recv_pdu(&mut io, &cfg, |p| match p {
                Pdu::C2HData { hdr, data } => {
                    back.extend_from_slice(data);
                    hdr.success
                }
                Pdu::CapsuleResp { cqe } => {
                    assert!(cqe.status().is_success());
                    true
                }
                other => panic!("unexpected {}", other.pdu_type()),
            });
            if done.expect("the target answers") {
                break;
            }
        }
        assert!(back == pattern(i), "block range {i}: data differs");
    }
    median(took)
}

fn target_takes_writes_without_stall(chunk: usize, crowd: u16) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let nodelay = target_takes_writes(chunk, false, crowd);
    let nagle = target_takes_writes(chunk, true, crowd);
    assert_no_stall(
        &format!(
            "128 KiB writes into our target in {chunk}-byte records, beside {crowd} idle I/O queues"
        ),
        nagle,
        nodelay,
    );
}

#[test]
fn our_target_takes_h2c_data_cut_into_16k_records() {
    target_takes_writes_without_stall(16 << 10, 0);
}

#[test]
fn our_target_takes_h2c_data_cut_into_4k_records() {
    target_takes_writes_without_stall(4 << 10, 0);
}

/// The same among ten idle connections: the target reads by readiness, and a connection its readiness set
/// calls empty must still get its ACK asked for (a poll without a read counts as a read that found nothing).
#[test]
fn our_target_takes_h2c_data_cut_into_4k_records_beside_idle_queues() {
    target_takes_writes_without_stall(4 << 10, 10);
}

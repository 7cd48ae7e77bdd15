//! TLS key renewal between our initiator and our target (issue 48): both sides renew by KeyUpdate at a low
//! count while every block reads back as written; a peer that cannot take a KeyUpdate (emulated by a relay
//! that resets the connection when it carries one, as a kernel TLS peer without re-keying ends it) is
//! noticed once, and its connections are renewed by reconnecting instead, with nothing lost.

use nvpoll_testkit::target as target_common;

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use nvpoll::api::{Controller, IoOp, IoRequest, QueuePair};
use nvpoll_target::TargetTls;
use nvpoll_tcp::host::{ConnectOptions, TcpController};
use nvpoll_tcp::tls::{ConfiguredKey, IdentityVersion};
use nvpoll_tcp::KeyRenewal;
use target_common::{fill_pattern, pool, TestTarget, HOSTNQN, NQN};

const KEY: &str = "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:";

/// The ciphertext length of a record holding only a KeyUpdate: the 5-byte message, the content type, the
/// 16-byte tag. No NVMe/TCP PDU is that short (the smallest is 8 bytes), so the record is a KeyUpdate.
const KEY_UPDATE_RECORD: usize = 5 + 1 + 16;

fn target(renew_after: u64) -> TestTarget {
    let key = ConfiguredKey::parse(KEY).unwrap();
    TestTarget::start(|mut c| {
        c.tls = Some(TargetTls::with_host_keys(
            true,
            &[(HOSTNQN.to_string(), key)],
            &[NQN.to_string()],
        ));
        c.tls_key_renewal = KeyRenewal::after(renew_after);
        c
    })
}

fn opts(addr: SocketAddr, renew_after: u64) -> ConnectOptions {
    let mut o = ConnectOptions::new(addr, NQN, HOSTNQN)
        .with_tls_key(&ConfiguredKey::parse(KEY).unwrap(), IdentityVersion::V0);
    o.tls_key_renewal = KeyRenewal::after(renew_after);
    o.reconnect_delay = Duration::from_millis(50);
    o
}

/// Which direction's KeyUpdates the relay answers with a reset.
#[derive(Clone, Copy, PartialEq)]
enum Refuse {
    FromHost,
    FromTarget,
}

/// A TCP relay to `to` that resets both sides of a connection when it carries a KeyUpdate record in the
/// `refuse` direction. Returns its address; it serves until the test ends.
fn refusing_relay(to: SocketAddr, refuse: Refuse) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for host in l.incoming() {
            let Ok(host) = host else { return };
            let Ok(target) = TcpStream::connect(to) else {
                return;
            };
            // Records go on at once (no Nagle delay behind the peer's delayed ACK).
            for s in [&host, &target] {
                s.set_nodelay(true).unwrap();
            }
            for (from, into, watch) in [
                (&host, &target, refuse == Refuse::FromHost),
                (&target, &host, refuse == Refuse::FromTarget),
            ] {
                let (from, into) = (from.try_clone().unwrap(), into.try_clone().unwrap());
                std::thread::spawn(move || relay(from, into, watch));
            }
        }
    });
    addr
}

/// Copies `from` to `into` record by record; with `watch`, a KeyUpdate record resets both.
fn relay(mut from: TcpStream, mut into: TcpStream, watch: bool) {
    let mut header = [0u8; 5];
    loop {
        if from.read_exact(&mut header).is_err() {
            let _ = into.shutdown(Shutdown::Write);
            return;
        }
        let len = usize::from(u16::from_be_bytes([header[3], header[4]]));
        let mut body = vec![0u8; len];
        if from.read_exact(&mut body).is_err() {
            let _ = into.shutdown(Shutdown::Write);
            return;
        }
        if watch && header[0] == 23 && len == KEY_UPDATE_RECORD {
            for s in [&from, &into] {
                let _ = socket2::SockRef::from(s).set_linger(Some(Duration::ZERO));
                let _ = s.shutdown(Shutdown::Both);
            }
            return;
        }
        let mut record = header.to_vec();
        record.extend_from_slice(&body);
        if into.write_all(&record).is_err() {
            return;
        }
    }
}

/// Writes then reads back `rounds` 4 KiB blocks, polling the controller's admin queue as well (it
/// reconnects); panics on any error or mismatch.
fn write_read(ctrl: &mut TcpController, qp: &mut impl QueuePair, rounds: u64) {
    let ns = ctrl.namespaces()[1].clone(); // 4 KiB blocks
    let pool = ctrl.pool().clone();
    for i in 0..rounds {
        let lba = i % ns.blocks;
        let mut w = pool.alloc(4096).unwrap();
        fill_pattern(w.as_mut_slice(), i);
        for (op, buf) in [(IoOp::Write, w), (IoOp::Read, pool.alloc(4096).unwrap())] {
            qp.submit(IoRequest {
                op,
                nsid: ns.nsid,
                lba,
                blocks: 1,
                buf: Some(buf),
                tag: i,
            })
            .map_err(|r| r.error)
            .unwrap();
            qp.flush().unwrap();
            let deadline = Instant::now() + Duration::from_secs(20);
            let c = loop {
                ctrl.poll_admin().unwrap();
                qp.poll(4).unwrap();
                if let Some(c) = qp.pop_completion() {
                    break c;
                }
                assert!(
                    Instant::now() < deadline,
                    "no completion in 20 s (round {i})"
                );
            };
            c.result
                .unwrap_or_else(|e| panic!("{op:?} in round {i}: {e}"));
            if op == IoOp::Read {
                let mut expect = vec![0u8; 4096];
                fill_pattern(&mut expect, i);
                assert!(
                    c.buf.unwrap().as_slice() == &expect[..],
                    "round {i} read back wrong"
                );
            }
        }
    }
}

#[test]
fn both_sides_renew_by_key_update_at_a_low_count() {
    let t = target(40);
    let mut ctrl = TcpController::connect(opts(t.addr, 40), pool()).expect("TLS attach");
    let mut qp = ctrl.create_queue_pair(8).unwrap();
    write_read(&mut ctrl, &mut qp, 1000);
    let s = qp.stats();
    // 2,000 commands, a record or more each way per command, a renewal per 40 records on each side.
    assert!(s.key_updates_sent >= 20, "{s:?}");
    assert!(s.key_updates_received >= 20, "{s:?}");
    assert_eq!(ctrl.reconnects(), 0, "renewed without reconnecting");
    let c = t.wait_counters("the target counted its renewals", |c| {
        c.key_updates_sent >= 20 && c.key_updates_received >= 20
    });
    assert_eq!(c.errors, 0, "{c:?}");
    assert!(t.events_matching("KeyUpdate").is_empty());
}

#[test]
fn a_target_that_cannot_take_a_key_update_is_renewed_by_reconnecting() {
    let t = target(1 << 23);
    let relay = refusing_relay(t.addr, Refuse::FromHost);
    let mut ctrl = TcpController::connect(opts(relay, 100), pool()).expect("TLS attach");
    let mut qp = ctrl.create_queue_pair(8).unwrap();
    write_read(&mut ctrl, &mut qp, 600);
    let s = qp.stats();
    // The first KeyUpdate (of whichever queue got there first) ended its connection; from then on the
    // queues renew by reconnecting: 1,200 commands at 100 records per key take several.
    assert!(s.key_updates_sent <= 2, "KeyUpdates went on: {s:?}");
    assert!(ctrl.reconnects() >= 4, "reconnects {}", ctrl.reconnects());
    let r = qp.recovery_stats();
    assert_eq!(r.failed, 0, "{r:?}");
    // The queue pair's counters go on across its reconnects: each one counted, and every command sent
    // (1,200, and the retried ones again) in records that are not lost from the count when a connection ends.
    assert_eq!(s.reconnects, r.reconnects, "{s:?} {r:?}");
    assert!(s.reconnects >= 2, "{s:?}");
    assert!(s.commands >= 1200, "{s:?}");
    assert!(s.records >= 1200, "{s:?}");
}

#[test]
fn a_host_that_cannot_take_a_key_update_is_renewed_by_closing() {
    let t = target(100);
    let relay = refusing_relay(t.addr, Refuse::FromTarget);
    let mut ctrl = TcpController::connect(opts(relay, 1 << 23), pool()).expect("TLS attach");
    let mut qp = ctrl.create_queue_pair(8).unwrap();
    write_read(&mut ctrl, &mut qp, 600);
    let said = t.wait_event("at our TLS KeyUpdate");
    assert_eq!(said.len(), 1, "said once per host: {said:?}");
    assert!(said[0].contains(HOSTNQN), "{said:?}");
    assert!(ctrl.reconnects() >= 4, "reconnects {}", ctrl.reconnects());
    let c = t.counters();
    assert!(c.key_updates_sent <= 2, "KeyUpdates went on: {c:?}");
    assert_eq!(qp.recovery_stats().failed, 0);
}

//! NVMe/TCP with TLS 1.3 (external PSK) between our initiator and our target: identify, 64 MiB written and
//! verified, every queue behind the same identity; wrong keys and plaintext hosts refused with typed errors;
//! the optional mode serves both; the discovery log says what the port requires.

use nvpoll_testkit::target as target_common;

use std::time::{Duration, Instant};

use nvpoll::api::{Controller, IoOp, IoRequest, QueuePair};
use nvpoll::send::SendMode;
use nvpoll_target::TargetTls;
use nvpoll_tcp::host::{ConnectOptions, TcpController};
use nvpoll_tcp::tls::{ConfiguredKey, IdentityVersion};
use nvpoll_tcp::Error;
use target_common::{fill_pattern, pool, TestTarget, HOSTNQN, NQN};

const KEY: &str = "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:";
/// SPDK's test key: the ASCII text of a hex string as key bytes.
const OTHER_KEY: &str = "NVMeTLSkey-1:01:MDAxMTIyMzM0NDU1NjY3Nzg4OTlhYWJiY2NkZGVlZmZwJEiQ:";

fn tls_target(required: bool) -> TestTarget {
    let key = ConfiguredKey::parse(KEY).unwrap();
    TestTarget::start(|mut c| {
        c.tls = Some(TargetTls::with_host_keys(
            required,
            &[(HOSTNQN.to_string(), key)],
            &[NQN.to_string()],
        ));
        c
    })
}

fn opts(t: &TestTarget, key: Option<&str>, version: IdentityVersion) -> ConnectOptions {
    let o = ConnectOptions::new(t.addr, NQN, HOSTNQN);
    match key {
        Some(k) => o.with_tls_key(&ConfiguredKey::parse(k).unwrap(), version),
        None => o,
    }
}

fn write_read_verify(ctrl: &mut TcpController, mode: SendMode, total: usize, tls: bool) {
    let ns = ctrl.namespaces()[1].clone(); // the 4 KiB-block namespace
    let pool = ctrl.pool().clone();
    let mut qp = ctrl.create_queue_pair(32).unwrap();
    qp.set_send_mode(mode).unwrap();
    let sizes = [4096usize, 8192, 65536, 131072, 1 << 20, 12288];
    let (mut done, mut lba, mut i) = (0usize, 0u64, 0u64);
    while done < total {
        let len = sizes[i as usize % sizes.len()];
        let blocks = (len / 4096) as u32;
        if lba + u64::from(blocks) > ns.blocks {
            lba = 0;
        }
        let mut w = pool.alloc(len).unwrap();
        fill_pattern(w.as_mut_slice(), i);
        for (op, buf) in [(IoOp::Write, w), (IoOp::Read, pool.alloc(len).unwrap())] {
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
            qp.flush().unwrap();
            let deadline = Instant::now() + Duration::from_secs(10);
            let c = loop {
                qp.poll(4).unwrap();
                if let Some(c) = qp.pop_completion() {
                    break c;
                }
                assert!(Instant::now() < deadline, "no completion in 10 s");
            };
            c.result
                .unwrap_or_else(|e| panic!("{op:?} of {len} bytes: {e}"));
            if op == IoOp::Read {
                let mut expect = vec![0u8; len];
                fill_pattern(&mut expect, i);
                assert!(
                    c.buf.unwrap().as_slice() == &expect[..],
                    "{len} bytes at lba {lba} read back wrong"
                );
            }
        }
        done += len;
        lba += u64::from(blocks);
        i += 1;
    }
    let s = qp.stats();
    if tls {
        assert!(s.records > 0, "the data went in TLS records: {s:?}");
        assert!(
            s.record_bytes >= total as u64,
            "at least the data was sealed: {s:?}"
        );
    } else {
        assert_eq!(s.records, 0, "a plain connection seals nothing: {s:?}");
    }
}

#[test]
fn identify_and_64_mib_over_tls() {
    let t = tls_target(true);
    let mut ctrl = TcpController::connect(opts(&t, Some(KEY), IdentityVersion::V0), pool())
        .expect("TLS attach");
    assert_eq!(ctrl.identify().subnqn, NQN);
    assert_eq!(ctrl.namespaces().len(), 2);
    write_read_verify(&mut ctrl, SendMode::Deferred, 32 << 20, true);
    write_read_verify(&mut ctrl, SendMode::Inline, 16 << 20, true);
    write_read_verify(&mut ctrl, SendMode::Adaptive, 16 << 20, true);
    ctrl.shutdown().unwrap();
}

#[test]
fn v1_identity_is_accepted_too() {
    let t = tls_target(true);
    let mut ctrl = TcpController::connect(opts(&t, Some(KEY), IdentityVersion::V1), pool())
        .expect("TLS attach (v1)");
    write_read_verify(&mut ctrl, SendMode::Deferred, 1 << 20, true);
}

#[test]
fn wrong_psk_is_refused_with_a_typed_error() {
    let t = tls_target(true);
    let e =
        TcpController::connect(opts(&t, Some(OTHER_KEY), IdentityVersion::V0), pool()).unwrap_err();
    // The identity is known (same host and subsystem) but the PSK differs: the binder does not verify.
    assert!(matches!(e, Error::Tls(_) | Error::Closed), "{e:?}");
    t.wait_counters("the session closed", |c| c.closed >= 1);
    let closed = t.events_matching("TLS handshake failed");
    assert!(
        !closed.is_empty(),
        "the target says why: {:?}",
        t.events_matching("")
    );
}

#[test]
fn unknown_identity_is_refused() {
    let t = tls_target(true);
    let mut o = ConnectOptions::new(t.addr, NQN, "nqn.2024-01.io.nvpoll:stranger");
    o = o.with_tls_key(&ConfiguredKey::parse(KEY).unwrap(), IdentityVersion::V0);
    let e = TcpController::connect(o, pool()).unwrap_err();
    assert!(matches!(e, Error::Tls(_) | Error::Closed), "{e:?}");
}

#[test]
fn plaintext_host_refused_when_tls_is_required() {
    let t = tls_target(true);
    let e = TcpController::connect(opts(&t, None, IdentityVersion::V0), pool()).unwrap_err();
    assert!(
        matches!(e, Error::Closed | Error::Io { .. } | Error::Timeout(_)),
        "{e:?}"
    );
    t.wait_counters("the session closed", |c| c.closed >= 1);
}

#[test]
fn optional_tls_serves_both() {
    let t = tls_target(false);
    let mut plain =
        TcpController::connect(opts(&t, None, IdentityVersion::V0), pool()).expect("plain attach");
    write_read_verify(&mut plain, SendMode::Deferred, 1 << 20, false);
    let mut tls = TcpController::connect(opts(&t, Some(KEY), IdentityVersion::V0), pool())
        .expect("TLS attach");
    write_read_verify(&mut tls, SendMode::Deferred, 1 << 20, true);
}

#[test]
fn discovery_log_reports_treq_and_sectype() {
    use nvpoll::spec::{fabrics::DISCOVERY_NQN, log_page, DiscoveryLog, DiscoveryLogEntry, Sqe};
    for (required, treq) in [
        (true, DiscoveryLogEntry::TREQ_SECURE_REQUIRED),
        (false, DiscoveryLogEntry::TREQ_SECURE_NOT_REQUIRED),
    ] {
        let t = tls_target(required);
        let mut o = ConnectOptions::new(t.addr, DISCOVERY_NQN, HOSTNQN);
        o = o.with_tls_key(&ConfiguredKey::parse(KEY).unwrap(), IdentityVersion::V0);
        // The discovery controller is reached over TLS too (its identity names the discovery NQN).
        let key = ConfiguredKey::parse(KEY).unwrap();
        let t2 = TestTarget::start(|mut c| {
            c.tls = Some(TargetTls::with_host_keys(
                required,
                &[(HOSTNQN.to_string(), key)],
                &[NQN.to_string(), DISCOVERY_NQN.to_string()],
            ));
            c
        });
        drop(t);
        o.addr = t2.addr;
        let mut ctrl = TcpController::connect(o, pool()).expect("discovery attach over TLS");
        let buf = pool().alloc(4096).unwrap();
        let (cqe, buf) = ctrl
            .admin(
                Sqe::get_log_page(log_page::DISCOVERY, 0, 4096, 0),
                Some(buf),
            )
            .unwrap();
        assert!(cqe.status().is_success());
        let log = DiscoveryLog::parse(buf.unwrap().as_slice()).unwrap();
        let e = log
            .entries
            .iter()
            .find(|e| e.subnqn == NQN)
            .expect("our subsystem is listed");
        assert_eq!(e.treq & 0x3, treq);
        assert_eq!(e.tcp_sectype(), DiscoveryLogEntry::TCP_SECTYPE_TLS13);
    }
}

/// A target that knows two hosts, each with its own key.
fn two_host_target() -> TestTarget {
    TestTarget::start(|mut c| {
        c.tls = Some(TargetTls::with_host_keys(
            true,
            &[
                (HOST1.to_string(), ConfiguredKey::parse(KEY).unwrap()),
                (HOST2.to_string(), ConfiguredKey::parse(OTHER_KEY).unwrap()),
            ],
            &[
                NQN.to_string(),
                nvpoll::spec::fabrics::DISCOVERY_NQN.to_string(),
            ],
        ));
        c
    })
}

const HOST1: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-0000000000h1";
const HOST2: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-0000000000h2";

/// Options that prove `proven_host` (and `proven_sub`) in TLS with KEY, then claim `claimed_host` on
/// `claimed_sub` in Connect.
fn posing(
    t: &TestTarget,
    version: IdentityVersion,
    proven_host: &str,
    proven_sub: &str,
    claimed_host: &str,
    claimed_sub: &str,
) -> ConnectOptions {
    let key = ConfiguredKey::parse(KEY).unwrap();
    let (identity, psk) = key.derive(
        version,
        proven_host,
        proven_sub,
        nvpoll_tcp::tls::Derivation::Rfc8446,
    );
    let mut o = ConnectOptions::new(t.addr, claimed_sub, claimed_host);
    o.tls = Some(nvpoll_tcp::tls::ClientConfig::new(identity, psk));
    o
}

/// Connect is refused with Invalid Parameters, and the target's log says which field and why, with no key.
fn expect_refused(t: &TestTarget, o: ConnectOptions, field: &str) {
    use nvpoll::spec::Status;
    match TcpController::connect(o, pool()) {
        Err(Error::Refused(r)) => {
            assert!(r.status.is(Status::CONNECT_INVALID_PARAMETERS), "{r:?}")
        }
        Err(e) => panic!("expected Connect Invalid Parameters ({field}), got {e:?}"),
        Ok(_) => panic!("a host got in as another"),
    }
    let why = match field {
        "HOSTNQN" => "not the host in Connect",
        _ => "not the subsystem in Connect",
    };
    let log = t.wait_event("Connect refused");
    assert!(
        log.iter().any(|l| l.contains(why)),
        "the log says why ({why}): {log:?}"
    );
    assert!(
        log.iter()
            .all(|l| !l.contains("NVMeTLSkey") && !l.contains("VRLbtnN9")),
        "no key material in the log: {log:?}"
    );
}

#[test]
fn a_tls_identity_cannot_claim_another_host() {
    for v in [IdentityVersion::V0, IdentityVersion::V1] {
        let t = two_host_target();
        // host1's key, host1's identity, then Connect as host2.
        expect_refused(&t, posing(&t, v, HOST1, NQN, HOST2, NQN), "HOSTNQN");
        assert!(t.events_matching("admin queue of controller").is_empty());
        // The honest host1 gets in.
        let o = posing(&t, v, HOST1, NQN, HOST1, NQN);
        TcpController::connect(o, pool()).expect("host1 with its own identity");
    }
}

#[test]
fn a_tls_identity_for_one_subsystem_cannot_connect_to_another() {
    use nvpoll::spec::fabrics::DISCOVERY_NQN;
    let t = two_host_target();
    // Proven for the discovery subsystem, Connect to the NVM subsystem; and the other way round.
    expect_refused(
        &t,
        posing(&t, IdentityVersion::V0, HOST1, DISCOVERY_NQN, HOST1, NQN),
        "SUBNQN",
    );
    let t = two_host_target();
    expect_refused(
        &t,
        posing(&t, IdentityVersion::V1, HOST1, NQN, HOST1, DISCOVERY_NQN),
        "SUBNQN",
    );
}

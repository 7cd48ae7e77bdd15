//! DH-HMAC-CHAP between our initiator and our target (issue 34): every hash with the null group, ffdhe2048
//! and ffdhe8192, host-only and bidirectional, each followed by a write and a verified read; wrong keys
//! refused on either side with the reason in the target's log; nothing but authentication runs before it;
//! hostile hosts (a wrong transaction ID, a replayed Reply, one that stops mid-exchange); and
//! re-authentication of a live controller with a key changed at run time.

use nvpoll_testkit::target as target_common;

use std::time::{Duration, Instant};

use nvpoll::api::{IoOp, IoRequest, QueuePair};
use nvpoll::spec::fabrics::{self, FabricsCommand};
use nvpoll::spec::{ConnectData, Sqe, Status};
use nvpoll_target::{DhchapKey, DhchapPolicy, TargetConfig};
use nvpoll_tcp::dhchap::host::HostAuth;
use nvpoll_tcp::dhchap::{self, DhGroup, FailureReason, Hash, Message, Secret};
use nvpoll_tcp::host::{ConnectOptions, TcpController};
use nvpoll_tcp::pdu::Digests;
use target_common::{fill_pattern, pool, wait_one, RawHost, TestTarget, HOSTNQN, NQN};

/// Keys as nvme-cli 2.3 writes them (`gen-dhchap-key`): the host's transformed with SHA-256, the
/// controller's with SHA-512 (64 bytes), a second host key untransformed.
const HOST_KEY: &str = "DHHC-1:01:WulleCBkG4oCs0iIC3Cit9gBDCLWiZ9PNXuhqytWkBIZkvGy:";
const HOST_KEY_2: &str = "DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:";

fn ctrl_key() -> String {
    let raw: Vec<u8> = (0..64u8)
        .map(|i| i.wrapping_mul(7).wrapping_add(3))
        .collect();
    Secret::from_key(&raw, Some(Hash::Sha512))
        .unwrap()
        .to_dhhc1()
        .to_string()
}

fn start(ctrl: bool) -> TestTarget {
    start_with(ctrl, |c| c)
}

fn start_with(ctrl: bool, f: impl FnOnce(TargetConfig) -> TargetConfig) -> TestTarget {
    let key = DhchapKey {
        hostnqn: HOSTNQN.into(),
        key: Secret::parse(HOST_KEY).unwrap(),
        ctrl_key: ctrl.then(|| Secret::parse(&ctrl_key()).unwrap()),
        concat: false,
    };
    TestTarget::start(|mut c| {
        c.subsystems[0].dhchap_keys.push(key);
        f(c)
    })
}

fn options(t: &TestTarget, key: &str, ctrl: Option<&str>) -> ConnectOptions {
    let mut o = ConnectOptions::new(t.addr, NQN, HOSTNQN)
        .with_dhchap(key, ctrl)
        .unwrap();
    o.timeout = Duration::from_secs(10);
    o
}

/// Writes a pattern through a new I/O queue and reads it back.
fn write_read_verify(ctrl: &mut TcpController, seed: u64) {
    let mut qp = ctrl
        .connect_io_queue(16)
        .expect("I/O queue (it authenticates too)");
    let p = pool();
    let mut w = p.alloc(4096).unwrap();
    fill_pattern(&mut w.as_mut_slice()[..4096], seed);
    let expect = w.as_slice()[..4096].to_vec();
    for (op, buf) in [(IoOp::Write, w), (IoOp::Read, p.alloc(4096).unwrap())] {
        let req = IoRequest {
            op,
            nsid: 1,
            lba: seed % 1000 * 8,
            blocks: 8,
            buf: Some(buf),
            tag: 0,
        };
        qp.submit(req).map_err(|r| r.error).expect("submit");
        qp.flush().expect("flush");
        let c = wait_one(&mut qp);
        assert!(c.result.is_ok(), "{op:?}: {:?}", c.result);
        if op == IoOp::Read {
            assert_eq!(&c.buf.unwrap().as_slice()[..4096], &expect[..], "read back");
        }
    }
}

#[test]
fn every_hash_and_group_authenticates_one_way_and_both_ways() {
    let t = start(true);
    let ck = ctrl_key();
    let mut n = 0;
    for hash in Hash::ALL {
        for group in [DhGroup::Null, DhGroup::Ffdhe2048, DhGroup::Ffdhe8192] {
            t.handle
                .set_dhchap_policy(
                    NQN,
                    DhchapPolicy {
                        hashes: vec![hash],
                        groups: vec![group],
                    },
                )
                .unwrap();
            for bidi in [false, true] {
                let o = options(&t, HOST_KEY, bidi.then_some(ck.as_str()));
                let mut ctrl = TcpController::connect(o, pool())
                    .unwrap_or_else(|e| panic!("{hash} {group} bidi {bidi}: {e}"));
                write_read_verify(&mut ctrl, n);
                n += 1;
                let how = format!(
                    "(DH-HMAC-CHAP, {hash}, {group}, {})",
                    if bidi { "bidirectional" } else { "host only" }
                );
                let ev = t.events_matching(&how);
                assert!(
                    ev.len() >= 2,
                    "admin and I/O queue authenticated with {how}: {ev:?} {:?}",
                    t.events
                        .lock()
                        .unwrap()
                        .iter()
                        .rev()
                        .take(8)
                        .collect::<Vec<_>>()
                );
                drop(ctrl);
            }
        }
    }
    assert!(t.counters().authentications >= 36);
    assert_eq!(t.counters().auth_failures, 0);
}

#[test]
fn wrong_keys_are_refused_on_both_sides_with_the_reason_logged() {
    let t = start(true);
    // The host's key is wrong: the controller answers AUTH_Failure1.
    let e = TcpController::connect(options(&t, HOST_KEY_2, None), pool()).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("refused") && msg.contains("wrong key"),
        "{msg}"
    );
    t.wait_event("not authenticated: DH-HMAC-CHAP: authentication failed (wrong key)");

    // The controller's key is not the one the host expects: the host refuses the controller.
    let other = Secret::from_key(&[5u8; 64], Some(Hash::Sha512))
        .unwrap()
        .to_dhhc1();
    let e = TcpController::connect(options(&t, HOST_KEY, Some(&other)), pool()).unwrap_err();
    assert!(
        e.to_string().contains("controller failed to prove its key"),
        "{e}"
    );
    t.wait_event("the host did not accept the controller's response");

    // No key at all: the host says what is missing.
    let mut o = ConnectOptions::new(t.addr, NQN, HOSTNQN);
    o.timeout = Duration::from_secs(10);
    let e = TcpController::connect(o, pool()).unwrap_err();
    assert!(e.to_string().contains("--dhchap-secret"), "{e}");
    assert!(t.counters().auth_failures >= 2);
    // No log line carries key material.
    for line in t.events.lock().unwrap().iter() {
        for k in [HOST_KEY, HOST_KEY_2, &ctrl_key(), &other] {
            let b64 = &k[10..30];
            assert!(!line.contains(b64), "key material in the log: {line}");
        }
    }
}

#[test]
fn a_host_without_a_controller_key_on_the_target_cannot_ask_for_one() {
    let t = start(false);
    let e = TcpController::connect(options(&t, HOST_KEY, Some(&ctrl_key())), pool()).unwrap_err();
    assert!(e.to_string().contains("refused"), "{e}");
    t.wait_event("no controller key for it");
}

fn auth_send(h: &mut RawHost, msg: &[u8]) -> nvpoll::spec::Cqe {
    let sqe = FabricsCommand::AuthSend {
        secp: dhchap::SECP,
        spsp0: 1,
        spsp1: 1,
        tl: msg.len() as u32,
    }
    .to_sqe();
    h.run(sqe, msg, msg.len() as u32, &[]).0
}

fn auth_recv(h: &mut RawHost) -> Message {
    let sqe = FabricsCommand::AuthReceive {
        secp: dhchap::SECP,
        spsp0: 1,
        spsp1: 1,
        al: 4096,
    }
    .to_sqe();
    let (cqe, data) = h.run(sqe, &[], 4096, &[]);
    assert!(cqe.status().is_success(), "{:?}", cqe.status());
    Message::parse(&data).expect("a message")
}

fn negotiate(tid: u16, group: DhGroup) -> Vec<u8> {
    Message::Negotiate {
        tid,
        sc_c: 0,
        hashes: vec![Hash::Sha256 as u8],
        groups: vec![group as u8],
        dhchap: true,
    }
    .encode()
}

/// A raw admin queue that connected and was told to authenticate (AUTHREQ ATR, no concatenation).
fn raw_admin(t: &TestTarget, kato_ms: u32) -> (RawHost, u16) {
    raw_admin_expecting(t, kato_ms, 0x2)
}

/// A raw admin queue that connected; Connect's AUTHREQ bits 2:1 must be `authreq`.
fn raw_admin_expecting(t: &TestTarget, kato_ms: u32, authreq: u32) -> (RawHost, u16) {
    let mut h = RawHost::connect(t.addr);
    h.icreq(Digests::NONE);
    let cd = ConnectData {
        hostid: [7; 16],
        cntlid: fabrics::CNTLID_DYNAMIC,
        subnqn: NQN.into(),
        hostnqn: HOSTNQN.into(),
    };
    let cqe = h.fabrics_connect(0, 31, 0, kato_ms, &cd);
    assert!(cqe.status().is_success());
    assert_eq!(cqe.dw0 >> 16 & 0x6, authreq, "AUTHREQ bits 2:1 (ASCR, ATR)");
    (h, cqe.dw0 as u16)
}

/// The Reply a host with `key` sends to `challenge`.
fn reply_to(challenge: &Message, key: &Secret) -> Vec<u8> {
    let Message::Challenge { tid, seq, cval, .. } = challenge else {
        panic!("not a challenge: {challenge:?}")
    };
    let r = dhchap::response(
        dhchap::Role::Host,
        key,
        &dhchap::ResponseInput {
            hash: Hash::Sha256,
            challenge: cval,
            dh_secret: None,
            seq: *seq,
            tid: *tid,
            sc_c: 0,
            hostnqn: HOSTNQN,
            subnqn: NQN,
        },
    );
    Message::Reply {
        tid: *tid,
        cvalid: false,
        seq: 0,
        rval: r.to_vec(),
        cval: vec![0; 32],
        dhv: vec![],
    }
    .encode()
}

#[test]
fn nothing_but_authentication_runs_before_the_host_authenticated() {
    let t = start(false);
    let (mut h, _) = raw_admin(&t, 0);
    let (cqe, _) = h.run(Sqe::property_get(nvpoll::spec::reg::CAP, true), &[], 0, &[]);
    assert_eq!(cqe.status(), Status::AUTHENTICATION_REQUIRED);
    let mut identify = Sqe {
        opcode: nvpoll::spec::admin::IDENTIFY,
        cdw10: 1,
        ..Default::default()
    };
    identify.nsid = 0;
    let (cqe, data) = h.run(identify, &[], 4096, &[]);
    assert_eq!(cqe.status(), Status::AUTHENTICATION_REQUIRED);
    assert!(data.is_empty(), "no data before authentication");
    t.wait_event("before authentication: refused with Authentication Required");
    // A proper exchange then opens the queue.
    assert!(auth_send(&mut h, &negotiate(3, DhGroup::Null))
        .status()
        .is_success());
    let ch = auth_recv(&mut h);
    let key = Secret::parse(HOST_KEY).unwrap();
    assert!(auth_send(&mut h, &reply_to(&ch, &key))
        .status()
        .is_success());
    assert!(matches!(
        auth_recv(&mut h),
        Message::Success1 { rval: None, .. }
    ));
    let (cqe, _) = h.run(Sqe::property_get(nvpoll::spec::reg::CAP, true), &[], 0, &[]);
    assert!(cqe.status().is_success());
}

#[test]
fn hostile_hosts_are_refused_and_nothing_blocks() {
    let t = start(false);
    let key = Secret::parse(HOST_KEY).unwrap();

    // Another transaction's ID in the Reply: Failure1 (incorrect payload), then the queue closes.
    let (mut h, _) = raw_admin(&t, 0);
    auth_send(&mut h, &negotiate(9, DhGroup::Null));
    let ch = auth_recv(&mut h);
    let mut reply = reply_to(&ch, &key);
    reply[4] = 10;
    assert!(auth_send(&mut h, &reply).status().is_success());
    match auth_recv(&mut h) {
        Message::Failure {
            second: false,
            explanation,
            ..
        } => assert_eq!(explanation, FailureReason::IncorrectPayload as u8),
        m => panic!("expected Failure1, got {m:?}"),
    }
    h.expect_close();
    t.wait_event("Reply for transaction 10, expected 9");

    // A Reply replayed from an earlier transaction (another challenge): Failure1 (failed).
    let (mut h1, _) = raw_admin(&t, 0);
    auth_send(&mut h1, &negotiate(1, DhGroup::Null));
    let ch1 = auth_recv(&mut h1);
    let old = reply_to(&ch1, &key);
    assert!(auth_send(&mut h1, &old).status().is_success());
    assert!(matches!(auth_recv(&mut h1), Message::Success1 { .. }));
    let (mut h2, _) = raw_admin(&t, 0);
    auth_send(&mut h2, &negotiate(1, DhGroup::Null));
    let _fresh = auth_recv(&mut h2);
    assert!(auth_send(&mut h2, &old).status().is_success());
    match auth_recv(&mut h2) {
        Message::Failure { explanation, .. } => {
            assert_eq!(explanation, FailureReason::Failed as u8)
        }
        m => panic!("expected Failure1, got {m:?}"),
    }

    // Messages out of order: a Reply before Negotiate, Success2 when none is due.
    let (mut h3, _) = raw_admin(&t, 0);
    auth_send(&mut h3, &negotiate(2, DhGroup::Null));
    assert!(auth_send(&mut h3, &Message::Success2 { tid: 2 }.encode())
        .status()
        .is_success());
    match auth_recv(&mut h3) {
        Message::Failure { explanation, .. } => {
            assert_eq!(explanation, FailureReason::IncorrectProtocolMessage as u8)
        }
        m => panic!("expected Failure1, got {m:?}"),
    }

    // A malformed Authentication Send: wrong SECP is an invalid field, and the queue goes on waiting.
    let (mut h4, _) = raw_admin(&t, 0);
    let msg = negotiate(4, DhGroup::Null);
    let mut sqe = FabricsCommand::AuthSend {
        secp: 0xea,
        spsp0: 1,
        spsp1: 1,
        tl: msg.len() as u32,
    }
    .to_sqe();
    sqe.cid = 0;
    let (cqe, _) = h4.run(sqe, &msg, msg.len() as u32, &[]);
    assert_eq!(
        (cqe.status().sct(), cqe.status().sc()),
        (Status::INVALID_FIELD.sct(), Status::INVALID_FIELD.sc())
    );

    // The target still serves a good host.
    let mut ctrl = TcpController::connect(options(&t, HOST_KEY, None), pool()).unwrap();
    write_read_verify(&mut ctrl, 77);
}

#[test]
fn a_slow_host_has_its_time_for_each_step_and_a_stopped_one_is_closed() {
    // The host's time runs from each of its messages (a slow host's ffdhe8192 arithmetic, or its crypto
    // modules loading, can take seconds: more than 16 s in an emulated guest), not for the whole transaction;
    // the keep-alive timer (600 ms here) does not run before the admin queue authenticated.
    let step = Duration::from_secs(3);
    let t = start_with(false, |mut c| {
        c.auth_step_timeout = step;
        c
    });
    let key = Secret::parse(HOST_KEY).unwrap();
    let pause = step / 2;

    // Three steps of half the time each, one and a half times the step in all: authenticated.
    let (mut h, _) = raw_admin(&t, 600);
    std::thread::sleep(pause);
    auth_send(&mut h, &negotiate(6, DhGroup::Null));
    let ch = auth_recv(&mut h);
    std::thread::sleep(pause);
    assert!(auth_send(&mut h, &reply_to(&ch, &key))
        .status()
        .is_success());
    std::thread::sleep(pause);
    assert!(matches!(
        auth_recv(&mut h),
        Message::Success1 { rval: None, .. }
    ));
    let (cqe, _) = h.run(Sqe::property_get(nvpoll::spec::reg::CAP, true), &[], 0, &[]);
    assert!(cqe.status().is_success(), "the slow host is served");

    // A host that stops mid-exchange: the target ends the queue by itself once the step's time is up.
    let (mut h5, _) = raw_admin(&t, 600);
    auth_send(&mut h5, &negotiate(5, DhGroup::Ffdhe2048));
    let _ = auth_recv(&mut h5);
    let t0 = Instant::now();
    assert!(!h5.still_open_after(step * 4), "the queue is closed");
    let waited = t0.elapsed();
    assert!(
        waited >= step - Duration::from_millis(100) && waited < step * 2,
        "closed after the step's time, not {waited:?}"
    );
    t.wait_event("sent no next authentication message within 3s");
    let mut ctrl = TcpController::connect(options(&t, HOST_KEY, None), pool()).unwrap();
    write_read_verify(&mut ctrl, 78);
}

#[test]
fn a_live_controller_reauthenticates_with_a_key_changed_at_run_time() {
    let t = start(false);
    let mut ctrl = TcpController::connect(options(&t, HOST_KEY, None), pool()).unwrap();
    write_read_verify(&mut ctrl, 1);
    // The target gets a new key for the host: the old one no longer authenticates.
    t.handle
        .set_dhchap_key(
            NQN,
            DhchapKey {
                hostnqn: HOSTNQN.into(),
                key: Secret::parse(HOST_KEY_2).unwrap(),
                ctrl_key: None,
                concat: false,
            },
        )
        .unwrap();
    ctrl.reauthenticate(Some(HostAuth::new(
        Secret::parse(HOST_KEY_2).unwrap(),
        None,
    )))
    .expect("re-authentication with the new key");
    write_read_verify(&mut ctrl, 2);
    let before = t.counters().auth_failures;
    let e = ctrl
        .reauthenticate(Some(HostAuth::new(Secret::parse(HOST_KEY).unwrap(), None)))
        .unwrap_err();
    assert!(e.to_string().contains("wrong key"), "{e}");
    assert!(t.counters().auth_failures > before);
}

/// Secure channel concatenation between our own ends (the Linux host has it from 6.15; the guest's 6.12 does
/// not): the admin queue authenticates without TLS and generates a PSK, every queue then runs TLS 1.3 with the
/// `NVMe1G` identity derived from it, and the plain admin queue carries nothing but the authentication.
#[test]
fn secure_channel_concatenation_between_our_ends() {
    let t = TestTarget::start(|mut c| {
        c.subsystems[0].dhchap_keys.push(DhchapKey {
            hostnqn: HOSTNQN.into(),
            key: Secret::parse(HOST_KEY).unwrap(),
            ctrl_key: Some(Secret::parse(&ctrl_key()).unwrap()),
            concat: true,
        });
        // TLS optional: the first admin queue comes without it.
        c.tls = Some(nvpoll_target::TargetTls {
            required: false,
            keys: Vec::new(),
            subnqns: Vec::new(),
        });
        c
    });
    for (hash, bidi) in [(Hash::Sha256, false), (Hash::Sha384, true)] {
        t.handle
            .set_dhchap_policy(
                NQN,
                DhchapPolicy {
                    hashes: vec![hash],
                    groups: vec![DhGroup::Ffdhe2048],
                },
            )
            .unwrap();
        let ck = ctrl_key();
        let mut o = options(&t, HOST_KEY, bidi.then_some(ck.as_str()));
        o.dhchap.as_mut().unwrap().concat = true;
        let mut ctrl = TcpController::connect(o, pool()).expect("connect with concatenation");
        write_read_verify(&mut ctrl, 40 + u64::from(bidi));
        let ev = t.wait_event(&format!(
            "secure channel concatenation: TLS identity NVMe1G0{} {HOSTNQN} {NQN} ",
            hash as u8
        ));
        assert_eq!(
            ev.len(),
            1,
            "one transaction, on the plain admin queue: {ev:?}"
        );
        t.events.lock().unwrap().clear();
    }

    t.handle
        .set_dhchap_policy(NQN, DhchapPolicy::default())
        .unwrap();
    // A host that does not offer concatenation is refused: the target requires it (AUTHREQ ASCR).
    let e = TcpController::connect(options(&t, HOST_KEY, None), pool()).unwrap_err();
    assert!(e.to_string().contains("--concat"), "{e}");

    // The plain queue that authenticated with concatenation carries no command.
    let (mut h, _) = raw_admin_expecting(&t, 0, 0x6);
    let mut neg = negotiate(1, DhGroup::Null);
    neg[6] = dhchap::SC_C_NEW_TLS_PSK;
    assert!(auth_send(&mut h, &neg).status().is_success());
    match auth_recv(&mut h) {
        Message::Failure { explanation, .. } => {
            assert_eq!(
                explanation,
                FailureReason::DhGroupUnusable as u8,
                "concatenation needs a DH group"
            )
        }
        m => panic!("expected Failure1, got {m:?}"),
    }
}

//! Connection loss and recovery, against our own target on loopback: the target is stopped and restarted (its
//! namespace in a file, so the data persists), or stopped for good. Every accepted command completes exactly
//! once; a write completes successfully only if the target acknowledged it; with the retry policy nothing
//! fails while the target comes back within ctrl-loss-tmo.

use nvpoll_testkit::target as target_common;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use nvpoll::api::{Completion, Controller, IoOp, IoRequest, QueuePair};
use nvpoll::mem::DmaPool;
use nvpoll::spec::Sqe;
use nvpoll_target::{Backing, SubsystemConfig, TargetConfig};
use nvpoll_tcp::host::{ConnectOptions, Recovery, TcpController, TcpQueuePair};
use nvpoll_tcp::queue::{DataDir, HostQueue, QueueParams};
use target_common::{fill_pattern, TestTarget, HOSTNQN, NQN};

const BLOCKS: u64 = 8192; // 4 MiB of 512-byte blocks

fn file_target(path: &std::path::Path, addr: SocketAddr) -> TestTarget {
    let subsys = SubsystemConfig::new(NQN).namespace(Backing::File(path.to_path_buf()), 512);
    TestTarget::start_with(TargetConfig::new(addr).subsystem(subsys))
}

fn options(addr: SocketAddr, recovery: Recovery, ctrl_loss_tmo: Duration) -> ConnectOptions {
    let mut o = ConnectOptions::new(addr, NQN, HOSTNQN);
    o.reconnect_delay = Duration::from_millis(100);
    o.ctrl_loss_tmo = ctrl_loss_tmo;
    o.timeout = Duration::from_secs(2);
    o.recovery = recovery;
    o
}

fn submit_write(qp: &mut TcpQueuePair, pool: &DmaPool, lba: u64, seed: u64) {
    let mut buf = pool.alloc(4096).unwrap();
    fill_pattern(buf.as_mut_slice(), seed);
    qp.submit(IoRequest {
        op: IoOp::Write,
        nsid: 1,
        lba,
        blocks: 8,
        buf: Some(buf),
        tag: seed,
    })
    .map_err(|r| r.error)
    .expect("accepted");
}

/// Polls the controller and the queue pair until `n` completions arrived or `limit` passed.
fn collect(
    ctrl: &mut TcpController,
    qp: &mut TcpQueuePair,
    n: usize,
    limit: Duration,
) -> Vec<Completion> {
    let deadline = Instant::now() + limit;
    let mut out = Vec::new();
    while out.len() < n {
        // The controller being given up is reported here; the queue pair fails its commands on its own.
        let _ = ctrl.poll_admin();
        qp.flush().unwrap();
        let _ = qp.poll(64);
        while let Some(c) = qp.pop_completion() {
            out.push(c);
        }
        assert!(
            Instant::now() < deadline,
            "{} of {n} completions after {limit:?}",
            out.len()
        );
    }
    out
}

fn unique_tags(done: &[Completion]) {
    let mut seen = HashSet::new();
    for c in done {
        assert!(seen.insert(c.tag), "command {} completed twice", c.tag);
    }
}

#[test]
fn target_restart_retries_outstanding_and_new_commands() {
    let dir = std::env::temp_dir().join(format!("nvpoll-recovery-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("ns1.img");
    std::fs::write(&path, vec![0u8; (BLOCKS * 512) as usize]).unwrap();
    let target = file_target(&path, "127.0.0.1:0".parse().unwrap());
    let addr = target.addr;
    let pool = DmaPool::builder().class(4096, 256).build().unwrap();
    let mut ctrl = TcpController::connect(
        options(addr, Recovery::Retry, Duration::from_secs(20)),
        pool.clone(),
    )
    .unwrap();
    let mut qp = ctrl.create_queue_pair(32).unwrap();

    // 32 writes acknowledged before the fault.
    for i in 0..32 {
        submit_write(&mut qp, &pool, i * 8, i);
    }
    let before = collect(&mut ctrl, &mut qp, 32, Duration::from_secs(10));
    assert!(before.iter().all(|c| c.result.is_ok()));

    // The target goes away; 32 more writes are submitted while it is down.
    drop(target);
    for i in 32..64 {
        submit_write(&mut qp, &pool, i * 8, i);
    }
    // It comes back on the same address with the same file.
    let target = file_target(&path, addr);
    let after = collect(&mut ctrl, &mut qp, 32, Duration::from_secs(20));
    unique_tags(&after);
    for c in &after {
        c.result.as_ref().unwrap_or_else(|e| {
            panic!("write {} failed although the target came back: {e}", c.tag)
        });
    }
    let r = qp.recovery_stats();
    assert!(r.losses >= 1 && r.reconnects >= 1, "{r:?}");
    assert!(ctrl.reconnects() >= 1);

    // Every write reads back: the acknowledged ones were on disk, the retried ones were written again.
    for half in 0..2u64 {
        for i in half * 32..half * 32 + 32 {
            let buf = pool.alloc(4096).unwrap();
            qp.submit(IoRequest {
                op: IoOp::Read,
                nsid: 1,
                lba: i * 8,
                blocks: 8,
                buf: Some(buf),
                tag: 1000 + i,
            })
            .map_err(|r| r.error)
            .unwrap();
        }
        let reads = collect(&mut ctrl, &mut qp, 32, Duration::from_secs(10));
        for c in reads {
            c.result.as_ref().unwrap();
            let mut expect = vec![0u8; 4096];
            fill_pattern(&mut expect, c.tag - 1000);
            assert!(
                c.buf.unwrap().as_slice() == &expect[..],
                "block {} lost its data",
                c.tag - 1000
            );
        }
    }
    drop(qp);
    ctrl.shutdown().unwrap();
    drop(target);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn target_gone_for_good_fails_everything_after_ctrl_loss_tmo() {
    let target = TestTarget::start(|c| c);
    let pool = DmaPool::builder().class(4096, 256).build().unwrap();
    let mut ctrl = TcpController::connect(
        options(target.addr, Recovery::Retry, Duration::from_millis(800)),
        pool.clone(),
    )
    .unwrap();
    let mut qp = ctrl.create_queue_pair(16).unwrap();
    drop(target);
    for i in 0..16 {
        submit_write(&mut qp, &pool, i * 8, i);
    }
    let t0 = Instant::now();
    let done = collect(&mut ctrl, &mut qp, 16, Duration::from_secs(15));
    unique_tags(&done);
    assert!(
        done.iter().all(|c| c.result.is_err()),
        "no write is reported done without the target"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "gave up within a bounded time: {:?}",
        t0.elapsed()
    );
    // Each says once, as a lost connection (never as the peer's protocol violation), that the controller
    // was given up.
    for c in &done {
        let e = c.result.as_ref().unwrap_err();
        assert!(matches!(e, nvpoll::Error::ConnectionLost(_)), "{e:?}");
        assert_eq!(
            e.to_string(),
            format!("connection lost: queue {} failed: {GIVEN_UP}", qp.qid())
        );
    }
    // What perf prints for the controller: "perf: controller 0: {e}".
    let e = nvpoll::api::Controller::poll_admin(&mut ctrl).expect_err("the controller is lost");
    assert!(matches!(e, nvpoll::Error::ConnectionLost(_)), "{e:?}");
    assert_eq!(e.to_string(), format!("connection lost: {GIVEN_UP}"));
    let buf = pool.alloc(4096).unwrap();
    let r = qp.submit(IoRequest {
        op: IoOp::Read,
        nsid: 1,
        lba: 0,
        blocks: 8,
        buf: Some(buf),
        tag: 99,
    });
    let e = r
        .expect_err("a lost controller refuses new commands at once")
        .error;
    assert!(matches!(e, nvpoll::Error::ConnectionLost(_)), "{e:?}");
    assert_eq!(e.to_string(), format!("connection lost: {GIVEN_UP}"));
}

/// How a given-up controller's errors end.
const GIVEN_UP: &str = "controller given up: ctrl-loss-tmo expired";

#[test]
fn fail_fast_fails_outstanding_at_once() {
    let target = TestTarget::start(|c| c);
    let pool = DmaPool::builder().class(4096, 256).build().unwrap();
    let mut ctrl = TcpController::connect(
        options(target.addr, Recovery::FailFast, Duration::from_secs(5)),
        pool.clone(),
    )
    .unwrap();
    let mut qp = ctrl.create_queue_pair(16).unwrap();
    // Queue the writes but do not flush them: they are outstanding when the target goes away.
    qp.set_send_mode(nvpoll::send::SendMode::Deferred).unwrap();
    for i in 0..16 {
        submit_write(&mut qp, &pool, i * 8, i);
    }
    drop(target);
    let done = collect(&mut ctrl, &mut qp, 16, Duration::from_secs(10));
    unique_tags(&done);
    // Some may have been acknowledged before the target stopped; none after.
    let failed = done.iter().filter(|c| c.result.is_err()).count();
    assert!(failed > 0, "the target vanished with writes outstanding");
    assert!(qp.recovery_stats().failed as usize >= failed);
}

/// A command the controller never answers: an Abort is requested after the timeout, and the command fails
/// with a timeout after the grace period (the scripted peer answers nothing).
#[test]
fn command_timeout_requests_abort_then_expires() {
    use std::io::{Read, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut icreq = [0u8; 128];
        s.read_exact(&mut icreq).unwrap();
        let mut resp = Vec::new();
        let ic = nvpoll_tcp::pdu::IcResp {
            pfv: 0,
            cpda: 0,
            digests: nvpoll_tcp::pdu::Digests::NONE,
            maxh2cdata: 128 * 1024,
        };
        nvpoll_tcp::pdu::encode_ic_resp(&mut resp, &ic);
        s.write_all(&resp).unwrap();
        // Read and ignore everything until the host goes away.
        let mut sink = [0u8; 4096];
        while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
    });
    let mut q = HostQueue::connect(&QueueParams {
        addr,
        qid: 1,
        depth: 4,
        header_digest: false,
        data_digest: false,
        max_transfer: 4096,
        connect_timeout: Duration::from_secs(5),
        tls: None,
        key_renewal: Default::default(),
        tcp_congestion: None,
    })
    .unwrap();
    q.submit(Sqe::flush(1), DataDir::None, None, 0, 7)
        .map_err(|(e, _)| e)
        .unwrap();
    q.flush().unwrap();
    let (timeout, grace) = (Duration::from_millis(200), Duration::from_millis(100));
    let mut aborts = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    let expired = loop {
        q.poll().unwrap();
        if let Some(cid) = q.check_timeouts(timeout, grace, &mut |cid| aborts.push(cid)) {
            break cid;
        }
        assert!(Instant::now() < deadline, "the command never expired");
    };
    assert_eq!(
        aborts,
        vec![expired],
        "one Abort requested for the stuck command"
    );
    q.expire(expired);
    let d = q.pop_done().expect("the expired command completes");
    assert_eq!(d.tag, 7);
    assert!(
        matches!(d.result, Err(nvpoll_tcp::Error::Timeout(_))),
        "{:?}",
        d.result
    );
    assert_eq!(q.outstanding(), 0);
}

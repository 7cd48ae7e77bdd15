//! A target that has served thousands of connections, ended every way a host can end one, keeps nothing of
//! them: every connection closed, no controller left in the subsystem, the reactor walks as many pollers as
//! before, and the process's memory stays flat. (Its throughput after such a soak is measured, side by side
//! with a fresh target, by `cargo bench --bench soak`.)

use nvpoll_testkit::target as target_common;

use std::net::TcpStream;
use std::time::{Duration, Instant};

use nvpoll::api::{Controller, IoOp, IoRequest, QueuePair};
use nvpoll::spec::Sqe;
use nvpoll_tcp::host::{ConnectOptions, TcpController};
use nvpoll_tcp::pdu::Digests;
use target_common::{pool, RawHost, Resp, TestTarget, HOSTNQN, NQN};

/// Resident memory of this process in bytes.
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("resident pages");
    pages * 4096
}

/// The TCP connections `one(kind)` opens.
fn connections(kind: usize) -> u64 {
    [2, 1, 1, 1, 2][kind % 5]
}

/// One session, ended in the way `kind` picks.
fn one(t: &TestTarget, kind: usize, p: &nvpoll::mem::DmaPool) {
    match kind % 5 {
        // A whole session: our initiator, an I/O queue, a write and a read, a clean shutdown.
        0 => {
            let mut c =
                TcpController::connect(ConnectOptions::new(t.addr, NQN, HOSTNQN), p.clone())
                    .expect("attach");
            let mut qp = c.create_queue_pair(4).expect("I/O queue");
            for (tag, op) in [(1, IoOp::Write), (2, IoOp::Read)] {
                qp.submit(IoRequest {
                    op,
                    nsid: 1,
                    lba: (kind as u64 * 8) % 1024,
                    blocks: 8,
                    buf: Some(p.alloc(4096).unwrap()),
                    tag,
                })
                .map_err(|r| r.error)
                .unwrap();
                qp.flush().unwrap();
                let deadline = Instant::now() + Duration::from_secs(10);
                while qp.outstanding() > 0 {
                    qp.process_completions(4, |_, c| c.result.as_ref().map(|_| ()).expect("I/O"))
                        .unwrap();
                    assert!(Instant::now() < deadline, "I/O timed out");
                }
            }
            drop(qp);
            c.shutdown().expect("shutdown");
        }
        // An admin queue, then gone without a word.
        1 => drop(RawHost::admin_queue(t.addr, NQN, 0)),
        // ICReq only.
        2 => {
            let mut h = RawHost::connect(t.addr);
            h.icreq(Digests::NONE);
        }
        // A TCP connection that never says anything.
        3 => drop(TcpStream::connect(t.addr).expect("TCP connect")),
        // A write waiting for its data (R2T sent) when the host vanishes, its admin queue still open.
        _ => {
            let (admin, cntlid) = RawHost::admin_queue(t.addr, NQN, 0);
            let (mut q, cqe) = RawHost::io_queue(t.addr, cntlid, 1, 15, 0, Digests::NONE);
            assert!(cqe.status().is_success());
            let mut sqe = Sqe::write(1, 0, 127);
            sqe.cid = q.cid();
            q.send_cmd(sqe, &[], 65536);
            assert!(matches!(q.recv(), Some(Resp::R2T(_))));
            drop(q);
            drop(admin);
        }
    }
}

#[test]
fn thousands_of_connections_leave_nothing_behind() {
    let t = TestTarget::start(|c| c);
    let p = pool();
    // Warm up (buffers, allocator arenas), then take the baseline.
    for i in 0..100 {
        one(&t, i, &p);
    }
    let warm: u64 = (0..100).map(connections).sum();
    t.wait_counters("the warm-up's connections to close", |c| {
        c.accepted == warm && c.closed == warm
    });
    let pollers = t.reactor_stats()[0].pollers;
    let before = rss();
    let total = 2000;
    for i in 0..total {
        one(&t, i, &p);
    }
    let expect = warm + (0..total).map(connections).sum::<u64>();
    let c = t.wait_counters("every connection to close", |c| {
        c.accepted == expect && c.closed == expect
    });
    assert_eq!(c.dropped, 0, "{c}");
    assert_eq!(c.internal_errors, 0, "{c}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = &t.handle.subsystems()[0];
        let now = t.reactor_stats()[0].pollers;
        if s.controllers == 0 && now == pollers {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "left behind: {} controllers, {now} pollers (baseline {pollers})",
            s.controllers
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let grown = rss().saturating_sub(before);
    assert!(
        grown < 32 << 20,
        "memory grew by {} MiB over {total} sessions",
        grown >> 20
    );
    eprintln!(
        "{} connections: {} KiB more resident memory, {pollers} pollers before and after",
        c.accepted,
        grown >> 10
    );
}

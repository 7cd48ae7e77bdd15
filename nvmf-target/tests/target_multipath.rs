//! Our initiator's multipath against our target: one subsystem over two paths, I/O spread by the path
//! policy, moved off a path whose ANA group turns inaccessible and back when it is optimized again, and
//! moved to the other of two target processes (here: two targets sharing a file namespace) when one dies,
//! only after the quiesce time. Nothing fails, nothing is lost, every block reads back as last written.

use nvpoll_testkit::target as target_common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use nvpoll::api::{IoOp, IoRequest, QueuePair};
use nvpoll::mem::DmaPool;
use nvpoll::spec::AnaState;
use nvpoll_target::{Backing, CntlidRange, SubsystemConfig, TargetConfig, TlsMode};
use nvpoll_tcp::host::ConnectOptions;
use nvpoll_tcp::multipath::{MultipathController, MultipathQueuePair, PathPolicy};
use target_common::{pool, TestTarget, HOSTNQN, NQN};

const BLOCKS: u64 = 2048;
const BS: usize = 512;

fn free_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

fn path(addr: SocketAddr) -> ConnectOptions {
    let mut o = ConnectOptions::new(addr, NQN, HOSTNQN);
    o.kato = Duration::from_secs(1);
    o.ana_refresh = Duration::from_millis(100);
    o.reconnect_delay = Duration::from_millis(200);
    o.ctrl_loss_tmo = Duration::from_secs(30);
    o
}

/// Attaches the subsystem over `paths`, opens an I/O queue pair, and writes until every path has completed
/// `per_path_min` commands.
fn attach_and_spread(
    paths: Vec<ConnectOptions>,
    policy: PathPolicy,
    per_path_min: u64,
) -> (MultipathController, MultipathQueuePair, Writer) {
    let pool = pool();
    let mut ctrl =
        MultipathController::connect(paths, pool.clone(), policy).expect("attach both paths");
    let mut qp = ctrl.connect_io_queue(32).unwrap();
    let mut w = Writer::new(pool);
    w.run(
        &mut ctrl,
        &mut qp,
        16,
        |q| per_path(q).iter().all(|&n| n >= per_path_min),
        Duration::from_secs(20),
    );
    (ctrl, qp, w)
}

/// Keeps `qd` writes of one block outstanding, each to a random block with a fresh stamp, for `time`,
/// polling the controller's admin side too; remembers what each block holds. Panics on any failure.
struct Writer {
    pool: DmaPool,
    written: HashMap<u64, u64>,
    stamp: u64,
    inflight: HashMap<u64, (u64, u64)>,
    next_tag: u64,
}

impl Writer {
    fn new(pool: DmaPool) -> Writer {
        Writer {
            pool,
            written: HashMap::new(),
            stamp: 1,
            inflight: HashMap::new(),
            next_tag: 0,
        }
    }

    fn run(
        &mut self,
        ctrl: &mut MultipathController,
        qp: &mut MultipathQueuePair,
        qd: usize,
        mut until: impl FnMut(&MultipathQueuePair) -> bool,
        limit: Duration,
    ) {
        let deadline = Instant::now() + limit;
        let mut last_admin = Instant::now();
        while !until(qp) {
            assert!(
                Instant::now() < deadline,
                "the condition never held: {:?}",
                qp.multipath_stats()
            );
            while self.inflight.len() < qd {
                self.stamp += 1;
                let lba = (self.stamp * 7919) % BLOCKS;
                if self.inflight.values().any(|&(l, _)| l == lba) {
                    continue;
                }
                let mut buf = self.pool.alloc(BS).unwrap();
                buf.set_len(BS).unwrap();
                buf.as_mut_slice()[..8].copy_from_slice(&self.stamp.to_le_bytes());
                buf.as_mut_slice()[8..16].copy_from_slice(&lba.to_le_bytes());
                let tag = self.next_tag;
                self.next_tag += 1;
                qp.submit(IoRequest {
                    op: IoOp::Write,
                    nsid: 1,
                    lba,
                    blocks: 1,
                    buf: Some(buf),
                    tag,
                })
                .expect("the multipath queue pair accepts");
                self.inflight.insert(tag, (lba, self.stamp));
            }
            qp.flush().unwrap();
            qp.poll(64).unwrap();
            while let Some(c) = qp.pop_completion() {
                let (lba, stamp) = self.inflight.remove(&c.tag).expect("a tag we sent");
                if let Err(e) = c.result {
                    panic!(
                        "write of block {lba} failed: {e} ({:?})",
                        qp.multipath_stats()
                    );
                }
                self.written.insert(lba, stamp);
            }
            if last_admin.elapsed() >= Duration::from_millis(20) {
                nvpoll::api::Controller::poll_admin(ctrl).expect("a path is alive");
                last_admin = Instant::now();
            }
        }
    }

    /// Drains and verifies ([`Writer::drain_and_verify`]); every request must have come back successful.
    fn finish_clean(&mut self, ctrl: &mut MultipathController, qp: &mut MultipathQueuePair) {
        self.drain_and_verify(ctrl, qp);
        let s = qp.multipath_stats();
        assert_eq!(s.failed, 0, "{s:?}");
        assert_eq!(
            s.submitted, s.ok,
            "every request came back successful: {s:?}"
        );
    }

    /// Waits for what is in flight, then reads every written block back through the multipath queue pair.
    fn drain_and_verify(&mut self, ctrl: &mut MultipathController, qp: &mut MultipathQueuePair) {
        self.run(
            ctrl,
            qp,
            0,
            |q| q.outstanding() == 0,
            Duration::from_secs(30),
        );
        for (&lba, &stamp) in &self.written {
            let buf = self.pool.alloc(BS).unwrap();
            qp.submit(IoRequest {
                op: IoOp::Read,
                nsid: 1,
                lba,
                blocks: 1,
                buf: Some(buf),
                tag: u64::MAX,
            })
            .unwrap();
            qp.flush().unwrap();
            let deadline = Instant::now() + Duration::from_secs(20);
            let c = loop {
                qp.poll(1).unwrap();
                if let Some(c) = qp.pop_completion() {
                    break c;
                }
                nvpoll::api::Controller::poll_admin(ctrl).unwrap();
                assert!(
                    Instant::now() < deadline,
                    "read of block {lba} never completed"
                );
            };
            c.result.expect("the read succeeds");
            let b = c.buf.unwrap();
            let got = u64::from_le_bytes(b.as_slice()[..8].try_into().unwrap());
            let got_lba = u64::from_le_bytes(b.as_slice()[8..16].try_into().unwrap());
            assert_eq!(
                (got_lba, got),
                (lba, stamp),
                "block {lba} holds the last write"
            );
        }
    }
}

/// Two targets (as two target processes would be) exporting `NQN` from one file, with disjoint controller
/// IDs; returns the folder of the file (the caller removes it) and both.
fn two_targets_sharing_a_file(name: &str) -> (std::path::PathBuf, TestTarget, TestTarget) {
    let dir = std::env::temp_dir().join(format!("nvpoll-mp-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let image = dir.join("shared.img");
    std::fs::write(&image, vec![0u8; BLOCKS as usize * BS]).unwrap();
    let start = |range: CntlidRange| {
        let mut subsys = SubsystemConfig::new(NQN).namespace(Backing::File(image.clone()), 512);
        subsys.cntlids = range;
        TestTarget::start_with(TargetConfig::new(free_addr()).subsystem(subsys))
    };
    let ta = start(CntlidRange { min: 1, max: 99 });
    let tb = start(CntlidRange { min: 100, max: 199 });
    (dir, ta, tb)
}

fn per_path(qp: &MultipathQueuePair) -> Vec<u64> {
    qp.multipath_stats().per_path
}

#[test]
fn ana_inaccessible_moves_io_off_a_path_and_optimized_brings_it_back() {
    let a = free_addr();
    let b = free_addr();
    let subsys = SubsystemConfig::new(NQN).namespace(Backing::Ram(BLOCKS * BS as u64), 512);
    let t = TestTarget::start_with(
        TargetConfig::new(a)
            .listener(b, TlsMode::Off)
            .subsystem(subsys),
    );
    // Both paths carry I/O.
    let (mut ctrl, mut qp, mut w) =
        attach_and_spread(vec![path(a), path(b)], PathPolicy::RoundRobin, 200);

    // Inaccessible: path A takes nothing. Non-optimized: it works, but optimized B is preferred.
    for (state, why) in [
        (
            AnaState::Inaccessible,
            "no command went to the inaccessible path",
        ),
        (AnaState::NonOptimized, "the optimized path is preferred"),
    ] {
        t.handle.set_ana_state(NQN, a, 1, state).unwrap();
        // Within the ANA refresh (or at the first refused command) path A sees it.
        w.run(
            &mut ctrl,
            &mut qp,
            16,
            |q| q.paths()[0].ana_state(1) == state,
            Duration::from_secs(10),
        );
        let settled = per_path(&qp);
        w.run(
            &mut ctrl,
            &mut qp,
            16,
            |q| per_path(q)[1] >= settled[1] + 500,
            Duration::from_secs(20),
        );
        assert_eq!(per_path(&qp)[0], settled[0], "{why}");
    }

    // Failback: A optimized again takes its share.
    t.handle
        .set_ana_state(NQN, a, 1, AnaState::Optimized)
        .unwrap();
    let before = per_path(&qp);
    w.run(
        &mut ctrl,
        &mut qp,
        16,
        |q| per_path(q)[0] >= before[0] + 200,
        Duration::from_secs(20),
    );

    w.finish_clean(&mut ctrl, &mut qp);
}

#[test]
fn a_dead_target_process_hands_its_io_to_the_other_after_the_quiesce_time() {
    let (dir, ta, tb) = two_targets_sharing_a_file("dead");
    let (mut ctrl, mut qp, mut w) = attach_and_spread(
        vec![path(ta.addr), path(tb.addr)],
        PathPolicy::QueueDepth,
        200,
    );
    let quiesce = ctrl.paths()[0].options().kato + ctrl.paths()[0].cqt();
    assert!(
        ctrl.paths()[0].cqt() > Duration::ZERO,
        "our target reports CQT"
    );

    // Path A's target goes away with commands outstanding on it.
    drop(ta);
    let killed = Instant::now();
    w.run(
        &mut ctrl,
        &mut qp,
        16,
        |q| q.multipath_stats().held > 0 && q.multipath_stats().retried > 0,
        Duration::from_secs(30),
    );
    assert!(
        killed.elapsed() >= quiesce,
        "commands of the dead path waited the quiesce time ({quiesce:?}) before going elsewhere"
    );
    let s = qp.multipath_stats();
    assert!(s.longest_failover >= quiesce, "{s:?}");
    let settled = per_path(&qp);
    w.run(
        &mut ctrl,
        &mut qp,
        16,
        |q| per_path(q)[1] >= settled[1] + 500,
        Duration::from_secs(20),
    );
    w.finish_clean(&mut ctrl, &mut qp);
    drop(tb);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_reconnect_that_hangs_never_stalls_the_other_path() {
    // Path A's target dies and a silent listener takes its port: it accepts the reconnect's TCP connection
    // and never answers ICReq, so each attempt waits the whole step timeout. That wait must happen off the
    // caller's thread: I/O on path B goes on while an attempt hangs.
    let (dir, ta, tb) = two_targets_sharing_a_file("silent");
    let a = ta.addr;
    let mut pa = path(a);
    pa.timeout = Duration::from_secs(3);
    let (mut ctrl, mut qp, mut w) =
        attach_and_spread(vec![pa, path(tb.addr)], PathPolicy::QueueDepth, 100);

    drop(ta);
    let silent = std::net::TcpListener::bind(a).expect("take over path A's port");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // Hand each accepted connection over, unanswered.
        for s in silent.incoming() {
            let Ok(s) = s else { break };
            if tx.send(s).is_err() {
                break;
            }
        }
    });
    // Run until a reconnect attempt is hanging on the silent port...
    let mut hung = None;
    w.run(
        &mut ctrl,
        &mut qp,
        16,
        |_| {
            if hung.is_none() {
                hung = rx.try_recv().ok();
            }
            hung.is_some()
        },
        Duration::from_secs(20),
    );
    let mut stream = hung.expect("a reconnect attempt reached the silent port");
    stream.set_nonblocking(true).unwrap();
    // ...and while it hangs (the host closes it only after its 3 s step timeout), path B completes I/O.
    let ok_before = qp.multipath_stats().ok;
    let attempt_open = |s: &mut std::net::TcpStream| {
        let mut b = [0u8; 256];
        match std::io::Read::read(s, &mut b) {
            Ok(0) => false,
            Ok(_) => true,
            Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
        }
    };
    w.run(
        &mut ctrl,
        &mut qp,
        16,
        |q| q.multipath_stats().ok >= ok_before + 1000 || !attempt_open(&mut stream),
        Duration::from_secs(20),
    );
    assert!(
        attempt_open(&mut stream),
        "the hanging reconnect attempt ended before path B completed 1000 writes: it blocked the caller"
    );
    w.finish_clean(&mut ctrl, &mut qp);
    drop(tb);
    let _ = std::fs::remove_dir_all(&dir);
}

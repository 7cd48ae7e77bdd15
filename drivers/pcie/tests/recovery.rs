//! Recovery from controller resets against the memory-backed stand-in: with the retry policy every command
//! completes successfully after the automatic reset (and its data reads back); with fail-fast each
//! outstanding command fails once; a timeout-triggered reset behaves the same; removal, or a controller
//! that cannot be brought back, fails everything and refuses more. Every test checks that each tag comes
//! back exactly once.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvpoll::api::{Completion, Controller, IoOp, IoRequest, QueuePair};
use nvpoll::mem::{DmaPool, HugepageMode};
use nvpoll_pcie::fake::{FakeConfig, FakeDevice};
use nvpoll_pcie::{Error, PcieController, PcieOptions, PcieQueuePair, QueueOptions, Recovery};

type Qp = PcieQueuePair<FakeDevice>;

fn opts() -> PcieOptions {
    PcieOptions {
        hugepages: HugepageMode::Off,
        admin_timeout: Duration::from_secs(2),
        ..PcieOptions::default()
    }
}

fn attach(o: PcieOptions) -> (Arc<FakeDevice>, DmaPool, PcieController<FakeDevice>) {
    let dev = Arc::new(FakeDevice::new(FakeConfig::default()));
    let pool = DmaPool::builder()
        .class(4096, 512)
        .hugepages(HugepageMode::Off)
        .build()
        .unwrap();
    let ctrl = PcieController::attach(Arc::clone(&dev), pool.clone(), o).unwrap();
    (dev, pool, ctrl)
}

fn with_policy(depth: u16, recovery: Recovery) -> QueueOptions {
    QueueOptions {
        recovery: Some(recovery),
        ..QueueOptions::new(depth)
    }
}

/// The 4 KiB block pattern written for `tag`.
fn pattern(tag: u64) -> Vec<u8> {
    (0..4096u64)
        .map(|i| (i.wrapping_mul(7) ^ tag.wrapping_mul(131)) as u8)
        .collect()
}

/// Each tag writes its own 4 KiB (8 blocks) at LBA tag * 8.
fn write(pool: &DmaPool, tag: u64) -> IoRequest {
    let mut b = pool.alloc(4096).unwrap();
    b.as_mut_slice().copy_from_slice(&pattern(tag));
    IoRequest {
        op: IoOp::Write,
        nsid: 1,
        lba: tag * 8,
        blocks: 8,
        buf: Some(b),
        tag,
    }
}

fn read(pool: &DmaPool, tag: u64) -> IoRequest {
    let mut b = pool.alloc(4096).unwrap();
    b.as_mut_slice().fill(0xee);
    IoRequest {
        op: IoOp::Read,
        nsid: 1,
        lba: tag * 8,
        blocks: 8,
        buf: Some(b),
        tag,
    }
}

fn submit(qp: &mut Qp, req: IoRequest) {
    if let Err(r) = qp.submit(req) {
        panic!("submit of tag {}: {}", r.request.tag, r.error);
    }
}

/// Polls until `n` completions came back (or the deadline), and checks that no tag came back twice.
fn collect(qp: &mut Qp, n: usize, got: &mut BTreeMap<u64, Completion>) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let want = got.len() + n;
    while got.len() < want {
        let _ = qp.poll(64);
        while let Some(c) = qp.pop_completion() {
            let tag = c.tag;
            assert!(got.insert(tag, c).is_none(), "tag {tag} completed twice");
        }
        assert!(
            Instant::now() < deadline,
            "{} of {want} completions; {qp:?}",
            got.len()
        );
    }
    assert_eq!(got.len(), want, "more completions than commands");
}

/// Nothing more comes back.
fn assert_quiet(qp: &mut Qp) {
    for _ in 0..100 {
        let _ = qp.poll(64);
        if let Some(c) = qp.pop_completion() {
            panic!("unexpected completion of tag {}: {:?}", c.tag, c.result);
        }
    }
}

/// Reads tag's block back through the queue pair and compares it with its pattern.
fn read_back(qp: &mut Qp, pool: &DmaPool, tag: u64) {
    submit(qp, read(pool, tag));
    qp.flush().unwrap();
    let mut got = BTreeMap::new();
    collect(qp, 1, &mut got);
    let c = got.remove(&tag).expect("the read's own tag");
    c.result.unwrap_or_else(|e| panic!("read back {tag}: {e}"));
    assert!(
        c.buf.unwrap().as_slice() == &pattern(tag)[..],
        "data of tag {tag}"
    );
}

/// Batch A completes on the device before CFS (its completions still unreaped), batch B is kicked while the
/// device is fatal (never carried out), batch C is submitted after the reset, before the queue pair polled.
type Outcome = (
    Arc<FakeDevice>,
    DmaPool,
    PcieController<FakeDevice>,
    Qp,
    BTreeMap<u64, Completion>,
);

fn cfs_with_three_batches(recovery: Recovery) -> Outcome {
    let (dev, pool, mut ctrl) = attach(opts());
    let mut qp = ctrl
        .create_queue_pair_with(with_policy(16, recovery))
        .unwrap();
    for tag in 0..4 {
        submit(&mut qp, write(&pool, tag));
    }
    qp.flush().unwrap();
    dev.set_fatal();
    for tag in 4..8 {
        submit(&mut qp, write(&pool, tag));
    }
    qp.flush().unwrap();
    assert_eq!(qp.outstanding(), 8);
    assert!(
        ctrl.poll_admin().unwrap(),
        "CFS makes the health check reset"
    );
    assert_eq!(dev.stats().resets, 1);
    assert!(
        dev.io_queues().is_empty(),
        "the reset deleted every I/O queue"
    );
    let mut got = BTreeMap::new();
    for tag in 8..12 {
        let r = qp.submit(write(&pool, tag));
        match (recovery, r) {
            (Recovery::Retry, Ok(())) => {}
            (Recovery::FailFast, Err(r)) => {
                assert!(r.request.buf.is_some(), "the buffer comes back");
                assert!(r.error.to_string().contains("reset"), "{}", r.error);
            }
            (_, r) => panic!("{recovery:?}: submit while waiting: {r:?}"),
        }
    }
    assert!(qp.is_recovering());
    let n = if recovery == Recovery::Retry { 12 } else { 8 };
    collect(&mut qp, n, &mut got);
    assert!(!qp.is_recovering());
    assert_eq!(dev.io_queues(), vec![qp.qid()], "the queues are back");
    // The controller keeps running; nothing further comes back.
    assert!(!ctrl.poll_admin().unwrap());
    assert_quiet(&mut qp);
    (dev, pool, ctrl, qp, got)
}

#[test]
fn cfs_with_retry_completes_everything_after_the_reset() {
    let (dev, pool, _ctrl, mut qp, got) = cfs_with_three_batches(Recovery::Retry);
    for (tag, c) in &got {
        assert!(c.result.is_ok(), "tag {tag}: {:?}", c.result);
        assert!(c.buf.is_some());
        assert_eq!(
            dev.read_blocks(1, tag * 8, 8),
            pattern(*tag),
            "device copy of {tag}"
        );
    }
    let rs = qp.recovery_stats();
    assert_eq!(rs.resets, 1);
    assert_eq!(rs.recreated, 1);
    assert_eq!(
        rs.completed_before_reset, 4,
        "batch A came from the old queue"
    );
    assert_eq!(rs.retried, 4, "batch B was posted again");
    assert_eq!(rs.held, 4, "batch C waited for the queues");
    assert_eq!(rs.failed, 0);
    assert_eq!(
        QueuePair::stats(&qp).retried,
        4,
        "retried reaches the API counters"
    );
    for tag in 0..12 {
        read_back(&mut qp, &pool, tag);
    }
}

#[test]
fn cfs_with_fail_fast_fails_each_outstanding_command_once() {
    let (dev, pool, _ctrl, mut qp, got) = cfs_with_three_batches(Recovery::FailFast);
    for (tag, c) in &got {
        assert!(c.buf.is_some(), "tag {tag}: the buffer comes back");
        if *tag < 4 {
            assert!(
                c.result.is_ok(),
                "A {tag}: done before the reset: {:?}",
                c.result
            );
            assert_eq!(dev.read_blocks(1, tag * 8, 8), pattern(*tag));
        } else {
            assert!(
                matches!(c.result, Err(nvpoll::Error::Aborted(_))),
                "B {tag}: {:?}",
                c.result
            );
            // A write that failed was never carried out.
            assert_eq!(dev.read_blocks(1, tag * 8, 8), vec![0; 4096]);
        }
    }
    assert_eq!(
        got.keys().copied().collect::<Vec<_>>(),
        (0..8).collect::<Vec<_>>()
    );
    let rs = qp.recovery_stats();
    assert_eq!((rs.resets, rs.recreated, rs.retried, rs.held), (1, 1, 0, 0));
    assert_eq!((rs.completed_before_reset, rs.failed), (4, 4));
    // The queue pair takes work again.
    let mut got = BTreeMap::new();
    for tag in 20..24 {
        submit(&mut qp, write(&pool, tag));
    }
    qp.flush().unwrap();
    collect(&mut qp, 4, &mut got);
    assert!(got.values().all(|c| c.result.is_ok()));
    read_back(&mut qp, &pool, 21);
}

#[test]
fn a_timeout_triggered_reset_retries_the_stalled_commands() {
    let o = PcieOptions {
        io_timeout: Duration::from_millis(50),
        ..opts()
    };
    let (dev, pool, mut ctrl) = attach(o);
    let mut qp = ctrl.create_queue_pair(16).unwrap();
    assert_eq!(qp.recovery(), Recovery::Retry, "retry is the default");
    dev.set_stalled(true);
    for tag in 0..4 {
        submit(&mut qp, write(&pool, tag));
    }
    qp.flush().unwrap();
    let start = Instant::now();
    while !qp.is_recovering() {
        assert_eq!(qp.poll(16).unwrap(), 0, "completions from a stalled device");
        assert!(start.elapsed() < Duration::from_secs(10), "no timeout");
    }
    assert_eq!(qp.recovery_stats().timeouts, 1);
    // Waiting for the reset the queue pair asked for: new commands are held, nothing comes back.
    for tag in 4..6 {
        submit(&mut qp, write(&pool, tag));
    }
    qp.flush().unwrap();
    assert_eq!(qp.outstanding(), 6);
    assert_quiet(&mut qp);
    dev.set_stalled(false);
    assert!(
        ctrl.poll_admin().unwrap(),
        "the queue pair asked for a reset"
    );
    let mut got = BTreeMap::new();
    collect(&mut qp, 6, &mut got);
    for (tag, c) in &got {
        assert!(c.result.is_ok(), "tag {tag}: {:?}", c.result);
    }
    let rs = qp.recovery_stats();
    assert_eq!((rs.resets, rs.retried, rs.held, rs.failed), (1, 4, 2, 0));
    for tag in 0..6 {
        read_back(&mut qp, &pool, tag);
    }
    assert!(!ctrl.poll_admin().unwrap());
}

#[test]
fn a_manual_reset_retries_posted_reads() {
    let (_dev, pool, mut ctrl) = attach(opts());
    let mut qp = ctrl.create_queue_pair(32).unwrap();
    let mut got = BTreeMap::new();
    for tag in 0..16 {
        submit(&mut qp, write(&pool, tag));
    }
    qp.flush().unwrap();
    collect(&mut qp, 16, &mut got);
    // Reads posted, not kicked: the reset comes first; the queue pair posts them again afterwards.
    for tag in 100..116 {
        let mut r = read(&pool, tag - 100);
        r.tag = tag;
        submit(&mut qp, r);
    }
    ctrl.reset().unwrap();
    let mut reads = BTreeMap::new();
    collect(&mut qp, 16, &mut reads);
    for (tag, c) in reads {
        c.result.unwrap_or_else(|e| panic!("read {tag}: {e}"));
        assert!(
            c.buf.unwrap().as_slice() == &pattern(tag - 100)[..],
            "read {tag}"
        );
    }
    assert_eq!(qp.recovery_stats().retried, 16);
    assert_eq!(ctrl.stats().resets, 1);
}

#[test]
fn queue_ids_survive_a_reset_and_dropped_waiters_free_theirs() {
    let (dev, pool, mut ctrl) = attach(opts());
    let mut a = ctrl.create_queue_pair(8).unwrap();
    let b = ctrl.create_queue_pair(8).unwrap();
    assert_eq!((a.qid(), b.qid()), (1, 2));
    ctrl.reset().unwrap();
    // Neither has re-created its queues yet; a new queue pair must not take their IDs.
    let c = ctrl.create_queue_pair(8).unwrap();
    assert_eq!(c.qid(), 3);
    // b goes away without ever re-creating its queues: nothing to delete, its ID is free again.
    drop(b);
    assert!(!ctrl.poll_admin().unwrap());
    assert_eq!(dev.io_queues(), vec![3]);
    submit(&mut a, write(&pool, 1));
    a.flush().unwrap();
    let mut got = BTreeMap::new();
    collect(&mut a, 1, &mut got);
    assert!(got[&1].result.is_ok());
    assert_eq!(dev.io_queues(), vec![1, 3]);
    assert_eq!(ctrl.create_queue_pair(8).unwrap().qid(), 2);
    // A queue pair that re-created its queues has them deleted when dropped.
    drop(a);
    assert!(!ctrl.poll_admin().unwrap());
    assert_eq!(dev.io_queues(), vec![3]);
}

#[test]
fn retries_are_limited() {
    let o = PcieOptions {
        max_retries: 1,
        ..opts()
    };
    let (dev, pool, mut ctrl) = attach(o);
    let mut qp = ctrl.create_queue_pair(4).unwrap();
    dev.set_io_stalled(true); // fetched and lost, every time
    submit(&mut qp, write(&pool, 7));
    qp.flush().unwrap();
    ctrl.reset().unwrap();
    assert_eq!(qp.poll(4).unwrap(), 0, "posted again (retry 1 of 1)");
    assert_eq!(qp.recovery_stats().retried, 1);
    ctrl.reset().unwrap();
    assert_eq!(qp.poll(4).unwrap(), 1, "no retry left");
    let c = qp.pop_completion().unwrap();
    assert_eq!(c.tag, 7);
    assert!(
        matches!(c.result, Err(nvpoll::Error::Aborted(_))),
        "{:?}",
        c.result
    );
    assert!(c.buf.is_some());
    assert_eq!(qp.recovery_stats().failed, 1);
    assert_quiet(&mut qp);
    dev.set_io_stalled(false);
    // The write never happened.
    submit(&mut qp, read(&pool, 7));
    qp.flush().unwrap();
    let mut got = BTreeMap::new();
    collect(&mut qp, 1, &mut got);
    assert!(got[&7].buf.as_ref().unwrap().as_slice() == &[0u8; 4096][..]);
}

/// Polls until the queue pair reports failure, checking every completion is an error and comes once.
fn fail_all(qp: &mut Qp, n: usize) -> nvpoll::Error {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut got = BTreeMap::new();
    let e = loop {
        if let Err(e) = qp.poll(64) {
            break e;
        }
        assert!(
            Instant::now() < deadline,
            "the queue pair never failed: {qp:?}"
        );
    };
    while let Some(c) = qp.pop_completion() {
        assert!(c.result.is_err(), "tag {}: {:?}", c.tag, c.result);
        assert!(c.buf.is_some(), "the buffer comes back");
        assert!(
            got.insert(c.tag, ()).is_none(),
            "tag {} completed twice",
            c.tag
        );
    }
    assert_eq!(got.len(), n);
    assert_eq!(qp.outstanding(), 0);
    // Later: refused, and polls keep failing without completing anything again.
    let r = qp.submit(IoRequest {
        op: IoOp::Flush,
        nsid: 1,
        lba: 0,
        blocks: 0,
        buf: None,
        tag: 99,
    });
    assert!(r.is_err());
    assert!(qp.flush().is_err());
    for _ in 0..10 {
        assert!(qp.poll(64).is_err());
        assert!(qp.pop_completion().is_none());
    }
    e
}

#[test]
fn removal_with_outstanding_commands_fails_them_all() {
    for recovery in [Recovery::Retry, Recovery::FailFast] {
        let (dev, pool, mut ctrl) = attach(opts());
        let mut qp = ctrl
            .create_queue_pair_with(with_policy(8, recovery))
            .unwrap();
        dev.set_stalled(true);
        for tag in 0..4 {
            submit(&mut qp, write(&pool, tag));
        }
        qp.flush().unwrap();
        dev.remove();
        assert!(matches!(ctrl.poll_admin(), Err(Error::Removed)));
        let e = fail_all(&mut qp, 4);
        assert!(e.to_string().contains("removed"), "{recovery:?}: {e}");
        assert_eq!(qp.recovery_stats().failed, 4);
        assert!(matches!(ctrl.poll_admin(), Err(Error::Removed)));
        assert!(ctrl.create_queue_pair(4).is_err());
    }
}

#[test]
fn removal_while_waiting_for_a_reset_fails_held_commands_too() {
    let o = PcieOptions {
        io_timeout: Duration::from_millis(20),
        ..opts()
    };
    let (dev, pool, mut ctrl) = attach(o);
    let mut qp = ctrl.create_queue_pair(8).unwrap();
    dev.set_stalled(true);
    for tag in 0..3 {
        submit(&mut qp, write(&pool, tag));
    }
    qp.flush().unwrap();
    while !qp.is_recovering() {
        qp.poll(8).unwrap();
    }
    for tag in 3..5 {
        submit(&mut qp, write(&pool, tag)); // held
    }
    dev.remove();
    // The health check finds the device gone instead of resetting it.
    assert!(matches!(ctrl.poll_admin(), Err(Error::Removed)));
    fail_all(&mut qp, 5);
    assert_eq!(qp.recovery_stats().held, 2);
}

#[test]
fn removal_during_the_reset_fails_everything() {
    let (dev, pool, mut ctrl) = attach(opts());
    let mut qp = ctrl.create_queue_pair(8).unwrap();
    dev.set_fatal();
    for tag in 0..4 {
        submit(&mut qp, write(&pool, tag));
    }
    qp.flush().unwrap();
    dev.remove();
    assert!(matches!(ctrl.reset(), Err(Error::Removed)));
    fail_all(&mut qp, 4);
}

#[test]
fn a_controller_that_cannot_be_brought_back_fails_everything() {
    for recovery in [Recovery::Retry, Recovery::FailFast] {
        let (dev, pool, mut ctrl) = attach(opts());
        let mut qp = ctrl
            .create_queue_pair_with(with_policy(8, recovery))
            .unwrap();
        dev.set_broken(true);
        dev.set_fatal();
        for tag in 0..4 {
            submit(&mut qp, write(&pool, tag));
        }
        qp.flush().unwrap();
        let e = ctrl.poll_admin().unwrap_err();
        assert!(matches!(e, Error::Fatal), "{e}");
        assert_eq!(dev.stats().resets, 3, "three attempts");
        let e = fail_all(&mut qp, 4);
        assert!(e.to_string().contains("could not be reset"), "{e}");
        // Lost for good: the health check, new queue pairs and admin commands fail; no retry happens.
        assert!(ctrl.poll_admin().is_err());
        assert!(ctrl.reset().is_err());
        assert!(ctrl.create_queue_pair(4).is_err());
        assert_eq!(dev.stats().resets, 3);
        drop(ctrl);
        drop(qp);
    }
}

/// Three queue pairs on their own threads write continuously while the controller is reset again and
/// again (CFS, and manual resets); with retry every write completes exactly once, successfully, and its
/// data is on the device.
#[test]
fn repeated_resets_under_load_lose_and_repeat_nothing() {
    let o = PcieOptions {
        max_retries: u8::MAX,
        ..opts()
    };
    let (dev, pool, mut ctrl) = attach(o);
    let stop = Arc::new(AtomicBool::new(false));
    // Writes completed by all the writers, so that each reset comes after some I/O went through.
    let completed = Arc::new(AtomicU64::new(0));
    let mut handles = Vec::new();
    for t in 0..3u64 {
        let mut qp = ctrl.create_queue_pair(8).unwrap();
        let (pool, stop) = (pool.clone(), Arc::clone(&stop));
        let completed = Arc::clone(&completed);
        handles.push(std::thread::spawn(move || {
            let mut got = BTreeMap::new();
            let (first, mut next) = (t * 1000, t * 1000);
            loop {
                let stopping = stop.load(Ordering::Acquire);
                while !stopping && qp.outstanding() < 8 && next < first + 1000 {
                    submit(&mut qp, write(&pool, next));
                    next += 1;
                }
                qp.flush().unwrap();
                qp.poll(8).unwrap();
                while let Some(c) = qp.pop_completion() {
                    let tag = c.tag;
                    assert!(c.result.is_ok(), "tag {tag}: {:?}", c.result);
                    assert!(got.insert(tag, ()).is_none(), "tag {tag} completed twice");
                    completed.fetch_add(1, Ordering::Release);
                }
                if (stopping || next == first + 1000) && qp.outstanding() == 0 {
                    break;
                }
            }
            assert_eq!(got.len() as u64, next - first);
            assert!(got.keys().copied().eq(first..next), "every tag once");
            (first..next, qp.recovery_stats())
        }));
    }
    let mut resets = 0;
    let mut before = 0;
    for i in 0..12 {
        // Each reset waits for writes to complete since the previous one (or for the writers to be done).
        let deadline = Instant::now() + Duration::from_secs(10);
        while completed.load(Ordering::Acquire) == before
            && handles.iter().any(|h| !h.is_finished())
        {
            assert!(
                Instant::now() < deadline,
                "no write completed in 10 s after reset {resets}"
            );
            std::thread::yield_now();
        }
        before = completed.load(Ordering::Acquire);
        if i % 3 == 0 {
            ctrl.reset().unwrap();
        } else {
            dev.set_fatal();
            assert!(ctrl.poll_admin().unwrap());
        }
        resets += 1;
    }
    stop.store(true, Ordering::Release);
    let deadline = Instant::now() + Duration::from_secs(20);
    while handles.iter().any(|h| !h.is_finished()) {
        ctrl.poll_admin().unwrap();
        assert!(Instant::now() < deadline, "the writers did not finish");
        std::thread::sleep(Duration::from_millis(1));
    }
    let (mut written, mut seen, mut retried) = (0, 0, 0);
    for h in handles {
        let (tags, rs) = h.join().unwrap();
        println!("{tags:?}: {rs:?}");
        assert_eq!(rs.failed, 0);
        assert!(rs.resets <= resets);
        seen += rs.resets;
        retried += rs.retried + rs.held + rs.completed_before_reset;
        for tag in tags {
            assert_eq!(dev.read_blocks(1, tag * 8, 8), pattern(tag), "tag {tag}");
            written += 1;
        }
    }
    assert!(written > 0);
    assert!(seen > 0 && retried > 0, "the resets hit the queue pairs");
    assert_eq!(dev.stats().cq_overflows, 0);
}

#[test]
fn default_policy_is_retry_and_fail_fast_is_an_option() {
    assert_eq!(PcieOptions::default().recovery, Recovery::Retry);
    assert_eq!(QueueOptions::new(4).recovery, None);
    let o = PcieOptions {
        recovery: Recovery::FailFast,
        ..opts()
    };
    let (_dev, _pool, mut ctrl) = attach(o);
    assert_eq!(
        ctrl.create_queue_pair(4).unwrap().recovery(),
        Recovery::FailFast
    );
    let qp = ctrl
        .create_queue_pair_with(with_policy(4, Recovery::Retry))
        .unwrap();
    assert_eq!(qp.recovery(), Recovery::Retry);
}

#[test]
fn a_release_request_releases_the_device_and_fails_everything() {
    for recovery in [Recovery::Retry, Recovery::FailFast] {
        let (dev, pool, mut ctrl) = attach(opts());
        let mut qp = ctrl
            .create_queue_pair_with(with_policy(8, recovery))
            .unwrap();
        // Two complete before the request, four are still on the device when it comes.
        for tag in 0..2 {
            submit(&mut qp, write(&pool, tag));
        }
        qp.flush().unwrap();
        let mut got = BTreeMap::new();
        collect(&mut qp, 2, &mut got);
        dev.set_io_stalled(true);
        for tag in 2..6 {
            submit(&mut qp, write(&pool, tag));
        }
        qp.flush().unwrap();
        assert!(matches!(ctrl.poll_admin(), Ok(false)));
        dev.request_release();
        assert!(
            !dev.released(),
            "the device is released by the health check"
        );
        assert!(matches!(ctrl.poll_admin(), Err(Error::Removed)));
        assert!(dev.released());
        assert!(ctrl.is_removed());
        assert_eq!(dev.mapped_regions(), 0, "DMA mappings left after release");
        let e = fail_all(&mut qp, 4);
        assert!(e.to_string().contains("removed"), "{recovery:?}: {e}");
        assert_eq!(qp.recovery_stats().failed, 4);
        assert!(matches!(ctrl.poll_admin(), Err(Error::Removed)));
        assert!(matches!(
            ctrl.create_queue_pair_with(QueueOptions::new(4)),
            Err(Error::Removed)
        ));
        drop(qp);
        // Dropping the controller after release neither panics nor touches the device.
        ctrl.shutdown().unwrap();
    }
}

#[test]
fn a_release_request_with_queue_pairs_busy_on_other_threads() {
    let (dev, pool, mut ctrl) = attach(opts());
    let stop = Arc::new(AtomicBool::new(false));
    // Successful completions per writer, so that the release is requested only once both are busy.
    let progress: Arc<[AtomicU64; 2]> = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
    let mut threads = Vec::new();
    for t in 0..2u64 {
        let mut qp = ctrl.create_queue_pair(16).unwrap();
        let pool = pool.clone();
        let stop = Arc::clone(&stop);
        let progress = Arc::clone(&progress);
        threads.push(std::thread::spawn(move || {
            let (mut ok, mut failed, mut submitted) = (0u64, 0u64, 0u64);
            let mut tag = t * 1_000_000;
            let mut err = None;
            while err.is_none() && !stop.load(Ordering::Relaxed) {
                while qp.outstanding() < 16 {
                    tag += 1;
                    match qp.submit(write(&pool, tag % 1000 + t * 1000)) {
                        Ok(()) => submitted += 1,
                        Err(_) => break,
                    }
                }
                let _ = qp.flush();
                if let Err(e) = qp.poll(64) {
                    err = Some(e);
                }
                while let Some(c) = qp.pop_completion() {
                    match c.result {
                        Ok(()) => {
                            ok += 1;
                            progress[t as usize].fetch_add(1, Ordering::Release);
                        }
                        Err(_) => failed += 1,
                    }
                }
            }
            assert_eq!(qp.outstanding(), 0, "commands lost");
            assert_eq!(submitted, ok + failed);
            (ok, failed, err.map(|e| e.to_string()))
        }));
    }
    // Wait until every writer has completed a write: the release then finds both queue pairs busy.
    let deadline = Instant::now() + Duration::from_secs(10);
    while progress.iter().any(|p| p.load(Ordering::Acquire) == 0) {
        assert!(
            threads.iter().all(|t| !t.is_finished()),
            "a writer stopped before the release was requested"
        );
        assert!(
            Instant::now() < deadline,
            "a writer completed no write in 10 s (completions per writer: {progress:?})"
        );
        std::thread::yield_now();
    }
    dev.request_release();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !matches!(ctrl.poll_admin(), Err(Error::Removed)) {
        assert!(Instant::now() < deadline);
    }
    assert!(dev.released());
    for t in threads {
        let (ok, _failed, err) = t.join().unwrap();
        assert!(ok > 0);
        let err = err.expect("the queue pair failed");
        assert!(err.contains("removed"), "{err}");
    }
    stop.store(true, Ordering::Relaxed);
}

/// A reset from outside (a function-level reset through sysfs): the controller is found disabled and reset,
/// the queue pairs re-create their queues, and retry or fail their commands by their policy.
#[test]
fn a_function_reset_from_outside_is_recovered_by_the_policy() {
    for recovery in [Recovery::Retry, Recovery::FailFast] {
        let (dev, pool, mut ctrl) = attach(opts());
        let mut qp = ctrl
            .create_queue_pair_with(with_policy(8, recovery))
            .unwrap();
        dev.set_io_stalled(true);
        for tag in 0..4 {
            submit(&mut qp, write(&pool, tag));
        }
        qp.flush().unwrap();
        dev.function_reset();
        dev.set_io_stalled(false);
        assert!(matches!(ctrl.poll_admin(), Ok(true)), "{recovery:?}");
        assert_eq!(ctrl.stats().resets, 1);
        let mut got = BTreeMap::new();
        collect(&mut qp, 4, &mut got);
        for (tag, c) in &got {
            match recovery {
                Recovery::Retry => assert!(c.result.is_ok(), "tag {tag}: {:?}", c.result),
                Recovery::FailFast => assert!(c.result.is_err(), "tag {tag}: {:?}", c.result),
            }
        }
        let rs = qp.recovery_stats();
        assert_eq!(rs.resets, 1);
        match recovery {
            Recovery::Retry => assert_eq!(rs.retried, 4),
            Recovery::FailFast => assert_eq!(rs.failed, 4),
        }
        assert_quiet(&mut qp);
        for tag in 10..12 {
            submit(&mut qp, write(&pool, tag));
            qp.flush().unwrap();
            let mut got = BTreeMap::new();
            collect(&mut qp, 1, &mut got);
            got[&tag].result.as_ref().unwrap();
            read_back(&mut qp, &pool, tag);
        }
        if recovery == Recovery::Retry {
            for tag in 0..4 {
                read_back(&mut qp, &pool, tag);
            }
        }
        assert!(matches!(ctrl.poll_admin(), Ok(false)));
    }
}

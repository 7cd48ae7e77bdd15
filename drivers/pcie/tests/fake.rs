//! The driver against the memory-backed controller stand-in: bring-up, every PRP shape, doorbell batching,
//! argument checks, and fail-fast recovery from a fatal status, a timeout and surprise removal (the retry
//! policy is in recovery.rs).

use std::sync::Arc;
use std::time::{Duration, Instant};

use nvpoll::api::{Completion, Controller, IoOp, IoRequest, QueuePair};
use nvpoll::mem::{DmaPool, HugepageMode};
use nvpoll::spec::{feature, reg, Csts, Sqe};
use nvpoll_pcie::fake::{FakeConfig, FakeDevice};
use nvpoll_pcie::{
    Device, Error, PcieController, PcieOptions, PcieQueuePair, QueueOptions, Recovery,
};

fn opts() -> PcieOptions {
    PcieOptions {
        hugepages: HugepageMode::Off,
        admin_timeout: Duration::from_secs(2),
        ..PcieOptions::default()
    }
}

fn pool() -> DmaPool {
    DmaPool::builder()
        .class(4096, 64)
        .class(1 << 20, 4)
        .hugepages(HugepageMode::Off)
        .build()
        .unwrap()
}

fn attach(
    cfg: FakeConfig,
    o: PcieOptions,
) -> (Arc<FakeDevice>, DmaPool, PcieController<FakeDevice>) {
    let dev = Arc::new(FakeDevice::new(cfg));
    let pool = pool();
    let ctrl = PcieController::attach(Arc::clone(&dev), pool.clone(), o).unwrap();
    (dev, pool, ctrl)
}

fn wait_one(qp: &mut PcieQueuePair<FakeDevice>) -> Completion {
    qp.flush().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        qp.poll(16).unwrap();
        if let Some(c) = qp.pop_completion() {
            return c;
        }
        assert!(Instant::now() < deadline, "no completion");
    }
}

fn io(op: IoOp, lba: u64, blocks: u32, buf: Option<nvpoll::mem::DmaBuf>, tag: u64) -> IoRequest {
    IoRequest {
        op,
        nsid: 1,
        lba,
        blocks,
        buf,
        tag,
    }
}

#[test]
fn brings_up_and_identifies() {
    let (dev, _pool, mut ctrl) = attach(FakeConfig::default(), opts());
    assert_eq!(ctrl.identify().model, "nvpoll fake NVMe");
    assert_eq!(ctrl.identify().mdts, 7);
    assert_eq!(ctrl.max_transfer(), Some(512 * 1024));
    assert_eq!(ctrl.io_queues_granted(), 64);
    assert_eq!(ctrl.namespaces().len(), 1);
    assert_eq!(ctrl.namespaces()[0].block_size, 512);
    assert_eq!(ctrl.namespaces()[0].blocks, 32768);
    assert_eq!(ctrl.cap().mqes(), 2047);
    assert!(Csts(dev.read32(reg::CSTS as usize)).rdy());
    // A raw admin command through the API.
    let (cqe, _) = ctrl
        .admin(Sqe::get_features(feature::NUMBER_OF_QUEUES), None)
        .unwrap();
    assert!(cqe.status().is_success());
    assert_eq!(feature::num_queues_granted(cqe.dw0), (64, 64));
    ctrl.shutdown().unwrap();
    assert_eq!(
        Csts(dev.read32(reg::CSTS as usize)).shst(),
        Csts::SHST_COMPLETE
    );
}

/// Writes a pattern of `len` bytes at buffer offset `off`, reads it back into another buffer at the same
/// offset, and checks both the read data and the stand-in's copy.
fn round_trip(
    dev: &FakeDevice,
    pool: &DmaPool,
    qp: &mut PcieQueuePair<FakeDevice>,
    lba: u64,
    len: usize,
    off: usize,
    seed: u8,
) {
    let blocks = (len / 512) as u32;
    let mut w = pool.alloc(off + len).unwrap();
    w.set_window(off, len).unwrap();
    for (i, b) in w.as_mut_slice().iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
    }
    let expect = w.as_slice().to_vec();
    qp.submit(io(IoOp::Write, lba, blocks, Some(w), 1)).unwrap();
    let c = wait_one(qp);
    c.result
        .unwrap_or_else(|e| panic!("write {len}@{off}: {e}"));
    assert_eq!(
        dev.read_blocks(1, lba, blocks),
        expect,
        "device copy {len}@{off}"
    );
    let mut r = pool.alloc(off + len).unwrap();
    r.as_mut_slice().fill(0xee);
    r.set_window(off, len).unwrap();
    qp.submit(io(IoOp::Read, lba, blocks, Some(r), 2)).unwrap();
    let c = wait_one(qp);
    c.result.unwrap_or_else(|e| panic!("read {len}@{off}: {e}"));
    assert!(
        c.buf.unwrap().as_slice() == &expect[..],
        "read back {len}@{off}"
    );
}

#[test]
fn every_prp_shape_round_trips() {
    let (dev, pool, mut ctrl) = attach(FakeConfig::default(), opts());
    let mut qp = ctrl.create_queue_pair(8).unwrap();
    let sizes = [
        512,
        4096,
        8192,
        12288,
        64 * 1024,
        512 * 1024 - 4096,
        512 * 1024,
    ];
    let mut lba = 0;
    for &len in &sizes {
        for off in [0, 4, 512, 4092] {
            if off + len > 1 << 20 {
                continue;
            }
            round_trip(&dev, &pool, &mut qp, lba, len, off, lba as u8);
            lba += (len / 512) as u64;
        }
    }
    let s = dev.stats();
    assert!(s.prp_one > 0 && s.prp_two > 0 && s.prp_list > 0, "{s:?}");
    assert_eq!(
        s.prp_chained, 0,
        "lists at offset 0 never cross a page at MDTS 7"
    );
    assert_eq!(s.dma_faults, 0);
    assert!(qp.stats().prp_lists > 0);

    // Lists placed near the end of their page chain into the next one.
    let mut chained = ctrl
        .create_queue_pair_with(QueueOptions {
            prp_list_offset: 4096 - 256,
            ..QueueOptions::new(4)
        })
        .unwrap();
    for off in [0, 4, 4092] {
        round_trip(&dev, &pool, &mut chained, 0, 512 * 1024, off, 7);
    }
    assert_eq!(
        dev.stats().prp_chained,
        6,
        "a write and a read each: {:?}",
        dev.stats()
    );
}

#[test]
fn one_doorbell_per_flush_and_per_poll_batch() {
    let (dev, pool, mut ctrl) = attach(FakeConfig::default(), opts());
    let mut qp = ctrl.create_queue_pair(32).unwrap();
    let before = dev.stats();
    for i in 0..16 {
        let b = pool.alloc(4096).unwrap();
        qp.submit(io(IoOp::Write, i * 8, 8, Some(b), i)).unwrap();
    }
    assert_eq!(
        dev.stats().sq_doorbells,
        before.sq_doorbells,
        "submit only posts"
    );
    assert_eq!(qp.outstanding(), 16);
    qp.flush().unwrap();
    qp.flush().unwrap();
    assert_eq!(
        dev.stats().sq_doorbells,
        before.sq_doorbells + 1,
        "one kick, none when nothing moved"
    );
    let n = qp.poll(64).unwrap();
    assert_eq!(n, 16);
    assert_eq!(dev.stats().cq_doorbells, before.cq_doorbells + 1);
    let mut tags: Vec<u64> = std::iter::from_fn(|| qp.pop_completion())
        .map(|c| {
            c.result.unwrap();
            c.tag
        })
        .collect();
    tags.sort();
    assert_eq!(tags, (0..16).collect::<Vec<_>>());
    // A batch cap splits reaping, with one completion doorbell per batch.
    let mut capped = ctrl
        .create_queue_pair_with(QueueOptions {
            batch: 4,
            ..QueueOptions::new(32)
        })
        .unwrap();
    for i in 0..10 {
        capped.submit(io(IoOp::Flush, 0, 0, None, i)).unwrap();
    }
    capped.flush().unwrap();
    let cq0 = dev.stats().cq_doorbells;
    assert_eq!(capped.poll(100).unwrap(), 4);
    assert_eq!(capped.poll(100).unwrap(), 4);
    assert_eq!(capped.poll(100).unwrap(), 2);
    assert_eq!(capped.poll(100).unwrap(), 0);
    assert_eq!(dev.stats().cq_doorbells, cq0 + 3);
    let s = capped.stats();
    assert_eq!(
        (s.submitted, s.completed, s.sq_doorbells, s.cq_doorbells),
        (10, 10, 1, 3)
    );
    assert_eq!(dev.stats().cq_overflows, 0);
}

#[test]
fn wraps_around_the_rings_many_times() {
    let (dev, pool, mut ctrl) = attach(FakeConfig::default(), opts());
    let mut qp = ctrl.create_queue_pair(3).unwrap();
    let mut done = 0;
    let mut next = 0u64;
    while done < 1000 {
        while qp.outstanding() < qp.depth() {
            let b = pool.alloc(512).unwrap();
            qp.submit(io(IoOp::Write, next % 1000, 1, Some(b), next))
                .unwrap();
            next += 1;
        }
        qp.flush().unwrap();
        done += qp.process_completions(8, |_, c| c.result.unwrap()).unwrap();
    }
    assert_eq!(dev.stats().cq_overflows, 0);
}

#[test]
fn rejects_what_it_cannot_send() {
    let (_dev, pool, mut ctrl) = attach(FakeConfig::default(), opts());
    let mut qp = ctrl.create_queue_pair(2).unwrap();
    let reject = |qp: &mut PcieQueuePair<FakeDevice>, req: IoRequest| {
        let had_buf = req.buf.is_some();
        let r = qp.submit(req).unwrap_err();
        assert_eq!(r.request.buf.is_some(), had_buf, "buffer handed back");
        r.error.to_string()
    };
    let e = reject(
        &mut qp,
        IoRequest {
            nsid: 9,
            ..io(IoOp::Read, 0, 1, Some(pool.alloc(512).unwrap()), 0)
        },
    );
    assert!(e.contains("namespace 9"), "{e}");
    let e = reject(
        &mut qp,
        io(IoOp::Read, 32767, 2, Some(pool.alloc(1024).unwrap()), 0),
    );
    assert!(e.contains("beyond"), "{e}");
    let e = reject(
        &mut qp,
        io(IoOp::Read, 0, 2048, Some(pool.alloc(1 << 20).unwrap()), 0),
    );
    assert!(e.contains("maximum"), "{e}");
    let e = reject(
        &mut qp,
        io(IoOp::Read, 0, 2, Some(pool.alloc(512).unwrap()), 0),
    );
    assert!(e.contains("shorter"), "{e}");
    let mut odd = pool.alloc(4096).unwrap();
    odd.set_window(2, 512).unwrap();
    let e = reject(&mut qp, io(IoOp::Read, 0, 1, Some(odd), 0));
    assert!(e.contains("dword"), "{e}");
    let e = reject(&mut qp, io(IoOp::Write, 0, 1, None, 0));
    assert!(e.contains("buffer"), "{e}");
    // Queue full: depth 2.
    for t in 0..2 {
        qp.submit(io(IoOp::Flush, 0, 0, None, t)).unwrap();
    }
    let r = qp
        .submit(io(IoOp::Read, 0, 1, Some(pool.alloc(512).unwrap()), 9))
        .unwrap_err();
    assert!(matches!(r.error, nvpoll::Error::QueueFull));
    assert!(r.request.buf.is_some());
    // Depth outside CAP.MQES.
    assert!(ctrl.create_queue_pair(2048).is_err());
    assert!(ctrl.create_queue_pair(0).is_err());
    assert!(ctrl.create_queue_pair(2047).is_ok());
}

#[test]
fn dropped_queue_pairs_are_deleted_on_the_device() {
    let (dev, _pool, mut ctrl) = attach(FakeConfig::default(), opts());
    let a = ctrl.create_queue_pair(4).unwrap();
    let b = ctrl.create_queue_pair(4).unwrap();
    assert_eq!((a.qid(), b.qid()), (1, 2));
    assert_eq!(dev.io_queues(), vec![1, 2]);
    drop(a);
    assert!(!ctrl.poll_admin().unwrap());
    assert_eq!(dev.io_queues(), vec![2]);
    let c = ctrl.create_queue_pair(4).unwrap();
    assert_eq!(c.qid(), 1, "queue IDs are reused");
    assert_eq!(ctrl.stats().queues_deleted, 1);
    // Queue pairs live on other threads.
    let t = std::thread::spawn(move || drop((b, c)));
    t.join().unwrap();
    ctrl.poll_admin().unwrap();
    assert!(dev.io_queues().is_empty());
}

fn submit_four(pool: &DmaPool, qp: &mut PcieQueuePair<FakeDevice>) {
    for t in 0..4 {
        qp.submit(io(
            IoOp::Write,
            t * 8,
            8,
            Some(pool.alloc(4096).unwrap()),
            t,
        ))
        .unwrap();
    }
    qp.flush().unwrap();
}

fn drain_errors(qp: &mut PcieQueuePair<FakeDevice>) -> Vec<nvpoll::Error> {
    let mut out = Vec::new();
    while let Some(c) = qp.pop_completion() {
        assert!(c.buf.is_some(), "the buffer comes back with the error");
        out.push(c.result.unwrap_err());
    }
    out
}

fn fail_fast(depth: u16) -> QueueOptions {
    QueueOptions {
        recovery: Some(Recovery::FailFast),
        ..QueueOptions::new(depth)
    }
}

#[test]
fn fatal_status_resets_the_controller_and_fail_fast_fails_outstanding_commands() {
    let (dev, pool, mut ctrl) = attach(FakeConfig::default(), opts());
    let mut qp = ctrl.create_queue_pair_with(fail_fast(8)).unwrap();
    dev.set_fatal();
    submit_four(&pool, &mut qp);
    assert_eq!(qp.poll(8).unwrap(), 0);
    assert_eq!(qp.outstanding(), 4);
    assert!(
        ctrl.poll_admin().unwrap(),
        "CFS makes the health check reset"
    );
    assert_eq!(dev.stats().resets, 1);
    assert_eq!(ctrl.stats().resets, 1);
    assert_eq!(qp.poll(8).unwrap(), 4, "the four fail on the next poll");
    let errs = drain_errors(&mut qp);
    assert_eq!(errs.len(), 4);
    assert!(errs.iter().all(|e| matches!(e, nvpoll::Error::Aborted(_))));
    assert_eq!(qp.outstanding(), 0);
    assert_eq!(qp.recovery_stats().failed, 4);
    // The queue pair re-created its queues (same queue ID) and takes work again.
    assert_eq!(dev.io_queues(), vec![1]);
    round_trip(&dev, &pool, &mut qp, 100, 8192, 0, 3);
    assert!(!ctrl.poll_admin().unwrap());
    // A new queue pair gets the next queue ID: the old one kept its own through the reset.
    assert_eq!(ctrl.create_queue_pair(8).unwrap().qid(), 2);
}

#[test]
fn a_command_timeout_triggers_a_reset_and_fail_fast_fails_the_commands() {
    let o = PcieOptions {
        io_timeout: Duration::from_millis(50),
        ..opts()
    };
    let (dev, pool, mut ctrl) = attach(FakeConfig::default(), o);
    let mut qp = ctrl.create_queue_pair_with(fail_fast(8)).unwrap();
    dev.set_stalled(true);
    submit_four(&pool, &mut qp);
    let start = Instant::now();
    while !qp.is_recovering() {
        assert_eq!(qp.poll(8).unwrap(), 0, "completions from a stalled device");
        assert!(start.elapsed() < Duration::from_secs(10), "no timeout");
    }
    assert!(start.elapsed() >= Duration::from_millis(50));
    assert_eq!(qp.recovery_stats().timeouts, 1);
    // Until the reset, nothing is handed back (the device may still write the buffers) and submits are
    // refused.
    assert_eq!(qp.poll(8).unwrap(), 0);
    assert_eq!(qp.outstanding(), 4);
    let r = qp.submit(io(IoOp::Flush, 0, 0, None, 9)).unwrap_err();
    assert!(r.error.to_string().contains("reset"), "{}", r.error);
    dev.set_stalled(false);
    assert!(ctrl.poll_admin().unwrap(), "the queue asked for a reset");
    assert_eq!(qp.poll(8).unwrap(), 4);
    let errs = drain_errors(&mut qp);
    assert_eq!(errs.len(), 4);
    assert!(errs.iter().all(|e| matches!(e, nvpoll::Error::Timeout)));
    round_trip(&dev, &pool, &mut qp, 0, 4096, 4, 9);
}

#[test]
fn surprise_removal_fails_everything_without_panicking() {
    let (dev, pool, mut ctrl) = attach(FakeConfig::default(), opts());
    let mut qp = ctrl.create_queue_pair(8).unwrap();
    submit_four(&pool, &mut qp);
    dev.remove();
    // Completions posted before the removal are still in memory; the health check then finds it gone.
    let _ = qp.poll(8);
    while qp.pop_completion().is_some() {}
    assert!(matches!(ctrl.poll_admin(), Err(Error::Removed)));
    assert!(qp.poll(8).is_err());
    assert!(qp.submit(io(IoOp::Flush, 0, 0, None, 0)).is_err());
    assert!(matches!(
        ctrl.create_queue_pair_with(QueueOptions::new(4)),
        Err(Error::Removed)
    ));
    assert!(ctrl
        .admin(Sqe::get_features(feature::NUMBER_OF_QUEUES), None)
        .is_err());
    drop(ctrl);
    drop(qp);
}

#[test]
fn removal_while_commands_hang_is_reported_as_removal() {
    let o = PcieOptions {
        io_timeout: Duration::from_millis(20),
        ..opts()
    };
    let (dev, pool, mut ctrl) = attach(FakeConfig::default(), o);
    let mut qp = ctrl.create_queue_pair(8).unwrap();
    dev.set_stalled(true);
    submit_four(&pool, &mut qp);
    dev.remove();
    let e = loop {
        if let Err(e) = qp.poll(8) {
            break e;
        }
    };
    assert!(e.to_string().contains("removed"), "{e}");
    assert_eq!(drain_errors(&mut qp).len(), 4);
    assert!(matches!(ctrl.poll_admin(), Err(Error::Removed)));
}

#[test]
fn queue_pairs_run_on_other_threads() {
    fn assert_send<T: Send>() {}
    assert_send::<PcieQueuePair<FakeDevice>>();
    assert_send::<PcieQueuePair>();
    let (dev, pool, mut ctrl) = attach(FakeConfig::default(), opts());
    let mut handles = Vec::new();
    for t in 0..3u64 {
        let mut qp = ctrl.create_queue_pair(16).unwrap();
        let pool = pool.clone();
        handles.push(std::thread::spawn(move || {
            let mut done = 0;
            let mut n = 0u64;
            while done < 200 {
                while qp.outstanding() < 16 && n < 200 {
                    let lba = t * 1000 + n % 100;
                    qp.submit(io(IoOp::Write, lba, 1, Some(pool.alloc(512).unwrap()), n))
                        .unwrap();
                    n += 1;
                }
                qp.flush().unwrap();
                done += qp
                    .process_completions(16, |_, c| c.result.unwrap())
                    .unwrap();
            }
        }));
    }
    for h in handles {
        h.join().unwrap();
    }
    ctrl.poll_admin().unwrap();
    assert!(dev.io_queues().is_empty());
    assert_eq!(dev.stats().cq_overflows, 0);
}

#[test]
fn unmapped_buffers_fail_like_an_iommu_fault() {
    let (dev, _pool, mut ctrl) = attach(FakeConfig::default(), opts());
    let mut qp = ctrl.create_queue_pair(2).unwrap();
    let other = pool();
    qp.submit(io(IoOp::Write, 0, 8, Some(other.alloc(4096).unwrap()), 1))
        .unwrap();
    let c = wait_one(&mut qp);
    assert!(
        matches!(c.result, Err(nvpoll::Error::Nvme(s)) if s.status == nvpoll::spec::Status::DATA_TRANSFER_ERROR)
    );
    assert_eq!(dev.stats().dma_faults, 1);
}

#[test]
fn sgl_data_blocks_where_the_controller_supports_them() {
    let (dev, pool, mut ctrl) = attach(FakeConfig::default(), opts());
    let mut qp = ctrl
        .create_queue_pair_with(QueueOptions {
            sgl: true,
            ..QueueOptions::new(4)
        })
        .unwrap();
    let mut lba = 0;
    for len in [512, 4096, 8192, 64 * 1024, 512 * 1024] {
        // SGLS 01b: any byte alignment.
        for off in [0, 1, 3, 4092] {
            round_trip(&dev, &pool, &mut qp, lba, len, off, 5);
            lba += (len / 512) as u64;
        }
    }
    assert_eq!(qp.stats().sgls, 40);
    assert_eq!((qp.stats().prp_lists, dev.stats().prp_list), (0, 0));
    assert_eq!(dev.stats().sgl, 40);

    // Without SGL support the queue pair is refused; with dword-only SGLs odd buffers are.
    let (_d, _p, mut none) = attach(
        FakeConfig {
            sgls: 0,
            ..FakeConfig::default()
        },
        opts(),
    );
    let e = none
        .create_queue_pair_with(QueueOptions {
            sgl: true,
            ..QueueOptions::new(4)
        })
        .unwrap_err();
    assert!(e.to_string().contains("SGL"), "{e}");
    let (dev2, pool2, mut dword) = attach(
        FakeConfig {
            sgls: 0b10,
            ..FakeConfig::default()
        },
        opts(),
    );
    let mut qp = dword
        .create_queue_pair_with(QueueOptions {
            sgl: true,
            ..QueueOptions::new(4)
        })
        .unwrap();
    let mut odd = pool2.alloc(4096).unwrap();
    odd.set_window(1, 512).unwrap();
    let e = qp.submit(io(IoOp::Write, 0, 1, Some(odd), 0)).unwrap_err();
    assert!(e.error.to_string().contains("dword"), "{}", e.error);
    round_trip(&dev2, &pool2, &mut qp, 0, 4096, 4, 1);
}

#[test]
fn honours_mqes_and_the_doorbell_stride() {
    let cfg = FakeConfig {
        dstrd: 2,
        mqes: 63,
        ..FakeConfig::default()
    };
    let (dev, pool, mut ctrl) = attach(cfg, opts());
    assert_eq!(
        (ctrl.cap().dstrd(), ctrl.cap().max_queue_entries()),
        (2, 64)
    );
    let e = ctrl.create_queue_pair(64).unwrap_err();
    assert!(e.to_string().contains("MQES"), "{e}");
    let mut qp = ctrl.create_queue_pair(63).unwrap();
    // With 16-byte doorbells the stand-in only completes commands if the driver rang the right ones.
    for round in 0..4 {
        round_trip(&dev, &pool, &mut qp, round * 64, 8192, 4, round as u8);
    }
    let other = ctrl.create_queue_pair(8).unwrap();
    assert_eq!(dev.io_queues(), vec![1, 2]);
    drop(other);
    ctrl.poll_admin().unwrap();
    assert_eq!(dev.io_queues(), vec![1]);
}

//! The send policy on the PCIe doorbell (against the memory-backed stand-in): inline rings the SQ tail
//! doorbell from `submit`, deferred once per `flush`, adaptive inline only while the queue is idle.

use std::sync::Arc;
use std::time::{Duration, Instant};

use nvpoll::api::{Controller, IoOp, IoRequest, QueuePair};
use nvpoll::mem::{DmaPool, HugepageMode};
use nvpoll::send::SendMode;
use nvpoll_pcie::fake::{FakeConfig, FakeDevice};
use nvpoll_pcie::{PcieController, PcieOptions};

fn doorbells_for_a_batch(mode: SendMode, batch: u64) -> u64 {
    let dev = Arc::new(FakeDevice::new(FakeConfig::default()));
    let pool = DmaPool::builder()
        .class(4096, 64)
        .hugepages(HugepageMode::Off)
        .build()
        .unwrap();
    let opts = PcieOptions {
        hugepages: HugepageMode::Off,
        admin_timeout: Duration::from_secs(2),
        ..PcieOptions::default()
    };
    let mut ctrl = PcieController::attach(Arc::clone(&dev), pool.clone(), opts).unwrap();
    let mut qp = ctrl.create_queue_pair(32).unwrap();
    qp.set_send_mode(mode).unwrap();
    let before = QueuePair::stats(&qp);
    for i in 0..batch {
        let buf = pool.alloc(4096).unwrap();
        qp.submit(IoRequest {
            op: IoOp::Read,
            nsid: 1,
            lba: i * 8,
            blocks: 8,
            buf: Some(buf),
            tag: i,
        })
        .map_err(|r| r.error)
        .unwrap();
    }
    qp.flush().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut done = 0;
    while done < batch {
        qp.poll(64).unwrap();
        while let Some(c) = qp.pop_completion() {
            c.result.unwrap();
            done += 1;
        }
        assert!(Instant::now() < deadline, "completions did not arrive");
    }
    QueuePair::stats(&qp).since(&before).writes
}

#[test]
fn doorbells_follow_the_send_mode() {
    assert_eq!(
        doorbells_for_a_batch(SendMode::Inline, 16),
        16,
        "inline: one doorbell per submit"
    );
    assert_eq!(
        doorbells_for_a_batch(SendMode::Deferred, 16),
        1,
        "deferred: one doorbell per flush"
    );
    // Adaptive: the first two go inline (idle queue), the rest wait for the flush.
    let adaptive = doorbells_for_a_batch(SendMode::Adaptive, 16);
    assert!(
        (2..=3).contains(&adaptive),
        "adaptive rang {adaptive} doorbells"
    );
}

//! A namespace backed by another controller's namespace through the queue-pair API (`Backing::Device`): here
//! the backing controller is a second target of ours over NVMe/TCP, standing in for a PCIe SSD. What a host
//! writes through the exporting target is on the backing namespace, and the other way round.

use nvpoll_testkit::target as target_common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use nvpoll::api::{Controller, IoOp, IoRequest, QueuePair};
use nvpoll_target::{Backing, QueuePairDevice, SubsystemConfig, TargetConfig};
use nvpoll_tcp::host::{ConnectOptions, TcpController, TcpQueuePair};
use target_common::{fill_pattern, pool, TestTarget, HOSTNQN, NQN};

const EXPORT_NQN: &str = "nqn.2024-01.io.nvpoll:export";

fn run(
    qp: &mut TcpQueuePair,
    op: IoOp,
    nsid: u32,
    lba: u64,
    blocks: u32,
    buf: nvpoll::mem::DmaBuf,
) -> nvpoll::mem::DmaBuf {
    qp.submit(IoRequest {
        op,
        nsid,
        lba,
        blocks,
        buf: Some(buf),
        tag: 1,
    })
    .map_err(|r| r.error)
    .unwrap();
    qp.flush().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        qp.poll(1).unwrap();
        if let Some(c) = qp.pop_completion() {
            c.result.unwrap();
            return c.buf.unwrap();
        }
        assert!(Instant::now() < deadline, "no completion");
    }
}

fn flush(qp: &mut TcpQueuePair) {
    qp.submit(IoRequest {
        op: IoOp::Flush,
        nsid: 1,
        lba: 0,
        blocks: 0,
        buf: None,
        tag: 2,
    })
    .map_err(|r| r.error)
    .unwrap();
    qp.flush().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        qp.poll(1).unwrap();
        if let Some(c) = qp.pop_completion() {
            assert_eq!(c.tag, 2);
            c.result.unwrap();
            return;
        }
        assert!(Instant::now() < deadline, "no flush completion");
    }
}

#[test]
fn exported_namespace_is_the_backing_namespace() {
    // The backing store: namespace 1 (512-byte blocks) of an ordinary target.
    let backing = TestTarget::start(|c| c);
    let bpool = pool();
    let bctrl = TcpController::connect(
        ConnectOptions::new(backing.addr, NQN, HOSTNQN),
        bpool.clone(),
    )
    .unwrap();
    let device = Arc::new(QueuePairDevice::new(bctrl, bpool, 1, "backing target").unwrap());
    // The exporting target serves it as its namespace 1.
    let export = TestTarget::start_with(
        TargetConfig::new("127.0.0.1:0".parse().unwrap())
            .subsystem(SubsystemConfig::new(EXPORT_NQN).namespace(Backing::Device(device), 512)),
    );
    let p = pool();
    let mut host = TcpController::connect(
        ConnectOptions::new(export.addr, EXPORT_NQN, HOSTNQN),
        p.clone(),
    )
    .unwrap();
    assert_eq!(
        host.namespaces()[0].capacity_bytes(),
        target_common::NS1_BYTES
    );
    let mut qp = host.create_queue_pair(4).unwrap();
    // 256 KiB written through the export...
    let mut w = p.alloc(256 * 1024).unwrap();
    fill_pattern(w.as_mut_slice(), 9);
    let expect = w.as_slice().to_vec();
    run(&mut qp, IoOp::Write, 1, 100, 512, w);
    // ...is on the backing namespace.
    let mut direct =
        TcpController::connect(ConnectOptions::new(backing.addr, NQN, HOSTNQN), p.clone()).unwrap();
    let mut dqp = direct.create_queue_pair(4).unwrap();
    let got = run(
        &mut dqp,
        IoOp::Read,
        1,
        100,
        512,
        p.alloc(256 * 1024).unwrap(),
    );
    assert!(
        got.as_slice() == &expect[..],
        "the backing namespace holds what was written through the export"
    );
    // And what is written on the backing namespace reads back through the export (flush included).
    let mut w = p.alloc(4096).unwrap();
    fill_pattern(w.as_mut_slice(), 10);
    let expect = w.as_slice().to_vec();
    run(&mut dqp, IoOp::Write, 1, 4000, 8, w);
    flush(&mut qp);
    let got = run(&mut qp, IoOp::Read, 1, 4000, 8, p.alloc(4096).unwrap());
    assert!(got.as_slice() == &expect[..]);
    // A deallocate through the export reaches the backing controller (ours: it has Dataset Management, and
    // deallocated blocks read as zeroes there).
    run(
        &mut qp,
        IoOp::Deallocate,
        1,
        4002,
        4,
        p.alloc(4096).unwrap(),
    );
    let got = run(&mut dqp, IoOp::Read, 1, 4000, 8, p.alloc(4096).unwrap());
    assert!(got.as_slice()[..1024] == expect[..1024]);
    assert!(got.as_slice()[1024..3072].iter().all(|&b| b == 0));
    assert!(got.as_slice()[3072..] == expect[3072..]);
}

//! The set-up the `qpair` bench and the `fake_loop` example share: a controller attached to the
//! memory-backed stand-in in its null mode, and one I/O queue pair. Both include this file with
//! `#[path = ...] mod common;` (a folder, so that Cargo does not take it for a bench of its own).

use std::sync::Arc;

use nvpoll::api::Controller;
use nvpoll::mem::{DmaPool, HugepageMode};
use nvpoll_pcie::fake::{FakeConfig, FakeDevice};
use nvpoll_pcie::{PcieController, PcieOptions, PcieQueuePair};

/// A null-mode stand-in (no data kept) attached with a pool of the given `(size, count)` buffer classes, huge
/// pages off, and an I/O queue pair of `depth` entries; the pool is the one the controller maps.
pub(crate) fn null_controller(
    classes: &[(usize, usize)],
    depth: u16,
) -> (
    PcieController<FakeDevice>,
    PcieQueuePair<FakeDevice>,
    DmaPool,
) {
    let dev = Arc::new(FakeDevice::new(FakeConfig {
        store_data: false,
        ..FakeConfig::default()
    }));
    let pool = classes
        .iter()
        .fold(DmaPool::builder(), |b, &(size, count)| b.class(size, count))
        .hugepages(HugepageMode::Off)
        .build()
        .unwrap();
    let opts = PcieOptions {
        hugepages: HugepageMode::Off,
        ..PcieOptions::default()
    };
    let mut ctrl = PcieController::attach(dev, pool.clone(), opts).unwrap();
    let qp = ctrl.create_queue_pair(depth).unwrap();
    (ctrl, qp, pool)
}

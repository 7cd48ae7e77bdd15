//! The I/O path allocates nothing: submit, flush, poll and pop_completion against the stand-in (null mode)
//! run under a counting global allocator, with PRP lists and SGLs.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use nvpoll::api::{IoOp, IoRequest, QueuePair};
use nvpoll::mem::{DmaPool, HugepageMode};
use nvpoll_pcie::fake::{FakeConfig, FakeDevice};
use nvpoll_pcie::{PcieController, PcieOptions, QueueOptions};

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// Set on the test thread while it measures: only the I/O path's own allocations count, not those of
    /// unrelated threads of the test harness (a const, drop-free thread local: reading it never allocates).
    static COUNTING: Cell<bool> = const { Cell::new(false) };
}

// SAFETY: every method forwards to the system allocator unchanged; counting touches no allocation.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.try_with(Cell::get).unwrap_or(false) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn the_io_path_does_not_allocate() {
    let dev = Arc::new(FakeDevice::new(FakeConfig {
        store_data: false,
        ..FakeConfig::default()
    }));
    let pool = DmaPool::builder()
        .class(64 * 1024, 64)
        .hugepages(HugepageMode::Off)
        .build()
        .unwrap();
    let opts = PcieOptions {
        hugepages: HugepageMode::Off,
        ..PcieOptions::default()
    };
    let mut ctrl = PcieController::attach(dev, pool.clone(), opts).unwrap();
    for sgl in [false, true] {
        let mut qp = ctrl
            .create_queue_pair_with(QueueOptions {
                sgl,
                ..QueueOptions::new(64)
            })
            .unwrap();
        let mut bufs: Vec<_> = (0..32).map(|_| pool.alloc(64 * 1024).unwrap()).collect();
        let mut run = |rounds: u32, bufs: &mut Vec<nvpoll::mem::DmaBuf>| {
            for _ in 0..rounds {
                for (i, b) in bufs.drain(..).enumerate() {
                    let req = IoRequest {
                        op: if i % 2 == 0 { IoOp::Read } else { IoOp::Write },
                        nsid: 1,
                        lba: i as u64 * 128,
                        blocks: 128,
                        buf: Some(b),
                        tag: i as u64,
                    };
                    assert!(qp.submit(req).is_ok());
                }
                qp.flush().unwrap();
                while bufs.len() < 32 {
                    qp.poll(32).unwrap();
                    while let Some(c) = qp.pop_completion() {
                        assert!(c.result.is_ok());
                        bufs.push(c.buf.unwrap());
                    }
                }
            }
        };
        run(2, &mut bufs); // warm-up
        let before = ALLOCS.load(Ordering::Relaxed);
        COUNTING.with(|c| c.set(true));
        run(100, &mut bufs);
        COUNTING.with(|c| c.set(false));
        let allocs = ALLOCS.load(Ordering::Relaxed) - before;
        assert_eq!(allocs, 0, "{allocs} allocations for 3200 I/Os (sgl: {sgl})");
    }
}

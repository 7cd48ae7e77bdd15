//! The driver's own cost per I/O: submit, doorbell, completion polling and hand-back, against the
//! memory-backed controller stand-in ([`nvpoll_pcie::fake::FakeDevice`]) in its null mode (no data moved, no
//! PRP walk). The stand-in's share (a mutex, one 64-byte SQE read and one 16-byte CQE write per command) is
//! included; `prp` measures PRP list building alone.
//!
//! Run with `cargo bench -p nvpoll-pcie --bench qpair`; `drivers/pcie/benches/callgrind.sh` counts
//! instructions per I/O for the same loops.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use nvpoll::api::{IoOp, IoRequest, QueuePair};
use nvpoll::mem::{DmaBuf, DmaPool, HugepageMode};
use nvpoll_pcie::fake::FakeDevice;
use nvpoll_pcie::mmio::SharedMem;
use nvpoll_pcie::PcieQueuePair;

#[path = "common/mod.rs"]
mod common;

/// Submits `bufs.len()` reads of `blocks` blocks, flushes once, and polls until all are back.
fn batch(qp: &mut PcieQueuePair<FakeDevice>, bufs: &mut Vec<DmaBuf>, blocks: u32) {
    let n = bufs.len();
    for (i, b) in bufs.drain(..).enumerate() {
        let req = IoRequest {
            op: IoOp::Read,
            nsid: 1,
            lba: i as u64 * 128,
            blocks,
            buf: Some(b),
            tag: i as u64,
        };
        if qp.submit(req).is_err() {
            panic!("submit failed");
        }
    }
    qp.flush().unwrap();
    while bufs.len() < n {
        qp.poll(n).unwrap();
        while let Some(c) = qp.pop_completion() {
            bufs.push(c.buf.unwrap());
        }
    }
}

fn bench_io(c: &mut Criterion) {
    let mut g = c.benchmark_group("pcie_fake");
    for (name, qd, len) in [
        ("read4k_qd1", 1usize, 4096usize),
        ("read4k_batch32", 32, 4096),
        ("read64k_prp_list_qd1", 1, 64 * 1024),
        ("read64k_prp_list_batch32", 32, 64 * 1024),
    ] {
        let (_ctrl, mut qp, pool) = common::null_controller(&[(4096, 256), (64 * 1024, 64)], 128);
        let mut bufs: Vec<DmaBuf> = (0..qd).map(|_| pool.alloc(len).unwrap()).collect();
        g.throughput(Throughput::Elements(qd as u64));
        g.bench_function(name, |b| {
            b.iter(|| batch(&mut qp, black_box(&mut bufs), (len / 512) as u32))
        });
    }
    g.finish();
}

fn bench_prp(c: &mut Criterion) {
    let pool = DmaPool::builder()
        .class(4096, 1)
        .hugepages(HugepageMode::Off)
        .build()
        .unwrap();
    let mut list = SharedMem::new(pool.alloc(4096).unwrap());
    let mut g = c.benchmark_group("prp");
    for (name, len) in [
        ("4k", 4096u32),
        ("8k", 8192),
        ("64k", 65536),
        ("512k", 512 * 1024),
    ] {
        g.bench_function(name, |b| {
            b.iter(|| {
                nvpoll_pcie::prp::build(black_box(0x10_0000), black_box(len), &mut list, 0).unwrap()
            })
        });
    }
    g.finish();
}

// criterion_group! makes an undocumented `pub fn`: kept in a module of its own, it is not public.
mod group {
    use super::*;
    criterion_group!(benches, bench_io, bench_prp);
}
criterion_main!(group::benches);

//! Runs N read I/Os through a queue pair against the memory-backed stand-in, at queue depth 1 or in batches
//! of 32: the workload `benches/callgrind.sh` counts instructions for.
//!
//! usage: fake_loop ITERATIONS [qd1|batch32]

use nvpoll::api::{IoOp, IoRequest, QueuePair};

#[path = "../benches/common/mod.rs"]
mod common;

fn main() {
    let mut args = std::env::args().skip(1);
    let ios: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(100_000);
    let qd: usize = match args.next().as_deref() {
        None | Some("qd1") => 1,
        Some("batch32") => 32,
        Some(other) => panic!("unknown mode {other}: qd1 or batch32"),
    };
    let (_ctrl, mut qp, pool) = common::null_controller(&[(4096, 64)], 128);
    let mut bufs: Vec<_> = (0..qd).map(|_| pool.alloc(4096).unwrap()).collect();
    let mut done = 0u64;
    while done < ios {
        for (i, b) in bufs.drain(..).enumerate() {
            let req = IoRequest {
                op: IoOp::Read,
                nsid: 1,
                lba: i as u64 * 8,
                blocks: 8,
                buf: Some(b),
                tag: i as u64,
            };
            qp.submit(req).unwrap();
        }
        qp.flush().unwrap();
        while bufs.len() < qd {
            qp.poll(qd).unwrap();
            while let Some(c) = qp.pop_completion() {
                bufs.push(c.buf.unwrap());
            }
        }
        done += qd as u64;
    }
    println!("{done} I/Os, {:?}", qp.stats());
}

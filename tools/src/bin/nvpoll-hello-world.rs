//! `hello_world`: write a pattern to the first namespace, read it back and check it.

use std::time::{Duration, Instant};

use clap::Parser;
use nvpoll::api::{Completion, Controller, IoOp, IoRequest, QueuePair};
use nvpoll::mem::DmaPool;
use nvpoll::trid::TransportId;
use nvpoll_pcie::PcieOptions;

use nvpoll_tools::cli as common;

/// Write "Hello world!" and a pattern to LBA 0 of the first namespace, read it back and compare.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    #[command(flatten)]
    target: common::Target,
    /// First LBA to write.
    #[arg(long, default_value_t = 0)]
    lba: u64,
    #[command(flatten)]
    verbosity: common::Verbosity,
}

fn main() {
    let args = Args::parse();
    common::run_main("nvpoll-hello-world", args.verbosity.verbose, || run(args));
}

fn wait<Q: QueuePair>(qp: &mut Q) -> Result<Completion, String> {
    qp.flush().map_err(|e| e.to_string())?;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        qp.poll(1).map_err(|e| e.to_string())?;
        if let Some(c) = qp.pop_completion() {
            return Ok(c);
        }
        if Instant::now() > deadline {
            return Err("no completion within 10 s".into());
        }
    }
}

fn run(args: Args) -> Result<(), String> {
    let trid = common::parse_trid(&args.target.trid)?;
    if let TransportId::Pcie { bdf } = &trid {
        let pool = common::dma_pool(64)?;
        let mut ctrl = common::open_pcie(*bdf, &pool, PcieOptions::default())?;
        write_read(&mut ctrl, &pool, args.lba)?;
        return common::shutdown(ctrl).map_err(String::from);
    }
    let opts = args.target.host.connect_options(&trid)?;
    let pool = common::dma_pool(64)?;
    let mut ctrl = common::connect_tcp(opts, &pool)?;
    write_read(&mut ctrl, &pool, args.lba)?;
    common::shutdown(ctrl).map_err(String::from)
}

/// Writes the message and a pattern at `lba` of the first namespace, reads it back and compares.
fn write_read<C: Controller>(ctrl: &mut C, pool: &DmaPool, lba: u64) -> Result<(), String> {
    let ns = ctrl
        .namespaces()
        .first()
        .cloned()
        .ok_or("the controller has no active namespace")?;
    let mut qp = ctrl
        .create_queue_pair(4)
        .map_err(|e| format!("I/O queue: {e}"))?;
    let len = 4096usize;
    let blocks = (len as u32).div_ceil(ns.block_size);
    let len = (blocks * ns.block_size) as usize;
    let mut w = pool.alloc(len).map_err(|e| e.to_string())?;
    let msg = b"Hello world!\n";
    for (i, b) in w.as_mut_slice().iter_mut().enumerate() {
        *b = if i < msg.len() {
            msg[i]
        } else {
            (i % 251) as u8
        };
    }
    let expect = w.as_slice().to_vec();
    let req = IoRequest {
        op: IoOp::Write,
        nsid: ns.nsid,
        lba,
        blocks,
        buf: Some(w),
        tag: 1,
    };
    qp.submit(req).map_err(|r| format!("write: {}", r.error))?;
    wait(&mut qp)?.result.map_err(|e| format!("write: {e}"))?;
    let r = pool.alloc(len).map_err(|e| e.to_string())?;
    let req = IoRequest {
        op: IoOp::Read,
        nsid: ns.nsid,
        lba,
        blocks,
        buf: Some(r),
        tag: 2,
    };
    qp.submit(req).map_err(|r| format!("read: {}", r.error))?;
    let c = wait(&mut qp)?;
    c.result.map_err(|e| format!("read: {e}"))?;
    let got = c.buf.ok_or("read returned no buffer")?;
    if got.as_slice() != &expect[..] {
        return Err(format!(
            "data read back from LBA {} differs from what was written",
            lba
        ));
    }
    print!("{}", String::from_utf8_lossy(&got.as_slice()[..msg.len()]));
    println!(
        "hello_world: wrote and read back {len} bytes at LBA {} of namespace {}: OK",
        lba, ns.nsid
    );
    Ok(())
}

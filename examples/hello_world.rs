//! `hello_world`: write a pattern to the first namespace, read it back and check it.

use std::time::{Duration, Instant};

use clap::Parser;
use nvpoll::api::{Completion, Controller, IoOp, IoRequest, QueuePair};
use nvpoll::mem::DmaPool;
use nvpoll::trid::TransportId;
use nvpoll_pcie::{PcieController, PcieOptions};
use nvpoll_tcp::host::{ConnectOptions, TcpController};

/// Write "Hello world!" and a pattern to LBA 0 of the first namespace, read it back and compare.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Transport ID, e.g. 'trtype:tcp traddr:127.0.0.1 trsvcid:4420 subnqn:NQN' or
    /// 'trtype:pcie traddr:0000:01:00.0' (a controller bound to vfio-pci: see `nvpoll-setup bind`).
    #[arg(long)]
    trid: String,
    /// Host NQN (default: /etc/nvme/hostnqn, or one derived from the machine's UUID).
    #[arg(long)]
    hostnqn: Option<String>,
    /// TLS 1.3 PSK in the NVMe interchange format (NVMeTLSkey-1:01:...:); TLS runs before ICReq on every queue.
    #[arg(long)]
    psk: Option<String>,
    /// With --psk: the TLS PSK identity to present verbatim (default: derived from the host and subsystem NQNs).
    #[arg(long, requires = "psk")]
    psk_identity: Option<String>,
    /// With --psk: the identity version to derive, 0 (NVMe0R0x) or 1 (NVMe1R0x with the digest).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=1))]
    psk_identity_version: u8,
    /// First LBA to write.
    #[arg(long, default_value_t = 0)]
    lba: u64,
    /// More log lines from the libraries: -v info, -vv debug, -vvv trace (RUST_LOG, in env_logger's
    /// syntax, overrides this).
    #[arg(short = 'v', long = "verbose", action = clap::ArgAction::Count, global = true)]
    verbose: u8,
}

fn main() {
    let args = Args::parse();
    nvpoll_tools::logging::init(args.verbose);
    if let Err(e) = run(args) {
        eprintln!("hello_world: {e}");
        std::process::exit(1);
    }
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
    let trid: TransportId = args.trid.parse().map_err(|e| format!("--trid: {e}"))?;
    if let TransportId::Pcie { bdf } = &trid {
        let pool = DmaPool::builder()
            .class(4096, 64)
            .build()
            .map_err(|e| format!("DMA pool: {e}"))?;
        let mut ctrl = PcieController::open(*bdf, pool.clone(), PcieOptions::default())
            .map_err(|e| format!("opening {bdf}: {e}"))?;
        write_read(&mut ctrl, &pool, args.lba)?;
        return ctrl.shutdown().map_err(|e| format!("shutdown: {e}"));
    }
    let mut opts = ConnectOptions::from_trid(&trid, args.hostnqn.as_deref())
        .map_err(|e| format!("--trid: {e}"))?;
    if let Some(k) = &args.psk {
        opts = opts
            .with_psk_args(k, args.psk_identity.as_deref(), args.psk_identity_version)
            .map_err(|e| format!("--psk: {e}"))?;
    }
    let addr = opts.addr;
    let pool = DmaPool::builder()
        .class(4096, 64)
        .build()
        .map_err(|e| format!("DMA pool: {e}"))?;
    let mut ctrl = TcpController::connect(opts, pool.clone())
        .map_err(|e| format!("connecting to {addr}: {e}"))?;
    write_read(&mut ctrl, &pool, args.lba)?;
    ctrl.shutdown().map_err(|e| format!("shutdown: {e}"))
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

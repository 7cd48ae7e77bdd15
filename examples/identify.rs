//! `identify`: attach to a controller and print its Identify data, in the style of `nvme id-ctrl`.

use clap::Parser;
use nvpoll::api::Controller;
use nvpoll::mem::DmaPool;
use nvpoll::trid::TransportId;
use nvpoll_pcie::{PcieController, PcieOptions};
use nvpoll_tcp::host::{ConnectOptions, TcpController};

/// Print the controller and namespace summary of an NVMe controller.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Transport ID, e.g. 'trtype:tcp adrfam:IPv4 traddr:127.0.0.1 trsvcid:4420 subnqn:NQN' or
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
    /// Ask for header digests (NVMe/TCP).
    #[arg(long)]
    hdr_digest: bool,
    /// Ask for data digests (NVMe/TCP).
    #[arg(long)]
    data_digest: bool,
    /// More log lines from the libraries: -v info, -vv debug, -vvv trace (RUST_LOG, in env_logger's
    /// syntax, overrides this).
    #[arg(short = 'v', long = "verbose", action = clap::ArgAction::Count, global = true)]
    verbose: u8,
}

fn main() {
    let args = Args::parse();
    nvpoll_tools::logging::init(args.verbose);
    if let Err(e) = run(args) {
        eprintln!("identify: {e}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<(), String> {
    let trid: TransportId = args.trid.parse().map_err(|e| format!("--trid: {e}"))?;
    if let TransportId::Pcie { bdf } = &trid {
        return identify_pcie(&trid, *bdf);
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
    opts.header_digest = args.hdr_digest;
    opts.data_digest = args.data_digest;
    let ctrl =
        TcpController::connect(opts, pool).map_err(|e| format!("connecting to {addr}: {e}"))?;
    let id = ctrl.identify();
    println!("NVMe Identify Controller ({trid}):");
    println!("vid       : {:#06x}", id.vid);
    println!("ssvid     : {:#06x}", id.ssvid);
    println!("sn        : {}", id.serial);
    println!("mn        : {}", id.model);
    println!("fr        : {}", id.firmware);
    println!("ver       : {} (VS register {})", id.ver, ctrl.vs());
    println!("cntlid    : {:#x}", ctrl.cntlid());
    println!(
        "mdts      : {}{}",
        id.mdts,
        if id.mdts == 0 { " (no limit)" } else { "" }
    );
    println!(
        "max xfer  : {} bytes (used by nvpoll)",
        ctrl.max_transfer().unwrap_or(0)
    );
    println!("maxcmd    : {}", id.maxcmd);
    println!("nn        : {}", id.nn);
    println!("sgls      : {:#x}", id.sgls);
    println!(
        "ioccsz    : {} ({} bytes of in-capsule data)",
        id.ioccsz,
        (id.ioccsz * 16).saturating_sub(64)
    );
    println!("iorcsz    : {}", id.iorcsz);
    println!("subnqn    : {}", id.subnqn);
    println!("mqes      : {}", u32::from(ctrl.cap().mqes()) + 1);
    println!("io queues : {} granted", ctrl.io_queues_allowed());
    for ns in ctrl.namespaces() {
        println!(
            "namespace {}: {} blocks of {} bytes = {} MiB",
            ns.nsid,
            ns.blocks,
            ns.block_size,
            ns.capacity_bytes() >> 20
        );
    }
    ctrl.shutdown().map_err(|e| format!("shutdown: {e}"))
}

/// The PCIe branch: open the controller through VFIO and print what it identified as.
fn identify_pcie(trid: &TransportId, bdf: nvpoll::trid::PciAddress) -> Result<(), String> {
    let pool = DmaPool::builder()
        .class(4096, 16)
        .build()
        .map_err(|e| format!("DMA pool: {e}"))?;
    let ctrl = PcieController::open(bdf, pool, PcieOptions::default())
        .map_err(|e| format!("opening {bdf}: {e}"))?;
    let id = ctrl.identify();
    println!("NVMe Identify Controller ({trid}):");
    println!("vid       : {:#06x}", id.vid);
    println!("ssvid     : {:#06x}", id.ssvid);
    println!("sn        : {}", id.serial);
    println!("mn        : {}", id.model);
    println!("fr        : {}", id.firmware);
    println!("ver       : {} (VS register {})", id.ver, ctrl.vs());
    println!("cntlid    : {:#x}", id.cntlid);
    println!(
        "mdts      : {}{}",
        id.mdts,
        if id.mdts == 0 { " (no limit)" } else { "" }
    );
    println!(
        "max xfer  : {} bytes (used by nvpoll)",
        ctrl.max_transfer().unwrap_or(0)
    );
    println!("nn        : {}", id.nn);
    println!("oncs      : {:#x}", id.oncs);
    println!("sgls      : {:#x}", id.sgls);
    println!("mqes      : {}", ctrl.cap().max_queue_entries());
    println!("dstrd     : {}", ctrl.cap().dstrd());
    println!("io queues : {} granted", ctrl.io_queues_granted());
    let dev = ctrl.device();
    println!(
        "vfio      : group {}, BAR0 {} KiB, IOMMU page sizes {:#x}",
        dev.group(),
        dev.bar().len() >> 10,
        dev.iommu().page_sizes
    );
    for ns in ctrl.namespaces() {
        println!(
            "namespace {}: {} blocks of {} bytes = {} MiB",
            ns.nsid,
            ns.blocks,
            ns.block_size,
            ns.capacity_bytes() >> 20
        );
    }
    ctrl.shutdown().map_err(|e| format!("shutdown: {e}"))
}

//! `identify`: attach to a controller and print its Identify data, in the style of `nvme id-ctrl`.

use clap::Parser;
use nvpoll::api::Controller;
use nvpoll::spec::Vs;
use nvpoll::trid::TransportId;
use nvpoll_pcie::PcieOptions;

use nvpoll_tools::cli as common;

/// Print the controller and namespace summary of an NVMe controller.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    #[command(flatten)]
    target: common::Target,
    /// Ask for header digests (NVMe/TCP).
    #[arg(long)]
    hdr_digest: bool,
    /// Ask for data digests (NVMe/TCP).
    #[arg(long)]
    data_digest: bool,
    #[command(flatten)]
    verbosity: common::Verbosity,
}

fn main() {
    let args = Args::parse();
    common::run_main("nvpoll-identify", args.verbosity.verbose, || run(args));
}

fn run(args: Args) -> Result<(), String> {
    let trid = common::parse_trid(&args.target.trid)?;
    if let TransportId::Pcie { bdf } = &trid {
        return identify_pcie(&trid, *bdf);
    }
    let mut opts = args.target.host.connect_options(&trid)?;
    let pool = common::dma_pool(64)?;
    opts.header_digest = args.hdr_digest;
    opts.data_digest = args.data_digest;
    let ctrl = common::connect_tcp(opts, &pool)?;
    let id = ctrl.identify();
    let transport = [
        format!("maxcmd    : {}", id.maxcmd),
        format!("nn        : {}", id.nn),
        format!("sgls      : {:#x}", id.sgls),
        format!(
            "ioccsz    : {} ({} bytes of in-capsule data)",
            id.ioccsz,
            (id.ioccsz * 16).saturating_sub(64)
        ),
        format!("iorcsz    : {}", id.iorcsz),
        format!("subnqn    : {}", id.subnqn),
        format!("mqes      : {}", u32::from(ctrl.cap().mqes()) + 1),
        format!("io queues : {} granted", ctrl.io_queues_allowed()),
    ];
    print_summary(&trid, &ctrl, ctrl.vs(), ctrl.cntlid(), &transport);
    common::shutdown(ctrl).map_err(String::from)
}

/// The PCIe branch: open the controller through VFIO and print what it identified as.
fn identify_pcie(trid: &TransportId, bdf: nvpoll::trid::PciAddress) -> Result<(), String> {
    let pool = common::dma_pool(16)?;
    let ctrl = common::open_pcie(bdf, &pool, PcieOptions::default())?;
    let id = ctrl.identify();
    let dev = ctrl.device();
    let transport = [
        format!("nn        : {}", id.nn),
        format!("oncs      : {:#x}", id.oncs),
        format!("sgls      : {:#x}", id.sgls),
        format!("mqes      : {}", ctrl.cap().max_queue_entries()),
        format!("dstrd     : {}", ctrl.cap().dstrd()),
        format!("io queues : {} granted", ctrl.io_queues_granted()),
        format!(
            "vfio      : group {}, BAR0 {} KiB, IOMMU page sizes {:#x}",
            dev.group(),
            dev.bar().len() >> 10,
            dev.iommu().page_sizes
        ),
    ];
    print_summary(trid, &ctrl, ctrl.vs(), id.cntlid, &transport);
    common::shutdown(ctrl).map_err(String::from)
}

/// Prints the summary of `ctrl`, reached at `trid`: what every controller identifies as (with its VS register
/// `vs` and the controller ID `cntlid`), then the `transport`'s own lines, then the namespaces.
fn print_summary<C: Controller>(
    trid: &TransportId,
    ctrl: &C,
    vs: Vs,
    cntlid: u16,
    transport: &[String],
) {
    let id = ctrl.identify();
    println!("NVMe Identify Controller ({trid}):");
    println!("vid       : {:#06x}", id.vid);
    println!("ssvid     : {:#06x}", id.ssvid);
    println!("sn        : {}", id.serial);
    println!("mn        : {}", id.model);
    println!("fr        : {}", id.firmware);
    println!("ver       : {} (VS register {vs})", id.ver);
    println!("cntlid    : {cntlid:#x}");
    println!(
        "mdts      : {}{}",
        id.mdts,
        if id.mdts == 0 { " (no limit)" } else { "" }
    );
    println!(
        "max xfer  : {} bytes (used by nvpoll)",
        ctrl.max_transfer().unwrap_or(0)
    );
    for line in transport {
        println!("{line}");
    }
    for ns in ctrl.namespaces() {
        println!(
            "namespace {}: {} blocks of {} bytes = {} MiB",
            ns.nsid,
            ns.blocks,
            ns.block_size,
            ns.capacity_bytes() >> 20
        );
    }
}

//! nvpoll's NVMe/TCP target as a program: serves one NVM subsystem (and the discovery subsystem) until Ctrl-C
//! or SIGTERM, printing one line per connection and a stats line at the end.
//!
//! ```text
//! cargo run --release --example target -- --listen 127.0.0.1:4420 --nqn nqn.2024-01.io.nvpoll:demo --ram 1G --cores 0
//! nvme discover -t tcp -a 127.0.0.1 -s 4420
//! nvme connect -t tcp -a 127.0.0.1 -s 4420 -n nqn.2024-01.io.nvpoll:demo
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::mpsc;

use clap::Parser;
use nvpoll::reactor::{CoreList, Reactors};
use nvpoll_tcp::target::{Backing, SubsystemConfig, Target, TargetConfig, TargetEvent};

/// nvpoll NVMe/TCP target: a polled-mode target on nvpoll's reactors.
///
/// Serves one NVM subsystem with one or more namespaces (a RAM namespace and/or one per --file), plus the
/// discovery subsystem (nqn.2014-08.org.nvmexpress.discovery) for `nvme discover`. Namespace IDs are given in
/// order: the RAM namespace first (if any), then the files. Runs until Ctrl-C or SIGTERM, then prints the
/// target's counters.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// When responses leave: inline (as each is made), deferred (at the reactor's end-of-iteration flush, all
    /// together) or adaptive (inline while the connection has nothing else to answer).
    #[arg(long, default_value = "deferred")]
    send_mode: nvpoll::send::SendMode,

    /// A host's TLS PSK, as HOSTNQN=KEY with KEY in the NVMe interchange format (NVMeTLSkey-1:01:...:). May be
    /// given once per host. The host may present the v0 or v1 identity derived from it.
    #[arg(long = "psk", value_name = "HOSTNQN=KEY")]
    psks: Vec<String>,

    /// TLS 1.3: off, optional (the first bytes decide: a ClientHello starts TLS, a plain ICReq goes on
    /// without), or required. Default: required when a --psk is given, off otherwise.
    #[arg(long, value_parser = ["off", "optional", "required"])]
    tls: Option<String>,

    /// Address and port to listen on.
    #[arg(long, default_value = "127.0.0.1:4420")]
    listen: SocketAddr,

    /// NQN of the NVM subsystem.
    #[arg(long, default_value = "nqn.2024-01.io.nvpoll:target")]
    nqn: String,

    /// Size of a RAM namespace (bytes, or with a K, M, G or T suffix: powers of 1024). Its contents are lost
    /// when the target stops. Default: 1G when no --file or --pcie is given, none otherwise.
    #[arg(long, value_parser = nvpoll::loadgen::parse_size)]
    ram: Option<u64>,

    /// A namespace backed by an existing regular file or block device, read and written through the page
    /// cache (Flush runs fdatasync). May be given several times.
    #[arg(long)]
    file: Vec<PathBuf>,

    /// A namespace backed by namespace 1 of a local NVMe controller bound to vfio-pci (see `nvpoll-setup
    /// bind`), driven by nvpoll's PCIe driver: the target exports the SSD over NVMe/TCP. Its block size is the
    /// SSD's. May be given several times.
    #[arg(long, value_name = "BDF")]
    pcie: Vec<nvpoll::trid::PciAddress>,

    /// Logical block size of every namespace: 512 or 4096.
    #[arg(long, default_value_t = 512, value_parser = parse_block_size)]
    block_size: u32,

    /// Cores to run reactors on: a list with ranges ("0", "0-3", "0,2") or a hexadecimal mask ("0x3").
    /// Connections are spread over the reactors round robin; the listener runs on the first.
    #[arg(long, default_value = "0")]
    cores: CoreList,

    /// Serial number reported by Identify Controller (at most 20 characters; default: derived from the NQN).
    #[arg(long)]
    serial: Option<String>,

    /// Model number reported by Identify Controller (at most 40 characters).
    #[arg(long, default_value = "nvpoll")]
    model: String,

    /// Entries per queue (CAP.MQES + 1): the most commands a host may have outstanding on one queue.
    #[arg(long, default_value_t = 128)]
    queue_size: u16,

    /// I/O queues per controller (what Set Features Number of Queues grants; 128 as nvmet and SPDK).
    #[arg(long, default_value_t = 128)]
    io_queues: u16,

    /// A host (by Host NQN) that may connect; may be given several times. Without it any host may, an empty
    /// Host NQN included (as SPDK's allow-any-host). A refused host gets Connect Invalid Parameters (HOSTNQN),
    /// and the refusal is logged with its reason.
    #[arg(long = "allow-host", value_name = "HOSTNQN")]
    allow_hosts: Vec<String>,

    /// Also print accepted connections and every closed one (by default: one line per connected queue, and
    /// closes only when something went wrong).
    #[arg(short, long)]
    verbose: bool,
}

fn parse_block_size(s: &str) -> Result<u32, String> {
    match s {
        "512" => Ok(512),
        "4096" | "4K" | "4k" => Ok(4096),
        _ => Err(format!("block size {s:?}: must be 512 or 4096")),
    }
}

/// Whether a close reason is the ordinary end of a connection.
fn ordinary_close(reason: &str) -> bool {
    matches!(
        reason,
        "closed by the host" | "host sent Disconnect" | "target stopping"
    )
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("target: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> Result<(), String> {
    let mut subsys = SubsystemConfig::new(args.nqn.clone());
    subsys.model = args.model.clone();
    if let Some(serial) = &args.serial {
        subsys.serial = serial.clone();
    }
    let ram = match (args.ram, args.file.is_empty() && args.pcie.is_empty()) {
        (Some(bytes), _) => Some(bytes),
        (None, true) => Some(1 << 30),
        (None, false) => None,
    };
    if let Some(bytes) = ram {
        if bytes % u64::from(args.block_size) != 0 {
            return Err(format!(
                "--ram {bytes} is not a multiple of the {}-byte block size",
                args.block_size
            ));
        }
        subsys = subsys.namespace(Backing::Ram(bytes), args.block_size);
    }
    for path in &args.file {
        subsys = subsys.namespace(Backing::File(path.clone()), args.block_size);
    }
    for bdf in &args.pcie {
        let pool = nvpoll::mem::DmaPool::builder()
            .class(4096, 256)
            .class(1 << 20, 8)
            .build()
            .map_err(|e| format!("DMA pool for {bdf}: {e}"))?;
        let ctrl = nvpoll_pcie::PcieController::open(
            *bdf,
            pool.clone(),
            nvpoll_pcie::PcieOptions::default(),
        )
        .map_err(|e| format!("--pcie {bdf}: {e}"))?;
        let dev = nvpoll_tcp::target::QueuePairDevice::new(ctrl, pool, 1, format!("PCIe {bdf}"))
            .map_err(|e| format!("--pcie {bdf}: {e}"))?;
        let bs = nvpoll_tcp::target::BlockDevice::block_size(&dev);
        subsys = subsys.namespace(Backing::Device(std::sync::Arc::new(dev)), bs);
    }
    for h in &args.allow_hosts {
        subsys = subsys.allow_host(h.clone());
    }
    let verbose = args.verbose;
    let mut config = TargetConfig::new(args.listen)
        .subsystem(subsys)
        .on_event(move |e| match e {
            TargetEvent::Accepted { .. } if !verbose => {}
            TargetEvent::Closed { reason, .. } if !verbose && ordinary_close(reason) => {}
            e => println!("{e}"),
        });
    config.queue_entries = args.queue_size;
    config.send_mode = args.send_mode;
    let mut keys = Vec::new();
    for p in &args.psks {
        let (host, key) = p
            .split_once('=')
            .ok_or_else(|| format!("--psk '{}': expected HOSTNQN=KEY", redact(p)))?;
        let key = nvpoll_tcp::tls::ConfiguredKey::parse(key)
            .map_err(|e| format!("--psk for {host}: {e}"))?;
        keys.push((host.to_string(), key));
    }
    let tls = args.tls.clone().unwrap_or_else(|| {
        if keys.is_empty() {
            "off".into()
        } else {
            "required".into()
        }
    });
    if tls != "off" {
        if keys.is_empty() {
            return Err(format!("--tls {tls} needs at least one --psk HOSTNQN=KEY"));
        }
        let subnqns = [
            args.nqn.clone(),
            nvpoll_tcp::target::DISCOVERY_NQN.to_string(),
        ];
        config.tls = Some(nvpoll_tcp::target::TargetTls::with_host_keys(
            tls == "required",
            &keys,
            &subnqns,
        ));
    }
    config.max_io_queues = args.io_queues;

    let target = Target::bind(config).map_err(|e| e.to_string())?;
    println!(
        "nvpoll target listening on {} (reactors on cores {})",
        target.local_addr(),
        args.cores
    );
    for line in target.describe() {
        println!("{line}");
    }
    let (stop_tx, stop_rx) = mpsc::channel();
    ctrlc::set_handler(move || {
        let _ = stop_tx.send(());
    })
    .map_err(|e| format!("cannot handle Ctrl-C: {e}"))?;
    let reactors = Reactors::start(&args.cores).map_err(|e| e.to_string())?;
    let handle = target.start(&reactors).map_err(|e| e.to_string())?;
    let _ = stop_rx.recv();
    handle.stop();
    let stats = reactors.stop().map_err(|e| e.to_string())?;
    println!("stats: {}", handle.counters());
    for s in stats {
        let polls = (s.busy + s.idle).max(1);
        println!(
            "reactor on core {}: {} polls, {:.1}% busy, {} messages, CPU {:.2} s",
            s.core,
            s.busy + s.idle,
            100.0 * s.busy as f64 / polls as f64,
            s.messages,
            s.cpu_time.as_secs_f64()
        );
    }
    Ok(())
}

/// A --psk argument for an error message, without the key.
fn redact(arg: &str) -> String {
    match arg.split_once('=') {
        Some((host, _)) => format!("{host}=<key>"),
        None => "<not shown>".into(),
    }
}

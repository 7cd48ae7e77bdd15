//! nvpoll's NVMe/TCP target as a program: serves the NVM subsystems of a configuration file, or one given by
//! flags (and the discovery subsystem), until Ctrl-C or SIGTERM, printing one line per connection and a stats
//! line at the end. With --rpc-socket, a control socket changes it while it runs (nvpoll-rpc).
//!
//! ```text
//! cargo run --release --bin nvpoll-target -- --listen 127.0.0.1:4420 --nqn nqn.2024-01.io.nvpoll:demo --ram 1G --cores 0
//! cargo run --release --bin nvpoll-target -- --config target.json --rpc-socket /var/tmp/nvpoll.sock
//! nvme discover -t tcp -a 127.0.0.1 -s 4420
//! nvme connect -t tcp -a 127.0.0.1 -s 4420 -n nqn.2024-01.io.nvpoll:demo
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{mpsc, Arc};

use clap::Parser;
use nvpoll::reactor::{CoreList, IdlePolicy, Reactors};
use nvpoll_target::rpc::{self, ServeOptions};
use nvpoll_target::{
    config, Backing, ListenerConfig, SubsystemConfig, Target, TargetConfig, TargetEvent, TargetTls,
    TlsMode,
};

/// nvpoll NVMe/TCP target: a polled-mode target on nvpoll's reactors.
///
/// Serves the NVM subsystems of a configuration file (--config), or one NVM subsystem given by flags with one
/// or more namespaces (a RAM namespace and/or one per --file or --pcie), plus the discovery subsystem
/// (nqn.2014-08.org.nvmexpress.discovery) for `nvme discover`. Namespace IDs are given in order: the RAM
/// namespace first (if any), then the files, then the PCIe namespaces. With --rpc-socket, subsystems,
/// namespaces, hosts, keys and listeners can be changed while it runs (with nvpoll-rpc). Runs until Ctrl-C
/// or SIGTERM, then prints the target's counters.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// A JSON configuration file: listeners, defaults and subsystems (see docs/target.md). The flags that describe
    /// the subsystem or the first listener (--nqn, --ram, --file, --pcie, --psk, --tls, --listen, ...) must
    /// then not be given.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,

    /// Serve a JSON-RPC control socket at PATH (mode 0600): `rpc -s PATH METHOD ...` adds and removes
    /// subsystems, namespaces, hosts, keys and listeners while the target runs. None unless given.
    #[arg(long, value_name = "PATH")]
    rpc_socket: Option<PathBuf>,

    /// One more listener, as ADDR[,tls=off|optional|required]; may be given several times.
    #[arg(long = "listener", value_name = "ADDR[,tls=MODE]", value_parser = parse_listener)]
    listeners: Vec<ListenerConfig>,

    /// When responses leave: inline (as each is made), deferred (at the reactor's end-of-iteration flush, all
    /// together) or adaptive (inline while the connection has nothing else to answer). Default: deferred, or
    /// the configuration file's send_mode.
    #[arg(long)]
    send_mode: Option<nvpoll::send::SendMode>,

    /// The TCP congestion control of every listener and so of every connection (e.g. cubic; 'system' keeps
    /// the system's everywhere); the target sends the data of reads, so this paces them. Default: the
    /// configuration file's tcp_congestion, else the system's (net.ipv4.tcp_congestion_control) except that a
    /// loopback connection under BBR gets cubic: on loopback (a minimum RTT of about a microsecond) BBR keeps
    /// a window of a few segments, and a connection's speed depends on the round trip it measured first.
    #[arg(long, value_name = "NAME")]
    tcp_congestion: Option<String>,

    /// With TLS: renew each connection's keys after this many records under one key (a KeyUpdate that asks
    /// the host to renew too; 1 to 8388608). Default: 8388608 (2^23), or the configuration file's
    /// tls_key_update; changeable at run time with the RPC tls_key_update_set. A host that ends a connection
    /// at our KeyUpdate is said once, and its connections are closed at the count instead.
    #[arg(long, value_name = "RECORDS", value_parser = nvpoll_tools::cli::parse_key_update)]
    tls_key_update: Option<u64>,

    /// A host's TLS PSK, as HOSTNQN=KEY with KEY in the NVMe interchange format (NVMeTLSkey-1:01:...:). May be
    /// given once per host. The host may present the v0 or v1 identity derived from it.
    #[arg(long = "psk", value_name = "HOSTNQN=KEY", conflicts_with = "config")]
    psks: Vec<String>,

    /// A host's DH-HMAC-CHAP secret, as HOSTNQN=KEY with KEY as nvme-cli's gen-dhchap-key writes it
    /// (DHHC-1:hh:...:): that host must then authenticate every queue in band. May be given once per host.
    #[arg(
        long = "dhchap-key",
        value_name = "HOSTNQN=KEY",
        conflicts_with = "config"
    )]
    dhchap_keys: Vec<String>,

    /// The controller's DH-HMAC-CHAP secret for a host (HOSTNQN=KEY), which the target proves to that host
    /// when it asks (bidirectional authentication); the host needs a --dhchap-key too.
    #[arg(
        long = "dhchap-ctrl-key",
        value_name = "HOSTNQN=KEY",
        conflicts_with = "config"
    )]
    dhchap_ctrl_keys: Vec<String>,

    /// TLS 1.3 on --listen: off, optional (the first bytes decide: a ClientHello starts TLS, a plain ICReq goes
    /// on without), or required. Default: required when a --psk is given, off otherwise.
    #[arg(long, value_parser = ["off", "optional", "required"], conflicts_with = "config")]
    tls: Option<String>,

    /// Address and port to listen on.
    #[arg(long, default_value = "127.0.0.1:4420", conflicts_with = "config")]
    listen: SocketAddr,

    /// NQN of the NVM subsystem.
    #[arg(
        long,
        default_value = "nqn.2024-01.io.nvpoll:target",
        conflicts_with = "config"
    )]
    nqn: String,

    /// Size of a RAM namespace (bytes, or with a K, M, G or T suffix: powers of 1024). Its contents are lost
    /// when the target stops. Default: 1G when no --file or --pcie is given, none otherwise.
    #[arg(long, value_parser = nvpoll::units::parse_size, conflicts_with = "config")]
    ram: Option<u64>,

    /// A namespace backed by an existing regular file or block device, read and written through the page
    /// cache (Flush runs fdatasync). May be given several times.
    #[arg(long, conflicts_with = "config")]
    file: Vec<PathBuf>,

    /// A namespace backed by namespace 1 of a local NVMe controller bound to vfio-pci (see `nvpoll-setup
    /// bind`), driven by nvpoll's PCIe driver: the target exports the SSD over NVMe/TCP. Its block size is the
    /// SSD's. May be given several times.
    #[arg(long, value_name = "BDF", conflicts_with = "config")]
    pcie: Vec<nvpoll::trid::PciAddress>,

    /// Logical block size of every namespace: 512 or 4096.
    #[arg(long, default_value_t = 512, value_parser = parse_block_size, conflicts_with = "config")]
    block_size: u32,

    /// Cores to run reactors on: a list with ranges ("0", "0-3", "0,2") or a hexadecimal mask ("0x3").
    /// Connections are spread over the reactors round robin; the listener runs on the first.
    #[arg(long, default_value = "0")]
    cores: CoreList,

    /// What a reactor does with nothing to do: poll (spin on its core, as SPDK does: the lowest latency, a full
    /// core each even when idle) or hybrid (poll while there is work; after a quiet time of 1 ms with none,
    /// sleep until a connection, a command, a timer or a control-socket change wakes it; hybrid:QUIET sets
    /// the quiet time, e.g. hybrid:200us). The first command after a sleep waits for the wake-up, some
    /// microseconds; the ones after it do not. Default: hybrid, because a target spends most of its life
    /// waiting for hosts.
    #[arg(long, default_value = "hybrid", value_name = "poll|hybrid[:QUIET]")]
    idle: IdlePolicy,

    /// Serial number reported by Identify Controller (at most 20 characters; default: derived from the NQN).
    #[arg(long, conflicts_with = "config")]
    serial: Option<String>,

    /// Model number reported by Identify Controller (at most 40 characters).
    #[arg(long, default_value = "nvpoll", conflicts_with = "config")]
    model: String,

    /// Entries per queue (CAP.MQES + 1): the most commands a host may have outstanding on one queue.
    #[arg(long, default_value_t = 128, conflicts_with = "config")]
    queue_size: u16,

    /// I/O queues per controller (what Set Features Number of Queues grants; 128 as nvmet and SPDK).
    #[arg(long, default_value_t = 128, conflicts_with = "config")]
    io_queues: u16,

    /// A host (by Host NQN) that may connect; may be given several times. Without it any host may, an empty
    /// Host NQN included (as SPDK's allow-any-host). A refused host gets Connect Invalid Parameters (HOSTNQN),
    /// and the refusal is logged with its reason.
    #[arg(long = "allow-host", value_name = "HOSTNQN", conflicts_with = "config")]
    allow_hosts: Vec<String>,

    /// Also print accepted connections and every closed one (by default: one line per connected queue, and
    /// closes only when something went wrong); -vv also the libraries' debug log lines, -vvv their trace
    /// (RUST_LOG, in env_logger's syntax, overrides the libraries' level).
    #[arg(short = 'v', long = "verbose", action = clap::ArgAction::Count)]
    verbose: u8,
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
    ) || reason.starts_with("closed to renew the TLS keys")
}

fn main() -> ExitCode {
    let args = Args::parse();
    nvpoll_tools::logging::init(if args.verbose < 2 { 0 } else { args.verbose });
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nvpoll-target: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `ADDR[,tls=off|optional|required]`.
fn parse_listener(s: &str) -> Result<ListenerConfig, String> {
    let mut parts = s.split(',');
    let addr = parts.next().unwrap_or_default();
    let address = addr
        .parse()
        .map_err(|_| format!("{addr:?} is not an IP address and port such as 127.0.0.1:4421"))?;
    let mut tls = TlsMode::Off;
    for option in parts {
        match option.split_once('=') {
            Some(("tls", mode)) => tls = mode.parse().map_err(|e| format!("{e}"))?,
            _ => {
                return Err(format!(
                    "{option:?}: the only option is tls=off|optional|required"
                ))
            }
        }
    }
    Ok(ListenerConfig { address, tls })
}

/// Opens namespace 1 of the NVMe controller at `bdf` (bound to vfio-pci) with nvpoll's PCIe driver: what
/// --pcie and the configuration file's and the control socket's `pcie` namespaces give.
fn open_pcie(bdf: &str) -> Result<Backing, nvpoll_target::Error> {
    let failed = |e: Box<dyn std::error::Error + Send + Sync>| nvpoll_target::Error::pcie(bdf, e);
    let addr: nvpoll::trid::PciAddress = bdf
        .parse()
        .map_err(|e| failed(format!("not a PCI address: {e}").into()))?;
    let pool = nvpoll::mem::DmaPool::builder()
        .class(4096, 256)
        .class(1 << 20, 8)
        .build()
        .map_err(|e| failed(format!("DMA pool: {e}").into()))?;
    let ctrl =
        nvpoll_pcie::PcieController::open(addr, pool.clone(), nvpoll_pcie::PcieOptions::default())
            .map_err(|e| failed(e.into()))?;
    let dev = nvpoll_target::QueuePairDevice::new(ctrl, pool, 1, format!("PCIe {addr}"))
        .map_err(|e| failed(e.into()))?;
    Ok(Backing::Device(Arc::new(dev)))
}

/// The target the subsystem flags describe (when no --config is given).
fn from_flags(args: &Args) -> Result<TargetConfig, String> {
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
        let backing = open_pcie(&bdf.to_string()).map_err(|e| format!("--pcie {e}"))?;
        let bs = match &backing {
            Backing::Device(d) => d.block_size(),
            _ => args.block_size,
        };
        subsys = subsys.namespace(backing, bs);
    }
    for h in &args.allow_hosts {
        subsys = subsys.allow_host(h.clone());
    }
    for p in &args.psks {
        let (host, key) = p
            .split_once('=')
            .ok_or_else(|| format!("--psk '{}': expected HOSTNQN=KEY", redact(p)))?;
        let key = nvpoll_tcp::tls::ConfiguredKey::parse(key)
            .map_err(|e| format!("--psk for {host}: {e}"))?;
        subsys = subsys.host_key(host, key);
    }
    for p in &args.dhchap_keys {
        let (host, key) = p
            .split_once('=')
            .ok_or_else(|| format!("--dhchap-key '{}': expected HOSTNQN=KEY", redact(p)))?;
        let key = nvpoll_tcp::dhchap::Secret::parse(key)
            .map_err(|e| format!("--dhchap-key for {host}: {e}"))?;
        let ctrl_key = args
            .dhchap_ctrl_keys
            .iter()
            .filter_map(|c| c.split_once('='))
            .find(|(h, _)| *h == host)
            .map(|(_, k)| {
                nvpoll_tcp::dhchap::Secret::parse(k)
                    .map_err(|e| format!("--dhchap-ctrl-key for {host}: {e}"))
            })
            .transpose()?;
        subsys.dhchap_keys.push(nvpoll_target::DhchapKey {
            hostnqn: host.to_string(),
            key,
            ctrl_key,
            concat: false,
        });
    }
    for c in &args.dhchap_ctrl_keys {
        let host = c
            .split_once('=')
            .ok_or_else(|| format!("--dhchap-ctrl-key '{}': expected HOSTNQN=KEY", redact(c)))?
            .0;
        if !subsys.dhchap_keys.iter().any(|k| k.hostnqn == host) {
            return Err(format!(
                "--dhchap-ctrl-key for {host}: that host has no --dhchap-key"
            ));
        }
    }
    let tls = args.tls.clone().unwrap_or_else(|| {
        if args.psks.is_empty() {
            "off".into()
        } else {
            "required".into()
        }
    });
    let mut config = TargetConfig::new(args.listen).subsystem(subsys);
    if tls != "off" {
        if args.psks.is_empty() && args.rpc_socket.is_none() {
            return Err(format!("--tls {tls} needs at least one --psk HOSTNQN=KEY"));
        }
        // The keys are the subsystem's (and so valid for discovery too); this sets the listener's mode.
        config.tls = Some(TargetTls {
            required: tls == "required",
            keys: Vec::new(),
            subnqns: Vec::new(),
        });
    }
    config.queue_entries = args.queue_size;
    config.max_io_queues = args.io_queues;
    Ok(config)
}

/// Connections one process can hold before its descriptor limit says the target's last word.
const FEW_DESCRIPTORS: u64 = 4096;

fn run(args: Args) -> Result<(), String> {
    // Each connection holds a descriptor: take the hard limit, and say so when even that is low.
    match nvpoll_target::raise_descriptor_limit() {
        Ok(Some(n)) if n < FEW_DESCRIPTORS => eprintln!(
            "nvpoll-target: at most {n} open descriptors (RLIMIT_NOFILE's hard limit), so fewer connections than \
             that; raise it for more (ulimit -Hn as root, systemd's LimitNOFILE=)"
        ),
        Ok(_) => {}
        Err(e) => eprintln!("nvpoll-target: could not raise the descriptor limit: {e}"),
    }
    let mut config = match &args.config {
        Some(path) => config::load(path, &open_pcie).map_err(|e| e.to_string())?,
        None => from_flags(&args)?,
    };
    for l in &args.listeners {
        config = config.listener(l.address, l.tls);
    }
    if let Some(mode) = args.send_mode {
        config.send_mode = mode;
    }
    if let Some(cc) = &args.tcp_congestion {
        config.tcp_congestion = Some(cc.clone());
    }
    if let Some(n) = args.tls_key_update {
        config.tls_key_renewal = nvpoll_tcp::KeyRenewal::after(n);
    }
    if config.tcp_congestion.is_none() {
        congestion_notice();
    }
    let verbose = args.verbose > 0;
    let config = config.on_event(move |e| match e {
        TargetEvent::Accepted { .. } if !verbose => {}
        TargetEvent::Closed { reason, .. } if !verbose && ordinary_close(reason) => {}
        e => println!("{e}"),
    });

    let target = Target::bind(config).map_err(|e| e.to_string())?;
    println!(
        "nvpoll target listening on {} (reactors on cores {}, idle {})",
        target.local_addr(),
        args.cores,
        args.idle
    );
    for line in target.describe() {
        println!("{line}");
    }
    let (stop_tx, stop_rx) = mpsc::channel();
    ctrlc::set_handler(move || {
        let _ = stop_tx.send(());
    })
    .map_err(|e| format!("cannot handle Ctrl-C: {e}"))?;
    let reactors = Reactors::builder()
        .idle(args.idle)
        .start(&args.cores)
        .map_err(|e| e.to_string())?;
    let handle = target.start(&reactors).map_err(|e| e.to_string())?;
    let server = match &args.rpc_socket {
        Some(path) => {
            let options = ServeOptions {
                pcie: Arc::new(open_pcie),
                on_change: Some(Arc::new(|line: &str| println!("rpc: {line}"))),
            };
            let server = rpc::serve(path, handle.clone(), options);
            let server = match server {
                Ok(s) => s,
                Err(e) => {
                    handle.stop();
                    let _ = reactors.stop();
                    return Err(format!("--rpc-socket {}: {e}", path.display()));
                }
            };
            println!("control socket: {}", path.display());
            Some(server)
        }
        None => None,
    };
    let _ = stop_rx.recv();
    if let Some(s) = server {
        s.stop();
    }
    handle.stop();
    let stats = reactors.stop().map_err(|e| e.to_string())?;
    println!("stats: {}", handle.counters());
    for s in stats {
        let polls = (s.busy + s.idle).max(1);
        println!(
            "reactor on core {}: {} polls, {:.1}% busy, {} messages, CPU {:.2} s, {} sleeps ({:.2} s asleep)",
            s.core,
            s.busy + s.idle,
            100.0 * s.busy as f64 / polls as f64,
            s.messages,
            s.cpu_time.as_secs_f64(),
            s.sleeps,
            s.slept.as_secs_f64()
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

/// Says, once at start, when the system's TCP congestion control is BBR: loopback connections get cubic, and
/// on other paths of microseconds (one rack) BBR's window holds a few segments (see docs/performance.md, Large
/// I/O).
fn congestion_notice() {
    if nvpoll_tools::machine::system_congestion().as_deref() == Some("bbr") {
        println!(
            "nvpoll-target: the system's TCP congestion control is bbr: loopback connections use cubic instead \
             (under bbr their speed depends on the round trip they measured first); other connections keep bbr, \
             which on microsecond paths keeps a window of a few segments; --tcp-congestion NAME (or \
             tcp_congestion in the configuration) chooses one for every connection, 'system' keeps bbr everywhere"
        );
    }
}

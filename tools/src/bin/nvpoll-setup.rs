//! `nvpoll-setup`: get NVMe controllers and hugepages ready for nvpoll's PCIe driver.
//!
//! - `status`: every NVMe controller with its PCI address, driver, IOMMU group, model and whether any of its
//!   namespaces is mounted or in use; the IOMMU, vfio-pci and hugepages.
//! - `bind BDF|all`: hand controllers to vfio-pci (driver_override), refusing one that is in use unless
//!   `--force`.
//! - `unbind BDF`: give a controller back to the kernel's nvme driver.
//! - `hugepages N [--node K] [--size 2M|1G]`: reserve hugepages and report what the kernel gave.
//! - `kernel-psk --hostnqn H --subnqn S [--key-file F]`: put the TLS PSK an `NVMeTLSkey-1` key derives for
//!   (H, S) into the kernel's `.nvme` keyring, where Linux's nvme-tcp host (with tlshd) looks it up, and print
//!   its serial for the connect's `tls_key=` (nvme-cli before 2.5 cannot do this).
//!
//! It says what it changes, step by step. Changing anything needs root.

use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use nvpoll::mem::hugepage_status;
use nvpoll::trid::PciAddress;
use nvpoll_pcie::sysfs::{NvmeDevice, Sysfs, Use};

/// Prepare NVMe controllers and hugepages for nvpoll's userspace PCIe driver, and TLS keys for the kernel's
/// NVMe/TCP host.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
    /// More log lines from the libraries: -v info, -vv debug, -vvv trace (RUST_LOG, in env_logger's
    /// syntax, overrides this).
    #[arg(short = 'v', long = "verbose", action = clap::ArgAction::Count, global = true)]
    verbose: u8,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// List NVMe controllers (address, driver, IOMMU group, model, in use or not), the IOMMU, vfio-pci and
    /// hugepages.
    Status,
    /// Bind a controller (or every NVMe controller not in use: `all`) to vfio-pci for nvpoll.
    Bind {
        /// PCI address (0000:01:00.0) or `all`.
        target: String,
        /// Bind even if a namespace is mounted or in use (its users will lose the device).
        #[arg(long)]
        force: bool,
    },
    /// Give a controller back to the kernel's nvme driver.
    Unbind {
        /// PCI address.
        bdf: PciAddress,
        /// Unbind even if a process has its VFIO group open.
        #[arg(long)]
        force: bool,
    },
    /// Reserve N hugepages (system-wide, or on one NUMA node) and report how many the kernel gave.
    Hugepages {
        /// How many pages the pool should hold.
        count: u64,
        /// Reserve on this NUMA node only.
        #[arg(long)]
        node: Option<u32>,
        /// Page size: 2M or 1G.
        #[arg(long, default_value = "2M")]
        size: String,
    },
    /// Put the TLS PSK that an NVMe interchange key (NVMeTLSkey-1:01:...:) derives for HOSTNQN and SUBNQN
    /// into the kernel's .nvme keyring, under its v0 identity (NVMe0R01 HOSTNQN SUBNQN), as Linux's nvme-tcp
    /// host and tlshd look it up; prints the key's serial, for `tls_key=SERIAL` in the connect string
    /// written to /dev/nvme-fabrics. The key is read from --key-file or standard input, never from the
    /// command line; the derived PSK goes to keyctl (keyutils) on its standard input.
    KernelPsk {
        /// The host's NQN.
        #[arg(long)]
        hostnqn: String,
        /// The subsystem's NQN.
        #[arg(long)]
        subnqn: String,
        /// A file holding the interchange key; standard input if absent or `-`.
        #[arg(long)]
        key_file: Option<std::path::PathBuf>,
    },
}

fn main() -> ExitCode {
    let args = Args::parse();
    nvpoll_tools::logging::init(args.verbose);
    let sys = Sysfs::new();
    let r = match args.cmd {
        Cmd::Status => status(&sys),
        Cmd::Bind { target, force } => bind(&sys, &target, force),
        Cmd::Unbind { bdf, force } => unbind(&sys, bdf, force),
        Cmd::Hugepages { count, node, size } => hugepages(count, node, &size),
        Cmd::KernelPsk {
            hostnqn,
            subnqn,
            key_file,
        } => kernel_psk(&hostnqn, &subnqn, key_file.as_deref()),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("nvpoll-setup: {msg}");
            ExitCode::FAILURE
        }
    }
}

/// The effective user ID, from /proc (no libc call needed).
fn euid() -> Option<u32> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(2)?.parse().ok()
}

fn need_root(what: &str) -> Result<(), String> {
    match euid() {
        Some(0) => Ok(()),
        _ => Err(format!(
            "{what} changes kernel settings and needs root: run it with sudo"
        )),
    }
}

const IOMMU_OFF: &str = "the IOMMU is off, so no device has an IOMMU group and vfio-pci cannot give a device to a \
    process safely. Turn it on: enable VT-d (Intel) or AMD-Vi (AMD) in the firmware setup, and add \
    intel_iommu=on (Intel) or amd_iommu=on (AMD) to the kernel command line (iommu=pt as well keeps the \
    kernel's own devices fast), e.g. in GRUB_CMDLINE_LINUX of /etc/default/grub, then update-grub and reboot";

fn describe_use(uses: &[Use]) -> String {
    uses.iter()
        .map(Use::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// Processes that hold `/dev/vfio/GROUP` open.
fn vfio_users(group: u32) -> Vec<String> {
    let node = format!("/dev/vfio/{group}");
    let me = std::process::id().to_string();
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in rd.flatten() {
        let pid = e.file_name().to_string_lossy().into_owned();
        if pid == me || !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(e.path().join("fd")) else {
            continue;
        };
        if fds
            .flatten()
            .any(|f| std::fs::read_link(f.path()).is_ok_and(|t| t == Path::new(&node)))
        {
            let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
            out.push(format!("process {pid} ({})", comm.trim()));
        }
    }
    out
}

fn state_of(sys: &Sysfs, d: &NvmeDevice) -> String {
    match d.driver.as_deref() {
        Some("vfio-pci") => {
            let Some(g) = d.iommu_group else {
                return "bound to vfio-pci without an IOMMU group".into();
            };
            let blockers = sys.group_blockers(g);
            let users = vfio_users(g);
            if !blockers.is_empty() {
                format!("group {g} not viable: {}", blockers.join(", "))
            } else if !users.is_empty() {
                format!("in use by {}", users.join(", "))
            } else {
                "ready for nvpoll".into()
            }
        }
        Some("nvme") => {
            let uses = sys.uses(d);
            if uses.is_empty() {
                "free (kernel driver; `bind` hands it to nvpoll)".into()
            } else {
                format!("in use: {}", describe_use(&uses))
            }
        }
        Some(other) => format!("bound to {other}"),
        None => "no driver".into(),
    }
}

fn status(sys: &Sysfs) -> Result<(), String> {
    let devs = sys.nvme_devices().map_err(|e| e.to_string())?;
    if devs.is_empty() {
        println!("No NVMe controllers (PCI class 01:08:02) found.");
    } else {
        println!("NVMe controllers:");
        println!(
            "  {:<13} {:<9} {:<6} {:<10} {:<34} state",
            "address", "driver", "group", "ids", "model / namespaces"
        );
        for d in &devs {
            let model = match (&d.model, d.driver.as_deref()) {
                (Some(m), _) => {
                    if d.namespaces.is_empty() {
                        m.clone()
                    } else {
                        format!("{m}: {}", d.namespaces.join(" "))
                    }
                }
                (None, Some("vfio-pci")) => "(held by vfio-pci)".into(),
                (None, _) => "-".into(),
            };
            println!(
                "  {:<13} {:<9} {:<6} {:<10} {:<34} {}",
                d.bdf.to_string(),
                d.driver.as_deref().unwrap_or("-"),
                d.iommu_group.map_or("-".to_string(), |g| g.to_string()),
                format!("{:04x}:{:04x}", d.ids.0, d.ids.1),
                model,
                state_of(sys, d)
            );
        }
    }
    println!();
    if sys.iommu_enabled() {
        println!("IOMMU: on");
    } else {
        println!("IOMMU: off: {IOMMU_OFF}");
    }
    let vfio_loaded = Path::new("/sys/bus/pci/drivers/vfio-pci").is_dir();
    println!(
        "vfio-pci: {}",
        if vfio_loaded {
            "loaded"
        } else {
            "not loaded (`bind` loads it with modprobe vfio-pci)"
        }
    );
    for (size, name) in [(2usize << 20, "2 MiB"), (1 << 30, "1 GiB")] {
        match hugepage_status(size) {
            Ok(s) => println!(
                "hugepages {name}: {} reserved, {} free for new mappings",
                s.total,
                s.available()
            ),
            Err(_) => println!("hugepages {name}: not supported by this kernel or CPU"),
        }
    }
    Ok(())
}

fn bind(sys: &Sysfs, target: &str, force: bool) -> Result<(), String> {
    need_root("bind")?;
    let targets: Vec<PciAddress> = if target == "all" {
        let devs = sys.nvme_devices().map_err(|e| e.to_string())?;
        let mut todo = Vec::new();
        for d in devs
            .iter()
            .filter(|d| d.driver.as_deref() != Some("vfio-pci"))
        {
            let uses = sys.uses(d);
            if !uses.is_empty() && !force {
                println!("Skipping {}: in use ({}).", d.bdf, describe_use(&uses));
                continue;
            }
            todo.push(d.bdf);
        }
        if todo.is_empty() {
            println!(
                "No NVMe controller left to bind (all are bound to vfio-pci, in use, or absent)."
            );
            return Ok(());
        }
        todo
    } else {
        vec![target.parse().map_err(|e| format!("{e}"))?]
    };
    let mut failed = Vec::new();
    for bdf in targets {
        if let Err(e) = bind_one(sys, bdf, force) {
            eprintln!("nvpoll-setup: {bdf}: {e}");
            failed.push(bdf.to_string());
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!("not bound: {}", failed.join(", ")))
    }
}

fn bind_one(sys: &Sysfs, bdf: PciAddress, force: bool) -> Result<(), String> {
    if !sys.exists(bdf) {
        return Err(format!("no PCI device {bdf} (see `nvpoll-setup status`)"));
    }
    let class = sys.class(bdf).map_err(|e| e.to_string())?;
    if class != nvpoll_pcie::sysfs::NVME_CLASS {
        return Err(format!(
            "{bdf} is not an NVMe controller (PCI class {class:06x}); nvpoll-setup only binds NVMe controllers"
        ));
    }
    let group = match sys.iommu_group(bdf).map_err(|e| e.to_string())? {
        Some(g) => g,
        None => return Err(format!("{bdf} has no IOMMU group: {IOMMU_OFF}")),
    };
    let dev = sys.nvme_device(bdf);
    if dev.driver.as_deref() == Some("vfio-pci") {
        println!("{bdf} is already bound to vfio-pci (IOMMU group {group}, /dev/vfio/{group}).");
        return Ok(());
    }
    let uses = sys.uses(&dev);
    if !uses.is_empty() {
        if !force {
            return Err(format!(
                "refusing to take {bdf} from the kernel: {}. Unmount it / stop its users first, or pass \
                 --force to take it anyway (whatever uses it will fail)",
                describe_use(&uses)
            ));
        }
        println!(
            "warning: {bdf} is in use ({}); taking it anyway (--force)",
            describe_use(&uses)
        );
    }
    let what = match (&dev.model, dev.namespaces.is_empty()) {
        (Some(m), false) => format!("{m} with {}", dev.namespaces.join(", ")),
        (Some(m), true) => m.clone(),
        (None, _) => "controller".into(),
    };
    println!("Binding {bdf} ({what}) to vfio-pci:");
    let steps = sys
        .rebind(bdf, "vfio-pci", Duration::from_secs(10))
        .map_err(|e| e.to_string())?;
    for s in steps {
        println!("  - {s}");
    }
    let node = format!("/dev/vfio/{group}");
    if Path::new(&node).exists() {
        println!("  - its VFIO group is {node}");
    } else {
        println!("  - warning: {node} does not exist yet");
    }
    let blockers = sys.group_blockers(group);
    if !blockers.is_empty() {
        println!(
            "warning: IOMMU group {group} also holds {}: bind those to vfio-pci too (or unbind them), or nvpoll \
             cannot open the group",
            blockers.join(", ")
        );
    }
    println!("{bdf} is ready: trid 'trtype:pcie traddr:{bdf}'. `nvpoll-setup unbind {bdf}` gives it back.");
    Ok(())
}

fn unbind(sys: &Sysfs, bdf: PciAddress, force: bool) -> Result<(), String> {
    need_root("unbind")?;
    if !sys.exists(bdf) {
        return Err(format!("no PCI device {bdf}"));
    }
    let current = sys.driver(bdf);
    if current.as_deref() == Some("nvme") {
        println!("{bdf} is already bound to nvme.");
        return Ok(());
    }
    if let (Some("vfio-pci"), Some(g)) = (current.as_deref(), sys.iommu_group(bdf).ok().flatten()) {
        let users = vfio_users(g);
        if !users.is_empty() {
            if !force {
                return Err(format!(
                    "refusing to unbind {bdf}: /dev/vfio/{g} is open in {}. Stop it first, or pass --force",
                    users.join(", ")
                ));
            }
            println!(
                "warning: /dev/vfio/{g} is open in {}; unbinding anyway (--force)",
                users.join(", ")
            );
        }
    }
    println!("Giving {bdf} back to the kernel's nvme driver:");
    let steps = sys
        .rebind(bdf, "nvme", Duration::from_secs(10))
        .map_err(|e| e.to_string())?;
    for s in steps {
        println!("  - {s}");
    }
    // The namespaces show up once the kernel has reset and scanned the controller.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let d = sys.nvme_device(bdf);
        if !d.namespaces.is_empty() {
            println!(
                "  - its namespaces are back: {}",
                d.namespaces
                    .iter()
                    .map(|n| format!("/dev/{n}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            );
            break;
        }
        if Instant::now() >= deadline {
            println!("  - no namespace block device yet (see `dmesg` and `nvme list`)");
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

fn hugepages(count: u64, node: Option<u32>, size: &str) -> Result<(), String> {
    let (kb, bytes) = match size.to_ascii_uppercase().as_str() {
        "2M" | "2MB" | "2MIB" | "2048K" => (2048u64, 2usize << 20),
        "1G" | "1GB" | "1GIB" | "1048576K" => (1_048_576, 1 << 30),
        other => return Err(format!("--size {other}: use 2M or 1G")),
    };
    need_root("hugepages")?;
    let dir = match node {
        Some(n) => format!("/sys/devices/system/node/node{n}/hugepages/hugepages-{kb}kB"),
        None => format!("/sys/kernel/mm/hugepages/hugepages-{kb}kB"),
    };
    if !Path::new(&dir).is_dir() {
        return Err(match node {
            Some(n) if !Path::new(&format!("/sys/devices/system/node/node{n}")).is_dir() => {
                format!("there is no NUMA node {n} (see /sys/devices/system/node/)")
            }
            _ => format!(
                "this kernel or CPU has no {size} hugepages ({dir} is missing); 1 GiB pages need the pdpe1gb \
                 CPU flag. See docs/hugepages.md"
            ),
        });
    }
    let nr = format!("{dir}/nr_hugepages");
    let read = |p: &str| -> Result<u64, String> {
        std::fs::read_to_string(p)
            .map_err(|e| format!("{p}: {e}"))?
            .trim()
            .parse()
            .map_err(|e| format!("{p}: {e}"))
    };
    let before = read(&nr)?;
    println!(
        "Reserving {count} hugepages of {size}{}: writing {count} to {nr} (was {before})",
        node.map_or(String::new(), |n| format!(" on node {n}"))
    );
    std::fs::write(&nr, format!("{count}\n")).map_err(|e| format!("writing {nr}: {e}"))?;
    let got = read(&nr)?;
    let free = read(&format!("{dir}/free_hugepages")).unwrap_or(0);
    println!(
        "The kernel holds {got} pages of {size} ({} MiB); {free} are free.",
        (got * bytes as u64) >> 20
    );
    if got < count {
        println!(
            "It could not find {} more: memory is too fragmented (or too small) for that many contiguous pages \
             now. Free some memory and retry, run `echo 1 > /proc/sys/vm/compact_memory` first, or reserve them \
             at boot with the kernel parameter {}. See docs/hugepages.md (\"When the kernel cannot find them\").",
            count - got,
            if kb == 2048 {
                format!("hugepages={count}")
            } else {
                format!("default_hugepagesz=1G hugepagesz=1G hugepages={count}")
            }
        );
        return Err(format!("asked for {count} hugepages of {size}, got {got}"));
    }
    if let Ok(s) = hugepage_status(bytes) {
        println!(
            "System-wide: {} reserved, {} available for new mappings.",
            s.total,
            s.available()
        );
    }
    Ok(())
}

/// `kernel-psk`: derives the TLS PSK for (hostnqn, subnqn) and hands it to `keyctl padd` into `.nvme`.
fn kernel_psk(hostnqn: &str, subnqn: &str, key_file: Option<&Path>) -> Result<(), String> {
    use std::io::Read;

    use nvpoll_tcp::tls::ConfiguredKey;

    let text = match key_file {
        Some(p) if p != Path::new("-") => std::fs::read_to_string(p)
            .map_err(|e| format!("cannot read the key file {}: {e}", p.display()))?,
        _ => {
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .map_err(|e| format!("cannot read the key from standard input: {e}"))?;
            s
        }
    };
    let key = ConfiguredKey::parse(text.trim()).map_err(|e| {
        format!("the key is not an NVMe TLS interchange key (NVMeTLSkey-1:01:...:): {e}")
    })?;
    let added =
        nvpoll_tcp::keyring::add_kernel_psk(&key, hostnqn, subnqn).map_err(|e| e.to_string())?;
    eprintln!(
        "nvpoll-setup: the TLS PSK for '{}' is in the .nvme keyring",
        added.identity
    );
    println!("{}", added.serial);
    Ok(())
}

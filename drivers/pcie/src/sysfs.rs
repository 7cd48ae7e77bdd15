//! What sysfs and procfs say about PCI devices, IOMMU groups, drivers and the block devices of NVMe
//! controllers; and the driver_override dance that binds a device to vfio-pci or back to nvme.
//!
//! Everything takes its root directories from a [`Sysfs`] value, so the logic is tested against a fake tree.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nvpoll::trid::PciAddress;

use crate::error::Error;

/// PCI class code (class, subclass, programming interface) of an NVMe controller.
pub const NVME_CLASS: u32 = 0x01_08_02;

/// Where sysfs, procfs and /dev are (the real ones by default).
#[derive(Clone, Debug)]
pub struct Sysfs {
    sys: PathBuf,
    proc: PathBuf,
    dev: PathBuf,
}

impl Default for Sysfs {
    fn default() -> Self {
        Sysfs {
            sys: "/sys".into(),
            proc: "/proc".into(),
            dev: "/dev".into(),
        }
    }
}

/// Why a block device counts as in use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Use {
    /// It (or a partition of it) is mounted.
    Mounted {
        /// The block device.
        dev: String,
        /// Where.
        at: String,
    },
    /// It is an active swap area.
    Swap(String),
    /// Another block device sits on it (device-mapper, md, ...).
    Holder {
        /// The block device.
        dev: String,
        /// The holder.
        holder: String,
    },
    /// A process has it open.
    Open {
        /// The device node.
        dev: String,
        /// The process ID.
        pid: u32,
        /// The process name.
        comm: String,
    },
}

impl std::fmt::Display for Use {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Use::Mounted { dev, at } => write!(f, "{dev} is mounted on {at}"),
            Use::Swap(dev) => write!(f, "{dev} is an active swap area"),
            Use::Holder { dev, holder } => write!(f, "{dev} is held by {holder}"),
            Use::Open { dev, pid, comm } => write!(f, "{dev} is open in process {pid} ({comm})"),
        }
    }
}

/// One NVMe PCI function as `status` reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvmeDevice {
    /// Its address.
    pub bdf: PciAddress,
    /// The driver bound to it, if any.
    pub driver: Option<String>,
    /// Its IOMMU group, if the IOMMU is on.
    pub iommu_group: Option<u32>,
    /// PCI vendor and device IDs.
    pub ids: (u16, u16),
    /// The model string (known while the kernel's nvme driver runs it).
    pub model: Option<String>,
    /// The kernel's controller names (nvme0, ...), while the nvme driver runs it.
    pub controllers: Vec<String>,
    /// The block devices of its namespaces (nvme0n1, ...).
    pub namespaces: Vec<String>,
}

fn read_trim(path: &Path) -> Result<String, Error> {
    fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .map_err(|e| Error::sysfs(path.display().to_string(), e))
}

fn parse_hex(s: &str) -> Option<u32> {
    u32::from_str_radix(s.trim().trim_start_matches("0x"), 16).ok()
}

fn sorted_names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

impl Sysfs {
    /// The real /sys, /proc and /dev.
    pub fn new() -> Sysfs {
        Sysfs::default()
    }

    /// A tree rooted elsewhere (for tests): `root/sys`, `root/proc` and `root/dev`.
    pub fn at(root: impl AsRef<Path>) -> Sysfs {
        let root = root.as_ref();
        Sysfs {
            sys: root.join("sys"),
            proc: root.join("proc"),
            dev: root.join("dev"),
        }
    }

    /// The sysfs directory of a PCI device.
    pub fn device_dir(&self, bdf: PciAddress) -> PathBuf {
        self.sys.join("bus/pci/devices").join(bdf.to_string())
    }

    /// Whether the PCI device exists.
    pub fn exists(&self, bdf: PciAddress) -> bool {
        self.device_dir(bdf).is_dir()
    }

    /// The device's IOMMU group; `None` when it has none (the IOMMU is off or absent).
    pub fn iommu_group(&self, bdf: PciAddress) -> Result<Option<u32>, Error> {
        let dir = self.device_dir(bdf);
        if !dir.is_dir() {
            return Err(Error::sysfs(
                dir.display().to_string(),
                std::io::Error::new(std::io::ErrorKind::NotFound, "no such PCI device"),
            ));
        }
        let link = dir.join("iommu_group");
        match fs::read_link(&link) {
            Ok(target) => Ok(target
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.parse().ok())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::sysfs(link.display().to_string(), e)),
        }
    }

    /// Whether any IOMMU group exists (the IOMMU is on).
    pub fn iommu_enabled(&self) -> bool {
        !sorted_names(&self.sys.join("kernel/iommu_groups")).is_empty()
    }

    /// The devices of an IOMMU group, by sysfs name.
    pub fn group_devices(&self, group: u32) -> Vec<String> {
        sorted_names(
            &self
                .sys
                .join("kernel/iommu_groups")
                .join(group.to_string())
                .join("devices"),
        )
    }

    /// The devices of `group` that keep it from being viable for VFIO: bound to a driver other than
    /// vfio-pci (bridges bound to pcieport are fine, as the kernel allows them).
    pub fn group_blockers(&self, group: u32) -> Vec<String> {
        self.group_devices(group)
            .into_iter()
            .filter_map(|name| {
                let drv = self.driver_of_name(&name)?;
                (drv != "vfio-pci" && drv != "pcieport" && drv != "pci-stub")
                    .then(|| format!("{name} (driver {drv})"))
            })
            .collect()
    }

    fn driver_of_name(&self, name: &str) -> Option<String> {
        let link = self.sys.join("bus/pci/devices").join(name).join("driver");
        fs::read_link(link)
            .ok()?
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
    }

    /// The driver bound to the device, if any.
    pub fn driver(&self, bdf: PciAddress) -> Option<String> {
        self.driver_of_name(&bdf.to_string())
    }

    /// The device's class code (24 bits).
    pub fn class(&self, bdf: PciAddress) -> Result<u32, Error> {
        let p = self.device_dir(bdf).join("class");
        let s = read_trim(&p)?;
        parse_hex(&s).ok_or_else(|| Error::Unsupported(format!("{} holds {s:?}", p.display())))
    }

    fn ids(&self, bdf: PciAddress) -> (u16, u16) {
        let id = |f: &str| {
            read_trim(&self.device_dir(bdf).join(f))
                .ok()
                .and_then(|s| parse_hex(&s))
                .unwrap_or(0) as u16
        };
        (id("vendor"), id("device"))
    }

    /// Every NVMe controller (PCI class 01:08:02) in the system, sorted by address.
    pub fn nvme_devices(&self) -> Result<Vec<NvmeDevice>, Error> {
        let dir = self.sys.join("bus/pci/devices");
        let rd = fs::read_dir(&dir).map_err(|e| Error::sysfs(dir.display().to_string(), e))?;
        let mut out = Vec::new();
        for e in rd.flatten() {
            let Ok(bdf) = e.file_name().to_string_lossy().parse::<PciAddress>() else {
                continue;
            };
            if self.class(bdf).ok() != Some(NVME_CLASS) {
                continue;
            }
            out.push(self.nvme_device(bdf));
        }
        out.sort_by_key(|d| d.bdf);
        Ok(out)
    }

    /// What sysfs says about one NVMe controller.
    pub fn nvme_device(&self, bdf: PciAddress) -> NvmeDevice {
        let controllers = sorted_names(&self.device_dir(bdf).join("nvme"));
        let model = controllers
            .first()
            .and_then(|c| read_trim(&self.device_dir(bdf).join("nvme").join(c).join("model")).ok());
        let namespaces = self.namespaces(bdf, &controllers);
        NvmeDevice {
            bdf,
            driver: self.driver(bdf),
            iommu_group: self.iommu_group(bdf).ok().flatten(),
            ids: self.ids(bdf),
            model,
            controllers,
            namespaces,
        }
    }

    /// The block devices of the namespaces of the kernel controllers `controllers` of `bdf`. With native
    /// multipath the controller holds path devices `nvmeXcYnZ` and the block device is `nvmeXnZ`.
    fn namespaces(&self, bdf: PciAddress, controllers: &[String]) -> Vec<String> {
        let mut out = Vec::new();
        for c in controllers {
            for name in sorted_names(&self.device_dir(bdf).join("nvme").join(c)) {
                if !name.starts_with("nvme") || !name.contains('n') {
                    continue;
                }
                let Some(block) = block_name(&name) else {
                    continue;
                };
                if !out.contains(&block) {
                    out.push(block);
                }
            }
        }
        out
    }

    /// Why the block devices of `bdf` (with their partitions) are in use, if they are: mounted, swap, held by
    /// another block device, or open in a process. Also looks for open handles on the controller's character
    /// devices (`/dev/nvme0`, `/dev/ng0n1`).
    pub fn uses(&self, dev: &NvmeDevice) -> Vec<Use> {
        let mut blocks = Vec::new();
        for ns in &dev.namespaces {
            blocks.push(ns.clone());
            for p in sorted_names(&self.sys.join("class/block").join(ns)) {
                if p.starts_with(ns.as_str()) && p.len() > ns.len() {
                    blocks.push(p);
                }
            }
        }
        let mut uses = Vec::new();
        let numbers: Vec<(String, String)> = blocks
            .iter()
            .filter_map(|b| {
                read_trim(&self.sys.join("class/block").join(b).join("dev"))
                    .ok()
                    .map(|n| (b.clone(), n))
            })
            .collect();
        if let Ok(mi) = fs::read_to_string(self.proc.join("self/mountinfo")) {
            for line in mi.lines() {
                let f: Vec<&str> = line.split(' ').collect();
                if f.len() < 5 {
                    continue;
                }
                let source = line
                    .split(" - ")
                    .nth(1)
                    .and_then(|rest| rest.split(' ').nth(1))
                    .unwrap_or("");
                for (b, num) in &numbers {
                    if f[2] == num || source == format!("/dev/{b}") {
                        uses.push(Use::Mounted {
                            dev: b.clone(),
                            at: f[4].to_string(),
                        });
                    }
                }
            }
        }
        if let Ok(sw) = fs::read_to_string(self.proc.join("swaps")) {
            for line in sw.lines().skip(1) {
                let name = line.split_whitespace().next().unwrap_or("");
                if let Some(b) = blocks.iter().find(|b| name == format!("/dev/{b}")) {
                    uses.push(Use::Swap(b.clone()));
                }
            }
        }
        for b in &blocks {
            for h in sorted_names(&self.sys.join("class/block").join(b).join("holders")) {
                uses.push(Use::Holder {
                    dev: b.clone(),
                    holder: h,
                });
            }
        }
        let mut nodes: Vec<PathBuf> = blocks.iter().map(|b| self.dev.join(b)).collect();
        for c in &dev.controllers {
            nodes.push(self.dev.join(c));
            if let Some(num) = c.strip_prefix("nvme") {
                for ns in &dev.namespaces {
                    if let Some(nsid) = ns.rsplit('n').next() {
                        nodes.push(self.dev.join(format!("ng{num}n{nsid}")));
                    }
                }
            }
        }
        uses.extend(self.open_handles(&nodes));
        uses
    }

    /// Processes (other than this one) with one of `nodes` open.
    fn open_handles(&self, nodes: &[PathBuf]) -> Vec<Use> {
        let me = std::process::id().to_string();
        let mut out = Vec::new();
        for pid in sorted_names(&self.proc) {
            if pid == me || !pid.bytes().all(|b| b.is_ascii_digit()) {
                continue;
            }
            let fd_dir = self.proc.join(&pid).join("fd");
            let Ok(rd) = fs::read_dir(&fd_dir) else {
                continue;
            };
            for e in rd.flatten() {
                let Ok(target) = fs::read_link(e.path()) else {
                    continue;
                };
                if let Some(node) = nodes.iter().find(|n| **n == target) {
                    let comm = read_trim(&self.proc.join(&pid).join("comm")).unwrap_or_default();
                    let u = Use::Open {
                        dev: node.display().to_string(),
                        pid: pid.parse().unwrap_or(0),
                        comm,
                    };
                    if !out.contains(&u) {
                        out.push(u);
                    }
                }
            }
        }
        out
    }

    fn write(&self, path: &Path, value: &str) -> Result<(), Error> {
        fs::write(path, value).map_err(|e| Error::sysfs(path.display().to_string(), e))
    }

    /// Binds `bdf` to `driver` ("vfio-pci" or "nvme"): sets driver_override, unbinds the current driver,
    /// asks the PCI core to probe it again, and waits up to `wait` for the new driver to show up. Returns the
    /// steps it took, in words. The caller checks first that the device is not in use.
    pub fn rebind(
        &self,
        bdf: PciAddress,
        driver: &str,
        wait: Duration,
    ) -> Result<Vec<String>, Error> {
        let dir = self.device_dir(bdf);
        let mut steps = Vec::new();
        let current = self.driver(bdf);
        if current.as_deref() == Some(driver) {
            steps.push(format!("{bdf} is already bound to {driver}"));
            return Ok(steps);
        }
        // vfio-pci must be loaded for the probe to find it.
        if !self.sys.join("bus/pci/drivers").join(driver).is_dir() {
            let module = driver.replace('-', "_");
            let st = std::process::Command::new("modprobe").arg(&module).status();
            steps.push(format!(
                "loaded the {module} module (modprobe {module}: {st:?})"
            ));
        }
        let override_value = if driver == "vfio-pci" { driver } else { "" };
        self.write(&dir.join("driver_override"), &format!("{override_value}\n"))?;
        steps.push(if override_value.is_empty() {
            format!("cleared {}/driver_override", dir.display())
        } else {
            format!(
                "wrote {override_value} to {}/driver_override",
                dir.display()
            )
        });
        if let Some(cur) = current {
            self.write(&dir.join("driver/unbind"), &bdf.to_string())?;
            steps.push(format!("unbound {bdf} from {cur}"));
        }
        let probe = self.sys.join("bus/pci/drivers_probe");
        self.write(&probe, &bdf.to_string())?;
        steps.push(format!(
            "asked the PCI core to probe {bdf} ({})",
            probe.display()
        ));
        let deadline = Instant::now() + wait;
        loop {
            if self.driver(bdf).as_deref() == Some(driver) {
                break;
            }
            if Instant::now() >= deadline {
                // A direct bind is the fallback (e.g. an old kernel without driver_override for this driver).
                let bind = self.sys.join("bus/pci/drivers").join(driver).join("bind");
                if self.driver(bdf).is_none() && self.write(&bind, &bdf.to_string()).is_ok() {
                    steps.push(format!("bound {bdf} through {}", bind.display()));
                }
                if self.driver(bdf).as_deref() == Some(driver) {
                    break;
                }
                return Err(Error::Unsupported(format!(
                    "{bdf} did not bind to {driver} (it is bound to {}); see `dmesg`",
                    self.driver(bdf).unwrap_or_else(|| "nothing".into())
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        steps.push(format!("{bdf} is now bound to {driver}"));
        Ok(steps)
    }
}

/// The block device of a namespace entry under a controller's sysfs directory: `nvme0n1` stays, a multipath
/// path device `nvme0c1n1` becomes `nvme0n1`; anything else is `None`.
pub fn block_name(entry: &str) -> Option<String> {
    let rest = entry.strip_prefix("nvme")?;
    let (ctrl, after) = rest.split_at(rest.find(|c: char| !c.is_ascii_digit())?);
    if ctrl.is_empty() {
        return None;
    }
    let after = match after.strip_prefix('c') {
        Some(a) => {
            let i = a.find(|c: char| !c.is_ascii_digit())?;
            &a[i..]
        }
        None => after,
    };
    let nsid = after.strip_prefix('n')?;
    (!nsid.is_empty() && nsid.bytes().all(|b| b.is_ascii_digit()))
        .then(|| format!("nvme{ctrl}n{nsid}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn block_names() {
        assert_eq!(block_name("nvme0n1").as_deref(), Some("nvme0n1"));
        assert_eq!(block_name("nvme3c12n7").as_deref(), Some("nvme3n7"));
        assert_eq!(block_name("nvme0"), None);
        assert_eq!(block_name("nvme0n1p1"), None);
        assert_eq!(block_name("power"), None);
        assert_eq!(block_name("nvmen1"), None);
    }

    /// A fake tree: two NVMe functions, one on nvme with a mounted namespace, one on vfio-pci, sharing
    /// nothing, plus a network card in the vfio one's group.
    fn fake_tree() -> (tempdir::Dir, Sysfs) {
        let t = tempdir::Dir::new();
        let sys = t.path().join("sys");
        let mk = |p: &Path| fs::create_dir_all(p).unwrap();
        let put = |p: &Path, s: &str| {
            mk(p.parent().unwrap());
            fs::write(p, s).unwrap()
        };
        for d in ["nvme", "vfio-pci", "e1000e"] {
            mk(&sys.join("bus/pci/drivers").join(d));
        }
        let devs = sys.join("bus/pci/devices");
        for (bdf, class, drv, group) in [
            ("0000:00:04.0", "0x010802", "vfio-pci", 4),
            ("0000:00:05.0", "0x010802", "nvme", 5),
            ("0000:00:06.0", "0x020000", "e1000e", 4),
        ] {
            let d = devs.join(bdf);
            put(&d.join("class"), &format!("{class}\n"));
            put(&d.join("vendor"), "0x1b36\n");
            put(&d.join("device"), "0x0010\n");
            symlink(sys.join("bus/pci/drivers").join(drv), d.join("driver")).unwrap();
            let g = sys.join("kernel/iommu_groups").join(group.to_string());
            mk(&g.join("devices"));
            symlink(&d, g.join("devices").join(bdf)).unwrap();
            symlink(&g, d.join("iommu_group")).unwrap();
        }
        let c = devs.join("0000:00:05.0/nvme/nvme0");
        put(&c.join("model"), "QEMU NVMe Ctrl   \n");
        mk(&c.join("nvme0c0n1"));
        put(&sys.join("class/block/nvme0n1/dev"), "259:0\n");
        put(&sys.join("class/block/nvme0n1/nvme0n1p1/partition"), "1\n");
        put(&sys.join("class/block/nvme0n1p1/dev"), "259:1\n");
        mk(&sys.join("class/block/nvme0n1/holders"));
        put(
            &t.path().join("proc/self/mountinfo"),
            "22 1 0:21 / / rw - 9p root rw\n\
             40 22 259:1 / /mnt rw,relatime - ext4 /dev/nvme0n1p1 rw\n",
        );
        put(
            &t.path().join("proc/swaps"),
            "Filename Type Size Used Priority\n",
        );
        let s = Sysfs::at(t.path());
        (t, s)
    }

    #[test]
    fn lists_nvme_devices_groups_and_uses() {
        let (_t, s) = fake_tree();
        let devs = s.nvme_devices().unwrap();
        assert_eq!(devs.len(), 2);
        let v = &devs[0];
        assert_eq!(v.bdf.to_string(), "0000:00:04.0");
        assert_eq!(v.driver.as_deref(), Some("vfio-pci"));
        assert_eq!(v.iommu_group, Some(4));
        assert_eq!(v.model, None);
        assert!(v.namespaces.is_empty());
        let k = &devs[1];
        assert_eq!(k.driver.as_deref(), Some("nvme"));
        assert_eq!(k.model.as_deref(), Some("QEMU NVMe Ctrl"));
        assert_eq!(k.controllers, vec!["nvme0".to_string()]);
        assert_eq!(k.namespaces, vec!["nvme0n1".to_string()]);
        assert_eq!(k.ids, (0x1b36, 0x0010));
        assert!(s.iommu_enabled());
        assert_eq!(
            s.group_blockers(4),
            vec!["0000:00:06.0 (driver e1000e)".to_string()]
        );
        assert!(
            s.group_blockers(5).len() == 1,
            "nvme itself blocks its group"
        );
        let uses = s.uses(k);
        assert_eq!(
            uses,
            vec![Use::Mounted {
                dev: "nvme0n1p1".into(),
                at: "/mnt".into()
            }]
        );
        assert_eq!(uses[0].to_string(), "nvme0n1p1 is mounted on /mnt");
        assert!(s.uses(v).is_empty());
    }

    /// A self-deleting temporary directory (std has none).
    mod tempdir {
        use std::path::{Path, PathBuf};
        use std::sync::atomic::{AtomicU32, Ordering};

        pub(super) struct Dir(PathBuf);

        impl Dir {
            pub(super) fn new() -> Dir {
                static N: AtomicU32 = AtomicU32::new(0);
                let p = std::env::temp_dir().join(format!(
                    "nvpoll-pcie-sysfs-{}-{}",
                    std::process::id(),
                    N.fetch_add(1, Ordering::Relaxed)
                ));
                std::fs::create_dir_all(&p).unwrap();
                Dir(p)
            }

            pub(super) fn path(&self) -> &Path {
                &self.0
            }
        }

        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }
}

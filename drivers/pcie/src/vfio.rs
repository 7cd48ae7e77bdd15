//! The legacy VFIO container/group API: everything the driver asks of the kernel to own a PCI function.
//!
//! [`VfioDevice::open`] does the whole sequence for one NVMe controller:
//! 1. finds the device's IOMMU group in sysfs and opens `/dev/vfio/vfio` (the container) and `/dev/vfio/N`;
//! 2. checks the API version, that the type-1 v2 IOMMU is there, and that the group is viable (all its
//!    devices bound to vfio-pci), naming the devices that block it if not;
//! 3. attaches the group to the container and selects `VFIO_TYPE1v2_IOMMU`, then reads the IOMMU's page sizes
//!    and allowed IOVA ranges (`VFIO_IOMMU_GET_INFO` with the IOVA-range capability);
//! 4. gets the device fd, checks it is an NVMe controller, maps BAR0, and turns on memory space and bus
//!    mastering in the PCI command register (vfio-pci leaves bus mastering off).
//!
//! DMA memory is mapped with [`VfioDevice::map_pool`]: IOVA = virtual address, as SPDK and libvfn do, unless
//! the IOMMU's ranges exclude that address; then an IOVA is picked from an allowed range.
//!
//! Together with `mmio.rs` this module holds all the `unsafe` code of the crate: the ioctls and the BAR mmap.
#![allow(unsafe_code)]

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use nvpoll::mem::DmaPool;
use nvpoll::trid::PciAddress;
use vfio_bindings::bindings::vfio as sys;

use crate::device::Device;
use crate::error::{Error, Irq};
use crate::mmio::Bar;
use crate::sysfs::{Sysfs, NVME_CLASS};

/// `_IO(VFIO_TYPE, VFIO_BASE + n)`: every VFIO ioctl is encoded without size or direction.
const fn vfio_io(n: u32) -> libc::c_ulong {
    ((sys::VFIO_TYPE as libc::c_ulong) << 8) | (sys::VFIO_BASE + n) as libc::c_ulong
}

const VFIO_GET_API_VERSION: libc::c_ulong = vfio_io(0);
const VFIO_CHECK_EXTENSION: libc::c_ulong = vfio_io(1);
const VFIO_SET_IOMMU: libc::c_ulong = vfio_io(2);
const VFIO_GROUP_GET_STATUS: libc::c_ulong = vfio_io(3);
const VFIO_GROUP_SET_CONTAINER: libc::c_ulong = vfio_io(4);
const VFIO_GROUP_GET_DEVICE_FD: libc::c_ulong = vfio_io(6);
const VFIO_DEVICE_GET_INFO: libc::c_ulong = vfio_io(7);
const VFIO_DEVICE_GET_REGION_INFO: libc::c_ulong = vfio_io(8);
const VFIO_DEVICE_GET_IRQ_INFO: libc::c_ulong = vfio_io(9);
const VFIO_DEVICE_SET_IRQS: libc::c_ulong = vfio_io(10);
const VFIO_IOMMU_GET_INFO: libc::c_ulong = vfio_io(12);
const VFIO_IOMMU_MAP_DMA: libc::c_ulong = vfio_io(13);
const VFIO_IOMMU_UNMAP_DMA: libc::c_ulong = vfio_io(14);

/// PCI configuration space: the command register and its bits.
const PCI_COMMAND: u64 = 0x04;
const PCI_COMMAND_MEMORY: u16 = 1 << 1;
const PCI_COMMAND_MASTER: u16 = 1 << 2;
/// PCI configuration space: revision ID and class code (dword at 0x08, class in bits 31:8).
const PCI_CLASS_REVISION: u64 = 0x08;

/// Runs an ioctl whose argument is a pointer to `arg`, returning its non-negative result.
///
/// # Safety
/// `request` must be an ioctl that reads and writes at most `size_of::<T>()` bytes at its argument (or the
/// `argsz` the argument itself declares, which must not exceed the allocation `arg` points into).
unsafe fn ioctl_ptr<T>(fd: &File, request: libc::c_ulong, arg: *mut T) -> io::Result<i32> {
    // SAFETY: the caller guarantees `arg` matches what `request` accesses; `fd` is an open file.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), request as _, arg) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// Runs an ioctl whose argument is a plain integer, returning its non-negative result.
fn ioctl_val(fd: &File, request: libc::c_ulong, arg: libc::c_ulong) -> io::Result<i32> {
    // SAFETY: only called with VFIO ioctls that take an integer argument (API version, extension check,
    // IOMMU type), which read no memory of ours.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), request as _, arg) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// What the type-1 IOMMU supports: page sizes and the IOVA ranges DMA may use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IommuInfo {
    /// Bit mask of supported IOMMU page sizes (e.g. 4K|2M|1G).
    pub page_sizes: u64,
    /// Allowed IOVA ranges, inclusive `(start, end)`; empty when the kernel does not report them (then every
    /// IOVA is allowed).
    pub ranges: Vec<(u64, u64)>,
}

impl IommuInfo {
    /// The smallest IOMMU page size.
    pub fn min_page_size(&self) -> u64 {
        if self.page_sizes == 0 {
            4096
        } else {
            1 << self.page_sizes.trailing_zeros()
        }
    }

    /// Whether `iova..iova + len` lies within one allowed range.
    pub fn allows(&self, iova: u64, len: u64) -> bool {
        let Some(last) = len.checked_sub(1).and_then(|l| iova.checked_add(l)) else {
            return false;
        };
        self.ranges.is_empty() || self.ranges.iter().any(|&(s, e)| iova >= s && last <= e)
    }

    /// Picks the IOVA for `len` bytes at virtual address `vaddr`: the address itself when allowed (IOVA =
    /// VA), else the lowest address aligned to `align` in an allowed range that overlaps none of `taken`
    /// (`(iova, len)` pairs).
    pub fn choose(
        &self,
        vaddr: u64,
        len: u64,
        align: u64,
        taken: &[(u64, u64)],
    ) -> Result<u64, Error> {
        let pg = self.min_page_size();
        if vaddr % pg != 0 || len % pg != 0 || len == 0 {
            return Err(Error::IovaUnaligned {
                vaddr,
                len,
                page: pg,
            });
        }
        let overlaps = |iova: u64| taken.iter().any(|&(t, tl)| iova < t + tl && t < iova + len);
        if self.allows(vaddr, len) && !overlaps(vaddr) {
            return Ok(vaddr);
        }
        let align = align.max(pg);
        for &(start, end) in &self.ranges {
            let mut iova = start.next_multiple_of(align).max(align);
            while iova.checked_add(len - 1).is_some_and(|last| last <= end) {
                match taken
                    .iter()
                    .find(|&&(t, tl)| iova < t + tl && t < iova + len)
                {
                    None => return Ok(iova),
                    Some(&(t, tl)) => iova = (t + tl).next_multiple_of(align),
                }
            }
        }
        Err(Error::NoIova {
            len,
            ranges: self.ranges.clone(),
        })
    }
}

/// Parses the capability chain of a `VFIO_IOMMU_GET_INFO` answer (`buf` is the whole answer).
fn parse_iommu_info(buf: &[u8]) -> IommuInfo {
    let u32_at = |o: usize| {
        buf.get(o..o + 4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
    };
    let u64_at = |o: usize| {
        buf.get(o..o + 8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
    };
    let flags = u32_at(4).unwrap_or(0);
    let page_sizes = if flags & sys::VFIO_IOMMU_INFO_PGSIZES != 0 {
        u64_at(8).unwrap_or(0)
    } else {
        0
    };
    let mut ranges = Vec::new();
    let mut off = if flags & sys::VFIO_IOMMU_INFO_CAPS != 0 {
        u32_at(16).unwrap_or(0) as usize
    } else {
        0
    };
    // Each capability: id (u16), version (u16), next (u32, offset from the start of the buffer; 0 ends).
    let mut hops = 0;
    while off != 0 && hops < 64 {
        hops += 1;
        let Some(head) = u32_at(off) else { break };
        let id = head & 0xffff;
        if id == sys::VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE {
            let n = u32_at(off + 8).unwrap_or(0) as usize;
            for i in 0..n.min(1024) {
                let o = off + 16 + 16 * i;
                if let (Some(s), Some(e)) = (u64_at(o), u64_at(o + 8)) {
                    ranges.push((s, e));
                }
            }
        }
        off = u32_at(off + 4).unwrap_or(0) as usize;
    }
    IommuInfo { page_sizes, ranges }
}

/// One DMA mapping made in the container.
#[derive(Debug)]
struct Mapping {
    vaddr: usize,
    iova: u64,
    len: u64,
    /// How many `map_pool` calls share it.
    refs: u32,
    /// Keeps the memory alive while the IOMMU maps it.
    _pool: DmaPool,
}

/// The open files of a device, until it is released.
#[derive(Debug)]
struct Files {
    // Field order is drop order: the device fd closes before the group, the group before the container.
    device: File,
    _group: File,
    container: File,
}

/// What [`VfioDevice`] changes after opening, under one lock: DMA mappings, and the files (gone once the
/// device is released).
#[derive(Debug)]
struct Inner {
    mappings: Vec<Mapping>,
    files: Option<Files>,
}

/// A PCI function owned through VFIO: container, group, device fd, BAR0 and DMA mappings.
///
/// The kernel asks for the device back (hot removal, unplug) through the VFIO device request interrupt,
/// which [`VfioDevice::release_requested`] polls; [`VfioDevice::release`] then gives it back while the
/// driver may still be running: BAR0 is cut off atomically (it reads as all ones from then on), bus
/// mastering is turned off, every DMA mapping is undone and the fds are closed.
///
/// Dropping it unmaps every DMA mapping still there, unmaps BAR0 and closes the fds (which detaches the group
/// from the container).
#[derive(Debug)]
pub struct VfioDevice {
    bdf: PciAddress,
    group: u32,
    iommu: IommuInfo,
    // Dropped (unmapped) before the files close.
    bar: Bar,
    config_offset: u64,
    inner: Mutex<Inner>,
    /// The eventfd the kernel signals to ask for the device back (None: this kernel has no request IRQ).
    request: Option<File>,
    /// A request was seen (it is signalled once; this keeps it).
    requested: AtomicBool,
    released: AtomicBool,
}

fn region_info(device: &File, index: u32) -> Result<sys::vfio_region_info, Error> {
    let mut info = sys::vfio_region_info {
        argsz: std::mem::size_of::<sys::vfio_region_info>() as u32,
        index,
        ..Default::default()
    };
    // SAFETY: VFIO_DEVICE_GET_REGION_INFO reads and writes at most `argsz` bytes of the struct, which is
    // exactly its size.
    unsafe { ioctl_ptr(device, VFIO_DEVICE_GET_REGION_INFO, &mut info) }
        .map_err(|source| Error::RegionInfo { index, source })?;
    Ok(info)
}

impl VfioDevice {
    /// Opens `bdf` (bound to vfio-pci) as described in the module documentation, looking it up in the real
    /// sysfs.
    pub fn open(bdf: PciAddress) -> Result<VfioDevice, Error> {
        VfioDevice::open_in(&Sysfs::new(), bdf)
    }

    /// As [`VfioDevice::open`], with sysfs looked up through `sysfs`.
    pub fn open_in(sysfs: &Sysfs, bdf: PciAddress) -> Result<VfioDevice, Error> {
        let group = match sysfs.iommu_group(bdf)? {
            Some(g) => g,
            None => {
                return Err(Error::Unsupported(format!(
                    "{bdf} has no IOMMU group: the IOMMU is off. Turn it on with intel_iommu=on (Intel) or \
                     amd_iommu=on (AMD) on the kernel command line, and check that VT-d/AMD-Vi is enabled \
                     in the firmware"
                )))
            }
        };
        match sysfs.driver(bdf) {
            Some(d) if d == "vfio-pci" => {}
            other => {
                return Err(Error::Unsupported(format!(
                    "{bdf} is bound to {}, not vfio-pci: run `nvpoll-setup bind {bdf}` first",
                    other.unwrap_or_else(|| "no driver".into())
                )))
            }
        }
        let open = |path: &str| {
            OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(path)
        };
        let cpath = "/dev/vfio/vfio";
        let container = open(cpath).map_err(|source| Error::OpenContainer {
            path: cpath.into(),
            source,
        })?;
        let version = ioctl_val(&container, VFIO_GET_API_VERSION, 0).map_err(Error::ApiVersion)?;
        if version != sys::VFIO_API_VERSION as i32 {
            return Err(Error::ApiMismatch {
                kernel: version,
                driver: sys::VFIO_API_VERSION as i32,
            });
        }
        let ext = ioctl_val(
            &container,
            VFIO_CHECK_EXTENSION,
            sys::VFIO_TYPE1v2_IOMMU as libc::c_ulong,
        )
        .map_err(Error::CheckExtension)?;
        if ext <= 0 {
            return Err(Error::NoType1v2);
        }

        let gpath = format!("/dev/vfio/{group}");
        let group_file = open(&gpath).map_err(|source| Error::OpenGroup {
            path: gpath.clone(),
            source,
        })?;
        let mut status = sys::vfio_group_status {
            argsz: std::mem::size_of::<sys::vfio_group_status>() as u32,
            flags: 0,
        };
        // SAFETY: VFIO_GROUP_GET_STATUS writes a `vfio_group_status`, exactly `argsz` bytes.
        unsafe { ioctl_ptr(&group_file, VFIO_GROUP_GET_STATUS, &mut status) }
            .map_err(Error::GroupStatus)?;
        if status.flags & sys::VFIO_GROUP_FLAGS_VIABLE == 0 {
            return Err(Error::GroupNotViable {
                group,
                others: sysfs.group_blockers(group),
            });
        }
        let mut cfd: i32 = container.as_raw_fd();
        // SAFETY: VFIO_GROUP_SET_CONTAINER reads one int (the container fd) at its argument.
        unsafe { ioctl_ptr(&group_file, VFIO_GROUP_SET_CONTAINER, &mut cfd) }
            .map_err(Error::SetContainer)?;
        ioctl_val(
            &container,
            VFIO_SET_IOMMU,
            sys::VFIO_TYPE1v2_IOMMU as libc::c_ulong,
        )
        .map_err(Error::SetIommu)?;
        let iommu = iommu_info(&container)?;

        let name = CString::new(bdf.to_string()).expect("a PCI address has no NUL");
        // SAFETY: VFIO_GROUP_GET_DEVICE_FD reads a NUL-terminated string at its argument.
        let dfd = unsafe {
            ioctl_ptr(
                &group_file,
                VFIO_GROUP_GET_DEVICE_FD,
                name.as_ptr().cast_mut(),
            )
        }
        .map_err(|source| Error::DeviceFd {
            bdf: bdf.to_string(),
            source,
        })?;
        // SAFETY: the ioctl returned a new fd that nothing else owns.
        let device = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(dfd) };

        let mut dinfo = sys::vfio_device_info {
            argsz: std::mem::size_of::<sys::vfio_device_info>() as u32,
            ..Default::default()
        };
        // SAFETY: VFIO_DEVICE_GET_INFO writes at most `argsz` bytes of a `vfio_device_info`.
        unsafe { ioctl_ptr(&device, VFIO_DEVICE_GET_INFO, &mut dinfo) }
            .map_err(Error::DeviceInfo)?;
        if dinfo.flags & sys::VFIO_DEVICE_FLAGS_PCI == 0
            || dinfo.num_regions <= sys::VFIO_PCI_CONFIG_REGION_INDEX
        {
            return Err(Error::Unsupported(format!(
                "{bdf} is not a PCI device to VFIO"
            )));
        }
        let config = region_info(&device, sys::VFIO_PCI_CONFIG_REGION_INDEX)?;
        let config_offset = config.offset;
        let read_config = |offset: u64, buf: &mut [u8]| {
            device
                .read_exact_at(buf, config_offset + offset)
                .map_err(|source| Error::Config { offset, source })
        };
        let mut class = [0u8; 4];
        read_config(PCI_CLASS_REVISION, &mut class)?;
        let class = u32::from_le_bytes(class) >> 8;
        if class != NVME_CLASS {
            return Err(Error::Unsupported(format!(
                "{bdf} has PCI class {class:06x}, not an NVMe controller ({NVME_CLASS:06x})"
            )));
        }

        let bar0 = region_info(&device, sys::VFIO_PCI_BAR0_REGION_INDEX)?;
        if bar0.flags & sys::VFIO_REGION_INFO_FLAG_MMAP == 0 || bar0.size < 0x2000 {
            return Err(Error::BarNotMappable {
                bdf,
                flags: bar0.flags,
                size: bar0.size,
            });
        }
        let len = bar0.size as usize;
        // SAFETY: a fresh shared mapping of the device fd at the offset VFIO gave for BAR0; the kernel picks
        // the address, so nothing else lives there.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                device.as_raw_fd(),
                bar0.offset as libc::off_t,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(Error::MapBar(io::Error::last_os_error()));
        }
        let base = NonNull::new(base.cast::<u8>())
            .ok_or_else(|| Error::MapBar(io::Error::other("null mapping")))?;
        // SAFETY: `base..base + len` is the live shared mapping just made, owned by nothing else.
        let bar = unsafe { Bar::from_mmap(base, len) };

        let request = register_request(&device, bdf);
        let dev = VfioDevice {
            bdf,
            group,
            iommu,
            bar,
            config_offset,
            inner: Mutex::new(Inner {
                mappings: Vec::new(),
                files: Some(Files {
                    device,
                    _group: group_file,
                    container,
                }),
            }),
            request,
            requested: AtomicBool::new(false),
            released: AtomicBool::new(false),
        };
        dev.set_command_bits(PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER, 0)?;
        Ok(dev)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets `set` and clears `clear` in the PCI command register.
    fn set_command_bits(&self, set: u16, clear: u16) -> Result<(), Error> {
        let inner = self.lock();
        let files = inner.files.as_ref().ok_or(Error::Removed)?;
        let cmd = read_command(&files.device, self.config_offset)?;
        let value = (cmd | set) & !clear;
        files
            .device
            .write_all_at(&value.to_le_bytes(), self.config_offset + PCI_COMMAND)
            .map_err(|source| Error::Config {
                offset: PCI_COMMAND,
                source,
            })
    }

    /// Reads the PCI command register.
    pub fn pci_command(&self) -> Result<u16, Error> {
        let inner = self.lock();
        let files = inner.files.as_ref().ok_or(Error::Removed)?;
        read_command(&files.device, self.config_offset)
    }

    /// Whether the function still answers configuration reads with its vendor ID (the kernel serves them, and
    /// waits out a function-level reset in progress). False once released.
    pub fn is_present(&self) -> bool {
        if self.released.load(Ordering::Acquire) {
            return false;
        }
        let inner = self.lock();
        let Some(files) = inner.files.as_ref() else {
            return false;
        };
        let mut id = [0u8; 2];
        match files.device.read_exact_at(&mut id, self.config_offset) {
            Ok(()) => u16::from_le_bytes(id) != 0xffff,
            Err(_) => false,
        }
    }

    /// Whether the kernel has asked for the device back (the VFIO device request: `remove` in sysfs, a hot
    /// unplug). Never blocks; stays true once seen. Always false on a kernel without the request interrupt.
    pub fn release_requested(&self) -> bool {
        if self.requested.load(Ordering::Acquire) {
            return true;
        }
        let Some(efd) = &self.request else {
            return false;
        };
        let mut count = [0u8; 8];
        match (&*efd).read(&mut count) {
            Ok(8) => {
                self.requested.store(true, Ordering::Release);
                true
            }
            _ => false,
        }
    }

    /// Whether [`VfioDevice::release`] has run.
    pub fn is_released(&self) -> bool {
        self.released.load(Ordering::Acquire)
    }

    /// Gives the device back to the kernel, safely while other threads still access its registers: turns bus
    /// mastering off, cuts BAR0 off (see `Bar::detach`: it reads as all ones from now on), undoes every DMA
    /// mapping and closes the device, group and container fds. Later [`VfioDevice::map_pool`] calls fail with
    /// [`Error::Removed`]; [`VfioDevice::unmap_pool`] has nothing left to do.
    pub fn release(&self) {
        if self.released.load(Ordering::Acquire) {
            return;
        }
        // Best effort: the device may already be gone.
        let _ = self.set_command_bits(0, PCI_COMMAND_MASTER);
        let mut inner = self.lock();
        let Some(files) = inner.files.take() else {
            return;
        };
        if let Err(e) = self.bar.detach() {
            // The device mapping stays (and keeps the device open in the kernel) rather than risk an access
            // to unmapped memory.
            log::warn!(
                "{}: cannot cut BAR0 off ({e}); the kernel may wait for this process to \
                 exit before it can remove the device",
                self.bdf
            );
        }
        for m in std::mem::take(&mut inner.mappings) {
            if let Err(e) = unmap(&files.container, m.iova, m.len) {
                log::warn!("releasing {}: {e}", self.bdf);
            }
        }
        self.released.store(true, Ordering::Release);
        drop(inner);
        drop(files);
    }

    /// The device's PCI address.
    pub fn bdf(&self) -> PciAddress {
        self.bdf
    }

    /// The IOMMU group.
    pub fn group(&self) -> u32 {
        self.group
    }

    /// What the IOMMU supports.
    pub fn iommu(&self) -> &IommuInfo {
        &self.iommu
    }

    /// BAR0.
    pub fn bar(&self) -> &Bar {
        &self.bar
    }

    /// Maps every region of `pool` for DMA (read and write) and sets the pool's IOVAs. Mapping a pool that
    /// is already mapped only counts a reference. Fails with [`Error::Removed`] once the device is released.
    pub fn map_pool(&self, pool: &DmaPool) -> Result<(), Error> {
        let mut guard = self.lock();
        let Inner { mappings, files } = &mut *guard;
        let (maps, container) = match files {
            Some(f) => (mappings, &f.container),
            None => return Err(Error::Removed),
        };
        // The pool's callback speaks nvpoll::Error; keep ours to return it unchanged.
        let mut failure: Option<Error> = None;
        let mut fail = |e: Error| {
            let msg = e.to_string();
            failure = Some(e);
            nvpoll::Error::Memory(msg)
        };
        let r = pool.map_iova(|region| {
            if let Some(m) = maps.iter_mut().find(|m| m.vaddr == region.vaddr) {
                m.refs += 1;
                return Ok(m.iova);
            }
            let taken: Vec<(u64, u64)> = maps.iter().map(|m| (m.iova, m.len)).collect();
            let len = region.len as u64;
            let iova = self
                .iommu
                .choose(
                    region.vaddr as u64,
                    len,
                    nvpoll::mem::HUGEPAGE_SIZE as u64,
                    &taken,
                )
                .map_err(&mut fail)?;
            let mut map = sys::vfio_iommu_type1_dma_map {
                argsz: std::mem::size_of::<sys::vfio_iommu_type1_dma_map>() as u32,
                flags: sys::VFIO_DMA_MAP_FLAG_READ | sys::VFIO_DMA_MAP_FLAG_WRITE,
                vaddr: region.vaddr as u64,
                iova,
                size: len,
            };
            // SAFETY: VFIO_IOMMU_MAP_DMA reads a `vfio_iommu_type1_dma_map` of `argsz` bytes. The memory it
            // pins belongs to `pool`, which the mapping record keeps alive until it is unmapped.
            unsafe { ioctl_ptr(container, VFIO_IOMMU_MAP_DMA, &mut map) }
                .map_err(|source| Error::MapDma { iova, len, source })
                .map_err(&mut fail)?;
            maps.push(Mapping {
                vaddr: region.vaddr,
                iova,
                len,
                refs: 1,
                _pool: pool.clone(),
            });
            Ok(iova)
        });
        match (r, failure) {
            (Ok(()), _) => Ok(()),
            (Err(_), Some(e)) => Err(e),
            (Err(e), None) => Err(Error::Memory(e)),
        }
    }

    /// Drops one reference to the mappings of `pool`'s regions, unmapping those that reach zero.
    pub fn unmap_pool(&self, pool: &DmaPool) -> Result<(), Error> {
        let mut guard = self.lock();
        let Inner { mappings, files } = &mut *guard;
        let Some(files) = files else {
            return Ok(()); // released: nothing is mapped any more
        };
        let maps = mappings;
        let mut result = Ok(());
        for region in pool.regions() {
            let Some(i) = maps.iter().position(|m| m.vaddr == region.vaddr) else {
                continue;
            };
            maps[i].refs -= 1;
            if maps[i].refs == 0 {
                let m = maps.swap_remove(i);
                if let Err(e) = unmap(&files.container, m.iova, m.len) {
                    result = Err(e);
                }
            }
        }
        result
    }

    /// The IOVA ranges mapped now, `(iova, len)`.
    pub fn mapped(&self) -> Vec<(u64, u64)> {
        self.lock()
            .mappings
            .iter()
            .map(|m| (m.iova, m.len))
            .collect()
    }
}

fn unmap(container: &File, iova: u64, len: u64) -> Result<(), Error> {
    let mut unmap = sys::vfio_iommu_type1_dma_unmap {
        argsz: std::mem::size_of::<sys::vfio_iommu_type1_dma_unmap>() as u32,
        flags: 0,
        iova,
        size: len,
        data: Default::default(),
    };
    // SAFETY: VFIO_IOMMU_UNMAP_DMA reads and writes a `vfio_iommu_type1_dma_unmap` of `argsz` bytes (no
    // dirty bitmap is asked for, so nothing past the fixed fields).
    unsafe { ioctl_ptr(container, VFIO_IOMMU_UNMAP_DMA, &mut unmap) }
        .map_err(|source| Error::UnmapDma { iova, len, source })?;
    Ok(())
}

fn read_command(device: &File, config_offset: u64) -> Result<u16, Error> {
    let mut cmd = [0u8; 2];
    device
        .read_exact_at(&mut cmd, config_offset + PCI_COMMAND)
        .map_err(|source| Error::Config {
            offset: PCI_COMMAND,
            source,
        })?;
    Ok(u16::from_le_bytes(cmd))
}

/// A new non-blocking, close-on-exec eventfd, for VFIO to signal.
fn new_eventfd() -> io::Result<std::os::fd::OwnedFd> {
    rustix::event::eventfd(
        0,
        rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC,
    )
    .map_err(io::Error::from)
}

/// `VFIO_DEVICE_SET_IRQS` with one eventfd: the argument's fixed part and its data.
#[repr(C)]
struct IrqSetOne {
    head: sys::vfio_irq_set,
    fd: i32,
}

/// Registers an eventfd for the device request interrupt (the kernel signals it when it wants the device
/// back). A kernel without it (no such IRQ, or refusing it) gets a warning and `None`: removal then waits
/// for the process to close the device.
fn register_request(device: &File, bdf: PciAddress) -> Option<File> {
    let warn = |why: Error| {
        log::warn!(
            "{bdf}: no VFIO device request channel ({why}); removing the device will wait \
             until this process closes it"
        );
        None
    };
    let irq = Irq::Request;
    let mut info = sys::vfio_irq_info {
        argsz: std::mem::size_of::<sys::vfio_irq_info>() as u32,
        index: sys::VFIO_PCI_REQ_IRQ_INDEX,
        ..Default::default()
    };
    // SAFETY: VFIO_DEVICE_GET_IRQ_INFO reads and writes a `vfio_irq_info` of `argsz` bytes.
    if let Err(e) = unsafe { ioctl_ptr(device, VFIO_DEVICE_GET_IRQ_INFO, &mut info) } {
        return warn(Error::IrqInfo { irq, source: e });
    }
    if info.count == 0 {
        return warn(Error::NoIrq { bdf, irq });
    }
    let efd = match new_eventfd() {
        Ok(fd) => File::from(fd),
        Err(source) => return warn(Error::Eventfd { irq, source }),
    };
    let mut set = IrqSetOne {
        head: sys::vfio_irq_set {
            argsz: std::mem::size_of::<IrqSetOne>() as u32,
            flags: sys::VFIO_IRQ_SET_DATA_EVENTFD | sys::VFIO_IRQ_SET_ACTION_TRIGGER,
            index: sys::VFIO_PCI_REQ_IRQ_INDEX,
            start: 0,
            count: 1,
            ..Default::default()
        },
        fd: efd.as_raw_fd(),
    };
    // SAFETY: VFIO_DEVICE_SET_IRQS reads `argsz` bytes: the fixed `vfio_irq_set` and `count` (1) eventfd
    // numbers right after it, which is exactly `IrqSetOne` (repr(C), the fd at offset 20).
    if let Err(e) = unsafe { ioctl_ptr(device, VFIO_DEVICE_SET_IRQS, &mut set) } {
        return warn(Error::SetIrqs {
            irq,
            vectors: 1,
            source: e,
        });
    }
    Some(efd)
}

impl Drop for VfioDevice {
    fn drop(&mut self) {
        let inner = self.inner.get_mut().unwrap_or_else(|e| e.into_inner());
        let maps = std::mem::take(&mut inner.mappings);
        if let Some(files) = &inner.files {
            for m in maps {
                if let Err(e) = unmap(&files.container, m.iova, m.len) {
                    log::warn!("{e}");
                }
            }
        }
    }
}

/// `VFIO_IOMMU_GET_INFO`, asked twice when the capability chain does not fit the first buffer.
fn iommu_info(container: &File) -> Result<IommuInfo, Error> {
    let mut argsz = std::mem::size_of::<sys::vfio_iommu_type1_info>();
    for _ in 0..2 {
        // u64 storage keeps the buffer aligned for the struct.
        let mut buf = vec![0u64; argsz.div_ceil(8)];
        let bytes = buf.len() * 8;
        let head = buf.as_mut_ptr().cast::<sys::vfio_iommu_type1_info>();
        // SAFETY: the buffer holds at least one `vfio_iommu_type1_info` and is 8-byte aligned.
        unsafe { (*head).argsz = argsz as u32 };
        // SAFETY: the kernel writes at most `argsz` bytes, which the buffer holds.
        unsafe { ioctl_ptr(container, VFIO_IOMMU_GET_INFO, head) }.map_err(Error::IommuInfo)?;
        // SAFETY: as above; the kernel filled the header.
        let (want, flags) = unsafe { ((*head).argsz as usize, (*head).flags) };
        if want > argsz && flags & sys::VFIO_IOMMU_INFO_CAPS != 0 {
            argsz = want;
            continue;
        }
        let raw: Vec<u8> = buf
            .iter()
            .flat_map(|w| w.to_ne_bytes())
            .take(bytes)
            .collect();
        return Ok(parse_iommu_info(&raw[..argsz.min(bytes)]));
    }
    Err(Error::IommuInfoGrowing)
}

impl Device for VfioDevice {
    #[inline]
    fn read32(&self, offset: usize) -> u32 {
        self.bar().read32(offset)
    }

    #[inline]
    fn write32(&self, offset: usize, value: u32) {
        self.bar().write32(offset, value)
    }

    fn map_dma(&self, pool: &DmaPool) -> Result<(), Error> {
        self.map_pool(pool)
    }

    fn unmap_dma(&self, pool: &DmaPool) -> Result<(), Error> {
        self.unmap_pool(pool)
    }

    fn name(&self) -> String {
        self.bdf().to_string()
    }

    fn is_present(&self) -> bool {
        VfioDevice::is_present(self)
    }

    fn release_requested(&self) -> bool {
        VfioDevice::release_requested(self)
    }

    fn release(&self) {
        VfioDevice::release(self)
    }

    fn enable_msix(&self, want: u16) -> Result<Vec<std::os::fd::OwnedFd>, Error> {
        VfioDevice::enable_msix(self, want)
    }
}

/// The most MSI-X vectors [`VfioDevice::enable_msix`] sets up.
const MAX_MSIX: usize = 64;

/// `VFIO_DEVICE_SET_IRQS` with up to [`MAX_MSIX`] eventfds.
#[repr(C)]
struct IrqSetMany {
    head: sys::vfio_irq_set,
    fds: [i32; MAX_MSIX],
}

impl VfioDevice {
    /// Enables MSI-X with `min(want, the function's vectors, 64)` vectors, each triggering its own new
    /// eventfd; returns them by vector. Vector 0 is the admin queue's.
    pub fn enable_msix(&self, want: u16) -> Result<Vec<std::os::fd::OwnedFd>, Error> {
        let inner = self.lock();
        let files = inner.files.as_ref().ok_or(Error::Removed)?;
        let irq = Irq::Msix;
        let mut info = sys::vfio_irq_info {
            argsz: std::mem::size_of::<sys::vfio_irq_info>() as u32,
            index: sys::VFIO_PCI_MSIX_IRQ_INDEX,
            ..Default::default()
        };
        // SAFETY: VFIO_DEVICE_GET_IRQ_INFO reads and writes a `vfio_irq_info` of `argsz` bytes.
        unsafe { ioctl_ptr(&files.device, VFIO_DEVICE_GET_IRQ_INFO, &mut info) }
            .map_err(|source| Error::IrqInfo { irq, source })?;
        let n = (info.count as usize).min(usize::from(want)).min(MAX_MSIX);
        if n == 0 {
            return Err(Error::NoIrq { bdf: self.bdf, irq });
        }
        let mut fds = Vec::with_capacity(n);
        for _ in 0..n {
            fds.push(new_eventfd().map_err(|source| Error::Eventfd { irq, source })?);
        }
        let mut set = IrqSetMany {
            head: sys::vfio_irq_set {
                argsz: (std::mem::size_of::<sys::vfio_irq_set>() + 4 * n) as u32,
                flags: sys::VFIO_IRQ_SET_DATA_EVENTFD | sys::VFIO_IRQ_SET_ACTION_TRIGGER,
                index: sys::VFIO_PCI_MSIX_IRQ_INDEX,
                start: 0,
                count: n as u32,
                ..Default::default()
            },
            fds: [-1; MAX_MSIX],
        };
        for (slot, fd) in set.fds.iter_mut().zip(&fds) {
            *slot = fd.as_raw_fd();
        }
        // SAFETY: VFIO_DEVICE_SET_IRQS reads `argsz` bytes: the fixed `vfio_irq_set` and `count` eventfd
        // numbers right after it; `IrqSetMany` is repr(C) with the array at the end of the fixed part and
        // room for MAX_MSIX >= count of them.
        unsafe { ioctl_ptr(&files.device, VFIO_DEVICE_SET_IRQS, &mut set) }.map_err(|source| {
            Error::SetIrqs {
                irq,
                vectors: n,
                source,
            }
        })?;
        Ok(fds)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers() {
        // From <linux/vfio.h>: _IO(';', 100 + n).
        assert_eq!(VFIO_GET_API_VERSION, 0x3b64);
        assert_eq!(VFIO_SET_IOMMU, 0x3b66);
        assert_eq!(VFIO_GROUP_GET_DEVICE_FD, 0x3b6a);
        assert_eq!(VFIO_IOMMU_GET_INFO, 0x3b70);
        assert_eq!(VFIO_IOMMU_MAP_DMA, 0x3b71);
        assert_eq!(VFIO_IOMMU_UNMAP_DMA, 0x3b72);
        assert_eq!(VFIO_DEVICE_GET_IRQ_INFO, 0x3b6d);
        assert_eq!(VFIO_DEVICE_SET_IRQS, 0x3b6e);
        assert_eq!(std::mem::offset_of!(IrqSetOne, fd), 20);
        assert_eq!(std::mem::size_of::<IrqSetOne>(), 24);
    }

    #[test]
    fn iommu_info_capability_chain() {
        // Header (24 bytes), then a migration capability (id 2) that points at an IOVA-range one (id 1).
        let mut b = vec![0u8; 24];
        b[0..4].copy_from_slice(&(24u32 + 32 + 48).to_le_bytes());
        b[4..8].copy_from_slice(
            &(sys::VFIO_IOMMU_INFO_PGSIZES | sys::VFIO_IOMMU_INFO_CAPS).to_le_bytes(),
        );
        b[8..16].copy_from_slice(&0x4020_1000u64.to_le_bytes());
        b[16..20].copy_from_slice(&24u32.to_le_bytes());
        let mut mig = vec![0u8; 32];
        mig[0..2].copy_from_slice(&2u16.to_le_bytes());
        mig[4..8].copy_from_slice(&56u32.to_le_bytes());
        b.extend(mig);
        let mut r = vec![0u8; 48];
        r[0..2].copy_from_slice(&1u16.to_le_bytes());
        r[8..12].copy_from_slice(&2u32.to_le_bytes());
        r[16..24].copy_from_slice(&0u64.to_le_bytes());
        r[24..32].copy_from_slice(&0xfedf_ffffu64.to_le_bytes());
        r[32..40].copy_from_slice(&0xfef0_0000u64.to_le_bytes());
        r[40..48].copy_from_slice(&0xffff_ffff_ffffu64.to_le_bytes());
        b.extend(r);
        let info = parse_iommu_info(&b);
        assert_eq!(info.page_sizes, 0x4020_1000);
        assert_eq!(info.min_page_size(), 4096);
        assert_eq!(
            info.ranges,
            vec![(0, 0xfedf_ffff), (0xfef0_0000, 0xffff_ffff_ffff)]
        );
        // A truncated chain stops without panicking.
        let cut = parse_iommu_info(&b[..60]);
        assert!(cut.ranges.is_empty());
    }

    #[test]
    fn iova_choice() {
        let info = IommuInfo {
            page_sizes: 0x4020_1000,
            ranges: vec![(0, 0xfedf_ffff), (0xfef0_0000, 0xffff_ffff_ffff)],
        };
        let mb2 = 2 << 20;
        // IOVA = VA where allowed.
        assert_eq!(
            info.choose(0x7f00_0000_0000, mb2, mb2, &[]).unwrap(),
            0x7f00_0000_0000
        );
        // A VA inside the MSI hole, or beyond 48 bits, gets an IOVA from the first range.
        assert_eq!(info.choose(0xfee0_0000, mb2, mb2, &[]).unwrap(), mb2);
        assert_eq!(
            info.choose(1 << 50, mb2, mb2, &[(mb2, mb2)]).unwrap(),
            2 * mb2
        );
        // Overlap with an existing mapping moves it too.
        assert_eq!(
            info.choose(0x4000_0000, mb2, mb2, &[(0x4000_0000, 4096)])
                .unwrap(),
            mb2
        );
        assert!(matches!(
            info.choose(0x1001, 4096, mb2, &[]),
            Err(Error::IovaUnaligned { .. })
        ));
        let tiny = IommuInfo {
            page_sizes: 4096,
            ranges: vec![(0, 0xfff)],
        };
        assert!(matches!(
            tiny.choose(1 << 40, mb2, mb2, &[]),
            Err(Error::NoIova { .. })
        ));
        let open = IommuInfo {
            page_sizes: 0,
            ranges: vec![],
        };
        assert!(open.allows(u64::MAX - 4095, 4096));
        assert!(!open.allows(u64::MAX, 2));
    }
}

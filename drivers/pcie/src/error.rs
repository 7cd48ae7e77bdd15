//! The error type of the PCIe driver.
//!
//! Every VFIO ioctl that can fail has its own variant carrying the OS error, so that a failure names the exact
//! step (as rust-vmm's `vfio-ioctls` does). Controller-level failures say what the controller did wrong.

use std::io;

use nvpoll::spec::Status;
use nvpoll::trid::PciAddress;

/// Everything that can go wrong in the PCIe driver and its setup tool.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Opening `/dev/vfio/vfio` failed.
    #[error("opening the VFIO container {path}: {source} (is the vfio-pci module loaded? `modprobe vfio-pci`)")]
    OpenContainer {
        /// The path opened.
        path: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `VFIO_GET_API_VERSION` failed.
    #[error("VFIO_GET_API_VERSION: {0}")]
    ApiVersion(#[source] io::Error),
    /// `VFIO_GET_API_VERSION` returned a version other than the one this driver speaks.
    #[error("VFIO_GET_API_VERSION: the kernel speaks VFIO API {kernel}, this driver {driver}")]
    ApiMismatch {
        /// The kernel's version.
        kernel: i32,
        /// The driver's version.
        driver: i32,
    },
    /// `VFIO_CHECK_EXTENSION(VFIO_TYPE1v2_IOMMU)` failed.
    #[error("VFIO_CHECK_EXTENSION(TYPE1v2): {0} (the kernel needs vfio_iommu_type1 and an enabled IOMMU: intel_iommu=on or amd_iommu=on on the kernel command line)")]
    CheckExtension(#[source] io::Error),
    /// `VFIO_CHECK_EXTENSION(VFIO_TYPE1v2_IOMMU)` said no.
    #[error("VFIO_CHECK_EXTENSION(TYPE1v2): the type-1 v2 IOMMU is not supported (the kernel needs vfio_iommu_type1 and an enabled IOMMU: intel_iommu=on or amd_iommu=on on the kernel command line)")]
    NoType1v2,
    /// Opening `/dev/vfio/N` failed.
    #[error("opening the VFIO group {path}: {source}")]
    OpenGroup {
        /// The path opened.
        path: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `VFIO_GROUP_GET_STATUS` failed.
    #[error("VFIO_GROUP_GET_STATUS: {0}")]
    GroupStatus(#[source] io::Error),
    /// The group is not viable: some device in it is bound to a driver other than vfio-pci.
    #[error(
        "IOMMU group {group} is not viable: every device in it must be bound to vfio-pci (or to no driver), \
         but {}; bind them with `nvpoll-setup bind BDF` or unbind them",
        others.join(", ")
    )]
    GroupNotViable {
        /// The group number.
        group: u32,
        /// The devices of the group that block it, as "BDF (driver X)".
        others: Vec<String>,
    },
    /// `VFIO_GROUP_SET_CONTAINER` failed.
    #[error("VFIO_GROUP_SET_CONTAINER: {0}")]
    SetContainer(#[source] io::Error),
    /// `VFIO_SET_IOMMU(VFIO_TYPE1v2_IOMMU)` failed.
    #[error("VFIO_SET_IOMMU(TYPE1v2): {0}")]
    SetIommu(#[source] io::Error),
    /// `VFIO_IOMMU_GET_INFO` failed.
    #[error("VFIO_IOMMU_GET_INFO: {0}")]
    IommuInfo(#[source] io::Error),
    /// `VFIO_IOMMU_GET_INFO` asked for a larger buffer on the second call too: its answer kept growing.
    #[error("VFIO_IOMMU_GET_INFO: the answer kept growing between two calls")]
    IommuInfoGrowing,
    /// `VFIO_GROUP_GET_DEVICE_FD` failed.
    #[error("VFIO_GROUP_GET_DEVICE_FD({bdf}): {source} (is the device bound to vfio-pci, and not open elsewhere?)")]
    DeviceFd {
        /// The device.
        bdf: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `VFIO_DEVICE_GET_INFO` failed.
    #[error("VFIO_DEVICE_GET_INFO: {0}")]
    DeviceInfo(#[source] io::Error),
    /// `VFIO_DEVICE_GET_REGION_INFO` failed.
    #[error("VFIO_DEVICE_GET_REGION_INFO(region {index}): {source}")]
    RegionInfo {
        /// The region index.
        index: u32,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Mapping BAR0 into the process failed.
    #[error("mapping BAR0: {0}")]
    MapBar(#[source] io::Error),
    /// VFIO does not offer BAR0 for mmap, or it is too small for an NVMe controller's registers.
    #[error("mapping BAR0: BAR0 of {bdf} is not mappable (flags {flags:#x}, {size} bytes)")]
    BarNotMappable {
        /// The device.
        bdf: PciAddress,
        /// The region's VFIO flags.
        flags: u32,
        /// The region's size.
        size: u64,
    },
    /// Reading or writing PCI configuration space through the device fd failed.
    #[error("PCI config space at {offset:#x}: {source}")]
    Config {
        /// Offset in configuration space.
        offset: u64,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `VFIO_IOMMU_MAP_DMA` failed.
    #[error("VFIO_IOMMU_MAP_DMA of {len:#x} bytes at IOVA {iova:#x}: {source} (out of locked memory? see `ulimit -l` and docs/hugepages.md)")]
    MapDma {
        /// The IOVA asked for.
        iova: u64,
        /// The length.
        len: u64,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `VFIO_IOMMU_UNMAP_DMA` failed.
    #[error("VFIO_IOMMU_UNMAP_DMA of {len:#x} bytes at IOVA {iova:#x}: {source}")]
    UnmapDma {
        /// The IOVA.
        iova: u64,
        /// The length.
        len: u64,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A DMA region is not aligned to the IOMMU's smallest page (or is empty), so the IOMMU cannot map it.
    #[error(
        "the IOMMU cannot map {len:#x} bytes of DMA memory: the region at {vaddr:#x} is not aligned to \
         the IOMMU's smallest page of {page:#x} bytes"
    )]
    IovaUnaligned {
        /// The region's virtual address.
        vaddr: u64,
        /// The region's length.
        len: u64,
        /// The IOMMU's smallest page size.
        page: u64,
    },
    /// No IOVA range the IOMMU allows has room for a DMA region.
    #[error("the IOMMU cannot map {len:#x} bytes of DMA memory: no allowed IOVA range has room (ranges {ranges:x?})")]
    NoIova {
        /// The region's length.
        len: u64,
        /// The allowed IOVA ranges, as inclusive `(start, end)` pairs.
        ranges: Vec<(u64, u64)>,
    },
    /// Reading sysfs (or another file the driver or tool needs) failed.
    #[error("{path}: {source}")]
    Sysfs {
        /// The path.
        path: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The device is not an NVMe controller the driver can run (wrong class, no memory BAR, unsupported
    /// capabilities).
    #[error("unsupported device: {0}")]
    Unsupported(String),
    /// `VFIO_DEVICE_GET_IRQ_INFO` failed for an interrupt index (MSI-X, or the device request interrupt).
    #[error("VFIO_DEVICE_GET_IRQ_INFO ({irq}): {source}")]
    IrqInfo {
        /// The interrupt index asked about.
        irq: Irq,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The device offers no vector of an interrupt index (`VFIO_DEVICE_GET_IRQ_INFO` reports a count of 0).
    #[error("{bdf} has no {irq} interrupt")]
    NoIrq {
        /// The device.
        bdf: PciAddress,
        /// The interrupt index.
        irq: Irq,
    },
    /// Creating an eventfd for VFIO to signal failed.
    #[error("eventfd for {irq}: {source}")]
    Eventfd {
        /// The interrupt index the eventfd was for.
        irq: Irq,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// `VFIO_DEVICE_SET_IRQS` failed to attach eventfds to the vectors of an interrupt index.
    #[error("VFIO_DEVICE_SET_IRQS ({irq}, {vectors} vectors): {source}")]
    SetIrqs {
        /// The interrupt index.
        irq: Irq,
        /// How many vectors were asked for.
        vectors: usize,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The controller reported a fatal status (CSTS.CFS).
    #[error("the controller reports a fatal status (CSTS.CFS)")]
    Fatal,
    /// The device is gone: hot removal (the kernel asked for it back, and the driver released it), or its
    /// registers read as all ones while the function no longer answers (a surprise link down).
    #[error("the controller was removed (hot removal, or its registers read as all ones)")]
    Removed,
    /// Something did not happen in time.
    #[error("timed out waiting for {0}")]
    Timeout(&'static str),
    /// A command completed with an error status where the driver needed success.
    #[error("{what} failed with NVMe status {}", status.named_in(*kind))]
    Command {
        /// Which command.
        what: &'static str,
        /// Its command set, which names the status (command-specific codes differ between them).
        kind: nvpoll::spec::CommandKind,
        /// Its status.
        status: Status,
    },
    /// The controller answered something that breaks the specification (an unknown command ID, a bad
    /// Identify page, ...).
    #[error("controller protocol violation: {0}")]
    Protocol(String),
    /// The queue pair or controller cannot take commands any more (reset, failed, detached).
    #[error("{0}")]
    Dead(Dead),
    /// The caller asked for something invalid.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The queue is full.
    #[error("queue full")]
    QueueFull,
    /// DMA memory could not be had.
    #[error("DMA memory: {0}")]
    Memory(#[source] nvpoll::Error),
}

/// A VFIO interrupt index the driver sets up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Irq {
    /// MSI-X: one vector per queue ([`crate::PcieOptions::interrupts`]).
    Msix,
    /// The device request interrupt: the kernel signals it when it wants the device back.
    Request,
}

impl std::fmt::Display for Irq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Irq::Msix => "MSI-X",
            Irq::Request => "device request",
        })
    }
}

/// Why a controller or queue pair takes no more commands ([`Error::Dead`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Dead {
    /// The controller was reset while the command was outstanding.
    #[error("the controller was reset")]
    Reset,
    /// The controller was shut down (detached or dropped).
    #[error("the controller was shut down")]
    ShutDown,
    /// Resets could not bring the controller back, and it was given up.
    #[error("the controller could not be reset and was given up")]
    GivenUp,
    /// The command was outstanding across more resets than the retry limit allows.
    #[error("the command's retries are used up")]
    RetriesUsedUp,
    /// CC.EN read 0 while the driver waited for CSTS.RDY: someone reset the controller during bring-up.
    #[error("the controller was reset during bring-up (CC.EN reads 0 after it was set)")]
    ResetDuringBringUp,
}

impl Error {
    /// A sysfs (or other file) error for `path`.
    pub fn sysfs(path: impl Into<String>, source: io::Error) -> Error {
        Error::Sysfs {
            path: path.into(),
            source,
        }
    }
}

impl nvpoll::TransportError for Error {
    fn class(&self) -> nvpoll::ErrorClass {
        use nvpoll::ErrorClass;
        match self {
            Error::Command { status, kind, .. } => ErrorClass::Nvme(status.named_in(*kind)),
            Error::Timeout(_) => ErrorClass::Timeout,
            Error::InvalidArgument(s) => ErrorClass::InvalidArgument(s.clone()),
            Error::QueueFull => ErrorClass::QueueFull,
            Error::Fatal | Error::Removed | Error::Dead(_) => ErrorClass::ConnectionLost,
            Error::Protocol(_) => ErrorClass::PeerProtocol,
            // Setting up VFIO, the IOMMU, the device's registers and interrupts, DMA memory, or a device the
            // driver cannot run: this side's failure, which a retry does not mend.
            Error::OpenContainer { .. }
            | Error::ApiVersion(_)
            | Error::ApiMismatch { .. }
            | Error::CheckExtension(_)
            | Error::NoType1v2
            | Error::OpenGroup { .. }
            | Error::GroupStatus(_)
            | Error::GroupNotViable { .. }
            | Error::SetContainer(_)
            | Error::SetIommu(_)
            | Error::IommuInfo(_)
            | Error::IommuInfoGrowing
            | Error::DeviceFd { .. }
            | Error::DeviceInfo(_)
            | Error::RegionInfo { .. }
            | Error::MapBar(_)
            | Error::BarNotMappable { .. }
            | Error::Config { .. }
            | Error::MapDma { .. }
            | Error::UnmapDma { .. }
            | Error::IovaUnaligned { .. }
            | Error::NoIova { .. }
            | Error::Sysfs { .. }
            | Error::Unsupported(_)
            | Error::IrqInfo { .. }
            | Error::NoIrq { .. }
            | Error::Eventfd { .. }
            | Error::SetIrqs { .. }
            | Error::Memory(_) => ErrorClass::Local,
        }
    }
}

impl From<Error> for nvpoll::Error {
    fn from(e: Error) -> Self {
        match e {
            // DMA memory failed in the core: its own error, as it was.
            Error::Memory(inner) => inner,
            other => nvpoll::Error::from_transport(other),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    #[test]
    fn an_interrupt_ioctl_failure_names_the_ioctl_and_keeps_the_os_error() {
        let e = Error::SetIrqs {
            irq: Irq::Msix,
            vectors: 9,
            source: io::Error::from_raw_os_error(libc::EINVAL),
        };
        let text = e.to_string();
        assert!(
            text.starts_with("VFIO_DEVICE_SET_IRQS (MSI-X, 9 vectors): "),
            "{text}"
        );
        let source = e.source().expect("the OS error is the source");
        let os = source.downcast_ref::<io::Error>().expect("an io::Error");
        assert_eq!(os.raw_os_error(), Some(libc::EINVAL));
        let e = Error::IrqInfo {
            irq: Irq::Request,
            source: io::Error::from_raw_os_error(libc::ENOTTY),
        };
        assert!(
            e.to_string()
                .starts_with("VFIO_DEVICE_GET_IRQ_INFO (device request): "),
            "{e}"
        );
        assert!(e.source().is_some());
        let bdf: PciAddress = "0000:04:00.0".parse().unwrap();
        let e = Error::NoIrq {
            bdf,
            irq: Irq::Msix,
        };
        assert_eq!(e.to_string(), "0000:04:00.0 has no MSI-X interrupt");
    }

    #[test]
    fn a_dead_queue_says_why_and_is_a_lost_connection() {
        use nvpoll::TransportError as _;
        let e = Error::Dead(Dead::GivenUp);
        assert_eq!(
            e.to_string(),
            "the controller could not be reset and was given up"
        );
        assert_eq!(e.class(), nvpoll::ErrorClass::ConnectionLost);
        let api = nvpoll::Error::from(e);
        assert_eq!(api.retry(), nvpoll::Retry::Elsewhere);
    }

    #[test]
    fn a_vfio_failure_is_ours_and_not_retried() {
        use nvpoll::TransportError as _;
        let e = Error::SetIommu(io::Error::from_raw_os_error(libc::EPERM));
        assert_eq!(e.class(), nvpoll::ErrorClass::Local);
        let api = nvpoll::Error::from(e);
        assert!(matches!(api, nvpoll::Error::Local(_)), "{api:?}");
        assert!(api.to_string().contains("VFIO_SET_IOMMU"), "{api}");
        assert_eq!(
            (api.retry(), api.fault()),
            (nvpoll::Retry::Never, nvpoll::Fault::Ours)
        );
    }
}

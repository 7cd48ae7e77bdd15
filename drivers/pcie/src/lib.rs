//! # nvpoll-pcie
//!
//! NVMe over PCIe for nvpoll: a polled-mode userspace driver for NVMe controllers bound to vfio-pci, in the
//! spirit of SPDK's PCIe transport and libvfn.
//!
//! - [`PcieController`] brings a controller up (reset, admin queue, enable, Identify, Number of Queues),
//!   creates I/O queue pairs, watches for a fatal status, resets, and shuts the controller down on drop;
//!   queue pairs survive a reset by re-creating their queues, and retry or fail their commands by their
//!   [`Recovery`] policy (retry by default; counters in [`RecoveryStats`]);
//! - [`PcieQueuePair`] is one I/O submission/completion queue pair, owned by one reactor: `submit` posts a
//!   command (building PRPs in the tracker's own list page), `flush` rings the submission doorbell once for
//!   everything posted since the last flush, and `poll` reaps completions by phase tag and rings the
//!   completion doorbell once per batch;
//! - [`Device`] is what the driver needs from the PCI function (32-bit register access and DMA mapping):
//!   [`vfio::VfioDevice`] for real hardware, and (with the `fake` feature, test support only) `fake::FakeDevice`, a memory-backed stand-in that tests and
//!   benchmarks run against;
//! - [`sysfs`] and the `nvpoll-setup` tool (crate nvpoll-tools) bind controllers to vfio-pci and back, and reserve hugepages.
//!
//! ```no_run
//! use nvpoll::api::{Controller, IoOp, IoRequest, QueuePair};
//! use nvpoll::mem::DmaPool;
//! use nvpoll_pcie::{PcieController, PcieOptions};
//!
//! let pool = DmaPool::builder().class(4096, 256).build()?;
//! let mut ctrl = PcieController::open("0000:00:04.0".parse()?, pool.clone(), PcieOptions::default())?;
//! let ns = ctrl.namespaces()[0].clone();
//! let mut qp = ctrl.create_queue_pair(128)?;
//! let req = IoRequest { op: IoOp::Read, nsid: ns.nsid, lba: 0, blocks: 8, buf: Some(pool.alloc(4096)?), tag: 1 };
//! qp.submit(req).map_err(|r| r.error)?;
//! qp.flush()?;
//! while qp.process_completions(32, |_, c| println!("{}: {:?}", c.tag, c.result))? == 0 {}
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! All `unsafe` code is in [`vfio`] (ioctls, BAR mmap) and [`mmio`] (volatile accesses to registers and to
//! memory shared with the device).
#![deny(missing_docs)]
#![deny(unsafe_code)]

mod ctrl;
mod error;
#[cfg(feature = "fake")]
pub mod fake;
pub mod mmio;
pub mod prp;
mod qpair;
mod ring;
mod shared;
pub mod sysfs;
pub mod vfio;

pub use ctrl::{CtrlStats, PcieController, PcieOptions};
pub use error::Error;
pub use qpair::{PcieQueuePair, QueueOptions, Recovery, RecoveryStats};
pub use ring::QueueStats;

use nvpoll::mem::DmaPool;

/// What the driver needs from an NVMe PCI function: its BAR0 registers and DMA mapping.
///
/// Registers are accessed 32 bits at a time at 4-byte aligned offsets; a 64-bit register is read as two
/// halves, low dword first ([`Device::read64`]).
pub trait Device: Send + Sync + 'static {
    /// Reads the 32-bit register at byte `offset` of BAR0.
    fn read32(&self, offset: usize) -> u32;

    /// Writes the 32-bit register at byte `offset` of BAR0.
    fn write32(&self, offset: usize, value: u32);

    /// Reads a 64-bit register as two 32-bit reads, low dword first.
    fn read64(&self, offset: usize) -> u64 {
        let lo = self.read32(offset);
        let hi = self.read32(offset + 4);
        u64::from(lo) | u64::from(hi) << 32
    }

    /// Writes a 64-bit register as two 32-bit writes, low dword first.
    fn write64(&self, offset: usize, value: u64) {
        self.write32(offset, value as u32);
        self.write32(offset + 4, (value >> 32) as u32);
    }

    /// Makes every region of `pool` reachable by the device's DMA and sets the pool's IOVAs.
    fn map_dma(&self, pool: &DmaPool) -> Result<(), Error>;

    /// Undoes one [`Device::map_dma`] of `pool`.
    fn unmap_dma(&self, pool: &DmaPool) -> Result<(), Error>;

    /// A short name for messages (the PCI address).
    fn name(&self) -> String;

    /// Whether the function is still there, asked when a register reads as all ones (which a removed device
    /// answers, but also one whose memory decoding is briefly off, as during a function-level reset): true
    /// means a transient, false that the device is gone. Default: true.
    fn is_present(&self) -> bool {
        true
    }

    /// Whether the kernel asks for the device back (a VFIO device request: the function is being removed or
    /// unplugged). Must not block; the controller's health check asks it on every call. Default: never.
    fn release_requested(&self) -> bool {
        false
    }

    /// Gives the device back to the kernel: afterwards no access reaches the device (registers read as all
    /// ones and writes are dropped), its DMA mappings are gone ([`Device::unmap_dma`] does nothing,
    /// [`Device::map_dma`] fails with [`Error::Removed`]), and it is closed. Safe to call while other threads
    /// still read and write registers. Default: nothing.
    fn release(&self) {}
}

impl Device for vfio::VfioDevice {
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
        vfio::VfioDevice::is_present(self)
    }

    fn release_requested(&self) -> bool {
        vfio::VfioDevice::release_requested(self)
    }

    fn release(&self) {
        vfio::VfioDevice::release(self)
    }
}

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
#![deny(unsafe_code)]

mod ctrl;
mod device;
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
pub use device::Device;
pub use error::{Dead, Error, Irq};
pub use qpair::{PcieQueuePair, QueueOptions, Recovery, RecoveryStats};
pub use ring::QueueStats;

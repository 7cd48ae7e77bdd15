//! The controller: bring-up, the admin queue, I/O queue creation, health checks, reset and shutdown.
//!
//! Bring-up follows the NVMe Base specification's initialization sequence:
//! 1. read CAP and VS; check the NVM command set and 4 KiB pages are supported;
//! 2. disable the controller (CC.EN = 0) and wait for CSTS.RDY = 0 within CAP.TO;
//! 3. program the admin queues (AQA, ASQ, ACQ) in DMA memory;
//! 4. enable (CC.EN = 1 with 64-byte SQEs, 16-byte CQEs, 4 KiB pages) and wait for CSTS.RDY = 1;
//! 5. Identify Controller (MDTS limits the transfer size), Set Features Number of Queues, Identify of the
//!    active namespaces.
//!
//! I/O queues are created on demand with interrupts disabled (polled), sized within CAP.MQES, with doorbells
//! at the CAP.DSTRD stride. [`PcieController::poll_admin`] is the controller's health check: CSTS.CFS, a
//! controller found disabled (CSTS.RDY = 0: reset from outside, e.g. a function-level reset through sysfs),
//! a queue pair's command timeout, or a failed admin command makes it reset the controller; a request from
//! the kernel to give the device back (VFIO's device request, on hot removal) or registers that read as all
//! ones while the function no longer answers make it release the device ([`Device::release`]) and fail
//! everything as removed.
//!
//! A reset moves the shared epoch when it begins (queue pairs stop touching their rings) and publishes it as
//! ready once the controller is enabled and identified again; each queue pair then re-creates its own queues
//! on its next poll, keeping its queue ID, and retries or fails its commands by its [`crate::Recovery`]
//! policy. A controller that cannot be brought back after a few attempts, or that is removed, is lost:
//! everything fails. Dropping the controller shuts it down (CC.SHN) and unmaps its DMA memory.

use std::fmt;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nvpoll::api::{Controller, ControllerInfo, Namespace};
use nvpoll::mem::{DmaBuf, DmaPool, HugepageMode};
use nvpoll::spec::{self, cns, feature, reg, Aqa, Cap, Cc, Cqe, Csts, IdentifyController, Sqe, Vs};
use nvpoll::trid::PciAddress;

use crate::device::Device;
use crate::error::{Dead, Error};
use crate::qpair::CtrlLink;
use crate::qpair::{PcieQueuePair, QueueOptions, Recovery};
use crate::ring::{lock_admin, Failure, Queue, QueueLayout, SglMode};
use crate::shared::{AtomicCtrlState, CtrlState, Retired, Shared};
use crate::vfio::VfioDevice;

/// Attempts at bringing the controller back (disable, enable, identify) before it is given up.
const RESET_ATTEMPTS: u32 = 3;

/// The pause before the second attempt at a reset (doubling after): a function-level reset keeps the
/// controller's registers out of reach for about 100 ms, and what is written to them meanwhile is lost.
const RESET_BACKOFF: Duration = Duration::from_millis(250);

/// Options for attaching a controller.
///
/// See [`PcieController`]'s example and [`PcieController::open`]'s.
#[derive(Clone, Debug)]
pub struct PcieOptions {
    /// Admin queue depth (commands; the queues get one slot more).
    pub admin_depth: u16,
    /// I/O queues to ask for (Set Features Number of Queues).
    pub io_queues: u16,
    /// Largest transfer per command we issue (further limited by MDTS).
    pub max_transfer: u32,
    /// Time allowed for each admin command.
    pub admin_timeout: Duration,
    /// An I/O queue pair whose outstanding commands make no progress for this long fails with a timeout and
    /// asks the controller for a reset.
    pub io_timeout: Duration,
    /// Time allowed for shutdown (CSTS.SHST to report complete).
    pub shutdown_timeout: Duration,
    /// Whether the driver's own memory (queues, PRP lists) comes from hugepages.
    pub hugepages: HugepageMode,
    /// What a controller reset does to the commands of the queue pairs (unless a queue pair's
    /// [`QueueOptions::recovery`] says otherwise): retried after the reset by default.
    pub recovery: Recovery,
    /// With [`Recovery::Retry`], how many times a command is submitted again after resets; a command still
    /// outstanding at the reset after that fails with [`nvpoll::Error::Aborted`].
    pub max_retries: u8,
    /// Completion interrupts, for reactors that sleep ([`nvpoll::reactor::IdlePolicy::Hybrid`]): MSI-X is
    /// enabled with a vector per I/O queue (as many as the function has, up to 64; vector 0 is the admin
    /// queue's), each signalling an eventfd that the queue pair declares as its wake source while it has
    /// commands outstanding. Queue pairs beyond the vectors, and every queue pair without this, are polled:
    /// their reactor does not sleep while they have commands outstanding. The vectors stay armed while the
    /// reactor polls, so each completion batch also costs the host an interrupt: leave this off (the
    /// default) for reactors that never sleep.
    pub interrupts: bool,
}

impl Default for PcieOptions {
    fn default() -> Self {
        PcieOptions {
            admin_depth: 31,
            io_queues: 64,
            max_transfer: 2 << 20,
            admin_timeout: Duration::from_secs(10),
            io_timeout: Duration::from_secs(30),
            shutdown_timeout: Duration::from_secs(10),
            hugepages: HugepageMode::Prefer,
            recovery: Recovery::Retry,
            max_retries: 5,
            interrupts: false,
        }
    }
}

/// Controller-level counters.
///
/// See [`PcieController`]'s example.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtrlStats {
    /// Admin commands run.
    pub admin_commands: u64,
    /// Controller resets after bring-up (each attempt that disabled the controller).
    pub resets: u64,
    /// I/O queue pairs created.
    pub queues_created: u64,
    /// I/O queue pairs deleted on the device after being dropped.
    pub queues_deleted: u64,
}

/// The epoch of a retired queue that could not be deleted: its memory waits for a reset.
const STUCK: u64 = u64::MAX;

/// An NVMe controller driven from user space over PCIe.
///
/// # Examples
///
/// A real controller is opened with [`PcieController::open`] (vfio-pci and an IOMMU: see its example).
/// This one runs against the memory-backed stand-in device of the `fake` feature (test support, enabled for
/// this crate's tests), through [`PcieController::attach`], which `open` calls with the VFIO device:
///
/// ```
/// use std::sync::Arc;
/// use nvpoll::api::{Controller, IoOp, IoRequest, QueuePair};
/// use nvpoll::mem::DmaPool;
/// use nvpoll_pcie::fake::{FakeConfig, FakeDevice};
/// use nvpoll_pcie::{PcieController, PcieOptions, QueueOptions};
///
/// let pool = DmaPool::builder().class(4096, 64).build()?;
/// let dev = Arc::new(FakeDevice::new(FakeConfig::default()));
/// let mut ctrl = PcieController::attach(dev, pool.clone(), PcieOptions::default())?;
/// println!("NVMe {:?}, CAP {:?}, {} I/O queues granted", ctrl.vs(), ctrl.cap(), ctrl.io_queues_granted());
/// assert!(Arc::strong_count(ctrl.device()) >= 1);
/// let ns = ctrl.namespace(1).ok_or("no namespace 1")?.clone();
///
/// let mut qp = ctrl.create_queue_pair_with(QueueOptions { batch: 16, ..QueueOptions::new(64) })?;
/// let blocks = 4096 / ns.block_size;
/// let req = IoRequest { op: IoOp::Read, nsid: 1, lba: 0, blocks, buf: Some(ctrl.pool().alloc(4096)?), tag: 7 };
/// qp.submit(req).map_err(|r| r.error)?;
/// qp.flush()?; // one doorbell write
/// let mut done = None;
/// while done.is_none() {
///     qp.process_completions(16, |_, c| done = Some(c))?;
/// }
/// done.ok_or("no completion")?.result?;
///
/// assert!(!ctrl.poll_admin()?, "healthy: no reset");
/// ctrl.reset()?; // the queue pair re-creates its queues on its next poll
/// assert_eq!(ctrl.stats().resets, 1);
/// assert!(ctrl.admin_stats().submitted > 0);
/// assert!(!ctrl.is_removed());
/// drop(qp);
/// ctrl.shutdown()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct PcieController<D: Device = VfioDevice> {
    dev: Arc<D>,
    /// Shared with the queue pairs, which re-create their queues through it after a reset.
    admin: Arc<Mutex<Queue<D>>>,
    /// Memory of the admin queue and of Identify buffers.
    admin_pool: DmaPool,
    /// The caller's pool for data buffers.
    pool: DmaPool,
    shared: Arc<Shared>,
    opts: PcieOptions,
    cap: Cap,
    vs: Vs,
    info: ControllerInfo,
    io_queues_granted: u16,
    /// Queue IDs in use, by index (index 0 is the admin queue).
    qids: Vec<bool>,
    /// The MSI-X eventfds by vector, with [`PcieOptions::interrupts`] (vector `qid` is queue `qid`'s).
    irqs: Vec<Arc<OwnedFd>>,
    stats: CtrlStats,
    shut_down: bool,
}

impl<D: Device> fmt::Debug for PcieController<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PcieController")
            .field("device", &self.dev.name())
            .field("model", &self.info.identify.model)
            .field("vs", &self.vs.to_string())
            .field("max_transfer", &self.info.max_transfer)
            .field("io_queues_granted", &self.io_queues_granted)
            .field("stats", &self.stats)
            .finish()
    }
}

impl PcieController<VfioDevice> {
    /// Opens the controller at `bdf` (bound to vfio-pci) through VFIO, maps `pool` for DMA (the data
    /// buffers of I/O must come from it), and brings the controller up.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// use nvpoll::api::Controller;
    /// use nvpoll::mem::{DmaPool, HugepageMode};
    /// use nvpoll_pcie::{PcieController, PcieOptions};
    ///
    /// // Needs a controller bound to vfio-pci (nvpoll-setup), an IOMMU, and hugepages.
    /// let pool = DmaPool::builder().class(4096, 1024).hugepages(HugepageMode::Require).build()?;
    /// let opts = PcieOptions { io_queues: 4, ..PcieOptions::default() };
    /// let mut ctrl = PcieController::open("0000:00:04.0".parse()?, pool, opts)?;
    /// println!("{} namespaces, {:?}", ctrl.namespaces().len(), ctrl.identify().model);
    /// let qp = ctrl.create_queue_pair(128)?;
    /// drop(qp);
    /// ctrl.shutdown()?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn open(
        bdf: PciAddress,
        pool: DmaPool,
        opts: PcieOptions,
    ) -> Result<PcieController<VfioDevice>, Error> {
        let dev = VfioDevice::open(bdf)?;
        PcieController::attach(Arc::new(dev), pool, opts)
    }
}

/// Whether a register read of all ones means the device is gone (rather than briefly out of reach, as during
/// a function-level reset).
fn gone<D: Device>(dev: &D, raw: u32) -> bool {
    raw == u32::MAX && !dev.is_present()
}

/// Waits until `done(CSTS)` or the deadline; CSTS all ones means the device is gone (unless the function
/// still answers: then it is waited out).
fn wait_csts<D: Device>(
    dev: &D,
    timeout: Duration,
    what: &'static str,
    mut done: impl FnMut(Csts) -> bool,
) -> Result<Csts, Error> {
    let deadline = Instant::now() + timeout;
    loop {
        let raw = dev.read32(reg::CSTS as usize);
        if gone(dev, raw) {
            return Err(Error::Removed);
        }
        let csts = Csts(raw);
        if raw != u32::MAX && done(csts) {
            return Ok(csts);
        }
        if Instant::now() >= deadline {
            return Err(Error::Timeout(what));
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

impl<D: Device> PcieController<D> {
    /// Brings up the controller behind `dev`: maps `pool` for DMA, resets and enables the controller, and
    /// identifies it and its namespaces.
    /// See [`PcieController`]'s example.
    pub fn attach(
        dev: Arc<D>,
        pool: DmaPool,
        opts: PcieOptions,
    ) -> Result<PcieController<D>, Error> {
        if opts.admin_depth == 0 || opts.admin_depth >= Aqa::MAX_ENTRIES {
            return Err(Error::InvalidArgument(format!(
                "admin depth {} is outside 1..{}",
                opts.admin_depth,
                Aqa::MAX_ENTRIES
            )));
        }
        let cap = Cap(dev.read64(reg::CAP as usize));
        if cap.0 == u64::MAX {
            return Err(Error::Removed);
        }
        let vs = Vs(dev.read32(reg::VS as usize));
        if cap.css() & Cap::CSS_NVM == 0 {
            return Err(Error::Unsupported(format!(
                "{} does not support the NVM command set (CAP.CSS {:#x})",
                dev.name(),
                cap.css()
            )));
        }
        if cap.min_page_size() > prp_page() {
            return Err(Error::Unsupported(format!(
                "{} needs pages of at least {} bytes; the driver uses 4 KiB",
                dev.name(),
                cap.min_page_size()
            )));
        }
        dev.map_dma(&pool)?;
        let layout = QueueLayout::new(opts.admin_depth, 2 << 20, 0);
        let admin_pool = layout
            .pool_classes(DmaPool::builder())
            .class(4096, 4)
            .hugepages(opts.hugepages)
            .build()
            .map_err(Error::Memory);
        let admin_pool = match admin_pool {
            Ok(p) => p,
            Err(e) => {
                let _ = dev.unmap_dma(&pool);
                return Err(e);
            }
        };
        if let Err(e) = dev.map_dma(&admin_pool) {
            let _ = dev.unmap_dma(&pool);
            return Err(e);
        }
        let admin = Queue::new(
            Arc::clone(&dev),
            &admin_pool,
            0,
            layout,
            cap.dstrd(),
            opts.admin_timeout,
        )?;
        let mut ctrl = PcieController {
            dev,
            admin: Arc::new(Mutex::new(admin)),
            admin_pool,
            pool,
            shared: Arc::new(Shared {
                epoch: AtomicU64::new(0),
                ready: AtomicU64::new(0),
                state: AtomicCtrlState::new(CtrlState::Running),
                reset_requested: AtomicBool::new(false),
                retired: Mutex::new(Vec::new()),
            }),
            opts,
            cap,
            vs,
            info: ControllerInfo::default(),
            io_queues_granted: 0,
            qids: vec![true],
            irqs: Vec::new(),
            stats: CtrlStats::default(),
            shut_down: false,
        };
        // On error, Drop unmaps what was mapped (and skips the shutdown of a controller never enabled).
        ctrl.bring_up()?;
        if ctrl.opts.interrupts {
            let want = ctrl.io_queues_granted.saturating_add(1);
            ctrl.irqs = ctrl
                .dev
                .enable_msix(want)?
                .into_iter()
                .map(Arc::new)
                .collect();
            if ctrl.irqs.len() < 2 {
                log::warn!(
                    "{}: interrupts asked for, but the function gives {} MSI-X vector(s): I/O queues are polled",
                    ctrl.dev.name(),
                    ctrl.irqs.len()
                );
            } else {
                log::info!(
                    "{}: MSI-X on, {} vectors: I/O queues 1-{} signal completions",
                    ctrl.dev.name(),
                    ctrl.irqs.len(),
                    ctrl.irqs.len() - 1
                );
            }
        }
        Ok(ctrl)
    }

    /// Disable, program the admin queue, enable, identify.
    fn bring_up(&mut self) -> Result<(), Error> {
        self.disable()?;
        let (entries, asq, acq) = {
            let aq = self.aq();
            (aq.entries(), aq.sq_iova(), aq.cq_iova())
        };
        let aqa = Aqa::new(entries, entries);
        self.dev.write32(reg::AQA as usize, aqa.0);
        self.dev.write64(reg::ASQ as usize, asq);
        self.dev.write64(reg::ACQ as usize, acq);
        let mut cc = Cc(0);
        cc.set_css(Cc::CSS_NVM);
        cc.set_mps(0);
        cc.set_ams(0);
        cc.set_iosqes(6);
        cc.set_iocqes(4);
        cc.set_en(true);
        self.dev.write32(reg::CC as usize, cc.0);
        let csts = self.wait_ready()?;
        if csts.cfs() {
            return Err(Error::Fatal);
        }
        self.identify_all()
    }

    /// Waits for CSTS.RDY = 1 (or CFS) after CC.EN = 1. Fails early if CC.EN reads 0 again: the controller
    /// was reset under the driver (a function-level reset in progress drops register writes), and the
    /// bring-up has to start over.
    fn wait_ready(&self) -> Result<Csts, Error> {
        let deadline = Instant::now() + self.ready_timeout();
        loop {
            let raw = self.dev.read32(reg::CSTS as usize);
            if gone(&*self.dev, raw) {
                return Err(Error::Removed);
            }
            let csts = Csts(raw);
            if raw != u32::MAX {
                if csts.rdy() || csts.cfs() {
                    return Ok(csts);
                }
                if !Cc(self.dev.read32(reg::CC as usize)).en() {
                    return Err(Error::Dead(Dead::ResetDuringBringUp));
                }
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout("CSTS.RDY = 1 after CC.EN = 1"));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    fn ready_timeout(&self) -> Duration {
        self.cap.timeout().max(Duration::from_millis(500))
    }

    /// CC.EN = 0 and CSTS.RDY = 0 (a reset of the controller; clears CSTS.CFS).
    fn disable(&mut self) -> Result<(), Error> {
        let cc = Cc(self.dev.read32(reg::CC as usize));
        let csts = self.dev.read32(reg::CSTS as usize);
        if gone(&*self.dev, csts) {
            return Err(Error::Removed);
        }
        if cc.en() && csts != u32::MAX && !Csts(csts).rdy() && !Csts(csts).cfs() {
            // The specification asks the host to let an enable finish before disabling.
            let _ = wait_csts(&*self.dev, self.ready_timeout(), "CSTS.RDY = 1", |c| {
                c.rdy() || c.cfs()
            });
        }
        let mut off = cc;
        off.set_en(false);
        off.set_shn(Cc::SHN_NONE);
        self.dev.write32(reg::CC as usize, off.0);
        wait_csts(
            &*self.dev,
            self.ready_timeout(),
            "CSTS.RDY = 0 after CC.EN = 0",
            |c| !c.rdy(),
        )?;
        Ok(())
    }

    fn identify_all(&mut self) -> Result<(), Error> {
        let page = self.identify_page(cns::CONTROLLER, 0)?;
        self.info.identify = IdentifyController::parse(&page)
            .map_err(|e| Error::Protocol(format!("Identify Controller: {e}")))?;
        let mut max = self.opts.max_transfer;
        if let Some(limit) = self
            .info
            .identify
            .max_transfer_bytes(self.cap.min_page_size())
        {
            max = max.min(limit.min(u64::from(u32::MAX)) as u32);
        }
        self.info.max_transfer = max.max(prp_page() as u32);
        let want = self.opts.io_queues.max(1);
        let cqe = self.admin_run(
            Sqe::set_features(feature::NUMBER_OF_QUEUES, feature::num_queues(want, want)),
            None,
            0,
            "Set Features (Number of Queues)",
        )?;
        let (nsq, ncq) = feature::num_queues_granted(cqe.dw0);
        self.io_queues_granted = nsq.min(ncq).min(u32::from(want)) as u16;
        // After a reset, the queue pairs still alive keep their queue IDs (they re-create their queues).
        let mut qids = vec![false; usize::from(self.io_queues_granted) + 1];
        qids[0] = true;
        for (used, &was) in qids.iter_mut().zip(&self.qids).skip(1) {
            *used = was;
        }
        self.qids = qids;
        self.info.namespaces = self.scan_namespaces()?;
        Ok(())
    }

    fn identify_page(&mut self, cns: u8, nsid: u32) -> Result<Vec<u8>, Error> {
        let buf = self.admin_pool.alloc(4096).map_err(Error::Memory)?;
        let (_, buf) = self.admin_run_buf(Sqe::identify(cns, nsid), Some(buf), 4096, "Identify")?;
        Ok(buf.map(|b| b.as_slice().to_vec()).unwrap_or_default())
    }

    fn scan_namespaces(&mut self) -> Result<Vec<Namespace>, Error> {
        let list = self.identify_page(cns::ACTIVE_NS_LIST, 0)?;
        let mut out = Vec::new();
        for nsid in spec::decode_ns_list(&list) {
            let page = self.identify_page(cns::NAMESPACE, nsid)?;
            if let Some(ns) =
                Namespace::from_identify(nsid, &page).map_err(|e| Error::Protocol(e.to_string()))?
            {
                out.push(ns);
            }
        }
        Ok(out)
    }

    fn admin_run(
        &mut self,
        sqe: Sqe,
        buf: Option<DmaBuf>,
        len: u32,
        what: &'static str,
    ) -> Result<Cqe, Error> {
        self.admin_run_buf(sqe, buf, len, what).map(|(c, _)| c)
    }

    /// Runs one admin command to completion; a non-success status is an [`Error::Command`].
    fn admin_run_buf(
        &mut self,
        sqe: Sqe,
        buf: Option<DmaBuf>,
        len: u32,
        what: &'static str,
    ) -> Result<(Cqe, Option<DmaBuf>), Error> {
        self.stats.admin_commands += 1;
        let timeout = self.opts.admin_timeout;
        self.aq().run_checked(sqe, buf, len, timeout, what)
    }

    /// Runs one admin command to completion and returns its completion, whatever the status.
    fn admin_raw(
        &mut self,
        sqe: Sqe,
        buf: Option<DmaBuf>,
        len: u32,
    ) -> Result<(Cqe, Option<DmaBuf>), Error> {
        self.stats.admin_commands += 1;
        let timeout = self.opts.admin_timeout;
        self.aq().run(sqe, buf, len, timeout)
    }

    /// The admin queue (shared with the queue pairs).
    fn aq(&self) -> std::sync::MutexGuard<'_, Queue<D>> {
        lock_admin(&self.admin)
    }

    /// The Capabilities register.
    /// See [`PcieController`]'s example.
    pub fn cap(&self) -> Cap {
        self.cap
    }

    /// The Version register.
    /// See [`PcieController`]'s example.
    pub fn vs(&self) -> Vs {
        self.vs
    }

    /// How many I/O queues the controller granted.
    /// See [`PcieController`]'s example.
    pub fn io_queues_granted(&self) -> u16 {
        self.io_queues_granted
    }

    /// The pool data buffers come from.
    /// See [`PcieController`]'s example.
    pub fn pool(&self) -> &DmaPool {
        &self.pool
    }

    /// The device under the controller.
    /// See [`PcieController`]'s example.
    pub fn device(&self) -> &Arc<D> {
        &self.dev
    }

    /// Controller-level counters.
    /// See [`PcieController`]'s example.
    pub fn stats(&self) -> CtrlStats {
        self.stats
    }

    /// The admin queue's counters.
    /// See [`PcieController`]'s example.
    pub fn admin_stats(&self) -> crate::QueueStats {
        self.aq().stats
    }

    /// Creates an I/O queue pair with the given options (see [`QueueOptions`]).
    /// See [`PcieController`]'s example.
    pub fn create_queue_pair_with(&mut self, qo: QueueOptions) -> Result<PcieQueuePair<D>, Error> {
        self.ensure_running()?;
        self.process_retired(false);
        let mqes = u32::from(self.cap.mqes());
        if qo.depth < 1 || u32::from(qo.depth) > mqes {
            return Err(Error::InvalidArgument(format!(
                "queue depth {} is outside 1..={mqes} (CAP.MQES allows queues of {} entries, one of which \
                 stays empty)",
                qo.depth,
                mqes + 1
            )));
        }
        if qo.prp_list_offset % 8 != 0 || u64::from(qo.prp_list_offset) >= prp_page() {
            return Err(Error::InvalidArgument(format!(
                "PRP list offset {} is not a multiple of 8 below 4096",
                qo.prp_list_offset
            )));
        }
        let sgl = match (qo.sgl, self.info.identify.sgls & 0x3) {
            (false, _) => SglMode::Off,
            (true, 0b01) => SglMode::AnyAlignment,
            (true, 0b10) => SglMode::DwordAligned,
            (true, _) => {
                return Err(Error::Unsupported(format!(
                    "{} does not support SGLs for I/O (Identify SGLS {:#x}); use PRPs",
                    self.dev.name(),
                    self.info.identify.sgls
                )))
            }
        };
        let Some(qid) = self.qids.iter().position(|used| !used) else {
            return Err(Error::InvalidArgument(format!(
                "the controller granted {} I/O queues; all are in use",
                self.io_queues_granted
            )));
        };
        let qid = qid as u16;
        let layout = QueueLayout::new(
            qo.depth,
            self.info.max_transfer,
            usize::from(qo.prp_list_offset),
        );
        let pool = layout
            .pool_classes(DmaPool::builder())
            .hugepages(self.opts.hugepages)
            .build()
            .map_err(Error::Memory)?;
        self.dev.map_dma(&pool)?;
        let q = match Queue::new(
            Arc::clone(&self.dev),
            &pool,
            qid,
            layout,
            self.cap.dstrd(),
            self.opts.io_timeout,
        ) {
            Ok(mut q) => {
                q.set_sgl(sgl);
                // Vector qid, if there is one (vector 0 is the admin queue's, which nobody waits on).
                if usize::from(qid) < self.irqs.len() {
                    q.set_irq(Some(qid));
                }
                q
            }
            Err(e) => {
                let _ = self.dev.unmap_dma(&pool);
                return Err(e);
            }
        };
        let (commands, created) = {
            let timeout = self.opts.admin_timeout;
            lock_admin(&self.admin).create_io_queues(&q, timeout)
        };
        self.stats.admin_commands += commands;
        if let Err(e) = created {
            drop(q);
            let _ = self.dev.unmap_dma(&pool);
            return Err(e);
        }
        self.qids[usize::from(qid)] = true;
        self.stats.queues_created += 1;
        let namespaces = self.info.namespaces.clone();
        let link = CtrlLink {
            shared: Arc::clone(&self.shared),
            admin: Arc::clone(&self.admin),
            admin_timeout: self.opts.admin_timeout,
            epoch: self.shared.epoch.load(Ordering::Acquire),
            recovery: self.opts.recovery,
            max_retries: self.opts.max_retries,
            max_transfer: self.info.max_transfer,
            namespaces,
        };
        let irq = self.irqs.get(usize::from(qid)).cloned();
        Ok(PcieQueuePair::new(q, &qo, link, pool, irq))
    }

    fn ensure_running(&self) -> Result<(), Error> {
        match self.shared.state.load() {
            CtrlState::Removed => Err(Error::Removed),
            CtrlState::Detached => Err(Error::Dead(Dead::ShutDown)),
            CtrlState::Failed => Err(Error::Dead(Dead::GivenUp)),
            CtrlState::Running => Ok(()),
        }
    }

    /// Deletes the queues of dropped queue pairs on the device, frees their memory and their queue IDs. With
    /// `device_forgot` (after a reset) nothing is deleted: the device no longer knows any I/O queue; nor are
    /// the queues of a queue pair dropped before it re-created them after a reset.
    fn process_retired(&mut self, device_forgot: bool) {
        let retired = std::mem::take(
            &mut *self
                .shared
                .retired
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        );
        let epoch = self.shared.epoch.load(Ordering::Acquire);
        let running = self.shared.state.load() == CtrlState::Running;
        let mut keep = Vec::new();
        for r in retired {
            if !device_forgot && running && r.epoch == STUCK {
                keep.push(r);
                continue;
            }
            if !device_forgot && running && r.epoch == epoch {
                let sq = self.admin_run(
                    Sqe::delete_io_sq(r.qid),
                    None,
                    0,
                    "Delete I/O Submission Queue",
                );
                let cq = self.admin_run(
                    Sqe::delete_io_cq(r.qid),
                    None,
                    0,
                    "Delete I/O Completion Queue",
                );
                if sq.is_err() || cq.is_err() {
                    // The queue may still be live on the device: keep its memory until a reset.
                    self.shared.reset_requested.store(true, Ordering::Release);
                    keep.push(Retired { epoch: STUCK, ..r });
                    continue;
                }
                self.stats.queues_deleted += 1;
            }
            if let Some(used) = self.qids.get_mut(usize::from(r.qid)) {
                *used = false;
            }
            let _ = self.dev.unmap_dma(&r.pool);
            drop(r.held);
        }
        if !keep.is_empty() {
            self.shared
                .retired
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend(keep);
        }
    }

    /// The health check, for a timed poller: looks at CSTS, and resets the controller when it reports a
    /// fatal status, when it was disabled from outside (CSTS.RDY = 0, e.g. by a function-level reset), when a
    /// queue pair's commands timed out, or when the admin queue failed. Also deletes the queues of dropped
    /// queue pairs. Returns `Ok(true)` when it reset the controller (the queue pairs recover on their next
    /// poll, see [`crate::Recovery`]), and an error once the controller is lost for good:
    /// [`Error::Removed`] when the device is gone or the kernel asked for it back (then the device has been
    /// released, see [`Device::release`]), the reset's error when it could not be brought back.
    /// See [`PcieController`]'s example.
    pub fn poll_admin(&mut self) -> Result<bool, Error> {
        self.ensure_running()?;
        if self.dev.release_requested() {
            self.remove();
            return Err(Error::Removed);
        }
        let csts = self.dev.read32(reg::CSTS as usize);
        if gone(&*self.dev, csts) {
            self.remove();
            return Err(Error::Removed);
        }
        // All ones from a function that still answers: its registers are out of reach for a moment (a
        // function-level reset), which also leaves the controller disabled.
        let reset_outside = csts == u32::MAX || !Csts(csts).rdy();
        let requested = self.shared.reset_requested.swap(false, Ordering::AcqRel);
        let admin_failed = self.aq().failure().is_some();
        if Csts(csts).cfs() || reset_outside || requested || admin_failed {
            self.reset()?;
            return Ok(true);
        }
        self.process_retired(false);
        Ok(false)
    }

    /// Whether the controller was given up as removed (and its device released).
    /// See [`PcieController`]'s example.
    pub fn is_removed(&self) -> bool {
        self.shared.state.load() == CtrlState::Removed
    }

    /// The device is gone or wanted back by the kernel: release it first (from then on nothing reaches it:
    /// no register access, no DMA into buffers the callers get back), then fail everything as removed.
    fn remove(&self) {
        self.dev.release();
        self.lose(CtrlState::Removed, Failure::Removed);
    }

    /// Moves the epoch with a new state. The caller holds the admin queue.
    fn mark(&self, state: CtrlState) {
        self.shared.state.store(state);
        self.shared.epoch.fetch_add(1, Ordering::AcqRel);
    }

    /// The controller is lost for good (removed or failed): the queue pairs fail everything.
    fn lose(&self, state: CtrlState, why: Failure) {
        let mut aq = self.aq();
        self.mark(state);
        aq.fail(why);
        while aq.pop_done().is_some() {}
    }

    /// Resets the controller (CC.EN 1 -> 0 -> 1) and brings it up again, trying a few times. The queue
    /// pairs then re-create their queues on their next poll and go on by their [`crate::Recovery`] policy.
    /// If the controller cannot be brought back (or is removed) it is lost: every queue pair fails its
    /// commands, and this returns the error.
    /// See [`PcieController`]'s example.
    pub fn reset(&mut self) -> Result<(), Error> {
        self.ensure_running()?;
        let mut last = None;
        for attempt in 0..RESET_ATTEMPTS {
            if attempt > 0 {
                std::thread::sleep(RESET_BACKOFF * (1 << (attempt - 1)));
                if self.dev.release_requested() {
                    self.remove();
                    return Err(Error::Removed);
                }
            }
            match self.reset_once() {
                Ok(()) => {
                    let epoch = self.shared.epoch.load(Ordering::Acquire);
                    self.shared.ready.store(epoch, Ordering::Release);
                    return Ok(());
                }
                Err(Error::Removed) => {
                    self.remove();
                    return Err(Error::Removed);
                }
                Err(e) => last = Some(e),
            }
        }
        self.lose(CtrlState::Failed, Failure::Lost);
        Err(last.unwrap_or(Error::Dead(Dead::GivenUp)))
    }

    /// One attempt: move the epoch (queue pairs stop touching their rings), disable, free the memory of
    /// dropped queue pairs (the device forgot their queues), enable and identify.
    fn reset_once(&mut self) -> Result<(), Error> {
        {
            let mut aq = self.aq();
            self.mark(CtrlState::Running);
            aq.fail(Failure::Reset);
            while aq.pop_done().is_some() {}
        }
        self.disable()?;
        self.stats.resets += 1;
        self.process_retired(true);
        self.aq().reinit();
        self.bring_up()
    }

    /// Shuts the controller down (CC.SHN normal, waiting for CSTS.SHST complete) and unmaps its DMA memory.
    /// Queue pairs still alive fail their outstanding commands with [`nvpoll::Error::Aborted`].
    /// See [`PcieController`]'s example.
    pub fn shutdown(mut self) -> Result<(), Error> {
        self.shutdown_inner()
    }

    fn shutdown_inner(&mut self) -> Result<(), Error> {
        if self.shut_down {
            return Ok(());
        }
        self.shut_down = true;
        let was = self.shared.state.load();
        if was == CtrlState::Running && self.dev.release_requested() {
            self.remove();
        }
        let was = self.shared.state.load();
        let csts = self.dev.read32(reg::CSTS as usize);
        let healthy = was == CtrlState::Running && csts != u32::MAX && !Csts(csts).cfs();
        if healthy && self.aq().failure().is_none() {
            self.process_retired(false);
        }
        if was != CtrlState::Removed {
            // A removed controller stays removed (its queue pairs fail with that).
            let mut aq = self.aq();
            self.mark(CtrlState::Detached);
            aq.fail(Failure::Detached);
        }
        let mut result = Ok(());
        if healthy {
            let mut cc = Cc(self.dev.read32(reg::CC as usize));
            if cc.en() {
                cc.set_shn(Cc::SHN_NORMAL);
                self.dev.write32(reg::CC as usize, cc.0);
                result = wait_csts(
                    &*self.dev,
                    self.opts.shutdown_timeout,
                    "CSTS.SHST = shutdown complete",
                    |c| c.shst() == Csts::SHST_COMPLETE,
                )
                .map(|_| ());
            }
        }
        // Memory of dropped queue pairs, then the driver's and the caller's pools.
        for r in std::mem::take(
            &mut *self
                .shared
                .retired
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        ) {
            let _ = self.dev.unmap_dma(&r.pool);
        }
        let _ = self.dev.unmap_dma(&self.admin_pool);
        let _ = self.dev.unmap_dma(&self.pool);
        result
    }
}

fn prp_page() -> u64 {
    crate::prp::PAGE_SIZE
}

impl<D: Device> Drop for PcieController<D> {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown_inner() {
            log::warn!("shutdown of {}: {e}", self.dev.name());
        }
    }
}

impl<D: Device> Controller for PcieController<D> {
    type QueuePair = PcieQueuePair<D>;

    fn info(&self) -> &ControllerInfo {
        &self.info
    }

    fn admin(&mut self, cmd: Sqe, buf: Option<DmaBuf>) -> nvpoll::Result<(Cqe, Option<DmaBuf>)> {
        self.ensure_running()?;
        let len = buf.as_ref().map_or(0, |b| b.len() as u32);
        Ok(self.admin_raw(cmd, buf, len)?)
    }

    fn io_queues_granted(&self) -> Option<u16> {
        Some(self.io_queues_granted)
    }

    fn create_queue_pair(&mut self, depth: u16) -> nvpoll::Result<PcieQueuePair<D>> {
        Ok(self.create_queue_pair_with(QueueOptions::new(depth))?)
    }

    fn poll_admin(&mut self) -> nvpoll::Result<()> {
        PcieController::poll_admin(self)?;
        Ok(())
    }

    fn shutdown(self) -> nvpoll::Result<()> {
        Ok(PcieController::shutdown(self)?)
    }
}

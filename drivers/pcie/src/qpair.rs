//! The I/O queue pairs applications use: a ring ([`crate::ring`]) plus what survives a controller reset.
//!
//! One I/O, start to end:
//! 1. [`PcieQueuePair::submit`] checks the request, pops a free command ID, builds the PRPs (writing a list
//!    into the tracker's own list page when the buffer spans more than two pages), copies the SQE into the
//!    submission queue slot at the tail and advances the tail. Nothing is written to the device yet (post).
//! 2. [`PcieQueuePair::flush`] rings the submission queue tail doorbell once if the tail moved (kick).
//! 3. [`PcieQueuePair::poll`] reads completion entries at the head while their phase tag matches, completes
//!    each command's tracker into the done list, and rings the completion queue head doorbell once for the
//!    batch.
//! 4. [`PcieQueuePair::pop_completion`] hands the finished request back with its buffer.
//!
//! A queue pair survives a controller reset (see [`Recovery`]): once it sees that a reset has begun it stops
//! touching its rings; once the controller has finished the reset, its next poll takes what the device
//! completed before the reset from the old completion queue, re-creates its queues on the device (same queue
//! ID and depth) and, by its recovery policy, submits the rest again or fails them. It fails as a whole
//! (every command completes with an error, later submits are refused) when the controller is removed, shut
//! down or lost for good, or when the controller completes an unknown command ID.

use std::collections::VecDeque;
use std::fmt;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nvpoll::api::{
    check_request, Completion, IoRequest, Namespace, QueuePair, QueueStats as ApiQueueStats,
    Rejected,
};
use nvpoll::mem::DmaPool;
use nvpoll::send::{SendMode, SendPolicy};
use nvpoll::spec::Sqe;

use crate::device::Device;
use crate::error::Error;
use crate::ring::{lock_admin, Done, Failure, Held, Queue, QueueStats};
use crate::shared::{CtrlState, Retired, Shared};
use crate::vfio::VfioDevice;

/// What a controller reset does to the commands of a queue pair.
///
/// A reset (after CSTS.CFS, a command timeout, a failed admin command, or [`crate::PcieController::reset`])
/// makes the device forget every I/O queue. Each queue pair then waits until the controller has finished
/// the reset, takes what the device completed before it from its old completion queue (those commands
/// complete normally, once), re-creates its queues on the device with the same queue ID and depth, and deals
/// with the rest by this policy. In both cases a command completes exactly once, a write completes
/// successfully only if the device reported it done (before or after the reset), and nothing is handed back
/// while the device may still write its buffer. If the device is removed or the controller cannot be
/// brought back, every command fails and later submits are refused, whatever the policy.
///
/// See [`PcieQueuePair`]'s example.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Recovery {
    /// Keep the commands that were outstanding, with their buffers and tags, and submit them again on the
    /// re-created queues (in their first submission order); commands submitted while waiting for the reset
    /// are held and submitted after them. A command outstanding across more resets than
    /// [`crate::PcieOptions::max_retries`] allows fails with [`nvpoll::Error::Aborted`].
    #[default]
    Retry,
    /// Fail the outstanding commands as soon as the reset has stopped the device: with
    /// [`nvpoll::Error::Timeout`] when this queue pair's own timeout asked for the reset, with
    /// [`nvpoll::Error::Aborted`] otherwise. Submits are refused while waiting for the reset; the queue pair
    /// takes new commands again once its queues are re-created.
    FailFast,
}

/// Counters of a queue pair's recovery from controller resets, cumulative since it was created.
///
/// See [`PcieQueuePair`]'s example.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecoveryStats {
    /// Controller resets the queue pair went through.
    pub resets: u64,
    /// Times it re-created its queues on the device after a reset.
    pub recreated: u64,
    /// Commands posted to the device again after a reset (with [`Recovery::Retry`]).
    pub retried: u64,
    /// Commands accepted while waiting for a reset (held, and posted once it completed).
    pub held: u64,
    /// Commands the device had completed before a reset, found in the old completion queue after it.
    pub completed_before_reset: u64,
    /// Commands failed by the recovery: fail-fast, retries used up, removal, controller lost.
    pub failed: u64,
    /// Times the outstanding commands made no progress within the I/O timeout (each asked for a reset).
    pub timeouts: u64,
}

/// Options of one I/O queue pair.
///
/// See [`crate::PcieController`]'s example.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueOptions {
    /// Commands that may be outstanding at once (the submission queue gets one slot more).
    pub depth: u16,
    /// Where each tracker's PRP list starts in its first list page, in bytes (a multiple of 8 below 4096;
    /// default 0). A non-zero offset makes long lists cross a page boundary and chain, which tests use to
    /// exercise chained lists on controllers whose MDTS keeps every list within one page.
    pub prp_list_offset: u16,
    /// Most completions one poll reaps (and so one completion doorbell covers); 0: the queue's depth.
    pub batch: u16,
    /// Describe data with one SGL data block per command instead of PRPs (no PRP list to build, and any
    /// byte alignment where the controller allows it). Creating the queue pair fails if the controller
    /// does not support SGLs (Identify Controller SGLS).
    pub sgl: bool,
    /// What a controller reset does to this queue pair's commands; `None` (the default): the controller's
    /// [`crate::PcieOptions::recovery`].
    pub recovery: Option<Recovery>,
}

impl QueueOptions {
    /// A queue pair of `depth` commands with the defaults. See [`crate::PcieController`]'s example.
    pub fn new(depth: u16) -> QueueOptions {
        QueueOptions {
            depth,
            prp_list_offset: 0,
            batch: 0,
            sgl: false,
            recovery: None,
        }
    }
}

/// What a queue pair gets from its controller.
pub(crate) struct CtrlLink<D: Device> {
    pub shared: Arc<Shared>,
    /// The admin queue, to re-create the queues after a reset.
    pub admin: Arc<Mutex<Queue<D>>>,
    pub admin_timeout: Duration,
    /// The epoch the queues were created in.
    pub epoch: u64,
    pub recovery: Recovery,
    pub max_retries: u8,
    pub max_transfer: u32,
    pub namespaces: Vec<Namespace>,
}

/// Where a queue pair stands with respect to controller resets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Link {
    /// Its queues exist on the device in its epoch.
    Live,
    /// A reset has begun (or this queue pair asked for one): its rings are not touched until the reset has
    /// completed.
    Waiting,
    /// Failed for good.
    Dead,
}

/// Consecutive failed attempts at re-creating the queues after resets before the queue pair gives up.
const RECREATE_ATTEMPTS: u32 = 3;

/// An NVMe I/O queue pair over PCIe, owned by one reactor (or thread).
///
/// Create it with [`nvpoll::api::Controller::create_queue_pair`] (or
/// [`crate::PcieController::create_queue_pair_with`]), move it to its reactor, and drive it through
/// [`nvpoll::api::QueuePair`]. It survives controller resets by its [`Recovery`] policy. Dropping it hands
/// its memory back to the controller, which deletes the queues on the device before freeing it.
///
/// # Examples
///
/// Its own accessors, on the memory-backed stand-in device of the `fake` feature (see
/// [`crate::PcieController`]'s example), across a controller reset:
///
/// ```
/// use std::sync::Arc;
/// use nvpoll::api::{Controller, IoOp, IoRequest, QueuePair};
/// use nvpoll::mem::DmaPool;
/// use nvpoll_pcie::fake::{FakeConfig, FakeDevice};
/// use nvpoll_pcie::{PcieController, PcieOptions, Recovery};
///
/// let pool = DmaPool::builder().class(4096, 16).build()?;
/// let dev = Arc::new(FakeDevice::new(FakeConfig::default()));
/// let mut ctrl = PcieController::attach(dev, pool, PcieOptions::default())?;
/// let mut qp = ctrl.create_queue_pair(32)?;
/// assert!(qp.qid() >= 1);
/// assert_eq!(qp.recovery(), Recovery::Retry, "the default");
/// assert!(!qp.has_interrupt(), "polled only: no interrupts asked for");
/// assert_eq!(qp.interrupt_waits(), 0);
///
/// ctrl.reset()?;
/// qp.submit(IoRequest { op: IoOp::Flush, nsid: 1, lba: 0, blocks: 0, buf: None, tag: 0 }).map_err(|r| r.error)?;
/// qp.flush()?;
/// while qp.outstanding() > 0 {
///     qp.process_completions(16, |_, c| assert!(c.result.is_ok()))?;
/// }
/// assert!(!qp.is_recovering());
/// assert_eq!(qp.recovery_stats().resets, 1, "its queues were re-created after the reset");
/// assert!(qp.failure().is_none());
/// println!("{:?}", qp.stats());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct PcieQueuePair<D: Device = VfioDevice> {
    q: Queue<D>,
    batch: usize,
    max_transfer: u32,
    /// The epoch its queues exist in on the device (or last existed in, while waiting).
    epoch: u64,
    link: Link,
    shared: Arc<Shared>,
    namespaces: Vec<Namespace>,
    /// The queue's own memory (rings and PRP lists), mapped for DMA.
    pool: DmaPool,
    /// When the SQ tail doorbell is rung: inline from `submit`, at `flush`, or adaptive.
    policy: SendPolicy,
    // Recovery (cold).
    recovery: Recovery,
    max_retries: u8,
    /// Commands waiting for the re-created queues (Retry).
    waiting: VecDeque<Held>,
    /// Why the queue pair is waiting: a reset, or its own timeout that asked for one.
    cause: Failure,
    admin: Arc<Mutex<Queue<D>>>,
    admin_timeout: Duration,
    recreate_failures: u32,
    rstats: RecoveryStats,
    /// The eventfd its CQ's MSI-X vector signals ([`crate::PcieOptions::interrupts`]).
    irq: Option<Arc<OwnedFd>>,
    /// Times it let its reactor sleep with commands outstanding, waiting on `irq`.
    irq_waits: AtomicU64,
}

impl<D: Device> fmt::Debug for PcieQueuePair<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PcieQueuePair")
            .field("q", &self.q)
            .field("epoch", &self.epoch)
            .field("link", &self.link)
            .field("recovery", &self.recovery)
            .field("waiting", &self.waiting.len())
            .field("rstats", &self.rstats)
            .finish()
    }
}

fn reject(error: impl Into<nvpoll::Error>, request: IoRequest) -> Rejected {
    Rejected {
        error: error.into(),
        request,
    }
}

impl<D: Device> PcieQueuePair<D> {
    pub(crate) fn new(
        q: Queue<D>,
        opts: &QueueOptions,
        link: CtrlLink<D>,
        pool: DmaPool,
        irq: Option<Arc<OwnedFd>>,
    ) -> PcieQueuePair<D> {
        let batch = if opts.batch == 0 {
            q.depth()
        } else {
            usize::from(opts.batch)
        };
        let depth = q.depth();
        PcieQueuePair {
            q,
            batch,
            max_transfer: link.max_transfer,
            epoch: link.epoch,
            link: Link::Live,
            shared: link.shared,
            namespaces: link.namespaces,
            pool,
            policy: SendPolicy::new(SendMode::Deferred),
            recovery: opts.recovery.unwrap_or(link.recovery),
            max_retries: link.max_retries,
            waiting: VecDeque::with_capacity(depth),
            cause: Failure::Reset,
            admin: link.admin,
            admin_timeout: link.admin_timeout,
            recreate_failures: 0,
            rstats: RecoveryStats::default(),
            irq,
            irq_waits: AtomicU64::new(0),
        }
    }

    /// Whether its completions raise an interrupt its reactor can sleep on ([`crate::PcieOptions::interrupts`]).
    /// See [`PcieQueuePair`]'s example.
    pub fn has_interrupt(&self) -> bool {
        self.irq.is_some()
    }

    /// Times it let its reactor sleep with commands outstanding, to be woken by its interrupt.
    /// See [`PcieQueuePair`]'s example.
    pub fn interrupt_waits(&self) -> u64 {
        self.irq_waits.load(Ordering::Relaxed)
    }

    /// Queue ID.
    /// See [`PcieQueuePair`]'s example.
    pub fn qid(&self) -> u16 {
        self.q.qid()
    }

    /// The queue's counters.
    /// See [`PcieQueuePair`]'s example.
    pub fn stats(&self) -> QueueStats {
        self.q.stats
    }

    /// Counters of the recovery from controller resets.
    /// See [`PcieQueuePair`]'s example.
    pub fn recovery_stats(&self) -> RecoveryStats {
        self.rstats
    }

    /// The recovery policy of this queue pair.
    /// See [`PcieQueuePair`]'s example.
    pub fn recovery(&self) -> Recovery {
        self.recovery
    }

    /// Whether the queue pair is waiting for a controller reset to complete (its commands are held, or
    /// refused with [`Recovery::FailFast`]).
    /// See [`PcieQueuePair`]'s example.
    pub fn is_recovering(&self) -> bool {
        self.link == Link::Waiting
    }

    /// Why the queue pair failed for good, if it did.
    /// See [`PcieQueuePair`]'s example.
    pub fn failure(&self) -> Option<nvpoll::Error> {
        self.q.failure().map(Failure::to_error)
    }

    /// Whether its queues exist on the device in the controller's current epoch.
    #[inline]
    fn is_live(&self) -> bool {
        self.link == Link::Live && self.shared.epoch.load(Ordering::Acquire) == self.epoch
    }

    /// Looks at the controller: fails everything if it is gone, and stops using the rings (waiting) if a
    /// reset has begun.
    #[cold]
    fn sync_link(&mut self) {
        if self.link == Link::Dead {
            return;
        }
        if let Some(why) = self.shared.state.load().failure() {
            return self.die(why);
        }
        if self.link == Link::Live && self.shared.epoch.load(Ordering::Acquire) != self.epoch {
            self.link = Link::Waiting;
            self.cause = Failure::Reset;
        }
    }

    /// Fails every command (outstanding and held) with `why`; later submits are refused. Only once the
    /// device can no longer write their buffers (it is gone, stopped, or the queue pair saw a protocol
    /// violation).
    fn die(&mut self, why: Failure) {
        let n = self.q.outstanding() + self.waiting.len();
        self.q.fail(why.clone());
        while let Some(h) = self.waiting.pop_front() {
            self.q.push_done(Done {
                tag: h.tag,
                buf: h.buf,
                result: Err(why.clone()),
            });
        }
        self.rstats.failed += n as u64;
        self.link = Link::Dead;
    }

    fn dead_error(&self) -> nvpoll::Error {
        self.q.failure().map_or(
            nvpoll::Error::ConnectionLost("queue pair failed".into()),
            Failure::to_error,
        )
    }

    /// The outstanding commands made no progress within the timeout: ask for a reset and wait for it, or
    /// fail everything if the device is gone.
    #[cold]
    fn on_stall(&mut self) {
        self.rstats.timeouts += 1;
        if self.q.diagnose() == Failure::Removed {
            return self.die(Failure::Removed);
        }
        self.shared.reset_requested.store(true, Ordering::Release);
        self.link = Link::Waiting;
        self.cause = Failure::Timeout;
    }

    /// While waiting: once the controller has finished a reset, takes back what the device completed before
    /// it, re-creates the queues, and retries or fails the rest by the policy.
    #[cold]
    fn recover(&mut self) {
        let epoch = self.shared.epoch.load(Ordering::Acquire);
        if epoch == self.epoch || self.shared.ready.load(Ordering::Acquire) != epoch {
            return; // the reset has not begun (a timeout asked for it) or not finished
        }
        let admin = Arc::clone(&self.admin);
        let mut aq = lock_admin(&admin);
        // The controller moves the epoch only while it holds the admin queue: this look is stable.
        if self.shared.state.load() != CtrlState::Running
            || self.shared.epoch.load(Ordering::Acquire) != epoch
            || self.shared.ready.load(Ordering::Acquire) != epoch
        {
            return;
        }
        self.rstats.resets += 1;
        // The device completed these before the reset: they complete now, once, and are not retried.
        let n = self.q.drain_stale();
        self.rstats.completed_before_reset += n as u64;
        if let Some(f) = self.q.failure() {
            let f = f.clone();
            return self.die(f);
        }
        let taken = self.q.take_outstanding();
        self.q.reinit();
        let mut retry = Vec::with_capacity(taken.len());
        for h in taken {
            let why = match self.recovery {
                Recovery::FailFast => self.cause.clone(),
                Recovery::Retry if h.posted > self.max_retries => Failure::Retries,
                Recovery::Retry => {
                    retry.push(h);
                    continue;
                }
            };
            self.rstats.failed += 1;
            self.q.push_done(Done {
                tag: h.tag,
                buf: h.buf,
                result: Err(why),
            });
        }
        // Retried commands go before those accepted while waiting.
        for h in retry.into_iter().rev() {
            self.waiting.push_front(h);
        }
        let created = self.recreate(&mut aq);
        drop(aq);
        match created {
            Ok(()) => {
                self.epoch = epoch;
                self.link = Link::Live;
                self.cause = Failure::Reset;
                self.recreate_failures = 0;
                self.rstats.recreated += 1;
                self.resubmit();
            }
            Err(e @ Error::Command { .. }) => {
                let msg = format!(
                    "queue {} could not be re-created after a reset: {e}",
                    self.qid()
                );
                self.die(Failure::Protocol(msg));
            }
            Err(e) => {
                // The admin queue failed (timeout, fatal status): the controller resets again, and this queue
                // pair tries again in the next epoch.
                self.epoch = epoch;
                self.recreate_failures += 1;
                if self.recreate_failures >= RECREATE_ATTEMPTS {
                    let msg = format!(
                        "queue {} could not be re-created after {} resets: {e}",
                        self.qid(),
                        self.recreate_failures
                    );
                    self.die(Failure::Protocol(msg));
                } else {
                    self.shared.reset_requested.store(true, Ordering::Release);
                }
            }
        }
    }

    /// Creates the completion and submission queues on the device again, over the same (zeroed) rings.
    fn recreate(&mut self, aq: &mut Queue<D>) -> Result<(), Error> {
        aq.create_io_queues(&self.q, self.admin_timeout).1
    }

    /// Posts every waiting command on the re-created queues and rings the doorbell.
    fn resubmit(&mut self) {
        while let Some(h) = self.waiting.pop_front() {
            let (tag, again) = (h.tag, h.posted > 0);
            match self.q.submit_held(h) {
                Ok(()) if again => self.rstats.retried += 1,
                Ok(()) => {}
                Err((e, buf)) => {
                    // Cannot happen (the request was checked, and the queue is empty); fail it rather than
                    // lose it.
                    self.rstats.failed += 1;
                    self.q.push_done(Done {
                        tag,
                        buf,
                        result: Err(Failure::Protocol(format!(
                            "submitting a command again after a reset: {e}"
                        ))),
                    });
                }
            }
        }
        self.q.flush();
    }

    /// Builds the command for a request, or says why it cannot be sent.
    #[inline]
    fn command(&self, req: &mut IoRequest) -> Result<(Sqe, u32), nvpoll::Error> {
        check_request(req, &self.namespaces, self.max_transfer).map(|c| (c.sqe, c.len))
    }

    /// Submit while not live: refused when dead (or waiting, fail-fast), held when waiting (retry).
    #[cold]
    fn submit_recovering(&mut self, mut req: IoRequest) -> Result<(), Rejected> {
        self.sync_link();
        match self.link {
            Link::Dead => return Err(reject(self.dead_error(), req)),
            Link::Waiting if self.recovery == Recovery::FailFast => {
                let e = nvpoll::Error::ConnectionLost(
                    "the queue pair is waiting for a controller reset to complete".into(),
                );
                return Err(reject(e, req));
            }
            Link::Waiting => {}
            Link::Live => return self.submit_live(req),
        }
        let (sqe, len) = match self.command(&mut req) {
            Ok(c) => c,
            Err(e) => return Err(reject(e, req)),
        };
        if self.outstanding() >= self.depth() {
            return Err(reject(nvpoll::Error::QueueFull, req));
        }
        self.waiting.push_back(Held {
            sqe,
            buf: req.buf.take(),
            len,
            tag: req.tag,
            posted: 0,
        });
        self.rstats.held += 1;
        Ok(())
    }

    #[inline]
    fn submit_live(&mut self, mut req: IoRequest) -> Result<(), Rejected> {
        let (sqe, len) = match self.command(&mut req) {
            Ok(c) => c,
            Err(e) => return Err(reject(e, req)),
        };
        let buf = req.buf.take();
        match self.q.submit(sqe, buf, len, req.tag) {
            Ok(()) => {
                // The post/kick split: the send policy decides whether this submit rings the doorbell.
                let waiting = self.q.unrung() - 1;
                if self.policy.kick_now(waiting, self.q.outstanding() - 1) {
                    self.q.flush();
                }
                Ok(())
            }
            Err((e, buf)) => {
                req.buf = buf;
                Err(reject(e, req))
            }
        }
    }

    /// Poll while not live: notices resets and removal, and recovers once a reset has completed.
    #[cold]
    fn poll_recovering(&mut self) -> nvpoll::Result<usize> {
        let before = self.q.done_len();
        self.sync_link();
        if self.link == Link::Waiting {
            self.recover();
        }
        let n = self.q.done_len() - before;
        match self.link {
            Link::Dead => Err(self.dead_error()),
            _ => Ok(n),
        }
    }
}

impl<D: Device> QueuePair for PcieQueuePair<D> {
    #[inline]
    fn submit(&mut self, req: IoRequest) -> Result<(), Rejected> {
        if self.is_live() {
            self.submit_live(req)
        } else {
            self.submit_recovering(req)
        }
    }

    #[inline]
    fn flush(&mut self) -> nvpoll::Result<()> {
        match self.link {
            Link::Live => self.q.flush(),
            Link::Waiting => {} // held commands leave once the queues are re-created
            Link::Dead => return Err(self.dead_error()),
        }
        Ok(())
    }

    #[inline]
    fn poll(&mut self, max: usize) -> nvpoll::Result<usize> {
        if !self.is_live() {
            return self.poll_recovering();
        }
        let n = self.q.reap(max.min(self.batch));
        if n == 0 && self.q.stalled() {
            self.on_stall();
        }
        if let Some(f) = self.q.failure() {
            // A protocol violation (or removal found by the stall check): every command has been failed.
            self.link = Link::Dead;
            return Err(f.to_error());
        }
        Ok(n)
    }

    #[inline]
    fn pop_completion(&mut self) -> Option<Completion> {
        let d = self.q.pop_done()?;
        let result = d.result.map_err(|f| f.to_error());
        Some(Completion::from_result(d.tag, d.buf, result))
    }

    #[inline]
    fn outstanding(&self) -> usize {
        self.q.outstanding() + self.waiting.len()
    }

    #[inline]
    fn depth(&self) -> usize {
        self.q.depth()
    }

    /// With nothing outstanding and nothing to hand out, nothing can arrive: the reactor may sleep. With
    /// commands outstanding it may sleep only on its CQ's interrupt ([`crate::PcieOptions::interrupts`]);
    /// without one it must poll.
    fn wake_sources<'a>(&'a self, w: &mut nvpoll::reactor::WakeSources<'a>) -> bool {
        if self.q.has_done() {
            return false;
        }
        if self.outstanding() == 0 {
            return true;
        }
        let Some(fd) = &self.irq else {
            return false;
        };
        if !self.is_live() || !self.waiting.is_empty() {
            return false;
        }
        // Empty the eventfd, then look at the CQ: a completion posted before the read is found here, one
        // posted after it signals the eventfd again. (A failed read is an empty eventfd: EAGAIN.)
        let mut count = [0u8; 8];
        let _ = rustix::io::read(&**fd, &mut count);
        if self.q.cq_pending() {
            return false;
        }
        self.irq_waits.fetch_add(1, Ordering::Relaxed);
        w.readable(&**fd);
        true
    }

    fn set_send_mode(&mut self, mode: SendMode) -> nvpoll::Result<()> {
        self.policy.set_mode(mode);
        Ok(())
    }

    fn stats(&self) -> ApiQueueStats {
        let s = self.q.stats;
        ApiQueueStats {
            commands: s.submitted,
            pdus: s.submitted,
            writes: s.sq_doorbells,
            reads: s.polls - s.idle_polls,
            records: 0,
            record_bytes: 0,
            flushes: s.sq_doorbells,
            key_updates_sent: 0,
            key_updates_received: 0,
            retried: self.rstats.retried,
            reconnects: 0,
            longest_failover: std::time::Duration::ZERO,
        }
    }
}

impl<D: Device> Drop for PcieQueuePair<D> {
    fn drop(&mut self) {
        // The device may still write the rings and the buffers of outstanding commands until the controller
        // deletes the queues (or is reset), so both go to the controller rather than back to their pools;
        // so do the buffers of held commands (the reset they wait for may not have stopped the device yet).
        let mut held = self.q.take_buffers();
        held.extend(self.waiting.drain(..).filter_map(|h| h.buf));
        let retired = Retired {
            qid: self.q.qid(),
            epoch: self.epoch,
            pool: self.pool.clone(),
            held,
        };
        self.shared
            .retired
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(retired);
    }
}

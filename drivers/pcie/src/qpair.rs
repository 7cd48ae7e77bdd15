//! Submission/completion queue pairs: the admin queue's engine and the I/O queue pairs applications use.
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
//! A queue pair fails as a whole (every outstanding command completes with an error, later submits are
//! refused) when its controller is reset, removed or detached, when a command sees no progress within the
//! timeout, or when the controller completes an unknown command ID.

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvpoll::api::{Completion, IoOp, IoRequest, QueuePair, QueueStats as ApiQueueStats, Rejected};
use nvpoll::mem::{DmaBuf, DmaPool};
use nvpoll::send::{SendMode, SendPolicy};
use nvpoll::spec::{reg, Cqe, Csts, SglDescriptor, Sqe, CQE_SIZE, SQE_SIZE};

use crate::ctrl::{Retired, Shared, STATE_DETACHED, STATE_REMOVED};
use crate::mmio::{wmb, SharedMem};
use crate::prp::{self, Shape, PAGE_SIZE};
use crate::vfio::VfioDevice;
use crate::{Device, Error};

/// Counters of one queue, cheap enough to keep on the hot path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueStats {
    /// Commands posted to the submission queue.
    pub submitted: u64,
    /// Completions reaped.
    pub completed: u64,
    /// Calls to poll.
    pub polls: u64,
    /// Polls that found nothing.
    pub idle_polls: u64,
    /// Submission queue tail doorbell writes.
    pub sq_doorbells: u64,
    /// Completion queue head doorbell writes.
    pub cq_doorbells: u64,
    /// Commands that needed a PRP list.
    pub prp_lists: u64,
    /// Commands whose PRP list chained across list pages.
    pub prp_chained: u64,
    /// Commands whose data pointer was an SGL data block.
    pub sgls: u64,
}

/// Why a queue failed; every outstanding command of the queue completes with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The controller was reset.
    Reset,
    /// The controller object was dropped or shut down.
    Detached,
    /// The controller reported CSTS.CFS.
    Fatal,
    /// The controller's registers read as all ones.
    Removed,
    /// No command completed within the timeout.
    Timeout,
    /// The controller broke the protocol.
    Protocol(String),
}

impl Failure {
    fn to_error(&self) -> nvpoll::Error {
        match self {
            Failure::Reset => nvpoll::Error::Aborted("controller reset"),
            Failure::Detached => nvpoll::Error::Aborted("controller detached"),
            Failure::Fatal => nvpoll::Error::Transport("controller fatal status (CSTS.CFS)".into()),
            Failure::Removed => nvpoll::Error::Transport("controller removed".into()),
            Failure::Timeout => nvpoll::Error::Timeout,
            Failure::Protocol(s) => nvpoll::Error::Transport(s.clone()),
        }
    }

    fn to_pcie(&self) -> Error {
        match self {
            Failure::Reset => {
                Error::Dead("the controller was reset; create a new queue pair".into())
            }
            Failure::Detached => Error::Dead("the controller was shut down".into()),
            Failure::Fatal => Error::Fatal,
            Failure::Removed => Error::Removed,
            Failure::Timeout => Error::Timeout("a command completion"),
            Failure::Protocol(s) => Error::Protocol(s.clone()),
        }
    }
}

/// A finished command of a [`Queue`].
#[derive(Debug)]
pub(crate) struct Done {
    pub tag: u64,
    pub buf: Option<DmaBuf>,
    pub result: Result<Cqe, Failure>,
}

/// Whether a queue describes data with SGLs instead of PRPs, and the alignment the controller needs then.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SglMode {
    /// PRPs (dword-aligned buffers).
    Off,
    /// One SGL data block per command, any byte alignment (Identify SGLS bits 1:0 = 01b).
    AnyAlignment,
    /// One SGL data block per command, dword-aligned buffers (SGLS bits 1:0 = 10b).
    DwordAligned,
}

/// Per-command state: what to hand back, and the command's own PRP list memory.
struct Tracker {
    tag: u64,
    busy: bool,
    buf: Option<DmaBuf>,
    list: SharedMem,
}

/// How many empty polls with commands outstanding pass between two looks at the clock.
const STALL_POLLS: u32 = 4096;

/// The engine of one submission/completion queue pair (admin or I/O).
pub(crate) struct Queue<D: Device> {
    // Hot: touched by every command.
    sq: SharedMem,
    cq: SharedMem,
    sq_tail: u16,
    sq_rung: u16,
    cq_head: u16,
    entries: u16,
    phase: bool,
    sq_db: usize,
    cq_db: usize,
    outstanding: usize,
    dev: Arc<D>,
    trackers: Box<[Tracker]>,
    free: Vec<u16>,
    done: VecDeque<Done>,
    pub stats: QueueStats,
    // Cold.
    list_offset: usize,
    sgl: SglMode,
    qid: u16,
    failed: Option<Failure>,
    stall_polls: u32,
    stall_since: Option<Instant>,
    timeout: Duration,
}

impl<D: Device> fmt::Debug for Queue<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Queue")
            .field("qid", &self.qid)
            .field("entries", &self.entries)
            .field("outstanding", &self.outstanding)
            .field("sq_tail", &self.sq_tail)
            .field("cq_head", &self.cq_head)
            .field("phase", &self.phase)
            .field("failed", &self.failed)
            .field("stats", &self.stats)
            .finish()
    }
}

/// Sizes of one queue's memory.
#[derive(Clone, Copy, Debug)]
pub(crate) struct QueueLayout {
    /// Slots in each ring (one more than the commands that may be outstanding).
    pub entries: u16,
    /// Trackers (commands that may be outstanding).
    pub trackers: u16,
    /// Bytes of PRP list memory per tracker (a multiple of 4 KiB).
    pub list_bytes: usize,
    /// Where each tracker's list starts in its memory.
    pub list_offset: usize,
}

impl QueueLayout {
    /// The layout for `depth` outstanding commands of at most `max_transfer` bytes each.
    pub fn new(depth: u16, max_transfer: u32, list_offset: usize) -> QueueLayout {
        // The worst case starts 4 bytes before a page boundary.
        let entries = prp::list_entries(PAGE_SIZE - 4, max_transfer, list_offset as u64);
        let list_bytes = (list_offset + entries * 8)
            .max(1)
            .next_multiple_of(PAGE_SIZE as usize);
        QueueLayout {
            entries: depth + 1,
            trackers: depth,
            list_bytes,
            list_offset,
        }
    }

    /// Adds the size classes this queue needs to a pool builder.
    pub fn pool_classes(&self, b: nvpoll::mem::DmaPoolBuilder) -> nvpoll::mem::DmaPoolBuilder {
        let pow2 = |n: usize| n.next_power_of_two().max(4096);
        b.class(pow2(usize::from(self.entries) * SQE_SIZE), 1)
            .class(pow2(usize::from(self.entries) * CQE_SIZE), 1)
            .class(pow2(self.list_bytes), usize::from(self.trackers))
    }
}

impl<D: Device> Queue<D> {
    /// Allocates the queue's memory from `pool` (already mapped for DMA). The caller creates the queue on
    /// the controller (or programs AQA/ASQ/ACQ for the admin queue).
    pub fn new(
        dev: Arc<D>,
        pool: &DmaPool,
        qid: u16,
        layout: QueueLayout,
        dstrd: u8,
        timeout: Duration,
    ) -> Result<Queue<D>, Error> {
        let alloc = |len: usize| pool.alloc(len).map(SharedMem::new).map_err(Error::Memory);
        let sq = alloc(usize::from(layout.entries) * SQE_SIZE)?;
        let cq = alloc(usize::from(layout.entries) * CQE_SIZE)?;
        let mut trackers = Vec::with_capacity(usize::from(layout.trackers));
        for _ in 0..layout.trackers {
            trackers.push(Tracker {
                tag: 0,
                busy: false,
                buf: None,
                list: alloc(layout.list_bytes)?,
            });
        }
        Ok(Queue {
            sq,
            cq,
            sq_tail: 0,
            sq_rung: 0,
            cq_head: 0,
            entries: layout.entries,
            phase: true,
            sq_db: reg::sq_tail_doorbell(qid, dstrd),
            cq_db: reg::cq_head_doorbell(qid, dstrd),
            outstanding: 0,
            dev,
            trackers: trackers.into_boxed_slice(),
            free: (0..layout.trackers).rev().collect(),
            done: VecDeque::with_capacity(usize::from(layout.trackers)),
            stats: QueueStats::default(),
            list_offset: layout.list_offset,
            sgl: SglMode::Off,
            qid,
            failed: None,
            stall_polls: 0,
            stall_since: None,
            timeout,
        })
    }

    pub fn qid(&self) -> u16 {
        self.qid
    }

    /// Describes data with SGLs from now on (an I/O queue of a controller that supports them).
    pub fn set_sgl(&mut self, mode: SglMode) {
        self.sgl = mode;
    }

    pub fn sq_iova(&self) -> u64 {
        self.sq.iova()
    }

    pub fn cq_iova(&self) -> u64 {
        self.cq.iova()
    }

    pub fn entries(&self) -> u16 {
        self.entries
    }

    pub fn outstanding(&self) -> usize {
        self.outstanding
    }

    pub fn depth(&self) -> usize {
        self.trackers.len()
    }

    pub fn failure(&self) -> Option<&Failure> {
        self.failed.as_ref()
    }

    /// Posts one command: `len` bytes of `buf` (from its visible window's start) are the data, described by
    /// PRPs in the data pointer; with `len` 0 the data pointer is left as the caller set it (queue creation
    /// puts the queue's address there). On error the buffer is handed back.
    #[inline]
    pub fn submit(
        &mut self,
        mut sqe: Sqe,
        buf: Option<DmaBuf>,
        len: u32,
        tag: u64,
    ) -> Result<(), (Error, Option<DmaBuf>)> {
        if let Some(f) = &self.failed {
            return Err((f.to_pcie(), buf));
        }
        let Some(&cid) = self.free.last() else {
            return Err((Error::QueueFull, buf));
        };
        let t = &mut self.trackers[usize::from(cid)];
        if len > 0 {
            let Some(b) = buf.as_ref() else {
                return Err((
                    Error::InvalidArgument("a data command needs a buffer".into()),
                    buf,
                ));
            };
            if b.len() < len as usize {
                let msg = format!(
                    "buffer of {} bytes is shorter than the transfer ({len})",
                    b.len()
                );
                return Err((Error::InvalidArgument(msg), buf));
            }
            let iova = b.iova();
            match self.sgl {
                SglMode::Off => match prp::build(iova, len, &mut t.list, self.list_offset) {
                    Ok(p) => {
                        match p.shape {
                            Shape::List => self.stats.prp_lists += 1,
                            Shape::ChainedList => {
                                self.stats.prp_lists += 1;
                                self.stats.prp_chained += 1;
                            }
                            _ => {}
                        }
                        sqe.flags &= !0xc0; // PSDT 0: PRPs
                        sqe.dptr1 = p.prp1;
                        sqe.dptr2 = p.prp2;
                    }
                    Err(e) => return Err((Error::InvalidArgument(e.to_string()), buf)),
                },
                SglMode::DwordAligned if iova & 3 != 0 => {
                    let msg = format!("buffer at IOVA {iova:#x} is not dword aligned (the controller's SGLs need it)");
                    return Err((Error::InvalidArgument(msg), buf));
                }
                _ => {
                    // A DmaBuf is contiguous in IOVA space: one data block describes any transfer.
                    sqe.set_sgl(&SglDescriptor::data_block(iova, len));
                    self.stats.sgls += 1;
                }
            }
        }
        self.free.pop();
        sqe.cid = cid;
        self.sq.write_sqe(usize::from(self.sq_tail), &sqe);
        self.sq_tail += 1;
        if self.sq_tail == self.entries {
            self.sq_tail = 0;
        }
        t.tag = tag;
        t.buf = buf;
        t.busy = true;
        self.outstanding += 1;
        self.stats.submitted += 1;
        Ok(())
    }

    /// Rings the submission queue doorbell if the tail moved since the last ring.
    #[inline]
    /// Commands posted and not yet announced by a doorbell.
    pub fn unrung(&self) -> usize {
        usize::from((self.sq_tail + self.entries - self.sq_rung) % self.entries)
    }

    pub fn flush(&mut self) {
        if self.sq_tail != self.sq_rung {
            wmb();
            self.dev.write32(self.sq_db, u32::from(self.sq_tail));
            self.sq_rung = self.sq_tail;
            self.stats.sq_doorbells += 1;
        }
    }

    /// Reaps up to `max` completions into the done list and rings the completion doorbell once if any.
    #[inline]
    pub fn reap(&mut self, max: usize) -> usize {
        self.stats.polls += 1;
        let mut n = 0;
        while n < max {
            let Some(cqe) = self.cq.read_cqe(usize::from(self.cq_head), self.phase) else {
                break;
            };
            self.cq_head += 1;
            if self.cq_head == self.entries {
                self.cq_head = 0;
                self.phase = !self.phase;
            }
            n += 1;
            self.complete(cqe);
        }
        if n > 0 {
            self.dev.write32(self.cq_db, u32::from(self.cq_head));
            self.stats.cq_doorbells += 1;
            self.stats.completed += n as u64;
            self.stall_polls = 0;
            self.stall_since = None;
        } else {
            self.stats.idle_polls += 1;
        }
        n
    }

    #[inline]
    fn complete(&mut self, cqe: Cqe) {
        let cid = usize::from(cqe.cid);
        match self.trackers.get_mut(cid) {
            Some(t) if t.busy => {
                t.busy = false;
                let buf = t.buf.take();
                let tag = t.tag;
                self.free.push(cqe.cid);
                self.outstanding -= 1;
                self.done.push_back(Done {
                    tag,
                    buf,
                    result: Ok(cqe),
                });
            }
            _ => self.fail(Failure::Protocol(format!(
                "queue {} got a completion for command id {cid}, which is not outstanding",
                self.qid
            ))),
        }
    }

    /// Whether the commands outstanding have made no progress for longer than the timeout. Reads the clock
    /// only once every [`STALL_POLLS`] empty polls.
    #[inline]
    pub fn stalled(&mut self) -> bool {
        if self.outstanding == 0 {
            self.stall_polls = 0;
            self.stall_since = None;
            return false;
        }
        self.stall_polls += 1;
        if self.stall_polls < STALL_POLLS {
            return false;
        }
        self.stall_polls = 0;
        let now = Instant::now();
        match self.stall_since {
            None => {
                self.stall_since = Some(now);
                false
            }
            Some(t) => now.duration_since(t) >= self.timeout,
        }
    }

    /// Fails the queue: every outstanding command completes with `why`, and later submits are refused.
    pub fn fail(&mut self, why: Failure) {
        for (cid, t) in self.trackers.iter_mut().enumerate() {
            if t.busy {
                t.busy = false;
                self.free.push(cid as u16);
                self.outstanding -= 1;
                self.done.push_back(Done {
                    tag: t.tag,
                    buf: t.buf.take(),
                    result: Err(why.clone()),
                });
            }
        }
        if self.failed.is_none() {
            self.failed = Some(why);
        }
    }

    /// Makes the queue usable again after a controller reset: empty rings, tail and head at 0, phase 1.
    /// Outstanding commands must have been failed first.
    pub fn reinit(&mut self) {
        debug_assert_eq!(self.outstanding, 0);
        self.sq.zero();
        self.cq.zero();
        self.sq_tail = 0;
        self.sq_rung = 0;
        self.cq_head = 0;
        self.phase = true;
        self.failed = None;
        self.stall_polls = 0;
        self.stall_since = None;
    }

    pub fn pop_done(&mut self) -> Option<Done> {
        self.done.pop_front()
    }

    /// Removes the finished command with `tag`, if it is done.
    pub fn take_done(&mut self, tag: u64) -> Option<Done> {
        let i = self.done.iter().position(|d| d.tag == tag)?;
        self.done.remove(i)
    }

    /// Takes every data buffer still held by a tracker (the device may still write them).
    pub fn take_buffers(&mut self) -> Vec<DmaBuf> {
        self.trackers
            .iter_mut()
            .filter_map(|t| t.buf.take())
            .collect()
    }

    /// Why the controller stopped answering: removed (all-ones registers), fatal status, or plain timeout.
    pub fn diagnose(&self) -> Failure {
        let csts = self.dev.read32(reg::CSTS as usize);
        if csts == u32::MAX {
            Failure::Removed
        } else if Csts(csts).cfs() {
            Failure::Fatal
        } else {
            Failure::Timeout
        }
    }
}

/// Options of one I/O queue pair.
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
}

impl QueueOptions {
    /// A queue pair of `depth` commands with the defaults.
    pub fn new(depth: u16) -> QueueOptions {
        QueueOptions {
            depth,
            prp_list_offset: 0,
            batch: 0,
            sgl: false,
        }
    }
}

/// One namespace as a queue pair checks requests against it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct NsInfo {
    pub nsid: u32,
    pub block_shift: u32,
    pub blocks: u64,
}

/// An NVMe I/O queue pair over PCIe, owned by one reactor (or thread).
///
/// Create it with [`crate::PcieController::create_queue_pair`] (or `create_queue_pair_with`), move it to
/// its reactor, and drive it through [`nvpoll::api::QueuePair`]. Dropping it hands its memory back to the
/// controller, which deletes the queues on the device before freeing it.
pub struct PcieQueuePair<D: Device = VfioDevice> {
    q: Queue<D>,
    batch: usize,
    max_transfer: u32,
    epoch: u64,
    shared: Arc<Shared>,
    namespaces: Vec<NsInfo>,
    /// The queue's own memory (rings and PRP lists), mapped for DMA.
    pool: DmaPool,
    /// When the SQ tail doorbell is rung: inline from `submit`, at `flush`, or adaptive.
    policy: SendPolicy,
}

impl<D: Device> fmt::Debug for PcieQueuePair<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PcieQueuePair")
            .field("q", &self.q)
            .field("epoch", &self.epoch)
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
        max_transfer: u32,
        epoch: u64,
        shared: Arc<Shared>,
        namespaces: Vec<NsInfo>,
        pool: DmaPool,
    ) -> PcieQueuePair<D> {
        let batch = if opts.batch == 0 {
            q.depth()
        } else {
            usize::from(opts.batch)
        };
        PcieQueuePair {
            q,
            batch,
            max_transfer,
            epoch,
            shared,
            namespaces,
            pool,
            policy: SendPolicy::new(SendMode::Deferred),
        }
    }

    /// Queue ID.
    pub fn qid(&self) -> u16 {
        self.q.qid()
    }

    /// The queue's counters.
    pub fn stats(&self) -> QueueStats {
        self.q.stats
    }

    /// Why the queue pair failed, if it did.
    pub fn failure(&self) -> Option<nvpoll::Error> {
        self.q.failure().map(Failure::to_error)
    }

    /// Fails the queue if the controller was reset, removed or detached since it was created.
    #[inline]
    fn check_epoch(&mut self) -> bool {
        if self.shared.epoch.load(Ordering::Acquire) == self.epoch {
            return true;
        }
        if self.q.failure().is_none() {
            let why = match self.shared.state.load(Ordering::Acquire) {
                STATE_DETACHED => Failure::Detached,
                STATE_REMOVED => Failure::Removed,
                _ => Failure::Reset,
            };
            self.q.fail(why);
        }
        false
    }

    #[inline]
    fn ns(&self, nsid: u32) -> Option<&NsInfo> {
        self.namespaces.iter().find(|n| n.nsid == nsid)
    }
}

impl<D: Device> QueuePair for PcieQueuePair<D> {
    #[inline]
    fn submit(&mut self, mut req: IoRequest) -> Result<(), Rejected> {
        if !self.check_epoch() {
            let e = self
                .q
                .failure()
                .map_or(Error::Dead("queue failed".into()), Failure::to_pcie);
            return Err(reject(e, req));
        }
        let Some(&ns) = self.ns(req.nsid) else {
            let msg = format!("namespace {} is not active on this controller", req.nsid);
            return Err(reject(nvpoll::Error::InvalidArgument(msg), req));
        };
        let (sqe, len) = match req.op {
            IoOp::Flush => (Sqe::flush(req.nsid), 0),
            op => {
                if req.blocks == 0 || req.blocks > 0x1_0000 {
                    let msg = format!("{} blocks: one command carries 1 to 65536", req.blocks);
                    return Err(reject(nvpoll::Error::InvalidArgument(msg), req));
                }
                if req
                    .lba
                    .checked_add(u64::from(req.blocks))
                    .is_none_or(|end| end > ns.blocks)
                {
                    let msg = format!(
                        "blocks {}+{} are beyond the namespace's {}",
                        req.lba, req.blocks, ns.blocks
                    );
                    return Err(reject(nvpoll::Error::InvalidArgument(msg), req));
                }
                let nlb = (req.blocks - 1) as u16;
                let bytes = u64::from(req.blocks) << ns.block_shift;
                match op {
                    IoOp::WriteZeroes => (Sqe::write_zeroes(req.nsid, req.lba, nlb), 0),
                    _ if bytes > u64::from(self.max_transfer) => {
                        let msg = format!(
                            "a transfer of {bytes} bytes exceeds the controller's maximum of {}",
                            self.max_transfer
                        );
                        return Err(reject(nvpoll::Error::InvalidArgument(msg), req));
                    }
                    IoOp::Read => (Sqe::read(req.nsid, req.lba, nlb), bytes as u32),
                    _ => (Sqe::write(req.nsid, req.lba, nlb), bytes as u32),
                }
            }
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

    #[inline]
    fn flush(&mut self) -> nvpoll::Result<()> {
        if let Some(f) = self.q.failure() {
            return Err(f.to_error());
        }
        self.q.flush();
        Ok(())
    }

    #[inline]
    fn poll(&mut self, max: usize) -> nvpoll::Result<usize> {
        if !self.check_epoch() {
            return Err(self.q.failure().map_or(
                nvpoll::Error::Aborted("controller reset"),
                Failure::to_error,
            ));
        }
        if let Some(f) = self.q.failure() {
            return Err(f.to_error());
        }
        let n = self.q.reap(max.min(self.batch));
        if n == 0 && self.q.stalled() {
            let why = self.q.diagnose();
            if why != Failure::Removed {
                self.shared.reset_requested.store(true, Ordering::Release);
            }
            self.q.fail(why);
        }
        match self.q.failure() {
            Some(f) => Err(f.to_error()),
            None => Ok(n),
        }
    }

    #[inline]
    fn pop_completion(&mut self) -> Option<Completion> {
        let d = self.q.pop_done()?;
        let result = match d.result {
            Ok(cqe) if cqe.status().is_success() => Ok(()),
            Ok(cqe) => Err(nvpoll::Error::Nvme(cqe.status())),
            Err(f) => Err(f.to_error()),
        };
        Some(Completion {
            tag: d.tag,
            buf: d.buf,
            result,
        })
    }

    #[inline]
    fn outstanding(&self) -> usize {
        self.q.outstanding()
    }

    #[inline]
    fn depth(&self) -> usize {
        self.q.depth()
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
            retried: 0,
        }
    }
}

impl<D: Device> Drop for PcieQueuePair<D> {
    fn drop(&mut self) {
        // The device may still write the rings and the buffers of outstanding commands until the controller
        // deletes the queues (or is reset), so both go to the controller rather than back to their pools.
        let held = self.q.take_buffers();
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

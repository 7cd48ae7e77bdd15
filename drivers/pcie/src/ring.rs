//! The ring engine of one submission/completion queue pair, admin or I/O: command IDs and trackers, PRP lists
//! or SGL data blocks, posting SQEs, ringing doorbells, reaping CQEs by phase tag, timeouts, and running one
//! admin command to completion. It knows nothing of controller resets: the I/O queue pair ([`crate::qpair`])
//! and the controller ([`crate::ctrl`]) build on it.

use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nvpoll::mem::{DmaBuf, DmaPool};
use nvpoll::spec::{reg, Cqe, Csts, SglDescriptor, Sqe, CQE_SIZE, SQE_SIZE};

use crate::device::Device;
use crate::error::{Dead, Error};
use crate::mmio::{wmb, SharedMem};
use crate::prp::{self, Shape, PAGE_SIZE};

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
    /// The controller could not be brought back by a reset and was given up.
    Lost,
    /// The command was outstanding across more resets than the retry limit allows.
    Retries,
}

impl Failure {
    /// The API error a command of a queue that failed this way completes with: an abort where the
    /// controller is being reset or shut down (the command may be retried), a timeout, and otherwise the
    /// driver's error ([`Failure::to_pcie`]) as the source of a connection-lost or protocol error.
    pub(crate) fn to_error(&self) -> nvpoll::Error {
        match self {
            Failure::Reset => nvpoll::Error::Aborted("controller reset"),
            Failure::Detached => nvpoll::Error::Aborted("controller detached"),
            Failure::Retries => {
                nvpoll::Error::Aborted("controller reset (the command's retries are used up)")
            }
            Failure::Timeout => nvpoll::Error::Timeout,
            Failure::Fatal | Failure::Removed | Failure::Protocol(_) | Failure::Lost => {
                self.to_pcie().into()
            }
        }
    }

    /// The driver's error for a queue that failed this way (what a command run to completion returns).
    pub(crate) fn to_pcie(&self) -> Error {
        match self {
            Failure::Reset => Error::Dead(Dead::Reset),
            Failure::Detached => Error::Dead(Dead::ShutDown),
            Failure::Fatal => Error::Fatal,
            Failure::Removed => Error::Removed,
            Failure::Timeout => Error::Timeout("a command completion"),
            Failure::Protocol(s) => Error::Protocol(s.clone()),
            Failure::Lost => Error::Dead(Dead::GivenUp),
            Failure::Retries => Error::Dead(Dead::RetriesUsedUp),
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

/// Per-command state: what to hand back, what to submit again after a controller reset, and the command's
/// own PRP list memory.
struct Tracker {
    tag: u64,
    busy: bool,
    /// Times the command has been posted (1, plus one per retry after a reset).
    posted: u8,
    /// Data bytes (0: the data pointer is the caller's).
    len: u32,
    /// Submission order, to submit again in the same order.
    seq: u64,
    buf: Option<DmaBuf>,
    /// The command as posted (its command ID and data pointer are rewritten when it is posted again).
    sqe: Sqe,
    list: SharedMem,
}

/// A command that is not on the device: taken back after a reset, or accepted while waiting for one.
#[derive(Debug)]
pub(crate) struct Held {
    pub sqe: Sqe,
    pub buf: Option<DmaBuf>,
    pub len: u32,
    pub tag: u64,
    /// Times it has been posted to the device (0: accepted while the queue pair waited for a reset).
    pub posted: u8,
}

/// The tag of the one command [`Queue::run`] runs at a time.
const RUN_TAG: u64 = u64::MAX;

/// How many empty polls with commands outstanding pass between two looks at the clock.
const STALL_POLLS: u32 = 4096;

/// The engine of one submission/completion queue pair (admin or I/O).
///
/// `repr(C)` keeps the fields in the order written: what every submit and reap touches comes first, the
/// ring indexes and the doorbell offsets in the first cache line (asserted below), the rest of the hot
/// fields right after, and the cold ones last.
#[repr(C)]
pub(crate) struct Queue<D: Device> {
    // Hot: touched by every command. The first cache line:
    sq_tail: u16,
    sq_rung: u16,
    cq_head: u16,
    entries: u16,
    phase: bool,
    sq_db: usize,
    cq_db: usize,
    outstanding: usize,
    // then:
    sq: SharedMem,
    cq: SharedMem,
    dev: Arc<D>,
    trackers: Box<[Tracker]>,
    free: Vec<u16>,
    done: VecDeque<Done>,
    pub stats: QueueStats,
    // Cold.
    list_offset: usize,
    sgl: SglMode,
    /// The MSI-X vector of an I/O queue's CQ (None: polled, interrupts off).
    irq: Option<u16>,
    qid: u16,
    failed: Option<Failure>,
    stall_polls: u32,
    stall_since: Option<Instant>,
    timeout: Duration,
    next_seq: u64,
}

// The ring indexes, the phase, the doorbell offsets and the outstanding count share the first cache line.
const _: () = assert!(
    std::mem::offset_of!(Queue<crate::vfio::VfioDevice>, outstanding)
        + std::mem::size_of::<usize>()
        <= 64
);

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
    pub(crate) fn new(depth: u16, max_transfer: u32, list_offset: usize) -> QueueLayout {
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
    pub(crate) fn pool_classes(
        &self,
        b: nvpoll::mem::DmaPoolBuilder,
    ) -> nvpoll::mem::DmaPoolBuilder {
        let pow2 = |n: usize| n.next_power_of_two().max(4096);
        b.class(pow2(usize::from(self.entries) * SQE_SIZE), 1)
            .class(pow2(usize::from(self.entries) * CQE_SIZE), 1)
            .class(pow2(self.list_bytes), usize::from(self.trackers))
    }
}

impl<D: Device> Queue<D> {
    /// Allocates the queue's memory from `pool` (already mapped for DMA). The caller creates the queue on
    /// the controller (or programs AQA/ASQ/ACQ for the admin queue).
    pub(crate) fn new(
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
                posted: 0,
                len: 0,
                seq: 0,
                buf: None,
                sqe: Sqe::default(),
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
            irq: None,
            qid,
            failed: None,
            stall_polls: 0,
            stall_since: None,
            timeout,
            next_seq: 0,
        })
    }

    pub(crate) fn qid(&self) -> u16 {
        self.qid
    }

    /// Creates the CQ of this I/O queue with interrupts on MSI-X vector `vector` (at the next
    /// [`Queue::create_io_queues`]).
    pub(crate) fn set_irq(&mut self, vector: Option<u16>) {
        self.irq = vector;
    }

    /// Whether the device has posted a completion at the CQ head that nobody reaped yet.
    pub(crate) fn cq_pending(&self) -> bool {
        self.cq
            .read_cqe(usize::from(self.cq_head), self.phase)
            .is_some()
    }

    /// Describes data with SGLs from now on (an I/O queue of a controller that supports them).
    pub(crate) fn set_sgl(&mut self, mode: SglMode) {
        self.sgl = mode;
    }

    pub(crate) fn sq_iova(&self) -> u64 {
        self.sq.iova()
    }

    pub(crate) fn cq_iova(&self) -> u64 {
        self.cq.iova()
    }

    pub(crate) fn entries(&self) -> u16 {
        self.entries
    }

    pub(crate) fn outstanding(&self) -> usize {
        self.outstanding
    }

    pub(crate) fn depth(&self) -> usize {
        self.trackers.len()
    }

    pub(crate) fn failure(&self) -> Option<&Failure> {
        self.failed.as_ref()
    }

    /// Posts one command: `len` bytes of `buf` (from its visible window's start) are the data, described by
    /// PRPs in the data pointer; with `len` 0 the data pointer is left as the caller set it (queue creation
    /// puts the queue's address there). On error the buffer is handed back.
    #[inline]
    pub(crate) fn submit(
        &mut self,
        sqe: Sqe,
        buf: Option<DmaBuf>,
        len: u32,
        tag: u64,
    ) -> Result<(), (Error, Option<DmaBuf>)> {
        self.post(sqe, buf, len, tag, 0)
    }

    /// Posts a command taken back after a reset (or held while waiting for one). On error the buffer is
    /// handed back.
    pub(crate) fn submit_held(&mut self, h: Held) -> Result<(), (Error, Option<DmaBuf>)> {
        self.post(h.sqe, h.buf, h.len, h.tag, h.posted)
    }

    /// [`Queue::submit`] of a command posted `posted` times before.
    #[inline]
    fn post(
        &mut self,
        mut sqe: Sqe,
        buf: Option<DmaBuf>,
        len: u32,
        tag: u64,
        posted: u8,
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
        t.posted = posted.saturating_add(1);
        t.len = len;
        t.seq = self.next_seq;
        t.sqe = sqe;
        self.next_seq += 1;
        self.outstanding += 1;
        self.stats.submitted += 1;
        Ok(())
    }

    /// Commands posted and not yet announced by a doorbell.
    #[inline]
    pub(crate) fn unrung(&self) -> usize {
        usize::from((self.sq_tail + self.entries - self.sq_rung) % self.entries)
    }

    /// Rings the submission queue doorbell if the tail moved since the last ring.
    #[inline]
    pub(crate) fn flush(&mut self) {
        if self.sq_tail != self.sq_rung {
            wmb();
            self.dev.write32(self.sq_db, u32::from(self.sq_tail));
            self.sq_rung = self.sq_tail;
            self.stats.sq_doorbells += 1;
        }
    }

    /// The completion at the CQ head if the device has posted it (its phase tag is current), with the head
    /// moved past it (and the phase flipped at the wrap).
    #[inline]
    fn next_cqe(&mut self) -> Option<Cqe> {
        let cqe = self.cq.read_cqe(usize::from(self.cq_head), self.phase)?;
        self.cq_head += 1;
        if self.cq_head == self.entries {
            self.cq_head = 0;
            self.phase = !self.phase;
        }
        Some(cqe)
    }

    /// Reaps up to `max` completions into the done list and rings the completion doorbell once if any.
    #[inline]
    pub(crate) fn reap(&mut self, max: usize) -> usize {
        self.stats.polls += 1;
        let mut n = 0;
        while n < max {
            let Some(cqe) = self.next_cqe() else {
                break;
            };
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
    pub(crate) fn stalled(&mut self) -> bool {
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
    pub(crate) fn fail(&mut self, why: Failure) {
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
    pub(crate) fn reinit(&mut self) {
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

    /// Whether finished commands wait to be handed out.
    pub(crate) fn has_done(&self) -> bool {
        !self.done.is_empty()
    }

    pub(crate) fn pop_done(&mut self) -> Option<Done> {
        self.done.pop_front()
    }

    /// Removes the finished command with `tag`, if it is done.
    pub(crate) fn take_done(&mut self, tag: u64) -> Option<Done> {
        let i = self.done.iter().position(|d| d.tag == tag)?;
        self.done.remove(i)
    }

    /// Takes every data buffer still held by a tracker (the device may still write them).
    pub(crate) fn take_buffers(&mut self) -> Vec<DmaBuf> {
        self.trackers
            .iter_mut()
            .filter_map(|t| t.buf.take())
            .collect()
    }

    /// Why the controller stopped answering: removed (all-ones registers, and the function no longer
    /// answers), fatal status, or plain timeout (also when the registers are briefly out of reach).
    pub(crate) fn diagnose(&self) -> Failure {
        let csts = self.dev.read32(reg::CSTS as usize);
        if csts == u32::MAX {
            if self.dev.is_present() {
                Failure::Timeout
            } else {
                Failure::Removed
            }
        } else if Csts(csts).cfs() {
            Failure::Fatal
        } else {
            Failure::Timeout
        }
    }

    /// After a controller reset has completed: reaps what the device completed before it from the old
    /// completion queue, without ringing the doorbell of a queue the device no longer has. Returns how many
    /// commands it completed.
    pub(crate) fn drain_stale(&mut self) -> usize {
        let mut n = 0;
        while n < usize::from(self.entries) && self.failed.is_none() {
            let Some(cqe) = self.next_cqe() else {
                break;
            };
            n += 1;
            self.complete(cqe);
        }
        self.stats.completed += n as u64;
        n
    }

    /// Takes every outstanding command back, in submission order, and frees its tracker. Only once the
    /// device can no longer touch them (after a reset).
    pub(crate) fn take_outstanding(&mut self) -> Vec<Held> {
        let mut taken = Vec::with_capacity(self.outstanding);
        for (cid, t) in self.trackers.iter_mut().enumerate() {
            if t.busy {
                t.busy = false;
                self.free.push(cid as u16);
                taken.push((
                    t.seq,
                    Held {
                        sqe: t.sqe,
                        buf: t.buf.take(),
                        len: t.len,
                        tag: t.tag,
                        posted: t.posted,
                    },
                ));
            }
        }
        self.outstanding = 0;
        taken.sort_unstable_by_key(|(seq, _)| *seq);
        taken.into_iter().map(|(_, h)| h).collect()
    }

    /// Adds a finished command to the done list (one the queue pair completed itself).
    pub(crate) fn push_done(&mut self, d: Done) {
        self.done.push_back(d);
    }

    /// Finished commands not yet taken.
    pub(crate) fn done_len(&self) -> usize {
        self.done.len()
    }

    /// Runs one command to completion (the admin queue: bring-up, queue creation) and returns its completion,
    /// whatever the status. Gives up after `timeout`, and early when the controller reports a fatal status
    /// or is gone; the queue has failed then.
    pub(crate) fn run(
        &mut self,
        sqe: Sqe,
        buf: Option<DmaBuf>,
        len: u32,
        timeout: Duration,
    ) -> Result<(Cqe, Option<DmaBuf>), Error> {
        if let Some(f) = self.failure() {
            return Err(f.to_pcie());
        }
        self.submit(sqe, buf, len, RUN_TAG).map_err(|(e, _)| e)?;
        self.flush();
        let deadline = Instant::now() + timeout;
        let mut spins = 0u32;
        loop {
            self.reap(usize::MAX);
            if let Some(d) = self.take_done(RUN_TAG) {
                return match d.result {
                    Ok(cqe) => Ok((cqe, d.buf)),
                    Err(f) => Err(f.to_pcie()),
                };
            }
            if let Some(f) = self.failure() {
                return Err(f.to_pcie());
            }
            spins = spins.wrapping_add(1);
            if spins % 256 == 0 {
                let why = self.diagnose();
                if why != Failure::Timeout || Instant::now() >= deadline {
                    self.fail(why.clone());
                    // Drop the failed command's completion; the caller gets the error.
                    let _ = self.take_done(RUN_TAG);
                    return Err(match why {
                        Failure::Timeout => Error::Timeout("an admin command completion"),
                        other => other.to_pcie(),
                    });
                }
            }
            std::hint::spin_loop();
        }
    }

    /// Creates the completion and submission queues of `io` on the device, this queue being the admin queue:
    /// Create I/O Completion Queue, then Create I/O Submission Queue (same ID and depth), and when the second
    /// fails, Delete I/O Completion Queue again. Returns how many admin commands it posted, and the outcome.
    /// Both the first creation (by the controller) and the re-creation after a reset (by the queue pair) use it.
    pub(crate) fn create_io_queues(
        &mut self,
        io: &Queue<D>,
        timeout: Duration,
    ) -> (u64, Result<(), Error>) {
        let (qid, size) = (io.qid(), io.entries() - 1);
        let cq = Sqe::create_io_cq(qid, size, io.cq_iova(), io.irq);
        if let Err(e) = self.run_checked(cq, None, 0, timeout, "Create I/O Completion Queue") {
            return (1, Err(e));
        }
        let sq = Sqe::create_io_sq(qid, size, io.sq_iova(), qid);
        match self.run_checked(sq, None, 0, timeout, "Create I/O Submission Queue") {
            Ok(_) => (2, Ok(())),
            Err(e) => {
                // Best effort: the queue pair is not created either way, and the error that counts is the SQ's.
                let _ = self.run(Sqe::delete_io_cq(qid), None, 0, timeout);
                (3, Err(e))
            }
        }
    }

    /// [`Queue::run`], with a non-success status as an [`Error::Command`] naming `what`.
    pub(crate) fn run_checked(
        &mut self,
        sqe: Sqe,
        buf: Option<DmaBuf>,
        len: u32,
        timeout: Duration,
        what: &'static str,
    ) -> Result<(Cqe, Option<DmaBuf>), Error> {
        let (cqe, buf) = self.run(sqe, buf, len, timeout)?;
        if cqe.status().is_success() {
            Ok((cqe, buf))
        } else {
            Err(Error::Command {
                what,
                kind: nvpoll::spec::CommandKind::of(&sqe, self.qid()),
                status: cqe.status(),
            })
        }
    }
}

/// Locks the admin queue (a panic while it was held leaves it usable: its state is checked per command).
pub(crate) fn lock_admin<D: Device>(admin: &Mutex<Queue<D>>) -> MutexGuard<'_, Queue<D>> {
    admin.lock().unwrap_or_else(|e| e.into_inner())
}

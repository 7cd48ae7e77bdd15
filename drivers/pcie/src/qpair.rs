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
//! A queue pair survives a controller reset (see [`Recovery`]): once it sees that a reset has begun it stops
//! touching its rings; once the controller has finished the reset, its next poll takes what the device
//! completed before the reset from the old completion queue, re-creates its queues on the device (same queue
//! ID and depth) and, by its recovery policy, submits the rest again or fails them. It fails as a whole
//! (every command completes with an error, later submits are refused) when the controller is removed, shut
//! down or lost for good, or when the controller completes an unknown command ID.

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nvpoll::api::{Completion, IoOp, IoRequest, QueuePair, QueueStats as ApiQueueStats, Rejected};
use nvpoll::mem::{DmaBuf, DmaPool};
use nvpoll::send::{SendMode, SendPolicy};
use nvpoll::spec::{reg, Cqe, Csts, SglDescriptor, Sqe, CQE_SIZE, SQE_SIZE};

use crate::ctrl::{CtrlState, Retired, Shared};
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
    /// The controller could not be brought back by a reset and was given up.
    Lost,
    /// The command was outstanding across more resets than the retry limit allows.
    Retries,
}

impl Failure {
    pub(crate) fn to_error(&self) -> nvpoll::Error {
        match self {
            Failure::Reset => nvpoll::Error::Aborted("controller reset"),
            Failure::Detached => nvpoll::Error::Aborted("controller detached"),
            Failure::Fatal => nvpoll::Error::Transport("controller fatal status (CSTS.CFS)".into()),
            Failure::Removed => nvpoll::Error::Transport("controller removed".into()),
            Failure::Timeout => nvpoll::Error::Timeout,
            Failure::Protocol(s) => nvpoll::Error::Transport(s.clone()),
            Failure::Lost => {
                nvpoll::Error::Transport("controller lost: it could not be reset".into())
            }
            Failure::Retries => {
                nvpoll::Error::Aborted("controller reset (the command's retries are used up)")
            }
        }
    }

    fn to_pcie(&self) -> Error {
        match self {
            Failure::Reset => Error::Dead("the controller is being reset".into()),
            Failure::Detached => Error::Dead("the controller was shut down".into()),
            Failure::Fatal => Error::Fatal,
            Failure::Removed => Error::Removed,
            Failure::Timeout => Error::Timeout("a command completion"),
            Failure::Protocol(s) => Error::Protocol(s.clone()),
            Failure::Lost => {
                Error::Dead("the controller could not be reset and was given up".into())
            }
            Failure::Retries => Error::Dead("the command's retries are used up".into()),
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
    next_seq: u64,
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
            qid,
            failed: None,
            stall_polls: 0,
            stall_since: None,
            timeout,
            next_seq: 0,
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
        sqe: Sqe,
        buf: Option<DmaBuf>,
        len: u32,
        tag: u64,
    ) -> Result<(), (Error, Option<DmaBuf>)> {
        self.post(sqe, buf, len, tag, 0)
    }

    /// Posts a command taken back after a reset (or held while waiting for one). On error the buffer is
    /// handed back.
    pub fn submit_held(&mut self, h: Held) -> Result<(), (Error, Option<DmaBuf>)> {
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
    pub fn unrung(&self) -> usize {
        usize::from((self.sq_tail + self.entries - self.sq_rung) % self.entries)
    }

    /// Rings the submission queue doorbell if the tail moved since the last ring.
    #[inline]
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

    /// Why the controller stopped answering: removed (all-ones registers, and the function no longer
    /// answers), fatal status, or plain timeout (also when the registers are briefly out of reach).
    pub fn diagnose(&self) -> Failure {
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
    pub fn drain_stale(&mut self) -> usize {
        let mut n = 0;
        while n < usize::from(self.entries) && self.failed.is_none() {
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
        self.stats.completed += n as u64;
        n
    }

    /// Takes every outstanding command back, in submission order, and frees its tracker. Only once the
    /// device can no longer touch them (after a reset).
    pub fn take_outstanding(&mut self) -> Vec<Held> {
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
    pub fn push_done(&mut self, d: Done) {
        self.done.push_back(d);
    }

    /// Finished commands not yet taken.
    pub fn done_len(&self) -> usize {
        self.done.len()
    }

    /// Runs one command to completion (the admin queue: bring-up, queue creation) and returns its completion,
    /// whatever the status. Gives up after `timeout`, and early when the controller reports a fatal status
    /// or is gone; the queue has failed then.
    pub fn run(
        &mut self,
        sqe: Sqe,
        buf: Option<DmaBuf>,
        len: u32,
        timeout: Duration,
    ) -> Result<(Cqe, Option<DmaBuf>), Error> {
        if let Some(f) = self.failure() {
            return Err(f.clone().into_error());
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
                    Err(f) => Err(f.into_error()),
                };
            }
            if let Some(f) = self.failure() {
                return Err(f.clone().into_error());
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
                        other => other.into_error(),
                    });
                }
            }
            std::hint::spin_loop();
        }
    }

    /// [`Queue::run`], with a non-success status as an [`Error::Command`] naming `what`.
    pub fn run_checked(
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
                status: cqe.status(),
            })
        }
    }
}

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
    /// A queue pair of `depth` commands with the defaults.
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

/// One namespace as a queue pair checks requests against it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct NsInfo {
    pub nsid: u32,
    pub block_shift: u32,
    pub blocks: u64,
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
    pub namespaces: Vec<NsInfo>,
}

/// Locks the admin queue (a panic while it was held leaves it usable: its state is checked per command).
pub(crate) fn lock_admin<D: Device>(admin: &Mutex<Queue<D>>) -> MutexGuard<'_, Queue<D>> {
    admin.lock().unwrap_or_else(|e| e.into_inner())
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
pub struct PcieQueuePair<D: Device = VfioDevice> {
    q: Queue<D>,
    batch: usize,
    max_transfer: u32,
    /// The epoch its queues exist in on the device (or last existed in, while waiting).
    epoch: u64,
    link: Link,
    shared: Arc<Shared>,
    namespaces: Vec<NsInfo>,
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

    /// Counters of the recovery from controller resets.
    pub fn recovery_stats(&self) -> RecoveryStats {
        self.rstats
    }

    /// The recovery policy of this queue pair.
    pub fn recovery(&self) -> Recovery {
        self.recovery
    }

    /// Whether the queue pair is waiting for a controller reset to complete (its commands are held, or
    /// refused with [`Recovery::FailFast`]).
    pub fn is_recovering(&self) -> bool {
        self.link == Link::Waiting
    }

    /// Why the queue pair failed for good, if it did.
    pub fn failure(&self) -> Option<nvpoll::Error> {
        self.q.failure().map(Failure::to_error)
    }

    /// Whether its queues exist on the device in the controller's current epoch.
    #[inline]
    fn is_live(&self) -> bool {
        self.link == Link::Live && self.shared.epoch.load(Ordering::Acquire) == self.epoch
    }

    #[inline]
    fn ns(&self, nsid: u32) -> Option<&NsInfo> {
        self.namespaces.iter().find(|n| n.nsid == nsid)
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
            nvpoll::Error::Transport("queue pair failed".into()),
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
        let (qid, size, t) = (self.q.qid(), self.q.entries() - 1, self.admin_timeout);
        aq.run_checked(
            Sqe::create_io_cq(qid, size, self.q.cq_iova(), None),
            None,
            0,
            t,
            "Create I/O Completion Queue",
        )?;
        let sq = aq.run_checked(
            Sqe::create_io_sq(qid, size, self.q.sq_iova(), qid),
            None,
            0,
            t,
            "Create I/O Submission Queue",
        );
        if let Err(e) = sq {
            let _ = aq.run(Sqe::delete_io_cq(qid), None, 0, t);
            return Err(e);
        }
        Ok(())
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
    fn command(&self, req: &IoRequest) -> Result<(Sqe, u32), nvpoll::Error> {
        let Some(&ns) = self.ns(req.nsid) else {
            let msg = format!("namespace {} is not active on this controller", req.nsid);
            return Err(nvpoll::Error::InvalidArgument(msg));
        };
        if req.op == IoOp::Flush {
            return Ok((Sqe::flush(req.nsid), 0));
        }
        if req.blocks == 0 || req.blocks > 0x1_0000 {
            let msg = format!("{} blocks: one command carries 1 to 65536", req.blocks);
            return Err(nvpoll::Error::InvalidArgument(msg));
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
            return Err(nvpoll::Error::InvalidArgument(msg));
        }
        let nlb = (req.blocks - 1) as u16;
        let bytes = u64::from(req.blocks) << ns.block_shift;
        match req.op {
            IoOp::WriteZeroes => Ok((Sqe::write_zeroes(req.nsid, req.lba, nlb), 0)),
            _ if bytes > u64::from(self.max_transfer) => {
                let msg = format!(
                    "a transfer of {bytes} bytes exceeds the controller's maximum of {}",
                    self.max_transfer
                );
                Err(nvpoll::Error::InvalidArgument(msg))
            }
            IoOp::Read => Ok((Sqe::read(req.nsid, req.lba, nlb), bytes as u32)),
            _ => Ok((Sqe::write(req.nsid, req.lba, nlb), bytes as u32)),
        }
    }

    /// Submit while not live: refused when dead (or waiting, fail-fast), held when waiting (retry).
    #[cold]
    fn submit_recovering(&mut self, mut req: IoRequest) -> Result<(), Rejected> {
        self.sync_link();
        match self.link {
            Link::Dead => return Err(reject(self.dead_error(), req)),
            Link::Waiting if self.recovery == Recovery::FailFast => {
                let e = nvpoll::Error::Transport(
                    "the queue pair is waiting for a controller reset to complete".into(),
                );
                return Err(reject(e, req));
            }
            Link::Waiting => {}
            Link::Live => return self.submit_live(req),
        }
        let (sqe, len) = match self.command(&req) {
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
        let (sqe, len) = match self.command(&req) {
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
        self.q.outstanding() + self.waiting.len()
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
            retried: self.rstats.retried,
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

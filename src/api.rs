//! The controller, namespace and queue-pair API that every transport implements.
//!
//! A [`QueuePair`] is owned by exactly one reactor (or thread). Submitting never blocks: a command is either
//! accepted (and later completes exactly once, with success or an error) or rejected at once with its buffer
//! handed back. Completions are delivered by [`QueuePair::process_completions`], whose callback receives the
//! queue pair itself, so that it may submit again from inside the callback (run to completion, as in SPDK).

use crate::mem::DmaBuf;
use crate::send::SendMode;
use crate::spec::{CommandKind, Cqe, Sqe};
use crate::Error;

/// What an I/O request does.
///
/// # Examples
///
/// A write carries its data in the request's buffer; a write-zeroes and a flush carry none:
///
/// ```
/// # mod ram { include!("doctest/ram.rs"); }
/// use nvpoll::api::{IoOp, IoRequest, QueuePair};
/// use nvpoll::mem::DmaPool;
///
/// let pool = DmaPool::builder().class(4096, 4).build()?;
/// let mut qp = ram::RamQueuePair::new(8); // 512-byte blocks (hidden: an in-memory queue pair)
/// let mut data = pool.alloc(1024)?;
/// data.fill(0xab);
/// let ops = [
///     (IoOp::Write, 2, Some(data)),
///     (IoOp::WriteZeroes, 1, None),
///     (IoOp::Flush, 0, None),
/// ];
/// for (tag, (op, blocks, buf)) in ops.into_iter().enumerate() {
///     let req = IoRequest { op, nsid: 1, lba: 0, blocks, buf, tag: tag as u64 };
///     qp.submit(req).map_err(|r| r.error)?;
/// }
/// qp.flush()?;
/// let mut done = 0;
/// qp.process_completions(8, |_, c| {
///     assert!(c.result.is_ok());
///     done += 1;
/// })?;
/// assert_eq!(done, 3);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoOp {
    /// Read `blocks` logical blocks into the request's buffer.
    Read,
    /// Write `blocks` logical blocks from the request's buffer.
    Write,
    /// Flush the namespace's volatile write cache.
    Flush,
    /// Write zeroes to `blocks` logical blocks (no buffer).
    WriteZeroes,
    /// Deallocate (trim) `blocks` logical blocks from `lba` with Dataset Management: the controller may forget
    /// them, and what they then read as is its Identify Namespace's DLFEAT. The request's buffer carries the
    /// command's data, one 16-byte range, which the transport writes into it: give a buffer of at least
    /// [`DSM_RANGE_SIZE`](crate::spec::DSM_RANGE_SIZE) bytes from the controller's pool. Up to `u32::MAX`
    /// blocks. A controller without Dataset Management (ONCS bit 2 in [`Controller::identify`]) answers
    /// Invalid Command Opcode.
    Deallocate,
}

/// One I/O request, as handed to [`QueuePair::submit`].
///
/// # Examples
///
/// A read of 8 blocks of 512 bytes needs a buffer of 4096 bytes; its `tag` comes back in the completion:
///
/// ```
/// use nvpoll::api::{IoOp, IoRequest};
/// use nvpoll::mem::DmaPool;
///
/// let pool = DmaPool::builder().class(4096, 4).build()?;
/// let req = IoRequest { op: IoOp::Read, nsid: 1, lba: 64, blocks: 8, buf: Some(pool.alloc(8 * 512)?), tag: 7 };
/// assert_eq!(req.buf.as_ref().map(|b| b.len()), Some(4096));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct IoRequest {
    /// The operation.
    pub op: IoOp,
    /// Namespace ID.
    pub nsid: u32,
    /// First logical block.
    pub lba: u64,
    /// Number of logical blocks (at least 1 for read, write, write-zeroes and deallocate; ignored for flush).
    pub blocks: u32,
    /// The data buffer for read and write; its length must be `blocks` times the block size.
    pub buf: Option<DmaBuf>,
    /// An opaque value handed back in the [`Completion`].
    pub tag: u64,
}

/// A finished request, handed back exactly once.
///
/// # Examples
///
/// The buffer comes back whatever the outcome; `result` says whether the controller reported success:
///
/// ```
/// # mod ram { include!("doctest/ram.rs"); }
/// use nvpoll::api::{IoOp, IoRequest, QueuePair};
/// use nvpoll::mem::DmaPool;
///
/// let pool = DmaPool::builder().class(4096, 4).build()?;
/// let mut qp = ram::RamQueuePair::new(8);
/// let buf = pool.alloc(512)?;
/// qp.submit(IoRequest { op: IoOp::Read, nsid: 1, lba: 0, blocks: 1, buf: Some(buf), tag: 11 })
///     .map_err(|r| r.error)?;
/// qp.flush()?;
/// qp.poll(8)?;
/// let c = qp.pop_completion().ok_or("no completion")?;
/// assert_eq!(c.tag, 11);
/// c.result?;
/// let buf = c.buf.ok_or("no buffer")?;
/// assert_eq!(buf.len(), 512);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct Completion {
    /// The request's tag.
    pub tag: u64,
    /// The request's buffer (filled with the data for a successful read).
    pub buf: Option<DmaBuf>,
    /// `Ok` only if the controller reported success for the whole request.
    pub result: Result<(), Error>,
}

impl Completion {
    /// The completion of a request whose command ended with `result`: a completion entry (success only if
    /// its status is), or the transport's reason it did not complete. Both transports hand requests back
    /// through this.
    ///
    /// # Examples
    ///
    /// ```
    /// use nvpoll::api::Completion;
    /// use nvpoll::spec::{Cqe, Status};
    /// use nvpoll::Error;
    ///
    /// let ok = Completion::from_result(1, None, Ok(Cqe::default()));
    /// assert!(ok.result.is_ok());
    ///
    /// let mut cqe = Cqe::default();
    /// cqe.set_status(Status::LBA_OUT_OF_RANGE, true);
    /// let failed = Completion::from_result(2, None, Ok(cqe));
    /// assert!(matches!(failed.result, Err(Error::Nvme(_))));
    ///
    /// let lost = Completion::from_result(3, None, Err(Error::Timeout));
    /// assert!(matches!(lost.result, Err(Error::Timeout)));
    /// ```
    #[inline]
    pub fn from_result(tag: u64, buf: Option<DmaBuf>, result: Result<Cqe, Error>) -> Completion {
        let result = match result {
            Ok(cqe) if cqe.status().is_success() => Ok(()),
            Ok(cqe) => Err(Error::Nvme(cqe.status().named_in(CommandKind::Nvm))),
            Err(e) => Err(e),
        };
        Completion { tag, buf, result }
    }
}

/// Most logical blocks one NVM command carries (NLB is a 0-based 16-bit field).
pub const MAX_BLOCKS_PER_COMMAND: u32 = 0x1_0000;

/// A request checked by [`check_request`]: the command to send, and how many bytes of data move with it.
///
/// See [`check_request`] for an example.
#[derive(Clone, Copy, Debug)]
pub struct Checked {
    /// The NVM command (its command ID and data pointer are the transport's to fill in).
    pub sqe: Sqe,
    /// Bytes of data: the request's blocks times the block size for a read or write, the range for a
    /// deallocate, 0 otherwise.
    pub len: u32,
}

/// Checks a request against the namespaces a queue pair knows and the controller's largest transfer, and
/// builds its command. This is the one check of both transports: the namespace must be active, a read,
/// write or write-zeroes must carry 1 to 65536 blocks within the namespace, and a read or write at most
/// `max_transfer` bytes. The buffer is the transport's to check (where it looks at it anyway), except for a
/// deallocate, whose range this writes into it (so it must hold one).
///
/// # Examples
///
/// ```
/// use nvpoll::api::{check_request, IoOp, IoRequest, Namespace};
/// use nvpoll::Error;
///
/// let namespaces = [Namespace { nsid: 1, block_size: 512, blocks: 1024 }];
/// let mut req = IoRequest { op: IoOp::Read, nsid: 1, lba: 8, blocks: 8, buf: None, tag: 0 };
/// let checked = check_request(&mut req, &namespaces, 128 * 1024)?;
/// assert_eq!(checked.len, 4096);
/// assert_eq!(checked.sqe.nsid, 1);
///
/// // Past the namespace's end, or on a namespace it does not have: refused before anything is sent.
/// let mut beyond = IoRequest { lba: 1020, ..req };
/// assert!(matches!(check_request(&mut beyond, &namespaces, 128 * 1024), Err(Error::InvalidArgument(_))));
/// let mut other = IoRequest { op: IoOp::Flush, nsid: 2, lba: 0, blocks: 0, buf: None, tag: 0 };
/// assert!(check_request(&mut other, &namespaces, 128 * 1024).is_err());
/// # Ok::<(), nvpoll::Error>(())
/// ```
#[inline]
pub fn check_request(
    req: &mut IoRequest,
    namespaces: &[Namespace],
    max_transfer: u32,
) -> Result<Checked, Error> {
    let Some(ns) = namespaces.iter().find(|n| n.nsid == req.nsid) else {
        let msg = format!("namespace {} is not active on this controller", req.nsid);
        return Err(Error::InvalidArgument(msg));
    };
    if req.op == IoOp::Flush {
        return Ok(Checked {
            sqe: Sqe::flush(req.nsid),
            len: 0,
        });
    }
    if req.op == IoOp::Deallocate {
        return deallocate_request(req, ns);
    }
    if req.blocks == 0 || req.blocks > MAX_BLOCKS_PER_COMMAND {
        let msg = format!(
            "{} blocks: one command carries 1 to {MAX_BLOCKS_PER_COMMAND}",
            req.blocks
        );
        return Err(Error::InvalidArgument(msg));
    }
    within_namespace(req, ns)?;
    let nlb = (req.blocks - 1) as u16;
    let bytes = u64::from(req.blocks) * u64::from(ns.block_size);
    let (sqe, len) = match req.op {
        IoOp::WriteZeroes => {
            return Ok(Checked {
                sqe: Sqe::write_zeroes(req.nsid, req.lba, nlb),
                len: 0,
            })
        }
        _ if bytes > u64::from(max_transfer) => {
            let msg = format!(
                "a transfer of {bytes} bytes exceeds the controller's maximum of {max_transfer}"
            );
            return Err(Error::InvalidArgument(msg));
        }
        IoOp::Read => (Sqe::read(req.nsid, req.lba, nlb), bytes as u32),
        _ => (Sqe::write(req.nsid, req.lba, nlb), bytes as u32),
    };
    Ok(Checked { sqe, len })
}

/// The request's blocks lie within the namespace.
fn within_namespace(req: &IoRequest, ns: &Namespace) -> Result<(), Error> {
    if req
        .lba
        .checked_add(u64::from(req.blocks))
        .is_none_or(|end| end > ns.blocks)
    {
        return Err(Error::InvalidArgument(format!(
            "blocks {}+{} are beyond the namespace's {}",
            req.lba, req.blocks, ns.blocks
        )));
    }
    Ok(())
}

/// [`check_request`] for a deallocate: one range of 1 to `u32::MAX` blocks within the namespace, written into
/// the request's buffer.
#[cold]
fn deallocate_request(req: &mut IoRequest, ns: &Namespace) -> Result<Checked, Error> {
    use crate::spec::{DsmRange, DSM_RANGE_SIZE};
    if req.blocks == 0 {
        return Err(Error::InvalidArgument(
            "a deallocate needs at least one block".into(),
        ));
    }
    within_namespace(req, ns)?;
    let range = DsmRange {
        attributes: 0,
        nlb: req.blocks,
        slba: req.lba,
    };
    match req.buf.as_mut() {
        Some(b) if b.len() >= DSM_RANGE_SIZE => {
            b.as_mut_slice()[..DSM_RANGE_SIZE].copy_from_slice(&range.to_bytes())
        }
        _ => {
            let msg = format!(
                "a deallocate needs a buffer of at least {DSM_RANGE_SIZE} bytes for its range"
            );
            return Err(Error::InvalidArgument(msg));
        }
    }
    Ok(Checked {
        sqe: crate::spec::Sqe::dsm_deallocate(req.nsid, 0),
        len: DSM_RANGE_SIZE as u32,
    })
}

/// A request that was not accepted, with its buffer handed back.
///
/// # Examples
///
/// A full queue hands the request back, buffer and all, to be submitted again after completions:
///
/// ```
/// # mod ram { include!("doctest/ram.rs"); }
/// use nvpoll::api::{IoOp, IoRequest, QueuePair};
/// use nvpoll::mem::DmaPool;
/// use nvpoll::{Error, Retry};
///
/// let pool = DmaPool::builder().class(4096, 4).build()?;
/// let mut qp = ram::RamQueuePair::new(1); // room for one request
/// let read = |tag| IoRequest { op: IoOp::Read, nsid: 1, lba: 0, blocks: 1, buf: None, tag };
/// qp.submit(IoRequest { buf: Some(pool.alloc(512)?), ..read(1) }).map_err(|r| r.error)?;
/// let rejected = qp.submit(IoRequest { buf: Some(pool.alloc(512)?), ..read(2) }).unwrap_err();
/// assert!(matches!(rejected.error, Error::QueueFull));
/// assert_eq!(rejected.error.retry(), Retry::AfterCompletions);
/// assert_eq!(rejected.request.tag, 2);
/// assert!(rejected.request.buf.is_some(), "the buffer is handed back");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct Rejected {
    /// Why the request was not accepted ([`Error::QueueFull`] means "try again after completions").
    pub error: Error,
    /// The request, unchanged.
    pub request: IoRequest,
}

/// An I/O queue pair, owned by one reactor.
///
/// # Examples
///
/// Write a block, read it back, and wait for both: submit, flush once, then poll until nothing is
/// outstanding. The queue pair here is an in-memory one (hidden lines); a TCP or PCIe queue pair is driven
/// the same way.
///
/// ```
/// # mod ram { include!("doctest/ram.rs"); }
/// use nvpoll::api::{IoOp, IoRequest, QueuePair};
/// use nvpoll::mem::DmaPool;
///
/// let pool = DmaPool::builder().class(4096, 8).build()?;
/// let mut qp = ram::RamQueuePair::new(32);
/// assert_eq!(qp.depth(), 32);
///
/// let mut data = pool.alloc(512)?;
/// data.fill(0x5a);
/// qp.submit(IoRequest { op: IoOp::Write, nsid: 1, lba: 3, blocks: 1, buf: Some(data), tag: 1 })
///     .map_err(|r| r.error)?;
/// qp.submit(IoRequest { op: IoOp::Read, nsid: 1, lba: 3, blocks: 1, buf: Some(pool.alloc(512)?), tag: 2 })
///     .map_err(|r| r.error)?;
/// assert_eq!(qp.outstanding(), 2);
/// qp.flush()?;
///
/// let mut read_back = None;
/// while qp.outstanding() > 0 {
///     qp.process_completions(16, |_qp, c| {
///         assert!(c.result.is_ok(), "tag {}: {:?}", c.tag, c.result);
///         if c.tag == 2 {
///             read_back = c.buf;
///         }
///     })?;
/// }
/// assert!(read_back.ok_or("no read")?.iter().all(|&b| b == 0x5a));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub trait QueuePair {
    /// Queues one request. With the inline send mode it may also leave at once; otherwise it leaves at the next
    /// [`QueuePair::flush`].
    ///
    /// A refused request comes back in the `Err` with its buffer: see [`Rejected`]'s example; an accepted one
    /// is in [`QueuePair`]'s example.
    fn submit(&mut self, req: IoRequest) -> Result<(), Rejected>;

    /// Sends everything queued since the last flush (the "kick": one doorbell or one coalesced write).
    ///
    /// # Examples
    ///
    /// Several submissions, one flush: they leave together.
    ///
    /// ```
    /// # mod ram { include!("doctest/ram.rs"); }
    /// use nvpoll::api::{IoOp, IoRequest, QueuePair};
    ///
    /// let mut qp = ram::RamQueuePair::new(8);
    /// for lba in 0..4 {
    ///     let req = IoRequest { op: IoOp::WriteZeroes, nsid: 1, lba, blocks: 1, buf: None, tag: lba };
    ///     qp.submit(req).map_err(|r| r.error)?;
    /// }
    /// qp.flush()?;
    /// assert_eq!(qp.stats().writes, 1, "one write for the four commands");
    /// assert_eq!(qp.poll(8)?, 4);
    /// # Ok::<(), nvpoll::Error>(())
    /// ```
    fn flush(&mut self) -> Result<(), Error>;

    /// Polls the transport for up to `max` completions and moves them to the queue pair's done list.
    /// Returns how many it moved. An `Err` means the queue pair has failed: every outstanding request has then
    /// been completed with an error.
    ///
    /// # Examples
    ///
    /// [`QueuePair::process_completions`] is `poll` and [`QueuePair::pop_completion`] together; apart:
    ///
    /// ```
    /// # mod ram { include!("doctest/ram.rs"); }
    /// use nvpoll::api::{IoOp, IoRequest, QueuePair};
    ///
    /// let mut qp = ram::RamQueuePair::new(8);
    /// for tag in 0..3 {
    ///     qp.submit(IoRequest { op: IoOp::Flush, nsid: 1, lba: 0, blocks: 0, buf: None, tag })
    ///         .map_err(|r| r.error)?;
    /// }
    /// qp.flush()?;
    /// assert_eq!(qp.poll(2)?, 2, "at most max");
    /// assert_eq!(qp.poll(2)?, 1);
    /// let tags: Vec<u64> = std::iter::from_fn(|| qp.pop_completion()).map(|c| c.tag).collect();
    /// assert_eq!(tags, [0, 1, 2]);
    /// assert_eq!(qp.outstanding(), 0);
    /// # Ok::<(), nvpoll::Error>(())
    /// ```
    fn poll(&mut self, max: usize) -> Result<usize, Error>;

    /// As [`QueuePair::poll`], with the caller's reading of the clock taken this pass: a poller that reads it
    /// anyway (to time its I/Os) spares the transport its own reads (on the 2-vCPU development VM the TCP
    /// queue pair's two `clock_gettime` calls a pass were 7% of perf's initiator core at qd128). Transports
    /// that keep no time ignore it (the default calls [`QueuePair::poll`]). See [`QueuePair::poll`]'s example:
    /// `qp.poll_at(2, std::time::Instant::now())` there does what `qp.poll(2)` does.
    fn poll_at(&mut self, max: usize, now: std::time::Instant) -> Result<usize, Error> {
        let _ = now;
        self.poll(max)
    }

    /// Takes the oldest completion from the done list. See [`QueuePair::poll`]'s example.
    fn pop_completion(&mut self) -> Option<Completion>;

    /// Requests accepted and not yet handed back. See [`QueuePair`]'s example.
    fn outstanding(&self) -> usize;

    /// The most requests this queue pair accepts at once. See [`QueuePair`]'s example.
    fn depth(&self) -> usize;

    /// Chooses when posted commands leave (see [`crate::send`]). Transports with a single behaviour refuse.
    ///
    /// # Examples
    ///
    /// ```
    /// # mod ram { include!("doctest/ram.rs"); }
    /// use nvpoll::api::QueuePair;
    /// use nvpoll::send::SendMode;
    ///
    /// let mut qp = ram::RamQueuePair::new(8); // keeps the default: one behaviour, so it refuses
    /// let refused = qp.set_send_mode(SendMode::Inline);
    /// assert!(matches!(refused, Err(nvpoll::Error::InvalidArgument(_))));
    /// ```
    fn set_send_mode(&mut self, mode: SendMode) -> Result<(), Error> {
        Err(Error::InvalidArgument(format!(
            "this transport cannot switch to the {mode} send mode"
        )))
    }

    /// What can complete this queue pair's requests, for a reactor that wants to sleep
    /// ([`crate::reactor::Poller::wake_sources`]): adds its file descriptors and deadlines to `w` and returns
    /// `true`, or returns `false` when only polling can find its completions (the default). A queue pair with
    /// nothing outstanding and nothing in its done list has nothing to be woken for.
    ///
    /// # Examples
    ///
    /// ```
    /// # mod ram { include!("doctest/ram.rs"); }
    /// use nvpoll::api::QueuePair;
    /// use nvpoll::reactor::WakeSources;
    ///
    /// let qp = ram::RamQueuePair::new(8); // keeps the default: only polling finds its completions
    /// let mut w = WakeSources::default();
    /// assert!(!qp.wake_sources(&mut w));
    /// assert_eq!(w.watched().count(), 0);
    /// ```
    fn wake_sources<'a>(&'a self, _w: &mut crate::reactor::WakeSources<'a>) -> bool {
        false
    }

    /// Counters of this queue pair (zero for a transport that keeps none).
    ///
    /// # Examples
    ///
    /// Two samples give the counters of the window between them:
    ///
    /// ```
    /// # mod ram { include!("doctest/ram.rs"); }
    /// use nvpoll::api::{IoOp, IoRequest, QueuePair};
    ///
    /// let mut qp = ram::RamQueuePair::new(8);
    /// let before = qp.stats();
    /// qp.submit(IoRequest { op: IoOp::Flush, nsid: 1, lba: 0, blocks: 0, buf: None, tag: 0 })
    ///     .map_err(|r| r.error)?;
    /// qp.flush()?;
    /// let window = qp.stats().since(&before);
    /// assert_eq!(window.commands, 1);
    /// assert_eq!(window.reconnects, 0);
    /// # Ok::<(), nvpoll::Error>(())
    /// ```
    fn stats(&self) -> QueueStats {
        QueueStats::default()
    }

    /// Polls (as [`QueuePair::poll`]) and then hands each completion to `f`, which may submit again.
    /// Returns the number of completions handed to `f`.
    ///
    /// # Examples
    ///
    /// The callback gets the queue pair, so it may submit the next request (run to completion): here each
    /// completed write submits the write of the next block until eight are done.
    ///
    /// ```
    /// # mod ram { include!("doctest/ram.rs"); }
    /// use nvpoll::api::{IoOp, IoRequest, QueuePair};
    /// use nvpoll::mem::DmaPool;
    ///
    /// let pool = DmaPool::builder().class(4096, 4).build()?;
    /// let mut qp = ram::RamQueuePair::new(4);
    /// let write = |lba, buf| IoRequest { op: IoOp::Write, nsid: 1, lba, blocks: 1, buf, tag: lba };
    /// qp.submit(write(0, Some(pool.alloc(512)?))).map_err(|r| r.error)?;
    /// qp.flush()?;
    /// let mut written = 0;
    /// while qp.outstanding() > 0 {
    ///     qp.process_completions(16, |qp, c| {
    ///         assert!(c.result.is_ok());
    ///         written += 1;
    ///         if c.tag < 7 {
    ///             // The same buffer again, for the next block.
    ///             qp.submit(write(c.tag + 1, c.buf)).expect("room for it");
    ///         }
    ///     })?;
    ///     qp.flush()?;
    /// }
    /// assert_eq!(written, 8);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    fn process_completions<F>(&mut self, max: usize, mut f: F) -> Result<usize, Error>
    where
        Self: Sized,
        F: FnMut(&mut Self, Completion),
    {
        let polled = self.poll(max);
        let mut n = 0;
        while let Some(c) = self.pop_completion() {
            f(self, c);
            n += 1;
        }
        polled.map(|_| n)
    }
}

/// Counters of one queue pair, cumulative since it was created. Subtract two samples to get a window.
///
/// # Examples
///
/// ```
/// use nvpoll::api::QueueStats;
/// use std::time::Duration;
///
/// let earlier = QueueStats { commands: 10, writes: 4, ..Default::default() };
/// let now = QueueStats { commands: 25, writes: 6, longest_failover: Duration::from_millis(3), ..Default::default() };
/// let window = now.since(&earlier);
/// assert_eq!((window.commands, window.writes), (15, 2));
///
/// // Two paths' counters together: counts add up, the longest failover is the longer one.
/// let other_path = QueueStats { commands: 5, longest_failover: Duration::from_millis(9), ..Default::default() };
/// let both = now.plus(&other_path);
/// assert_eq!(both.commands, 30);
/// assert_eq!(both.longest_failover, Duration::from_millis(9));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QueueStats {
    /// Commands submitted, the queue's own included: over TCP each connection's Fabrics Connect (and its
    /// DH-HMAC-CHAP commands) counts too, once per connect and reconnect.
    pub commands: u64,
    /// PDUs (TCP) or SQEs (PCIe) posted.
    pub pdus: u64,
    /// Kicks that sent something: `write`/`sendmsg` calls for TCP, doorbell writes for PCIe.
    pub writes: u64,
    /// Receive system calls (TCP) or completion-queue scans that found entries (PCIe).
    pub reads: u64,
    /// TLS records sealed (0 without TLS).
    pub records: u64,
    /// Plaintext bytes sealed into those records.
    pub record_bytes: u64,
    /// End-of-iteration flushes that found something to send.
    pub flushes: u64,
    /// TLS KeyUpdates sent (our sending key renewed), over the queue pair's life (0 without TLS).
    pub key_updates_sent: u64,
    /// TLS KeyUpdates received (the peer's key renewed), over the queue pair's life.
    pub key_updates_received: u64,
    /// Commands submitted again after the transport recovered from a lost connection.
    pub retried: u64,
    /// Times the transport connected the queue pair again after its connection ended (a fault, or a TLS
    /// key renewal by reconnecting); 0 for PCIe.
    pub reconnects: u64,
    /// Over the queue pair's life: the longest a command waited between the failure that took it off a path
    /// and its send on another (multipath's time to fail over; zero for a single path).
    pub longest_failover: std::time::Duration,
}

impl QueueStats {
    /// `self + other`, field by field: counters add up, `longest_failover` is the longer of the two (the
    /// queue pairs of a multipath pair, or a queue pair's past connections and its live one).
    /// See [`QueueStats`]'s example.
    pub fn plus(&self, other: &QueueStats) -> QueueStats {
        QueueStats {
            commands: self.commands + other.commands,
            pdus: self.pdus + other.pdus,
            writes: self.writes + other.writes,
            reads: self.reads + other.reads,
            records: self.records + other.records,
            record_bytes: self.record_bytes + other.record_bytes,
            flushes: self.flushes + other.flushes,
            key_updates_sent: self.key_updates_sent + other.key_updates_sent,
            key_updates_received: self.key_updates_received + other.key_updates_received,
            retried: self.retried + other.retried,
            reconnects: self.reconnects + other.reconnects,
            longest_failover: self.longest_failover.max(other.longest_failover),
        }
    }

    /// `self - earlier`, field by field (saturating, should a transport's counter ever start again).
    /// See [`QueueStats`]'s example.
    pub fn since(&self, earlier: &QueueStats) -> QueueStats {
        QueueStats {
            commands: self.commands.saturating_sub(earlier.commands),
            pdus: self.pdus.saturating_sub(earlier.pdus),
            writes: self.writes.saturating_sub(earlier.writes),
            reads: self.reads.saturating_sub(earlier.reads),
            records: self.records.saturating_sub(earlier.records),
            record_bytes: self.record_bytes.saturating_sub(earlier.record_bytes),
            flushes: self.flushes.saturating_sub(earlier.flushes),
            key_updates_sent: self
                .key_updates_sent
                .saturating_sub(earlier.key_updates_sent),
            key_updates_received: self
                .key_updates_received
                .saturating_sub(earlier.key_updates_received),
            retried: self.retried.saturating_sub(earlier.retried),
            reconnects: self.reconnects.saturating_sub(earlier.reconnects),
            // A maximum, not a count: the later sample's.
            longest_failover: self.longest_failover,
        }
    }
}

/// What a host learns of a controller when it attaches (and again after a reset or reconnect).
///
/// # Examples
///
/// ```
/// use nvpoll::api::{ControllerInfo, Namespace};
///
/// let info = ControllerInfo {
///     namespaces: vec![Namespace { nsid: 1, block_size: 4096, blocks: 256 }],
///     max_transfer: 128 * 1024,
///     ..Default::default()
/// };
/// assert_eq!(info.namespace(1).map(|ns| ns.block_size), Some(4096));
/// assert!(info.namespace(2).is_none());
/// ```
#[derive(Clone, Debug, Default)]
pub struct ControllerInfo {
    /// The Identify Controller data.
    pub identify: crate::spec::IdentifyController,
    /// The active namespaces, by NSID.
    pub namespaces: Vec<Namespace>,
    /// The largest data transfer of one command in bytes (MDTS, and the transport's own limit).
    pub max_transfer: u32,
}

impl ControllerInfo {
    /// The active namespace `nsid`, if there is one. See [`ControllerInfo`]'s example.
    pub fn namespace(&self, nsid: u32) -> Option<&Namespace> {
        self.namespaces.iter().find(|n| n.nsid == nsid)
    }
}

/// A namespace as seen by the host.
///
/// # Examples
///
/// ```
/// use nvpoll::api::Namespace;
///
/// let ns = Namespace { nsid: 1, block_size: 512, blocks: 2048 };
/// assert_eq!(ns.capacity_bytes(), 1024 * 1024);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Namespace {
    /// Namespace ID.
    pub nsid: u32,
    /// Logical block size in bytes.
    pub block_size: u32,
    /// Size in logical blocks (NSZE).
    pub blocks: u64,
}

/// Why an Identify Namespace page gives no namespace.
///
/// # Examples
///
/// ```
/// use nvpoll::api::{Namespace, NamespaceError};
///
/// let short_page = [0u8; 100];
/// let err = Namespace::from_identify(1, &short_page).unwrap_err();
/// assert!(matches!(err, NamespaceError::Parse { nsid: 1, .. }));
/// ```
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NamespaceError {
    /// The page does not parse.
    #[error("Identify Namespace {nsid}: {source}")]
    Parse {
        /// The namespace asked for.
        nsid: u32,
        /// What is wrong with the page.
        #[source]
        source: crate::spec::ParseError,
    },
    /// The current LBA format is not one of those the page lists, or has no valid data size.
    #[error("namespace {nsid} reports an invalid LBA format")]
    InvalidLbaFormat {
        /// The namespace.
        nsid: u32,
    },
}

impl Namespace {
    /// The namespace an Identify Namespace page describes: `Ok(None)` for an inactive one (NSZE 0), an error
    /// naming what is wrong for a page that does not parse or whose current LBA format is invalid.
    ///
    /// # Examples
    ///
    /// ```
    /// use nvpoll::api::Namespace;
    /// use nvpoll::spec::{IdentifyNamespace, LbaFormat};
    ///
    /// let id = IdentifyNamespace {
    ///     nsze: 1 << 20,
    ///     lbaf: vec![LbaFormat { ms: 0, lbads: 12, rp: 0 }], // 4 KiB blocks, format 0 current
    ///     ..Default::default()
    /// };
    /// let ns = Namespace::from_identify(3, &id.to_bytes())?.ok_or("inactive")?;
    /// assert_eq!(ns, Namespace { nsid: 3, block_size: 4096, blocks: 1 << 20 });
    ///
    /// let inactive = IdentifyNamespace { nsze: 0, ..id };
    /// assert_eq!(Namespace::from_identify(3, &inactive.to_bytes())?, None);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn from_identify(nsid: u32, page: &[u8]) -> Result<Option<Namespace>, NamespaceError> {
        let ns = crate::spec::IdentifyNamespace::parse(page)
            .map_err(|source| NamespaceError::Parse { nsid, source })?;
        if ns.nsze == 0 {
            return Ok(None);
        }
        let block_size = ns
            .block_size()
            .ok_or(NamespaceError::InvalidLbaFormat { nsid })?;
        Ok(Some(Namespace {
            nsid,
            block_size,
            blocks: ns.nsze,
        }))
    }

    /// Capacity in bytes. See [`Namespace`]'s example.
    pub fn capacity_bytes(&self) -> u64 {
        self.blocks * u64::from(self.block_size)
    }
}

/// A controller: its admin queue, what it identified as, and a factory of I/O queue pairs.
///
/// # Examples
///
/// Attach (here an in-memory controller, in the hidden lines; a TCP or PCIe one is opened by its crate), look
/// at what it identified as, and create a queue pair for a reactor:
///
/// ```
/// # mod ram { include!("doctest/ram.rs"); }
/// use nvpoll::api::{Controller, QueuePair};
///
/// let mut ctrl = ram::RamController::new();
/// assert_eq!(ctrl.identify().model, "nvpoll RAM disk");
/// let ns = ctrl.namespaces()[0].clone();
/// assert_eq!(ctrl.namespace(ns.nsid), Some(&ns));
/// assert_eq!(ctrl.info().namespaces.len(), 1);
/// assert_eq!(ctrl.max_transfer(), Some(128 * 1024));
/// assert_eq!(ctrl.io_queues_granted(), None, "it does not say");
///
/// let qp = ctrl.create_queue_pair(64)?;
/// assert_eq!(qp.depth(), 64);
/// ctrl.poll_admin()?; // a few times a second, from a control thread or a timed poller
/// drop(qp);
/// ctrl.shutdown()?;
/// # Ok::<(), nvpoll::Error>(())
/// ```
pub trait Controller {
    /// The queue pair type of this transport.
    type QueuePair: QueuePair;

    /// What attach learnt of the controller: its Identify data, its namespaces, its transfer limit.
    ///
    /// See [`Controller`]'s example.
    fn info(&self) -> &ControllerInfo;

    /// The Identify Controller data read at attach time.
    ///
    /// See [`Controller`]'s example.
    fn identify(&self) -> &crate::spec::IdentifyController {
        &self.info().identify
    }

    /// The active namespaces.
    ///
    /// See [`Controller`]'s example.
    fn namespaces(&self) -> &[Namespace] {
        &self.info().namespaces
    }

    /// The active namespace `nsid`, if there is one.
    ///
    /// See [`Controller`]'s example.
    fn namespace(&self, nsid: u32) -> Option<&Namespace> {
        self.info().namespace(nsid)
    }

    /// Largest data transfer in bytes for one command (from MDTS), if limited.
    ///
    /// See [`Controller`]'s example.
    fn max_transfer(&self) -> Option<u32> {
        Some(self.info().max_transfer)
    }

    /// Runs one admin command to completion. Meant for setup and tools, not for a reactor's hot path.
    ///
    /// # Examples
    ///
    /// Identify Controller into a buffer from the pool, then a command the controller refuses: its status
    /// is in the completion entry, not in the `Err` (which is for a command that did not complete).
    ///
    /// ```
    /// # mod ram { include!("doctest/ram.rs"); }
    /// use nvpoll::api::Controller;
    /// use nvpoll::mem::DmaPool;
    /// use nvpoll::spec::{IdentifyController, Sqe, Status};
    ///
    /// let pool = DmaPool::builder().class(4096, 2).build()?;
    /// let mut ctrl = ram::RamController::new();
    /// let (cqe, buf) = ctrl.admin(Sqe::identify(1, 0), Some(pool.alloc(4096)?))?;
    /// assert!(cqe.status().is_success());
    /// let id = IdentifyController::parse(&buf.ok_or("no buffer")?)?;
    /// assert_eq!(id.model, "nvpoll RAM disk");
    ///
    /// let (cqe, _) = ctrl.admin(Sqe { opcode: 0xc1, ..Sqe::default() }, None)?;
    /// assert_eq!(cqe.status(), Status::INVALID_OPCODE);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    fn admin(&mut self, cmd: Sqe, buf: Option<DmaBuf>) -> Result<(Cqe, Option<DmaBuf>), Error>;

    /// How many I/O queue pairs the controller granted (Set Features, Number of Queues), if it is known:
    /// [`Controller::create_queue_pair`] fails once that many are connected.
    ///
    /// See [`Controller`]'s example.
    fn io_queues_granted(&self) -> Option<u16> {
        None
    }

    /// Creates one I/O queue pair with the given depth. The caller moves it to the reactor that will own it.
    ///
    /// See [`Controller`]'s example.
    fn create_queue_pair(&mut self, depth: u16) -> Result<Self::QueuePair, Error>;

    /// Services the admin side: keep-alive, health checks, recovery. Call it from a timed poller (or any loop)
    /// a few times a second. An `Err` means the controller is lost for good.
    ///
    /// See [`Controller`]'s example.
    fn poll_admin(&mut self) -> Result<(), Error> {
        Ok(())
    }

    /// Shuts the controller down cleanly (CC.SHN) and releases it.
    ///
    /// See [`Controller`]'s example.
    fn shutdown(self) -> Result<(), Error>
    where
        Self: Sized,
    {
        drop(self);
        Ok(())
    }
}

//! One fio job (thread): its queue pairs, one per file; its I/O buffers, one pinned area fio carves (zero
//! copy: each io_u's buffer is a part of it, handed to the queue pair as a `DmaBuf`); and what it reaped.
//! Everything here is safe Rust; `ffi` translates fio's structures to and from these calls.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Once};
use std::time::{Duration, Instant};

use nvpoll::api::{IoOp, IoRequest};
use nvpoll::mem::{DmaBuf, DmaPool};
use nvpoll::Error;

use crate::error::Error as EngineError;
use crate::filename;
use crate::registry::{self, AnyQueuePair, Attached};
use crate::settings::{Idle, Settings};

/// What fio asks of one io_u.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    /// Read into the buffer.
    Read,
    /// Write from the buffer.
    Write,
    /// Deallocate the range (Dataset Management).
    Trim,
    /// Flush the volatile write cache (fio's fsync/fdatasync).
    Flush,
}

/// One I/O as fio hands it over.
#[derive(Clone, Copy, Debug)]
pub struct Io {
    /// The io_u's index (its buffer's part).
    pub index: usize,
    /// Which of the job's files (fio's fileno).
    pub file: usize,
    /// What to do.
    pub dir: Dir,
    /// Byte offset in the namespace.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// Where the transfer starts in the io_u's buffer (fio's xfer_buf - buf).
    pub buf_offset: usize,
}

/// What became of [`Job::queue`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Queued {
    /// Accepted: it completes in a later reap.
    Queued,
    /// The queue pair is full: reap first.
    Busy,
    /// Refused at once with this errno (the reason was logged).
    Failed(i32),
}

struct FileQp {
    // Dropped first: the queue pair goes before its controller's last reference.
    qp: AnyQueuePair,
    attached: Arc<Attached>,
    name: String,
    nsid: u32,
    block_size: u32,
    blocks: u64,
}

struct Memory {
    pool: DmaPool,
    /// The area before fio carved it (until [`Job::carve`]).
    whole: Option<DmaBuf>,
    /// The controllers the pool is mapped for (PCIe).
    mapped: Vec<Arc<Attached>>,
}

/// At most this many failed I/Os are logged one by one; the rest are counted.
const LOGGED_ERRORS: u64 = 10;

/// One fio job's state.
pub struct Job {
    files: Vec<FileQp>,
    memory: Option<Memory>,
    /// Each io_u's buffer, by io_u index; `None` while it is with a queue pair.
    views: Vec<Option<DmaBuf>>,
    /// What the last reap collected: io_u index and errno (0: success).
    events: Vec<(usize, i32)>,
    outstanding: usize,
    /// I/Os queued since the last flush (not yet on the wire in the deferred mode).
    unsent: usize,
    idle: Idle,
    /// How many CPUs this job may run on (its cpus_allowed, or the machine's).
    cpus: usize,
    errors: u64,
    log: fn(&str),
}

/// The engine's jobs open in this process (fio runs them as threads of one process): with more of them than
/// a job has CPUs, a job that asked for `idle=spin` yields instead ([`Idle::for_cpus`]).
static OPEN_JOBS: AtomicUsize = AtomicUsize::new(0);
/// The advice that goes with it, said once a process.
static SPIN_ADVICE: Once = Once::new();

fn errno(e: &Error) -> i32 {
    match e {
        Error::InvalidArgument(_) => libc::EINVAL,
        Error::Timeout => libc::ETIMEDOUT,
        Error::Memory(_) => libc::ENOMEM,
        _ => libc::EIO,
    }
}

impl Job {
    /// Attaches (or shares) the controller of each of fio's file names and connects this job's queue pair
    /// on each, `depth` deep. `log` prints a line where fio prints its errors.
    pub fn open(
        names: &[String],
        settings: &Settings,
        depth: u16,
        cpus: usize,
        log: fn(&str),
    ) -> Result<Job, EngineError> {
        let mut files = Vec::with_capacity(names.len());
        for name in names {
            let t = filename::parse(name)?;
            let attached = registry::attach(&t.trid, settings)?;
            let ns = match t.nsid {
                Some(n) => attached.info.namespace(n).cloned().ok_or_else(|| {
                    EngineError::InactiveNamespace {
                        name: attached.name.clone(),
                        nsid: n,
                        active: attached.info.namespaces.iter().map(|n| n.nsid).collect(),
                    }
                })?,
                None => attached
                    .info
                    .namespaces
                    .first()
                    .cloned()
                    .ok_or_else(|| EngineError::NoNamespace(attached.name.clone()))?,
            };
            let qp = attached.create_queue_pair(depth, settings.send_mode)?;
            if qp.depth() < usize::from(depth) {
                return Err(EngineError::QueueTooShallow {
                    name: attached.name.clone(),
                    holds: qp.depth(),
                    depth,
                });
            }
            files.push(FileQp {
                qp,
                name: format!("{} ns={}", attached.name, ns.nsid),
                attached,
                nsid: ns.nsid,
                block_size: ns.block_size,
                blocks: ns.blocks,
            });
        }
        Ok(Job {
            files,
            memory: None,
            views: Vec::new(),
            events: Vec::new(),
            outstanding: 0,
            unsent: 0,
            idle: settings.idle,
            cpus,
            errors: 0,
            log,
        })
        .inspect(|_| {
            OPEN_JOBS.fetch_add(1, Ordering::Relaxed);
        })
    }

    /// Each file's size in bytes (its namespace's capacity), in fio's file order.
    pub fn file_sizes(&self) -> Vec<u64> {
        self.files
            .iter()
            .map(|f| f.blocks * u64::from(f.block_size))
            .collect()
    }

    /// Refuses block sizes the namespaces or controllers cannot take: every size in `sizes` (fio's bs,
    /// bssplit and bsrange bounds) must be a multiple of each namespace's block size, and `max_bs` within each
    /// controller's largest transfer.
    pub fn check_block_sizes(&self, sizes: &[u64], max_bs: u64) -> Result<(), EngineError> {
        for f in &self.files {
            if let Some(&bad) = sizes.iter().find(|&&s| s % u64::from(f.block_size) != 0) {
                return Err(EngineError::BlockSize {
                    file: f.name.clone(),
                    bs: bad,
                    block_size: f.block_size,
                });
            }
            if max_bs > u64::from(f.attached.info.max_transfer) {
                return Err(EngineError::TransferTooLarge {
                    file: f.name.clone(),
                    bs: max_bs,
                    max: f.attached.info.max_transfer,
                });
            }
        }
        Ok(())
    }

    /// Allocates the job's I/O buffer area of `bytes` (fio's iomem_alloc), pinned and, for PCIe
    /// controllers, mapped for their devices. Returns its address for fio to carve.
    pub fn alloc_memory(&mut self, bytes: usize) -> Result<*mut u8, EngineError> {
        let size = bytes.max(4096).next_power_of_two();
        let mut whole =
            self.new_memory(size, 1)?
                .alloc(size)
                .map_err(|source| EngineError::IoBuffers {
                    count: 1,
                    size,
                    source,
                })?;
        let ptr = whole.as_mut_ptr();
        if let Some(m) = self.memory.as_mut() {
            m.whole = Some(whole);
        }
        Ok(ptr)
    }

    /// A pool of `count` buffers of `size` bytes, reachable by every controller of the job, kept as the
    /// job's memory.
    fn new_memory(&mut self, size: usize, count: usize) -> Result<DmaPool, EngineError> {
        let pool = DmaPool::builder()
            .class(size, count)
            .build()
            .map_err(|source| EngineError::IoBuffers {
                count,
                size,
                source,
            })?;
        let mut mapped: Vec<Arc<Attached>> = Vec::new();
        for f in &self.files {
            if f.attached.is_pcie() && !mapped.iter().any(|m| Arc::ptr_eq(m, &f.attached)) {
                f.attached.map_pool(&pool)?;
                mapped.push(Arc::clone(&f.attached));
            }
        }
        self.memory = Some(Memory {
            pool: pool.clone(),
            whole: None,
            mapped,
        });
        Ok(pool)
    }

    /// Takes each io_u's buffer out of the area (fio's post_init, after it carved): `bufs` holds each io_u's
    /// index and its buffer's address, `stride` bytes each.
    /// A job that moves no data (trim only) has no area: each io_u then gets a small buffer of its own (a
    /// deallocate's range is written there).
    pub fn carve(&mut self, bufs: &[(usize, usize)], stride: usize) -> Result<(), EngineError> {
        let n = bufs.iter().map(|b| b.0 + 1).max().unwrap_or(0);
        self.views = (0..n).map(|_| None).collect();
        if self.memory.is_none() {
            let count = n.max(1);
            let pool = self.new_memory(4096, count)?;
            for &(index, _) in bufs {
                let buf = pool.alloc(4096).map_err(|source| EngineError::IoBuffers {
                    count,
                    size: 4096,
                    source,
                })?;
                self.views[index] = Some(buf);
            }
            return Ok(());
        }
        let mem = self.memory.as_mut().expect("checked above");
        let mut rest = mem.whole.take().ok_or(EngineError::CarvedTwice)?;
        let base = rest.as_mut_ptr() as usize;
        let mut sorted = bufs.to_vec();
        sorted.sort_by_key(|b| b.1);
        let mut at = base;
        for (index, addr) in sorted {
            if addr < at {
                return Err(EngineError::BufferOverlaps { index, addr, base });
            }
            let outside = |source| EngineError::BufferOutside { index, source };
            let (_, tail) = rest.split_at(addr - at).map_err(outside)?;
            let (view, tail) = tail.split_at(stride).map_err(outside)?;
            self.views[index] = Some(view);
            rest = tail;
            at = addr + stride;
        }
        Ok(())
    }

    /// Sends one I/O (it leaves at once, or at the next commit or reap, as the send mode says).
    pub fn queue(&mut self, io: Io) -> Queued {
        let Some(f) = self.files.get_mut(io.file) else {
            return self.refuse(
                libc::EINVAL,
                format!("file {} is not one of the job's", io.file),
            );
        };
        let bs = u64::from(f.block_size);
        let (op, needs_range) = match io.dir {
            Dir::Read => (IoOp::Read, true),
            Dir::Write => (IoOp::Write, true),
            Dir::Trim => (IoOp::Deallocate, true),
            Dir::Flush => (IoOp::Flush, false),
        };
        let (lba, blocks) = if needs_range {
            if io.offset % bs != 0 || io.len % bs != 0 || io.len == 0 {
                let msg = format!(
                    "{}: offset {} and length {} are not whole {bs}-byte blocks",
                    f.name, io.offset, io.len
                );
                return self.refuse(libc::EINVAL, msg);
            }
            match u32::try_from(io.len / bs) {
                Ok(b) => (io.offset / bs, b),
                Err(_) => return self.refuse(libc::EINVAL, format!("{} bytes in one I/O", io.len)),
            }
        } else {
            (0, 0)
        };
        let buf = match op {
            IoOp::Flush => None,
            _ => {
                let Some(mut view) = self.views.get_mut(io.index).and_then(Option::take) else {
                    let msg = format!("io_u {} has no buffer (or is already queued)", io.index);
                    return self.refuse(libc::EINVAL, msg);
                };
                let window = if op == IoOp::Deallocate {
                    (0, nvpoll::spec::DSM_RANGE_SIZE)
                } else {
                    (io.buf_offset, io.len as usize)
                };
                if let Err(e) = view.set_window(window.0, window.1) {
                    self.views[io.index] = Some(view);
                    return self.refuse(libc::EINVAL, format!("io_u {}: {e}", io.index));
                }
                Some(view)
            }
        };
        let req = IoRequest {
            op,
            nsid: f.nsid,
            lba,
            blocks,
            buf,
            tag: io.index as u64,
        };
        match f.qp.submit(req) {
            Ok(()) => {
                self.outstanding += 1;
                self.unsent += 1;
                Queued::Queued
            }
            Err(r) => {
                if let Some(b) = r.request.buf {
                    self.views[io.index] = Some(b);
                }
                match r.error {
                    Error::QueueFull => Queued::Busy,
                    e => {
                        let msg = format!("{}: {e}", self.files[io.file].name);
                        self.refuse(errno(&e), msg)
                    }
                }
            }
        }
    }

    fn refuse(&mut self, errno: i32, msg: String) -> Queued {
        self.note_error(&msg);
        Queued::Failed(errno)
    }

    fn note_error(&mut self, msg: &str) {
        self.errors += 1;
        if self.errors <= LOGGED_ERRORS {
            (self.log)(&format!("nvpoll: I/O failed: {msg}"));
        }
    }

    /// fio's commit. With the deferred send mode it sends nothing: fio commits after every queued I/O
    /// (iodepth_batch=1, its default), so what was queued leaves at the next reap, together, in one write
    /// (with TLS, in as few records). The other modes have sent already.
    pub fn commit(&mut self) {}

    /// Sends everything queued on every queue pair.
    fn flush_all(&mut self) {
        self.unsent = 0;
        for i in 0..self.files.len() {
            if let Err(e) = self.files[i].qp.flush() {
                let msg = format!("{}: {e}", self.files[i].name);
                self.note_error(&msg);
            }
        }
    }

    /// Hands out up to `max` completions the queue pairs already hold, without a system call.
    fn take_done(&mut self, max: usize) {
        for i in 0..self.files.len() {
            while self.events.len() < max {
                let Some(c) = self.files[i].qp.pop_completion() else {
                    break;
                };
                let index = c.tag as usize;
                if let (Some(slot), Some(b)) = (self.views.get_mut(index), c.buf) {
                    *slot = Some(b);
                }
                let err = match &c.result {
                    Ok(()) => 0,
                    Err(e) => {
                        let msg = format!("{}: {e}", self.files[i].name);
                        self.note_error(&msg);
                        errno(e)
                    }
                };
                self.outstanding = self.outstanding.saturating_sub(1);
                self.events.push((index, err));
            }
        }
    }

    /// Polls until at least `min` (and at most `max`) I/Os completed, or `timeout` passed. Returns how many;
    /// [`Job::event`] hands them out.
    ///
    /// fio reaps one completion at a time by default (iodepth_batch_complete_max defaults to its _min, 1), so
    /// a reap takes from the transport everything that has arrived, keeps what is past `max` for the next
    /// reaps, and touches the socket only when that is used up: then it sends what was queued since (one
    /// write for many I/Os in the deferred mode) and polls.
    pub fn reap(&mut self, min: usize, max: usize, timeout: Option<Duration>) -> usize {
        self.events.clear();
        self.take_done(max);
        if self.events.len() >= min.max(1) {
            return self.events.len();
        }
        // When everything in flight left just now (qd1 jobs), nothing can have come back yet: a yielding job
        // lets the others run before it looks.
        let just_sent = self.unsent > 0 && self.unsent >= self.outstanding;
        self.flush_all();
        let yields = self.yields();
        if just_sent && yields && min > 0 {
            std::thread::yield_now();
        }
        let start = timeout.map(|_| Instant::now());
        loop {
            let before = self.events.len();
            for i in 0..self.files.len() {
                let depth = self.files[i].qp.depth();
                if let Err(e) = self.files[i].qp.poll(depth) {
                    // The queue pair failed: its commands come back with errors.
                    let msg = format!("{}: {e}", self.files[i].name);
                    self.note_error(&msg);
                }
            }
            self.take_done(max);
            let n = self.events.len();
            let expired = match (start, timeout) {
                (Some(s), Some(t)) => s.elapsed() >= t,
                _ => false,
            };
            if n >= min || n >= max || expired {
                return n;
            }
            if n == before {
                // Anything a retry or a reconnect queued goes out too.
                self.flush_all();
                if yields {
                    std::thread::yield_now();
                }
            }
        }
    }

    /// Whether this job yields between empty polls now: it asked to, or it asked to spin while more jobs are
    /// open than it has CPUs. One relaxed load a reap.
    fn yields(&self) -> bool {
        let jobs = OPEN_JOBS.load(Ordering::Relaxed);
        let idle = self.idle.for_cpus(jobs, self.cpus);
        if idle != self.idle {
            SPIN_ADVICE.call_once(|| (self.log)(&Idle::spin_advice(jobs, self.cpus)));
        }
        idle == Idle::Yield
    }

    /// The `i`th I/O the last reap collected: its io_u index and errno (0: success).
    pub fn event(&self, i: usize) -> Option<(usize, i32)> {
        self.events.get(i).copied()
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        OPEN_JOBS.fetch_sub(1, Ordering::Relaxed);
        // The queue pairs go first (no device writes the buffers any more), then the buffers' IOMMU
        // mappings, then the buffers.
        let files = std::mem::take(&mut self.files);
        let attached: Vec<Arc<Attached>> = files.iter().map(|f| Arc::clone(&f.attached)).collect();
        drop(files);
        if let Some(mem) = &self.memory {
            for a in &mem.mapped {
                a.unmap_pool(&mem.pool);
            }
        }
        if self.errors > LOGGED_ERRORS {
            (self.log)(&format!(
                "nvpoll: {} I/Os failed in all ({} logged)",
                self.errors, LOGGED_ERRORS
            ));
        }
        self.views.clear();
        self.memory = None;
        drop(attached);
    }
}

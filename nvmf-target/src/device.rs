//! Namespaces backed by another NVMe namespace reached through the queue-pair API: typically a local SSD
//! driven by nvpoll-pcie, which the target then exports over NVMe/TCP.
//!
//! The target's stores are synchronous (a session reads into its send buffer and writes from its receive
//! buffer), so this backing completes each command before it returns: it submits on its own queue pair and
//! polls it until the completion arrives. On a real SSD that is a few microseconds of the calling reactor's
//! time per command; the queue pair is shared by every session behind a lock. A deeper integration (commands
//! held open while the device works, as flushes are) is the next step for throughput.

use std::fmt;
use std::io;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nvpoll::api::{Controller, IoOp, IoRequest, Namespace as HostNamespace, QueuePair};
use nvpoll::mem::DmaPool;

/// A block device the target can export.
pub trait BlockDevice: Send + Sync + fmt::Debug {
    /// Logical block size in bytes; the exported namespace uses the same.
    fn block_size(&self) -> u32;
    /// Size in bytes.
    fn size_bytes(&self) -> u64;
    /// Reads `out.len()` bytes at byte offset `off` (block aligned).
    fn read(&self, off: u64, out: &mut [u8]) -> io::Result<()>;
    /// Writes `data` at byte offset `off` (block aligned).
    fn write(&self, off: u64, data: &[u8]) -> io::Result<()>;
    /// Makes completed writes durable.
    fn flush(&self) -> io::Result<()>;
    /// Whether [`BlockDevice::deallocate`] works here.
    fn can_deallocate(&self) -> bool {
        false
    }
    /// Deallocates (trims) `len` bytes at byte offset `off` (block aligned); what they read as afterwards is
    /// the device's to say.
    fn deallocate(&self, off: u64, len: u64) -> io::Result<()> {
        let _ = (off, len);
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "the device has no Dataset Management",
        ))
    }
    /// What it is, for logs.
    fn describe(&self) -> String;
}

/// One namespace of a controller, through one queue pair of it. Keeps the controller alive (and its admin
/// side serviced) for as long as the device is used.
pub struct QueuePairDevice<C: Controller> {
    inner: Mutex<Inner<C>>,
    ns: HostNamespace,
    max_transfer: u32,
    /// The controller has Dataset Management (ONCS bit 2).
    dsm: bool,
    name: String,
}

struct Inner<C: Controller> {
    ctrl: C,
    qp: C::QueuePair,
    pool: DmaPool,
    next_admin: Instant,
}

impl<C: Controller> fmt::Debug for QueuePairDevice<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueuePairDevice")
            .field("name", &self.name)
            .field("ns", &self.ns)
            .finish_non_exhaustive()
    }
}

/// How long one command may take before the backing reports an I/O error.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

impl<C> QueuePairDevice<C>
where
    C: Controller + Send,
    C::QueuePair: Send,
{
    /// Uses namespace `nsid` of `ctrl` through a new queue pair; I/O buffers come from `pool`, which must be
    /// the controller's DMA pool. `name` describes it in logs (for example the PCI address).
    pub fn new(
        mut ctrl: C,
        pool: DmaPool,
        nsid: u32,
        name: impl Into<String>,
    ) -> nvpoll::Result<Self> {
        let ns = ctrl
            .namespaces()
            .iter()
            .find(|n| n.nsid == nsid)
            .cloned()
            .ok_or_else(|| {
                nvpoll::Error::InvalidArgument(format!(
                    "the controller has no active namespace {nsid}"
                ))
            })?;
        let max_transfer = ctrl.max_transfer().unwrap_or(128 * 1024).min(1 << 20);
        let dsm = ctrl.identify().oncs & nvpoll::spec::IdentifyController::ONCS_DSM != 0;
        let qp = ctrl.create_queue_pair(4)?;
        Ok(QueuePairDevice {
            inner: Mutex::new(Inner {
                ctrl,
                qp,
                pool,
                next_admin: Instant::now(),
            }),
            ns,
            max_transfer,
            dsm,
            name: name.into(),
        })
    }

    /// Runs one command to completion, chunk by chunk up to the largest transfer.
    fn io(
        &self,
        op: IoOp,
        off: u64,
        len: usize,
        mut data: impl FnMut(usize, &mut [u8]),
    ) -> io::Result<()> {
        let bs = u64::from(self.ns.block_size);
        if off % bs != 0 || len as u64 % bs != 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "unaligned device I/O",
            ));
        }
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let inner = &mut *inner;
        if Instant::now() >= inner.next_admin {
            inner.ctrl.poll_admin().map_err(io::Error::other)?;
            inner.next_admin = Instant::now() + Duration::from_millis(100);
        }
        let mut done = 0usize;
        while done < len || (op == IoOp::Flush && done == 0) {
            // A deallocate carries one range of at most u32::MAX blocks and no data of the namespace.
            let n = if op == IoOp::Deallocate {
                (len - done).min((u64::from(u32::MAX) * bs) as usize)
            } else {
                (len - done).min(self.max_transfer as usize)
            };
            let buf = if op == IoOp::Deallocate {
                Some(
                    inner
                        .pool
                        .alloc(nvpoll::spec::DSM_RANGE_SIZE)
                        .map_err(io::Error::other)?,
                )
            } else if n > 0 {
                let mut b = inner.pool.alloc(n).map_err(io::Error::other)?;
                if op == IoOp::Write {
                    data(done, b.as_mut_slice());
                }
                Some(b)
            } else {
                None
            };
            let lba = (off + done as u64) / bs;
            let blocks = (n as u64 / bs) as u32;
            let req = IoRequest {
                op,
                nsid: self.ns.nsid,
                lba,
                blocks,
                buf,
                tag: 0,
            };
            inner
                .qp
                .submit(req)
                .map_err(|r| io::Error::other(r.error))?;
            inner.qp.flush().map_err(io::Error::other)?;
            let deadline = Instant::now() + COMMAND_TIMEOUT;
            let c = loop {
                inner.qp.poll(1).map_err(io::Error::other)?;
                if let Some(c) = inner.qp.pop_completion() {
                    break c;
                }
                if Instant::now() >= deadline {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "device command timed out",
                    ));
                }
            };
            c.result.map_err(io::Error::other)?;
            if op == IoOp::Read {
                let mut b = c.buf.expect("a read hands its buffer back");
                data(done, &mut b.as_mut_slice()[..n]);
            }
            if op == IoOp::Flush {
                break;
            }
            done += n;
        }
        Ok(())
    }
}

impl<C> BlockDevice for QueuePairDevice<C>
where
    C: Controller + Send,
    C::QueuePair: Send,
{
    fn block_size(&self) -> u32 {
        self.ns.block_size
    }

    fn size_bytes(&self) -> u64 {
        self.ns.capacity_bytes()
    }

    fn read(&self, off: u64, out: &mut [u8]) -> io::Result<()> {
        let len = out.len();
        self.io(IoOp::Read, off, len, |at, chunk| {
            out[at..at + chunk.len()].copy_from_slice(chunk)
        })
    }

    fn write(&self, off: u64, data: &[u8]) -> io::Result<()> {
        self.io(IoOp::Write, off, data.len(), |at, chunk| {
            let n = chunk.len();
            chunk.copy_from_slice(&data[at..at + n]);
        })
    }

    fn flush(&self) -> io::Result<()> {
        self.io(IoOp::Flush, 0, 0, |_, _| {})
    }

    fn can_deallocate(&self) -> bool {
        self.dsm
    }

    fn deallocate(&self, off: u64, len: u64) -> io::Result<()> {
        if !self.dsm {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "the device has no Dataset Management",
            ));
        }
        let len = usize::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        self.io(IoOp::Deallocate, off, len, |_, _| {})
    }

    fn describe(&self) -> String {
        format!("{} namespace {}", self.name, self.ns.nsid)
    }
}

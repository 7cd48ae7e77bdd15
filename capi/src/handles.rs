//! The state behind the C interface's handles, in safe Rust: the pool, the controller of either transport,
//! the queue pair with its table of requests in flight, and the DMA buffer a C caller holds.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::ffi::c_void;
use std::ops::Range;
use std::rc::Rc;
use std::sync::Arc;

use nvpoll_core::api::{Completion, Controller, ControllerInfo, IoOp, IoRequest, QueuePair};
use nvpoll_core::mem::{DmaBuf, DmaPool};
use nvpoll_core::trid::TransportId;
use nvpoll_core::Error;
use nvpoll_pcie::{PcieController, PcieOptions};
use nvpoll_tcp::host::{ConnectOptions, TcpController};

use crate::error::{invalid, Failure};
use crate::ffi::{NvpollCb, NvpollCompletion};
use nvpoll_core::aio::CompletionFd;

/// A DMA pool (`nvpoll_pool` in C): pinned memory carved into buffers of fixed size classes.
#[derive(Debug)]
pub struct NvpollPool {
    pub(crate) pool: DmaPool,
}

impl NvpollPool {
    /// A pool of `small` buffers of 4 KiB and `large` buffers of `large_size` bytes (none when `large` is 0).
    pub(crate) fn new(
        small: usize,
        large_size: usize,
        large: usize,
    ) -> Result<NvpollPool, Failure> {
        let mut b = DmaPool::builder();
        if small > 0 {
            b = b.class(nvpoll_core::mem::PAGE_SIZE, small);
        }
        if large > 0 {
            b = b.class(large_size, large);
        }
        Ok(NvpollPool { pool: b.build()? })
    }

    /// Takes a buffer of `len` bytes.
    pub(crate) fn alloc(&self, len: usize) -> Result<NvpollBuf, Failure> {
        if len == 0 {
            return Err(invalid("a DMA buffer of 0 bytes"));
        }
        let mut buf = self.pool.alloc(len)?;
        let ptr = buf.as_mut_ptr();
        Ok(NvpollBuf {
            state: Rc::new(RefCell::new(BufState::Held(buf))),
            ptr,
            len,
        })
    }
}

/// Where a buffer is.
#[derive(Debug)]
pub(crate) enum BufState {
    /// With its C owner.
    Held(DmaBuf),
    /// Submitted: the queue pair's until its completion.
    InFlight,
    /// Its queue pair was freed with it in flight: the memory went back to the pool with the request, and
    /// only the handle is left to free.
    Lost,
}

/// A DMA buffer (`nvpoll_buf` in C): its memory stays at one address from allocation to free. Between a
/// submit and that request's completion it belongs to the queue pair.
#[derive(Debug)]
pub struct NvpollBuf {
    pub(crate) state: Rc<RefCell<BufState>>,
    pub(crate) ptr: *mut u8,
    pub(crate) len: usize,
}

impl NvpollBuf {
    /// Whether the caller holds the buffer (it is neither in flight nor lost).
    pub(crate) fn is_held(&self) -> bool {
        matches!(*self.state.borrow(), BufState::Held(_))
    }

    /// Whether the buffer is in flight (its handle may not be freed).
    pub(crate) fn is_in_flight(&self) -> bool {
        matches!(*self.state.borrow(), BufState::InFlight)
    }
}

/// A controller of either transport.
#[derive(Debug)]
enum Ctrl {
    Tcp(Box<TcpController>),
    Pcie(Box<PcieController>),
}

/// What `nvpoll_ctrl_open` was given besides the transport ID.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct OpenOptions<'a> {
    pub(crate) hostnqn: Option<&'a str>,
    pub(crate) psk: Option<&'a str>,
    pub(crate) psk_identity: Option<&'a str>,
    pub(crate) psk_identity_version: u8,
}

/// An open controller (`nvpoll_ctrl` in C).
#[derive(Debug)]
pub struct NvpollCtrl {
    ctrl: Ctrl,
    pool: DmaPool,
    /// One clone per open queue pair: the controller closes only when it holds the last.
    qpairs: Arc<()>,
}

impl NvpollCtrl {
    /// Parses `trid` and opens its controller with its DMA memory from `pool`: connects and brings up an
    /// NVMe/TCP controller (with TLS when `opts` has a PSK), or opens a PCIe controller through VFIO.
    pub(crate) fn open(
        trid: &str,
        opts: OpenOptions<'_>,
        pool: &DmaPool,
    ) -> Result<NvpollCtrl, Failure> {
        let trid: TransportId = trid.parse().map_err(|e| invalid(format!("{e}")))?;
        if opts.psk.is_none() && opts.psk_identity.is_some() {
            return Err(invalid("a PSK identity without a PSK"));
        }
        if opts.psk_identity_version > 1 {
            return Err(invalid(format!(
                "PSK identity version {}: 0 (NVMe0R0x) or 1 (NVMe1R0x)",
                opts.psk_identity_version
            )));
        }
        let ctrl = match &trid {
            TransportId::Pcie { bdf } => {
                if opts.psk.is_some() {
                    return Err(invalid("TLS (a PSK) applies to trtype:tcp only"));
                }
                let c = PcieController::open(*bdf, pool.clone(), PcieOptions::default())
                    .map_err(Error::from)?;
                Ctrl::Pcie(Box::new(c))
            }
            TransportId::Tcp { .. } => {
                let mut o = ConnectOptions::from_trid(&trid, opts.hostnqn).map_err(Error::from)?;
                if let Some(psk) = opts.psk {
                    o = o
                        .with_psk_args(psk, opts.psk_identity, opts.psk_identity_version)
                        .map_err(Error::from)?;
                }
                Ctrl::Tcp(Box::new(
                    TcpController::connect(o, pool.clone()).map_err(Error::from)?,
                ))
            }
        };
        Ok(NvpollCtrl {
            ctrl,
            pool: pool.clone(),
            qpairs: Arc::new(()),
        })
    }

    /// What attach learnt: the namespaces, the largest transfer.
    pub(crate) fn info(&self) -> &ControllerInfo {
        match &self.ctrl {
            Ctrl::Tcp(c) => Controller::info(&**c),
            Ctrl::Pcie(c) => Controller::info(&**c),
        }
    }

    /// Services the admin queue: keep-alive, reconnects, health.
    pub(crate) fn poll_admin(&mut self) -> Result<(), Failure> {
        match &mut self.ctrl {
            Ctrl::Tcp(c) => Controller::poll_admin(&mut **c)?,
            Ctrl::Pcie(c) => Controller::poll_admin(&mut **c)?,
        }
        Ok(())
    }

    /// How many queue pairs of this controller are open.
    pub(crate) fn open_qpairs(&self) -> usize {
        Arc::strong_count(&self.qpairs) - 1
    }

    /// Connects (TCP) or creates (PCIe) one I/O queue pair of `depth` commands.
    pub(crate) fn create_qpair(&mut self, depth: u16) -> Result<NvpollQpair, Failure> {
        let qp: Box<dyn QueuePair> = match &mut self.ctrl {
            Ctrl::Tcp(c) => Box::new(c.create_queue_pair(depth)?),
            Ctrl::Pcie(c) => Box::new(c.create_queue_pair(depth)?),
        };
        let slots = qp.depth().max(1);
        let region = self
            .pool
            .regions()
            .iter()
            .map(|r| r.vaddr..r.vaddr + r.len)
            .collect();
        Ok(NvpollQpair {
            qp,
            slots: (0..slots).map(|_| None).collect(),
            free: (0..slots as u32).rev().collect(),
            ready: VecDeque::with_capacity(slots),
            in_callback: false,
            pool: region,
            _ctrl: Arc::clone(&self.qpairs),
            waiter: None,
        })
    }

    /// Shuts the controller down (its queue pairs must be freed first).
    pub(crate) fn close(self) -> Result<(), Failure> {
        match self.ctrl {
            Ctrl::Tcp(c) => Controller::shutdown(*c)?,
            Ctrl::Pcie(c) => Controller::shutdown(*c)?,
        }
        Ok(())
    }
}

/// What one submit asks for, besides its buffer and callback.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Request {
    pub(crate) op: IoOp,
    pub(crate) nsid: u32,
    pub(crate) lba: u64,
    pub(crate) blocks: u32,
}

/// A request in flight: what its completion calls or hands back.
#[derive(Debug)]
struct Pending {
    cb: NvpollCb,
    arg: *mut c_void,
    /// The buffer's state (to give the memory back at completion) and the C handle's address (to hand back).
    buf: Option<(Rc<RefCell<BufState>>, *mut NvpollBuf)>,
}

/// A finished request, taken from the queue pair.
#[derive(Debug)]
pub(crate) struct Done {
    /// The callback given at submit (`None`: the completion waits for `nvpoll_qpair_reap`).
    pub(crate) cb: NvpollCb,
    /// The callback's argument.
    pub(crate) arg: *mut c_void,
    /// The buffer handle given at submit (null without one).
    pub(crate) buf: *mut NvpollBuf,
    /// Why it failed, if it did.
    pub(crate) failure: Option<Failure>,
    /// The buffer's state and memory, given back to the handle when the caller gets the completion.
    give_back: Option<(Rc<RefCell<BufState>>, Option<DmaBuf>)>,
}

impl Done {
    /// Hands the buffer back to its C owner: from now on the caller may touch or free it.
    pub(crate) fn release_buffer(&mut self) {
        if let Some((state, buf)) = self.give_back.take() {
            *state.borrow_mut() = match buf {
                Some(b) => BufState::Held(b),
                None => BufState::Lost,
            };
        }
    }

    /// The entry `nvpoll_qpair_reap` writes for this completion.
    pub(crate) fn entry(&self) -> NvpollCompletion {
        NvpollCompletion {
            arg: self.arg,
            buf: self.buf,
            status: self.failure.as_ref().map_or(0, |f| f.code() as i32),
            nvme_status: self.failure.as_ref().map_or(0, Failure::nvme_status),
        }
    }
}

/// A queue pair (`nvpoll_qpair` in C), owned by one thread at a time.
pub struct NvpollQpair {
    qp: Box<dyn QueuePair>,
    /// The requests in flight, by tag.
    slots: Vec<Option<Pending>>,
    /// The free tags.
    free: Vec<u32>,
    /// Completions of requests submitted without a callback, until reaped.
    ready: VecDeque<Done>,
    /// A callback of this queue pair is running (it may submit and flush, not process, reap or free).
    pub(crate) in_callback: bool,
    /// The controller's pool: a buffer must lie in it.
    pool: Vec<Range<usize>>,
    /// Counts this queue pair as open on its controller.
    _ctrl: Arc<()>,
    /// The completion fd, once asked for.
    pub(crate) waiter: Option<CompletionFd>,
}

impl std::fmt::Debug for NvpollQpair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvpollQpair")
            .field("depth", &self.slots.len())
            .field("in_flight", &(self.slots.len() - self.free.len()))
            .field("ready", &self.ready.len())
            .finish()
    }
}

impl NvpollQpair {
    /// Submits one request. `buf` is the C handle and its address; it becomes the queue pair's until the
    /// request completes.
    pub(crate) fn submit(
        &mut self,
        req: Request,
        buf: Option<(&NvpollBuf, *mut NvpollBuf)>,
        cb: NvpollCb,
        arg: *mut c_void,
    ) -> Result<(), Failure> {
        let Some(tag) = self.free.last().copied() else {
            return Err(Error::QueueFull.into());
        };
        let taken = match buf {
            Some((handle, addr)) => {
                let mut state = handle.state.borrow_mut();
                match &*state {
                    BufState::Held(b) => {
                        let at = handle.ptr as usize;
                        if !self.pool.iter().any(|r| r.contains(&at)) {
                            return Err(invalid(
                                "the buffer is not from the pool the controller was opened with",
                            ));
                        }
                        debug_assert_eq!(b.len(), handle.len);
                    }
                    BufState::InFlight => {
                        return Err(Failure::Busy(
                            "the buffer is in flight (submitted and not yet completed)".into(),
                        ))
                    }
                    BufState::Lost => {
                        return Err(invalid(
                            "the buffer was lost with a freed queue pair; free it",
                        ))
                    }
                }
                let BufState::Held(b) = std::mem::replace(&mut *state, BufState::InFlight) else {
                    unreachable!("matched Held above");
                };
                Some((b, Rc::clone(&handle.state), addr))
            }
            None => None,
        };
        let (dma, keep) = match taken {
            Some((b, state, addr)) => (Some(b), Some((state, addr))),
            None => (None, None),
        };
        let req = IoRequest {
            op: req.op,
            nsid: req.nsid,
            lba: req.lba,
            blocks: req.blocks,
            buf: dma,
            tag: u64::from(tag),
        };
        match self.qp.submit(req) {
            Ok(()) => {
                self.free.pop();
                self.slots[tag as usize] = Some(Pending { cb, arg, buf: keep });
                Ok(())
            }
            Err(rejected) => {
                if let (Some((state, _)), Some(b)) = (keep, rejected.request.buf) {
                    *state.borrow_mut() = BufState::Held(b);
                }
                Err(rejected.error.into())
            }
        }
    }

    /// Sends what was queued.
    pub(crate) fn flush(&mut self) -> Result<(), Failure> {
        Ok(self.qp.flush()?)
    }

    /// Polls the transport for up to `max` completions.
    pub(crate) fn poll(&mut self, max: usize) -> Result<usize, Error> {
        self.qp.poll(max)
    }

    /// Takes the next finished request from the transport. Its buffer stays the queue pair's until
    /// [`Done::release_buffer`].
    pub(crate) fn pop(&mut self) -> Option<Done> {
        loop {
            let Completion { tag, buf, result } = self.qp.pop_completion()?;
            let Some(p) = self.slots.get_mut(tag as usize).and_then(Option::take) else {
                // Not a tag of ours: the transport hands back only what was submitted, so never.
                debug_assert!(false, "completion of tag {tag}, which is not in flight");
                continue;
            };
            self.free.push(tag as u32);
            let (give_back, addr) = match p.buf {
                Some((state, addr)) => (Some((state, buf)), addr),
                None => (None, std::ptr::null_mut()),
            };
            return Some(Done {
                cb: p.cb,
                arg: p.arg,
                buf: addr,
                failure: result.err().map(Failure::Api),
                give_back,
            });
        }
    }

    /// Keeps a completion without a callback for `nvpoll_qpair_reap`.
    pub(crate) fn keep_for_reap(&mut self, done: Done) {
        self.ready.push_back(done);
    }

    /// Completions kept for reaping.
    pub(crate) fn ready_len(&self) -> usize {
        self.ready.len()
    }

    /// The oldest completion kept for reaping.
    pub(crate) fn take_ready(&mut self) -> Option<Done> {
        self.ready.pop_front()
    }

    /// Requests submitted and not yet handed back (in flight or waiting to be reaped).
    pub(crate) fn outstanding(&self) -> usize {
        self.slots.len() - self.free.len() + self.ready.len()
    }

    /// Creates the completion fd if need be, and points it at what can now complete a request.
    pub(crate) fn arm_waiter(&mut self) -> Result<std::os::fd::RawFd, Failure> {
        if self.waiter.is_none() {
            self.waiter = Some(CompletionFd::new()?);
        }
        self.rearm()?;
        Ok(self.waiter.as_ref().map_or(-1, |w| {
            std::os::fd::AsRawFd::as_raw_fd(&std::os::fd::AsFd::as_fd(w))
        }))
    }

    /// Points the completion fd (if asked for) at what can now complete a request.
    pub(crate) fn rearm(&mut self) -> Result<(), Failure> {
        if let Some(w) = &mut self.waiter {
            w.arm(&*self.qp, !self.ready.is_empty())?;
        }
        Ok(())
    }
}

impl Drop for NvpollQpair {
    /// Requests still in flight are dropped with the queue pair, unanswered: their buffers' handles are left
    /// to free, without memory.
    fn drop(&mut self) {
        for p in self.slots.iter_mut().filter_map(Option::take) {
            if let Some((state, _)) = p.buf {
                *state.borrow_mut() = BufState::Lost;
            }
        }
        for mut d in self.ready.drain(..) {
            d.release_buffer();
        }
    }
}

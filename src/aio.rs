//! An async interface over any [`QueuePair`]: each command a future that resolves to its completion.
//!
//! [`AsyncQueue`] wraps one queue pair on the thread that owns it (it is neither `Send` nor `Sync`: a queue
//! pair belongs to one reactor). Its methods ([`read`](AsyncQueue::read), [`write`](AsyncQueue::write),
//! [`flush`](AsyncQueue::flush), [`write_zeroes`](AsyncQueue::write_zeroes), or any [`IoRequest`] through
//! [`submit`](AsyncQueue::submit)) return an [`Io`] future. Nothing happens until the future is polled: its
//! first poll hands the command to the queue pair, or waits for room when the queue is full; it resolves to
//! the command's [`Completion`], its buffer handed back, exactly once.
//!
//! **Who drives it.** A future is woken by the pass that reaps its completion: [`AsyncQueue::poll`] sends
//! what the futures submitted (one flush for all of them, as a reactor's end of iteration does) and reaps
//! completions. Three ways to call it:
//! - on our reactors, a [`LocalExecutor`] runs the futures (which need not be `Send`) and drives the queues
//!   registered with it, as a [`Poller`]: one reactor, one thread, no locks;
//! - standalone, [`LocalExecutor::block_on`] does the same on the calling thread;
//! - from another executor (tokio, or any), a driver task calls [`AsyncQueue::poll`] and, when there is
//!   nothing to do, sleeps on [`AsyncQueue::completion_fd`] after [`AsyncQueue::arm`], having left its waker
//!   with [`AsyncQueue::set_driver_waker`] so that a new submission wakes it to send.
//!
//! **Costs.** No allocation per command in steady state: the slots that pair completions with futures are
//! allocated once, at the queue pair's depth, and a future is a plain value inside its caller's future. A
//! dropped future whose command is in flight leaves its slot reserved until the completion arrives; the
//! completion, and its buffer, are then dropped (the buffer goes back to its pool).
//!
//! ```no_run
//! # fn demo<Q: nvpoll::api::QueuePair + 'static>(qp: Q, pool: nvpoll::mem::DmaPool) -> nvpoll::Result<()> {
//! use nvpoll::aio::{AsyncQueue, LocalExecutor};
//! let q = AsyncQueue::new(qp);
//! let mut ex = LocalExecutor::new();
//! ex.drive(&q);
//! let buf = pool.alloc(4096)?;
//! let done = ex.block_on(q.read(1, 0, 8, buf));
//! done.result?;
//! # Ok(()) }
//! ```

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::Future;
use std::os::fd::{AsFd, OwnedFd};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Instant;

use crate::api::{Completion, IoOp, IoRequest, QueuePair, Rejected};
pub use crate::completion_fd::CompletionFd;
use crate::mem::DmaBuf;
use crate::reactor::{PollStatus, Poller, ReactorContext, ReactorWaker, WakeSources};
use crate::{Error, Result};

/// What pairs a command in flight with its future.
enum Slot {
    /// Not in use.
    Free,
    /// In flight, with the caller's tag; the future's waker is the slot's entry in `State::wakers`.
    Waiting { tag: u64 },
    /// Completed, not yet taken by its future.
    Ready(Completion),
    /// In flight, its future dropped: the completion is dropped when it comes.
    Abandoned,
}

struct State<Q> {
    qp: Q,
    slots: Vec<Slot>,
    /// Each slot's future's waker, kept after the command completes: a task that awaits one command after
    /// another gets its slot back (the free list hands out the last slot freed) and finds its own waker there,
    /// so a command costs no waker clone (an atomic increment, and a decrement when it is woken).
    wakers: Vec<Option<Waker>>,
    free: Vec<u32>,
    /// Futures waiting for a free slot (the queue was full when they were polled).
    room: VecDeque<Waker>,
    /// The task that drives this queue from another executor: woken when a future submits.
    driver: Option<Waker>,
    /// Commands submitted since the last flush.
    unsent: bool,
    /// What to wake once the state is no longer borrowed (kept to reuse its capacity).
    to_wake: Wakes,
    /// The completion fd (made on first use).
    waiter: Option<CompletionFd>,
}

/// A queue pair's async interface (see the [module](self)). Cloning gives another handle to the same queue.
///
/// # Examples
///
/// Write two blocks, read them back, zero one and flush, each an `await`; the queue pair is an in-memory one
/// (hidden lines), a TCP or PCIe one is wrapped the same way:
///
/// ```
/// # mod ram { include!("doctest/ram.rs"); }
/// use nvpoll::aio::{AsyncQueue, LocalExecutor};
/// use nvpoll::api::{IoOp, IoRequest, QueuePair};
/// use nvpoll::mem::DmaPool;
///
/// let pool = DmaPool::builder().class(4096, 8).build()?;
/// let q = AsyncQueue::new(ram::RamQueuePair::new(16));
/// let mut ex = LocalExecutor::new();
/// ex.drive(&q);
///
/// let (q2, pool2) = (q.clone(), pool.clone());
/// let read_back = ex.block_on(async move {
///     let mut data = pool2.alloc(1024)?;
///     data.fill(0xee);
///     q2.write(1, 10, 2, data).await.result?;
///     let done = q2.read(1, 10, 2, pool2.alloc(1024)?).await;
///     done.result?;
///     q2.write_zeroes(1, 11, 1).await.result?;
///     q2.flush(1).await.result?;
///     // Any request, with a tag of its own:
///     let req = IoRequest { op: IoOp::Read, nsid: 1, lba: 11, blocks: 1, buf: Some(pool2.alloc(512)?), tag: 99 };
///     let zeroed = q2.submit(req).await;
///     assert_eq!(zeroed.tag, 99);
///     assert!(zeroed.buf.as_deref().is_some_and(|b| b.iter().all(|&x| x == 0)));
///     Ok::<_, nvpoll::Error>(done.buf)
/// })?;
/// assert!(read_back.ok_or("no buffer")?.iter().all(|&x| x == 0xee));
///
/// assert_eq!(q.outstanding(), 0);
/// assert!(!q.has_unsent());
/// assert_eq!(q.with_queue_pair(|qp| qp.stats().commands), 5);
/// drop(ex); // the executor holds a handle too
/// let qp = q.into_queue_pair().map_err(|_| "another handle is alive")?;
/// assert_eq!(qp.outstanding(), 0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct AsyncQueue<Q: QueuePair> {
    state: Rc<RefCell<State<Q>>>,
}

impl<Q: QueuePair> Clone for AsyncQueue<Q> {
    fn clone(&self) -> Self {
        AsyncQueue {
            state: Rc::clone(&self.state),
        }
    }
}

impl<Q: QueuePair> AsyncQueue<Q> {
    /// Wraps `qp`: as many commands may be in flight as its depth.
    /// See [`AsyncQueue`]'s example.
    pub fn new(qp: Q) -> AsyncQueue<Q> {
        let depth = qp.depth().max(1);
        let slots = (0..depth).map(|_| Slot::Free).collect();
        let wakers = (0..depth).map(|_| None).collect();
        // Handed out lowest first.
        let free = (0..depth as u32).rev().collect();
        AsyncQueue {
            state: Rc::new(RefCell::new(State {
                qp,
                slots,
                wakers,
                free,
                room: VecDeque::with_capacity(depth),
                driver: None,
                unsent: false,
                to_wake: Wakes {
                    slots: Vec::with_capacity(depth),
                    others: Vec::new(),
                },
                waiter: None,
            })),
        }
    }

    /// Reads `blocks` blocks at `lba` of namespace `nsid` into `buf`.
    /// See [`AsyncQueue`]'s example.
    pub fn read(&self, nsid: u32, lba: u64, blocks: u32, buf: DmaBuf) -> Io<Q> {
        self.io(IoOp::Read, nsid, lba, blocks, Some(buf))
    }

    /// Writes `blocks` blocks from `buf` at `lba` of namespace `nsid`.
    /// See [`AsyncQueue`]'s example.
    pub fn write(&self, nsid: u32, lba: u64, blocks: u32, buf: DmaBuf) -> Io<Q> {
        self.io(IoOp::Write, nsid, lba, blocks, Some(buf))
    }

    /// Flushes namespace `nsid`'s volatile write cache.
    /// See [`AsyncQueue`]'s example.
    pub fn flush(&self, nsid: u32) -> Io<Q> {
        self.io(IoOp::Flush, nsid, 0, 0, None)
    }

    /// Writes zeroes to `blocks` blocks at `lba` of namespace `nsid`, with no data transfer.
    /// See [`AsyncQueue`]'s example.
    pub fn write_zeroes(&self, nsid: u32, lba: u64, blocks: u32) -> Io<Q> {
        self.io(IoOp::WriteZeroes, nsid, lba, blocks, None)
    }

    fn io(&self, op: IoOp, nsid: u32, lba: u64, blocks: u32, buf: Option<DmaBuf>) -> Io<Q> {
        self.submit(IoRequest {
            op,
            nsid,
            lba,
            blocks,
            buf,
            tag: 0,
        })
    }

    /// Any request; its `tag` comes back in the [`Completion`].
    /// See [`AsyncQueue`]'s example.
    pub fn submit(&self, req: IoRequest) -> Io<Q> {
        Io {
            state: Rc::clone(&self.state),
            stage: Stage::New(Some(req)),
        }
    }

    /// One pass of the driver: sends what the futures submitted, reaps up to `max` completions and wakes their
    /// futures. Returns how many completed. An error is the queue pair's own (its connection failed for good,
    /// say); the commands it fails still complete, each with its error.
    ///
    /// # Examples
    ///
    /// A driver of its own, without [`LocalExecutor`]: the future is polled by hand here (another executor
    /// does that part), and `poll` sends and reaps.
    ///
    /// ```
    /// # mod ram { include!("doctest/ram.rs"); }
    /// use std::future::Future;
    /// use std::pin::pin;
    /// use std::task::{Context, Poll, Waker};
    /// use nvpoll::aio::AsyncQueue;
    ///
    /// let q = AsyncQueue::new(ram::RamQueuePair::new(4));
    /// let mut io = pin!(q.write_zeroes(1, 0, 8));
    /// let mut cx = Context::from_waker(Waker::noop());
    /// assert!(io.as_mut().poll(&mut cx).is_pending(), "handed to the queue pair, not yet sent");
    /// assert!(q.has_unsent());
    /// q.send()?; // or let poll send it
    /// assert!(!q.has_unsent());
    /// assert_eq!(q.poll(16)?, 1);
    /// let Poll::Ready(done) = io.as_mut().poll(&mut cx) else { panic!("completed by the pass") };
    /// done.result?;
    /// # Ok::<(), nvpoll::Error>(())
    /// ```
    pub fn poll(&self, max: usize) -> Result<usize> {
        let mut first_err = None;
        let mut n = 0;
        let (polled, mut to_wake) = {
            let mut guard = self.state.borrow_mut();
            let st = &mut *guard;
            if std::mem::take(&mut st.unsent) {
                if let Err(e) = st.qp.flush() {
                    first_err = Some(e);
                }
            }
            let polled = st.qp.poll(max);
            while let Some(c) = st.qp.pop_completion() {
                n += 1;
                st.complete(c);
            }
            (polled, std::mem::take(&mut st.to_wake))
        };
        drop_borrow_then_wake(&self.state, &mut to_wake);
        match (polled, first_err) {
            (Err(e), _) | (Ok(_), Some(e)) => Err(e),
            (Ok(_), None) => Ok(n),
        }
    }

    /// Sends what the futures submitted, without reaping. See [`AsyncQueue::poll`]'s example.
    pub fn send(&self) -> Result<()> {
        let mut st = self.state.borrow_mut();
        if std::mem::take(&mut st.unsent) {
            st.qp.flush()?;
        }
        Ok(())
    }

    /// Commands handed to the queue pair and not yet reaped (abandoned ones included).
    /// See [`AsyncQueue`]'s example.
    pub fn outstanding(&self) -> usize {
        let st = self.state.borrow();
        st.slots.len() - st.free.len()
    }

    /// Whether a pass of [`poll`](Self::poll) has something to send. See [`AsyncQueue::poll`]'s example.
    pub fn has_unsent(&self) -> bool {
        self.state.borrow().unsent
    }

    /// For a driver on another executor: `waker` is woken whenever a future submits a command (which the
    /// driver then sends with [`poll`](Self::poll)). Replaces the previous one.
    ///
    /// # Examples
    ///
    /// What a driver task on another executor does before it sleeps: leave its waker, arm, and wait on the
    /// completion fd (tokio's `AsyncFd` would wait; `poll(2)` does here). An in-memory queue pair names no
    /// descriptor, so the fd is readable at once: poll again.
    ///
    /// ```
    /// # mod ram { include!("doctest/ram.rs"); }
    /// use std::future::Future;
    /// use std::pin::pin;
    /// use std::sync::atomic::{AtomicBool, Ordering};
    /// use std::sync::Arc;
    /// use std::task::{Context, Wake, Waker};
    /// use rustix::event::{poll, PollFd, PollFlags};
    /// use nvpoll::aio::AsyncQueue;
    ///
    /// struct Flag(AtomicBool);
    /// impl Wake for Flag {
    ///     fn wake(self: Arc<Self>) {
    ///         self.0.store(true, Ordering::Release);
    ///     }
    /// }
    ///
    /// let q = AsyncQueue::new(ram::RamQueuePair::new(4));
    /// let driver = Arc::new(Flag(AtomicBool::new(false)));
    /// q.set_driver_waker(&Waker::from(Arc::clone(&driver)));
    ///
    /// let mut io = pin!(q.flush(1));
    /// assert!(io.as_mut().poll(&mut Context::from_waker(Waker::noop())).is_pending());
    /// assert!(driver.0.load(Ordering::Acquire), "the submission woke the driver to send it");
    ///
    /// q.poll(16)?; // sends and reaps
    /// let deadline = q.arm()?; // the next timer duty, if any
    /// println!("next deadline: {deadline:?}");
    /// let fd = q.completion_fd()?;
    /// let mut fds = [PollFd::new(&fd, PollFlags::IN)];
    /// assert_eq!(poll(&mut fds, None)?, 1, "readable: nothing names what wakes this queue pair");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn set_driver_waker(&self, waker: &Waker) {
        let mut st = self.state.borrow_mut();
        match &st.driver {
            Some(w) if w.will_wake(waker) => {}
            _ => st.driver = Some(waker.clone()),
        }
    }

    /// Before a driver sleeps on [`completion_fd`](Self::completion_fd): points it at what can wake the queue
    /// pair now (its socket may have changed after a reconnect) and at its next deadline (keep-alive,
    /// reconnect timers), which it also returns. A queue pair that cannot say what wakes it makes the
    /// descriptor readable at once (poll it again then). See [`AsyncQueue::set_driver_waker`]'s example.
    pub fn arm(&self) -> Result<Option<Instant>> {
        let mut st = self.state.borrow_mut();
        let st = &mut *st;
        let fd = match &mut st.waiter {
            Some(fd) => fd,
            None => st.waiter.insert(CompletionFd::new()?),
        };
        fd.arm(&st.qp, false)
    }

    /// A descriptor that becomes readable when the queue pair may have completions, for a driver on another
    /// executor to sleep on (tokio's `AsyncFd`, say): a duplicate of the queue's [`CompletionFd`], which
    /// [`arm`](Self::arm) points at the queue pair's sockets and deadline before each sleep. Level-triggered:
    /// it stays readable until [`poll`](Self::poll) has read what arrived. The caller owns (and closes) it.
    /// See [`AsyncQueue::set_driver_waker`]'s example.
    pub fn completion_fd(&self) -> Result<OwnedFd> {
        let mut st = self.state.borrow_mut();
        let fd = match &mut st.waiter {
            Some(fd) => fd,
            None => st.waiter.insert(CompletionFd::new()?),
        };
        fd.as_fd()
            .try_clone_to_owned()
            .map_err(|e| Error::os("dup of the completion fd", e))
    }

    /// The queue pair back, if this is the last handle (every future and executor that held one dropped);
    /// else the handle itself.
    /// See [`AsyncQueue`]'s example.
    pub fn into_queue_pair(self) -> std::result::Result<Q, AsyncQueue<Q>> {
        match Rc::try_unwrap(self.state) {
            Ok(state) => Ok(state.into_inner().qp),
            Err(state) => Err(AsyncQueue { state }),
        }
    }

    /// Runs `f` on the queue pair (its statistics, its send mode), outside any pass.
    /// See [`AsyncQueue`]'s example.
    pub fn with_queue_pair<R>(&self, f: impl FnOnce(&mut Q) -> R) -> R {
        f(&mut self.state.borrow_mut().qp)
    }
}

/// Futures to wake: those whose commands completed (by slot: their wakers stay in `State::wakers`) and those
/// waiting for room.
#[derive(Default)]
struct Wakes {
    slots: Vec<u32>,
    others: Vec<Waker>,
}

impl Wakes {
    fn is_empty(&self) -> bool {
        self.slots.is_empty() && self.others.is_empty()
    }
}

/// Wakes what `to_wake` holds, with `state` not borrowed (a waker may poll a future at once, which borrows
/// it), then gives the lists' capacity back.
fn drop_borrow_then_wake<Q>(state: &RefCell<State<Q>>, to_wake: &mut Wakes) {
    for i in to_wake.slots.drain(..) {
        // Lent out of the slot for the wake and put back after, unless the wake already put a new one there.
        let Some(w) = state.borrow_mut().wakers[i as usize].take() else {
            continue;
        };
        w.wake_by_ref();
        state.borrow_mut().wakers[i as usize].get_or_insert(w);
    }
    for w in to_wake.others.drain(..) {
        w.wake();
    }
    if let Ok(mut st) = state.try_borrow_mut() {
        // (Only into empty lists: a wake may have queued more, which the next pass wakes.)
        if st.to_wake.is_empty() && st.to_wake.slots.capacity() < to_wake.slots.capacity() {
            std::mem::swap(&mut st.to_wake, to_wake);
        }
    }
}

/// Keeps `waker` as slot `i`'s, cloning it only when it is not the one kept already.
#[inline]
fn keep_waker(wakers: &mut [Option<Waker>], i: u32, waker: &Waker) {
    match &mut wakers[i as usize] {
        Some(w) if w.will_wake(waker) => {}
        w => *w = Some(waker.clone()),
    }
}

impl<Q: QueuePair> State<Q> {
    /// Routes `c` to its slot; collects the wakers to wake.
    #[inline]
    fn complete(&mut self, mut c: Completion) {
        let Ok(i) = usize::try_from(c.tag) else {
            return;
        };
        let Some(slot) = self.slots.get_mut(i) else {
            log::error!(
                "nvpoll::aio: a completion with tag {} that no slot has",
                c.tag
            );
            return;
        };
        match std::mem::replace(slot, Slot::Free) {
            Slot::Waiting { tag } => {
                c.tag = tag;
                *slot = Slot::Ready(c);
                self.to_wake.slots.push(i as u32);
            }
            Slot::Abandoned => self.release(i as u32),
            other => {
                *slot = other;
                log::error!("nvpoll::aio: a second completion for slot {i}");
            }
        }
    }

    /// Frees slot `i` and wakes one future waiting for room.
    #[inline]
    fn release(&mut self, i: u32) {
        self.slots[i as usize] = Slot::Free;
        self.free.push(i);
        if let Some(w) = self.room.pop_front() {
            self.to_wake.others.push(w);
        }
    }
}

enum Stage {
    /// Not submitted yet (the request, until it is).
    New(Option<IoRequest>),
    /// In flight in this slot.
    InFlight(u32),
    /// Resolved.
    Done,
}

/// One command as a future (see [`AsyncQueue`]): resolves to its [`Completion`], with the buffer handed back.
/// A request the queue pair refuses outright (a bad namespace, blocks beyond its end) resolves at once, its
/// error in the completion.
///
/// # Examples
///
/// ```
/// # mod ram { include!("doctest/ram.rs"); }
/// use nvpoll::aio::{AsyncQueue, LocalExecutor};
/// use nvpoll::Error;
///
/// let q = AsyncQueue::new(ram::RamQueuePair::new(4));
/// let mut ex = LocalExecutor::new();
/// ex.drive(&q);
/// // Namespace 7 is not active: the future resolves at once, with the refusal.
/// let refused = ex.block_on(q.write_zeroes(7, 0, 1));
/// assert!(matches!(refused.result, Err(Error::InvalidArgument(_))));
/// assert_eq!(q.outstanding(), 0);
/// ```
#[must_use = "a command is submitted only when its future is polled"]
pub struct Io<Q: QueuePair> {
    state: Rc<RefCell<State<Q>>>,
    stage: Stage,
}

impl<Q: QueuePair> Unpin for Io<Q> {}

impl<Q: QueuePair> Future for Io<Q> {
    type Output = Completion;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Completion> {
        let this = &mut *self;
        match &mut this.stage {
            Stage::New(req) => {
                let mut st = this.state.borrow_mut();
                let Some(slot) = st.free.pop() else {
                    st.room.push_back(cx.waker().clone());
                    return Poll::Pending;
                };
                let mut r = req.take().expect("a new stage holds its request");
                let tag = r.tag;
                r.tag = u64::from(slot);
                match st.qp.submit(r) {
                    Ok(()) => {
                        st.slots[slot as usize] = Slot::Waiting { tag };
                        keep_waker(&mut st.wakers, slot, cx.waker());
                        st.unsent = true;
                        let driver = st.driver.clone();
                        drop(st);
                        this.stage = Stage::InFlight(slot);
                        if let Some(d) = driver {
                            d.wake();
                        }
                        Poll::Pending
                    }
                    Err(Rejected { error, mut request }) => {
                        st.free.push(slot);
                        request.tag = tag;
                        if matches!(error, Error::QueueFull) {
                            // The queue pair has fewer entries free than we have slots (commands of its own in
                            // flight): wait for a completion.
                            *req = Some(request);
                            st.room.push_back(cx.waker().clone());
                            return Poll::Pending;
                        }
                        drop(st);
                        this.stage = Stage::Done;
                        Poll::Ready(Completion {
                            tag,
                            buf: request.buf,
                            result: Err(error),
                        })
                    }
                }
            }
            Stage::InFlight(slot) => {
                let i = *slot;
                let mut guard = this.state.borrow_mut();
                let st = &mut *guard;
                match &mut st.slots[i as usize] {
                    Slot::Waiting { .. } => {
                        keep_waker(&mut st.wakers, i, cx.waker());
                        Poll::Pending
                    }
                    Slot::Ready(_) => {
                        let Slot::Ready(c) =
                            std::mem::replace(&mut st.slots[i as usize], Slot::Free)
                        else {
                            unreachable!("matched Ready above")
                        };
                        st.release(i);
                        this.stage = Stage::Done;
                        // Someone waiting for room, now and then.
                        if !st.to_wake.is_empty() {
                            let mut to_wake = std::mem::take(&mut st.to_wake);
                            drop(guard);
                            drop_borrow_then_wake(&this.state, &mut to_wake);
                        }
                        Poll::Ready(c)
                    }
                    Slot::Free | Slot::Abandoned => {
                        unreachable!("a live future's slot is never freed or abandoned")
                    }
                }
            }
            Stage::Done => panic!("an nvpoll::aio::Io future polled after it completed"),
        }
    }
}

impl<Q: QueuePair> Drop for Io<Q> {
    fn drop(&mut self) {
        let Stage::InFlight(i) = self.stage else {
            return;
        };
        let Ok(mut st) = self.state.try_borrow_mut() else {
            return;
        };
        match &st.slots[i as usize] {
            Slot::Waiting { .. } => st.slots[i as usize] = Slot::Abandoned,
            Slot::Ready(_) => {
                st.release(i);
                let mut to_wake = std::mem::take(&mut st.to_wake);
                drop(st);
                drop_borrow_then_wake(&self.state, &mut to_wake);
            }
            Slot::Free | Slot::Abandoned => {}
        }
    }
}

/// What a [`LocalExecutor`] drives: a queue's passes, whatever its queue pair type.
trait Driven {
    fn pass(&self, max: usize) -> Result<usize>;
    fn send(&self) -> Result<()>;
    fn outstanding(&self) -> usize;
    /// For a sleeping reactor: what wakes this queue (its completion fd, armed, and its deadline); `false`
    /// when it cannot say or has something to send.
    fn wake_sources<'a>(&'a self, w: &mut WakeSources<'a>) -> bool;
}

/// A queue as a [`LocalExecutor`] holds it, with its own handle on the completion fd (made on first sleep).
struct DrivenQueue<Q: QueuePair> {
    q: AsyncQueue<Q>,
    fd: std::cell::OnceCell<OwnedFd>,
}

impl<Q: QueuePair> Driven for DrivenQueue<Q> {
    fn pass(&self, max: usize) -> Result<usize> {
        self.q.poll(max)
    }
    fn send(&self) -> Result<()> {
        self.q.send()
    }
    fn outstanding(&self) -> usize {
        self.q.outstanding()
    }
    fn wake_sources<'a>(&'a self, w: &mut WakeSources<'a>) -> bool {
        if self.q.has_unsent() {
            return false;
        }
        let Ok(deadline) = self.q.arm() else {
            return false;
        };
        if self.fd.get().is_none() {
            match self.q.completion_fd() {
                Ok(fd) => {
                    let _ = self.fd.set(fd);
                }
                Err(_) => return false,
            }
        }
        if let Some(fd) = self.fd.get() {
            w.readable(fd);
        }
        if let Some(d) = deadline {
            w.deadline(d);
        }
        true
    }
}

/// The executor's ready set, one bit per task in words of 64, and the reactor to kick when a task is woken
/// from elsewhere (another thread, or while the reactor sleeps). A wake is one atomic OR on the task's word,
/// which also says whether the task was already queued; the executor takes a whole word of woken tasks with
/// one swap. (A queue of task numbers cost a compare-and-swap to push, another to pop, a flag per task to
/// keep a task queued once, and now and then a block allocation.)
struct Ready {
    /// The reactor to kick, set once the executor runs on one.
    kick: std::sync::OnceLock<ReactorWaker>,
}

/// 64 tasks' ready bits.
struct ReadyWord {
    bits: AtomicU64,
    ready: Arc<Ready>,
}

/// A task's waker: sets the task's bit in its word of the executor's ready set.
struct TaskWaker {
    mask: u64,
    word: Arc<ReadyWord>,
}

impl Wake for TaskWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        let before = self.word.bits.fetch_or(self.mask, Ordering::AcqRel);
        // A word that had a bit set already was kicked for by whoever set it, and the executor has not taken
        // it yet (it clears the word before polling its tasks): one kick per word per pass is enough.
        if before == 0 {
            if let Some(k) = self.word.ready.kick.get() {
                k.wake();
            }
        }
    }
}

struct Task {
    fut: Pin<Box<dyn Future<Output = ()>>>,
    /// Its [`TaskWaker`], made once (not per poll).
    waker: Waker,
}

/// A single-threaded executor for futures that need not be `Send`, and the driver of the [`AsyncQueue`]s
/// registered with it: each [`pass`](Self::pass) polls the tasks that were woken, then sends what they
/// submitted and reaps completions, which wakes their tasks for the next pass. Spawning allocates the task;
/// running it does not. As a [`Poller`] it runs on one of our reactors.
///
/// # Examples
///
/// Many tasks over one queue pair, driven by passes on this thread (on a reactor, add the executor as a
/// poller instead):
///
/// ```
/// # mod ram { include!("doctest/ram.rs"); }
/// use std::cell::Cell;
/// use std::rc::Rc;
/// use nvpoll::aio::{AsyncQueue, LocalExecutor};
/// use nvpoll::mem::DmaPool;
///
/// let pool = DmaPool::builder().class(4096, 64).build()?;
/// let q = AsyncQueue::new(ram::RamQueuePair::new(8)); // fewer slots than tasks: they wait for room
/// let mut ex = LocalExecutor::default();
/// ex.drive(&q);
/// let ok = Rc::new(Cell::new(0));
/// for lba in 0..32u64 {
///     let (q, pool, ok) = (q.clone(), pool.clone(), Rc::clone(&ok));
///     ex.spawn(async move {
///         let buf = pool.alloc(512).expect("a buffer");
///         if q.read(1, lba, 1, buf).await.result.is_ok() {
///             ok.set(ok.get() + 1);
///         }
///     });
/// }
/// assert_eq!(ex.tasks(), 32);
/// while ex.tasks() > 0 {
///     ex.pass();
/// }
/// assert_eq!(ok.get(), 32);
/// assert!(ex.take_error().is_none(), "the queue pair itself never failed");
/// # Ok::<(), nvpoll::Error>(())
/// ```
pub struct LocalExecutor {
    tasks: Vec<Option<Task>>,
    free: Vec<usize>,
    ready: Arc<Ready>,
    /// The ready set: task `i`'s bit is bit `i % 64` of word `i / 64`.
    words: Vec<Arc<ReadyWord>>,
    queues: Vec<Box<dyn Driven>>,
    /// Completions reaped per queue per pass, at most.
    batch: usize,
    live: Rc<Cell<usize>>,
    /// The first error a queue's pass returned since [`take_error`](Self::take_error).
    error: Option<Error>,
}

impl Default for LocalExecutor {
    fn default() -> Self {
        Self::new()
    }
}

impl LocalExecutor {
    /// An executor with no tasks and no queues.
    /// See [`LocalExecutor`]'s example.
    pub fn new() -> LocalExecutor {
        LocalExecutor {
            tasks: Vec::new(),
            free: Vec::new(),
            ready: Arc::new(Ready {
                kick: std::sync::OnceLock::new(),
            }),
            words: Vec::new(),
            queues: Vec::new(),
            batch: 64,
            live: Rc::new(Cell::new(0)),
            error: None,
        }
    }

    /// Drives `q` in every pass from now on.
    /// See [`LocalExecutor`]'s example.
    pub fn drive<Q: QueuePair + 'static>(&mut self, q: &AsyncQueue<Q>) {
        self.queues.push(Box::new(DrivenQueue {
            q: q.clone(),
            fd: std::cell::OnceCell::new(),
        }));
    }

    /// Runs `fut` to its end in the passes to come.
    /// See [`LocalExecutor`]'s example.
    pub fn spawn(&mut self, fut: impl Future<Output = ()> + 'static) {
        let id = self.free.pop().unwrap_or(self.tasks.len());
        if id / 64 == self.words.len() {
            self.words.push(Arc::new(ReadyWord {
                bits: AtomicU64::new(0),
                ready: Arc::clone(&self.ready),
            }));
        }
        let word = &self.words[id / 64];
        let task = Task {
            fut: Box::pin(fut),
            waker: Waker::from(Arc::new(TaskWaker {
                mask: 1 << (id % 64),
                word: Arc::clone(word),
            })),
        };
        if id == self.tasks.len() {
            self.tasks.push(Some(task));
        } else {
            self.tasks[id] = Some(task);
        }
        self.live.set(self.live.get() + 1);
        // Polled in the next pass (a bit of the executor's own thread: no kick needed).
        word.bits.fetch_or(1 << (id % 64), Ordering::Release);
    }

    /// Tasks not yet finished.
    /// See [`LocalExecutor`]'s example.
    pub fn tasks(&self) -> usize {
        self.live.get()
    }

    /// One pass: the woken tasks, then every queue's send and reap. Says whether anything happened.
    /// See [`LocalExecutor`]'s example.
    pub fn pass(&mut self) -> bool {
        let mut busy = false;
        // A word's tasks are taken at once and each polled once: a task that wakes itself (or one whose word
        // was already taken) waits for the next pass. Words are few (a relaxed load each when nothing woke).
        for w in 0..self.words.len() {
            if self.words[w].bits.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let mut bits = self.words[w].bits.swap(0, Ordering::AcqRel);
            busy = true;
            while bits != 0 {
                let id = w * 64 + bits.trailing_zeros() as usize;
                bits &= bits - 1;
                // A stale waker of a finished task may wake its number: nothing to poll then (or a spurious
                // poll of the task that took the number, which futures allow).
                let Some(task) = self.tasks.get_mut(id).and_then(Option::as_mut) else {
                    continue;
                };
                let mut cx = Context::from_waker(&task.waker);
                if task.fut.as_mut().poll(&mut cx).is_ready() {
                    self.tasks[id] = None;
                    self.free.push(id);
                    self.live.set(self.live.get() - 1);
                }
            }
        }
        for q in &self.queues {
            match q.pass(self.batch) {
                Ok(n) => busy |= n > 0,
                Err(e) => {
                    self.error.get_or_insert(e);
                }
            }
            busy |= q.outstanding() > 0;
        }
        busy
    }

    /// The first error a driven queue returned (the commands it failed complete with their own errors).
    /// See [`LocalExecutor`]'s example.
    pub fn take_error(&mut self) -> Option<Error> {
        self.error.take()
    }

    /// Runs `fut` on this thread, with the spawned tasks and the driven queues, until it resolves.
    /// See [`AsyncQueue`]'s example.
    pub fn block_on<T: 'static>(&mut self, fut: impl Future<Output = T> + 'static) -> T {
        let out = Rc::new(RefCell::new(None));
        let slot = Rc::clone(&out);
        self.spawn(async move {
            let v = fut.await;
            *slot.borrow_mut() = Some(v);
        });
        loop {
            self.pass();
            if let Some(v) = out.borrow_mut().take() {
                return v;
            }
        }
    }
}

impl Poller for LocalExecutor {
    fn poll(&mut self, ctx: &mut ReactorContext) -> PollStatus {
        if self.ready.kick.get().is_none() {
            let _ = self.ready.kick.set(ctx.waker());
        }
        PollStatus::busy_if(self.pass())
    }

    fn flush(&mut self, _ctx: &mut ReactorContext) {
        for q in &self.queues {
            if let Err(e) = q.send() {
                self.error.get_or_insert(e);
            }
        }
    }

    /// A hybrid reactor may sleep once no task is woken and every driven queue has said what wakes it (its
    /// completion fd, which [`AsyncQueue::arm`] points at the queue pair's sockets, and its deadline).
    fn wake_sources<'a>(&'a self, w: &mut WakeSources<'a>) -> bool {
        if self
            .words
            .iter()
            .any(|w| w.bits.load(Ordering::Acquire) != 0)
        {
            return false;
        }
        self.queues.iter().all(|q| q.wake_sources(w))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::QueueStats;
    use crate::mem::DmaPool;
    use std::sync::atomic::AtomicBool;

    /// A queue pair that completes what it was sent (on `flush`) at the next `poll`, in order; it refuses
    /// namespace 9 and takes at most `room` commands at a time.
    struct Fake {
        depth: usize,
        room: usize,
        queued: Vec<IoRequest>,
        sent: VecDeque<IoRequest>,
        done: VecDeque<Completion>,
        flushes: usize,
        /// Complete at most this many per poll.
        per_poll: usize,
    }

    impl Fake {
        fn new(depth: usize) -> Fake {
            Fake {
                depth,
                room: depth,
                queued: Vec::new(),
                sent: VecDeque::new(),
                done: VecDeque::new(),
                flushes: 0,
                per_poll: usize::MAX,
            }
        }
        fn in_flight(&self) -> usize {
            self.queued.len() + self.sent.len() + self.done.len()
        }
    }

    impl QueuePair for Fake {
        fn submit(&mut self, req: IoRequest) -> std::result::Result<(), Rejected> {
            if req.nsid == 9 {
                return Err(Rejected {
                    error: Error::InvalidArgument("namespace 9 is not active".into()),
                    request: req,
                });
            }
            if self.in_flight() >= self.room {
                return Err(Rejected {
                    error: Error::QueueFull,
                    request: req,
                });
            }
            self.queued.push(req);
            Ok(())
        }
        fn flush(&mut self) -> Result<()> {
            self.flushes += 1;
            self.sent.extend(self.queued.drain(..));
            Ok(())
        }
        fn poll(&mut self, max: usize) -> Result<usize> {
            let n = self.sent.len().min(max).min(self.per_poll);
            for r in self.sent.drain(..n) {
                self.done.push_back(Completion {
                    tag: r.tag,
                    buf: r.buf,
                    result: Ok(()),
                });
            }
            Ok(n)
        }
        fn pop_completion(&mut self) -> Option<Completion> {
            self.done.pop_front()
        }
        fn outstanding(&self) -> usize {
            self.in_flight()
        }
        fn depth(&self) -> usize {
            self.depth
        }
        fn stats(&self) -> QueueStats {
            QueueStats::default()
        }
    }

    fn pool() -> DmaPool {
        DmaPool::builder()
            .class(4096, 64)
            .build()
            .expect("a small DMA pool")
    }

    #[test]
    fn a_read_resolves_with_its_buffer_and_tag() {
        let q = AsyncQueue::new(Fake::new(4));
        let mut ex = LocalExecutor::new();
        ex.drive(&q);
        let p = pool();
        let mut buf = p.alloc(4096).unwrap();
        buf.as_mut_slice()[0] = 7;
        let req = IoRequest {
            op: IoOp::Read,
            nsid: 1,
            lba: 3,
            blocks: 1,
            buf: Some(buf),
            tag: 42,
        };
        let c = ex.block_on(q.submit(req));
        assert_eq!(c.tag, 42);
        c.result.unwrap();
        assert_eq!(c.buf.unwrap().as_slice()[0], 7, "the same buffer back");
        assert_eq!(q.outstanding(), 0);
        assert_eq!(ex.tasks(), 0);
    }

    #[test]
    fn more_commands_than_slots_wait_for_room_and_all_complete_once() {
        let q = AsyncQueue::new(Fake::new(4));
        q.with_queue_pair(|f| f.per_poll = 1);
        let mut ex = LocalExecutor::new();
        ex.drive(&q);
        let done = Rc::new(RefCell::new(Vec::new()));
        for i in 0..40u64 {
            let (q, done) = (q.clone(), Rc::clone(&done));
            ex.spawn(async move {
                let c = q
                    .submit(IoRequest {
                        op: IoOp::Flush,
                        nsid: 1,
                        lba: 0,
                        blocks: 0,
                        buf: None,
                        tag: i,
                    })
                    .await;
                c.result.unwrap();
                done.borrow_mut().push(c.tag);
            });
        }
        let mut passes = 0;
        while ex.tasks() > 0 {
            ex.pass();
            assert!(q.outstanding() <= 4, "never more in flight than slots");
            passes += 1;
            assert!(passes < 1000, "stuck with {} tasks", ex.tasks());
        }
        let mut tags = done.borrow().clone();
        tags.sort_unstable();
        assert_eq!(tags, (0..40).collect::<Vec<_>>());
    }

    #[test]
    fn the_queue_pairs_own_queue_full_waits_too() {
        let q = AsyncQueue::new(Fake::new(8));
        // The queue pair has room for 2 although it says depth 8 (commands of its own in flight, say).
        q.with_queue_pair(|f| f.room = 2);
        let mut ex = LocalExecutor::new();
        ex.drive(&q);
        let n = Rc::new(Cell::new(0));
        for _ in 0..10 {
            let (q, n) = (q.clone(), Rc::clone(&n));
            ex.spawn(async move {
                q.write_zeroes(1, 0, 1).await.result.unwrap();
                n.set(n.get() + 1);
            });
        }
        for _ in 0..200 {
            if ex.tasks() == 0 {
                break;
            }
            ex.pass();
        }
        assert_eq!(n.get(), 10);
    }

    #[test]
    fn a_refused_request_resolves_at_once_with_its_error_and_buffer() {
        let q = AsyncQueue::new(Fake::new(4));
        let mut ex = LocalExecutor::new();
        ex.drive(&q);
        let p = pool();
        let buf = p.alloc(4096).unwrap();
        let c = ex.block_on(q.write(9, 0, 1, buf));
        assert!(matches!(c.result, Err(Error::InvalidArgument(_))), "{c:?}");
        assert!(c.buf.is_some(), "the buffer comes back");
        assert_eq!(q.outstanding(), 0);
    }

    #[test]
    fn a_dropped_future_keeps_its_slot_until_the_completion_comes() {
        let q = AsyncQueue::new(Fake::new(2));
        let p = pool();
        let before = p.available(4096);
        let mut io = Box::pin(q.read(1, 0, 1, p.alloc(4096).unwrap()));
        let waker = Waker::from(Arc::new(TaskWaker {
            mask: 1,
            word: Arc::new(ReadyWord {
                bits: AtomicU64::new(0),
                ready: Arc::new(Ready {
                    kick: std::sync::OnceLock::new(),
                }),
            }),
        }));
        let mut cx = Context::from_waker(&waker);
        assert!(io.as_mut().poll(&mut cx).is_pending(), "submitted");
        drop(io);
        assert_eq!(
            q.outstanding(),
            1,
            "the slot stays taken while the command is in flight"
        );
        q.poll(8).unwrap();
        assert_eq!(q.outstanding(), 0, "freed when the completion came");
        assert_eq!(
            p.available(4096),
            before,
            "and its buffer went back to the pool"
        );
    }

    #[test]
    fn a_submission_wakes_the_driver_and_one_flush_sends_a_batch() {
        struct Flag(AtomicBool);
        impl Wake for Flag {
            fn wake(self: Arc<Self>) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let q = AsyncQueue::new(Fake::new(8));
        let flag = Arc::new(Flag(AtomicBool::new(false)));
        q.set_driver_waker(&Waker::from(Arc::clone(&flag)));
        let mut ex = LocalExecutor::new();
        for _ in 0..5 {
            let q = q.clone();
            ex.spawn(async move { q.flush(1).await.result.unwrap() });
        }
        ex.pass(); // the tasks submit; nothing drives the queue from this executor
        assert!(flag.0.load(Ordering::SeqCst), "the driver was woken");
        assert!(q.has_unsent());
        q.poll(64).unwrap();
        assert_eq!(
            q.with_queue_pair(|f| f.flushes),
            1,
            "one flush for the five"
        );
        ex.pass();
        assert_eq!(ex.tasks(), 0);
    }
}

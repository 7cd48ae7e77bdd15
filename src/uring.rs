//! Receiving from many sockets through one io_uring: one multishot receive per socket, into buffers the kernel
//! takes from a ring of provided buffers that this module shares with it (the io_uring counterpart of a readiness
//! set plus a `read` per ready socket; SPDK's uring socket group also receives into provided buffers, with a
//! single-shot receive armed again after each completion).
//!
//! A [`RecvRing`] arms a multishot `IORING_OP_RECV` with buffer selection for each socket it
//! [watches](RecvRing::watch). Whenever bytes arrive, the kernel copies them into a free buffer of the ring and
//! posts a completion naming it; [`RecvRing::poll`] hands each completion's bytes to the caller and gives the
//! buffer back. A socket with nothing to say costs nothing per poll, and a poll with no completion costs no
//! system call: completions are read from memory shared with the kernel. How the kernel gets to post them is the
//! [`TaskRun`] choice: by interrupting the thread (SPDK's setting) or when the thread asks, in the one
//! `io_uring_enter` of a poll that has anything pending (the kernel raises a flag in the shared memory for that).
//!
//! What stays with the caller: writing (this is a receive path only), and the socket's lifetime: a socket must
//! stay open while it is watched ([`RecvRing::unwatch`] first); a socket closed while watched is not a memory
//! hazard (the kernel holds its own reference to the file) but its token keeps receiving until the kernel ends
//! the receive.
//!
//! This module holds the `unsafe` code for the memory shared with the kernel's io_uring: the buffer ring (the
//! kernel reads its entries and writes into the buffers they name) and the raw `io_uring_enter`. The invariants:
//! - the ring's entries and buffers are allocated before the ring is registered and freed only after it is
//!   unregistered and every receive has ended (or never, when the kernel would not say so);
//! - a buffer is either the kernel's (published in the ring) or the caller's (named by a completion, until
//!   [`RecvRing::poll`] gives it back after the caller's closure returned), never both;
//! - the tail is published with a release store after the entries it covers are written.
#![allow(unsafe_code)]

use std::alloc::{self, Layout};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU16, Ordering};

use io_uring::{cqueue, opcode, types, IoUring};

/// How the kernel posts completions for the ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskRun {
    /// The kernel interrupts the thread to post a completion as the bytes arrive (io_uring's default, and
    /// SPDK's uring socket's): a poll never enters the kernel unless it has receives to arm.
    Interrupt,
    /// `IORING_SETUP_DEFER_TASKRUN`: completions are posted when the thread asks, in one `io_uring_enter` per
    /// poll that has work pending (the kernel raises `IORING_SQ_TASKRUN` in the shared memory), and never
    /// interrupt it. The ring must then be used by the thread that made it.
    Deferred,
}

/// What a watched socket delivered.
#[derive(Debug)]
pub enum Received<'a> {
    /// Bytes, in order.
    Data(&'a [u8]),
    /// The peer closed its side: the receive ended and the socket is no longer watched.
    Closed,
    /// The receive failed; the socket is no longer watched.
    Failed(io::Error),
}

/// The buffer group id of the ring's buffers (one group per ring).
const GROUP: u16 = 0;
/// `user_data` of the cancellation sent at drop: not a token's.
const CANCEL: u64 = u64::MAX;

/// A ring of `count` buffers of `size` bytes each, shared with the kernel.
struct ProvidedBuffers {
    /// `count` 16-byte entries (`io_uring_buf`), page-aligned; the first entry's last two bytes are the tail.
    ring: NonNull<types::BufRingEntry>,
    ring_layout: Layout,
    /// `count * size` bytes.
    data: NonNull<u8>,
    data_layout: Layout,
    count: u16,
    size: u32,
    /// The tail as this side last wrote it (the kernel owns the head).
    tail: u16,
}

impl ProvidedBuffers {
    fn new(count: u16, size: u32) -> io::Result<ProvidedBuffers> {
        if !count.is_power_of_two() || count > 1 << 15 || size == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "provided buffers: {count} x {size} bytes (the count must be a power of two up to 32768)"
                ),
            ));
        }
        let bad =
            |e: alloc::LayoutError| io::Error::new(io::ErrorKind::InvalidInput, e.to_string());
        let ring_layout = Layout::from_size_align(
            usize::from(count) * std::mem::size_of::<types::BufRingEntry>(),
            4096,
        )
        .map_err(bad)?;
        let data_layout =
            Layout::from_size_align(usize::from(count) * size as usize, 64).map_err(bad)?;
        // SAFETY: both layouts have a non-zero size (count >= 1, size >= 1).
        let ring = unsafe { alloc::alloc_zeroed(ring_layout) };
        // SAFETY: as above.
        let data = unsafe { alloc::alloc(data_layout) };
        let (Some(ring), Some(data)) = (
            NonNull::new(ring.cast::<types::BufRingEntry>()),
            NonNull::new(data),
        ) else {
            return Err(io::Error::new(
                io::ErrorKind::OutOfMemory,
                "provided buffers: out of memory",
            ));
        };
        Ok(ProvidedBuffers {
            ring,
            ring_layout,
            data,
            data_layout,
            count,
            size,
            tail: 0,
        })
    }

    /// Writes buffer `bid`'s entry at the tail; [`ProvidedBuffers::publish`] makes it the kernel's.
    fn stage(&mut self, bid: u16) {
        debug_assert!(bid < self.count);
        let slot = usize::from(self.tail & (self.count - 1));
        // SAFETY: `slot < count`, inside the ring's allocation; the entry at the tail is not the kernel's until
        // the tail passes it (the kernel reads entries between its head and the published tail only), and the
        // tail field that entry 0 shares is only written through `publish`'s atomic, below.
        let entry = unsafe { &mut *self.ring.as_ptr().add(slot) };
        // SAFETY: `bid < count`: the buffer lies inside the data allocation.
        let addr = unsafe {
            self.data
                .as_ptr()
                .add(usize::from(bid) * self.size as usize)
        };
        entry.set_addr(addr as u64);
        entry.set_len(self.size);
        entry.set_bid(bid);
        self.tail = self.tail.wrapping_add(1);
    }

    /// Hands the kernel every entry staged since the last publish.
    fn publish(&self) {
        // SAFETY: the ring's first entry is initialised (zeroed, then written by `stage`), and its tail field is
        // a naturally aligned u16 that the kernel reads concurrently: an atomic is the right access.
        let tail = unsafe { &*types::BufRingEntry::tail(self.ring.as_ptr()).cast::<AtomicU16>() };
        tail.store(self.tail, Ordering::Release);
    }

    /// The first `len` bytes of buffer `bid`, which a completion just handed to this side.
    fn bytes(&self, bid: u16, len: usize) -> &[u8] {
        assert!(
            bid < self.count && len <= self.size as usize,
            "a completion beyond the ring: buffer {bid}, {len} bytes"
        );
        // SAFETY: inside the data allocation (checked above); the kernel wrote these bytes before it posted the
        // completion and does not touch the buffer until it is staged again, which needs `&mut self`.
        unsafe {
            std::slice::from_raw_parts(
                self.data
                    .as_ptr()
                    .add(usize::from(bid) * self.size as usize),
                len,
            )
        }
    }
}

impl Drop for ProvidedBuffers {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with these layouts; `RecvRing::drop` only lets this run once the kernel is
        // done with them (it forgets the buffers otherwise).
        unsafe {
            alloc::dealloc(self.ring.as_ptr().cast(), self.ring_layout);
            alloc::dealloc(self.data.as_ptr(), self.data_layout);
        }
    }
}

/// One io_uring receiving from many sockets into provided buffers. See the [module](self) documentation.
pub struct RecvRing {
    ring: IoUring,
    /// `ManuallyDrop`: freed only once the kernel is done with them (see [`Drop`]).
    bufs: std::mem::ManuallyDrop<ProvidedBuffers>,
    mode: TaskRun,
    /// Each token's socket while watched (`-1`: not watched).
    fds: Vec<RawFd>,
    /// Receives armed in the kernel (a completion without `IORING_CQE_F_MORE` ends one).
    armed: usize,
    /// Tokens whose receive ended for want of buffers or by the kernel's choice, to arm again.
    rearm: Vec<u32>,
}

impl RecvRing {
    /// A ring with room for `sockets` armed receives and `buffers` (a power of two) buffers of `buffer_size`
    /// bytes.
    pub fn new(
        sockets: u32,
        buffers: u16,
        buffer_size: u32,
        mode: TaskRun,
    ) -> io::Result<RecvRing> {
        let mut b = IoUring::builder();
        if mode == TaskRun::Deferred {
            b.setup_single_issuer()
                .setup_defer_taskrun()
                .setup_taskrun_flag();
        }
        b.setup_cqsize(
            sockets
                .max(64)
                .next_power_of_two()
                .saturating_mul(2)
                .max(u32::from(buffers)),
        );
        let ring = b.build(sockets.clamp(8, 4096).next_power_of_two())?;
        let mut bufs = ProvidedBuffers::new(buffers, buffer_size)?;
        for bid in 0..buffers {
            bufs.stage(bid);
        }
        bufs.publish();
        // SAFETY: the ring's memory is page-aligned, holds `buffers` entries and stays allocated until the
        // ring is unregistered (Drop); the buffers it names likewise.
        unsafe {
            ring.submitter().register_buf_ring_with_flags(
                bufs.ring.as_ptr() as u64,
                buffers,
                GROUP,
                0,
            )?;
        }
        Ok(RecvRing {
            ring,
            bufs: std::mem::ManuallyDrop::new(bufs),
            mode,
            fds: Vec::new(),
            armed: 0,
            rearm: Vec::new(),
        })
    }

    /// Starts receiving from `socket` (non-blocking or not: the kernel waits for it), its bytes reported under
    /// `token`. The receive is armed at the next [`RecvRing::poll`].
    pub fn watch(&mut self, socket: BorrowedFd<'_>, token: u32) -> io::Result<()> {
        let i = token as usize;
        if self.fds.len() <= i {
            self.fds.resize(i + 1, -1);
        }
        if self.fds[i] >= 0 {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("token {token} is already watched"),
            ));
        }
        self.fds[i] = socket.as_raw_fd();
        self.arm(token)
    }

    /// Stops reporting `token`'s socket (its receive is cancelled); the socket may be closed after.
    pub fn unwatch(&mut self, token: u32) -> io::Result<()> {
        if let Some(fd) = self.fds.get_mut(token as usize) {
            if *fd >= 0 {
                *fd = -1;
                let e =
                    opcode::AsyncCancel2::new(types::CancelBuilder::user_data(u64::from(token)))
                        .build()
                        .user_data(CANCEL);
                self.push(&e)?;
            }
        }
        Ok(())
    }

    fn arm(&mut self, token: u32) -> io::Result<()> {
        let fd = self.fds[token as usize];
        let e = opcode::RecvMulti::new(types::Fd(fd), GROUP)
            .build()
            .user_data(u64::from(token));
        self.push(&e)?;
        self.armed += 1;
        Ok(())
    }

    fn push(&mut self, e: &io_uring::squeue::Entry) -> io::Result<()> {
        if self.ring.submission().is_full() {
            self.enter(false)?;
        }
        // SAFETY: the entries this module makes reference no memory of the caller's: a receive names a socket
        // and the buffer group (alive until Drop), a cancellation only a user_data.
        unsafe { self.ring.submission().push(e) }
            .map_err(|_| io::Error::other("io_uring submission queue full"))
    }

    fn enter(&mut self, getevents: bool) -> io::Result<usize> {
        let pending = self.ring.submission().len() as u32;
        let flags = if getevents {
            io_uring::EnterFlags::GETEVENTS.bits()
        } else {
            0
        };
        // SAFETY: a plain submit (and, with GETEVENTS, running the deferred task work), no argument.
        match unsafe { self.ring.submitter().enter::<()>(pending, 0, flags, None) } {
            Ok(n) => Ok(n),
            Err(e)
                if e.raw_os_error() == Some(libc::EBUSY)
                    || e.raw_os_error() == Some(libc::EINTR) =>
            {
                Ok(0)
            }
            Err(e) => Err(e),
        }
    }

    /// Arms what is pending, lets the kernel post what it holds back ([`TaskRun::Deferred`]), and hands every
    /// completion to `f` with its token. Enters the kernel only when it has to. Returns how many completions
    /// it handed out.
    pub fn poll(&mut self, mut f: impl FnMut(u32, Received<'_>)) -> io::Result<usize> {
        // Deferred task work to run, or completions the kernel kept aside because the completion queue was full:
        // both want an enter with GETEVENTS.
        let getevents = (self.mode == TaskRun::Deferred && self.ring.submission().taskrun())
            || self.ring.submission().cq_overflow();
        if getevents || !self.ring.submission().is_empty() {
            self.enter(getevents)?;
        }
        let mut n = 0;
        let mut staged = false;
        let Self {
            ring,
            bufs,
            fds,
            armed,
            rearm,
            ..
        } = self;
        for cqe in ring.completion() {
            let token = cqe.user_data();
            if token == CANCEL {
                continue;
            }
            let more = cqueue::more(cqe.flags());
            if !more {
                *armed -= 1;
            }
            let Ok(token) = u32::try_from(token) else {
                continue;
            };
            let watched = fds.get(token as usize).is_some_and(|fd| *fd >= 0);
            let res = cqe.result();
            match (res, cqueue::buffer_select(cqe.flags())) {
                (len, Some(bid)) if len > 0 => {
                    if watched {
                        n += 1;
                        f(token, Received::Data(bufs.bytes(bid, len as usize)));
                    }
                    bufs.stage(bid);
                    staged = true;
                    if !more && watched {
                        rearm.push(token);
                    }
                }
                (_, Some(bid)) => {
                    // A buffer with an end or an error: give it back all the same.
                    bufs.stage(bid);
                    staged = true;
                    if watched && !more {
                        fds[token as usize] = -1;
                        n += 1;
                        f(token, Received::Closed);
                    }
                }
                (0, None) if watched && !more => {
                    fds[token as usize] = -1;
                    n += 1;
                    f(token, Received::Closed);
                }
                (e, None) if e < 0 && watched && !more => {
                    if e == -libc::ENOBUFS {
                        rearm.push(token);
                    } else {
                        fds[token as usize] = -1;
                        n += 1;
                        f(token, Received::Failed(io::Error::from_raw_os_error(-e)));
                    }
                }
                _ => {}
            }
        }
        if staged {
            self.bufs.publish();
        }
        while let Some(token) = self.rearm.pop() {
            if self.fds.get(token as usize).is_some_and(|fd| *fd >= 0) {
                self.arm(token)?;
            }
        }
        Ok(n)
    }
}

impl Drop for RecvRing {
    fn drop(&mut self) {
        // Every receive ends (cancelled) before the buffers go: an armed receive may still pick a buffer.
        let cancel = opcode::AsyncCancel2::new(types::CancelBuilder::any())
            .build()
            .user_data(CANCEL);
        let mut ended = self.armed == 0;
        if !ended && self.push(&cancel).is_ok() {
            // At most 5 s of 100 ms waits: a cancelled receive ends at once, so this only bounds a kernel that
            // would not answer.
            let ts = types::Timespec::new().nsec(100_000_000);
            let args = types::SubmitArgs::new().timespec(&ts);
            for _ in 0..50 {
                match self.ring.submitter().submit_with_args(1, &args) {
                    Ok(_) => {}
                    Err(e)
                        if e.raw_os_error() == Some(libc::ETIME)
                            || e.raw_os_error() == Some(libc::EINTR) => {}
                    Err(_) => break,
                }
                for cqe in self.ring.completion() {
                    if cqe.user_data() != CANCEL && !cqueue::more(cqe.flags()) {
                        self.armed -= 1;
                    }
                }
                if self.armed == 0 {
                    ended = true;
                    break;
                }
            }
        }
        if ended && self.ring.submitter().unregister_buf_ring(GROUP).is_ok() {
            // SAFETY: taken once, here; the kernel no longer reads the ring nor writes the buffers.
            unsafe { std::mem::ManuallyDrop::drop(&mut self.bufs) };
        }
        // Otherwise the buffers stay allocated for good: better a leak than the kernel writing freed memory.
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        (c, s)
    }

    /// Polls until `want` bytes came for `token` (the kernel posts completions asynchronously: a bounded
    /// number of polls, each of which may find nothing yet).
    fn collect(r: &mut RecvRing, token: u32, want: usize) -> (Vec<u8>, Vec<String>) {
        let mut got = Vec::new();
        let mut other = Vec::new();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while got.len() < want && std::time::Instant::now() < deadline {
            r.poll(|t, rx| match rx {
                Received::Data(d) if t == token => got.extend_from_slice(d),
                rx => other.push(format!("{t}: {rx:?}")),
            })
            .unwrap();
        }
        (got, other)
    }

    #[test]
    fn bytes_arrive_in_order_through_few_small_buffers_in_both_modes() {
        for mode in [TaskRun::Interrupt, TaskRun::Deferred] {
            let Some(mut r) = ring_or_skip(mode) else {
                return;
            };
            let (mut c, s) = pair();
            let (_c2, s2) = pair();
            r.watch(s.as_fd_ref(), 3).unwrap();
            r.watch(s2.as_fd_ref(), 7).unwrap();
            // 4 buffers of 64 bytes for 10,000 bytes: the ring runs dry and the receive is armed again.
            let msg: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
            let writer = std::thread::spawn(move || {
                for chunk in msg.chunks(1000) {
                    c.write_all(chunk).unwrap();
                }
                (c, msg)
            });
            let (got, other) = collect(&mut r, 3, 10_000);
            let (c, msg) = writer.join().unwrap();
            assert_eq!(got.len(), msg.len(), "{mode:?}: {other:?}");
            assert!(got == msg, "{mode:?}: the bytes came out of order");
            assert!(
                other.is_empty(),
                "{mode:?}: the idle socket reported {other:?}"
            );
            // The peer's close ends the receive.
            drop(c);
            let mut closed = false;
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while !closed && std::time::Instant::now() < deadline {
                r.poll(|t, rx| {
                    if t == 3 && matches!(rx, Received::Closed) {
                        closed = true;
                    }
                })
                .unwrap();
            }
            assert!(closed, "{mode:?}: no end reported after the peer closed");
            r.unwatch(7).unwrap();
            drop(r);
            drop(s);
            drop(s2);
        }
    }

    /// The pure part, which Miri runs (scripts/miri.sh): the entries name every buffer once, inside the data,
    /// the tail wraps, and a buffer's bytes are where its entry says.
    #[test]
    fn pure_buffer_ring_entries_name_each_buffer_once_and_the_tail_wraps() {
        assert!(ProvidedBuffers::new(3, 64).is_err());
        assert!(ProvidedBuffers::new(4, 0).is_err());
        let mut b = ProvidedBuffers::new(4, 32).unwrap();
        let base = b.data.as_ptr() as u64;
        for round in 0..3u16 {
            for bid in [2, 0, 3, 1] {
                b.stage(bid);
            }
            b.publish();
            // SAFETY: (a test) the ring holds 4 entries, all written just now.
            let entries = unsafe { std::slice::from_raw_parts(b.ring.as_ptr(), 4) };
            let mut seen: Vec<u16> = entries.iter().map(|e| e.bid()).collect();
            for e in entries {
                assert_eq!(e.addr(), base + u64::from(e.bid()) * 32);
                assert_eq!(e.len(), 32);
            }
            seen.sort_unstable();
            assert_eq!(seen, [0, 1, 2, 3]);
            // SAFETY: (a test) the tail field of entry 0, as `publish` wrote it.
            let tail = unsafe { *types::BufRingEntry::tail(b.ring.as_ptr()) };
            assert_eq!(tail, 4 * (round + 1));
        }
        assert_eq!(b.bytes(3, 32).len(), 32);
    }

    /// A ring, or `None` with a line saying why on a kernel without io_uring (too old, or
    /// `kernel.io_uring_disabled`); in CI (`CI` set) that is a failure, not a skip.
    fn ring_or_skip(mode: TaskRun) -> Option<RecvRing> {
        match RecvRing::new(4, 4, 64, mode) {
            Ok(r) => Some(r),
            Err(e) if std::env::var_os("CI").is_none() => {
                eprintln!(
                    "skipped: io_uring with provided buffers ({mode:?}) is not available here: {e}"
                );
                None
            }
            Err(e) => panic!("io_uring with provided buffers ({mode:?}): {e}"),
        }
    }

    #[test]
    fn a_token_is_watched_once_and_buffer_counts_are_checked() {
        assert!(RecvRing::new(4, 3, 64, TaskRun::Interrupt).is_err());
        let Some(mut r) = ring_or_skip(TaskRun::Interrupt) else {
            return;
        };
        let (_c, s) = pair();
        r.watch(s.as_fd_ref(), 0).unwrap();
        let e = r.watch(s.as_fd_ref(), 0).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AlreadyExists);
    }

    trait AsFdRef {
        fn as_fd_ref(&self) -> BorrowedFd<'_>;
    }
    impl AsFdRef for TcpStream {
        fn as_fd_ref(&self) -> BorrowedFd<'_> {
            std::os::fd::AsFd::as_fd(self)
        }
    }
}

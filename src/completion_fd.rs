//! [`CompletionFd`] (re-exported as `nvpoll::aio::CompletionFd`).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use rustix::event::epoll;
use rustix::time::{
    timerfd_create, timerfd_settime, Itimerspec, TimerfdClockId, TimerfdFlags, TimerfdTimerFlags,
    Timespec,
};

use crate::api::QueuePair;
use crate::reactor::WakeSources;
use crate::{Error, Result};

/// A queue pair's completion fd: one epoll descriptor for the queue pair's life, for a caller that sleeps
/// between polls (another executor, a C program's event loop, a reactor in idle mode). Its members are what
/// the queue pair says can complete its requests ([`QueuePair::wake_sources`]: its socket, its interrupt
/// eventfd) and a timerfd. The timer carries the queue pair's next deadline (a timeout check) and fires at
/// once when only polling can find completions (a reconnect under way, completions already waiting), so the
/// descriptor never sleeps through work: a caller that polls whenever it is readable misses nothing.
/// Level-triggered: readable while one of its members is, until the caller has polled the queue pair (and
/// [`arm`](Self::arm)ed the set again).
///
/// # Examples
///
/// An event loop of its own over a queue pair (here an in-memory one, which names no descriptor, so the
/// armed set is readable at once):
///
/// ```
/// # mod ram { include!("doctest/ram.rs"); }
/// use rustix::event::{poll, PollFd, PollFlags};
/// use nvpoll::aio::CompletionFd;
/// use nvpoll::api::{IoOp, IoRequest, QueuePair};
///
/// let mut qp = ram::RamQueuePair::new(4);
/// let mut fd = CompletionFd::new()?;
/// qp.submit(IoRequest { op: IoOp::Flush, nsid: 1, lba: 0, blocks: 0, buf: None, tag: 0 })
///     .map_err(|r| r.error)?;
/// qp.flush()?;
/// let mut done = 0;
/// while qp.outstanding() > 0 {
///     let deadline = fd.arm(&qp, false)?; // what wakes the queue pair now, and its next deadline
///     assert!(deadline.is_some(), "the timer fires at once when only polling can tell");
///     let mut fds = [PollFd::new(&fd, PollFlags::IN)];
///     poll(&mut fds, None)?; // sleep until the queue pair may have completions
///     done += qp.process_completions(16, |_, c| assert!(c.result.is_ok()))?;
/// }
/// assert_eq!(done, 1);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct CompletionFd {
    epoll: OwnedFd,
    timer: OwnedFd,
    /// The descriptors in the set, by number.
    registered: Vec<RawFd>,
    /// When the timer fires (`None`: disarmed).
    armed: Option<Instant>,
}

fn os(what: &'static str) -> impl FnOnce(rustix::io::Errno) -> Error {
    move |e| Error::os(what, e.into())
}

impl CompletionFd {
    /// An epoll set with a disarmed timer in it. See [`CompletionFd`]'s example.
    pub fn new() -> Result<CompletionFd> {
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC).map_err(os("epoll_create"))?;
        let timer = timerfd_create(
            TimerfdClockId::Monotonic,
            TimerfdFlags::CLOEXEC | TimerfdFlags::NONBLOCK,
        )
        .map_err(os("timerfd_create"))?;
        epoll::add(
            &epoll,
            &timer,
            epoll::EventData::new_u64(u64::MAX),
            epoll::EventFlags::IN,
        )
        .map_err(os("epoll_ctl (the timer)"))?;
        Ok(CompletionFd {
            epoll,
            timer,
            registered: Vec::new(),
            armed: None,
        })
    }

    /// Points the set at what can now complete one of `qp`'s requests: its wake sources and deadline, or
    /// (when `ready`, completions waiting to be taken, or when the queue pair names none) a timer that fires
    /// at once. Returns the deadline the timer carries. A descriptor the queue pair no longer names stays
    /// in the set until it is closed (a closed file leaves an epoll set by itself): at most a spurious
    /// wake-up, which costs one poll. See [`CompletionFd`]'s example.
    pub fn arm<Q: QueuePair + ?Sized>(&mut self, qp: &Q, ready: bool) -> Result<Option<Instant>> {
        let mut w = WakeSources::new();
        if ready || !qp.wake_sources(&mut w) {
            let now = Instant::now();
            self.set_timer(Some(now))?;
            return Ok(Some(now));
        }
        let mut wanted: Vec<(BorrowedFd<'_>, epoll::EventFlags)> = Vec::new();
        for (fd, interest) in w.watched() {
            let flag = if interest.contains(rustix::event::PollFlags::OUT) {
                epoll::EventFlags::OUT
            } else {
                epoll::EventFlags::IN
            };
            match wanted
                .iter_mut()
                .find(|(f, _)| f.as_raw_fd() == fd.as_raw_fd())
            {
                Some((_, flags)) => *flags |= flag,
                None => wanted.push((fd, flag)),
            }
        }
        for &(fd, flags) in &wanted {
            let data = epoll::EventData::new_u64(fd.as_raw_fd() as u64);
            // Modified if registered, else added: the number may name a new file (a reconnect's socket)
            // whose registration does not exist yet, the old file's having gone when it was closed.
            match epoll::modify(&self.epoll, fd, data, flags) {
                Ok(()) => {}
                Err(rustix::io::Errno::NOENT) => {
                    epoll::add(&self.epoll, fd, data, flags).map_err(os("epoll_ctl (add)"))?
                }
                Err(e) => return Err(os("epoll_ctl (modify)")(e)),
            }
        }
        self.registered.clear();
        self.registered
            .extend(wanted.iter().map(|(fd, _)| fd.as_raw_fd()));
        let deadline = w.deadline_at();
        drop(w);
        self.set_timer(deadline)?;
        Ok(deadline)
    }

    /// Arms the timer for `at` (at once when it has passed), or disarms it. A timer already armed for the
    /// same instant, still ahead, is left alone; setting it clears what it counted.
    fn set_timer(&mut self, at: Option<Instant>) -> Result<()> {
        let now = Instant::now();
        if at == self.armed && at.is_none_or(|t| t > now) {
            return Ok(());
        }
        let value = match at {
            None => Duration::ZERO,
            // A zero value disarms: the least delay that fires.
            Some(t) => t
                .saturating_duration_since(now)
                .max(Duration::from_nanos(1)),
        };
        let spec = Itimerspec {
            it_interval: Timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: Timespec {
                tv_sec: value.as_secs() as _,
                tv_nsec: value.subsec_nanos().into(),
            },
        };
        timerfd_settime(&self.timer, TimerfdTimerFlags::empty(), &spec)
            .map_err(os("timerfd_settime"))?;
        self.armed = at;
        Ok(())
    }
}

impl AsFd for CompletionFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.epoll.as_fd()
    }
}

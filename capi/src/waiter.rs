//! A queue pair's completion fd: an epoll descriptor that stays the same for the queue pair's life, whose
//! members are what the queue pair says can complete its requests ([`QueuePair::wake_sources`]: its socket,
//! its interrupt eventfd) and a timerfd. The timer carries the queue pair's next deadline (a timeout check),
//! and fires at once when only polling can find completions (a reconnect under way, completions already
//! waiting): so the descriptor never sleeps through work, and a caller that polls whenever it is readable
//! misses nothing.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use nvpoll_core::api::QueuePair;
use nvpoll_core::reactor::WakeSources;
use rustix::event::epoll;
use rustix::time::{
    timerfd_create, timerfd_settime, Itimerspec, TimerfdClockId, TimerfdFlags, TimerfdTimerFlags,
    Timespec,
};

/// The epoll set behind a completion fd.
#[derive(Debug)]
pub(crate) struct Waiter {
    epoll: OwnedFd,
    timer: OwnedFd,
    /// The queue pair's descriptors now in the set, with what each is watched for.
    registered: Vec<(RawFd, epoll::EventFlags)>,
    /// When the timer fires (`None`: disarmed).
    armed: Option<Instant>,
}

impl Waiter {
    /// An epoll set with a disarmed timer in it.
    pub(crate) fn new() -> io::Result<Waiter> {
        let epoll = epoll::create(epoll::CreateFlags::CLOEXEC)?;
        let timer = timerfd_create(
            TimerfdClockId::Monotonic,
            TimerfdFlags::CLOEXEC | TimerfdFlags::NONBLOCK,
        )?;
        epoll::add(
            &epoll,
            &timer,
            epoll::EventData::new_u64(u64::MAX),
            epoll::EventFlags::IN,
        )?;
        Ok(Waiter {
            epoll,
            timer,
            registered: Vec::new(),
            armed: None,
        })
    }

    /// The descriptor a C caller polls.
    pub(crate) fn fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }

    /// Points the set at what can now complete one of `qp`'s requests: its wake sources and deadline, or
    /// (when `ready` — completions wait to be reaped — or when the queue pair names none) a timer that
    /// fires at once.
    pub(crate) fn arm(&mut self, qp: &dyn QueuePair, ready: bool) -> io::Result<()> {
        let mut w = WakeSources::default();
        if ready || !qp.wake_sources(&mut w) {
            // Leave the descriptors as they are: a spurious wake-up costs one poll.
            return self.set_timer(Some(Instant::now()));
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
            // The number may name a new file (a reconnect's socket) whose registration does not exist yet:
            // the old file's went when it was closed.
            match epoll::modify(&self.epoll, fd, data, flags) {
                Ok(()) => {}
                Err(rustix::io::Errno::NOENT) => epoll::add(&self.epoll, fd, data, flags)?,
                Err(e) => return Err(e.into()),
            }
        }
        for &(old, _) in &self.registered {
            if !wanted.iter().any(|(fd, _)| fd.as_raw_fd() == old) {
                // Its file may be closed (the registration then went with it) or the number taken by a file
                // outside the set: either answer is fine.
                crate::ffi::epoll_forget(self.epoll.as_fd(), old);
            }
        }
        self.registered = wanted
            .iter()
            .map(|(fd, flags)| (fd.as_raw_fd(), *flags))
            .collect();
        let deadline = w.deadline_at();
        drop(w);
        self.set_timer(deadline)
    }

    /// Arms the timer for `at` (at once when it has passed), or disarms it. A timer already armed for the
    /// same instant, still ahead, is left alone; setting it clears what it counted.
    fn set_timer(&mut self, at: Option<Instant>) -> io::Result<()> {
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
        timerfd_settime(&self.timer, TimerfdTimerFlags::empty(), &spec)?;
        self.armed = at;
        Ok(())
    }
}

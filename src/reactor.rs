//! Run-to-completion reactors: one thread per selected core, pinned, polling forever.
//!
//! Each iteration of a reactor does, in order:
//! 1. run up to a batch of **messages** from its ring (closures other threads and reactors sent it);
//! 2. call every registered [`Poller`] once;
//! 3. call the **timed pollers** whose period has elapsed;
//! 4. call [`Poller::flush`] on every poller, so that work queued during the iteration leaves in one go.
//!
//! An iteration in which something ran or a poller reported [`PollStatus::Busy`] counts as busy, any other as
//! idle ([`ReactorStats`]). Nothing on a reactor blocks: a message to a full ring is refused with
//! [`Error::QueueFull`], and the sender decides what to do.
//!
//! Ownership follows the reactors: a queue pair is handed to the reactor that will own it by sending it a
//! message that registers the queue pair's poller there ([`ReactorContext::add_poller`]).
//!
//! Stopping ([`Reactors::stop`]) runs every message sent before it: each reactor closes its ring (later sends
//! fail with [`Error::Reactor`]), runs what is left in it, flushes its pollers once more and drops them. A panic
//! on one reactor stops all of them, and `stop` (or [`Reactors::join`]) returns it as an `Err`.
//!
//! ```
//! use nvpoll::reactor::{CoreList, PollStatus, Reactors};
//!
//! let cores: CoreList = "0".parse()?;
//! let reactors = Reactors::start(&cores)?;
//! // Register a poller on reactor 0 from the outside, then ask every reactor something.
//! reactors.send(0, |ctx| {
//!     ctx.add_poller(|_: &mut nvpoll::reactor::ReactorContext| PollStatus::Idle);
//! })?;
//! let cores_seen: Vec<usize> = reactors.run_on_all(|ctx| ctx.core())?;
//! assert_eq!(cores_seen, vec![0]);
//! let stats = reactors.stop()?;
//! assert_eq!(stats[0].messages, 2);
//! # Ok::<(), nvpoll::Error>(())
//! ```

use std::any::Any;
use std::cell::Cell;
use std::fmt;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::str::FromStr;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;
use rustix::event::{EventfdFlags, PollFd, PollFlags, Timespec};

use crate::{Error, Result};

/// The set of cores to run reactors on, sorted and without duplicates.
///
/// Parsed as SPDK's core masks are: a hexadecimal mask (`0x3`: cores 0 and 1) or a list of cores and
/// inclusive ranges, optionally in brackets (`0,1`, `0-3`, `[0,2-3]`). Every core must be one this process may
/// run on.
///
/// # Examples
///
/// ```
/// use nvpoll::reactor::CoreList;
///
/// let all = CoreList::all();
/// assert!(!all.is_empty());
/// let first = all.cores()[0];
/// let one = CoreList::parse(&format!("[{first}]"))?;
/// assert_eq!((one.len(), one.cores()), (1, &[first][..]));
/// assert_eq!(format!("0x{:x}", 1u64 << first).parse::<CoreList>()?, one, "a mask selects the same core");
/// assert_eq!(all.to_string().parse::<CoreList>()?, all, "Display writes what parses");
/// assert!(CoreList::parse("100000").is_err(), "no such core here");
/// # Ok::<(), nvpoll::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CoreList {
    cores: Vec<usize>,
}

impl CoreList {
    /// Parses a mask or list (see the type's documentation). Fails with [`Error::InvalidArgument`] for bad
    /// syntax, an empty selection, or a core that does not exist on this machine (or is outside this process's
    /// affinity mask). See [`CoreList`]'s example.
    pub fn parse(spec: &str) -> Result<CoreList> {
        let bad = |why: &str| Error::InvalidArgument(format!("core list {spec:?}: {why}"));
        let s = spec.trim();
        let mut cores = Vec::new();
        if let Some(hex) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
            for (nibble, c) in hex.chars().rev().enumerate() {
                let bits = c
                    .to_digit(16)
                    .ok_or_else(|| bad("not a hexadecimal mask"))?;
                cores.extend(
                    (0..4)
                        .filter(|b| bits & (1 << b) != 0)
                        .map(|b| nibble * 4 + b),
                );
            }
        } else {
            let s = s
                .strip_prefix('[')
                .and_then(|s| s.strip_suffix(']'))
                .unwrap_or(s);
            for item in s.split(',').map(str::trim) {
                let number = |n: &str| {
                    n.trim()
                        .parse::<usize>()
                        .map_err(|_| bad("expected core numbers"))
                };
                match item.split_once('-') {
                    Some((first, last)) => {
                        let (first, last) = (number(first)?, number(last)?);
                        if first > last {
                            return Err(bad(&format!("range {first}-{last} is backwards")));
                        }
                        cores.extend(first..=last);
                    }
                    None => cores.push(number(item)?),
                }
            }
        }
        cores.sort_unstable();
        cores.dedup();
        if cores.is_empty() {
            return Err(bad("selects no core"));
        }
        let available = available_cores();
        if let Some(core) = cores.iter().find(|c| available.binary_search(c).is_err()) {
            return Err(Error::InvalidArgument(format!(
                "core {core} does not exist on this machine (available: {})",
                CoreList { cores: available }
            )));
        }
        Ok(CoreList { cores })
    }

    /// Every core this process may run on. See [`CoreList`]'s example.
    pub fn all() -> CoreList {
        CoreList {
            cores: available_cores(),
        }
    }

    /// The cores, in increasing order. See [`CoreList`]'s example.
    pub fn cores(&self) -> &[usize] {
        &self.cores
    }

    /// The number of cores. See [`CoreList`]'s example.
    pub fn len(&self) -> usize {
        self.cores.len()
    }

    /// Always false: a core list selects at least one core. See [`CoreList`]'s example.
    pub fn is_empty(&self) -> bool {
        self.cores.is_empty()
    }
}

impl FromStr for CoreList {
    type Err = Error;

    fn from_str(s: &str) -> Result<CoreList> {
        CoreList::parse(s)
    }
}

/// Writes the list form with ranges, e.g. `0-3,8`.
impl fmt::Display for CoreList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut i = 0;
        while i < self.cores.len() {
            let first = self.cores[i];
            while i + 1 < self.cores.len() && self.cores[i + 1] == self.cores[i] + 1 {
                i += 1;
            }
            let sep = if first == self.cores[0] { "" } else { "," };
            match self.cores[i] {
                last if last == first => write!(f, "{sep}{first}")?,
                last => write!(f, "{sep}{first}-{last}")?,
            }
            i += 1;
        }
        Ok(())
    }
}

/// The cores this process may be pinned to, sorted.
fn available_cores() -> Vec<usize> {
    let mut cores: Vec<usize> = match core_affinity::get_core_ids() {
        Some(ids) if !ids.is_empty() => ids.into_iter().map(|c| c.id).collect(),
        _ => (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect(),
    };
    cores.sort_unstable();
    cores
}

/// What a poller found.
///
/// See [`Poller`]'s example.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PollStatus {
    /// It did some work (completions, received data, ...).
    Busy,
    /// There was nothing to do.
    Idle,
}

impl PollStatus {
    /// [`PollStatus::Busy`] if `busy`, else [`PollStatus::Idle`].
    ///
    /// # Examples
    ///
    /// ```
    /// use nvpoll::reactor::PollStatus;
    ///
    /// let completed = 3;
    /// assert_eq!(PollStatus::busy_if(completed > 0), PollStatus::Busy);
    /// assert_eq!(PollStatus::busy_if(false), PollStatus::Idle);
    /// ```
    pub fn busy_if(busy: bool) -> PollStatus {
        if busy {
            PollStatus::Busy
        } else {
            PollStatus::Idle
        }
    }
}

/// Something a reactor calls on every iteration (or every period, for a timed poller).
///
/// Closures `FnMut(&mut ReactorContext) -> PollStatus` are pollers too.
///
/// # Examples
///
/// A queue pair driven by a poller on its reactor: the poller is made there (a queue pair belongs to the
/// thread that drives it), submits reads, sends them all in its `flush` at the end of each iteration, and
/// stops the reactors after 100 completions. The queue pair is an in-memory one (hidden lines).
///
/// ```
/// # mod ram { include!("doctest/ram.rs"); }
/// use nvpoll::api::{IoOp, IoRequest, QueuePair};
/// use nvpoll::mem::DmaPool;
/// use nvpoll::reactor::{CoreList, IdlePolicy, PollStatus, Poller, ReactorContext, Reactors};
///
/// struct Reader {
///     qp: ram::RamQueuePair,
///     pool: DmaPool,
///     completed: u64,
/// }
///
/// impl Poller for Reader {
///     fn poll(&mut self, ctx: &mut ReactorContext) -> PollStatus {
///         while self.qp.outstanding() < 4 {
///             let buf = self.pool.alloc(512).expect("a buffer");
///             let req = IoRequest { op: IoOp::Read, nsid: 1, lba: 0, blocks: 1, buf: Some(buf), tag: 0 };
///             self.qp.submit(req).expect("room");
///         }
///         let mut n = 0;
///         self.qp.process_completions(32, |_, c| {
///             assert!(c.result.is_ok());
///             n += 1;
///         }).expect("the queue pair works");
///         self.completed += n;
///         if self.completed >= 100 && !ctx.stop_requested() {
///             ctx.request_stop();
///         }
///         PollStatus::busy_if(n > 0)
///     }
///
///     fn flush(&mut self, _ctx: &mut ReactorContext) {
///         self.qp.flush().expect("sent"); // one send for everything this iteration submitted
///     }
/// }
///
/// let pool = DmaPool::builder().class(4096, 16).build()?;
/// let cores = CoreList::parse(&CoreList::all().cores()[0].to_string())?;
/// let reactors = Reactors::builder().idle(IdlePolicy::hybrid()).start(&cores)?;
/// reactors.send(0, move |ctx| {
///     ctx.add_poller(Reader { qp: ram::RamQueuePair::new(8), pool, completed: 0 });
/// })?;
/// let stats = reactors.join()?; // returns once the poller asked the reactors to stop
/// assert!(stats[0].busy > 0);
/// # Ok::<(), nvpoll::Error>(())
/// ```
pub trait Poller {
    /// Does whatever work is ready, without blocking, and says whether there was any. See [`Poller`]'s example.
    fn poll(&mut self, ctx: &mut ReactorContext) -> PollStatus;

    /// Called at the end of every iteration of the reactor, after all pollers ran: the place to send what was
    /// queued during the iteration (one doorbell write, one coalesced socket write). Does nothing by default.
    /// See [`Poller`]'s example.
    fn flush(&mut self, _ctx: &mut ReactorContext) {}

    /// For [`IdlePolicy::Hybrid`]: says what can give this poller work, so that a quiet reactor may sleep.
    /// Add the file descriptors whose readiness means work and the moment of the poller's next timed duty to
    /// `w`, and return `true`; the reactor sleeps until one of them (or a message on its ring) fires, and then
    /// polls everything again. A poller with nothing to wait for (no I/O outstanding on a device that cannot
    /// interrupt, say) returns `true` and adds nothing.
    ///
    /// Return `false` (the default) when work can arrive in a way no file descriptor or deadline shows: an
    /// ordinary poller that returns `false` keeps its reactor polling; for a timed poller `false` means "wake
    /// me at my next period".
    ///
    /// See [`ReactorWaker`]'s example (a poller with nothing to wait for) and [`WakeSources`]' (one with a
    /// descriptor and a deadline).
    fn wake_sources<'a>(&'a self, _w: &mut WakeSources<'a>) -> bool {
        false
    }
}

/// What a sleeping reactor waits for, collected from its pollers ([`Poller::wake_sources`]).
///
/// # Examples
///
/// A poller that waits for a socket and a timer says so; the reactor (or a caller outside one, such as the
/// async interface's completion fd) reads back what was given:
///
/// ```
/// use std::os::unix::net::UnixStream;
/// use std::time::{Duration, Instant};
/// use nvpoll::reactor::{PollStatus, Poller, ReactorContext, WakeSources};
///
/// struct Conn {
///     sock: UnixStream,
///     unsent: usize,
///     keep_alive_at: Instant,
/// }
///
/// impl Poller for Conn {
///     fn poll(&mut self, _ctx: &mut ReactorContext) -> PollStatus {
///         PollStatus::Idle
///     }
///     fn wake_sources<'a>(&'a self, w: &mut WakeSources<'a>) -> bool {
///         w.readable(&self.sock);
///         if self.unsent > 0 {
///             w.writable(&self.sock); // only while the socket pushed back
///         }
///         w.deadline(self.keep_alive_at);
///         true
///     }
/// }
///
/// let (sock, _peer) = UnixStream::pair()?;
/// let at = Instant::now() + Duration::from_secs(5);
/// let conn = Conn { sock, unsent: 100, keep_alive_at: at };
/// let mut w = WakeSources::default();
/// assert!(conn.wake_sources(&mut w));
/// w.deadline(at + Duration::from_secs(1)); // a later deadline changes nothing
/// assert_eq!(w.deadline_at(), Some(at));
/// assert_eq!(w.watched().count(), 2);
/// # Ok::<(), std::io::Error>(())
/// ```
pub struct WakeSources<'a> {
    fds: Vec<PollFd<'a>>,
    /// What each of `fds` is watched for (PollFd does not say).
    interest: Vec<PollFlags>,
    deadline: Option<Instant>,
}

impl<'a> WakeSources<'a> {
    pub(crate) fn new() -> Self {
        WakeSources {
            fds: Vec::new(),
            interest: Vec::new(),
            deadline: None,
        }
    }

    /// Wake when `fd` has something to read (or is closed or failed). See [`WakeSources`]' example.
    pub fn readable(&mut self, fd: &'a impl AsFd) {
        self.fds.push(PollFd::new(fd, PollFlags::IN));
        self.interest.push(PollFlags::IN);
    }

    /// Wake when `fd` can take more bytes: only while the poller has bytes the socket refused (a socket is
    /// nearly always writable, so asking otherwise wakes the reactor at once). See [`WakeSources`]' example.
    pub fn writable(&mut self, fd: &'a impl AsFd) {
        self.fds.push(PollFd::new(fd, PollFlags::OUT));
        self.interest.push(PollFlags::OUT);
    }

    /// Wake no later than `at` (the earliest of all the deadlines given counts). See [`WakeSources`]' example.
    pub fn deadline(&mut self, at: Instant) {
        self.deadline = Some(self.deadline.map_or(at, |d| d.min(at)));
    }

    /// The descriptors given, each with what it is watched for: for a caller that waits outside a reactor
    /// (the async interface's completion fd, the C interface's). See [`WakeSources`]' example.
    pub fn watched(&self) -> impl Iterator<Item = (BorrowedFd<'_>, PollFlags)> + '_ {
        self.fds
            .iter()
            .map(PollFd::as_fd)
            .zip(self.interest.iter().copied())
    }

    /// The earliest deadline given. See [`WakeSources`]' example.
    pub fn deadline_at(&self) -> Option<Instant> {
        self.deadline
    }
}

/// An empty set, for a caller that asks a queue pair outside a reactor what would wake it.
impl Default for WakeSources<'_> {
    fn default() -> Self {
        WakeSources::new()
    }
}

impl fmt::Debug for WakeSources<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WakeSources")
            .field("fds", &self.fds.len())
            .field("deadline", &self.deadline)
            .finish()
    }
}

/// How a reactor spends the iterations in which nothing happens.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use nvpoll::reactor::IdlePolicy;
///
/// assert_eq!(IdlePolicy::default(), IdlePolicy::Poll);
/// assert_eq!(IdlePolicy::hybrid(), IdlePolicy::Hybrid { quiet: IdlePolicy::DEFAULT_QUIET });
/// let p: IdlePolicy = "hybrid:500us".parse()?;
/// assert_eq!(p, IdlePolicy::Hybrid { quiet: Duration::from_micros(500) });
/// assert_eq!(p.to_string(), "hybrid:500us");
/// # Ok::<(), nvpoll::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum IdlePolicy {
    /// Poll on, always (the default, as in SPDK): the lowest latency, and a full core per reactor even with
    /// nothing to do.
    #[default]
    Poll,
    /// Poll while there is work. After `quiet` of iterations in which nothing happened, sleep in `poll(2)`
    /// until one of the pollers' wake sources ([`Poller::wake_sources`]), a message on the ring, a stop or the
    /// earliest deadline wakes the reactor; then poll again at once. A reactor sleeps only when every poller
    /// says what wakes it.
    Hybrid {
        /// How long the reactor keeps polling with nothing to do before it sleeps.
        quiet: Duration,
    },
}

impl IdlePolicy {
    /// The quiet time of `hybrid` when none is given: longer than a round trip of any I/O on a LAN, so that a
    /// reactor under load never sleeps between two commands.
    pub const DEFAULT_QUIET: Duration = Duration::from_millis(1);

    /// Hybrid with [`IdlePolicy::DEFAULT_QUIET`]. See [`IdlePolicy`]'s example.
    pub fn hybrid() -> IdlePolicy {
        IdlePolicy::Hybrid {
            quiet: IdlePolicy::DEFAULT_QUIET,
        }
    }
}

/// `poll` or `hybrid`, optionally with its quiet time: `hybrid:200us`.
impl FromStr for IdlePolicy {
    type Err = Error;

    fn from_str(s: &str) -> Result<IdlePolicy> {
        let bad = || {
            Error::InvalidArgument(format!(
                "idle policy {s:?}: expected poll, hybrid or hybrid:<quiet time> (e.g. hybrid:500us)"
            ))
        };
        match s.trim().split_once(':') {
            None if s.trim() == "poll" => Ok(IdlePolicy::Poll),
            None if s.trim() == "hybrid" => Ok(IdlePolicy::hybrid()),
            Some(("hybrid", q)) => {
                let quiet = crate::units::parse_duration(q).map_err(|_| bad())?;
                Ok(IdlePolicy::Hybrid { quiet })
            }
            _ => Err(bad()),
        }
    }
}

impl fmt::Display for IdlePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IdlePolicy::Poll => f.write_str("poll"),
            IdlePolicy::Hybrid { quiet } => write!(f, "hybrid:{}us", quiet.as_micros()),
        }
    }
}

impl<F: FnMut(&mut ReactorContext) -> PollStatus> Poller for F {
    fn poll(&mut self, ctx: &mut ReactorContext) -> PollStatus {
        self(ctx)
    }
}

/// Identifies a registered poller on its reactor, to remove it with [`ReactorContext::remove_poller`].
///
/// See [`ReactorContext`]'s example.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PollerId(u64);

/// Counters of one reactor. Read them while it runs with [`Reactors::stats`], or as [`Reactors::stop`] returns
/// them.
///
/// See [`Reactors`]'s example.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReactorStats {
    /// The core the reactor runs on.
    pub core: usize,
    /// Iterations in which a message ran or a poller was busy.
    pub busy: u64,
    /// Iterations in which nothing happened.
    pub idle: u64,
    /// Messages run (counted as each one starts).
    pub messages: u64,
    /// CPU time the reactor thread used. While it runs this is refreshed every 4096 iterations; after it
    /// stopped it is exact.
    pub cpu_time: Duration,
    /// Pollers registered now, timed ones included.
    pub pollers: u64,
    /// Of those, how many are parked now: idle, and polled only when one of their wake sources fires (see
    /// [`ReactorContext::wake_poller`]); an iteration walks the others.
    pub parked: u64,
    /// Times the reactor went to sleep ([`IdlePolicy::Hybrid`]), counted as each sleep starts.
    pub sleeps: u64,
    /// Time spent asleep, counted as each sleep ends.
    pub slept: Duration,
}

/// Configures and starts [`Reactors`]; see [`Reactors::builder`].
///
/// # Examples
///
/// ```
/// use nvpoll::reactor::{CoreList, IdlePolicy, Reactors};
///
/// let cores = CoreList::parse(&CoreList::all().cores()[0].to_string())?;
/// let reactors = Reactors::builder()
///     .ring_capacity(256)
///     .message_batch(16)
///     .idle(IdlePolicy::hybrid()) // sleep when there is nothing to do
///     .parking(true)
///     .start(&cores)?;
/// assert_eq!(reactors.len(), 1);
/// reactors.stop()?;
///
/// let none = Reactors::builder().ring_capacity(0).start(&cores);
/// assert!(matches!(none, Err(nvpoll::Error::InvalidArgument(_))));
/// # Ok::<(), nvpoll::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct ReactorsBuilder {
    ring_capacity: usize,
    message_batch: usize,
    idle: IdlePolicy,
    parking: bool,
}

impl ReactorsBuilder {
    /// How many messages each reactor's ring holds (4096 by default). A send to a full ring fails.
    /// See [`ReactorsBuilder`]'s example.
    pub fn ring_capacity(mut self, capacity: usize) -> Self {
        self.ring_capacity = capacity;
        self
    }

    /// The most messages a reactor runs per iteration before it polls again (64 by default).
    /// See [`ReactorsBuilder`]'s example.
    pub fn message_batch(mut self, batch: usize) -> Self {
        self.message_batch = batch;
        self
    }

    /// What the reactors do when there is nothing to do ([`IdlePolicy::Poll`] by default).
    /// See [`ReactorsBuilder`]'s example.
    pub fn idle(mut self, policy: IdlePolicy) -> Self {
        self.idle = policy;
        self
    }

    /// Whether a reactor with more than 8 pollers parks the idle ones (on by default): a poller idle for a
    /// while that says what wakes it ([`Poller::wake_sources`]) is polled only when one of its wake sources
    /// fires ([`ReactorContext::wake_poller`] has the rules). Off, every poller is polled on every iteration
    /// (for comparisons, or a poller whose wake sources are incomplete). See [`ReactorsBuilder`]'s example.
    pub fn parking(mut self, on: bool) -> Self {
        self.parking = on;
        self
    }

    /// Starts one reactor per core of `cores`, pinned to it, and returns once all are running.
    /// Fails with [`Error::Reactor`] if a thread cannot be spawned or pinned (the others are then stopped).
    /// See [`ReactorsBuilder`]'s example.
    pub fn start(self, cores: &CoreList) -> Result<Reactors> {
        if self.ring_capacity == 0 || self.message_batch == 0 {
            return Err(Error::InvalidArgument(
                "ring capacity and message batch must be at least 1".into(),
            ));
        }
        let mut per = Vec::with_capacity(cores.len());
        for &core in cores.cores() {
            let wake_fd = rustix::event::eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)
                .map_err(|e| {
                    Error::Reactor(format!(
                        "cannot create the wake eventfd of core {core}: {e}"
                    ))
                })?;
            per.push(PerReactor {
                core,
                ring: ArrayQueue::new(self.ring_capacity),
                ring_state: AtomicUsize::new(0),
                sleeping: AtomicBool::new(false),
                kicked: AtomicBool::new(false),
                wake_fd,
                stats: Counters::default(),
            });
        }
        let shared = Arc::new(Shared {
            reactors: per.into_boxed_slice(),
            stop: AtomicBool::new(false),
        });
        let mut reactors = Reactors {
            shared: Arc::clone(&shared),
            threads: Vec::new(),
        };
        let (ready_tx, ready_rx) = mpsc::channel();
        for index in 0..cores.len() {
            let shared = Arc::clone(&shared);
            let ready = ready_tx.clone();
            let (batch, idle) = (self.message_batch, self.idle);
            let park_min = if self.parking { PARK_MIN } else { usize::MAX };
            let core = cores.cores()[index];
            let spawned = std::thread::Builder::new()
                .name(format!("nvpoll-reactor-{core}"))
                .spawn(move || reactor_thread(shared, index, batch, idle, park_min, ready));
            match spawned {
                Ok(handle) => reactors.threads.push(handle),
                Err(e) => {
                    drop(reactors.stop());
                    return Err(Error::Reactor(format!(
                        "cannot spawn the thread of core {core}: {e}"
                    )));
                }
            }
        }
        drop(ready_tx);
        for _ in 0..cores.len() {
            match ready_rx.recv() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    drop(reactors.stop());
                    return Err(e);
                }
                Err(_) => {
                    return reactors
                        .stop()
                        .and(Err(Error::Reactor("a reactor died while starting".into())))
                }
            }
        }
        Ok(reactors)
    }
}

/// A set of running reactors, one per core of a [`CoreList`], addressed by index `0..len()` in core order.
///
/// Dropping it stops the reactors as [`Reactors::stop`] does, ignoring (but printing) a panic.
///
/// # Examples
///
/// ```
/// use nvpoll::reactor::{CoreList, Reactors};
///
/// let cores = CoreList::parse(&CoreList::all().cores()[0].to_string())?;
/// let reactors = Reactors::start(&cores)?;
/// assert_eq!((reactors.len(), reactors.is_empty()), (1, false));
/// assert_eq!(reactors.cores(), cores.cores());
///
/// reactors.send(0, |ctx| println!("on core {}", ctx.core()))?;
/// let counts: Vec<usize> = reactors.run_on_all(|ctx| ctx.reactor_count())?;
/// assert_eq!(counts, [1]);
/// assert!(reactors.stats()[0].messages <= 2, "counted as each one starts");
/// reactors.waker(0)?.wake(); // nothing to do for a reactor that polls, but allowed
/// assert!(reactors.waker(1).is_err(), "no reactor 1");
///
/// let stats = reactors.stop()?;
/// assert_eq!(stats[0].messages, 2);
/// assert_eq!(stats[0].core, cores.cores()[0]);
/// # Ok::<(), nvpoll::Error>(())
/// ```
pub struct Reactors {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<ThreadResult>>,
}

impl Reactors {
    /// Starts configuring reactors, to change the ring capacity or message batch. See [`ReactorsBuilder`]'s
    /// example.
    pub fn builder() -> ReactorsBuilder {
        ReactorsBuilder {
            ring_capacity: 4096,
            message_batch: 64,
            idle: IdlePolicy::Poll,
            parking: true,
        }
    }

    /// A handle that wakes reactor `index` if it sleeps ([`ReactorWaker`]). Fails with
    /// [`Error::InvalidArgument`] for an index out of range. See [`Reactors`]'s example, and
    /// [`ReactorWaker`]'s.
    pub fn waker(&self, index: usize) -> Result<ReactorWaker> {
        self.shared.waker(index)
    }

    /// Starts one reactor per core with the default configuration; see [`ReactorsBuilder::start`].
    /// See [`Reactors`]'s example.
    pub fn start(cores: &CoreList) -> Result<Reactors> {
        Reactors::builder().start(cores)
    }

    /// The number of reactors.
    /// See [`Reactors`]'s example.
    pub fn len(&self) -> usize {
        self.shared.reactors.len()
    }

    /// Always false: there is at least one reactor.
    /// See [`Reactors`]'s example.
    pub fn is_empty(&self) -> bool {
        self.shared.reactors.is_empty()
    }

    /// The core of each reactor, by index.
    /// See [`Reactors`]'s example.
    pub fn cores(&self) -> Vec<usize> {
        self.shared.reactors.iter().map(|r| r.core).collect()
    }

    /// Sends `msg` to reactor `target`, which runs it on its thread; see [`ReactorContext::send`].
    /// See [`Reactors`]'s example.
    pub fn send<F>(&self, target: usize, msg: F) -> Result<()>
    where
        F: FnOnce(&mut ReactorContext) + Send + 'static,
    {
        self.shared.send(target, Box::new(msg))
    }

    /// Runs `f` once on every reactor and returns the results by reactor index. Blocks the calling thread, so it
    /// fails with [`Error::Reactor`] when called from a reactor, and when a reactor stops before running `f`;
    /// it fails with [`Error::QueueFull`] when a ring is full (some reactors may then have run `f`).
    /// See [`Reactors`]'s example.
    pub fn run_on_all<T, F>(&self, f: F) -> Result<Vec<T>>
    where
        T: Send + 'static,
        F: Fn(&mut ReactorContext) -> T + Send + Sync + 'static,
    {
        if ON_REACTOR.get() {
            return Err(Error::Reactor(
                "run_on_all cannot be called on a reactor: it would block it".into(),
            ));
        }
        let f = Arc::new(f);
        let (tx, rx) = mpsc::channel();
        for target in 0..self.len() {
            let (f, tx) = (Arc::clone(&f), tx.clone());
            self.send(target, move |ctx| {
                // The receiver is gone only if `run_on_all` already failed.
                let _ = tx.send((ctx.index(), f(ctx)));
            })?;
        }
        drop(tx);
        let mut results: Vec<Option<T>> = (0..self.len()).map(|_| None).collect();
        for _ in 0..self.len() {
            let (index, value) = rx.recv().map_err(|_| {
                Error::Reactor("a reactor stopped before running the closure".into())
            })?;
            results[index] = Some(value);
        }
        Ok(results.into_iter().flatten().collect())
    }

    /// The counters of every reactor, by index, as they are now.
    /// See [`Reactors`]'s example.
    pub fn stats(&self) -> Vec<ReactorStats> {
        self.shared.reactors.iter().map(PerReactor::stats).collect()
    }

    /// Stops every reactor after it ran the messages already in its ring, waits for the threads, and returns
    /// their final counters. Fails with [`Error::Reactor`] naming every reactor that panicked.
    /// See [`Reactors`]'s example.
    pub fn stop(self) -> Result<Vec<ReactorStats>> {
        self.shared.request_stop();
        self.join()
    }

    /// Waits until the reactors stop by themselves (through [`ReactorContext::request_stop`] or a panic), then
    /// returns as [`Reactors::stop`] does. See [`Poller`]'s example.
    pub fn join(mut self) -> Result<Vec<ReactorStats>> {
        self.join_threads()
    }

    fn join_threads(&mut self) -> Result<Vec<ReactorStats>> {
        if ON_REACTOR.get() {
            self.shared.request_stop();
            self.threads.clear();
            return Err(Error::Reactor(
                "reactors cannot be joined from a reactor".into(),
            ));
        }
        let mut stats = Vec::with_capacity(self.threads.len());
        let mut failures = Vec::new();
        for (index, thread) in self.threads.drain(..).enumerate() {
            let core = self.shared.reactors[index].core;
            match thread.join() {
                Ok(Ok(s)) => stats.push(s),
                Ok(Err(why)) => failures.push(format!("reactor {index} (core {core}) {why}")),
                Err(payload) => failures.push(format!(
                    "reactor {index} (core {core}) panicked while stopping: {}",
                    panic_message(payload.as_ref())
                )),
            }
        }
        if failures.is_empty() {
            Ok(stats)
        } else {
            Err(Error::Reactor(failures.join("; ")))
        }
    }
}

impl Drop for Reactors {
    fn drop(&mut self) {
        if !self.threads.is_empty() {
            self.shared.request_stop();
            if let Err(e) = self.join_threads() {
                log::error!("reactors dropped without stop(): {e}");
            }
        }
    }
}

impl fmt::Debug for Reactors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reactors")
            .field("cores", &self.cores())
            .finish_non_exhaustive()
    }
}

/// What a message, a poller or a flush sees of the reactor it runs on.
///
/// # Examples
///
/// A message that registers pollers (one timed), sends itself a message, and removes a poller again:
///
/// ```
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use std::sync::Arc;
/// use std::time::Duration;
/// use nvpoll::reactor::{CoreList, IdlePolicy, PollStatus, ReactorContext, Reactors};
///
/// let cores = CoreList::parse(&CoreList::all().cores()[0].to_string())?;
/// let reactors = Reactors::builder().idle(IdlePolicy::hybrid()).start(&cores)?;
/// let ticks = Arc::new(AtomicU64::new(0));
/// let t = Arc::clone(&ticks);
/// let ids = reactors.run_on_all(move |ctx: &mut ReactorContext| {
///     assert_eq!((ctx.index(), ctx.reactor_count()), (0, 1));
///     assert!(!ctx.stop_requested());
///     println!("core {}, {:?} of CPU so far, woke up: {}", ctx.core(), ctx.cpu_time(), ctx.woke_up());
///     let t = Arc::clone(&t);
///     let timed = ctx.add_timed_poller(Duration::from_millis(1), move |_: &mut ReactorContext| {
///         t.fetch_add(1, Ordering::Relaxed);
///         PollStatus::Busy
///     });
///     let spare = ctx.add_poller(|_: &mut ReactorContext| PollStatus::Idle);
///     ctx.wake_poller(spare); // poll it on the next iteration even if it was parked
///     ctx.remove_poller(spare);
///     let waker = ctx.waker(); // for another thread, to wake this reactor from a sleep
///     ctx.send(ctx.index(), move |_ctx| waker.wake()).expect("room on the ring");
///     timed
/// })?;
/// while ticks.load(Ordering::Relaxed) < 3 {
///     std::thread::sleep(Duration::from_millis(1));
/// }
/// let timed = ids[0];
/// reactors.send(0, move |ctx| ctx.remove_poller(timed))?;
/// let stats = reactors.stop()?;
/// assert_eq!(stats[0].pollers, 0);
/// # Ok::<(), nvpoll::Error>(())
/// ```
pub struct ReactorContext {
    index: usize,
    shared: Arc<Shared>,
    next_id: u64,
    added: Vec<(PollerId, Option<Duration>, Box<dyn Poller>)>,
    removed: Vec<PollerId>,
    /// Pollers to unpark at the end of the current step ([`ReactorContext::wake_poller`]).
    wake: Vec<PollerId>,
    woke: bool,
}

impl ReactorContext {
    /// This reactor's index (`0..reactor_count()`).
    /// See [`ReactorContext`]'s example.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The core this reactor is pinned to.
    /// See [`ReactorContext`]'s example.
    pub fn core(&self) -> usize {
        self.shared.reactors[self.index].core
    }

    /// How many reactors there are.
    /// See [`ReactorContext`]'s example.
    pub fn reactor_count(&self) -> usize {
        self.shared.reactors.len()
    }

    /// Sends `msg` to reactor `target` (this one included), to run there in a later iteration. Never blocks:
    /// fails with [`Error::QueueFull`] when the target's ring is full (the message is dropped; try again later),
    /// with [`Error::Reactor`] when the target has stopped, and with [`Error::InvalidArgument`] for an index
    /// out of range.
    /// See [`ReactorContext`]'s example.
    pub fn send<F>(&self, target: usize, msg: F) -> Result<()>
    where
        F: FnOnce(&mut ReactorContext) + Send + 'static,
    {
        self.shared.send(target, Box::new(msg))
    }

    /// Registers a poller on this reactor, polled from the next iteration on.
    /// See [`ReactorContext`]'s example.
    pub fn add_poller(&mut self, poller: impl Poller + 'static) -> PollerId {
        self.register(None, Box::new(poller))
    }

    /// Registers a timed poller, polled once every `period` (for keep-alives and timeouts). Its
    /// [`Poller::flush`] runs on every iteration, like any poller's.
    /// See [`ReactorContext`]'s example.
    pub fn add_timed_poller(
        &mut self,
        period: Duration,
        poller: impl Poller + 'static,
    ) -> PollerId {
        self.register(Some(period), Box::new(poller))
    }

    /// Unregisters (and drops) a poller at the end of the current step of the iteration. Unknown ids are
    /// ignored.
    /// See [`ReactorContext`]'s example.
    pub fn remove_poller(&mut self, id: PollerId) {
        self.removed.push(id);
    }

    /// Makes sure poller `id` of this reactor is polled on the next iteration, for a poller that hands another
    /// work through state they share (no message, no descriptor): a poller that was idle for a while and said
    /// what wakes it may be parked, polled only when one of its wake sources fires. Unknown ids are ignored.
    /// See [`ReactorContext`]'s example.
    pub fn wake_poller(&mut self, id: PollerId) {
        self.wake.push(id);
    }

    /// Asks every reactor to stop, as [`Reactors::stop`] does; the owner of [`Reactors`] collects them with
    /// [`Reactors::join`]. See [`Poller`]'s example.
    pub fn request_stop(&self) {
        self.shared.request_stop();
    }

    /// Whether this iteration is the first after a sleep ([`IdlePolicy::Hybrid`]): one of the wake sources
    /// fired, so a poller that looks at some of its work only now and then should look at all of it now.
    /// See [`ReactorContext`]'s example.
    pub fn woke_up(&self) -> bool {
        self.woke
    }

    /// A handle that wakes this reactor if it sleeps, for whoever changes state its pollers read.
    /// See [`ReactorContext`]'s example.
    pub fn waker(&self) -> ReactorWaker {
        ReactorWaker {
            shared: Arc::clone(&self.shared),
            index: self.index,
        }
    }

    /// Whether the reactors have been asked to stop.
    /// See [`ReactorContext`]'s example.
    pub fn stop_requested(&self) -> bool {
        self.shared.stop.load(Ordering::Acquire)
    }

    /// CPU time this reactor's thread has used so far (for CPU time per I/O).
    /// See [`ReactorContext`]'s example.
    pub fn cpu_time(&self) -> Duration {
        thread_cpu_time()
    }

    fn register(&mut self, period: Option<Duration>, poller: Box<dyn Poller>) -> PollerId {
        let id = PollerId(self.next_id);
        self.next_id += 1;
        self.added.push((id, period, poller));
        id
    }
}

impl fmt::Debug for ReactorContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReactorContext")
            .field("index", &self.index)
            .field("core", &self.core())
            .finish_non_exhaustive()
    }
}

type Message = Box<dyn FnOnce(&mut ReactorContext) + Send>;

/// What a reactor thread hands back: its counters, or why it failed.
type ThreadResult = std::result::Result<ReactorStats, ThreadFailure>;

/// Why a reactor thread ended without its counters.
#[derive(Debug)]
enum ThreadFailure {
    /// It could not be pinned to its core (it never ran).
    NotPinned,
    /// A poller or message panicked; the panic's message.
    Panicked(String),
}

impl fmt::Display for ThreadFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ThreadFailure::NotPinned => f.write_str("could not be pinned"),
            ThreadFailure::Panicked(why) => write!(f, "panicked: {why}"),
        }
    }
}

/// Set in `ring_state` once the reactor accepts no more messages; the other bits count senders inside `send`.
const CLOSED: usize = 1 << (usize::BITS - 1);

struct Shared {
    reactors: Box<[PerReactor]>,
    stop: AtomicBool,
}

impl Shared {
    fn send(&self, target: usize, msg: Message) -> Result<()> {
        let Some(r) = self.reactors.get(target) else {
            return Err(Error::InvalidArgument(format!(
                "reactor {target} does not exist (there are {})",
                self.reactors.len()
            )));
        };
        // Announce this sender before looking at CLOSED, so that a closing reactor waits for the push below and
        // then finds the message when it drains its ring.
        if r.ring_state.fetch_add(1, Ordering::AcqRel) & CLOSED != 0 {
            r.ring_state.fetch_sub(1, Ordering::Release);
            return Err(Error::Reactor(format!(
                "reactor {target} (core {}) has stopped",
                r.core
            )));
        }
        let pushed = r.ring.push(msg);
        r.ring_state.fetch_sub(1, Ordering::Release);
        pushed.map_err(|_| Error::QueueFull)?;
        r.wake();
        Ok(())
    }

    /// Sets the stop flag and wakes every reactor that sleeps, so that each sees it.
    fn request_stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        for r in self.reactors.iter() {
            r.wake();
        }
    }

    fn waker(self: &Arc<Self>, index: usize) -> Result<ReactorWaker> {
        if index >= self.reactors.len() {
            return Err(Error::InvalidArgument(format!(
                "reactor {index} does not exist (there are {})",
                self.reactors.len()
            )));
        }
        Ok(ReactorWaker {
            shared: Arc::clone(self),
            index,
        })
    }
}

/// Wakes one reactor if it sleeps ([`IdlePolicy::Hybrid`]); see [`Reactors::waker`] and
/// [`ReactorContext::waker`]. Messages and stops wake reactors by themselves: this is for state that pollers
/// read without a message (a flag, a shared table), which a sleeping reactor would otherwise see only at its
/// next wake. Cheap when the reactor is awake: a fence and a load.
///
/// # Examples
///
/// A hybrid reactor sleeps while its poller has nothing to do; the poller reads a flag no message carries,
/// so whoever sets it wakes the reactor:
///
/// ```
/// use std::sync::atomic::{AtomicBool, Ordering};
/// use std::sync::Arc;
/// use std::time::Duration;
/// use nvpoll::reactor::{CoreList, IdlePolicy, PollStatus, Poller, ReactorContext, Reactors, WakeSources};
///
/// struct Watcher(Arc<AtomicBool>);
///
/// impl Poller for Watcher {
///     fn poll(&mut self, ctx: &mut ReactorContext) -> PollStatus {
///         if self.0.load(Ordering::Acquire) && !ctx.stop_requested() {
///             ctx.request_stop();
///         }
///         PollStatus::Idle
///     }
///     fn wake_sources<'a>(&'a self, _w: &mut WakeSources<'a>) -> bool {
///         true // nothing to wait for but the waker: the reactor may sleep
///     }
/// }
///
/// let cores = CoreList::parse(&CoreList::all().cores()[0].to_string())?;
/// let policy = IdlePolicy::Hybrid { quiet: Duration::from_micros(100) };
/// let reactors = Reactors::builder().idle(policy).start(&cores)?;
/// let flag = Arc::new(AtomicBool::new(false));
/// let f = Arc::clone(&flag);
/// reactors.send(0, move |ctx| {
///     ctx.add_poller(Watcher(f));
/// })?;
/// let waker = reactors.waker(0)?;
/// while reactors.stats()[0].sleeps == 0 {
///     std::thread::sleep(Duration::from_millis(1));
/// }
/// flag.store(true, Ordering::Release);
/// waker.wake();
/// let stats = reactors.join()?; // the poller saw the flag and stopped the reactors
/// assert!(stats[0].sleeps >= 1);
/// # Ok::<(), nvpoll::Error>(())
/// ```
#[derive(Clone)]
pub struct ReactorWaker {
    shared: Arc<Shared>,
    index: usize,
}

impl ReactorWaker {
    /// Makes the reactor run an iteration soon, if it sleeps; does nothing if it polls. Call it after the
    /// change its pollers must see. See [`ReactorWaker`]'s example.
    pub fn wake(&self) {
        let r = &self.shared.reactors[self.index];
        // The change was made before this; a reactor about to sleep finds the flag (see `Reactor::sleep`).
        r.kicked.store(true, Ordering::Relaxed);
        r.wake();
    }
}

impl fmt::Debug for ReactorWaker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReactorWaker")
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

/// The state of one reactor that other threads touch, on its own cache lines.
#[repr(align(128))]
struct PerReactor {
    core: usize,
    ring: ArrayQueue<Message>,
    ring_state: AtomicUsize,
    /// Set by the reactor just before it sleeps, cleared as it wakes: a sender writes `wake_fd` only then.
    sleeping: AtomicBool,
    /// Set by [`ReactorWaker::wake`]: something a poller reads changed, so the reactor must poll once more
    /// before it sleeps. (A message needs no flag: the ring itself is looked at.)
    kicked: AtomicBool,
    /// An eventfd in the sleeping reactor's poll set.
    wake_fd: OwnedFd,
    stats: Counters,
}

impl PerReactor {
    fn stats(&self) -> ReactorStats {
        let c = &self.stats;
        ReactorStats {
            core: self.core,
            busy: c.busy.load(Ordering::Relaxed),
            idle: c.idle.load(Ordering::Relaxed),
            messages: c.messages.load(Ordering::Relaxed),
            cpu_time: Duration::from_nanos(c.cpu_ns.load(Ordering::Relaxed)),
            pollers: c.pollers.load(Ordering::Relaxed),
            parked: c.parked.load(Ordering::Relaxed),
            sleeps: c.sleeps.load(Ordering::Relaxed),
            slept: Duration::from_nanos(c.slept_ns.load(Ordering::Relaxed)),
        }
    }

    /// After the change that must be seen (a push, a flag): wakes the reactor if it sleeps or is about to.
    ///
    /// The reactor stores `sleeping`, fences, then looks at its ring and the stop flag; a waker makes its
    /// change, fences, then loads `sleeping`. With both fences sequentially consistent, at least one side sees
    /// the other's store: either the reactor finds the change and does not sleep, or the waker finds it
    /// sleeping and writes the eventfd, which ends (or pre-empts) its `poll`.
    fn wake(&self) {
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::Relaxed) {
            // Fails only with EAGAIN, when the counter is already near its maximum, so nonzero: the reactor
            // wakes anyway.
            let _ = rustix::io::write(&self.wake_fd, &1u64.to_ne_bytes());
        }
    }

    /// Refuses new messages, and waits for the senders already inside `send` to finish their push.
    fn close(&self) {
        self.ring_state.fetch_or(CLOSED, Ordering::AcqRel);
        while self.ring_state.load(Ordering::Acquire) & !CLOSED != 0 {
            std::thread::yield_now();
        }
    }
}

/// Written by the reactor only (plain stores), read by anyone.
#[repr(align(128))]
#[derive(Default)]
struct Counters {
    busy: AtomicU64,
    idle: AtomicU64,
    messages: AtomicU64,
    cpu_ns: AtomicU64,
    pollers: AtomicU64,
    parked: AtomicU64,
    sleeps: AtomicU64,
    slept_ns: AtomicU64,
}

thread_local! {
    static ON_REACTOR: Cell<bool> = const { Cell::new(false) };
}

fn thread_cpu_time() -> Duration {
    cpu_time::ThreadTime::try_now().map_or(Duration::ZERO, |t| t.as_duration())
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    match (
        payload.downcast_ref::<&str>(),
        payload.downcast_ref::<String>(),
    ) {
        (Some(s), _) => (*s).to_string(),
        (_, Some(s)) => s.clone(),
        _ => "(no message)".to_string(),
    }
}

fn reactor_thread(
    shared: Arc<Shared>,
    index: usize,
    batch: usize,
    idle: IdlePolicy,
    park_min: usize,
    ready: mpsc::Sender<Result<()>>,
) -> ThreadResult {
    ON_REACTOR.set(true);
    let core = shared.reactors[index].core;
    if !core_affinity::set_for_current(core_affinity::CoreId { id: core }) {
        shared.request_stop();
        shared.reactors[index].close();
        let _ = ready.send(Err(Error::Reactor(format!(
            "cannot pin a reactor thread to core {core}"
        ))));
        return Err(ThreadFailure::NotPinned);
    }
    let _ = ready.send(Ok(()));
    drop(ready);
    if idle != IdlePolicy::Poll {
        // A sleep's timeout would otherwise overshoot by the default 50 us slack.
        if let Err(e) = rustix::thread::set_current_timer_slack(std::num::NonZeroU64::new(1)) {
            log::warn!(
                "reactor on core {core}: cannot set the timer slack ({e}); timers may fire late"
            );
        }
    }

    let mut reactor = Reactor {
        shared: Arc::clone(&shared),
        ctx: ReactorContext {
            index,
            shared,
            next_id: 0,
            added: Vec::new(),
            removed: Vec::new(),
            wake: Vec::new(),
            woke: false,
        },
        pollers: Vec::new(),
        active: Vec::new(),
        parking: None,
        timers: Vec::new(),
        next_deadline: None,
        batch,
        park_min,
        policy: idle,
        busy: 0,
        idle: 0,
        messages: 0,
        sleeps: 0,
        slept: Duration::ZERO,
    };
    match catch_unwind(AssertUnwindSafe(|| reactor.run())) {
        Ok(()) => Ok(reactor.stats()),
        Err(payload) => {
            let shared = Arc::clone(&reactor.ctx.shared);
            shared.request_stop();
            // Drop what can no longer run, so that nobody waits for it (run_on_all's channel disconnects).
            let me = &shared.reactors[index];
            me.close();
            while let Some(msg) = me.ring.pop() {
                drop(msg);
            }
            Err(ThreadFailure::Panicked(panic_message(payload.as_ref())))
        }
    }
}

struct Reactor {
    /// The same as `ctx.shared`, so that it can be borrowed while `ctx` is lent to a message or poller.
    shared: Arc<Shared>,
    ctx: ReactorContext,
    pollers: Vec<Entry>,
    /// The indices in `pollers` of those not parked: what an iteration polls and flushes.
    active: Vec<usize>,
    /// The readiness set of parked pollers, made when the reactor first has more than [`PARK_MIN`] pollers.
    parking: Option<Parking>,
    timers: Vec<Timer>,
    /// The earliest `Timer::next`, if there are timers.
    next_deadline: Option<Instant>,
    batch: usize,
    /// Parking starts above this many pollers ([`PARK_MIN`], or never).
    park_min: usize,
    policy: IdlePolicy,
    busy: u64,
    idle: u64,
    messages: u64,
    sleeps: u64,
    slept: Duration,
}

/// One ordinary poller on its reactor.
struct Entry {
    id: PollerId,
    poller: Box<dyn Poller>,
    /// Not polled or flushed until one of its wake sources fires, a message runs, a waker kicks the reactor
    /// or another poller asks ([`ReactorContext::wake_poller`]).
    parked: bool,
    /// Idle polls in a row (parking is considered after [`PARK_POLLS`] of them)...
    idle_polls: u32,
    /// ... and the iteration's time at the first of them (and after [`PARK_QUIET`]).
    idle_since: Option<Instant>,
    /// The deadline its wake sources gave when it parked.
    deadline: Option<Instant>,
}

/// Asks a level-triggered epoll set which of its descriptors are ready, without waiting: fills the first
/// entries of `events` (grown to fit) and returns how many. At most `want` (at least 1, at most 1024) come back
/// per call; the rest stay ready and come with the next. An error (EINTR) reads as none ready: the next call
/// asks again. What a reactor's parking and a target's ready group both ask once per iteration.
///
/// # Examples
///
/// ```
/// use std::io::Write;
/// use std::os::unix::net::UnixStream;
/// use nvpoll::reactor::epoll_ready_now;
/// use rustix::event::epoll;
///
/// let set = epoll::create(epoll::CreateFlags::CLOEXEC)?;
/// let (mut a, b) = UnixStream::pair()?;
/// epoll::add(&set, &b, epoll::EventData::new_u64(7), epoll::EventFlags::IN)?;
/// let mut events = Vec::new();
/// assert_eq!(epoll_ready_now(&set, &mut events, 1), 0, "nothing to read yet");
/// a.write_all(b"x")?;
/// assert_eq!(epoll_ready_now(&set, &mut events, 1), 1);
/// assert_eq!(events[0].data.u64(), 7);
/// // Level-triggered: still ready, since nothing was read.
/// assert_eq!(epoll_ready_now(&set, &mut events, 1), 1);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn epoll_ready_now(
    epoll: &impl AsFd,
    events: &mut Vec<rustix::event::epoll::Event>,
    want: usize,
) -> usize {
    let want = want.clamp(1, 1024);
    if events.len() < want {
        events.resize(
            want,
            rustix::event::epoll::Event {
                flags: rustix::event::epoll::EventFlags::empty(),
                data: rustix::event::epoll::EventData::new_u64(0),
            },
        );
    }
    let zero = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    rustix::event::epoll::wait(epoll, &mut events[..want], Some(&zero)).unwrap_or(0)
}

/// A reactor's parked pollers: one epoll set of their wake sources' descriptors, asked once per iteration
/// with a zero timeout, and the earliest of their deadlines.
///
/// Why: a reactor that polls every poller on every iteration pays for each of them, idle or not (a `recv`
/// per idle queue pair), so a busy queue beside many idle ones runs as slowly as its reactor's longest
/// iteration. A poller that has been idle for [`PARK_QUIET`] and says what wakes it is parked instead, and
/// an iteration then costs one `epoll_wait` plus the work of the pollers that have any.
///
/// Level-triggered: a descriptor with unread bytes stays ready, so a poller that left bytes in its socket is
/// woken again and nothing waits for an edge that already passed. Registrations are never deleted by number
/// (a closed descriptor leaves the set by itself, and its number may already belong to another poller's new
/// socket): each park modifies (or adds) every descriptor the poller gives, so a socket reopened under an
/// old number is registered afresh, and a descriptor a poller no longer gives at most wakes it for nothing.
/// A descriptor belongs to one poller: two pollers giving the same one would take it from each other.
struct Parking {
    epoll: OwnedFd,
    events: Vec<rustix::event::epoll::Event>,
    /// How many pollers are parked.
    parked: usize,
    /// The earliest deadline of a parked poller.
    next_deadline: Option<Instant>,
    /// Bumped whenever indices in `pollers` move (a removal, which unparks every poller): an event carrying an
    /// older epoch is stale.
    epoch: u32,
    /// A registration failed once (logged once; that poller stays active).
    warned: bool,
}

/// Parking starts when a reactor has more pollers than this: with a few, one `recv` each costs about what
/// the `epoll_wait` would, and they are usually busy.
const PARK_MIN: usize = 8;

/// A poller is parked after this many idle polls in a row...
const PARK_POLLS: u32 = 64;

/// ... spanning at least this long: longer than a command's round trip on a LAN and than a loaded reactor's
/// (perf qd1 x 128 on one core waits 1.9 ms per command here), so that a queue pair under load is never
/// parked and parking costs its `epoll_ctl` once per quiet spell, not per command. With 500 us, that qd1 x 128
/// row lost 5% (its queues parked and woke on every command).
const PARK_QUIET: Duration = Duration::from_millis(5);

struct Timer {
    id: PollerId,
    period: Duration,
    next: Instant,
    poller: Box<dyn Poller>,
}

/// How much earlier than a deadline a sleeping reactor asks to be woken, polling the rest of the way, so that
/// timers fire on time: a sleep's timeout overshoots by the timer slack (set to 1 ns on hybrid reactors) plus
/// the machine's own wake-up, 70-250 us on the 2-vCPU VM this was measured on (`cargo bench --bench idle`).
/// It costs that much polling per timed wake-up, a few per second at most.
const TIMER_SPIN: Duration = Duration::from_micros(250);

/// Iterations between two refreshes of the CPU time counter.
const CPU_TIME_REFRESH: u64 = 4096;

/// Busy iterations between two refreshes of it as well: a reactor that seals 1 MiB of TLS per iteration
/// runs 4096 iterations in about a second, which left a 2 s measuring window one refresh or none.
const BUSY_CPU_TIME_REFRESH: u64 = 64;

impl Reactor {
    fn run(&mut self) {
        let shared = Arc::clone(&self.ctx.shared);
        let counters = &shared.reactors[self.ctx.index].stats;
        // Hybrid: since when nothing has happened, and whether the reactor just woke from a sleep.
        let mut quiet_since: Option<Instant> = None;
        let mut woke = false;
        while !shared.stop.load(Ordering::Acquire) {
            let mut busy = self.run_messages(self.batch) > 0;
            if busy {
                // A message may have handed a parked poller work through state they share.
                self.unpark_all();
            }
            self.apply_changes();
            let now = self.parking_now();
            if let Some(now) = now {
                self.wake_parked(now);
            }
            for k in 0..self.active.len() {
                let e = &mut self.pollers[self.active[k]];
                if e.poller.poll(&mut self.ctx) == PollStatus::Busy {
                    busy = true;
                    e.idle_polls = 0;
                } else {
                    e.idle_polls = e.idle_polls.saturating_add(1);
                    if e.idle_polls == 1 {
                        e.idle_since = now;
                    }
                }
            }
            self.apply_changes();
            if let Some(deadline) = self.next_deadline {
                let now = Instant::now();
                if now >= deadline {
                    busy |= self.run_timers(now);
                    self.apply_changes();
                }
            }
            self.flush();
            if let Some(now) = now {
                self.park_quiet(now);
                self.count_parked();
            }
            if busy {
                self.busy += 1;
                counters.busy.store(self.busy, Ordering::Relaxed);
                quiet_since = None;
                woke = false;
                self.ctx.woke = false;
            } else {
                self.idle += 1;
                counters.idle.store(self.idle, Ordering::Relaxed);
                if let IdlePolicy::Hybrid { quiet } = self.policy {
                    let now = Instant::now();
                    let since = *quiet_since.get_or_insert(now);
                    // A wake that brought nothing (a deadline with nothing due, a spurious readiness) goes back
                    // to sleep at once; otherwise the reactor sleeps after `quiet` of nothing.
                    if woke || now.duration_since(since) >= quiet {
                        woke = self.sleep(counters);
                        self.ctx.woke = woke;
                        // Refused (a poller cannot say what wakes it): look again after another quiet time.
                        quiet_since = (!woke).then(Instant::now);
                    }
                }
            }
            if (self.busy + self.idle) % CPU_TIME_REFRESH == 0
                || (busy && self.busy % BUSY_CPU_TIME_REFRESH == 0)
            {
                counters
                    .cpu_ns
                    .store(thread_cpu_time().as_nanos() as u64, Ordering::Relaxed);
            }
        }
        // Stopping: run everything that was sent before the ring closed, then flush once more.
        shared.reactors[self.ctx.index].close();
        while self.run_messages(usize::MAX) > 0 {
            self.apply_changes();
        }
        self.apply_changes();
        self.flush();
        counters
            .cpu_ns
            .store(thread_cpu_time().as_nanos() as u64, Ordering::Relaxed);
    }

    /// Sleeps until a wake source fires. Returns `false` without sleeping when a poller cannot say what wakes
    /// it, or when a message or a stop arrived meanwhile.
    fn sleep(&mut self, counters: &Counters) -> bool {
        let shared = Arc::clone(&self.shared);
        let me = &shared.reactors[self.ctx.index];
        // With parking, every poller that can be parked is first (the rest must say what wakes them here):
        // the sleep then watches the parked ones' epoll set as one descriptor.
        if self.parking.is_some() {
            let mut k = 0;
            while k < self.active.len() {
                let i = self.active[k];
                if self.try_park(i) {
                    self.active.swap_remove(k);
                } else {
                    k += 1;
                }
            }
            // A parked poller whose descriptor is ready already makes the epoll set readable: the sleep below
            // ends at once.
            self.count_parked();
        }
        let mut w = WakeSources::new();
        w.readable(&me.wake_fd);
        if let Some(p) = &self.parking {
            if p.parked > 0 {
                w.readable(&p.epoll);
                if let Some(d) = p.next_deadline {
                    w.deadline(d);
                }
            }
        }
        for &i in &self.active {
            if !self.pollers[i].poller.wake_sources(&mut w) {
                return false;
            }
        }
        // Which fds belong to which timer: a timer whose fd fires is due at once.
        let mut timer_fds = Vec::new();
        for (i, timer) in self.timers.iter().enumerate() {
            let first = w.fds.len();
            if timer.poller.wake_sources(&mut w) {
                timer_fds.push((i, first..w.fds.len()));
            } else {
                w.deadline(timer.next);
            }
        }
        // A deadline is met by waking TIMER_SPIN early and polling up to it: closer than that, no sleep.
        let start = Instant::now();
        if w.deadline.is_some_and(|d| d <= start + TIMER_SPIN) {
            return false;
        }
        me.sleeping.store(true, Ordering::Relaxed);
        // Pairs with the fence in `PerReactor::wake` (see there).
        fence(Ordering::SeqCst);
        // The pollers said what wakes them before `sleeping` was set: a change a waker made in between (and
        // whose wake saw `sleeping` still clear) shows here, and the reactor polls again instead.
        if !me.ring.is_empty()
            || shared.stop.load(Ordering::Relaxed)
            || me.kicked.swap(false, Ordering::Relaxed)
        {
            me.sleeping.store(false, Ordering::Relaxed);
            // The kick (or message) is for pollers that may be parked now.
            self.unpark_all();
            return false;
        }
        // Counted as it starts, so that a reactor asleep for good shows it.
        self.sleeps += 1;
        counters.sleeps.store(self.sleeps, Ordering::Relaxed);
        let timeout = w
            .deadline
            .and_then(|d| Timespec::try_from(d - start - TIMER_SPIN).ok());
        let polled = rustix::event::poll(&mut w.fds, timeout.as_ref());
        me.sleeping.store(false, Ordering::Relaxed);
        // Awake: the next iteration polls every active poller and the parked ones whose sources fired; a kick
        // (state that pollers read without a descriptor) wakes the parked ones too.
        let kicked = me.kicked.swap(false, Ordering::Relaxed);
        let now = Instant::now();
        match polled {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => {
                // Nothing the pollers gave can make poll fail but a closed fd (a bug in a poller): keep
                // polling rather than spin on the error.
                log::error!(
                    "reactor on core {}: poll failed ({e}); polling from now on",
                    me.core
                );
                self.policy = IdlePolicy::Poll;
            }
        }
        if !w.fds[0].revents().is_empty() {
            let mut count = [0u8; 8];
            // The eventfd is non-blocking; a wake that raced with this read is in the ring already.
            let _ = rustix::io::read(&me.wake_fd, &mut count);
        }
        let fired: Vec<usize> = timer_fds
            .into_iter()
            .filter(|(_, fds)| w.fds[fds.clone()].iter().any(|f| !f.revents().is_empty()))
            .map(|(i, _)| i)
            .collect();
        drop(w);
        if kicked {
            self.unpark_all();
        }
        for i in fired {
            self.timers[i].next = now;
            self.next_deadline = Some(now);
        }
        self.slept += now - start;
        counters
            .slept_ns
            .store(self.slept.as_nanos() as u64, Ordering::Relaxed);
        true
    }

    /// Runs up to `max` messages; returns how many ran.
    fn run_messages(&mut self, max: usize) -> usize {
        let me = &self.shared.reactors[self.ctx.index];
        // Checked first because `pop` on an empty ring pays for a full fence, on every idle iteration.
        if me.ring.is_empty() {
            return 0;
        }
        let mut ran = 0;
        while ran < max {
            let Some(msg) = me.ring.pop() else { break };
            // Counted before it runs, so that whoever sees its effects sees it counted.
            self.messages += 1;
            me.stats.messages.store(self.messages, Ordering::Relaxed);
            msg(&mut self.ctx);
            ran += 1;
        }
        ran
    }

    /// Polls the timers that are due; returns whether one was busy.
    fn run_timers(&mut self, now: Instant) -> bool {
        let mut busy = false;
        let mut next_deadline = None::<Instant>;
        for timer in &mut self.timers {
            if timer.next <= now {
                busy |= timer.poller.poll(&mut self.ctx) == PollStatus::Busy;
                timer.next += timer.period;
                if timer.next <= now {
                    // Fell behind (a long iteration): skip the missed periods rather than catch up in a burst.
                    timer.next = now + timer.period;
                }
            }
            next_deadline = Some(next_deadline.map_or(timer.next, |d| d.min(timer.next)));
        }
        self.next_deadline = next_deadline;
        busy
    }

    fn flush(&mut self) {
        for k in 0..self.active.len() {
            self.pollers[self.active[k]].poller.flush(&mut self.ctx);
        }
        for timer in &mut self.timers {
            timer.poller.flush(&mut self.ctx);
        }
    }

    /// Applies the registrations and removals the last step asked for.
    fn apply_changes(&mut self) {
        if !self.ctx.wake.is_empty() {
            let wake = std::mem::take(&mut self.ctx.wake);
            for id in &wake {
                if let Some(i) = self.pollers.iter().position(|e| e.id == *id) {
                    self.unpark(i);
                }
            }
            self.ctx.wake = wake;
            self.ctx.wake.clear();
        }
        if self.ctx.added.is_empty() && self.ctx.removed.is_empty() {
            return;
        }
        let now = Instant::now();
        for (id, period, poller) in self.ctx.added.drain(..) {
            match period {
                None => {
                    self.active.push(self.pollers.len());
                    self.pollers.push(Entry {
                        id,
                        poller,
                        parked: false,
                        idle_polls: 0,
                        idle_since: None,
                        deadline: None,
                    });
                }
                Some(period) => {
                    let next = now + period;
                    self.next_deadline = Some(self.next_deadline.map_or(next, |d| d.min(next)));
                    self.timers.push(Timer {
                        id,
                        period,
                        next,
                        poller,
                    });
                }
            }
        }
        if !self.ctx.removed.is_empty() {
            let removed = std::mem::take(&mut self.ctx.removed);
            // Indices move: every poller is active again, and events registered under the old ones are stale.
            self.pollers.retain(|e| !removed.contains(&e.id));
            self.reset_parking();
            self.timers.retain(|t| !removed.contains(&t.id));
            self.next_deadline = self.timers.iter().map(|t| t.next).min();
            self.ctx.removed = removed;
            self.ctx.removed.clear();
        }
        let count = (self.pollers.len() + self.timers.len()) as u64;
        self.ctx.shared.reactors[self.ctx.index]
            .stats
            .pollers
            .store(count, Ordering::Relaxed);
    }

    fn stats(&self) -> ReactorStats {
        self.ctx.shared.reactors[self.ctx.index].stats()
    }

    /// The iteration's time when parking is on (more than [`PARK_MIN`] pollers), starting it if needed.
    fn parking_now(&mut self) -> Option<Instant> {
        if self.pollers.len() <= self.park_min {
            if self.parking.as_ref().is_some_and(|p| p.parked > 0) {
                self.unpark_all();
                self.count_parked();
            }
            return None;
        }
        if self.parking.is_none() {
            match rustix::event::epoll::create(rustix::event::epoll::CreateFlags::CLOEXEC) {
                Ok(epoll) => {
                    self.parking = Some(Parking {
                        epoll,
                        events: Vec::new(),
                        parked: 0,
                        next_deadline: None,
                        epoch: 0,
                        warned: false,
                    })
                }
                Err(e) => {
                    // Never asked again: PARK_MIN is raised out of reach.
                    log::warn!(
                        "reactor on core {}: no epoll set for idle pollers ({e}); every poller is polled on every iteration",
                        self.ctx.core()
                    );
                    self.parking = None;
                    return None;
                }
            }
        }
        Some(Instant::now())
    }

    /// Unparks the pollers whose descriptors are ready (one `epoll_wait`, no waiting), whose deadline passed,
    /// or all of them when a waker kicked the reactor.
    fn wake_parked(&mut self, now: Instant) {
        let Some(p) = self.parking.as_mut() else {
            return;
        };
        if p.parked == 0 {
            return;
        }
        let me = &self.shared.reactors[self.ctx.index];
        if me.kicked.load(Ordering::Relaxed) && me.kicked.swap(false, Ordering::Relaxed) {
            // Something pollers read changed (see ReactorWaker): each looks.
            self.unpark_all();
            return;
        }
        let n = epoll_ready_now(&p.epoll, &mut p.events, p.parked);
        let epoch = p.epoch;
        for k in 0..n {
            let data = self.parking.as_ref().map_or(0, |p| p.events[k].data.u64());
            if (data >> 32) as u32 == epoch {
                self.unpark((data & 0xffff_ffff) as usize);
            }
        }
        let Some(p) = self.parking.as_mut() else {
            return;
        };
        if p.next_deadline.is_some_and(|d| d <= now) {
            let mut next = None::<Instant>;
            for i in 0..self.pollers.len() {
                let e = &self.pollers[i];
                if !e.parked {
                    continue;
                }
                match e.deadline {
                    Some(d) if d <= now => self.unpark(i),
                    Some(d) => next = Some(next.map_or(d, |n| n.min(d))),
                    None => {}
                }
            }
            if let Some(p) = self.parking.as_mut() {
                p.next_deadline = next;
            }
        }
    }

    /// Parks the active pollers that have been idle long enough, if they say what wakes them.
    fn park_quiet(&mut self, now: Instant) {
        let mut k = 0;
        while k < self.active.len() {
            let i = self.active[k];
            let e = &self.pollers[i];
            let quiet = e.idle_polls >= PARK_POLLS
                && e.idle_since
                    .is_some_and(|t| now.duration_since(t) >= PARK_QUIET);
            if quiet && self.try_park(i) {
                self.active.swap_remove(k);
            } else {
                k += 1;
            }
        }
    }

    /// Registers the wake sources of poller `i` in the parking set and marks it parked (the caller takes it
    /// off `active`). Returns `false`, and leaves it active, when it cannot say what wakes it or a descriptor
    /// cannot be registered; it is asked again after another quiet spell.
    fn try_park(&mut self, i: usize) -> bool {
        let Some(p) = self.parking.as_mut() else {
            return false;
        };
        let e = &mut self.pollers[i];
        if e.parked {
            return false;
        }
        let mut w = WakeSources::new();
        if !e.poller.wake_sources(&mut w) {
            e.idle_polls = 0;
            return false;
        }
        let data = rustix::event::epoll::EventData::new_u64((u64::from(p.epoch) << 32) | i as u64);
        for k in 0..w.fds.len() {
            let raw = w.fds[k].as_fd().as_raw_fd();
            if w.fds[..k].iter().any(|f| f.as_fd().as_raw_fd() == raw) {
                continue;
            }
            let mut flags = rustix::event::epoll::EventFlags::empty();
            for j in k..w.fds.len() {
                if w.fds[j].as_fd().as_raw_fd() == raw {
                    if w.interest[j].contains(PollFlags::IN) {
                        flags |= rustix::event::epoll::EventFlags::IN;
                    }
                    if w.interest[j].contains(PollFlags::OUT) {
                        flags |= rustix::event::epoll::EventFlags::OUT;
                    }
                }
            }
            let fd = w.fds[k].as_fd();
            let registered = match rustix::event::epoll::modify(&p.epoll, fd, data, flags) {
                Err(rustix::io::Errno::NOENT) => {
                    rustix::event::epoll::add(&p.epoll, fd, data, flags)
                }
                r => r,
            };
            if let Err(err) = registered {
                if !p.warned {
                    p.warned = true;
                    log::warn!(
                        "reactor on core {}: a poller's descriptor cannot join the epoll set ({err}); it stays polled",
                        self.ctx.core()
                    );
                }
                e.idle_polls = 0;
                return false;
            }
        }
        e.parked = true;
        e.deadline = w.deadline;
        p.parked += 1;
        if let Some(d) = w.deadline {
            p.next_deadline = Some(p.next_deadline.map_or(d, |n| n.min(d)));
        }
        true
    }

    /// Publishes the parked count ([`ReactorStats::parked`]).
    fn count_parked(&self) {
        let n = self.parking.as_ref().map_or(0, |p| p.parked) as u64;
        let c = &self.shared.reactors[self.ctx.index].stats.parked;
        if c.load(Ordering::Relaxed) != n {
            c.store(n, Ordering::Relaxed);
        }
    }

    /// Makes poller `i` active again (polled from the next loop over `active` on).
    fn unpark(&mut self, i: usize) {
        let Some(e) = self.pollers.get_mut(i) else {
            return;
        };
        if !e.parked {
            return;
        }
        e.parked = false;
        e.idle_polls = 0;
        self.active.push(i);
        if let Some(p) = self.parking.as_mut() {
            p.parked -= 1;
        }
    }

    /// Makes every poller active again.
    fn unpark_all(&mut self) {
        if self.parking.as_ref().is_some_and(|p| p.parked > 0) {
            for i in 0..self.pollers.len() {
                self.unpark(i);
            }
        }
        if let Some(p) = self.parking.as_mut() {
            p.next_deadline = None;
        }
    }

    /// After a removal: every poller active, in order, and older registrations stale.
    fn reset_parking(&mut self) {
        for e in &mut self.pollers {
            e.parked = false;
            e.idle_polls = 0;
        }
        self.active = (0..self.pollers.len()).collect();
        if let Some(p) = self.parking.as_mut() {
            p.parked = 0;
            p.next_deadline = None;
            p.epoch = p.epoch.wrapping_add(1);
        }
    }
}

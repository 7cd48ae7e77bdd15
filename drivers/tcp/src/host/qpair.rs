//! [`TcpQueuePair`], an I/O queue pair and its [`nvpoll::api::QueuePair`]: submission, polling, per-command
//! timeouts (Abort, then reset), the recovery after a lost connection (reconnect, then retry or fail by
//! [`Recovery`]), and the path's ANA states as the queue pair sees them.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvpoll::api::{Completion, IoOp, IoRequest, Namespace, QueuePair, QueueStats, Rejected};
use nvpoll::send::SendMode;
use nvpoll::spec::{self, AnaState};

use super::ana::AnaView;
use super::connect::{Background, QueueLink};
use super::options::Recovery;
use super::shared::{CtrlShared, GIVEN_UP};
use crate::queue::{DataDir, Done, HostQueue, Orphan, Parked, EXPIRED};
use crate::Error;

/// Counters of a queue pair's recovery.
///
/// See [`TcpQueuePair`]'s example.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecoveryStats {
    /// Times the queue pair lost its connection.
    pub losses: u64,
    /// Times it reconnected.
    pub reconnects: u64,
    /// Commands submitted again after a reconnect.
    pub retried: u64,
    /// Commands failed by the recovery (fail-fast, timeouts, or the controller given up).
    pub failed: u64,
    /// Commands that timed out (an Abort was requested for each).
    pub timeouts: u64,
    /// The transport counters of connections that are gone (commands, PDUs, writes, reads, records,
    /// flushes, key updates); the live connection counts its own, and [`QueuePair::stats`] adds the two.
    pub past: QueueStats,
}

/// A live connection's transport counters, as [`QueueStats`] names them.
fn conn_counters(q: &HostQueue) -> QueueStats {
    let c = q.conn_stats();
    QueueStats {
        commands: q.commands(),
        pdus: c.pdus_tx,
        writes: c.writes,
        reads: c.reads,
        records: c.records,
        record_bytes: c.record_bytes,
        flushes: c.flushes,
        key_updates_sent: c.key_updates_sent,
        key_updates_received: c.key_updates_received,
        ..QueueStats::default()
    }
}

/// A queue pair's connection, or what it keeps while it has none.
// The connected queue is the hot path and stays inline (no pointer to chase per I/O), as the
// `Option<HostQueue>` before it did; the small variant costs only its unused bytes.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum QueueState {
    /// Connected: the queue holds the finished commands.
    Connected(HostQueue),
    /// Reconnecting: the finished commands not yet taken, and the commands waiting for the next connection
    /// (accepted, not completed).
    Reconnecting(Parked),
}

/// An NVMe/TCP I/O queue pair. It survives connection loss: see [`Recovery`].
///
/// # Examples
///
/// Against our target (started in the hidden lines): a queue pair's own accessors beside the
/// [`QueuePair`](nvpoll::api::QueuePair) methods (those are in [`TcpController`](super::TcpController)'s
/// example).
///
/// ```
/// # mod target { include!("../doctest/target.rs"); }
/// use nvpoll::api::{Controller, IoOp, IoRequest, QueuePair};
/// use nvpoll::mem::DmaPool;
/// use nvpoll::spec::{AnaState, Status};
/// use nvpoll_tcp::host::{ConnectOptions, TcpController};
///
/// # let t = target::start()?;
/// let pool = DmaPool::builder().class(4096, 16).build()?;
/// let mut ctrl = TcpController::connect(ConnectOptions::new(t.addr, target::SUBNQN, target::HOSTNQN), pool)?;
/// let mut qp = ctrl.create_queue_pair(16)?;
/// assert!(qp.is_connected());
/// assert!(qp.qid() >= 1, "I/O queues are numbered from 1");
/// assert_eq!(qp.ana_state(1), AnaState::Optimized, "no ANA reporting: every namespace optimized");
/// println!("{:?} before a lost path's commands may run elsewhere", qp.quiesce_time());
///
/// qp.submit(IoRequest { op: IoOp::Flush, nsid: 1, lba: 0, blocks: 0, buf: None, tag: 0 }).map_err(|r| r.error)?;
/// qp.flush()?;
/// while qp.outstanding() > 0 {
///     qp.process_completions(16, |_, c| assert!(c.result.is_ok()))?;
/// }
/// assert!(qp.conn_stats().pdus_tx >= 1);
/// assert_eq!(qp.recovery_stats().losses, 0);
/// assert_eq!(qp.stats().commands, 2, "the queue's Fabrics Connect, then the Flush");
///
/// // A path status seen on a command (here made up) changes the path's state at once for every queue pair.
/// qp.note_path_status(1, Status::TRANSIENT_TRANSPORT_ERROR);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct TcpQueuePair {
    state: QueueState,
    link: QueueLink,
    shared: Arc<CtrlShared>,
    /// The controller generation the connection belongs to.
    gen: u64,
    namespaces: Vec<Namespace>,
    mode: SendMode,
    next_attempt: Instant,
    next_timeout_check: Instant,
    recovery: RecoveryStats,
    /// A reconnect running on its own thread, for the controller generation given, if any.
    connecting: Option<(Background<HostQueue>, u64)>,
    /// The path's ANA states as this queue pair saw them last, and their generation.
    ana: AnaView,
    ana_gen: u64,
}

/// How often outstanding commands are checked against the command timeout.
const TIMEOUT_CHECK_PERIOD: Duration = Duration::from_millis(100);

impl TcpQueuePair {
    pub(super) fn new(
        q: HostQueue,
        link: QueueLink,
        shared: Arc<CtrlShared>,
        gen: u64,
        namespaces: Vec<Namespace>,
    ) -> Self {
        TcpQueuePair {
            state: QueueState::Connected(q),
            link,
            shared,
            gen,
            namespaces,
            mode: SendMode::default(),
            next_attempt: Instant::now(),
            next_timeout_check: Instant::now() + TIMEOUT_CHECK_PERIOD,
            recovery: RecoveryStats::default(),
            connecting: None,
            ana: AnaView::default(),
            ana_gen: u64::MAX,
        }
    }

    /// The ANA state of namespace `nsid` on this queue pair's path, as of its last poll (optimized for a
    /// controller that reports no ANA).
    /// See [`TcpQueuePair`]'s example.
    pub fn ana_state(&self, nsid: u32) -> AnaState {
        if self.ana_gen == u64::MAX {
            return self.shared_ana().state_of(nsid);
        }
        self.ana.state_of(nsid)
    }

    fn shared_ana(&self) -> AnaView {
        self.shared.ana.snapshot()
    }

    /// Takes the path's ANA states if they changed (one atomic load when they did not).
    fn refresh_ana(&mut self) {
        let gen = self.shared.ana.gen.load(Ordering::Acquire);
        if gen != self.ana_gen {
            self.ana = self.shared_ana();
            self.ana_gen = gen;
        }
    }

    /// A command on namespace `nsid` failed with `status`, a path status: if it names an ANA state (the
    /// group is inaccessible, lost or changing on this path), every queue pair of the controller takes that
    /// state at once, and the controller reads the ANA log again at its next admin poll.
    /// See [`TcpQueuePair`]'s example.
    pub fn note_path_status(&mut self, nsid: u32, status: spec::Status) {
        let state = if status.sct() != spec::sct::PATH {
            return;
        } else if status.sc() == spec::Status::ANA_INACCESSIBLE.sc() {
            AnaState::Inaccessible
        } else if status.sc() == spec::Status::ANA_PERSISTENT_LOSS.sc() {
            AnaState::PersistentLoss
        } else if status.sc() == spec::Status::ANA_TRANSITION.sc() {
            AnaState::Change
        } else {
            return;
        };
        self.shared.ana.note(nsid, state);
        self.refresh_ana();
    }

    /// How long after this path was lost its controller may still run what it had: the keep-alive timeout
    /// (the target tears a silent controller down after it) plus the Command Quiesce Time it reports. A
    /// command whose fate the loss left unknown may run elsewhere only after that, or a late copy of it could
    /// overwrite newer data (spdk#3593).
    /// See [`TcpQueuePair`]'s example.
    pub fn quiesce_time(&self) -> Duration {
        self.link.opts.kato + self.link.cqt
    }

    /// The live connection, if any.
    fn live(&self) -> Option<&HostQueue> {
        match &self.state {
            QueueState::Connected(q) => Some(q),
            QueueState::Reconnecting(_) => None,
        }
    }

    /// Finished commands not yet taken.
    fn done_len(&self) -> usize {
        match &self.state {
            QueueState::Connected(q) => q.done_len(),
            QueueState::Reconnecting(p) => p.done.len(),
        }
    }

    /// Counters of this queue's current connection (zero while reconnecting).
    /// See [`TcpQueuePair`]'s example.
    pub fn conn_stats(&self) -> crate::conn::ConnStats {
        self.live().map(HostQueue::conn_stats).unwrap_or_default()
    }

    /// Counters of the recovery: losses, reconnects, retried and failed commands, timeouts.
    /// See [`TcpQueuePair`]'s example.
    pub fn recovery_stats(&self) -> RecoveryStats {
        RecoveryStats {
            failed: self.recovery.failed + self.live().map_or(0, HostQueue::commands_failed),
            ..self.recovery
        }
    }

    /// Whether the queue pair has a live connection.
    /// See [`TcpQueuePair`]'s example.
    pub fn is_connected(&self) -> bool {
        self.live().is_some_and(|q| q.failure().is_none())
    }

    /// Queue ID.
    /// See [`TcpQueuePair`]'s example.
    pub fn qid(&self) -> u16 {
        self.link.qid
    }

    /// The connection failed: keep (or fail) its outstanding commands, drop it, and ask the controller to
    /// reconnect.
    fn lose_connection(&mut self) {
        if let Some(cause) = self.live().and_then(HostQueue::failure) {
            self.shared.note_loss(cause, &self.link.opts);
        }
        self.drop_connection();
        self.shared.reset_requested.store(true, Ordering::Release);
    }

    /// Keeps (or fails) the outstanding commands of the connection and drops it. What completed before the
    /// failure (and, fail-fast, the failed commands) is handed out as usual.
    fn drop_connection(&mut self) {
        let state = std::mem::replace(&mut self.state, QueueState::Reconnecting(Parked::default()));
        self.state = match state {
            QueueState::Connected(q) => {
                self.recovery.failed += q.commands_failed();
                self.recovery.losses += 1;
                self.recovery.past = self.recovery.past.plus(&conn_counters(&q));
                self.next_attempt = Instant::now();
                QueueState::Reconnecting(q.park())
            }
            down => down,
        };
    }

    /// Fails everything waiting for a connection with `cause` (the controller was given up).
    fn fail_waiting(&mut self, cause: Error) {
        let QueueState::Reconnecting(p) = &mut self.state else {
            return;
        };
        let cause = Arc::new(cause);
        while let Some(o) = p.orphans.pop_front() {
            self.recovery.failed += 1;
            p.done.push_back(Done {
                tag: o.tag,
                buf: o.buf,
                result: Err(Error::QueueFailed {
                    qid: self.link.qid,
                    cause: Arc::clone(&cause),
                }),
            });
        }
    }

    /// While disconnected: reconnect once the controller has, then submit the waiting commands again.
    fn try_reconnect(&mut self) -> Result<(), Error> {
        if self.shared.dead.load(Ordering::Acquire) {
            self.fail_waiting(GIVEN_UP);
            return Err(GIVEN_UP);
        }
        let gen = self.shared.generation.load(Ordering::Acquire);
        let result = match &self.connecting {
            None => {
                if gen == self.gen || Instant::now() < self.next_attempt {
                    return Ok(());
                }
                // The connect waits on the network: on a thread of its own, never on the reactor.
                let mut link = self.link.clone();
                link.opts.tls_key_renewal = self.shared.key_renewal(link.opts.tls_key_renewal);
                let cntlid = self.shared.cntlid.load(Ordering::Acquire);
                match Background::spawn(move || link.connect(cntlid)) {
                    Ok(b) => {
                        self.connecting = Some((b, gen));
                        return Ok(());
                    }
                    Err(e) => Err(e),
                }
            }
            Some((b, for_gen)) => match b.poll() {
                None => return Ok(()),
                // Connected to an incarnation of the controller that is gone by now: try again.
                Some(Ok(_)) if *for_gen != gen => {
                    Err(Error::Lost("the controller reconnected meanwhile"))
                }
                Some(r) => r,
            },
        };
        self.connecting = None;
        match result {
            Ok(mut q) => {
                q.set_send_mode(self.mode);
                let state = std::mem::replace(&mut self.state, QueueState::Connected(q));
                if let (QueueState::Reconnecting(parked), QueueState::Connected(q)) =
                    (state, &mut self.state)
                {
                    // The slot count equals the depth, and no more than that many were waiting.
                    self.recovery.retried += q.resume(parked);
                }
                self.gen = gen;
                self.recovery.reconnects += 1;
                Ok(())
            }
            Err(_) => {
                // The controller may have been lost again; wait for its next generation or a short back-off.
                self.next_attempt = Instant::now() + self.link.opts.reconnect_delay / 4;
                Ok(())
            }
        }
    }

    /// Per-command timeouts: ask for an Abort once, give up on the command (and reset the connection) when
    /// the Abort did not complete it either.
    fn check_timeouts(&mut self, now: Instant) {
        if now < self.next_timeout_check {
            return;
        }
        self.next_timeout_check = now + TIMEOUT_CHECK_PERIOD;
        let QueueState::Connected(q) = &mut self.state else {
            return;
        };
        let (timeout, grace) = (self.link.opts.io_timeout, self.link.opts.io_timeout / 2);
        let (shared, qid, stats) = (&self.shared, self.link.qid, &mut self.recovery);
        let expired = q.check_timeouts(timeout, grace, &mut |cid| {
            stats.timeouts += 1;
            // A full abort ring only delays the abort: the command still expires after the grace period.
            let _ = shared.aborts.push((qid, cid));
        });
        if let Some(cid) = expired {
            q.expire(cid);
            q.fail(EXPIRED);
            self.lose_connection();
        } else if q.renew_keys_if_due(now).is_err() {
            self.lose_connection();
        }
    }
}

fn to_completion(d: Done) -> Completion {
    Completion::from_result(d.tag, d.buf, d.result.map_err(nvpoll::Error::from))
}

fn reject(error: impl Into<nvpoll::Error>, request: IoRequest) -> Rejected {
    Rejected {
        error: error.into(),
        request,
    }
}

impl QueuePair for TcpQueuePair {
    fn submit(&mut self, mut req: IoRequest) -> Result<(), Rejected> {
        let checked =
            match nvpoll::api::check_request(&mut req, &self.namespaces, self.link.max_transfer) {
                Ok(c) => c,
                Err(e) => return Err(reject(e, req)),
            };
        let (sqe, len) = (checked.sqe, checked.len);
        let dir = match req.op {
            IoOp::Read => DataDir::FromController,
            IoOp::Write | IoOp::Deallocate => DataDir::ToController,
            _ => DataDir::None,
        };
        let q = match &mut self.state {
            QueueState::Connected(q) => q,
            QueueState::Reconnecting(parked) => {
                if self.shared.dead.load(Ordering::Acquire) {
                    return Err(reject(GIVEN_UP, req));
                }
                if self.link.opts.recovery == Recovery::FailFast {
                    return Err(reject(
                        nvpoll::Error::ConnectionLost("the queue is reconnecting".into()),
                        req,
                    ));
                }
                if parked.orphans.len() >= usize::from(self.link.depth) {
                    return Err(reject(nvpoll::Error::QueueFull, req));
                }
                parked.orphans.push_back(Orphan {
                    sqe,
                    dir,
                    buf: req.buf.take(),
                    len,
                    tag: req.tag,
                });
                return Ok(());
            }
        };
        let buf = req.buf.take();
        match q.submit(sqe, dir, buf, len, req.tag) {
            Ok(()) => {
                if q.failure().is_some() {
                    // An inline kick found the connection dead: the command is kept (or failed) by the policy.
                    self.lose_connection();
                }
                Ok(())
            }
            Err((e, buf)) => {
                req.buf = buf;
                Err(reject(e, req))
            }
        }
    }

    fn flush(&mut self) -> nvpoll::Result<()> {
        if let QueueState::Connected(q) = &mut self.state {
            if q.flush().is_err() {
                self.lose_connection();
            }
        }
        Ok(())
    }

    fn poll(&mut self, max: usize) -> nvpoll::Result<usize> {
        self.poll_at(max, Instant::now())
    }

    fn poll_at(&mut self, max: usize, now: Instant) -> nvpoll::Result<usize> {
        let before = self.done_len();
        self.refresh_ana();
        self.check_timeouts(now);
        if let QueueState::Connected(q) = &mut self.state {
            if self.shared.generation.load(Ordering::Acquire) != self.gen {
                // The controller reconnected (its old incarnation, and so this connection, is gone on the
                // target): move to the new one now instead of waiting for the old connection to fail.
                q.fail(Error::Lost("the controller reconnected"));
                self.drop_connection();
            } else if self.shared.admin_lost.load(Ordering::Acquire) {
                // The controller is lost (its admin connection failed, or keep-alive went unanswered): this
                // connection goes with it, now.
                q.fail(Error::Lost("the controller's admin connection went down"));
                self.drop_connection();
            }
        }
        match &mut self.state {
            QueueState::Connected(q) => {
                if q.poll_max_at(max, now).is_err() {
                    self.lose_connection();
                }
            }
            QueueState::Reconnecting(_) => self.try_reconnect()?,
        }
        Ok(self.done_len().saturating_sub(before))
    }

    fn pop_completion(&mut self) -> Option<Completion> {
        let d = match &mut self.state {
            QueueState::Connected(q) => q.pop_done(),
            QueueState::Reconnecting(p) => p.done.pop_front(),
        };
        d.map(to_completion)
    }

    fn outstanding(&self) -> usize {
        match &self.state {
            QueueState::Connected(q) => q.outstanding() + q.orphans_len(),
            QueueState::Reconnecting(p) => p.orphans.len(),
        }
    }

    fn depth(&self) -> usize {
        usize::from(self.link.depth)
    }

    /// The connection's socket, and the next timeout check while commands are outstanding. Reconnecting, the
    /// queue polls: the controller's reconnect (on another thread) announces itself through no descriptor.
    fn wake_sources<'a>(&'a self, w: &mut nvpoll::reactor::WakeSources<'a>) -> bool {
        match &self.state {
            QueueState::Connected(q) => {
                if !q.wake_sources(w) {
                    return false;
                }
                if q.outstanding() > 0 {
                    w.deadline(self.next_timeout_check);
                }
                true
            }
            QueueState::Reconnecting(_) => false,
        }
    }

    fn set_send_mode(&mut self, mode: SendMode) -> nvpoll::Result<()> {
        self.mode = mode;
        if let QueueState::Connected(q) = &mut self.state {
            q.set_send_mode(mode);
        }
        Ok(())
    }

    /// Over the queue pair's life: the connections that are gone and the live one, added (so that a reconnect,
    /// planned or not, does not make the counters start again).
    fn stats(&self) -> QueueStats {
        let c = match self.live() {
            Some(q) => self.recovery.past.plus(&conn_counters(q)),
            None => self.recovery.past,
        };
        QueueStats {
            retried: self.recovery.retried,
            reconnects: self.recovery.reconnects,
            ..c
        }
    }
}

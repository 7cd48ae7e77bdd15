//! Multipath: one subsystem's namespaces over several paths (one controller per path), chosen by ANA state,
//! with failover that never lets a command run twice out of order.
//!
//! A [`MultipathController`] attaches the same subsystem through several transport addresses (listeners of one
//! target, or two target processes that export it) and checks that every path shows the same namespaces. Its
//! [`MultipathQueuePair`] holds one [`TcpQueuePair`] per path and sends each request down one of them:
//!
//! - **Path selection** ([`PathPolicy`]): only a connected path whose ANA state for the namespace's group is
//!   accessible is used; optimized paths come before non-optimized ones; among paths of the same state, the
//!   one with the fewest commands outstanding (the default), or round robin.
//! - **A path status** (the controller answered: ANA inaccessible, persistent loss or transition, or another
//!   path-related or transient transport status) means the command did not run: it is sent again at once on
//!   another path, and the path's ANA state for that group is updated on every queue pair of its controller
//!   (which also reads the ANA log again).
//! - **A lost connection or a timeout** leaves the command's fate unknown: the target may still run it. It is
//!   held for the path's quiesce time ([`TcpQueuePair::quiesce_time`]: KATO plus the Command Quiesce Time the
//!   controller reports, NVMe 2.1) from the moment the loss was seen, then sent on a live path. Sending it
//!   earlier could let a late copy of an old write land after a newer one (spdk#3593; the Linux host had the
//!   same hole).
//! - **Failback** is by ANA state and connection: a path that reconnects (its controller does so on its own,
//!   on threads of its own) or whose group turns optimized again takes I/O on the next submission.
//! - A command that found no usable path for `ctrl_loss_tmo` since its first failure fails with the last
//!   error. Commands fail only for what no path can change: a non-path NVMe status, or a bad request.
//!
//! Nothing here blocks: path queue pairs reconnect on threads of their own, and the held commands are
//! timestamps checked at each poll.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use nvpoll::api::{
    check_request, Completion, Controller, ControllerInfo, IoOp, IoRequest, Namespace, QueuePair,
    QueueStats, Rejected,
};
use nvpoll::mem::{DmaBuf, DmaPool};
use nvpoll::send::SendMode;
use nvpoll::spec::{AnaState, Cqe, Sqe};

use crate::host::{ConnectOptions, Recovery, TcpController, TcpQueuePair};
use crate::Error;

/// How a multipath queue pair chooses among paths of the same ANA state.
///
/// # Examples
///
/// ```
/// use nvpoll_tcp::multipath::{PathPolicy, UnknownPathPolicy};
///
/// assert_eq!(PathPolicy::default(), PathPolicy::QueueDepth);
/// let p: PathPolicy = "round-robin".parse()?;
/// assert_eq!((p.name(), p.to_string()), ("round-robin", "round-robin".to_string()));
/// assert_eq!("fastest".parse::<PathPolicy>(), Err(UnknownPathPolicy("fastest".into())));
/// # Ok::<(), UnknownPathPolicy>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PathPolicy {
    /// Each request to the next usable path in turn. A slow path collects the commands (the fast one
    /// returns its share sooner, and half of every resubmission goes to the slow one), and with it whatever
    /// a loss there holds for the quiesce time.
    RoundRobin,
    /// Each request to the usable path with the fewest commands outstanding (ties: the first). The default:
    /// it follows each path's speed, so a slow or dying path holds few commands.
    #[default]
    QueueDepth,
}

impl PathPolicy {
    /// Its name on the command line. See [`PathPolicy`]'s example.
    pub fn name(self) -> &'static str {
        match self {
            PathPolicy::RoundRobin => "round-robin",
            PathPolicy::QueueDepth => "queue-depth",
        }
    }
}

impl std::fmt::Display for PathPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A name that is neither path policy ([`PathPolicy`]'s `FromStr`). See [`PathPolicy`]'s example.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("path policy '{0}': must be round-robin or queue-depth")]
pub struct UnknownPathPolicy(pub String);

impl std::str::FromStr for PathPolicy {
    type Err = UnknownPathPolicy;

    fn from_str(s: &str) -> Result<PathPolicy, UnknownPathPolicy> {
        match s {
            "round-robin" => Ok(PathPolicy::RoundRobin),
            "queue-depth" => Ok(PathPolicy::QueueDepth),
            other => Err(UnknownPathPolicy(other.to_string())),
        }
    }
}

/// One subsystem attached through several paths.
///
/// # Examples
///
/// Two paths to one subsystem (our target, started in the hidden lines, listening on 127.0.0.1 and
/// 127.0.0.2), and a queue pair over both:
///
/// ```
/// # mod target { include!("doctest/target.rs"); }
/// use nvpoll::api::{Controller, IoOp, IoRequest, QueuePair};
/// use nvpoll::mem::DmaPool;
/// use nvpoll_tcp::host::ConnectOptions;
/// use nvpoll_tcp::multipath::{MultipathController, PathPolicy};
///
/// # let second = "127.0.0.2:0".parse()?;
/// # let t = target::start_with(|c| c.listener(second, nvpoll_target::TlsMode::Off))?;
/// let pool = DmaPool::builder().class(4096, 64).build()?;
/// let paths = t.addrs.iter().map(|&a| ConnectOptions::new(a, target::SUBNQN, target::HOSTNQN)).collect();
/// let mut ctrl = MultipathController::connect(paths, pool.clone(), PathPolicy::RoundRobin)?;
/// assert_eq!(ctrl.paths().len(), 2);
/// assert_eq!(ctrl.policy(), PathPolicy::RoundRobin);
///
/// let mut qp = ctrl.connect_io_queue(16)?; // as Controller::create_queue_pair
/// assert_eq!(qp.paths().len(), 2);
/// assert!(qp.choose(1).is_some(), "a usable path for namespace 1");
/// for tag in 0..8 {
///     let req = IoRequest { op: IoOp::Read, nsid: 1, lba: tag, blocks: 1, buf: Some(pool.alloc(512)?), tag };
///     qp.submit(req).map_err(|r| r.error)?;
/// }
/// qp.flush()?;
/// while qp.outstanding() > 0 {
///     qp.process_completions(16, |_, c| assert!(c.result.is_ok(), "{:?}", c.result))?;
///     ctrl.poll_admin()?;
/// }
/// let stats = qp.multipath_stats();
/// assert_eq!((stats.submitted, stats.ok), (8, 8));
/// assert_eq!(stats.per_path, [4, 4], "round robin: half each");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct MultipathController {
    paths: Vec<TcpController>,
    info: ControllerInfo,
    policy: PathPolicy,
}

impl MultipathController {
    /// Attaches the subsystem through each of `paths` (the same subsystem NQN on each). Every path must
    /// attach and show the same namespaces (ID, block size, size). Each path's queue pairs fail their
    /// commands fast when their connection drops ([`Recovery::FailFast`]): the multipath queue pair decides
    /// where they go next. See [`MultipathController`]'s example.
    pub fn connect(
        paths: Vec<ConnectOptions>,
        pool: DmaPool,
        policy: PathPolicy,
    ) -> Result<MultipathController, Error> {
        let Some(first) = paths.first() else {
            return Err(Error::InvalidArgument(
                "multipath needs at least one path".into(),
            ));
        };
        let subnqn = first.subnqn.clone();
        let mut ctrls: Vec<TcpController> = Vec::with_capacity(paths.len());
        for mut opts in paths {
            if opts.subnqn != subnqn {
                return Err(Error::InvalidArgument(format!(
                    "path {} is to subsystem {}, not {subnqn}",
                    opts.addr, opts.subnqn
                )));
            }
            if ctrls.iter().any(|c| c.options().addr == opts.addr) {
                return Err(Error::InvalidArgument(format!(
                    "path {} is given twice",
                    opts.addr
                )));
            }
            opts.recovery = Recovery::FailFast;
            let addr = opts.addr;
            let c = TcpController::connect(opts, pool.clone()).map_err(|e| Error::PathAttach {
                addr,
                subnqn: subnqn.clone(),
                cause: Box::new(e),
            })?;
            if let Some(prev) = ctrls.first() {
                if prev.namespaces() != c.namespaces() {
                    return Err(Error::Protocol(format!(
                        "path {addr} shows other namespaces than path {}: {:?} against {:?}",
                        prev.options().addr,
                        c.namespaces(),
                        prev.namespaces()
                    )));
                }
            }
            ctrls.push(c);
        }
        let mut info = ctrls[0].info().clone();
        info.max_transfer = ctrls
            .iter()
            .map(|c| c.info().max_transfer)
            .min()
            .unwrap_or(info.max_transfer);
        Ok(MultipathController {
            paths: ctrls,
            info,
            policy,
        })
    }

    /// The paths' controllers, in the order given. See [`MultipathController`]'s example.
    pub fn paths(&self) -> &[TcpController] {
        &self.paths
    }

    /// The path policy of its queue pairs. See [`MultipathController`]'s example.
    pub fn policy(&self) -> PathPolicy {
        self.policy
    }

    /// Connects one I/O queue pair of `depth` on every path and joins them. See [`MultipathController`]'s
    /// example.
    pub fn connect_io_queue(&mut self, depth: u16) -> Result<MultipathQueuePair, Error> {
        let mut qps = Vec::with_capacity(self.paths.len());
        for c in &mut self.paths {
            qps.push(c.connect_io_queue(depth)?);
        }
        let give_up = self
            .paths
            .iter()
            .map(|c| c.options().ctrl_loss_tmo)
            .max()
            .unwrap_or_default();
        Ok(MultipathQueuePair::new(
            qps,
            self.policy,
            self.info.namespaces.clone(),
            self.info.max_transfer,
            usize::from(depth),
            give_up,
        ))
    }
}

impl Controller for MultipathController {
    type QueuePair = MultipathQueuePair;

    fn info(&self) -> &ControllerInfo {
        &self.info
    }

    /// Runs the admin command on the first path whose admin connection is up.
    fn admin(&mut self, cmd: Sqe, buf: Option<DmaBuf>) -> nvpoll::Result<(Cqe, Option<DmaBuf>)> {
        match self.paths.iter_mut().find(|c| c.is_live()) {
            Some(c) => c.admin(cmd, buf),
            None => Err(nvpoll::Error::ConnectionLost(
                "no path's admin connection is up".into(),
            )),
        }
    }

    /// The fewest any path granted: a queue pair has one queue on every path.
    fn io_queues_granted(&self) -> Option<u16> {
        self.paths.iter().map(|c| c.io_queues_allowed()).min()
    }

    fn create_queue_pair(&mut self, depth: u16) -> nvpoll::Result<MultipathQueuePair> {
        Ok(self.connect_io_queue(depth)?)
    }

    /// Services every path's admin queue (keep-alive, ANA log, reconnects). An error only once every path is
    /// given up.
    fn poll_admin(&mut self) -> nvpoll::Result<()> {
        let mut last = None;
        let mut alive = 0;
        for c in &mut self.paths {
            match c.poll_admin() {
                Ok(()) => alive += 1,
                Err(e) => last = Some(e),
            }
        }
        match last {
            Some(e) if alive == 0 => Err(e.into()),
            _ => Ok(()),
        }
    }

    /// Shuts every path down; the first error is returned after all were tried.
    fn shutdown(self) -> nvpoll::Result<()> {
        let mut first = None;
        for c in self.paths {
            if let Err(e) = c.shutdown() {
                first.get_or_insert(e);
            }
        }
        match first {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }
}

/// Counters of a multipath queue pair, cumulative. See [`MultipathController`]'s example.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MultipathStats {
    /// Requests accepted.
    pub submitted: u64,
    /// Requests handed back successful.
    pub ok: u64,
    /// Requests handed back failed.
    pub failed: u64,
    /// Sends of a request after its first (on another path, or the same path after it came back).
    pub retried: u64,
    /// Completions with a path status (the command did not run; sent again at once).
    pub path_errors: u64,
    /// Requests whose path was lost under them (held for the quiesce time, then sent again).
    pub held: u64,
    /// Commands sent down each path, in path order.
    pub per_path: Vec<u64>,
    /// The longest a request waited between the failure that made it change paths and its send on the
    /// next path (the quiesce time after a lost connection; ~0 after a path status).
    pub longest_failover: Duration,
}

#[derive(Debug)]
struct Request {
    op: IoOp,
    nsid: u32,
    lba: u64,
    blocks: u32,
    tag: u64,
    /// The buffer, while the request is not on a path.
    buf: Option<DmaBuf>,
    /// Sends so far.
    sends: u32,
    /// When it first failed (the give-up clock), and when its last failure was seen.
    first_failure: Option<Instant>,
    last_failure: Option<Instant>,
    /// The error of its last failure, for when it is given up.
    last_error: Option<nvpoll::Error>,
}

/// A queue pair over every path of a [`MultipathController`]; see the module documentation, and
/// [`MultipathController`]'s example.
#[derive(Debug)]
pub struct MultipathQueuePair {
    paths: Vec<TcpQueuePair>,
    policy: PathPolicy,
    /// Round-robin cursor.
    next: usize,
    /// Requests by our tag (the index); `None` is free.
    reqs: Vec<Option<Request>>,
    free: Vec<u32>,
    /// Accepted and not on a path: to be sent as soon as a path is usable.
    ready: VecDeque<u32>,
    /// Their path was lost under them: sent again once the instant passes.
    held: VecDeque<(u32, Instant)>,
    done: VecDeque<Completion>,
    namespaces: Vec<Namespace>,
    max_transfer: u32,
    depth: usize,
    give_up: Duration,
    stats: MultipathStats,
}

impl MultipathQueuePair {
    fn new(
        paths: Vec<TcpQueuePair>,
        policy: PathPolicy,
        namespaces: Vec<Namespace>,
        max_transfer: u32,
        depth: usize,
        give_up: Duration,
    ) -> MultipathQueuePair {
        let n = paths.len();
        MultipathQueuePair {
            paths,
            policy,
            next: 0,
            reqs: (0..depth).map(|_| None).collect(),
            free: (0..depth as u32).rev().collect(),
            ready: VecDeque::with_capacity(depth),
            held: VecDeque::with_capacity(depth),
            done: VecDeque::with_capacity(depth),
            namespaces,
            max_transfer,
            depth,
            give_up,
            stats: MultipathStats {
                per_path: vec![0; n],
                ..MultipathStats::default()
            },
        }
    }

    /// Its counters. See [`MultipathController`]'s example.
    pub fn multipath_stats(&self) -> MultipathStats {
        self.stats.clone()
    }

    /// The path queue pairs, in path order. See [`MultipathController`]'s example.
    pub fn paths(&self) -> &[TcpQueuePair] {
        &self.paths
    }

    /// The path a request to `nsid` would take now, if any is usable. One pass over the paths, no allocation:
    /// this runs for every request. See [`MultipathController`]'s example.
    pub fn choose(&mut self, nsid: u32) -> Option<usize> {
        let n = self.paths.len();
        // (rank, tie-break key, path): the lowest wins. Rank 0 optimized, 1 non-optimized; the key is the
        // distance from the round-robin cursor, or the commands outstanding.
        let mut best: Option<(u8, usize, usize)> = None;
        for k in 0..n {
            let i = match self.policy {
                PathPolicy::RoundRobin => (self.next + k) % n,
                PathPolicy::QueueDepth => k,
            };
            let p = &self.paths[i];
            if !p.is_connected() {
                continue;
            }
            let rank = match p.ana_state(nsid) {
                AnaState::Optimized => 0,
                AnaState::NonOptimized => 1,
                _ => continue,
            };
            let key = match self.policy {
                PathPolicy::RoundRobin => k,
                PathPolicy::QueueDepth => p.outstanding(),
            };
            if best.is_none_or(|(r, kk, _)| (rank, key) < (r, kk)) {
                best = Some((rank, key, i));
            }
        }
        let (_, _, pick) = best?;
        self.next = (pick + 1) % n;
        Some(pick)
    }

    /// Sends request `idx` down a usable path; `false` (it stays with us) when none takes it.
    fn dispatch(&mut self, idx: u32) -> bool {
        let r = self.reqs[idx as usize].as_mut().expect("a live request");
        let nsid = r.nsid;
        // A path that refuses (it just lost its connection) is skipped for this request.
        for _ in 0..self.paths.len() {
            let Some(p) = self.choose(nsid) else {
                return false;
            };
            let r = self.reqs[idx as usize].as_mut().expect("a live request");
            let req = IoRequest {
                op: r.op,
                nsid: r.nsid,
                lba: r.lba,
                blocks: r.blocks,
                buf: r.buf.take(),
                tag: u64::from(idx),
            };
            match self.paths[p].submit(req) {
                Ok(()) => {
                    let r = self.reqs[idx as usize].as_mut().expect("a live request");
                    if r.sends > 0 {
                        self.stats.retried += 1;
                        if let Some(t) = r.last_failure {
                            self.stats.longest_failover =
                                self.stats.longest_failover.max(t.elapsed());
                        }
                    }
                    r.sends += 1;
                    self.stats.per_path[p] += 1;
                    return true;
                }
                Err(rej) => {
                    let r = self.reqs[idx as usize].as_mut().expect("a live request");
                    r.buf = rej.request.buf;
                    if !matches!(rej.error, nvpoll::Error::ConnectionLost(_)) {
                        // Not a path problem (the request was checked, and no path holds more than we
                        // accept): keep it for the next poll.
                        return false;
                    }
                }
            }
        }
        false
    }

    /// Hands request `idx` back.
    fn finish(&mut self, idx: u32, result: Result<(), nvpoll::Error>) {
        let r = self.reqs[idx as usize].take().expect("a live request");
        if result.is_ok() {
            self.stats.ok += 1;
        } else {
            self.stats.failed += 1;
        }
        self.free.push(idx);
        self.done.push_back(Completion {
            tag: r.tag,
            buf: r.buf,
            result,
        });
    }

    /// A completion from path `p`.
    fn on_completion(&mut self, p: usize, c: Completion) {
        let Ok(idx) = u32::try_from(c.tag) else {
            return;
        };
        let Some(r) = self.reqs.get_mut(idx as usize).and_then(Option::as_mut) else {
            return;
        };
        r.buf = c.buf;
        let err = match c.result {
            Ok(()) => return self.finish(idx, Ok(())),
            Err(e) => e,
        };
        let now = Instant::now();
        // What the error says to do (nvpoll::Error::retry): only `Elsewhere` is a multipath matter; a status
        // the controller may take again later, a full queue or a failure that repeats goes to the caller.
        let retry_at = match (&err, err.retry()) {
            // The controller answered a path-related status: the command did not run. Another path may take
            // it now.
            (nvpoll::Error::Nvme(st), nvpoll::Retry::Elsewhere) => {
                let nsid = r.nsid;
                self.paths[p].note_path_status(nsid, st.status);
                self.stats.path_errors += 1;
                Some(now)
            }
            // The path went away under it (or it timed out): it may still run there until the controller
            // is torn down.
            (_, nvpoll::Retry::Elsewhere) => {
                self.stats.held += 1;
                Some(now + self.paths[p].quiesce_time())
            }
            _ => None,
        };
        let r = self.reqs[idx as usize].as_mut().expect("a live request");
        let first = *r.first_failure.get_or_insert(now);
        r.last_failure = Some(now);
        match retry_at {
            Some(at) if now.duration_since(first) < self.give_up => {
                r.last_error = Some(err);
                if at <= now {
                    self.ready.push_back(idx);
                } else {
                    self.held.push_back((idx, at));
                }
            }
            _ => self.finish(idx, Err(err)),
        }
    }

    /// Moves held requests whose time came to `ready`, sends what is ready, and gives up on what waited too
    /// long for a path.
    fn pump(&mut self) {
        let now = Instant::now();
        let mut k = 0;
        while k < self.held.len() {
            if self.held[k].1 <= now {
                let (idx, _) = self.held.remove(k).expect("index in range");
                self.ready.push_back(idx);
            } else {
                k += 1;
            }
        }
        for _ in 0..self.ready.len() {
            let Some(idx) = self.ready.pop_front() else {
                break;
            };
            if self.dispatch(idx) {
                continue;
            }
            let r = self.reqs[idx as usize].as_mut().expect("a live request");
            let since = *r.first_failure.get_or_insert(now);
            if now.duration_since(since) >= self.give_up {
                let e = r.last_error.take().unwrap_or_else(|| {
                    nvpoll::Error::ConnectionLost("no path to the namespace".into())
                });
                self.finish(idx, Err(e));
            } else {
                self.ready.push_back(idx);
            }
        }
    }
}

impl QueuePair for MultipathQueuePair {
    fn submit(&mut self, mut req: IoRequest) -> Result<(), Rejected> {
        if let Err(e) = check_request(&mut req, &self.namespaces, self.max_transfer) {
            return Err(Rejected {
                error: e,
                request: req,
            });
        }
        let Some(idx) = self.free.pop() else {
            return Err(Rejected {
                error: nvpoll::Error::QueueFull,
                request: req,
            });
        };
        self.reqs[idx as usize] = Some(Request {
            op: req.op,
            nsid: req.nsid,
            lba: req.lba,
            blocks: req.blocks,
            tag: req.tag,
            buf: req.buf.take(),
            sends: 0,
            first_failure: None,
            last_failure: None,
            last_error: None,
        });
        self.stats.submitted += 1;
        if !self.dispatch(idx) {
            // No path now: it goes as soon as one is usable (or fails after ctrl-loss-tmo).
            self.ready.push_back(idx);
        }
        Ok(())
    }

    fn flush(&mut self) -> nvpoll::Result<()> {
        let mut first = Ok(());
        for p in &mut self.paths {
            if let Err(e) = p.flush() {
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }

    fn poll(&mut self, max: usize) -> nvpoll::Result<usize> {
        self.poll_at(max, Instant::now())
    }

    fn poll_at(&mut self, max: usize, now: Instant) -> nvpoll::Result<usize> {
        let before = self.done.len();
        for p in 0..self.paths.len() {
            // A path that failed for good has completed its commands with errors, handled below.
            let _ = self.paths[p].poll_at(max, now);
            while let Some(c) = self.paths[p].pop_completion() {
                self.on_completion(p, c);
            }
        }
        if !self.ready.is_empty() || !self.held.is_empty() {
            self.pump();
        }
        Ok(self.done.len() - before)
    }

    fn pop_completion(&mut self) -> Option<Completion> {
        self.done.pop_front()
    }

    fn outstanding(&self) -> usize {
        self.depth - self.free.len()
    }

    fn depth(&self) -> usize {
        self.depth
    }

    fn set_send_mode(&mut self, mode: SendMode) -> nvpoll::Result<()> {
        for p in &mut self.paths {
            p.set_send_mode(mode)?;
        }
        Ok(())
    }

    fn stats(&self) -> QueueStats {
        let s = self
            .paths
            .iter()
            .fold(QueueStats::default(), |s, p| s.plus(&p.stats()));
        QueueStats {
            retried: s.retried + self.stats.retried,
            longest_failover: self.stats.longest_failover,
            ..s
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nvpoll::spec;

    #[test]
    fn policies_parse_and_path_statuses_are_told_apart() {
        for p in [PathPolicy::RoundRobin, PathPolicy::QueueDepth] {
            assert_eq!(p.name().parse::<PathPolicy>(), Ok(p));
        }
        assert!("numa".parse::<PathPolicy>().is_err());
        let elsewhere = |st: spec::Status| {
            nvpoll::Error::Nvme(st.named_in(spec::CommandKind::Nvm)).retry()
                == nvpoll::Retry::Elsewhere
        };
        assert!(elsewhere(spec::Status::ANA_INACCESSIBLE));
        assert!(elsewhere(spec::Status::ANA_TRANSITION));
        assert!(elsewhere(spec::Status::TRANSIENT_TRANSPORT_ERROR));
        assert!(!elsewhere(spec::Status::ANA_INACCESSIBLE.with_dnr()));
        assert!(!elsewhere(spec::Status::LBA_OUT_OF_RANGE));
        assert!(!elsewhere(spec::Status::WRITE_FAULT));
    }
}

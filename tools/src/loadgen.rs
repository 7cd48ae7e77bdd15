//! A load generator over any [`QueuePair`]: jobs (one queue pair each) kept at their queue depth by reactor
//! pollers, latency in an HDR histogram, CPU time per I/O from the reactors' thread clocks, and an optional
//! verify mode that stamps every written block (LBA, generation, CRC32C) and checks it on every read.
//!
//! `nvpoll-perf` and the loopback benchmark are built on it; a storage engine can use it to qualify a
//! device the same way.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
pub use nvpoll::units::{parse_duration, parse_size};

use nvpoll::api::{IoOp, IoRequest, Namespace, QueuePair, QueueStats};
use nvpoll::mem::{DmaBuf, DmaPool};
use nvpoll::reactor::{PollStatus, Poller, ReactorContext, Reactors, WakeSources};
use nvpoll::send::SendMode;
use nvpoll::Error;

/// The access pattern of a run (also perf's `--workload`, each variant's doc its help).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Workload {
    /// Random reads.
    Randread,
    /// Random writes.
    Randwrite,
    /// Sequential reads.
    Read,
    /// Sequential writes.
    Write,
    /// Random reads and writes, --rwmix percent reads.
    Randrw,
    /// Random deallocates (Dataset Management), --io-size each.
    Randtrim,
    /// Sequential deallocates.
    Trim,
}

impl Workload {
    /// The name fio uses for it.
    pub fn name(self) -> &'static str {
        match self {
            Workload::Randread => "randread",
            Workload::Randwrite => "randwrite",
            Workload::Read => "read",
            Workload::Write => "write",
            Workload::Randrw => "randrw",
            Workload::Randtrim => "randtrim",
            Workload::Trim => "trim",
        }
    }

    /// Whether it deallocates (and so moves no data, and leaves blocks that `verify` cannot check).
    pub fn trims(self) -> bool {
        matches!(self, Workload::Randtrim | Workload::Trim)
    }
}

/// The parameters of one measured run.
#[derive(Clone, Copy, Debug)]
pub struct RunSpec {
    /// Queue depth per job.
    pub qd: u16,
    /// Number of jobs (queue pairs), spread round-robin over the reactors.
    pub jobs: usize,
    /// Bytes per I/O.
    pub io_size: u64,
    /// Access pattern.
    pub workload: Workload,
    /// Percent reads for [`Workload::Randrw`].
    pub rwmix: u8,
    /// Stamp written blocks and check every read.
    pub verify: bool,
    /// When each job's queue pair sends what it posted.
    pub send_mode: SendMode,
    /// How long after the measured window jobs wait for their outstanding commands; what is still
    /// outstanding then counts as lost.
    pub drain_timeout: Duration,
    /// Unmeasured time before the measurement.
    pub warmup: Duration,
    /// Measured time.
    pub time: Duration,
}

/// What one job measured.
struct JobResult<Q> {
    reactor: usize,
    submitted: u64,
    completed_ok: u64,
    rejected: u64,
    lost: u64,
    retried: u64,
    reconnects: u64,
    key_updates: (u64, u64),
    max_stall: Duration,
    failover: Duration,
    ios: u64,
    bytes: u64,
    errors: u64,
    mismatches: u64,
    hist: Histogram<u64>,
    cpu: Option<Duration>,
    stats: QueueStats,
    failure: Option<String>,
    job: usize,
    gens: Vec<u64>,
    qp: Option<(Q, Namespace)>,
}

/// What one run measured, all jobs together.
#[derive(Clone, Debug, Default)]
pub struct RunResult {
    /// I/Os per second completed successfully in the measured window.
    pub iops: f64,
    /// MiB per second.
    pub mib_s: f64,
    /// Mean latency in microseconds.
    pub mean_us: f64,
    /// Median latency.
    pub p50_us: f64,
    /// 99th percentile latency.
    pub p99_us: f64,
    /// 99.9th percentile latency.
    pub p999_us: f64,
    /// CPU time of the reactors running jobs, per I/O, in microseconds.
    pub cpu_us_per_io: f64,
    /// TLS records sent per I/O (0 without TLS).
    pub records_per_io: f64,
    /// Plaintext bytes per TLS record (0 without TLS).
    pub bytes_per_record: f64,
    /// Send system calls (or doorbells) per I/O.
    pub writes_per_io: f64,
    /// PDUs (or SQEs) posted per I/O.
    pub pdus_per_io: f64,
    /// End-of-iteration flushes that sent something, per I/O.
    pub flushes_per_io: f64,
    /// Send and receive system calls per I/O (receive polls that found nothing included).
    pub syscalls_per_io: f64,
    /// I/Os that failed.
    pub errors: u64,
    /// Verify mismatches (blocks that did not read back as written).
    pub mismatches: u64,
    /// Commands accepted by the queue pairs over the whole run (warm-up and drain included).
    pub submitted: u64,
    /// Of those, completed successfully.
    pub completed_ok: u64,
    /// Submits the queue pairs refused (not counted as submitted).
    pub rejected: u64,
    /// Commands the transport submitted again after recovering a lost connection.
    pub retried: u64,
    /// Times the queue pairs connected again after losing their connection, over the whole run (faults, or
    /// TLS keys renewed by reconnecting where the target refused a KeyUpdate).
    pub reconnects: u64,
    /// TLS KeyUpdates the queue pairs sent over the whole run (our keys renewed).
    pub key_updates_sent: u64,
    /// TLS KeyUpdates they received (the target's keys renewed).
    pub key_updates_received: u64,
    /// Accepted commands that never completed (must be 0).
    pub lost: u64,
    /// The longest time without a completion while commands were outstanding.
    pub max_stall: Duration,
    /// The longest a command waited to change paths (multipath; zero otherwise).
    pub failover: Duration,
    /// Why jobs ended early, if any did.
    pub failures: Vec<String>,
}

/// Tiny xorshift generator: deterministic per job, no allocation.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
}

/// Marks a unit's generation as uncertain: a write to it failed, so the media holds that generation or the one
/// before.
const UNCERTAIN: u64 = 1 << 63;
/// Marks a unit of which at least one write of this run was acknowledged.
const ACKED: u64 = 1 << 62;
/// The generation bits of a unit's state.
const GEN: u64 = ACKED - 1;

/// Verify stamp at the start of every block: LBA, generation, CRC32C of the rest of the block.
fn stamp(block: &mut [u8], lba: u64, gen: u64) {
    block[0..8].copy_from_slice(&lba.to_le_bytes());
    block[8..16].copy_from_slice(&gen.to_le_bytes());
    for (i, b) in block[20..].iter_mut().enumerate() {
        *b = (lba as u8).wrapping_add(gen as u8).wrapping_add(i as u8);
    }
    let crc = crc32c::crc32c(&block[20..]);
    block[16..20].copy_from_slice(&crc.to_le_bytes());
}

/// Checks a block read back: true if it carries the expected LBA and generation and its CRC holds, or if this
/// run never wrote it (`gen` 0: its contents are unknown).
fn check_stamp(block: &[u8], lba: u64, gen: u64) -> bool {
    let l = u64::from_le_bytes(block[0..8].try_into().unwrap());
    let g = u64::from_le_bytes(block[8..16].try_into().unwrap());
    let crc_ok =
        || u32::from_le_bytes(block[16..20].try_into().unwrap()) == crc32c::crc32c(&block[20..]);
    if gen & UNCERTAIN != 0 {
        // A failed write left the unit at its generation or an earlier one of ours; before any of our writes
        // was acknowledged, it may also still hold what was there before the run.
        if gen & ACKED == 0 {
            return true;
        }
        return l == lba && g >= 1 && g <= gen & GEN && crc_ok();
    }
    let gen = gen & GEN;
    if gen == 0 {
        // Not written by this run: whatever was there before (zeroes, or an earlier program's data) is fine.
        return true;
    }
    l == lba && g == gen && crc_ok()
}

/// One queue pair kept at its queue depth from a reactor poller.
struct Job<Q: QueuePair> {
    /// The queue pair; handed back (with the result) when the job finishes.
    qp: Option<Q>,
    spec: RunSpec,
    ns: Namespace,
    /// The job's region of the namespace, in I/O-size units: [first, first + count).
    first: u64,
    count: u64,
    next_seq: u64,
    rng: Rng,
    bufs: Vec<DmaBuf>,
    /// Per outstanding slot: submit time, unit, and whether it was a read.
    inflight: Vec<(Instant, u64, bool)>,
    free_slots: Vec<u16>,
    /// Verify: generation written per unit; busy marks units with an I/O in flight.
    gens: Vec<u64>,
    busy: Vec<bool>,
    measure_start: Instant,
    measure_end: Instant,
    hist: Histogram<u64>,
    ios: u64,
    errors: u64,
    mismatches: u64,
    /// Fault accounting over the whole run: commands accepted, completed OK, failed, refused at submit.
    submitted: u64,
    completed_ok: u64,
    rejected: u64,
    /// The longest time without any completion while commands were outstanding, and the last completion.
    max_stall: Duration,
    last_completion: Instant,
    /// Give up draining at this point: whatever is still outstanding is lost.
    drain_deadline: Instant,
    /// The queue pair's counters when the job started (for its retries and key updates).
    base: QueueStats,
    cpu_start: Option<Duration>,
    /// Queue-pair counters at the start of the measured window, and their change over it.
    stats_start: Option<QueueStats>,
    stats: Option<QueueStats>,
    cpu: Option<Duration>,
    measure_cpu: bool,
    reactor: usize,
    index: usize,
    done: Option<mpsc::Sender<JobResult<Q>>>,
    /// This job's completions so far, for the progress line: written by this job only, on its own line.
    progress: Arc<Tally>,
}

/// A count written by one thread and read by others, alone on its cache lines: each job has one, so that no
/// two reactors write the same line on every poll (a counter shared by all jobs did, and bent the scaling).
#[derive(Debug, Default)]
#[repr(align(128))]
struct Tally(AtomicU64);

impl Tally {
    /// Adds `n`; only the owning thread calls it (a load and a store, no locked instruction).
    fn add(&self, n: u64) {
        if n > 0 {
            self.0
                .store(self.0.load(Ordering::Relaxed) + n, Ordering::Relaxed);
        }
    }

    fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

impl<Q: QueuePair> Job<Q> {
    /// Moves what the job writes per I/O into memory of its reactor's thread (it was built on the caller's),
    /// so that no two reactors' jobs share a cache line.
    fn rehome(&mut self) {
        nvpoll::mem::rehome_vec(&mut self.inflight);
        nvpoll::mem::rehome_vec(&mut self.free_slots);
        nvpoll::mem::rehome_vec(&mut self.bufs);
        nvpoll::mem::rehome_vec(&mut self.gens);
        nvpoll::mem::rehome_vec(&mut self.busy);
    }

    fn qp(&mut self) -> &mut Q {
        self.qp
            .as_mut()
            .expect("a job has its queue pair until it finishes")
    }

    fn pick(&mut self) -> Option<(u64, bool)> {
        let read = match self.spec.workload {
            Workload::Randread | Workload::Read => true,
            Workload::Randwrite | Workload::Write | Workload::Randtrim | Workload::Trim => false,
            Workload::Randrw => self.rng.next() % 100 < u64::from(self.spec.rwmix),
        };
        let sequential = matches!(
            self.spec.workload,
            Workload::Read | Workload::Write | Workload::Trim
        );
        for _ in 0..16 {
            let unit = if sequential {
                let u = self.next_seq % self.count;
                self.next_seq += 1;
                u
            } else {
                self.rng.next() % self.count
            };
            if !self.spec.verify || !self.busy[unit as usize] {
                return Some((unit, read));
            }
        }
        None
    }

    fn submit_one(&mut self, now: Instant) -> bool {
        let Some(slot) = self.free_slots.pop() else {
            return false;
        };
        let Some((unit, read)) = self.pick() else {
            self.free_slots.push(slot);
            return false;
        };
        let bs = u64::from(self.ns.block_size);
        let lba = (self.first + unit) * self.spec.io_size / bs;
        let blocks = (self.spec.io_size / bs) as u32;
        let mut buf = self.bufs.pop().expect("one buffer per slot");
        if !read && self.spec.verify {
            let state = self.gens[unit as usize];
            let gen = (state & GEN) + 1;
            self.gens[unit as usize] = gen | (state & !GEN);
            for (i, block) in buf.as_mut_slice().chunks_mut(bs as usize).enumerate() {
                stamp(block, lba + i as u64, gen);
            }
        }
        if self.spec.verify {
            self.busy[unit as usize] = true;
        }
        let op = if read {
            IoOp::Read
        } else if self.spec.workload.trims() {
            // The buffer carries the range.
            IoOp::Deallocate
        } else {
            IoOp::Write
        };
        let req = IoRequest {
            op,
            nsid: self.ns.nsid,
            lba,
            blocks,
            buf: Some(buf),
            tag: u64::from(slot),
        };
        self.inflight[usize::from(slot)] = (now, unit, read);
        match self.qp().submit(req) {
            Ok(()) => {
                self.submitted += 1;
                true
            }
            Err(r) => {
                self.rejected += 1;
                self.bufs.push(r.request.buf.expect("buffer handed back"));
                self.free_slots.push(slot);
                if self.spec.verify {
                    self.busy[unit as usize] = false;
                    if !read {
                        // Nothing was written: the unit keeps its generation.
                        self.gens[unit as usize] -= 1;
                    }
                }
                false
            }
        }
    }

    fn finish(&mut self, failure: Option<String>) {
        if let Some(tx) = self.done.take() {
            // Over the whole run, like the other fault counts (a retry may come after the measured window).
            let over_run = self
                .qp
                .as_ref()
                .map(|q| q.stats().since(&self.base))
                .unwrap_or_default();
            let retried = over_run.retried;
            let reconnects = over_run.reconnects;
            let key_updates = (over_run.key_updates_sent, over_run.key_updates_received);
            let failover = self
                .qp
                .as_ref()
                .map_or(Duration::ZERO, |q| q.stats().longest_failover);
            let hist = std::mem::replace(&mut self.hist, Histogram::new(1).expect("histogram"));
            self.bufs.clear();
            let qp = if failure.is_none() {
                self.qp.take().map(|q| (q, self.ns.clone()))
            } else {
                None
            };
            let lost = self.qp.as_ref().map_or(0, |q| q.outstanding() as u64);
            let result = JobResult {
                reactor: self.reactor,
                submitted: self.submitted,
                completed_ok: self.completed_ok,
                rejected: self.rejected,
                lost,
                retried,
                reconnects,
                key_updates,
                max_stall: self.max_stall,
                failover,
                ios: self.ios,
                bytes: self.ios * self.spec.io_size,
                errors: self.errors,
                mismatches: self.mismatches,
                hist,
                cpu: self.cpu,
                stats: self.stats.unwrap_or_default(),
                failure,
                job: self.index,
                gens: std::mem::take(&mut self.gens),
                qp,
            };
            // The receiver waits for every job; it is gone only if perf itself is exiting.
            let _ = tx.send(result);
        }
    }
}

impl<Q: QueuePair> Poller for Job<Q> {
    fn poll(&mut self, ctx: &mut ReactorContext) -> PollStatus {
        if self.done.is_none() {
            return PollStatus::Idle;
        }
        let now = Instant::now();
        let measuring = now >= self.measure_start && now < self.measure_end;
        if measuring && self.stats_start.is_none() {
            self.stats_start = Some(self.qp().stats());
        }
        if now >= self.measure_end && self.stats.is_none() {
            if let Some(start) = self.stats_start {
                self.stats = Some(self.qp().stats().since(&start));
            }
        }
        if self.measure_cpu {
            if measuring && self.cpu_start.is_none() {
                self.cpu_start = Some(ctx.cpu_time());
            }
            if now >= self.measure_end && self.cpu.is_none() {
                if let Some(start) = self.cpu_start {
                    self.cpu = Some(ctx.cpu_time().saturating_sub(start));
                }
            }
        }
        if let Err(e) = self.qp().poll_at(256, now) {
            self.drain_completions(now, measuring);
            self.finish(Some(e.to_string()));
            return PollStatus::Busy;
        }
        let n = self.drain_completions(now, measuring);
        if now < self.measure_end {
            while self.submit_one(now) {}
        } else if self.qp().outstanding() == 0 {
            self.finish(None);
            return PollStatus::Busy;
        } else if now > self.drain_deadline {
            let n = self.qp().outstanding();
            self.finish(Some(format!("{n} commands never completed (lost)")));
            return PollStatus::Busy;
        }
        if n > 0 {
            PollStatus::Busy
        } else {
            PollStatus::Idle
        }
    }

    /// A finished job waits for nothing. A running one for its queue pair's completions and for the
    /// moments its run changes phase (measuring starts, measuring ends, the drain times out).
    fn wake_sources<'a>(&'a self, w: &mut WakeSources<'a>) -> bool {
        let Some(qp) = self.done.as_ref().and(self.qp.as_ref()) else {
            return true;
        };
        let now = Instant::now();
        for at in [self.measure_start, self.measure_end, self.drain_deadline] {
            if at > now {
                w.deadline(at);
            }
        }
        qp.wake_sources(w)
    }

    /// The reactor's end-of-iteration flush: what the deferred and adaptive modes left queued goes out here,
    /// together.
    fn flush(&mut self, _ctx: &mut ReactorContext) {
        if self.done.is_none() {
            return;
        }
        if let Err(e) = self.qp().flush() {
            self.finish(Some(e.to_string()));
        }
    }
}

impl<Q: QueuePair> Job<Q> {
    fn drain_completions(&mut self, now: Instant, measuring: bool) -> usize {
        let mut n = 0;
        while let Some(c) = self.qp().pop_completion() {
            n += 1;
            let slot = c.tag as u16;
            let (t0, unit, read) = self.inflight[usize::from(slot)];
            let buf = c.buf.expect("buffer handed back");
            match c.result {
                Ok(()) => {
                    self.completed_ok += 1;
                    if self.spec.verify && !read {
                        // Acknowledged: the unit holds exactly this generation again.
                        self.gens[unit as usize] = (self.gens[unit as usize] & GEN) | ACKED;
                    }
                    if self.spec.verify && read {
                        let bs = self.ns.block_size as usize;
                        let lba0 = (self.first + unit) * self.spec.io_size / bs as u64;
                        let gen = self.gens[unit as usize];
                        for (i, block) in buf.as_slice().chunks(bs).enumerate() {
                            if !check_stamp(block, lba0 + i as u64, gen) {
                                self.mismatches += 1;
                                if self.mismatches <= 3 {
                                    let l = u64::from_le_bytes(block[0..8].try_into().unwrap());
                                    let g = u64::from_le_bytes(block[8..16].try_into().unwrap());
                                    eprintln!(
                                        "perf: verify mismatch at LBA {}: expected generation {gen}, \
                                         block says LBA {l} generation {g}",
                                        lba0 + i as u64
                                    );
                                }
                            }
                        }
                    }
                    if measuring && t0 >= self.measure_start {
                        let ns = now.duration_since(t0).as_nanos() as u64;
                        self.hist.saturating_record(ns.max(1));
                        self.ios += 1;
                    }
                }
                Err(_) => {
                    self.errors += 1;
                    if self.spec.verify && !read {
                        // The write may or may not have reached the media: either generation is right.
                        self.gens[unit as usize] |= UNCERTAIN;
                    }
                }
            }
            if self.spec.verify {
                self.busy[unit as usize] = false;
            }
            self.bufs.push(buf);
            self.free_slots.push(slot);
        }
        if n > 0 {
            self.max_stall = self
                .max_stall
                .max(now.saturating_duration_since(self.last_completion));
            self.last_completion = now;
        } else if self.qp().outstanding() == 0 {
            self.last_completion = now;
        }
        self.progress.add(n as u64);
        n
    }
}

fn percentile_us(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

/// Which part of a run is under way; handed to the `tick` callback of [`LoadGen::run`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Before the measured window.
    Warmup,
    /// Inside the measured window.
    Measuring,
    /// After it, while the jobs drain their outstanding I/O.
    Draining,
}

/// Makes (or hands back) the queue pair of job `index` with the given depth, and names its namespace.
pub type Connect<'a, Q> = dyn FnMut(usize, u16) -> Result<(Q, Namespace), Error> + 'a;

/// Runs measured runs of jobs on reactors, keeping queue pairs and verify state from one run to the next.
pub struct LoadGen<Q: QueuePair + Send + 'static> {
    pool: DmaPool,
    /// Verify: the generation last written to each unit, per job, kept across runs.
    gens: Vec<Vec<u64>>,
    /// Queue pairs (with their namespace) kept between runs, by job index.
    qps: Vec<Option<(Q, Namespace)>>,
    /// The depth every queue pair is created with.
    qp_depth: u16,
    quiet: bool,
}

impl<Q: QueuePair + Send + 'static> LoadGen<Q> {
    /// A load generator whose buffers come from `pool`, whose queue pairs are created `qp_depth` deep (the
    /// deepest queue depth any run will use), printing a progress line each second unless `quiet`.
    pub fn new(pool: DmaPool, qp_depth: u16, quiet: bool) -> Self {
        LoadGen {
            pool,
            gens: Vec::new(),
            qps: Vec::new(),
            qp_depth,
            quiet,
        }
    }

    /// Drops every queue pair kept for the next run.
    pub fn release_queue_pairs(&mut self) {
        self.qps.clear();
    }

    /// Runs one measured run: `spec.jobs` queue pairs (made by `connect` the first time, reused after) spread
    /// over `reactors`, started together, and their results gathered. `tick` runs on the calling thread about
    /// every 100 ms with the current phase (keep-alive for admin queues, sampling a target's CPU time).
    pub fn run(
        &mut self,
        reactors: &Reactors,
        spec: RunSpec,
        connect: &mut Connect<'_, Q>,
        tick: &mut dyn FnMut(Phase) -> Result<(), Error>,
    ) -> Result<RunResult, Error> {
        if spec.qd == 0 || spec.qd > self.qp_depth || spec.jobs == 0 || spec.io_size == 0 {
            return Err(Error::InvalidArgument(format!(
                "a run needs 1 <= qd <= {} (got {}), at least one job and a non-zero I/O size",
                self.qp_depth, spec.qd
            )));
        }
        if spec.verify && spec.workload.trims() {
            return Err(Error::InvalidArgument(format!(
                "verify checks what was written, and {} leaves blocks whose content the controller decides \
                 (its DLFEAT): run it without verify",
                spec.workload.name()
            )));
        }
        let (tx, rx) = mpsc::channel();
        let mut progress: Vec<Arc<Tally>> = Vec::with_capacity(spec.jobs);
        let start = Instant::now() + Duration::from_millis(50);
        let measure_start = start + spec.warmup;
        let measure_end = measure_start + spec.time;
        let nreactors = reactors.len();
        let mut cpu_owner = vec![false; nreactors];
        for j in 0..spec.jobs {
            // Queue pairs are made once, at the deepest queue depth of the session, and reused by every run.
            let (mut qp, ns) = match self.qps.get_mut(j).and_then(Option::take) {
                Some(pair) => pair,
                None => connect(j, self.qp_depth)?,
            };
            qp.set_send_mode(spec.send_mode)?;
            let base = qp.stats();
            if spec.io_size % u64::from(ns.block_size) != 0 {
                return Err(Error::InvalidArgument(format!(
                    "the I/O size {} is not a multiple of the block size {}",
                    spec.io_size, ns.block_size
                )));
            }
            let units = ns.capacity_bytes() / spec.io_size;
            let per_job = units / spec.jobs as u64;
            if per_job == 0 {
                return Err(Error::InvalidArgument(
                    "the namespace is too small for that many jobs at this I/O size".into(),
                ));
            }
            let mut bufs = Vec::with_capacity(usize::from(spec.qd));
            for _ in 0..spec.qd {
                bufs.push(self.pool.alloc(spec.io_size as usize)?);
            }
            let reactor = j % nreactors;
            let tally = Arc::new(Tally::default());
            progress.push(Arc::clone(&tally));
            let job = Job {
                qp: Some(qp),
                spec,
                ns,
                first: per_job * j as u64,
                count: per_job,
                next_seq: 0,
                rng: Rng(0x9e37_79b9_7f4a_7c15 ^ (j as u64 + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9)),
                bufs,
                inflight: vec![(start, 0, false); usize::from(spec.qd)],
                free_slots: (0..spec.qd).collect(),
                gens: match self.gens.get_mut(j).map(std::mem::take) {
                    Some(g) if g.len() == per_job as usize => g,
                    _ => vec![0; if spec.verify { per_job as usize } else { 0 }],
                },
                busy: if spec.verify {
                    vec![false; per_job as usize]
                } else {
                    Vec::new()
                },
                measure_start,
                measure_end,
                hist: Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("histogram bounds"),
                ios: 0,
                errors: 0,
                mismatches: 0,
                submitted: 0,
                completed_ok: 0,
                rejected: 0,
                max_stall: Duration::ZERO,
                last_completion: start,
                drain_deadline: measure_end + spec.drain_timeout,
                base,
                cpu_start: None,
                stats_start: None,
                stats: None,
                cpu: None,
                measure_cpu: !std::mem::replace(&mut cpu_owner[reactor], true),
                reactor,
                index: j,
                done: Some(tx.clone()),
                progress: Arc::clone(&tally),
            };
            reactors.send(reactor, move |ctx| {
                let mut job = job;
                job.rehome();
                ctx.add_poller(job);
            })?;
        }
        drop(tx);
        let mut results = Vec::with_capacity(spec.jobs);
        let mut last = (Instant::now(), 0u64);
        let deadline = measure_end + spec.drain_timeout + Duration::from_secs(10);
        while results.len() < spec.jobs {
            let now = Instant::now();
            let phase = if now < measure_start {
                Phase::Warmup
            } else if now < measure_end {
                Phase::Measuring
            } else {
                Phase::Draining
            };
            tick(phase)?;
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(r) => results.push(r),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(Error::Reactor("a reactor stopped during the run".into()));
                }
            }
            if Instant::now() > deadline {
                return Err(Error::Timeout);
            }
            if !self.quiet && last.0.elapsed() >= Duration::from_secs(1) {
                let n: u64 = progress.iter().map(|t| t.get()).sum();
                let rate = (n - last.1) as f64 / last.0.elapsed().as_secs_f64();
                let what = if phase == Phase::Warmup {
                    "warm-up"
                } else {
                    "measuring"
                };
                eprintln!("  ... {what}: {rate:.0} IOPS");
                last = (Instant::now(), n);
            }
        }
        tick(Phase::Draining)?;
        let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("histogram");
        let (mut ios, mut bytes, mut errors, mut mismatches) = (0, 0, 0, 0);
        let mut cpu = Duration::ZERO;
        let mut qs = QueueStats::default();
        let mut failures = Vec::new();
        let (mut submitted, mut completed_ok, mut rejected, mut lost) = (0, 0, 0, 0);
        let mut max_stall = Duration::ZERO;
        let mut failover = Duration::ZERO;
        for r in &mut results {
            if self.gens.len() <= r.job {
                self.gens.resize(r.job + 1, Vec::new());
            }
            self.gens[r.job] = std::mem::take(&mut r.gens);
            if self.qps.len() <= r.job {
                self.qps.resize_with(r.job + 1, || None);
            }
            self.qps[r.job] = r.qp.take();
            hist.add(&r.hist)
                .map_err(|e| Error::InvalidArgument(e.to_string()))?;
            ios += r.ios;
            bytes += r.bytes;
            errors += r.errors;
            mismatches += r.mismatches;
            cpu += r.cpu.unwrap_or_default();
            submitted += r.submitted;
            completed_ok += r.completed_ok;
            rejected += r.rejected;
            lost += r.lost;
            max_stall = max_stall.max(r.max_stall);
            failover = failover.max(r.failover);
            qs.retried += r.retried;
            qs.reconnects += r.reconnects;
            qs.key_updates_sent += r.key_updates.0;
            qs.key_updates_received += r.key_updates.1;
            qs.writes += r.stats.writes;
            qs.pdus += r.stats.pdus;
            qs.flushes += r.stats.flushes;
            qs.reads += r.stats.reads;
            qs.records += r.stats.records;
            qs.record_bytes += r.stats.record_bytes;
            if let Some(f) = &r.failure {
                failures.push(format!("job on reactor {}: {f}", r.reactor));
            }
        }

        let secs = spec.time.as_secs_f64();
        let per_io = |n: u64| if ios > 0 { n as f64 / ios as f64 } else { 0.0 };
        Ok(RunResult {
            records_per_io: per_io(qs.records),
            bytes_per_record: if qs.records > 0 {
                qs.record_bytes as f64 / qs.records as f64
            } else {
                0.0
            },
            writes_per_io: per_io(qs.writes),
            pdus_per_io: per_io(qs.pdus),
            flushes_per_io: per_io(qs.flushes),
            syscalls_per_io: per_io(qs.writes + qs.reads),
            iops: ios as f64 / secs,
            mib_s: bytes as f64 / secs / (1 << 20) as f64,
            mean_us: hist.mean() / 1000.0,
            p50_us: percentile_us(&hist, 0.5),
            p99_us: percentile_us(&hist, 0.99),
            p999_us: percentile_us(&hist, 0.999),
            cpu_us_per_io: if ios > 0 {
                cpu.as_secs_f64() * 1e6 / ios as f64
            } else {
                0.0
            },
            errors,
            mismatches,
            submitted,
            completed_ok,
            rejected,
            retried: qs.retried,
            reconnects: qs.reconnects,
            key_updates_sent: qs.key_updates_sent,
            key_updates_received: qs.key_updates_received,
            lost,
            max_stall,
            failover,
            failures,
        })
    }
}

/// The run with the median IOPS.
pub fn median(mut runs: Vec<RunResult>) -> RunResult {
    runs.sort_by(|a, b| a.iops.total_cmp(&b.iops));
    runs[runs.len() / 2].clone()
}

/// One row of a results table: a workload label, a send mode and the median of its runs.
pub struct Row {
    /// What ran, e.g. "qd128 x 2 randread".
    pub workload: String,
    /// The send mode.
    pub mode: &'static str,
    /// The median run.
    pub result: RunResult,
    /// Every run.
    pub runs: Vec<RunResult>,
}

/// The rows as a Markdown table. Where any run renewed TLS keys, a column counts the KeyUpdates sent and
/// received (`sent/received`, over the whole run); where any queue pair reconnected, a last column counts
/// its reconnects (a fault, or keys renewed by reconnecting).
pub fn table(rows: &[Row]) -> String {
    let renewed = rows
        .iter()
        .any(|r| r.result.key_updates_sent + r.result.key_updates_received > 0);
    let reconnected = rows.iter().any(|r| r.result.reconnects > 0);
    let mut s = String::new();
    let _ = write!(
        s,
        "| {:<24} | {:<8} | {:>9} | {:>8} | {:>8} | {:>8} | {:>8} | {:>10} | {:>10} | {:>11} | {:>9} |",
        "workload",
        "mode",
        "IOPS",
        "mean us",
        "p50 us",
        "p99 us",
        "p99.9 us",
        "records/IO",
        "writes/IO",
        "syscalls/IO",
        "CPU us/IO"
    );
    if renewed {
        let _ = write!(s, " {:>13} |", "key updates");
    }
    if reconnected {
        let _ = write!(s, " {:>10} |", "reconnects");
    }
    let _ = write!(
        s,
        "\n|{:-<26}|{:-<10}|{:->11}|{:->10}|{:->10}|{:->10}|{:->10}|{:->12}|{:->12}|{:->13}|{:->11}|",
        "", "", "", "", "", "", "", "", "", "", ""
    );
    if renewed {
        let _ = write!(s, "{:->15}|", "");
    }
    if reconnected {
        let _ = write!(s, "{:->12}|", "");
    }
    s.push('\n');
    for r in rows {
        let x = &r.result;
        let _ = write!(
            s,
            "| {:<24} | {:<8} | {:>9.0} | {:>8.1} | {:>8.1} | {:>8.1} | {:>8.1} | {:>10.3} | {:>10.3} | {:>11.2} | {:>9.2} |",
            r.workload,
            r.mode,
            x.iops,
            x.mean_us,
            x.p50_us,
            x.p99_us,
            x.p999_us,
            x.records_per_io,
            x.writes_per_io,
            x.syscalls_per_io,
            x.cpu_us_per_io
        );
        if renewed {
            let updates = format!("{}/{}", x.key_updates_sent, x.key_updates_received);
            let _ = write!(s, " {updates:>13} |");
        }
        if reconnected {
            let _ = write!(s, " {:>10} |", x.reconnects);
        }
        s.push('\n');
    }
    s
}

/// One run as perf's JSON writes it.
#[derive(serde::Serialize)]
struct JsonRun {
    iops: f64,
    mib_s: f64,
    mean_us: f64,
    p50_us: f64,
    p99_us: f64,
    p999_us: f64,
    cpu_us_per_io: f64,
    records_per_io: f64,
    bytes_per_record: f64,
    writes_per_io: f64,
    pdus_per_io: f64,
    flushes_per_io: f64,
    syscalls_per_io: f64,
    errors: u64,
    mismatches: u64,
    submitted: u64,
    completed_ok: u64,
    rejected: u64,
    retried: u64,
    reconnects: u64,
    key_updates: JsonKeyUpdates,
    lost: u64,
    max_stall_s: f64,
    failover_s: f64,
}

/// TLS KeyUpdates over a run: ours sent, the target's received.
#[derive(serde::Serialize)]
struct JsonKeyUpdates {
    sent: u64,
    received: u64,
}

impl From<&RunResult> for JsonRun {
    fn from(x: &RunResult) -> Self {
        JsonRun {
            iops: x.iops,
            mib_s: x.mib_s,
            mean_us: x.mean_us,
            p50_us: x.p50_us,
            p99_us: x.p99_us,
            p999_us: x.p999_us,
            cpu_us_per_io: x.cpu_us_per_io,
            records_per_io: x.records_per_io,
            bytes_per_record: x.bytes_per_record,
            writes_per_io: x.writes_per_io,
            pdus_per_io: x.pdus_per_io,
            flushes_per_io: x.flushes_per_io,
            syscalls_per_io: x.syscalls_per_io,
            errors: x.errors,
            mismatches: x.mismatches,
            submitted: x.submitted,
            completed_ok: x.completed_ok,
            rejected: x.rejected,
            retried: x.retried,
            reconnects: x.reconnects,
            key_updates: JsonKeyUpdates {
                sent: x.key_updates_sent,
                received: x.key_updates_received,
            },
            lost: x.lost,
            max_stall_s: x.max_stall.as_secs_f64(),
            failover_s: x.failover.as_secs_f64(),
        }
    }
}

#[derive(serde::Serialize)]
struct JsonRow<'a> {
    workload: &'a str,
    mode: &'a str,
    median: JsonRun,
    runs: Vec<JsonRun>,
}

#[derive(serde::Serialize)]
struct JsonReport<'a> {
    machine: &'a str,
    rows: Vec<JsonRow<'a>>,
}

/// The rows (with every run) as one JSON object (serde_json: every string escaped).
pub fn json(rows: &[Row], machine: &str) -> String {
    let report = JsonReport {
        machine,
        rows: rows
            .iter()
            .map(|r| JsonRow {
                workload: &r.workload,
                mode: r.mode,
                median: (&r.result).into(),
                runs: r.runs.iter().map(JsonRun::from).collect(),
            })
            .collect(),
    };
    serde_json::to_string(&report).expect("a report of numbers and strings always serializes")
}

/// Connected queue pairs that send nothing, held on the reactors for a whole session: what many quiet queue
/// pairs cost a reactor beside the measured jobs (perf `--idle-queues`). Each is a poller that reads whatever
/// its connection brings and says what wakes it, so that its reactor may park it.
pub struct IdleQueues {
    /// (reactor, poller) of each held queue pair.
    held: Vec<(usize, nvpoll::reactor::PollerId)>,
}

struct IdleQueue<Q> {
    qp: Q,
    index: usize,
    failed: bool,
}

impl<Q: QueuePair> Poller for IdleQueue<Q> {
    fn poll(&mut self, _ctx: &mut ReactorContext) -> PollStatus {
        if self.failed {
            return PollStatus::Idle;
        }
        match self.qp.poll(16) {
            Ok(n) => {
                while self.qp.pop_completion().is_some() {}
                PollStatus::busy_if(n > 0)
            }
            Err(e) => {
                eprintln!("perf: idle queue {}: {e}", self.index);
                self.failed = true;
                PollStatus::Idle
            }
        }
    }

    fn flush(&mut self, _ctx: &mut ReactorContext) {
        if !self.failed {
            if let Err(e) = self.qp.flush() {
                eprintln!("perf: idle queue {}: {e}", self.index);
                self.failed = true;
            }
        }
    }

    fn wake_sources<'a>(&'a self, w: &mut WakeSources<'a>) -> bool {
        self.failed || self.qp.wake_sources(w)
    }
}

impl IdleQueues {
    /// Registers each of `qps` on a reactor, round-robin from `first_reactor`.
    pub fn hold<Q: QueuePair + Send + 'static>(
        reactors: &Reactors,
        qps: Vec<Q>,
        first_reactor: usize,
    ) -> Result<IdleQueues, Error> {
        let n = reactors.len();
        let (tx, rx) = mpsc::channel();
        let count = qps.len();
        for (index, qp) in qps.into_iter().enumerate() {
            let reactor = (first_reactor + index) % n;
            let tx = tx.clone();
            reactors.send(reactor, move |ctx| {
                let id = ctx.add_poller(IdleQueue {
                    qp,
                    index,
                    failed: false,
                });
                let _ = tx.send((reactor, id));
            })?;
        }
        drop(tx);
        let mut held = Vec::with_capacity(count);
        for _ in 0..count {
            held.push(
                rx.recv_timeout(Duration::from_secs(30))
                    .map_err(|_| Error::Reactor("a reactor did not take an idle queue".into()))?,
            );
        }
        Ok(IdleQueues { held })
    }

    /// How many queue pairs are held.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Unregisters (and so drops, on their reactors) every held queue pair, and waits until that is done.
    pub fn release(self, reactors: &Reactors) -> Result<(), Error> {
        let (tx, rx) = mpsc::channel();
        let mut by_reactor: Vec<Vec<nvpoll::reactor::PollerId>> = vec![Vec::new(); reactors.len()];
        for (r, id) in self.held {
            by_reactor[r].push(id);
        }
        let mut sent = 0;
        for (r, ids) in by_reactor.into_iter().enumerate() {
            if ids.is_empty() {
                continue;
            }
            let tx = tx.clone();
            reactors.send(r, move |ctx| {
                for id in ids {
                    ctx.remove_poller(id);
                }
                // Removed at the end of this step; the next message on this reactor runs after that.
                let _ = tx.send(());
            })?;
            sent += 1;
        }
        drop(tx);
        for _ in 0..sent {
            rx.recv_timeout(Duration::from_secs(30))
                .map_err(|_| Error::Reactor("a reactor did not release its idle queues".into()))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_escapes_strings_and_parses_back() {
        let run = RunResult {
            iops: 1000.0,
            lost: 0,
            ..Default::default()
        };
        let rows = vec![Row {
            workload: "qd1 \"x\" \\ randread".into(),
            mode: "inline",
            result: run.clone(),
            runs: vec![run.clone(), run],
        }];
        let out = json(&rows, "a \"quoted\"\nmachine");
        let v: serde_json::Value = serde_json::from_str(&out).expect("perf's JSON parses");
        assert_eq!(v["machine"], "a \"quoted\"\nmachine");
        assert_eq!(v["rows"][0]["workload"], "qd1 \"x\" \\ randread");
        assert_eq!(v["rows"][0]["median"]["iops"], 1000.0);
        assert_eq!(v["rows"][0]["runs"].as_array().map(Vec::len), Some(2));
    }
}

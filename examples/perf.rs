//! `perf`: an I/O load generator in the spirit of fio and spdk_nvme_perf.
//!
//! With no `--trid`, it starts our NVMe/TCP target in-process on 127.0.0.1 with a RAM namespace and runs the
//! seed matrix in miniature: `qd1 x jobs` and `qd128 x jobs`, 4 KiB random writes, printed as one table.
//! With `--trid`, it drives the given controllers with the given workload.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use hdrhistogram::Histogram;
use nvpoll::api::{Controller, IoOp, IoRequest, Namespace, QueuePair};
use nvpoll::mem::{DmaBuf, DmaPool};
use nvpoll::reactor::{CoreList, PollStatus, ReactorContext, Reactors};
use nvpoll::trid::TransportId;
use nvpoll_tcp::host::{ConnectOptions, TcpController, TcpQueuePair};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Workload {
    Randread,
    Randwrite,
    Read,
    Write,
    Randrw,
}

impl Workload {
    fn name(self) -> &'static str {
        match self {
            Workload::Randread => "randread",
            Workload::Randwrite => "randwrite",
            Workload::Read => "read",
            Workload::Write => "write",
            Workload::Randrw => "randrw",
        }
    }
}

/// I/O load generator for NVMe over TCP (and, later, PCIe).
///
/// Without --trid it starts the embedded NVMe/TCP target on 127.0.0.1 (RAM namespace) and runs the default
/// matrix: qd1 x jobs and qd128 x jobs, 4 KiB random writes.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
struct Args {
    /// Transport ID of a controller to drive, e.g. 'trtype:tcp traddr:127.0.0.1 trsvcid:4420 subnqn:NQN'.
    /// May be given several times; jobs are spread over them. Without it, the embedded target is used.
    #[arg(long = "trid")]
    trids: Vec<String>,
    /// Queue depth per job. May be given several times (the embedded default runs 1 and 128).
    #[arg(long = "qd")]
    qds: Vec<u16>,
    /// I/O size (e.g. 512, 4k, 128k, 1m); a multiple of the namespace's block size.
    #[arg(long, default_value = "4k", value_parser = parse_size)]
    io_size: u64,
    /// Access pattern.
    #[arg(long, value_enum, default_value_t = Workload::Randwrite)]
    workload: Workload,
    /// Percentage of reads for randrw.
    #[arg(long, default_value_t = 70, value_parser = clap::value_parser!(u8).range(0..=100))]
    rwmix: u8,
    /// Measured time per run (e.g. 10s, 500ms).
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    time: Duration,
    /// Warm-up before each run, not measured.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    warmup: Duration,
    /// Number of jobs (queue pairs), spread round-robin over the initiator reactors. Default: 2 per reactor.
    #[arg(long)]
    jobs: Option<usize>,
    /// Cores for the initiator reactors: a list (0,1 or 0-3) or a mask (0x3). Default: core 0.
    #[arg(long, default_value = "0")]
    cores: String,
    /// Cores for the embedded target's reactors (ignored with --trid). Default: the last core.
    #[arg(long)]
    target_cores: Option<String>,
    /// Runs per table row; the median run is reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Print the results as JSON on stdout (progress and tables go to stderr).
    #[arg(long)]
    json: bool,
    /// Stamp written blocks (LBA, generation, CRC) and check them on every read; count mismatches.
    #[arg(long)]
    verify: bool,
    /// No progress line every second.
    #[arg(long)]
    quiet: bool,
    /// Host NQN (default: /etc/nvme/hostnqn, or one derived from the machine's UUID).
    #[arg(long)]
    hostnqn: Option<String>,
    /// Size of the embedded target's RAM namespace.
    #[arg(long, default_value = "256m", value_parser = parse_size)]
    ram: u64,
}

fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim().to_ascii_lowercase();
    let (num, mult) = match t.trim_end_matches(['b', 'i']).char_indices().last() {
        Some((i, 'k')) => (&t[..i], 1u64 << 10),
        Some((i, 'm')) => (&t[..i], 1 << 20),
        Some((i, 'g')) => (&t[..i], 1 << 30),
        _ => (t.as_str(), 1),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a size (e.g. 512, 4k, 1m, 1g)"))?;
    n.checked_mul(mult)
        .filter(|&v| v > 0)
        .ok_or_else(|| format!("'{s}' is not a usable size"))
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let bad = || format!("'{s}' is not a duration (e.g. 10s, 500ms, 1m)");
    let (num, unit) = t.split_at(t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len()));
    let v: f64 = num.parse().map_err(|_| bad())?;
    let secs = match unit {
        "" | "s" => v,
        "ms" => v / 1000.0,
        "us" => v / 1e6,
        "m" | "min" => v * 60.0,
        _ => return Err(bad()),
    };
    if !(0.0..=86400.0).contains(&secs) {
        return Err(bad());
    }
    Ok(Duration::from_secs_f64(secs))
}

/// One controller to drive.
struct Target {
    addr: SocketAddr,
    subnqn: String,
}

/// The parameters of one measured run.
#[derive(Clone, Copy, Debug)]
struct RunSpec {
    qd: u16,
    jobs: usize,
    io_size: u64,
    workload: Workload,
    rwmix: u8,
    verify: bool,
    warmup: Duration,
    time: Duration,
}

/// What one job measured.
struct JobResult {
    reactor: usize,
    ios: u64,
    bytes: u64,
    errors: u64,
    mismatches: u64,
    hist: Histogram<u64>,
    cpu: Option<Duration>,
    failure: Option<String>,
    job: usize,
    gens: Vec<u64>,
    qp: Option<TcpQueuePair>,
}

/// What one run measured, all jobs together.
#[derive(Clone, Debug)]
struct RunResult {
    iops: f64,
    mib_s: f64,
    mean_us: f64,
    p50_us: f64,
    p99_us: f64,
    p999_us: f64,
    cpu_us_per_io: f64,
    errors: u64,
    mismatches: u64,
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

/// Checks a block read back: `Ok` if it carries the expected LBA and generation and its CRC holds, or if it
/// was never written (all zero) and `gen` is 0.
fn check_stamp(block: &[u8], lba: u64, gen: u64) -> bool {
    if gen == 0 {
        return block.iter().all(|&b| b == 0);
    }
    let l = u64::from_le_bytes(block[0..8].try_into().unwrap());
    let g = u64::from_le_bytes(block[8..16].try_into().unwrap());
    let crc = u32::from_le_bytes(block[16..20].try_into().unwrap());
    l == lba && g == gen && crc == crc32c::crc32c(&block[20..])
}

/// One queue pair kept at its queue depth from a reactor poller.
struct Job {
    /// The queue pair; handed back (with the result) when the job finishes.
    qp: Option<TcpQueuePair>,
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
    cpu_start: Option<Duration>,
    cpu: Option<Duration>,
    measure_cpu: bool,
    reactor: usize,
    index: usize,
    done: Option<mpsc::Sender<JobResult>>,
    progress: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl Job {
    fn qp(&mut self) -> &mut TcpQueuePair {
        self.qp
            .as_mut()
            .expect("a job has its queue pair until it finishes")
    }

    fn pick(&mut self) -> Option<(u64, bool)> {
        let read = match self.spec.workload {
            Workload::Randread | Workload::Read => true,
            Workload::Randwrite | Workload::Write => false,
            Workload::Randrw => self.rng.next() % 100 < u64::from(self.spec.rwmix),
        };
        let sequential = matches!(self.spec.workload, Workload::Read | Workload::Write);
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
            let gen = self.gens[unit as usize] + 1;
            self.gens[unit as usize] = gen;
            for (i, block) in buf.as_mut_slice().chunks_mut(bs as usize).enumerate() {
                stamp(block, lba + i as u64, gen);
            }
        }
        if self.spec.verify {
            self.busy[unit as usize] = true;
        }
        let op = if read { IoOp::Read } else { IoOp::Write };
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
            Ok(()) => true,
            Err(r) => {
                self.errors += 1;
                self.bufs.push(r.request.buf.expect("buffer handed back"));
                self.free_slots.push(slot);
                if self.spec.verify {
                    self.busy[unit as usize] = false;
                }
                false
            }
        }
    }

    fn finish(&mut self, failure: Option<String>) {
        if let Some(tx) = self.done.take() {
            let hist = std::mem::replace(&mut self.hist, Histogram::new(1).expect("histogram"));
            self.bufs.clear();
            let qp = if failure.is_none() {
                self.qp.take()
            } else {
                None
            };
            let result = JobResult {
                reactor: self.reactor,
                ios: self.ios,
                bytes: self.ios * self.spec.io_size,
                errors: self.errors,
                mismatches: self.mismatches,
                hist,
                cpu: self.cpu,
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

impl nvpoll::reactor::Poller for Job {
    fn poll(&mut self, ctx: &mut ReactorContext) -> PollStatus {
        if self.done.is_none() {
            return PollStatus::Idle;
        }
        let now = Instant::now();
        let measuring = now >= self.measure_start && now < self.measure_end;
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
        if let Err(e) = self.qp().poll(256) {
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
        }
        if let Err(e) = self.qp().flush() {
            self.finish(Some(e.to_string()));
        }
        if n > 0 {
            PollStatus::Busy
        } else {
            PollStatus::Idle
        }
    }
}

impl Job {
    fn drain_completions(&mut self, now: Instant, measuring: bool) -> usize {
        let mut n = 0;
        while let Some(c) = self.qp().pop_completion() {
            n += 1;
            let slot = c.tag as u16;
            let (t0, unit, read) = self.inflight[usize::from(slot)];
            let buf = c.buf.expect("buffer handed back");
            match c.result {
                Ok(()) => {
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
                Err(_) => self.errors += 1,
            }
            if self.spec.verify {
                self.busy[unit as usize] = false;
            }
            self.bufs.push(buf);
            self.free_slots.push(slot);
        }
        self.progress
            .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        n
    }
}

fn percentile_us(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

struct Session {
    reactors: Reactors,
    /// Verify: the generation last written to each unit, per job, kept across runs.
    gens: Vec<Vec<u64>>,
    /// Queue pairs kept between runs, by job index.
    qps: Vec<Option<TcpQueuePair>>,
    /// The depth every queue pair is created with.
    qp_depth: u16,
    ctrls: Vec<TcpController>,
    pool: DmaPool,
    quiet: bool,
}

impl Session {
    /// Runs one measured run: creates `spec.jobs` queue pairs spread over the controllers and reactors, starts
    /// them together, and gathers their results.
    fn run(&mut self, spec: RunSpec) -> Result<RunResult, String> {
        let (tx, rx) = mpsc::channel();
        let progress = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let start = Instant::now() + Duration::from_millis(50);
        let measure_start = start + spec.warmup;
        let measure_end = measure_start + spec.time;
        let nreactors = self.reactors.len();
        let mut cpu_owner = vec![false; nreactors];
        for j in 0..spec.jobs {
            let ci = j % self.ctrls.len();
            let ctrl = &mut self.ctrls[ci];
            let ns = ctrl
                .namespaces()
                .first()
                .cloned()
                .ok_or("the controller has no namespace")?;
            if spec.io_size % u64::from(ns.block_size) != 0 {
                return Err(format!(
                    "--io-size {} is not a multiple of the block size {}",
                    spec.io_size, ns.block_size
                ));
            }
            // Queue pairs are made once, at the deepest queue depth of the session, and reused by every run.
            let qp = match self.qps.get_mut(j).and_then(Option::take) {
                Some(qp) => qp,
                None => ctrl
                    .connect_io_queue(self.qp_depth)
                    .map_err(|e| format!("creating queue pair {j}: {e}"))?,
            };
            let units = ns.capacity_bytes() / spec.io_size;
            let per_job = units / spec.jobs as u64;
            if per_job == 0 {
                return Err(
                    "the namespace is too small for that many jobs at this I/O size".into(),
                );
            }
            let mut bufs = Vec::with_capacity(usize::from(spec.qd));
            for _ in 0..spec.qd {
                let b = self
                    .pool
                    .alloc(spec.io_size as usize)
                    .map_err(|e| e.to_string())?;
                bufs.push(b);
            }
            let reactor = j % nreactors;
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
                cpu_start: None,
                cpu: None,
                measure_cpu: !std::mem::replace(&mut cpu_owner[reactor], true),
                reactor,
                index: j,
                done: Some(tx.clone()),
                progress: progress.clone(),
            };
            self.reactors
                .send(reactor, move |ctx| {
                    ctx.add_poller(job);
                })
                .map_err(|e| e.to_string())?;
        }
        drop(tx);
        let mut results = Vec::with_capacity(spec.jobs);
        let mut last = (Instant::now(), 0u64);
        let deadline = measure_end + Duration::from_secs(30);
        while results.len() < spec.jobs {
            // Keep the admin queues alive (keep-alive) while the jobs run.
            for c in &mut self.ctrls {
                c.poll_admin().map_err(|e| format!("admin queue: {e}"))?;
            }
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(r) => results.push(r),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err("a reactor stopped during the run".into())
                }
            }
            if Instant::now() > deadline {
                return Err("jobs did not finish 30 s after the end of the run".into());
            }
            if !self.quiet && last.0.elapsed() >= Duration::from_secs(1) {
                let n = progress.load(std::sync::atomic::Ordering::Relaxed);
                let rate = (n - last.1) as f64 / last.0.elapsed().as_secs_f64();
                let phase = if Instant::now() < measure_start {
                    "warm-up"
                } else {
                    "measuring"
                };
                eprintln!("  ... {phase}: {:.0} IOPS", rate);
                last = (Instant::now(), n);
            }
        }
        let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("histogram");
        let (mut ios, mut bytes, mut errors, mut mismatches) = (0, 0, 0, 0);
        let mut cpu = Duration::ZERO;
        let mut failures = Vec::new();
        for r in &mut results {
            if self.gens.len() <= r.job {
                self.gens.resize(r.job + 1, Vec::new());
            }
            self.gens[r.job] = std::mem::take(&mut r.gens);
            if self.qps.len() <= r.job {
                self.qps.resize_with(r.job + 1, || None);
            }
            self.qps[r.job] = r.qp.take();
            hist.add(&r.hist).map_err(|e| e.to_string())?;
            ios += r.ios;
            bytes += r.bytes;
            errors += r.errors;
            mismatches += r.mismatches;
            cpu += r.cpu.unwrap_or_default();
            if let Some(f) = &r.failure {
                failures.push(format!("job on reactor {}: {f}", r.reactor));
            }
        }
        if !failures.is_empty() {
            return Err(failures.join("; "));
        }
        let secs = spec.time.as_secs_f64();
        Ok(RunResult {
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
        })
    }
}

fn median(mut runs: Vec<RunResult>) -> RunResult {
    runs.sort_by(|a, b| a.iops.total_cmp(&b.iops));
    runs[runs.len() / 2].clone()
}

struct Row {
    workload: String,
    mode: &'static str,
    result: RunResult,
    runs: Vec<RunResult>,
}

fn table(rows: &[Row]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| {:<22} | {:<8} | {:>10} | {:>8} | {:>9} | {:>9} | {:>9} | {:>9} | {:>9} |",
        "workload", "mode", "IOPS", "MiB/s", "mean us", "p50 us", "p99 us", "p99.9 us", "CPU us/IO"
    );
    let _ = writeln!(
        s,
        "|{:-<24}|{:-<10}|{:->12}|{:->10}|{:->11}|{:->11}|{:->11}|{:->11}|{:->11}|",
        "", "", "", "", "", "", "", "", ""
    );
    for r in rows {
        let x = &r.result;
        let _ = writeln!(
            s,
            "| {:<22} | {:<8} | {:>10.0} | {:>8.1} | {:>9.1} | {:>9.1} | {:>9.1} | {:>9.1} | {:>9.2} |",
            r.workload, r.mode, x.iops, x.mib_s, x.mean_us, x.p50_us, x.p99_us, x.p999_us, x.cpu_us_per_io
        );
    }
    s
}

fn json(rows: &[Row], machine: &str) -> String {
    let run = |x: &RunResult| {
        format!(
            "{{\"iops\":{:.1},\"mib_s\":{:.3},\"mean_us\":{:.3},\"p50_us\":{:.3},\"p99_us\":{:.3},\"p999_us\":{:.3},\
             \"cpu_us_per_io\":{:.4},\"errors\":{},\"mismatches\":{}}}",
            x.iops, x.mib_s, x.mean_us, x.p50_us, x.p99_us, x.p999_us, x.cpu_us_per_io, x.errors, x.mismatches
        )
    };
    let rows: Vec<String> = rows
        .iter()
        .map(|r| {
            let runs: Vec<String> = r.runs.iter().map(run).collect();
            format!(
                "{{\"workload\":\"{}\",\"mode\":\"{}\",\"median\":{},\"runs\":[{}]}}",
                r.workload,
                r.mode,
                run(&r.result),
                runs.join(",")
            )
        })
        .collect();
    format!(
        "{{\"machine\":\"{}\",\"rows\":[{}]}}",
        machine.replace('"', "'"),
        rows.join(",")
    )
}

fn main() {
    let args = Args::parse();
    if let Err(e) = run(args) {
        eprintln!("perf: {e}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<(), String> {
    let cores = CoreList::parse(&args.cores).map_err(|e| format!("--cores: {e}"))?;
    let embedded = args.trids.is_empty();
    let hostnqn = match args.hostnqn.clone() {
        Some(n) => n,
        None => nvpoll::trid::default_hostnqn()
            .map_err(|e| format!("host NQN: {e} (give --hostnqn)"))?,
    };
    let hostid = nvpoll::trid::hostid_from_hostnqn(&hostnqn)
        .or_else(|| nvpoll::trid::default_hostid().ok())
        .unwrap_or_default();
    let mut _target = None;
    let targets: Vec<Target> = if embedded {
        let tcores = match &args.target_cores {
            Some(c) => CoreList::parse(c).map_err(|e| format!("--target-cores: {e}"))?,
            None => {
                let all = CoreList::all();
                let last = *all.cores().last().ok_or("no cores")?;
                CoreList::parse(&last.to_string()).map_err(|e| e.to_string())?
            }
        };
        let t = embedded_target::start(&tcores, args.ram)?;
        eprintln!(
            "perf: embedded NVMe/TCP target {} on {} (cores {tcores}), RAM namespace of {} MiB",
            t.nqn,
            t.addr,
            args.ram >> 20
        );
        let tg = Target {
            addr: t.addr,
            subnqn: t.nqn.clone(),
        };
        _target = Some(t);
        vec![tg]
    } else {
        args.trids
            .iter()
            .map(|s| {
                let trid: TransportId = s.parse().map_err(|e| format!("--trid '{s}': {e}"))?;
                match trid {
                    TransportId::Tcp {
                        addr,
                        subnqn: Some(subnqn),
                        ..
                    } => Ok(Target { addr, subnqn }),
                    TransportId::Tcp { subnqn: None, .. } => {
                        Err(format!("--trid '{s}' needs subnqn:NQN"))
                    }
                    other => Err(format!(
                        "--trid '{s}': trtype:{} is not supported by perf yet",
                        other.trtype()
                    )),
                }
            })
            .collect::<Result<_, String>>()?
    };
    let qds = if args.qds.is_empty() {
        if embedded {
            vec![1, 128]
        } else {
            vec![128]
        }
    } else {
        args.qds.clone()
    };
    if let Some(&bad) = qds.iter().find(|&&q| q == 0) {
        return Err(format!("--qd {bad}: the queue depth must be at least 1"));
    }
    if args.runs == 0 {
        return Err("--runs must be at least 1".into());
    }
    let jobs = args.jobs.unwrap_or(2 * cores.len());
    if jobs == 0 {
        return Err("--jobs must be at least 1".into());
    }
    let max_qd = *qds.iter().max().expect("at least one qd") as usize;
    let bufs_needed = jobs * max_qd + 64;
    let class = (args.io_size as usize).next_power_of_two().max(4096);
    let pool = DmaPool::builder()
        .class(4096, 256)
        .class(class, bufs_needed)
        .build()
        .map_err(|e| format!("DMA pool: {e}"))?;
    let mut ctrls = Vec::new();
    for t in &targets {
        let mut o = ConnectOptions::new(t.addr, t.subnqn.clone(), hostnqn.clone());
        o.hostid = hostid;
        let c = TcpController::connect(o, pool.clone())
            .map_err(|e| format!("connecting to {}: {e}", t.addr))?;
        ctrls.push(c);
    }
    let reactors = Reactors::start(&cores).map_err(|e| format!("starting reactors: {e}"))?;
    let mut session = Session {
        gens: Vec::new(),
        qps: Vec::new(),
        qp_depth: max_qd as u16,
        reactors,
        ctrls,
        pool,
        quiet: args.quiet || args.json,
    };
    let machine = format!("{} cores, initiator cores {cores}", CoreList::all().len());
    eprintln!(
        "perf: {} {} B, {} job(s) on {} reactor(s), warm-up {:?}, {:?} x {} run(s) per row{}",
        args.workload.name(),
        args.io_size,
        jobs,
        cores.len(),
        args.warmup,
        args.time,
        args.runs,
        if args.verify { ", verifying" } else { "" }
    );
    let mut rows = Vec::new();
    for &qd in &qds {
        let spec = RunSpec {
            qd,
            jobs,
            io_size: args.io_size,
            workload: args.workload,
            rwmix: args.rwmix,
            verify: args.verify,
            warmup: args.warmup,
            time: args.time,
        };
        let label = format!("qd{qd} x {jobs} {}", args.workload.name());
        let mut runs = Vec::new();
        for i in 0..args.runs {
            if !session.quiet {
                eprintln!("run {}/{}: {label}", i + 1, args.runs);
            }
            // Each run gets fresh queue pairs; the controller grants a limited number, so reconnect when needed.
            let r = session.run(spec)?;
            if !session.quiet {
                eprintln!(
                    "  {:.0} IOPS, mean {:.1} us, p99 {:.1} us",
                    r.iops, r.mean_us, r.p99_us
                );
            }
            runs.push(r);
        }
        // Until per-queue send modes exist (issue 6), every job posts its commands during its poll and writes
        // them with one flush at the end of it: the deferred mode.
        rows.push(Row {
            workload: label,
            mode: "deferred",
            result: median(runs.clone()),
            runs,
        });
    }
    let stats = session.reactors.stop().map_err(|e| e.to_string())?;
    let total_errors: u64 = rows
        .iter()
        .flat_map(|r| r.runs.iter())
        .map(|r| r.errors)
        .sum();
    let total_mismatches: u64 = rows
        .iter()
        .flat_map(|r| r.runs.iter())
        .map(|r| r.mismatches)
        .sum();
    if args.json {
        println!("{}", json(&rows, &machine));
    } else {
        println!("{}", table(&rows));
        let polls: u64 = stats.iter().map(|s| s.busy + s.idle).sum();
        let busy: u64 = stats.iter().map(|s| s.busy).sum();
        println!("initiator reactors: {polls} polls, {:.1}% busy; errors {total_errors}, verify mismatches {total_mismatches}", 100.0 * busy as f64 / polls.max(1) as f64);
    }
    session.qps.clear();
    for c in session.ctrls.drain(..) {
        c.shutdown().map_err(|e| format!("shutdown: {e}"))?;
    }
    if total_errors > 0 || total_mismatches > 0 {
        return Err(format!(
            "{total_errors} I/O errors and {total_mismatches} verify mismatches"
        ));
    }
    Ok(())
}

/// The embedded target: our NVMe/TCP target on 127.0.0.1, on its own reactors.
mod embedded_target {
    use super::*;
    use nvpoll_tcp::target::{Backing, SubsystemConfig, Target, TargetConfig, TargetHandle};

    pub struct Embedded {
        pub addr: SocketAddr,
        pub nqn: String,
        handle: TargetHandle,
        reactors: Option<Reactors>,
    }

    pub fn start(cores: &CoreList, ram: u64) -> Result<Embedded, String> {
        let nqn = "nqn.2024-01.io.nvpoll:perf".to_string();
        let listen: SocketAddr = "127.0.0.1:0".parse().expect("address literal");
        let config = TargetConfig::new(listen)
            .subsystem(SubsystemConfig::new(nqn.clone()).namespace(Backing::Ram(ram), 4096));
        let target = Target::bind(config).map_err(|e| format!("embedded target: {e}"))?;
        let reactors =
            Reactors::start(cores).map_err(|e| format!("embedded target reactors: {e}"))?;
        let handle = target
            .start(&reactors)
            .map_err(|e| format!("embedded target: {e}"))?;
        Ok(Embedded {
            addr: handle.local_addr(),
            nqn,
            handle,
            reactors: Some(reactors),
        })
    }

    impl Drop for Embedded {
        fn drop(&mut self) {
            self.handle.stop();
            if let Some(r) = self.reactors.take() {
                if let Err(e) = r.stop() {
                    eprintln!("perf: embedded target reactors: {e}");
                }
            }
        }
    }
}

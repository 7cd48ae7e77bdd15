//! Scaling: how IOPS grow with reactors, ours against SPDK's in the same run.
//!
//! Part 1, the curve: for n = 1, 2, 4, ... up to half the machine's cores (or NVPOLL_SCALE_MAX), n initiator
//! reactors on cores 0..n and n target reactors on the upper half, 4 KiB random writes at qd32 x 2 jobs per
//! initiator reactor, plain and TLS. Ours is `perf` with its embedded target, adaptive; with SPDK_DIR set,
//! SPDK's `nvmf_tgt -m MASK` and `spdk_nvme_perf -c MASK -q 64 -P 2` run on the same cores right after ours.
//! Printed: IOPS, IOPS per reactor, the efficiency against one reactor, and the ratios 8 vs 2 and 8 vs 4.
//!
//! Part 2, the seed's two shapes at the largest n: 4 KiB random writes at qd1 x 128 jobs and at qd128 x 8 jobs,
//! plain and TLS, each send mode, against one controller of our embedded target; with SPDK_DIR, also our perf
//! and spdk_nvme_perf against one controller of SPDK's nvmf_tgt. Every run is printed, and the median.
//!
//! `cargo bench --bench scale` (`-- curve` or `-- seed` runs one part). Knobs (environment):
//! - NVPOLL_BENCH_TIME (2s), NVPOLL_BENCH_WARMUP (500ms), NVPOLL_BENCH_RUNS (3: runs per seed-shape cell;
//!   the curve runs each point once per round, and takes the median of the rounds);
//! - NVPOLL_SCALE_MAX: the most reactors a side (default half the cores; at least 1);
//! - NVPOLL_SCALE_SEED_JOBS: the jobs of the qd1 shape (128);
//! - NVPOLL_BIN_DIR: a folder with our built `nvpoll-perf` (default: the one cargo builds for this bench);
//! - SPDK_DIR: an SPDK build (v26.05) with build/bin/nvmf_tgt and build/bin/spdk_nvme_perf; never built here.
//!   SPDK's apps run with `--no-huge -s 4096`; its target gets a JSON config (no rpc.py).
//!
//! Never two busy-polling processes on one core: the initiator and target halves do not overlap, so the
//! largest n is half the cores.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const KEY: &str = "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:f81d4fae-7dec-11d0-a765-00a0c91e6bf6";
const SPDK_NQN: &str = "nqn.2016-06.io.spdk:scale";
const SPDK_NQN_TLS: &str = "nqn.2016-06.io.spdk:scale-tls";
const SPDK_PORT: u16 = 4590;
const SPDK_PORT_TLS: u16 = 4591;

/// Runs that failed (printed where they failed); any makes the bench exit 1.
static FAILED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn failed(why: String) {
    FAILED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    println!("  ({why})");
}

struct Setup {
    perf: PathBuf,
    spdk: Option<PathBuf>,
    time: String,
    warmup: String,
    secs: f64,
    runs: usize,
    half: usize,
    max: usize,
    seed_jobs: usize,
    work: PathBuf,
}

fn main() {
    let only = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let (curve, seed) = match only.as_deref() {
        None => (true, true),
        Some("curve") => (true, false),
        Some("seed") => (false, true),
        Some(other) => panic!("unknown part '{other}': give curve or seed"),
    };
    let s = setup();
    println!(
        "scale: {} cores; initiator reactors on cores 0.., target reactors on {}..; up to {} a side; {} measured \
         after {} per run; {}",
        cores(),
        s.half,
        s.max,
        s.time,
        s.warmup,
        match &s.spdk {
            Some(d) => format!("SPDK from {}", d.display()),
            None => "SPDK_DIR not set: ours only".to_string(),
        }
    );
    if curve {
        run_curve(&s);
    }
    if seed {
        run_seed(&s);
    }
    let _ = std::fs::remove_dir_all(&s.work);
    let n = FAILED.load(std::sync::atomic::Ordering::Relaxed);
    if n > 0 {
        eprintln!("scale: {n} run(s) failed (see above)");
        std::process::exit(1);
    }
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn env_or(key: &str, default: &str) -> String {
    std::env::var(key).unwrap_or_else(|_| default.to_string())
}

fn setup() -> Setup {
    let ncores = cores();
    let half = (ncores / 2).max(1);
    let max = match std::env::var("NVPOLL_SCALE_MAX") {
        Ok(v) => v
            .parse::<usize>()
            .unwrap_or_else(|e| panic!("NVPOLL_SCALE_MAX={v}: {e}")),
        Err(_) => half,
    };
    assert!(
        max >= 1 && (ncores < 2 || max <= half),
        "NVPOLL_SCALE_MAX={max}: give 1 to {half} (half of the {ncores} cores: each side has its own)"
    );
    let time = env_or("NVPOLL_BENCH_TIME", "2s");
    let warmup = env_or("NVPOLL_BENCH_WARMUP", "500ms");
    let secs = nvpoll_tools::loadgen::parse_duration(&time)
        .unwrap_or_else(|e| panic!("NVPOLL_BENCH_TIME: {e}"))
        .as_secs_f64();
    let runs: usize = env_or("NVPOLL_BENCH_RUNS", "3")
        .parse()
        .expect("NVPOLL_BENCH_RUNS is a number");
    let seed_jobs: usize = env_or("NVPOLL_SCALE_SEED_JOBS", "128")
        .parse()
        .expect("NVPOLL_SCALE_SEED_JOBS is a number");
    let perf = match std::env::var_os("NVPOLL_BIN_DIR") {
        Some(d) => PathBuf::from(d).join("nvpoll-perf"),
        // cargo builds the package's binaries for its benches, in the bench profile
        None => PathBuf::from(env!("CARGO_BIN_EXE_nvpoll-perf")),
    };
    assert!(perf.is_file(), "no perf at {}", perf.display());
    let spdk = std::env::var_os("SPDK_DIR").map(PathBuf::from);
    if let Some(d) = &spdk {
        for b in ["nvmf_tgt", "spdk_nvme_perf"] {
            let p = d.join("build/bin").join(b);
            assert!(p.is_file(), "SPDK_DIR: no {}", p.display());
        }
    }
    let work = std::env::temp_dir().join(format!("nvpoll-scale.{}", std::process::id()));
    std::fs::create_dir_all(&work).expect("work folder");
    Setup {
        perf,
        spdk,
        time,
        warmup,
        secs,
        runs: runs.max(1),
        half: if ncores < 2 { 0 } else { half },
        max,
        seed_jobs,
        work,
    }
}

/// "a-b" for n cores from `first`.
fn range(first: usize, n: usize) -> String {
    format!("{first}-{}", first + n - 1)
}

fn mask(first: usize, n: usize) -> String {
    let mut m: u128 = 0;
    for c in first..first + n {
        m |= 1 << c;
    }
    format!("{m:#x}")
}

/// One run of our perf with its embedded target: the IOPS of each send mode's row, each run.
fn ours_embedded(
    s: &Setup,
    n: usize,
    qd: u16,
    jobs: usize,
    tls: bool,
    modes: &str,
    runs: usize,
) -> Vec<(String, Vec<f64>)> {
    let mut cmd = Command::new(&s.perf);
    cmd.args(["--cores", &range(0, n)])
        .args(["--target-cores", &range(s.half, n)])
        .args(["--jobs", &jobs.to_string(), "--qd", &qd.to_string()])
        .args(["--workload", "randwrite", "--io-size", "4k"])
        .args([
            "--send-mode",
            modes,
            "--tls",
            if tls { "on" } else { "off" },
        ])
        .args(["--time", &s.time, "--warmup", &s.warmup])
        .args(["--runs", &runs.to_string(), "--idle", "poll", "--json"])
        .args(["--hostnqn", HOSTNQN, "--psk", KEY]);
    perf_rows(cmd, s.secs, runs)
}

/// Our perf against SPDK's target (one controller).
fn ours_on_spdk(s: &Setup, n: usize, qd: u16, jobs: usize, tls: bool) -> Vec<(String, Vec<f64>)> {
    let (port, nqn) = if tls {
        (SPDK_PORT_TLS, SPDK_NQN_TLS)
    } else {
        (SPDK_PORT, SPDK_NQN)
    };
    let mut cmd = Command::new(&s.perf);
    cmd.args([
        "--trid",
        &format!("trtype:tcp traddr:127.0.0.1 trsvcid:{port} subnqn:{nqn}"),
    ])
    .args(["--cores", &range(0, n)])
    .args(["--jobs", &jobs.to_string(), "--qd", &qd.to_string()])
    .args([
        "--workload",
        "randwrite",
        "--io-size",
        "4k",
        "--send-mode",
        "all",
    ])
    .args(["--time", &s.time, "--warmup", &s.warmup])
    .args(["--runs", &s.runs.to_string(), "--idle", "poll", "--json"])
    .args(["--hostnqn", HOSTNQN]);
    if tls {
        cmd.args(["--psk", KEY, "--psk-identity-version", "0"]);
    }
    perf_rows(cmd, s.secs, s.runs)
}

/// Runs perf with --json and returns (mode, IOPS of each run) per row; an empty list (and the reason
/// printed) if it failed.
fn perf_rows(mut cmd: Command, secs: f64, runs: usize) -> Vec<(String, Vec<f64>)> {
    let limit = Duration::from_secs_f64(60.0 + 4.0 * (secs + 1.0) * runs as f64 * 3.0);
    let out = run_with_limit(&mut cmd, limit);
    let Some(out) = out else {
        failed(format!("perf did not finish in {limit:?}"));
        return Vec::new();
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let Some(v) = stdout
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
    else {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(3).collect();
        failed(format!("perf failed: {}", tail.join(" | ")));
        return Vec::new();
    };
    let mut rows = Vec::new();
    for r in v["rows"].as_array().into_iter().flatten() {
        let mode = r["mode"].as_str().unwrap_or("?").to_string();
        let iops = r["runs"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|x| x["iops"].as_f64())
            .collect();
        rows.push((mode, iops));
    }
    rows
}

fn run_with_limit(cmd: &mut Command, limit: Duration) -> Option<std::process::Output> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {cmd:?}: {e}"));
    let out_pipe = child.stdout.take().expect("stdout");
    let err_pipe = child.stderr.take().expect("stderr");
    let read = |mut p: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = p.read_to_end(&mut v);
            v
        })
    };
    let (o, e) = (read(Box::new(out_pipe)), read(Box::new(err_pipe)));
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(st) = child.try_wait().expect("waiting for a child") {
            break Some(st);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (stdout, stderr) = (o.join().unwrap_or_default(), e.join().unwrap_or_default());
    status.map(|status| std::process::Output {
        status,
        stdout,
        stderr,
    })
}

/// SPDK's nvmf_tgt on `n` cores from the upper half, with a plain and a TLS subsystem (a 256 MiB malloc bdev
/// each, 512 B blocks) on two ports; killed on drop.
struct SpdkTarget {
    child: Child,
}

impl SpdkTarget {
    fn start(s: &Setup, spdk: &Path, n: usize) -> Option<SpdkTarget> {
        let keyfile = s.work.join("psk.key");
        std::fs::write(&keyfile, KEY).expect("key file");
        set_private(&keyfile);
        let sub = |nqn: &str, bdev: &str, port: u16, tls: bool| {
            let mut v = vec![
                serde_json::json!({"method": "nvmf_create_subsystem", "params": {
                    "nqn": nqn, "allow_any_host": !tls, "serial_number": "SPDK00000000000001",
                    "max_namespaces": 4}}),
                serde_json::json!({"method": "nvmf_subsystem_add_ns", "params": {
                    "nqn": nqn, "namespace": {"bdev_name": bdev}}}),
                serde_json::json!({"method": "nvmf_subsystem_add_listener", "params": {
                    "nqn": nqn, "secure_channel": tls, "listen_address": {
                        "trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1",
                        "trsvcid": port.to_string()}}}),
            ];
            if tls {
                v.push(
                    serde_json::json!({"method": "nvmf_subsystem_add_host", "params": {
                    "nqn": nqn, "host": HOSTNQN, "psk": "key0"}}),
                );
            }
            v
        };
        let mut nvmf = vec![
            serde_json::json!({"method": "nvmf_create_transport", "params": {
            "trtype": "TCP", "max_io_size": 1048576, "in_capsule_data_size": 8192,
            "max_io_qpairs_per_ctrlr": 1024, "max_queue_depth": 128}}),
        ];
        nvmf.extend(sub(SPDK_NQN, "Malloc0", SPDK_PORT, false));
        nvmf.extend(sub(SPDK_NQN_TLS, "Malloc1", SPDK_PORT_TLS, true));
        let config = serde_json::json!({"subsystems": [
            {"subsystem": "keyring", "config": [{"method": "keyring_file_add_key", "params": {
                "name": "key0", "path": keyfile.to_string_lossy()}}]},
            {"subsystem": "bdev", "config": [
                {"method": "bdev_malloc_create", "params": {"name": "Malloc0", "num_blocks": 524288, "block_size": 512}},
                {"method": "bdev_malloc_create", "params": {"name": "Malloc1", "num_blocks": 524288, "block_size": 512}}]},
            {"subsystem": "nvmf", "config": nvmf},
        ]});
        let cfg = s.work.join("nvmf_tgt.json");
        std::fs::write(&cfg, config.to_string()).expect("nvmf_tgt config");
        let log = s.work.join("nvmf_tgt.log");
        let child = Command::new(spdk.join("build/bin/nvmf_tgt"))
            .args(["-m", &mask(s.half, n), "--no-huge", "-s", "4096", "--json"])
            .arg(&cfg)
            .args(["-r", &s.work.join("spdk.sock").to_string_lossy()])
            .stdout(std::fs::File::create(&log).expect("log"))
            .stderr(Stdio::null())
            .spawn()
            .expect("starting nvmf_tgt");
        let t = SpdkTarget { child };
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if std::net::TcpStream::connect(("127.0.0.1", SPDK_PORT_TLS)).is_ok() {
                return Some(t);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(5).collect();
        failed(format!(
            "nvmf_tgt did not listen in 30 s: {}",
            tail.join(" | ")
        ));
        None
    }
}

impl Drop for SpdkTarget {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn set_private(p: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o600)).expect("chmod 600");
}

/// spdk_nvme_perf on `n` cores from 0: `qpairs` queue pairs per core at `qd` each; the total IOPS.
fn spdk_perf(s: &Setup, spdk: &Path, n: usize, qd: u16, qpairs: usize, tls: bool) -> Option<f64> {
    let (port, nqn) = if tls {
        (SPDK_PORT_TLS, SPDK_NQN_TLS)
    } else {
        (SPDK_PORT, SPDK_NQN)
    };
    let mut cmd = Command::new(spdk.join("build/bin/spdk_nvme_perf"));
    let total_qd = usize::from(qd) * qpairs;
    cmd.args(["--no-huge", "-s", "4096", "-c", &mask(0, n)])
        .args(["-q", &total_qd.to_string(), "-P", &qpairs.to_string()])
        .args(["-o", "4096", "-w", "randwrite", "-t"])
        .arg(format!("{}", s.secs.ceil().max(1.0) as u64))
        .arg("-r")
        .arg(format!(
            "trtype:tcp adrfam:IPv4 traddr:127.0.0.1 trsvcid:{port} subnqn:{nqn} hostnqn:{HOSTNQN}"
        ));
    if tls {
        let keyfile = s.work.join("psk.key");
        cmd.args(["-S", "ssl", "--psk-path"]).arg(keyfile);
    }
    let out = run_with_limit(&mut cmd, Duration::from_secs_f64(s.secs + 40.0))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let total = text
        .lines()
        .find(|l| l.trim_start().starts_with("Total"))
        .and_then(|l| l.split(':').nth(1))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<f64>().ok());
    if total.is_none() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(3).collect();
        failed(format!(
            "spdk_nvme_perf gave no total: {}",
            tail.join(" | ")
        ));
    }
    total
}

fn median(v: &[f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

fn fmt_iops(v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(x) if x >= 1e6 => format!("{:.2}M", x / 1e6),
        Some(x) => format!("{:.0}K", x / 1e3),
    }
}

fn points(max: usize) -> Vec<usize> {
    let mut v = Vec::new();
    let mut n = 1;
    while n < max {
        v.push(n);
        n *= 2;
    }
    v.push(max);
    v
}

fn run_curve(s: &Setup) {
    let ns = points(s.max);
    // [stack][tls] -> IOPS per point, over rounds.
    let stacks: &[&str] = if s.spdk.is_some() {
        &["ours", "SPDK"]
    } else {
        &["ours"]
    };
    let mut got = vec![vec![vec![Vec::new(); ns.len()]; 2]; stacks.len()];
    let rounds = if s.runs >= 3 { 3 } else { 1 };
    for round in 0..rounds {
        for (i, &n) in ns.iter().enumerate() {
            let jobs = 2 * n;
            let ours = ours_embedded(s, n, 32, jobs, false, "adaptive", 1)
                .into_iter()
                .chain(ours_embedded(s, n, 32, jobs, true, "adaptive", 1))
                .map(|(_, r)| r.first().copied())
                .collect::<Vec<_>>();
            for (tls, v) in ours.iter().enumerate() {
                if let Some(x) = v {
                    got[0][tls][i].push(*x);
                }
            }
            let mut line = format!(
                "round {}/{rounds}, {n} reactor(s) a side: ours plain {} tls {}",
                round + 1,
                fmt_iops(ours.first().copied().flatten()),
                fmt_iops(ours.get(1).copied().flatten())
            );
            if let Some(spdk) = &s.spdk {
                if let Some(_t) = SpdkTarget::start(s, spdk, n) {
                    for tls in [false, true] {
                        let r = spdk_perf(s, spdk, n, 32, 2, tls);
                        if let Some(x) = r {
                            got[1][usize::from(tls)][i].push(x);
                        }
                        line += &format!(
                            ", SPDK {} {}",
                            if tls { "tls" } else { "plain" },
                            fmt_iops(r)
                        );
                    }
                }
            }
            println!("{line}");
        }
    }
    println!();
    println!(
        "4 KiB randwrite, qd32 x 2 jobs per initiator reactor, n reactors a side; median of {rounds} round(s)"
    );
    println!("| stack | n | IOPS | per reactor | vs 1 reactor (efficiency) |");
    println!("|---|---|---|---|---|");
    let mut slopes = Vec::new();
    for (si, stack) in stacks.iter().enumerate() {
        for tls in [false, true] {
            let med: Vec<Option<f64>> = got[si][usize::from(tls)]
                .iter()
                .map(|v| median(v))
                .collect();
            let one = med[0];
            for (i, &n) in ns.iter().enumerate() {
                let eff = match (med[i], one) {
                    (Some(x), Some(o)) if o > 0.0 => {
                        format!("{:.2}x ({:.0}%)", x / o, 100.0 * x / o / n as f64)
                    }
                    _ => "-".into(),
                };
                println!(
                    "| {stack} {} | {n} | {} | {} | {eff} |",
                    if tls { "tls" } else { "plain" },
                    fmt_iops(med[i]),
                    fmt_iops(med[i].map(|x| x / n as f64)),
                );
            }
            let at = |n: usize| ns.iter().position(|&m| m == n).and_then(|i| med[i]);
            let ratio = |a: usize, b: usize| match (at(a), at(b)) {
                (Some(x), Some(y)) if y > 0.0 => format!("{:.2}", x / y),
                _ => "-".into(),
            };
            slopes.push(format!(
                "{stack} {}: {} vs 1 {}, {} vs 2 {}, {} vs 4 {}",
                if tls { "tls" } else { "plain" },
                s.max,
                ratio(s.max, 1),
                s.max,
                ratio(s.max, 2),
                s.max,
                ratio(s.max, 4)
            ));
        }
    }
    for l in slopes {
        println!("{l}");
    }
}

fn run_seed(s: &Setup) {
    let n = s.max;
    let shapes = [(1u16, s.seed_jobs), (128u16, 8usize)];
    println!();
    println!(
        "the seed's shapes: 4 KiB randwrite, {n} reactor(s) a side, one controller; {} run(s) a cell (each run, \
         then the median)",
        s.runs
    );
    println!("| shape | target | initiator | mode | runs | median | vs best mode |");
    println!("|---|---|---|---|---|---|---|");
    for (qd, jobs) in shapes {
        for tls in [false, true] {
            let sec = if tls { " tls" } else { "" };
            let label = format!("qd{qd} x {jobs}{sec}");
            let rows = ours_embedded(s, n, qd, jobs, tls, "all", s.runs);
            print_modes(&label, "ours", "ours", &rows);
            if let Some(spdk) = &s.spdk {
                if let Some(_t) = SpdkTarget::start(s, spdk, n) {
                    let rows = ours_on_spdk(s, n, qd, jobs, tls);
                    print_modes(&label, "SPDK", "ours", &rows);
                    // spdk_nvme_perf: the jobs spread over its n cores, qd each.
                    let per_core = jobs.div_ceil(n);
                    let runs: Vec<f64> = (0..s.runs)
                        .filter_map(|_| spdk_perf(s, spdk, n, qd, per_core, tls))
                        .collect();
                    print_modes(&label, "SPDK", "SPDK", &[("-".to_string(), runs)]);
                }
            }
        }
    }
}

fn print_modes(label: &str, target: &str, initiator: &str, rows: &[(String, Vec<f64>)]) {
    let best = rows
        .iter()
        .filter_map(|(_, r)| median(r))
        .fold(0.0f64, f64::max);
    if rows.is_empty() {
        println!("| {label} | {target} | {initiator} | - | failed | - | - |");
    }
    for (mode, runs) in rows {
        let m = median(runs);
        let each: Vec<String> = runs.iter().map(|&x| fmt_iops(Some(x))).collect();
        let vs = match m {
            Some(x) if best > 0.0 => format!("{:.3}", x / best),
            _ => "-".into(),
        };
        println!(
            "| {label} | {target} | {initiator} | {mode} | {} | {} | {vs} |",
            each.join(" "),
            fmt_iops(m)
        );
    }
}

//! What idle connections cost a target: one measured host beside N connected queues that send nothing.
//!
//! For N = 0, 64, 256 and 1024 (NVPOLL_CONN_COUNTS), a holder process (this binary, re-run with `--hold`)
//! connects N I/O queues to the target, 128 per controller as a 128-CPU Linux host's nvme-tcp would, and then
//! blocks: it costs the machine no CPU while the measurement runs. Our `perf` then measures 4 KiB random
//! writes on another controller of the same subsystem, at qd1 on one queue and at qd32 on eight, with the
//! target on one core and perf on another. Targets: ours (`nvpoll-target`, one reactor) and, with
//! SPDK_DIR, SPDK's nvmf_tgt (`--no-huge -s 4096`, one core), each restarted for every cell. Rounds
//! interleave everything (N, target); the table gives each cell's median IOPS and its ratio to N = 0 on the
//! same target and shape, the median of the per-round ratios with their spread (min-max).
//!
//! `cargo bench --bench connections`. Knobs (environment): NVPOLL_BENCH_TIME (3s per run), NVPOLL_BENCH_WARMUP
//! (1s), NVPOLL_BENCH_RUNS (3 rounds), NVPOLL_CONN_COUNTS ("0 64 256 1024"), NVPOLL_BIN_DIR (built
//! `nvpoll-perf` and `nvpoll-target`; default: those cargo builds for this bench), SPDK_DIR (an SPDK v26.05
//! build; never built here), SPDK_URING_DIR (an SPDK build configured `--with-uring`: its nvmf_tgt with the
//! uring socket implementation, SPDK's io_uring anchor, as a third target). The target runs on the last core,
//! perf on core 0: it needs two cores.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nvpoll::spec::{fabrics, reg, Cc, ConnectData, Cqe, Sqe};
use nvpoll_tcp::pdu::{self, Decoded, Digests, Pdu};

const NQN: &str = "nqn.2016-06.io.spdk:conns";
const HOLDER_NQN: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-00000000c0de";
const PERF_NQN: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-00000000beef";
const PORT: u16 = 4610;
/// I/O queues per holder controller (a 128-CPU host's nvme-tcp opens one per CPU).
const PER_CTRL: usize = 128;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--hold") {
        hold(&args[2], args[3].parse().expect("queue count"));
        return;
    }
    run();
}

// ---- the holder ------------------------------------------------------------------------------------------------

/// A blocking NVMe/TCP queue, just enough to connect and stay connected.
struct Queue {
    s: TcpStream,
    rx: Vec<u8>,
    cid: u16,
}

impl Queue {
    fn open(addr: SocketAddr) -> Queue {
        let s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("holder: connect {addr}: {e}"));
        s.set_nodelay(true).expect("nodelay");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let mut q = Queue {
            s,
            rx: Vec::new(),
            cid: 0,
        };
        let mut b = Vec::new();
        pdu::encode_ic_req(
            &mut b,
            &pdu::IcReq {
                pfv: 0,
                hpda: 0,
                digests: Digests::NONE,
                maxr2t: 0,
            },
        );
        q.s.write_all(&b).expect("holder: send ICReq");
        assert!(q.next().is_none(), "holder: expected an ICResp");
        q
    }

    /// The next PDU from the target: an ICResp (`None`) or a completion.
    fn next(&mut self) -> Option<Cqe> {
        let cfg = pdu::DecodeConfig::new(pdu::Direction::ToHost, Digests::NONE, 1 << 20);
        loop {
            let got = match pdu::decode(&self.rx, &cfg)
                .expect("holder: a valid PDU from the target")
            {
                Decoded::Pdu { pdu, len } => Some((
                    match pdu {
                        Pdu::IcResp(_) => None,
                        Pdu::CapsuleResp { cqe } => Some(cqe),
                        other => panic!("holder: unexpected {} from the target", other.pdu_type()),
                    },
                    len,
                )),
                Decoded::Incomplete { .. } => None,
            };
            if let Some((r, len)) = got {
                self.rx.drain(..len);
                return r;
            }
            let mut chunk = [0u8; 4096];
            let n = self.s.read(&mut chunk).expect("holder: receive");
            assert!(n > 0, "holder: the target closed a queue during set-up");
            self.rx.extend_from_slice(&chunk[..n]);
        }
    }

    /// Runs one command with optional in-capsule data; returns its completion, which must be a success.
    fn run(&mut self, mut sqe: Sqe, data: &[u8]) -> Cqe {
        self.cid = self.cid.wrapping_add(1);
        sqe.cid = self.cid;
        sqe.set_sgl(&if data.is_empty() {
            nvpoll::spec::SglDescriptor::transport_data_block(0)
        } else {
            nvpoll::spec::SglDescriptor::in_capsule(0, data.len() as u32)
        });
        let mut b = Vec::new();
        pdu::encode_capsule_cmd(&mut b, &sqe, data, Digests::NONE, 0);
        self.s.write_all(&b).expect("holder: send a command");
        let cqe = self.next().expect("holder: a completion, not an ICResp");
        assert!(
            cqe.status().is_success(),
            "holder: command {:#x} failed: {}",
            sqe.opcode,
            cqe.status()
        );
        cqe
    }

    fn connect(&mut self, qid: u16, cntlid: u16) -> Cqe {
        let cd = ConnectData {
            hostid: [0xc0; 16],
            cntlid,
            subnqn: NQN.into(),
            hostnqn: HOLDER_NQN.into(),
        };
        // KATO 0: no keep-alive, so the controller lives while the holder sleeps.
        self.run(Sqe::fabrics_connect(qid, 31, 0, 0), &cd.to_bytes())
    }
}

/// Connects `n` I/O queues to `addr`, prints "held N", and blocks until its standard input closes.
fn hold(addr: &str, n: usize) {
    raise_nofile(n as u64 + 64);
    let addr: SocketAddr = addr.parse().expect("holder: address");
    let mut held = Vec::new();
    let mut left = n;
    while left > 0 {
        let k = left.min(PER_CTRL);
        let mut admin = Queue::open(addr);
        let cntlid = admin.connect(0, fabrics::CNTLID_DYNAMIC).dw0 as u16;
        let mut cc = Cc(0);
        cc.set_en(true);
        cc.set_iosqes(6);
        cc.set_iocqes(4);
        admin.run(Sqe::property_set(reg::CC, false, u64::from(cc.0)), &[]);
        let deadline = Instant::now() + Duration::from_secs(10);
        while admin.run(Sqe::property_get(reg::CSTS, false), &[]).dw0 & 1 == 0 {
            assert!(Instant::now() < deadline, "holder: CSTS.RDY never came");
            std::thread::sleep(Duration::from_millis(1));
        }
        // Number of Queues, as a host asks for them once the controller is ready.
        let nq = (k as u32 - 1) | (k as u32 - 1) << 16;
        admin.run(Sqe::set_features(0x07, nq), &[]);
        for qid in 1..=k as u16 {
            let mut q = Queue::open(addr);
            q.connect(qid, cntlid);
            held.push(q);
        }
        held.push(admin);
        left -= k;
    }
    println!("held {n}");
    std::io::stdout().flush().expect("stdout");
    // Blocks (no CPU) until the bench closes our standard input; the sockets close with the process.
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    drop(held);
}

/// Raises the soft descriptor limit to at least `want` (up to the hard limit).
fn raise_nofile(want: u64) {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut lim = getrlimit(Resource::Nofile);
    if lim.current.is_some_and(|c| c < want) {
        lim.current = Some(lim.maximum.map_or(want, |m| m.min(want)));
        if let Err(e) = setrlimit(Resource::Nofile, lim) {
            eprintln!("connections: raising the descriptor limit to {want}: {e}");
        }
    }
}

// ---- the bench -------------------------------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq)]
enum Target {
    Ours,
    Spdk,
    /// nvmf_tgt with its uring socket implementation (`sock_set_default_impl uring`).
    SpdkUring,
}

impl Target {
    fn name(self) -> &'static str {
        match self {
            Target::Ours => "ours",
            Target::Spdk => "spdk",
            Target::SpdkUring => "spdk-uring",
        }
    }
}

const SHAPES: [(&str, u32, u32); 2] = [("qd1 x 1", 1, 1), ("qd32 x 8", 32, 8)];

fn env_or(key: &str, default: &str) -> String {
    std::env::var(key).unwrap_or_else(|_| default.to_string())
}

fn run() {
    let ncores = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert!(
        ncores >= 2,
        "connections: needs two cores (target and perf apart)"
    );
    let tcore = ncores - 1;
    let time = env_or("NVPOLL_BENCH_TIME", "3s");
    let warmup = env_or("NVPOLL_BENCH_WARMUP", "1s");
    let rounds: usize = env_or("NVPOLL_BENCH_RUNS", "3")
        .parse()
        .expect("NVPOLL_BENCH_RUNS");
    let counts: Vec<usize> = env_or("NVPOLL_CONN_COUNTS", "0 64 256 1024")
        .split_whitespace()
        .map(|c| c.parse().expect("NVPOLL_CONN_COUNTS: numbers"))
        .collect();
    let dir = match std::env::var_os("NVPOLL_BIN_DIR") {
        Some(d) => PathBuf::from(d),
        // cargo builds the package's binaries for its benches, in the bench profile
        None => Path::new(env!("CARGO_BIN_EXE_nvpoll-perf"))
            .parent()
            .expect("the binaries' folder")
            .to_path_buf(),
    };
    let spdk = std::env::var_os("SPDK_DIR").map(PathBuf::from);
    let spdk_uring = std::env::var_os("SPDK_URING_DIR").map(PathBuf::from);
    let mut targets = vec![Target::Ours];
    if spdk.is_some() {
        targets.push(Target::Spdk);
    }
    if let Some(d) = &spdk_uring {
        let config = std::fs::read_to_string(d.join("mk/config.mk")).unwrap_or_default();
        assert!(
            config.lines().any(|l| l.trim() == "CONFIG_URING?=y"),
            "connections: SPDK_URING_DIR={} is not an SPDK build configured --with-uring (mk/config.mk)",
            d.display()
        );
        targets.push(Target::SpdkUring);
    }
    let work = std::env::temp_dir().join(format!("nvpoll-conns.{}", std::process::id()));
    std::fs::create_dir_all(&work).expect("work folder");
    raise_nofile(8192);
    println!(
        "connections: target on core {tcore}, perf on core 0; {time} per run after {warmup}, {rounds} round(s); \
         N = {counts:?} idle I/O queues ({PER_CTRL} per controller) held by another process; {}",
        match (&spdk, &spdk_uring) {
            (None, None) => "ours only (SPDK_DIR not set)",
            (Some(_), None) => "ours and SPDK's nvmf_tgt",
            (None, Some(_)) => "ours and SPDK's nvmf_tgt on io_uring",
            (Some(_), Some(_)) => "ours and SPDK's nvmf_tgt, posix and io_uring sockets",
        }
    );
    // iops[target][count][shape][round]
    let mut iops = vec![vec![vec![Vec::new(); SHAPES.len()]; counts.len()]; targets.len()];
    for round in 0..rounds {
        for (ci, &n) in counts.iter().enumerate() {
            for (ti, &t) in targets.iter().enumerate() {
                let spdk_dir = match t {
                    Target::SpdkUring => spdk_uring.as_deref(),
                    _ => spdk.as_deref(),
                };
                let target = start_target(t, &dir, spdk_dir, &work, tcore);
                let holder = (n > 0).then(|| start_holder(n));
                for (si, &(shape, qd, jobs)) in SHAPES.iter().enumerate() {
                    let v = measure(&dir, &time, &warmup, qd, jobs);
                    println!(
                        "  round {} {} N={n} {shape}: {}",
                        round + 1,
                        t.name(),
                        v.map_or("fail".into(), |v| format!("{v:.0}"))
                    );
                    iops[ti][ci][si].push(v);
                }
                if let Some(mut h) = holder {
                    drop(h.0.stdin.take());
                    let _ = h.0.wait();
                }
                drop(target);
            }
        }
    }
    println!();
    println!("| target | idle queues | shape    |    IOPS | vs N=0 | spread (min-max) |");
    println!("|--------|-------------|----------|---------|--------|------------------|");
    for (ti, t) in targets.iter().enumerate() {
        for (si, &(shape, _, _)) in SHAPES.iter().enumerate() {
            for (ci, &n) in counts.iter().enumerate() {
                let runs = &iops[ti][ci][si];
                let base = &iops[ti][0][si];
                let ratios: Vec<f64> = runs
                    .iter()
                    .zip(base)
                    .filter_map(|(a, b)| Some(a.as_ref()? / b.as_ref()?))
                    .collect();
                let ok: Vec<f64> = runs.iter().flatten().copied().collect();
                let (lo, hi) = min_max(&ratios);
                println!(
                    "| {:6} | {n:11} | {shape:8} | {:>7} | {:>6} | {:>16} |",
                    t.name(),
                    median(&ok).map_or("fail".into(), |m| format!("{m:.0}")),
                    median(&ratios).map_or("-".into(), |m| format!("{m:.2}")),
                    if ratios.len() > 1 {
                        format!("{lo:.2}-{hi:.2}")
                    } else {
                        "-".into()
                    }
                );
            }
        }
    }
    let _ = std::fs::remove_dir_all(&work);
}

fn median(v: &[f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    Some(if s.len() % 2 == 1 {
        s[s.len() / 2]
    } else {
        (s[s.len() / 2 - 1] + s[s.len() / 2]) / 2.0
    })
}

fn min_max(v: &[f64]) -> (f64, f64) {
    v.iter()
        .fold((f64::MAX, f64::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)))
}

/// A child process that is stopped when dropped (a panic included), so that no target outlives the bench
/// and answers on its port in the next cell.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        stop(&mut self.0);
    }
}

fn start_target(t: Target, dir: &Path, spdk: Option<&Path>, work: &Path, core: usize) -> Proc {
    assert!(
        TcpStream::connect(("127.0.0.1", PORT)).is_err(),
        "something already listens on 127.0.0.1:{PORT} (a target left over?): stop it first"
    );
    // Queues for the holder's controllers and perf's, with room to spare.
    let max_io = PER_CTRL.max(8) + 1;
    let child = match t {
        Target::Ours => {
            let conf = work.join("ours.json");
            std::fs::write(
                &conf,
                format!(
                    r#"{{ "listeners": [ {{ "address": "127.0.0.1:{PORT}", "tls": "off" }} ],
  "subsystems": [ {{ "nqn": "{NQN}", "allow_any_host": true, "max_io_queues": {max_io},
    "namespaces": [ {{ "ram": "256M", "block_size": 512 }} ] }} ] }}"#
                ),
            )
            .expect("config");
            Command::new(dir.join("nvpoll-target"))
                .args([
                    "--config",
                    conf.to_str().expect("path"),
                    "--cores",
                    &core.to_string(),
                ])
                .stdout(Stdio::null())
                .stderr(Stdio::from(
                    std::fs::File::create(work.join("ours.log")).expect("log"),
                ))
                .spawn()
                .expect("start our target")
        }
        Target::Spdk | Target::SpdkUring => {
            let conf = work.join("spdk.json");
            let sock = if t == Target::SpdkUring {
                r#"{ "subsystem": "sock", "config": [ { "method": "sock_set_default_impl",
      "params": { "impl_name": "uring" } } ] },"#
            } else {
                ""
            };
            std::fs::write(
                &conf,
                format!(
                    r#"{{ "subsystems": [ {sock}
  {{ "subsystem": "bdev", "config": [ {{ "method": "bdev_malloc_create",
      "params": {{ "name": "Malloc0", "num_blocks": 524288, "block_size": 512 }} }} ] }},
  {{ "subsystem": "nvmf", "config": [
    {{ "method": "nvmf_create_transport", "params": {{ "trtype": "TCP", "max_io_qpairs_per_ctrlr": {max_io},
        "max_queue_depth": 128 }} }},
    {{ "method": "nvmf_create_subsystem", "params": {{ "nqn": "{NQN}", "allow_any_host": true,
        "serial_number": "SPDK00000000000001" }} }},
    {{ "method": "nvmf_subsystem_add_ns", "params": {{ "nqn": "{NQN}", "namespace": {{ "bdev_name": "Malloc0" }} }} }},
    {{ "method": "nvmf_subsystem_add_listener", "params": {{ "nqn": "{NQN}", "listen_address": {{
        "trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1", "trsvcid": "{PORT}" }} }} }} ] }} ] }}"#
                ),
            )
            .expect("config");
            let bin = spdk
                .expect("SPDK_DIR or SPDK_URING_DIR")
                .join("build/bin/nvmf_tgt");
            Command::new(bin)
                .args([
                    "-m",
                    &format!("{:#x}", 1u64 << core),
                    "--no-huge",
                    "-s",
                    "4096",
                ])
                .args(["--json", conf.to_str().expect("path")])
                .args(["-r", work.join("spdk.sock").to_str().expect("path")])
                .stdout(Stdio::from(
                    std::fs::File::create(work.join("spdk.log")).expect("log"),
                ))
                .stderr(Stdio::null())
                .spawn()
                .expect("start nvmf_tgt")
        }
    };
    let mut child = Proc(child);
    let deadline = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect(("127.0.0.1", PORT)).is_err() {
        assert!(
            child.0.try_wait().expect("wait").is_none(),
            "{}: the target exited (its log is in {})",
            t.name(),
            work.display()
        );
        assert!(
            Instant::now() < deadline,
            "{}: nothing listens on {PORT}",
            t.name()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    child
}

fn stop(c: &mut Child) {
    // SIGTERM (the targets print their counters and exit), then SIGKILL after a grace period.
    if let Ok(Some(_)) = c.try_wait() {
        return;
    }
    let pid = c.id().to_string();
    // It may exit between the look and the signal: kill's complaint then says nothing useful.
    let _ = Command::new("kill")
        .args(["-TERM", &pid])
        .stderr(std::process::Stdio::null())
        .status();
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = c.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = c.kill();
    let _ = c.wait();
}

fn start_holder(n: usize) -> Proc {
    let exe = std::env::current_exe().expect("this binary");
    let mut h = Proc(
        Command::new(exe)
            .args(["--hold", &format!("127.0.0.1:{PORT}"), &n.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the holder"),
    );
    let mut line = String::new();
    let mut out = h.0.stdout.take().expect("holder stdout");
    let mut b = [0u8; 1];
    while !line.ends_with('\n') {
        match out.read(&mut b) {
            Ok(1) => line.push(b[0] as char),
            _ => panic!("the holder ended before it held {n} queues: {line}"),
        }
    }
    assert_eq!(line.trim(), format!("held {n}"), "the holder said: {line}");
    h
}

fn measure(dir: &Path, time: &str, warmup: &str, qd: u32, jobs: u32) -> Option<f64> {
    let out = Command::new(dir.join("nvpoll-perf"))
        .args([
            "--trid",
            &format!("trtype:tcp traddr:127.0.0.1 trsvcid:{PORT} subnqn:{NQN}"),
            "--hostnqn",
            PERF_NQN,
            "--workload",
            "randwrite",
            "--io-size",
            "4k",
            "--qd",
            &qd.to_string(),
            "--jobs",
            &jobs.to_string(),
            "--time",
            time,
            "--warmup",
            warmup,
            "--runs",
            "1",
            "--send-mode",
            "adaptive",
            "--cores",
            "0",
            "--json",
            "--quiet",
        ])
        .output()
        .expect("run perf");
    let text = String::from_utf8_lossy(&out.stdout);
    let at = text.find("\"iops\":")? + 7;
    let num: String = text[at..]
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    if !out.status.success() {
        eprintln!(
            "  perf failed: {}",
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        );
        return None;
    }
    num.parse().ok()
}

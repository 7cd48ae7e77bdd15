//! fio through the engine against our NVMe/TCP target (in this process, on its own reactor): verify jobs
//! plain and with TLS, the seed's two shapes (briefly), the knobs people use, a target that dies and comes
//! back mid-job, and the inputs the engine must refuse.
//!
//! Needs fio and the engine built with fio's headers (scripts/fio-source.sh); without them each test says so
//! and passes, except under CI=true, where that is a failure.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use nvpoll::reactor::{CoreList, IdlePolicy, Reactors};
use nvpoll_target::{Backing, SubsystemConfig, Target, TargetConfig, TargetHandle, TargetTls};
use nvpoll_tcp::tls::ConfiguredKey;

const NQN: &str = "nqn.2024-01.io.nvpoll:fio";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-0000000f10e0";
const KEY: &str = "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:";

/// The engine library cargo built with this test (next to its binary, in deps/), or why the test cannot run.
fn engine() -> Option<PathBuf> {
    let why = if nvpoll_fio::built_for().is_none() {
        "the engine was built without fio's headers (run scripts/fio-source.sh)".to_string()
    } else if Command::new("fio").arg("--version").output().is_err() {
        "fio is not installed".to_string()
    } else {
        let exe = std::env::current_exe().expect("test binary path");
        let so = exe
            .parent()
            .map(|d| d.join("libnvpoll_fio.so"))
            .expect("the test binary's folder");
        if so.is_file() {
            return Some(so);
        }
        format!("{} is not built", so.display())
    };
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("fio engine test cannot run under CI: {why}");
    }
    eprintln!("SKIP: {why}");
    None
}

struct TestTarget {
    addr: SocketAddr,
    handle: TargetHandle,
    reactors: Option<Reactors>,
}

impl TestTarget {
    fn start(tls: bool, backing: Backing, block_size: u32, listen: SocketAddr) -> TestTarget {
        let subsystem = SubsystemConfig::new(NQN).namespace(backing, block_size);
        let mut config = TargetConfig::new(listen).subsystem(subsystem);
        if tls {
            let key = ConfiguredKey::parse(KEY).unwrap();
            config.tls = Some(TargetTls::with_host_keys(
                true,
                &[(HOSTNQN.to_string(), key)],
                &[NQN.to_string()],
            ));
        }
        let target = Target::bind(config).expect("bind the target");
        let reactors = Reactors::builder()
            .idle(IdlePolicy::Poll)
            .start(&last_core())
            .expect("reactors");
        let handle = target.start(&reactors).expect("start the target");
        TestTarget {
            addr: handle.local_addr(),
            handle,
            reactors: Some(reactors),
        }
    }

    fn ram(tls: bool) -> TestTarget {
        Self::start(
            tls,
            Backing::Ram(64 << 20),
            512,
            "127.0.0.1:0".parse().unwrap(),
        )
    }

    fn filename(&self) -> String {
        filename(self.addr, 1)
    }

    fn stop(mut self) {
        self.handle.stop();
        if let Some(r) = self.reactors.take() {
            r.stop().expect("stop the target's reactors");
        }
    }
}

impl Drop for TestTarget {
    fn drop(&mut self) {
        self.handle.stop();
        if let Some(r) = self.reactors.take() {
            if let Err(e) = r.stop() {
                eprintln!("stopping the target's reactors: {e}");
            }
        }
    }
}

/// The filename of namespace `ns` of the test subsystem at `addr`, as a job file writes it.
fn filename(addr: SocketAddr, ns: u32) -> String {
    format!(
        "trtype=tcp adrfam=IPv4 traddr={} trsvcid={} subnqn={} ns={ns}",
        addr.ip(),
        addr.port(),
        NQN.replace(':', "\\:")
    )
}

/// The machine's last core, for the target's reactor (fio's threads run where the scheduler puts them).
fn last_core() -> CoreList {
    let n = std::thread::available_parallelism().map_or(1, |n| n.get());
    (n - 1).to_string().parse().expect("core list")
}

/// A file (mode 0600) removed when dropped.
struct TempFile(PathBuf);

impl TempFile {
    fn with(content: &str) -> TempFile {
        use std::os::unix::fs::PermissionsExt;
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "nvpoll-fio-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&p, content).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        TempFile(p)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_file(&self.0) {
            eprintln!("removing {}: {e}", self.0.display());
        }
    }
}

/// Runs fio with the engine and `args`, bounded in time, saving no verify state.
fn fio(so: &Path, args: &[String]) -> Output {
    Command::new("timeout")
        .args(["-k", "10", "240", "fio", "--thread=1"])
        // fio saves each verify job's state in the current directory (local-NAME-N-verify.state) unless told
        // not to: these jobs need none, and a test leaves nothing in the checkout.
        .arg("--verify_state_save=0")
        .arg(format!("--ioengine=external:{}", so.display()))
        .args(args)
        .output()
        .expect("run fio")
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}\n--- stderr\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// fio's JSON report (`--output-format=json`).
fn report(o: &Output) -> serde_json::Value {
    let out = String::from_utf8_lossy(&o.stdout);
    let start = out
        .find('{')
        .unwrap_or_else(|| panic!("no JSON in fio's output:\n{}", text(o)));
    serde_json::from_str(&out[start..]).unwrap_or_else(|e| panic!("fio JSON: {e}\n{}", text(o)))
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// Every job of the report ended without an error; returns the jobs.
fn jobs_ok(o: &Output) -> Vec<serde_json::Value> {
    assert!(o.status.success(), "fio failed:\n{}", text(o));
    let r = report(o);
    let jobs = r["jobs"].as_array().expect("jobs").clone();
    assert!(!jobs.is_empty(), "no jobs:\n{}", text(o));
    for j in &jobs {
        assert_eq!(j["error"], 0, "job {} failed:\n{}", j["jobname"], text(o));
    }
    jobs
}

fn bytes(j: &serde_json::Value, dir: &str) -> u64 {
    j[dir]["io_bytes"].as_u64().expect("io_bytes")
}

fn verify_job(so: &Path, t: &TestTarget, extra: &[String]) {
    let mut a = args(&[
        "--name=verify",
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=16",
        "--size=16M",
        "--verify=crc32c",
        "--do_verify=1",
        "--output-format=json",
    ]);
    a.push(format!("--hostnqn={HOSTNQN}"));
    a.push(format!("--filename={}", t.filename()));
    a.extend_from_slice(extra);
    let o = fio(so, &a);
    let jobs = jobs_ok(&o);
    // Everything written was read back and checked: the verify phase's reads are the job's reads.
    assert_eq!(bytes(&jobs[0], "write"), 16 << 20, "{}", text(&o));
    assert_eq!(bytes(&jobs[0], "read"), 16 << 20, "{}", text(&o));
}

#[test]
fn verify_passes_plain_in_every_send_mode() {
    let Some(so) = engine() else { return };
    let t = TestTarget::ram(false);
    for mode in ["inline", "deferred", "adaptive"] {
        verify_job(
            &so,
            &t,
            &[format!("--send_mode={mode}"), "--digest=both".into()],
        );
    }
}

#[test]
fn verify_passes_with_tls() {
    let Some(so) = engine() else { return };
    let t = TestTarget::ram(true);
    let psk = TempFile::with(KEY);
    for mode in ["inline", "deferred"] {
        verify_job(
            &so,
            &t,
            &[
                format!("--psk_path={}", psk.0.display()),
                format!("--send_mode={mode}"),
            ],
        );
    }
    // The listener requires TLS: without the key the same job cannot connect, and fio says why.
    let o = fio(
        &so,
        &[
            "--name=nokey".into(),
            "--rw=read".into(),
            "--size=1M".into(),
            format!("--hostnqn={HOSTNQN}"),
            format!("--filename={}", t.filename()),
        ],
    );
    assert!(!o.status.success(), "a plain host got in:\n{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("nvpoll: connecting to"),
        "{}",
        text(&o)
    );
}

#[test]
fn a_pattern_verify_of_data_never_written_fails() {
    // Reads return what the namespace holds: a verify-only pass over a fresh (zeroed) namespace must report
    // mismatches rather than pass.
    let Some(so) = engine() else { return };
    let t = TestTarget::ram(false);
    let job = |verify_only: bool| {
        let mut a = args(&[
            "--name=pattern",
            "--rw=write",
            "--bs=4k",
            "--size=1M",
            "--verify=pattern",
            "--verify_pattern=0x5a5aa5a5",
            "--output-format=json",
        ]);
        if verify_only {
            a.push("--verify_only=1".into());
        }
        a.push(format!("--filename={}", t.filename()));
        fio(&so, &a)
    };
    let o = job(true);
    assert!(
        !o.status.success(),
        "verify of unwritten data passed:\n{}",
        text(&o)
    );
    assert!(text(&o).contains("verify"), "{}", text(&o));
    // Written with the pattern, the same verify passes.
    jobs_ok(&job(false));
    jobs_ok(&job(true));
}

#[test]
fn the_seed_shapes_run_with_tls() {
    let Some(so) = engine() else { return };
    let t = TestTarget::ram(true);
    let psk = TempFile::with(KEY);
    for (depth, jobs) in [(1, 128), (128, 8)] {
        let mut a = args(&[
            "--name=seed",
            "--rw=randwrite",
            "--bs=4k",
            "--direct=1",
            "--time_based",
            "--runtime=1",
            "--output-format=json",
        ]);
        a.push(format!("--iodepth={depth}"));
        a.push(format!("--numjobs={jobs}"));
        a.push(format!("--hostnqn={HOSTNQN}"));
        a.push(format!("--psk_path={}", psk.0.display()));
        a.push(format!("--filename={}", t.filename()));
        let o = fio(&so, &a);
        // Every job ran, each on its own queue pair, and each did I/O.
        let js = jobs_ok(&o);
        assert_eq!(js.len(), jobs, "{}", text(&o));
        for j in &js {
            let ios = j["write"]["total_ios"].as_u64().unwrap();
            assert!(
                ios > 0,
                "qd{depth} x {jobs}: a job did no I/O\n{}",
                text(&o)
            );
        }
    }
}

#[test]
fn the_knobs_people_use_work() {
    let Some(so) = engine() else { return };
    let t = TestTarget::ram(false);
    // randrw with a mix, bssplit, batched submit and reap, offset and size, ramp time, percentiles.
    let mut a = args(&[
        "--name=knobs",
        "--rw=randrw",
        "--rwmixread=70",
        "--bssplit=4k/50:8k/30:16k/20",
        "--iodepth=32",
        "--iodepth_batch_submit=8",
        "--iodepth_batch_complete_min=4",
        "--iodepth_batch_complete_max=16",
        "--offset=8M",
        "--size=16M",
        "--numjobs=2",
        "--time_based",
        "--runtime=1",
        "--ramp_time=1",
        "--percentile_list=50:99:99.9",
        "--group_reporting",
        "--output-format=json",
    ]);
    a.push(format!("--filename={}", t.filename()));
    let o = fio(&so, &a);
    let js = jobs_ok(&o);
    let j = &js[0];
    let (r, w) = (bytes(j, "read"), bytes(j, "write"));
    assert!(r > 0 && w > 0, "randrw moved reads {r} and writes {w}");
    let share = r as f64 / (r + w) as f64;
    assert!(
        (0.5..0.9).contains(&share),
        "rwmixread=70 gave a read share of {share:.2}"
    );
    let p = &j["write"]["clat_ns"]["percentile"];
    assert!(p["99.000000"].as_u64().is_some(), "no p99 in {p}");
}

#[test]
fn two_namespaces_in_one_job_with_flushes_and_trim() {
    let Some(so) = engine() else { return };
    let subsystem = SubsystemConfig::new(NQN)
        .namespace(Backing::Ram(16 << 20), 512)
        .namespace(Backing::Ram(16 << 20), 4096);
    let config = TargetConfig::new("127.0.0.1:0".parse().unwrap()).subsystem(subsystem);
    let target = Target::bind(config).unwrap();
    let reactors = Reactors::builder().start(&last_core()).unwrap();
    let handle = target.start(&reactors).unwrap();
    let addr = handle.local_addr();
    // Each file is a queue pair of its own; fsync= sends Flush commands.
    let mut a = args(&[
        "--name=two",
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=8",
        "--size=8M",
        "--fsync=16",
        "--verify=crc32c",
        "--output-format=json",
    ]);
    a.push(format!(
        "--filename={}:{}",
        filename(addr, 1),
        filename(addr, 2)
    ));
    let o = fio(&so, &a);
    let js = jobs_ok(&o);
    assert_eq!(bytes(&js[0], "write"), 8 << 20, "{}", text(&o));
    assert_eq!(bytes(&js[0], "read"), 8 << 20, "{}", text(&o));
    assert!(
        js[0]["sync"]["total_ios"].as_u64().unwrap() > 0,
        "{}",
        text(&o)
    );
    let trim = fio(
        &so,
        &[
            "--name=trim".into(),
            "--rw=randtrim".into(),
            "--bs=64k".into(),
            "--size=4M".into(),
            "--output-format=json".into(),
            format!("--filename={}", filename(addr, 1)),
        ],
    );
    assert_eq!(bytes(&jobs_ok(&trim)[0], "trim"), 4 << 20);
    handle.stop();
    reactors.stop().unwrap();
}

#[test]
fn bad_input_is_refused_with_a_reason() {
    let Some(so) = engine() else { return };
    let t = TestTarget::start(
        false,
        Backing::Ram(16 << 20),
        4096,
        "127.0.0.1:0".parse().unwrap(),
    );
    let good = format!("--filename={}", t.filename());
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            args(&["--filename=/dev/nvme0n1"]),
            "expected e.g. 'trtype=tcp",
        ),
        (vec![good.clone(), "--thread=0".into()], "needs thread=1"),
        (
            vec![good.clone(), "--bs=512".into()],
            "not a multiple of the namespace's 4096-byte blocks",
        ),
        (
            vec![good.clone(), "--bs=4m".into(), "--size=8M".into()],
            "exceeds the controller's largest transfer",
        ),
        (vec![good.clone(), "--send_mode=eager".into()], "send_mode"),
        (vec![good.clone(), "--digest=md5".into()], "digest=md5"),
        (
            vec![good.clone(), "--filesize=1m".into()],
            "filesize= means nothing here",
        ),
        (
            vec![good.replace("ns=1", "ns=7")],
            "namespace 7 is not active",
        ),
        (
            vec![format!(
                "--filename=trtype=tcp traddr=127.0.0.1 trsvcid=1 subnqn={}",
                NQN.replace(':', "\\:")
            )],
            "connecting to",
        ),
        // A subsystem the target does not have: the refused Connect says so in words.
        (
            vec![good.replace(
                &NQN.replace(':', "\\:"),
                "nqn.2016-06.io.spdk\\:nothere",
            )],
            "Fabrics Connect (admin queue) refused: the target has no subsystem nqn.2016-06.io.spdk:nothere",
        ),
        // An NQN whose colon is not escaped: fio cuts the filename there.
        (
            vec![good.replace(&NQN.replace(':', "\\:"), NQN)],
            "fio splits filenames at every ':' that is not escaped",
        ),
    ];
    for (extra, needle) in cases {
        let mut a = args(&["--name=bad", "--rw=read", "--size=1M"]);
        a.extend(extra);
        let o = fio(&so, &a);
        let all = text(&o);
        assert!(!o.status.success(), "{a:?} was accepted:\n{all}");
        assert!(all.contains(needle), "{a:?}: no '{needle}' in\n{all}");
    }
}

#[test]
fn a_target_that_dies_mid_job_and_comes_back_loses_nothing() {
    // A file-backed namespace survives the target; the job's queue pairs reconnect and retry what was in
    // flight, and fio's verify then reads back every block it was told was written.
    let Some(so) = engine() else { return };
    let path = std::env::temp_dir().join(format!("nvpoll-fio-fault-{}", std::process::id()));
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(64 << 20).unwrap();
    drop(f);
    let t = TestTarget::start(
        false,
        Backing::File(path.clone()),
        512,
        "127.0.0.1:0".parse().unwrap(),
    );
    let addr = t.addr;
    let mut a = args(&[
        "--name=fault",
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=8",
        "--size=24M",
        "--rate_iops=3000",
        "--verify=crc32c",
        "--do_verify=1",
        "--output-format=json",
    ]);
    a.push(format!("--filename={}", t.filename()));
    let so2 = so.clone();
    let run = std::thread::spawn(move || fio(&so2, &a));
    // Kill the target once the job is well under way (a quarter of its 6144 writes done), and start another
    // on the same address and file.
    let deadline = Instant::now() + Duration::from_secs(60);
    while t.handle.counters().writes < 1500 {
        assert!(Instant::now() < deadline, "the job never got going");
        assert!(!run.is_finished(), "fio ended before the fault");
        std::thread::sleep(Duration::from_millis(20));
    }
    let before = t.handle.counters().writes;
    t.stop();
    let t2 = TestTarget::start(false, Backing::File(path.clone()), 512, addr);
    let o = run.join().unwrap();
    let js = jobs_ok(&o);
    assert_eq!(bytes(&js[0], "write"), 24 << 20, "{}", text(&o));
    assert_eq!(bytes(&js[0], "read"), 24 << 20, "{}", text(&o));
    assert!(
        before < 6144 && t2.handle.counters().writes > 0,
        "the fault did not fall mid-job (writes before it: {before})"
    );
    drop(t2);
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn spinning_jobs_beyond_their_cpus_yield_and_say_so_once() {
    let Some(so) = engine() else { return };
    let t = TestTarget::ram(false);
    let run = |jobs: usize| {
        let mut a = args(&[
            "--name=spin",
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=1",
            "--idle=spin",
            "--cpus_allowed=0",
            "--time_based",
            "--runtime=1",
            "--output-format=json",
        ]);
        a.push(format!("--numjobs={jobs}"));
        a.push(format!("--filename={}", t.filename()));
        let o = fio(&so, &a);
        let done = jobs_ok(&o);
        assert_eq!(done.len(), jobs, "{}", text(&o));
        let out =
            String::from_utf8_lossy(&o.stderr).into_owned() + &String::from_utf8_lossy(&o.stdout);
        (done, out)
    };
    // Three spinning jobs on one CPU: said once for the process, not once a job, and the jobs yield: a
    // context switch (fio's `ctx`) at least every few I/Os, where a spinning job switches only when its time
    // slice ends (a few hundred a second against tens of thousands of I/Os).
    let (done, out) = run(3);
    let advice = "idle=spin with 3 jobs on 1 CPU";
    assert_eq!(out.matches(advice).count(), 1, "{out}");
    assert!(out.contains("yield between empty polls instead"), "{out}");
    for j in &done {
        let ios = j["write"]["total_ios"].as_u64().expect("total_ios");
        let ctx = j["ctx"].as_u64().expect("ctx");
        assert!(
            ios > 0 && ctx * 4 >= ios,
            "job {}: {ctx} context switches for {ios} I/Os: it did not yield",
            j["jobname"]
        );
    }
    // One job on its CPU: nothing to advise.
    let (_, out) = run(1);
    assert!(!out.contains("idle=spin with"), "{out}");
}

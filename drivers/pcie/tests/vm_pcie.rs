//! The PCIe driver against QEMU's NVMe controller behind an emulated IOMMU, in the guest of `scripts/vm.sh`
//! (run by `scripts/vm-test.sh`). Outside the guest every test prints a skip notice and passes.
//!
//! - identify on the vfio-bound controller matches `nvme id-ctrl`/`id-ns` on its kernel-driven twin;
//! - write/read/verify from 512 bytes to MDTS in every PRP shape, at dword-aligned buffer offsets;
//! - several queue pairs on two reactors at queue depth 1 and 128, with IOPS printed for the record.

use std::process::Command;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nvpoll::api::{Controller, IoOp, IoRequest, QueuePair};
use nvpoll::mem::{DmaBuf, DmaPool};
use nvpoll::reactor::{CoreList, PollStatus, ReactorContext, Reactors};
use nvpoll::spec::{reg, Csts};
use nvpoll::trid::PciAddress;
use nvpoll_pcie::vfio::VfioDevice;
use nvpoll_pcie::{Device, PcieController, PcieOptions, PcieQueuePair, QueueOptions};

/// True inside the test guest; otherwise prints the skip notice.
fn in_vm() -> bool {
    if std::env::var_os("NVPOLL_VM").is_some() {
        return true;
    }
    println!("skipping: needs the QEMU guest (run scripts/vm-test.sh)");
    false
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!("{name} is not set: NVPOLL_VM=1 outside the scripts/vm.sh guest?")
    })
}

fn bdf() -> PciAddress {
    env("VM_VFIO_BDF")
        .parse()
        .expect("VM_VFIO_BDF is a PCI address")
}

fn pool() -> DmaPool {
    DmaPool::builder()
        .class(4096, 1024)
        .class(1 << 20, 8)
        .build()
        .expect("DMA pool")
}

fn open(pool: &DmaPool) -> PcieController {
    PcieController::open(bdf(), pool.clone(), PcieOptions::default())
        .unwrap_or_else(|e| panic!("opening {}: {e}", bdf()))
}

/// `field : value` lines of nvme-cli's plain output.
fn nvme_cli(args: &[&str]) -> Vec<(String, String)> {
    let out = Command::new("nvme")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running nvme {args:?}: {e}"));
    assert!(
        out.status.success(),
        "nvme {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(':')?;
            Some((k.trim().to_string(), v.trim().to_string()))
        })
        .collect()
}

fn field<'a>(fields: &'a [(String, String)], name: &str) -> &'a str {
    fields
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
        .unwrap_or_else(|| panic!("nvme-cli printed no {name}"))
}

fn num(s: &str) -> u64 {
    match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16).unwrap(),
        None => s
            .parse()
            .unwrap_or_else(|_| panic!("{s:?} is not a number")),
    }
}

#[test]
fn vm_pcie_identify_matches_the_kernel_twin() {
    if !in_vm() {
        return;
    }
    let pool = pool();
    let ctrl = open(&pool);
    let dev = ctrl.device();
    // VFIO facts: bus mastering is on, the IOMMU reports 4 KiB pages, DMA is mapped at IOVA = VA.
    let cmd = dev.pci_command().unwrap();
    assert_eq!(
        cmd & 0b110,
        0b110,
        "memory space and bus master are on: {cmd:#x}"
    );
    assert!(dev.iommu().page_sizes & 4096 != 0, "{:?}", dev.iommu());
    let region = pool.regions()[0];
    assert_eq!(region.iova, region.vaddr as u64, "IOVA = VA");
    assert!(dev.mapped().contains(&(region.iova, region.len as u64)));
    assert!(Csts(dev.read32(reg::CSTS as usize)).rdy());
    assert_eq!(dev.bar().len(), 16 * 1024);
    println!("VFIO group {}, IOMMU {:?}", dev.group(), dev.iommu());

    let knvme = env("VM_KNVME_DEV");
    let kc = nvme_cli(&["id-ctrl", &knvme]);
    let id = ctrl.identify();
    println!(
        "ours: mn {:?} sn {:?} fr {:?} mdts {} ver {}",
        id.model, id.serial, id.firmware, id.mdts, id.ver
    );
    assert_eq!(id.model, field(&kc, "mn"));
    assert_eq!(id.firmware, field(&kc, "fr"));
    assert_eq!(u64::from(id.mdts), num(field(&kc, "mdts")));
    assert_eq!(u64::from(id.vid), num(field(&kc, "vid")));
    assert_eq!(u64::from(id.ver.0), num(field(&kc, "ver")));
    assert_eq!(u64::from(id.nn), num(field(&kc, "nn")));
    assert_eq!(u64::from(id.oncs), num(field(&kc, "oncs")));
    assert_eq!(u64::from(id.sqes), num(field(&kc, "sqes")));
    assert_eq!(u64::from(id.cqes), num(field(&kc, "cqes")));
    assert_eq!(
        id.serial,
        "NVPOLLVFIO",
        "the vfio twin's serial (the kernel's is {})",
        field(&kc, "sn")
    );
    assert_eq!(ctrl.max_transfer(), Some(4096 << id.mdts));
    assert_eq!(ctrl.cap().max_queue_entries(), 2048);
    assert_eq!(ctrl.cap().dstrd(), 0);
    assert_eq!(ctrl.vs().to_string(), "1.4.0");

    let kn = nvme_cli(&["id-ns", &knvme]);
    let ns = &ctrl.namespaces()[0];
    assert_eq!(ns.nsid, 1);
    assert_eq!(ns.blocks, num(field(&kn, "nsze")));
    // The LBA format in use: "lbaf  0 : ms:0   lbads:9  rp:0 (in use)".
    let in_use = kn
        .iter()
        .find(|(k, v)| k.starts_with("lbaf") && v.contains("in use"))
        .map(|(_, v)| v.clone())
        .expect("an LBA format in use");
    let lbads: u32 = in_use
        .split_whitespace()
        .find_map(|w| w.strip_prefix("lbads:"))
        .and_then(|v| v.parse().ok())
        .expect("lbads");
    assert_eq!(ns.block_size, 1 << lbads);
    assert_eq!(ns.block_size, 512);
    println!(
        "identify matches the kernel twin: {} mdts {} ({} KiB transfers), ns 1: {} blocks of {}",
        id.model,
        id.mdts,
        ctrl.max_transfer().unwrap() >> 10,
        ns.blocks,
        ns.block_size
    );
    ctrl.shutdown().unwrap();
}

fn fill(buf: &mut DmaBuf, seed: u64) {
    for (i, chunk) in buf.as_mut_slice().chunks_mut(8).enumerate() {
        let v = (seed ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

fn run_one(qp: &mut PcieQueuePair, req: IoRequest) -> DmaBuf {
    let what = format!("{:?} lba {} x{}", req.op, req.lba, req.blocks);
    qp.submit(req)
        .unwrap_or_else(|r| panic!("{what}: {}", r.error));
    qp.flush().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        qp.poll(8).unwrap();
        if let Some(c) = qp.pop_completion() {
            c.result.unwrap_or_else(|e| panic!("{what}: {e}"));
            return c.buf.expect("buffer back");
        }
        assert!(Instant::now() < deadline, "{what}: no completion in 30 s");
    }
}

#[test]
fn vm_pcie_write_read_verify_every_prp_shape() {
    if !in_vm() {
        return;
    }
    let pool = pool();
    let mut ctrl = open(&pool);
    let mdts = ctrl.max_transfer().unwrap() as usize;
    let nsid = ctrl.namespaces()[0].nsid;
    let mut plain = ctrl.create_queue_pair(8).unwrap();
    // Lists that start 256 bytes before the end of their page: a 128-entry list chains into a second page.
    let mut chained = ctrl
        .create_queue_pair_with(QueueOptions {
            prp_list_offset: 4096 - 256,
            ..QueueOptions::new(4)
        })
        .unwrap();
    // One SGL data block per command (QEMU reports SGLS 01b: any byte alignment).
    let mut sgl = ctrl
        .create_queue_pair_with(QueueOptions {
            sgl: true,
            ..QueueOptions::new(4)
        })
        .unwrap();
    let mut sizes = vec![
        512,
        1024,
        4096,
        4096 + 512,
        8192,
        12288,
        16384,
        65536,
        128 * 1024,
    ];
    sizes.extend([mdts - 4096, mdts - 512, mdts]);
    let mut lba = 2048u64;
    let mut checked = 0;
    for (q, qp) in [&mut plain, &mut chained, &mut sgl].into_iter().enumerate() {
        let offsets: &[usize] = if q == 2 {
            &[0, 1, 3, 4, 4093]
        } else {
            &[0, 4, 512, 2048 + 4, 4092]
        };
        for &len in &sizes {
            for &off in offsets {
                let blocks = (len / 512) as u32;
                let mut w = pool.alloc(off + len).unwrap();
                w.set_window(off, len).unwrap();
                fill(&mut w, lba * 31 + off as u64);
                let expect = w.as_slice().to_vec();
                let write = IoRequest {
                    op: IoOp::Write,
                    nsid,
                    lba,
                    blocks,
                    buf: Some(w),
                    tag: 1,
                };
                drop(run_one(qp, write));
                let mut r = pool.alloc(off + len).unwrap();
                r.as_mut_slice().fill(0x5a);
                r.set_window(off, len).unwrap();
                let read = IoRequest {
                    op: IoOp::Read,
                    nsid,
                    lba,
                    blocks,
                    buf: Some(r),
                    tag: 2,
                };
                let got = run_one(qp, read);
                assert!(
                    got.as_slice() == &expect[..],
                    "queue {q}: {len} bytes at buffer offset {off} (lba {lba}) read back differently"
                );
                lba += u64::from(blocks);
                checked += 1;
            }
        }
    }
    let (p, c, g) = (plain.stats(), chained.stats(), sgl.stats());
    println!(
        "verified {checked} transfers of 512 B to {} KiB; plain queue: {p:?}; chained-list queue: {c:?}; \
         SGL queue: {g:?}",
        mdts >> 10
    );
    assert_eq!((g.sgls, g.prp_lists), (g.submitted, 0));
    assert!(p.prp_lists > 0 && p.prp_chained == 0);
    assert!(c.prp_chained > 0, "the offset lists chained");
    assert_eq!(
        p.sq_doorbells, p.submitted,
        "one doorbell per flush, one command per flush here"
    );
    // Write zeroes and flush.
    let wz = IoRequest {
        op: IoOp::WriteZeroes,
        nsid,
        lba: 2048,
        blocks: 8,
        buf: None,
        tag: 3,
    };
    plain.submit(wz).unwrap();
    plain
        .submit(IoRequest {
            op: IoOp::Flush,
            nsid,
            lba: 0,
            blocks: 0,
            buf: None,
            tag: 4,
        })
        .unwrap();
    plain.flush().unwrap();
    let mut n = 0;
    while n < 2 {
        n += plain
            .process_completions(8, |_, c| c.result.unwrap())
            .unwrap();
    }
    let got = run_one(
        &mut plain,
        IoRequest {
            op: IoOp::Read,
            nsid,
            lba: 2048,
            blocks: 8,
            buf: Some(pool.alloc(4096).unwrap()),
            tag: 5,
        },
    );
    assert!(got.iter().all(|&b| b == 0), "write zeroes zeroed");
    // Deallocate (Dataset Management): QEMU's NVMe has it (ONCS bit 2); what the range reads as afterwards
    // is its Identify Namespace's DLFEAT to say.
    assert_ne!(
        ctrl.identify().oncs & nvpoll::spec::IdentifyController::ONCS_DSM,
        0
    );
    let (cqe, page) = ctrl
        .admin(
            nvpoll::spec::Sqe::identify(nvpoll::spec::cns::NAMESPACE, nsid),
            Some(pool.alloc(4096).unwrap()),
        )
        .unwrap();
    assert!(cqe.status().is_success());
    let dlfeat = nvpoll::spec::IdentifyNamespace::parse(page.unwrap().as_slice())
        .unwrap()
        .dlfeat;
    let mut w = pool.alloc(4096).unwrap();
    w.as_mut_slice().fill(0xa5);
    let wr = IoRequest {
        op: IoOp::Write,
        nsid,
        lba: 3072,
        blocks: 8,
        buf: Some(w),
        tag: 6,
    };
    run_one(&mut plain, wr);
    let trim = IoRequest {
        op: IoOp::Deallocate,
        nsid,
        lba: 3074,
        blocks: 4,
        buf: Some(pool.alloc(4096).unwrap()),
        tag: 7,
    };
    run_one(&mut plain, trim);
    let rd = IoRequest {
        op: IoOp::Read,
        nsid,
        lba: 3072,
        blocks: 8,
        buf: Some(pool.alloc(4096).unwrap()),
        tag: 8,
    };
    let got = run_one(&mut plain, rd);
    let bs = 512;
    assert!(got[..2 * bs].iter().all(|&b| b == 0xa5) && got[6 * bs..].iter().all(|&b| b == 0xa5));
    // Deallocation is advisory: each block of the range was either deallocated (and reads as DLFEAT says:
    // zeroes for 001b) or kept. QEMU keeps ranges smaller than its discard granularity.
    let mut forgotten = 0;
    for block in got[2 * bs..6 * bs].chunks(bs) {
        if block.iter().all(|&b| b == 0) && dlfeat & 7 == 1 {
            forgotten += 1;
        } else {
            assert!(
                block.iter().all(|&b| b == 0xa5),
                "a deallocated block reads as neither its data nor what DLFEAT {dlfeat:#x} says"
            );
        }
    }
    println!("deallocate: DLFEAT {dlfeat:#x}, {forgotten} of 4 blocks deallocated");
    drop((plain, chained, sgl));
    assert!(!ctrl.poll_admin().unwrap());
    assert_eq!(ctrl.stats().queues_deleted, 3);
}

/// One queue pair's job on a reactor: write `count` 4 KiB blocks at queue depth `qd`, then read them back
/// and verify, timing the read phase.
struct Job {
    qp: PcieQueuePair,
    pool: DmaPool,
    nsid: u32,
    base_lba: u64,
    count: u64,
    qd: usize,
    issued: u64,
    done: u64,
    reading: bool,
    read_start: Option<Instant>,
    tx: Option<mpsc::Sender<Result<JobResult, String>>>,
    seed: u64,
}

#[derive(Debug)]
struct JobResult {
    reads: u64,
    read_time: Duration,
    doorbells: u64,
    submitted: u64,
}

impl Job {
    fn lba(&self, i: u64) -> u64 {
        // A stride that visits every slot once, in a scattered order.
        self.base_lba + ((i * 7919) % self.count) * 8
    }
}

fn pattern_check(buf: &DmaBuf, seed: u64, lba: u64) -> bool {
    let want = seed ^ lba;
    buf.chunks(8)
        .all(|c| u64::from_le_bytes(c.try_into().unwrap()) == want)
}

fn poll_job(job: &mut Job) -> PollStatus {
    if job.tx.is_none() {
        return PollStatus::Idle;
    }
    let seed = job.seed;
    let mut failures = Vec::new();
    let mut finished = 0u64;
    let reading = job.reading;
    let res = job.qp.process_completions(128, |_, c| {
        finished += 1;
        match (c.result, c.buf) {
            (Ok(()), Some(buf)) => {
                if reading && !pattern_check(&buf, seed, c.tag) {
                    failures.push(format!("lba {}: data differs", c.tag));
                }
            }
            (Err(e), _) => failures.push(format!("lba {}: {e}", c.tag)),
            (Ok(()), None) => failures.push("no buffer".into()),
        }
    });
    let fail = |job: &mut Job, msg: String| {
        if let Some(tx) = job.tx.take() {
            let _ = tx.send(Err(msg));
        }
        PollStatus::Idle
    };
    if let Err(e) = res {
        return fail(job, format!("queue {}: {e}", job.qp.qid()));
    }
    if let Some(f) = failures.into_iter().next() {
        return fail(job, format!("queue {}: {f}", job.qp.qid()));
    }
    job.done += finished;
    if job.done == job.count && !job.reading {
        job.reading = true;
        job.issued = 0;
        job.done = 0;
        job.read_start = Some(Instant::now());
    } else if job.done == job.count {
        let s = job.qp.stats();
        let r = JobResult {
            reads: job.count,
            read_time: job.read_start.unwrap().elapsed(),
            doorbells: s.sq_doorbells,
            submitted: s.submitted,
        };
        if let Some(tx) = job.tx.take() {
            let _ = tx.send(Ok(r));
        }
        return PollStatus::Busy;
    }
    while job.qp.outstanding() < job.qd && job.issued < job.count {
        let lba = job.lba(job.issued);
        let mut buf = match job.pool.alloc(4096) {
            Ok(b) => b,
            Err(e) => return fail(job, e.to_string()),
        };
        let op = if job.reading {
            IoOp::Read
        } else {
            let v = (seed ^ lba).to_le_bytes();
            buf.chunks_mut(8).for_each(|c| c.copy_from_slice(&v));
            IoOp::Write
        };
        let req = IoRequest {
            op,
            nsid: job.nsid,
            lba,
            blocks: 8,
            buf: Some(buf),
            tag: lba,
        };
        if let Err(r) = job.qp.submit(req) {
            return fail(job, format!("submit: {}", r.error));
        }
        job.issued += 1;
    }
    // The kick: one doorbell for everything posted in this iteration.
    if let Err(e) = job.qp.flush() {
        return fail(job, e.to_string());
    }
    if finished > 0 {
        PollStatus::Busy
    } else {
        PollStatus::Idle
    }
}

#[test]
fn vm_pcie_queue_pairs_on_two_reactors_at_qd1_and_qd128() {
    if !in_vm() {
        return;
    }
    let pool = DmaPool::builder().class(4096, 2048).build().expect("pool");
    let mut ctrl = open(&pool);
    let nsid = ctrl.namespaces()[0].nsid;
    let cores: CoreList = "0,1".parse().unwrap_or_else(|_| CoreList::all());
    let reactors = Reactors::start(&cores).expect("reactors");
    let nreact = reactors.len();
    let counts = std::env::var("NVPOLL_VM_PCIE_IOS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4000u64);
    let mut report = Vec::new();
    let mut region = 0u64;
    // One queue pair first (comparable with a single fio job), then four spread over the reactors.
    for &(qd, pairs) in &[(1usize, 1usize), (128, 1), (1, 4), (128, 4)] {
        let (tx, rx) = mpsc::channel();
        let count = if qd == 1 { counts / 4 } else { counts };
        for j in 0..pairs {
            let qp = ctrl.create_queue_pair(qd as u16).expect("queue pair");
            let mut job = Job {
                qp,
                pool: pool.clone(),
                nsid,
                base_lba: region,
                count,
                qd,
                issued: 0,
                done: 0,
                reading: false,
                read_start: None,
                tx: Some(tx.clone()),
                seed: 0x1234_5678 ^ (j as u64) << 40 ^ (qd as u64) << 48,
            };
            region += count * 8;
            reactors
                .send(j % nreact, move |ctx: &mut ReactorContext| {
                    ctx.add_poller(move |_: &mut ReactorContext| poll_job(&mut job));
                })
                .unwrap();
        }
        drop(tx);
        let mut results = Vec::new();
        for _ in 0..pairs {
            let r = rx
                .recv_timeout(Duration::from_secs(300))
                .expect("a job finished in time")
                .unwrap_or_else(|e| panic!("qd {qd}: {e}"));
            results.push(r);
        }
        let reads: u64 = results.iter().map(|r| r.reads).sum();
        let slowest = results.iter().map(|r| r.read_time).max().unwrap();
        let iops = reads as f64 / slowest.as_secs_f64();
        let doorbells: u64 = results.iter().map(|r| r.doorbells).sum();
        let submitted: u64 = results.iter().map(|r| r.submitted).sum();
        println!(
            "pcie qd{qd}: {pairs} queue pairs on {nreact} reactors, {reads} verified 4 KiB random reads in {:.2} s = \
             {iops:.0} IOPS; {submitted} commands in {doorbells} SQ doorbells",
            slowest.as_secs_f64()
        );
        report.push((qd, pairs, iops.round()));
        if qd == 128 {
            assert!(doorbells < submitted, "doorbells are batched at qd128");
        }
    }
    reactors.stop().expect("reactors stop");
    // The queue pairs were dropped with their pollers: their queues are deleted.
    assert!(!ctrl.poll_admin().unwrap());
    assert_eq!(ctrl.stats().queues_deleted, 10);
    println!("pcie IOPS as (queue depth, queue pairs, IOPS); guest under TCG emulation, a sanity check only: {report:?}");
}

/// Polls until `n` completions came back, checking that no tag comes back twice.
fn collect_tags(
    qp: &mut PcieQueuePair,
    n: usize,
) -> std::collections::BTreeMap<u64, nvpoll::api::Completion> {
    let mut got = std::collections::BTreeMap::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while got.len() < n {
        qp.poll(64).unwrap();
        while let Some(c) = qp.pop_completion() {
            let tag = c.tag;
            assert!(got.insert(tag, c).is_none(), "tag {tag} completed twice");
        }
        assert!(
            Instant::now() < deadline,
            "{} of {n} completions in 30 s: {qp:?}",
            got.len()
        );
    }
    // Nothing more comes back.
    for _ in 0..1000 {
        qp.poll(64).unwrap();
        assert!(qp.pop_completion().is_none(), "a completion too many");
    }
    got
}

#[test]
fn vm_pcie_reset_with_outstanding_reads_keeps_the_queue_pairs_working() {
    if !in_vm() {
        return;
    }
    let pool = pool();
    let mut ctrl = open(&pool);
    let ns = ctrl.namespaces()[0].clone();
    assert_eq!(ns.block_size, 512);
    let base = ns.blocks - 64 * 8; // 64 blocks of 4 KiB at the end of the namespace
    let lba = |i: u64| base + i * 8;
    let req = |op: IoOp, i: u64, tag: u64, buf: DmaBuf| IoRequest {
        op,
        nsid: ns.nsid,
        lba: lba(i),
        blocks: 8,
        buf: Some(buf),
        tag,
    };
    let check = |i: u64, c: &nvpoll::api::Completion| {
        if let Err(e) = &c.result {
            panic!("read of block {i}: {e}");
        }
        let mut want = pool.alloc(4096).unwrap();
        fill(&mut want, 0xdead_0000 ^ i);
        assert!(
            c.buf.as_ref().unwrap().as_slice() == want.as_slice(),
            "block {i} read back differently"
        );
    };
    let mut qp = ctrl.create_queue_pair(64).unwrap();
    for i in 0..64 {
        let mut w = pool.alloc(4096).unwrap();
        fill(&mut w, 0xdead_0000 ^ i);
        run_one(&mut qp, req(IoOp::Write, i, i, w));
    }

    // Retry (the default): 16 reads kicked (in flight in QEMU's controller) and 16 posted, then a reset.
    for i in 0..32 {
        qp.submit(req(IoOp::Read, i, i, pool.alloc(4096).unwrap()))
            .unwrap();
        if i == 15 {
            qp.flush().unwrap();
        }
    }
    ctrl.reset().unwrap();
    let got = collect_tags(&mut qp, 32);
    for (i, c) in &got {
        check(*i, c);
    }
    let rs = qp.recovery_stats();
    println!("retry: {rs:?}");
    assert_eq!((rs.resets, rs.recreated, rs.failed), (1, 1, 0));
    assert_eq!(rs.completed_before_reset + rs.retried, 32);
    assert_eq!(QueuePair::stats(&qp).retried, rs.retried);

    // Fail-fast: each outstanding read completes once, either done before the reset or aborted.
    let mut ff = ctrl
        .create_queue_pair_with(QueueOptions {
            recovery: Some(nvpoll_pcie::Recovery::FailFast),
            ..QueueOptions::new(32)
        })
        .unwrap();
    for i in 0..16 {
        ff.submit(req(IoOp::Read, i, i, pool.alloc(4096).unwrap()))
            .unwrap();
    }
    ff.flush().unwrap();
    ctrl.reset().unwrap();
    let got = collect_tags(&mut ff, 16);
    let mut aborted = 0;
    for (i, c) in &got {
        match &c.result {
            Err(nvpoll::Error::Aborted(_)) => aborted += 1,
            _ => check(*i, c),
        }
        assert!(c.buf.is_some());
    }
    let rs = ff.recovery_stats();
    println!("fail-fast: {rs:?}");
    assert_eq!(rs.failed, aborted);
    assert_eq!(rs.completed_before_reset + aborted, 16);

    // Both queue pairs keep working on their re-created queues (same queue IDs).
    assert!(!ctrl.poll_admin().unwrap());
    for (q, i) in [(&mut qp, 40u64), (&mut ff, 41)] {
        let mut w = pool.alloc(4096).unwrap();
        fill(&mut w, 0xbeef ^ i);
        run_one(q, req(IoOp::Write, i, 1, w));
        let r = run_one(q, req(IoOp::Read, i, 2, pool.alloc(4096).unwrap()));
        let mut want = pool.alloc(4096).unwrap();
        fill(&mut want, 0xbeef ^ i);
        assert!(r.as_slice() == want.as_slice(), "queue {}", q.qid());
    }
    assert_eq!((qp.qid(), ff.qid()), (1, 2));
    assert_eq!(ctrl.stats().resets, 2);
    drop((qp, ff));
    assert!(!ctrl.poll_admin().unwrap());
    assert_eq!(ctrl.stats().queues_deleted, 2);
}

#[test]
fn vm_pcie_vfio_refuses_a_device_not_bound_to_vfio() {
    if !in_vm() {
        return;
    }
    // The kernel-driven twin is bound to nvme: opening it must say so and how to fix it.
    let twin: PciAddress = "0000:00:05.0".parse().unwrap();
    let e = VfioDevice::open(twin).unwrap_err().to_string();
    assert!(e.contains("nvpoll-setup bind"), "{e}");
}

/// A helper for scripts/vm-tests/50-target-exports-pcie.sh: with NVPOLL_PCIE_FILE=path and
/// NVPOLL_PCIE_OFFSET=bytes, writes the file to the vfio-bound namespace at that offset
/// (NVPOLL_PCIE_OP=write) or checks that the namespace holds it there (NVPOLL_PCIE_OP=check). Without
/// NVPOLL_PCIE_FILE it has nothing to do.
#[test]
fn vm_pcie_file_io_from_env() {
    if !in_vm() {
        return;
    }
    let Ok(path) = std::env::var("NVPOLL_PCIE_FILE") else {
        println!("nothing to do: NVPOLL_PCIE_FILE is not set (the export script sets it)");
        return;
    };
    let offset: u64 = env("NVPOLL_PCIE_OFFSET")
        .parse()
        .expect("NVPOLL_PCIE_OFFSET is a byte offset");
    let op = env("NVPOLL_PCIE_OP");
    let bytes = std::fs::read(&path).expect("NVPOLL_PCIE_FILE is readable");
    let pool = pool();
    let mut ctrl = open(&pool);
    let ns = ctrl.namespaces()[0].clone();
    let bs = u64::from(ns.block_size);
    assert!(
        offset % bs == 0 && bytes.len() as u64 % bs == 0,
        "block-aligned offset and length"
    );
    let chunk_len = ctrl.max_transfer().unwrap_or(128 * 1024).min(1 << 20) as usize;
    let mut qp = ctrl.create_queue_pair(4).expect("queue pair");
    for (i, chunk) in bytes.chunks(chunk_len).enumerate() {
        let lba = (offset + (i * chunk_len) as u64) / bs;
        let blocks = (chunk.len() as u64 / bs) as u32;
        let mut buf = pool.alloc(chunk.len()).unwrap();
        let io = if op == "write" {
            buf.as_mut_slice().copy_from_slice(chunk);
            IoOp::Write
        } else {
            IoOp::Read
        };
        qp.submit(IoRequest {
            op: io,
            nsid: ns.nsid,
            lba,
            blocks,
            buf: Some(buf),
            tag: i as u64,
        })
        .map_err(|r| r.error)
        .unwrap();
        qp.flush().unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let c = loop {
            qp.poll(1).unwrap();
            if let Some(c) = qp.pop_completion() {
                break c;
            }
            assert!(Instant::now() < deadline, "no completion");
        };
        c.result.unwrap();
        if io == IoOp::Read {
            assert!(
                c.buf.unwrap().as_slice() == chunk,
                "chunk {i} at lba {lba} differs from {path}"
            );
        }
    }
    println!("{op} of {} bytes at offset {offset}: ok", bytes.len());
}

/// A PCIe queue pair on a hybrid reactor, fed from this thread (a channel, then the reactor's waker).
struct HybridJob {
    qp: PcieQueuePair,
    asks: mpsc::Receiver<(IoOp, u64, DmaBuf)>,
    /// Each completed buffer, with the queue pair's interrupt waits so far.
    answers: mpsc::Sender<Result<(DmaBuf, u64), String>>,
}

impl nvpoll::reactor::Poller for HybridJob {
    fn poll(&mut self, _: &mut ReactorContext) -> PollStatus {
        let mut busy = false;
        while let Ok((op, lba, buf)) = self.asks.try_recv() {
            busy = true;
            let req = IoRequest {
                op,
                nsid: 1,
                lba,
                blocks: 8,
                buf: Some(buf),
                tag: 0,
            };
            if let Err(r) = self.qp.submit(req) {
                self.answers
                    .send(Err(format!("submit: {}", r.error)))
                    .unwrap();
            }
        }
        if let Err(e) = self.qp.poll(64) {
            self.answers.send(Err(format!("poll: {e}"))).unwrap();
        }
        while let Some(c) = self.qp.pop_completion() {
            busy = true;
            let buf = c.buf.expect("buffer");
            let waits = self.qp.interrupt_waits();
            let r = c.result.map(|()| (buf, waits)).map_err(|e| e.to_string());
            self.answers.send(r).unwrap();
        }
        PollStatus::busy_if(busy)
    }

    fn flush(&mut self, _: &mut ReactorContext) {
        self.qp.flush().expect("doorbell");
    }

    fn wake_sources<'a>(&'a self, w: &mut nvpoll::reactor::WakeSources<'a>) -> bool {
        self.qp.wake_sources(w)
    }
}

/// Hybrid idle mode over PCIe: writes and verified reads arrive at random moments around the reactor's
/// sleep/wake boundary; each must complete within a bound, and the reactor must have slept often between
/// them. Polled (with commands outstanding the reactor polls), then with MSI-X interrupts (it may sleep with
/// commands outstanding, woken by the CQ's vector).
#[test]
fn vm_pcie_hybrid_reactor_loses_no_wake_up() {
    if !in_vm() {
        return;
    }
    hybrid_rounds(false);
    hybrid_rounds(true);
}

fn hybrid_rounds(interrupts: bool) {
    const QUIET: Duration = Duration::from_micros(100);
    const ROUNDS: usize = 300;
    let pool = DmaPool::builder().class(4096, 64).build().expect("pool");
    let opts = PcieOptions {
        interrupts,
        ..PcieOptions::default()
    };
    let mut ctrl = PcieController::open(bdf(), pool.clone(), opts)
        .unwrap_or_else(|e| panic!("opening {}: {e}", bdf()));
    let qp = ctrl.create_queue_pair(8).expect("queue pair");
    // The guest's QEMU NVMe has MSI-X vectors to give.
    assert_eq!(qp.has_interrupt(), interrupts, "interrupts: {interrupts}");
    let reactors = Reactors::builder()
        .idle(nvpoll::reactor::IdlePolicy::Hybrid { quiet: QUIET })
        .start(&"0".parse().unwrap())
        .expect("reactors");
    let (ask_tx, asks) = mpsc::channel();
    let (answers, answer_rx) = mpsc::channel();
    reactors
        .send(0, move |ctx: &mut ReactorContext| {
            ctx.add_poller(HybridJob { qp, asks, answers });
        })
        .unwrap();
    let waker = reactors.waker(0).unwrap();
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut written = [None::<u8>; 16];
    let mut worst = Duration::ZERO;
    let mut waits = 0;
    for round in 0..ROUNDS {
        let pause = if next() % 8 == 0 {
            Duration::from_micros(next() % 5000)
        } else {
            Duration::from_nanos(next() % (3 * QUIET.as_nanos() as u64))
        };
        let start = Instant::now();
        while start.elapsed() < pause {
            std::hint::spin_loop();
        }
        let unit = (next() % 16) as usize;
        let write = next() % 2 == 0;
        let mut buf = pool.alloc(4096).unwrap();
        if write {
            buf.as_mut_slice().fill(round as u8);
        }
        let op = if write { IoOp::Write } else { IoOp::Read };
        let sent = Instant::now();
        ask_tx.send((op, unit as u64 * 8, buf)).unwrap();
        waker.wake();
        let (buf, w) = answer_rx
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| panic!("round {round}: {op:?} lost (not completed in 30 s)"))
            .unwrap_or_else(|e| panic!("round {round}: {op:?} failed: {e}"));
        waits = w;
        worst = worst.max(sent.elapsed());
        if write {
            written[unit] = Some(round as u8);
        } else if let Some(v) = written[unit] {
            assert!(
                buf.as_slice().iter().all(|&b| b == v),
                "round {round}: unit {unit} reads back wrong"
            );
        }
    }
    let stats = reactors.stop().expect("reactors stop");
    println!(
        "pcie hybrid (interrupts {interrupts}): {ROUNDS} I/Os at random moments, worst {worst:?}; {} sleeps \
         ({waits} with commands outstanding, on the interrupt), {:?} asleep",
        stats[0].sleeps, stats[0].slept
    );
    if interrupts {
        assert!(waits > 0, "the reactor never slept on the interrupt");
    }
    ctrl.shutdown().expect("shutdown");
    assert!(
        stats[0].sleeps as usize > ROUNDS / 10,
        "the reactor slept only {} times",
        stats[0].sleeps
    );
}

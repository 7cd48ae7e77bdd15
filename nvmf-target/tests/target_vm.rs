//! The Linux kernel's NVMe/TCP host against our target, inside the QEMU guest (scripts/vm-test.sh runs the vm_
//! tests with NVPOLL_VM=1; outside the guest they say why they skip).
//!
//! - `vm_kernel_writes_our_initiator_reads`: our target in this process, `nvme connect` by the kernel, a pattern
//!   written through the kernel's block device, `nvme disconnect`, then our initiator reads it back.
//! - `vm_check_pattern_from_env`: the same read-back check against a target started elsewhere; the script
//!   scripts/vm-tests/20-kernel-initiator-vs-our-target.sh runs it with NVPOLL_TARGET_CHECK set.

use nvpoll_testkit::target as target_common;

use std::net::SocketAddr;
use std::os::unix::fs::FileExt;
use std::process::Command;
use std::time::{Duration, Instant};

use nvpoll::api::{Controller, IoOp, IoRequest, QueuePair};
use nvpoll_tcp::host::{ConnectOptions, TcpController};
use target_common::kernel::wait_disk;
use target_common::{fill_pattern, pool, TestTarget, NQN};

fn in_guest() -> bool {
    if std::env::var_os("NVPOLL_VM").is_none() {
        eprintln!("skipping: needs the QEMU guest with the kernel's nvme-tcp host (run scripts/vm-test.sh)");
        return false;
    }
    true
}

/// The host NQN nvme-cli uses in the guest.
fn hostnqn() -> String {
    std::env::var("VM_HOSTNQN").unwrap_or_else(|_| target_common::HOSTNQN.to_string())
}

fn nvme(args: &[&str]) -> String {
    let out = Command::new("nvme")
        .args(args)
        .output()
        .expect("run nvme-cli");
    assert!(
        out.status.success(),
        "nvme {}: {}\n{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Reads `expect.len()` bytes at byte offset `offset` of namespace 1 with our initiator and compares.
fn read_back(addr: SocketAddr, nqn: &str, offset: u64, expect: &[u8]) {
    let mut ctrl =
        TcpController::connect(ConnectOptions::new(addr, nqn, hostnqn()), pool()).expect("attach");
    let bs = u64::from(ctrl.namespaces()[0].block_size);
    let mut qp = ctrl.create_queue_pair(8).expect("I/O queue");
    let p = ctrl.pool().clone();
    for (i, chunk) in expect.chunks(1 << 20).enumerate() {
        let at = offset + (i as u64) * (1 << 20);
        let req = IoRequest {
            op: IoOp::Read,
            nsid: 1,
            lba: at / bs,
            blocks: (chunk.len() as u64 / bs) as u32,
            buf: Some(p.alloc(chunk.len()).unwrap()),
            tag: 0,
        };
        qp.submit(req).map_err(|r| r.error).expect("submit");
        qp.flush().expect("flush");
        let deadline = Instant::now() + Duration::from_secs(60);
        let c = loop {
            qp.poll(8).expect("poll");
            if let Some(c) = qp.pop_completion() {
                break c;
            }
            assert!(Instant::now() < deadline, "read timed out");
        };
        c.result.expect("read");
        let got = c.buf.unwrap();
        if let Some(i) = got.as_slice().iter().zip(chunk).position(|(a, b)| a != b) {
            let end = (i + 16).min(chunk.len());
            panic!(
                "bytes at {at} differ from what the kernel wrote: first at +{i}: got {:02x?}, want {:02x?}; \
                 {} of {} bytes differ",
                &got.as_slice()[i..end],
                &chunk[i..end],
                got.as_slice().iter().zip(chunk).filter(|(a, b)| a != b).count(),
                chunk.len()
            );
        }
    }
    drop(qp);
    ctrl.shutdown().expect("shutdown");
}

#[test]
fn vm_kernel_writes_our_initiator_reads() {
    if !in_guest() {
        return;
    }
    let t = TestTarget::start(|c| c);
    let port = t.addr.port().to_string();
    let hostnqn = hostnqn();
    let disc = nvme(&[
        "discover",
        "-t",
        "tcp",
        "-a",
        "127.0.0.1",
        "-s",
        &port,
        "--hostnqn",
        &hostnqn,
    ]);
    assert!(disc.contains(NQN), "discovery lists our subsystem:\n{disc}");
    nvme(&[
        "connect",
        "-t",
        "tcp",
        "-a",
        "127.0.0.1",
        "-s",
        &port,
        "-n",
        NQN,
        "--hostnqn",
        &hostnqn,
    ]);
    let dev = wait_disk(NQN, 1, true).expect("the kernel made a disk");
    let mut pattern = vec![0u8; 2 << 20];
    fill_pattern(&mut pattern, 2024);
    let offset = 5 << 20;
    {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&dev)
            .expect("open the kernel's block device");
        f.write_all_at(&pattern, offset)
            .expect("write through the kernel");
        f.sync_all().expect("fsync (a Flush to our target)");
    }
    nvme(&["disconnect", "-n", NQN]);
    assert!(
        !t.events_matching("admin queue").is_empty(),
        "the kernel connected"
    );
    read_back(t.addr, NQN, offset, &pattern);
    let c = t.counters();
    assert_eq!(
        c.term_reqs, 0,
        "no protocol error with the kernel host: {c}"
    );
}

/// NVPOLL_TARGET_CHECK="ADDR NQN FILE OFFSET": the target at ADDR holds FILE's bytes at byte OFFSET of
/// namespace 1.
#[test]
fn vm_check_pattern_from_env() {
    let Ok(spec) = std::env::var("NVPOLL_TARGET_CHECK") else {
        eprintln!("skipping: NVPOLL_TARGET_CHECK is not set (scripts/vm-tests/20-kernel-initiator-vs-our-target.sh sets it)");
        return;
    };
    let parts: Vec<&str> = spec.split_whitespace().collect();
    let [addr, nqn, file, offset] = parts[..] else {
        panic!("NVPOLL_TARGET_CHECK must be 'ADDR NQN FILE OFFSET', not {spec:?}");
    };
    let expect = std::fs::read(file).expect("read the pattern file");
    read_back(
        addr.parse().expect("ADDR"),
        nqn,
        offset.parse().expect("OFFSET"),
        &expect,
    );
    eprintln!(
        "check: {} bytes at offset {offset} of {nqn} match {file}",
        expect.len()
    );
}

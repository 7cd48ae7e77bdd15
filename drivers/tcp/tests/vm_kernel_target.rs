//! Our initiator against the Linux kernel's nvmet-tcp target, inside the QEMU guest (scripts/vm-test.sh runs
//! these with NVPOLL_VM=1). Outside the guest each test says it skips and why.

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use nvpoll::api::{Completion, Controller, IoOp, IoRequest, QueuePair};
use nvpoll::mem::DmaPool;
use nvpoll_tcp::host::{ConnectOptions, TcpController, TcpQueuePair};

struct Guest {
    addr: SocketAddr,
    nqn: String,
    hostnqn: String,
}

fn guest() -> Option<Guest> {
    if std::env::var_os("NVPOLL_VM").is_none() {
        eprintln!(
            "skipping: needs the QEMU guest with the kernel's nvmet-tcp (run scripts/vm-test.sh)"
        );
        return None;
    }
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} is not set in the guest"));
    let addr = format!("{}:{}", var("VM_NVMET_ADDR"), var("VM_NVMET_PORT"))
        .parse()
        .expect("target address");
    Some(Guest {
        addr,
        nqn: var("VM_NVMET_NQN"),
        hostnqn: var("VM_HOSTNQN"),
    })
}

fn pool() -> DmaPool {
    DmaPool::builder()
        .class(4096, 2048)
        .class(1 << 20, 16)
        .build()
        .expect("DMA pool")
}

fn attach(g: &Guest, header_digest: bool, data_digest: bool) -> TcpController {
    let mut o = ConnectOptions::new(g.addr, g.nqn.clone(), g.hostnqn.clone());
    o.header_digest = header_digest;
    o.data_digest = data_digest;
    TcpController::connect(o, pool()).expect("attach to the kernel target")
}

/// Submits one request and polls until it completes.
fn run_one(qp: &mut TcpQueuePair, req: IoRequest) -> Completion {
    qp.submit(req).map_err(|r| r.error).expect("submit");
    qp.flush().expect("flush");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        qp.poll(16).expect("poll");
        if let Some(c) = qp.pop_completion() {
            return c;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "I/O did not complete in 30 s"
        );
    }
}

fn fill_pattern(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

#[test]
fn vm_identify_kernel_target() {
    let Some(g) = guest() else { return };
    let ctrl = attach(&g, false, false);
    let id = ctrl.identify();
    assert_eq!(
        id.subnqn, g.nqn,
        "the controller reports the subsystem we connected to"
    );
    assert!(
        id.model.contains("Linux"),
        "nvmet's model string is 'Linux', got {:?}",
        id.model
    );
    let ns = ctrl.namespaces();
    assert_eq!(ns.len(), 1, "the guest's target serves one namespace");
    assert_eq!(ns[0].capacity_bytes(), 256 << 20);
    assert!(ctrl.io_queues_allowed() >= 1);
    ctrl.shutdown().expect("CC.SHN shutdown");
}

fn write_read_verify(header_digest: bool, data_digest: bool) {
    let Some(g) = guest() else { return };
    let mut ctrl = attach(&g, header_digest, data_digest);
    let ns = ctrl.namespaces()[0].clone();
    let bs = ns.block_size as usize;
    let max = ctrl.max_transfer().unwrap() as usize;
    let pool = ctrl.pool().clone();
    let mut qp = ctrl.create_queue_pair(32).expect("I/O queue");
    // Sizes from one block to the largest transfer, crossing the in-capsule size (8 KiB on nvmet by default)
    // and MAXH2CDATA, at unaligned block offsets, until 64 MiB have been written and read back.
    let sizes: Vec<usize> = [
        1, 2, 7, 8, 15, 16, 17, 31, 33, 64, 127, 129, 255, 256, 1000, 2048,
    ]
    .iter()
    .map(|b| (b * bs).min(max))
    .collect();
    let (mut written, mut lba, mut i) = (0usize, 3u64, 0u64);
    while written < 64 << 20 {
        let len = sizes[i as usize % sizes.len()];
        let blocks = (len / bs) as u32;
        if lba + u64::from(blocks) > ns.blocks {
            lba = (i * 7) % 64;
        }
        let mut wbuf = pool.alloc(len).expect("buffer");
        wbuf.set_len(len).unwrap();
        fill_pattern(wbuf.as_mut_slice(), i);
        let c = run_one(
            &mut qp,
            IoRequest {
                op: IoOp::Write,
                nsid: ns.nsid,
                lba,
                blocks,
                buf: Some(wbuf),
                tag: i,
            },
        );
        c.result
            .unwrap_or_else(|e| panic!("write of {len} bytes at lba {lba}: {e}"));
        let mut rbuf = pool.alloc(len).expect("buffer");
        rbuf.set_len(len).unwrap();
        rbuf.as_mut_slice().fill(0xee);
        let c = run_one(
            &mut qp,
            IoRequest {
                op: IoOp::Read,
                nsid: ns.nsid,
                lba,
                blocks,
                buf: Some(rbuf),
                tag: i,
            },
        );
        c.result
            .unwrap_or_else(|e| panic!("read of {len} bytes at lba {lba}: {e}"));
        let mut expect = vec![0u8; len];
        fill_pattern(&mut expect, i);
        assert!(
            c.buf.unwrap().as_slice() == &expect[..],
            "data mismatch: {len} bytes at lba {lba}"
        );
        written += len;
        lba += u64::from(blocks) + 1;
        i += 1;
    }
    eprintln!("verified {written} bytes in {i} write/read pairs (hdgst={header_digest}, ddgst={data_digest})");
}

#[test]
fn vm_write_read_verify_no_digests() {
    write_read_verify(false, false);
}

#[test]
fn vm_write_read_verify_header_digest() {
    write_read_verify(true, false);
}

#[test]
fn vm_write_read_verify_both_digests() {
    write_read_verify(true, true);
}

/// Many queue pairs, each kept at depth `qd` with 4 KiB writes then reads of its own region.
fn many_queues(qd: u16) {
    let Some(g) = guest() else { return };
    let mut ctrl = attach(&g, false, false);
    let ns = ctrl.namespaces()[0].clone();
    let pool = ctrl.pool().clone();
    let nq = ctrl.io_queues_allowed().min(4);
    let mut qps: Vec<TcpQueuePair> = (0..nq)
        .map(|_| ctrl.create_queue_pair(qd).expect("queue"))
        .collect();
    let blocks = 4096 / ns.block_size;
    let per_queue = 512u64;
    for op in [IoOp::Write, IoOp::Read] {
        let mut submitted = vec![0u64; qps.len()];
        let mut completed = vec![0u64; qps.len()];
        while completed.iter().any(|&c| c < per_queue) {
            for (q, qp) in qps.iter_mut().enumerate() {
                while submitted[q] < per_queue && qp.outstanding() < usize::from(qd) {
                    let k = submitted[q];
                    let lba = (q as u64 * per_queue + k) * u64::from(blocks);
                    let mut buf = pool.alloc(4096).expect("buffer");
                    buf.set_len(4096).unwrap();
                    if op == IoOp::Write {
                        fill_pattern(buf.as_mut_slice(), lba);
                    }
                    let req = IoRequest {
                        op,
                        nsid: ns.nsid,
                        lba,
                        blocks,
                        buf: Some(buf),
                        tag: lba,
                    };
                    qp.submit(req).map_err(|r| r.error).expect("submit");
                    submitted[q] += 1;
                }
                qp.flush().expect("flush");
                qp.poll(256).expect("poll");
                while let Some(c) = qp.pop_completion() {
                    c.result
                        .unwrap_or_else(|e| panic!("{op:?} at lba {}: {e}", c.tag));
                    if op == IoOp::Read {
                        let mut expect = vec![0u8; 4096];
                        fill_pattern(&mut expect, c.tag);
                        assert!(
                            c.buf.unwrap().as_slice() == &expect[..],
                            "mismatch at lba {}",
                            c.tag
                        );
                    }
                    completed[q] += 1;
                }
            }
        }
    }
    eprintln!(
        "{nq} queue pairs at qd{qd}: {} writes and reads verified",
        nq as u64 * per_queue
    );
}

#[test]
fn vm_many_queue_pairs_qd1() {
    many_queues(1);
}

#[test]
fn vm_many_queue_pairs_qd128() {
    many_queues(128);
}

/// The kernel initiator and ours agree on the bytes, both ways.
#[test]
fn vm_kernel_initiator_and_ours_agree() {
    let Some(g) = guest() else { return };
    let sh = |cmd: &str| {
        let out = Command::new("sh").arg("-c").arg(cmd).output().expect("sh");
        assert!(
            out.status.success(),
            "`{cmd}` failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    sh(&format!(
        "nvme connect -t tcp -a {} -s {} -n {}",
        g.addr.ip(),
        g.addr.port(),
        g.nqn
    ));
    let dev = sh(&format!(
        "for i in $(seq 100); do d=$(nvme list -o json | grep -o '\"/dev/nvme[0-9]*n[0-9]*\"' | tr -d '\"' | \
         while read d; do [ \"$(cat /sys/block/${{d#/dev/}}/device/subsysnqn 2>/dev/null)\" = {} ] && echo $d; done | head -1); \
         [ -n \"$d\" ] && echo $d && exit 0; sleep 0.1; done; exit 1",
        g.nqn
    ));
    // The kernel writes 1 MiB of pattern at byte offset 8 MiB; we read it.
    sh("head -c 1048576 /dev/urandom > /tmp/kpat");
    sh(&format!(
        "dd if=/tmp/kpat of={dev} bs=1M seek=8 oflag=direct conv=fsync status=none"
    ));
    let kernel_bytes = std::fs::read("/tmp/kpat").unwrap();
    let mut ctrl = attach(&g, false, true);
    let ns = ctrl.namespaces()[0].clone();
    let bs = u64::from(ns.block_size);
    let pool = ctrl.pool().clone();
    let mut qp = ctrl.create_queue_pair(8).expect("queue");
    let mut buf = pool.alloc(1 << 20).unwrap();
    buf.set_len(1 << 20).unwrap();
    let blocks = ((1 << 20) / bs) as u32;
    let c = run_one(
        &mut qp,
        IoRequest {
            op: IoOp::Read,
            nsid: 1,
            lba: (8 << 20) / bs,
            blocks,
            buf: Some(buf),
            tag: 0,
        },
    );
    c.result.expect("read");
    assert!(
        c.buf.unwrap().as_slice() == &kernel_bytes[..],
        "we read what the kernel wrote"
    );
    // We write 1 MiB at 16 MiB; the kernel reads it.
    let mut buf = pool.alloc(1 << 20).unwrap();
    buf.set_len(1 << 20).unwrap();
    fill_pattern(buf.as_mut_slice(), 42);
    let ours = buf.as_slice().to_vec();
    let c = run_one(
        &mut qp,
        IoRequest {
            op: IoOp::Write,
            nsid: 1,
            lba: (16 << 20) / bs,
            blocks,
            buf: Some(buf),
            tag: 1,
        },
    );
    c.result.expect("write");
    let c = run_one(
        &mut qp,
        IoRequest {
            op: IoOp::Flush,
            nsid: 1,
            lba: 0,
            blocks: 0,
            buf: None,
            tag: 2,
        },
    );
    c.result.expect("flush");
    sh(&format!(
        "dd if={dev} of=/tmp/ours bs=1M skip=16 count=1 iflag=direct status=none"
    ));
    let read_back = std::fs::read("/tmp/ours").unwrap();
    sh("nvme disconnect-all");
    assert!(read_back == ours, "the kernel reads what we wrote");
}

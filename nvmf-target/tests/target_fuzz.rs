//! Random commands and random PDUs from connected hosts. Whatever arrives, the target answers each command or
//! ends the connection with a termination request or a close, never hits an internal error (a caught panic),
//! and keeps serving. The generator is seeded, so a failure repeats.

use nvpoll_testkit::target as target_common;

use std::time::Duration;

use nvpoll::spec::{SglDescriptor, Sqe};
use nvpoll_tcp::pdu::{self, Digests};
use nvpoll_testkit::exactly_once::Rng;
use target_common::{RawHost, Resp, TestTarget, NQN};

/// A random command: a real opcode most of the time, fields that are often at their limits.
fn random_sqe(rng: &mut Rng, cid: u16, io_queue: bool) -> (Sqe, Vec<u8>, u32) {
    if io_queue && rng.below(2) == 0 {
        return well_formed_io(rng, cid);
    }
    const ADMIN: [u8; 12] = [
        0x02, 0x06, 0x08, 0x09, 0x0a, 0x0c, 0x18, 0x7f, 0x00, 0x01, 0x10, 0x80,
    ];
    const IO: [u8; 8] = [0x00, 0x01, 0x02, 0x08, 0x09, 0x05, 0x7f, 0x04];
    let opcode = if rng.below(10) == 0 {
        rng.next_u64() as u8
    } else if io_queue {
        IO[rng.below(IO.len() as u64) as usize]
    } else {
        ADMIN[rng.below(ADMIN.len() as u64) as usize]
    };
    let mut sqe = Sqe {
        opcode,
        cid,
        nsid: if rng.below(3) == 0 {
            rng.field()
        } else {
            1 + rng.below(3) as u32
        },
        cdw10: rng.field(),
        cdw11: rng.field(),
        cdw12: if rng.below(2) == 0 {
            rng.below(64) as u32
        } else {
            rng.field()
        },
        cdw13: rng.field(),
        ..Default::default()
    };
    // In-capsule data (small), a transport data block, a random descriptor, or PRPs.
    let (data, xfer) = match rng.below(5) {
        0 => {
            let n = [512usize, 1024, 4096, 100][rng.below(4) as usize];
            (vec![0x5a; n], 0)
        }
        1 | 2 => (
            Vec::new(),
            [0u32, 512, 4096, 8192, 1 << 20, rng.field()][rng.below(6) as usize],
        ),
        3 => {
            let mut b = [0u8; 16];
            for x in b.iter_mut() {
                *x = rng.next_u64() as u8;
            }
            sqe.set_dptr_bytes(&b);
            sqe.flags = rng.next_u64() as u8;
            (Vec::new(), u32::MAX)
        }
        _ => (Vec::new(), 0),
    };
    if data.is_empty() && xfer != u32::MAX {
        sqe.set_sgl(&SglDescriptor::transport_data_block(xfer));
    } else if !data.is_empty() {
        sqe.set_sgl(&SglDescriptor::in_capsule(0, data.len() as u32));
    }
    (sqe, data, xfer)
}

/// A well-formed read, write, write zeroes or flush on namespace 1 (512-byte blocks), usually in range.
fn well_formed_io(rng: &mut Rng, cid: u16) -> (Sqe, Vec<u8>, u32) {
    let blocks = target_common::NS1_BYTES / 512;
    let max = if rng.below(4) == 0 { 2048 } else { 32 };
    let nlb = 1 + rng.below(max);
    let slba = if rng.below(8) == 0 {
        blocks - rng.below(64)
    } else {
        rng.below(blocks - nlb)
    };
    let len = (nlb * 512) as u32;
    let nlb0 = (nlb - 1) as u16;
    let mut sqe = match rng.below(4) {
        0 => Sqe::read(1, slba, nlb0),
        1 => Sqe::write(1, slba, nlb0),
        2 => Sqe::write_zeroes(1, slba, nlb0),
        _ => Sqe::flush(1),
    };
    if rng.below(4) == 0 {
        sqe = sqe.with_fua();
    }
    sqe.cid = cid;
    let (data, xfer) = match sqe.opcode {
        0x01 if len <= 8192 => (vec![rng.next_u64() as u8; len as usize], 0),
        0x01 | 0x02 => (Vec::new(), len),
        _ => (Vec::new(), 0),
    };
    if data.is_empty() {
        sqe.set_sgl(&SglDescriptor::transport_data_block(xfer));
    } else {
        sqe.set_sgl(&SglDescriptor::in_capsule(0, data.len() as u32));
    }
    (sqe, data, xfer)
}

/// Sends `sqe` and reads until its completion; answers R2Ts with zeroes. Returns false if the target closed the
/// connection.
fn exchange(h: &mut RawHost, sqe: Sqe, data: &[u8]) -> bool {
    let mut b = Vec::new();
    pdu::encode_capsule_cmd(&mut b, &sqe, data, h.digests, 0);
    h.send(&b);
    loop {
        match h.recv() {
            None => return false,
            Some(Resp::TermReq { .. }) => return false,
            Some(Resp::Cqe(c)) if c.cid == sqe.cid => return true,
            Some(Resp::C2H { hdr, .. }) if hdr.success => return true,
            Some(Resp::R2T(r)) => {
                let mut b = Vec::new();
                let mut off = r.r2to;
                while off < r.r2to + r.r2tl {
                    let n = (r.r2to + r.r2tl - off).min(128 * 1024);
                    let last = off + n == r.r2to + r.r2tl;
                    let hdr = pdu::H2CDataHdr {
                        cccid: r.cccid,
                        ttag: r.ttag,
                        datao: off,
                        datal: n,
                        last,
                    };
                    pdu::encode_h2c_data(&mut b, &hdr, &vec![0u8; n as usize], h.digests, 0);
                    off += n;
                }
                h.send(&b);
            }
            // Completions of held commands never come; other PDUs (data for this command) are skipped.
            Some(_) => {}
        }
    }
}

#[test]
fn random_commands_on_admin_and_io_queues() {
    let t = TestTarget::start(|c| c);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut commands = 0;
    let mut reconnects = 0;
    while commands < 3000 {
        let (mut admin, cntlid) = RawHost::admin_queue(t.addr, NQN, 0);
        let (mut io, cqe) = RawHost::io_queue(t.addr, cntlid, 1, 127, 0, Digests::NONE);
        assert!(cqe.status().is_success());
        let mut cid = 1000u16;
        loop {
            commands += 1;
            cid = cid.wrapping_add(1);
            let io_queue = rng.below(2) == 0;
            let (sqe, data, _) = random_sqe(&mut rng, cid, io_queue);
            let h = if io_queue { &mut io } else { &mut admin };
            // Asynchronous Event Requests stay outstanding: do not wait for them.
            if sqe.opcode == 0x0c && !io_queue {
                let mut b = Vec::new();
                pdu::encode_capsule_cmd(&mut b, &sqe, &data, h.digests, 0);
                h.send(&b);
                continue;
            }
            if !exchange(h, sqe, &data) || commands % 500 == 0 || commands >= 3000 {
                break;
            }
        }
        reconnects += 1;
    }
    let c = t.counters();
    assert_eq!(c.internal_errors, 0, "{c}");
    eprintln!("{commands} random commands over {reconnects} controllers: {c}");
    // Still serving.
    let (mut admin, _) = RawHost::admin_queue(t.addr, NQN, 0);
    let (cqe, _) = admin.run(Sqe::keep_alive(), &[], 0, &[]);
    assert!(cqe.status().is_success());
}

#[test]
fn random_pdus_after_connect() {
    let t = TestTarget::start(|c| c);
    let mut rng = Rng(12345);
    for round in 0..300 {
        let (_admin, cntlid) = RawHost::admin_queue(t.addr, NQN, 0);
        let digests = Digests {
            header: round % 2 == 0,
            data: round % 3 == 0,
        };
        let (mut io, cqe) = RawHost::io_queue(t.addr, cntlid, 1, 31, 0, digests);
        assert!(cqe.status().is_success());
        // A valid-looking common header of a host PDU type with random flags, lengths and contents.
        let ty = [0x00u8, 0x02, 0x04, 0x06, 0x07, 0x04, 0x06][rng.below(7) as usize];
        let hlen = [24u8, 72, 128, rng.next_u64() as u8][rng.below(4) as usize];
        let plen = match rng.below(3) {
            0 => u32::from(hlen),
            1 => u32::from(hlen) + rng.below(9000) as u32,
            _ => rng.field(),
        };
        let mut b = vec![ty, rng.below(16) as u8, hlen, rng.next_u64() as u8];
        b.extend_from_slice(&plen.to_le_bytes());
        let body = (plen as usize).saturating_sub(8).min(20_000);
        for _ in 0..body {
            b.push(rng.next_u64() as u8);
        }
        io.send(&b);
        // The target answers, terminates, or waits for more; none of which may take it down.
        io.s.set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let mut sink = [0u8; 4096];
        let _ = std::io::Read::read(&mut io.s, &mut sink);
    }
    let c = t.counters();
    assert_eq!(c.internal_errors, 0, "{c}");
    let (mut admin, _) = RawHost::admin_queue(t.addr, NQN, 0);
    let (cqe, _) = admin.run(Sqe::keep_alive(), &[], 0, &[]);
    assert!(cqe.status().is_success());
}

/// The command a command fuzzer reported unanswered (issue 33): a vendor-specific I/O opcode (DCh, no data
/// direction), PSDT 10b, a reserved flag bit, a random NSID and dwords, and an SGL of every descriptor type in
/// DPTR. Each gets exactly one completion, and the queue goes on.
#[test]
fn vendor_opcode_with_psdt_10b_and_any_sgl_is_answered_once() {
    let t = TestTarget::start(|c| c);
    let (_admin, cntlid) = RawHost::admin_queue(t.addr, NQN, 0);
    let (mut io, cqe) = RawHost::io_queue(t.addr, cntlid, 1, 127, 0, Digests::NONE);
    assert!(cqe.status().is_success());
    let mut rng = Rng(0xe107_0b1c);
    for (i, sgl_id) in (0..=255u8).enumerate() {
        let mut sqe = Sqe {
            opcode: 0xdc,
            flags: 0x80 | 0x04,
            cid: 100 + i as u16,
            nsid: 0xe107_0b1c,
            cdw2: rng.next_u64() as u32,
            cdw3: rng.next_u64() as u32,
            mptr: rng.next_u64(),
            cdw10: rng.next_u64() as u32,
            cdw11: rng.next_u64() as u32,
            cdw12: rng.next_u64() as u32,
            cdw13: rng.next_u64() as u32,
            cdw14: rng.next_u64() as u32,
            cdw15: rng.next_u64() as u32,
            ..Default::default()
        };
        let mut dptr = [0u8; 16];
        dptr[..8].copy_from_slice(&rng.next_u64().to_le_bytes());
        dptr[8..12].copy_from_slice(&(rng.next_u64() as u32).to_le_bytes());
        dptr[15] = sgl_id;
        sqe.set_dptr_bytes(&dptr);
        let mut b = Vec::new();
        pdu::encode_capsule_cmd(&mut b, &sqe, &[], io.digests, 0);
        io.send(&b);
        match io.recv() {
            Some(Resp::Cqe(c)) => {
                assert_eq!(c.cid, sqe.cid, "SGL identifier {sgl_id:#04x}");
                assert!(!c.status().is_success(), "SGL identifier {sgl_id:#04x}");
            }
            other => panic!("SGL identifier {sgl_id:#04x}: {other:?} instead of a completion"),
        }
    }
    assert!(
        io.still_open_after(Duration::from_millis(100)),
        "nothing more came"
    );
    let (cqe, _) = io.run(Sqe::flush(1), &[], 0, &[]);
    assert!(cqe.status().is_success(), "the queue still works");
}

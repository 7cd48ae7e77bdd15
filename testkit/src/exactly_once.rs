//! A stateful fuzzer of the target's sessions: every command gets exactly one answer.
//!
//! Hosts connect an admin queue and I/O queues, then take random steps: send a random command (admin, I/O or
//! fabrics opcodes, reserved bits, PSDT values, SGL descriptors, NSIDs, in-capsule data or a transport data
//! block), answer one of the target's R2Ts with a random part of the data it asked for (the H2CData of several
//! commands interleaved), or read what came. Many commands are outstanding at once. Every completion (or
//! C2HData with SUCCESS) must be for a command that is outstanding; data and R2Ts only for outstanding
//! commands; and at the end of a round, with every R2T answered, every command but the held Asynchronous
//! Event Requests must have been answered. A queue the target ends (a termination request or a close) is
//! counted and left: its outstanding commands are the transport's to fail. Seeded, so a failure repeats.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use nvpoll::spec::{fabrics, ConnectData, DsmRange, SglDescriptor, Sqe};
use nvpoll_tcp::pdu::{self, Digests};

use crate::target::{Polled, RawHost, Resp, HOSTNQN, NQN, NS1_BYTES};

/// xorshift64.
pub struct Rng(pub u64);

impl Rng {
    /// The next value of the sequence.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A value in 0..n.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Often 0, small, at a boundary, a power of two; else anything.
    pub fn field(&mut self) -> u32 {
        match self.below(6) {
            0 => 0,
            1 => self.below(16) as u32,
            2 => u32::MAX - self.below(4) as u32,
            3 => 1 << self.below(32),
            _ => self.next_u64() as u32,
        }
    }
}

/// What the fuzzer caught the target doing: a command answered twice or never, or a PDU out of place.
#[derive(Debug)]
pub enum Violation {
    /// A completion, C2HData or R2T (`what`) for a command that is not outstanding (answered before, or
    /// never sent); `detail` is what came, where it says more.
    NotOutstanding {
        /// The queue it came on.
        qid: u16,
        /// The PDU.
        what: &'static str,
        /// The command ID it named.
        cid: u16,
        /// The PDU as received, when it says more than its kind.
        detail: Option<String>,
    },
    /// An ICResp on a connection already up.
    IcRespAfterUp {
        /// The queue.
        qid: u16,
    },
    /// Commands the target never answered within 5 s, the connection still open.
    NeverAnswered {
        /// The queue.
        qid: u16,
        /// Each command, as sent.
        commands: Vec<String>,
    },
    /// A round failed: which, with the seed to repeat it and the counts so far.
    InRound {
        /// The round.
        round: u64,
        /// The seed of the run.
        seed: u64,
        /// The counts up to it.
        tally: Tally,
        /// What happened in it.
        violation: Box<Violation>,
    },
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Violation::NotOutstanding {
                qid,
                what,
                cid,
                detail,
            } => {
                write!(
                    f,
                    "queue {qid}: {what} for command {cid:#x}, which is not outstanding"
                )?;
                match detail {
                    Some(d) => write!(f, " (answered twice, or never sent): {d}"),
                    None => Ok(()),
                }
            }
            Violation::IcRespAfterUp { qid } => {
                write!(f, "queue {qid}: an ICResp after the connection was up")
            }
            Violation::NeverAnswered { qid, commands } => write!(
                f,
                "queue {qid}: {} command(s) never answered within 5 s, the connection still open:\n  {}",
                commands.len(),
                commands.join("\n  ")
            ),
            Violation::InRound {
                round,
                seed,
                tally,
                violation,
            } => write!(f, "round {round} (seed {seed:#x}): {violation}\n(so far: {tally})"),
        }
    }
}

impl std::error::Error for Violation {}

/// What a round counted.
#[derive(Clone, Debug, Default)]
pub struct Tally {
    /// Rounds run.
    pub rounds: u64,
    /// Commands sent.
    pub commands: u64,
    /// Completions received (each command must get exactly one).
    pub answers: u64,
    /// R2Ts received.
    pub r2ts: u64,
    /// H2CData PDUs sent.
    pub h2c_pdus: u64,
    /// Queues the target ended (termination request or close).
    pub ended: u64,
    /// Asynchronous Event Requests left held at the end of a round.
    pub held_aers: u64,
}

impl fmt::Display for Tally {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} rounds, {} commands, {} answered, {} R2Ts answered in {} H2CData PDUs, {} queues ended by the \
             target, {} AERs held",
            self.rounds, self.commands, self.answers, self.r2ts, self.h2c_pdus, self.ended, self.held_aers
        )
    }
}

/// A command sent and not yet answered.
#[derive(Clone, Copy, Debug)]
struct Sent {
    sqe: Sqe,
    /// An Asynchronous Event Request: held until an event, so never owed an answer within a round.
    aer: bool,
}

/// An R2T not yet fully answered.
#[derive(Clone, Copy, Debug)]
struct Owed {
    cccid: u16,
    ttag: u16,
    /// Next offset to send, and the end of the range asked for.
    at: u32,
    end: u32,
}

/// One queue of a host.
struct Queue {
    h: RawHost,
    qid: u16,
    depth: usize,
    maxh2cdata: u32,
    outstanding: HashMap<u16, Sent>,
    owed: VecDeque<Owed>,
    next_cid: u16,
    ended: bool,
}

impl Queue {
    fn open(
        addr: SocketAddr,
        qid: u16,
        sqsize: u16,
        cntlid: u16,
        digests: Digests,
    ) -> (Queue, u16) {
        let mut h = RawHost::connect(addr);
        let ic = h.icreq(digests);
        let cd = ConnectData {
            hostid: [7; 16],
            cntlid,
            subnqn: NQN.into(),
            hostnqn: HOSTNQN.into(),
        };
        let cqe = h.fabrics_connect(qid, sqsize, 0, 0, &cd);
        assert!(
            cqe.status().is_success(),
            "connect queue {qid}: {:?}",
            cqe.status()
        );
        if qid == 0 {
            h.enable();
        }
        let q = Queue {
            h,
            qid,
            depth: usize::from(sqsize) + 1,
            maxh2cdata: ic.maxh2cdata,
            outstanding: HashMap::new(),
            owed: VecDeque::new(),
            next_cid: 0x100,
            ended: false,
        };
        (q, cqe.dw0 as u16)
    }

    fn cid(&mut self) -> u16 {
        loop {
            self.next_cid = self.next_cid.wrapping_add(1);
            if !self.outstanding.contains_key(&self.next_cid) {
                return self.next_cid;
            }
        }
    }

    fn send_command(&mut self, rng: &mut Rng, tally: &mut Tally) {
        let cid = self.cid();
        let (sqe, data) = random_command(rng, cid, self.qid != 0);
        let mut b = Vec::new();
        pdu::encode_capsule_cmd(&mut b, &sqe, &data, self.h.digests, 0);
        if self.h.s.write_all_or_closed(&b) {
            self.ended = true;
            return;
        }
        let aer = self.qid == 0 && sqe.opcode == 0x0c;
        self.outstanding.insert(cid, Sent { sqe, aer });
        tally.commands += 1;
    }

    /// Sends the next part of one owed R2T (a random one, so that the data of several commands interleave).
    fn answer_r2t(&mut self, rng: &mut Rng, tally: &mut Tally, whole: bool) {
        if self.owed.is_empty() {
            return;
        }
        let i = rng.below(self.owed.len() as u64) as usize;
        let o = self.owed[i];
        let left = o.end - o.at;
        let n = if whole {
            left.min(self.maxh2cdata)
        } else {
            (1 + rng.below(u64::from(left)) as u32).min(self.maxh2cdata)
        };
        let last = o.at + n == o.end;
        let hdr = pdu::H2CDataHdr {
            cccid: o.cccid,
            ttag: o.ttag,
            datao: o.at,
            datal: n,
            last,
        };
        let mut b = Vec::new();
        pdu::encode_h2c_data(&mut b, &hdr, &vec![0xa5; n as usize], self.h.digests, 0);
        if self.h.s.write_all_or_closed(&b) {
            self.ended = true;
            return;
        }
        tally.h2c_pdus += 1;
        if last {
            self.owed.remove(i);
            tally.r2ts += 1;
        } else {
            self.owed[i].at += n;
        }
    }

    /// Takes what arrives within `wait`; checks each PDU against what is outstanding.
    fn receive(&mut self, wait: Duration, tally: &mut Tally) -> Result<bool, Violation> {
        if self.ended {
            return Ok(false);
        }
        let resp = match self.h.poll_recv(wait) {
            Polled::Nothing => return Ok(false),
            Polled::Closed => {
                self.end(tally);
                return Ok(true);
            }
            Polled::Pdu(r) => r,
        };
        let qid = self.qid;
        match resp {
            Resp::Cqe(c) => match self.outstanding.remove(&c.cid) {
                Some(_) => tally.answers += 1,
                None => {
                    return Err(Violation::NotOutstanding {
                        qid,
                        what: "a completion",
                        cid: c.cid,
                        detail: Some(format!("{c:?}")),
                    })
                }
            },
            Resp::C2H { hdr, .. } => {
                if !self.outstanding.contains_key(&hdr.cccid) {
                    return Err(Violation::NotOutstanding {
                        qid,
                        what: "C2HData",
                        cid: hdr.cccid,
                        detail: None,
                    });
                }
                if hdr.success {
                    self.outstanding.remove(&hdr.cccid);
                    tally.answers += 1;
                }
            }
            Resp::R2T(r) => {
                if !self.outstanding.contains_key(&r.cccid) {
                    return Err(Violation::NotOutstanding {
                        qid,
                        what: "R2T",
                        cid: r.cccid,
                        detail: None,
                    });
                }
                self.owed.push_back(Owed {
                    cccid: r.cccid,
                    ttag: r.ttag,
                    at: r.r2to,
                    end: r.r2to + r.r2tl,
                });
            }
            Resp::TermReq { .. } => {
                // The connection ends: whatever else comes until the close is not checked.
                while !matches!(
                    self.h.poll_recv(Duration::from_secs(5)),
                    Polled::Closed | Polled::Nothing
                ) {}
                self.end(tally);
            }
            Resp::IcResp(_) => return Err(Violation::IcRespAfterUp { qid }),
        }
        Ok(true)
    }

    fn end(&mut self, tally: &mut Tally) {
        self.ended = true;
        tally.ended += 1;
        self.owed.clear();
    }

    /// Answers every R2T and waits for every command but the held AERs to be answered.
    fn settle(&mut self, tally: &mut Tally, rng: &mut Rng) -> Result<(), Violation> {
        let mut last_progress = Instant::now();
        while !self.ended {
            while !self.owed.is_empty() && !self.ended {
                self.answer_r2t(rng, tally, true);
            }
            let owed = self.outstanding.values().filter(|s| !s.aer).count();
            if owed == 0 {
                break;
            }
            if self.receive(Duration::from_millis(2), tally)? {
                last_progress = Instant::now();
            } else if last_progress.elapsed() > Duration::from_secs(5) {
                let mut never: Vec<String> = self
                    .outstanding
                    .iter()
                    .filter(|(_, s)| !s.aer)
                    .map(|(cid, s)| {
                        format!(
                            "cid {cid:#x}: opcode {:#04x} flags {:#04x} nsid {:#x} cdw10 {:#x} dptr {:02x?}",
                            s.sqe.opcode,
                            s.sqe.flags,
                            s.sqe.nsid,
                            s.sqe.cdw10,
                            s.sqe.dptr_bytes()
                        )
                    })
                    .collect();
                never.sort();
                return Err(Violation::NeverAnswered {
                    qid: self.qid,
                    commands: never,
                });
            }
        }
        tally.held_aers += self.outstanding.values().filter(|s| s.aer).count() as u64;
        Ok(())
    }
}

/// Writes all of `b`; `true` when the target has closed the connection.
trait WriteOrClosed {
    fn write_all_or_closed(&mut self, b: &[u8]) -> bool;
}

impl WriteOrClosed for std::net::TcpStream {
    fn write_all_or_closed(&mut self, b: &[u8]) -> bool {
        std::io::Write::write_all(self, b).is_err()
    }
}

/// A random command: mostly real opcodes (admin or NVM), with fields at their limits, random PSDT and SGL
/// descriptors, in-capsule data or a transport data block.
fn random_command(rng: &mut Rng, cid: u16, io_queue: bool) -> (Sqe, Vec<u8>) {
    if io_queue && rng.below(3) == 0 {
        return well_formed_io(rng, cid);
    }
    const ADMIN: [u8; 13] = [
        0x02, 0x06, 0x08, 0x09, 0x0a, 0x0c, 0x18, 0x7f, 0x00, 0x01, 0x10, 0x80, 0x05,
    ];
    const IO: [u8; 14] = [
        0x00, 0x01, 0x02, 0x08, 0x09, 0x05, 0x7f, 0x04, 0x0d, 0x0e, 0x11, 0x15, 0xdc, 0x80,
    ];
    let opcode = if rng.below(8) == 0 {
        rng.next_u64() as u8
    } else if io_queue {
        IO[rng.below(IO.len() as u64) as usize]
    } else {
        ADMIN[rng.below(ADMIN.len() as u64) as usize]
    };
    let mut sqe = Sqe {
        opcode,
        cid,
        nsid: match rng.below(4) {
            0 => rng.field(),
            _ => 1 + rng.below(3) as u32,
        },
        cdw2: rng.field(),
        cdw10: rng.field(),
        cdw11: rng.field(),
        cdw12: if rng.below(2) == 0 {
            rng.below(64) as u32
        } else {
            rng.field()
        },
        cdw13: rng.field(),
        cdw14: rng.field(),
        cdw15: rng.field(),
        ..Default::default()
    };
    if opcode == fabrics::FABRICS {
        // Not Property Set (it may disable the controller, which ends its queues) nor Disconnect (which ends
        // this one): both end queues by design, leaving nothing to check.
        while matches!(sqe.nsid as u8, 0x00 | 0x08) {
            sqe.nsid = rng.next_u64() as u32 & !0xff
                | [0x01, 0x04, 0x05, 0x06, 0x7f][rng.below(5) as usize];
        }
    }
    let data = match rng.below(6) {
        0 => {
            let n = [16usize, 512, 1024, 4096, 100][rng.below(5) as usize];
            let data = vec![rng.next_u64() as u8; n];
            sqe.set_sgl(&SglDescriptor::in_capsule(0, n as u32));
            data
        }
        1 | 2 => {
            let len = [0u32, 16, 512, 4096, 8192, 1 << 20, rng.field()][rng.below(7) as usize];
            sqe.set_sgl(&SglDescriptor::transport_data_block(len));
            Vec::new()
        }
        3 => {
            // Any descriptor at all, any PSDT.
            let mut b = [0u8; 16];
            for x in b.iter_mut() {
                *x = rng.next_u64() as u8;
            }
            sqe.set_dptr_bytes(&b);
            Vec::new()
        }
        _ => {
            sqe.set_sgl(&SglDescriptor::transport_data_block(0));
            Vec::new()
        }
    };
    // Reserved flag bits, FUSE and PSDT now and then.
    if rng.below(4) == 0 {
        sqe.flags = rng.next_u64() as u8;
    }
    (sqe, data)
}

/// A well-formed read, write, write zeroes, flush or deallocate on namespace 1 (512-byte blocks), usually in
/// range; the data of writes in the capsule or fetched with R2T.
fn well_formed_io(rng: &mut Rng, cid: u16) -> (Sqe, Vec<u8>) {
    let blocks = NS1_BYTES / 512;
    let max = if rng.below(4) == 0 { 2048 } else { 32 };
    let nlb = 1 + rng.below(max);
    let slba = if rng.below(8) == 0 {
        blocks - rng.below(64)
    } else {
        rng.below(blocks - nlb)
    };
    let len = (nlb * 512) as u32;
    let nlb0 = (nlb - 1) as u16;
    let mut sqe = match rng.below(5) {
        0 => Sqe::read(1, slba, nlb0),
        1 => Sqe::write(1, slba, nlb0),
        2 => Sqe::write_zeroes(1, slba, nlb0),
        3 => {
            let ranges = 1 + rng.below(4) as u8;
            Sqe::dsm_deallocate(1, ranges - 1)
        }
        _ => Sqe::flush(1),
    };
    if rng.below(4) == 0 && sqe.opcode != 0x09 {
        sqe = sqe.with_fua();
    }
    sqe.cid = cid;
    let data = match sqe.opcode {
        0x01 if len <= 4096 && rng.below(2) == 0 => vec![rng.next_u64() as u8; len as usize],
        0x09 => {
            let n = (sqe.cdw10 & 0xff) as u64 + 1;
            let data: Vec<u8> = (0..n)
                .flat_map(|_| {
                    DsmRange {
                        attributes: 0,
                        nlb: 1 + rng.below(64) as u32,
                        slba: rng.below(blocks),
                    }
                    .to_bytes()
                })
                .collect();
            if rng.below(2) == 0 {
                data
            } else {
                sqe.set_sgl(&SglDescriptor::transport_data_block(data.len() as u32));
                return (sqe, Vec::new());
            }
        }
        _ => Vec::new(),
    };
    if !data.is_empty() {
        sqe.set_sgl(&SglDescriptor::in_capsule(0, data.len() as u32));
    } else {
        let xfer = if matches!(sqe.opcode, 0x01 | 0x02) {
            len
        } else {
            0
        };
        sqe.set_sgl(&SglDescriptor::transport_data_block(xfer));
    }
    (sqe, data)
}

/// Runs rounds until `rounds` are done or `until` passes (whichever first; `rounds` 0: only the time).
pub fn run(
    addr: SocketAddr,
    seed: u64,
    rounds: u64,
    steps: usize,
    until: Option<Instant>,
) -> Result<Tally, Violation> {
    let mut rng = Rng(seed | 1);
    let mut tally = Tally::default();
    loop {
        if rounds > 0 && tally.rounds >= rounds {
            break;
        }
        if until.is_some_and(|t| Instant::now() >= t) {
            break;
        }
        round(addr, &mut rng, steps, &mut tally).map_err(|e| Violation::InRound {
            round: tally.rounds,
            seed,
            tally: tally.clone(),
            violation: Box::new(e),
        })?;
        tally.rounds += 1;
    }
    Ok(tally)
}

fn round(
    addr: SocketAddr,
    rng: &mut Rng,
    steps: usize,
    tally: &mut Tally,
) -> Result<(), Violation> {
    let digests = Digests {
        header: rng.below(3) == 0,
        data: rng.below(3) == 0,
    };
    let (admin, cntlid) = Queue::open(
        addr,
        0,
        31,
        nvpoll::spec::fabrics::CNTLID_DYNAMIC,
        Digests::NONE,
    );
    let mut queues = vec![admin];
    for qid in 1..=2 {
        let sqsize = [15u16, 63, 127][rng.below(3) as usize];
        queues.push(Queue::open(addr, qid, sqsize, cntlid, digests).0);
    }
    for _ in 0..steps {
        let live: Vec<usize> = (0..queues.len()).filter(|&i| !queues[i].ended).collect();
        if live.is_empty() {
            break;
        }
        let q = &mut queues[live[rng.below(live.len() as u64) as usize]];
        match rng.below(10) {
            0..=4 => {
                // Keep one entry free: the target may refuse a full queue.
                if q.outstanding.len() + 1 < q.depth {
                    q.send_command(rng, tally);
                }
            }
            5..=7 => q.answer_r2t(rng, tally, false),
            _ => while q.receive(Duration::from_micros(100), tally)? {},
        }
    }
    // I/O queues first: the admin queue's end takes the controller (and so them) down.
    for q in queues.iter_mut().rev() {
        q.settle(tally, rng)?;
    }
    Ok(())
}

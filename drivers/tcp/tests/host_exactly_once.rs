//! Every request our host accepts is handed back exactly once, whatever the target does: a stateful fuzzer
//! of a host queue against a scripted target that answers many outstanding commands out of order (reads in
//! one to three C2HData PDUs, with the SUCCESS flag or a response capsule; writes in the capsule or through
//! R2Ts; random statuses), and now and then does something hostile: a response for a command that is not
//! outstanding or was answered already, data for a write or past a read's end, SUCCESS before all the data,
//! an R2T for a read or past a write's end, garbage, a termination request, or a close. Then the host must
//! fail the queue, and every command it had accepted comes back once, with an error; a read comes back as
//! a success only with all of its data. The target checks the host too: H2CData only for what an R2T asked,
//! no command ID reused while outstanding. Seeded; NVPOLL_HOST_EXACTLY_ONCE_ROUNDS runs more rounds.

use std::collections::{HashMap, HashSet};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use nvpoll::mem::DmaPool;
use nvpoll::spec::{Cqe, Sqe, Status};
use nvpoll_tcp::pdu::{self, Decoded, Digests, Pdu};
use nvpoll_tcp::queue::{DataDir, HostQueue, QueueParams};

/// The byte every read's data is made of.
const READ_BYTE: u8 = 0xc3;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A command as the scripted target holds it.
#[derive(Clone, Copy, Debug)]
struct Held {
    opcode: u8,
    /// Bytes its data pointer names.
    len: u32,
    /// Write data received so far (all of it for in-capsule data).
    received: u32,
    /// An R2T for the rest was sent and not yet fully answered.
    r2t_open: bool,
}

/// The scripted target's side of one round.
struct Peer {
    s: TcpStream,
    rng: Rng,
    digests: Digests,
    rx: Vec<u8>,
    held: HashMap<u16, Held>,
    /// Command IDs answered, the last few (a duplicate answer picks one).
    answered: Vec<u16>,
    /// Percent of actions that are hostile.
    hostility: u64,
    /// Set by the host side: answer everything properly from now on.
    drain: Arc<AtomicBool>,
    /// What the host did wrong (the test fails on any).
    violations: Arc<Mutex<Vec<String>>>,
    ttag: u16,
}

impl Peer {
    fn violation(&self, what: String) {
        self.violations.lock().unwrap().push(what);
    }

    /// Reads what the host sent; `false` once it has closed.
    fn take_input(&mut self) -> bool {
        let mut chunk = [0u8; 65536];
        match self.s.read(&mut chunk) {
            Ok(0) => return false,
            Ok(n) => self.rx.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(_) => return false,
        }
        let cfg = pdu::DecodeConfig::new(pdu::Direction::ToController, self.digests, 1 << 20);
        loop {
            let (consumed, pdu) = match pdu::decode(&self.rx, &cfg) {
                Ok(Decoded::Pdu { pdu, len }) => (len, pdu_summary(pdu)),
                Ok(Decoded::Incomplete { .. }) => return true,
                Err(e) => {
                    self.violation(format!("the host sent a PDU the target cannot decode: {e}"));
                    return false;
                }
            };
            self.rx.drain(..consumed);
            match pdu {
                FromHost::Command {
                    cid,
                    opcode,
                    len,
                    in_capsule,
                } => {
                    if self.held.contains_key(&cid) {
                        self.violation(format!("command ID {cid:#x} reused while outstanding"));
                    }
                    let received = if in_capsule { len } else { 0 };
                    self.held.insert(
                        cid,
                        Held {
                            opcode,
                            len,
                            received,
                            r2t_open: false,
                        },
                    );
                }
                FromHost::Data {
                    cccid,
                    datao,
                    datal,
                    last,
                } => {
                    let answered_early = self.answered.contains(&cccid);
                    let bad = match self.held.get_mut(&cccid) {
                        Some(h) if h.r2t_open && datao == h.received && datao + datal <= h.len => {
                            h.received += datal;
                            if last {
                                h.r2t_open = false;
                            }
                            None
                        }
                        // Data for a command answered early (an error before its R2T was served) is dropped.
                        None if answered_early => None,
                        other => Some(format!(
                            "H2CData for {cccid:#x} at {datao}+{datal} that no R2T asked for ({other:?})"
                        )),
                    };
                    if let Some(m) = bad {
                        self.violation(m);
                    }
                }
                FromHost::TermReq => return false,
                FromHost::Other(t) => self.violation(format!("the host sent a {t} PDU")),
            }
        }
    }

    fn send(&mut self, b: &[u8]) -> bool {
        self.s.set_nonblocking(false).unwrap();
        let ok = self.s.write_all(b).is_ok();
        self.s.set_nonblocking(true).unwrap();
        ok
    }

    fn complete(&mut self, cid: u16, status: Status) -> Vec<u8> {
        self.held.remove(&cid);
        self.answered.push(cid);
        if self.answered.len() > 16 {
            self.answered.remove(0);
        }
        let cqe = Cqe {
            cid,
            status_phase: status.raw() << 1,
            ..Default::default()
        };
        let mut b = Vec::new();
        pdu::encode_capsule_resp(&mut b, &cqe, self.digests);
        b
    }

    fn random_status(&mut self) -> Status {
        match self.rng.below(10) {
            0 => Status::LBA_OUT_OF_RANGE,
            1 => Status::INVALID_FIELD.with_dnr(),
            _ => Status::SUCCESS,
        }
    }

    /// One proper step for a random held command: R2T, data, or its answer.
    fn good_step(&mut self) -> Option<Vec<u8>> {
        let cids: Vec<u16> = self
            .held
            .iter()
            .filter(|(_, h)| !h.r2t_open)
            .map(|(&c, _)| c)
            .collect();
        if cids.is_empty() {
            return None;
        }
        let cid = cids[self.rng.below(cids.len() as u64) as usize];
        let h = self.held[&cid];
        let mut b = Vec::new();
        match h.opcode {
            0x01 if h.received < h.len && self.rng.below(6) != 0 => {
                // Ask for the rest, or for part of it.
                let left = h.len - h.received;
                let n = if left > 512 && self.rng.below(2) == 0 {
                    left / 2
                } else {
                    left
                };
                self.ttag = self.ttag.wrapping_add(1);
                let r2t = pdu::R2T {
                    cccid: cid,
                    ttag: self.ttag,
                    r2to: h.received,
                    r2tl: n,
                };
                pdu::encode_r2t(&mut b, &r2t, self.digests);
                self.held.get_mut(&cid).unwrap().r2t_open = true;
            }
            0x02 if self.rng.below(8) != 0 => {
                let status = self.random_status();
                let mut at = 0;
                while at < h.len {
                    let n = if self.rng.below(2) == 0 {
                        h.len - at
                    } else {
                        (1 + self.rng.below(u64::from(h.len - at))) as u32
                    };
                    let last = at + n == h.len;
                    let success = last && status.is_success() && self.rng.below(2) == 0;
                    let hdr = pdu::C2HDataHdr {
                        cccid: cid,
                        datao: at,
                        datal: n,
                        last,
                        success,
                    };
                    pdu::encode_c2h_data(
                        &mut b,
                        &hdr,
                        &vec![READ_BYTE; n as usize],
                        self.digests,
                        0,
                    );
                    at += n;
                    if success {
                        self.held.remove(&cid);
                        self.answered.push(cid);
                        return Some(b);
                    }
                }
                b.extend(self.complete(cid, status));
            }
            _ => {
                // Any command may be answered with an error before its data; writes with all data may succeed.
                let status = if h.opcode == 0x01 && h.received < h.len {
                    Status::INVALID_FIELD.with_dnr()
                } else if h.opcode == 0x02 {
                    Status::LBA_OUT_OF_RANGE
                } else {
                    self.random_status()
                };
                b = self.complete(cid, status);
            }
        }
        Some(b)
    }

    /// Something a target must not do; the host must end the queue.
    fn hostile_step(&mut self) -> Option<Vec<u8>> {
        let mut b = Vec::new();
        let any = self.held.keys().copied().next();
        let read = self
            .held
            .iter()
            .find(|(_, h)| h.opcode == 0x02 && h.len > 0)
            .map(|(&c, h)| (c, *h));
        let write = self
            .held
            .iter()
            .find(|(_, h)| h.opcode == 0x01)
            .map(|(&c, h)| (c, *h));
        match self.rng.below(10) {
            0 => {
                let mut cid = self.rng.next() as u16;
                while self.held.contains_key(&cid) {
                    cid = cid.wrapping_add(1);
                }
                let cqe = Cqe {
                    cid,
                    ..Default::default()
                };
                pdu::encode_capsule_resp(&mut b, &cqe, self.digests);
            }
            1 => {
                // An answer again for a command answered already (unless the host reused its ID since).
                let cid = *self.answered.last()?;
                if self.held.contains_key(&cid) {
                    return None;
                }
                let cqe = Cqe {
                    cid,
                    ..Default::default()
                };
                pdu::encode_capsule_resp(&mut b, &cqe, self.digests);
            }
            2 => {
                let (cid, h) = write?;
                let hdr = pdu::C2HDataHdr {
                    cccid: cid,
                    datao: 0,
                    datal: 512.min(h.len.max(1)),
                    last: true,
                    success: false,
                };
                pdu::encode_c2h_data(
                    &mut b,
                    &hdr,
                    &vec![READ_BYTE; hdr.datal as usize],
                    self.digests,
                    0,
                );
            }
            3 => {
                let (cid, h) = read?;
                let hdr = pdu::C2HDataHdr {
                    cccid: cid,
                    datao: h.len,
                    datal: 512,
                    last: true,
                    success: false,
                };
                pdu::encode_c2h_data(&mut b, &hdr, &[READ_BYTE; 512], self.digests, 0);
            }
            4 => {
                let (cid, h) = read?;
                if h.len < 2 {
                    return None;
                }
                let hdr = pdu::C2HDataHdr {
                    cccid: cid,
                    datao: 0,
                    datal: h.len / 2,
                    last: true,
                    success: true,
                };
                pdu::encode_c2h_data(
                    &mut b,
                    &hdr,
                    &vec![READ_BYTE; (h.len / 2) as usize],
                    self.digests,
                    0,
                );
            }
            5 => {
                let (cid, h) = read?;
                let r2t = pdu::R2T {
                    cccid: cid,
                    ttag: 1,
                    r2to: 0,
                    r2tl: h.len,
                };
                pdu::encode_r2t(&mut b, &r2t, self.digests);
            }
            6 => {
                let (cid, h) = write?;
                let r2t = pdu::R2T {
                    cccid: cid,
                    ttag: 2,
                    r2to: h.len,
                    r2tl: 4096,
                };
                pdu::encode_r2t(&mut b, &r2t, self.digests);
            }
            7 => {
                let cid = any.unwrap_or(1);
                let _ = cid;
                for _ in 0..8 + self.rng.below(64) {
                    b.push(self.rng.next() as u8);
                }
            }
            8 => {
                pdu::encode_c2h_term_req(
                    &mut b,
                    &pdu::TermReq {
                        fes: 1,
                        fei: 0,
                        data: &[],
                    },
                );
            }
            _ => {
                let _ = self.s.shutdown(std::net::Shutdown::Both);
                return Some(Vec::new());
            }
        }
        Some(b)
    }

    fn run(mut self) {
        self.s.set_nonblocking(true).unwrap();
        let mut ended = false;
        loop {
            if !self.take_input() {
                return;
            }
            if ended {
                // A hostile step ends the round's good behaviour: close our side after what it sent, so that a
                // host left waiting for the rest of a garbage PDU sees the end instead of waiting for ever (a
                // real host would give up after its command timeout, longer than this test waits).
                let _ = self.s.shutdown(std::net::Shutdown::Write);
                thread::sleep(Duration::from_micros(200));
                continue;
            }
            let draining = self.drain.load(Ordering::Acquire);
            let out = if !draining && self.rng.below(1000) < self.hostility * 10 {
                let out = self.hostile_step();
                ended = out.is_some();
                out
            } else if draining || self.rng.below(3) != 0 {
                self.good_step()
            } else {
                None
            };
            match out {
                Some(b) if !b.is_empty() => {
                    if !self.send(&b) {
                        return;
                    }
                }
                _ => thread::sleep(Duration::from_micros(100)),
            }
        }
    }
}

/// What the scripted target needs of a host PDU.
enum FromHost {
    Command {
        cid: u16,
        opcode: u8,
        len: u32,
        in_capsule: bool,
    },
    Data {
        cccid: u16,
        datao: u32,
        datal: u32,
        last: bool,
    },
    TermReq,
    Other(String),
}

fn pdu_summary(p: Pdu<'_>) -> FromHost {
    match p {
        Pdu::CapsuleCmd { sqe, data } => FromHost::Command {
            cid: sqe.cid,
            opcode: sqe.opcode,
            len: sqe.sgl().length,
            in_capsule: !data.is_empty(),
        },
        Pdu::H2CData { hdr, .. } => FromHost::Data {
            cccid: hdr.cccid,
            datao: hdr.datao,
            datal: hdr.datal,
            last: hdr.last,
        },
        Pdu::H2CTermReq(_) => FromHost::TermReq,
        other => FromHost::Other(other.pdu_type().to_string()),
    }
}

/// Starts the scripted target for one round; returns its address and the thread.
fn start_peer(
    seed: u64,
    hostility: u64,
    digests: Digests,
    drain: Arc<AtomicBool>,
    violations: Arc<Mutex<Vec<String>>>,
) -> (SocketAddr, thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.set_nodelay(true).unwrap();
        let mut icreq = [0u8; 128];
        if s.read_exact(&mut icreq).is_err() {
            return;
        }
        let mut b = Vec::new();
        pdu::encode_ic_resp(
            &mut b,
            &pdu::IcResp {
                pfv: 0,
                cpda: 0,
                digests,
                maxh2cdata: 8192,
            },
        );
        if s.write_all(&b).is_err() {
            return;
        }
        Peer {
            s,
            rng: Rng(seed | 1),
            digests,
            rx: Vec::new(),
            held: HashMap::new(),
            answered: Vec::new(),
            hostility,
            drain,
            violations,
            ttag: 0,
        }
        .run();
    });
    (addr, t)
}

/// What the host side of a round saw.
#[derive(Default, Debug)]
struct Seen {
    accepted: u64,
    handed_back: u64,
    successes: u64,
    failed_queue: bool,
}

/// Takes what the queue handed back: each tag accepted, once; a successful read with all of its data.
fn take(
    q: &mut HostQueue,
    accepted: &HashMap<u64, Option<u32>>,
    back: &mut HashSet<u64>,
    seen: &mut Seen,
) -> Result<(), String> {
    while let Some(d) = q.pop_done() {
        let Some(read_len) = accepted.get(&d.tag) else {
            return Err(format!("tag {} handed back but never accepted", d.tag));
        };
        if !back.insert(d.tag) {
            return Err(format!("tag {} handed back twice", d.tag));
        }
        seen.handed_back += 1;
        if d.buf.is_none() && read_len.is_some() {
            return Err(format!("tag {}: the buffer was not handed back", d.tag));
        }
        if let Ok(cqe) = &d.result {
            if cqe.status().is_success() {
                seen.successes += 1;
                if let (Some(len), Some(buf)) = (read_len, &d.buf) {
                    if buf.as_slice()[..*len as usize]
                        .iter()
                        .any(|&x| x != READ_BYTE)
                    {
                        return Err(format!(
                            "tag {}: a read completed successfully without all its data",
                            d.tag
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

fn round(seed: u64, pool: &DmaPool) -> Result<Seen, String> {
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let hostility = [0, 1, 3, 10][rng.below(4) as usize];
    let digests = Digests {
        header: rng.below(2) == 0,
        data: rng.below(3) == 0,
    };
    let drain = Arc::new(AtomicBool::new(false));
    let violations = Arc::new(Mutex::new(Vec::new()));
    let (addr, peer) = start_peer(
        rng.next(),
        hostility,
        digests,
        Arc::clone(&drain),
        Arc::clone(&violations),
    );
    let depth = [4u16, 16, 64][rng.below(3) as usize];
    let mut q = HostQueue::connect(&QueueParams {
        addr,
        qid: 1,
        depth,
        header_digest: digests.header,
        data_digest: digests.data,
        max_transfer: 64 * 1024,
        connect_timeout: Duration::from_secs(5),
        tls: None,
        key_renewal: Default::default(),
        tcp_congestion: None,
    })
    .map_err(|e| format!("ICReq: {e}"))?;
    // tag -> (read length or None)
    let mut accepted: HashMap<u64, Option<u32>> = HashMap::new();
    let mut back: HashSet<u64> = HashSet::new();
    let mut seen = Seen::default();
    let mut next_tag = 1u64;
    let steps = 300 + rng.below(300);
    for _ in 0..steps {
        if rng.below(3) != 0 {
            let len = [512u32, 1024, 4096, 16384, 65536][rng.below(5) as usize];
            let blocks = (len / 512 - 1) as u16;
            let (sqe, dir, buf) = match rng.below(5) {
                0 | 1 => {
                    let mut b = pool.alloc(len as usize).unwrap();
                    b.as_mut_slice().fill(0);
                    (Sqe::read(1, 0, blocks), DataDir::FromController, Some(b))
                }
                2 | 3 => (
                    Sqe::write(1, 0, blocks),
                    DataDir::ToController,
                    Some(pool.alloc(len as usize).unwrap()),
                ),
                _ => (Sqe::flush(1), DataDir::None, None),
            };
            let xfer = if dir == DataDir::None { 0 } else { len };
            let tag = next_tag;
            next_tag += 1;
            if q.submit(sqe, dir, buf, xfer, tag).is_ok() {
                accepted.insert(tag, (dir == DataDir::FromController).then_some(len));
                seen.accepted += 1;
            }
        }
        // Poll for a while (the target answers from its own thread), taking what comes back.
        let until = Instant::now() + Duration::from_micros(rng.below(300));
        loop {
            if q.poll().is_err() {
                seen.failed_queue = true;
                break;
            }
            take(&mut q, &accepted, &mut back, &mut seen)?;
            if Instant::now() >= until {
                break;
            }
        }
        if seen.failed_queue {
            break;
        }
    }
    if !seen.failed_queue {
        drain.store(true, Ordering::Release);
        let deadline = Instant::now() + Duration::from_secs(10);
        while q.outstanding() > 0 {
            if q.poll().is_err() {
                seen.failed_queue = true;
                break;
            }
            take(&mut q, &accepted, &mut back, &mut seen)?;
            if Instant::now() > deadline {
                return Err(format!(
                    "{} command(s) still outstanding 10 s after the target began answering everything",
                    q.outstanding()
                ));
            }
        }
    }
    take(&mut q, &accepted, &mut back, &mut seen)?;
    if q.outstanding() != 0 {
        return Err(format!(
            "{} command(s) outstanding after the queue failed",
            q.outstanding()
        ));
    }
    let missing: Vec<u64> = accepted
        .keys()
        .filter(|t| !back.contains(t))
        .copied()
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "{} accepted request(s) never handed back: tags {missing:?}",
            missing.len()
        ));
    }
    drop(q);
    peer.join()
        .map_err(|_| "the scripted target panicked".to_string())?;
    let v = violations.lock().unwrap();
    if !v.is_empty() {
        return Err(format!("the host misbehaved: {}", v.join("; ")));
    }
    Ok(seen)
}

#[test]
fn every_accepted_request_is_handed_back_exactly_once() {
    let rounds: u64 = std::env::var("NVPOLL_HOST_EXACTLY_ONCE_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40);
    let pool = DmaPool::builder()
        .class(4096, 256)
        .class(65536, 256)
        .build()
        .unwrap();
    let mut total = Seen::default();
    let mut failed = 0;
    for seed in 1..=rounds {
        let seen = round(seed, &pool).unwrap_or_else(|e| panic!("round {seed}: {e}"));
        total.accepted += seen.accepted;
        total.handed_back += seen.handed_back;
        total.successes += seen.successes;
        failed += u64::from(seen.failed_queue);
    }
    eprintln!(
        "{rounds} rounds: {} requests accepted, {} handed back ({} successes), {failed} queues failed by a hostile target",
        total.accepted, total.handed_back, total.successes
    );
    assert_eq!(total.accepted, total.handed_back);
    assert!(
        failed > 0 && failed < rounds,
        "both hostile and clean rounds ran"
    );
}

//! The host side of one NVMe/TCP queue (admin or I/O): connection, ICReq/ICResp, command slots, and the
//! receive path that turns CapsuleResp, C2HData and R2T PDUs into completions.
//!
//! A [`HostQueue`] is owned by one thread (a reactor). It never blocks: [`HostQueue::submit`] encodes the
//! command into the connection's send buffer and [`HostQueue::poll`] reads, decodes and completes. The
//! blocking helpers used during bring-up ([`HostQueue::run`]) only spin on `poll` with a deadline.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvpoll::mem::DmaBuf;
use nvpoll::send::{SendMode, SendPolicy};
use nvpoll::spec::{CommandKind, Cqe, SglDescriptor, Sqe, Status, SQE_SIZE};

use crate::conn::{Conn, DIRECT_SEND_MIN};
use crate::pdu::{self, Decoded, Pdu};
use crate::Error;

/// Data direction of a command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataDir {
    /// No data.
    None,
    /// Host to controller (write-like): in-capsule or through R2T/H2CData.
    ToController,
    /// Controller to host (read-like): through C2HData.
    FromController,
}

/// Parameters of one queue connection.
#[derive(Clone, Debug)]
pub struct QueueParams {
    /// Target address.
    pub addr: SocketAddr,
    /// Queue ID (0 = admin).
    pub qid: u16,
    /// Number of commands that may be outstanding.
    pub depth: u16,
    /// Ask for header digests.
    pub header_digest: bool,
    /// Ask for data digests.
    pub data_digest: bool,
    /// Largest transfer of one command in bytes.
    pub max_transfer: u32,
    /// Time allowed for TCP connect, the TLS handshake and ICReq/ICResp.
    pub connect_timeout: Duration,
    /// TLS 1.3 with a PSK before ICReq, when set.
    pub tls: Option<crate::tls::ClientConfig>,
    /// With TLS: when the connection renews its keys.
    pub key_renewal: crate::KeyRenewal,
    /// The TCP congestion control of the connection; `None`: the system's, or cubic for a loopback connection
    /// under BBR (see [`crate::conn::apply_congestion`]).
    pub tcp_congestion: Option<String>,
}

/// What a finished command hands back.
#[derive(Debug)]
pub struct Done {
    /// The tag given at submit.
    pub tag: u64,
    /// The buffer given at submit.
    pub buf: Option<DmaBuf>,
    /// The completion entry (synthesised for a C2HData with SUCCESS), or why the command failed.
    pub result: Result<Cqe, Error>,
}

#[derive(Debug, Default)]
#[repr(C)]
struct Slot {
    // Hot: what a completion and a data PDU of the command read and write.
    busy: bool,
    /// Data went in the capsule (no R2T expected).
    in_capsule: bool,
    /// A C2HData PDU of this command failed its data digest: the command fails whatever its status.
    data_digest_error: bool,
    /// An Abort was requested for it after it timed out.
    abort_sent: bool,
    len: u32,
    /// Read: bytes of C2HData received. Write: bytes solicited by R2T so far.
    transferred: u32,
    dir: Option<DataDir>,
    tag: u64,
    buf: Option<DmaBuf>,
    /// When it was submitted (the queue's coarse clock: the start of the last poll).
    since: Option<Instant>,
    // Cold: read again only to resubmit the command after a reconnect or to abort it.
    /// The command as submitted (with its CID).
    sqe: Sqe,
}

// The command kept for resubmission comes last, after the fields a completion touches; a slot grows only on
// purpose.
const _: () = assert!(std::mem::size_of::<Slot>() <= 152);
const _: () = assert!(std::mem::offset_of!(Slot, sqe) + SQE_SIZE == std::mem::size_of::<Slot>());

impl Slot {
    /// The slot of a command just submitted.
    #[inline]
    fn new(
        sqe: Sqe,
        dir: DataDir,
        tag: u64,
        buf: Option<DmaBuf>,
        len: u32,
        in_capsule: bool,
        now: Instant,
    ) -> Slot {
        Slot {
            busy: true,
            in_capsule,
            data_digest_error: false,
            abort_sent: false,
            len,
            transferred: 0,
            dir: Some(dir),
            tag,
            buf,
            since: Some(now),
            sqe,
        }
    }
}

/// A command taken back from a failed queue, to be submitted again on a new connection.
#[derive(Debug)]
pub struct Orphan {
    /// The command (its CID is reassigned on resubmission).
    pub sqe: Sqe,
    /// Data direction.
    pub dir: DataDir,
    /// The buffer.
    pub buf: Option<DmaBuf>,
    /// Data length in bytes.
    pub len: u32,
    /// The caller's tag.
    pub tag: u64,
}

/// The lists of a queue that outlive its connection: finished commands not yet taken, and (with
/// [`HostQueue::set_keep_orphans`]) the commands a failure left outstanding. [`HostQueue::park`] hands them
/// over when the connection is gone, the owner adds to them while it reconnects, and [`HostQueue::resume`]
/// gives them to the next connection: they move, and are never copied.
#[derive(Debug, Default)]
pub struct Parked {
    /// Finished commands not yet taken, oldest first.
    pub done: VecDeque<Done>,
    /// Commands to submit again on the next connection.
    pub orphans: VecDeque<Orphan>,
}

/// What the receive path does after looking at one PDU.
enum Action {
    None,
    /// Complete the command with this CQE (`None`: the command ended without one, e.g. after a digest error).
    Complete(u16, Option<Cqe>),
    /// Send the H2CData that this (validated) R2T asks for.
    SendData(pdu::R2T),
}

fn slot_in<'s>(slots: &'s mut [Slot], cid: u16, what: &str) -> Result<&'s mut Slot, Error> {
    match slots.get_mut(usize::from(cid)) {
        Some(s) if s.busy => Ok(s),
        _ => Err(Error::Protocol(format!(
            "{what} for unknown command id {cid}"
        ))),
    }
}

/// Checks a C2HData header against the command it names (a read, at the next offset, within its length) and
/// counts its data as transferred; the caller then puts the data in the slot's buffer.
fn accept_c2h<'s>(slots: &'s mut [Slot], hdr: &pdu::C2HDataHdr) -> Result<&'s mut Slot, Error> {
    let cid = hdr.cccid;
    let slot = slot_in(slots, cid, "C2HData")?;
    if slot.dir != Some(DataDir::FromController) {
        return Err(Error::Protocol(format!(
            "C2HData for cid {cid}, which reads no data"
        )));
    }
    let end = u64::from(hdr.datao) + u64::from(hdr.datal);
    if end > u64::from(slot.len) {
        return Err(Error::Protocol(format!(
            "C2HData for cid {cid} covers bytes {}..{end}, beyond the {}-byte transfer",
            hdr.datao, slot.len
        )));
    }
    if hdr.datao != slot.transferred {
        return Err(Error::Protocol(format!(
            "C2HData for cid {cid} at offset {}, expected {}",
            hdr.datao, slot.transferred
        )));
    }
    slot.transferred += hdr.datal;
    Ok(slot)
}

/// Whether a command may return less data than its buffer: Authentication Receive, whose allocation length is
/// a bound (the message says its own length; SPDK's target sends just the message, nvmet and ours pad it).
/// Any other read that ends short is a protocol error, never a success with stale bytes.
fn may_return_less(sqe: &Sqe) -> bool {
    sqe.opcode == nvpoll::spec::fabrics::FABRICS
        && sqe.nsid as u8 == nvpoll::spec::fabrics::AUTH_RECV
}

/// What a C2HData whose data is in place leads to: nothing, or (with SUCCESS) the command's completion.
fn c2h_end(slot: &Slot, qid: u16, hdr: &pdu::C2HDataHdr) -> Result<Action, Error> {
    let cid = hdr.cccid;
    if !hdr.success {
        return Ok(Action::None);
    }
    if slot.transferred != slot.len && !may_return_less(&slot.sqe) {
        return Err(Error::Protocol(format!(
            "C2HData SUCCESS for cid {cid} after {} of {} bytes",
            slot.transferred, slot.len
        )));
    }
    Ok(Action::Complete(
        cid,
        Some(Cqe {
            cid,
            sqid: qid,
            ..Default::default()
        }),
    ))
}

/// Checks one PDU against the command it names and copies C2HData into the command's buffer.
fn on_pdu(slots: &mut [Slot], qid: u16, pdu: &Pdu<'_>) -> Result<Action, Error> {
    match *pdu {
        Pdu::CapsuleResp { cqe } => {
            let slot = slot_in(slots, cqe.cid, "CapsuleResp")?;
            let short_write = slot.dir == Some(DataDir::ToController)
                && !slot.in_capsule
                && slot.transferred < slot.len;
            if short_write && cqe.status().is_success() {
                return Err(Error::Protocol(format!(
                    "write cid {} reported success after {} of {} bytes were asked for",
                    cqe.cid, slot.transferred, slot.len
                )));
            }
            if slot.dir == Some(DataDir::FromController)
                && slot.transferred < slot.len
                && cqe.status().is_success()
                && !may_return_less(&slot.sqe)
            {
                return Err(Error::Protocol(format!(
                    "read cid {} reported success after {} of {} bytes",
                    cqe.cid, slot.transferred, slot.len
                )));
            }
            Ok(Action::Complete(cqe.cid, Some(cqe)))
        }
        Pdu::C2HData { hdr, data } => {
            let slot = accept_c2h(slots, &hdr)?;
            let buf = slot.buf.as_mut().expect("read slot has a buffer");
            buf.as_mut_slice()[hdr.datao as usize..][..data.len()].copy_from_slice(data);
            c2h_end(slot, qid, &hdr)
        }
        Pdu::R2T(r2t) => {
            let cid = r2t.cccid;
            let slot = slot_in(slots, cid, "R2T")?;
            if slot.dir != Some(DataDir::ToController) || slot.in_capsule {
                return Err(Error::Protocol(format!(
                    "R2T for cid {cid}, which has no data to solicit"
                )));
            }
            let end = u64::from(r2t.r2to) + u64::from(r2t.r2tl);
            if r2t.r2tl == 0 || end > u64::from(slot.len) || r2t.r2to != slot.transferred {
                return Err(Error::Protocol(format!(
                    "R2T for cid {cid} asks for bytes {}..{end} of a {}-byte write (next expected {})",
                    r2t.r2to, slot.len, slot.transferred
                )));
            }
            slot.transferred = end as u32;
            Ok(Action::SendData(r2t))
        }
        Pdu::C2HTermReq(t) => Err(Error::TermReq {
            fes: t.fes,
            fei: t.fei,
        }),
        ref other => Err(Error::Protocol(format!(
            "unexpected {} PDU on a host queue",
            other.pdu_type()
        ))),
    }
}

/// C2HData payloads at least this large go straight from the socket into the read's buffer
/// ([`Conn::fill_into`]) instead of through the receive buffer and a copy (plain connections).
const DIRECT_RECV_MIN: usize = 16 * 1024;

/// A C2HData PDU whose data is arriving straight into its command's buffer.
#[derive(Debug)]
struct DirectRx {
    hdr: pdu::C2HDataHdr,
    /// The next byte of the command's buffer to fill.
    at: usize,
    /// Data bytes still to come.
    left: usize,
    /// The data digest so far, when one follows the data.
    crc: Option<pdu::DataDigest>,
}

/// Negotiated connection parameters (from ICResp).
#[derive(Clone, Copy, Debug)]
pub struct Negotiated {
    /// Header digest on.
    pub header_digest: bool,
    /// Data digest on.
    pub data_digest: bool,
    /// Controller PDU data alignment (CPDA, 0's based dwords) for the data of our H2C PDUs.
    pub cpda: u8,
    /// Largest H2CData payload the controller accepts.
    pub maxh2cdata: u32,
}

/// The most H2CData PDUs [`HostQueue::send_h2c`] hands to the socket in one call: eight of 128 KiB cover a 1 MiB
/// write (our target's and SPDK's MAXH2CDATA, the MDTS of ours), in 24 slices with data digests.
const H2C_GATHER: usize = 8;

/// Sends gathered H2CData PDUs: `group` holds, for each, its header's end in `hdrs` (the headers are back to back
/// there), its payload's offset and length in `data`, and its data digest (sent when `ddgst`). Counts the PDUs.
fn send_gathered(
    conn: &mut Conn,
    hdrs: &mut Vec<u8>,
    group: &[(usize, u32, u32, [u8; pdu::DIGEST_LEN])],
    data: &[u8],
    ddgst: bool,
) -> Result<(), Error> {
    if group.is_empty() {
        return Ok(());
    }
    let mut parts: [&[u8]; 3 * H2C_GATHER] = [&[]; 3 * H2C_GATHER];
    let mut k = 0;
    let mut start = 0;
    for (end, off, len, digest) in group {
        parts[k] = &hdrs[start..*end];
        parts[k + 1] = &data[*off as usize..(*off + *len) as usize];
        k += 2;
        if ddgst {
            parts[k] = digest;
            k += 1;
        }
        start = *end;
    }
    conn.send_parts(&parts[..k])?;
    for _ in group {
        conn.pdu_queued();
    }
    hdrs.clear();
    Ok(())
}

/// What a command gets that timed out and whose Abort did not complete it ([`HostQueue::expire`]); the queue
/// is then failed with it too.
pub(crate) const EXPIRED: Error = Error::Timeout("command completion (Abort did not complete it)");

/// One host-side NVMe/TCP queue.
///
/// `repr(C)` keeps the fields in the order written: what every submit and completion touches comes first
/// (the counts, limits, send policy and free list in the first cache line, asserted below; the failure
/// every submit checks right after), then the slots,
/// the clock and the connection, and the cold fields (set-up, failure, reconnect) last.
#[derive(Debug)]
#[repr(C)]
pub struct HostQueue {
    // Hot. The first cache line:
    outstanding: usize,
    commands: u64,
    incapsule_max: u32,
    max_transfer: u32,
    policy: SendPolicy,
    free: Vec<u16>,
    // Then:
    /// What failed the queue, if anything did: every command it held, and every later submit, gets it as
    /// the cause of an [`Error::QueueFailed`] (checked by every submit).
    failed: Option<Arc<Error>>,
    slots: Vec<Slot>,
    /// The coarse clock: the start of the last poll.
    now: Instant,
    neg: Negotiated,
    conn: Conn,
    /// Finished commands and orphans.
    lists: Parked,
    /// The C2HData being received into its buffer, if any.
    direct: Option<DirectRx>,
    // Cold.
    qid: u16,
    decode: pdu::DecodeConfig,
    /// Commands this queue completed with an error of its own (failed with the queue, expired, or refused
    /// on resubmission).
    commands_failed: u64,
    /// On failure, keep outstanding commands as orphans (for a retry) instead of failing them.
    keep_orphans: bool,
    /// The headers of the H2CData PDUs [`HostQueue::send_h2c`] gathers (kept for its capacity).
    h2c_headers: Vec<u8>,
    /// The buffers were moved into memory of the thread that polls the queue ([`HostQueue::rehome`]).
    homed: bool,
}

// What a submit reads and writes before it touches the slots and the connection shares the first cache line.
const _: () =
    assert!(std::mem::offset_of!(HostQueue, free) + std::mem::size_of::<Vec<u16>>() <= 64);

impl HostQueue {
    /// Connects the TCP socket and exchanges ICReq/ICResp. Fabrics Connect is the caller's next step.
    pub fn connect(p: &QueueParams) -> Result<HostQueue, Error> {
        if p.depth == 0 {
            return Err(Error::InvalidArgument(
                "queue depth must be at least 1".into(),
            ));
        }
        let rx_cap = p.max_transfer as usize + 8192;
        let mut conn = Conn::connect(p.addr, p.connect_timeout, rx_cap)?;
        conn.apply_congestion(p.tcp_congestion.as_deref())?;
        if let Some(cfg) = &p.tls {
            conn.set_key_renewal(p.key_renewal);
            conn.tls_client_handshake(cfg.clone(), p.connect_timeout)?;
        }
        let digests = pdu::Digests {
            header: p.header_digest,
            data: p.data_digest,
        };
        let icreq = pdu::IcReq {
            pfv: pdu::PFV_1_0,
            hpda: 0,
            digests,
            maxr2t: 0,
        };
        pdu::encode_ic_req(conn.tx_buf(), &icreq);
        conn.pdu_queued();
        let cfg = pdu::DecodeConfig::new(pdu::Direction::ToHost, pdu::Digests::NONE, 0);
        let deadline = Instant::now() + p.connect_timeout;
        let icresp = loop {
            conn.flush()?;
            conn.fill()?;
            match pdu::decode(conn.rx_data(), &cfg)? {
                Decoded::Pdu {
                    pdu: Pdu::IcResp(r),
                    len,
                } => {
                    conn.consume(len);
                    break r;
                }
                Decoded::Pdu {
                    pdu: Pdu::C2HTermReq(t),
                    ..
                } => {
                    return Err(Error::TermReq {
                        fes: t.fes,
                        fei: t.fei,
                    })
                }
                Decoded::Pdu { pdu, .. } => {
                    return Err(Error::Protocol(format!(
                        "expected ICResp, got {}",
                        pdu.pdu_type()
                    )));
                }
                Decoded::Incomplete { .. } => {}
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout("ICResp"));
            }
            std::thread::yield_now();
        };
        if icresp.digests.header && !p.header_digest || icresp.digests.data && !p.data_digest {
            return Err(Error::Protocol(
                "ICResp enables a digest the host did not ask for".into(),
            ));
        }
        let neg = Negotiated {
            header_digest: icresp.digests.header,
            data_digest: icresp.digests.data,
            cpda: icresp.cpda,
            maxh2cdata: icresp.maxh2cdata,
        };
        let decode = pdu::DecodeConfig::new(
            pdu::Direction::ToHost,
            pdu::Digests {
                header: neg.header_digest,
                data: neg.data_digest,
            },
            p.max_transfer,
        );
        let depth = usize::from(p.depth);
        let mut slots = Vec::with_capacity(depth);
        slots.resize_with(depth, Slot::default);
        Ok(HostQueue {
            conn,
            qid: p.qid,
            neg,
            decode,
            // Until the caller knows IOCCSZ, allow what every controller must accept on the admin queue and
            // for Connect: 8 KiB (NVMe/TCP admin queue) or 1 KiB (Connect data) on I/O queues.
            incapsule_max: if p.qid == 0 { 8192 } else { 1024 },
            max_transfer: p.max_transfer,
            slots,
            free: (0..p.depth).rev().collect(),
            lists: Parked {
                done: VecDeque::with_capacity(depth),
                orphans: VecDeque::new(),
            },
            outstanding: 0,
            commands_failed: 0,
            failed: None,
            policy: SendPolicy::default(),
            commands: 0,
            now: Instant::now(),
            keep_orphans: false,
            direct: None,
            // A header with its digest and padding takes at most 128 bytes.
            h2c_headers: Vec::with_capacity(H2C_GATHER * 128),
            homed: false,
        })
    }

    /// Moves every buffer this queue writes per command into new allocations made by the calling thread.
    ///
    /// A queue is connected on one thread (the application's, or a reconnect thread) and then polled by a
    /// reactor on another. The allocator hands consecutive queues' buffers out side by side, so without this
    /// the slots, free list or TLS state of a queue owned by one reactor can share cache lines with another
    /// reactor's queue, and both write them for every I/O. Done once, at the first poll.
    fn rehome(&mut self) {
        nvpoll::mem::rehome_vec(&mut self.slots);
        nvpoll::mem::rehome_vec(&mut self.free);
        nvpoll::mem::rehome_vec(&mut self.h2c_headers);
        self.lists.done = self.lists.done.drain(..).collect::<Vec<_>>().into();
        self.lists.done.reserve(self.slots.len());
        self.lists.orphans = self.lists.orphans.drain(..).collect::<Vec<_>>().into();
        self.conn.rehome();
        self.homed = true;
    }

    /// Queue ID.
    pub fn qid(&self) -> u16 {
        self.qid
    }

    /// What ICResp negotiated.
    pub fn negotiated(&self) -> Negotiated {
        self.neg
    }

    /// Sets the largest in-capsule data size (from IOCCSZ: `ioccsz * 16 - 64`).
    pub fn set_incapsule_max(&mut self, bytes: u32) {
        self.incapsule_max = bytes;
    }

    /// Commands accepted and not yet handed back.
    pub fn outstanding(&self) -> usize {
        self.outstanding
    }

    /// Queue depth.
    pub fn depth(&self) -> usize {
        self.slots.len()
    }

    /// The connection counters.
    pub fn conn_stats(&self) -> crate::conn::ConnStats {
        self.conn.stats
    }

    /// With TLS, renews the keys once they have been in use for the renewal's interval (see
    /// [`crate::conn::Conn::renew_keys_if_due`]); a failure fails the queue.
    pub fn renew_keys_if_due(&mut self, now: std::time::Instant) -> Result<(), Error> {
        if self.failed.is_some() {
            return Ok(());
        }
        self.conn
            .renew_keys_if_due(now)
            .inspect_err(|e| self.fail(e.clone()))
    }

    /// The send policy (see [`nvpoll::send`]).
    pub fn set_send_mode(&mut self, mode: SendMode) {
        self.policy.set_mode(mode);
    }

    /// The current send mode.
    pub fn send_mode(&self) -> SendMode {
        self.policy.mode()
    }

    /// Commands submitted so far.
    pub fn commands(&self) -> u64 {
        self.commands
    }

    /// What failed the queue, if anything did (its class says whose fault it was).
    pub fn failure(&self) -> Option<&Error> {
        self.failed.as_deref()
    }

    /// The error of a command held by, or submitted to, the failed queue.
    fn failed_error(&self, cause: &Arc<Error>) -> Error {
        Error::QueueFailed {
            qid: self.qid,
            cause: Arc::clone(cause),
        }
    }

    /// Encodes a command into the send buffer (it leaves at the next [`HostQueue::flush`]). `len` is the data
    /// length in bytes (the buffer may be larger). On error the buffer is handed back.
    ///
    /// The path of one command: `refusal` (cold: a failed queue, a bad request), a free command
    /// ID, the capsule encoded into the send buffer (`encode_capsule`), the slot filled, then the
    /// send policy's kick: now, or at the reactor's end-of-poll flush.
    pub fn submit(
        &mut self,
        sqe: Sqe,
        dir: DataDir,
        buf: Option<DmaBuf>,
        len: u32,
        tag: u64,
    ) -> Result<(), (Error, Option<DmaBuf>)> {
        if self.failed.is_some() || (dir != DataDir::None && !self.fits(&buf, len)) {
            return Err((self.refusal(&buf, len), buf));
        }
        let Some(cid) = self.free.pop() else {
            return Err((Error::QueueFull, buf));
        };
        let in_capsule = dir == DataDir::ToController && len <= self.incapsule_max;
        let waiting = self.conn.tx_pending();
        let (sqe, direct) = self.encode_capsule(sqe, cid, dir, buf.as_ref(), len, in_capsule);
        // Write data beyond the capsule leaves on R2T: the sooner the capsule, the sooner the R2T.
        let solicited = if dir == DataDir::ToController && !in_capsule {
            u64::from(len)
        } else {
            0
        };
        let kick = self
            .policy
            .kick_now_solicited(waiting, self.outstanding, solicited);
        self.slots[usize::from(cid)] = Slot::new(sqe, dir, tag, buf, len, in_capsule, self.now);
        self.outstanding += 1;
        self.commands += 1;
        if direct {
            self.send_capsule_data(cid, len);
        } else if kick {
            // The command is accepted either way: a failed write fails the queue, which completes it with
            // an error through the done list.
            let _ = self.flush();
        }
        Ok(())
    }

    /// A data command's buffer holds the transfer, and the transfer is within the controller's limit.
    #[inline]
    fn fits(&self, buf: &Option<DmaBuf>, len: u32) -> bool {
        buf.as_ref().is_some_and(|b| b.len() >= len as usize) && len <= self.max_transfer
    }

    /// Why [`HostQueue::submit`] refuses a command: the queue failed, or the request is not one it can send.
    #[cold]
    fn refusal(&self, buf: &Option<DmaBuf>, len: u32) -> Error {
        if let Some(cause) = &self.failed {
            return self.failed_error(cause);
        }
        match buf {
            None => Error::InvalidArgument("a data command needs a buffer".into()),
            Some(b) if b.len() < len as usize => Error::InvalidArgument(format!(
                "buffer of {} bytes is shorter than the transfer ({len})",
                b.len()
            )),
            Some(_) => Error::InvalidArgument(format!(
                "transfer of {len} bytes exceeds the maximum of {}",
                self.max_transfer
            )),
        }
    }

    /// Encodes the capsule of command `cid` into the send buffer, its data with it when it goes in the
    /// capsule, and returns the command as sent and whether its in-capsule data is large enough to leave
    /// straight from the buffer ([`HostQueue::send_capsule_data`]) instead of being copied.
    #[inline]
    fn encode_capsule(
        &mut self,
        mut sqe: Sqe,
        cid: u16,
        dir: DataDir,
        buf: Option<&DmaBuf>,
        len: u32,
        in_capsule: bool,
    ) -> (Sqe, bool) {
        sqe.cid = cid;
        sqe.flags = (sqe.flags & !0xc0) | Sqe::PSDT_SGL;
        let sgl = match dir {
            DataDir::None => SglDescriptor::transport_data_block(0),
            DataDir::ToController if in_capsule => SglDescriptor::in_capsule(0, len),
            _ => SglDescriptor::transport_data_block(len),
        };
        sqe.set_sgl(&sgl);
        let data: &[u8] = match (buf, in_capsule) {
            (Some(b), true) => &b.as_slice()[..len as usize],
            _ => &[],
        };
        let digests = self.digests();
        let direct = data.len() >= DIRECT_SEND_MIN;
        if direct {
            pdu::encode_capsule_cmd_header(self.conn.tx_buf(), &sqe, len, digests, self.neg.cpda);
        } else {
            pdu::encode_capsule_cmd(self.conn.tx_buf(), &sqe, data, digests, self.neg.cpda);
        }
        self.conn.pdu_queued();
        (sqe, direct)
    }

    /// Sends the in-capsule data of command `cid` straight from its buffer, behind its header (large
    /// in-capsule data is not copied into the send buffer).
    fn send_capsule_data(&mut self, cid: u16, len: u32) {
        let digest = self.neg.data_digest;
        let slot = &self.slots[usize::from(cid)];
        let data = &slot
            .buf
            .as_ref()
            .expect("in-capsule data has a buffer")
            .as_slice()[..len as usize];
        if let Err(e) = self.conn.send_payload(&[data], digest) {
            // The command is accepted: the failed queue completes it with an error.
            self.fail(e);
        }
    }

    fn digests(&self) -> pdu::Digests {
        pdu::Digests {
            header: self.neg.header_digest,
            data: self.neg.data_digest,
        }
    }

    /// Writes what is queued. Returns `true` when everything went out.
    pub fn flush(&mut self) -> Result<bool, Error> {
        match self.conn.flush() {
            Ok(all) => Ok(all),
            Err(e) => {
                self.fail(e.clone());
                Err(e)
            }
        }
    }

    /// Reads from the socket once, handles every complete PDU, and queues any H2CData that R2Ts asked for.
    /// Returns the number of commands completed. On a connection or protocol error every outstanding command
    /// is completed with an error, and the error is returned.
    pub fn poll(&mut self) -> Result<usize, Error> {
        self.poll_max(usize::MAX)
    }

    /// As [`HostQueue::poll`], but stops handling PDUs once `max` commands have completed in this call; the
    /// PDUs left in the receive buffer are handled by the next poll.
    pub fn poll_max(&mut self, max: usize) -> Result<usize, Error> {
        self.poll_max_at(max, Instant::now())
    }

    /// As [`HostQueue::poll_max`], with the caller's reading of the clock (stamped on the commands submitted
    /// until the next poll, for their timeouts).
    pub fn poll_max_at(&mut self, max: usize, now: Instant) -> Result<usize, Error> {
        if !self.homed {
            self.rehome();
        }
        self.now = now;
        if let Some(cause) = &self.failed {
            return Err(self.failed_error(cause));
        }
        let before = self.lists.done.len();
        let r = self.poll_inner(before, max);
        if let Err(e) = &r {
            self.fail(e.clone());
        }
        let n = self.lists.done.len() - before;
        r.map(|_| n)
    }

    fn poll_inner(&mut self, before: usize, max: usize) -> Result<(), Error> {
        if self.direct.is_some() {
            if !self.pump_direct()? {
                self.conn.flush()?;
                return Ok(());
            }
        } else {
            self.conn.fill()?;
        }
        while self.lists.done.len() - before < max {
            let action = match pdu::decode(self.conn.rx_data(), &self.decode) {
                Ok(Decoded::Incomplete { need }) => {
                    if need >= DIRECT_RECV_MIN && !self.conn.is_tls() && self.start_direct()? {
                        if self.pump_direct()? {
                            continue;
                        }
                        break;
                    }
                    self.conn.reserve_rx(need);
                    self.conn.ack_partial(need);
                    break;
                }
                Ok(Decoded::Pdu { pdu, len }) => {
                    let action = on_pdu(&mut self.slots, self.qid, &pdu)?;
                    (action, len)
                }
                Err(pdu::PduError::DataDigest {
                    cccid, len, flags, ..
                }) => {
                    // Not fatal: the command fails with a transient transport error; the stream goes on.
                    let slot = slot_in(&mut self.slots, cccid, "C2HData")?;
                    slot.data_digest_error = true;
                    let ends_command = flags & pdu::FLAG_SUCCESS != 0;
                    (
                        if ends_command {
                            Action::Complete(cccid, None)
                        } else {
                            Action::None
                        },
                        len,
                    )
                }
                Err(e) => return Err(e.into()),
            };
            match action {
                (Action::None, len) => self.conn.consume(len),
                (Action::Complete(cid, cqe), len) => {
                    self.conn.consume(len);
                    self.complete(cid, cqe);
                }
                (Action::SendData(r2t), len) => {
                    self.conn.consume(len);
                    self.send_h2c(r2t)?;
                }
            }
        }
        // H2CData queued by R2Ts goes out now.
        self.conn.flush()?;
        Ok(())
    }

    /// At an incomplete PDU: if it is a C2HData whose header (and padding) is here, checks it, moves the data
    /// that came with it into the command's buffer and receives the rest straight there
    /// ([`HostQueue::pump_direct`]). Returns whether it did.
    fn start_direct(&mut self) -> Result<bool, Error> {
        let rx = self.conn.rx_data();
        let Some(p) = pdu::decode_partial(rx, &self.decode)? else {
            return Ok(false);
        };
        let Pdu::C2HData { hdr, .. } = p.pdu else {
            return Ok(false);
        };
        let (data_off, data_len, ddgst) = (p.data_off, p.data_len, p.ddgst);
        if rx.len() < data_off {
            return Ok(false);
        }
        let slot = accept_c2h(&mut self.slots, &hdr)?;
        let have = (rx.len() - data_off).min(data_len);
        let at = hdr.datao as usize;
        let dest = &mut slot
            .buf
            .as_mut()
            .expect("read slot has a buffer")
            .as_mut_slice()[at..][..have];
        dest.copy_from_slice(&rx[data_off..][..have]);
        let mut crc = ddgst.then(pdu::DataDigest::new);
        if let Some(c) = &mut crc {
            c.update(dest);
        }
        self.conn.skip(data_off + have);
        self.direct = Some(DirectRx {
            hdr,
            at: at + have,
            left: data_len - have,
            crc,
        });
        Ok(true)
    }

    /// Receives more of the C2HData in progress straight into its buffer. Returns `true` once the PDU is
    /// whole (data and digest) and handled; `false` while the socket has no more of it.
    fn pump_direct(&mut self) -> Result<bool, Error> {
        let d = self.direct.as_mut().expect("a direct receive in progress");
        let cid = d.hdr.cccid;
        let slot = match self.slots.get_mut(usize::from(cid)) {
            Some(s) if s.busy && s.buf.is_some() => s,
            _ => {
                return Err(Error::Protocol(format!(
                    "read cid {cid} ended while its C2HData was arriving"
                )))
            }
        };
        if d.left > 0 {
            let buf = slot.buf.as_mut().expect("checked above").as_mut_slice();
            let dest = &mut buf[d.at..][..d.left];
            let n = self.conn.fill_into(dest)?;
            if let Some(c) = &mut d.crc {
                c.update(&dest[..n]);
            }
            d.at += n;
            d.left -= n;
            if d.left > 0 {
                self.conn.ack_direct();
                return Ok(false);
            }
        }
        if let Some(crc) = d.crc {
            if self.conn.rx_data().len() < pdu::DIGEST_LEN {
                self.conn.fill()?;
                if self.conn.rx_data().len() < pdu::DIGEST_LEN {
                    return Ok(false);
                }
            }
            if self.conn.rx_data()[..pdu::DIGEST_LEN] != crc.finish() {
                // Not fatal, as in the gathered path: the command fails; the stream goes on.
                slot.data_digest_error = true;
            }
            self.conn.skip(pdu::DIGEST_LEN);
        }
        self.conn.pdu_received();
        let hdr = d.hdr;
        self.direct = None;
        let action = if slot.data_digest_error && hdr.success {
            Action::Complete(cid, None)
        } else {
            c2h_end(slot, self.qid, &hdr)?
        };
        if let Action::Complete(cid, cqe) = action {
            self.complete(cid, cqe);
        }
        Ok(true)
    }

    /// Queues the H2CData PDUs that answer an R2T (already validated), split by MAXH2CDATA.
    ///
    /// Payloads from [`DIRECT_SEND_MIN`] bytes go straight from the command's buffer, and up to [`H2C_GATHER`]
    /// of them leave in one `writev` (or one run of sealed records): a 1 MiB write to a target with MAXH2CDATA
    /// 128 KiB is one system call, not eight. Per call the kernel pays a fixed cost (the copy set-up, a push
    /// through the TCP stack and, on loopback, the receiver's softirq); on the 2-vCPU development VM, 1 MiB
    /// qd4 writes to our target went from about 3.4K to 6.0K IOPS.
    fn send_h2c(&mut self, r2t: pdu::R2T) -> Result<(), Error> {
        let digests = self.digests();
        let slot = &self.slots[usize::from(r2t.cccid)];
        let data = &slot
            .buf
            .as_ref()
            .expect("write slot has a buffer")
            .as_slice()[..slot.len as usize];
        let end = r2t.r2to + r2t.r2tl;
        let mut off = r2t.r2to;
        // The gathered PDUs: their headers back to back in `hdrs`, and for each its header's end there, its
        // payload's range and its data digest.
        let hdrs = &mut self.h2c_headers;
        hdrs.clear();
        let mut group: [(usize, u32, u32, [u8; pdu::DIGEST_LEN]); H2C_GATHER] =
            [(0, 0, 0, [0; pdu::DIGEST_LEN]); H2C_GATHER];
        let mut k = 0;
        while off < end {
            let n = self.neg.maxh2cdata.min(end - off);
            let hdr = pdu::H2CDataHdr {
                cccid: r2t.cccid,
                ttag: r2t.ttag,
                datao: off,
                datal: n,
                last: off + n == end,
            };
            let chunk = &data[off as usize..(off + n) as usize];
            if chunk.len() >= DIRECT_SEND_MIN {
                pdu::encode_h2c_data_header(hdrs, &hdr, digests, self.neg.cpda);
                let ddgst = if digests.data {
                    pdu::data_digest(chunk)
                } else {
                    [0; pdu::DIGEST_LEN]
                };
                group[k] = (hdrs.len(), off, n, ddgst);
                k += 1;
                if k == H2C_GATHER {
                    send_gathered(&mut self.conn, hdrs, &group[..k], data, digests.data)?;
                    k = 0;
                }
            } else {
                // Small: through the send buffer, after whatever was gathered before it.
                send_gathered(&mut self.conn, hdrs, &group[..k], data, digests.data)?;
                k = 0;
                pdu::encode_h2c_data(self.conn.tx_buf(), &hdr, chunk, digests, self.neg.cpda);
                self.conn.pdu_queued();
            }
            off += n;
        }
        send_gathered(&mut self.conn, hdrs, &group[..k], data, digests.data)
    }

    fn complete(&mut self, cid: u16, cqe: Option<Cqe>) {
        let slot = &mut self.slots[usize::from(cid)];
        let result = match cqe {
            _ if slot.data_digest_error => Err(Error::Protocol(format!(
                "data digest mismatch in C2HData for cid {cid}"
            ))),
            Some(cqe) => Ok(cqe),
            None => Err(Error::Protocol(format!(
                "command {cid} ended without a completion"
            ))),
        };
        self.complete_with(cid, result);
    }

    fn complete_with(&mut self, cid: u16, result: Result<Cqe, Error>) {
        let slot = &mut self.slots[usize::from(cid)];
        slot.busy = false;
        let buf = slot.buf.take();
        let tag = slot.tag;
        self.free.push(cid);
        self.outstanding -= 1;
        self.lists.done.push_back(Done { tag, buf, result });
    }

    /// Fails the queue with `cause` (the first cause stays): every outstanding command completes with
    /// [`Error::QueueFailed`] naming it, and so classed as it is (a lost connection, a TLS failure, the peer's
    /// protocol violation, a timeout), and later submits are refused the same way.
    pub fn fail(&mut self, cause: Error) {
        self.direct = None;
        let cause = Arc::clone(self.failed.get_or_insert_with(|| Arc::new(cause)));
        for cid in 0..self.slots.len() {
            if self.slots[cid].busy && self.keep_orphans {
                let slot = &mut self.slots[cid];
                slot.busy = false;
                self.lists.orphans.push_back(Orphan {
                    sqe: slot.sqe,
                    dir: slot.dir.unwrap_or(DataDir::None),
                    buf: slot.buf.take(),
                    len: slot.len,
                    tag: slot.tag,
                });
                self.free.push(cid as u16);
                self.outstanding -= 1;
            } else if self.slots[cid].busy {
                let e = self.failed_error(&cause);
                self.commands_failed += 1;
                self.complete_with(cid as u16, Err(e));
            }
        }
        self.conn.shutdown();
    }

    /// When set, a failure keeps outstanding commands as orphans, handed over by [`HostQueue::park`], instead
    /// of failing them.
    pub fn set_keep_orphans(&mut self, keep: bool) {
        self.keep_orphans = keep;
    }

    /// Commands a failure left outstanding, not yet handed over.
    pub fn orphans_len(&self) -> usize {
        self.lists.orphans.len()
    }

    /// Commands this queue completed with an error of its own: failed with the queue (without
    /// [`HostQueue::set_keep_orphans`]), expired ([`HostQueue::expire`]), or refused by [`HostQueue::resume`].
    pub fn commands_failed(&self) -> u64 {
        self.commands_failed
    }

    /// Ends the queue (failing it first if it has not failed) and hands over its finished commands and
    /// orphans.
    pub fn park(mut self) -> Parked {
        if self.failed.is_none() {
            self.fail(Error::Lost("queue parked by the host"));
        }
        std::mem::take(&mut self.lists)
    }

    /// Takes over what an earlier connection parked: its finished commands go before this queue's own, and
    /// its orphans are submitted again (a refused one completes with the error). Returns how many were
    /// submitted.
    pub fn resume(&mut self, parked: Parked) -> u64 {
        let Parked { mut done, orphans } = parked;
        done.append(&mut self.lists.done);
        self.lists.done = done;
        let mut resubmitted = 0;
        for o in orphans {
            match self.submit(o.sqe, o.dir, o.buf, o.len, o.tag) {
                Ok(()) => resubmitted += 1,
                Err((e, buf)) => {
                    self.commands_failed += 1;
                    self.lists.done.push_back(Done {
                        tag: o.tag,
                        buf,
                        result: Err(e),
                    });
                }
            }
        }
        resubmitted
    }

    /// Per-command timeouts, checked against the queue's coarse clock. A command outstanding longer than
    /// `timeout` gets `abort(cid)` called once; one still outstanding after `timeout + grace` is returned, for
    /// the caller to give up on it ([`HostQueue::expire`]) and reset the connection.
    pub fn check_timeouts(
        &mut self,
        timeout: Duration,
        grace: Duration,
        abort: &mut dyn FnMut(u16),
    ) -> Option<u16> {
        let now = self.now;
        for (cid, slot) in self.slots.iter_mut().enumerate() {
            let Some(since) = slot.since.filter(|_| slot.busy) else {
                continue;
            };
            let age = now.saturating_duration_since(since);
            if age > timeout + grace && slot.abort_sent {
                return Some(cid as u16);
            }
            if age > timeout && !slot.abort_sent {
                slot.abort_sent = true;
                abort(cid as u16);
            }
        }
        None
    }

    /// Completes command `cid` with [`Error::Timeout`] (it timed out and its Abort did not complete it).
    pub fn expire(&mut self, cid: u16) {
        if self.slots.get(usize::from(cid)).is_some_and(|s| s.busy) {
            self.commands_failed += 1;
            self.complete_with(cid, Err(EXPIRED));
        }
    }

    /// Finished commands not yet taken.
    pub fn done_len(&self) -> usize {
        self.lists.done.len()
    }

    /// For a reactor that wants to sleep: adds the socket (and its writability while bytes wait) and returns
    /// `true`, or returns `false` when this queue has work that no socket event will announce: finished
    /// commands not yet handed out, a whole PDU left in the receive buffer by [`HostQueue::poll_max`], or a
    /// failed queue.
    pub fn wake_sources<'a>(&'a self, w: &mut nvpoll::reactor::WakeSources<'a>) -> bool {
        if self.failed.is_some() || !self.lists.done.is_empty() {
            return false;
        }
        let rx = self.conn.rx_data();
        if self.direct.is_none()
            && !rx.is_empty()
            && !matches!(
                pdu::decode(rx, &self.decode),
                Ok(Decoded::Incomplete { .. })
            )
        {
            return false;
        }
        self.conn.wake_sources(w);
        true
    }

    /// Takes the oldest finished command.
    pub fn pop_done(&mut self) -> Option<Done> {
        self.lists.done.pop_front()
    }

    /// Runs one command to completion by polling, for bring-up and admin tools. Other completions that arrive
    /// meanwhile stay in the done list.
    pub fn run(
        &mut self,
        sqe: Sqe,
        dir: DataDir,
        buf: Option<DmaBuf>,
        len: u32,
        timeout: Duration,
    ) -> Result<(Cqe, Option<DmaBuf>), Error> {
        const SYNC_TAG: u64 = u64::MAX;
        self.submit(sqe, dir, buf, len, SYNC_TAG)
            .map_err(|(e, _)| e)?;
        let deadline = Instant::now() + timeout;
        loop {
            self.flush()?;
            self.poll()?;
            if let Some(i) = self.lists.done.iter().position(|d| d.tag == SYNC_TAG) {
                let d = self.lists.done.remove(i).expect("index from position");
                return d.result.map(|cqe| (cqe, d.buf));
            }
            if Instant::now() >= deadline {
                const LATE: Error = Error::Timeout("admin command completion");
                self.fail(LATE);
                return Err(LATE);
            }
            std::thread::yield_now();
        }
    }

    /// Status of a completion as a `Result`, naming the command (of `kind`) on failure.
    pub fn check(what: &'static str, kind: CommandKind, cqe: &Cqe) -> Result<(), Error> {
        let status: Status = cqe.status();
        if status.is_success() {
            Ok(())
        } else {
            Err(Error::Command { what, kind, status })
        }
    }

    /// Closes the connection.
    pub fn close(&mut self) {
        let _ = self.conn.flush();
        self.fail(Error::Lost("queue closed by the host"));
    }
}

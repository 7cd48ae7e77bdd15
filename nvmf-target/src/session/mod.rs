//! One controller-side connection: the NVMe/TCP state machine of a single queue.
//!
//! A [`Session`] owns its socket and is polled by one reactor. Its life:
//!
//! 1. **ICReq**: the host's first PDU; the ICResp grants the digests it asked for, CPDA 0 and our MAXH2CDATA.
//! 2. **Connect**: a Fabrics Connect makes the connection an admin queue (creating a controller) or an I/O queue
//!    of an existing controller. Both must happen within the connect timeout.
//! 3. **Commands**: each CapsuleCmd is executed at once ([`crate::admin`], [`crate::io`]) unless its data must
//!    first be fetched with R2T/H2CData, or it waits (an Asynchronous Event Request, a flush of a file).
//!
//! Sending is split in two steps, as everywhere in nvpoll: handlers only *queue* PDUs in the connection's send
//! buffer, and [`Session::flush`] (the reactor's end-of-iteration hook) writes them out. A send policy (inline,
//! deferred, adaptive) or a TLS record layer plugs in at that seam without touching the handlers.
//!
//! Anything a host sends that breaks the protocol ends the connection with a C2HTermReq naming the fault (or a
//! plain close when there is nothing to report); it never panics the reactor, and no other connection notices.
//!
//! Here: the [`Session`] with its phase state ([`State`]: set-up or connected), polling, closing and the
//! counters. Beside it, a concern a file: `setup` (TLS, ICReq, Connect), `rx` (decoding, routing by PDU kind,
//! H2CData), `capsule` (a command's checks and its handler), `reply` (what a handler decided, put on the
//! wire), `slots` (outstanding commands, flushes), `auth` (DH-HMAC-CHAP), `notices` (AERs), `timers`.

mod auth;
mod capsule;
mod notices;
mod reply;
mod rx;
mod setup;
mod slots;
mod timers;

use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvpoll::send::SendPolicy;

use crate::events::TargetEvent;
use crate::handler::Queue;
use crate::options::TlsMode;
use crate::shared::SessionStats;
use crate::shared::{Listener, TargetShared};
use nvpoll_wire::conn::Conn;
use nvpoll_wire::pdu::{self, Digests, Fes};
use nvpoll_wire::Error;

use setup::{Setup, SetupPhase};
use slots::Slot;

/// Above this many unsent bytes the session stops reading new PDUs until the peer drains its socket.
const TX_HIGH_WATER: usize = 4 << 20;
/// The most data bytes in one C2HData PDU.
const C2H_CHUNK: usize = 128 * 1024;
/// How long a closing connection may take to get its last PDUs (a C2HTermReq) out.
const DRAIN_TIME: Duration = Duration::from_secs(1);

/// How long an I/O queue stays open after its Disconnect completed while the host sends nothing more: it
/// answers what still arrives ([`Session::on_capsule`]) and closes when the host does, or after this.
const DISCONNECT_LINGER: Duration = Duration::from_secs(2);
/// The most bytes of data fetched with R2T for a command other than an NVM write (Connect: 1 KiB).
const MAX_ADMIN_DATA: u32 = 4096;

/// What only a connected session needs: the queue it became.
struct Connected {
    queue: Queue,
    /// The host sent Disconnect on this I/O queue: every command behind it is answered with Command Aborted
    /// due to SQ Deletion, and the connection closes at this time unless another command moves it on.
    disconnected: Option<Instant>,
}

/// Where a connection is in its life, with the state of that phase only.
enum State {
    /// Before Fabrics Connect succeeded. Boxed: a connected session carries no handshake state, and its
    /// [`State`] is no larger than [`Connected`] (asserted below).
    Setup(Box<Setup>),
    /// A queue of a controller.
    Connected(Connected),
}

// A connected session's phase state is its queue and nothing else: the set-up phase's handshake (about 300
// bytes), buffer and deadline live behind the `Setup` box, which fits beside `Connected` in a niche of its
// fields instead of widening every connected session. A field added to `Setup` unboxed, or to `Connected`
// beyond what the hot path reads (the queue's ID, SQ head, flow control flag, controller, namespace view, and
// the Disconnect linger), trips these.
const _: () = assert!(std::mem::size_of::<State>() == std::mem::size_of::<Connected>());

const _: () = assert!(std::mem::size_of::<Connected>() <= 192);

impl State {
    /// The queue, once Connect made the connection one.
    #[inline]
    fn queue(&self) -> Option<&Queue> {
        match self {
            State::Connected(c) => Some(&c.queue),
            State::Setup(_) => None,
        }
    }

    #[inline]
    fn queue_mut(&mut self) -> Option<&mut Queue> {
        match self {
            State::Connected(c) => Some(&mut c.queue),
            State::Setup(_) => None,
        }
    }

    /// What the set-up phase waits for; `None` once connected.
    #[inline]
    fn setup_phase(&self) -> Option<SetupPhase> {
        match self {
            State::Setup(s) => Some(s.phase),
            State::Connected(_) => None,
        }
    }

    /// When a Disconnect's linger ends (connected I/O queues only).
    #[inline]
    fn disconnected(&self) -> Option<Instant> {
        match self {
            State::Connected(c) => c.disconnected,
            State::Setup(_) => None,
        }
    }
}

/// Why decoding stopped the connection.
struct Fatal {
    /// The termination request to send, if any: FES, FEI.
    term: Option<(Fes, u32)>,
    why: String,
}

impl Fatal {
    fn term(fes: Fes, fei: u32, why: impl Into<String>) -> Fatal {
        Fatal {
            term: Some((fes, fei)),
            why: why.into(),
        }
    }

    fn close(why: impl Into<String>) -> Fatal {
        Fatal {
            term: None,
            why: why.into(),
        }
    }
}

/// Whether a poll found work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Progress {
    Busy,
    Idle,
    /// The connection is closed; drop the session.
    Finished,
}

/// PDUs a verdict on the host's packing waits for ([`packing_verdict`]).
const PACKING_SAMPLE: u64 = 4;

/// What the TLS records opened and the PDUs received since the last verdict say about how the host packs its
/// PDUs: `None` while fewer than [`PACKING_SAMPLE`] PDUs came (an idle connection, a large PDU in pieces:
/// what was learned stands), else whether it sealed each PDU in a record of its own or more (a plain
/// connection opens no records: batched, as before).
fn packing_verdict(records: u64, pdus: u64) -> Option<bool> {
    (pdus >= PACKING_SAMPLE).then_some(records >= pdus)
}

/// One connection.
///
/// The fields every PDU of a connected session reads or writes come first: the connection (its buffers), the
/// phase state (the queue), the slot table and its counts, the counters and the decode and send settings. The
/// order is for the reader (Rust lays fields out itself): what the asserts on [`State`] and the slots pin is
/// size, so that a connected session stays free of set-up state.
pub(crate) struct Session {
    conn: Conn,
    state: State,
    slots: Vec<Slot>,
    busy_slots: usize,
    flushing: usize,
    /// Slots in [`SlotState::Authenticating`](slots::SlotState::Authenticating).
    auth_jobs: usize,
    stats: SessionStats,
    decode: pdu::DecodeConfig,
    /// When responses leave; refreshed from the target's setting at every poll.
    policy: SendPolicy,
    /// With TLS, the host seals each PDU in a record of its own (or more): adaptive then answers each PDU at
    /// once, as the host asks, instead of at the end of what one read brought (see [`Session::note_packing`]).
    host_unbatched: bool,
    /// TLS records opened and PDUs received at the last [`Session::note_packing`].
    packing_mark: (u64, u64),
    digests: Digests,
    hpda: u8,
    target: Arc<TargetShared>,
    closing: Option<(String, Instant)>,
    // Cold: read at set-up, on a close, by some admin commands, or when idle.
    published: SessionStats,
    /// When the TLS keys' age is next checked (the target's clock, ms).
    next_key_check_ms: u64,
    listener: Arc<Listener>,
    peer: SocketAddr,
    local: SocketAddr,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Session");
        d.field("peer", &self.peer);
        match self.state.setup_phase() {
            Some(phase) => d.field("phase", &phase),
            None => d.field("phase", &format_args!("Ready")),
        };
        d.field("qid", &self.state.queue().map(|q| q.qid))
            .finish_non_exhaustive()
    }
}

/// Why a connection that failed with `e` closes, in words: a connection of a host that takes no KeyUpdate,
/// closed at its record count, says so as an ordinary close.
fn close_reason(e: &Error) -> String {
    match e {
        Error::Rekey(nvpoll_wire::RekeyCause::Planned) => {
            "closed to renew the TLS keys (the host takes no KeyUpdate)".to_string()
        }
        e => e.to_string(),
    }
}

/// The receive buffer of a connection before Fabrics Connect.
const SETUP_RX_BUFFER: usize = 8192;

impl Session {
    /// Wraps an accepted connection.
    pub(crate) fn new(
        stream: TcpStream,
        target: Arc<TargetShared>,
        listener: Arc<Listener>,
    ) -> Result<Session, Error> {
        let peer = stream
            .peer_addr()
            .map_err(|e| Error::io("peer address", e))?;
        let local = stream
            .local_addr()
            .map_err(|e| Error::io("local address", e))?;
        let keepalive = socket2::TcpKeepalive::new()
            .with_time(Duration::from_secs(30))
            .with_interval(Duration::from_secs(5))
            .with_retries(3);
        socket2::SockRef::from(&stream)
            .set_tcp_keepalive(&keepalive)
            .map_err(|e| Error::io("SO_KEEPALIVE", e))?;
        let limits = &target.limits;
        // Small until Fabrics Connect succeeds (ICReq, Connect and its data fit; TLS grows it as records need):
        // half-open connections from a flood then cost a few KiB each, not the full data buffer.
        let mut conn = Conn::from_stream(stream, SETUP_RX_BUFFER)?;
        conn.set_key_renewal(target.key_renewal(None));
        let connect_deadline = Instant::now() + limits.connect_timeout;
        Ok(Session {
            conn,
            state: State::Setup(Box::new(Setup {
                phase: if listener.tls == TlsMode::Off {
                    SetupPhase::IcReq
                } else {
                    SetupPhase::Detect
                },
                tls_hs: None,
                tls_inb: Vec::new(),
                connect_deadline,
            })),
            slots: Vec::new(),
            busy_slots: 0,
            flushing: 0,
            auth_jobs: 0,
            stats: SessionStats::default(),
            decode: pdu::DecodeConfig::new(pdu::Direction::ToController, Digests::NONE, 0),
            policy: SendPolicy::new(target.send_mode()),
            host_unbatched: false,
            packing_mark: (0, 0),
            digests: Digests::NONE,
            hpda: 0,
            target,
            closing: None,
            published: SessionStats::default(),
            next_key_check_ms: 0,
            listener,
            peer,
            local,
        })
    }

    /// The peer's address.
    pub(crate) fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// Records that the session panicked; it is about to be dropped.
    pub(crate) fn note_internal_error(&mut self) {
        self.target
            .stats
            .internal_errors
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.closing = Some((
            "internal error (a panic, see stderr)".into(),
            Instant::now(),
        ));
    }

    /// Whether the session has finished Fabrics Connect and is not closing: from then on it is polled on every
    /// iteration of its reactor (before, the target's setup poller looks at it when it has something to do).
    pub(crate) fn is_ready(&self) -> bool {
        matches!(self.state, State::Connected(_)) && self.closing.is_none()
    }

    /// Reads and handles whatever the host sent, and checks the timers. Never blocks.
    pub(crate) fn poll(&mut self) -> Progress {
        self.poll_with(true)
    }

    /// What [`Session::poll`] does but the read: the timers, notices, finished flushes and authentication
    /// jobs, and what is already in the receive buffer. For a session whose socket has nothing to read (its
    /// reactor's readiness set said so): no system call.
    pub(crate) fn tick(&mut self) -> Progress {
        self.poll_with(false)
    }

    /// Whether the session has work of its own that no readable socket announces: a close in progress,
    /// flushes or authentication jobs on other threads, or bytes its socket has not taken yet. Such a session
    /// is polled on every iteration; one without is polled when its socket is readable and periodically.
    pub(crate) fn needs_poll(&self) -> bool {
        self.closing.is_some() || self.flushing > 0 || self.auth_jobs > 0 || self.conn.wants_flush()
    }

    /// The connection's socket (for a readiness set).
    pub(crate) fn socket(&self) -> std::os::fd::BorrowedFd<'_> {
        self.conn.socket()
    }

    fn poll_with(&mut self, read: bool) -> Progress {
        if let Some((_, deadline)) = &self.closing {
            let deadline = *deadline;
            return self.drain(deadline);
        }
        if self
            .state
            .disconnected()
            .is_some_and(|until| Instant::now() >= until)
        {
            self.close(None, "host sent Disconnect".into());
            return Progress::Busy;
        }
        let now_ms = self.target.now_ms();
        if let Some(why) = self.check_timers(now_ms) {
            // What the queue still holds gets an answer before the connection goes.
            self.abort_outstanding();
            self.close(None, why);
            return Progress::Busy;
        }
        self.poll_notices();
        self.policy.set_mode(self.target.send_mode());
        if matches!(
            self.state.setup_phase(),
            Some(SetupPhase::Detect | SetupPhase::Tls)
        ) {
            return self.poll_tls();
        }
        self.poll_commands(read, now_ms)
    }

    /// The part of a poll past ICReq: finished flushes and authentication jobs, then (`read`: after reading
    /// the socket) the PDUs received, unless the host is not reading its responses.
    fn poll_commands(&mut self, read: bool, now_ms: u64) -> Progress {
        let mut busy = self.poll_flushes();
        if self.auth_jobs > 0 {
            // Polled every time (no wake-up comes from the job's thread): stay busy until it is done.
            self.poll_auth_jobs();
            busy = true;
        }
        if self.conn.tx_pending() > TX_HIGH_WATER {
            // The host is not reading its responses: take no more commands until it does.
            if busy {
                return Progress::Busy;
            }
            self.publish_stats();
            return Progress::Idle;
        }
        if read {
            match self.conn.fill() {
                Ok(0) => {}
                Ok(_) => busy = true,
                Err(e) => return self.close_on(e),
            }
        } else {
            // Not readable when the reactor looked: as good as a read that found nothing (see
            // `Conn::ack_partial`).
            self.conn.note_empty();
        }
        let before = self.stats.commands;
        if let Err(f) = self.handle_received() {
            self.close(f.term, f.why);
            return Progress::Busy;
        }
        self.note_packing();
        if self.stats.commands != before {
            busy = true;
            if let Some(q) = self.state.queue() {
                q.ctrl.touch(now_ms);
            }
        }
        if busy {
            Progress::Busy
        } else {
            self.publish_stats();
            Progress::Idle
        }
    }

    /// Learns how the host packs its PDUs into TLS records, from what the last reads brought: a host that
    /// seals every PDU in a record of its own (SPDK's, which writes each of a PDU's buffers with its own
    /// `SSL_write`) is not batching, and gets each response at once in adaptive mode (its own records, as it
    /// sends); a host that packs several PDUs into each record (ours, deferred or adaptive) gets the responses
    /// to one read's worth together. Measured with SPDK's perf writing 4 KiB over TLS at qd128 into our target
    /// against into SPDK's (bench-spdk, 2-vCPU VM, 2026-12-07, the builds alternating): the responses to a
    /// read's worth together gave 0.95 and 0.96 (five rounds each), 0.92 and 0.96 (three); answered as the
    /// host packs, 1.02 and 1.01, 0.96 and 0.95; our own host, batched either way, ran 7.5x SPDK's pair both
    /// times (answered at once it fell to 2.4x: the target's inline mode).
    fn note_packing(&mut self) {
        let now = (self.conn.records_opened(), self.conn.stats.pdus_rx);
        let (records, pdus) = (now.0 - self.packing_mark.0, now.1 - self.packing_mark.1);
        if let Some(unbatched) = packing_verdict(records, pdus) {
            self.host_unbatched = unbatched;
            self.packing_mark = now;
        }
    }

    /// Closes the connection after its socket or TLS failed with `e` (the host closing it is an ordinary
    /// close, anything else is logged as what it was).
    fn close_on(&mut self, e: Error) -> Progress {
        self.note_conn_failure(&e);
        let why = match e {
            Error::Closed => "closed by the host".to_string(),
            e => close_reason(&e),
        };
        self.close(None, why);
        Progress::Busy
    }

    /// The connection failed with `e` while sending.
    fn send_failed(&self, e: &Error) -> Fatal {
        self.note_conn_failure(e);
        Fatal::close(format!("send failed: {e}"))
    }

    /// Tells the target of a host that ended the connection at our KeyUpdate (see
    /// [`TargetShared::note_conn_failure`]).
    fn note_conn_failure(&self, e: &Error) {
        if let Some(q) = self.state.queue() {
            self.target.note_conn_failure(e, &q.ctrl.hostnqn, self.peer);
        }
    }

    /// Writes out what the handlers queued (the end-of-iteration flush).
    pub(crate) fn flush(&mut self) {
        if self.closing.is_none() {
            if let Err(e) = self.conn.flush() {
                let f = self.send_failed(&e);
                self.close(f.term, f.why);
            }
        }
    }

    /// Starts closing: queues a C2HTermReq if `term` says so, and drains for a moment so that it gets out.
    fn close(&mut self, term: Option<(Fes, u32)>, why: String) {
        if self.closing.is_some() {
            return;
        }
        if let Some((fes, fei)) = term {
            let mut header = [0u8; pdu::MAX_TERM_DATA];
            let rx = self.conn.rx_data();
            let hlen = rx
                .get(2)
                .map_or(pdu::CH_LEN, |&h| usize::from(h).max(pdu::CH_LEN));
            let n = hlen.min(pdu::MAX_TERM_DATA).min(rx.len());
            header[..n].copy_from_slice(&rx[..n]);
            let t = pdu::TermReq {
                fes: fes as u16,
                fei,
                data: &header[..n],
            };
            pdu::encode_c2h_term_req(self.conn.tx_buf(), &t);
            self.conn.pdu_queued();
            self.target
                .stats
                .term_reqs
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        if let Some(q) = self.state.queue() {
            if q.qid == 0 {
                // The controller goes with its admin queue; its I/O queues may sleep on other reactors.
                q.ctrl.kill();
                self.target.wake_all();
            }
        }
        self.closing = Some((why, Instant::now() + DRAIN_TIME));
    }

    /// Closing: sends what is left, and reads (and drops) what the host still sends so that the socket closes
    /// with a FIN rather than a reset, which could destroy a termination request still in flight.
    fn drain(&mut self, deadline: Instant) -> Progress {
        let sent = matches!(self.conn.flush(), Ok(true) | Err(_));
        while let Ok(n) = self.conn.fill() {
            if n == 0 {
                break;
            }
            let len = self.conn.rx_data().len();
            self.conn.consume(len);
        }
        if sent || Instant::now() >= deadline {
            self.conn.shutdown();
            return Progress::Finished;
        }
        Progress::Idle
    }

    /// Adds this session's counters to the target's totals.
    fn publish_stats(&mut self) {
        self.stats.key_updates_sent = self.conn.stats.key_updates_sent;
        self.stats.key_updates_received = self.conn.stats.key_updates_received;
        let s = self.stats;
        let p = self.published;
        if s.commands == p.commands {
            return;
        }
        s.publish(&p, &self.target.stats);
        self.published = s;
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.publish_stats();
        let reason = self
            .closing
            .as_ref()
            .map_or("session dropped", |(why, _)| why.as_str());
        let (qid, cntlid) = match self.state.queue() {
            Some(q) => {
                if q.qid == 0 {
                    q.ctrl.kill();
                    q.subsys.remove_controller(q.ctrl.cntlid);
                    self.target.wake_all();
                } else {
                    q.ctrl.release_io_queue(q.qid);
                }
                (Some(q.qid), Some(q.ctrl.cntlid))
            }
            None => (None, None),
        };
        self.target.emit(&TargetEvent::Closed {
            peer: self.peer,
            qid,
            cntlid,
            reason,
        });
        self.target
            .stats
            .closed
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::packing_verdict;

    #[test]
    fn a_host_that_seals_each_pdu_alone_is_answered_at_once_and_a_batching_one_in_batches() {
        // SPDK's host: a capsule's header and its data, each sealed by its own SSL_write (seen: 8 records,
        // 4 PDUs a read).
        assert_eq!(packing_verdict(8, 4), Some(true));
        assert_eq!(packing_verdict(4, 4), Some(true));
        // Ours at depth: several capsules a record (seen: 8 records, 28-31 PDUs).
        assert_eq!(packing_verdict(8, 30), Some(false));
        assert_eq!(packing_verdict(3, 4), Some(false));
        // A plain connection opens no records.
        assert_eq!(packing_verdict(0, 40), Some(false));
        // Too few PDUs to tell: the last verdict stands.
        assert_eq!(packing_verdict(2, 3), None);
        assert_eq!(packing_verdict(0, 0), None);
    }
}

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

use std::net::{SocketAddr, TcpStream};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvpoll::reactor::WakeSources;
use nvpoll::send::SendPolicy;
use nvpoll::spec::{fabrics, io as io_op, Cqe, SglType, Sqe, Status};

use crate::admin;
use crate::events::TargetEvent;
use crate::handler::{Ctx, NsRef, Queue, Reply};
use crate::io;
use crate::options::TlsMode;
use crate::shared::SessionStats;
use crate::shared::{Listener, TargetShared};
use crate::store::{FlushStatus, FlushTicket};
use nvpoll_wire::conn::{Conn, DIRECT_SEND_MIN};
use nvpoll_wire::dhchap::{self, controller::Computed};
use nvpoll_wire::pdu::{self, Decoded, Digests, Fes, Pdu, PduError};
use nvpoll_wire::Error;

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

/// Where the data of a command fetched with R2T goes.
#[derive(Debug)]
enum Sink {
    /// Straight into a namespace, at this byte offset (an NVM write).
    Namespace { ns: NsRef, off: u64, fua: bool },
    /// Into a buffer, then the command runs with it.
    Buffer(Vec<u8>),
}

#[derive(Debug)]
enum SlotState {
    Free,
    /// Waiting for H2CData: `received` of `len` bytes so far. `error` is set when a write failed or a data
    /// digest was bad; the data still has to arrive before the command completes with it.
    Receiving {
        sink: Sink,
        len: u32,
        received: u32,
        error: Option<Status>,
    },
    /// An Asynchronous Event Request, held until an event happens.
    Held,
    /// Waiting for flushes, then completes with `status`.
    Flushing {
        tickets: Vec<(NsRef, FlushTicket)>,
        status: Status,
    },
    /// An Authentication Send or Receive whose Diffie-Hellman work runs on a thread of its own.
    Authenticating {
        job: std::sync::mpsc::Receiver<Computed>,
    },
}

/// A command that stays outstanding after the poll that received it.
#[derive(Debug)]
struct Slot {
    cid: u16,
    sqe: Sqe,
    state: SlotState,
}

// Every command scans the slot table for its command ID while commands are outstanding: a slot stays two cache
// lines or less (the command, its ID and a state whose largest variant is an R2T's sink); a bigger state goes
// behind a box.
const _: () = assert!(std::mem::size_of::<Slot>() <= 128);

/// What a connection that is not a queue yet is waiting for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SetupPhase {
    /// TLS is configured: waiting for the first byte to tell a ClientHello from a plain ICReq.
    Detect,
    /// The TLS handshake is running.
    Tls,
    IcReq,
    Connect,
}

/// What only the set-up phase needs (TLS detection and handshake, ICReq, Fabrics Connect): dropped when
/// Connect succeeds.
struct Setup {
    phase: SetupPhase,
    /// The TLS handshake while [`SetupPhase::Tls`] runs, and the bytes it has not consumed yet.
    tls_hs: Option<nvpoll_tls::Handshake>,
    tls_inb: Vec<u8>,
    /// ICReq and Connect must have come by then.
    connect_deadline: Instant,
}

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

/// A PDU with its data as a range of the receive buffer, so that the buffer is free to borrow again.
enum Rx {
    IcReq(pdu::IcReq),
    TermReq {
        fes: u16,
        fei: u32,
    },
    Capsule {
        sqe: Sqe,
        data: Range<usize>,
    },
    H2CData {
        hdr: pdu::H2CDataHdr,
        data: Range<usize>,
    },
}

/// Whether a poll found work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Progress {
    Busy,
    Idle,
    /// The connection is closed; drop the session.
    Finished,
}

/// One connection.
///
/// The fields every PDU of a connected session reads or writes come first: the connection (its buffers), the
/// phase state (the queue), the slot table and its counts, the counters and the decode and send settings.
pub(crate) struct Session {
    conn: Conn,
    state: State,
    slots: Vec<Slot>,
    busy_slots: usize,
    flushing: usize,
    /// Slots in [`SlotState::Authenticating`].
    auth_jobs: usize,
    stats: SessionStats,
    decode: pdu::DecodeConfig,
    /// When responses leave; refreshed from the target's setting at every poll.
    policy: SendPolicy,
    digests: Digests,
    hpda: u8,
    target: Arc<TargetShared>,
    closing: Option<(String, Instant)>,
    // Cold: read at set-up, on a close, by some admin commands, or when idle.
    published: SessionStats,
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
        let conn = Conn::from_stream(stream, SETUP_RX_BUFFER)?;
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
            digests: Digests::NONE,
            hpda: 0,
            target,
            closing: None,
            published: SessionStats::default(),
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
        if let Some(q) = self.state.queue_mut() {
            q.refresh_namespaces();
            if q.qid == 0 && q.ctrl.ns_notice_pending() {
                self.deliver_notice(Notice::NamespaceAttribute);
            }
            if self
                .state
                .queue()
                .is_some_and(|q| q.qid == 0 && q.ctrl.ana_notice_pending())
            {
                self.deliver_notice(Notice::AnaChange);
            }
            if self
                .state
                .queue()
                .is_some_and(|q| q.qid == 0 && q.ctrl.resv_notice_pending())
            {
                self.deliver_notice(Notice::Reservation);
            }
        }
        self.policy.set_mode(self.target.send_mode());
        if matches!(
            self.state.setup_phase(),
            Some(SetupPhase::Detect | SetupPhase::Tls)
        ) {
            return self.poll_tls();
        }
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
        }
        let before = self.stats.commands;
        if let Err(f) = self.handle_received() {
            self.close(f.term, f.why);
            return Progress::Busy;
        }
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

    /// Closes the connection after its socket or TLS failed with `e` (the host closing it is an ordinary
    /// close, anything else is logged as what it was).
    fn close_on(&mut self, e: Error) -> Progress {
        let why = match e {
            Error::Closed => "closed by the host".to_string(),
            e => e.to_string(),
        };
        self.close(None, why);
        Progress::Busy
    }

    /// Before ICReq on a TLS-enabled target: tells TLS from plain TCP by the first byte, then runs the
    /// handshake one non-blocking step per poll. The connect deadline bounds both.
    fn poll_tls(&mut self) -> Progress {
        let State::Setup(setup) = &mut self.state else {
            unreachable!("TLS runs before Connect")
        };
        if setup.phase == SetupPhase::Detect {
            match self.conn.peek_first_byte() {
                Ok(None) => return Progress::Idle,
                Ok(Some(0x16)) => {
                    setup.tls_hs = Some(nvpoll_tls::Handshake::server(
                        self.target.tls_server.clone(),
                    ));
                    setup.phase = SetupPhase::Tls;
                }
                Ok(Some(_)) if self.listener.tls == TlsMode::Required => {
                    self.close(None, "TLS is required and the host sent plaintext".into());
                    return Progress::Busy;
                }
                Ok(Some(_)) => {
                    setup.phase = SetupPhase::IcReq;
                    return Progress::Busy;
                }
                // Closed before its first byte (a probe, or a host that gave up) is an ordinary close.
                Err(e) => return self.close_on(e),
            }
        }
        match self.conn.tls_step(&mut setup.tls_hs, &mut setup.tls_inb) {
            Ok(true) => {
                setup.phase = SetupPhase::IcReq;
                Progress::Busy
            }
            Ok(false) => Progress::Idle,
            Err(e) => {
                self.close(None, format!("TLS handshake failed: {e}"));
                Progress::Busy
            }
        }
    }

    /// What can give this session work while its reactor sleeps (hybrid idle mode): its socket, and the
    /// deadline of its next timer (connect, keep-alive, closing). Changes made elsewhere (a stop, a removed
    /// subsystem, a torn-down controller, a namespace notice) wake the reactors through
    /// [`TargetShared::wake_all`]. Returns `false` while a flush runs on the flusher thread, which does not
    /// wake anyone: the session is then polled.
    pub(crate) fn wake_sources<'a>(&'a self, w: &mut WakeSources<'a>) -> bool {
        self.wake_sources_with(w, true)
    }

    /// [`Session::wake_sources`] without the socket's readability, for a group that watches the socket in an
    /// epoll set of its own; `false` also while it has bytes to send (the group polls it).
    pub(crate) fn wake_timers<'a>(&'a self, w: &mut WakeSources<'a>) -> bool {
        self.wake_sources_with(w, false)
    }

    fn wake_sources_with<'a>(&'a self, w: &mut WakeSources<'a>, socket: bool) -> bool {
        if self.flushing > 0 || self.auth_jobs > 0 {
            return false;
        }
        if let Some(deadline) = self.state.queue().and_then(|q| q.auth_deadline) {
            w.deadline(deadline);
        }
        if socket {
            self.conn.wake_sources(w);
        } else if self.conn.wants_flush() {
            return false;
        }
        if let Some((_, deadline)) = &self.closing {
            w.deadline(*deadline);
            return true;
        }
        if let Some(until) = self.state.disconnected() {
            w.deadline(until);
        }
        match &self.state {
            State::Setup(setup) => w.deadline(setup.connect_deadline),
            State::Connected(Connected { queue: q, .. }) if q.qid == 0 => {
                if let Some(ms) = q.ctrl.keep_alive_deadline_ms() {
                    w.deadline(self.target.epoch + Duration::from_millis(ms));
                }
            }
            State::Connected(_) => {}
        }
        true
    }

    /// Writes out what the handlers queued (the end-of-iteration flush).
    pub(crate) fn flush(&mut self) {
        if self.closing.is_none() {
            if let Err(e) = self.conn.flush() {
                self.close(None, format!("send failed: {e}"));
            }
        }
    }

    /// Timers: the connect deadline, the keep-alive timeout on the admin queue, and the controller's death on
    /// I/O queues. Returns why the connection must close.
    fn check_timers(&mut self, now_ms: u64) -> Option<String> {
        if self.target.stopping() {
            return Some("target stopping".into());
        }
        let q = match &self.state {
            State::Connected(c) => &c.queue,
            State::Setup(setup) => {
                return (Instant::now() >= setup.connect_deadline).then(|| {
                    format!(
                        "no ICReq and Connect within {:?}",
                        self.target.limits.connect_timeout
                    )
                });
            }
        };
        if q.subsys.is_removed() {
            return Some(format!("subsystem {} was removed", q.subsys.nqn));
        }
        if let (Some(a), Some(deadline)) = (&q.auth, q.auth_deadline) {
            if (a.in_progress() || !a.authenticated()) && Instant::now() >= deadline {
                let why = format!(
                    "DH-HMAC-CHAP: the host sent no next authentication message within {:?} ({a:?})",
                    q.auth_step
                );
                self.emit_auth_failed(&why);
                return Some(why);
            }
        }
        if q.qid == 0 {
            // Torn down from outside (a new I/O queue count): the host reconnects.
            if q.ctrl.is_dead() {
                return Some(format!("controller {} was torn down", q.ctrl.cntlid));
            }
            // Before the admin queue authenticated, the authentication's own deadline bounds it: a host can
            // send no Keep Alive then, and its first DH-HMAC-CHAP transaction may wait for its crypto
            // modules to load (seconds in an emulated guest).
            if q.authenticated() && q.ctrl.keep_alive_expired(now_ms) {
                self.target.emit(&TargetEvent::KeepAliveExpired {
                    peer: self.peer,
                    subnqn: &q.subsys.nqn,
                    cntlid: q.ctrl.cntlid,
                    kato_ms: q.ctrl.kato_ms(),
                });
                self.target
                    .stats
                    .keep_alive_expired
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                return Some(format!(
                    "keep-alive timeout ({} ms) expired",
                    q.ctrl.kato_ms()
                ));
            }
        } else if q.ctrl.is_dead() {
            return Some(format!("controller {} was torn down", q.ctrl.cntlid));
        }
        None
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

    /// Decodes and handles the whole PDUs in the receive buffer, until the send buffer passes its high-water
    /// mark (the rest waits for the host to read its responses).
    fn handle_received(&mut self) -> Result<(), Fatal> {
        loop {
            if self.conn.tx_pending() > TX_HIGH_WATER {
                // Responses pile up unsent: leave the rest for when the host has read them.
                return Ok(());
            }
            let rx = self.conn.rx_data();
            let (pdu, len) = match pdu::decode(rx, &self.decode) {
                Ok(Decoded::Incomplete { need }) => {
                    if need > rx.len() {
                        self.conn.reserve_rx(need);
                    }
                    self.conn.ack_partial(need);
                    return Ok(());
                }
                Ok(Decoded::Pdu { pdu, len }) => (to_rx(rx, pdu)?, len),
                Err(e) => match e.skip_len() {
                    Some(len) => {
                        self.on_data_digest_error(&e)?;
                        self.conn.consume(len);
                        continue;
                    }
                    None => {
                        let fes = e.fes().unwrap_or(Fes::InvalidHeaderField);
                        return Err(Fatal::term(fes, e.fei(), format!("malformed PDU: {e}")));
                    }
                },
            };
            let waiting = self.conn.tx_pending();
            self.on_pdu(pdu)?;
            self.conn.consume(len);
            if self.closing.is_some() {
                return Ok(());
            }
            // Send mode: inline writes each PDU's responses at once when nothing was waiting; adaptive does so
            // only when nothing else was received either (an idle connection); deferred leaves everything to
            // the end-of-iteration flush.
            if self.conn.tx_pending() > waiting {
                let more = if self.conn.rx_data().is_empty() {
                    0
                } else {
                    usize::MAX
                };
                if self.policy.kick_now(waiting, more) {
                    if let Err(e) = self.conn.flush() {
                        return Err(Fatal::close(format!("send failed: {e}")));
                    }
                }
            }
        }
    }

    fn on_pdu(&mut self, pdu: Rx) -> Result<(), Fatal> {
        match (self.state.setup_phase() == Some(SetupPhase::IcReq), pdu) {
            (_, Rx::TermReq { fes, fei }) => Err(Fatal::close(format!(
                "host sent H2CTermReq (fes {fes:#x}, fei {fei:#x})"
            ))),
            (true, Rx::IcReq(ic)) => {
                self.on_icreq(&ic);
                Ok(())
            }
            (true, _) => Err(Fatal::term(
                Fes::PduSequenceError,
                0,
                "first PDU is not an ICReq",
            )),
            (_, Rx::IcReq(_)) => Err(Fatal::term(Fes::PduSequenceError, 0, "second ICReq")),
            (_, Rx::Capsule { sqe, data }) => self.on_capsule(sqe, data),
            (_, Rx::H2CData { hdr, data }) => self.on_h2c_data(hdr, data),
        }
    }

    fn on_icreq(&mut self, ic: &pdu::IcReq) {
        let limits = &self.target.limits;
        // Grant exactly the digests the host asked for: Linux refuses an ICResp that differs.
        self.digests = ic.digests;
        self.hpda = ic.hpda;
        let resp = pdu::IcResp {
            pfv: pdu::PFV_1_0,
            cpda: 0,
            digests: ic.digests,
            maxh2cdata: limits.maxh2cdata,
        };
        pdu::encode_ic_resp(self.conn.tx_buf(), &resp);
        self.conn.pdu_queued();
        let max_data = limits.maxh2cdata.max(limits.incapsule_data);
        self.decode = pdu::DecodeConfig::new(pdu::Direction::ToController, ic.digests, max_data);
        if let State::Setup(setup) = &mut self.state {
            setup.phase = SetupPhase::Connect;
        }
    }

    /// A command capsule: checks its data pointer, then executes it or asks for its data.
    fn on_capsule(&mut self, sqe: Sqe, data: Range<usize>) -> Result<(), Fatal> {
        self.stats.commands += 1;
        if let State::Connected(Connected {
            disconnected: Some(until),
            ..
        }) = &mut self.state
        {
            // Behind a Disconnect (SPDK's nvme_fuzz sends commands there): each still gets its one answer.
            // Disconnect deleted this I/O queue's submission queue, and these commands were submitted to it
            // before the host could see that, so they end as commands on a deleted SQ do (NVMe Base 2.0,
            // Delete I/O Submission Queue): Command Aborted due to SQ Deletion, which the host may retry on
            // another queue (no DNR). Command Sequence Error would tell it that it broke a command sequence,
            // and a host cannot know where in the stream the target processed its Disconnect.
            *until = Instant::now() + DISCONNECT_LINGER;
            self.stats.aborted_after_disconnect += 1;
            return self.complete(sqe.cid, Status::ABORTED_SQ_DELETION, 0, 0);
        }
        if self.busy_slots > 0 {
            if let Some(i) = self
                .slots
                .iter()
                .position(|s| !matches!(s.state, SlotState::Free) && s.cid == sqe.cid)
            {
                if !matches!(self.slots[i].state, SlotState::Held) {
                    return Err(Fatal::term(
                        Fes::InvalidHeaderField,
                        10,
                        format!("command ID {:#x} is already outstanding", sqe.cid),
                    ));
                }
                // A host that completed an Asynchronous Event Request on its own (SPDK does at detach) and
                // reused its command ID: the AER is retired, never completed, and the new command runs. Only a
                // held AER is forgiven; its completion carries no data the host could confuse with another's.
                self.retire_aer(i);
            }
        }
        if let Some(q) = self.state.queue_mut() {
            q.sqhd = ((u32::from(q.sqhd) + 1) % (u32::from(q.sqsize) + 1)) as u16;
            // The namespaces and the path's ANA states as they are now (an atomic load each when unchanged):
            // the poll's refresh can have run before this command arrived in the same pass, and a change the
            // host saw take effect (an RPC answered, an ANA event read) before it sent the command applies to
            // it. Without this, CI saw a write answered with the ANA state from before the change.
            q.refresh_namespaces();
        }
        let fctype = (sqe.opcode == fabrics::FABRICS).then_some(sqe.nsid as u8);
        // Data transfer direction: bits 1:0 of the opcode (of the fctype for fabrics commands).
        let dir = fctype.unwrap_or(sqe.opcode) & 3;
        let in_len = data.len() as u32;
        let sgl = sqe.sgl();
        let xfer_len = sgl.length;
        if sqe.flags & 0xc0 == 0 && (dir != 0 || in_len > 0) {
            return self.complete(sqe.cid, Status::INVALID_FIELD.with_dnr(), 0, 0);
        }
        let incapsule =
            sgl.sgl_type == SglType::DataBlock && sgl.subtype == nvpoll::spec::sgl_subtype::OFFSET;
        let transport = sgl.sgl_type == SglType::TransportDataBlock;
        if in_len > 0 && !incapsule {
            return self.complete(
                sqe.cid,
                Status::SGL_DESCRIPTOR_TYPE_INVALID.with_dnr(),
                0,
                0,
            );
        }
        if incapsule {
            if dir != 1 {
                return self.complete(
                    sqe.cid,
                    Status::SGL_DESCRIPTOR_TYPE_INVALID.with_dnr(),
                    0,
                    0,
                );
            }
            if sgl.address != 0 {
                return self.complete(sqe.cid, Status::SGL_OFFSET_INVALID.with_dnr(), 0, 0);
            }
            if xfer_len != in_len || in_len > self.target.limits.incapsule_data {
                return self.complete(sqe.cid, Status::DATA_SGL_LENGTH_INVALID.with_dnr(), 0, 0);
            }
        } else if xfer_len > 0 && !transport {
            return self.complete(
                sqe.cid,
                Status::SGL_DESCRIPTOR_TYPE_INVALID.with_dnr(),
                0,
                0,
            );
        }

        // The connection is not a queue yet: only Connect may come.
        if self.awaiting_connect() && fctype != Some(fabrics::CONNECT) {
            return self.complete(sqe.cid, Status::COMMAND_SEQUENCE_ERROR.with_dnr(), 0, 0);
        }

        // A queue whose host must authenticate runs nothing else until it has.
        let auth_cmd = matches!(fctype, Some(fabrics::AUTH_SEND | fabrics::AUTH_RECV));
        if !auth_cmd && self.state.queue().is_some_and(|q| !q.authenticated()) {
            self.emit_auth_failed(&format!(
                "opcode {:#04x}{} before authentication: refused with Authentication Required",
                sqe.opcode,
                fctype.map_or(String::new(), |t| format!(" (fctype {t:#04x})"))
            ));
            return self.complete(sqe.cid, Status::AUTHENTICATION_REQUIRED, 0, 0);
        }

        // Host-to-controller data that is not in the capsule: ask for it first, for the commands that take it
        // (the others complete without it, with an error or without needing it).
        let io_queue = self.state.queue().is_some_and(|q| q.qid != 0);
        let io_data = io_queue && (sqe.opcode == io_op::WRITE || io::takes_data(sqe.opcode));
        if dir == 1
            && transport
            && xfer_len > 0
            && (io_data || matches!(fctype, Some(fabrics::CONNECT | fabrics::AUTH_SEND)))
        {
            return self.solicit(sqe, xfer_len);
        }
        if self.awaiting_connect() {
            let data = &self.conn.rx_data()[data];
            let outcome = admin::connect(
                &self.target,
                &self.listener,
                &sqe,
                data,
                self.tls_identity(),
            );
            return self.finish_connect(sqe.cid, outcome);
        }
        if auth_cmd {
            let data = self.conn.rx_data()[data].to_vec();
            return self.on_auth(sqe, &data);
        }
        let queue = self
            .state
            .queue_mut()
            .expect("a connected session has a queue");
        let reply = if queue.qid != 0 && sqe.opcode == io_op::WRITE && !data.is_empty() {
            // An in-capsule write goes straight to the namespace.
            io::write_in_capsule(queue, &sqe, &self.conn.rx_data()[data], &mut self.stats)
        } else {
            self.run_handler(&sqe, Data::Received(data), xfer_len)
        };
        self.reply(sqe, reply)
    }

    /// Sends R2T for a command's data (or completes it with an error if it cannot take data).
    fn solicit(&mut self, sqe: Sqe, len: u32) -> Result<(), Fatal> {
        let sink = match self.state.queue() {
            Some(q) if q.qid != 0 && sqe.opcode == io_op::WRITE => {
                match io::prepare_write(q, &sqe, len) {
                    Ok((ns, off)) => Sink::Namespace {
                        ns,
                        off,
                        fua: sqe.cdw12 & Sqe::FUA != 0,
                    },
                    Err(status) => return self.complete(sqe.cid, status, 0, 0),
                }
            }
            _ if len > MAX_ADMIN_DATA.max(io::MAX_COMMAND_DATA) => {
                return self.complete(sqe.cid, Status::DATA_SGL_LENGTH_INVALID.with_dnr(), 0, 0);
            }
            _ => Sink::Buffer(Vec::with_capacity(len as usize)),
        };
        let ttag = self.take_slot(
            sqe,
            SlotState::Receiving {
                sink,
                len,
                received: 0,
                error: None,
            },
        )?;
        let r2t = pdu::R2T {
            cccid: sqe.cid,
            ttag,
            r2to: 0,
            r2tl: len,
        };
        pdu::encode_r2t(self.conn.tx_buf(), &r2t, self.digests);
        self.conn.pdu_queued();
        self.stats.r2ts += 1;
        Ok(())
    }

    /// Data for an outstanding command.
    fn on_h2c_data(&mut self, hdr: pdu::H2CDataHdr, data: Range<usize>) -> Result<(), Fatal> {
        let index = usize::from(hdr.ttag);
        let slot = match self.slots.get_mut(index) {
            Some(s) if s.cid == hdr.cccid && matches!(s.state, SlotState::Receiving { .. }) => s,
            _ => {
                return Err(Fatal::term(
                    Fes::InvalidHeaderField,
                    10,
                    format!(
                        "H2CData for command {:#x} with unknown transfer tag {}",
                        hdr.cccid, hdr.ttag
                    ),
                ))
            }
        };
        let SlotState::Receiving {
            sink,
            len,
            received,
            error,
        } = &mut slot.state
        else {
            unreachable!()
        };
        let end = u64::from(hdr.datao) + u64::from(hdr.datal);
        if hdr.datao != *received || end > u64::from(*len) {
            return Err(Fatal::term(
                Fes::DataOutOfRange,
                0,
                format!(
                    "H2CData for command {:#x} covers bytes {}..{end}; expected from {} of {}",
                    hdr.cccid, hdr.datao, received, len
                ),
            ));
        }
        let bytes = &self.conn.rx_data()[data];
        match sink {
            Sink::Namespace { ns, off, .. } => {
                if error.is_none() {
                    if let Err(e) = ns.store.write(*off + u64::from(hdr.datao), bytes) {
                        *error = Some(io::write_error_status(&e));
                    }
                }
            }
            Sink::Buffer(buf) => buf.extend_from_slice(bytes),
        }
        *received = end as u32;
        if *received < *len {
            return Ok(());
        }
        self.data_complete(index)
    }

    /// A data digest error: the PDU is dropped and its command fails with a transient transport error.
    fn on_data_digest_error(&mut self, e: &PduError) -> Result<(), Fatal> {
        let PduError::DataDigest { pdu_type, .. } = *e else {
            return Ok(());
        };
        let rx = self.conn.rx_data();
        match pdu_type {
            pdu::PduType::CapsuleCmd => {
                let sqe =
                    Sqe::from_bytes(&rx[pdu::CH_LEN..]).expect("the decoder checked the header");
                self.stats.commands += 1;
                if let Some(q) = self.state.queue_mut() {
                    q.sqhd = ((u32::from(q.sqhd) + 1) % (u32::from(q.sqsize) + 1)) as u16;
                }
                self.complete(sqe.cid, Status::TRANSIENT_TRANSPORT_ERROR, 0, 0)
            }
            pdu::PduType::H2CData => {
                let field = |o: usize| u32::from_le_bytes([rx[o], rx[o + 1], rx[o + 2], rx[o + 3]]);
                let (cccid, ttag) = (
                    u16::from_le_bytes([rx[8], rx[9]]),
                    u16::from_le_bytes([rx[10], rx[11]]),
                );
                let (datao, datal) = (field(12), field(16));
                let index = usize::from(ttag);
                let Some(slot) = self.slots.get_mut(index).filter(|s| s.cid == cccid) else {
                    return Err(Fatal::term(
                        Fes::InvalidHeaderField,
                        10,
                        "H2CData with unknown transfer tag",
                    ));
                };
                let SlotState::Receiving {
                    len,
                    received,
                    error,
                    ..
                } = &mut slot.state
                else {
                    return Err(Fatal::term(
                        Fes::PduSequenceError,
                        0,
                        "H2CData for a command not receiving",
                    ));
                };
                let end = u64::from(datao) + u64::from(datal);
                if datao != *received || end > u64::from(*len) {
                    return Err(Fatal::term(Fes::DataOutOfRange, 0, "H2CData out of range"));
                }
                *error = Some(Status::TRANSIENT_TRANSPORT_ERROR);
                *received = end as u32;
                if *received < *len {
                    Ok(())
                } else {
                    self.data_complete(index)
                }
            }
            _ => Ok(()),
        }
    }

    /// All data of the command in slot `index` arrived.
    fn data_complete(&mut self, index: usize) -> Result<(), Fatal> {
        let slot = &mut self.slots[index];
        let state = std::mem::replace(&mut slot.state, SlotState::Free);
        let sqe = slot.sqe;
        self.busy_slots -= 1;
        let SlotState::Receiving { sink, error, .. } = state else {
            unreachable!()
        };
        if let Some(status) = error {
            return self.complete(sqe.cid, status, 0, 0);
        }
        match sink {
            Sink::Namespace { ns, fua, .. } => {
                self.stats.writes += 1;
                self.stats.bytes_written += u64::from(sqe.sgl().length);
                if fua {
                    let ticket = ns.store.start_flush();
                    self.reply(sqe, Reply::Flush(vec![(ns, ticket)]))
                } else {
                    self.complete(sqe.cid, Status::SUCCESS, 0, 0)
                }
            }
            Sink::Buffer(buf) => {
                if self.awaiting_connect() {
                    let outcome = admin::connect(
                        &self.target,
                        &self.listener,
                        &sqe,
                        &buf,
                        self.tls_identity(),
                    );
                    return self.finish_connect(sqe.cid, outcome);
                }
                if sqe.opcode == fabrics::FABRICS && sqe.nsid as u8 == fabrics::AUTH_SEND {
                    return self.on_auth(sqe, &buf);
                }
                let reply = self.run_handler(&sqe, Data::Gathered(&buf), buf.len() as u32);
                self.reply(sqe, reply)
            }
        }
    }

    /// The outcome of a Connect: the connection becomes a queue, or the host hears why not.
    fn finish_connect(
        &mut self,
        cid: u16,
        outcome: Result<Queue, admin::Refusal>,
    ) -> Result<(), Fatal> {
        match outcome {
            Ok(mut q) => {
                q.sqhd = (1 % (u32::from(q.sqsize) + 1)) as u16;
                let cntlid = q.ctrl.cntlid;
                self.target.emit(&TargetEvent::QueueConnected {
                    peer: self.peer,
                    subnqn: &q.subsys.nqn,
                    hostnqn: &q.ctrl.hostnqn,
                    cntlid,
                    qid: q.qid,
                    depth: u32::from(q.sqsize) + 1,
                    digests: self.digests,
                });
                // The set-up state goes: a connected session carries only its queue.
                self.state = State::Connected(Connected {
                    queue: q,
                    disconnected: None,
                });
                let limits = &self.target.limits;
                let max_data = limits.maxh2cdata.max(limits.incapsule_data);
                self.conn.reserve_rx(max_data as usize + 4096);
                // AUTHREQ (dword 0 bits 31:16): bit 1, an authentication transaction is required.
                // Bit 2: secure channel concatenation required as well.
                let authreq = match self.state.queue().and_then(|q| q.auth.as_ref()) {
                    Some(a) if a.concat_required() => (1u32 << 17) | (1 << 18),
                    Some(_) => 1u32 << 17,
                    None => 0,
                };
                self.complete(cid, Status::SUCCESS, u32::from(cntlid) | authreq, 0)
            }
            Err(r) => {
                self.target
                    .stats
                    .connects_rejected
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.target.emit(&TargetEvent::ConnectRefused {
                    peer: self.peer,
                    subnqn: &r.subnqn,
                    hostnqn: &r.hostnqn,
                    qid: r.qid,
                    reason: &r.reason,
                });
                self.complete(cid, r.status, r.dw0, 0)
            }
        }
    }

    /// Carries out a handler's decision.
    fn reply(&mut self, sqe: Sqe, reply: Reply) -> Result<(), Fatal> {
        match reply {
            Reply::Complete { status, dw0, dw1 } => self.complete(sqe.cid, status, dw0, dw1),
            Reply::Data(mut data) => {
                let len = sqe.sgl().length;
                let max = self
                    .state
                    .queue()
                    .map_or(MAX_ADMIN_DATA, Queue::max_transfer);
                if len > max {
                    return self.complete(
                        sqe.cid,
                        Status::DATA_SGL_LENGTH_INVALID.with_dnr(),
                        0,
                        0,
                    );
                }
                data.resize(len as usize, 0);
                if !data.is_empty() {
                    self.send_data(sqe.cid, &data);
                }
                self.complete_after_data(sqe.cid, !data.is_empty())
            }
            Reply::Read { ns, off, len } => {
                let mark = self.conn.tx_buf().len();
                let mut done = 0usize;
                while done < len as usize {
                    let n = C2H_CHUNK.min(len as usize - done);
                    let last = done + n == len as usize;
                    let success = last && self.state.queue().is_some_and(|q| q.sqflow_disabled);
                    let hdr = pdu::C2HDataHdr {
                        cccid: sqe.cid,
                        datao: done as u32,
                        datal: n as u32,
                        last,
                        success,
                    };
                    let tx = self.conn.tx_buf();
                    pdu::encode_c2h_data_header(tx, &hdr, self.digests, self.hpda);
                    if n >= DIRECT_SEND_MIN {
                        // Straight from the namespace's memory to the socket (RAM stores).
                        let conn = &mut self.conn;
                        let digest = self.digests.data;
                        let sent = ns.store.with_ram_slices(off + done as u64, n, |data| {
                            conn.send_payload(data, digest)
                        });
                        match sent {
                            Some(Ok(_)) => {
                                self.conn.pdu_queued();
                                done += n;
                                continue;
                            }
                            Some(Err(e)) => {
                                return Err(Fatal::close(format!("send failed: {e}")));
                            }
                            None => {}
                        }
                    }
                    let tx = self.conn.tx_buf();
                    let start = tx.len();
                    if ns.store.read_append(off + done as u64, n, tx).is_err() {
                        tx.truncate(mark);
                        return self.complete(sqe.cid, Status::UNRECOVERED_READ_ERROR, 0, 0);
                    }
                    if self.digests.data {
                        let d = pdu::data_digest(&tx[start..]);
                        tx.extend_from_slice(&d);
                    }
                    self.conn.pdu_queued();
                    done += n;
                }
                self.stats.reads += 1;
                self.stats.bytes_read += u64::from(len);
                self.complete_after_data(sqe.cid, len > 0)
            }
            Reply::Hold => {
                self.take_slot(sqe, SlotState::Held)?;
                Ok(())
            }
            Reply::Flush(tickets) => {
                self.take_slot(
                    sqe,
                    SlotState::Flushing {
                        tickets,
                        status: Status::SUCCESS,
                    },
                )?;
                self.flushing += 1;
                Ok(())
            }
            Reply::CompleteAndClose => {
                // What the queue still holds is answered first (the queue is going), then the Disconnect;
                // the connection stays to answer what the host sent behind it, and closes when the host
                // closes it or falls silent.
                self.abort_outstanding();
                self.complete(sqe.cid, Status::SUCCESS, 0, 0)?;
                if let State::Connected(c) = &mut self.state {
                    c.disconnected = Some(Instant::now() + DISCONNECT_LINGER);
                }
                Ok(())
            }
        }
    }

    /// Queues `data` as C2HData PDUs (without SUCCESS; see [`Session::complete_after_data`]).
    fn send_data(&mut self, cid: u16, data: &[u8]) {
        let sqflow_disabled = self.state.queue().is_some_and(|q| q.sqflow_disabled);
        let mut done = 0;
        for chunk in data.chunks(C2H_CHUNK) {
            let last = done + chunk.len() == data.len();
            let hdr = pdu::C2HDataHdr {
                cccid: cid,
                datao: done as u32,
                datal: chunk.len() as u32,
                last,
                success: last && sqflow_disabled,
            };
            pdu::encode_c2h_data(self.conn.tx_buf(), &hdr, chunk, self.digests, self.hpda);
            self.conn.pdu_queued();
            done += chunk.len();
        }
    }

    /// Completes a command whose data went out: with SQ flow control disabled the last C2HData carried SUCCESS
    /// and no response capsule follows (the C2H success optimization); otherwise a CapsuleResp does.
    fn complete_after_data(&mut self, cid: u16, sent_data: bool) -> Result<(), Fatal> {
        if sent_data && self.state.queue().is_some_and(|q| q.sqflow_disabled) {
            return Ok(());
        }
        self.complete(cid, Status::SUCCESS, 0, 0)
    }

    /// Queues a response capsule.
    fn complete(&mut self, cid: u16, status: Status, dw0: u32, dw1: u32) -> Result<(), Fatal> {
        let (sqid, sqhd) = match self.state.queue() {
            Some(q) if q.sqflow_disabled => (q.qid, 0xffff),
            Some(q) => (q.qid, q.sqhd),
            None => (0, 0),
        };
        let mut cqe = Cqe {
            dw0,
            dw1,
            sqhd,
            sqid,
            cid,
            status_phase: 0,
        };
        cqe.set_status(status, false);
        pdu::encode_capsule_resp(self.conn.tx_buf(), &cqe, self.digests);
        self.conn.pdu_queued();
        if !status.is_success() {
            self.stats.errors += 1;
        }
        Ok(())
    }

    /// Whether the connection waits for Fabrics Connect (ICReq done).
    #[inline]
    fn awaiting_connect(&self) -> bool {
        self.state.setup_phase() == Some(SetupPhase::Connect)
    }

    /// The PSK identity the host proved in the TLS handshake, if the connection runs TLS.
    fn tls_identity(&self) -> Option<&[u8]> {
        self.conn.tls_session().map(|s| s.psk_identity())
    }

    /// Frees the slot of a held Asynchronous Event Request without completing it: the host has given up on it.
    fn retire_aer(&mut self, i: usize) {
        debug_assert!(matches!(self.slots[i].state, SlotState::Held));
        self.slots[i].state = SlotState::Free;
        self.busy_slots -= 1;
        self.stats.aers_retired += 1;
    }

    /// A notice waits: a held AER carries it, if the host enabled such notices (otherwise it is dropped; the
    /// log page it points to still has the news).
    fn deliver_notice(&mut self, notice: Notice) {
        let Some(q) = self.state.queue() else { return };
        let (aec, event) = match notice {
            Notice::NamespaceAttribute => {
                (admin::AEC_NS_ATTRIBUTE, admin::NS_ATTRIBUTE_CHANGED_EVENT)
            }
            Notice::AnaChange => (admin::AEC_ANA_CHANGE, admin::ANA_CHANGE_EVENT),
            // Not in Asynchronous Event Configuration: the Reservation Notification Mask filters these.
            Notice::Reservation => (0, admin::RESERVATION_LOG_EVENT),
        };
        let take = |q: &crate::handler::Queue| match notice {
            Notice::NamespaceAttribute => q.ctrl.take_ns_notice(),
            Notice::AnaChange => q.ctrl.take_ana_notice(),
            Notice::Reservation => q.ctrl.take_resv_notice(),
        };
        let enabled = aec == 0
            || q.admin
                .as_ref()
                .is_some_and(|a| a.async_event_config() & aec != 0);
        if enabled {
            let Some(i) = self
                .slots
                .iter()
                .position(|s| matches!(s.state, SlotState::Held))
            else {
                // The notice waits for the next AER.
                return;
            };
            if take(q) {
                let cid = self.slots[i].cid;
                self.slots[i].state = SlotState::Free;
                self.busy_slots -= 1;
                let _ = self.complete(cid, Status::SUCCESS, event, 0);
            }
        } else {
            take(q);
        }
    }

    /// Completes every command the queue still holds (waiting for data or a flush, or a held AER) with Command
    /// Aborted due to SQ Deletion: the connection is about to close on the target's account, and the host must
    /// hear what became of each command rather than guess.
    fn abort_outstanding(&mut self) {
        if self.busy_slots == 0 || !matches!(self.state, State::Connected(_)) {
            return;
        }
        let cids: Vec<u16> = self
            .slots
            .iter_mut()
            .filter(|s| !matches!(s.state, SlotState::Free))
            .map(|s| {
                s.state = SlotState::Free;
                s.cid
            })
            .collect();
        self.busy_slots = 0;
        self.flushing = 0;
        self.auth_jobs = 0;
        for cid in cids {
            let _ = self.complete(cid, Status::ABORTED_SQ_DELETION, 0, 0);
        }
    }

    /// Puts a command in a free slot (its index is the R2T transfer tag).
    fn take_slot(&mut self, sqe: Sqe, state: SlotState) -> Result<u16, Fatal> {
        let depth = self.state.queue().map_or(1, Queue::depth);
        if self.busy_slots >= depth {
            // A full queue that holds AERs: the host counts only what it still waits for, so it has given up on
            // one of them (completed it locally) and used its entry. Retire one rather than end the session.
            if let Some(i) = self
                .slots
                .iter()
                .position(|s| matches!(s.state, SlotState::Held))
            {
                self.retire_aer(i);
            }
        }
        if self.busy_slots >= depth {
            return Err(Fatal::term(
                Fes::PduSequenceError,
                0,
                format!("more than {depth} commands outstanding (the queue size)"),
            ));
        }
        self.busy_slots += 1;
        let slot = Slot {
            cid: sqe.cid,
            sqe,
            state,
        };
        match self
            .slots
            .iter()
            .position(|s| matches!(s.state, SlotState::Free))
        {
            Some(i) => {
                self.slots[i] = slot;
                Ok(i as u16)
            }
            None => {
                self.slots.push(slot);
                Ok((self.slots.len() - 1) as u16)
            }
        }
    }

    /// Authentication Send (with its data) or Receive.
    fn on_auth(&mut self, sqe: Sqe, data: &[u8]) -> Result<(), Fatal> {
        let cmd = fabrics::FabricsCommand::from_sqe(&sqe);
        let (secp, spsp0, spsp1, len, send) = match cmd {
            Some(fabrics::FabricsCommand::AuthSend {
                secp,
                spsp0,
                spsp1,
                tl,
            }) => (secp, spsp0, spsp1, tl, true),
            Some(fabrics::FabricsCommand::AuthReceive {
                secp,
                spsp0,
                spsp1,
                al,
            }) => (secp, spsp0, spsp1, al, false),
            _ => return self.complete(sqe.cid, Status::INVALID_FIELD.with_dnr(), 0, 0),
        };
        let sgl_len = sqe.sgl().length;
        if secp != dhchap::SECP
            || spsp0 != dhchap::SPSP
            || spsp1 != dhchap::SPSP
            || len != sgl_len
            || (send && data.len() as u32 != len)
            || len == 0
        {
            return self.complete(sqe.cid, Status::INVALID_FIELD.with_dnr(), 0, 0);
        }
        if self.auth_jobs > 0 {
            // One authentication command at a time: the previous one is still being computed.
            return self.complete(sqe.cid, Status::COMMAND_SEQUENCE_ERROR, 0, 0);
        }
        let q = self
            .state
            .queue_mut()
            .expect("a connected session has a queue");
        let starts = send && data.len() >= 2 && data[0] == 0 && data[1] == 0;
        if starts && !q.auth.as_ref().is_some_and(|a| a.in_progress()) {
            // AUTH_Negotiate: a new transaction (first, or a re-authentication) with the keys as they are now.
            let Some(policy) = q.subsys.dhchap_policy(&q.ctrl.hostnqn) else {
                let why =
                    "Authentication Send from a host with no DH-HMAC-CHAP key on this subsystem"
                        .to_string();
                self.emit_auth_failed(&why);
                return self.complete(sqe.cid, Status::INVALID_FIELD.with_dnr(), 0, 0);
            };
            match &mut q.auth {
                Some(a) => a.restart(policy),
                None => {
                    q.auth = Some(Box::new(dhchap::controller::ControllerAuth::new(
                        &q.ctrl.hostnqn,
                        &q.subsys.nqn,
                        policy,
                    )))
                }
            }
            q.auth_deadline = Some(Instant::now() + q.auth_step);
        } else if q.auth_deadline.is_some() {
            // A step of the transaction under way: the host's time runs afresh from each of its messages, as
            // nvmet's does (its next message comes after arithmetic of its own, which on a slow machine is
            // the long part).
            q.auth_deadline = Some(Instant::now() + q.auth_step);
        }
        let Some(auth) = q.auth.as_mut() else {
            let why = "Authentication Receive before any AUTH_Negotiate".to_string();
            self.emit_auth_failed(&why);
            return self.complete(sqe.cid, Status::COMMAND_SEQUENCE_ERROR.with_dnr(), 0, 0);
        };
        if send {
            match auth.on_send(data) {
                dhchap::controller::SendOutcome::Complete => {
                    self.complete(sqe.cid, Status::SUCCESS, 0, 0)?;
                    self.after_auth();
                    Ok(())
                }
                dhchap::controller::SendOutcome::Invalid => {
                    self.complete(sqe.cid, Status::INVALID_FIELD.with_dnr(), 0, 0)
                }
                dhchap::controller::SendOutcome::Compute(job) => self.run_auth_job(sqe, job),
            }
        } else {
            match auth.on_receive() {
                dhchap::controller::ReceiveOutcome::Message(m) => self.auth_message(sqe, m),
                dhchap::controller::ReceiveOutcome::Compute(job) => self.run_auth_job(sqe, job),
            }
        }
    }

    /// Runs an authentication job: at once when it is cheap (no Diffie-Hellman group), else on a thread of
    /// its own while the command waits in a slot, so that the reactor goes on serving its other queues.
    fn run_auth_job(&mut self, sqe: Sqe, job: dhchap::controller::Job) -> Result<(), Fatal> {
        let heavy = self
            .state
            .queue()
            .and_then(|q| q.auth.as_ref())
            .is_some_and(|a| a.uses_dh());
        if !heavy {
            let c = job();
            return self.resume_auth(sqe, c);
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let spawned = std::thread::Builder::new()
            .name("nvpoll-dhchap".into())
            .spawn(move || {
                // The session may be gone (closed) by the time the job ends: nothing to tell then.
                let _ = tx.send(job());
            });
        if spawned.is_err() {
            self.target
                .stats
                .internal_errors
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return self.complete(sqe.cid, Status::INTERNAL_ERROR, 0, 0);
        }
        self.take_slot(sqe, SlotState::Authenticating { job: rx })?;
        self.auth_jobs += 1;
        Ok(())
    }

    /// Completes the authentication commands whose jobs finished.
    fn poll_auth_jobs(&mut self) {
        let mut done = Vec::new();
        for (i, slot) in self.slots.iter().enumerate() {
            if let SlotState::Authenticating { job } = &slot.state {
                match job.try_recv() {
                    Ok(c) => done.push((i, Some(c))),
                    Err(std::sync::mpsc::TryRecvError::Empty) => {}
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => done.push((i, None)),
                }
            }
        }
        for (i, c) in done {
            let sqe = self.slots[i].sqe;
            self.slots[i].state = SlotState::Free;
            self.busy_slots -= 1;
            self.auth_jobs -= 1;
            let r = match c {
                Some(c) => self.resume_auth(sqe, c),
                None => {
                    self.target
                        .stats
                        .internal_errors
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    self.complete(sqe.cid, Status::INTERNAL_ERROR, 0, 0)
                }
            };
            if let Err(f) = r {
                self.close(f.term, f.why);
                return;
            }
        }
    }

    fn resume_auth(&mut self, sqe: Sqe, c: dhchap::controller::Computed) -> Result<(), Fatal> {
        let q = self
            .state
            .queue_mut()
            .expect("a connected session has a queue");
        let Some(auth) = q.auth.as_mut() else {
            return self.complete(sqe.cid, Status::INTERNAL_ERROR, 0, 0);
        };
        match auth.resume(c) {
            dhchap::controller::Resumed::SendComplete => {
                self.complete(sqe.cid, Status::SUCCESS, 0, 0)
            }
            dhchap::controller::Resumed::Message(m) => self.auth_message(sqe, m),
        }
    }

    /// Returns an authentication message to an Authentication Receive; after a success or a failure, says so
    /// in the log, and after a failure ends the queue.
    fn auth_message(&mut self, sqe: Sqe, m: Vec<u8>) -> Result<(), Fatal> {
        self.reply(sqe, Reply::Data(m))?;
        self.after_auth();
        Ok(())
    }

    /// After an authentication command: a failed transaction (the host was told) ends the queue; a finished
    /// one is logged.
    fn after_auth(&mut self) {
        let Some(auth) = self.state.queue().and_then(|q| q.auth.as_ref()) else {
            return;
        };
        if let Some(why) = auth.failed() {
            let why = format!("DH-HMAC-CHAP: {why}");
            self.emit_auth_failed(&why);
            self.close(None, why);
        } else if auth.finished() {
            self.note_authenticated();
        }
    }

    /// Logs a finished authentication once.
    fn note_authenticated(&mut self) {
        let Some(q) = self.state.queue_mut() else {
            return;
        };
        if q.auth_deadline.take().is_none() {
            return;
        }
        let Some((hash, group, bidi)) = q.auth.as_ref().and_then(|a| a.outcome()) else {
            return;
        };
        let mut how = format!(
            "{hash}, {group}, {}",
            if bidi { "bidirectional" } else { "host only" }
        );
        if let Some(psk) = q.auth.as_mut().and_then(|a| a.take_generated_psk()) {
            // Secure channel concatenation: the queues that connect with the generated PSK carry commands.
            match q.subsys.add_generated_key(&q.ctrl.hostnqn, hash, &psk) {
                Some(identity) => how.push_str(&format!(
                    ", secure channel concatenation: TLS identity {identity}"
                )),
                None => how.push_str(", secure channel concatenation refused: no TLS suite for it"),
            }
        }
        self.target
            .stats
            .authentications
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.target.emit(&TargetEvent::Authenticated {
            peer: self.peer,
            subnqn: &q.subsys.nqn,
            hostnqn: &q.ctrl.hostnqn,
            cntlid: q.ctrl.cntlid,
            qid: q.qid,
            how: &how,
        });
    }

    fn emit_auth_failed(&self, why: &str) {
        let Some(q) = self.state.queue() else { return };
        self.target
            .stats
            .auth_failures
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.target.emit(&TargetEvent::AuthenticationFailed {
            peer: self.peer,
            subnqn: &q.subsys.nqn,
            hostnqn: &q.ctrl.hostnqn,
            cntlid: q.ctrl.cntlid,
            qid: q.qid,
            reason: why,
        });
    }

    /// Completes the commands whose flushes finished. Returns whether one did.
    fn poll_flushes(&mut self) -> bool {
        if self.flushing == 0 {
            return false;
        }
        let mut done = Vec::new();
        for (i, slot) in self.slots.iter_mut().enumerate() {
            if let SlotState::Flushing { tickets, status } = &mut slot.state {
                let mut pending = false;
                for (ns, t) in tickets.iter() {
                    match ns.store.flush_status(*t) {
                        FlushStatus::Pending => pending = true,
                        FlushStatus::Failed => *status = Status::WRITE_FAULT,
                        FlushStatus::Done => {}
                    }
                }
                if !pending {
                    done.push((i, slot.cid, *status));
                }
            }
        }
        for &(i, cid, status) in &done {
            self.slots[i].state = SlotState::Free;
            self.busy_slots -= 1;
            self.flushing -= 1;
            let _ = self.complete(cid, status, 0, 0);
        }
        !done.is_empty()
    }

    /// Runs a command that needs no more data through its handler, on this session's queue.
    fn run_handler(&mut self, sqe: &Sqe, data: Data<'_>, xfer_len: u32) -> Reply {
        let data = match data {
            Data::Received(range) => &self.conn.rx_data()[range],
            Data::Gathered(buf) => buf,
        };
        let queue = self
            .state
            .queue_mut()
            .expect("a connected session has a queue");
        let held_aers = if queue.qid == 0 {
            held_aers(&self.slots)
        } else {
            0
        };
        let mut ctx = Ctx {
            target: &self.target,
            queue,
            local: self.local,
            listener: &self.listener,
            xfer_len,
            held_aers,
        };
        dispatch(&mut ctx, sqe, data)
    }

    /// Adds this session's counters to the target's totals.
    fn publish_stats(&mut self) {
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

/// The Asynchronous Event Requests held in `slots`.
/// Where a command's data is, for [`Session::run_handler`].
enum Data<'a> {
    /// In the capsule: this range of the receive buffer.
    Received(std::ops::Range<usize>),
    /// Gathered from H2CData PDUs.
    Gathered(&'a [u8]),
}

fn held_aers(slots: &[Slot]) -> usize {
    slots
        .iter()
        .filter(|s| matches!(s.state, SlotState::Held))
        .count()
}

/// Routes a command that needs no more data to its handler.
fn dispatch(ctx: &mut Ctx<'_>, sqe: &Sqe, data: &[u8]) -> Reply {
    if sqe.opcode == fabrics::FABRICS {
        return admin::fabrics(ctx, sqe);
    }
    if ctx.queue.qid == 0 {
        admin::execute(ctx, sqe, data)
    } else {
        io::execute(ctx.queue, sqe, data)
    }
}

/// Converts a decoded PDU into one that refers to its data by position.
fn to_rx(buf: &[u8], pdu: Pdu<'_>) -> Result<Rx, Fatal> {
    let range = |d: &[u8]| {
        if d.is_empty() {
            0..0
        } else {
            let start = d.as_ptr() as usize - buf.as_ptr() as usize;
            start..start + d.len()
        }
    };
    Ok(match pdu {
        Pdu::IcReq(ic) => Rx::IcReq(ic),
        Pdu::H2CTermReq(t) => Rx::TermReq {
            fes: t.fes,
            fei: t.fei,
        },
        Pdu::CapsuleCmd { sqe, data } => Rx::Capsule {
            sqe,
            data: range(data),
        },
        Pdu::H2CData { hdr, data } => Rx::H2CData {
            hdr,
            data: range(data),
        },
        other => {
            return Err(Fatal::term(
                Fes::InvalidHeaderField,
                0,
                format!("{} from a host", other.pdu_type()),
            ));
        }
    })
}
/// The asynchronous notices a held AER may carry.
#[derive(Clone, Copy, Debug)]
enum Notice {
    /// Namespace Attribute Changed (read the Changed Namespace List).
    NamespaceAttribute,
    /// Asymmetric Namespace Access Change (read the ANA log).
    AnaChange,
    /// Reservation Log Page Available (read the Reservation Notification log).
    Reservation,
}

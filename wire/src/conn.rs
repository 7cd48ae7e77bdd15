//! One non-blocking TCP connection with its send and receive buffers.
//!
//! Both the initiator and the target move PDUs through a [`Conn`]: encoders append whole PDUs to the send
//! buffer, [`Conn::flush`] writes as much of it as the socket takes (keeping the rest for the next flush, so a
//! partial write or `EAGAIN` never copies twice), and [`Conn::fill`] reads whatever the socket has into the
//! receive buffer, where the PDU decoder looks at it in place.
//!
//! Large payloads (the data of C2HData, H2CData and big in-capsule writes) skip the send buffer:
//! [`Conn::send_parts`] writes the queued headers and the payload's own slices with one `writev`, and copies
//! only what the socket refuses. On loopback with 128 KiB I/O that copy was a fifth to a third of the sending
//! core.
//!
//! The buffers are sized once at connect time; nothing on the I/O path allocates unless a peer sends a PDU
//! larger than the receive buffer, which only happens when the caller raised the limit.
//!
//! With TLS ([`Conn::tls_client_handshake`], or a server [`Handshake`] driven by [`Conn::tls_step`]), the
//! buffers above stay plaintext: [`Conn::flush`] seals everything queued since the last flush into as few
//! records of at most 16 KiB as it takes (so the send mode decides how much a record carries: one PDU when
//! kicked inline, a whole batch when deferred), and [`Conn::fill`] decrypts whole records into the receive
//! buffer, where PDUs may span records. While the socket pushes back, nothing new is sealed: the plaintext
//! waits and goes out in bigger records once the wire drains.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use crate::Error;
use nvpoll_tls::{Handshake, Session};

/// Counters of one connection; cheap to copy and print.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnStats {
    /// PDUs queued for sending.
    pub pdus_tx: u64,
    /// PDUs decoded from the peer.
    pub pdus_rx: u64,
    /// `write`/`writev` system calls that sent bytes or hit `EAGAIN`.
    pub writes: u64,
    /// Bytes written to the socket.
    pub bytes_tx: u64,
    /// `read` system calls.
    pub reads: u64,
    /// Bytes read from the socket.
    pub bytes_rx: u64,
    /// Of those, bytes read straight into a command's buffer ([`Conn::fill_into`]).
    pub bytes_rx_direct: u64,
    /// Flushes that found something to send.
    pub flushes: u64,
    /// Immediate ACKs asked of the kernel (`TCP_QUICKACK`) while a PDU was incomplete.
    pub quick_acks: u64,
    /// TLS records sealed (application data).
    pub records: u64,
    /// Plaintext bytes sealed into those records.
    pub record_bytes: u64,
    /// TLS KeyUpdates sent: times our sending key was renewed.
    pub key_updates_sent: u64,
    /// TLS KeyUpdates received: times the peer renewed its key.
    pub key_updates_received: u64,
}

/// The TLS side of a connection: the session and the ciphertext buffers.
#[derive(Debug)]
struct TlsWire {
    session: Session,
    /// Sealed records not yet written: `out[out_sent..out_end]`. The Vec only grows (records are sealed
    /// straight into it, with no zero-fill per record).
    out: Vec<u8>,
    out_sent: usize,
    out_end: usize,
    /// Received ciphertext not yet opened: `inb[inb_start..inb_end]` (a partial record at most, after each
    /// fill). Fixed size: reads go into the free tail without zero-filling.
    inb: Vec<u8>,
    inb_start: usize,
    inb_end: usize,
    /// When our sending key was last renewed (or the session began), as [`Conn::renew_keys_if_due`] saw it.
    key_since: Instant,
    /// KeyUpdates sent when `key_since` was last set.
    updates_seen: u64,
}

/// The smallest incomplete PDU for which [`Conn::ack_partial`] asks for an immediate ACK: larger than one TLS
/// record's plaintext.
pub const QUICKACK_MIN_PDU: usize = 16 * 1024;

/// Ciphertext read per `read` call with TLS.
const TLS_READ: usize = 64 * 1024;

/// The smallest payload worth sending with [`Conn::send_parts`] instead of through the send buffer.
pub const DIRECT_SEND_MIN: usize = 16 * 1024;

/// The most slices one [`Conn::send_parts`] call writes (the queued bytes count as one): eight H2CData PDUs
/// with data digests, three slices each, and the queue.
const MAX_PARTS: usize = 32;

/// A connected, non-blocking TCP socket with its buffers.
#[derive(Debug)]
pub struct Conn {
    stream: TcpStream,
    tx: Vec<u8>,
    tx_sent: usize,
    rx: Vec<u8>,
    rx_start: usize,
    rx_end: usize,
    closed: bool,
    /// Bytes arrived since the last [`Conn::ack_partial`] asked for an immediate ACK.
    unacked_rx: bool,
    /// The last read found the socket empty.
    rx_dry: bool,
    tls: Option<Box<TlsWire>>,
    /// How TLS keys are renewed (applied when the session is installed, or at once if it is).
    renewal: crate::KeyRenewal,
    /// Counters.
    pub stats: ConnStats,
}

/// The congestion control a connection over loopback gets when none is configured, where the system's is
/// BBR (see [`loopback_congestion`]).
pub const LOOPBACK_CONGESTION: &str = "cubic";

/// The configured name that keeps the system's congestion control on every connection, loopback included.
pub const SYSTEM_CONGESTION: &str = "system";

/// Sets the TCP congestion control of a socket (`setsockopt(TCP_CONGESTION)`), e.g. `cubic`; a listening
/// socket hands it to the connections it accepts. [`SYSTEM_CONGESTION`] changes nothing. Fails with a message
/// naming the algorithm and where the system lists those it has.
pub fn set_congestion(sock: &impl std::os::fd::AsFd, name: &str) -> Result<(), Error> {
    if name == SYSTEM_CONGESTION {
        return Ok(());
    }
    socket2::SockRef::from(sock)
        .set_tcp_congestion(name.as_bytes())
        .map_err(|e| {
            Error::io(
                format!(
                    "TCP congestion control '{name}' (available: /proc/sys/net/ipv4/tcp_available_congestion_control; \
                     unprivileged processes may use tcp_allowed_congestion_control)"
                ),
                e,
            )
        })
}

/// What [`loopback_congestion`] did to a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoopbackCongestion {
    /// Nothing: the peer is another machine, or the connection is not under BBR.
    Kept,
    /// The connection moved from BBR to [`LOOPBACK_CONGESTION`].
    Switched,
    /// The system refused [`LOOPBACK_CONGESTION`] (an unprivileged process, and
    /// `net.ipv4.tcp_allowed_congestion_control` lacks it): the connection stays on BBR.
    Refused,
}

/// For a connection whose two ends are this machine (a loopback address, or the same address at both ends)
/// and which runs under BBR, chooses [`LOOPBACK_CONGESTION`] instead; the congestion control of every other
/// connection stays the system's. Call it where nothing is configured (an explicit choice, including
/// [`SYSTEM_CONGESTION`], goes through [`set_congestion`]).
///
/// Why: on loopback the round trip is about a microsecond, so BBR's window (twice its bandwidth estimate times
/// its minimum RTT, plus a few segments) holds 14-30 segments of 64 KiB, and whether a connection runs fast or
/// at half speed depends on the minimum RTT it measured at its start: the same pair gave 0.8M or 1.5M 4 KiB
/// reads a second at qd128 from one run to the next, and 128 KiB reads at half the speed cubic gives
/// (docs/performance.md, "Large I/O"). Best effort: a refusal is returned, not an error, and the connection
/// carries on under BBR.
pub fn loopback_congestion(stream: &TcpStream) -> LoopbackCongestion {
    let (Ok(peer), Ok(local)) = (stream.peer_addr(), stream.local_addr()) else {
        return LoopbackCongestion::Kept;
    };
    let peer = peer.ip().to_canonical();
    if !(peer.is_loopback() || peer == local.ip().to_canonical()) {
        return LoopbackCongestion::Kept;
    }
    let sock = socket2::SockRef::from(stream);
    let Ok(current) = sock.tcp_congestion() else {
        return LoopbackCongestion::Kept;
    };
    if current.split(|&b| b == 0).next() != Some(b"bbr".as_slice()) {
        return LoopbackCongestion::Kept;
    }
    match sock.set_tcp_congestion(LOOPBACK_CONGESTION.as_bytes()) {
        Ok(()) => LoopbackCongestion::Switched,
        Err(_) => LoopbackCongestion::Refused,
    }
}

/// Applies the congestion control policy to a connected socket: `configured` when given ([`set_congestion`]),
/// else [`apply_loopback_congestion`].
pub fn apply_congestion(stream: &TcpStream, configured: Option<&str>) -> Result<(), Error> {
    match configured {
        Some(name) => set_congestion(stream, name),
        None => {
            apply_loopback_congestion(stream);
            Ok(())
        }
    }
}

/// [`loopback_congestion`], with its outcome logged once per process: info when it switched a connection, a
/// warning when the system refused.
pub fn apply_loopback_congestion(stream: &TcpStream) -> LoopbackCongestion {
    use std::sync::atomic::{AtomicBool, Ordering};
    static SAID_SWITCHED: AtomicBool = AtomicBool::new(false);
    static SAID_REFUSED: AtomicBool = AtomicBool::new(false);
    let outcome = loopback_congestion(stream);
    match outcome {
        LoopbackCongestion::Kept => {}
        LoopbackCongestion::Switched => {
            if !SAID_SWITCHED.swap(true, Ordering::Relaxed) {
                log::info!(
                    "TCP congestion control: loopback connections use {LOOPBACK_CONGESTION} instead of the \
                     system's bbr (on loopback BBR's window holds a few segments, and its speed depends on the \
                     round trip it measured first); other paths keep the system's; configure \
                     '{SYSTEM_CONGESTION}' to keep bbr"
                );
            }
        }
        LoopbackCongestion::Refused => {
            if !SAID_REFUSED.swap(true, Ordering::Relaxed) {
                log::warn!(
                    "TCP congestion control: loopback connections stay on the system's bbr: the system refused \
                     {LOOPBACK_CONGESTION} (unprivileged processes may use only \
                     net.ipv4.tcp_allowed_congestion_control); their speed may vary from one connection to \
                     the next"
                );
            }
        }
    }
    outcome
}

/// Initial size of the send buffer.
const TX_INITIAL: usize = 256 * 1024;

impl Conn {
    /// Sets this connection's TCP congestion control (see [`set_congestion`]).
    pub fn set_congestion(&self, name: &str) -> Result<(), Error> {
        set_congestion(&self.stream, name)
    }

    /// Applies the congestion control policy to this connection (see [`apply_congestion`]): `configured`, or
    /// for a loopback connection under BBR, [`LOOPBACK_CONGESTION`].
    pub fn apply_congestion(&self, configured: Option<&str>) -> Result<(), Error> {
        apply_congestion(&self.stream, configured)
    }

    /// Moves the buffers into new allocations of the calling thread, for a connection that has moved to the
    /// reactor that will own it (so that its memory is that thread's, see `nvpoll::mem::rehome_vec`).
    pub fn rehome(&mut self) {
        nvpoll::mem::rehome_vec(&mut self.tx);
        nvpoll::mem::rehome_vec(&mut self.rx);
        if let Some(old) = self.tls.take() {
            let mut t = Box::new(*old);
            nvpoll::mem::rehome_vec(&mut t.out);
            nvpoll::mem::rehome_vec(&mut t.inb);
            self.tls = Some(t);
        }
    }

    /// Connects to `addr` without blocking the thread in `connect(2)`: the connect is started non-blocking and
    /// polled until it completes, fails, or `timeout` passes.
    pub fn connect(addr: SocketAddr, timeout: Duration, rx_capacity: usize) -> Result<Conn, Error> {
        let domain = if addr.is_ipv4() {
            Domain::IPV4
        } else {
            Domain::IPV6
        };
        let sock = Socket::new(domain, Type::STREAM, Some(Protocol::TCP))
            .map_err(|e| Error::io("socket", e))?;
        sock.set_nonblocking(true)
            .map_err(|e| Error::io("set O_NONBLOCK", e))?;
        sock.set_nodelay(true)
            .map_err(|e| Error::io("set TCP_NODELAY", e))?;
        match sock.connect(&SockAddr::from(addr)) {
            Ok(()) => {}
            Err(e)
                if e.raw_os_error() == Some(libc::EINPROGRESS)
                    || e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(Error::io(format!("connect to {addr}"), e)),
        }
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(e) = sock.take_error().map_err(|e| Error::io("SO_ERROR", e))? {
                return Err(Error::io(format!("connect to {addr}"), e));
            }
            match sock.peer_addr() {
                Ok(_) => break,
                Err(e) if e.kind() == io::ErrorKind::NotConnected => {}
                Err(e) => return Err(Error::io(format!("connect to {addr}"), e)),
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout("TCP connect"));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(Conn::new(sock.into(), rx_capacity))
    }

    /// Wraps an accepted stream (made non-blocking here).
    pub fn from_stream(stream: TcpStream, rx_capacity: usize) -> Result<Conn, Error> {
        stream
            .set_nonblocking(true)
            .map_err(|e| Error::io("set O_NONBLOCK", e))?;
        stream
            .set_nodelay(true)
            .map_err(|e| Error::io("set TCP_NODELAY", e))?;
        Ok(Conn::new(stream, rx_capacity))
    }

    fn new(stream: TcpStream, rx_capacity: usize) -> Conn {
        Conn {
            stream,
            tx: Vec::with_capacity(TX_INITIAL),
            tx_sent: 0,
            rx: vec![0; rx_capacity.max(4096)],
            rx_start: 0,
            rx_end: 0,
            closed: false,
            unacked_rx: false,
            rx_dry: false,
            tls: None,
            renewal: crate::KeyRenewal::default(),
            stats: ConnStats::default(),
        }
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.stream.peer_addr().ok()
    }

    /// The send buffer, to which encoders append whole PDUs. Call [`Conn::pdu_queued`] for each.
    pub fn tx_buf(&mut self) -> &mut Vec<u8> {
        &mut self.tx
    }

    /// Counts one PDU appended to the send buffer.
    pub fn pdu_queued(&mut self) {
        self.stats.pdus_tx += 1;
    }

    /// Bytes waiting to leave: plaintext not yet sent (or sealed) plus sealed records not yet written.
    pub fn tx_pending(&self) -> usize {
        self.tx.len() - self.tx_sent + self.tls.as_ref().map_or(0, |t| t.out_end - t.out_sent)
    }

    /// Whether [`Conn::flush`] has anything to do: bytes not yet sent, or TLS records or alerts not yet
    /// sealed.
    pub fn wants_flush(&self) -> bool {
        self.tx_pending() > 0 || self.tls.as_ref().is_some_and(|t| t.session.has_pending())
    }

    /// The socket, for a readiness set (epoll) that tells when it has something to read. Reading or writing
    /// through it directly would bypass the connection's buffers and TLS: don't.
    pub fn socket(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.stream.as_fd()
    }

    /// For a reactor that wants to sleep ([`nvpoll::reactor::Poller::wake_sources`]): wake when the socket
    /// has something to read, and, while bytes wait that the socket refused, when it takes more.
    pub fn wake_sources<'a>(&'a self, w: &mut nvpoll::reactor::WakeSources<'a>) {
        w.readable(&self.stream);
        if self.tx_pending() > 0 {
            w.writable(&self.stream);
        }
    }

    /// Whether the connection runs TLS.
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// TLS records received and opened so far (0 without TLS): with [`ConnStats::pdus_rx`], how the peer
    /// packs its PDUs into records.
    pub fn records_opened(&self) -> u64 {
        self.tls
            .as_ref()
            .map_or(0, |t| t.session.stats().records_opened)
    }

    /// The TLS session, once the handshake is done.
    pub fn tls_session(&self) -> Option<&Session> {
        self.tls.as_ref().map(|t| &t.session)
    }

    /// Writes as much of the send buffer as the socket takes (with TLS: seals it into records first). Returns
    /// `true` when nothing is left to send.
    pub fn flush(&mut self) -> Result<bool, Error> {
        if self.tx_pending() == 0 && !self.tls.as_ref().is_some_and(|t| t.session.has_pending()) {
            return Ok(true);
        }
        self.stats.flushes += 1;
        if self.tls.is_some() {
            let r = self.flush_tls();
            return r.map_err(|e| self.tls_failure(e));
        }
        while self.tx_sent < self.tx.len() {
            match write_some(&mut self.stream, &self.tx[self.tx_sent..], &mut self.stats)? {
                Some(n) => self.tx_sent += n,
                None => return Ok(false),
            }
        }
        self.tx.clear();
        self.tx_sent = 0;
        Ok(true)
    }

    /// Sends `parts` after whatever the send buffer holds, without copying them into it first: the large
    /// payload of a C2HData or H2CData PDU (its header already queued with [`Conn::tx_buf`]), straight from
    /// the namespace or the command's buffer. Returns `true` when everything went out.
    ///
    /// Plain, one `writev` carries the queued bytes and `parts`; only what the socket does not take is
    /// copied into the send buffer, to leave at the next flush. With TLS, `parts` are sealed straight into
    /// records (after the queued plaintext, in the same records) and written. While earlier records still
    /// wait for the wire, `parts` join the send buffer as [`Conn::tx_buf`] would take them, so that order
    /// and the sealing policy hold.
    ///
    /// Payloads of a few KiB gain nothing from this (a copy into the send buffer is cheaper than the
    /// early write it costs); callers use it from [`DIRECT_SEND_MIN`] bytes.
    pub fn send_parts(&mut self, parts: &[&[u8]]) -> Result<bool, Error> {
        if self.tls.is_some() {
            let r = self.send_parts_tls(parts);
            return r.map_err(|e| self.tls_failure(e));
        }
        assert!(
            parts.len() < MAX_PARTS,
            "send_parts takes at most {MAX_PARTS} - 1 parts"
        );
        self.stats.flushes += 1;
        let pending = self.tx.len() - self.tx_sent;
        let total = pending + parts.iter().map(|p| p.len()).sum::<usize>();
        let mut iov = [io::IoSlice::new(&[]); MAX_PARTS];
        iov[0] = io::IoSlice::new(&self.tx[self.tx_sent..]);
        for (slot, p) in iov[1..].iter_mut().zip(parts) {
            *slot = io::IoSlice::new(p);
        }
        let mut bufs = &mut iov[..=parts.len()];
        let mut written = 0;
        while written < total {
            self.stats.writes += 1;
            match self.stream.write_vectored(bufs) {
                Ok(0) => return Err(Error::Closed),
                Ok(n) => {
                    self.stats.bytes_tx += n as u64;
                    written += n;
                    io::IoSlice::advance_slices(&mut bufs, n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io("send", e)),
            }
        }
        // Keep what the socket did not take, in order.
        let mut skip = if written >= pending {
            self.tx.clear();
            self.tx_sent = 0;
            written - pending
        } else {
            self.tx_sent += written;
            0
        };
        for p in parts {
            if skip >= p.len() {
                skip -= p.len();
                continue;
            }
            self.tx.extend_from_slice(&p[skip..]);
            skip = 0;
        }
        Ok(written == total)
    }

    /// Sends the payload of a data PDU whose header is queued ([`Conn::send_parts`]), in up to
    /// `MAX_PARTS - 2` slices, and, with data digests, its CRC32C after it.
    pub fn send_payload(&mut self, data: &[&[u8]], digest: bool) -> Result<bool, Error> {
        assert!(
            data.len() + 2 <= MAX_PARTS,
            "too many slices for one payload"
        );
        let mut parts: [&[u8]; MAX_PARTS] = [&[]; MAX_PARTS];
        parts[..data.len()].copy_from_slice(data);
        let mut k = data.len();
        let ddgst;
        if digest {
            let mut crc = crate::pdu::DataDigest::new();
            for d in data {
                crc.update(d);
            }
            ddgst = crc.finish();
            parts[k] = &ddgst;
            k += 1;
        }
        self.send_parts(&parts[..k])
    }

    fn send_parts_tls(&mut self, parts: &[&[u8]]) -> Result<bool, Error> {
        let tls = self.tls.as_mut().expect("TLS connection");
        if tls.out_sent < tls.out_end || parts.len() >= MAX_PARTS {
            for p in parts {
                self.tx.extend_from_slice(p);
            }
            return self.flush();
        }
        tls.out_sent = 0;
        tls.out_end = 0;
        let mut plain: [&[u8]; MAX_PARTS] = [&[]; MAX_PARTS];
        plain[0] = &self.tx[self.tx_sent..];
        plain[1..=parts.len()].copy_from_slice(parts);
        let plain = &plain[..=parts.len()];
        let total: usize = plain.iter().map(|p| p.len()).sum();
        ensure_len(
            &mut tls.out,
            nvpoll_tls::KEY_UPDATE_LEN + Session::sealed_len(total),
        );
        let (records, written) = tls.session.seal_to_slice(plain, &mut tls.out)?;
        tls.out_end = written;
        self.stats.records += records as u64;
        self.stats.record_bytes += total as u64;
        self.tx.clear();
        self.tx_sent = 0;
        self.flush()
    }

    fn flush_tls(&mut self) -> Result<bool, Error> {
        let tls = self.tls.as_mut().expect("TLS connection");
        loop {
            // Drain sealed records first; seal more only once the wire is empty, so that plaintext queued
            // behind a slow peer leaves in full records.
            while tls.out_sent < tls.out_end {
                match write_some(
                    &mut self.stream,
                    &tls.out[tls.out_sent..tls.out_end],
                    &mut self.stats,
                )? {
                    Some(n) => tls.out_sent += n,
                    None => return Ok(false),
                }
            }
            tls.out_sent = 0;
            tls.out_end = 0;
            if tls.session.has_pending() {
                // A KeyUpdate reply (rare): through a small Vec.
                let mut owed = Vec::new();
                tls.session.write_pending(&mut owed)?;
                ensure_len(&mut tls.out, owed.len());
                tls.out[..owed.len()].copy_from_slice(&owed);
                tls.out_end = owed.len();
            }
            if self.tx_sent < self.tx.len() {
                let plain = &self.tx[self.tx_sent..];
                ensure_len(
                    &mut tls.out,
                    tls.out_end + nvpoll_tls::KEY_UPDATE_LEN + Session::sealed_len(plain.len()),
                );
                let (records, written) = tls
                    .session
                    .seal_to_slice(&[plain], &mut tls.out[tls.out_end..])?;
                tls.out_end += written;
                self.stats.records += records as u64;
                self.stats.record_bytes += plain.len() as u64;
                self.tx.clear();
                self.tx_sent = 0;
            }
            if tls.out_end == 0 {
                self.stats.key_updates_sent = tls.session.stats().key_updates_sent;
                return Ok(true);
            }
        }
    }

    /// Reads what the socket has into the receive buffer (one `read` call; with TLS, whole records are
    /// decrypted into it). Returns the number of bytes read from the socket; 0 means nothing was available.
    /// A peer that closed (or sent close_notify) gives [`Error::Closed`].
    pub fn fill(&mut self) -> Result<usize, Error> {
        if self.closed {
            return Err(Error::Closed);
        }
        if self.tls.is_some() {
            let r = self.fill_tls();
            return r.map_err(|e| self.tls_failure(e));
        }
        self.make_rx_room();
        let n = read_some(
            &mut self.stream,
            &mut self.rx[self.rx_end..],
            &mut self.stats,
            &mut self.closed,
        )?;
        self.rx_end += n;
        self.unacked_rx |= n > 0;
        self.rx_dry = n == 0;
        Ok(n)
    }

    /// Called by a decoder that found the PDU at the front of the receive buffer incomplete, `need` bytes long
    /// in all: if the last read found the socket empty, bytes arrived before it that were not acknowledged
    /// this way, and part of a large PDU is here (more than [`QUICKACK_MIN_PDU`]: one TLS record's worth), asks
    /// the kernel to acknowledge them now (`TCP_QUICKACK`) instead of after its delayed-ACK timer, up to 40 ms
    /// on Linux.
    ///
    /// Why: a peer that sends a PDU as many small segments can be held back until we acknowledge the previous
    /// ones: by Nagle's algorithm on a socket without TCP_NODELAY, or by its congestion window after an idle
    /// spell. SPDK's TLS socket writes every record in its own call (it does set TCP_NODELAY, and stalled all
    /// the same), so a 128 KiB C2HData or H2CData from it waited out our delayed-ACK timer, again and again,
    /// while we polled an empty socket: 17-26 IOPS, against about 4,200-5,400 with this. Small PDUs never ask
    /// (the rest of one that a read cut is already on its way), so 4 KiB I/O pays nothing. A large transfer
    /// asks only once the socket runs dry before the PDU is whole, the moment a held-back peer waits for us:
    /// while its data keeps coming, the kernel acknowledges as we read (a full segment's worth at a time), and
    /// a `setsockopt` per read bought nothing but extra ACK packets (spdk_nvme_perf's 1 MiB writes into our
    /// target: 10-14 a command).
    pub fn ack_partial(&mut self, need: usize) {
        if !self.unacked_rx || !self.rx_dry {
            return;
        }
        self.unacked_rx = false;
        if need <= QUICKACK_MIN_PDU || self.rx_end == self.rx_start {
            return;
        }
        self.quick_ack();
    }

    /// Tells the connection that its socket has nothing to read (a readiness set said so), as a read that
    /// found it empty would: [`Conn::ack_partial`] may then ask for the ACK a held-back peer waits for.
    pub fn note_empty(&mut self) {
        self.rx_dry = true;
    }

    /// Asks the kernel to acknowledge what arrived now instead of after its delayed-ACK timer.
    fn quick_ack(&mut self) {
        self.stats.quick_acks += 1;
        // Best effort: an error here only means the ACK keeps its usual timing.
        let _ = socket2::SockRef::from(&self.stream).set_quickack(true);
    }

    /// Reads what the socket has with one `readv`: first into `dest` (the rest of a large PDU's data, straight
    /// into the buffer where it belongs), then, past it, into the receive buffer (the PDUs that follow).
    /// Returns the bytes that went into `dest`. Plain connections only (with TLS, use [`Conn::fill`]).
    pub fn fill_into(&mut self, dest: &mut [u8]) -> Result<usize, Error> {
        assert!(
            self.tls.is_none(),
            "fill_into reads plaintext from the socket"
        );
        if self.closed {
            return Err(Error::Closed);
        }
        self.make_rx_room();
        self.stats.reads += 1;
        let want = dest.len();
        let n = loop {
            let mut iov = [
                io::IoSliceMut::new(dest),
                io::IoSliceMut::new(&mut self.rx[self.rx_end..]),
            ];
            match self.stream.read_vectored(&mut iov) {
                Ok(0) => {
                    self.closed = true;
                    return Err(Error::Closed);
                }
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.rx_dry = true;
                    return Ok(0);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io("recv", e)),
            }
        };
        self.stats.bytes_rx += n as u64;
        self.unacked_rx = true;
        self.rx_dry = false;
        let direct = n.min(want);
        self.stats.bytes_rx_direct += direct as u64;
        self.rx_end += n - direct;
        Ok(direct)
    }

    /// While a large PDU's data goes straight to its buffer ([`Conn::fill_into`]): once a read finds the socket
    /// empty, asks for an immediate ACK of what arrived before it, as [`Conn::ack_partial`] does for a PDU
    /// gathered in the receive buffer.
    pub fn ack_direct(&mut self) {
        if self.rx_dry && std::mem::take(&mut self.unacked_rx) {
            self.quick_ack();
        }
    }

    /// Drops `n` received bytes that are part of a PDU still being received (its header and the data moved
    /// out of the receive buffer); [`Conn::pdu_received`] counts the PDU once it is whole.
    pub fn skip(&mut self, n: usize) {
        debug_assert!(n <= self.rx_end - self.rx_start);
        self.rx_start += n;
        if self.rx_start == self.rx_end {
            self.rx_start = 0;
            self.rx_end = 0;
        }
    }

    /// Counts one PDU received in pieces (see [`Conn::skip`]).
    pub fn pdu_received(&mut self) {
        self.stats.pdus_rx += 1;
    }

    /// Makes room at the end of the plaintext receive buffer: compacts, or grows when a PDU larger than the
    /// buffer is being received (only when the caller allowed such PDUs).
    fn make_rx_room(&mut self) {
        if self.rx_end == self.rx.len() {
            if self.rx_start > 0 {
                self.rx.copy_within(self.rx_start..self.rx_end, 0);
                self.rx_end -= self.rx_start;
                self.rx_start = 0;
            } else {
                let n = self.rx.len() * 2;
                self.rx.resize(n, 0);
            }
        }
    }

    fn fill_tls(&mut self) -> Result<usize, Error> {
        let tls = self.tls.as_mut().expect("TLS connection");
        if tls.inb_end == tls.inb.len() {
            // Make room: move the partial record to the front (or grow for an oversized one, which the
            // record layer rejects as soon as its header is there).
            tls.inb.copy_within(tls.inb_start..tls.inb_end, 0);
            tls.inb_end -= tls.inb_start;
            tls.inb_start = 0;
            if tls.inb_end == tls.inb.len() {
                let n = tls.inb.len() * 2;
                tls.inb.resize(n, 0);
            }
        }
        let r = read_some(
            &mut self.stream,
            &mut tls.inb[tls.inb_end..],
            &mut self.stats,
            &mut self.closed,
        );
        let n = *r.as_ref().unwrap_or(&0);
        tls.inb_end += n;
        self.unacked_rx |= n > 0;
        self.rx_dry = n == 0;
        // Records received before a close are still opened; the close is reported after them.
        let read_error = r.err();
        let mut used = tls.inb_start;
        while used < tls.inb_end {
            // Decrypt straight into the receive buffer, after the data not yet consumed.
            let room = (tls.inb_end - used).min(nvpoll_tls::MAX_CIPHERTEXT + 512);
            if self.rx.len() - self.rx_end < room {
                if self.rx_start > 0 {
                    self.rx.copy_within(self.rx_start..self.rx_end, 0);
                    self.rx_end -= self.rx_start;
                    self.rx_start = 0;
                }
                if self.rx.len() - self.rx_end < room {
                    let want = self.rx_end + room;
                    self.rx.resize(want, 0);
                }
            }
            match tls
                .session
                .open_to_slice(&tls.inb[used..tls.inb_end], &mut self.rx[self.rx_end..])
            {
                Ok((0, _)) => break, // a partial record: wait for the rest
                Ok((consumed, written)) => {
                    used += consumed;
                    self.rx_end += written;
                }
                Err(nvpoll_tls::TlsError::Closed) => {
                    self.closed = true;
                    tls.inb_start = used;
                    if self.rx_end > self.rx_start {
                        return Ok(n);
                    }
                    return Err(Error::Closed);
                }
                Err(e) => {
                    // The fatal alert is owed to the peer: best effort, the connection is over anyway.
                    let mut alert = Vec::new();
                    let _ = tls.session.write_pending(&mut alert);
                    let _ = write_some(&mut self.stream, &alert, &mut self.stats);
                    self.closed = true;
                    return Err(e.into());
                }
            }
        }
        if used == tls.inb_end {
            tls.inb_start = 0;
            tls.inb_end = 0;
        } else {
            tls.inb_start = used;
        }
        self.stats.key_updates_received = tls.session.stats().key_updates_received;
        if tls.session.peer_key_overdue() {
            self.closed = true;
            return Err(self.key_limit(crate::RekeyCause::PeerDidNotRenew));
        }
        if tls.session.has_pending() && read_error.is_none() {
            // A KeyUpdate reply is owed.
            self.flush()?;
        }
        match read_error {
            // Hand out what arrived first; the next fill reports the close.
            Some(_) if self.rx_end > self.rx_start => Ok(n),
            Some(e) => Err(e),
            None => Ok(n),
        }
    }

    /// The received bytes not yet consumed.
    pub fn rx_data(&self) -> &[u8] {
        &self.rx[self.rx_start..self.rx_end]
    }

    /// Marks `n` received bytes as consumed (one decoded PDU).
    pub fn consume(&mut self, n: usize) {
        self.skip(n);
        self.stats.pdus_rx += 1;
    }

    /// Makes sure the receive buffer can hold a PDU of `len` bytes.
    pub fn reserve_rx(&mut self, len: usize) {
        if self.rx.len() < len {
            self.rx.resize(len, 0);
        }
    }

    /// Runs the client side of a TLS handshake to completion (before ICReq), polling the socket until
    /// `timeout`. Afterwards every PDU travels in records.
    pub fn tls_client_handshake(
        &mut self,
        cfg: nvpoll_tls::ClientConfig,
        timeout: Duration,
    ) -> Result<(), Error> {
        let (hs, first) = Handshake::client(cfg)?;
        // The ClientHello goes out with the first step's flush, in the clear (no TLS state exists yet).
        self.tx.extend_from_slice(&first);
        let mut hs = Some(hs);
        let mut inb = Vec::with_capacity(TLS_READ);
        let deadline = Instant::now() + timeout;
        while !self.tls_step(&mut hs, &mut inb)? {
            if Instant::now() >= deadline {
                return Err(Error::Timeout("TLS handshake"));
            }
            std::thread::yield_now();
        }
        Ok(())
    }

    /// One non-blocking step of a handshake on this connection (the server side on a reactor): reads what the
    /// socket has, feeds it to `hs`, writes what it answers. Returns `true` once the handshake is done and the
    /// session is installed (then drop `hs`). `inb` carries received bytes between steps.
    pub fn tls_step(
        &mut self,
        hs: &mut Option<Handshake>,
        inb: &mut Vec<u8>,
    ) -> Result<bool, Error> {
        let h = hs.as_mut().expect("a handshake in progress");
        if h.is_done() {
            // Only the last of our flight is left to write.
            if !self.flush()? {
                return Ok(false);
            }
            let session = hs.take().expect("checked above").into_session()?;
            self.install_tls(session, std::mem::take(inb));
            return Ok(true);
        }
        let have = inb.len();
        inb.resize(have + TLS_READ, 0);
        let r = read_some(
            &mut self.stream,
            &mut inb[have..],
            &mut self.stats,
            &mut self.closed,
        );
        inb.truncate(have + *r.as_ref().unwrap_or(&0));
        r?;
        let result = h.read(inb, &mut self.tx);
        // Handshake messages and alerts go out in the clear buffer's place, before any TLS state exists.
        let flushed = self.flush();
        match result {
            Ok(p) => {
                inb.drain(..p.consumed);
            }
            Err(e) => return Err(e.into()),
        }
        if !flushed? {
            return Ok(false);
        }
        if h.is_done() {
            let session = hs.take().expect("checked above").into_session()?;
            let rest = std::mem::take(inb);
            self.install_tls(session, rest);
            return Ok(true);
        }
        Ok(false)
    }

    fn install_tls(&mut self, mut session: Session, leftover: Vec<u8>) {
        session
            .set_key_limits(self.renewal.limits())
            .expect("KeyRenewal::limits are valid");
        let inb_end = leftover.len();
        let mut inb = leftover;
        inb.resize(inb_end.max(TLS_READ) * 2, 0);
        self.tls = Some(Box::new(TlsWire {
            session,
            out: vec![0; TX_INITIAL + 4096],
            out_sent: 0,
            out_end: 0,
            inb,
            inb_start: 0,
            inb_end,
            key_since: Instant::now(),
            updates_seen: 0,
        }));
        // Records that arrived with the handshake's last flight stay in `inb` and are opened at the next fill.
    }

    /// Sets how this connection's TLS keys are renewed (before the handshake, or at once after it; nothing
    /// without TLS). Counts already run under the current keys carry on.
    pub fn set_key_renewal(&mut self, renewal: crate::KeyRenewal) {
        self.renewal = renewal;
        if let Some(tls) = self.tls.as_mut() {
            tls.session
                .set_key_limits(renewal.limits())
                .expect("KeyRenewal::limits are valid");
        }
    }

    /// How this connection's TLS keys are renewed.
    pub fn key_renewal(&self) -> crate::KeyRenewal {
        self.renewal
    }

    /// Renews the keys when our sending key has been in use for [`KeyRenewal::interval`](crate::KeyRenewal)
    /// (a KeyUpdate asking the peer too, written now), or, renewing by reconnecting, ends the connection with
    /// [`Error::Rekey`]. The connection's owner calls it now and then (its timer check); cheap otherwise.
    pub fn renew_keys_if_due(&mut self, now: Instant) -> Result<(), Error> {
        let Some(interval) = self.renewal.interval else {
            return Ok(());
        };
        let Some(tls) = self.tls.as_mut() else {
            return Ok(());
        };
        let sent = tls.session.stats().key_updates_sent;
        if sent != tls.updates_seen {
            tls.updates_seen = sent;
            tls.key_since = now;
            return Ok(());
        }
        if now.saturating_duration_since(tls.key_since) < interval {
            return Ok(());
        }
        tls.key_since = now;
        match self.renewal.method {
            crate::RenewBy::KeyUpdate => {
                tls.session.schedule_key_update();
                self.flush().map(|_| ())
            }
            crate::RenewBy::Reconnect => {
                self.closed = true;
                Err(Error::Rekey(crate::RekeyCause::Planned))
            }
        }
    }

    /// A key reached its limit: the planned end of a connection that renews by reconnecting, or else
    /// `unrenewed` (a KeyUpdate that should have come did not).
    fn key_limit(&self, unrenewed: crate::RekeyCause) -> Error {
        Error::Rekey(match self.renewal.method {
            crate::RenewBy::Reconnect => crate::RekeyCause::Planned,
            crate::RenewBy::KeyUpdate => unrenewed,
        })
    }

    /// A TLS connection's failure, said for what it is: a key limit becomes [`Error::Rekey`], and a
    /// connection the peer ended right after our KeyUpdate (never having sent one) [`Error::KeyUpdateRefused`].
    #[cold]
    fn tls_failure(&self, e: Error) -> Error {
        let Some(tls) = self.tls.as_ref() else {
            return e;
        };
        match e {
            Error::Tls(nvpoll_tls::TlsError::KeyLimitReached) => {
                self.key_limit(crate::RekeyCause::HardLimit)
            }
            Error::Closed | Error::Io { .. } | Error::Tls(nvpoll_tls::TlsError::PeerAlert(_))
                if tls.session.peer_update_awaited()
                    && !tls.session.is_peer_closed()
                    && tls.session.stats().key_updates_sent > 0
                    && tls.session.stats().key_updates_received == 0 =>
            {
                Error::KeyUpdateRefused { cause: Box::new(e) }
            }
            e => e,
        }
    }

    /// Peeks at the first byte the peer sent, without consuming it (to tell a TLS ClientHello, 0x16, from a
    /// plain ICReq, 0x00). `None` while nothing has arrived.
    pub fn peek_first_byte(&mut self) -> Result<Option<u8>, Error> {
        let mut b = [0u8; 1];
        match self.stream.peek(&mut b) {
            Ok(0) => Err(Error::Closed),
            Ok(_) => Ok(Some(b[0])),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(Error::io("peek", e)),
        }
    }

    /// Ends the connection for good: with a zero linger time, so that closing the socket (on drop) resets
    /// it and drops whatever the kernel still holds unsent, then shuts both directions (best effort). A
    /// failed queue must not have old commands delivered later: after a blackhole lifts, a graceful close
    /// would still retransmit them, possibly after the host sent them again on another path.
    pub fn shutdown(&mut self) {
        let _ = socket2::SockRef::from(&self.stream).set_linger(Some(Duration::ZERO));
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        self.closed = true;
    }
}

/// One `write` of `buf`. `Ok(Some(n))` for bytes written, `Ok(None)` when the socket would block.
fn write_some(
    stream: &mut TcpStream,
    buf: &[u8],
    stats: &mut ConnStats,
) -> Result<Option<usize>, Error> {
    loop {
        stats.writes += 1;
        match stream.write(buf) {
            Ok(0) => return Err(Error::Closed),
            Ok(n) => {
                stats.bytes_tx += n as u64;
                return Ok(Some(n));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io("send", e)),
        }
    }
}

/// One `read` into `buf`: the bytes read (0 when nothing was available); a closed peer sets `closed`.
fn read_some(
    stream: &mut TcpStream,
    buf: &mut [u8],
    stats: &mut ConnStats,
    closed: &mut bool,
) -> Result<usize, Error> {
    stats.reads += 1;
    loop {
        match stream.read(buf) {
            Ok(0) => {
                *closed = true;
                return Err(Error::Closed);
            }
            Ok(n) => {
                stats.bytes_rx += n as u64;
                return Ok(n);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(0),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io("recv", e)),
        }
    }
}

/// Makes `v` at least `len` long (zero-filling only what it grows by).
fn ensure_len(v: &mut Vec<u8>, len: usize) {
    if v.len() < len {
        v.resize(len, 0);
    }
}

#[cfg(test)]
// Test data is made by wrapping counters into bytes on purpose.
#[allow(clippy::cast_possible_truncation)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A listener's congestion control is what was set (reno: every Linux has it, and anyone may set it), and
    /// an algorithm the system lacks is refused with its name.
    #[test]
    fn congestion_control_is_set_or_refused_by_name() {
        // The kernel answers with the name NUL-padded to 16 bytes.
        let cc = |s: socket2::SockRef<'_>| {
            let v = s.tcp_congestion().unwrap();
            v.split(|&b| b == 0).next().unwrap_or_default().to_vec()
        };
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        set_congestion(&l, "reno").expect("reno");
        assert_eq!(cc(socket2::SockRef::from(&l)), b"reno");
        // Accepted connections inherit it.
        let c = Conn::connect(l.local_addr().unwrap(), Duration::from_secs(5), 4096).unwrap();
        let (accepted, _) = l.accept().unwrap();
        assert_eq!(cc(socket2::SockRef::from(&accepted)), b"reno");
        c.set_congestion("reno").expect("on a connection");
        assert_eq!(cc(socket2::SockRef::from(&c.stream)), b"reno");
        let e = set_congestion(&l, "no-such-cc").expect_err("an unknown algorithm");
        assert!(e.to_string().contains("'no-such-cc'"), "{e}");
    }

    fn pair() -> (Conn, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = Conn::connect(l.local_addr().unwrap(), Duration::from_secs(5), 4096).unwrap();
        let (peer, _) = l.accept().unwrap();
        (c, peer)
    }

    fn congestion_of(s: &TcpStream) -> Vec<u8> {
        let mut cc = socket2::SockRef::from(s).tcp_congestion().unwrap();
        cc.retain(|&b| b != 0);
        cc
    }

    #[test]
    fn loopback_connections_under_bbr_move_to_cubic_and_others_keep_theirs() {
        let (_c, peer) = pair();
        // The accepted end, from 127.0.0.1: under BBR it moves, under anything else it stays.
        if let Err(e) = set_congestion(&peer, "bbr") {
            // BBR is a module; a kernel without it has nothing for this rule to do.
            eprintln!("SKIPPED: this kernel does not offer bbr: {e}");
            return;
        }
        assert_eq!(loopback_congestion(&peer), LoopbackCongestion::Switched);
        assert_eq!(congestion_of(&peer), LOOPBACK_CONGESTION.as_bytes());
        set_congestion(&peer, "reno").unwrap();
        assert_eq!(loopback_congestion(&peer), LoopbackCongestion::Kept);
        assert_eq!(congestion_of(&peer), b"reno");
        // An explicit choice wins, and "system" changes nothing.
        set_congestion(&peer, "bbr").unwrap();
        apply_congestion(&peer, Some(SYSTEM_CONGESTION)).unwrap();
        assert_eq!(congestion_of(&peer), b"bbr");
        apply_congestion(&peer, Some("reno")).unwrap();
        assert_eq!(congestion_of(&peer), b"reno");
        assert!(apply_congestion(&peer, Some("no-such-algorithm")).is_err());
        set_congestion(&peer, "bbr").unwrap();
        apply_congestion(&peer, None).unwrap();
        assert_eq!(congestion_of(&peer), LOOPBACK_CONGESTION.as_bytes());
    }

    /// Reads from `peer` until `want` bytes arrived, flushing `c` meanwhile (both non-blocking; bounded).
    fn drain(c: &mut Conn, peer: &mut TcpStream, want: usize) -> Vec<u8> {
        peer.set_nonblocking(true).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut got = Vec::new();
        let mut buf = vec![0u8; 1 << 16];
        while got.len() < want {
            assert!(
                Instant::now() < deadline,
                "only {} of {want} bytes arrived; {} pending",
                got.len(),
                c.tx_pending()
            );
            c.flush().unwrap();
            match peer.read(&mut buf) {
                Ok(0) => panic!("peer closed early"),
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::yield_now(),
                Err(e) => panic!("read: {e}"),
            }
        }
        got
    }

    #[test]
    fn send_parts_keeps_order_and_keeps_what_the_socket_refused() {
        let (mut c, mut peer) = pair();
        // A small send buffer and a peer that reads nothing yet: most of 4 MiB cannot leave at once.
        socket2::SockRef::from(&c.stream)
            .set_send_buffer_size(16 * 1024)
            .unwrap();
        let a: Vec<u8> = (0..3000u32).map(|i| i as u8).collect();
        let b: Vec<u8> = (0..(2 << 20) as u32).map(|i| (i * 7 + 1) as u8).collect();
        let d: Vec<u8> = (0..(2 << 20) as u32).map(|i| (i * 3 + 5) as u8).collect();
        c.tx_buf().extend_from_slice(&a);
        let all_sent = c.send_parts(&[&b, &d]).unwrap();
        assert!(
            !all_sent,
            "4 MiB went out at once into a 16 KiB send buffer"
        );
        assert!(c.tx_pending() > 0);
        // Queued after the refused remainder, so it must arrive after it.
        c.tx_buf().extend_from_slice(b"tail");
        let want = [&a[..], &b, &d, b"tail"].concat();
        assert_eq!(drain(&mut c, &mut peer, want.len()), want);
        assert_eq!(c.tx_pending(), 0);
        assert_eq!(c.stats.bytes_tx, want.len() as u64);
    }

    #[test]
    fn a_large_pdu_asks_for_an_immediate_ack_once_the_socket_runs_dry() {
        let (mut c, mut peer) = pair();
        // 20,000 bytes of a 64 KiB PDU, read in pieces (the 4 KiB buffer doubles as it fills).
        for _ in 0..5 {
            peer.write_all(&[7u8; 4000]).unwrap();
        }
        let mut reads = 0;
        let mut got = 0;
        let deadline = Instant::now() + Duration::from_secs(5);
        while got < 20_000 {
            assert!(Instant::now() < deadline, "the peer's bytes never came");
            let n = c.fill().unwrap();
            got += n;
            reads += usize::from(n > 0);
            if n > 0 {
                c.ack_partial(64 << 10);
                assert_eq!(
                    c.stats.quick_acks, 0,
                    "data still coming: the kernel acknowledges as we read"
                );
            }
        }
        assert!(reads >= 2, "the test needs more than one read, got {reads}");
        // The socket runs dry with the PDU incomplete: now, once.
        assert_eq!(c.fill().unwrap(), 0);
        c.ack_partial(64 << 10);
        assert_eq!(c.stats.quick_acks, 1);
        assert_eq!(c.fill().unwrap(), 0);
        c.ack_partial(64 << 10);
        assert_eq!(c.stats.quick_acks, 1, "nothing arrived since the last one");
        // A readiness set that says "not readable" counts as a read that found nothing.
        peer.write_all(&[7u8; 1000]).unwrap();
        while c.fill().unwrap() == 0 {
            assert!(Instant::now() < deadline, "the peer's bytes never came");
        }
        c.ack_partial(64 << 10);
        assert_eq!(c.stats.quick_acks, 1);
        c.note_empty();
        c.ack_partial(64 << 10);
        assert_eq!(c.stats.quick_acks, 2);
        // A small PDU never asks: the rest of it is on its way.
        c.consume(21_000);
        peer.write_all(&[7u8; 10]).unwrap();
        while c.fill().unwrap() == 0 {
            assert!(Instant::now() < deadline, "the peer's bytes never came");
        }
        assert_eq!(c.fill().unwrap(), 0);
        c.ack_partial(100);
        assert_eq!(c.stats.quick_acks, 2);
    }

    #[test]
    fn send_payload_appends_the_data_digest() {
        let (mut c, mut peer) = pair();
        let x = vec![0x5au8; 40_000];
        let y = vec![0xa5u8; 30_000];
        c.tx_buf().extend_from_slice(b"hdr");
        assert!(c.send_payload(&[&x, &y], true).unwrap());
        let got = drain(&mut c, &mut peer, 3 + x.len() + y.len() + 4);
        let mut want = [&b"hdr"[..], &x, &y].concat();
        want.extend_from_slice(&crate::pdu::data_digest(&[&x[..], &y].concat()));
        assert_eq!(got, want);
    }
}

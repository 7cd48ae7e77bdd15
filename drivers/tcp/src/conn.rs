//! One non-blocking TCP connection with its send and receive buffers.
//!
//! Both the initiator and the target move PDUs through a [`Conn`]: encoders append whole PDUs to the send
//! buffer, [`Conn::flush`] writes as much of it as the socket takes (keeping the rest for the next flush, so a
//! partial write or `EAGAIN` never copies twice), and [`Conn::fill`] reads whatever the socket has into the
//! receive buffer, where the PDU decoder looks at it in place.
//!
//! The buffers are sized once at connect time; nothing on the I/O path allocates unless a peer sends a PDU
//! larger than the receive buffer, which only happens when the caller raised the limit.
#![forbid(unsafe_code)]

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use crate::Error;

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
    /// Flushes that found something to send.
    pub flushes: u64,
}

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
    /// Counters.
    pub stats: ConnStats,
}

/// Initial size of the send buffer.
const TX_INITIAL: usize = 256 * 1024;

impl Conn {
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

    /// Bytes waiting in the send buffer.
    pub fn tx_pending(&self) -> usize {
        self.tx.len() - self.tx_sent
    }

    /// Writes as much of the send buffer as the socket takes. Returns `true` when the buffer is empty.
    pub fn flush(&mut self) -> Result<bool, Error> {
        if self.tx_pending() == 0 {
            return Ok(true);
        }
        self.stats.flushes += 1;
        while self.tx_sent < self.tx.len() {
            self.stats.writes += 1;
            match self.stream.write(&self.tx[self.tx_sent..]) {
                Ok(0) => return Err(Error::Closed),
                Ok(n) => {
                    self.tx_sent += n;
                    self.stats.bytes_tx += n as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io("send", e)),
            }
        }
        self.tx.clear();
        self.tx_sent = 0;
        Ok(true)
    }

    /// Reads what the socket has into the receive buffer (one `read` call). Returns the number of bytes read;
    /// 0 means nothing was available. A peer that closed gives [`Error::Closed`].
    pub fn fill(&mut self) -> Result<usize, Error> {
        if self.closed {
            return Err(Error::Closed);
        }
        if self.rx_end == self.rx.len() {
            if self.rx_start > 0 {
                self.rx.copy_within(self.rx_start..self.rx_end, 0);
                self.rx_end -= self.rx_start;
                self.rx_start = 0;
            } else {
                // A PDU larger than the buffer: grow (only when the caller allowed such PDUs).
                let n = self.rx.len() * 2;
                self.rx.resize(n, 0);
            }
        }
        self.stats.reads += 1;
        loop {
            match self.stream.read(&mut self.rx[self.rx_end..]) {
                Ok(0) => {
                    self.closed = true;
                    return Err(Error::Closed);
                }
                Ok(n) => {
                    self.rx_end += n;
                    self.stats.bytes_rx += n as u64;
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(0),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io("recv", e)),
            }
        }
    }

    /// The received bytes not yet consumed.
    pub fn rx_data(&self) -> &[u8] {
        &self.rx[self.rx_start..self.rx_end]
    }

    /// Marks `n` received bytes as consumed (one decoded PDU).
    pub fn consume(&mut self, n: usize) {
        debug_assert!(n <= self.rx_end - self.rx_start);
        self.rx_start += n;
        self.stats.pdus_rx += 1;
        if self.rx_start == self.rx_end {
            self.rx_start = 0;
            self.rx_end = 0;
        }
    }

    /// Makes sure the receive buffer can hold a PDU of `len` bytes.
    pub fn reserve_rx(&mut self, len: usize) {
        if self.rx.len() < len {
            self.rx.resize(len, 0);
        }
    }

    /// Closes both directions (best effort; the socket is closed on drop anyway).
    pub fn shutdown(&mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        self.closed = true;
    }
}

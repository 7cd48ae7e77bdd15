//! Helpers for the TLS tests: peers as child processes (ended by PID on drop), ports polled with a
//! deadline, and blocking drivers for our sans-IO handshake and session over a TcpStream.

use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use nvpoll_tls::{ClientConfig, Handshake, ServerConfig, Session, TlsError};

/// Bound for any one step of a test (spawn to listen, handshake, a reply).
pub const STEP: Duration = Duration::from_secs(15);

/// The GnuTLS priority string tlshd uses for NVMe/TCP (TLS 1.3, PSK, AES-GCM).
pub const TLSHD_PRIORITY: &str = "NORMAL:-VERS-ALL:+VERS-TLS1.3:%NO_TICKETS:-CIPHER-ALL:+AES-128-GCM:+AES-256-GCM:+DHE-PSK:+ECDHE-PSK";
/// The priority string for gnutls-serv as an NVMe/TCP-style PSK server.
pub const GNUTLS_SERV_PRIORITY: &str = "NORMAL:-VERS-ALL:+VERS-TLS1.3:%NO_TICKETS:-CIPHER-ALL:+AES-128-GCM:+AES-256-GCM:+PSK:+DHE-PSK:+ECDHE-PSK";

/// Whether `bin` is on PATH; if not, prints why the test is skipped. Under CI (`CI` set, as `.ci/run`
/// runs) a missing peer fails the test instead: CI installs it, and must never be a machine where it skips.
pub fn have(bin: &str, package: &str) -> bool {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(bin).is_file()))
        .unwrap_or(false);
    if !found {
        if std::env::var_os("CI").is_some_and(|v| !v.is_empty() && v != "false") {
            panic!("`{bin}` not found under CI, where .ci/run installs it (apt-get install -y {package})");
        }
        eprintln!("SKIPPED: `{bin}` not found (apt-get install -y {package})");
    }
    found
}

/// Spawns a server that listens on the port it is given, on a free port: `make` builds its command for a
/// port. If the server exits before it listens (the port was taken meanwhile by another test's peer or
/// socket), it is tried again on another port, up to five times.
pub fn spawn_listening(mut make: impl FnMut(u16) -> Command) -> (Peer, u16) {
    let mut last = String::new();
    for _ in 0..5 {
        let port = free_port();
        let mut peer = Peer::spawn(&mut make(port), false);
        if peer.listening(port) {
            return (peer, port);
        }
        last = peer.output();
    }
    panic!("the peer never listened (five ports tried); its last output:\n{last}");
}

/// A TCP port on 127.0.0.1 that nothing listens on now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `b` in lowercase hex.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

static SEQ: AtomicUsize = AtomicUsize::new(0);

/// A path for a scratch file of this test process.
pub fn scratch(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "nvpoll-tls-{}-{}-{name}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ))
}

/// A peer process; its stdout and stderr go to a file. Killed (by its PID) and reaped on drop.
pub struct Peer {
    /// The process.
    pub child: Child,
    log: PathBuf,
}

impl Peer {
    /// Starts `cmd` with its output captured (and a stdin pipe if asked).
    pub fn spawn(cmd: &mut Command, stdin: bool) -> Peer {
        let log = scratch("peer.log");
        let f = File::create(&log).unwrap();
        let child = cmd
            .stdin(if stdin { Stdio::piped() } else { Stdio::null() })
            .stdout(f.try_clone().unwrap())
            .stderr(f)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
        Peer { child, log }
    }

    /// What the peer printed so far (stdout and stderr).
    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Writes to the peer's stdin.
    pub fn send_stdin(&mut self, data: &[u8]) {
        let stdin = self.child.stdin.as_mut().expect("stdin piped");
        stdin.write_all(data).unwrap();
        stdin.flush().unwrap();
    }

    /// Waits (polling, bounded) for the peer to exit.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let end = Instant::now() + limit;
        while Instant::now() < end {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    /// Waits until the output contains `needle`, bounded; returns whether it did.
    pub fn wait_output(&mut self, needle: &str, limit: Duration) -> bool {
        let end = Instant::now() + limit;
        while Instant::now() < end {
            if self.output().contains(needle) {
                return true;
            }
            if self.child.try_wait().unwrap().is_some() {
                return self.output().contains(needle);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    /// Polls /proc/net/tcp until the peer itself listens on 127.0.0.1:`port` (without connecting, which would
    /// use up a `-naccept 1` server): a listening socket on that port that is one of the peer's own
    /// descriptors. Returns `false` if the peer exited first or said its bind failed (another process took
    /// the port `free_port` handed out, so the caller tries another); panics once time runs out.
    pub fn listening(&mut self, port: u16) -> bool {
        let end = Instant::now() + STEP;
        // IPv4 only: the tests connect to 127.0.0.1 (gnutls-serv also listens on ::, possibly first).
        let want = [
            format!("0100007F:{port:04X}"),
            format!("00000000:{port:04X}"),
        ];
        loop {
            let t = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
            for line in t.lines().skip(1) {
                let f: Vec<&str> = line.split_whitespace().collect();
                if f.len() > 9
                    && f[3] == "0A"
                    && want.iter().any(|w| w == f[1])
                    && self.owns_socket(f[9])
                {
                    return true;
                }
            }
            if self.child.try_wait().unwrap().is_some() {
                return false;
            }
            // gnutls-serv does not exit when its bind fails (it says so and serves nothing): the port was
            // taken, so the caller tries another.
            if self.output().contains("Address already in use") {
                return false;
            }
            if Instant::now() > end {
                panic!("peer not listening on {port} in time:\n{}", self.output());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Whether socket inode `inode` is one of the peer's open descriptors.
    fn owns_socket(&self, inode: &str) -> bool {
        let want = format!("socket:[{inode}]");
        let Ok(fds) = std::fs::read_dir(format!("/proc/{}/fd", self.child.id())) else {
            return false;
        };
        fds.flatten()
            .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|l| l.as_os_str() == want.as_str()))
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// Why a blocking handshake or read ended.
#[derive(Debug)]
pub enum Failure {
    /// Our TLS refused or failed.
    Tls(TlsError),
    /// The peer closed the connection.
    Eof,
    /// A socket call failed.
    Io(std::io::Error),
}

impl Failure {
    /// The TLS error, if that is what it was.
    pub fn tls(&self) -> Option<&TlsError> {
        match self {
            Failure::Tls(e) => Some(e),
            _ => None,
        }
    }
}

fn fill(stream: &mut TcpStream, buf: &mut Vec<u8>, end: Instant) -> Result<(), Failure> {
    let mut chunk = [0u8; 65536];
    loop {
        if Instant::now() > end {
            return Err(Failure::Io(std::io::Error::new(
                ErrorKind::TimedOut,
                "deadline",
            )));
        }
        match stream.read(&mut chunk) {
            Ok(0) => return Err(Failure::Eof),
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                return Ok(());
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(Failure::Io(e)),
        }
    }
}

/// Runs a handshake to completion over a blocking stream. Returns the session and the bytes received
/// after the handshake's last record.
pub fn drive(
    stream: &mut TcpStream,
    mut hs: Handshake,
    first: Vec<u8>,
) -> Result<(Session, Vec<u8>), Failure> {
    stream
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let end = Instant::now() + STEP;
    stream.write_all(&first).map_err(Failure::Io)?;
    let mut buf = Vec::new();
    loop {
        let mut out = Vec::new();
        let r = hs.read(&buf, &mut out);
        if !out.is_empty() {
            // A failed write after a fatal alert does not hide the TLS error.
            let _ = stream.write_all(&out);
        }
        let p = r.map_err(Failure::Tls)?;
        buf.drain(..p.consumed);
        if p.done {
            let s = hs.into_session().map_err(Failure::Tls)?;
            return Ok((s, buf));
        }
        fill(stream, &mut buf, end)?;
    }
}

/// Runs our client handshake over `stream` to the end: the session and the bytes received after it.
pub fn client_handshake(
    stream: &mut TcpStream,
    cfg: ClientConfig,
) -> Result<(Session, Vec<u8>), Failure> {
    let (hs, first) = Handshake::client(cfg).map_err(Failure::Tls)?;
    drive(stream, hs, first)
}

/// Runs our server handshake over `stream` to the end: the session and the bytes received after it.
pub fn server_handshake(
    stream: &mut TcpStream,
    cfg: ServerConfig,
) -> Result<(Session, Vec<u8>), Failure> {
    drive(stream, Handshake::server(cfg), Vec::new())
}

/// Connects to 127.0.0.1:`port` with TCP_NODELAY.
pub fn connect(port: u16) -> TcpStream {
    let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_nodelay(true).unwrap();
    s
}

/// Seals `data` into records and writes them.
pub fn send(stream: &mut TcpStream, s: &mut Session, data: &[&[u8]]) {
    let mut out = Vec::new();
    s.seal(data, &mut out).unwrap();
    stream.write_all(&out).unwrap();
}

/// Reads and opens records until `plain` holds at least `want` bytes or the peer closes.
pub fn recv(
    stream: &mut TcpStream,
    s: &mut Session,
    pending: &mut Vec<u8>,
    plain: &mut Vec<u8>,
    want: usize,
) -> Result<(), Failure> {
    let end = Instant::now() + STEP;
    loop {
        match s.open(pending, plain) {
            Ok(n) => {
                pending.drain(..n);
            }
            Err(e) => {
                let mut out = Vec::new();
                if s.write_pending(&mut out).unwrap_or(false) {
                    let _ = stream.write_all(&out);
                }
                return Err(Failure::Tls(e));
            }
        }
        let mut out = Vec::new();
        if s.write_pending(&mut out).unwrap() {
            stream.write_all(&out).unwrap();
        }
        if plain.len() >= want {
            return Ok(());
        }
        fill(stream, pending, end)?;
    }
}

/// Accepts one connection on a fresh listener, in a thread; returns the port and the thread.
pub fn accept_one<T: Send + 'static>(
    f: impl FnOnce(TcpStream) -> T + Send + 'static,
) -> (u16, std::thread::JoinHandle<T>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let t = std::thread::spawn(move || {
        l.set_nonblocking(true).unwrap();
        let end = Instant::now() + STEP;
        let s = loop {
            match l.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == ErrorKind::WouldBlock && Instant::now() < end => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                Err(e) => panic!("accept: {e}"),
            }
        };
        s.set_nonblocking(false).unwrap();
        s.set_nodelay(true).unwrap();
        f(s)
    });
    (port, t)
}

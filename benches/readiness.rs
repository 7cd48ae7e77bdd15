//! What a busy-polling server pays to find the sockets with something to read, beside N idle connections:
//! reading every socket every pass (what our target did before the ready group), asking epoll once per pass
//! (level-triggered, a `read` per ready socket: the ready group's way), and io_uring with a multishot receive
//! per socket into provided buffers ([`nvpoll::uring`], SPDK's uring socket's way), with the kernel posting
//! completions by interrupting the server (`uring`) or when it asks (`uring-defer`).
//!
//! `cargo bench --bench readiness`. One process: a server thread busy-polls on SERVER_CORE (default 1) and
//! echoes every message; a client thread on CLIENT_CORE (default 0), which blocks and never spins, keeps
//! DEPTH messages of 72 bytes (a command capsule's size) in flight on each of ACTIVE connections and holds
//! IDLE more connections that send nothing. Two shapes by default: one connection at depth 1, and eight at
//! depth 32. The modes take turns within each round (ROUNDS, default 5, each cell SECS seconds, default 2), and
//! the table gives each cell's median messages a second, its spread, and its ratio to the same mode with no
//! idle connection and to epoll beside the same idle ones.
//!
//! Knobs (environment): IDLE="0 64 256 1024", SHAPES="1x1 8x32" (connections x depth), MODES="readall epoll
//! uring uring-defer", ROUNDS, SECS, SERVER_CORE, CLIENT_CORE. The echo is all the server does for a message,
//! so the mechanism's cost shows larger here than under a target's real work per command.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvpoll::uring::{Received, RecvRing, TaskRun};

const MSG: usize = 72;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Mode {
    ReadAll,
    Epoll,
    Uring,
    UringDefer,
}

impl Mode {
    fn parse(s: &str) -> Mode {
        match s {
            "readall" => Mode::ReadAll,
            "epoll" => Mode::Epoll,
            "uring" => Mode::Uring,
            "uring-defer" => Mode::UringDefer,
            _ => panic!("readiness: unknown mode {s:?} (readall, epoll, uring, uring-defer)"),
        }
    }
    fn name(self) -> &'static str {
        match self {
            Mode::ReadAll => "readall",
            Mode::Epoll => "epoll",
            Mode::Uring => "uring",
            Mode::UringDefer => "uring-defer",
        }
    }
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_string())
}

fn pin(core: usize) {
    let ok = core_affinity::set_for_current(core_affinity::CoreId { id: core });
    assert!(ok, "readiness: cannot pin a thread to core {core}");
}

/// The server's side of one connection: what it still has to write back.
struct Conn {
    sock: TcpStream,
    out: Vec<u8>,
}

impl Conn {
    fn echo(&mut self, data: &[u8]) {
        if self.out.is_empty() {
            match self.sock.write(data) {
                Ok(n) => self.out.extend_from_slice(&data[n..]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => self.out.extend_from_slice(data),
                Err(e) => panic!("readiness: server write: {e}"),
            }
        } else {
            self.out.extend_from_slice(data);
            self.flush();
        }
    }
    fn flush(&mut self) {
        while !self.out.is_empty() {
            match self.sock.write(&self.out) {
                Ok(n) => {
                    self.out.drain(..n);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) => panic!("readiness: server write: {e}"),
            }
        }
    }
}

/// Busy-polls `conns` the `mode`'s way until `stop`, echoing every byte.
fn serve(mode: Mode, mut conns: Vec<Conn>, stop: &AtomicBool) {
    let mut buf = vec![0u8; 64 * 1024];
    match mode {
        Mode::ReadAll => {
            while !stop.load(Ordering::Relaxed) {
                for c in conns.iter_mut() {
                    match c.sock.read(&mut buf) {
                        Ok(0) => {}
                        Ok(n) => c.echo(&buf[..n]),
                        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                        Err(e) => panic!("readiness: server read: {e}"),
                    }
                }
            }
        }
        Mode::Epoll => {
            use rustix::event::epoll;
            let set = epoll::create(epoll::CreateFlags::CLOEXEC).unwrap();
            for (i, c) in conns.iter().enumerate() {
                epoll::add(
                    &set,
                    c.sock.as_fd(),
                    epoll::EventData::new_u64(i as u64),
                    epoll::EventFlags::IN,
                )
                .unwrap();
            }
            // The same call the ready group makes (level-triggered, no waiting).
            let mut events = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let n = nvpoll::reactor::epoll_ready_now(&set, &mut events, conns.len());
                for ev in &events[..n] {
                    let c = &mut conns[ev.data.u64() as usize];
                    match c.sock.read(&mut buf) {
                        Ok(0) => {}
                        Ok(n) => c.echo(&buf[..n]),
                        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                        Err(e) => panic!("readiness: server read: {e}"),
                    }
                }
            }
        }
        Mode::Uring | Mode::UringDefer => {
            let taskrun = if mode == Mode::Uring {
                TaskRun::Interrupt
            } else {
                TaskRun::Deferred
            };
            let mut ring = RecvRing::new(conns.len() as u32, 256, 16 * 1024, taskrun)
                .unwrap_or_else(|e| panic!("readiness: io_uring: {e}"));
            for (i, c) in conns.iter().enumerate() {
                ring.watch(c.sock.as_fd(), i as u32).unwrap();
            }
            while !stop.load(Ordering::Relaxed) {
                ring.poll(|t, rx| match rx {
                    Received::Data(d) => conns[t as usize].echo(d),
                    Received::Closed => {}
                    Received::Failed(e) => panic!("readiness: server receive: {e}"),
                })
                .unwrap();
            }
            for i in 0..conns.len() {
                ring.unwatch(i as u32).unwrap();
            }
        }
    }
}

/// Keeps `depth` messages in flight on each of `active` (blocking in poll(2), never spinning) until `until`;
/// returns the round trips completed.
fn drive(active: &mut [TcpStream], depth: usize, until: Instant) -> u64 {
    let msg = vec![0x5au8; MSG * depth];
    for s in active.iter_mut() {
        s.write_all(&msg).unwrap();
    }
    let mut partial = vec![0usize; active.len()];
    let mut buf = vec![0u8; 64 * 1024];
    let mut done = 0u64;
    while Instant::now() < until {
        let mut fds: Vec<rustix::event::PollFd<'_>> = active
            .iter()
            .map(|s| rustix::event::PollFd::new(s, rustix::event::PollFlags::IN))
            .collect();
        let timeout = rustix::time::Timespec {
            tv_sec: 0,
            tv_nsec: 100_000_000,
        };
        rustix::event::poll(&mut fds, Some(&timeout)).unwrap();
        let ready: Vec<bool> = fds.iter().map(|f| !f.revents().is_empty()).collect();
        drop(fds);
        for (i, s) in active.iter_mut().enumerate() {
            if !ready[i] {
                continue;
            }
            let n = s.read(&mut buf).unwrap();
            assert!(n > 0, "readiness: the server closed a connection");
            let bytes = partial[i] + n;
            let whole = bytes / MSG;
            partial[i] = bytes % MSG;
            done += whole as u64;
            if whole > 0 {
                s.write_all(&msg[..whole * MSG]).unwrap();
            }
        }
    }
    done
}

/// One cell: returns messages a second.
fn cell(
    mode: Mode,
    idle: usize,
    conns: usize,
    depth: usize,
    secs: f64,
    cores: (usize, usize),
) -> f64 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let mut idle_socks = Vec::with_capacity(idle);
    let mut server = Vec::with_capacity(idle + conns);
    let mut active = Vec::with_capacity(conns);
    for i in 0..idle + conns {
        let c = TcpStream::connect(addr).unwrap();
        c.set_nodelay(true).unwrap();
        let (s, _) = listener.accept().unwrap();
        s.set_nodelay(true).unwrap();
        s.set_nonblocking(true).unwrap();
        server.push(Conn {
            sock: s,
            out: Vec::new(),
        });
        if i < idle {
            idle_socks.push(c);
        } else {
            active.push(c);
        }
    }
    // The active connections last: every mode meets the idle ones first in its order.
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = Arc::clone(&stop);
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let t = std::thread::spawn(move || {
        pin(cores.0);
        started_tx.send(()).unwrap();
        serve(mode, server, &stop2);
    });
    started_rx.recv().unwrap();
    pin(cores.1);
    // A warm-up of a fifth of the cell, then the measured part.
    let warm = Duration::from_secs_f64(secs / 5.0);
    drive(&mut active, depth, Instant::now() + warm);
    // Drain what the warm-up left in flight, so each cell starts from the same state.
    let start = Instant::now();
    let done = drive_settled(&mut active, depth, start + Duration::from_secs_f64(secs));
    let rate = done as f64 / start.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    t.join().expect("readiness: the server thread panicked");
    drop(idle_socks);
    rate
}

/// [`drive`], after reading back what an earlier drive left in flight on each connection.
fn drive_settled(active: &mut [TcpStream], depth: usize, until: Instant) -> u64 {
    for s in active.iter_mut() {
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let mut left = depth * MSG;
        let mut buf = vec![0u8; left];
        while left > 0 {
            match s.read(&mut buf[..left]) {
                Ok(0) => panic!("readiness: the server closed a connection"),
                Ok(n) => left -= n,
                Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::TimedOut => {
                    break
                }
                Err(e) => panic!("readiness: client read: {e}"),
            }
        }
        s.set_read_timeout(None).unwrap();
    }
    drive(active, depth, until)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn main() {
    // `cargo bench` passes --bench; nothing else is taken from the command line.
    if std::env::args().any(|a| a == "--help" || a == "-h") {
        println!("see the header of benches/readiness.rs: knobs IDLE, SHAPES, MODES, ROUNDS, SECS, SERVER_CORE, CLIENT_CORE");
        return;
    }
    let idles: Vec<usize> = env_or("IDLE", "0 64 256 1024")
        .split_whitespace()
        .map(|s| s.parse().expect("IDLE: numbers"))
        .collect();
    let shapes: Vec<(usize, usize)> = env_or("SHAPES", "1x1 8x32")
        .split_whitespace()
        .map(|s| {
            let (a, b) = s.split_once('x').expect("SHAPES: CONNSxDEPTH");
            (a.parse().expect("SHAPES"), b.parse().expect("SHAPES"))
        })
        .collect();
    let modes: Vec<Mode> = env_or("MODES", "readall epoll uring uring-defer")
        .split_whitespace()
        .map(Mode::parse)
        .collect();
    let rounds: usize = env_or("ROUNDS", "5").parse().expect("ROUNDS");
    let secs: f64 = env_or("SECS", "2").parse().expect("SECS");
    let server_core: usize = env_or("SERVER_CORE", "1").parse().expect("SERVER_CORE");
    let client_core: usize = env_or("CLIENT_CORE", "0").parse().expect("CLIENT_CORE");
    assert_ne!(
        server_core, client_core,
        "readiness: the server and the client need a core each"
    );

    // Each connection costs two descriptors here (both ends live in this process).
    let need = (idles.iter().max().copied().unwrap_or(0) + 64) as u64 * 2 + 64;
    let lim = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    if lim.current.is_some_and(|c| c < need) {
        let want = lim.maximum.map_or(need, |m| m.min(need.max(4096)));
        rustix::process::setrlimit(
            rustix::process::Resource::Nofile,
            rustix::process::Rlimit {
                current: Some(want),
                maximum: lim.maximum,
            },
        )
        .unwrap_or_else(|e| panic!("readiness: cannot raise the descriptor limit to {want}: {e}"));
    }

    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, m)| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    println!(
        "readiness: {cpu}; server on core {server_core}, client on core {client_core}; {rounds} round(s) of {secs} s a cell, modes taking turns"
    );
    let mut rates: HashMap<(Mode, usize, (usize, usize)), Vec<f64>> = HashMap::new();
    for round in 1..=rounds {
        for &shape in &shapes {
            for &idle in &idles {
                for &mode in &modes {
                    let r = cell(
                        mode,
                        idle,
                        shape.0,
                        shape.1,
                        secs,
                        (server_core, client_core),
                    );
                    eprintln!(
                        "readiness: round {round}: {}x{} beside {idle} idle, {}: {r:.0}/s",
                        shape.0,
                        shape.1,
                        mode.name()
                    );
                    rates.entry((mode, idle, shape)).or_default().push(r);
                }
            }
        }
    }
    println!(
        "{:<6} {:>5} {:<12} {:>10} {:>21} {:>8} {:>9}",
        "shape", "idle", "mode", "msgs/s", "spread (min-max)", "vs 0", "vs epoll"
    );
    for &shape in &shapes {
        for &idle in &idles {
            for &mode in &modes {
                let v = rates.get_mut(&(mode, idle, shape)).unwrap();
                let (lo, hi) = v
                    .iter()
                    .fold((f64::MAX, 0f64), |(l, h), x| (l.min(*x), h.max(*x)));
                let m = median(v);
                let base = median(&mut rates.get(&(mode, idles[0], shape)).unwrap().clone());
                let ep = rates
                    .get(&(Mode::Epoll, idle, shape))
                    .map(|e| median(&mut e.clone()));
                println!(
                    "{:<6} {:>5} {:<12} {:>10.0} {:>10.0}-{:<10.0} {:>8.2} {:>9}",
                    format!("{}x{}", shape.0, shape.1),
                    idle,
                    mode.name(),
                    m,
                    lo,
                    hi,
                    m / base,
                    ep.map_or("-".to_string(), |e| format!("{:.2}", m / e))
                );
            }
        }
    }
}

//! Parked pollers (src/reactor.rs, issue 46): a poller that has been idle for a while and says what wakes it
//! is not polled until one of its wake sources fires, and then at once.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nvpoll::reactor::{
    CoreList, PollStatus, Poller, PollerId, ReactorContext, Reactors, WakeSources,
};

const HANG: Duration = Duration::from_secs(30);

/// One busy-polling reactor on core 0 at a time.
fn exclusive() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Counts its polls; reads whatever its socket holds (busy when it read something); may ask to be woken at a
/// deadline, or refuse to say what wakes it.
struct Sock {
    rx: UnixStream,
    polls: Arc<AtomicU64>,
    got: Arc<AtomicU64>,
    deadline: Option<Instant>,
    says: bool,
    /// When it reads a byte: wakes this poller (by id, set once registered).
    wakes: Arc<Mutex<Option<PollerId>>>,
}

impl Poller for Sock {
    fn poll(&mut self, ctx: &mut ReactorContext) -> PollStatus {
        self.polls.fetch_add(1, Ordering::Relaxed);
        let mut buf = [0u8; 64];
        match self.rx.read(&mut buf) {
            Ok(n) if n > 0 => {
                self.got.fetch_add(n as u64, Ordering::Relaxed);
                if let Some(id) = *self.wakes.lock().unwrap() {
                    ctx.wake_poller(id);
                }
                PollStatus::Busy
            }
            _ => {
                if self.deadline.is_some_and(|d| Instant::now() >= d) {
                    self.deadline = None;
                    self.got.fetch_add(1000, Ordering::Relaxed);
                }
                PollStatus::Idle
            }
        }
    }

    fn wake_sources<'a>(&'a self, w: &mut WakeSources<'a>) -> bool {
        if let Some(d) = self.deadline {
            w.deadline(d);
        }
        w.readable(&self.rx);
        self.says
    }
}

struct Probe {
    tx: UnixStream,
    polls: Arc<AtomicU64>,
    got: Arc<AtomicU64>,
}

/// Registers `n` socket pollers on reactor 0; `deadline_of`/`says` per index.
fn start(
    n: usize,
    deadline_of: impl Fn(usize) -> Option<Instant>,
    says: impl Fn(usize) -> bool,
) -> Started {
    let guard = exclusive();
    let reactors = Reactors::start(&"0".parse::<CoreList>().unwrap()).unwrap();
    let wakes = Arc::new(Mutex::new(None));
    let mut probes = Vec::new();
    let mut pollers = Vec::new();
    for i in 0..n {
        let (tx, rx) = UnixStream::pair().unwrap();
        rx.set_nonblocking(true).unwrap();
        let polls = Arc::new(AtomicU64::new(0));
        let got = Arc::new(AtomicU64::new(0));
        pollers.push(Sock {
            rx,
            polls: Arc::clone(&polls),
            got: Arc::clone(&got),
            deadline: deadline_of(i),
            says: says(i),
            wakes: Arc::clone(&wakes),
        });
        probes.push(Probe { tx, polls, got });
    }
    let (done, ids) = std::sync::mpsc::channel();
    reactors
        .send(0, move |ctx| {
            let ids: Vec<PollerId> = pollers.into_iter().map(|p| ctx.add_poller(p)).collect();
            done.send(ids).unwrap();
        })
        .unwrap();
    let ids = ids.recv_timeout(HANG).unwrap();
    (reactors, probes, ids, wakes, guard)
}

type Started = (
    Reactors,
    Vec<Probe>,
    Vec<PollerId>,
    Arc<Mutex<Option<PollerId>>>,
    std::sync::MutexGuard<'static, ()>,
);

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < HANG, "timed out waiting for {what}");
        std::thread::yield_now();
    }
}

#[test]
fn idle_pollers_are_parked_and_woken_by_their_descriptors_and_deadlines() {
    // 32 pollers; number 7 wants to be woken 300 ms from now, number 9 cannot say what wakes it.
    let at = Instant::now() + Duration::from_millis(300);
    let (reactors, probes, _, _, _x) = start(32, |i| (i == 7).then_some(at), |i| i != 9);
    wait_until("31 parked pollers", || reactors.stats()[0].parked == 31);
    // Parked pollers are not polled: their counts stand still while the reactor iterates (number 9's grows).
    let before: Vec<u64> = probes
        .iter()
        .map(|p| p.polls.load(Ordering::Relaxed))
        .collect();
    let busy = reactors.stats()[0].idle;
    wait_until("more iterations", || {
        reactors.stats()[0].idle > busy + 10_000
    });
    for (i, p) in probes.iter().enumerate() {
        let now = p.polls.load(Ordering::Relaxed);
        if i == 9 {
            assert!(
                now > before[i] + 10_000,
                "the poller that cannot say what wakes it is polled on"
            );
        } else if Instant::now() < at {
            assert_eq!(now, before[i], "parked poller {i} was polled");
        }
    }
    // A byte on number 5's socket: it is polled and reads it at once; the others stay parked.
    (&probes[5].tx).write_all(b"x").unwrap();
    wait_until("number 5 reads its byte", || {
        probes[5].got.load(Ordering::Relaxed) == 1
    });
    for (i, p) in probes.iter().enumerate() {
        if i != 5 && i != 9 && Instant::now() < at {
            assert_eq!(p.polls.load(Ordering::Relaxed), before[i], "poller {i}");
        }
    }
    // Number 7 is polled at its deadline, without any descriptor firing.
    wait_until("number 7's deadline", || {
        probes[7].got.load(Ordering::Relaxed) == 1000
    });
    assert!(Instant::now() >= at);
    // And everyone parks again.
    wait_until("31 parked again", || reactors.stats()[0].parked == 31);
    reactors.stop().unwrap();
}

#[test]
fn a_poller_wakes_another_and_a_message_wakes_all() {
    let (reactors, probes, ids, wakes, _x) = start(16, |_| None, |_| true);
    wait_until("16 parked pollers", || reactors.stats()[0].parked == 16);
    // Number 2, on reading a byte, wakes number 11 (which has nothing on its socket).
    *wakes.lock().unwrap() = Some(ids[11]);
    let before11 = probes[11].polls.load(Ordering::Relaxed);
    (&probes[2].tx).write_all(b"y").unwrap();
    wait_until("number 11 polled", || {
        probes[11].polls.load(Ordering::Relaxed) > before11
    });
    *wakes.lock().unwrap() = None;
    wait_until("16 parked again", || reactors.stats()[0].parked == 16);
    // A message may hand any poller work: every one is polled after it.
    let before: Vec<u64> = probes
        .iter()
        .map(|p| p.polls.load(Ordering::Relaxed))
        .collect();
    let ran = Arc::new(AtomicBool::new(false));
    let r = Arc::clone(&ran);
    reactors
        .send(0, move |_| r.store(true, Ordering::Release))
        .unwrap();
    wait_until("every poller polled after the message", || {
        ran.load(Ordering::Acquire)
            && probes
                .iter()
                .zip(&before)
                .all(|(p, b)| p.polls.load(Ordering::Relaxed) > *b)
    });
    reactors.stop().unwrap();
}

#[test]
fn a_few_pollers_are_never_parked() {
    // Up to eight pollers are polled on every iteration (an epoll_wait would cost what their reads do).
    let (reactors, probes, _, _, _x) = start(8, |_| None, |_| true);
    let busy = reactors.stats()[0].idle;
    wait_until("iterations", || reactors.stats()[0].idle > busy + 100_000);
    assert_eq!(reactors.stats()[0].parked, 0);
    assert!(probes
        .iter()
        .all(|p| p.polls.load(Ordering::Relaxed) > 100_000));
    reactors.stop().unwrap();
}

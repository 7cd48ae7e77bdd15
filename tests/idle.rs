//! Hybrid idle mode: reactors that sleep when nothing happens, and wake for everything that can give them
//! work (messages, sockets, connections, timers, deadlines, wakers, stop) without losing a wake-up.

use std::cell::Cell;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nvpoll::reactor::{IdlePolicy, PollStatus, Poller, ReactorContext, Reactors, WakeSources};

/// How long an event may wait for its reactor before the test calls it a lost wake-up. Generous: this VM
/// stalls threads for tens of milliseconds at times, and a lost wake-up waits forever.
const BOUND: Duration = Duration::from_secs(2);

fn exclusive() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn hybrid(quiet: Duration) -> Reactors {
    Reactors::builder()
        .idle(IdlePolicy::Hybrid { quiet })
        .start(&"0".parse().unwrap())
        .unwrap()
}

/// A poller with nothing to do that says so: the reactor may sleep with it.
struct Nothing;

impl Poller for Nothing {
    fn poll(&mut self, _: &mut ReactorContext) -> PollStatus {
        PollStatus::Idle
    }
    fn wake_sources<'a>(&'a self, _: &mut WakeSources<'a>) -> bool {
        true
    }
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < BOUND, "timed out waiting until {what}");
        std::thread::yield_now();
    }
}

#[test]
fn idle_policies_parse_and_print() {
    assert_eq!("poll".parse::<IdlePolicy>().unwrap(), IdlePolicy::Poll);
    assert_eq!(
        "hybrid".parse::<IdlePolicy>().unwrap(),
        IdlePolicy::hybrid()
    );
    let p: IdlePolicy = "hybrid:250us".parse().unwrap();
    assert_eq!(
        p,
        IdlePolicy::Hybrid {
            quiet: Duration::from_micros(250)
        }
    );
    assert_eq!(p.to_string(), "hybrid:250us");
    assert_eq!(p.to_string().parse::<IdlePolicy>().unwrap(), p);
    for bad in ["", "interrupt", "hybrid:", "hybrid:soon", "poll:1ms"] {
        let e = bad.parse::<IdlePolicy>().unwrap_err().to_string();
        assert!(e.contains("expected poll, hybrid"), "{bad:?}: {e}");
    }
}

#[test]
fn a_poll_reactor_never_sleeps_and_a_hybrid_one_does() {
    let _x = exclusive();
    let poll = Reactors::start(&"0".parse().unwrap()).unwrap();
    poll.send(0, |ctx| {
        ctx.add_poller(Nothing);
    })
    .unwrap();
    wait_until("the polling reactor idled a while", || {
        poll.stats()[0].idle > 100_000
    });
    let stats = poll.stop().unwrap();
    assert_eq!((stats[0].sleeps, stats[0].slept), (0, Duration::ZERO));

    let reactors = hybrid(Duration::from_micros(200));
    reactors
        .send(0, |ctx| {
            ctx.add_poller(Nothing);
        })
        .unwrap();
    wait_until("the hybrid reactor slept", || {
        reactors.stats()[0].sleeps > 0
    });
    // Asleep, it still runs a message at once, and stops when asked.
    let t = Instant::now();
    let ran = reactors.run_on_all(|_| Instant::now()).unwrap();
    assert!(ran[0] - t < BOUND);
    let stats = reactors.stop().unwrap();
    assert!(
        stats[0].sleeps >= 1 && stats[0].slept > Duration::ZERO,
        "{stats:?}"
    );
}

#[test]
fn a_poller_that_cannot_say_what_wakes_it_keeps_the_reactor_polling() {
    let _x = exclusive();
    let reactors = hybrid(Duration::from_micros(100));
    // (With no poller at all it may sleep before this message, which wakes it.)
    reactors
        .run_on_all(|ctx| {
            ctx.add_poller(Nothing);
            // A closure declares no wake sources.
            ctx.add_poller(|_: &mut ReactorContext| PollStatus::Idle);
        })
        .unwrap();
    let before = reactors.stats()[0];
    wait_until("many idle iterations", || {
        reactors.stats()[0].idle > before.idle + 200_000
    });
    let stats = reactors.stop().unwrap();
    assert_eq!(stats[0].sleeps, before.sleeps, "{stats:?} {before:?}");
}

#[test]
fn stop_wakes_a_sleeping_reactor() {
    let _x = exclusive();
    let reactors = hybrid(Duration::from_micros(100));
    reactors
        .send(0, |ctx| {
            ctx.add_poller(Nothing);
        })
        .unwrap();
    wait_until("the reactor slept", || reactors.stats()[0].sleeps > 0);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || tx.send(reactors.stop()));
    let stats = rx
        .recv_timeout(BOUND)
        .expect("stop did not wake the reactor");
    assert!(stats.unwrap()[0].sleeps > 0);
}

/// What the stress poller reports, and when it saw it.
#[derive(Debug)]
enum Seen {
    Message,
    Byte,
    Connection,
    Flag,
    /// Its own deadline fired: how late.
    Deadline(Duration),
    /// The timed poller ran: when.
    Tick(Instant),
}

/// One poller that waits for a socket's bytes, a listener's connections, a flag set from outside (with a
/// waker) and its own deadline, which it moves to a new random moment each time it fires.
struct Stress {
    rx: UnixStream,
    listener: TcpListener,
    accepted: Vec<TcpStream>,
    flag: Arc<AtomicBool>,
    due: Cell<Instant>,
    rng: Cell<u64>,
    seen: mpsc::Sender<(Seen, Instant)>,
}

fn next_random(state: &Cell<u64>) -> u64 {
    let mut x = state.get();
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    state.set(x);
    x
}

impl Poller for Stress {
    fn poll(&mut self, _: &mut ReactorContext) -> PollStatus {
        let mut busy = false;
        let now = Instant::now();
        let mut byte = [0u8; 64];
        while let Ok(n) = self.rx.read(&mut byte) {
            if n == 0 {
                break;
            }
            for _ in 0..n {
                self.seen.send((Seen::Byte, now)).unwrap();
            }
            busy = true;
        }
        while let Ok((s, _)) = self.listener.accept() {
            self.accepted.push(s);
            self.seen.send((Seen::Connection, now)).unwrap();
            busy = true;
        }
        if self.flag.swap(false, Ordering::AcqRel) {
            self.seen.send((Seen::Flag, now)).unwrap();
            busy = true;
        }
        if now >= self.due.get() {
            self.seen
                .send((Seen::Deadline(now - self.due.get()), now))
                .unwrap();
            let wait = Duration::from_micros(next_random(&self.rng) % 3000);
            self.due.set(now + wait);
            busy = true;
        }
        PollStatus::busy_if(busy)
    }

    fn wake_sources<'a>(&'a self, w: &mut WakeSources<'a>) -> bool {
        w.readable(&self.rx);
        w.readable(&self.listener);
        w.deadline(self.due.get());
        true
    }
}

/// Events of every kind arrive one at a time, each after a random pause around the quiet time (so that some
/// land while the reactor polls, some as it decides to sleep, and some while it sleeps); each must be handled
/// within [`BOUND`]. Meanwhile the poller's own deadlines and a timed poller must fire on time.
#[test]
fn no_wake_up_is_lost_around_the_sleep_boundary() {
    const QUIET: Duration = Duration::from_micros(150);
    const ROUNDS: usize = 1500;
    const TICK: Duration = Duration::from_millis(7);
    let _x = exclusive();
    let reactors = hybrid(QUIET);
    let (seen_tx, seen) = mpsc::channel();
    let (mut tx, rx) = UnixStream::pair().unwrap();
    rx.set_nonblocking(true).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    let flag = Arc::new(AtomicBool::new(false));
    let waker = reactors.waker(0).unwrap();
    let stress = {
        let flag = Arc::clone(&flag);
        let seen = seen_tx.clone();
        move |ctx: &mut ReactorContext| {
            ctx.add_poller(Stress {
                rx,
                listener,
                accepted: Vec::new(),
                flag,
                due: Cell::new(Instant::now()),
                rng: Cell::new(0x2545_f491_4f6c_dd1d),
                seen: seen.clone(),
            });
            ctx.add_timed_poller(TICK, move |_: &mut ReactorContext| {
                seen.send((Seen::Tick(Instant::now()), Instant::now()))
                    .unwrap();
                PollStatus::Busy
            });
        }
    };
    reactors.send(0, stress).unwrap();

    let rng = Cell::new(0x9e37_79b9_7f4a_7c15u64);
    let mut worst = Duration::ZERO;
    let (mut late_deadline, mut deadlines, mut ticks) = (Duration::ZERO, 0u32, Vec::new());
    let mut clients = Vec::new();
    for round in 0..ROUNDS {
        // A pause of 0 to 3 quiet times, spun rather than slept so that it is as short as it says.
        let pause = Duration::from_nanos(next_random(&rng) % (3 * QUIET.as_nanos() as u64));
        let start = Instant::now();
        while start.elapsed() < pause {
            std::hint::spin_loop();
        }
        let kind = next_random(&rng) % 4;
        let sent = Instant::now();
        match kind {
            0 => {
                let s = seen_tx.clone();
                reactors
                    .send(0, move |_| s.send((Seen::Message, Instant::now())).unwrap())
                    .unwrap();
            }
            1 => tx.write_all(&[1]).unwrap(),
            2 => clients.push(TcpStream::connect(addr).unwrap()),
            _ => {
                flag.store(true, Ordering::Release);
                waker.wake();
            }
        }
        // Wait for this event (the deadlines and ticks that come meanwhile are checked as they pass).
        loop {
            let (what, at) = seen.recv_timeout(BOUND).unwrap_or_else(|_| {
                panic!("round {round}: event {kind} lost (not handled in {BOUND:?})")
            });
            match what {
                Seen::Deadline(late) => {
                    deadlines += 1;
                    late_deadline = late_deadline.max(late);
                }
                Seen::Tick(t) => ticks.push(t),
                handled => {
                    let expected = ["Message", "Byte", "Connection", "Flag"][kind as usize];
                    assert_eq!(format!("{handled:?}"), expected, "round {round}");
                    worst = worst.max(at.saturating_duration_since(sent));
                    break;
                }
            }
        }
    }
    let stats = reactors.stop().unwrap();
    for (what, _) in seen.try_iter() {
        match what {
            Seen::Deadline(late) => {
                deadlines += 1;
                late_deadline = late_deadline.max(late);
            }
            Seen::Tick(t) => ticks.push(t),
            other => panic!("an event handled twice: {other:?}"),
        }
    }
    let gaps = ticks
        .windows(2)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap_or_default();
    eprintln!(
        "{ROUNDS} events, worst {worst:?}; {deadlines} deadlines, worst {late_deadline:?} late; \
         {} ticks, widest gap {gaps:?}; {} sleeps, {:?} asleep",
        ticks.len(),
        stats[0].sleeps,
        stats[0].slept
    );
    assert!(worst < BOUND);
    assert!(
        late_deadline < BOUND,
        "a deadline fired {late_deadline:?} late"
    );
    assert!(deadlines > 10, "only {deadlines} deadlines fired");
    assert!(ticks.len() > 3, "only {} ticks", ticks.len());
    assert!(
        gaps < TICK + BOUND,
        "the timed poller missed its period by {gaps:?}"
    );
    // The test means something only if the reactor often slept in it.
    assert!(
        stats[0].sleeps as usize > ROUNDS / 10,
        "the reactor slept only {} times",
        stats[0].sleeps
    );
}

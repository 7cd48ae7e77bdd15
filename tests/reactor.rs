//! Reactors: core lists, message rings, pollers, timers, stop and panics.

use std::cell::Cell;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nvpoll::reactor::{CoreList, PollStatus, Poller, ReactorContext, ReactorStats, Reactors};
use nvpoll::Error;

/// How long a test waits for something that takes milliseconds before calling it a hang.
const HANG: Duration = Duration::from_secs(30);

/// Reactors spin on every core: run one test's reactors at a time.
fn exclusive() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Waits for the reactors to stop by themselves, failing the test instead of hanging.
fn join_or_fail(reactors: Reactors) -> nvpoll::Result<Vec<ReactorStats>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || tx.send(reactors.join()));
    rx.recv_timeout(HANG).expect("reactors did not stop")
}

/// Sends a message that spins until `gate` opens (or a stop is requested, so that a failing test cannot hang),
/// so the reactor runs nothing else meanwhile. Returns a flag that says when the message started.
fn hold_reactor(reactors: &Reactors, target: usize, gate: Arc<AtomicBool>) -> Arc<AtomicBool> {
    let entered = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&entered);
    reactors
        .send(target, move |ctx| {
            flag.store(true, Ordering::Release);
            while !gate.load(Ordering::Acquire) && !ctx.stop_requested() {
                std::hint::spin_loop();
            }
        })
        .unwrap();
    entered
}

fn wait_for(flag: &AtomicBool) {
    let start = Instant::now();
    while !flag.load(Ordering::Acquire) {
        assert!(start.elapsed() < HANG, "timed out");
        std::thread::yield_now();
    }
}

#[test]
fn core_lists_parse_like_spdk() {
    let all = CoreList::all();
    assert!(!all.is_empty());
    assert_eq!(CoreList::parse(&all.to_string()).unwrap(), all);
    let first = all.cores()[0];
    for spec in [
        format!("{first}"),
        format!("[{first}]"),
        format!("{first}-{first}"),
        format!("{0},{0}", first),
        format!("{:#x}", 1u128 << first),
    ] {
        assert_eq!(CoreList::parse(&spec).unwrap().cores(), &[first], "{spec}");
    }
    if all.cores().starts_with(&[0, 1]) {
        assert_eq!("0x3".parse::<CoreList>().unwrap().cores(), &[0, 1]);
        assert_eq!("0X3".parse::<CoreList>().unwrap().cores(), &[0, 1]);
        assert_eq!("[1, 0]".parse::<CoreList>().unwrap().cores(), &[0, 1]);
        assert_eq!("0-1".parse::<CoreList>().unwrap().to_string(), "0-1");
    }
    for bad in ["", "x", "0x", "0x0", "0xg", "1-0", "0,", "-1", "[0"] {
        match CoreList::parse(bad) {
            Err(Error::InvalidArgument(msg)) => assert!(msg.contains("core list"), "{msg}"),
            other => panic!("{bad:?} gave {other:?}"),
        }
    }
}

#[test]
fn a_core_that_does_not_exist_is_an_error() {
    let missing = CoreList::all().cores().last().unwrap() + 1;
    for spec in [
        format!("{missing}"),
        format!("0-{missing}"),
        "4096".to_string(),
        format!("{:#x}", 1u128 << 100),
    ] {
        match CoreList::parse(&spec) {
            Err(Error::InvalidArgument(msg)) => {
                assert!(msg.contains("does not exist"), "{msg}")
            }
            other => panic!("{spec:?} gave {other:?}"),
        }
    }
}

/// Tokens bounce between the reactors; each bounce is one message. A million are sent and a million run.
#[test]
fn a_million_messages_none_lost() {
    const TOKENS: u64 = 100;
    const HOPS: u64 = 10_000;

    fn bounce(
        ctx: &mut ReactorContext,
        hops_left: u64,
        run: Arc<AtomicU64>,
        done: mpsc::Sender<()>,
    ) {
        run.fetch_add(1, Ordering::Relaxed);
        if hops_left == 0 {
            done.send(()).unwrap();
            return;
        }
        let next = (ctx.index() + 1) % ctx.reactor_count();
        // At most TOKENS messages are in flight, far below the ring capacity: a failure is a bug.
        ctx.send(next, move |ctx| bounce(ctx, hops_left - 1, run, done))
            .unwrap();
    }

    let _x = exclusive();
    let reactors = Reactors::start(&CoreList::all()).unwrap();
    let run = Arc::new(AtomicU64::new(0));
    let (done_tx, done_rx) = mpsc::channel();
    for token in 0..TOKENS {
        let (run, done) = (Arc::clone(&run), done_tx.clone());
        let target = token as usize % reactors.len();
        reactors
            .send(target, move |ctx| bounce(ctx, HOPS - 1, run, done))
            .unwrap();
    }
    for _ in 0..TOKENS {
        done_rx.recv_timeout(HANG).expect("a token got lost");
    }
    let stats = reactors.stop().unwrap();
    assert_eq!(run.load(Ordering::Relaxed), TOKENS * HOPS);
    assert_eq!(stats.iter().map(|s| s.messages).sum::<u64>(), TOKENS * HOPS);
    assert_eq!(TOKENS * HOPS, 1_000_000);
}

#[test]
fn stop_runs_every_message_already_sent() {
    const SENT: u64 = 1000;
    let _x = exclusive();
    let reactors = Reactors::builder()
        .ring_capacity(2048)
        .message_batch(16)
        .start(&CoreList::parse(&CoreList::all().cores()[0].to_string()).unwrap())
        .unwrap();
    // Keep the reactor busy until stop is requested, so that the ring is still full when it is.
    reactors
        .send(0, |ctx| {
            while !ctx.stop_requested() {
                std::hint::spin_loop();
            }
        })
        .unwrap();
    let ran = Arc::new(AtomicU64::new(0));
    for _ in 0..SENT {
        let ran = Arc::clone(&ran);
        reactors
            .send(0, move |_| {
                ran.fetch_add(1, Ordering::Relaxed);
            })
            .unwrap();
    }
    let stats = reactors.stop().unwrap();
    assert_eq!(ran.load(Ordering::Relaxed), SENT);
    assert_eq!(stats[0].messages, SENT + 1);
}

#[test]
fn a_full_ring_refuses_the_message() {
    let _x = exclusive();
    let reactors = Reactors::builder()
        .ring_capacity(8)
        .start(&CoreList::all())
        .unwrap();
    let gate = Arc::new(AtomicBool::new(false));
    let entered = hold_reactor(&reactors, 0, Arc::clone(&gate));
    wait_for(&entered);
    let ran = Arc::new(AtomicU64::new(0));
    let count = |ran: &Arc<AtomicU64>| {
        let ran = Arc::clone(ran);
        move |_: &mut ReactorContext| {
            ran.fetch_add(1, Ordering::Relaxed);
        }
    };
    for _ in 0..8 {
        reactors.send(0, count(&ran)).unwrap();
    }
    assert!(matches!(
        reactors.send(0, count(&ran)),
        Err(Error::QueueFull)
    ));
    // A reactor sees the same from the inside.
    let (tx, rx) = mpsc::channel();
    if reactors.len() > 1 {
        let ran2 = Arc::clone(&ran);
        reactors
            .send(1, move |ctx| {
                let refused = ctx.send(0, move |_| {
                    ran2.fetch_add(1, Ordering::Relaxed);
                });
                tx.send(matches!(refused, Err(Error::QueueFull))).unwrap();
            })
            .unwrap();
        assert!(rx.recv_timeout(HANG).unwrap());
    }
    assert!(matches!(
        reactors.send(reactors.len(), |_| {}),
        Err(Error::InvalidArgument(_))
    ));
    gate.store(true, Ordering::Release);
    reactors.stop().unwrap();
    assert_eq!(ran.load(Ordering::Relaxed), 8);
}

#[test]
fn a_panicking_poller_is_an_error_and_stops_every_reactor() {
    let _x = exclusive();
    let reactors = Reactors::start(&CoreList::all()).unwrap();
    let target = reactors.len() - 1;
    reactors
        .send(target, |ctx| {
            let mut polls = 0;
            ctx.add_poller(move |_: &mut ReactorContext| {
                polls += 1;
                if polls == 100 {
                    panic!("poller exploded");
                }
                PollStatus::Idle
            });
        })
        .unwrap();
    match join_or_fail(reactors) {
        Err(Error::Reactor(msg)) => {
            assert!(msg.contains("poller exploded"), "{msg}");
            assert!(msg.contains(&format!("reactor {target}")), "{msg}");
        }
        other => panic!("expected Error::Reactor, got {other:?}"),
    }
}

#[test]
fn run_on_all_fails_cleanly_when_a_reactor_panics() {
    let _x = exclusive();
    let reactors = Reactors::start(&CoreList::all()).unwrap();
    let gate = Arc::new(AtomicBool::new(false));
    let entered = hold_reactor(&reactors, 0, Arc::clone(&gate));
    wait_for(&entered);
    // Queued behind the gate: the reactor panics before it gets there.
    reactors.send(0, |_| panic!("message exploded")).unwrap();
    let reactors = Arc::new(reactors);
    let (tx, rx) = mpsc::channel();
    let r = Arc::clone(&reactors);
    let caller = std::thread::spawn(move || tx.send(r.run_on_all(|ctx| ctx.index())));
    gate.store(true, Ordering::Release);
    let result = rx.recv_timeout(HANG).expect("run_on_all hung");
    assert!(matches!(result, Err(Error::Reactor(_))), "{result:?}");
    caller.join().unwrap().unwrap();
    let reactors = Arc::into_inner(reactors).unwrap();
    assert!(
        matches!(join_or_fail(reactors), Err(Error::Reactor(msg)) if msg.contains("message exploded"))
    );
}

struct Counting {
    polls: Rc<Cell<u64>>,
    flushes: Rc<Cell<u64>>,
}

impl Poller for Counting {
    fn poll(&mut self, _: &mut ReactorContext) -> PollStatus {
        self.polls.set(self.polls.get() + 1);
        PollStatus::Busy
    }

    fn flush(&mut self, _: &mut ReactorContext) {
        self.flushes.set(self.flushes.get() + 1);
    }
}

#[test]
fn pollers_flush_once_per_iteration_and_can_be_removed() {
    let _x = exclusive();
    let reactors = Reactors::start(&CoreList::all()).unwrap();
    let (tx, rx) = mpsc::channel();
    reactors
        .send(0, move |ctx| {
            let polls = Rc::new(Cell::new(0));
            let flushes = Rc::new(Cell::new(0));
            let counting = ctx.add_poller(Counting {
                polls: Rc::clone(&polls),
                flushes: Rc::clone(&flushes),
            });
            // A second poller watches the first and removes both after 1000 iterations.
            let me = Rc::new(Cell::new(None));
            let me2 = Rc::clone(&me);
            let id = ctx.add_poller(move |ctx: &mut ReactorContext| {
                if polls.get() == 1000 {
                    ctx.remove_poller(counting);
                    ctx.remove_poller(me2.get().unwrap());
                    tx.send((polls.get(), flushes.get())).unwrap();
                }
                PollStatus::Idle
            });
            me.set(Some(id));
        })
        .unwrap();
    let (polls, flushes) = rx.recv_timeout(HANG).unwrap();
    // Flushes run after the pollers of the same iteration: one behind at this point.
    assert_eq!((polls, flushes), (1000, 999));
    let stats = reactors.stop().unwrap();
    assert!(stats[0].busy >= 1000, "{stats:?}");
}

#[test]
fn timed_pollers_run_once_per_period() {
    const PERIOD: Duration = Duration::from_millis(2);
    let _x = exclusive();
    let reactors = Reactors::start(&CoreList::all()).unwrap();
    let (tx, rx) = mpsc::channel();
    reactors
        .send(0, move |ctx| {
            let mut ticks = 0;
            tx.send(Instant::now()).unwrap();
            ctx.add_timed_poller(PERIOD, move |_: &mut ReactorContext| {
                ticks += 1;
                if ticks <= 5 {
                    tx.send(Instant::now()).unwrap();
                }
                PollStatus::Busy
            });
        })
        .unwrap();
    // The registration time, then five ticks.
    let ticks: Vec<Instant> = (0..6).map(|_| rx.recv_timeout(HANG).unwrap()).collect();
    // Fixed rate: tick k comes no earlier than k periods after the registration.
    for (k, tick) in ticks.iter().enumerate().skip(1) {
        let since = *tick - ticks[0];
        assert!(since >= PERIOD * k as u32, "tick {k} after {since:?}");
    }
    let stats = reactors.stop().unwrap();
    assert!(stats[0].idle > 0, "{stats:?}");
}

#[test]
fn run_on_all_collects_by_reactor_and_stats_count() {
    let _x = exclusive();
    let cores = CoreList::all();
    let reactors = Reactors::start(&cores).unwrap();
    assert_eq!(reactors.cores(), cores.cores());
    let found = reactors
        .run_on_all(|ctx| (ctx.index(), ctx.core(), ctx.reactor_count()))
        .unwrap();
    let expected: Vec<_> = cores
        .cores()
        .iter()
        .enumerate()
        .map(|(i, &c)| (i, c, cores.len()))
        .collect();
    assert_eq!(found, expected);
    // Burn a little CPU on each reactor, then check CPU time moved.
    let cpu = reactors
        .run_on_all(|ctx| {
            let before = ctx.cpu_time();
            let start = Instant::now();
            while start.elapsed() < Duration::from_millis(5) {
                std::hint::spin_loop();
            }
            ctx.cpu_time() - before
        })
        .unwrap();
    assert!(cpu.iter().all(|t| *t > Duration::ZERO), "{cpu:?}");
    let live = reactors.stats();
    assert!(live.iter().all(|s| s.messages >= 2), "{live:?}");
    let stats = reactors.stop().unwrap();
    for ((s, &core), burnt) in stats.iter().zip(cores.cores()).zip(cpu) {
        assert_eq!(s.core, core);
        assert_eq!(s.messages, 2);
        assert!(s.cpu_time >= burnt, "{s:?}");
        assert!(s.busy >= 1, "{s:?}");
    }
}

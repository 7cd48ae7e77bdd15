//! Hybrid idle mode end to end: our initiator (its queue pair on a hybrid reactor) against our target (on a
//! hybrid reactor). I/O, new connections and keep-alives arrive at random moments around the sleep/wake
//! boundary of both reactors, and every one must be handled within a bound; then both sides idle through
//! several keep-alive periods, asleep, and the controller is still alive.

use nvpoll_testkit::target as target_common;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use nvpoll::api::{Controller, IoOp, IoRequest, QueuePair};
use nvpoll::mem::DmaBuf;
use nvpoll::reactor::{
    CoreList, IdlePolicy, PollStatus, Poller, ReactorContext, ReactorWaker, Reactors, WakeSources,
};
use nvpoll_tcp::host::{ConnectOptions, TcpController, TcpQueuePair};
use target_common::{fill_pattern, pool, TestTarget, HOSTNQN, NQN};

/// How long one event may wait before the test calls it lost (a lost wake-up waits forever).
const BOUND: Duration = Duration::from_secs(5);
const QUIET: Duration = Duration::from_micros(150);
const BLOCKS: u32 = 8;
const LBAS: u64 = 64;

/// An I/O the test asks the initiator's reactor for.
struct Ask {
    round: usize,
    op: IoOp,
    lba: u64,
    buf: DmaBuf,
}

/// What came back: the round, whether it succeeded, and the buffer.
type Answer = (usize, Result<(), String>, DmaBuf);

/// The queue pair on the initiator's reactor: takes requests from a channel (the test wakes the reactor
/// after each send), and answers each completion on another.
struct IoPoller {
    qp: TcpQueuePair,
    asks: mpsc::Receiver<Ask>,
    answers: mpsc::Sender<Answer>,
}

impl Poller for IoPoller {
    fn poll(&mut self, _: &mut ReactorContext) -> PollStatus {
        let mut busy = false;
        while let Ok(a) = self.asks.try_recv() {
            busy = true;
            let req = IoRequest {
                op: a.op,
                nsid: 1,
                lba: a.lba * u64::from(BLOCKS),
                blocks: BLOCKS,
                buf: Some(a.buf),
                tag: a.round as u64,
            };
            if let Err(r) = self.qp.submit(req) {
                let buf = r.request.buf.expect("buffer handed back");
                self.answers
                    .send((a.round, Err(format!("submit: {}", r.error)), buf))
                    .unwrap();
            }
        }
        if let Err(e) = self.qp.poll(64) {
            panic!("the queue pair failed: {e}");
        }
        while let Some(c) = self.qp.pop_completion() {
            busy = true;
            let result = c.result.map_err(|e| e.to_string());
            self.answers
                .send((c.tag as usize, result, c.buf.expect("buffer")))
                .unwrap();
        }
        PollStatus::busy_if(busy)
    }

    fn flush(&mut self, _: &mut ReactorContext) {
        self.qp.flush().expect("flush");
    }

    fn wake_sources<'a>(&'a self, w: &mut WakeSources<'a>) -> bool {
        self.qp.wake_sources(w)
    }
}

fn next_random(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

fn spin_for(d: Duration) {
    let start = Instant::now();
    while start.elapsed() < d {
        std::hint::spin_loop();
    }
}

struct Host {
    asks: mpsc::Sender<Ask>,
    answers: mpsc::Receiver<Answer>,
    waker: ReactorWaker,
}

impl Host {
    /// Runs one I/O on the initiator's reactor and waits for it; returns the buffer and how long it took.
    fn io(&self, round: usize, op: IoOp, lba: u64, buf: DmaBuf) -> (DmaBuf, Duration) {
        let sent = Instant::now();
        self.asks
            .send(Ask {
                round,
                op,
                lba,
                buf,
            })
            .unwrap();
        self.waker.wake();
        let (r, result, buf) = self
            .answers
            .recv_timeout(BOUND)
            .unwrap_or_else(|_| panic!("round {round}: {op:?} not completed within {BOUND:?}"));
        assert_eq!(r, round);
        result.unwrap_or_else(|e| panic!("round {round}: {op:?} failed: {e}"));
        (buf, sent.elapsed())
    }
}

#[test]
fn hybrid_target_and_initiator_lose_no_wake_up() {
    let hybrid = IdlePolicy::Hybrid { quiet: QUIET };
    let t = TestTarget::start_idle("0", hybrid, target_common::default_config());
    let all = CoreList::all();
    let host_core = all.cores().last().copied().expect("a core");
    let reactors = Reactors::builder()
        .idle(hybrid)
        .start(&host_core.to_string().parse().unwrap())
        .unwrap();
    let p = pool();
    let mut o = ConnectOptions::new(t.addr, NQN, HOSTNQN);
    o.kato = Duration::from_secs(1);
    let mut ctrl = TcpController::connect(o, p.clone()).expect("connect");
    let qp = ctrl.create_queue_pair(32).expect("queue pair");
    let (ask_tx, ask_rx) = mpsc::channel();
    let (answer_tx, answer_rx) = mpsc::channel();
    reactors
        .send(0, move |ctx| {
            ctx.add_poller(IoPoller {
                qp,
                asks: ask_rx,
                answers: answer_tx,
            });
        })
        .unwrap();
    let host = Host {
        asks: ask_tx,
        answers: answer_rx,
        waker: reactors.waker(0).unwrap(),
    };
    let len = (BLOCKS * 512) as usize;
    let mut written = vec![None::<u64>; LBAS as usize];
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let (mut worst_io, mut connects) = (Duration::ZERO, 0);
    for round in 0..600 {
        ctrl.poll_admin().expect("admin queue (keep-alive)");
        match next_random(&mut rng) % 8 {
            // A long pause now and then, so that both reactors are well asleep.
            0 => std::thread::sleep(Duration::from_micros(next_random(&mut rng) % 5000)),
            _ => spin_for(Duration::from_nanos(
                next_random(&mut rng) % (3 * QUIET.as_nanos() as u64),
            )),
        }
        let lba = next_random(&mut rng) % LBAS;
        match next_random(&mut rng) % 5 {
            0 => {
                // A second host comes and goes while the first one's reactors sleep.
                let c =
                    TcpController::connect(ConnectOptions::new(t.addr, NQN, HOSTNQN), p.clone())
                        .unwrap_or_else(|e| panic!("round {round}: connect: {e}"));
                c.shutdown().expect("disconnect");
                connects += 1;
            }
            1 | 2 => {
                let mut buf = p.alloc(len).unwrap();
                fill_pattern(buf.as_mut_slice(), round as u64);
                let (_, took) = host.io(round, IoOp::Write, lba, buf);
                written[lba as usize] = Some(round as u64);
                worst_io = worst_io.max(took);
            }
            _ => {
                let (buf, took) = host.io(round, IoOp::Read, lba, p.alloc(len).unwrap());
                worst_io = worst_io.max(took);
                if let Some(seed) = written[lba as usize] {
                    let mut want = vec![0u8; len];
                    fill_pattern(&mut want, seed);
                    assert!(
                        buf.as_slice() == want,
                        "round {round}: LBA {lba} reads back wrong"
                    );
                }
            }
        }
    }
    // Idle through three keep-alive timeouts: the target must take the keep-alives (its reactor asleep) and
    // keep the controller; both reactors sleep nearly all the time.
    let before = (t.reactor_stats()[0], reactors.stats()[0]);
    let idle_start = Instant::now();
    while idle_start.elapsed() < Duration::from_secs(3) {
        ctrl.poll_admin().expect("admin queue (keep-alive)");
        std::thread::sleep(Duration::from_millis(50));
    }
    // A sleep is added to the counters as it ends: the I/O that ends it comes first.
    let (_, took) = host.io(usize::MAX, IoOp::Read, 0, p.alloc(len).unwrap());
    let window = idle_start.elapsed();
    let after = (t.reactor_stats()[0], reactors.stats()[0]);
    let c = t.counters();
    assert_eq!(c.keep_alive_expired, 0, "{c}");
    let slept = |a: nvpoll::reactor::ReactorStats, b: nvpoll::reactor::ReactorStats| {
        (b.slept - a.slept).as_secs_f64() / window.as_secs_f64()
    };
    let (target_slept, host_slept) = (slept(before.0, after.0), slept(before.1, after.1));
    eprintln!(
        "600 rounds ({connects} connects): worst I/O {worst_io:?}; after the idle window, the first I/O \
         took {took:?}; asleep {:.1}% (target) and {:.1}% (initiator) of the {window:?} before it",
        100.0 * target_slept,
        100.0 * host_slept
    );
    // A reactor that slept through the window sleeps well over half of it even on a loaded machine; one
    // that never sleeps (a poller that cannot say what wakes it) gives 0.
    assert!(
        target_slept > 0.5,
        "the target reactor slept {target_slept:.2} of the window"
    );
    assert!(
        host_slept > 0.5,
        "the initiator reactor slept {host_slept:.2} of the window"
    );
    reactors.stop().expect("initiator reactors stop");
    ctrl.shutdown().expect("disconnect");
}

//! Reactor costs: a message round trip (bench thread <-> reactor, and reactor <-> reactor), one poll
//! iteration, and a DMA buffer alloc + free.
//!
//! `cargo bench --bench reactor`. Each reactor set is started for one benchmark and stopped after it, so that
//! spinning reactors never compete with each other.

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use nvpoll::mem::{DmaPool, HugepageMode};
use nvpoll::reactor::{CoreList, PollStatus, ReactorContext, Reactors};

fn one_core(core: usize) -> CoreList {
    CoreList::parse(&core.to_string()).unwrap()
}

/// The bench thread sends a message to a reactor on another core, which answers by storing a sequence number
/// the bench thread spins on.
fn thread_round_trip(c: &mut Criterion) {
    static SEEN: AtomicU64 = AtomicU64::new(0);
    let all = CoreList::all();
    let reactors = Reactors::start(&one_core(*all.cores().last().unwrap())).unwrap();
    let mut seq = 0u64;
    c.bench_function("message round trip: thread -> reactor -> thread", |b| {
        b.iter(|| {
            seq += 1;
            let s = seq;
            reactors
                .send(0, move |_| SEEN.store(s, Ordering::Release))
                .unwrap();
            while SEEN.load(Ordering::Acquire) != s {
                std::hint::spin_loop();
            }
        })
    });
    reactors.stop().unwrap();
}

fn bounce(ctx: &mut ReactorContext, left: u64, start: Instant, done: mpsc::Sender<Duration>) {
    if left == 0 {
        done.send(start.elapsed()).unwrap();
        return;
    }
    let other = (ctx.index() + 1) % ctx.reactor_count();
    ctx.send(other, move |ctx| bounce(ctx, left - 1, start, done))
        .unwrap();
}

/// One message goes from reactor 0 to reactor 1 and back, `iters` times.
fn reactor_round_trip(c: &mut Criterion) {
    let all = CoreList::all();
    if all.len() < 2 {
        eprintln!("skipping reactor <-> reactor round trip: needs two cores");
        return;
    }
    let pair = CoreList::parse(&format!("{},{}", all.cores()[0], all.cores()[1])).unwrap();
    let reactors = Reactors::start(&pair).unwrap();
    c.bench_function("message round trip: reactor -> reactor -> reactor", |b| {
        b.iter_custom(|iters| {
            let (tx, rx) = mpsc::channel();
            reactors
                .send(0, move |ctx| bounce(ctx, 2 * iters, Instant::now(), tx))
                .unwrap();
            rx.recv().unwrap()
        })
    });
    reactors.stop().unwrap();
}

/// A reactor with one idle poller and nothing else to do: the cost of one turn of its loop.
fn poll_iteration(c: &mut Criterion) {
    let all = CoreList::all();
    let reactors = Reactors::start(&one_core(*all.cores().last().unwrap())).unwrap();
    c.bench_function("poll iteration (one idle poller)", |b| {
        b.iter_custom(|iters| {
            let (tx, rx) = mpsc::channel();
            reactors
                .send(0, move |ctx| {
                    let mut polls = 0u64;
                    let mut start = Instant::now();
                    let me = std::rc::Rc::new(std::cell::Cell::new(None));
                    let me2 = std::rc::Rc::clone(&me);
                    let id = ctx.add_poller(move |ctx: &mut ReactorContext| {
                        if polls == 0 {
                            start = Instant::now();
                        }
                        polls += 1;
                        if polls == iters + 1 {
                            tx.send(start.elapsed()).unwrap();
                            ctx.remove_poller(me2.get().unwrap());
                        }
                        PollStatus::Idle
                    });
                    me.set(Some(id));
                })
                .unwrap();
            rx.recv().unwrap()
        })
    });
    reactors.stop().unwrap();
}

fn dma_alloc_free(c: &mut Criterion) {
    let pool = DmaPool::builder()
        .class(4096, 1024)
        .hugepages(HugepageMode::Off)
        .build()
        .unwrap();
    c.bench_function("DMA buffer alloc + free (4 KiB)", |b| {
        b.iter(|| black_box(pool.alloc(black_box(4096)).unwrap()))
    });
}

// criterion_group! makes an undocumented `pub fn`: kept in a module of its own, it is not public.
mod group {
    use super::*;
    criterion_group! {
        name = benches;
        config = Criterion::default()
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(1))
            .sample_size(20);
        targets = thread_round_trip, reactor_round_trip, poll_iteration, dma_alloc_free
    }
}
criterion_main!(group::benches);

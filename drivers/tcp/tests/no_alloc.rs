//! The steady-state I/O path allocates nothing, on either side: our initiator and our target (in this process,
//! on a reactor) exchange 4 KiB reads and writes, plain and with TLS, under a counting global allocator.

use nvpoll_testkit::target as target_common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nvpoll::api::{Controller, IoOp, IoRequest, QueuePair};
use nvpoll::reactor::{CoreList, Reactors};
use nvpoll::send::SendMode;
use nvpoll_target::TargetTls;
use nvpoll_target::{Backing, SubsystemConfig, Target, TargetConfig};
use nvpoll_tcp::host::{ConnectOptions, TcpController, TcpQueuePair};
use nvpoll_tcp::tls::{ConfiguredKey, IdentityVersion};
use target_common::{pool, HOSTNQN, NQN, NS1_BYTES, NS2_BYTES};

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// Set on the initiator's thread and on the target's reactor while measuring: only their allocations
    /// count, not those of unrelated threads of the test harness (a const, drop-free thread local: reading it
    /// never allocates).
    static COUNTING: Cell<bool> = const { Cell::new(false) };
}

// SAFETY: every method forwards to the system allocator unchanged; counting touches no allocation.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if COUNTING.try_with(Cell::get).unwrap_or(false) {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const KEY: &str = "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:";

/// `rounds` batches of 32 commands (alternating writes and reads of 4 KiB) through `qp`, waiting for each batch.
fn run(qp: &mut TcpQueuePair, bufs: &mut Vec<nvpoll::mem::DmaBuf>, rounds: u64) {
    for r in 0..rounds {
        let op = if r % 2 == 0 { IoOp::Write } else { IoOp::Read };
        for (i, b) in bufs.drain(..).enumerate() {
            let req = IoRequest {
                op,
                nsid: 2,
                lba: i as u64,
                blocks: 1,
                buf: Some(b),
                tag: i as u64,
            };
            qp.submit(req).map_err(|r| r.error).unwrap();
        }
        qp.flush().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while bufs.len() < 32 {
            qp.poll(64).unwrap();
            while let Some(c) = qp.pop_completion() {
                c.result.unwrap();
                bufs.push(c.buf.unwrap());
            }
            assert!(Instant::now() < deadline, "completions did not arrive");
        }
    }
}

/// The counter is shared: the tests of this file take turns.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn no_allocations(tls: bool) {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let key = ConfiguredKey::parse(KEY).unwrap();
    let subsys = SubsystemConfig::new(NQN)
        .namespace(Backing::Ram(NS1_BYTES), 512)
        .namespace(Backing::Ram(NS2_BYTES), 4096);
    let mut config = TargetConfig::new("127.0.0.1:0".parse().unwrap()).subsystem(subsys);
    if tls {
        config.tls = Some(TargetTls::with_host_keys(
            true,
            &[(HOSTNQN.to_string(), key.clone())],
            &[NQN.to_string()],
        ));
    }
    let reactors = Reactors::start(&"0".parse::<CoreList>().unwrap()).unwrap();
    let handle = Target::bind(config).unwrap().start(&reactors).unwrap();
    // Switch counting on the target's reactor with a plain message and an atomic acknowledgement: the
    // message is allocated here (not counted) and nothing on the reactor allocates to answer.
    let counting_on_target = |on: bool| {
        let ack = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let done = std::sync::Arc::clone(&ack);
        reactors
            .send(0, move |_| {
                COUNTING.with(|c| c.set(on));
                done.store(true, Ordering::Release);
            })
            .unwrap();
        while !ack.load(Ordering::Acquire) {
            std::hint::spin_loop();
        }
    };
    let p = pool();
    let mut o = ConnectOptions::new(handle.local_addr(), NQN, HOSTNQN);
    if tls {
        o = o.with_tls_key(&key, IdentityVersion::V0);
    }
    // Keep-alive would allocate nothing either, but it runs on the admin queue, not the I/O path.
    o.kato = Duration::from_secs(60);
    let mut ctrl = TcpController::connect(o, p.clone()).unwrap();
    for mode in SendMode::ALL {
        let mut qp = ctrl.create_queue_pair(32).unwrap();
        qp.set_send_mode(mode).unwrap();
        let mut bufs: Vec<_> = (0..32).map(|_| p.alloc(4096).unwrap()).collect();
        // Warm up: buffers grow to their working size, the target's session settles.
        run(&mut qp, &mut bufs, 20);
        let before = ALLOCS.load(Ordering::Relaxed);
        counting_on_target(true);
        COUNTING.with(|c| c.set(true));
        run(&mut qp, &mut bufs, 100);
        COUNTING.with(|c| c.set(false));
        counting_on_target(false);
        let allocs = ALLOCS.load(Ordering::Relaxed) - before;
        assert_eq!(
            allocs, 0,
            "{mode} (tls {tls}): 3200 I/Os allocated {allocs} times"
        );
    }
}

#[test]
fn plain_io_path_does_not_allocate() {
    no_allocations(false);
}

#[test]
fn tls_io_path_does_not_allocate() {
    no_allocations(true);
}

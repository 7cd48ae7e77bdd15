//! nvpoll's async interface (`nvpoll::aio`) over NVMe/TCP against our target, with and without TLS: futures
//! driven by our `LocalExecutor`, and by tokio (another executor) sleeping on the queue's completion fd.

use nvpoll_testkit::target as target_common;

use std::cell::Cell;
use std::future::poll_fn;
use std::rc::Rc;
use std::sync::mpsc;
use std::task::Poll;
use std::time::{Duration, Instant};

use nvpoll::aio::{AsyncQueue, LocalExecutor};
use nvpoll::api::{Controller, Namespace, QueuePair};
use nvpoll::mem::DmaPool;
use nvpoll::reactor::{CoreList, IdlePolicy, Reactors};
use nvpoll_target::TargetTls;
use nvpoll_tcp::host::{ConnectOptions, TcpController, TcpQueuePair};
use nvpoll_tcp::tls::{ConfiguredKey, IdentityVersion};
use target_common::{fill_pattern, pool, TestTarget, HOSTNQN, NQN};

/// Test vector of the interchange format (shared/notes/tls-psk.md); a test-only key.
const KEY: &str = "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:";

fn connect(t: &TestTarget, tls: bool) -> TcpController {
    let mut o = ConnectOptions::new(t.addr, NQN, HOSTNQN);
    if tls {
        o = o.with_tls_key(&ConfiguredKey::parse(KEY).unwrap(), IdentityVersion::V1);
    }
    TcpController::connect(o, pool()).expect("attach")
}

fn tls_target() -> TestTarget {
    TestTarget::start(|mut c| {
        let key = ConfiguredKey::parse(KEY).unwrap();
        c.tls = Some(TargetTls::with_host_keys(
            true,
            &[(HOSTNQN.to_string(), key)],
            &[NQN.to_string()],
        ));
        c
    })
}

/// `writers` tasks, each writing its own blocks with a pattern and reading them back `rounds` times; returns
/// the I/Os done. Panics on any failed I/O or wrong data.
fn workers(
    ex_spawn: &mut dyn FnMut(std::pin::Pin<Box<dyn std::future::Future<Output = ()>>>),
    q: &AsyncQueue<TcpQueuePair>,
    p: &DmaPool,
    ns: &Namespace,
    writers: u64,
    rounds: u64,
    done: &Rc<Cell<u64>>,
) {
    let (nsid, blocks) = (ns.nsid, 4096 / ns.block_size);
    for w in 0..writers {
        let (q, p, done) = (q.clone(), p.clone(), Rc::clone(done));
        ex_spawn(Box::pin(async move {
            for r in 0..rounds {
                let lba = (w * rounds + r) * u64::from(blocks);
                let mut buf = p.alloc(4096).unwrap();
                fill_pattern(buf.as_mut_slice(), w * 1000 + r);
                let expect = buf.as_slice().to_vec();
                let c = q.write(nsid, lba, blocks, buf).await;
                c.result.unwrap_or_else(|e| panic!("write {w}/{r}: {e}"));
                let c = q.read(nsid, lba, blocks, p.alloc(4096).unwrap()).await;
                c.result.unwrap_or_else(|e| panic!("read {w}/{r}: {e}"));
                assert!(
                    c.buf.unwrap().as_slice() == expect.as_slice(),
                    "writer {w} round {r}: other data read back"
                );
                done.set(done.get() + 2);
            }
        }));
    }
}

fn local_executor(tls: bool) {
    let t = if tls {
        tls_target()
    } else {
        TestTarget::start(|c| c)
    };
    let mut ctrl = connect(&t, tls);
    let ns = ctrl.namespaces()[0].clone();
    let p = ctrl.pool().clone();
    let q = AsyncQueue::new(ctrl.create_queue_pair(8).unwrap());
    let mut ex = LocalExecutor::new();
    ex.drive(&q);
    let done = Rc::new(Cell::new(0));
    // 16 writers on a queue of depth 8: half of them wait for room at any time.
    workers(&mut |f| ex.spawn(f), &q, &p, &ns, 16, 20, &done);
    let deadline = Instant::now() + Duration::from_secs(60);
    while ex.tasks() > 0 {
        ex.pass();
        ctrl.poll_admin().unwrap();
        assert!(Instant::now() < deadline, "{} tasks left", ex.tasks());
    }
    assert!(ex.take_error().is_none());
    assert_eq!(done.get(), 16 * 20 * 2);
    assert_eq!(q.outstanding(), 0);
    let s = q.with_queue_pair(|qp| qp.stats());
    assert_eq!(
        s.commands,
        16 * 20 * 2 + 1,
        "each I/O once, and the queue's Connect: {s:?}"
    );
    drop(q);
    ctrl.shutdown().unwrap();
}

#[test]
fn futures_on_our_local_executor() {
    local_executor(false);
}

#[test]
fn futures_on_our_local_executor_with_tls() {
    local_executor(true);
}

/// The driver of another executor: sends and reaps while there is work, and otherwise sleeps on the completion
/// fd until the queue pair's socket is readable, a future submits (the driver waker), or its deadline passes.
async fn tokio_driver(q: AsyncQueue<TcpQueuePair>, stop: Rc<Cell<bool>>, sleeps: Rc<Cell<u64>>) {
    // `new` is deprecated for types that may not keep their descriptor (tokio #8587); an OwnedFd does, for
    // as long as the AsyncFd owns it, so the safe constructor is sound here.
    #[allow(deprecated)]
    let fd = tokio::io::unix::AsyncFd::new(q.completion_fd().unwrap()).unwrap();
    loop {
        let n = q.poll(64).unwrap();
        if stop.get() && q.outstanding() == 0 {
            return;
        }
        if n > 0 || q.has_unsent() {
            tokio::task::yield_now().await;
            continue;
        }
        let deadline = q.arm().unwrap();
        let ready = poll_fn(|cx| {
            q.set_driver_waker(cx.waker());
            if q.has_unsent() || stop.get() {
                return Poll::Ready(());
            }
            match fd.poll_read_ready(cx) {
                Poll::Ready(Ok(mut guard)) => {
                    guard.clear_ready();
                    Poll::Ready(())
                }
                Poll::Ready(Err(e)) => panic!("the completion fd: {e}"),
                Poll::Pending => Poll::Pending,
            }
        });
        let wait = deadline.map_or(Duration::from_secs(1), |d| {
            d.saturating_duration_since(Instant::now())
        });
        sleeps.set(sleeps.get() + 1);
        let _ = tokio::time::timeout(wait, ready).await;
    }
}

#[test]
fn futures_on_tokio_through_the_completion_fd() {
    let t = tls_target();
    let mut ctrl = connect(&t, true);
    let ns = ctrl.namespaces()[0].clone();
    let p = ctrl.pool().clone();
    let q = AsyncQueue::new(ctrl.create_queue_pair(16).unwrap());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let local = tokio::task::LocalSet::new();
    let done = Rc::new(Cell::new(0));
    let stop = Rc::new(Cell::new(false));
    let sleeps = Rc::new(Cell::new(0));
    local.block_on(&rt, async {
        let driver = tokio::task::spawn_local(tokio_driver(
            q.clone(),
            Rc::clone(&stop),
            Rc::clone(&sleeps),
        ));
        let mut handles = Vec::new();
        workers(
            &mut |f| handles.push(tokio::task::spawn_local(f)),
            &q,
            &p,
            &ns,
            8,
            25,
            &done,
        );
        for h in handles {
            h.await.expect("a worker task");
        }
        stop.set(true);
        driver.await.expect("the driver task");
    });
    assert_eq!(done.get(), 8 * 25 * 2);
    // It slept between completions rather than spinning: each sleep waits for the socket or a submission.
    assert!(sleeps.get() > 0, "the driver never slept");
    assert_eq!(q.outstanding(), 0);
    drop(q);
    ctrl.shutdown().unwrap();
}

/// The executor as a poller on one of our reactors, with the queue pair moved there: 8 tasks write and read
/// back, each reporting from the reactor when it ends. Returns the reactors, still running, and the
/// controller (for `quiet`: the reactor must then go to sleep, which it can only do if the executor says what
/// wakes it).
fn on_a_reactor(idle: IdlePolicy) -> (Reactors, TcpController, TestTarget) {
    let t = TestTarget::start(|c| c);
    let mut ctrl = connect(&t, false);
    let ns = ctrl.namespaces()[0].clone();
    let p = ctrl.pool().clone();
    let qp = ctrl.create_queue_pair(8).unwrap();
    let reactors = Reactors::builder()
        .idle(idle)
        .start(&CoreList::parse("0").unwrap())
        .unwrap();
    let (tx, rx) = mpsc::channel();
    reactors
        .send(0, move |ctx| {
            let q = AsyncQueue::new(qp);
            let mut ex = LocalExecutor::new();
            ex.drive(&q);
            let done = Rc::new(Cell::new(0));
            // Each worker says when it ends, from the reactor (no task spins waiting for the others).
            workers(
                &mut |f| {
                    let tx = tx.clone();
                    ex.spawn(async move {
                        f.await;
                        tx.send(()).expect("the test waits");
                    })
                },
                &q,
                &p,
                &ns,
                8,
                10,
                &done,
            );
            ctx.add_poller(ex);
        })
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut ended = 0;
    while ended < 8 {
        ctrl.poll_admin().unwrap();
        match rx.recv_timeout(Duration::from_millis(10)) {
            Ok(()) => ended += 1,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                assert!(Instant::now() < deadline, "{ended} of 8 tasks ended")
            }
            Err(e) => panic!("{e}"),
        }
    }
    (reactors, ctrl, t)
}

#[test]
fn futures_on_a_polling_reactor() {
    let (reactors, ctrl, _t) = on_a_reactor(IdlePolicy::Poll);
    reactors.stop().unwrap();
    ctrl.shutdown().unwrap();
}

/// A hybrid reactor with the executor as its poller goes to sleep once the tasks are done: the executor says
/// what wakes it (the queue's completion fd and deadline). Were it to say nothing, the reactor would poll on.
#[test]
fn futures_on_a_hybrid_reactor_that_then_sleeps() {
    let (reactors, mut ctrl, _t) = on_a_reactor(IdlePolicy::Hybrid {
        quiet: Duration::from_micros(50),
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        ctrl.poll_admin().unwrap();
        let s = reactors.stats()[0];
        if s.sleeps > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the reactor never slept: {s:?}");
        std::thread::yield_now();
    }
    reactors.stop().unwrap();
    ctrl.shutdown().unwrap();
}

//! DMA pool: layout, windows, IOVA, exhaustion, contention from reactors, hugepages and the fallback warning.

use std::collections::HashSet;
use std::fs::OpenOptions;
use std::io::Write;
use std::sync::mpsc;
use std::sync::{Mutex, MutexGuard};

use nvpoll::mem::{
    hugepage_status, DmaBuf, DmaPool, HugepageMode, PageKind, HUGEPAGE_SIZE, PAGE_SIZE,
};
use nvpoll::reactor::{CoreList, PollStatus, ReactorContext, Reactors};
use nvpoll::Error;

const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";
const FALLBACK_CHILD: &str = "NVPOLL_TEST_FALLBACK_CHILD";

/// Serialises the tests whose outcome depends on how many hugepages are free.
fn hugepage_lock() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn small_pool(count: usize) -> DmaPool {
    DmaPool::builder()
        .class(PAGE_SIZE, count)
        .hugepages(HugepageMode::Off)
        .build()
        .unwrap()
}

#[test]
fn buffers_are_aligned_distinct_and_returned_on_drop() {
    let pool = DmaPool::builder()
        .class(4096, 8)
        .class(16384, 4)
        .class(1 << 20, 2)
        .hugepages(HugepageMode::Off)
        .build()
        .unwrap();
    let mut bufs = Vec::new();
    for (len, count, capacity) in [(1, 8, 4096), (4097, 4, 16384), (300_000, 2, 1 << 20)] {
        for _ in 0..count {
            let buf = pool.alloc(len).unwrap();
            assert_eq!(buf.len(), len);
            assert_eq!(buf.capacity(), capacity);
            assert_eq!(
                buf.as_ptr() as usize % capacity,
                0,
                "{buf:?} is not aligned to its size"
            );
            // IOVA = VA until a backend maps the pool.
            assert_eq!(buf.iova(), buf.as_ptr() as u64);
            bufs.push(buf);
        }
        assert_eq!(pool.available(len), 0);
    }
    let starts: HashSet<usize> = bufs.iter().map(|b| b.as_ptr() as usize).collect();
    assert_eq!(starts.len(), bufs.len());
    let region = pool.regions()[0];
    assert_eq!(region.vaddr % HUGEPAGE_SIZE, 0);
    // Ordinary pages: only what the classes need (8 × 4 KiB + 4 × 16 KiB + 2 × 1 MiB), yet aligned to 2 MiB.
    assert_eq!(region.len, 8 * 4096 + 4 * 16384 + (2 << 20));
    for buf in &bufs {
        let start = buf.as_ptr() as usize;
        assert!(start >= region.vaddr && start + buf.capacity() <= region.vaddr + region.len);
    }
    drop(bufs);
    assert_eq!(
        (
            pool.available(1),
            pool.available(16384),
            pool.available(1 << 20)
        ),
        (8, 4, 2)
    );
}

#[test]
fn exhaustion_and_oversize_are_typed_errors() {
    let pool = small_pool(4);
    let mut bufs: Vec<DmaBuf> = (0..4).map(|_| pool.alloc(4096).unwrap()).collect();
    match pool.alloc(100) {
        Err(Error::Memory(msg)) => assert!(msg.contains("exhausted"), "{msg}"),
        other => panic!("expected Error::Memory, got {other:?}"),
    }
    assert!(matches!(pool.alloc(8192), Err(Error::InvalidArgument(_))));
    bufs.pop();
    assert!(pool.alloc(4096).is_ok());
}

#[test]
fn bad_classes_are_rejected() {
    for builder in [
        DmaPool::builder(),
        DmaPool::builder().class(1000, 1),
        DmaPool::builder().class(2048, 1),
        DmaPool::builder().class(4096, 0),
    ] {
        let result = builder.hugepages(HugepageMode::Off).build();
        assert!(
            matches!(result, Err(Error::InvalidArgument(_))),
            "{result:?}"
        );
    }
    // The same size twice adds up.
    let pool = DmaPool::builder()
        .class(4096, 2)
        .class(4096, 3)
        .hugepages(HugepageMode::Off)
        .build()
        .unwrap();
    assert_eq!(pool.available(4096), 5);
}

#[test]
fn visible_window_moves_inside_the_capacity() {
    let pool = small_pool(1);
    let mut buf = pool.alloc(4096).unwrap();
    for (i, b) in buf.iter_mut().enumerate() {
        *b = i as u8;
    }
    let base = buf.iova();
    buf.set_window(3, 100).unwrap();
    assert_eq!((buf.offset(), buf.len()), (3, 100));
    assert_eq!(buf.iova(), base + 3);
    assert_eq!(buf[0], 3);
    assert_eq!(buf.as_slice().len(), 100);
    buf.set_len(4093).unwrap();
    assert_eq!(buf.as_mut_slice().len(), 4093);
    assert!(matches!(buf.set_len(4094), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        buf.set_window(usize::MAX, 2),
        Err(Error::InvalidArgument(_))
    ));
    assert!(buf.set_window(4096, 0).is_ok());
    assert!(buf.is_empty());
    let debug = format!("{buf:?}");
    assert!(
        debug.contains("iova") && debug.contains("capacity: 4096"),
        "{debug}"
    );
}

#[test]
fn map_iova_translates_every_buffer() {
    let pool = DmaPool::builder()
        .class(4096, 4)
        .class(8192, 4)
        .hugepages(HugepageMode::Off)
        .build()
        .unwrap();
    let before = pool.alloc(8192).unwrap();
    let offset_before = before.as_ptr() as u64 - pool.regions()[0].vaddr as u64;
    let mut seen = Vec::new();
    pool.map_iova(|region| {
        seen.push(*region);
        Ok(0x1_0000_0000)
    })
    .unwrap();
    assert_eq!(seen.len(), 1);
    assert_eq!(pool.regions()[0].iova, 0x1_0000_0000);
    assert_eq!(before.iova(), 0x1_0000_0000 + offset_before);
    let mut after = pool.alloc(4096).unwrap();
    after.set_window(512, 512).unwrap();
    let offset_after = after.as_ptr() as u64 - pool.regions()[0].vaddr as u64;
    assert_eq!(after.iova(), 0x1_0000_0000 + offset_after);
    // A failing backend leaves the mapping alone and reports its error.
    let failed = pool.map_iova(|_| Err(Error::Memory("no IOMMU".into())));
    assert!(matches!(failed, Err(Error::Memory(_))));
    assert_eq!(pool.regions()[0].iova, 0x1_0000_0000);
}

#[test]
fn dma_buf_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<DmaBuf>();
    assert_send_sync::<DmaPool>();
}

/// Every reactor allocates bursts, stamps and checks them, and hands half of them to the next reactor to free;
/// the test thread competes too. No buffer may be handed out twice, and all come back.
#[test]
fn pool_under_contention_from_reactors() {
    const ROUNDS: u64 = 5_000;
    const BURST: usize = 12;
    let pool = DmaPool::builder()
        .class(4096, 32)
        .class(65536, 8)
        .hugepages(HugepageMode::Off)
        .build()
        .unwrap();
    let reactors = Reactors::start(&CoreList::all()).unwrap();
    let (done_tx, done_rx) = mpsc::channel::<Result<u64, String>>();
    for index in 0..reactors.len() {
        let (pool, done) = (pool.clone(), done_tx.clone());
        reactors
            .send(index, move |ctx| {
                let mut round = 0u64;
                let mut exhausted = 0u64;
                ctx.add_poller(move |ctx: &mut ReactorContext| {
                    if round == ROUNDS {
                        return PollStatus::Idle;
                    }
                    let mut held = Vec::with_capacity(BURST);
                    for i in 0..BURST {
                        let len = if i % 4 == 0 { 65536 } else { 4096 };
                        match pool.alloc(len) {
                            Ok(mut buf) => {
                                let stamp = (ctx.index() as u64) << 48 | round << 8 | i as u64;
                                buf[..8].copy_from_slice(&stamp.to_le_bytes());
                                let end = buf.len() - 8;
                                buf[end..].copy_from_slice(&stamp.to_le_bytes());
                                held.push((stamp, buf));
                            }
                            Err(Error::Memory(_)) => exhausted += 1,
                            Err(e) => {
                                let _ = done.send(Err(format!("unexpected error {e}")));
                                round = ROUNDS;
                                return PollStatus::Idle;
                            }
                        }
                    }
                    for (stamp, buf) in &held {
                        let end = buf.len() - 8;
                        if buf[..8] != stamp.to_le_bytes() || buf[end..] != stamp.to_le_bytes() {
                            let _ = done.send(Err(format!("buffer {buf:?} shared by two owners")));
                        }
                    }
                    // Free half here and half on the next reactor.
                    let away: Vec<DmaBuf> = held.drain(..).map(|(_, b)| b).step_by(2).collect();
                    let next = (ctx.index() + 1) % ctx.reactor_count();
                    let _ = ctx.send(next, move |_| drop(away));
                    round += 1;
                    if round == ROUNDS {
                        let _ = done.send(Ok(exhausted));
                    }
                    PollStatus::Busy
                });
            })
            .unwrap();
    }
    // The test thread competes for the same buffers meanwhile.
    let mut finished = 0;
    let mut mine = 0u64;
    while finished < reactors.len() {
        if let Ok(buf) = pool.alloc(4096) {
            mine += 1;
            drop(buf);
        }
        match done_rx.try_recv() {
            Ok(Ok(_exhausted)) => finished += 1,
            Ok(Err(why)) => panic!("{why}"),
            Err(mpsc::TryRecvError::Empty) => std::thread::yield_now(),
            Err(mpsc::TryRecvError::Disconnected) => panic!("a reactor dropped its poller"),
        }
    }
    let stats = reactors.stop().unwrap();
    assert!(stats.iter().all(|s| s.busy >= ROUNDS), "{stats:?}");
    assert!(mine > 0);
    // Every buffer came back, including those freed by messages drained at stop.
    assert_eq!((pool.available(4096), pool.available(65536)), (32, 8));
}

/// Puts nr_hugepages back as it was when dropped, also when the test fails.
struct RestoreNrHugepages(u64);

impl Drop for RestoreNrHugepages {
    fn drop(&mut self) {
        if let Err(e) = std::fs::write(NR_HUGEPAGES, self.0.to_string()) {
            eprintln!("could not restore {NR_HUGEPAGES} to {}: {e}", self.0);
        }
    }
}

/// The kernel page size and hugetlb usage of the mapping that starts at `vaddr`, from /proc/self/smaps.
fn smaps_of(vaddr: usize) -> (u64, u64) {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let start = format!("{vaddr:x}-");
    let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&start));
    assert!(lines.next().is_some(), "no mapping at {vaddr:#x} in smaps");
    let mut kernel_page_kb = 0;
    let mut hugetlb_kb = 0;
    // The mapping's fields run up to the next header line, whose first word is an address range.
    let is_field = |l: &&str| {
        l.split_whitespace()
            .next()
            .is_some_and(|w| w.ends_with(':'))
    };
    for line in lines.take_while(is_field) {
        let value = |l: &str| -> u64 {
            l.split_whitespace()
                .nth(1)
                .unwrap_or("0")
                .parse()
                .unwrap_or(0)
        };
        if line.starts_with("KernelPageSize:") {
            kernel_page_kb = value(line);
        } else if line.starts_with("Private_Hugetlb:") || line.starts_with("Shared_Hugetlb:") {
            hugetlb_kb += value(line);
        }
    }
    (kernel_page_kb, hugetlb_kb)
}

#[test]
fn hugepages_are_used_when_reserved() {
    let _lock = hugepage_lock();
    if let Err(e) = OpenOptions::new().write(true).open(NR_HUGEPAGES) {
        eprintln!(
            "SKIPPED hugepages_are_used_when_reserved: cannot write {NR_HUGEPAGES} ({e}); run the tests as \
             root to reserve hugepages"
        );
        return;
    }
    let before = hugepage_status(HUGEPAGE_SIZE).unwrap();
    let _restore = RestoreNrHugepages(before.total);
    // The pool needs 2 pages (1 MiB + 1 MiB + 1 MiB, rounded up); reserve a few more for other processes.
    let mut file = OpenOptions::new().write(true).open(NR_HUGEPAGES).unwrap();
    write!(file, "{}", before.total + 4).unwrap();
    drop(file);
    let reserved = hugepage_status(HUGEPAGE_SIZE).unwrap();
    if reserved.available() < 2 {
        eprintln!(
            "SKIPPED hugepages_are_used_when_reserved: the kernel found only {} free 2 MiB pages \
             (memory too fragmented; see docs/hugepages.md)",
            reserved.available()
        );
        return;
    }

    let pool = DmaPool::builder()
        .class(4096, 256)
        .class(1 << 20, 2)
        .hugepages(HugepageMode::Require)
        .build()
        .unwrap();
    assert_eq!(pool.page_kind(), PageKind::Huge2M);
    let region = pool.regions()[0];
    assert_eq!(region.len, 2 * HUGEPAGE_SIZE);
    let (kernel_page_kb, hugetlb_kb) = smaps_of(region.vaddr);
    assert_eq!(
        kernel_page_kb, 2048,
        "the pool is not backed by 2 MiB pages"
    );
    assert_eq!(hugetlb_kb, 4096, "the pool's hugepages are not faulted in");
    let mut buf = pool.alloc(1 << 20).unwrap();
    buf.fill(0x5a);
    assert_eq!(buf.iova() % (1 << 20), 0);
    drop(buf);
    drop(pool);
}

/// Prints warnings and errors on stderr as the binaries' logger does (`nvpoll: warning: ...`), without the
/// tools crate: the core crate's tests depend on no other crate of the workspace.
struct StderrWarnings;

static STDERR_WARNINGS: StderrWarnings = StderrWarnings;

impl log::Log for StderrWarnings {
    fn enabled(&self, m: &log::Metadata) -> bool {
        m.level() <= log::Level::Warn
    }

    fn log(&self, r: &log::Record) {
        if self.enabled(r.metadata()) {
            let krate = r.target().split("::").next().unwrap_or("nvpoll");
            let level = if r.level() == log::Level::Warn {
                "warning"
            } else {
                "error"
            };
            eprintln!("{}: {level}: {}", krate.replace('_', "-"), r.args());
        }
    }

    fn flush(&self) {}
}

#[test]
fn falls_back_to_ordinary_pages_with_one_warning() {
    if std::env::var_os(FALLBACK_CHILD).is_some() {
        // The child: three pools, which would each warn if the warning were not once per process. The
        // warning goes through the log facade; a logger of the binaries' shape prints it on stderr.
        log::set_logger(&STDERR_WARNINGS).unwrap();
        log::set_max_level(log::LevelFilter::Warn);
        for _ in 0..3 {
            let pool = DmaPool::builder().class(4096, 4).build().unwrap();
            assert_eq!(pool.page_kind(), PageKind::Normal);
            assert_eq!(pool.regions()[0].vaddr % HUGEPAGE_SIZE, 0);
        }
        return;
    }
    let _lock = hugepage_lock();
    if hugepage_status(HUGEPAGE_SIZE).is_ok_and(|s| s.available() > 0) {
        eprintln!(
            "SKIPPED falls_back_to_ordinary_pages_with_one_warning: this machine has free hugepages"
        );
        return;
    }
    let required = DmaPool::builder()
        .class(4096, 4)
        .hugepages(HugepageMode::Require)
        .build();
    assert!(matches!(required, Err(Error::Memory(_))), "{required:?}");
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "falls_back_to_ordinary_pages_with_one_warning",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(FALLBACK_CHILD, "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child failed: {stderr}");
    let warnings: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("nvpoll: warning:"))
        .collect();
    assert_eq!(warnings.len(), 1, "{stderr}");
    assert!(
        warnings[0].contains("hugepages") && warnings[0].contains("ordinary"),
        "{}",
        warnings[0]
    );
}

#[test]
fn hugepage_status_is_consistent() {
    let status = hugepage_status(HUGEPAGE_SIZE).unwrap();
    assert_eq!(status.page_size, HUGEPAGE_SIZE);
    assert!(status.free <= status.total + status.surplus);
    assert!(status.available() <= status.free);
    assert!(matches!(
        hugepage_status(12345),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn mlock_failure_is_an_error_only_when_required() {
    let build = |required| {
        DmaPool::builder()
            .class(1 << 20, 2)
            .hugepages(HugepageMode::Off)
            .require_mlock(required)
            .build()
    };
    let relaxed = build(false).unwrap();
    match build(true) {
        Ok(pool) => assert!(pool.is_locked() && relaxed.is_locked()),
        // Only where mlock fails (an unprivileged user with a small RLIMIT_MEMLOCK).
        Err(Error::Os { context, .. }) => {
            assert!(!relaxed.is_locked());
            assert!(context.contains("mlock"), "{context}");
        }
        Err(e) => panic!("unexpected {e}"),
    }
}

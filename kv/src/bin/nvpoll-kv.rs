//! `nvpoll-kv`: the example engine's commands. `load` puts keys from concurrent writers through the log
//! (group commit) and reports commits per second and commit latency; with `--acked FILE` it writes each key to
//! FILE once the log has acknowledged it, so that a process killed mid-write can be checked. `verify` reopens
//! the log and checks that every acknowledged key is there with its value, and that every value in the log
//! is whole.

use std::cell::{Cell, RefCell};
use std::io::Write;
use std::rc::Rc;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use nvpoll::aio::{AsyncQueue, LocalExecutor};
use nvpoll::api::{Controller, Namespace, QueuePair};
use nvpoll::mem::DmaPool;
use nvpoll::trid::TransportId;
use nvpoll_kv::file::FileQueuePair;
use nvpoll_kv::{Kv, Wal};
use nvpoll_pcie::PcieOptions;
use nvpoll_tools::cli as common;

/// An example storage engine on nvpoll: a write-ahead log with group commit and a key-value store over it.
///
/// --trid may also be `file:PATH`: the same engine on a file or block device through the kernel (O_DIRECT,
/// pwrite and fdatasync per commit), for comparison with nvpoll's path (scripts/bench-kv-guest.sh).
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
    #[command(flatten)]
    verbosity: common::Verbosity,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Recover the log, then put keys from concurrent writers until each has put its share.
    Load {
        #[command(flatten)]
        target: common::Target,
        /// Concurrent writers (tasks), each waiting for its put to be acknowledged before the next.
        #[arg(long, default_value_t = 8)]
        writers: u64,
        /// Puts per writer.
        #[arg(long, default_value_t = 1000)]
        puts: u64,
        /// Bytes per value (1 to 4000).
        #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u16).range(1..=4000))]
        value_size: u16,
        /// A name for this run, the first part of every key (keys are RUN/WRITER/N).
        #[arg(long, default_value = "run")]
        run: String,
        /// Append each key to this file once the log has acknowledged it (one line, flushed).
        #[arg(long)]
        acked: Option<std::path::PathBuf>,
        /// Start from an empty log: zero its first record (and flush) before recovering; what the log held is
        /// forgotten.
        #[arg(long)]
        fresh: bool,
    },
    /// Recover the log and check it against the keys a `load --acked FILE` wrote.
    Verify {
        #[command(flatten)]
        target: common::Target,
        /// The file of acknowledged keys.
        #[arg(long)]
        acked: std::path::PathBuf,
    },
}

fn main() {
    let args = Args::parse();
    common::run_main("nvpoll-kv", args.verbosity.verbose, || run(args.cmd));
}

/// The value a key always gets: so that any value read back can be checked whole.
fn value_for(key: &[u8], len: usize) -> Vec<u8> {
    let seed = crc32c::crc32c(key);
    (0..len)
        .map(|j| (seed as u8).wrapping_add((j as u8).wrapping_mul(31)) ^ (seed >> 8) as u8)
        .collect()
}

fn run(cmd: Cmd) -> Result<(), String> {
    let target = match &cmd {
        Cmd::Load { target, .. } | Cmd::Verify { target, .. } => target,
    };
    let pool = common::dma_pool(512)?;
    if let Some(path) = target.trid.strip_prefix("file:") {
        // The kernel's block path, for comparison: the same engine on an O_DIRECT file or block device.
        let qp = FileQueuePair::open(std::path::Path::new(path), 64).map_err(|e| e.to_string())?;
        let ns = qp.namespace();
        return drive(qp, ns, pool, cmd, &mut || Ok(()));
    }
    let trid = common::parse_trid(&target.trid)?;
    if let TransportId::Pcie { bdf } = &trid {
        let ctrl = common::open_pcie(*bdf, &pool, PcieOptions::default())?;
        return engine(ctrl, pool, cmd);
    }
    let opts = target.host.connect_options(&trid)?;
    let ctrl = common::connect_tcp(opts, &pool)?;
    engine(ctrl, pool, cmd)
}

fn engine<C>(mut ctrl: C, pool: DmaPool, cmd: Cmd) -> Result<(), String>
where
    C: Controller,
    C::QueuePair: 'static,
{
    let ns = ctrl
        .namespaces()
        .first()
        .cloned()
        .ok_or("the controller has no namespace")?;
    let qp = ctrl.create_queue_pair(64).map_err(|e| e.to_string())?;
    let result = drive(qp, ns, pool, cmd, &mut || {
        ctrl.poll_admin().map_err(|e| e.to_string())
    });
    ctrl.shutdown().map_err(|e| e.to_string())?;
    result
}

/// Recovers the log on `ns` of `qp` and runs `cmd`; `admin` is called about once a second (keep-alive).
fn drive<Q: QueuePair + 'static>(
    qp: Q,
    ns: Namespace,
    pool: DmaPool,
    cmd: Cmd,
    admin: &mut dyn FnMut() -> Result<(), String>,
) -> Result<(), String> {
    let q = AsyncQueue::new(qp);
    let mut ex = LocalExecutor::new();
    ex.drive(&q);
    if let Cmd::Load { fresh: true, .. } = cmd {
        let (q, pool, ns) = (q.clone(), pool.clone(), ns.clone());
        ex.block_on(async move { Wal::erase(&q, &pool, &ns).await })
            .map_err(|e| format!("erasing the log: {e}"))?;
        eprintln!("nvpoll-kv: the log was erased (--fresh)");
    }
    let opened = Instant::now();
    let (wal, rec) = {
        let (q, pool, ns) = (q.clone(), pool.clone(), ns.clone());
        let res = ex.block_on(async move { Wal::recover(q, pool, &ns).await });
        res.map_err(|e| format!("recovering the log: {e}"))?
    };
    eprintln!(
        "nvpoll-kv: recovered {} records, {} entries in {:.2} s; the log ends {}",
        rec.records,
        rec.entries.len(),
        opened.elapsed().as_secs_f64(),
        if rec.torn_tail {
            "at a torn record (ignored)"
        } else {
            "cleanly"
        }
    );
    let result = match cmd {
        Cmd::Verify { acked, .. } => verify(&Kv::from_recovered(&rec), &acked),
        Cmd::Load {
            writers,
            puts,
            value_size,
            run,
            acked,
            ..
        } => load(&mut ex, admin, &wal, writers, puts, value_size, &run, acked),
    };
    drop(wal);
    drop(ex);
    drop(q);
    result
}

fn verify(kv: &Kv, acked: &std::path::Path) -> Result<(), String> {
    let text = std::fs::read_to_string(acked).map_err(|e| format!("{}: {e}", acked.display()))?;
    // Each acknowledged key is one line, written with its newline in one write; a last line without its
    // newline is a write the kill cut short (the key was acknowledged, but which key it was is not whole).
    let (whole, cut) = match text.rfind('\n') {
        Some(end) => (&text[..end + 1], &text[end + 1..]),
        None => ("", text.as_str()),
    };
    if !cut.is_empty() {
        eprintln!(
            "verify: the acked file's last line has no newline (its write was cut short): '{cut}' not checked"
        );
    }
    let mut n = 0u64;
    for key in whole.lines() {
        let v = kv
            .get(key.as_bytes())
            .ok_or_else(|| format!("LOST: key {key} was acknowledged and is not in the log"))?;
        if v != value_for(key.as_bytes(), v.len()).as_slice() {
            return Err(format!("TORN: key {key} has another value"));
        }
        n += 1;
    }
    for (k, v) in kv.iter() {
        if v != value_for(k, v.len()).as_slice() {
            return Err(format!(
                "TORN: key {} has a value it was never given",
                String::from_utf8_lossy(k)
            ));
        }
    }
    println!(
        "verify: {n} acknowledged keys all present, {} keys in the log, every value whole",
        kv.len()
    );
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn load<Q: QueuePair + 'static>(
    ex: &mut LocalExecutor,
    admin: &mut dyn FnMut() -> Result<(), String>,
    wal: &Wal<Q>,
    writers: u64,
    puts: u64,
    value_size: u16,
    run: &str,
    acked: Option<std::path::PathBuf>,
) -> Result<(), String> {
    let acked = match acked {
        Some(p) => {
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .read(true)
                .append(true)
                .open(&p)
                .map_err(|e| format!("{}: {e}", p.display()))?;
            // A process killed mid-line left a last line without its newline: drop that fragment (which
            // key it named is not known), so that our keys start on a line of their own.
            let mut text = String::new();
            std::io::Read::read_to_string(&mut f, &mut text)
                .map_err(|e| format!("{}: {e}", p.display()))?;
            if !text.is_empty() && !text.ends_with('\n') {
                let keep = text.rfind('\n').map_or(0, |i| i + 1);
                eprintln!(
                    "nvpoll-kv: {}: dropping a last line cut short by a kill: '{}'",
                    p.display(),
                    &text[keep..]
                );
                f.set_len(keep as u64)
                    .map_err(|e| format!("{}: {e}", p.display()))?;
            }
            Some(Rc::new(RefCell::new(f)))
        }
        None => None,
    };
    let hist = Rc::new(RefCell::new(
        hdrhistogram::Histogram::<u64>::new(3).map_err(|e| e.to_string())?,
    ));
    let failed = Rc::new(RefCell::new(None::<String>));
    let live = Rc::new(Cell::new(writers));
    for w in 0..writers {
        let (wal, acked, hist, failed, live) = (
            wal.clone(),
            acked.clone(),
            Rc::clone(&hist),
            Rc::clone(&failed),
            Rc::clone(&live),
        );
        let run = run.to_string();
        ex.spawn(async move {
            for i in 0..puts {
                // With its newline, as the acked file takes it (one write: a kill leaves a whole line or a
                // cut last one).
                let line = format!("{run}/{w}/{i}\n");
                let key = line.trim_end_matches('\n');
                let value = value_for(key.as_bytes(), usize::from(value_size));
                let t = Instant::now();
                if let Err(e) = wal.put(key.as_bytes(), &value).await {
                    failed.borrow_mut().get_or_insert(e.to_string());
                    break;
                }
                let _ = hist.borrow_mut().record(t.elapsed().as_nanos() as u64);
                if let Some(f) = &acked {
                    if let Err(e) = f.borrow_mut().write_all(line.as_bytes()) {
                        failed
                            .borrow_mut()
                            .get_or_insert(format!("the acked file: {e}"));
                        break;
                    }
                }
            }
            live.set(live.get() - 1);
            if live.get() == 0 {
                wal.close();
            }
        });
    }
    let committer = Rc::new(RefCell::new(None));
    {
        let (wal, out) = (wal.clone(), Rc::clone(&committer));
        ex.spawn(async move {
            *out.borrow_mut() = Some(wal.run_committer().await);
        });
    }
    let start = Instant::now();
    let mut last = start;
    while ex.tasks() > 0 {
        ex.pass();
        if last.elapsed() >= Duration::from_secs(1) {
            last = Instant::now();
            admin()?;
            let (records, entries) = wal.counts();
            eprintln!("nvpoll-kv: {entries} puts acknowledged in {records} records");
        }
        if failed.borrow().is_some() {
            break;
        }
    }
    if let Some(e) = failed.borrow().clone() {
        return Err(format!("a put failed: {e}"));
    }
    if let Some(Err(e)) = committer.borrow_mut().take() {
        return Err(format!("the committer failed: {e}"));
    }
    let secs = start.elapsed().as_secs_f64();
    let (records, entries) = wal.counts();
    let h = hist.borrow();
    println!(
        "load: {writers} writers, {entries} puts in {records} records ({:.1} per record), {:.0} puts/s, \
         {:.0} commits/s; put latency p50 {:.1} us, p99 {:.1} us",
        entries as f64 / records.max(1) as f64,
        entries as f64 / secs,
        records as f64 / secs,
        h.value_at_quantile(0.5) as f64 / 1000.0,
        h.value_at_quantile(0.99) as f64 / 1000.0
    );
    Ok(())
}

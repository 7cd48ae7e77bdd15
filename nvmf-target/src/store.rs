//! What holds a namespace's blocks: RAM, or a file or block device.
//!
//! A [`Store`] is shared by every connection that reaches its namespace, on any reactor, so all its methods take
//! `&self`. Reads and writes are plain copies (RAM) or `pread`/`pwrite` through the page cache (files); neither
//! waits on the device. The one slow operation, making writes durable (`fdatasync`), runs on a helper thread:
//! [`Store::start_flush`] hands out a ticket and [`Store::flush_status`] is polled until the ticket is done, so a
//! reactor never blocks on it.

use std::fs::File;
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// Size of one independently locked piece of a RAM store.
const RAM_SEGMENT: usize = 64 * 1024;

/// RAM stores of this size or more take writes with streaming stores ([`nvpoll::mem::copy_nontemporal`]): a
/// block written at random into them has left the cache before it is read again, so caching it on the way in
/// only costs the read of each line before it is overwritten. On the 2-vCPU development VM, random 4 KiB copies
/// took 152-239 ns cached and 366-375 ns streaming into 16-64 MiB, and 409-477 ns cached against 366 ns
/// streaming into 128-256 MiB; 4 KiB TLS randwrite at qd128 into a 256 MiB RAM namespace went from about 630K
/// to 750K IOPS (plain: 785K to 1.01M).
const STREAMING_MIN_STORE: u64 = 128 << 20;

/// The longest range [`Store::with_ram_slices`] lends out at once.
pub(crate) const DIRECT_READ_MAX: usize = 128 * 1024;

/// The most segments such a range touches.
const DIRECT_SEGMENTS: usize = DIRECT_READ_MAX / RAM_SEGMENT + 1;

/// What an unwritten RAM segment reads as.
static RAM_ZEROES: [u8; RAM_SEGMENT] = [0; RAM_SEGMENT];

/// A zeroed buffer used to write zeroes to files.
const ZERO_CHUNK: usize = 128 * 1024;

/// The blocks of one namespace.
#[derive(Debug)]
pub(crate) enum Store {
    /// Memory, allocated segment by segment on first write (unwritten segments read as zeroes).
    Ram(RamStore),
    /// A regular file or a block device.
    File(FileStore),
    /// Another NVMe namespace (a local SSD through nvpoll-pcie, for instance).
    Device(std::sync::Arc<dyn crate::device::BlockDevice>),
}

/// A flush in progress; see [`Store::start_flush`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FlushTicket(u64);

/// Where a flush stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FlushStatus {
    /// Still running.
    Pending,
    /// Everything written before the ticket was taken is durable.
    Done,
    /// The flush failed: writes before the ticket may be lost.
    Failed,
}

impl Store {
    /// A RAM store of `bytes` bytes.
    pub(crate) fn ram(bytes: u64) -> Store {
        let segments = bytes.div_ceil(RAM_SEGMENT as u64) as usize;
        Store::Ram(RamStore {
            segments: (0..segments).map(|_| Mutex::new(None)).collect(),
            len: bytes,
        })
    }

    /// Opens a file or block device for reading and writing.
    pub(crate) fn open(path: &Path) -> io::Result<Store> {
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)?;
        // A block device's metadata says 0 bytes; its end says how big it is.
        let len = file.seek(SeekFrom::End(0))?;
        Ok(Store::File(FileStore::new(file, path.to_path_buf(), len)?))
    }

    /// Size in bytes.
    pub(crate) fn len(&self) -> u64 {
        match self {
            Store::Ram(r) => r.len,
            Store::File(f) => f.len,
            Store::Device(d) => d.size_bytes(),
        }
    }

    /// What backs the store, for logs.
    pub(crate) fn describe(&self) -> String {
        match self {
            Store::Ram(_) => "RAM".to_string(),
            Store::File(f) => f.path.display().to_string(),
            Store::Device(d) => d.describe(),
        }
    }

    /// Appends `len` bytes read at byte offset `off` to `out` (a send buffer: the data goes from the store
    /// into the PDU with one copy). On error `out` may hold part of the data; the caller cuts it off.
    pub(crate) fn read_append(&self, off: u64, len: usize, out: &mut Vec<u8>) -> io::Result<()> {
        match self {
            Store::Ram(r) => {
                out.reserve(len);
                r.for_each_segment(off, len, |seg, range, _| match seg.as_deref() {
                    Some(s) => out.extend_from_slice(&s[range]),
                    None => out.resize(out.len() + range.len(), 0),
                });
                Ok(())
            }
            Store::File(f) => {
                let start = out.len();
                out.resize(start + len, 0);
                f.file.read_exact_at(&mut out[start..], off)
            }
            Store::Device(d) => {
                let start = out.len();
                out.resize(start + len, 0);
                d.read(off, &mut out[start..])
            }
        }
    }

    /// For a RAM store and a range of at most [`DIRECT_READ_MAX`] bytes: calls `f` with the bytes of
    /// `off..off + len` as slices of the store itself (unwritten parts as zeroes), the segments locked
    /// meanwhile, so the caller can send them with no copy of its own. `None` (and `f` is not called) for
    /// other stores or longer ranges: the caller falls back to [`Store::read_append`].
    pub(crate) fn with_ram_slices<R>(
        &self,
        off: u64,
        len: usize,
        f: impl FnOnce(&[&[u8]]) -> R,
    ) -> Option<R> {
        let Store::Ram(r) = self else { return None };
        if len > DIRECT_READ_MAX {
            return None;
        }
        // Lock in ascending order (as every other user does: one at a time), so no two callers deadlock.
        let first = (off / RAM_SEGMENT as u64) as usize;
        let last = ((off + len as u64).saturating_sub(1) / RAM_SEGMENT as u64) as usize;
        let mut guards: [Option<SegmentGuard<'_>>; DIRECT_SEGMENTS] = Default::default();
        if len > 0 {
            for (g, seg) in guards.iter_mut().zip(&r.segments[first..=last]) {
                *g = Some(seg.lock().unwrap_or_else(|e| e.into_inner()));
            }
        }
        let mut slices: [&[u8]; DIRECT_SEGMENTS] = [&[]; DIRECT_SEGMENTS];
        let mut at = 0usize;
        let mut k = 0;
        while at < len {
            let pos = off + at as u64;
            let start = (pos % RAM_SEGMENT as u64) as usize;
            let n = (RAM_SEGMENT - start).min(len - at);
            let bytes: &[u8] = match guards[k].as_deref().and_then(|s| s.as_deref()) {
                Some(seg) => seg,
                None => &RAM_ZEROES,
            };
            slices[k] = &bytes[start..start + n];
            at += n;
            k += 1;
        }
        Some(f(&slices[..k]))
    }

    /// Writes `data` at byte offset `off` (the caller checked the range).
    pub(crate) fn write(&self, off: u64, data: &[u8]) -> io::Result<()> {
        match self {
            Store::Ram(r) => {
                let streaming = r.len >= STREAMING_MIN_STORE;
                r.for_each_segment(off, data.len(), |seg, range, at| {
                    let s = seg.get_or_insert_with(SegmentBytes::zeroed);
                    let (to, from) = (&mut s[range.clone()], &data[at..at + range.len()]);
                    if streaming {
                        nvpoll::mem::copy_nontemporal(to, from);
                    } else {
                        to.copy_from_slice(from);
                    }
                });
                Ok(())
            }
            Store::File(f) => f.file.write_all_at(data, off),
            Store::Device(d) => d.write(off, data),
        }
    }

    /// Writes `len` zero bytes at byte offset `off` (the caller checked the range).
    pub(crate) fn write_zeroes(&self, off: u64, len: u64) -> io::Result<()> {
        match self {
            Store::Ram(r) => {
                let len = usize::try_from(len)
                    .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
                r.for_each_segment(off, len, |seg, range, _| {
                    if range.len() == RAM_SEGMENT {
                        *seg = None;
                    } else if let Some(s) = seg.as_deref_mut() {
                        s[range].fill(0);
                    }
                });
                Ok(())
            }
            Store::Device(d) => {
                let zeroes = vec![0u8; ZERO_CHUNK];
                let mut done = 0u64;
                while done < len {
                    let n = (len - done).min(ZERO_CHUNK as u64) as usize;
                    d.write(off + done, &zeroes[..n])?;
                    done += n as u64;
                }
                Ok(())
            }
            Store::File(f) => {
                let zeroes = [0u8; ZERO_CHUNK];
                let mut done = 0u64;
                while done < len {
                    let n = (len - done).min(ZERO_CHUNK as u64) as usize;
                    f.file.write_all_at(&zeroes[..n], off + done)?;
                    done += n as u64;
                }
                Ok(())
            }
        }
    }

    /// Whether [`Store::deallocate`] can forget blocks here, and what they then read as: `Some(true)` when
    /// they read as zeroes (RAM, files), `Some(false)` when the device decides (an SSD with Dataset
    /// Management), `None` when it cannot deallocate at all.
    pub(crate) fn deallocates(&self) -> Option<bool> {
        match self {
            Store::Ram(_) | Store::File(_) => Some(true),
            Store::Device(d) => d.can_deallocate().then_some(false),
        }
    }

    /// Forgets `len` bytes at byte offset `off` (the caller checked the range): RAM gives whole segments back
    /// and zeroes the rest; a file punches a hole (a block device zeroes or discards the range), or is written
    /// with zeroes where its file system cannot punch; a device gets Dataset Management.
    pub(crate) fn deallocate(&self, off: u64, len: u64) -> io::Result<()> {
        match self {
            Store::Ram(_) => self.write_zeroes(off, len),
            Store::File(f) => match punch_hole(&f.file, off, len) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Unsupported => self.write_zeroes(off, len),
                Err(e) => Err(e),
            },
            Store::Device(d) => d.deallocate(off, len),
        }
    }

    /// Starts making every completed write durable. RAM has nothing to do; a file asks its flusher thread.
    pub(crate) fn start_flush(&self) -> FlushTicket {
        match self {
            Store::Ram(_) => FlushTicket(0),
            Store::File(f) => f.flusher.request(),
            // Synchronous: the ticket records whether it worked.
            Store::Device(d) => FlushTicket(if d.flush().is_ok() { 0 } else { u64::MAX }),
        }
    }

    /// Where the flush of `ticket` stands. Never blocks.
    pub(crate) fn flush_status(&self, ticket: FlushTicket) -> FlushStatus {
        match self {
            Store::Ram(_) => FlushStatus::Done,
            Store::File(f) => f.flusher.status(ticket),
            Store::Device(_) if ticket.0 == u64::MAX => FlushStatus::Failed,
            Store::Device(_) => FlushStatus::Done,
        }
    }
}

/// Punches a hole of `len` bytes at `off` in a file, keeping its size (on a block device the kernel zeroes or
/// discards the range). `Unsupported` where the file system cannot.
fn punch_hole(file: &File, off: u64, len: u64) -> io::Result<()> {
    use rustix::fs::{fallocate, FallocateFlags};
    if len == 0 {
        return Ok(());
    }
    fallocate(
        file,
        FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
        off,
        len,
    )
    .map_err(|e| match e {
        rustix::io::Errno::OPNOTSUPP | rustix::io::Errno::NOSYS => {
            io::Error::from(io::ErrorKind::Unsupported)
        }
        e => io::Error::from(e),
    })
}

/// One piece of a RAM store: `None` until first written (it reads as zeroes).
type Segment = Mutex<Option<SegmentBytes>>;

/// A locked segment.
type SegmentGuard<'a> = std::sync::MutexGuard<'a, Option<SegmentBytes>>;

/// One 4 KiB page of a segment, aligned as a page is.
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C, align(4096))]
struct Page([u8; PAGE]);

/// The alignment (and size) of a [`Page`].
const PAGE: usize = 4096;

/// The bytes of a segment, page-aligned. From the allocator, a plain `Box<[u8]>` starts 16 bytes into a page,
/// so every 4 KiB block a host writes or reads straddled two pages: two TLB misses (costly in a VM, where a
/// miss walks two page tables) instead of one. Random 4 KiB copies into a 256 MiB store took 560 ns against
/// 480 ns aligned on the 2-vCPU development VM.
struct SegmentBytes(Box<[Page]>);

impl SegmentBytes {
    fn zeroed() -> SegmentBytes {
        SegmentBytes(bytemuck::allocation::zeroed_slice_box(RAM_SEGMENT / PAGE))
    }
}

impl std::ops::Deref for SegmentBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
}

impl std::ops::DerefMut for SegmentBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        bytemuck::cast_slice_mut(&mut self.0)
    }
}

/// Memory in segments of [`RAM_SEGMENT`] bytes, each behind its own lock so that connections on different
/// reactors only meet when they touch the same 64 KiB at the same moment (a copy of at most 64 KiB).
pub(crate) struct RamStore {
    segments: Box<[Segment]>,
    len: u64,
}

impl std::fmt::Debug for RamStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RamStore")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl RamStore {
    /// Calls `f(segment, range within the segment, offset into the caller's buffer)` for each segment that
    /// `off..off + len` touches, with the segment locked.
    fn for_each_segment(
        &self,
        off: u64,
        len: usize,
        mut f: impl FnMut(&mut Option<SegmentBytes>, std::ops::Range<usize>, usize),
    ) {
        let mut at = 0usize;
        while at < len {
            let pos = off + at as u64;
            let index = (pos / RAM_SEGMENT as u64) as usize;
            let start = (pos % RAM_SEGMENT as u64) as usize;
            let n = (RAM_SEGMENT - start).min(len - at);
            // A poisoned lock only means another thread panicked mid-copy; the bytes are still bytes.
            let mut seg = self.segments[index]
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            f(&mut seg, start..start + n, at);
            at += n;
        }
    }
}

/// A file or block device, with the thread that flushes it.
#[derive(Debug)]
pub(crate) struct FileStore {
    file: Arc<File>,
    path: PathBuf,
    len: u64,
    flusher: Flusher,
}

impl FileStore {
    fn new(file: File, path: PathBuf, len: u64) -> io::Result<FileStore> {
        let file = Arc::new(file);
        let flusher = Flusher::start(Arc::clone(&file), &path)?;
        Ok(FileStore {
            file,
            path,
            len,
            flusher,
        })
    }
}

/// Runs `fdatasync` on its own thread, on request, and counts what it finished.
///
/// Tickets are increasing numbers. One `fdatasync` started after ticket `n` was taken covers every ticket up to
/// `n`; `done` is the highest ticket so covered. Failures are rare and kept as ranges of tickets.
#[derive(Debug)]
struct Flusher {
    state: Arc<FlusherState>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Debug, Default)]
struct FlusherState {
    requested: AtomicU64,
    done: AtomicU64,
    failed: Mutex<Vec<(u64, u64)>>,
    stop: AtomicBool,
}

impl Flusher {
    fn start(file: Arc<File>, path: &Path) -> io::Result<Flusher> {
        let state = Arc::new(FlusherState::default());
        let s = Arc::clone(&state);
        let thread = std::thread::Builder::new()
            .name(format!(
                "nvpoll-flush-{}",
                path.file_name()
                    .map(|n| n.to_string_lossy())
                    .unwrap_or_default()
            ))
            .spawn(move || loop {
                let want = s.requested.load(Ordering::Acquire);
                let done = s.done.load(Ordering::Acquire);
                if want > done {
                    if file.sync_data().is_err() {
                        s.failed
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .push((done + 1, want));
                    }
                    s.done.store(want, Ordering::Release);
                } else if s.stop.load(Ordering::Acquire) {
                    return;
                } else {
                    std::thread::park_timeout(Duration::from_millis(100));
                }
            })?;
        Ok(Flusher {
            state,
            thread: Some(thread),
        })
    }

    fn request(&self) -> FlushTicket {
        let ticket = self.state.requested.fetch_add(1, Ordering::AcqRel) + 1;
        if let Some(t) = &self.thread {
            t.thread().unpark();
        }
        FlushTicket(ticket)
    }

    fn status(&self, ticket: FlushTicket) -> FlushStatus {
        if self.state.done.load(Ordering::Acquire) < ticket.0 {
            return FlushStatus::Pending;
        }
        let failed = self.state.failed.lock().unwrap_or_else(|e| e.into_inner());
        if failed.iter().any(|&(lo, hi)| (lo..=hi).contains(&ticket.0)) {
            FlushStatus::Failed
        } else {
            FlushStatus::Done
        }
    }
}

impl Drop for Flusher {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ram_reads_zeroes_then_what_was_written_across_segments() {
        let s = Store::ram(4 * RAM_SEGMENT as u64);
        let read = |off: u64, len: usize| {
            let mut out = Vec::new();
            s.read_append(off, len, &mut out).unwrap();
            out
        };
        assert!(read(100, 3 * RAM_SEGMENT).iter().all(|&b| b == 0));
        let data: Vec<u8> = (0..2 * RAM_SEGMENT + 7)
            .map(|i| (i * 7 + 3) as u8)
            .collect();
        s.write(RAM_SEGMENT as u64 - 5, &data).unwrap();
        assert_eq!(read(RAM_SEGMENT as u64 - 5, data.len()), data);
        let mut appended = vec![9u8];
        s.read_append(RAM_SEGMENT as u64 - 5, data.len(), &mut appended)
            .unwrap();
        assert_eq!(&appended[1..], &data[..]);
        s.write_zeroes(RAM_SEGMENT as u64, RAM_SEGMENT as u64 + 3)
            .unwrap();
        let back = read(RAM_SEGMENT as u64 - 5, data.len());
        assert_eq!(&back[..5], &data[..5]);
        assert!(back[5..5 + RAM_SEGMENT + 3].iter().all(|&b| b == 0));
        assert_eq!(&back[5 + RAM_SEGMENT + 3..], &data[5 + RAM_SEGMENT + 3..]);
        assert_eq!(s.flush_status(s.start_flush()), FlushStatus::Done);
    }

    #[test]
    fn ram_slices_lend_what_read_append_copies() {
        let s = Store::ram(4 * RAM_SEGMENT as u64);
        let data: Vec<u8> = (0..RAM_SEGMENT + 100).map(|i| (i * 13 + 1) as u8).collect();
        s.write(RAM_SEGMENT as u64 + 50, &data).unwrap();
        // Ranges within one segment, across two and across three, over written and unwritten bytes.
        for (off, len) in [
            (0u64, 4096usize),
            (RAM_SEGMENT as u64 - 10, 20),
            (10, DIRECT_READ_MAX),
            (RAM_SEGMENT as u64 + 1, DIRECT_READ_MAX),
            (2 * RAM_SEGMENT as u64 - 7, RAM_SEGMENT + 9),
            (3 * RAM_SEGMENT as u64, 0),
        ] {
            let mut copied = Vec::new();
            s.read_append(off, len, &mut copied).unwrap();
            let lent = s
                .with_ram_slices(off, len, |parts| parts.concat())
                .expect("a RAM store lends its slices");
            assert_eq!(lent, copied, "range {off}+{len}");
        }
        assert!(s.with_ram_slices(0, DIRECT_READ_MAX + 1, |_| ()).is_none());
    }

    #[test]
    fn file_store_round_trip_and_flush() {
        let dir = std::env::temp_dir().join(format!("nvpoll-store-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ns.img");
        std::fs::File::create(&path)
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
        let s = Store::open(&path).unwrap();
        assert_eq!(s.len(), 1 << 20);
        assert!(
            s.with_ram_slices(0, 4096, |_| ()).is_none(),
            "only RAM lends slices"
        );
        s.write(4096, b"hello").unwrap();
        s.write_zeroes(4097, 2).unwrap();
        let mut out = Vec::new();
        s.read_append(4096, 5, &mut out).unwrap();
        assert_eq!(&out, b"h\0\0lo");
        let t = s.start_flush();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while s.flush_status(t) == FlushStatus::Pending {
            assert!(std::time::Instant::now() < deadline, "flush did not finish");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(s.flush_status(t), FlushStatus::Done);
        drop(s);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

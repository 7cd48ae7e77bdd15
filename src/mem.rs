//! Pinned DMA memory, handed out as fixed-size buffers from a preallocated pool.
//!
//! A [`DmaPool`] maps all of its memory once, at creation: 2 MiB hugepages when they are reserved (see
//! `docs/hugepages.md`), ordinary 4 KiB pages otherwise, with one warning line on stderr per process. The memory is
//! mlock'ed and carved into size classes of power-of-two buffers (4 KiB and up), each with a lock-free free list.
//! [`DmaPool::alloc`] pops a buffer from the smallest class that fits, and dropping the [`DmaBuf`] pushes it back:
//! nothing is allocated or locked on the I/O path, and an exhausted class is an [`Error::Memory`], never a wait.
//!
//! Invariants the rest of the stack may rely on:
//! - a buffer is aligned to its class size (up to 2 MiB), so it never straddles a hugepage and its 4 KiB pages
//!   can be described by PRP entries directly;
//! - a buffer is contiguous in IOVA space: [`DmaBuf::iova`] plus `k` is the IOVA of byte `k` of the visible window;
//! - IOVA equals the virtual address until a VFIO backend calls [`DmaPool::map_iova`];
//! - the contents of a freshly allocated buffer are unspecified (whatever its previous user left there).
//!
//! [`copy_nontemporal`] copies into memory with streaming stores, for large destinations the cache should not
//! hold (a RAM namespace's blocks).
//!
//! This module holds all the `unsafe` code of the root crate.
//!
//! ```
//! use nvpoll::mem::{DmaPool, HugepageMode};
//!
//! let pool = DmaPool::builder()
//!     .class(4096, 16)
//!     .class(128 * 1024, 2)
//!     .hugepages(HugepageMode::Off)
//!     .build()?;
//! let mut buf = pool.alloc(512)?; // comes from the 4 KiB class, 512 bytes visible
//! buf.fill(0xab);
//! buf.set_window(100, 412)?; // an unaligned view inside the same buffer
//! assert_eq!(buf.iova() % 4096, 100);
//! assert_eq!(pool.available(4096), 15);
//! drop(buf);
//! assert_eq!(pool.available(4096), 16);
//! # Ok::<(), nvpoll::Error>(())
//! ```
#![allow(unsafe_code)]

use std::fmt;
use std::io;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam_queue::ArrayQueue;
use memmap2::{MmapOptions, MmapRaw};

use crate::{Error, Result};

/// The smallest buffer size, and the alignment every buffer has at least.
pub const PAGE_SIZE: usize = 4096;

/// The size of the hugepages the pool maps (2 MiB).
pub const HUGEPAGE_SIZE: usize = 2 << 20;

/// `log2(HUGEPAGE_SIZE)`, as `MAP_HUGE_2MB` encodes it.
const HUGEPAGE_SHIFT: u8 = 21;

/// Which kind of pages back a pool.
///
/// # Examples
///
/// ```
/// use nvpoll::mem::{DmaPool, HugepageMode, PageKind};
///
/// let pool = DmaPool::builder().class(4096, 4).hugepages(HugepageMode::Off).build()?;
/// assert_eq!(pool.page_kind(), PageKind::Normal);
/// # Ok::<(), nvpoll::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageKind {
    /// 2 MiB hugepages (`MAP_HUGETLB`): physically contiguous per 2 MiB and never swapped or moved.
    Huge2M,
    /// Ordinary 4 KiB pages, the fallback when no hugepages are reserved.
    Normal,
}

/// Whether a pool may, must or must not use hugepages.
///
/// # Examples
///
/// With `Require`, a pool is made of hugepages or not at all; here it depends on what the kernel has free:
///
/// ```
/// use nvpoll::mem::{hugepage_status, DmaPool, HugepageMode, PageKind, HUGEPAGE_SIZE};
///
/// let free = hugepage_status(HUGEPAGE_SIZE).map_or(0, |s| s.available());
/// match DmaPool::builder().class(4096, 4).hugepages(HugepageMode::Require).build() {
///     Ok(pool) => assert_eq!(pool.page_kind(), PageKind::Huge2M),
///     Err(e) => {
///         assert!(matches!(e, nvpoll::Error::Memory(_)), "{e}");
///         println!("no pool of hugepages ({free} free): {e}");
///     }
/// }
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HugepageMode {
    /// Use 2 MiB hugepages if enough are free, else ordinary pages with one warning line per process.
    #[default]
    Prefer,
    /// Use 2 MiB hugepages or fail with [`Error::Memory`].
    Require,
    /// Use ordinary pages, silently.
    Off,
}

/// One virtually contiguous chunk of a pool, as a VFIO backend maps it into the IOMMU.
///
/// See [`DmaPool::map_iova`] for an example.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DmaRegion {
    /// Virtual address of the first byte.
    pub vaddr: usize,
    /// Length in bytes (a multiple of 2 MiB with hugepages, of 4 KiB without).
    pub len: usize,
    /// The IOVA of the first byte (equal to `vaddr` until [`DmaPool::map_iova`] says otherwise).
    pub iova: u64,
}

/// Configures and creates a [`DmaPool`]; see [`DmaPool::builder`].
///
/// # Examples
///
/// Two size classes on ordinary pages, mlock not insisted on (the default: a failed `mlock` is a warning):
///
/// ```
/// use nvpoll::mem::{DmaPool, HugepageMode};
///
/// let pool = DmaPool::builder()
///     .class(4096, 64)
///     .class(128 * 1024, 4)
///     .class(4096, 64) // the same size again: 128 buffers of 4 KiB
///     .hugepages(HugepageMode::Off)
///     .require_mlock(false)
///     .build()?;
/// assert_eq!(pool.available(4096), 128);
/// assert_eq!(pool.available(100 * 1024), 4);
///
/// // A size class must be a power of two of at least 4 KiB.
/// let bad = DmaPool::builder().class(3000, 1).build();
/// assert!(matches!(bad, Err(nvpoll::Error::InvalidArgument(_))));
/// # Ok::<(), nvpoll::Error>(())
/// ```
#[derive(Clone, Debug, Default)]
pub struct DmaPoolBuilder {
    classes: Vec<(usize, usize)>,
    hugepages: HugepageMode,
    require_mlock: bool,
}

impl DmaPoolBuilder {
    /// Adds a size class of `count` buffers of `size` bytes. `size` must be a power of two of at least
    /// [`PAGE_SIZE`]; giving the same size twice adds up the counts.
    ///
    /// See [`DmaPoolBuilder`]'s example.
    pub fn class(mut self, size: usize, count: usize) -> Self {
        self.classes.push((size, count));
        self
    }

    /// Chooses whether hugepages are used ([`HugepageMode::Prefer`] by default).
    ///
    /// See [`DmaPoolBuilder`]'s example.
    pub fn hugepages(mut self, mode: HugepageMode) -> Self {
        self.hugepages = mode;
        self
    }

    /// Makes a failed `mlock` an error instead of a warning (off by default).
    ///
    /// See [`DmaPoolBuilder`]'s example.
    pub fn require_mlock(mut self, required: bool) -> Self {
        self.require_mlock = required;
        self
    }

    /// Maps, pins and carves the memory.
    ///
    /// Fails with [`Error::InvalidArgument`] for a bad class, with [`Error::Memory`] when the memory cannot be
    /// mapped (or hugepages are required and not available), and with [`Error::Os`] when `mlock` fails and was
    /// required.
    ///
    /// See [`DmaPoolBuilder`]'s example.
    pub fn build(self) -> Result<DmaPool> {
        let mut classes: Vec<(usize, usize)> = Vec::new();
        for &(size, count) in &self.classes {
            if !size.is_power_of_two() || size < PAGE_SIZE {
                return Err(Error::InvalidArgument(format!(
                    "DMA buffer size {size} is not a power of two of at least {PAGE_SIZE}"
                )));
            }
            match classes.iter_mut().find(|c| c.0 == size) {
                Some(c) => c.1 = c.1.saturating_add(count),
                None => classes.push((size, count)),
            }
        }
        if classes.is_empty() || classes.iter().any(|c| c.1 == 0) {
            return Err(Error::InvalidArgument(
                "a DMA pool needs at least one size class, each with at least one buffer".into(),
            ));
        }
        if let Some(c) = classes.iter().find(|c| c.1 > u32::MAX as usize) {
            return Err(Error::InvalidArgument(format!(
                "too many DMA buffers of {} bytes: {}",
                c.0, c.1
            )));
        }
        // Largest first: every offset is then a multiple of the current size, so each buffer is naturally
        // aligned (the region itself is aligned to 2 MiB).
        classes.sort_unstable_by_key(|c| std::cmp::Reverse(c.0));
        let mut offset = 0usize;
        let mut layout = Vec::with_capacity(classes.len());
        for &(size, count) in &classes {
            layout.push((size, count, offset));
            offset = size
                .checked_mul(count)
                .and_then(|bytes| offset.checked_add(bytes))
                .ok_or_else(|| Error::InvalidArgument("DMA pool size overflows usize".into()))?;
        }
        let mapping = Mapping::new(offset, self.hugepages)?;
        let len = mapping.len;
        let locked = match mapping.lock() {
            Ok(()) => true,
            Err(e) if self.require_mlock => {
                return Err(Error::os(format!("mlock of {len} bytes of DMA memory"), e))
            }
            Err(e) => {
                warn_once(
                    &MLOCK_WARNED,
                    &format!(
                        "could not mlock {} KiB of DMA memory ({e}); it may be swapped out \
                         (raise the limit with `ulimit -l`, or run with CAP_IPC_LOCK)",
                        len >> 10
                    ),
                );
                mapping.prefault();
                false
            }
        };

        layout.reverse(); // smallest first, for the lookup in `alloc`
        let classes = layout
            .into_iter()
            .map(|(size, count, start)| {
                let free = ArrayQueue::new(count);
                for slot in 0..count as u32 {
                    // Cannot fail: the queue holds exactly `count` entries.
                    let _ = free.push(slot);
                }
                SizeClass {
                    size,
                    count,
                    start,
                    free,
                }
            })
            .collect();
        Ok(DmaPool {
            inner: Arc::new(PoolInner {
                classes,
                mapping,
                locked,
                iova_offset: AtomicU64::new(0),
            }),
        })
    }
}

/// A preallocated, pinned pool of DMA buffers. Cloning it is cheap (it is reference counted), and buffers keep
/// the memory alive after the last clone of the pool is dropped.
///
/// # Examples
///
/// Every thread allocates from the same pool; a buffer dropped goes back to it:
///
/// ```
/// use nvpoll::mem::DmaPool;
///
/// let pool = DmaPool::builder().class(4096, 8).build()?;
/// let other = pool.clone();
/// let filled = std::thread::spawn(move || -> nvpoll::Result<_> {
///     let mut buf = other.alloc(4096)?;
///     buf.fill(7);
///     Ok(buf)
/// })
/// .join()
/// .expect("the thread ran")?;
/// assert_eq!(pool.available(4096), 7);
/// assert!(filled.iter().all(|&b| b == 7));
/// drop(filled);
/// assert_eq!(pool.available(4096), 8);
/// println!("{pool:?}: {:?} pages, locked: {}", pool.page_kind(), pool.is_locked());
/// # Ok::<(), nvpoll::Error>(())
/// ```
#[derive(Clone)]
pub struct DmaPool {
    inner: Arc<PoolInner>,
}

impl DmaPool {
    /// Starts configuring a pool: add size classes with [`DmaPoolBuilder::class`], then call
    /// [`DmaPoolBuilder::build`]. See [`DmaPoolBuilder`]'s example.
    pub fn builder() -> DmaPoolBuilder {
        DmaPoolBuilder::default()
    }

    /// Takes a buffer from the smallest size class that holds `len` bytes, with `len` bytes visible.
    ///
    /// Lock-free and allocation-free. Fails with [`Error::Memory`] when that class has no free buffer (the pool
    /// never falls back to a larger class, so exhaustion is predictable), and with [`Error::InvalidArgument`] when
    /// no class is large enough.
    ///
    /// # Examples
    ///
    /// ```
    /// use nvpoll::mem::DmaPool;
    /// use nvpoll::{Error, Retry};
    ///
    /// let pool = DmaPool::builder().class(4096, 2).class(16384, 1).build()?;
    /// let small = pool.alloc(512)?; // the 4 KiB class, 512 bytes visible
    /// assert_eq!((small.len(), small.capacity()), (512, 4096));
    /// let _second = pool.alloc(4096)?;
    ///
    /// // The 4 KiB class is empty now: no fallback to the larger class, and no waiting.
    /// let empty = pool.alloc(4096).unwrap_err();
    /// assert!(matches!(empty, Error::Memory(_)));
    /// assert_eq!(empty.retry(), Retry::Later);
    ///
    /// assert!(matches!(pool.alloc(1 << 20), Err(Error::InvalidArgument(_))), "no class that large");
    /// # Ok::<(), nvpoll::Error>(())
    /// ```
    pub fn alloc(&self, len: usize) -> Result<DmaBuf> {
        let inner = &self.inner;
        let (index, class) = inner.class_for(len)?;
        let slot = class.free.pop().ok_or_else(|| {
            Error::Memory(format!(
                "DMA pool exhausted: all {} buffers of {} bytes are in use",
                class.count, class.size
            ))
        })?;
        let offset = class.start + slot as usize * class.size;
        // SAFETY: `start + slot * size + size <= len` of the mapping by construction of the layout in `build`,
        // so the pointer stays inside the mapping, which is non-null.
        let ptr = unsafe { NonNull::new_unchecked(inner.mapping.base().add(offset)) };
        Ok(DmaBuf {
            ptr,
            capacity: class.size,
            offset: 0,
            len,
            owner: Owner::Slot(Lease {
                slot,
                class: index as u8,
                pool: Arc::clone(inner),
            }),
        })
    }

    /// How many buffers are free in the size class that [`DmaPool::alloc`] would use for `len` bytes (0 when no
    /// class is large enough). See [`DmaPool::alloc`]'s example and [`DmaPoolBuilder`]'s.
    pub fn available(&self, len: usize) -> usize {
        self.inner.class_for(len).map_or(0, |(_, c)| c.free.len())
    }

    /// Which kind of pages back this pool. See [`PageKind`]'s example.
    pub fn page_kind(&self) -> PageKind {
        self.inner.mapping.kind
    }

    /// Whether the memory is mlock'ed. See [`DmaPool`]'s example.
    pub fn is_locked(&self) -> bool {
        self.inner.locked
    }

    /// The virtually contiguous chunks of the pool, with their current IOVA. No buffer straddles two regions.
    /// See [`DmaPool::map_iova`]'s example.
    pub fn regions(&self) -> Vec<DmaRegion> {
        let vaddr = self.inner.mapping.base() as usize;
        let iova = (vaddr as u64).wrapping_add(self.inner.iova_offset.load(Ordering::Acquire));
        vec![DmaRegion {
            vaddr,
            len: self.inner.mapping.len,
            iova,
        }]
    }

    /// Lets a DMA backend (VFIO) map every region and say at which IOVA it mapped it. `map` is called once per
    /// region; from then on [`DmaBuf::iova`] of every buffer of this pool, allocated before or after, reflects
    /// it. Call it before any I/O uses the pool. If `map` fails for a region, its IOVA is left unchanged and the
    /// error is returned.
    ///
    /// # Examples
    ///
    /// A backend that maps each region at IOVA `0x10_0000_0000` (VFIO would ask the IOMMU here):
    ///
    /// ```
    /// use nvpoll::mem::DmaPool;
    ///
    /// let pool = DmaPool::builder().class(4096, 4).build()?;
    /// let regions = pool.regions();
    /// assert_eq!(regions.len(), 1);
    /// assert_eq!(regions[0].iova, regions[0].vaddr as u64, "IOVA is the address until mapped");
    ///
    /// let buf = pool.alloc(4096)?;
    /// let offset = buf.iova() - regions[0].iova;
    /// pool.map_iova(|_region| Ok(0x10_0000_0000))?;
    /// assert_eq!(pool.regions()[0].iova, 0x10_0000_0000);
    /// assert_eq!(buf.iova(), 0x10_0000_0000 + offset, "buffers allocated before see it too");
    /// # Ok::<(), nvpoll::Error>(())
    /// ```
    pub fn map_iova(&self, mut map: impl FnMut(&DmaRegion) -> Result<u64>) -> Result<()> {
        for region in self.regions() {
            let iova = map(&region)?;
            self.inner
                .iova_offset
                .store(iova.wrapping_sub(region.vaddr as u64), Ordering::Release);
        }
        Ok(())
    }
}

impl fmt::Debug for DmaPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let classes: Vec<_> = self
            .inner
            .classes
            .iter()
            .map(|c| (c.size, c.free.len(), c.count))
            .collect();
        f.debug_struct("DmaPool")
            .field("page_kind", &self.inner.mapping.kind)
            .field("locked", &self.inner.locked)
            .field("regions", &self.regions())
            .field("classes (size, free, total)", &classes)
            .finish()
    }
}

struct PoolInner {
    /// Smallest size first.
    classes: Box<[SizeClass]>,
    mapping: Mapping,
    locked: bool,
    /// IOVA minus virtual address, wrapping (0 means IOVA = VA).
    iova_offset: AtomicU64,
}

impl PoolInner {
    fn class_for(&self, len: usize) -> Result<(usize, &SizeClass)> {
        self.classes
            .iter()
            .enumerate()
            .find(|(_, c)| c.size >= len)
            .ok_or_else(|| {
                let largest = self.classes.last().map_or(0, |c| c.size);
                Error::InvalidArgument(format!(
                    "no DMA buffer class holds {len} bytes (largest is {largest})"
                ))
            })
    }
}

struct SizeClass {
    size: usize,
    count: usize,
    /// Offset of the first buffer from the start of the mapping.
    start: usize,
    /// Indices of the free buffers.
    free: ArrayQueue<u32>,
}

/// The memory of a pool: a mapping whose `len` bytes from `base_offset` are used, aligned to 2 MiB.
struct Mapping {
    map: MmapRaw,
    base_offset: usize,
    len: usize,
    kind: PageKind,
}

impl Mapping {
    /// Maps at least `bytes` (a multiple of [`PAGE_SIZE`]): whole hugepages, or else just enough ordinary pages.
    fn new(bytes: usize, mode: HugepageMode) -> Result<Mapping> {
        let too_big =
            || Error::InvalidArgument(format!("a DMA pool of {bytes} bytes is too large"));
        if mode != HugepageMode::Off {
            let len = bytes
                .checked_next_multiple_of(HUGEPAGE_SIZE)
                .ok_or_else(too_big)?;
            match MmapOptions::new()
                .len(len)
                .huge(Some(HUGEPAGE_SHIFT))
                .populate()
                .map_anon()
            {
                Ok(map) => {
                    return Ok(Mapping {
                        map: map.into(),
                        base_offset: 0,
                        len,
                        kind: PageKind::Huge2M,
                    });
                }
                Err(e) => {
                    let pages = len / HUGEPAGE_SIZE;
                    let free = hugepage_status(HUGEPAGE_SIZE)
                        .map_or_else(|_| "unknown".to_string(), |s| s.available().to_string());
                    if mode == HugepageMode::Require {
                        return Err(Error::Memory(format!(
                            "cannot map {pages} hugepages of 2 MiB ({free} available): {e}; see docs/hugepages.md"
                        )));
                    }
                    warn_once(
                        &HUGEPAGE_WARNED,
                        &format!(
                            "no 2 MiB hugepages for DMA memory ({pages} needed, {free} available: {e}); \
                             using ordinary 4 KiB pages (reserve some with `sysctl vm.nr_hugepages=N`, \
                             see docs/hugepages.md)"
                        ),
                    );
                }
            }
        }
        // Map one hugepage more than needed (less one page) so that the used part can start on a 2 MiB
        // boundary; the slack is never touched, so it costs address space only.
        let len = bytes;
        let map = MmapOptions::new()
            .len(
                len.checked_add(HUGEPAGE_SIZE - PAGE_SIZE)
                    .ok_or_else(too_big)?,
            )
            .map_anon()
            .map_err(|e| Error::Memory(format!("cannot map {len} bytes of DMA memory: {e}")))?;
        let map = MmapRaw::from(map);
        let base_offset =
            (map.as_ptr() as usize).next_multiple_of(HUGEPAGE_SIZE) - map.as_ptr() as usize;
        Ok(Mapping {
            map,
            base_offset,
            len,
            kind: PageKind::Normal,
        })
    }

    /// The first byte of the used part.
    fn base(&self) -> *mut u8 {
        // SAFETY: `base_offset + len` is within the mapping (see `new`), so the result stays inside it.
        unsafe { self.map.as_mut_ptr().add(self.base_offset) }
    }

    /// Locks the used part in memory, faulting it in.
    fn lock(&self) -> io::Result<()> {
        // Miri has no mlock: the pool takes its "could not lock" path (prefault), which Miri then checks.
        if cfg!(miri) {
            return Err(io::ErrorKind::Unsupported.into());
        }
        // SAFETY: mlock only changes the paging of the range, which lies inside our live mapping; it reads and
        // writes no memory that Rust code could observe.
        let rc = unsafe { libc::mlock(self.base().cast(), self.len) };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    /// Faults the used part in by writing it (with zeroes, which it already holds), so that the first I/O does
    /// not take page faults when `mlock` failed.
    fn prefault(&self) {
        // SAFETY: the range lies inside our mapping, which is readable and writable, and no buffer has been
        // handed out yet, so no reference to it exists.
        unsafe { std::ptr::write_bytes(self.base(), 0, self.len) };
    }
}

/// Moves the elements of `v` into a new allocation of the same capacity, made by the calling thread.
///
/// For state built on one thread and then owned by a reactor on another: the allocator places consecutive
/// allocations side by side, so buffers that two reactors write could otherwise share a cache line.
///
/// # Examples
///
/// ```
/// use nvpoll::mem::rehome_vec;
///
/// let mut slots: Vec<u64> = Vec::with_capacity(64);
/// slots.extend(0..10);
/// let moved = std::thread::spawn(move || {
///     rehome_vec(&mut slots); // now allocated by the thread that will write it
///     slots
/// })
/// .join()
/// .expect("the thread ran");
/// assert_eq!(moved, (0..10).collect::<Vec<u64>>());
/// assert!(moved.capacity() >= 64);
/// ```
pub fn rehome_vec<T>(v: &mut Vec<T>) {
    let mut fresh = Vec::with_capacity(v.capacity());
    fresh.append(v);
    *v = fresh;
}

static HUGEPAGE_WARNED: AtomicBool = AtomicBool::new(false);
static MLOCK_WARNED: AtomicBool = AtomicBool::new(false);

/// Logs `msg` as a warning (the `log` facade), the first time only for this `flag`.
fn warn_once(flag: &AtomicBool, msg: &str) {
    if !flag.swap(true, Ordering::Relaxed) {
        log::warn!("{msg}");
    }
}

/// A buffer of pinned DMA memory from a [`DmaPool`], returned to the pool when dropped.
///
/// It dereferences to its *visible window*: `len()` bytes starting `offset()` bytes into a buffer of
/// `capacity()` bytes. The window starts as the first `len` bytes passed to [`DmaPool::alloc`]; move it with
/// [`DmaBuf::set_len`] and [`DmaBuf::set_window`], for instance to test unaligned transfers.
///
/// A transport hands the buffer's IOVA to the device and keeps the `DmaBuf` until the transfer is over, so no
/// Rust reference to the memory exists while the device writes it.
///
/// # Examples
///
/// The window, its capacity and its offset:
///
/// ```
/// use nvpoll::mem::DmaPool;
///
/// let pool = DmaPool::builder().class(4096, 4).build()?;
/// let mut buf = pool.alloc(1024)?;
/// assert_eq!((buf.len(), buf.capacity(), buf.offset()), (1024, 4096, 0));
/// assert!(!buf.is_empty());
///
/// buf.as_mut_slice().fill(1); // or through DerefMut: buf.fill(1)
/// buf.set_len(4096)?; // the whole buffer visible
/// assert_eq!(buf.as_slice()[1023..1025], [1, buf[1024]]);
///
/// buf.set_window(512, 0)?;
/// assert!(buf.is_empty());
/// assert_eq!(buf.offset(), 512);
/// assert!(buf.set_window(4000, 100).is_err(), "past the capacity");
/// assert!(buf.set_len(8192).is_err());
///
/// let ptr = buf.as_mut_ptr(); // what a device's copy would write through
/// assert_eq!(ptr as u64, buf.iova(), "IOVA is the address until a VFIO backend maps the pool");
/// # Ok::<(), nvpoll::Error>(())
/// ```
pub struct DmaBuf {
    /// First byte of the whole buffer.
    ptr: NonNull<u8>,
    capacity: usize,
    offset: usize,
    len: usize,
    owner: Owner,
}

/// Which pool buffer (slot) a [`DmaBuf`] holds, returned to its size class's free list when dropped.
struct Lease {
    slot: u32,
    class: u8,
    pool: Arc<PoolInner>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        // Cannot fail: the free list has room for every buffer of the class and this slot is not in it.
        let pushed = self.pool.classes[self.class as usize].free.push(self.slot);
        debug_assert!(pushed.is_ok(), "DMA buffer slot freed twice");
    }
}

/// A [`DmaBuf`]'s hold on its pool buffer: the whole buffer, or a part of it ([`DmaBuf::split_at`]), whose
/// slot goes back to the pool when the last part is dropped.
enum Owner {
    Slot(Lease),
    Part(Arc<Lease>),
}

impl Owner {
    fn pool(&self) -> &PoolInner {
        match self {
            Owner::Slot(l) => &l.pool,
            Owner::Part(l) => &l.pool,
        }
    }
}

// SAFETY: a DmaBuf owns its bytes exclusively (its slot is off the free list until its last part is dropped,
// and parts made by `split_at` cover disjoint bytes) and keeps the mapping alive through the Arc; nothing about
// it is tied to the allocating thread.
unsafe impl Send for DmaBuf {}
// SAFETY: through `&DmaBuf` only shared reads of the bytes are possible.
unsafe impl Sync for DmaBuf {}

impl DmaBuf {
    /// Length of the visible window in bytes.
    ///
    /// See [`DmaBuf`]'s example.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the visible window is empty.
    ///
    /// See [`DmaBuf`]'s example.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The visible window.
    ///
    /// See [`DmaBuf`]'s example.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `offset + len <= capacity` (kept by every setter), the buffer is `capacity` bytes inside the
        // mapping that `pool` keeps alive, its bytes are initialised (mapped zeroed), and this DmaBuf is their
        // only owner, so no `&mut` to them exists while `&self` is borrowed.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(self.offset), self.len) }
    }

    /// The visible window, writable.
    ///
    /// See [`DmaBuf`]'s example.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(self.offset), self.len) }
    }

    /// Size of the whole buffer (its size class) in bytes.
    ///
    /// See [`DmaBuf`]'s example.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Where the visible window starts, in bytes from the start of the buffer.
    ///
    /// See [`DmaBuf`]'s example.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Resizes the visible window, keeping its start. Fails with [`Error::InvalidArgument`] if it would end past
    /// the capacity.
    ///
    /// See [`DmaBuf`]'s example.
    pub fn set_len(&mut self, len: usize) -> Result<()> {
        self.set_window(self.offset, len)
    }

    /// Moves the visible window to `len` bytes starting `offset` bytes into the buffer. Fails with
    /// [`Error::InvalidArgument`] if it would end past the capacity.
    ///
    /// See [`DmaBuf`]'s example.
    pub fn set_window(&mut self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.capacity => {
                self.offset = offset;
                self.len = len;
                Ok(())
            }
            _ => Err(Error::InvalidArgument(format!(
                "DMA buffer window {offset}+{len} exceeds its capacity of {}",
                self.capacity
            ))),
        }
    }

    /// The IOVA of the first visible byte: what a device is given. The window is contiguous in IOVA space.
    ///
    /// See [`DmaPool::map_iova`]'s example.
    pub fn iova(&self) -> u64 {
        let vaddr = self.ptr.as_ptr() as usize + self.offset;
        (vaddr as u64).wrapping_add(self.owner.pool().iova_offset.load(Ordering::Relaxed))
    }

    /// Splits the visible window into two buffers: the first `at` bytes and the rest. Each part's capacity is
    /// its share of the window (bytes outside the window are no longer reachable), and each is a window of its
    /// own. The pool buffer goes back to the pool when both parts (and any parts split from them) are dropped.
    /// This lets a caller carve one buffer into many, e.g. to hand another program one contiguous area
    /// (fio's I/O buffers) and still submit each piece as a `DmaBuf`. Fails with
    /// [`Error::InvalidArgument`] if `at` is past the window.
    ///
    /// # Examples
    ///
    /// ```
    /// use nvpoll::mem::DmaPool;
    ///
    /// let pool = DmaPool::builder().class(8192, 1).build()?;
    /// let buf = pool.alloc(8192)?;
    /// let base = buf.iova();
    /// let (head, tail) = buf.split_at(4096)?;
    /// assert_eq!((head.len(), tail.len()), (4096, 4096));
    /// assert_eq!(tail.iova(), base + 4096);
    /// drop(head);
    /// assert_eq!(pool.available(8192), 0, "the buffer is back only when every part is");
    /// drop(tail);
    /// assert_eq!(pool.available(8192), 1);
    ///
    /// let whole = pool.alloc(100)?;
    /// assert!(whole.split_at(101).is_err());
    /// # Ok::<(), nvpoll::Error>(())
    /// ```
    pub fn split_at(self, at: usize) -> Result<(DmaBuf, DmaBuf)> {
        if at > self.len {
            return Err(Error::InvalidArgument(format!(
                "cannot split a DMA buffer window of {} bytes at {at}",
                self.len
            )));
        }
        let DmaBuf {
            ptr,
            offset,
            len,
            owner,
            ..
        } = self;
        let lease = match owner {
            Owner::Slot(l) => Arc::new(l),
            Owner::Part(l) => l,
        };
        // SAFETY: `offset + len <= capacity`, so both pointers stay within (or one past) the buffer, which lies
        // inside the mapping; `ptr` is non-null and so is any pointer derived from it by an in-bounds offset.
        let (first, second) = unsafe {
            (
                NonNull::new_unchecked(ptr.as_ptr().add(offset)),
                NonNull::new_unchecked(ptr.as_ptr().add(offset + at)),
            )
        };
        let part = |ptr, len, lease| DmaBuf {
            ptr,
            capacity: len,
            offset: 0,
            len,
            owner: Owner::Part(lease),
        };
        Ok((
            part(first, at, Arc::clone(&lease)),
            part(second, len - at, lease),
        ))
    }

    /// The address of the first visible byte, for handing the window to code outside Rust (which must not
    /// touch it while a transport owns the buffer).
    ///
    /// The pointer is derived from the pool's mapping, not from a borrow of the window, so writes that come
    /// later through other pointers into the same memory (a device's DMA, the test device's copies) leave it
    /// valid: Miri's aliasing model checks this in the PCIe driver's shared queue memory.
    ///
    /// See [`DmaBuf`]'s example.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        // SAFETY: `offset <= capacity` (kept by `set_window` and `split_at`), so the result stays inside the
        // buffer, which lies inside the live mapping.
        unsafe { self.ptr.as_ptr().add(self.offset) }
    }
}

impl Deref for DmaBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl DerefMut for DmaBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

impl fmt::Debug for DmaBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DmaBuf")
            .field(
                "vaddr",
                &format_args!("{:#x}", self.ptr.as_ptr() as usize + self.offset),
            )
            .field("iova", &format_args!("{:#x}", self.iova()))
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("capacity", &self.capacity)
            .finish()
    }
}

/// How many hugepages of one size the kernel has reserved, and how many are still free.
///
/// # Examples
///
/// ```
/// use nvpoll::mem::HugepageStatus;
///
/// let s = HugepageStatus { page_size: 2 << 20, total: 512, free: 100, reserved: 40, surplus: 0 };
/// assert_eq!(s.available(), 60);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HugepageStatus {
    /// The hugepage size in bytes.
    pub page_size: usize,
    /// Pages in the pool (`nr_hugepages`, `HugePages_Total`).
    pub total: u64,
    /// Pages not yet faulted in by anyone (`free_hugepages`, `HugePages_Free`); includes `reserved`.
    pub free: u64,
    /// Free pages promised to existing mappings (`resv_hugepages`, `HugePages_Rsvd`).
    pub reserved: u64,
    /// Pages allocated beyond `total` through overcommit (`surplus_hugepages`, `HugePages_Surp`).
    pub surplus: u64,
}

impl HugepageStatus {
    /// Pages a new mapping can still get: `free - reserved`. See [`HugepageStatus`]'s example.
    pub fn available(&self) -> u64 {
        self.free.saturating_sub(self.reserved)
    }
}

/// Copies `src` into `dst` (of the same length) with streaming (non-temporal) stores where it can: whole 64-byte
/// lines of `dst` go straight to memory, without first reading them into the cache (the read-for-ownership an
/// ordinary store needs) and without evicting what the cache holds. The edges, and a copy shorter than a few
/// lines, use ordinary stores. The copy is complete and ordered before later stores (`sfence`) when this
/// returns. On other architectures it is `copy_from_slice`.
///
/// This pays for big destinations that will not be read again soon, such as a 4 KiB block written at random into
/// a RAM namespace larger than the caches: on the 2-vCPU development VM (Xeon, KVM), random 4 KiB copies into 256
/// MiB took 366 ns with streaming stores against 477 ns with `copy_from_slice`. Into memory the cache holds it is
/// slower (375 against 152 ns at 16 MiB).
///
/// # Panics
/// If the lengths differ, as `copy_from_slice` does.
///
/// # Examples
///
/// ```
/// use nvpoll::mem::copy_nontemporal;
///
/// let block: Vec<u8> = (0..4096).map(|i| i as u8).collect();
/// let mut namespace = vec![0u8; 64 * 1024];
/// copy_nontemporal(&mut namespace[8192..12288], &block);
/// assert_eq!(namespace[8192..12288], block[..]);
/// ```
pub fn copy_nontemporal(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_nontemporal: lengths differ");
    #[cfg(target_arch = "x86_64")]
    {
        const LINE: usize = 64;
        let head = dst.as_ptr().align_offset(LINE).min(dst.len());
        let lines = (dst.len() - head) / LINE;
        if lines >= 4 {
            let body = head + lines * LINE;
            dst[..head].copy_from_slice(&src[..head]);
            stream_lines(&mut dst[head..body], &src[head..body]);
            dst[body..].copy_from_slice(&src[body..]);
            return;
        }
    }
    dst.copy_from_slice(src);
}

/// The streaming part of [`copy_nontemporal`]: `dst` is 64-byte aligned and a whole number of lines long, and
/// `src` is as long (at any alignment).
#[cfg(target_arch = "x86_64")]
fn stream_lines(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128};
    #[cfg(not(miri))]
    use std::arch::x86_64::{_mm_sfence, _mm_stream_si128};
    debug_assert!(dst.len() == src.len() && dst.len() % 64 == 0 && dst.as_ptr() as usize % 64 == 0);
    for (d, s) in dst.chunks_exact_mut(16).zip(src.chunks_exact(16)) {
        // SAFETY: SSE2 is part of the x86_64 baseline, so these intrinsics exist on every x86_64 CPU. `s` is 16
        // readable bytes (loadu takes any alignment). `d` is 16 writable bytes, exclusively borrowed, and 16-byte
        // aligned as `_mm_stream_si128` requires: `dst` starts 64-byte aligned and the chunks are 16 bytes.
        unsafe {
            let v = _mm_loadu_si128(s.as_ptr().cast::<__m128i>());
            // Miri cannot run the streaming store (inline assembly): it checks the same pointer with an aligned
            // ordinary store, which has the same alignment and bounds requirements.
            #[cfg(not(miri))]
            _mm_stream_si128(d.as_mut_ptr().cast::<__m128i>(), v);
            #[cfg(miri)]
            d.as_mut_ptr().cast::<__m128i>().write(v);
        }
    }
    // SAFETY: as above, SSE2 is always there. The fence orders the streaming stores (weakly ordered) before any
    // later store, such as the release of a lock that publishes the data.
    #[cfg(not(miri))]
    unsafe {
        _mm_sfence()
    };
}

/// Reads the hugepage counters for `page_size` (e.g. [`HUGEPAGE_SIZE`], or 1 GiB) from
/// `/sys/kernel/mm/hugepages`, or from `/proc/meminfo` for the default size where sysfs is missing.
/// Fails with [`Error::InvalidArgument`] for a size the kernel does not support.
///
/// # Examples
///
/// ```no_run
/// use nvpoll::mem::{hugepage_status, HUGEPAGE_SIZE};
///
/// // Needs a kernel with hugepage support (sysfs or /proc/meminfo).
/// let s = hugepage_status(HUGEPAGE_SIZE)?;
/// println!("{} of {} hugepages of 2 MiB available", s.available(), s.total);
/// # Ok::<(), nvpoll::Error>(())
/// ```
pub fn hugepage_status(page_size: usize) -> Result<HugepageStatus> {
    let dir = format!("/sys/kernel/mm/hugepages/hugepages-{}kB", page_size / 1024);
    let read = |name: &str| -> Result<u64> {
        let path = format!("{dir}/{name}");
        let text =
            std::fs::read_to_string(&path).map_err(|e| Error::os(format!("reading {path}"), e))?;
        text.trim()
            .parse()
            .map_err(|_| Error::InvalidArgument(format!("{path} holds {:?}", text.trim())))
    };
    if std::path::Path::new(&dir).is_dir() {
        return Ok(HugepageStatus {
            page_size,
            total: read("nr_hugepages")?,
            free: read("free_hugepages")?,
            reserved: read("resv_hugepages")?,
            surplus: read("surplus_hugepages")?,
        });
    }
    let meminfo = std::fs::read_to_string("/proc/meminfo")
        .map_err(|e| Error::os("reading /proc/meminfo", e))?;
    parse_meminfo(&meminfo)
        .filter(|s| s.page_size == page_size)
        .ok_or_else(|| {
            Error::InvalidArgument(format!("this kernel has no hugepages of {page_size} bytes"))
        })
}

/// Parses the hugepage lines of `/proc/meminfo` (which describe the default hugepage size only).
fn parse_meminfo(text: &str) -> Option<HugepageStatus> {
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        line[name.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()
    };
    Some(HugepageStatus {
        page_size: usize::try_from(field("Hugepagesize:")?).ok()? * 1024,
        total: field("HugePages_Total:")?,
        free: field("HugePages_Free:")?,
        reserved: field("HugePages_Rsvd:")?,
        surplus: field("HugePages_Surp:")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_is_parsed() {
        let text = "MemTotal:       24000000 kB\nHugePages_Total:       8\nHugePages_Free:        6\n\
                    HugePages_Rsvd:        2\nHugePages_Surp:        0\nHugepagesize:       2048 kB\n";
        let s = parse_meminfo(text).unwrap();
        assert_eq!(
            s,
            HugepageStatus {
                page_size: HUGEPAGE_SIZE,
                total: 8,
                free: 6,
                reserved: 2,
                surplus: 0
            }
        );
        assert_eq!(s.available(), 4);
        assert_eq!(parse_meminfo("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn copy_nontemporal_copies_every_byte_at_any_alignment_and_length() {
        // Under Miri (thousands of times slower) the lengths that reach the streaming loop with a head and a
        // tail, at every destination alignment class.
        let (dst_offs, src_offs, lens): (&[usize], &[usize], &[usize]) = if cfg!(miri) {
            (&[0, 1, 64, 100], &[0, 33], &[0, 63, 256, 257, 777])
        } else {
            (
                &[0, 1, 15, 16, 63, 64, 100],
                &[0, 1, 8, 33],
                &[0, 1, 63, 64, 255, 256, 257, 4096, 4097, 8191],
            )
        };
        let src: Vec<u8> = (0..lens[lens.len() - 1] as u32 + 64)
            .map(|i| (i * 7 + 3) as u8)
            .collect();
        let mut backing = vec![0u8; src.len() + 128];
        for &dst_off in dst_offs {
            for &src_off in src_offs {
                for &len in lens {
                    backing.fill(0xee);
                    let s = &src[src_off..src_off + len];
                    copy_nontemporal(&mut backing[dst_off..dst_off + len], s);
                    assert_eq!(
                        &backing[dst_off..dst_off + len],
                        s,
                        "dst+{dst_off} src+{src_off} len {len}"
                    );
                    assert!(
                        backing[..dst_off].iter().all(|&b| b == 0xee),
                        "wrote before the range"
                    );
                    assert!(
                        backing[dst_off + len..].iter().all(|&b| b == 0xee),
                        "wrote past the range"
                    );
                }
            }
        }
    }

    #[test]
    fn split_parts_are_disjoint_and_the_slot_returns_with_the_last_part() {
        let pool = DmaPool::builder()
            .class(16384, 1)
            .hugepages(HugepageMode::Off)
            .build()
            .unwrap();
        let mut whole = pool.alloc(16384).unwrap();
        let base = whole.as_mut_ptr() as usize;
        let iova = whole.iova();
        whole.set_window(1000, 12000).unwrap();
        let (mut a, rest) = whole.split_at(4096).unwrap();
        let (mut b, mut c) = rest.split_at(4096).unwrap();
        assert_eq!((a.len(), a.capacity()), (4096, 4096));
        assert_eq!((b.len(), c.len()), (4096, 12000 - 8192));
        assert_eq!(a.as_mut_ptr() as usize, base + 1000);
        assert_eq!(b.as_mut_ptr() as usize, base + 1000 + 4096);
        assert_eq!(c.iova(), iova + 1000 + 8192);
        a.as_mut_slice().fill(1);
        b.as_mut_slice().fill(2);
        c.as_mut_slice().fill(3);
        assert!(a.iter().all(|&x| x == 1) && b.iter().all(|&x| x == 2));
        // A part's window moves within the part only.
        assert!(b.set_window(1, 4096).is_err());
        b.set_window(96, 4000).unwrap();
        assert_eq!(pool.available(16384), 0);
        drop(a);
        drop(c);
        assert_eq!(pool.available(16384), 0, "one part is still out");
        drop(b);
        assert_eq!(pool.available(16384), 1);
    }

    #[test]
    fn buffers_of_every_class_are_aligned_disjoint_and_come_back() {
        let pool = DmaPool::builder()
            .class(4096, 3)
            .class(16384, 2)
            .hugepages(HugepageMode::Off)
            .build()
            .unwrap();
        let mut bufs: Vec<DmaBuf> = [1, 4096, 4097, 16384, 100]
            .iter()
            .map(|&len| pool.alloc(len).unwrap())
            .collect();
        assert_eq!((pool.available(4096), pool.available(16384)), (0, 0));
        assert!(
            matches!(pool.alloc(1), Err(Error::Memory(_))),
            "an empty class is an error, never a wait or a larger class"
        );
        assert!(matches!(pool.alloc(16385), Err(Error::InvalidArgument(_))));
        for (i, b) in bufs.iter_mut().enumerate() {
            assert_eq!(b.iova() % b.capacity() as u64, 0, "aligned to its class");
            b.as_mut_slice().fill(i as u8);
        }
        for (i, b) in bufs.iter().enumerate() {
            assert!(
                b.iter().all(|&x| x == i as u8),
                "buffer {i} was overwritten"
            );
        }
        drop(bufs);
        assert_eq!((pool.available(4096), pool.available(16384)), (3, 2));
    }

    /// Two threads take and return buffers of one pool at once (Miri checks the free list for data races).
    #[test]
    fn buffers_move_between_threads() {
        let pool = DmaPool::builder()
            .class(4096, 4)
            .hugepages(HugepageMode::Off)
            .build()
            .unwrap();
        let rounds = if cfg!(miri) { 20 } else { 10_000 };
        std::thread::scope(|s| {
            for t in 0..2u8 {
                let pool = &pool;
                s.spawn(move || {
                    for _ in 0..rounds {
                        let mut b = pool.alloc(64).unwrap();
                        b.as_mut_slice().fill(t);
                        assert!(b.iter().all(|&x| x == t));
                    }
                });
            }
        });
        assert_eq!(pool.available(4096), 4);
    }

    #[test]
    fn split_past_the_window_is_refused() {
        let pool = DmaPool::builder()
            .class(4096, 1)
            .hugepages(HugepageMode::Off)
            .build()
            .unwrap();
        let buf = pool.alloc(100).unwrap();
        assert!(buf.split_at(101).is_err());
        assert_eq!(pool.available(4096), 1, "the refused buffer went back");
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn copy_nontemporal_refuses_different_lengths() {
        copy_nontemporal(&mut [0u8; 8], &[0u8; 7]);
    }
}

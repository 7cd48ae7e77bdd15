//! Memory the driver shares with the device: the controller's registers (BAR0) and DMA memory (queues, PRP
//! lists), accessed only through volatile loads and stores.
//!
//! - [`Bar`]: a mapped register window. Registers are read and written with plain, aligned 32-bit volatile
//!   accesses (a 64-bit register is two of them, low dword first): wide or vector MMIO is fragile under
//!   emulation, and the NVMe specification allows 32-bit accesses to every register.
//! - [`SharedMem`]: a [`DmaBuf`] that the device reads or writes behind the compiler's back (submission and
//!   completion queues, PRP lists). Each access is volatile, so a completion written by the device is seen by
//!   the next poll, and [`wmb`] / [`rmb`] (device barriers per architecture) put an entry the driver posts in
//!   memory before the doorbell that announces it, and a completion's phase tag before the rest of it.
//! - `HostMemory` (crate-private, with the `fake` feature or in tests): the device's side of DMA for the
//!   memory-backed controller stand-in (`crate::fake`): it reads and writes host memory by IOVA, like a device
//!   behind an IOMMU. It is private because its soundness rests on the driver's contract with a device (it is
//!   handed only memory no Rust reference borrows while a command runs), which only this crate's code keeps.
//!
//! Together with `vfio.rs` this module holds all the `unsafe` code of the crate.
#![allow(unsafe_code)]

use std::ptr::NonNull;
#[cfg(target_arch = "x86_64")]
use std::sync::atomic::{compiler_fence, Ordering};

use nvpoll::mem::DmaBuf;
#[cfg(any(test, feature = "fake"))]
use nvpoll::mem::{DmaPool, DmaRegion};
use nvpoll::spec::{Cqe, Sqe, CQE_SIZE, SQE_SIZE};

/// A mapped register window (BAR0 of an NVMe controller), unmapped on drop.
#[derive(Debug)]
pub struct Bar {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: the window is device memory that any thread may access with volatile loads and stores; `Bar` holds
// no thread-local state, and every access is a single aligned 32-bit load or store.
unsafe impl Send for Bar {}
// SAFETY: as above; shared access only ever performs volatile loads and stores of whole registers.
unsafe impl Sync for Bar {}

impl Bar {
    /// Takes ownership of a mapping of `len` bytes at `base`, which [`Drop`] unmaps with `munmap`.
    ///
    /// # Safety
    /// `base..base + len` must be a live, readable and writable shared mapping made with `mmap` that nothing
    /// else unmaps, and no Rust reference may point into it.
    pub(crate) unsafe fn from_mmap(base: NonNull<u8>, len: usize) -> Bar {
        Bar { base, len }
    }

    /// Size of the window in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the window is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Panics unless a 32-bit register at `offset` lies in the window and is aligned.
    #[inline(always)]
    fn check(&self, offset: usize) {
        assert!(
            offset % 4 == 0 && offset + 4 <= self.len,
            "register offset {offset:#x} outside BAR0 ({:#x} bytes) or unaligned",
            self.len
        );
    }

    /// Reads the 32-bit register at `offset`.
    #[inline]
    pub fn read32(&self, offset: usize) -> u32 {
        self.check(offset);
        // SAFETY: `check` keeps the aligned 4-byte access inside the live mapping (see `from_mmap`).
        unsafe { self.base.as_ptr().add(offset).cast::<u32>().read_volatile() }
    }

    /// Writes the 32-bit register at `offset`.
    #[inline]
    pub fn write32(&self, offset: usize, value: u32) {
        self.check(offset);
        // SAFETY: as in `read32`.
        unsafe {
            self.base
                .as_ptr()
                .add(offset)
                .cast::<u32>()
                .write_volatile(value)
        }
    }
}

impl Bar {
    /// Cuts the window off the device, atomically for every thread: the device mapping is replaced, in one
    /// step, by private memory that reads as all ones (what a removed device answers). A register access
    /// racing with this reaches either the device or that memory, never a hole; later writes land in that
    /// memory, never on the device (the driver reads no register it wrote after this). The window stays valid
    /// (its address and length unchanged) until the `Bar` is dropped. Afterwards the mapping no longer holds
    /// the device file, so the kernel can release the device once its fds close.
    pub(crate) fn detach(&self) -> std::io::Result<()> {
        // SAFETY: a fresh private anonymous mapping; the kernel picks an address where nothing lives.
        let spare = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                self.len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if spare == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `spare` is the `len`-byte mapping just made, readable and writable, seen by no one else.
        unsafe { std::ptr::write_bytes(spare.cast::<u8>(), 0xff, self.len) };
        // SAFETY: moves the spare mapping onto the window's page-aligned range of the same length. The kernel
        // unmaps the device mapping there and moves the spare in while holding the process's mmap lock, so a
        // concurrent access (volatile 32-bit loads and stores only, see `read32`) faults into one or the
        // other. The range stays mapped, and `Drop` unmaps it as before.
        let moved = unsafe {
            libc::mremap(
                spare,
                self.len,
                self.len,
                libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                self.base.as_ptr().cast::<libc::c_void>(),
            )
        };
        if moved == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            // SAFETY: the spare mapping was not moved; it is ours alone and unmapped only here.
            unsafe { libc::munmap(spare, self.len) };
            return Err(e);
        }
        Ok(())
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        // SAFETY: the mapping was made by mmap with this address and length and is unmapped only here.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// A DMA buffer shared with the device, accessed only with volatile loads and stores.
///
/// It owns the [`DmaBuf`], so the memory stays valid (and is never borrowed as a Rust slice) for as long as
/// the device may use it.
pub struct SharedMem {
    ptr: NonNull<u8>,
    len: usize,
    iova: u64,
    /// Keeps the memory alive; never dereferenced while `SharedMem` exists.
    _buf: DmaBuf,
}

// SAFETY: `SharedMem` owns its buffer exclusively (the DmaBuf is Send) and holds only a pointer into it.
unsafe impl Send for SharedMem {}

impl std::fmt::Debug for SharedMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedMem")
            .field("iova", &format_args!("{:#x}", self.iova))
            .field("len", &self.len)
            .finish()
    }
}

impl SharedMem {
    /// Takes over `buf` (its visible window), zeroing it.
    pub fn new(mut buf: DmaBuf) -> SharedMem {
        buf.as_mut_slice().fill(0);
        let len = buf.len();
        let iova = buf.iova();
        let ptr = NonNull::new(buf.as_mut_ptr()).expect("DMA buffer pointers are non-null");
        SharedMem {
            ptr,
            len,
            iova,
            _buf: buf,
        }
    }

    /// The IOVA of the first byte.
    #[inline]
    pub fn iova(&self) -> u64 {
        self.iova
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    #[inline(always)]
    fn at<T>(&self, offset: usize) -> *mut T {
        let size = std::mem::size_of::<T>();
        assert!(
            offset % std::mem::align_of::<T>() == 0 && offset + size <= self.len,
            "shared memory access of {size} bytes at {offset:#x} outside {:#x} bytes or unaligned",
            self.len
        );
        // SAFETY: the assertion keeps the pointer inside the buffer.
        unsafe { self.ptr.as_ptr().add(offset).cast() }
    }

    /// Zeroes the whole buffer.
    pub fn zero(&mut self) {
        // SAFETY: the range is exactly the buffer, which this value owns; no reference to it exists.
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr(), 0, self.len) };
        wmb();
    }

    /// Writes a 64-bit little-endian value at `offset` (8-byte aligned), e.g. a PRP list entry.
    #[inline]
    pub fn write_u64(&mut self, offset: usize, value: u64) {
        let p = self.at::<u64>(offset);
        // SAFETY: `at` checked bounds and alignment; the buffer is owned and not borrowed.
        unsafe { p.write_volatile(value.to_le()) }
    }

    /// Reads a 64-bit little-endian value at `offset` (8-byte aligned).
    #[inline]
    pub fn read_u64(&self, offset: usize) -> u64 {
        let p = self.at::<u64>(offset);
        // SAFETY: as in `write_u64`.
        u64::from_le(unsafe { p.read_volatile() })
    }

    /// Writes a submission queue entry into slot `index`.
    #[inline]
    pub fn write_sqe(&mut self, index: usize, sqe: &Sqe) {
        let p = self.at::<[u64; SQE_SIZE / 8]>(index * SQE_SIZE);
        let words = sqe_words(sqe);
        // SAFETY: `at` checked bounds and alignment; the buffer is owned and not borrowed.
        unsafe { p.write_volatile(words) }
    }

    /// Reads the completion queue entry in slot `index` if its phase tag equals `phase`: the dword holding the
    /// phase is read first, and the rest only after it (with [`rmb`] between).
    #[inline]
    pub fn read_cqe(&self, index: usize, phase: bool) -> Option<Cqe> {
        let base = index * CQE_SIZE;
        let p = self.at::<[u32; CQE_SIZE / 4]>(base).cast::<u32>();
        // SAFETY: `at` checked that the 16-byte entry lies in the buffer, 4-byte aligned.
        let dw3 = u32::from_le(unsafe { p.add(3).read_volatile() });
        if (dw3 >> 16) & 1 != u32::from(phase) {
            return None;
        }
        rmb();
        // SAFETY: as above.
        let (dw0, dw1, dw2) = unsafe {
            (
                u32::from_le(p.read_volatile()),
                u32::from_le(p.add(1).read_volatile()),
                u32::from_le(p.add(2).read_volatile()),
            )
        };
        Some(Cqe {
            dw0,
            dw1,
            sqhd: dw2 as u16,
            sqid: (dw2 >> 16) as u16,
            cid: dw3 as u16,
            status_phase: (dw3 >> 16) as u16,
        })
    }

    /// Copies `out.len()` bytes from `offset` into `out`.
    pub fn read_bytes(&self, offset: usize, out: &mut [u8]) {
        assert!(
            offset + out.len() <= self.len,
            "read past the shared buffer"
        );
        // SAFETY: the range lies in the owned buffer; `out` is a distinct Rust allocation.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().add(offset),
                out.as_mut_ptr(),
                out.len(),
            )
        };
    }
}

/// The SQE as the eight little-endian quadwords of its wire form.
#[inline(always)]
fn sqe_words(sqe: &Sqe) -> [u64; SQE_SIZE / 8] {
    let dw = |lo: u32, hi: u32| u64::from(lo) | u64::from(hi) << 32;
    let dw0 = u32::from(sqe.opcode) | u32::from(sqe.flags) << 8 | u32::from(sqe.cid) << 16;
    [
        dw(dw0, sqe.nsid).to_le(),
        dw(sqe.cdw2, sqe.cdw3).to_le(),
        sqe.mptr.to_le(),
        sqe.dptr1.to_le(),
        sqe.dptr2.to_le(),
        dw(sqe.cdw10, sqe.cdw11).to_le(),
        dw(sqe.cdw12, sqe.cdw13).to_le(),
        dw(sqe.cdw14, sqe.cdw15).to_le(),
    ]
}

// Device barriers, per architecture: what Linux calls dma_wmb() (before a doorbell, in writel()) and
// dma_rmb() (between reading a completion's phase tag and the rest of it).
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
compile_error!(
    "nvpoll-pcie has device memory barriers for x86_64 and aarch64 only; add this architecture's to mmio.rs"
);

/// Orders this CPU's earlier stores to DMA memory (a submission queue entry, a PRP list) before its later
/// stores, a doorbell's MMIO write included, as the device sees them.
///
/// x86-64 keeps stores in program order for write-back and uncached memory alike, so only the compiler must
/// be kept from reordering; aarch64 needs `dmb oshst` (outer shareable: the device is outside the inner
/// shareable domain, which a plain release fence, `dmb ish`, covers).
#[inline(always)]
pub fn wmb() {
    #[cfg(target_arch = "x86_64")]
    compiler_fence(Ordering::SeqCst);
    #[cfg(target_arch = "aarch64")]
    // SAFETY: a barrier instruction; it reads and writes no memory and, without `nomem`, is also a compiler
    // barrier for every access around it.
    unsafe {
        std::arch::asm!("dmb oshst", options(nostack, preserves_flags))
    };
}

/// Orders this CPU's earlier loads from DMA memory (a completion entry's phase tag) before its later loads
/// (the rest of the entry), against what the device wrote.
///
/// x86-64 does not reorder loads with loads: a compiler barrier is enough. aarch64 needs `dmb oshld`.
#[inline(always)]
pub fn rmb() {
    #[cfg(target_arch = "x86_64")]
    compiler_fence(Ordering::SeqCst);
    #[cfg(target_arch = "aarch64")]
    // SAFETY: as in `wmb`.
    unsafe {
        std::arch::asm!("dmb oshld", options(nostack, preserves_flags))
    };
}

/// The device's side of DMA for the memory-backed controller stand-in: reads and writes host memory by IOVA,
/// through the regions of the pools mapped into it, as a device behind an IOMMU does.
///
/// It follows the same contract as a real device: the driver hands it only IOVAs of memory it does not borrow
/// while the command runs (queue memory, PRP lists, the buffer of an in-flight command). An IOVA outside every
/// mapped region is refused, as an IOMMU would fault it.
#[cfg(any(test, feature = "fake"))]
#[derive(Debug, Default)]
pub(crate) struct HostMemory {
    regions: Vec<(DmaRegion, DmaPool)>,
}

#[cfg(any(test, feature = "fake"))]
impl HostMemory {
    /// An empty view: nothing is mapped.
    pub(crate) fn new() -> HostMemory {
        HostMemory::default()
    }

    /// Maps every region of `pool` (at the IOVA the pool reports); keeps the pool alive until removed.
    pub(crate) fn add(&mut self, pool: &DmaPool) {
        for r in pool.regions() {
            self.regions.push((r, pool.clone()));
        }
    }

    /// How many regions are mapped.
    pub(crate) fn regions(&self) -> usize {
        self.regions.len()
    }

    /// Unmaps the regions of `pool`. Returns how many were mapped.
    pub(crate) fn remove(&mut self, pool: &DmaPool) -> usize {
        let gone = pool.regions();
        let before = self.regions.len();
        self.regions.retain(|(r, _)| !gone.contains(r));
        before - self.regions.len()
    }

    /// Whether `iova..iova + len` lies in one mapped region.
    pub(crate) fn contains(&self, iova: u64, len: usize) -> bool {
        self.translate(iova, len).is_some()
    }

    fn translate(&self, iova: u64, len: usize) -> Option<*mut u8> {
        let (r, _) = self.regions.iter().find(|(r, _)| {
            iova >= r.iova
                && iova
                    .checked_add(len as u64)
                    .is_some_and(|end| end <= r.iova + r.len as u64)
        })?;
        Some((r.vaddr + (iova - r.iova) as usize) as *mut u8)
    }

    /// Device read: copies `out.len()` bytes at `iova` into `out`. Returns `false` (copying nothing) when the
    /// range is not mapped.
    pub(crate) fn read(&self, iova: u64, out: &mut [u8]) -> bool {
        let Some(p) = self.translate(iova, out.len()) else {
            return false;
        };
        // SAFETY: `translate` found the range inside a region of a live pool (kept alive by the clone we hold);
        // by this type's contract no Rust reference borrows it while the device accesses it.
        unsafe { std::ptr::copy_nonoverlapping(p, out.as_mut_ptr(), out.len()) };
        true
    }

    /// Device write: copies `data` to `iova`. Returns `false` (copying nothing) when the range is not mapped.
    pub(crate) fn write(&self, iova: u64, data: &[u8]) -> bool {
        let Some(p) = self.translate(iova, data.len()) else {
            return false;
        };
        // SAFETY: as in `read`.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nvpoll::mem::HugepageMode;

    fn pool() -> DmaPool {
        DmaPool::builder()
            .class(4096, 4)
            .hugepages(HugepageMode::Off)
            .build()
            .unwrap()
    }

    #[test]
    fn sqe_words_match_the_wire_form() {
        let sqe = Sqe {
            opcode: 0x02,
            flags: 0x40,
            cid: 0x1234,
            nsid: 7,
            cdw2: 2,
            cdw3: 3,
            mptr: 0x1111,
            dptr1: 0xdead_beef_0000,
            dptr2: 0x2000,
            cdw10: 10,
            cdw11: 11,
            cdw12: 12,
            cdw13: 13,
            cdw14: 14,
            cdw15: 15,
        };
        let words = sqe_words(&sqe);
        let bytes: Vec<u8> = words
            .iter()
            .flat_map(|w| u64::from_le(*w).to_le_bytes())
            .collect();
        assert_eq!(bytes, sqe.to_bytes());
    }

    #[test]
    fn shared_mem_and_host_memory_agree() {
        let pool = pool();
        let mut mem = SharedMem::new(pool.alloc(4096).unwrap());
        let mut host = HostMemory::new();
        let sqe = Sqe::read(1, 0x1234, 7);
        mem.write_sqe(2, &sqe);
        let mut b = [0u8; 64];
        assert!(
            !host.read(mem.iova() + 128, &mut b),
            "nothing is mapped yet"
        );
        host.add(&pool);
        assert!(host.read(mem.iova() + 128, &mut b));
        assert_eq!(Sqe::from_bytes(&b), Some(sqe));

        let mut cqe = Cqe {
            dw0: 5,
            cid: 9,
            sqhd: 3,
            sqid: 1,
            ..Default::default()
        };
        cqe.set_status(nvpoll::spec::Status::SUCCESS, true);
        assert_eq!(mem.read_cqe(1, true), None);
        assert!(host.write(mem.iova() + 16, &cqe.to_bytes()));
        assert_eq!(mem.read_cqe(1, false), None, "wrong phase");
        assert_eq!(mem.read_cqe(1, true), Some(cqe));

        mem.write_u64(4088, 0xabcd);
        assert_eq!(mem.read_u64(4088), 0xabcd);
        assert!(!host.contains(mem.iova() + 4090, 4096 * 4));
        assert_eq!(host.remove(&pool), 1);
        assert!(!host.contains(mem.iova(), 1));
    }

    /// A shared mapping of a 16 KiB file, standing in for a BAR mapped from the VFIO device fd.
    #[cfg(not(miri))]
    fn file_bar() -> (std::fs::File, Bar) {
        use std::os::fd::AsRawFd;
        let path = std::env::temp_dir().join(format!("nvpoll-bar-{}", std::process::id()));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        let _ = std::fs::remove_file(&path);
        file.set_len(16384).unwrap();
        // SAFETY: a fresh shared mapping of a file we own; the kernel picks the address.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                16384,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        // SAFETY: the live mapping just made, owned by nothing else.
        let bar = unsafe { Bar::from_mmap(NonNull::new(base.cast()).unwrap(), 16384) };
        (file, bar)
    }

    // Not under Miri, which maps no files and has no mremap; the pure parts of this module are checked there.
    #[cfg(not(miri))]
    #[test]
    fn a_detached_bar_reads_all_ones_and_no_longer_reaches_the_device() {
        use std::os::unix::fs::FileExt;
        let (file, bar) = file_bar();
        bar.write32(0x1c, 1);
        let mut b = [0u8; 4];
        file.read_exact_at(&mut b, 0x1c).unwrap();
        assert_eq!(u32::from_le_bytes(b), 1, "the mapping reaches the file");
        let bar = std::sync::Arc::new(bar);
        // Another thread keeps reading and writing registers while the window is cut off.
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let done = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let t = {
            let (bar, stop, done) = (bar.clone(), stop.clone(), done.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let v = bar.read32(0x1c);
                    assert!(v == 1 || v == u32::MAX, "read {v:#x}");
                    bar.write32(0x1000, done.load(Ordering::Relaxed) as u32);
                    done.fetch_add(1, Ordering::Release);
                }
            })
        };
        // The window is cut off while the other thread is inside its loop, and it goes on after the cut.
        let after = |n: u64| {
            while done.load(Ordering::Acquire) <= n && !t.is_finished() {
                std::thread::yield_now();
            }
            done.load(Ordering::Acquire)
        };
        let before = after(0);
        bar.detach().unwrap();
        let cut = done.load(Ordering::Acquire);
        after(cut + 1000);
        stop.store(true, Ordering::Relaxed);
        t.join().unwrap();
        assert!(before > 0 && done.load(Ordering::Relaxed) > cut + 1000);
        assert_eq!(bar.read32(0x1c), u32::MAX);
        assert_eq!(bar.read32(0x3ffc), u32::MAX);
        bar.write32(0x1c, 7);
        file.read_exact_at(&mut b, 0x1c).unwrap();
        assert_eq!(
            u32::from_le_bytes(b),
            1,
            "a write after detach reached the file"
        );
    }

    #[test]
    #[should_panic(expected = "outside")]
    fn shared_mem_is_bounds_checked() {
        let pool = pool();
        let mem = SharedMem::new(pool.alloc(4096).unwrap());
        mem.read_u64(4096);
    }
}

//! Physical Region Page (PRP) entries: how a command tells the controller where its data is.
//!
//! With a memory page size of 4 KiB (CC.MPS = 0), a transfer of `len` bytes at IOVA `a` takes:
//! - PRP1 = `a` (which may start anywhere in a page, dword aligned);
//! - nothing more if it ends within that first page (PRP2 = 0);
//! - PRP2 = the second page if it ends within two pages;
//! - otherwise PRP2 = the IOVA of a PRP list holding the page addresses from the second page on. When the
//!   list reaches the last entry of a list page and more than one entry remains, that entry points to the
//!   next list page instead (a chained list).
//!
//! A buffer from [`nvpoll::mem::DmaPool`] is contiguous in IOVA space, so the entries are consecutive pages.
//! The list lives in memory the command's tracker owns ([`crate::mmio::SharedMem`]), so building it allocates
//! nothing.

use crate::mmio::SharedMem;

/// The memory page size the driver configures (CC.MPS = 0).
pub const PAGE_SIZE: u64 = 4096;

/// The PRP entries for one command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prps {
    /// PRP entry 1.
    pub prp1: u64,
    /// PRP entry 2: 0, the second page, or the list's IOVA.
    pub prp2: u64,
    /// Which of the four shapes it took.
    pub shape: Shape,
}

/// The shape of a PRP description.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// The data lies in one page: PRP1 only.
    OnePage,
    /// Two pages: PRP1 and PRP2.
    TwoPages,
    /// PRP2 points to a list within one list page.
    List,
    /// PRP2 points to a list that chains across list pages.
    ChainedList,
}

/// Why a buffer cannot be described.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PrpError {
    /// The buffer does not start on a dword boundary.
    #[error("buffer at IOVA {0:#x} is not dword aligned")]
    Unaligned(u64),
    /// The transfer needs more list entries than the tracker's list holds.
    #[error("a transfer of {len} bytes needs {needed} PRP list entries; the list holds {room}")]
    TooLong {
        /// Transfer length.
        len: u32,
        /// Entries needed (data entries plus chain pointers).
        needed: usize,
        /// Entries the list has room for.
        room: usize,
    },
}

/// How many list entries (data pages plus chain pointers) a transfer of `len` bytes at `iova` needs when the
/// list starts at IOVA `list_iova`; 0 when it needs no list.
pub fn list_entries(iova: u64, len: u32, list_iova: u64) -> usize {
    let first = PAGE_SIZE - (iova & (PAGE_SIZE - 1));
    let len = u64::from(len);
    if len <= first + PAGE_SIZE {
        return 0;
    }
    let data = (len - first).div_ceil(PAGE_SIZE) as usize;
    // Walk list pages: each holds PAGE_SIZE / 8 slots from its start, fewer in the first (list offset).
    let per_page = (PAGE_SIZE / 8) as usize;
    let mut slots_left_in_page = per_page - ((list_iova & (PAGE_SIZE - 1)) / 8) as usize;
    let mut remaining = data;
    let mut used = 0;
    loop {
        if remaining <= slots_left_in_page {
            return used + remaining;
        }
        // Fill all but the last slot with data, the last with the chain pointer.
        used += slots_left_in_page;
        remaining -= slots_left_in_page - 1;
        slots_left_in_page = per_page;
    }
}

/// Describes `len` bytes (at least 1) at `iova`, writing a PRP list, when one is needed, into `list` from
/// byte `list_offset` (8-byte aligned) on.
#[inline]
pub fn build(
    iova: u64,
    len: u32,
    list: &mut SharedMem,
    list_offset: usize,
) -> Result<Prps, PrpError> {
    if iova & 3 != 0 {
        return Err(PrpError::Unaligned(iova));
    }
    let page_off = iova & (PAGE_SIZE - 1);
    let first = PAGE_SIZE - page_off;
    let len64 = u64::from(len);
    if len64 <= first {
        return Ok(Prps {
            prp1: iova,
            prp2: 0,
            shape: Shape::OnePage,
        });
    }
    let second = iova - page_off + PAGE_SIZE;
    if len64 <= first + PAGE_SIZE {
        return Ok(Prps {
            prp1: iova,
            prp2: second,
            shape: Shape::TwoPages,
        });
    }
    let list_iova = list.iova() + list_offset as u64;
    let data = (len64 - first).div_ceil(PAGE_SIZE) as usize;
    let room = (list.len() - list_offset) / 8;
    // The common case, a list within one page, needs no chain check per entry.
    let in_first_page = ((PAGE_SIZE - (list_iova & (PAGE_SIZE - 1))) / 8) as usize;
    let shape = if data <= in_first_page && data <= room {
        for k in 0..data {
            list.write_u64(list_offset + 8 * k, second + k as u64 * PAGE_SIZE);
        }
        Shape::List
    } else {
        let needed = list_entries(iova, len, list_iova);
        if needed > room {
            return Err(PrpError::TooLong { len, needed, room });
        }
        let mut slot = list_offset;
        for k in 0..data {
            let slot_iova = list.iova() + slot as u64;
            if slot_iova & (PAGE_SIZE - 1) == PAGE_SIZE - 8 && data - k > 1 {
                list.write_u64(slot, slot_iova + 8);
                slot += 8;
            }
            list.write_u64(slot, second + k as u64 * PAGE_SIZE);
            slot += 8;
        }
        Shape::ChainedList
    };
    Ok(Prps {
        prp1: iova,
        prp2: list_iova,
        shape,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use nvpoll::mem::{DmaPool, HugepageMode};

    fn list(pages: usize) -> (DmaPool, SharedMem) {
        let pool = DmaPool::builder()
            .class(4096 * pages.next_power_of_two(), 1)
            .hugepages(HugepageMode::Off)
            .build()
            .unwrap();
        let buf = pool.alloc(4096 * pages).unwrap();
        (pool.clone(), SharedMem::new(buf))
    }

    /// Walks a PRP description as a controller does and returns the (address, length) segments.
    fn walk(p: Prps, len: u32, mem: &SharedMem) -> Vec<(u64, u64)> {
        let mut segs = Vec::new();
        let mut left = u64::from(len);
        let first = (PAGE_SIZE - (p.prp1 & (PAGE_SIZE - 1))).min(left);
        segs.push((p.prp1, first));
        left -= first;
        if left == 0 {
            assert_eq!(p.prp2, 0);
            return segs;
        }
        if left <= PAGE_SIZE {
            assert_eq!(p.prp2 % PAGE_SIZE, 0);
            segs.push((p.prp2, left));
            return segs;
        }
        let mut entry = p.prp2;
        while left > 0 {
            let v = mem.read_u64((entry - mem.iova()) as usize);
            if entry % PAGE_SIZE == PAGE_SIZE - 8 && left > PAGE_SIZE {
                assert_eq!(v % PAGE_SIZE, 0, "chain pointer is page aligned");
                entry = v;
                continue;
            }
            assert_eq!(v % PAGE_SIZE, 0, "list entries are page aligned");
            let n = left.min(PAGE_SIZE);
            segs.push((v, n));
            left -= n;
            entry += 8;
        }
        segs
    }

    fn check(iova: u64, len: u32, list_offset: usize, pages: usize) -> Prps {
        let (_pool, mut mem) = list(pages);
        let p = build(iova, len, &mut mem, list_offset).unwrap();
        let segs = walk(p, len, &mem);
        let mut at = iova;
        for (a, n) in &segs {
            assert_eq!(*a, at, "segments are contiguous for {iova:#x}+{len}");
            at += n;
        }
        assert_eq!(at, iova + u64::from(len));
        p
    }

    #[test]
    fn every_shape() {
        let base = 0x10_0000u64;
        // One page.
        assert_eq!(check(base, 512, 0, 1).shape, Shape::OnePage);
        assert_eq!(check(base, 512, 0, 1).prp2, 0);
        assert_eq!(check(base, 4096, 0, 1).prp2, 0);
        assert_eq!(check(base + 4092, 4, 0, 1).prp2, 0);
        // Two pages.
        assert_eq!(check(base, 8192, 0, 1).prp2, base + 4096);
        assert_eq!(check(base, 8192, 0, 1).shape, Shape::TwoPages);
        assert_eq!(check(base + 4, 4096, 0, 1).prp2, base + 4096);
        // A list.
        let (_pool, mut mem) = list(1);
        let p = build(base, 12288, &mut mem, 0).unwrap();
        assert_eq!(p.prp2, mem.iova());
        assert_eq!(p.shape, Shape::List);
        assert_eq!(p.shape, Shape::List);
        assert_eq!(mem.read_u64(0), base + 4096);
        assert_eq!(mem.read_u64(8), base + 8192);
        // An unaligned start spills into one more page.
        check(base + 100, 512 * 1024, 0, 1);
        check(base + 4, 128 * 4096, 0, 1);
        // 2 MiB exactly fills one list page (511 entries after PRP1) ...
        assert_eq!(list_entries(base, 2 << 20, 0), 511);
        check(base, 2 << 20, 0, 1);
        // ... and 2 MiB + 8 KiB needs a chain.
        assert_eq!(list_entries(base, (2 << 20) + 8192, 0), 514);
        assert_eq!(
            check(base, (2 << 20) + 8192, 0, 2).shape,
            Shape::ChainedList
        );
        check(base + 8, 4 << 20, 0, 3);
    }

    #[test]
    fn list_at_an_offset_chains_across_pages() {
        let base = 0x20_0000u64;
        // 512 KiB needs 127 list entries; at offset 4096 - 256 only 32 fit in the first page.
        let off = 4096 - 256;
        assert_eq!(list_entries(base, 512 * 1024, off as u64), 128);
        let (_pool, mut mem) = list(2);
        let p = build(base, 512 * 1024, &mut mem, off).unwrap();
        assert_eq!(p.prp2, mem.iova() + off as u64);
        assert_eq!(p.shape, Shape::ChainedList);
        assert_eq!(
            mem.read_u64(4088),
            mem.iova() + 4096,
            "chain pointer in the last slot"
        );
        assert_eq!(mem.read_u64(4080), base + 31 * 4096);
        assert_eq!(mem.read_u64(4096), base + 32 * 4096);
        check(base, 512 * 1024, off, 2);
        check(base + 4, 512 * 1024, off, 2);
        // Exactly filling the first page's slots needs no chain.
        assert_eq!(list_entries(base, 33 * 4096, off as u64), 32);
        check(base, 33 * 4096, off, 1);
        // One more entry: the last slot becomes a chain pointer and two entries move on.
        assert_eq!(list_entries(base, 34 * 4096, off as u64), 34);
        check(base, 34 * 4096, off, 2);
    }

    #[test]
    fn refuses_what_it_cannot_describe() {
        let (_pool, mut mem) = list(1);
        assert_eq!(
            build(0x1002, 512, &mut mem, 0),
            Err(PrpError::Unaligned(0x1002))
        );
        let e = build(0x10_0000, 4 << 20, &mut mem, 0).unwrap_err();
        assert!(matches!(e, PrpError::TooLong { room: 512, .. }), "{e:?}");
    }
}

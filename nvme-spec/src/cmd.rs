//! The 64-byte submission queue entry and the 16-byte completion queue entry, with builders for the admin and
//! NVM I/O commands a driver sends. Fabrics command builders are in [`super::fabrics`].
//!
//! Builders leave the command identifier and the data pointer at 0: the queue assigns the first, the transport
//! fills in the second (PRPs, or an SGL descriptor through [`Sqe::set_sgl`]).

use super::opcodes::{admin, io};
use super::sgl::SglDescriptor;
use super::status::Status;

/// Size of a submission queue entry in bytes.
pub const SQE_SIZE: usize = 64;
/// Size of a completion queue entry in bytes.
pub const CQE_SIZE: usize = 16;

/// A submission queue entry (NVMe Base spec, "Common Command Format").
///
/// Fabrics commands reuse the layout: their `fctype` lives in byte 4, which is the low byte of `nsid`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct Sqe {
    /// Command dword 0, bits 7:0.
    pub opcode: u8,
    /// Command dword 0, bits 15:8: FUSE (1:0) and PSDT (7:6).
    pub flags: u8,
    /// Command identifier.
    pub cid: u16,
    /// Namespace identifier.
    pub nsid: u32,
    /// Command dword 2.
    pub cdw2: u32,
    /// Command dword 3.
    pub cdw3: u32,
    /// Metadata pointer.
    pub mptr: u64,
    /// Data pointer, first half (PRP entry 1, or the first 8 bytes of an SGL descriptor).
    pub dptr1: u64,
    /// Data pointer, second half (PRP entry 2, or the last 8 bytes of an SGL descriptor).
    pub dptr2: u64,
    /// Command dword 10.
    pub cdw10: u32,
    /// Command dword 11.
    pub cdw11: u32,
    /// Command dword 12.
    pub cdw12: u32,
    /// Command dword 13.
    pub cdw13: u32,
    /// Command dword 14.
    pub cdw14: u32,
    /// Command dword 15.
    pub cdw15: u32,
}

const _: () = assert!(std::mem::size_of::<Sqe>() == SQE_SIZE);
const _: () = assert!(std::mem::offset_of!(Sqe, nsid) == 4);
const _: () = assert!(std::mem::offset_of!(Sqe, mptr) == 16);
const _: () = assert!(std::mem::offset_of!(Sqe, dptr1) == 24);
const _: () = assert!(std::mem::offset_of!(Sqe, cdw10) == 40);
const _: () = assert!(std::mem::offset_of!(Sqe, cdw15) == 60);

impl Sqe {
    /// PSDT value selecting SGLs for the data pointer (with SGL descriptors, not segments, for metadata).
    pub const PSDT_SGL: u8 = 0b01 << 6;

    /// Encodes the entry into its 64-byte little-endian wire form.
    pub fn to_bytes(&self) -> [u8; SQE_SIZE] {
        let mut b = [0u8; SQE_SIZE];
        self.write_to(&mut b);
        b
    }

    /// Encodes the entry into `out` (exactly 64 bytes).
    pub fn write_to(&self, out: &mut [u8; SQE_SIZE]) {
        out[0] = self.opcode;
        out[1] = self.flags;
        out[2..4].copy_from_slice(&self.cid.to_le_bytes());
        out[4..8].copy_from_slice(&self.nsid.to_le_bytes());
        out[8..12].copy_from_slice(&self.cdw2.to_le_bytes());
        out[12..16].copy_from_slice(&self.cdw3.to_le_bytes());
        out[16..24].copy_from_slice(&self.mptr.to_le_bytes());
        out[24..32].copy_from_slice(&self.dptr1.to_le_bytes());
        out[32..40].copy_from_slice(&self.dptr2.to_le_bytes());
        let dw = [
            self.cdw10, self.cdw11, self.cdw12, self.cdw13, self.cdw14, self.cdw15,
        ];
        for (i, d) in dw.iter().enumerate() {
            out[40 + 4 * i..44 + 4 * i].copy_from_slice(&d.to_le_bytes());
        }
    }

    /// Decodes an entry from the first 64 bytes of `b`; `None` if `b` is shorter.
    pub fn from_bytes(b: &[u8]) -> Option<Sqe> {
        let b: &[u8; SQE_SIZE] = b.get(..SQE_SIZE)?.try_into().ok()?;
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64_at = |o: usize| u64::from(u32_at(o)) | (u64::from(u32_at(o + 4)) << 32);
        Some(Sqe {
            opcode: b[0],
            flags: b[1],
            cid: u16::from_le_bytes([b[2], b[3]]),
            nsid: u32_at(4),
            cdw2: u32_at(8),
            cdw3: u32_at(12),
            mptr: u64_at(16),
            dptr1: u64_at(24),
            dptr2: u64_at(32),
            cdw10: u32_at(40),
            cdw11: u32_at(44),
            cdw12: u32_at(48),
            cdw13: u32_at(52),
            cdw14: u32_at(56),
            cdw15: u32_at(60),
        })
    }

    /// The data pointer as the 16 raw bytes of an SGL descriptor.
    pub fn dptr_bytes(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&self.dptr1.to_le_bytes());
        b[8..].copy_from_slice(&self.dptr2.to_le_bytes());
        b
    }

    /// Sets the data pointer from the 16 raw bytes of an SGL descriptor.
    pub fn set_dptr_bytes(&mut self, b: &[u8; 16]) {
        self.dptr1 = u64::from_le_bytes(b[..8].try_into().expect("8 bytes"));
        self.dptr2 = u64::from_le_bytes(b[8..].try_into().expect("8 bytes"));
    }
}

/// Builders for common commands.
impl Sqe {
    /// Reads and Writes: Force Unit Access (dword 12 bit 30).
    pub const FUA: u32 = 1 << 30;
    /// Reads and Writes: Limited Retry (dword 12 bit 31).
    pub const LIMITED_RETRY: u32 = 1 << 31;
    /// Write Zeroes: Deallocate the blocks if the namespace can (dword 12 bit 25).
    pub const DEALLOCATE: u32 = 1 << 25;

    /// Identify: the structure selected by `cns` (see [`super::cns`]) for namespace `nsid`.
    pub fn identify(cns: u8, nsid: u32) -> Sqe {
        Sqe {
            opcode: admin::IDENTIFY,
            nsid,
            cdw10: cns.into(),
            ..Default::default()
        }
    }

    /// Get Log Page: `len` bytes (a multiple of 4, at least 4) of log `lid` (see [`super::log_page`]) from byte
    /// `offset` (a multiple of 4), for namespace `nsid` (`0xffff_ffff` for the controller-wide log).
    pub fn get_log_page(lid: u8, nsid: u32, len: u32, offset: u64) -> Sqe {
        let numd = (len / 4).saturating_sub(1);
        Sqe {
            opcode: admin::GET_LOG_PAGE,
            nsid,
            cdw10: u32::from(lid) | (numd & 0xffff) << 16,
            cdw11: numd >> 16,
            cdw12: (offset & 0xffff_ffff) as u32,
            cdw13: (offset >> 32) as u32,
            ..Default::default()
        }
    }

    /// Get Features: the current value of feature `fid` (see [`super::feature`]).
    pub fn get_features(fid: u8) -> Sqe {
        Sqe {
            opcode: admin::GET_FEATURES,
            cdw10: fid.into(),
            ..Default::default()
        }
    }

    /// Set Features: feature `fid` to `cdw11` (not saved across resets).
    pub fn set_features(fid: u8, cdw11: u32) -> Sqe {
        Sqe {
            opcode: admin::SET_FEATURES,
            cdw10: fid.into(),
            cdw11,
            ..Default::default()
        }
    }

    /// Keep Alive.
    pub fn keep_alive() -> Sqe {
        Sqe {
            opcode: admin::KEEP_ALIVE,
            ..Default::default()
        }
    }

    /// Asynchronous Event Request; it completes only when an event occurs.
    pub fn async_event_request() -> Sqe {
        Sqe {
            opcode: admin::ASYNC_EVENT_REQUEST,
            ..Default::default()
        }
    }

    /// Abort the command `cid` on submission queue `sqid`.
    pub fn abort(sqid: u16, cid: u16) -> Sqe {
        Sqe {
            opcode: admin::ABORT,
            cdw10: u32::from(sqid) | u32::from(cid) << 16,
            ..Default::default()
        }
    }

    /// Create I/O Completion Queue `qid` of `qsize_zero_based + 1` entries in physically contiguous memory at
    /// `base`, with interrupts on `irq_vector`, or polled if `None`.
    pub fn create_io_cq(
        qid: u16,
        qsize_zero_based: u16,
        base: u64,
        irq_vector: Option<u16>,
    ) -> Sqe {
        let (ien, iv) = irq_vector.map_or((0, 0), |v| (1 << 1, u32::from(v) << 16));
        Sqe {
            opcode: admin::CREATE_IO_CQ,
            dptr1: base,
            cdw10: u32::from(qid) | u32::from(qsize_zero_based) << 16,
            cdw11: 1 | ien | iv,
            ..Default::default()
        }
    }

    /// Create I/O Submission Queue `qid` of `qsize_zero_based + 1` entries in physically contiguous memory at
    /// `base`, completing to queue `cqid`, at medium priority.
    pub fn create_io_sq(qid: u16, qsize_zero_based: u16, base: u64, cqid: u16) -> Sqe {
        Sqe {
            opcode: admin::CREATE_IO_SQ,
            dptr1: base,
            cdw10: u32::from(qid) | u32::from(qsize_zero_based) << 16,
            cdw11: 1 | u32::from(cqid) << 16,
            ..Default::default()
        }
    }

    /// Delete I/O Submission Queue `qid`.
    pub fn delete_io_sq(qid: u16) -> Sqe {
        Sqe {
            opcode: admin::DELETE_IO_SQ,
            cdw10: qid.into(),
            ..Default::default()
        }
    }

    /// Delete I/O Completion Queue `qid` (after its submission queues).
    pub fn delete_io_cq(qid: u16) -> Sqe {
        Sqe {
            opcode: admin::DELETE_IO_CQ,
            cdw10: qid.into(),
            ..Default::default()
        }
    }

    /// Read `nlb_zero_based + 1` logical blocks from `slba` of namespace `nsid`.
    pub fn read(nsid: u32, slba: u64, nlb_zero_based: u16) -> Sqe {
        Self::lba_range(io::READ, nsid, slba, nlb_zero_based)
    }

    /// Write `nlb_zero_based + 1` logical blocks at `slba` of namespace `nsid`.
    pub fn write(nsid: u32, slba: u64, nlb_zero_based: u16) -> Sqe {
        Self::lba_range(io::WRITE, nsid, slba, nlb_zero_based)
    }

    /// Write Zeroes to `nlb_zero_based + 1` logical blocks at `slba` (no data transfer).
    pub fn write_zeroes(nsid: u32, slba: u64, nlb_zero_based: u16) -> Sqe {
        Self::lba_range(io::WRITE_ZEROES, nsid, slba, nlb_zero_based)
    }

    /// Flush the volatile write cache of namespace `nsid` (`0xffff_ffff`: all namespaces).
    pub fn flush(nsid: u32) -> Sqe {
        Sqe {
            opcode: io::FLUSH,
            nsid,
            ..Default::default()
        }
    }

    /// Dataset Management, deallocate: the data is `nr_zero_based + 1` [`DsmRange`]s.
    pub fn dsm_deallocate(nsid: u32, nr_zero_based: u8) -> Sqe {
        Sqe {
            opcode: io::DSM,
            nsid,
            cdw10: nr_zero_based.into(),
            cdw11: 1 << 2,
            ..Default::default()
        }
    }

    fn lba_range(opcode: u8, nsid: u32, slba: u64, nlb_zero_based: u16) -> Sqe {
        Sqe {
            opcode,
            nsid,
            cdw10: (slba & 0xffff_ffff) as u32,
            cdw11: (slba >> 32) as u32,
            cdw12: nlb_zero_based.into(),
            ..Default::default()
        }
    }

    /// The same command with Force Unit Access set (reads and writes).
    pub fn with_fua(mut self) -> Sqe {
        self.cdw12 |= Self::FUA;
        self
    }

    /// The starting LBA of a read, write or write zeroes (dwords 10 and 11).
    pub fn slba(&self) -> u64 {
        u64::from(self.cdw10) | u64::from(self.cdw11) << 32
    }

    /// The 0-based block count of a read, write or write zeroes (dword 12 bits 15:0).
    pub fn nlb_zero_based(&self) -> u16 {
        (self.cdw12 & 0xffff) as u16
    }

    /// Puts an SGL descriptor in the data pointer and selects SGLs in PSDT.
    pub fn set_sgl(&mut self, desc: &SglDescriptor) {
        self.set_dptr_bytes(&desc.to_bytes());
        self.flags = (self.flags & !0xc0) | Self::PSDT_SGL;
    }

    /// The data pointer read as an SGL descriptor.
    pub fn sgl(&self) -> SglDescriptor {
        SglDescriptor::from_array(&self.dptr_bytes())
    }
}

/// Size of a Dataset Management range.
pub const DSM_RANGE_SIZE: usize = 16;

/// One range of a Dataset Management command's data.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DsmRange {
    /// Context attributes (access hints; 0 for none).
    pub attributes: u32,
    /// Length in logical blocks (1-based, unlike the read/write NLB field).
    pub nlb: u32,
    /// Starting LBA.
    pub slba: u64,
}

impl DsmRange {
    /// Encodes the range (16 bytes).
    pub fn to_bytes(&self) -> [u8; DSM_RANGE_SIZE] {
        let mut b = [0u8; DSM_RANGE_SIZE];
        b[0..4].copy_from_slice(&self.attributes.to_le_bytes());
        b[4..8].copy_from_slice(&self.nlb.to_le_bytes());
        b[8..16].copy_from_slice(&self.slba.to_le_bytes());
        b
    }

    /// Decodes every whole range in `b` (a Dataset Management command's data).
    pub fn parse_all(b: &[u8]) -> Vec<DsmRange> {
        b.chunks_exact(DSM_RANGE_SIZE)
            .map(|c| {
                let u32_at = |o: usize| u32::from_le_bytes([c[o], c[o + 1], c[o + 2], c[o + 3]]);
                DsmRange {
                    attributes: u32_at(0),
                    nlb: u32_at(4),
                    slba: u64::from(u32_at(8)) | u64::from(u32_at(12)) << 32,
                }
            })
            .collect()
    }
}

/// A completion queue entry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct Cqe {
    /// Command-specific dword 0.
    pub dw0: u32,
    /// Command-specific dword 1.
    pub dw1: u32,
    /// Submission queue head pointer.
    pub sqhd: u16,
    /// Submission queue identifier.
    pub sqid: u16,
    /// Command identifier of the completed command.
    pub cid: u16,
    /// Phase tag (bit 0) and status field (bits 15:1).
    pub status_phase: u16,
}

const _: () = assert!(std::mem::size_of::<Cqe>() == CQE_SIZE);
const _: () = assert!(std::mem::offset_of!(Cqe, cid) == 12);

impl Cqe {
    /// Encodes the entry into its 16-byte little-endian wire form.
    pub fn to_bytes(&self) -> [u8; CQE_SIZE] {
        let mut b = [0u8; CQE_SIZE];
        b[0..4].copy_from_slice(&self.dw0.to_le_bytes());
        b[4..8].copy_from_slice(&self.dw1.to_le_bytes());
        b[8..10].copy_from_slice(&self.sqhd.to_le_bytes());
        b[10..12].copy_from_slice(&self.sqid.to_le_bytes());
        b[12..14].copy_from_slice(&self.cid.to_le_bytes());
        b[14..16].copy_from_slice(&self.status_phase.to_le_bytes());
        b
    }

    /// Decodes an entry from the first 16 bytes of `b`; `None` if `b` is shorter.
    pub fn from_bytes(b: &[u8]) -> Option<Cqe> {
        let b = b.get(..CQE_SIZE)?;
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        Some(Cqe {
            dw0: u32_at(0),
            dw1: u32_at(4),
            sqhd: u16_at(8),
            sqid: u16_at(10),
            cid: u16_at(12),
            status_phase: u16_at(14),
        })
    }

    /// The phase tag.
    pub fn phase(&self) -> bool {
        self.status_phase & 1 != 0
    }

    /// The status field, without the phase tag.
    pub fn status(&self) -> Status {
        Status::from_raw(self.status_phase >> 1)
    }

    /// Sets the status field and the phase tag.
    pub fn set_status(&mut self, status: Status, phase: bool) {
        self.status_phase = status.raw() << 1 | u16::from(phase);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqe_round_trip_and_layout() {
        let sqe = Sqe {
            opcode: 0x02,
            flags: 0x40,
            cid: 0x1234,
            nsid: 1,
            cdw10: 0xdead_beef,
            cdw11: 0x1,
            cdw12: 7,
            dptr1: 0x1122_3344_5566_7788,
            ..Default::default()
        };
        let b = sqe.to_bytes();
        assert_eq!(&b[0..4], &[0x02, 0x40, 0x34, 0x12]);
        assert_eq!(&b[24..32], &0x1122_3344_5566_7788u64.to_le_bytes());
        assert_eq!(&b[40..44], &[0xef, 0xbe, 0xad, 0xde]);
        assert_eq!(Sqe::from_bytes(&b), Some(sqe));
        assert_eq!(Sqe::from_bytes(&b[..63]), None);
    }

    #[test]
    fn cqe_round_trip() {
        let b = [1, 0, 0, 0, 0, 0, 0, 0, 5, 0, 1, 0, 0x34, 0x12, 0x03, 0x40];
        let c = Cqe::from_bytes(&b).unwrap();
        assert_eq!(c.cid, 0x1234);
        assert!(c.phase());
        assert_eq!(c.status().raw(), 0x2001);
        assert_eq!(c.to_bytes(), b);
        assert_eq!(Cqe::from_bytes(&b[..15]), None);
    }

    #[test]
    fn admin_builders() {
        let id = Sqe::identify(crate::cns::CONTROLLER, 0).to_bytes();
        assert_eq!((id[0], id[40]), (0x06, 0x01));
        let lp = Sqe::get_log_page(crate::log_page::DISCOVERY, 0, 3072, 0x1_0000_0400);
        assert_eq!((lp.opcode, lp.cdw10, lp.cdw11), (0x02, 0x02ff_0070, 0));
        assert_eq!((lp.cdw12, lp.cdw13), (0x400, 1));
        let big = Sqe::get_log_page(0x02, u32::MAX, 0x40_0000, 0);
        assert_eq!((big.cdw10 >> 16, big.cdw11), (0xffff, 0xf));
        assert_eq!(Sqe::get_log_page(0x02, 0, 0, 0).cdw10 >> 16, 0);
        let sf = Sqe::set_features(crate::feature::NUMBER_OF_QUEUES, 0x0003_0003);
        assert_eq!((sf.opcode, sf.cdw10, sf.cdw11), (0x09, 0x07, 0x0003_0003));
        assert_eq!(Sqe::get_features(0x0f).cdw10, 0x0f);
        assert_eq!(Sqe::keep_alive().opcode, 0x18);
        assert_eq!(Sqe::async_event_request().opcode, 0x0c);
        assert_eq!(Sqe::abort(2, 0x1234).cdw10, 0x1234_0002);
        let cq = Sqe::create_io_cq(1, 1023, 0x8000, Some(3));
        assert_eq!(
            (cq.opcode, cq.dptr1, cq.cdw10, cq.cdw11),
            (0x05, 0x8000, 0x03ff_0001, 0x0003_0003)
        );
        assert_eq!(Sqe::create_io_cq(1, 1023, 0x8000, None).cdw11, 1);
        let sq = Sqe::create_io_sq(1, 1023, 0x9000, 1);
        assert_eq!(
            (sq.opcode, sq.dptr1, sq.cdw10, sq.cdw11),
            (0x01, 0x9000, 0x03ff_0001, 0x0001_0001)
        );
        assert_eq!(
            (Sqe::delete_io_sq(4).opcode, Sqe::delete_io_sq(4).cdw10),
            (0x00, 4)
        );
        assert_eq!(
            (Sqe::delete_io_cq(4).opcode, Sqe::delete_io_cq(4).cdw10),
            (0x04, 4)
        );
    }

    #[test]
    fn io_builders() {
        let r = Sqe::read(1, 0x1_2345_6789, 7);
        let b = r.to_bytes();
        assert_eq!((b[0], &b[4..8]), (0x02, &[1u8, 0, 0, 0][..]));
        assert_eq!(
            &b[40..52],
            &[0x89, 0x67, 0x45, 0x23, 1, 0, 0, 0, 7, 0, 0, 0]
        );
        assert_eq!((r.slba(), r.nlb_zero_based()), (0x1_2345_6789, 7));
        let w = Sqe::write(1, 8, 0).with_fua();
        assert_eq!((w.opcode, w.cdw12), (0x01, 0x4000_0000));
        assert_eq!(Sqe::write_zeroes(2, 0, 0xffff).opcode, 0x08);
        assert_eq!(Sqe::write_zeroes(2, 0, 0xffff).cdw12, 0xffff);
        assert_eq!((Sqe::flush(1).opcode, Sqe::flush(1).nsid), (0x00, 1));
        let d = Sqe::dsm_deallocate(1, 1);
        assert_eq!((d.opcode, d.cdw10, d.cdw11), (0x09, 1, 4));
        let ranges = [
            DsmRange {
                attributes: 0,
                nlb: 8,
                slba: 0x100,
            },
            DsmRange {
                attributes: 1,
                nlb: 1,
                slba: 1 << 40,
            },
        ];
        let data: Vec<u8> = ranges.iter().flat_map(|r| r.to_bytes()).collect();
        assert_eq!(
            &data[..16],
            &[0, 0, 0, 0, 8, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(DsmRange::parse_all(&data), ranges);
        assert_eq!(DsmRange::parse_all(&data[..31]), ranges[..1]);
    }

    #[test]
    fn sgl_in_the_data_pointer() {
        let mut sqe = Sqe::write(1, 0, 7);
        sqe.set_sgl(&SglDescriptor::in_capsule(0, 4096));
        let b = sqe.to_bytes();
        assert_eq!(b[1], 0x40);
        assert_eq!(&b[24..40], &SglDescriptor::in_capsule(0, 4096).to_bytes());
        assert_eq!(b[39], 0x01);
        assert_eq!(sqe.sgl(), SglDescriptor::in_capsule(0, 4096));
        sqe.set_sgl(&SglDescriptor::transport_data_block(8192));
        assert_eq!(sqe.to_bytes()[39], 0x5a);
    }

    #[test]
    fn cqe_status() {
        let mut c = Cqe::default();
        c.set_status(Status::LBA_OUT_OF_RANGE.with_dnr(), true);
        assert!(c.phase());
        assert_eq!(c.status(), Status::LBA_OUT_OF_RANGE.with_dnr());
        assert_eq!(c.to_bytes()[14..16], [0x01, 0x81]);
    }
}

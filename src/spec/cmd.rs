//! The 64-byte submission queue entry and the 16-byte completion queue entry.

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
        let dw = [self.cdw10, self.cdw11, self.cdw12, self.cdw13, self.cdw14, self.cdw15];
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
    pub fn status(&self) -> crate::spec::Status {
        crate::spec::Status::from_raw(self.status_phase >> 1)
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
}

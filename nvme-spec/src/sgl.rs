//! Scatter gather list descriptors (NVMe Base 2.0, "Scatter Gather List (SGL)").
//!
//! A descriptor is 16 bytes: an address (bytes 7:0), a length (bytes 11:8; bytes 10:8 for keyed descriptors, whose
//! key fills bytes 14:11) and an identifier byte (byte 15) holding the type in its high nibble and the subtype in
//! its low nibble.
//!
//! NVMe/TCP uses two forms in the command capsule: in-capsule data is a Data Block descriptor with the Offset
//! subtype (identifier 0x01, address = offset into the capsule's data), and data moved by separate H2C/C2H data
//! PDUs is a Transport Data Block with the transport-specific subtype (identifier 0x5A, address 0).

use super::wire::{bytes_at, need, put_u32, put_u64, u32_at, u64_at, ParseError};

/// Size of an SGL descriptor in bytes.
pub const SGL_DESCRIPTOR_SIZE: usize = 16;

/// SGL descriptor types (byte 15, bits 7:4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SglType {
    /// A single data buffer.
    DataBlock,
    /// Data the controller discards (reads) or that is not transferred.
    BitBucket,
    /// A pointer to the next segment of descriptors.
    Segment,
    /// A pointer to the last segment of descriptors.
    LastSegment,
    /// A data buffer with a 32-bit key (RDMA).
    KeyedDataBlock,
    /// A data buffer whose location the transport defines (NVMe/TCP: separate data PDUs).
    TransportDataBlock,
    /// Vendor specific.
    VendorSpecific,
    /// A reserved type value.
    Reserved(u8),
}

impl SglType {
    /// The type for a 4-bit type value.
    pub const fn from_nibble(v: u8) -> SglType {
        match v & 0xf {
            0x0 => SglType::DataBlock,
            0x1 => SglType::BitBucket,
            0x2 => SglType::Segment,
            0x3 => SglType::LastSegment,
            0x4 => SglType::KeyedDataBlock,
            0x5 => SglType::TransportDataBlock,
            0xf => SglType::VendorSpecific,
            other => SglType::Reserved(other),
        }
    }

    /// The 4-bit type value.
    pub const fn nibble(self) -> u8 {
        match self {
            SglType::DataBlock => 0x0,
            SglType::BitBucket => 0x1,
            SglType::Segment => 0x2,
            SglType::LastSegment => 0x3,
            SglType::KeyedDataBlock => 0x4,
            SglType::TransportDataBlock => 0x5,
            SglType::VendorSpecific => 0xf,
            SglType::Reserved(v) => v & 0xf,
        }
    }
}

/// SGL descriptor subtypes (byte 15, bits 3:0).
pub mod subtype {
    /// The address field is a memory address.
    pub const ADDRESS: u8 = 0x0;
    /// The address field is an offset (NVMe/TCP in-capsule data: offset into the capsule's data).
    pub const OFFSET: u8 = 0x1;
    /// Transport specific (NVMe/TCP transport data blocks, RDMA keyed descriptors).
    pub const TRANSPORT: u8 = 0xa;
    /// Keyed descriptors: invalidate the key after the command (RDMA).
    pub const INVALIDATE_KEY: u8 = 0xf;
}

/// One SGL descriptor.
///
/// For every type but [`SglType::KeyedDataBlock`] the length is 32 bits and `key` is not on the wire (it decodes
/// as 0). For keyed descriptors the length is 24 bits: [`SglDescriptor::to_bytes`] keeps its low 24 bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SglDescriptor {
    /// Address or offset of the data, or of the next segment.
    pub address: u64,
    /// Length in bytes.
    pub length: u32,
    /// Key (keyed data blocks only).
    pub key: u32,
    /// Descriptor type.
    pub sgl_type: SglType,
    /// Descriptor subtype (see [`subtype`]).
    pub subtype: u8,
}

impl SglDescriptor {
    /// A data block at memory `address`.
    pub const fn data_block(address: u64, length: u32) -> SglDescriptor {
        Self::new(SglType::DataBlock, subtype::ADDRESS, address, length)
    }

    /// NVMe/TCP in-capsule data: a data block at `offset` into the capsule's data (identifier byte 0x01).
    pub const fn in_capsule(offset: u64, length: u32) -> SglDescriptor {
        Self::new(SglType::DataBlock, subtype::OFFSET, offset, length)
    }

    /// NVMe/TCP data carried by separate data PDUs: a transport data block (identifier byte 0x5A).
    pub const fn transport_data_block(length: u32) -> SglDescriptor {
        Self::new(SglType::TransportDataBlock, subtype::TRANSPORT, 0, length)
    }

    /// A keyed data block (RDMA); only the low 24 bits of `length` go on the wire.
    pub const fn keyed_data_block(address: u64, length: u32, key: u32) -> SglDescriptor {
        SglDescriptor {
            key,
            ..Self::new(SglType::KeyedDataBlock, subtype::ADDRESS, address, length)
        }
    }

    /// A segment of `length` bytes of further descriptors at `address`.
    pub const fn segment(address: u64, length: u32) -> SglDescriptor {
        Self::new(SglType::Segment, subtype::ADDRESS, address, length)
    }

    /// The last segment of `length` bytes of descriptors at `address`.
    pub const fn last_segment(address: u64, length: u32) -> SglDescriptor {
        Self::new(SglType::LastSegment, subtype::ADDRESS, address, length)
    }

    const fn new(sgl_type: SglType, subtype: u8, address: u64, length: u32) -> SglDescriptor {
        SglDescriptor {
            address,
            length,
            key: 0,
            sgl_type,
            subtype,
        }
    }

    /// The identifier byte (byte 15): type in bits 7:4, subtype in bits 3:0.
    pub const fn identifier(&self) -> u8 {
        (self.sgl_type.nibble() << 4) | (self.subtype & 0xf)
    }

    /// Encodes the descriptor into its 16-byte wire form.
    pub fn to_bytes(&self) -> [u8; SGL_DESCRIPTOR_SIZE] {
        let mut b = [0u8; SGL_DESCRIPTOR_SIZE];
        put_u64(&mut b, 0, self.address);
        if self.sgl_type == SglType::KeyedDataBlock {
            b[8..11].copy_from_slice(&self.length.to_le_bytes()[..3]);
            put_u32(&mut b, 11, self.key);
        } else {
            put_u32(&mut b, 8, self.length);
        }
        b[15] = self.identifier();
        b
    }

    /// Decodes a descriptor from the first 16 bytes of `b`.
    pub fn from_bytes(b: &[u8]) -> Result<SglDescriptor, ParseError> {
        need("SGL descriptor", b, SGL_DESCRIPTOR_SIZE)?;
        Ok(Self::from_array(&bytes_at(b, 0)))
    }

    /// Decodes a descriptor from its 16 bytes (every bit pattern is some descriptor).
    pub fn from_array(b: &[u8; SGL_DESCRIPTOR_SIZE]) -> SglDescriptor {
        let id = b[15];
        let sgl_type = SglType::from_nibble(id >> 4);
        let (length, key) = if sgl_type == SglType::KeyedDataBlock {
            (u32_at(b, 8) & 0x00ff_ffff, u32_at(b, 11))
        } else {
            (u32_at(b, 8), 0)
        };
        SglDescriptor {
            address: u64_at(b, 0),
            length,
            key,
            sgl_type,
            subtype: id & 0xf,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvme_tcp_forms() {
        let ic = SglDescriptor::in_capsule(0, 4096);
        let b = ic.to_bytes();
        assert_eq!(b, [0, 0, 0, 0, 0, 0, 0, 0, 0, 0x10, 0, 0, 0, 0, 0, 0x01]);
        assert_eq!(SglDescriptor::from_bytes(&b), Ok(ic));
        let t = SglDescriptor::transport_data_block(0x2_0000);
        let b = t.to_bytes();
        assert_eq!(b[15], 0x5a);
        assert_eq!(&b[8..12], &[0, 0, 2, 0]);
        let d = SglDescriptor::from_bytes(&b).unwrap();
        assert_eq!(
            (d.sgl_type, d.subtype, d.length, d.address),
            (SglType::TransportDataBlock, 0xa, 0x2_0000, 0)
        );
    }

    #[test]
    fn keyed_and_segments() {
        let k = SglDescriptor::keyed_data_block(0x1122_3344_5566_7788, 0x0012_3456, 0xaabb_ccdd);
        let b = k.to_bytes();
        assert_eq!(&b[8..16], &[0x56, 0x34, 0x12, 0xdd, 0xcc, 0xbb, 0xaa, 0x40]);
        assert_eq!(SglDescriptor::from_bytes(&b), Ok(k));
        // A keyed length wider than 24 bits keeps its low 24 bits.
        let wide = SglDescriptor::keyed_data_block(0, 0x0100_0001, 1);
        assert_eq!(
            SglDescriptor::from_bytes(&wide.to_bytes()).unwrap().length,
            1
        );
        for d in [
            SglDescriptor::segment(0x1000, 32),
            SglDescriptor::last_segment(0x2000, 48),
        ] {
            assert_eq!(SglDescriptor::from_bytes(&d.to_bytes()), Ok(d));
        }
        assert_eq!(SglDescriptor::last_segment(0, 0).identifier(), 0x30);
    }

    #[test]
    fn short_and_unknown() {
        assert!(matches!(
            SglDescriptor::from_bytes(&[0; 15]),
            Err(ParseError::Short {
                need: 16,
                got: 15,
                ..
            })
        ));
        let mut b = [0u8; 16];
        b[15] = 0x7f;
        let d = SglDescriptor::from_bytes(&b).unwrap();
        assert_eq!((d.sgl_type, d.subtype), (SglType::Reserved(7), 0xf));
        assert_eq!(d.to_bytes(), b);
        for v in 0..16 {
            assert_eq!(SglType::from_nibble(v).nibble(), v);
        }
    }
}

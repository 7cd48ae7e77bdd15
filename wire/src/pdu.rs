//! NVMe/TCP PDUs (NVMe/TCP transport specification 1.0 and 1.1): the wire types, an incremental zero-copy
//! decoder and encoders that append to a caller-owned buffer.
//!
//! # Wire format
//!
//! Every PDU starts with the 8-byte common header: `type`, `flags`, `hlen` (header length), `pdo` (offset of the
//! data section from the start of the PDU, 0 if there is none) and `plen` (the whole PDU's length, little
//! endian). Then come the rest of the PDU-specific header (`hlen` bytes in all), an optional 4-byte header
//! digest, padding up to `pdo`, the data, and an optional 4-byte data digest:
//!
//! ```text
//! | CH (8) | PSH (hlen - 8) | HDGST (4)? | PAD | DATA | DDGST (4)? |
//! 0                         hlen                pdo    pdo+len      plen
//! ```
//!
//! Digests are CRC32C, sent little endian (as Linux does: `cpu_to_le32(~crc32c(~0, ...))`). The header digest
//! covers the `hlen` header bytes, the data digest covers the data only (not the padding). The header digest
//! applies to CapsuleCmd, CapsuleResp, H2CData, C2HData and R2T; the data digest to the PDUs of those that carry
//! data. ICReq, ICResp and the termination requests never carry digests.
//!
//! Data is aligned to the receiver's PDU data alignment: the host pads H2C PDUs to the controller's CPDA, the
//! controller pads C2H PDUs to the host's HPDA. Both are 0's based counts of dwords, so a value `pda` aligns
//! `pdo` to `(pda + 1) * 4` bytes. The encoders take that raw value; the decoder accepts any `pdo` at or past the
//! end of the header (and header digest) and skips the padding.
//!
//! # Decoding
//!
//! [`decode`] looks at the start of a receive buffer and says either how many bytes the next PDU needs
//! ([`Decoded::Incomplete`]) or hands back the PDU with its data borrowed from the buffer and its length
//! ([`Decoded::Pdu`]). It checks the common header as soon as its 8 bytes are there, so a bogus `plen` is
//! rejected before anyone waits for more bytes, and the header digest and the header fields as soon as the
//! header is complete. Errors are typed ([`PduError`]); each maps to the fatal error status and information of
//! the termination request the receiver should send ([`PduError::fes`], [`PduError::fei`],
//! [`PduError::term_req`]). A data digest error is the one error that is not fatal: the spec has the command
//! fail with a transient transport error while the stream goes on, so that error tells how many bytes to skip.
//!
//! # Encoding
//!
//! The `encode_*` functions append one PDU to a `Vec<u8>` that the caller reuses, so nothing allocates once the
//! vector has grown to its working size. The `*_header` variants append only the header, header digest and
//! padding, so that the sender can hand header, data and data digest ([`data_digest`], [`DataDigest`]) to the
//! socket as separate iovecs without copying the data.

use std::fmt;

use nvpoll::spec::{Cqe, Sqe, CQE_SIZE, SQE_SIZE};

/// Length of the common header that starts every PDU.
pub const CH_LEN: usize = 8;
/// Length of a header or data digest.
pub const DIGEST_LEN: usize = 4;
/// Length of ICReq and ICResp (header and PDU alike).
pub const IC_LEN: usize = 128;
/// The most bytes of the offending PDU header a termination request carries.
pub const MAX_TERM_DATA: usize = 128;
/// The largest valid HPDA or CPDA value (0's based dwords: 128-byte alignment).
pub const MAX_PDA: u8 = 31;
/// The smallest MAXH2CDATA a controller may announce in ICResp.
pub const MIN_MAXH2CDATA: u32 = 4096;
/// The PDU format version defined by NVMe/TCP 1.0 and 1.1, the only one there is.
pub const PFV_1_0: u16 = 0;

/// Common header flag: a header digest follows the header.
pub const FLAG_HDGST: u8 = 0x01;
/// Common header flag: a data digest follows the data.
pub const FLAG_DDGST: u8 = 0x02;
/// H2CData and C2HData flag: the last data PDU of the command's transfer (or, for H2CData, of the R2T).
pub const FLAG_LAST_PDU: u8 = 0x04;
/// C2HData flag: the command succeeded and no CapsuleResp follows (only valid together with
/// [`FLAG_LAST_PDU`]).
pub const FLAG_SUCCESS: u8 = 0x08;

/// ICReq/ICResp digest field: header digests enabled.
const IC_DGST_HDGST: u8 = 0x01;
/// ICReq/ICResp digest field: data digests enabled.
const IC_DGST_DDGST: u8 = 0x02;

wire_enum! {
    /// The PDU types of NVMe/TCP.
    PduType: u8, from_u8;
    /// Initialize Connection Request, host to controller.
    IcReq = 0x00,
    /// Initialize Connection Response, controller to host.
    IcResp = 0x01,
    /// Host to Controller Terminate Connection Request.
    H2CTermReq = 0x02,
    /// Controller to Host Terminate Connection Request.
    C2HTermReq = 0x03,
    /// Command Capsule, host to controller.
    CapsuleCmd = 0x04,
    /// Response Capsule, controller to host.
    CapsuleResp = 0x05,
    /// Host to Controller Data.
    H2CData = 0x06,
    /// Controller to Host Data.
    C2HData = 0x07,
    /// Ready to Transfer, controller to host.
    R2T = 0x09,
}

impl PduType {
    /// The header length (`hlen`) the spec fixes for this type, without the header digest.
    // The lengths are constants of at most 128 (IC_LEN), so they fit in a byte.
    #[allow(clippy::cast_possible_truncation)]
    pub const fn hlen(self) -> u8 {
        match self {
            PduType::IcReq | PduType::IcResp => IC_LEN as u8,
            PduType::CapsuleCmd => (CH_LEN + SQE_SIZE) as u8,
            PduType::CapsuleResp => (CH_LEN + CQE_SIZE) as u8,
            PduType::H2CTermReq
            | PduType::C2HTermReq
            | PduType::H2CData
            | PduType::C2HData
            | PduType::R2T => 24,
        }
    }

    /// The direction in which PDUs of this type travel.
    pub const fn direction(self) -> Direction {
        match self {
            PduType::IcReq | PduType::H2CTermReq | PduType::CapsuleCmd | PduType::H2CData => {
                Direction::ToController
            }
            PduType::IcResp
            | PduType::C2HTermReq
            | PduType::CapsuleResp
            | PduType::C2HData
            | PduType::R2T => Direction::ToHost,
        }
    }

    /// Whether a negotiated header digest applies to this type (everything but ICReq, ICResp and the
    /// termination requests).
    pub const fn has_header_digest(self) -> bool {
        !matches!(
            self,
            PduType::IcReq | PduType::IcResp | PduType::H2CTermReq | PduType::C2HTermReq
        )
    }

    /// Whether this type may carry a data section with a data digest (CapsuleCmd, H2CData, C2HData).
    pub const fn has_data_digest(self) -> bool {
        matches!(
            self,
            PduType::CapsuleCmd | PduType::H2CData | PduType::C2HData
        )
    }
}

impl fmt::Display for PduType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PduType::IcReq => "ICReq",
            PduType::IcResp => "ICResp",
            PduType::H2CTermReq => "H2CTermReq",
            PduType::C2HTermReq => "C2HTermReq",
            PduType::CapsuleCmd => "CapsuleCmd",
            PduType::CapsuleResp => "CapsuleResp",
            PduType::H2CData => "H2CData",
            PduType::C2HData => "C2HData",
            PduType::R2T => "R2T",
        })
    }
}

/// Which way PDUs travel: what the decoder accepts is what the peer may send to us.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// From the controller to the host: a host decodes these.
    ToHost,
    /// From the host to the controller: a controller (target) decodes these.
    ToController,
}

/// Which digests a connection negotiated in ICReq/ICResp.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Digests {
    /// Header digests (HDGST).
    pub header: bool,
    /// Data digests (DDGST).
    pub data: bool,
}

impl Digests {
    /// No digests.
    pub const NONE: Digests = Digests {
        header: false,
        data: false,
    };
    /// Header and data digests.
    pub const BOTH: Digests = Digests {
        header: true,
        data: true,
    };
}

/// What the decoder expects of the byte stream it reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeConfig {
    /// Header digests were negotiated: PDUs to which they apply must have HDGSTF set and carry a valid one.
    pub hdgst: bool,
    /// Data digests were negotiated: PDUs with data must have DDGSTF set and carry a valid one.
    pub ddgst: bool,
    /// The largest data section accepted (in-capsule data, H2CData or C2HData); longer ones are rejected from
    /// the common header alone.
    pub max_data: u32,
    /// The direction of the PDUs we receive.
    pub direction: Direction,
}

impl DecodeConfig {
    /// A configuration for PDUs travelling in `direction`, with the negotiated `digests` and data limit.
    pub const fn new(direction: Direction, digests: Digests, max_data: u32) -> DecodeConfig {
        DecodeConfig {
            hdgst: digests.header,
            ddgst: digests.data,
            max_data,
            direction,
        }
    }

    /// The digests of this configuration.
    pub const fn digests(&self) -> Digests {
        Digests {
            header: self.hdgst,
            data: self.ddgst,
        }
    }
}

wire_enum! {
    /// Fatal error status of a termination request.
    Fes: u16, from_u16;
    /// Invalid PDU header field; FEI holds the byte offset of the field.
    InvalidHeaderField = 0x01,
    /// PDU sequence error.
    PduSequenceError = 0x02,
    /// Header digest error.
    HeaderDigestError = 0x03,
    /// Data transfer out of range.
    DataOutOfRange = 0x04,
    /// Data transfer limit exceeded (also R2T limit exceeded).
    DataLimitExceeded = 0x05,
    /// Unsupported parameter; FEI holds the byte offset of the field.
    UnsupportedParameter = 0x06,
}

/// ICReq: the host's half of connection setup.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IcReq {
    /// PDU format version; 0 ([`PFV_1_0`]) is the only one defined.
    pub pfv: u16,
    /// Host PDU data alignment (0's based dwords, at most [`MAX_PDA`]) for the controller's data PDUs.
    pub hpda: u8,
    /// The digests the host asks for.
    pub digests: Digests,
    /// Maximum number of outstanding R2Ts per command (0's based).
    pub maxr2t: u32,
}

/// ICResp: the controller's half of connection setup.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IcResp {
    /// PDU format version; 0 ([`PFV_1_0`]) is the only one defined.
    pub pfv: u16,
    /// Controller PDU data alignment (0's based dwords, at most [`MAX_PDA`]) for the host's data PDUs.
    pub cpda: u8,
    /// The digests the controller enables.
    pub digests: Digests,
    /// The most data bytes in one H2CData PDU: a multiple of 4, at least [`MIN_MAXH2CDATA`].
    pub maxh2cdata: u32,
}

/// H2CTermReq or C2HTermReq: the sender closes the connection after a fatal error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TermReq<'a> {
    /// Fatal error status, raw (see [`Fes`]).
    pub fes: u16,
    /// Fatal error information: for [`Fes::InvalidHeaderField`] and [`Fes::UnsupportedParameter`], the byte
    /// offset of the offending field; otherwise 0.
    pub fei: u32,
    /// Up to [`MAX_TERM_DATA`] bytes of the header of the PDU that caused the error.
    pub data: &'a [u8],
}

impl TermReq<'_> {
    /// The fatal error status, if it is one the spec defines.
    pub fn fes_kind(&self) -> Option<Fes> {
        Fes::from_u16(self.fes)
    }
}

/// The header fields of an H2CData PDU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct H2CDataHdr {
    /// Command identifier of the command the data belongs to.
    pub cccid: u16,
    /// Transfer tag from the R2T this data answers.
    pub ttag: u16,
    /// Offset of this data in the command's data buffer.
    pub datao: u32,
    /// Length of this PDU's data (never 0).
    pub datal: u32,
    /// LAST_PDU: the last H2CData PDU for this R2T.
    pub last: bool,
}

/// The header fields of a C2HData PDU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct C2HDataHdr {
    /// Command identifier of the command the data belongs to.
    pub cccid: u16,
    /// Offset of this data in the command's data buffer.
    pub datao: u32,
    /// Length of this PDU's data (never 0).
    pub datal: u32,
    /// LAST_PDU: the last C2HData PDU of the command.
    pub last: bool,
    /// SUCCESS: the command completed successfully and no CapsuleResp follows (requires `last`).
    pub success: bool,
}

/// R2T: the controller asks the host for a range of a command's data.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct R2T {
    /// Command identifier.
    pub cccid: u16,
    /// Transfer tag, echoed in the H2CData PDUs that answer.
    pub ttag: u16,
    /// Offset of the requested range in the command's data.
    pub r2to: u32,
    /// Length of the requested range (never 0).
    pub r2tl: u32,
}

/// One decoded PDU; data sections borrow from the receive buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pdu<'a> {
    /// ICReq.
    IcReq(IcReq),
    /// ICResp.
    IcResp(IcResp),
    /// H2CTermReq.
    H2CTermReq(TermReq<'a>),
    /// C2HTermReq.
    C2HTermReq(TermReq<'a>),
    /// Command capsule, with its in-capsule data (empty if none).
    CapsuleCmd {
        /// The command.
        sqe: Sqe,
        /// In-capsule data.
        data: &'a [u8],
    },
    /// Response capsule.
    CapsuleResp {
        /// The completion.
        cqe: Cqe,
    },
    /// Host to controller data.
    H2CData {
        /// Header fields; `hdr.datal == data.len()`.
        hdr: H2CDataHdr,
        /// The data.
        data: &'a [u8],
    },
    /// Controller to host data.
    C2HData {
        /// Header fields; `hdr.datal == data.len()`.
        hdr: C2HDataHdr,
        /// The data.
        data: &'a [u8],
    },
    /// Ready to transfer.
    R2T(R2T),
}

impl<'a> Pdu<'a> {
    /// The PDU's type.
    pub fn pdu_type(&self) -> PduType {
        match self {
            Pdu::IcReq(_) => PduType::IcReq,
            Pdu::IcResp(_) => PduType::IcResp,
            Pdu::H2CTermReq(_) => PduType::H2CTermReq,
            Pdu::C2HTermReq(_) => PduType::C2HTermReq,
            Pdu::CapsuleCmd { .. } => PduType::CapsuleCmd,
            Pdu::CapsuleResp { .. } => PduType::CapsuleResp,
            Pdu::H2CData { .. } => PduType::H2CData,
            Pdu::C2HData { .. } => PduType::C2HData,
            Pdu::R2T(_) => PduType::R2T,
        }
    }

    /// The PDU's data section (for a termination request, the offending header); empty if it has none.
    pub fn data(&self) -> &'a [u8] {
        match *self {
            Pdu::H2CTermReq(t) | Pdu::C2HTermReq(t) => t.data,
            Pdu::CapsuleCmd { data, .. }
            | Pdu::H2CData { data, .. }
            | Pdu::C2HData { data, .. } => data,
            Pdu::IcReq(_) | Pdu::IcResp(_) | Pdu::CapsuleResp { .. } | Pdu::R2T(_) => &[],
        }
    }

    fn set_data(&mut self, d: &'a [u8]) {
        match self {
            Pdu::H2CTermReq(t) | Pdu::C2HTermReq(t) => t.data = d,
            Pdu::CapsuleCmd { data, .. }
            | Pdu::H2CData { data, .. }
            | Pdu::C2HData { data, .. } => *data = d,
            Pdu::IcReq(_) | Pdu::IcResp(_) | Pdu::CapsuleResp { .. } | Pdu::R2T(_) => {}
        }
    }
}

/// What [`decode`] found at the start of the buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decoded<'a> {
    /// The PDU is not complete: it needs `need` bytes in all (8 while its common header is incomplete, its
    /// `plen` after that). Nothing wrong was found in the bytes so far.
    Incomplete {
        /// Total bytes the PDU needs, counted from the start of the buffer.
        need: usize,
    },
    /// A whole, valid PDU.
    Pdu {
        /// The PDU, borrowing its data from the buffer.
        pdu: Pdu<'a>,
        /// Its length on the wire (`plen`): drop this many bytes to get to the next PDU.
        len: usize,
    },
}

/// A malformed PDU. Every variant but [`PduError::DataDigest`] is fatal for the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PduError {
    /// The type byte is not an NVMe/TCP PDU type.
    #[error("unknown PDU type {pdu_type:#04x}")]
    UnknownType {
        /// The type byte.
        pdu_type: u8,
    },
    /// A PDU type that does not travel in the direction we receive.
    #[error("{pdu_type} is not allowed in this direction")]
    WrongDirection {
        /// The PDU type.
        pdu_type: PduType,
    },
    /// `hlen` is not the one the spec fixes for the type.
    #[error("{pdu_type}: hlen {hlen} (must be {})", .pdu_type.hlen())]
    BadHlen {
        /// The PDU type.
        pdu_type: PduType,
        /// The header length received.
        hlen: u8,
    },
    /// Flags that are reserved for the type, or an invalid combination (SUCCESS without LAST_PDU).
    #[error("{pdu_type}: invalid flags {flags:#04x}")]
    BadFlags {
        /// The PDU type.
        pdu_type: PduType,
        /// The flags received.
        flags: u8,
    },
    /// HDGSTF or DDGSTF does not match the negotiated digests.
    #[error("{pdu_type}: digest flags {flags:#04x} do not match the negotiated digests")]
    DigestFlags {
        /// The PDU type.
        pdu_type: PduType,
        /// The flags received.
        flags: u8,
    },
    /// `pdo` is not valid: non-zero without data, inside the header or header digest, or past the data.
    #[error("{pdu_type}: invalid pdo {pdo}")]
    BadPdo {
        /// The PDU type.
        pdu_type: PduType,
        /// The data offset received.
        pdo: u8,
    },
    /// `plen` is smaller than the header or is not what the type and flags allow.
    #[error("{pdu_type}: invalid plen {plen}")]
    BadPlen {
        /// The PDU type.
        pdu_type: PduType,
        /// The PDU length received.
        plen: u32,
    },
    /// The data section is longer than [`DecodeConfig::max_data`].
    #[error("{pdu_type}: {len} data bytes exceed the limit of {max}")]
    DataTooLong {
        /// The PDU type.
        pdu_type: PduType,
        /// The length of the data section.
        len: u32,
        /// The limit.
        max: u32,
    },
    /// The header digest does not match the header.
    #[error("{pdu_type}: header digest {received:#010x}, expected {expected:#010x}")]
    HeaderDigest {
        /// The PDU type.
        pdu_type: PduType,
        /// The digest computed over the header.
        expected: u32,
        /// The digest received.
        received: u32,
    },
    /// The data digest does not match the data. Not fatal: the command fails with a transient transport error,
    /// and the stream goes on after `len` bytes.
    #[error("{pdu_type} for command {cccid:#06x}: data digest {received:#010x}, expected {expected:#010x}")]
    DataDigest {
        /// The PDU type.
        pdu_type: PduType,
        /// The command the data belongs to (the CID of a CapsuleCmd).
        cccid: u16,
        /// The PDU's flags: with [`FLAG_SUCCESS`], a C2HData PDU was to end its command without a CapsuleResp.
        flags: u8,
        /// The digest computed over the data.
        expected: u32,
        /// The digest received.
        received: u32,
        /// The length of the PDU (`plen`): skip this many bytes to get to the next one.
        len: usize,
    },
    /// DATAL disagrees with the data section that `pdo` and `plen` describe.
    #[error("{pdu_type}: datal {datal} but the data section holds {data_len} bytes")]
    DataLength {
        /// The PDU type.
        pdu_type: PduType,
        /// The DATAL field.
        datal: u32,
        /// The length of the data section.
        data_len: u32,
    },
    /// A header field holds a reserved or invalid value.
    #[error("{pdu_type}: invalid value {value:#x} in the field at byte {offset}")]
    InvalidField {
        /// The PDU type.
        pdu_type: PduType,
        /// Byte offset of the field in the PDU.
        offset: u32,
        /// The value received.
        value: u32,
    },
    /// A header field holds a value we do not support (a PDU format version other than 1.0).
    #[error("{pdu_type}: unsupported value {value:#x} in the field at byte {offset}")]
    Unsupported {
        /// The PDU type.
        pdu_type: PduType,
        /// Byte offset of the field in the PDU.
        offset: u32,
        /// The value received.
        value: u32,
    },
}

impl PduError {
    /// The fatal error status for the termination request that reports this error, or `None` for a data digest
    /// error, which is not fatal (the spec has the command complete with a transient transport error).
    pub fn fes(&self) -> Option<Fes> {
        Some(match self {
            PduError::HeaderDigest { .. } => Fes::HeaderDigestError,
            PduError::DataTooLong { .. } => Fes::DataLimitExceeded,
            PduError::Unsupported { .. } => Fes::UnsupportedParameter,
            PduError::DataDigest { .. } => return None,
            PduError::UnknownType { .. }
            | PduError::WrongDirection { .. }
            | PduError::BadHlen { .. }
            | PduError::BadFlags { .. }
            | PduError::DigestFlags { .. }
            | PduError::BadPdo { .. }
            | PduError::BadPlen { .. }
            | PduError::DataLength { .. }
            | PduError::InvalidField { .. } => Fes::InvalidHeaderField,
        })
    }

    /// The fatal error information for the termination request: the byte offset of the offending field for
    /// [`Fes::InvalidHeaderField`] and [`Fes::UnsupportedParameter`], 0 (reserved) otherwise.
    pub fn fei(&self) -> u32 {
        match *self {
            PduError::UnknownType { .. } | PduError::WrongDirection { .. } => 0,
            PduError::BadFlags { .. } | PduError::DigestFlags { .. } => 1,
            PduError::BadHlen { .. } => 2,
            PduError::BadPdo { .. } => 3,
            PduError::BadPlen { .. } => 4,
            PduError::DataLength { .. } => 16,
            PduError::InvalidField { offset, .. } | PduError::Unsupported { offset, .. } => offset,
            PduError::DataTooLong { .. }
            | PduError::HeaderDigest { .. }
            | PduError::DataDigest { .. } => 0,
        }
    }

    /// For an error that is not fatal, the number of bytes to drop to get to the next PDU.
    pub fn skip_len(&self) -> Option<usize> {
        match *self {
            PduError::DataDigest { len, .. } => Some(len),
            _ => None,
        }
    }

    /// The termination request that reports this error, given the receive buffer whose start held the
    /// offending PDU: its FES, FEI and up to [`MAX_TERM_DATA`] bytes of the PDU header (as much of it as is in
    /// `buf`). `None` for an error that is not fatal.
    pub fn term_req<'a>(&self, buf: &'a [u8]) -> Option<TermReq<'a>> {
        let fes = self.fes()?;
        let hlen = buf.get(2).map_or(CH_LEN, |&h| usize::from(h).max(CH_LEN));
        let n = hlen.min(MAX_TERM_DATA).min(buf.len());
        Some(TermReq {
            fes: fes as u16,
            fei: self.fei(),
            data: &buf[..n],
        })
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Digests

/// The CRC32C data digest of `data`, in wire byte order.
pub fn data_digest(data: &[u8]) -> [u8; DIGEST_LEN] {
    crc32c::crc32c(data).to_le_bytes()
}

/// A data digest computed over several pieces (e.g. the iovecs of a scattered buffer).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DataDigest {
    crc: u32,
}

impl DataDigest {
    /// A digest over nothing yet.
    pub const fn new() -> DataDigest {
        DataDigest { crc: 0 }
    }

    /// Adds `data` to the digest.
    pub fn update(&mut self, data: &[u8]) {
        self.crc = crc32c::crc32c_append(self.crc, data);
    }

    /// The digest of everything added, in wire byte order.
    pub fn finish(&self) -> [u8; DIGEST_LEN] {
        self.crc.to_le_bytes()
    }
}

/// Appends the data digest of `data` to `out` (for a sender that copies the data into `out` as well).
pub fn append_data_digest(out: &mut Vec<u8>, data: &[u8]) {
    out.extend_from_slice(&data_digest(data));
}

// ---------------------------------------------------------------------------------------------------------------
// Decoding

#[inline]
fn le16(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}

#[inline]
fn le32(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

/// Where the parts of a PDU lie, as the common header describes them.
#[derive(Clone, Copy, Debug)]
struct Layout {
    ty: PduType,
    hlen: usize,
    /// End of the header and header digest.
    hend: usize,
    /// Start of the data section.
    data_off: usize,
    data_len: usize,
    ddgst: bool,
    plen: usize,
}

impl Layout {
    /// A PDU without a data section: it ends where its header (and header digest) ends.
    const fn header_only(ty: PduType, hlen: usize, hend: usize) -> Layout {
        Layout {
            ty,
            hlen,
            hend,
            data_off: hend,
            data_len: 0,
            ddgst: false,
            plen: hend,
        }
    }
}

/// Checks the common header against the type's rules and the configuration.
fn check_common_header(ch: &[u8], cfg: &DecodeConfig) -> Result<Layout, PduError> {
    let (raw, flags, hlen, pdo, plen) = (ch[0], ch[1], ch[2], ch[3], le32(ch, 4));
    let ty = PduType::from_u8(raw).ok_or(PduError::UnknownType { pdu_type: raw })?;
    if ty.direction() != cfg.direction {
        return Err(PduError::WrongDirection { pdu_type: ty });
    }
    if hlen != ty.hlen() {
        return Err(PduError::BadHlen { pdu_type: ty, hlen });
    }
    let hlen = usize::from(hlen);
    let bad_flags = Err(PduError::BadFlags {
        pdu_type: ty,
        flags,
    });
    let bad_dgst = Err(PduError::DigestFlags {
        pdu_type: ty,
        flags,
    });
    let bad_pdo = Err(PduError::BadPdo { pdu_type: ty, pdo });
    let bad_plen = Err(PduError::BadPlen { pdu_type: ty, plen });
    // u32 always fits usize on the 32- and 64-bit targets we build for; saturate rather than truncate anyway.
    let plen_us = usize::try_from(plen).unwrap_or(usize::MAX);

    match ty {
        PduType::IcReq | PduType::IcResp => {
            if flags != 0 {
                return bad_flags;
            }
            if pdo != 0 {
                return bad_pdo;
            }
            if plen_us != IC_LEN {
                return bad_plen;
            }
            Ok(Layout::header_only(ty, hlen, hlen))
        }
        PduType::H2CTermReq | PduType::C2HTermReq => {
            if flags != 0 {
                return bad_flags;
            }
            // PDO is reserved here; the error data follows the header directly. Accept 0 (what Linux and SPDK
            // send) and hlen.
            if pdo != 0 && usize::from(pdo) != hlen {
                return bad_pdo;
            }
            if plen_us < hlen || plen_us > hlen + MAX_TERM_DATA {
                return bad_plen;
            }
            Ok(Layout {
                ty,
                hlen,
                hend: hlen,
                data_off: hlen,
                data_len: plen_us - hlen,
                ddgst: false,
                plen: plen_us,
            })
        }
        PduType::CapsuleResp | PduType::R2T => {
            if flags & !FLAG_HDGST != 0 {
                return bad_flags;
            }
            if (flags & FLAG_HDGST != 0) != cfg.hdgst {
                return bad_dgst;
            }
            let hend = hlen + if cfg.hdgst { DIGEST_LEN } else { 0 };
            if pdo != 0 {
                return bad_pdo;
            }
            if plen_us != hend {
                return bad_plen;
            }
            Ok(Layout::header_only(ty, hlen, hend))
        }
        PduType::CapsuleCmd | PduType::H2CData | PduType::C2HData => {
            let allowed = FLAG_HDGST
                | FLAG_DDGST
                | match ty {
                    PduType::H2CData => FLAG_LAST_PDU,
                    PduType::C2HData => FLAG_LAST_PDU | FLAG_SUCCESS,
                    _ => 0,
                };
            if flags & !allowed != 0 || (flags & FLAG_SUCCESS != 0 && flags & FLAG_LAST_PDU == 0) {
                return bad_flags;
            }
            if (flags & FLAG_HDGST != 0) != cfg.hdgst {
                return bad_dgst;
            }
            let hend = hlen + if cfg.hdgst { DIGEST_LEN } else { 0 };
            let ddgstf = flags & FLAG_DDGST != 0;
            if plen_us < hend {
                return bad_plen;
            }
            if plen_us == hend {
                // No data section: only a command capsule may lack one.
                if ty != PduType::CapsuleCmd {
                    return bad_plen;
                }
                if ddgstf {
                    return bad_dgst;
                }
                if pdo != 0 {
                    return bad_pdo;
                }
                return Ok(Layout::header_only(ty, hlen, hend));
            }
            if ddgstf != cfg.ddgst {
                return bad_dgst;
            }
            let dd = if ddgstf { DIGEST_LEN } else { 0 };
            let data_off = usize::from(pdo);
            if data_off < hend || data_off + dd >= plen_us {
                return bad_pdo;
            }
            let data_len = plen_us - data_off - dd;
            if data_len > cfg.max_data as usize {
                let len = u32::try_from(data_len).unwrap_or(u32::MAX);
                return Err(PduError::DataTooLong {
                    pdu_type: ty,
                    len,
                    max: cfg.max_data,
                });
            }
            Ok(Layout {
                ty,
                hlen,
                hend,
                data_off,
                data_len,
                ddgst: ddgstf,
                plen: plen_us,
            })
        }
    }
}

/// Parses and checks the PDU-specific header (`h` holds the `hlen` header bytes); data sections are left empty.
fn parse_header<'a>(h: &[u8], l: &Layout) -> Result<Pdu<'a>, PduError> {
    let ty = l.ty;
    let invalid = |offset: u32, value: u32| PduError::InvalidField {
        pdu_type: ty,
        offset,
        value,
    };
    Ok(match ty {
        PduType::IcReq | PduType::IcResp => {
            let (pfv, pda, dgst, dw) = (le16(h, 8), h[10], h[11], le32(h, 12));
            if pfv != PFV_1_0 {
                return Err(PduError::Unsupported {
                    pdu_type: ty,
                    offset: 8,
                    value: pfv.into(),
                });
            }
            if pda > MAX_PDA {
                return Err(invalid(10, pda.into()));
            }
            if dgst & !(IC_DGST_HDGST | IC_DGST_DDGST) != 0 {
                return Err(invalid(11, dgst.into()));
            }
            let digests = Digests {
                header: dgst & IC_DGST_HDGST != 0,
                data: dgst & IC_DGST_DDGST != 0,
            };
            if ty == PduType::IcReq {
                Pdu::IcReq(IcReq {
                    pfv,
                    hpda: pda,
                    digests,
                    maxr2t: dw,
                })
            } else {
                if dw < MIN_MAXH2CDATA || dw % 4 != 0 {
                    return Err(invalid(12, dw));
                }
                Pdu::IcResp(IcResp {
                    pfv,
                    cpda: pda,
                    digests,
                    maxh2cdata: dw,
                })
            }
        }
        PduType::H2CTermReq | PduType::C2HTermReq => {
            let t = TermReq {
                fes: le16(h, 8),
                fei: le32(h, 10),
                data: &[],
            };
            if ty == PduType::H2CTermReq {
                Pdu::H2CTermReq(t)
            } else {
                Pdu::C2HTermReq(t)
            }
        }
        PduType::CapsuleCmd => Pdu::CapsuleCmd {
            sqe: Sqe::from_bytes(&h[CH_LEN..]).expect("hlen checked"),
            data: &[],
        },
        PduType::CapsuleResp => Pdu::CapsuleResp {
            cqe: Cqe::from_bytes(&h[CH_LEN..]).expect("hlen checked"),
        },
        PduType::H2CData | PduType::C2HData => {
            let (cccid, ttag, datao, datal) = (le16(h, 8), le16(h, 10), le32(h, 12), le32(h, 16));
            if datal as usize != l.data_len {
                let data_len = u32::try_from(l.data_len).unwrap_or(u32::MAX);
                return Err(PduError::DataLength {
                    pdu_type: ty,
                    datal,
                    data_len,
                });
            }
            let last = h[1] & FLAG_LAST_PDU != 0;
            if ty == PduType::H2CData {
                Pdu::H2CData {
                    hdr: H2CDataHdr {
                        cccid,
                        ttag,
                        datao,
                        datal,
                        last,
                    },
                    data: &[],
                }
            } else {
                let success = h[1] & FLAG_SUCCESS != 0;
                Pdu::C2HData {
                    hdr: C2HDataHdr {
                        cccid,
                        datao,
                        datal,
                        last,
                        success,
                    },
                    data: &[],
                }
            }
        }
        PduType::R2T => {
            let r2t = R2T {
                cccid: le16(h, 8),
                ttag: le16(h, 10),
                r2to: le32(h, 12),
                r2tl: le32(h, 16),
            };
            if r2t.r2tl == 0 {
                return Err(invalid(16, 0));
            }
            Pdu::R2T(r2t)
        }
    })
}

/// Decodes the PDU at the start of `buf`.
///
/// Returns [`Decoded::Incomplete`] while `buf` holds too little of the PDU, and [`Decoded::Pdu`] with the PDU
/// (its data borrowed from `buf`) and its length once it holds all of it; bytes past that length are left for
/// the next call. Checks run as early as the bytes allow: the common header (type, direction, `hlen`, flags,
/// `pdo`, `plen` and the data limit) once 8 bytes are there, the header digest and the header fields once the
/// header is complete, the data digest once the PDU is. Reserved bytes are not checked; padding is skipped.
/// Never panics, whatever `buf` holds.
pub fn decode<'a>(buf: &'a [u8], cfg: &DecodeConfig) -> Result<Decoded<'a>, PduError> {
    let (l, mut pdu) = match header(buf, cfg)? {
        Header::Incomplete { need } => return Ok(Decoded::Incomplete { need }),
        Header::Parsed(l, pdu) => (l, pdu),
    };
    let Some(p) = buf.get(..l.plen) else {
        return Ok(Decoded::Incomplete { need: l.plen });
    };
    let data = &p[l.data_off..l.data_off + l.data_len];
    if l.ddgst {
        let expected = crc32c::crc32c(data);
        let received = le32(p, l.plen - DIGEST_LEN);
        if expected != received {
            let cccid = match pdu {
                Pdu::CapsuleCmd { sqe, .. } => sqe.cid,
                Pdu::H2CData { hdr, .. } => hdr.cccid,
                Pdu::C2HData { hdr, .. } => hdr.cccid,
                _ => 0,
            };
            return Err(PduError::DataDigest {
                pdu_type: l.ty,
                cccid,
                flags: p[1],
                expected,
                received,
                len: l.plen,
            });
        }
    }
    pdu.set_data(data);
    Ok(Decoded::Pdu { pdu, len: l.plen })
}

enum Header<'a> {
    /// `need` bytes in all before the header can be read (8, then `plen`).
    Incomplete {
        need: usize,
    },
    Parsed(Layout, Pdu<'a>),
}

/// Checks and parses the header (with its digest) at the start of `buf`.
fn header<'a>(buf: &[u8], cfg: &DecodeConfig) -> Result<Header<'a>, PduError> {
    let Some(ch) = buf.get(..CH_LEN) else {
        return Ok(Header::Incomplete { need: CH_LEN });
    };
    let l = check_common_header(ch, cfg)?;
    let Some(h) = buf.get(..l.hend) else {
        return Ok(Header::Incomplete { need: l.plen });
    };
    if l.hend > l.hlen {
        let expected = crc32c::crc32c(&h[..l.hlen]);
        let received = le32(h, l.hlen);
        if expected != received {
            return Err(PduError::HeaderDigest {
                pdu_type: l.ty,
                expected,
                received,
            });
        }
    }
    let pdu = parse_header(&h[..l.hlen], &l)?;
    Ok(Header::Parsed(l, pdu))
}

/// The header of a PDU whose data has not all arrived: what [`decode_partial`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartialPdu<'a> {
    /// The PDU with its header fields (its data is empty).
    pub pdu: Pdu<'a>,
    /// Where the data starts, from the start of the PDU (after the header, its digest and padding).
    pub data_off: usize,
    /// Bytes of data.
    pub data_len: usize,
    /// A data digest follows the data.
    pub ddgst: bool,
    /// The PDU's length on the wire.
    pub plen: usize,
}

/// Decodes the header of the PDU at the start of `buf` once the header and its digest are there, before the
/// data is: for a receiver that puts the data straight where it belongs (a read's buffer) instead of
/// gathering the whole PDU first. `None` while the header is incomplete. The same checks as [`decode`]
/// apply to the header; the data digest, if any, is the caller's to check (see [`DataDigest`]).
pub fn decode_partial<'a>(
    buf: &'a [u8],
    cfg: &DecodeConfig,
) -> Result<Option<PartialPdu<'a>>, PduError> {
    let (l, pdu) = match header(buf, cfg)? {
        Header::Incomplete { .. } => return Ok(None),
        Header::Parsed(l, pdu) => (l, pdu),
    };
    Ok(Some(PartialPdu {
        pdu,
        data_off: l.data_off,
        data_len: l.data_len,
        ddgst: l.ddgst,
        plen: l.plen,
    }))
}

// ---------------------------------------------------------------------------------------------------------------
// Encoding

/// The data offset for a header of `hend` bytes (header and header digest) aligned for `pda`.
fn aligned_pdo(hend: usize, pda: u8) -> usize {
    assert!(
        pda <= MAX_PDA,
        "PDU data alignment {pda} is above {MAX_PDA}"
    );
    let align = (usize::from(pda) + 1) * 4;
    hend.div_ceil(align) * align
}

/// Appends the header of a PDU (header, header digest, padding) that will carry `data_len` bytes of data,
/// with `fill` writing the PDU-specific fields into the zeroed header; returns the bytes appended.
fn put_header(
    out: &mut Vec<u8>,
    ty: PduType,
    flags: u8,
    data_len: usize,
    digests: Digests,
    pda: u8,
    fill: impl FnOnce(&mut [u8]),
) -> usize {
    let hlen8 = ty.hlen();
    let hlen = usize::from(hlen8);
    let hdgst = digests.header && ty.has_header_digest();
    let hend = hlen + if hdgst { DIGEST_LEN } else { 0 };
    let ddgst = digests.data && ty.has_data_digest() && data_len > 0;
    let (pdo, plen) = if data_len == 0 {
        (0, hend)
    } else {
        let pdo = aligned_pdo(hend, pda);
        (pdo, pdo + data_len + if ddgst { DIGEST_LEN } else { 0 })
    };
    let plen = u32::try_from(plen).expect("PDU length exceeds u32");
    let flags = flags | if hdgst { FLAG_HDGST } else { 0 } | if ddgst { FLAG_DDGST } else { 0 };

    let start = out.len();
    out.resize(start + hlen, 0);
    let h = &mut out[start..];
    h[0] = ty as u8;
    h[1] = flags;
    h[2] = hlen8;
    // At most 128: a header with data ends by byte 76, rounded up to at most 128-byte alignment
    // (aligned_pdo refuses a pda above MAX_PDA).
    #[allow(clippy::cast_possible_truncation)]
    let pdo8 = pdo as u8;
    h[3] = pdo8;
    h[4..8].copy_from_slice(&plen.to_le_bytes());
    fill(h);
    if hdgst {
        let d = crc32c::crc32c(&out[start..]);
        out.extend_from_slice(&d.to_le_bytes());
    }
    if data_len > 0 {
        out.resize(start + pdo, 0);
    }
    out.len() - start
}

/// Appends `data` and, if data digests apply, its digest.
fn put_data(out: &mut Vec<u8>, data: &[u8], ddgst: bool) {
    out.extend_from_slice(data);
    if ddgst && !data.is_empty() {
        append_data_digest(out, data);
    }
}

/// Appends a PDU whose header `header` appends, then `data` and, if `ddgst`, its digest. Returns the bytes
/// appended.
fn put_with_data(
    out: &mut Vec<u8>,
    data: &[u8],
    ddgst: bool,
    header: impl FnOnce(&mut Vec<u8>) -> usize,
) -> usize {
    let start = out.len();
    header(out);
    put_data(out, data, ddgst);
    out.len() - start
}

/// Writes the fields that H2CData, C2HData and R2T headers keep at the same offsets: CCCID, TTAG (reserved in
/// C2HData, where it stays 0), and the offset and length of the data.
fn put_transfer(h: &mut [u8], cccid: u16, ttag: u16, offset: u32, len: u32) {
    h[8..10].copy_from_slice(&cccid.to_le_bytes());
    h[10..12].copy_from_slice(&ttag.to_le_bytes());
    h[12..16].copy_from_slice(&offset.to_le_bytes());
    h[16..20].copy_from_slice(&len.to_le_bytes());
}

fn put_ic(out: &mut Vec<u8>, ty: PduType, pda: u8, digests: Digests, dw: u32) -> usize {
    let dgst = if digests.header { IC_DGST_HDGST } else { 0 }
        | if digests.data { IC_DGST_DDGST } else { 0 };
    put_header(out, ty, 0, 0, Digests::NONE, 0, |h| {
        h[8..10].copy_from_slice(&PFV_1_0.to_le_bytes());
        h[10] = pda;
        h[11] = dgst;
        h[12..16].copy_from_slice(&dw.to_le_bytes());
    })
}

/// Appends an ICReq (128 bytes; `ic.pfv` is ignored, 0 is sent). Returns the bytes appended.
pub fn encode_ic_req(out: &mut Vec<u8>, ic: &IcReq) -> usize {
    put_ic(out, PduType::IcReq, ic.hpda, ic.digests, ic.maxr2t)
}

/// Appends an ICResp (128 bytes; `ic.pfv` is ignored, 0 is sent). Returns the bytes appended.
pub fn encode_ic_resp(out: &mut Vec<u8>, ic: &IcResp) -> usize {
    put_ic(out, PduType::IcResp, ic.cpda, ic.digests, ic.maxh2cdata)
}

fn put_term_req(out: &mut Vec<u8>, ty: PduType, t: &TermReq<'_>) -> usize {
    let data = &t.data[..t.data.len().min(MAX_TERM_DATA)];
    // Termination requests never carry a data digest.
    put_with_data(out, data, false, |out| {
        put_header(out, ty, 0, 0, Digests::NONE, 0, |h| {
            // data is cut to MAX_TERM_DATA (128) bytes above.
            #[allow(clippy::cast_possible_truncation)]
            let plen = (24 + data.len()) as u32;
            h[4..8].copy_from_slice(&plen.to_le_bytes());
            h[8..10].copy_from_slice(&t.fes.to_le_bytes());
            h[10..14].copy_from_slice(&t.fei.to_le_bytes());
        })
    })
}

/// Appends an H2CTermReq; `term.data` beyond [`MAX_TERM_DATA`] bytes is cut off. Returns the bytes appended.
pub fn encode_h2c_term_req(out: &mut Vec<u8>, term: &TermReq<'_>) -> usize {
    put_term_req(out, PduType::H2CTermReq, term)
}

/// Appends a C2HTermReq; `term.data` beyond [`MAX_TERM_DATA`] bytes is cut off. Returns the bytes appended.
pub fn encode_c2h_term_req(out: &mut Vec<u8>, term: &TermReq<'_>) -> usize {
    put_term_req(out, PduType::C2HTermReq, term)
}

/// Appends the header of a command capsule that will carry `data_len` bytes of in-capsule data: header,
/// header digest if `digests.header`, and padding to the controller's alignment `cpda` (0's based dwords) if
/// there is data. The caller then sends the data and, if `digests.data` and `data_len > 0`, its digest.
/// Returns the bytes appended.
///
/// # Panics
/// If `cpda` is above [`MAX_PDA`] or the PDU would be longer than `u32::MAX` bytes.
pub fn encode_capsule_cmd_header(
    out: &mut Vec<u8>,
    sqe: &Sqe,
    data_len: u32,
    digests: Digests,
    cpda: u8,
) -> usize {
    put_header(
        out,
        PduType::CapsuleCmd,
        0,
        data_len as usize,
        digests,
        cpda,
        |h| {
            h[CH_LEN..CH_LEN + SQE_SIZE].copy_from_slice(&sqe.to_bytes());
        },
    )
}

/// Appends a whole command capsule with `data` as in-capsule data (may be empty). Returns the bytes appended.
///
/// # Panics
/// As [`encode_capsule_cmd_header`].
pub fn encode_capsule_cmd(
    out: &mut Vec<u8>,
    sqe: &Sqe,
    data: &[u8],
    digests: Digests,
    cpda: u8,
) -> usize {
    let len = u32::try_from(data.len()).expect("in-capsule data exceeds u32");
    put_with_data(out, data, digests.data, |out| {
        encode_capsule_cmd_header(out, sqe, len, digests, cpda)
    })
}

/// Appends a response capsule (`digests.data` does not apply). Returns the bytes appended.
pub fn encode_capsule_resp(out: &mut Vec<u8>, cqe: &Cqe, digests: Digests) -> usize {
    put_header(out, PduType::CapsuleResp, 0, 0, digests, 0, |h| {
        h[CH_LEN..CH_LEN + CQE_SIZE].copy_from_slice(&cqe.to_bytes());
    })
}

/// Appends the header of an H2CData PDU carrying `hdr.datal` bytes: header, header digest, padding to the
/// controller's alignment `cpda`. The caller then sends the data and, if `digests.data`, its digest.
/// Returns the bytes appended.
///
/// # Panics
/// If `hdr.datal` is 0, `cpda` is above [`MAX_PDA`] or the PDU would be longer than `u32::MAX` bytes.
pub fn encode_h2c_data_header(
    out: &mut Vec<u8>,
    hdr: &H2CDataHdr,
    digests: Digests,
    cpda: u8,
) -> usize {
    assert!(hdr.datal > 0, "an H2CData PDU carries data");
    let flags = if hdr.last { FLAG_LAST_PDU } else { 0 };
    put_header(
        out,
        PduType::H2CData,
        flags,
        hdr.datal as usize,
        digests,
        cpda,
        |h| put_transfer(h, hdr.cccid, hdr.ttag, hdr.datao, hdr.datal),
    )
}

/// Appends a whole H2CData PDU. Returns the bytes appended.
///
/// # Panics
/// As [`encode_h2c_data_header`], and if `data.len() != hdr.datal`.
pub fn encode_h2c_data(
    out: &mut Vec<u8>,
    hdr: &H2CDataHdr,
    data: &[u8],
    digests: Digests,
    cpda: u8,
) -> usize {
    assert_eq!(
        data.len(),
        hdr.datal as usize,
        "H2CData datal must match the data"
    );
    put_with_data(out, data, digests.data, |out| {
        encode_h2c_data_header(out, hdr, digests, cpda)
    })
}

/// Appends the header of a C2HData PDU carrying `hdr.datal` bytes: header, header digest, padding to the
/// host's alignment `hpda`. The caller then sends the data and, if `digests.data`, its digest.
/// Returns the bytes appended.
///
/// # Panics
/// If `hdr.datal` is 0, `hdr.success` is set without `hdr.last`, `hpda` is above [`MAX_PDA`] or the PDU would
/// be longer than `u32::MAX` bytes.
pub fn encode_c2h_data_header(
    out: &mut Vec<u8>,
    hdr: &C2HDataHdr,
    digests: Digests,
    hpda: u8,
) -> usize {
    assert!(hdr.datal > 0, "a C2HData PDU carries data");
    assert!(
        hdr.last || !hdr.success,
        "C2HData SUCCESS requires LAST_PDU"
    );
    let flags =
        if hdr.last { FLAG_LAST_PDU } else { 0 } | if hdr.success { FLAG_SUCCESS } else { 0 };
    put_header(
        out,
        PduType::C2HData,
        flags,
        hdr.datal as usize,
        digests,
        hpda,
        |h| put_transfer(h, hdr.cccid, 0, hdr.datao, hdr.datal),
    )
}

/// Appends a whole C2HData PDU. Returns the bytes appended.
///
/// # Panics
/// As [`encode_c2h_data_header`], and if `data.len() != hdr.datal`.
pub fn encode_c2h_data(
    out: &mut Vec<u8>,
    hdr: &C2HDataHdr,
    data: &[u8],
    digests: Digests,
    hpda: u8,
) -> usize {
    assert_eq!(
        data.len(),
        hdr.datal as usize,
        "C2HData datal must match the data"
    );
    put_with_data(out, data, digests.data, |out| {
        encode_c2h_data_header(out, hdr, digests, hpda)
    })
}

/// Appends an R2T (`digests.data` does not apply). Returns the bytes appended.
pub fn encode_r2t(out: &mut Vec<u8>, r2t: &R2T, digests: Digests) -> usize {
    put_header(out, PduType::R2T, 0, 0, digests, 0, |h| {
        put_transfer(h, r2t.cccid, r2t.ttag, r2t.r2to, r2t.r2tl);
    })
}

/// Appends any PDU, whole: `digests` apply where the spec has them, and `pda` is the receiver's data
/// alignment (the controller's CPDA for H2C PDUs, the host's HPDA for C2H PDUs). Returns the bytes appended.
///
/// # Panics
/// As the encoder of the PDU's type.
pub fn encode(out: &mut Vec<u8>, pdu: &Pdu<'_>, digests: Digests, pda: u8) -> usize {
    match pdu {
        Pdu::IcReq(ic) => encode_ic_req(out, ic),
        Pdu::IcResp(ic) => encode_ic_resp(out, ic),
        Pdu::H2CTermReq(t) => encode_h2c_term_req(out, t),
        Pdu::C2HTermReq(t) => encode_c2h_term_req(out, t),
        Pdu::CapsuleCmd { sqe, data } => encode_capsule_cmd(out, sqe, data, digests, pda),
        Pdu::CapsuleResp { cqe } => encode_capsule_resp(out, cqe, digests),
        Pdu::H2CData { hdr, data } => encode_h2c_data(out, hdr, data, digests, pda),
        Pdu::C2HData { hdr, data } => encode_c2h_data(out, hdr, data, digests, pda),
        Pdu::R2T(r2t) => encode_r2t(out, r2t, digests),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_check_value() {
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(data_digest(b"123456789"), [0x83, 0x92, 0x06, 0xE3]);
    }

    #[test]
    fn hlen_fixed_per_type() {
        assert_eq!(PduType::CapsuleCmd.hlen(), 72);
        assert_eq!(PduType::CapsuleResp.hlen(), 24);
        assert_eq!(PduType::IcReq.hlen(), 128);
        for v in 0..=255u8 {
            if let Some(t) = PduType::from_u8(v) {
                assert_eq!(t as u8, v);
            }
        }
    }

    #[test]
    fn pdo_alignment() {
        assert_eq!(aligned_pdo(72, 0), 72);
        assert_eq!(aligned_pdo(76, 0), 76);
        assert_eq!(aligned_pdo(76, 3), 80);
        assert_eq!(aligned_pdo(28, 31), 128);
        assert_eq!(aligned_pdo(76, 31), 128);
    }
}

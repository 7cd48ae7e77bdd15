//! Identify data structures: Identify Controller, Identify Namespace (NVM command set), the Namespace
//! Identification Descriptor list and namespace ID lists.
//!
//! Each page is 4096 bytes. Parsing keeps the page it read ([`RawPage`]), and encoding starts from that page and
//! writes the modelled fields over it, so fields this module does not model survive a parse/encode round trip.
//! A target builds a page from `Default::default()` and the fields it cares about.

use super::regs::Vs;
use super::wire::{
    bytes_at, need, put_bytes, put_str, put_u128, put_u16, put_u32, put_u64, put_u8, str_at,
    u128_at, u16_at, u32_at, u64_at, u8_at, Pad, ParseError,
};

/// Size of every Identify data structure in bytes.
pub const IDENTIFY_SIZE: usize = 4096;

/// A whole 4096-byte Identify page, as received or as last encoded.
///
/// Its `Debug` form is only its length, to keep the structures that hold it readable.
#[derive(Clone, PartialEq, Eq)]
pub struct RawPage(Box<[u8; IDENTIFY_SIZE]>);

impl RawPage {
    /// The page's bytes.
    pub fn as_bytes(&self) -> &[u8; IDENTIFY_SIZE] {
        &self.0
    }

    /// The page's bytes, for setting fields the typed structure does not model.
    pub fn as_bytes_mut(&mut self) -> &mut [u8; IDENTIFY_SIZE] {
        &mut self.0
    }

    /// Copies the first 4096 bytes of `b`, or zeros where `b` is shorter.
    fn copy_of(b: &[u8]) -> RawPage {
        let mut page = Box::new([0u8; IDENTIFY_SIZE]);
        let n = b.len().min(IDENTIFY_SIZE);
        page[..n].copy_from_slice(&b[..n]);
        RawPage(page)
    }
}

impl Default for RawPage {
    fn default() -> Self {
        RawPage(Box::new([0; IDENTIFY_SIZE]))
    }
}

impl std::fmt::Debug for RawPage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RawPage({IDENTIFY_SIZE} bytes)")
    }
}

/// Identify Controller data structure (CNS 0x01), NVMe Base 2.0 with the NVMe over Fabrics fields.
///
/// Field names follow the specification's abbreviations; the text fields are trimmed of their padding.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IdentifyController {
    /// PCI Vendor ID (bytes 1:0).
    pub vid: u16,
    /// PCI Subsystem Vendor ID (3:2).
    pub ssvid: u16,
    /// Serial Number (23:4), trimmed.
    pub serial: String,
    /// Model Number (63:24), trimmed.
    pub model: String,
    /// Firmware Revision (71:64), trimmed.
    pub firmware: String,
    /// Recommended Arbitration Burst, as a power of two (72).
    pub rab: u8,
    /// IEEE OUI Identifier (75:73), least significant byte first as on the wire.
    pub ieee: [u8; 3],
    /// Controller Multi-Path I/O and Namespace Sharing Capabilities (76).
    pub cmic: u8,
    /// Maximum Data Transfer Size, a power of two in units of CAP.MPSMIN; 0 for no limit (77).
    pub mdts: u8,
    /// Controller ID (79:78).
    pub cntlid: u16,
    /// Version (83:80).
    pub ver: Vs,
    /// RTD3 Resume Latency, microseconds (87:84).
    pub rtd3r: u32,
    /// RTD3 Entry Latency, microseconds (91:88).
    pub rtd3e: u32,
    /// Optional Asynchronous Events Supported (95:92).
    pub oaes: u32,
    /// Controller Attributes (99:96).
    pub ctratt: u32,
    /// Controller Type (111): 1 I/O, 2 discovery, 3 administrative.
    pub cntrltype: u8,
    /// FRU Globally Unique Identifier (127:112).
    pub fguid: [u8; 16],
    /// Command Retry Delay Times 1 to 3, in 100 ms units (133:128).
    pub crdt: [u16; 3],
    /// Optional Admin Command Support (257:256); see the `OACS_` constants.
    pub oacs: u16,
    /// Abort Command Limit, 0-based (258).
    pub acl: u8,
    /// Asynchronous Event Request Limit, 0-based (259).
    pub aerl: u8,
    /// Firmware Updates (260).
    pub frmw: u8,
    /// Log Page Attributes (261).
    pub lpa: u8,
    /// Error Log Page Entries, 0-based (262).
    pub elpe: u8,
    /// Number of Power States Support, 0-based (263).
    pub npss: u8,
    /// Admin Vendor Specific Command Configuration (264).
    pub avscc: u8,
    /// Autonomous Power State Transition Attributes (265).
    pub apsta: u8,
    /// Warning Composite Temperature Threshold, kelvin (267:266).
    pub wctemp: u16,
    /// Critical Composite Temperature Threshold, kelvin (269:268).
    pub cctemp: u16,
    /// Total NVM Capacity, bytes (295:280).
    pub tnvmcap: u128,
    /// Unallocated NVM Capacity, bytes (311:296).
    pub unvmcap: u128,
    /// Keep Alive Support: granularity of the keep alive timer in 100 ms units; 0 if not supported (321:320).
    pub kas: u16,
    /// ANA Transition Time in seconds (342): the longest a group stays in the change state.
    pub anatt: u8,
    /// ANA Capabilities (343); see the `ANACAP_*` constants.
    pub anacap: u8,
    /// ANA Group Identifier Maximum (347:344).
    pub anagrpmax: u32,
    /// Number of ANA Group Identifiers (351:348).
    pub nanagrpid: u32,
    /// Command Quiesce Time in milliseconds (387:386, NVMe 2.1): how long after a path is lost its
    /// controller may still be running commands it had, so that a host must wait before it retries them
    /// elsewhere. 0: not reported.
    pub cqt: u16,
    /// Submission Queue Entry Size (512): required (bits 3:0) and maximum (7:4) size, as powers of two.
    pub sqes: u8,
    /// Completion Queue Entry Size (513): required (bits 3:0) and maximum (7:4) size, as powers of two.
    pub cqes: u8,
    /// Maximum Outstanding Commands (515:514); fabrics only.
    pub maxcmd: u16,
    /// Number of Namespaces: the largest valid namespace ID (519:516).
    pub nn: u32,
    /// Optional NVM Command Support (521:520); see the `ONCS_` constants.
    pub oncs: u16,
    /// Fused Operation Support (523:522).
    pub fuses: u16,
    /// Format NVM Attributes (524).
    pub fna: u8,
    /// Volatile Write Cache (525): bit 0 set when present.
    pub vwc: u8,
    /// Atomic Write Unit Normal, logical blocks, 0-based (527:526).
    pub awun: u16,
    /// Atomic Write Unit Power Fail, logical blocks, 0-based (529:528).
    pub awupf: u16,
    /// Namespace Write Protection Capabilities (531).
    pub nwpc: u8,
    /// Atomic Compare & Write Unit (533:532).
    pub acwu: u16,
    /// Copy Formats Supported (535:534).
    pub ocfs: u16,
    /// SGL Support (539:536); bits 1:0 non-zero when SGLs are supported.
    pub sgls: u32,
    /// Maximum Number of Allowed Namespaces (543:540).
    pub mnan: u32,
    /// NVM Subsystem NVMe Qualified Name (1023:768).
    pub subnqn: String,
    /// I/O Queue Command Capsule Supported Size, in 16-byte units (1795:1792); fabrics only.
    pub ioccsz: u32,
    /// I/O Queue Response Capsule Supported Size, in 16-byte units (1799:1796); fabrics only.
    pub iorcsz: u32,
    /// In Capsule Data Offset, in 16-byte units (1801:1800); fabrics only.
    pub icdoff: u16,
    /// Fabrics Controller Attributes (1802): bit 0 set for a dynamic controller model; fabrics only.
    pub fcatt: u8,
    /// Maximum SGL Data Block Descriptors (1803); fabrics only, 0 for no limit.
    pub msdbd: u8,
    /// Optional Fabric Commands Support (1805:1804); fabrics only.
    pub ofcs: u16,
    /// The page this was parsed from (all zeros for one built by hand).
    pub raw: RawPage,
}

impl IdentifyController {
    /// OACS: Security Send and Security Receive.
    pub const OACS_SECURITY: u16 = 1 << 0;
    /// OACS: Format NVM.
    pub const OACS_FORMAT: u16 = 1 << 1;
    /// OACS: Firmware Commit and Firmware Image Download.
    pub const OACS_FIRMWARE: u16 = 1 << 2;
    /// OACS: Namespace Management.
    pub const OACS_NS_MANAGEMENT: u16 = 1 << 3;
    /// OACS: Device Self-test.
    pub const OACS_SELF_TEST: u16 = 1 << 4;
    /// OACS: Directives.
    pub const OACS_DIRECTIVES: u16 = 1 << 5;
    /// OACS: Doorbell Buffer Config.
    pub const OACS_DOORBELL_BUFFER: u16 = 1 << 8;
    /// ONCS: Compare.
    pub const ONCS_COMPARE: u16 = 1 << 0;
    /// ONCS: Write Uncorrectable.
    pub const ONCS_WRITE_UNCORRECTABLE: u16 = 1 << 1;
    /// ONCS: Dataset Management.
    pub const ONCS_DSM: u16 = 1 << 2;
    /// ONCS: Write Zeroes.
    pub const ONCS_WRITE_ZEROES: u16 = 1 << 3;
    /// ONCS: the Save field of Set Features.
    pub const ONCS_SAVE_FEATURES: u16 = 1 << 4;
    /// ONCS: Reservations.
    pub const ONCS_RESERVATIONS: u16 = 1 << 5;
    /// ONCS: Timestamp feature.
    pub const ONCS_TIMESTAMP: u16 = 1 << 6;
    /// ONCS: Verify.
    pub const ONCS_VERIFY: u16 = 1 << 7;
    /// ONCS: Copy.
    pub const ONCS_COPY: u16 = 1 << 8;
    /// CMIC: the subsystem may have two or more ports.
    pub const CMIC_MULTI_PORT: u8 = 1 << 0;
    /// CMIC: the subsystem may have two or more controllers.
    pub const CMIC_MULTI_CONTROLLER: u8 = 1 << 1;
    /// CMIC: Asymmetric Namespace Access Reporting.
    pub const CMIC_ANA: u8 = 1 << 3;
    /// OAES: ANA Change notices.
    pub const OAES_ANA_CHANGE: u32 = 1 << 11;
    /// ANACAP: reports the ANA Optimized state.
    pub const ANACAP_OPTIMIZED: u8 = 1 << 0;
    /// ANACAP: reports the ANA Non-Optimized state.
    pub const ANACAP_NON_OPTIMIZED: u8 = 1 << 1;
    /// ANACAP: reports the ANA Inaccessible state.
    pub const ANACAP_INACCESSIBLE: u8 = 1 << 2;
    /// ANACAP: reports the ANA Persistent Loss state.
    pub const ANACAP_PERSISTENT_LOSS: u8 = 1 << 3;
    /// ANACAP: reports the ANA Change state.
    pub const ANACAP_CHANGE: u8 = 1 << 4;
    /// ANACAP: a namespace's ANAGRPID does not change while it is attached.
    pub const ANACAP_GRPID_STATIC: u8 = 1 << 6;
    /// ANACAP: non-zero ANAGRPIDs in Namespace Management.
    pub const ANACAP_GRPID_NONZERO: u8 = 1 << 7;
    /// CNTRLTYPE: I/O controller.
    pub const CNTRLTYPE_IO: u8 = 1;
    /// CNTRLTYPE: discovery controller.
    pub const CNTRLTYPE_DISCOVERY: u8 = 2;
    /// CNTRLTYPE: administrative controller.
    pub const CNTRLTYPE_ADMIN: u8 = 3;

    /// Parses the first 4096 bytes of `b`.
    pub fn parse(b: &[u8]) -> Result<IdentifyController, ParseError> {
        need("Identify Controller", b, IDENTIFY_SIZE)?;
        Ok(IdentifyController {
            vid: u16_at(b, 0),
            ssvid: u16_at(b, 2),
            serial: str_at(b, 4, 20),
            model: str_at(b, 24, 40),
            firmware: str_at(b, 64, 8),
            rab: u8_at(b, 72),
            ieee: bytes_at(b, 73),
            cmic: u8_at(b, 76),
            mdts: u8_at(b, 77),
            cntlid: u16_at(b, 78),
            ver: Vs(u32_at(b, 80)),
            rtd3r: u32_at(b, 84),
            rtd3e: u32_at(b, 88),
            oaes: u32_at(b, 92),
            ctratt: u32_at(b, 96),
            cntrltype: u8_at(b, 111),
            fguid: bytes_at(b, 112),
            crdt: [u16_at(b, 128), u16_at(b, 130), u16_at(b, 132)],
            oacs: u16_at(b, 256),
            acl: u8_at(b, 258),
            aerl: u8_at(b, 259),
            frmw: u8_at(b, 260),
            lpa: u8_at(b, 261),
            elpe: u8_at(b, 262),
            npss: u8_at(b, 263),
            avscc: u8_at(b, 264),
            apsta: u8_at(b, 265),
            wctemp: u16_at(b, 266),
            cctemp: u16_at(b, 268),
            tnvmcap: u128_at(b, 280),
            unvmcap: u128_at(b, 296),
            kas: u16_at(b, 320),
            anatt: u8_at(b, 342),
            anacap: u8_at(b, 343),
            anagrpmax: u32_at(b, 344),
            nanagrpid: u32_at(b, 348),
            cqt: u16_at(b, 386),
            sqes: u8_at(b, 512),
            cqes: u8_at(b, 513),
            maxcmd: u16_at(b, 514),
            nn: u32_at(b, 516),
            oncs: u16_at(b, 520),
            fuses: u16_at(b, 522),
            fna: u8_at(b, 524),
            vwc: u8_at(b, 525),
            awun: u16_at(b, 526),
            awupf: u16_at(b, 528),
            nwpc: u8_at(b, 531),
            acwu: u16_at(b, 532),
            ocfs: u16_at(b, 534),
            sgls: u32_at(b, 536),
            mnan: u32_at(b, 540),
            subnqn: str_at(b, 768, 256),
            ioccsz: u32_at(b, 1792),
            iorcsz: u32_at(b, 1796),
            icdoff: u16_at(b, 1800),
            fcatt: u8_at(b, 1802),
            msdbd: u8_at(b, 1803),
            ofcs: u16_at(b, 1804),
            raw: RawPage::copy_of(b),
        })
    }

    /// Encodes the structure as a 4096-byte page: [`IdentifyController::raw`] with every modelled field written
    /// over it. Text fields longer than their field are cut.
    pub fn to_bytes(&self) -> [u8; IDENTIFY_SIZE] {
        let mut page = *self.raw.as_bytes();
        let b = &mut page[..];
        put_u16(b, 0, self.vid);
        put_u16(b, 2, self.ssvid);
        put_str(b, 4, 20, &self.serial, Pad::Space);
        put_str(b, 24, 40, &self.model, Pad::Space);
        put_str(b, 64, 8, &self.firmware, Pad::Space);
        put_u8(b, 72, self.rab);
        put_bytes(b, 73, &self.ieee);
        put_u8(b, 76, self.cmic);
        put_u8(b, 77, self.mdts);
        put_u16(b, 78, self.cntlid);
        put_u32(b, 80, self.ver.0);
        put_u32(b, 84, self.rtd3r);
        put_u32(b, 88, self.rtd3e);
        put_u32(b, 92, self.oaes);
        put_u32(b, 96, self.ctratt);
        put_u8(b, 111, self.cntrltype);
        put_bytes(b, 112, &self.fguid);
        for (i, t) in self.crdt.iter().enumerate() {
            put_u16(b, 128 + 2 * i, *t);
        }
        put_u16(b, 256, self.oacs);
        put_bytes(
            b,
            258,
            &[
                self.acl, self.aerl, self.frmw, self.lpa, self.elpe, self.npss, self.avscc,
                self.apsta,
            ],
        );
        put_u16(b, 266, self.wctemp);
        put_u16(b, 268, self.cctemp);
        put_u128(b, 280, self.tnvmcap);
        put_u128(b, 296, self.unvmcap);
        put_u16(b, 320, self.kas);
        put_u8(b, 342, self.anatt);
        put_u8(b, 343, self.anacap);
        put_u32(b, 344, self.anagrpmax);
        put_u32(b, 348, self.nanagrpid);
        put_u16(b, 386, self.cqt);
        put_u8(b, 512, self.sqes);
        put_u8(b, 513, self.cqes);
        put_u16(b, 514, self.maxcmd);
        put_u32(b, 516, self.nn);
        put_u16(b, 520, self.oncs);
        put_u16(b, 522, self.fuses);
        put_u8(b, 524, self.fna);
        put_u8(b, 525, self.vwc);
        put_u16(b, 526, self.awun);
        put_u16(b, 528, self.awupf);
        put_u8(b, 531, self.nwpc);
        put_u16(b, 532, self.acwu);
        put_u16(b, 534, self.ocfs);
        put_u32(b, 536, self.sgls);
        put_u32(b, 540, self.mnan);
        put_str(b, 768, 256, &self.subnqn, Pad::Nul);
        put_u32(b, 1792, self.ioccsz);
        put_u32(b, 1796, self.iorcsz);
        put_u16(b, 1800, self.icdoff);
        put_u8(b, 1802, self.fcatt);
        put_u8(b, 1803, self.msdbd);
        put_u16(b, 1804, self.ofcs);
        page
    }

    /// The largest data transfer of one command in bytes, given the controller's minimum page size
    /// ([`super::Cap::min_page_size`]); `None` when MDTS reports no limit.
    pub fn max_transfer_bytes(&self, min_page_size: u64) -> Option<u64> {
        if self.mdts == 0 {
            return None;
        }
        Some(
            min_page_size
                .checked_shl(self.mdts.into())
                .filter(|v| *v >> self.mdts == min_page_size)
                .unwrap_or(u64::MAX),
        )
    }

    /// Whether the controller supports SGLs for the NVM command set (SGLS bits 1:0).
    pub fn supports_sgls(&self) -> bool {
        self.sgls & 0x3 != 0
    }

    /// Whether a volatile write cache is present (VWC bit 0), so that Flush matters.
    pub fn has_volatile_write_cache(&self) -> bool {
        self.vwc & 1 != 0
    }
}

/// One LBA format of a namespace.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LbaFormat {
    /// Metadata Size: bytes of metadata per logical block.
    pub ms: u16,
    /// LBA Data Size, as a power of two (9 for 512-byte blocks, 12 for 4 KiB).
    pub lbads: u8,
    /// Relative Performance, 0 best to 3 degraded.
    pub rp: u8,
}

impl LbaFormat {
    /// Decodes the 32-bit wire form.
    pub const fn from_u32(v: u32) -> LbaFormat {
        LbaFormat {
            ms: (v & 0xffff) as u16,
            lbads: ((v >> 16) & 0xff) as u8,
            rp: ((v >> 24) & 0x3) as u8,
        }
    }

    /// The 32-bit wire form.
    pub const fn to_u32(self) -> u32 {
        self.ms as u32 | (self.lbads as u32) << 16 | ((self.rp & 0x3) as u32) << 24
    }

    /// The logical block size in bytes; `None` if LBADS is outside what the specification allows (9 to 31).
    pub fn block_size(self) -> Option<u32> {
        (9..32).contains(&self.lbads).then(|| 1u32 << self.lbads)
    }
}

/// The most LBA formats a namespace can have (NVMe 2.0).
pub const MAX_LBA_FORMATS: usize = 64;

/// Identify Namespace data structure for the NVM command set (CNS 0x00).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IdentifyNamespace {
    /// Namespace Size, logical blocks (7:0).
    pub nsze: u64,
    /// Namespace Capacity, logical blocks (15:8).
    pub ncap: u64,
    /// Namespace Utilization, logical blocks (23:16).
    pub nuse: u64,
    /// Namespace Features (24).
    pub nsfeat: u8,
    /// Formatted LBA Size (26): format index (bits 3:0, and 6:5 above 16 formats), extended LBA (bit 4).
    pub flbas: u8,
    /// Metadata Capabilities (27).
    pub mc: u8,
    /// End-to-end Data Protection Capabilities (28).
    pub dpc: u8,
    /// End-to-end Data Protection Type Settings (29).
    pub dps: u8,
    /// Namespace Multi-path I/O and Namespace Sharing Capabilities (30).
    pub nmic: u8,
    /// Reservation Capabilities (31).
    pub rescap: u8,
    /// Format Progress Indicator (32).
    pub fpi: u8,
    /// Deallocate Logical Block Features (33).
    pub dlfeat: u8,
    /// Namespace Atomic Write Unit Normal (35:34).
    pub nawun: u16,
    /// Namespace Atomic Write Unit Power Fail (37:36).
    pub nawupf: u16,
    /// Namespace Atomic Compare & Write Unit (39:38).
    pub nacwu: u16,
    /// Namespace Atomic Boundary Size Normal (41:40).
    pub nabsn: u16,
    /// Namespace Atomic Boundary Offset (43:42).
    pub nabo: u16,
    /// Namespace Atomic Boundary Size Power Fail (45:44).
    pub nabspf: u16,
    /// Namespace Optimal I/O Boundary, logical blocks (47:46).
    pub noiob: u16,
    /// NVM Capacity, bytes (63:48).
    pub nvmcap: u128,
    /// Namespace Preferred Write Granularity, 0-based (65:64).
    pub npwg: u16,
    /// Namespace Preferred Write Alignment, 0-based (67:66).
    pub npwa: u16,
    /// Namespace Preferred Deallocate Granularity, 0-based (69:68).
    pub npdg: u16,
    /// Namespace Preferred Deallocate Alignment, 0-based (71:70).
    pub npda: u16,
    /// Namespace Optimal Write Size, 0-based (73:72).
    pub nows: u16,
    /// ANA Group Identifier (95:92).
    pub anagrpid: u32,
    /// Namespace Attributes (99).
    pub nsattr: u8,
    /// NVM Set Identifier (101:100).
    pub nvmsetid: u16,
    /// Endurance Group Identifier (103:102).
    pub endgid: u16,
    /// Namespace Globally Unique Identifier (119:104).
    pub nguid: [u8; 16],
    /// IEEE Extended Unique Identifier (127:120).
    pub eui64: [u8; 8],
    /// The LBA formats (NLBAF + 1 of them, at most 64), from byte 128.
    pub lbaf: Vec<LbaFormat>,
    /// The page this was parsed from (all zeros for one built by hand).
    pub raw: RawPage,
}

impl IdentifyNamespace {
    /// FLBAS bit 4: metadata travels at the end of each logical block (extended LBA).
    pub const FLBAS_EXTENDED: u8 = 1 << 4;

    /// Parses the first 4096 bytes of `b`.
    pub fn parse(b: &[u8]) -> Result<IdentifyNamespace, ParseError> {
        need("Identify Namespace", b, IDENTIFY_SIZE)?;
        let count = (usize::from(u8_at(b, 25)) + 1).min(MAX_LBA_FORMATS);
        Ok(IdentifyNamespace {
            nsze: u64_at(b, 0),
            ncap: u64_at(b, 8),
            nuse: u64_at(b, 16),
            nsfeat: u8_at(b, 24),
            flbas: u8_at(b, 26),
            mc: u8_at(b, 27),
            dpc: u8_at(b, 28),
            dps: u8_at(b, 29),
            nmic: u8_at(b, 30),
            rescap: u8_at(b, 31),
            fpi: u8_at(b, 32),
            dlfeat: u8_at(b, 33),
            nawun: u16_at(b, 34),
            nawupf: u16_at(b, 36),
            nacwu: u16_at(b, 38),
            nabsn: u16_at(b, 40),
            nabo: u16_at(b, 42),
            nabspf: u16_at(b, 44),
            noiob: u16_at(b, 46),
            nvmcap: u128_at(b, 48),
            npwg: u16_at(b, 64),
            npwa: u16_at(b, 66),
            npdg: u16_at(b, 68),
            npda: u16_at(b, 70),
            nows: u16_at(b, 72),
            anagrpid: u32_at(b, 92),
            nsattr: u8_at(b, 99),
            nvmsetid: u16_at(b, 100),
            endgid: u16_at(b, 102),
            nguid: bytes_at(b, 104),
            eui64: bytes_at(b, 120),
            lbaf: (0..count)
                .map(|i| LbaFormat::from_u32(u32_at(b, 128 + 4 * i)))
                .collect(),
            raw: RawPage::copy_of(b),
        })
    }

    /// Encodes the structure as a 4096-byte page: [`IdentifyNamespace::raw`] with every modelled field written
    /// over it. NLBAF comes from the length of [`IdentifyNamespace::lbaf`]; formats past the 64th are dropped.
    pub fn to_bytes(&self) -> [u8; IDENTIFY_SIZE] {
        let mut page = *self.raw.as_bytes();
        let b = &mut page[..];
        put_u64(b, 0, self.nsze);
        put_u64(b, 8, self.ncap);
        put_u64(b, 16, self.nuse);
        put_bytes(
            b,
            24,
            &[
                self.nsfeat,
                self.nlbaf(),
                self.flbas,
                self.mc,
                self.dpc,
                self.dps,
                self.nmic,
            ],
        );
        put_bytes(b, 31, &[self.rescap, self.fpi, self.dlfeat]);
        let atomics = [
            self.nawun,
            self.nawupf,
            self.nacwu,
            self.nabsn,
            self.nabo,
            self.nabspf,
            self.noiob,
        ];
        for (i, v) in atomics.iter().enumerate() {
            put_u16(b, 34 + 2 * i, *v);
        }
        put_u128(b, 48, self.nvmcap);
        for (i, v) in [self.npwg, self.npwa, self.npdg, self.npda, self.nows]
            .iter()
            .enumerate()
        {
            put_u16(b, 64 + 2 * i, *v);
        }
        put_u32(b, 92, self.anagrpid);
        put_u8(b, 99, self.nsattr);
        put_u16(b, 100, self.nvmsetid);
        put_u16(b, 102, self.endgid);
        put_bytes(b, 104, &self.nguid);
        put_bytes(b, 120, &self.eui64);
        for (i, f) in self.lbaf.iter().take(MAX_LBA_FORMATS).enumerate() {
            put_u32(b, 128 + 4 * i, f.to_u32());
        }
        page
    }

    /// Number of LBA Formats, 0-based, as NLBAF carries it.
    pub fn nlbaf(&self) -> u8 {
        // Clamped to 1..=MAX_LBA_FORMATS (64), so it fits in a byte.
        #[allow(clippy::cast_possible_truncation)]
        let n = self.lbaf.len().clamp(1, MAX_LBA_FORMATS) as u8;
        n - 1
    }

    /// Index of the format the namespace is formatted with (FLBAS bits 3:0, and bits 6:5 as bits 5:4 of the
    /// index when there are more than 16 formats).
    pub fn format_index(&self) -> usize {
        let low = usize::from(self.flbas & 0xf);
        if self.lbaf.len() > 16 {
            low | usize::from((self.flbas >> 5) & 0x3) << 4
        } else {
            low
        }
    }

    /// The format the namespace is formatted with; `None` if FLBAS points past the formats.
    pub fn current_format(&self) -> Option<LbaFormat> {
        self.lbaf.get(self.format_index()).copied()
    }

    /// Logical block size of the current format in bytes; `None` for a missing or invalid format (as on an
    /// inactive namespace, whose page is all zeros).
    pub fn block_size(&self) -> Option<u32> {
        self.current_format()?.block_size()
    }

    /// Whether metadata is interleaved with the data of each block (FLBAS bit 4) rather than in a separate buffer.
    pub fn extended_lba(&self) -> bool {
        self.flbas & Self::FLBAS_EXTENDED != 0
    }
}

/// Size of a namespace ID list (active, allocated or changed): 1024 IDs.
pub const NS_LIST_LEN: usize = IDENTIFY_SIZE / 4;

/// Decodes a namespace ID list (Identify CNS 0x02, or the Changed Namespace List log page): the IDs before the
/// first zero entry. Trailing bytes that do not form a whole entry are ignored.
pub fn decode_ns_list(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32_at(c, 0))
        .take_while(|&id| id != 0)
        .collect()
}

/// Encodes a namespace ID list as a 4096-byte page, zero-terminated; IDs past the 1024th are dropped.
pub fn encode_ns_list(ids: &[u32]) -> [u8; IDENTIFY_SIZE] {
    let mut b = [0u8; IDENTIFY_SIZE];
    for (i, id) in ids.iter().take(NS_LIST_LEN).enumerate() {
        put_u32(&mut b, 4 * i, *id);
    }
    b
}

/// One entry of the Namespace Identification Descriptor list (Identify CNS 0x03).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum NsIdDescriptor {
    /// IEEE Extended Unique Identifier (type 1, 8 bytes).
    Eui64([u8; 8]),
    /// Namespace Globally Unique Identifier (type 2, 16 bytes).
    Nguid([u8; 16]),
    /// Namespace UUID (type 3, 16 bytes, in the order of its text form).
    Uuid([u8; 16]),
    /// Command Set Identifier (type 4, 1 byte): 0 NVM, 2 zoned.
    Csi(u8),
    /// A type this module does not know, kept as it was.
    Other {
        /// Namespace Identifier Type.
        nidt: u8,
        /// The identifier's bytes.
        nid: Vec<u8>,
    },
}

impl NsIdDescriptor {
    /// NIDT of an EUI-64.
    pub const EUI64: u8 = 1;
    /// NIDT of an NGUID.
    pub const NGUID: u8 = 2;
    /// NIDT of a UUID.
    pub const UUID: u8 = 3;
    /// NIDT of a Command Set Identifier.
    pub const CSI: u8 = 4;

    /// The Namespace Identifier Type.
    pub fn nidt(&self) -> u8 {
        match self {
            NsIdDescriptor::Eui64(_) => Self::EUI64,
            NsIdDescriptor::Nguid(_) => Self::NGUID,
            NsIdDescriptor::Uuid(_) => Self::UUID,
            NsIdDescriptor::Csi(_) => Self::CSI,
            NsIdDescriptor::Other { nidt, .. } => *nidt,
        }
    }

    /// The identifier's bytes.
    pub fn nid(&self) -> &[u8] {
        match self {
            NsIdDescriptor::Eui64(v) => v,
            NsIdDescriptor::Nguid(v) | NsIdDescriptor::Uuid(v) => v,
            NsIdDescriptor::Csi(v) => std::slice::from_ref(v),
            NsIdDescriptor::Other { nid, .. } => nid,
        }
    }

    /// Decodes a descriptor list: descriptors follow each other until a zero type or the end of the buffer.
    ///
    /// A descriptor that runs past the end of the buffer, or a known type with the wrong length, is an error.
    pub fn decode_list(b: &[u8]) -> Result<Vec<NsIdDescriptor>, ParseError> {
        const WHAT: &str = "Namespace Identification Descriptor";
        let mut out = Vec::new();
        let mut off = 0usize;
        while off + 4 <= b.len() && b[off] != 0 {
            let (nidt, nidl) = (b[off], usize::from(b[off + 1]));
            let nid = b.get(off + 4..off + 4 + nidl).ok_or(ParseError::Short {
                what: WHAT,
                need: off + 4 + nidl,
                got: b.len(),
            })?;
            let fixed = |want: usize| {
                if nidl == want {
                    Ok(())
                } else {
                    Err(ParseError::Invalid {
                        what: WHAT,
                        reason: format!("type {nidt} has NIDL {nidl}, not {want}"),
                    })
                }
            };
            out.push(match nidt {
                Self::EUI64 => fixed(8).map(|()| NsIdDescriptor::Eui64(bytes_at(nid, 0)))?,
                Self::NGUID => fixed(16).map(|()| NsIdDescriptor::Nguid(bytes_at(nid, 0)))?,
                Self::UUID => fixed(16).map(|()| NsIdDescriptor::Uuid(bytes_at(nid, 0)))?,
                Self::CSI => fixed(1).map(|()| NsIdDescriptor::Csi(nid[0]))?,
                _ => NsIdDescriptor::Other {
                    nidt,
                    nid: nid.to_vec(),
                },
            });
            off += 4 + nidl;
        }
        Ok(out)
    }

    /// Encodes a descriptor list as a 4096-byte page; descriptors that do not fit are dropped, and an
    /// [`NsIdDescriptor::Other`] longer than 255 bytes is cut.
    pub fn encode_list(descs: &[NsIdDescriptor]) -> [u8; IDENTIFY_SIZE] {
        let mut b = [0u8; IDENTIFY_SIZE];
        let mut off = 0usize;
        for d in descs {
            // The length is one byte: a longer identifier is cut to 255 bytes.
            let nid_len = u8::try_from(d.nid().len()).unwrap_or(u8::MAX);
            let nid = &d.nid()[..usize::from(nid_len)];
            // Keep room for the 4-byte zero header that ends the list.
            if off + 4 + nid.len() + 4 > IDENTIFY_SIZE {
                break;
            }
            b[off] = d.nidt();
            b[off + 1] = nid_len;
            b[off + 4..off + 4 + nid.len()].copy_from_slice(nid);
            off += 4 + nid.len();
        }
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controller_hand_built_page() {
        let mut b = vec![0u8; IDENTIFY_SIZE];
        b[0..2].copy_from_slice(&0x1b36u16.to_le_bytes());
        b[4..24].copy_from_slice(b"SER123              ");
        b[24..64].copy_from_slice(b"Model X                                 ");
        b[64..72].copy_from_slice(b"1.0     ");
        b[77] = 5;
        b[78] = 7;
        b[80..84].copy_from_slice(&0x0002_0000u32.to_le_bytes());
        b[516..520].copy_from_slice(&32u32.to_le_bytes());
        b[525] = 1;
        b[536] = 1;
        b[768..768 + 9].copy_from_slice(b"nqn.x:abc");
        b[1792..1796].copy_from_slice(&260u32.to_le_bytes());
        b[1803] = 1;
        b[3000] = 0xaa; // vendor specific: must survive a round trip
        let c = IdentifyController::parse(&b).unwrap();
        assert_eq!(c.vid, 0x1b36);
        assert_eq!(
            (c.serial.as_str(), c.model.as_str(), c.firmware.as_str()),
            ("SER123", "Model X", "1.0")
        );
        assert_eq!((c.mdts, c.cntlid, c.ver, c.nn), (5, 7, Vs::V2_0, 32));
        assert_eq!(c.subnqn, "nqn.x:abc");
        assert_eq!((c.ioccsz, c.msdbd), (260, 1));
        assert!(c.supports_sgls() && c.has_volatile_write_cache());
        assert_eq!(c.max_transfer_bytes(4096), Some(128 * 1024));
        assert_eq!(&c.to_bytes()[..], &b[..]);
        assert_eq!(format!("{:?}", c.raw), "RawPage(4096 bytes)");
    }

    #[test]
    fn controller_short_and_limits() {
        assert_eq!(
            IdentifyController::parse(&[0; 4095]),
            Err(ParseError::Short {
                what: "Identify Controller",
                need: 4096,
                got: 4095
            })
        );
        let c = IdentifyController {
            mdts: 0,
            ..Default::default()
        };
        assert_eq!(c.max_transfer_bytes(4096), None);
        let c = IdentifyController {
            mdts: 255,
            ..Default::default()
        };
        assert_eq!(c.max_transfer_bytes(4096), Some(u64::MAX));
    }

    #[test]
    fn controller_built_by_a_target() {
        let c = IdentifyController {
            serial: "a serial number that is far too long".into(),
            model: "nvpoll".into(),
            subnqn: "n".repeat(300),
            ver: Vs::V1_4,
            ..Default::default()
        };
        let b = c.to_bytes();
        let back = IdentifyController::parse(&b).unwrap();
        assert_eq!(back.serial, "a serial number that");
        assert_eq!(back.model, "nvpoll");
        assert_eq!(&b[24 + 6..64], &[b' '; 34][..]);
        assert_eq!(back.subnqn.len(), 255);
        assert_eq!(back.ver, Vs::V1_4);
    }

    #[test]
    fn namespace_round_trip() {
        let mut b = vec![0u8; IDENTIFY_SIZE];
        b[0..8].copy_from_slice(&0x20_0000u64.to_le_bytes());
        b[8..16].copy_from_slice(&0x20_0000u64.to_le_bytes());
        b[25] = 1; // two formats
        b[26] = 1; // the second in use
        b[120..128].copy_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
        b[128..132].copy_from_slice(
            &LbaFormat {
                ms: 0,
                lbads: 9,
                rp: 0,
            }
            .to_u32()
            .to_le_bytes(),
        );
        b[132..136].copy_from_slice(&[8, 0, 12, 2]);
        let ns = IdentifyNamespace::parse(&b).unwrap();
        assert_eq!(ns.nsze, 0x20_0000);
        assert_eq!(
            ns.lbaf,
            vec![
                LbaFormat {
                    ms: 0,
                    lbads: 9,
                    rp: 0
                },
                LbaFormat {
                    ms: 8,
                    lbads: 12,
                    rp: 2
                }
            ]
        );
        assert_eq!(ns.nlbaf(), 1);
        assert_eq!(ns.block_size(), Some(4096));
        assert_eq!(ns.eui64, [1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&ns.to_bytes()[..], &b[..]);
    }

    #[test]
    fn namespace_formats_edge_cases() {
        // An inactive namespace: all zeros.
        let ns = IdentifyNamespace::parse(&[0; IDENTIFY_SIZE]).unwrap();
        assert_eq!(ns.lbaf.len(), 1);
        assert_eq!(ns.block_size(), None);
        // 64 formats, index 0x25 through FLBAS bits 6:5.
        let mut ns = IdentifyNamespace {
            lbaf: (0..70)
                .map(|i| LbaFormat {
                    ms: i,
                    lbads: 9 + (i % 4) as u8,
                    rp: 0,
                })
                .collect(),
            flbas: 0x40 | 0x05 | IdentifyNamespace::FLBAS_EXTENDED,
            ..Default::default()
        };
        assert_eq!(ns.format_index(), 0x25);
        assert!(ns.extended_lba());
        let back = IdentifyNamespace::parse(&ns.to_bytes()).unwrap();
        assert_eq!(back.lbaf.len(), 64);
        assert_eq!(back.nlbaf(), 63);
        assert_eq!(
            back.current_format(),
            Some(LbaFormat {
                ms: 0x25,
                lbads: 10,
                rp: 0
            })
        );
        assert_eq!(back.block_size(), Some(1024));
        // With 16 formats or fewer, bits 6:5 are reserved.
        ns.lbaf.truncate(16);
        assert_eq!(ns.format_index(), 5);
        ns.flbas = 0x0f;
        ns.lbaf.truncate(3);
        assert_eq!(ns.current_format(), None);
        assert_eq!(
            LbaFormat {
                ms: 0,
                lbads: 40,
                rp: 0
            }
            .block_size(),
            None
        );
    }

    #[test]
    fn ns_lists() {
        let b = encode_ns_list(&[1, 2, 7]);
        assert_eq!(&b[..16], &[1, 0, 0, 0, 2, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(decode_ns_list(&b), vec![1, 2, 7]);
        assert_eq!(decode_ns_list(&b[..9]), vec![1, 2]);
        let all: Vec<u32> = (1..=2000).collect();
        assert_eq!(decode_ns_list(&encode_ns_list(&all)).len(), NS_LIST_LEN);
    }

    #[test]
    fn ns_id_descriptors() {
        let descs = vec![
            NsIdDescriptor::Eui64([1; 8]),
            NsIdDescriptor::Nguid([2; 16]),
            NsIdDescriptor::Uuid([3; 16]),
            NsIdDescriptor::Csi(0),
            NsIdDescriptor::Other {
                nidt: 9,
                nid: vec![4, 5],
            },
        ];
        let b = NsIdDescriptor::encode_list(&descs);
        assert_eq!(&b[..4], &[1, 8, 0, 0]);
        assert_eq!(&b[12..16], &[2, 16, 0, 0]);
        assert_eq!(NsIdDescriptor::decode_list(&b), Ok(descs));
        // Wrong length for a known type.
        let bad = [4u8, 2, 0, 0, 0, 0];
        assert!(matches!(
            NsIdDescriptor::decode_list(&bad),
            Err(ParseError::Invalid { .. })
        ));
        // Runs past the end.
        let short = [3u8, 16, 0, 0, 1, 2];
        assert!(matches!(
            NsIdDescriptor::decode_list(&short),
            Err(ParseError::Short {
                need: 20,
                got: 6,
                ..
            })
        ));
        // Too many to fit: the list stays terminated.
        let many = vec![NsIdDescriptor::Uuid([9; 16]); 300];
        let b = NsIdDescriptor::encode_list(&many);
        assert_eq!(
            NsIdDescriptor::decode_list(&b).unwrap().len(),
            (IDENTIFY_SIZE - 4) / 20
        );
    }
}

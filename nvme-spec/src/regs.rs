//! Controller registers (NVMe Base 2.0, "Controller Registers"), which fabrics controllers expose as properties.
//!
//! [`reg`] holds the register offsets and the doorbell layout; [`Cap`], [`Vs`], [`Cc`], [`Csts`] and [`Aqa`]
//! wrap register values with typed getters and setters. A setter drops bits that do not fit its field.

use std::time::Duration;

/// Register (property) offsets, and the doorbell layout.
pub mod reg {
    /// Controller Capabilities (64 bits).
    pub const CAP: u32 = 0x00;
    /// Version.
    pub const VS: u32 = 0x08;
    /// Interrupt Mask Set.
    pub const INTMS: u32 = 0x0c;
    /// Interrupt Mask Clear.
    pub const INTMC: u32 = 0x10;
    /// Controller Configuration.
    pub const CC: u32 = 0x14;
    /// Controller Status.
    pub const CSTS: u32 = 0x1c;
    /// NVM Subsystem Reset; writing [`NSSR_RESET`] resets the subsystem.
    pub const NSSR: u32 = 0x20;
    /// Admin Queue Attributes.
    pub const AQA: u32 = 0x24;
    /// Admin Submission Queue base address (64 bits).
    pub const ASQ: u32 = 0x28;
    /// Admin Completion Queue base address (64 bits).
    pub const ACQ: u32 = 0x30;
    /// Controller Memory Buffer Location.
    pub const CMBLOC: u32 = 0x38;
    /// Controller Memory Buffer Size.
    pub const CMBSZ: u32 = 0x3c;
    /// Boot Partition Information.
    pub const BPINFO: u32 = 0x40;
    /// Boot Partition Read Select.
    pub const BPRSEL: u32 = 0x44;
    /// Boot Partition Memory Buffer Location (64 bits).
    pub const BPMBL: u32 = 0x48;
    /// Controller Memory Buffer Memory Space Control (64 bits).
    pub const CMBMSC: u32 = 0x50;
    /// Controller Memory Buffer Status.
    pub const CMBSTS: u32 = 0x58;
    /// Persistent Memory Region Capabilities.
    pub const PMRCAP: u32 = 0xe00;
    /// Persistent Memory Region Control.
    pub const PMRCTL: u32 = 0xe04;
    /// Persistent Memory Region Status.
    pub const PMRSTS: u32 = 0xe08;
    /// First doorbell: the admin submission queue's tail doorbell.
    pub const DOORBELLS: u32 = 0x1000;

    /// The value ("NVMe" in ASCII) that starts an NVM subsystem reset when written to [`NSSR`].
    pub const NSSR_RESET: u32 = 0x4e56_4d65;

    /// Whether the register at `offset` is 64 bits wide (a fabrics Property Get/Set of it uses size 8).
    pub const fn is_64bit(offset: u32) -> bool {
        matches!(offset, CAP | ASQ | ACQ | BPMBL | CMBMSC)
    }

    /// Byte offset of the submission queue tail doorbell of queue `qid`, for a doorbell stride `dstrd`
    /// (CAP.DSTRD: doorbells are `4 << dstrd` bytes apart).
    pub const fn sq_tail_doorbell(qid: u16, dstrd: u8) -> usize {
        doorbell(2 * qid as usize, dstrd)
    }

    /// Byte offset of the completion queue head doorbell of queue `qid`, for a doorbell stride `dstrd`.
    pub const fn cq_head_doorbell(qid: u16, dstrd: u8) -> usize {
        doorbell(2 * qid as usize + 1, dstrd)
    }

    const fn doorbell(index: usize, dstrd: u8) -> usize {
        DOORBELLS as usize + index * (4usize << (dstrd & 0xf))
    }
}

/// Generates a getter and a setter for each bit field of a register wrapper.
macro_rules! reg_fields {
    ($reg:ident: $int:ty; $($doc:literal $get:ident $set:ident [$lo:literal; $width:literal] -> $t:ty;)*) => {
        impl $reg {
            $(
                #[doc = $doc]
                // Masked to $width bits, which the assertion after this impl checks that $t holds.
                #[allow(clippy::cast_possible_truncation)]
                pub const fn $get(self) -> $t {
                    ((self.0 >> $lo) & (((1 as $int) << $width) - 1)) as $t
                }

                #[doc = concat!("Sets the field [`Self::", stringify!($get), "`] reads.")]
                pub fn $set(&mut self, v: $t) {
                    let mask: $int = (((1 as $int) << $width) - 1) << $lo;
                    self.0 = (self.0 & !mask) | (((v as $int) << $lo) & mask);
                }
            )*
        }
        $(
            const _: () = assert!($width <= <$t>::BITS && $lo + $width <= <$int>::BITS);
        )*
    };
}

/// Generates a getter and a setter for each one-bit flag of a register wrapper.
macro_rules! reg_flags {
    ($reg:ident: $int:ty; $($doc:literal $get:ident $set:ident [$bit:literal];)*) => {
        impl $reg {
            $(
                #[doc = $doc]
                pub const fn $get(self) -> bool {
                    self.0 & ((1 as $int) << $bit) != 0
                }

                #[doc = concat!("Sets the flag [`Self::", stringify!($get), "`] reads.")]
                pub fn $set(&mut self, on: bool) {
                    let bit: $int = (1 as $int) << $bit;
                    self.0 = if on { self.0 | bit } else { self.0 & !bit };
                }
            )*
        }
    };
}

/// Controller Capabilities (CAP, offset 0x00, 64 bits).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Cap(pub u64);

reg_fields! { Cap: u64;
    "Maximum Queue Entries Supported, 0-based (MQES)." mqes set_mqes [0; 16] -> u16;
    "Arbitration Mechanism Supported (AMS): bit 0 weighted round robin, bit 1 vendor specific." ams set_ams [17; 2] -> u8;
    "Timeout (TO): worst-case time to become ready, in 500 ms units; see [`Cap::timeout`]." to set_to [24; 8] -> u8;
    "Doorbell Stride (DSTRD): doorbells are `4 << dstrd` bytes apart." dstrd set_dstrd [32; 4] -> u8;
    "Command Sets Supported (CSS), a bit mask: see [`Cap::CSS_NVM`] and the constants after it." css set_css [37; 8] -> u8;
    "Controller Power Scope (CPS)." cps set_cps [46; 2] -> u8;
    "Memory Page Size Minimum (MPSMIN): 2 ^ (12 + mpsmin) bytes." mpsmin set_mpsmin [48; 4] -> u8;
    "Memory Page Size Maximum (MPSMAX): 2 ^ (12 + mpsmax) bytes." mpsmax set_mpsmax [52; 4] -> u8;
    "Controller Ready Modes Supported (CRMS)." crms set_crms [59; 2] -> u8;
}

reg_flags! { Cap: u64;
    "Contiguous Queues Required (CQR)." cqr set_cqr [16];
    "NVM Subsystem Reset Supported (NSSRS)." nssrs set_nssrs [36];
    "Boot Partition Support (BPS)." bps set_bps [45];
    "Persistent Memory Region Supported (PMRS)." pmrs set_pmrs [56];
    "Controller Memory Buffer Supported (CMBS)." cmbs set_cmbs [57];
    "NVM Subsystem Shutdown Supported (NSSS)." nsss set_nsss [58];
}

impl Cap {
    /// CAP.CSS bit: the NVM command set.
    pub const CSS_NVM: u8 = 1 << 0;
    /// CAP.CSS bit: one or more I/O command sets (selected through CC.CSS = 6).
    pub const CSS_IO_SETS: u8 = 1 << 6;
    /// CAP.CSS bit: no I/O command set, admin only.
    pub const CSS_ADMIN_ONLY: u8 = 1 << 7;

    /// How long the host waits for CSTS.RDY to follow CC.EN (CAP.TO, in 500 ms units).
    pub const fn timeout(self) -> Duration {
        Duration::from_millis(self.to() as u64 * 500)
    }

    /// The largest number of entries an I/O queue may have (MQES + 1).
    pub const fn max_queue_entries(self) -> u32 {
        self.mqes() as u32 + 1
    }

    /// The smallest memory page size the controller supports, in bytes.
    pub const fn min_page_size(self) -> u64 {
        1 << (12 + self.mpsmin() as u32)
    }

    /// The largest memory page size the controller supports, in bytes.
    pub const fn max_page_size(self) -> u64 {
        1 << (12 + self.mpsmax() as u32)
    }
}

/// Version (VS, offset 0x08).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Vs(pub u32);

reg_fields! { Vs: u32;
    "Major version." major set_major [16; 16] -> u16;
    "Minor version." minor set_minor [8; 8] -> u8;
    "Tertiary version." tertiary set_tertiary [0; 8] -> u8;
}

impl Vs {
    /// NVMe 1.2.
    pub const V1_2: Vs = Vs::new(1, 2, 0);
    /// NVMe 1.3.
    pub const V1_3: Vs = Vs::new(1, 3, 0);
    /// NVMe 1.4.
    pub const V1_4: Vs = Vs::new(1, 4, 0);
    /// NVMe 2.0.
    pub const V2_0: Vs = Vs::new(2, 0, 0);

    /// The version `major.minor.tertiary`.
    pub const fn new(major: u16, minor: u8, tertiary: u8) -> Vs {
        Vs(((major as u32) << 16) | ((minor as u32) << 8) | tertiary as u32)
    }
}

/// Formats as "major.minor.tertiary", e.g. "1.4.0".
impl std::fmt::Display for Vs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major(), self.minor(), self.tertiary())
    }
}

/// Controller Configuration (CC, offset 0x14).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Cc(pub u32);

reg_fields! { Cc: u32;
    "I/O Command Set Selected (CSS): see [`Cc::CSS_NVM`] and the constants after it." css set_css [4; 3] -> u8;
    "Memory Page Size (MPS): 2 ^ (12 + mps) bytes." mps set_mps [7; 4] -> u8;
    "Arbitration Mechanism Selected (AMS): 0 round robin." ams set_ams [11; 3] -> u8;
    "Shutdown Notification (SHN): see [`Cc::SHN_NORMAL`]." shn set_shn [14; 2] -> u8;
    "I/O Submission Queue Entry Size (IOSQES): 2 ^ iosqes bytes (6 for 64-byte entries)." iosqes set_iosqes [16; 4] -> u8;
    "I/O Completion Queue Entry Size (IOCQES): 2 ^ iocqes bytes (4 for 16-byte entries)." iocqes set_iocqes [20; 4] -> u8;
}

reg_flags! { Cc: u32;
    "Enable (EN)." en set_en [0];
    "Controller Ready Independent of Media Enable (CRIME)." crime set_crime [24];
}

impl Cc {
    /// CC.CSS: the NVM command set.
    pub const CSS_NVM: u8 = 0;
    /// CC.CSS: all supported I/O command sets.
    pub const CSS_ALL_IO: u8 = 6;
    /// CC.CSS: admin command set only.
    pub const CSS_ADMIN_ONLY: u8 = 7;
    /// CC.SHN: no notification.
    pub const SHN_NONE: u8 = 0;
    /// CC.SHN: normal shutdown.
    pub const SHN_NORMAL: u8 = 1;
    /// CC.SHN: abrupt shutdown.
    pub const SHN_ABRUPT: u8 = 2;
}

/// Controller Status (CSTS, offset 0x1c).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Csts(pub u32);

reg_fields! { Csts: u32;
    "Shutdown Status (SHST): see [`Csts::SHST_COMPLETE`]." shst set_shst [2; 2] -> u8;
}

reg_flags! { Csts: u32;
    "Ready (RDY)." rdy set_rdy [0];
    "Controller Fatal Status (CFS)." cfs set_cfs [1];
    "NVM Subsystem Reset Occurred (NSSRO)." nssro set_nssro [4];
    "Processing Paused (PP)." pp set_pp [5];
    "Shutdown Type (ST): the shutdown reported is of the whole subsystem." st set_st [6];
}

impl Csts {
    /// CSTS.SHST: normal operation, no shutdown requested.
    pub const SHST_NORMAL: u8 = 0;
    /// CSTS.SHST: shutdown processing occurring.
    pub const SHST_OCCURRING: u8 = 1;
    /// CSTS.SHST: shutdown processing complete.
    pub const SHST_COMPLETE: u8 = 2;
}

/// Admin Queue Attributes (AQA, offset 0x24).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Aqa(pub u32);

reg_fields! { Aqa: u32;
    "Admin Submission Queue Size, 0-based (ASQS)." asqs set_asqs [0; 12] -> u16;
    "Admin Completion Queue Size, 0-based (ACQS)." acqs set_acqs [16; 12] -> u16;
}

impl Aqa {
    /// The largest admin queue: 4096 entries.
    pub const MAX_ENTRIES: u16 = 4096;

    /// Admin queues of `sq_entries` and `cq_entries` entries (1-based counts, clamped to 1..=4096).
    pub fn new(sq_entries: u16, cq_entries: u16) -> Aqa {
        let zero_based = |n: u16| n.clamp(1, Self::MAX_ENTRIES) - 1;
        let mut a = Aqa(0);
        a.set_asqs(zero_based(sq_entries));
        a.set_acqs(zero_based(cq_entries));
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cap_fields() {
        // MQES 2047, CQR, TO 15, DSTRD 0, CSS NVM + I/O sets + admin only, MPSMIN 0, MPSMAX 4.
        let cap = Cap(0x0040_1820_0f01_07ff);
        assert_eq!(cap.mqes(), 0x7ff);
        assert_eq!(cap.max_queue_entries(), 2048);
        assert!(cap.cqr());
        assert_eq!(cap.ams(), 0);
        assert_eq!(cap.to(), 0x0f);
        assert_eq!(cap.timeout(), Duration::from_millis(7500));
        assert_eq!(cap.dstrd(), 0);
        assert_eq!(
            cap.css(),
            Cap::CSS_NVM | Cap::CSS_IO_SETS | Cap::CSS_ADMIN_ONLY
        );
        assert_eq!(cap.mpsmin(), 0);
        assert_eq!(cap.mpsmax(), 4);
        assert_eq!(cap.min_page_size(), 4096);
        assert_eq!(cap.max_page_size(), 65536);
        assert!(!cap.cmbs() && !cap.pmrs());

        let mut built = Cap::default();
        built.set_mqes(0x7ff);
        built.set_cqr(true);
        built.set_to(0x0f);
        built.set_css(Cap::CSS_NVM | Cap::CSS_IO_SETS | Cap::CSS_ADMIN_ONLY);
        built.set_mpsmax(4);
        assert_eq!(built, cap);
        built.set_dstrd(0xff);
        assert_eq!(built.dstrd(), 0xf);
        assert_eq!(
            (built.0 >> 36) & 1,
            0,
            "setter must not spill into the next field"
        );
    }

    #[test]
    fn cc_csts_aqa() {
        let mut cc = Cc::default();
        cc.set_en(true);
        cc.set_css(Cc::CSS_NVM);
        cc.set_mps(0);
        cc.set_iosqes(6);
        cc.set_iocqes(4);
        assert_eq!(cc.0, 0x0046_0001);
        cc.set_shn(Cc::SHN_NORMAL);
        assert_eq!(cc.shn(), 1);
        assert_eq!(cc.0, 0x0046_4001);
        cc.set_en(false);
        assert!(!cc.en());
        assert_eq!(
            (cc.iosqes(), cc.iocqes(), cc.ams(), cc.crime()),
            (6, 4, 0, false)
        );

        let mut csts = Csts(0x9);
        assert!(csts.rdy() && !csts.cfs() && csts.shst() == Csts::SHST_COMPLETE);
        csts.set_cfs(true);
        csts.set_pp(true);
        assert_eq!(csts.0, 0x2b);
        assert!(csts.pp() && !csts.nssro() && !csts.st());

        let aqa = Aqa::new(32, 32);
        assert_eq!(aqa.0, 0x001f_001f);
        assert_eq!((aqa.asqs(), aqa.acqs()), (31, 31));
        assert_eq!(
            (Aqa::new(0, 5000).asqs(), Aqa::new(0, 5000).acqs()),
            (0, 4095)
        );
    }

    #[test]
    fn version_and_doorbells() {
        let v = Vs(0x0001_0400);
        assert_eq!((v.major(), v.minor(), v.tertiary()), (1, 4, 0));
        assert_eq!(v, Vs::V1_4);
        assert_eq!(v.to_string(), "1.4.0");
        assert_eq!(Vs::new(2, 0, 1).to_string(), "2.0.1");
        assert!(Vs::V2_0 > Vs::V1_4);

        assert_eq!(reg::sq_tail_doorbell(0, 0), 0x1000);
        assert_eq!(reg::cq_head_doorbell(0, 0), 0x1004);
        assert_eq!(reg::sq_tail_doorbell(3, 0), 0x1018);
        assert_eq!(reg::cq_head_doorbell(1, 2), 0x1000 + 3 * 16);
        assert_eq!(
            reg::cq_head_doorbell(u16::MAX, 0xf),
            0x1000 + (2 * 65535 + 1) * (4 << 15)
        );
        assert!(reg::is_64bit(reg::CAP) && !reg::is_64bit(reg::CC) && reg::is_64bit(reg::ACQ));
    }
}

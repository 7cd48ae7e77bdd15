//! Log pages (Get Log Page) and asynchronous event completions: the SMART / Health Information log and the
//! fabrics Discovery log.

use super::wire::{
    bytes_at, need, put_bytes, put_str, put_u128, put_u16, put_u32, put_u64, put_u8, str_at,
    u128_at, u16_at, u32_at, u64_at, u8_at, Pad, ParseError,
};

/// Size of the SMART / Health Information log page.
pub const SMART_LOG_SIZE: usize = 512;

/// SMART / Health Information log page (log page 0x02).
///
/// The counters are 128-bit as on the wire. Data units are thousands of 512-byte units, rounded up.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct SmartLog {
    /// Critical Warning bits (byte 0): spare, temperature, reliability, read-only, volatile backup.
    pub critical_warning: u8,
    /// Composite Temperature, kelvin (2:1).
    pub temperature: u16,
    /// Available Spare, percent (3).
    pub available_spare: u8,
    /// Available Spare Threshold, percent (4).
    pub available_spare_threshold: u8,
    /// Percentage Used (5).
    pub percentage_used: u8,
    /// Endurance Group Critical Warning Summary (6).
    pub endurance_group_warning: u8,
    /// Data Units Read (47:32).
    pub data_units_read: u128,
    /// Data Units Written (63:48).
    pub data_units_written: u128,
    /// Host Read Commands (79:64).
    pub host_read_commands: u128,
    /// Host Write Commands (95:80).
    pub host_write_commands: u128,
    /// Controller Busy Time, minutes (111:96).
    pub controller_busy_time: u128,
    /// Power Cycles (127:112).
    pub power_cycles: u128,
    /// Power On Hours (143:128).
    pub power_on_hours: u128,
    /// Unsafe Shutdowns (159:144).
    pub unsafe_shutdowns: u128,
    /// Media and Data Integrity Errors (175:160).
    pub media_errors: u128,
    /// Number of Error Information Log Entries (191:176).
    pub error_log_entries: u128,
    /// Warning Composite Temperature Time, minutes (195:192).
    pub warning_temp_time: u32,
    /// Critical Composite Temperature Time, minutes (199:196).
    pub critical_temp_time: u32,
    /// Temperature Sensors 1 to 8, kelvin, 0 if absent (215:200).
    pub temp_sensors: [u16; 8],
    /// Thermal Management Temperature 1 and 2 Transition Counts (223:216).
    pub thermal_transitions: [u32; 2],
    /// Total Time For Thermal Management Temperature 1 and 2, seconds (231:224).
    pub thermal_time: [u32; 2],
}

impl SmartLog {
    /// Critical Warning bit: available spare below threshold.
    pub const WARN_SPARE: u8 = 1 << 0;
    /// Critical Warning bit: temperature outside its thresholds.
    pub const WARN_TEMPERATURE: u8 = 1 << 1;
    /// Critical Warning bit: reliability degraded.
    pub const WARN_RELIABILITY: u8 = 1 << 2;
    /// Critical Warning bit: media placed in read-only mode.
    pub const WARN_READ_ONLY: u8 = 1 << 3;
    /// Critical Warning bit: volatile memory backup failed.
    pub const WARN_VOLATILE_BACKUP: u8 = 1 << 4;

    const COUNTERS: usize = 10;

    fn counters(&self) -> [u128; Self::COUNTERS] {
        [
            self.data_units_read,
            self.data_units_written,
            self.host_read_commands,
            self.host_write_commands,
            self.controller_busy_time,
            self.power_cycles,
            self.power_on_hours,
            self.unsafe_shutdowns,
            self.media_errors,
            self.error_log_entries,
        ]
    }

    /// Encodes the page (512 bytes).
    pub fn to_bytes(&self) -> [u8; SMART_LOG_SIZE] {
        let mut b = [0u8; SMART_LOG_SIZE];
        put_u8(&mut b, 0, self.critical_warning);
        put_u16(&mut b, 1, self.temperature);
        put_bytes(
            &mut b,
            3,
            &[
                self.available_spare,
                self.available_spare_threshold,
                self.percentage_used,
                self.endurance_group_warning,
            ],
        );
        for (i, c) in self.counters().iter().enumerate() {
            put_u128(&mut b, 32 + 16 * i, *c);
        }
        put_u32(&mut b, 192, self.warning_temp_time);
        put_u32(&mut b, 196, self.critical_temp_time);
        for (i, t) in self.temp_sensors.iter().enumerate() {
            put_u16(&mut b, 200 + 2 * i, *t);
        }
        for (i, v) in self
            .thermal_transitions
            .iter()
            .chain(&self.thermal_time)
            .enumerate()
        {
            put_u32(&mut b, 216 + 4 * i, *v);
        }
        b
    }

    /// Decodes the first 512 bytes of `b`.
    pub fn parse(b: &[u8]) -> Result<SmartLog, ParseError> {
        need("SMART / Health log", b, SMART_LOG_SIZE)?;
        let counter = |i: usize| u128_at(b, 32 + 16 * i);
        Ok(SmartLog {
            critical_warning: u8_at(b, 0),
            temperature: u16_at(b, 1),
            available_spare: u8_at(b, 3),
            available_spare_threshold: u8_at(b, 4),
            percentage_used: u8_at(b, 5),
            endurance_group_warning: u8_at(b, 6),
            data_units_read: counter(0),
            data_units_written: counter(1),
            host_read_commands: counter(2),
            host_write_commands: counter(3),
            controller_busy_time: counter(4),
            power_cycles: counter(5),
            power_on_hours: counter(6),
            unsafe_shutdowns: counter(7),
            media_errors: counter(8),
            error_log_entries: counter(9),
            warning_temp_time: u32_at(b, 192),
            critical_temp_time: u32_at(b, 196),
            temp_sensors: std::array::from_fn(|i| u16_at(b, 200 + 2 * i)),
            thermal_transitions: [u32_at(b, 216), u32_at(b, 220)],
            thermal_time: [u32_at(b, 224), u32_at(b, 228)],
        })
    }
}

/// Size of the Discovery log page header, and of each of its entries.
pub const DISCOVERY_RECORD_SIZE: usize = 1024;

/// The header of the Discovery log page (log page 0x70).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DiscoveryLogHeader {
    /// Generation Counter: changes whenever the log changes.
    pub genctr: u64,
    /// Number of Records that follow the header.
    pub numrec: u64,
    /// Record Format; 0 is the only one defined.
    pub recfmt: u16,
}

impl DiscoveryLogHeader {
    /// Decodes the first 1024 bytes of `b` (the rest of the header is reserved).
    pub fn parse(b: &[u8]) -> Result<DiscoveryLogHeader, ParseError> {
        need("Discovery log header", b, DISCOVERY_RECORD_SIZE)?;
        Ok(DiscoveryLogHeader {
            genctr: u64_at(b, 0),
            numrec: u64_at(b, 8),
            recfmt: u16_at(b, 16),
        })
    }

    /// Bytes the whole log takes, header included: what a host should ask for next. `None` if `numrec` is so
    /// large that the length does not fit in a `usize`.
    pub fn log_len(&self) -> Option<usize> {
        usize::try_from(self.numrec)
            .ok()?
            .checked_add(1)?
            .checked_mul(DISCOVERY_RECORD_SIZE)
    }
}

/// One entry of the Discovery log page.
///
/// The text fields are trimmed of their padding; the transport specific address subtype (TSAS) is kept as bytes
/// without its trailing zeros.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct DiscoveryLogEntry {
    /// Transport Type (byte 0): see the `TRTYPE_` constants.
    pub trtype: u8,
    /// Address Family (1): see the `ADRFAM_` constants.
    pub adrfam: u8,
    /// Subsystem Type (2): see the `SUBTYPE_` constants.
    pub subtype: u8,
    /// Transport Requirements (3): secure channel (bits 1:0) and whether SQ flow control can be disabled (bit 2).
    pub treq: u8,
    /// Port ID (5:4).
    pub portid: u16,
    /// Controller ID (7:6): 0xffff under the dynamic controller model.
    pub cntlid: u16,
    /// Admin Max SQ Size (9:8).
    pub asqsz: u16,
    /// Entry Flags (11:10).
    pub eflags: u16,
    /// Transport Service Identifier (63:32): the TCP port, as text.
    pub trsvcid: String,
    /// NVM Subsystem Qualified Name (511:256).
    pub subnqn: String,
    /// Transport Address (767:512): the IP address, as text.
    pub traddr: String,
    /// Transport Specific Address Subtype (1023:768), trailing zeros dropped. For TCP, byte 0 is SECTYPE.
    pub tsas: Vec<u8>,
}

impl DiscoveryLogEntry {
    /// TRTYPE: RDMA.
    pub const TRTYPE_RDMA: u8 = 1;
    /// TRTYPE: Fibre Channel.
    pub const TRTYPE_FC: u8 = 2;
    /// TRTYPE: TCP.
    pub const TRTYPE_TCP: u8 = 3;
    /// TRTYPE: intra-host (loop).
    pub const TRTYPE_LOOP: u8 = 254;
    /// ADRFAM: IPv4.
    pub const ADRFAM_IPV4: u8 = 1;
    /// ADRFAM: IPv6.
    pub const ADRFAM_IPV6: u8 = 2;
    /// ADRFAM: InfiniBand.
    pub const ADRFAM_IB: u8 = 3;
    /// ADRFAM: Fibre Channel.
    pub const ADRFAM_FC: u8 = 4;
    /// ADRFAM: intra-host.
    pub const ADRFAM_LOOP: u8 = 254;
    /// SUBTYPE: a referral to another discovery service.
    pub const SUBTYPE_REFERRAL: u8 = 1;
    /// SUBTYPE: an NVM subsystem.
    pub const SUBTYPE_NVME: u8 = 2;
    /// SUBTYPE: the discovery subsystem that returned this log.
    pub const SUBTYPE_CURRENT_DISCOVERY: u8 = 3;
    /// TREQ bits 1:0: secure channel requirement not specified.
    pub const TREQ_SECURE_NOT_SPECIFIED: u8 = 0;
    /// TREQ bits 1:0: a secure channel is required.
    pub const TREQ_SECURE_REQUIRED: u8 = 1;
    /// TREQ bits 1:0: a secure channel is not required.
    pub const TREQ_SECURE_NOT_REQUIRED: u8 = 2;
    /// TREQ bit 2: the controller lets the host disable SQ flow control.
    pub const TREQ_DISABLE_SQFLOW: u8 = 1 << 2;
    /// TCP SECTYPE: no security.
    pub const TCP_SECTYPE_NONE: u8 = 0;
    /// TCP SECTYPE: TLS 1.2.
    pub const TCP_SECTYPE_TLS12: u8 = 1;
    /// TCP SECTYPE: TLS 1.3.
    pub const TCP_SECTYPE_TLS13: u8 = 2;

    /// Encodes the entry (1024 bytes). Text fields are NUL-padded, as Linux's target does.
    pub fn to_bytes(&self) -> [u8; DISCOVERY_RECORD_SIZE] {
        let mut b = [0u8; DISCOVERY_RECORD_SIZE];
        put_bytes(
            &mut b,
            0,
            &[self.trtype, self.adrfam, self.subtype, self.treq],
        );
        put_u16(&mut b, 4, self.portid);
        put_u16(&mut b, 6, self.cntlid);
        put_u16(&mut b, 8, self.asqsz);
        put_u16(&mut b, 10, self.eflags);
        put_str(&mut b, 32, 32, &self.trsvcid, Pad::Nul);
        put_str(&mut b, 256, 256, &self.subnqn, Pad::Nul);
        put_str(&mut b, 512, 256, &self.traddr, Pad::Nul);
        put_bytes(&mut b, 768, &self.tsas[..self.tsas.len().min(256)]);
        b
    }

    /// Decodes the first 1024 bytes of `b`.
    pub fn parse(b: &[u8]) -> Result<DiscoveryLogEntry, ParseError> {
        need("Discovery log entry", b, DISCOVERY_RECORD_SIZE)?;
        let tsas: [u8; 256] = bytes_at(b, 768);
        let used = tsas.iter().rposition(|&x| x != 0).map_or(0, |i| i + 1);
        Ok(DiscoveryLogEntry {
            trtype: u8_at(b, 0),
            adrfam: u8_at(b, 1),
            subtype: u8_at(b, 2),
            treq: u8_at(b, 3),
            portid: u16_at(b, 4),
            cntlid: u16_at(b, 6),
            asqsz: u16_at(b, 8),
            eflags: u16_at(b, 10),
            trsvcid: str_at(b, 32, 32),
            subnqn: str_at(b, 256, 256),
            traddr: str_at(b, 512, 256),
            tsas: tsas[..used].to_vec(),
        })
    }

    /// The TCP security type (TSAS byte 0); meaningful when `trtype` is TCP.
    pub fn tcp_sectype(&self) -> u8 {
        self.tsas.first().copied().unwrap_or(0)
    }
}

/// The whole Discovery log page: header and entries.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct DiscoveryLog {
    /// Generation Counter.
    pub genctr: u64,
    /// Record Format.
    pub recfmt: u16,
    /// The entries; their number is the header's NUMREC.
    pub entries: Vec<DiscoveryLogEntry>,
}

impl DiscoveryLog {
    /// Decodes a whole log: the header, then as many entries as it announces, all of which must be in `b`.
    pub fn parse(b: &[u8]) -> Result<DiscoveryLog, ParseError> {
        let header = DiscoveryLogHeader::parse(b)?;
        let len = header.log_len().ok_or_else(|| ParseError::Invalid {
            what: "Discovery log",
            reason: format!("NUMREC {} is too large", header.numrec),
        })?;
        need("Discovery log", b, len)?;
        let entries = b[DISCOVERY_RECORD_SIZE..len]
            .chunks_exact(DISCOVERY_RECORD_SIZE)
            .map(DiscoveryLogEntry::parse)
            .collect::<Result<_, _>>()?;
        Ok(DiscoveryLog {
            genctr: header.genctr,
            recfmt: header.recfmt,
            entries,
        })
    }

    /// Encodes the log: a 1024-byte header followed by 1024 bytes per entry.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = vec![0u8; DISCOVERY_RECORD_SIZE * (1 + self.entries.len())];
        put_u64(&mut b, 0, self.genctr);
        put_u64(&mut b, 8, self.entries.len() as u64);
        put_u16(&mut b, 16, self.recfmt);
        for (chunk, e) in b[DISCOVERY_RECORD_SIZE..]
            .chunks_exact_mut(DISCOVERY_RECORD_SIZE)
            .zip(&self.entries)
        {
            chunk.copy_from_slice(&e.to_bytes());
        }
        b
    }
}

/// An asynchronous event, as an Asynchronous Event Request completion's dword 0 reports it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AsyncEvent {
    /// Asynchronous Event Type (bits 2:0): see the `TYPE_` constants.
    pub event_type: u8,
    /// Asynchronous Event Information (bits 15:8), which depends on the type.
    pub info: u8,
    /// The log page to read to learn more and clear the event (bits 23:16).
    pub log_page: u8,
}

impl AsyncEvent {
    /// Event type: error status.
    pub const TYPE_ERROR: u8 = 0;
    /// Event type: SMART / health status.
    pub const TYPE_SMART: u8 = 1;
    /// Event type: notice.
    pub const TYPE_NOTICE: u8 = 2;
    /// Event type: I/O command set specific status.
    pub const TYPE_IO_COMMAND_SET: u8 = 6;
    /// Event type: vendor specific.
    pub const TYPE_VENDOR: u8 = 7;
    /// Notice information: namespace attribute changed (read the Changed Namespace List).
    pub const NOTICE_NS_CHANGED: u8 = 0x00;
    /// Notice information: firmware activation starting.
    pub const NOTICE_FIRMWARE_ACTIVATION: u8 = 0x01;
    /// Notice information: telemetry log changed.
    pub const NOTICE_TELEMETRY: u8 = 0x02;
    /// Notice information: asymmetric namespace access change.
    pub const NOTICE_ANA_CHANGE: u8 = 0x03;
    /// Notice information: discovery log page changed (discovery controllers).
    pub const NOTICE_DISCOVERY_CHANGE: u8 = 0xf0;

    /// Decodes a completion's dword 0.
    pub const fn from_dw0(dw0: u32) -> AsyncEvent {
        AsyncEvent {
            event_type: (dw0 & 0x7) as u8,
            info: ((dw0 >> 8) & 0xff) as u8,
            log_page: ((dw0 >> 16) & 0xff) as u8,
        }
    }

    /// Encodes a completion's dword 0.
    pub const fn to_dw0(self) -> u32 {
        (self.event_type & 0x7) as u32 | (self.info as u32) << 8 | (self.log_page as u32) << 16
    }
}

/// An ANA group's state, as a controller reports it for one of its paths (ANA log page, byte 16 of a group
/// descriptor).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AnaState {
    /// Optimized: the best path to the group's namespaces.
    Optimized,
    /// Non-Optimized: works, but slower than an optimized path.
    NonOptimized,
    /// Inaccessible: commands fail with [`crate::Status::ANA_INACCESSIBLE`] until the state changes.
    Inaccessible,
    /// Persistent Loss: this path will not return.
    PersistentLoss,
    /// Change: in transition (at most ANATT seconds); commands fail with
    /// [`crate::Status::ANA_TRANSITION`].
    Change,
}

impl AnaState {
    /// Every state, in the order of their codes.
    pub const ALL: [AnaState; 5] = [
        AnaState::Optimized,
        AnaState::NonOptimized,
        AnaState::Inaccessible,
        AnaState::PersistentLoss,
        AnaState::Change,
    ];

    /// The code on the wire.
    pub const fn code(self) -> u8 {
        match self {
            AnaState::Optimized => 0x01,
            AnaState::NonOptimized => 0x02,
            AnaState::Inaccessible => 0x03,
            AnaState::PersistentLoss => 0x04,
            AnaState::Change => 0x0f,
        }
    }

    /// The state a code names.
    pub const fn from_code(code: u8) -> Option<AnaState> {
        Some(match code {
            0x01 => AnaState::Optimized,
            0x02 => AnaState::NonOptimized,
            0x03 => AnaState::Inaccessible,
            0x04 => AnaState::PersistentLoss,
            0x0f => AnaState::Change,
            _ => return None,
        })
    }

    /// Its name in configuration and on the control socket (as Linux's nvmet spells them in configfs).
    pub const fn name(self) -> &'static str {
        match self {
            AnaState::Optimized => "optimized",
            AnaState::NonOptimized => "non-optimized",
            AnaState::Inaccessible => "inaccessible",
            AnaState::PersistentLoss => "persistent-loss",
            AnaState::Change => "change",
        }
    }

    /// Whether commands to the group's namespaces may run on this path.
    pub const fn is_accessible(self) -> bool {
        matches!(self, AnaState::Optimized | AnaState::NonOptimized)
    }

    /// The status a command gets on a path in this state; `None` when it may run.
    pub const fn refusal(self) -> Option<crate::Status> {
        match self {
            AnaState::Optimized | AnaState::NonOptimized => None,
            AnaState::Inaccessible => Some(crate::Status::ANA_INACCESSIBLE),
            AnaState::PersistentLoss => Some(crate::Status::ANA_PERSISTENT_LOSS),
            AnaState::Change => Some(crate::Status::ANA_TRANSITION),
        }
    }
}

impl std::fmt::Display for AnaState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A name that is none of the ANA states ([`AnaState`]'s `FromStr`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownAnaState(pub String);

impl std::fmt::Display for UnknownAnaState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ANA state '{}': must be one of {}",
            self.0,
            AnaState::ALL.map(AnaState::name).join(", ")
        )
    }
}

impl std::error::Error for UnknownAnaState {}

impl std::str::FromStr for AnaState {
    type Err = UnknownAnaState;

    fn from_str(s: &str) -> Result<AnaState, UnknownAnaState> {
        AnaState::ALL
            .into_iter()
            .find(|a| a.name() == s)
            .ok_or_else(|| UnknownAnaState(s.to_string()))
    }
}

/// One group descriptor of the ANA log page.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AnaGroupDescriptor {
    /// ANA Group ID (3:0), never 0.
    pub grpid: u32,
    /// Change Count of this group (15:8).
    pub change_count: u64,
    /// Its state on the path the log was read through (byte 16, bits 3:0).
    pub state: AnaState,
    /// The namespaces in the group (empty when the host asked for groups only).
    pub nsids: Vec<u32>,
}

/// The Asymmetric Namespace Access log page (log page 0x0C).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AnaLog {
    /// Change Count (7:0): moves whenever a state changes.
    pub change_count: u64,
    /// The group descriptors.
    pub groups: Vec<AnaGroupDescriptor>,
}

/// Size of the ANA log page header and of a group descriptor without its NSIDs.
pub const ANA_LOG_HEADER_SIZE: usize = 16;
/// Size of an ANA group descriptor before its NSID list.
pub const ANA_GROUP_DESCRIPTOR_SIZE: usize = 32;
/// Log Specific Field of Get Log Page for the ANA log: Return Groups Only (no NSID lists).
pub const ANA_LSP_RGO: u8 = 1;

impl AnaLog {
    /// Encodes the page. Its counts are 16 bits (descriptors) and 32 bits (NSIDs of a group): descriptors
    /// past the 65535th, and NSIDs past the 4294967295th of a group, are dropped, so that every count
    /// matches what follows it.
    pub fn to_bytes(&self) -> Vec<u8> {
        let ngroups = u16::try_from(self.groups.len()).unwrap_or(u16::MAX);
        let groups = &self.groups[..usize::from(ngroups)];
        fn nsids(g: &AnaGroupDescriptor) -> (u32, &[u32]) {
            let n = u32::try_from(g.nsids.len()).unwrap_or(u32::MAX);
            (n, &g.nsids[..n as usize])
        }
        let len = ANA_LOG_HEADER_SIZE
            + groups
                .iter()
                .map(|g| ANA_GROUP_DESCRIPTOR_SIZE + 4 * nsids(g).1.len())
                .sum::<usize>();
        let mut b = vec![0u8; len];
        put_u64(&mut b, 0, self.change_count);
        put_u16(&mut b, 8, ngroups);
        let mut at = ANA_LOG_HEADER_SIZE;
        for g in groups {
            let (n, ids) = nsids(g);
            put_u32(&mut b, at, g.grpid);
            put_u32(&mut b, at + 4, n);
            put_u64(&mut b, at + 8, g.change_count);
            put_u8(&mut b, at + 16, g.state.code());
            at += ANA_GROUP_DESCRIPTOR_SIZE;
            for &id in ids {
                put_u32(&mut b, at, id);
                at += 4;
            }
        }
        b
    }

    /// Parses a page, checking that every descriptor fits, names a group other than 0, and has a known state.
    pub fn parse(b: &[u8]) -> Result<AnaLog, ParseError> {
        const WHAT: &str = "ANA log page";
        need(WHAT, b, ANA_LOG_HEADER_SIZE)?;
        let n = u16_at(b, 8);
        let mut log = AnaLog {
            change_count: u64_at(b, 0),
            groups: Vec::with_capacity(usize::from(n)),
        };
        let mut at = ANA_LOG_HEADER_SIZE;
        for i in 0..n {
            need(WHAT, b, at + ANA_GROUP_DESCRIPTOR_SIZE)?;
            let grpid = u32_at(b, at);
            let count = u32_at(b, at + 4) as usize;
            let invalid = |reason: String| ParseError::Invalid { what: WHAT, reason };
            if grpid == 0 {
                return Err(invalid(format!("descriptor {i} names ANA group 0")));
            }
            let code = u8_at(b, at + 16) & 0xf;
            let state = AnaState::from_code(code)
                .ok_or_else(|| invalid(format!("group {grpid}: state {code:#x} is not defined")))?;
            let list = at + ANA_GROUP_DESCRIPTOR_SIZE;
            let end = count
                .checked_mul(4)
                .and_then(|l| l.checked_add(list))
                .ok_or_else(|| invalid(format!("group {grpid}: {count} NSIDs")))?;
            need(WHAT, b, end)?;
            log.groups.push(AnaGroupDescriptor {
                grpid,
                change_count: u64_at(b, at + 8),
                state,
                nsids: (0..count).map(|k| u32_at(b, list + 4 * k)).collect(),
            });
            at = end;
        }
        Ok(log)
    }

    /// The state of the group that holds namespace `nsid`, if any descriptor lists it.
    pub fn state_of(&self, nsid: u32) -> Option<AnaState> {
        self.groups
            .iter()
            .find(|g| g.nsids.contains(&nsid))
            .map(|g| g.state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smart_layout() {
        let s = SmartLog {
            critical_warning: SmartLog::WARN_TEMPERATURE,
            temperature: 323,
            available_spare: 100,
            data_units_read: 1,
            host_read_commands: 3,
            error_log_entries: u128::MAX,
            temp_sensors: [300, 0, 0, 0, 0, 0, 0, 301],
            thermal_time: [0, 9],
            ..Default::default()
        };
        let b = s.to_bytes();
        assert_eq!(&b[..4], &[2, 0x43, 0x01, 100]);
        assert_eq!(b[32], 1);
        assert_eq!(b[64], 3);
        assert_eq!(&b[176..192], &[0xff; 16]);
        assert_eq!(&b[214..216], &301u16.to_le_bytes());
        assert_eq!(&b[228..232], &9u32.to_le_bytes());
        assert_eq!(SmartLog::parse(&b), Ok(s));
        assert!(SmartLog::parse(&b[..511]).is_err());
    }

    fn tcp_entry(subtype: u8, nqn: &str) -> DiscoveryLogEntry {
        DiscoveryLogEntry {
            trtype: DiscoveryLogEntry::TRTYPE_TCP,
            adrfam: DiscoveryLogEntry::ADRFAM_IPV4,
            subtype,
            treq: DiscoveryLogEntry::TREQ_DISABLE_SQFLOW,
            portid: 1,
            cntlid: 0xffff,
            asqsz: 32,
            eflags: 0,
            trsvcid: "4420".into(),
            traddr: "127.0.0.1".into(),
            tsas: vec![],
            subnqn: nqn.into(),
        }
    }

    #[test]
    fn discovery_layout_and_round_trip() {
        let log = DiscoveryLog {
            genctr: 2,
            recfmt: 0,
            entries: vec![
                tcp_entry(
                    DiscoveryLogEntry::SUBTYPE_CURRENT_DISCOVERY,
                    crate::fabrics::DISCOVERY_NQN,
                ),
                DiscoveryLogEntry {
                    tsas: vec![DiscoveryLogEntry::TCP_SECTYPE_TLS13],
                    ..tcp_entry(2, "nqn.a:b")
                },
            ],
        };
        let b = log.to_bytes();
        assert_eq!(b.len(), 3072);
        assert_eq!(
            &b[..18],
            &[2, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(&b[1024..1034], &[3, 1, 3, 4, 1, 0, 0xff, 0xff, 32, 0]);
        assert_eq!(&b[1024 + 32..1024 + 37], b"4420\0");
        assert_eq!(&b[1024 + 256..1024 + 260], b"nqn.");
        assert_eq!(&b[1024 + 512..1024 + 522], b"127.0.0.1\0");
        assert_eq!(b[2048 + 768], 2);
        assert_eq!(DiscoveryLog::parse(&b), Ok(log.clone()));
        assert_eq!(
            log.entries[1].tcp_sectype(),
            DiscoveryLogEntry::TCP_SECTYPE_TLS13
        );
        let h = DiscoveryLogHeader::parse(&b).unwrap();
        assert_eq!((h.genctr, h.numrec, h.log_len()), (2, 2, Some(3072)));
        assert!(matches!(
            DiscoveryLog::parse(&b[..3071]),
            Err(ParseError::Short { need: 3072, .. })
        ));
    }

    #[test]
    fn discovery_huge_numrec() {
        let mut b = vec![0u8; 1024];
        b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert_eq!(DiscoveryLogHeader::parse(&b).unwrap().log_len(), None);
        assert!(matches!(
            DiscoveryLog::parse(&b),
            Err(ParseError::Invalid { .. })
        ));
        b[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(matches!(
            DiscoveryLog::parse(&b),
            Err(ParseError::Short { .. })
        ));
    }

    #[test]
    fn async_events() {
        let e = AsyncEvent {
            event_type: AsyncEvent::TYPE_NOTICE,
            info: AsyncEvent::NOTICE_NS_CHANGED,
            log_page: crate::log_page::CHANGED_NS,
        };
        assert_eq!(e.to_dw0(), 0x0004_0002);
        assert_eq!(AsyncEvent::from_dw0(0xff04_0002), e);
    }

    #[test]
    fn ana_log_round_trips_and_rejects_what_cannot_be() {
        let log = AnaLog {
            change_count: 7,
            groups: vec![
                AnaGroupDescriptor {
                    grpid: 1,
                    change_count: 3,
                    state: AnaState::Optimized,
                    nsids: vec![1, 2],
                },
                AnaGroupDescriptor {
                    grpid: 2,
                    change_count: 7,
                    state: AnaState::Inaccessible,
                    nsids: vec![5],
                },
            ],
        };
        let b = log.to_bytes();
        assert_eq!(b.len(), 16 + 32 + 8 + 32 + 4);
        assert_eq!(b[16 + 16], 0x01);
        assert_eq!(AnaLog::parse(&b).unwrap(), log);
        assert_eq!(log.state_of(5), Some(AnaState::Inaccessible));
        assert_eq!(log.state_of(3), None);
        assert!(AnaLog::parse(&b[..b.len() - 1]).is_err(), "a cut NSID list");
        let mut bad = b.clone();
        bad[16] = 0;
        bad[17] = 0;
        assert!(AnaLog::parse(&bad).is_err(), "group 0");
        let mut bad = b.clone();
        bad[16 + 16] = 0x05;
        assert!(AnaLog::parse(&bad).is_err(), "an undefined state");
        let mut huge = b;
        huge[16 + 4..16 + 8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(
            AnaLog::parse(&huge).is_err(),
            "an NSID count beyond the page"
        );
        for st in AnaState::ALL {
            assert_eq!(AnaState::from_code(st.code()), Some(st));
            assert_eq!(st.name().parse::<AnaState>(), Ok(st));
        }
        assert!("optimised".parse::<AnaState>().is_err());
    }

    #[test]
    fn ana_log_with_more_groups_than_its_count_holds_keeps_count_and_body_agreed() {
        // The descriptor count is 16 bits: 65536 groups used to encode a count of 0 before 2 MiB of
        // descriptors. The encoder now keeps the first 65535, and the page parses back to them.
        let groups: Vec<AnaGroupDescriptor> = (1..=0x1_0000u32)
            .map(|grpid| AnaGroupDescriptor {
                grpid,
                change_count: 0,
                state: AnaState::Optimized,
                nsids: Vec::new(),
            })
            .collect();
        let log = AnaLog {
            change_count: 1,
            groups,
        };
        let b = log.to_bytes();
        assert_eq!(u16_at(&b, 8), u16::MAX);
        assert_eq!(b.len(), 16 + 32 * 0xffff);
        let back = AnaLog::parse(&b).unwrap();
        assert_eq!(back.groups, log.groups[..0xffff]);
    }
}

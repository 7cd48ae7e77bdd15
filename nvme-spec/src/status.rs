//! Completion status codes (NVMe Base 2.0 "Status Field Definition", NVM Command Set 1.0, NVMe over Fabrics 1.1).
//!
//! The status field is the upper 15 bits of the last completion dword: SC (bits 7:0), SCT (10:8), CRD (12:11),
//! More (13) and DNR (14), counted after the phase tag has been shifted out.

/// The 15-bit status field of a completion (without the phase tag).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Status(u16);

/// Status Code Type values.
pub mod sct {
    /// Generic Command Status.
    pub const GENERIC: u8 = 0;
    /// Command Specific Status.
    pub const COMMAND_SPECIFIC: u8 = 1;
    /// Media and Data Integrity Errors.
    pub const MEDIA: u8 = 2;
    /// Path Related Status.
    pub const PATH: u8 = 3;
    /// Vendor Specific.
    pub const VENDOR: u8 = 7;
}

const DNR: u16 = 1 << 14;
const MORE: u16 = 1 << 13;

impl Status {
    /// Successful completion.
    pub const SUCCESS: Status = Status(0);
    /// Invalid Command Opcode.
    pub const INVALID_OPCODE: Status = Status::new(sct::GENERIC, 0x01);
    /// Invalid Field in Command.
    pub const INVALID_FIELD: Status = Status::new(sct::GENERIC, 0x02);
    /// Command ID Conflict.
    pub const CID_CONFLICT: Status = Status::new(sct::GENERIC, 0x03);
    /// Data Transfer Error.
    pub const DATA_TRANSFER_ERROR: Status = Status::new(sct::GENERIC, 0x04);
    /// Commands Aborted due to Power Loss Notification.
    pub const ABORTED_POWER_LOSS: Status = Status::new(sct::GENERIC, 0x05);
    /// Internal Error.
    pub const INTERNAL_ERROR: Status = Status::new(sct::GENERIC, 0x06);
    /// Command Abort Requested.
    pub const ABORT_REQUESTED: Status = Status::new(sct::GENERIC, 0x07);
    /// Command Aborted due to SQ Deletion.
    pub const ABORTED_SQ_DELETION: Status = Status::new(sct::GENERIC, 0x08);
    /// Invalid Namespace or Format.
    pub const INVALID_NAMESPACE: Status = Status::new(sct::GENERIC, 0x0b);
    /// Command Sequence Error.
    pub const COMMAND_SEQUENCE_ERROR: Status = Status::new(sct::GENERIC, 0x0c);
    /// Invalid SGL Segment Descriptor.
    pub const INVALID_SGL_SEGMENT: Status = Status::new(sct::GENERIC, 0x0d);
    /// Invalid Number of SGL Descriptors.
    pub const INVALID_SGL_COUNT: Status = Status::new(sct::GENERIC, 0x0e);
    /// Data SGL Length Invalid.
    pub const DATA_SGL_LENGTH_INVALID: Status = Status::new(sct::GENERIC, 0x0f);
    /// SGL Descriptor Type Invalid.
    pub const SGL_DESCRIPTOR_TYPE_INVALID: Status = Status::new(sct::GENERIC, 0x11);
    /// SGL Offset Invalid.
    pub const SGL_OFFSET_INVALID: Status = Status::new(sct::GENERIC, 0x16);
    /// Host Identifier Inconsistent Format.
    pub const HOST_ID_INCONSISTENT_FORMAT: Status = Status::new(sct::GENERIC, 0x18);
    /// Keep Alive Timer Expired.
    pub const KEEP_ALIVE_EXPIRED: Status = Status::new(sct::GENERIC, 0x19);
    /// Keep Alive Timeout Invalid.
    pub const KEEP_ALIVE_INVALID: Status = Status::new(sct::GENERIC, 0x1a);
    /// Command Interrupted (the host may retry).
    pub const COMMAND_INTERRUPTED: Status = Status::new(sct::GENERIC, 0x21);
    /// Transient Transport Error.
    pub const TRANSIENT_TRANSPORT_ERROR: Status = Status::new(sct::GENERIC, 0x22);
    /// LBA Out of Range.
    pub const LBA_OUT_OF_RANGE: Status = Status::new(sct::GENERIC, 0x80);
    /// Capacity Exceeded.
    pub const CAPACITY_EXCEEDED: Status = Status::new(sct::GENERIC, 0x81);
    /// Namespace Not Ready.
    pub const NS_NOT_READY: Status = Status::new(sct::GENERIC, 0x82);
    /// Reservation Conflict.
    pub const RESERVATION_CONFLICT: Status = Status::new(sct::GENERIC, 0x83);
    /// Completion Queue Invalid.
    pub const CQ_INVALID: Status = Status::new(sct::COMMAND_SPECIFIC, 0x00);
    /// Invalid Queue Identifier.
    pub const INVALID_QUEUE_ID: Status = Status::new(sct::COMMAND_SPECIFIC, 0x01);
    /// Invalid Queue Size.
    pub const INVALID_QUEUE_SIZE: Status = Status::new(sct::COMMAND_SPECIFIC, 0x02);
    /// Abort Command Limit Exceeded.
    pub const ABORT_LIMIT_EXCEEDED: Status = Status::new(sct::COMMAND_SPECIFIC, 0x03);
    /// Asynchronous Event Request Limit Exceeded.
    pub const ASYNC_EVENT_LIMIT_EXCEEDED: Status = Status::new(sct::COMMAND_SPECIFIC, 0x05);
    /// Invalid Log Page.
    pub const INVALID_LOG_PAGE: Status = Status::new(sct::COMMAND_SPECIFIC, 0x09);
    /// Invalid Queue Deletion.
    pub const INVALID_QUEUE_DELETION: Status = Status::new(sct::COMMAND_SPECIFIC, 0x0c);
    /// Feature Identifier Not Saveable.
    pub const FEATURE_NOT_SAVEABLE: Status = Status::new(sct::COMMAND_SPECIFIC, 0x0d);
    /// Feature Not Changeable.
    pub const FEATURE_NOT_CHANGEABLE: Status = Status::new(sct::COMMAND_SPECIFIC, 0x0e);
    /// Attempted Write to Read Only Range (NVM I/O commands).
    pub const WRITE_TO_READ_ONLY_RANGE: Status = Status::new(sct::COMMAND_SPECIFIC, 0x82);
    /// Connect: Incompatible Format (fabrics Connect only; shares its code with Conflicting Attributes).
    pub const CONNECT_INCOMPATIBLE_FORMAT: Status = Status::new(sct::COMMAND_SPECIFIC, 0x80);
    /// Connect: Controller Busy.
    pub const CONNECT_CONTROLLER_BUSY: Status = Status::new(sct::COMMAND_SPECIFIC, 0x81);
    /// Connect: Invalid Parameters; the completion's dword 0 says which (see `ConnectResponse`).
    pub const CONNECT_INVALID_PARAMETERS: Status = Status::new(sct::COMMAND_SPECIFIC, 0x82);
    /// Connect: Restart Discovery.
    pub const CONNECT_RESTART_DISCOVERY: Status = Status::new(sct::COMMAND_SPECIFIC, 0x83);
    /// Connect: Invalid Host (the host NQN may not use this subsystem).
    pub const CONNECT_INVALID_HOST: Status = Status::new(sct::COMMAND_SPECIFIC, 0x84);
    /// Authentication Required (Fabrics): the queue's host has not authenticated yet.
    pub const AUTHENTICATION_REQUIRED: Status = Status::new(sct::COMMAND_SPECIFIC, 0x91);
    /// Write Fault.
    pub const WRITE_FAULT: Status = Status::new(sct::MEDIA, 0x80);
    /// Unrecovered Read Error.
    pub const UNRECOVERED_READ_ERROR: Status = Status::new(sct::MEDIA, 0x81);
    /// Compare Failure.
    pub const COMPARE_FAILURE: Status = Status::new(sct::MEDIA, 0x85);
    /// Access Denied.
    pub const ACCESS_DENIED: Status = Status::new(sct::MEDIA, 0x86);
    /// Internal Path Error.
    pub const INTERNAL_PATH_ERROR: Status = Status::new(sct::PATH, 0x00);
    /// Asymmetric Access Inaccessible.
    pub const ANA_INACCESSIBLE: Status = Status::new(sct::PATH, 0x02);
    /// Asymmetric Access Persistent Loss: the path to the namespace is gone for good.
    pub const ANA_PERSISTENT_LOSS: Status = Status::new(sct::PATH, 0x01);
    /// Asymmetric Access Transition: the namespace's ANA group is changing state on this path.
    pub const ANA_TRANSITION: Status = Status::new(sct::PATH, 0x03);
    /// Command Aborted By Host (path related; the host gave up on the path).
    pub const ABORTED_BY_HOST: Status = Status::new(sct::PATH, 0x71);

    /// Builds a status from the 15-bit field (phase tag already removed).
    pub const fn from_raw(raw: u16) -> Status {
        Status(raw & 0x7fff)
    }

    /// Builds a status from a status code type and status code (no retry delay, more or DNR bits).
    pub const fn new(sct: u8, sc: u8) -> Status {
        Status(((sct as u16 & 0x7) << 8) | sc as u16)
    }

    /// The raw 15-bit field.
    pub const fn raw(self) -> u16 {
        self.0
    }

    /// Status code.
    pub const fn sc(self) -> u8 {
        (self.0 & 0xff) as u8
    }

    /// Status code type.
    pub const fn sct(self) -> u8 {
        ((self.0 >> 8) & 0x7) as u8
    }

    /// Do Not Retry.
    pub const fn dnr(self) -> bool {
        self.0 & DNR != 0
    }

    /// The same status with the Do Not Retry bit set.
    pub const fn with_dnr(self) -> Status {
        Status(self.0 | DNR)
    }

    /// More: the Error Information log page has more about this command.
    pub const fn more(self) -> bool {
        self.0 & MORE != 0
    }

    /// Command Retry Delay: which of the controller's CRDT times (1 to 3) to wait before a retry; 0 for none.
    pub const fn crd(self) -> u8 {
        ((self.0 >> 11) & 0x3) as u8
    }

    /// Whether this is a successful completion (SCT 0, SC 0).
    pub const fn is_success(self) -> bool {
        self.sct() == 0 && self.sc() == 0
    }

    /// Whether this is the same status code as `other`, ignoring the DNR, More and CRD bits.
    pub const fn is(self, other: Status) -> bool {
        self.sct() == other.sct() && self.sc() == other.sc()
    }

    /// The status's name as the specification words it, e.g. "Invalid Field in Command", for a completion of
    /// an NVM command set I/O command.
    ///
    /// Command-specific codes mean different things for different commands (82h is Attempted Write to Read
    /// Only Range for a Write and Connect Invalid Parameters for a Fabrics Connect): use [`Status::name_in`]
    /// whenever the command is known.
    pub fn name(self) -> &'static str {
        self.name_in(CommandKind::Nvm)
    }

    /// The status's name for a completion of a command of `kind`.
    pub fn name_in(self, kind: CommandKind) -> &'static str {
        match self.sct() {
            sct::GENERIC => generic_name(self.sc()),
            sct::COMMAND_SPECIFIC => match (kind, self.sc()) {
                // Fabrics-wide: any command on a queue that has not authenticated, and a discovery log read
                // that must start again.
                (_, 0x91) => "Authentication Required",
                (CommandKind::Admin, 0x90) => "Discovery Restart",
                (CommandKind::Fabrics | CommandKind::Authentication, sc) if sc >= 0x80 => {
                    fabrics_name(sc)
                }
                (CommandKind::Admin, sc) if sc >= 0x80 => "Unknown Command Specific Status",
                (CommandKind::Nvm, sc) if sc >= 0x80 => nvm_command_specific_name(sc),
                (_, sc) => command_specific_name(sc),
            },
            sct::MEDIA => media_name(self.sc()),
            sct::PATH => path_name(self.sc()),
            sct::VENDOR => "Vendor Specific",
            _ => "Reserved Status Code Type",
        }
    }

    /// The status as a completion of a command of `kind` words it: displays as
    /// "Connect Invalid Parameters (sct 0x1 sc 0x82)".
    pub const fn named_in(self, kind: CommandKind) -> StatusIn {
        StatusIn { status: self, kind }
    }
}

/// The command set of the command a completion answers: command-specific status codes from 80h mean
/// different things in each (NVMe Base 2.0 "Command Specific Status Values", NVM Command Set 1.0, and the
/// Fabrics command status values).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CommandKind {
    /// An admin command (not a fabrics command).
    Admin,
    /// An I/O command of the NVM command set (Read, Write, Flush, Dataset Management, ...).
    Nvm,
    /// A fabrics command other than authentication: Connect, Property Get and Set, Disconnect.
    Fabrics,
    /// Fabrics Authentication Send or Receive.
    Authentication,
}

impl CommandKind {
    /// The kind of `sqe`, submitted on queue `qid` (0: the admin queue).
    pub fn of(sqe: &crate::Sqe, qid: u16) -> CommandKind {
        use crate::fabrics;
        if sqe.opcode == fabrics::FABRICS {
            match (sqe.nsid & 0xff) as u8 {
                fabrics::AUTH_SEND | fabrics::AUTH_RECV => CommandKind::Authentication,
                _ => CommandKind::Fabrics,
            }
        } else if qid == 0 {
            CommandKind::Admin
        } else {
            CommandKind::Nvm
        }
    }

    /// The command set in words: "admin", "NVM", "Fabrics" or "Authentication".
    pub fn label(self) -> &'static str {
        match self {
            CommandKind::Admin => "admin",
            CommandKind::Nvm => "NVM",
            CommandKind::Fabrics => "Fabrics",
            CommandKind::Authentication => "Authentication",
        }
    }
}

/// A status named for the command it answers ([`Status::named_in`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StatusIn {
    /// The status.
    pub status: Status,
    /// The kind of command it completed.
    pub kind: CommandKind,
}

/// Formats as "Connect Invalid Parameters (sct 0x1 sc 0x82)".
impl std::fmt::Display for StatusIn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.status;
        write!(
            f,
            "{} (sct {:#x} sc {:#04x})",
            s.name_in(self.kind),
            s.sct(),
            s.sc()
        )
    }
}

fn generic_name(sc: u8) -> &'static str {
    match sc {
        0x00 => "Successful Completion",
        0x01 => "Invalid Command Opcode",
        0x02 => "Invalid Field in Command",
        0x03 => "Command ID Conflict",
        0x04 => "Data Transfer Error",
        0x05 => "Commands Aborted due to Power Loss Notification",
        0x06 => "Internal Error",
        0x07 => "Command Abort Requested",
        0x08 => "Command Aborted due to SQ Deletion",
        0x09 => "Command Aborted due to Failed Fused Command",
        0x0a => "Command Aborted due to Missing Fused Command",
        0x0b => "Invalid Namespace or Format",
        0x0c => "Command Sequence Error",
        0x0d => "Invalid SGL Segment Descriptor",
        0x0e => "Invalid Number of SGL Descriptors",
        0x0f => "Data SGL Length Invalid",
        0x10 => "Metadata SGL Length Invalid",
        0x11 => "SGL Descriptor Type Invalid",
        0x12 => "Invalid Use of Controller Memory Buffer",
        0x13 => "PRP Offset Invalid",
        0x14 => "Atomic Write Unit Exceeded",
        0x15 => "Operation Denied",
        0x16 => "SGL Offset Invalid",
        0x18 => "Host Identifier Inconsistent Format",
        0x19 => "Keep Alive Timer Expired",
        0x1a => "Keep Alive Timeout Invalid",
        0x1b => "Command Aborted due to Preempt and Abort",
        0x1c => "Sanitize Failed",
        0x1d => "Sanitize In Progress",
        0x1e => "SGL Data Block Granularity Invalid",
        0x1f => "Command Not Supported for Queue in CMB",
        0x20 => "Namespace is Write Protected",
        0x21 => "Command Interrupted",
        0x22 => "Transient Transport Error",
        0x23 => "Command Prohibited by Command and Feature Lockdown",
        0x24 => "Admin Command Media Not Ready",
        0x80 => "LBA Out of Range",
        0x81 => "Capacity Exceeded",
        0x82 => "Namespace Not Ready",
        0x83 => "Reservation Conflict",
        0x84 => "Format In Progress",
        _ => "Unknown Generic Status",
    }
}

fn command_specific_name(sc: u8) -> &'static str {
    match sc {
        0x00 => "Completion Queue Invalid",
        0x01 => "Invalid Queue Identifier",
        0x02 => "Invalid Queue Size",
        0x03 => "Abort Command Limit Exceeded",
        0x05 => "Asynchronous Event Request Limit Exceeded",
        0x06 => "Invalid Firmware Slot",
        0x07 => "Invalid Firmware Image",
        0x08 => "Invalid Interrupt Vector",
        0x09 => "Invalid Log Page",
        0x0a => "Invalid Format",
        0x0b => "Firmware Activation Requires Conventional Reset",
        0x0c => "Invalid Queue Deletion",
        0x0d => "Feature Identifier Not Saveable",
        0x0e => "Feature Not Changeable",
        0x0f => "Feature Not Namespace Specific",
        0x10 => "Firmware Activation Requires NVM Subsystem Reset",
        0x11 => "Firmware Activation Requires Controller Level Reset",
        0x12 => "Firmware Activation Requires Maximum Time Violation",
        0x13 => "Firmware Activation Prohibited",
        0x14 => "Overlapping Range",
        0x15 => "Namespace Insufficient Capacity",
        0x16 => "Namespace Identifier Unavailable",
        0x18 => "Namespace Already Attached",
        0x19 => "Namespace Is Private",
        0x1a => "Namespace Not Attached",
        0x1b => "Thin Provisioning Not Supported",
        0x1c => "Controller List Invalid",
        0x1d => "Device Self-test In Progress",
        0x1e => "Boot Partition Write Prohibited",
        0x1f => "Invalid Controller Identifier",
        0x20 => "Invalid Secondary Controller State",
        0x21 => "Invalid Number of Controller Resources",
        0x22 => "Invalid Resource Identifier",
        0x23 => "Sanitize Prohibited While Persistent Memory Region is Enabled",
        0x24 => "ANA Group Identifier Invalid",
        0x25 => "ANA Attach Failed",
        0x26 => "Insufficient Capacity",
        0x27 => "Namespace Attachment Limit Exceeded",
        0x28 => "Prohibition of Command Execution Not Supported",
        0x29 => "I/O Command Set Not Supported",
        0x2a => "I/O Command Set Not Enabled",
        0x2b => "I/O Command Set Combination Rejected",
        0x2c => "Invalid I/O Command Set",
        0x2d => "Identifier Unavailable",
        _ => "Unknown Command Specific Status",
    }
}

/// Command-specific codes from 80h of the NVM command set's I/O commands (NVM Command Set 1.0, Zoned
/// Namespace 1.1).
fn nvm_command_specific_name(sc: u8) -> &'static str {
    match sc {
        0x80 => "Conflicting Attributes",
        0x81 => "Invalid Protection Information",
        0x82 => "Attempted Write to Read Only Range",
        0x83 => "Command Size Limit Exceeded",
        0xb8 => "Zoned Boundary Error",
        0xb9 => "Zone Is Full",
        0xba => "Zone Is Read Only",
        0xbb => "Zone Is Offline",
        0xbc => "Zone Invalid Write",
        0xbd => "Too Many Active Zones",
        0xbe => "Too Many Open Zones",
        0xbf => "Invalid Zone State Transition",
        _ => "Unknown Command Specific Status",
    }
}

fn fabrics_name(sc: u8) -> &'static str {
    match sc {
        0x80 => "Connect Incompatible Format",
        0x81 => "Connect Controller Busy",
        0x82 => "Connect Invalid Parameters",
        0x83 => "Connect Restart Discovery",
        0x84 => "Connect Invalid Host",
        0x85 => "Invalid Queue Type",
        0x90 => "Discovery Restart",
        _ => "Unknown Fabrics Status",
    }
}

fn media_name(sc: u8) -> &'static str {
    match sc {
        0x80 => "Write Fault",
        0x81 => "Unrecovered Read Error",
        0x82 => "End-to-end Guard Check Error",
        0x83 => "End-to-end Application Tag Check Error",
        0x84 => "End-to-end Reference Tag Check Error",
        0x85 => "Compare Failure",
        0x86 => "Access Denied",
        0x87 => "Deallocated or Unwritten Logical Block",
        0x88 => "End-to-end Storage Tag Check Error",
        _ => "Unknown Media Error",
    }
}

fn path_name(sc: u8) -> &'static str {
    match sc {
        0x00 => "Internal Path Error",
        0x01 => "Asymmetric Access Persistent Loss",
        0x02 => "Asymmetric Access Inaccessible",
        0x03 => "Asymmetric Access Transition",
        0x60 => "Controller Pathing Error",
        0x70 => "Host Pathing Error",
        0x71 => "Command Aborted By Host",
        _ => "Unknown Path Related Status",
    }
}

impl std::fmt::Debug for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Status(sct={:#x}, sc={:#04x}", self.sct(), self.sc())?;
        if self.dnr() {
            f.write_str(", dnr")?;
        }
        if self.more() {
            f.write_str(", more")?;
        }
        if self.crd() != 0 {
            write!(f, ", crd={}", self.crd())?;
        }
        f.write_str(")")
    }
}

/// Formats as "Invalid Field in Command (sct 0x0 sc 0x02)", naming a command-specific code as an NVM I/O
/// command's ([`Status::name`]); [`Status::named_in`] names it for the command it answers.
impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.named_in(CommandKind::Nvm).fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_and_bits() {
        let s = Status::from_raw(0x8000 | 0x4000 | 0x2000 | 0x1800 | 0x0102);
        assert_eq!(s.raw(), 0x7902);
        assert_eq!(
            (s.sct(), s.sc(), s.dnr(), s.more(), s.crd()),
            (1, 2, true, true, 3)
        );
        assert!(s.is(Status::INVALID_QUEUE_SIZE));
        assert_ne!(s, Status::INVALID_QUEUE_SIZE);
        let d = Status::INVALID_FIELD.with_dnr();
        assert!(d.dnr() && d.is(Status::INVALID_FIELD) && !d.is_success());
        assert_eq!(d.raw(), 0x4002);
        assert!(Status::SUCCESS.is_success());
        assert!(Status::SUCCESS.with_dnr().is_success());
    }

    #[test]
    fn names_and_display() {
        assert_eq!(
            Status::INVALID_FIELD.to_string(),
            "Invalid Field in Command (sct 0x0 sc 0x02)"
        );
        assert_eq!(Status::LBA_OUT_OF_RANGE.name(), "LBA Out of Range");
        assert_eq!(Status::INVALID_QUEUE_ID.name(), "Invalid Queue Identifier");
        assert_eq!(
            Status::UNRECOVERED_READ_ERROR.name(),
            "Unrecovered Read Error"
        );
        assert_eq!(
            Status::ANA_INACCESSIBLE.name(),
            "Asymmetric Access Inaccessible"
        );
        assert_eq!(Status::new(7, 0x12).name(), "Vendor Specific");
        assert_eq!(Status::new(5, 0).name(), "Reserved Status Code Type");
        assert_eq!(Status::new(0, 0xfe).name(), "Unknown Generic Status");
        let fabrics = CommandKind::Fabrics;
        assert_eq!(
            Status::CONNECT_INVALID_HOST.name_in(fabrics),
            "Connect Invalid Host"
        );
        assert_eq!(
            Status::CONNECT_INVALID_PARAMETERS.name(),
            "Attempted Write to Read Only Range"
        );
        assert_eq!(
            Status::CONNECT_INVALID_PARAMETERS.name_in(fabrics),
            "Connect Invalid Parameters"
        );
        assert_eq!(
            Status::CONNECT_INVALID_PARAMETERS
                .named_in(fabrics)
                .to_string(),
            "Connect Invalid Parameters (sct 0x1 sc 0x82)"
        );
        assert_eq!(
            Status::INVALID_QUEUE_SIZE.name_in(fabrics),
            "Invalid Queue Size"
        );
        assert_eq!(
            format!("{:?}", Status::INVALID_OPCODE.with_dnr()),
            "Status(sct=0x0, sc=0x01, dnr)"
        );
    }

    #[test]
    fn command_specific_codes_are_named_for_their_command() {
        use CommandKind::*;
        let s = |sc| Status::new(sct::COMMAND_SPECIFIC, sc);
        // 82h: the NVM table's meaning for a Write, the Fabrics one for a Connect, none for an admin command.
        assert_eq!(s(0x82).name_in(Nvm), "Attempted Write to Read Only Range");
        assert_eq!(s(0x82).name_in(Fabrics), "Connect Invalid Parameters");
        assert_eq!(
            s(0x82).name_in(Authentication),
            "Connect Invalid Parameters"
        );
        assert_eq!(s(0x82).name_in(Admin), "Unknown Command Specific Status");
        assert_eq!(s(0x80).name_in(Fabrics), "Connect Incompatible Format");
        assert_eq!(s(0x80).name_in(Nvm), "Conflicting Attributes");
        assert_eq!(s(0x85).name_in(Fabrics), "Invalid Queue Type");
        // Below 80h the base table holds for every command.
        assert_eq!(s(0x02).name_in(Admin), "Invalid Queue Size");
        assert_eq!(s(0x09).name_in(Admin), "Invalid Log Page");
        // Fabrics-wide codes.
        for k in [Admin, Nvm, Fabrics, Authentication] {
            assert_eq!(s(0x91).name_in(k), "Authentication Required");
        }
        assert_eq!(s(0x90).name_in(Admin), "Discovery Restart");
        // Generic codes do not depend on the command.
        assert_eq!(
            Status::INVALID_FIELD.name_in(Fabrics),
            Status::INVALID_FIELD.name_in(Nvm)
        );
    }

    #[test]
    fn the_kind_of_a_command() {
        use crate::{fabrics, Sqe};
        let mut sqe = Sqe {
            opcode: fabrics::FABRICS,
            nsid: u32::from(fabrics::CONNECT),
            ..Sqe::default()
        };
        assert_eq!(CommandKind::of(&sqe, 0), CommandKind::Fabrics);
        assert_eq!(CommandKind::of(&sqe, 3), CommandKind::Fabrics);
        sqe.nsid = u32::from(fabrics::AUTH_RECV);
        assert_eq!(CommandKind::of(&sqe, 0), CommandKind::Authentication);
        sqe.opcode = 0x02;
        assert_eq!(CommandKind::of(&sqe, 0), CommandKind::Admin);
        assert_eq!(CommandKind::of(&sqe, 1), CommandKind::Nvm);
    }

    #[test]
    fn every_raw_value_has_a_name() {
        for raw in 0..=0x7fffu16 {
            for kind in [
                CommandKind::Admin,
                CommandKind::Nvm,
                CommandKind::Fabrics,
                CommandKind::Authentication,
            ] {
                assert!(!Status::from_raw(raw).name_in(kind).is_empty());
            }
        }
    }
}

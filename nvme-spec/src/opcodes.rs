//! Command opcodes and the small identifier spaces that go with them (feature IDs, CNS values, log page IDs).
//!
//! The fabrics opcode and its command types live in [`super::fabrics`].

/// Declares opcode constants, each documented with its command's name, and a `name` function from opcode to
/// name (which also knows the fabrics opcode, as it is valid on every queue).
macro_rules! opcodes {
    ($($id:ident = $val:literal, $name:literal;)*) => {
        $(
            #[doc = concat!($name, ".")]
            pub const $id: u8 = $val;
        )*

        /// The command's name, for logs; `None` for an opcode not listed here.
        pub fn name(opcode: u8) -> Option<&'static str> {
            match opcode {
                $($id => Some($name),)*
                crate::fabrics::FABRICS => Some("Fabrics"),
                _ => None,
            }
        }
    };
}

/// Admin command opcodes (NVMe Base 2.0, "Admin Command Set").
pub mod admin {
    opcodes! {
        DELETE_IO_SQ = 0x00, "Delete I/O Submission Queue";
        CREATE_IO_SQ = 0x01, "Create I/O Submission Queue";
        GET_LOG_PAGE = 0x02, "Get Log Page";
        DELETE_IO_CQ = 0x04, "Delete I/O Completion Queue";
        CREATE_IO_CQ = 0x05, "Create I/O Completion Queue";
        IDENTIFY = 0x06, "Identify";
        ABORT = 0x08, "Abort";
        SET_FEATURES = 0x09, "Set Features";
        GET_FEATURES = 0x0a, "Get Features";
        ASYNC_EVENT_REQUEST = 0x0c, "Asynchronous Event Request";
        NAMESPACE_MANAGEMENT = 0x0d, "Namespace Management";
        FIRMWARE_COMMIT = 0x10, "Firmware Commit";
        FIRMWARE_IMAGE_DOWNLOAD = 0x11, "Firmware Image Download";
        DEVICE_SELF_TEST = 0x14, "Device Self-test";
        NAMESPACE_ATTACHMENT = 0x15, "Namespace Attachment";
        KEEP_ALIVE = 0x18, "Keep Alive";
        DIRECTIVE_SEND = 0x19, "Directive Send";
        DIRECTIVE_RECEIVE = 0x1a, "Directive Receive";
        VIRTUALIZATION_MANAGEMENT = 0x1c, "Virtualization Management";
        NVME_MI_SEND = 0x1d, "NVMe-MI Send";
        NVME_MI_RECEIVE = 0x1e, "NVMe-MI Receive";
        DOORBELL_BUFFER_CONFIG = 0x7c, "Doorbell Buffer Config";
        FORMAT_NVM = 0x80, "Format NVM";
        SECURITY_SEND = 0x81, "Security Send";
        SECURITY_RECEIVE = 0x82, "Security Receive";
        SANITIZE = 0x84, "Sanitize";
        GET_LBA_STATUS = 0x86, "Get LBA Status";
    }
}

/// NVM command set I/O opcodes (NVM Command Set 1.0).
pub mod io {
    opcodes! {
        FLUSH = 0x00, "Flush";
        WRITE = 0x01, "Write";
        READ = 0x02, "Read";
        WRITE_UNCORRECTABLE = 0x04, "Write Uncorrectable";
        COMPARE = 0x05, "Compare";
        WRITE_ZEROES = 0x08, "Write Zeroes";
        DSM = 0x09, "Dataset Management";
        VERIFY = 0x0c, "Verify";
        RESERVATION_REGISTER = 0x0d, "Reservation Register";
        RESERVATION_REPORT = 0x0e, "Reservation Report";
        RESERVATION_ACQUIRE = 0x11, "Reservation Acquire";
        RESERVATION_RELEASE = 0x15, "Reservation Release";
        COPY = 0x19, "Copy";
    }
}

/// Feature identifiers for Get Features and Set Features, and the fields of their command dwords.
pub mod feature {
    /// Arbitration.
    pub const ARBITRATION: u8 = 0x01;
    /// Power Management.
    pub const POWER_MANAGEMENT: u8 = 0x02;
    /// LBA Range Type.
    pub const LBA_RANGE_TYPE: u8 = 0x03;
    /// Temperature Threshold.
    pub const TEMPERATURE_THRESHOLD: u8 = 0x04;
    /// Error Recovery (time-limited error recovery, DULBE).
    pub const ERROR_RECOVERY: u8 = 0x05;
    /// Volatile Write Cache (bit 0 of dword 11 enables it).
    pub const VOLATILE_WRITE_CACHE: u8 = 0x06;
    /// Number of Queues; see [`num_queues`] and [`num_queues_granted`].
    pub const NUMBER_OF_QUEUES: u8 = 0x07;
    /// Interrupt Coalescing.
    pub const INTERRUPT_COALESCING: u8 = 0x08;
    /// Interrupt Vector Configuration.
    pub const INTERRUPT_VECTOR_CONFIG: u8 = 0x09;
    /// Write Atomicity Normal.
    pub const WRITE_ATOMICITY: u8 = 0x0a;
    /// Asynchronous Event Configuration (which events the controller reports).
    pub const ASYNC_EVENT_CONFIG: u8 = 0x0b;
    /// Autonomous Power State Transition.
    pub const AUTONOMOUS_POWER_STATE_TRANSITION: u8 = 0x0c;
    /// Host Memory Buffer.
    pub const HOST_MEMORY_BUFFER: u8 = 0x0d;
    /// Timestamp.
    pub const TIMESTAMP: u8 = 0x0e;
    /// Keep Alive Timer (dword 11: KATO in milliseconds).
    pub const KEEP_ALIVE_TIMER: u8 = 0x0f;
    /// Host Controlled Thermal Management.
    pub const HOST_CONTROLLED_THERMAL_MGMT: u8 = 0x10;
    /// Non-Operational Power State Config.
    pub const NON_OPERATIONAL_POWER_STATE: u8 = 0x11;
    /// Host Identifier.
    pub const HOST_IDENTIFIER: u8 = 0x81;
    /// Reservation Notification Mask.
    pub const RESERVATION_NOTIFICATION_MASK: u8 = 0x82;
    /// Reservation Persistence.
    pub const RESERVATION_PERSISTENCE: u8 = 0x83;

    /// Get Features SEL (dword 10 bits 10:8): the current value.
    pub const SEL_CURRENT: u8 = 0;
    /// Get Features SEL: the default value.
    pub const SEL_DEFAULT: u8 = 1;
    /// Get Features SEL: the saved value.
    pub const SEL_SAVED: u8 = 2;
    /// Get Features SEL: the capabilities of the feature.
    pub const SEL_SUPPORTED_CAPABILITIES: u8 = 3;
    /// Set Features SV (dword 10 bit 31): save the value across resets.
    pub const SAVE: u32 = 1 << 31;

    /// Asynchronous Event Configuration: SMART / health critical warnings (bits 7:0, one per warning).
    pub const AEC_SMART_WARNINGS: u32 = 0xff;
    /// Asynchronous Event Configuration: Namespace Attribute Notices.
    pub const AEC_NS_ATTRIBUTE: u32 = 1 << 8;
    /// Asynchronous Event Configuration: Firmware Activation Notices.
    pub const AEC_FIRMWARE_ACTIVATION: u32 = 1 << 9;
    /// Asynchronous Event Configuration: Telemetry Log Notices.
    pub const AEC_TELEMETRY: u32 = 1 << 10;
    /// Asynchronous Event Configuration: Asymmetric Namespace Access Change Notices.
    pub const AEC_ANA_CHANGE: u32 = 1 << 11;
    /// Asynchronous Event Configuration: Discovery Log Page Change Notices (fabrics discovery controllers).
    pub const AEC_DISCOVERY_CHANGE: u32 = 1 << 31;

    /// Dword 11 of Set Features Number of Queues asking for `sq` submission and `cq` completion I/O queues.
    ///
    /// The counts are 1-based here; the wire fields are 0-based, so a count of 0 is sent as 1.
    pub const fn num_queues(sq: u16, cq: u16) -> u32 {
        ((cq.saturating_sub(1) as u32) << 16) | sq.saturating_sub(1) as u32
    }

    /// The `(submission, completion)` I/O queue counts a Number of Queues completion's dword 0 grants, 1-based.
    pub const fn num_queues_granted(dw0: u32) -> (u32, u32) {
        ((dw0 & 0xffff) + 1, (dw0 >> 16) + 1)
    }
}

/// Controller or Namespace Structure values for Identify (dword 10 bits 7:0).
pub mod cns {
    /// Identify Namespace data structure for the NSID.
    pub const NAMESPACE: u8 = 0x00;
    /// Identify Controller data structure.
    pub const CONTROLLER: u8 = 0x01;
    /// Active Namespace ID list (IDs greater than the NSID).
    pub const ACTIVE_NS_LIST: u8 = 0x02;
    /// Namespace Identification Descriptor list for the NSID.
    pub const NS_ID_DESCRIPTORS: u8 = 0x03;
    /// NVM Set list.
    pub const NVM_SET_LIST: u8 = 0x04;
    /// I/O Command Set specific Identify Namespace.
    pub const IO_CMD_SET_NAMESPACE: u8 = 0x05;
    /// I/O Command Set specific Identify Controller.
    pub const IO_CMD_SET_CONTROLLER: u8 = 0x06;
    /// Active Namespace ID list for an I/O command set.
    pub const IO_CMD_SET_ACTIVE_NS_LIST: u8 = 0x07;
    /// Allocated Namespace ID list.
    pub const ALLOCATED_NS_LIST: u8 = 0x10;
    /// Identify Namespace data structure for an allocated NSID.
    pub const ALLOCATED_NAMESPACE: u8 = 0x11;
    /// Controllers attached to the NSID.
    pub const NS_ATTACHED_CONTROLLERS: u8 = 0x12;
    /// Controllers in the NVM subsystem.
    pub const CONTROLLER_LIST: u8 = 0x13;
    /// I/O Command Set data structure.
    pub const IO_COMMAND_SETS: u8 = 0x1c;
}

/// Log page identifiers for Get Log Page.
pub mod log_page {
    /// Error Information.
    pub const ERROR: u8 = 0x01;
    /// SMART / Health Information; see [`crate::SmartLog`].
    pub const SMART: u8 = 0x02;
    /// Firmware Slot Information.
    pub const FIRMWARE_SLOT: u8 = 0x03;
    /// Changed Namespace List (same layout as the active namespace list).
    pub const CHANGED_NS: u8 = 0x04;
    /// Commands Supported and Effects.
    pub const COMMANDS_SUPPORTED_AND_EFFECTS: u8 = 0x05;
    /// Device Self-test.
    pub const DEVICE_SELF_TEST: u8 = 0x06;
    /// Telemetry Host-Initiated.
    pub const TELEMETRY_HOST: u8 = 0x07;
    /// Telemetry Controller-Initiated.
    pub const TELEMETRY_CONTROLLER: u8 = 0x08;
    /// Asymmetric Namespace Access.
    pub const ANA: u8 = 0x0c;
    /// Discovery (fabrics discovery controllers); see [`crate::DiscoveryLog`].
    pub const DISCOVERY: u8 = 0x70;
    /// Reservation Notification.
    pub const RESERVATION_NOTIFICATION: u8 = 0x80;
    /// Sanitize Status.
    pub const SANITIZE_STATUS: u8 = 0x81;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_queue_counts() {
        assert_eq!(admin::name(admin::KEEP_ALIVE), Some("Keep Alive"));
        assert_eq!(admin::name(0x7f), Some("Fabrics"));
        assert_eq!(io::name(io::WRITE_ZEROES), Some("Write Zeroes"));
        assert_eq!(io::name(0x42), None);
        assert_eq!(feature::num_queues(4, 8), 0x0007_0003);
        assert_eq!(feature::num_queues(0, 0), 0);
        assert_eq!(feature::num_queues_granted(0x0007_0003), (4, 8));
        assert_eq!(feature::num_queues_granted(0xffff_ffff), (0x10000, 0x10000));
    }
}

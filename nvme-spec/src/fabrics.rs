//! NVMe over Fabrics 1.1 commands: the fabrics opcode and command types, Connect (command, data and response),
//! Property Get/Set, Authentication Send/Receive and Disconnect.
//!
//! Every fabrics command has opcode [`FABRICS`] and its command type (fctype) in byte 4, the low byte of the
//! common `nsid` field. Their fields sit from byte 40 on, i.e. in `cdw10` onwards of [`Sqe`]:
//!
//! | command | bytes 40.. |
//! | --- | --- |
//! | Connect | recfmt u16 @40, qid u16 @42, sqsize u16 @44 (0-based), cattr u8 @46, kato u32 @48 (ms) |
//! | Property Set | attrib u8 @40 (size: 0 = 4 bytes, 1 = 8 bytes), offset u32 @44, value u64 @48 |
//! | Property Get | attrib u8 @40, offset u32 @44; the value returns in completion dwords 0 and 1 |
//! | Auth Send / Receive | spsp0 u8 @41, spsp1 u8 @42, secp u8 @43, transfer / allocation length u32 @44 |
//! | Disconnect | recfmt u16 @40 |
//!
//! The data pointer and the PSDT bits (fabrics commands always use SGLs) are the transport's to fill in.

use super::cmd::{Cqe, Sqe};
use super::status::{CommandKind, Status};
use super::wire::{bytes_at, need, put_bytes, put_str, put_u16, u16_at, utf8_at, Pad, ParseError};

/// The opcode of every fabrics command.
pub const FABRICS: u8 = 0x7f;
/// Fabrics command type: Property Set.
pub const PROPERTY_SET: u8 = 0x00;
/// Fabrics command type: Connect.
pub const CONNECT: u8 = 0x01;
/// Fabrics command type: Property Get.
pub const PROPERTY_GET: u8 = 0x04;
/// Fabrics command type: Authentication Send.
pub const AUTH_SEND: u8 = 0x05;
/// Fabrics command type: Authentication Receive.
pub const AUTH_RECV: u8 = 0x06;
/// Fabrics command type: Disconnect.
pub const DISCONNECT: u8 = 0x08;

/// The well-known NQN of discovery subsystems.
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";
/// The longest NQN the specification allows, in bytes (223: the Connect data's 256-byte fields end in a NUL).
pub const MAX_NQN_LEN: usize = 223;
/// The highest controller ID of the dynamic controller model (FFF0h and up are reserved).
pub const MAX_CNTLID: u16 = 0xffef;
/// Connect CATTR bit: the host asks to disable SQ flow control (SQHD is then not maintained).
pub const CATTR_DISABLE_SQFLOW: u8 = 1 << 2;
/// Connect data CNTLID asking the subsystem to pick any controller (dynamic controller model).
pub const CNTLID_DYNAMIC: u16 = 0xffff;
/// Connect data CNTLID asking for any controller under the static controller model.
pub const CNTLID_STATIC_ANY: u16 = 0xfffe;
/// Size of the Connect command's data.
pub const CONNECT_DATA_SIZE: usize = 1024;
/// Authentication security protocol (SECP) of NVMe in-band authentication (DH-HMAC-CHAP).
pub const AUTH_SECP_NVME: u8 = 0xe9;

/// The fields of a Connect command.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Connect {
    /// Record Format; 0 is the only one defined.
    pub recfmt: u16,
    /// Queue to create: 0 for the admin queue.
    pub qid: u16,
    /// Submission queue size, 0-based.
    pub sqsize: u16,
    /// Connect Attributes (see [`CATTR_DISABLE_SQFLOW`]).
    pub cattr: u8,
    /// Keep Alive Timeout in milliseconds (admin queue only; 0 disables it).
    pub kato: u32,
}

/// A fabrics command, decoded from or encoded into an [`Sqe`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FabricsCommand {
    /// Property Set.
    PropertySet {
        /// Register offset (see [`super::reg`]).
        offset: u32,
        /// Whether the property is 8 bytes wide (else 4).
        size8: bool,
        /// The value to write.
        value: u64,
    },
    /// Connect.
    Connect(Connect),
    /// Property Get.
    PropertyGet {
        /// Register offset (see [`super::reg`]).
        offset: u32,
        /// Whether the property is 8 bytes wide (else 4).
        size8: bool,
    },
    /// Authentication Send.
    AuthSend {
        /// Security Protocol ([`AUTH_SECP_NVME`]).
        secp: u8,
        /// SP Specific 0.
        spsp0: u8,
        /// SP Specific 1.
        spsp1: u8,
        /// Transfer Length in bytes.
        tl: u32,
    },
    /// Authentication Receive.
    AuthReceive {
        /// Security Protocol ([`AUTH_SECP_NVME`]).
        secp: u8,
        /// SP Specific 0.
        spsp0: u8,
        /// SP Specific 1.
        spsp1: u8,
        /// Allocation Length in bytes.
        al: u32,
    },
    /// Disconnect (of the I/O queue it is sent on).
    Disconnect,
    /// A command type this module does not know.
    Other {
        /// Fabrics command type.
        fctype: u8,
    },
}

impl FabricsCommand {
    /// The fabrics command type.
    pub fn fctype(&self) -> u8 {
        match self {
            FabricsCommand::PropertySet { .. } => PROPERTY_SET,
            FabricsCommand::Connect(_) => CONNECT,
            FabricsCommand::PropertyGet { .. } => PROPERTY_GET,
            FabricsCommand::AuthSend { .. } => AUTH_SEND,
            FabricsCommand::AuthReceive { .. } => AUTH_RECV,
            FabricsCommand::Disconnect => DISCONNECT,
            FabricsCommand::Other { fctype } => *fctype,
        }
    }

    /// Decodes the fabrics command in `sqe`; `None` if its opcode is not [`FABRICS`].
    pub fn from_sqe(sqe: &Sqe) -> Option<FabricsCommand> {
        if sqe.opcode != FABRICS {
            return None;
        }
        let size8 = sqe.cdw10 & 0x7 == 1;
        let [_, spsp0, spsp1, secp] = sqe.cdw10.to_le_bytes();
        Some(match (sqe.nsid & 0xff) as u8 {
            PROPERTY_SET => FabricsCommand::PropertySet {
                offset: sqe.cdw11,
                size8,
                value: u64::from(sqe.cdw12) | u64::from(sqe.cdw13) << 32,
            },
            CONNECT => FabricsCommand::Connect(Connect {
                recfmt: (sqe.cdw10 & 0xffff) as u16,
                qid: (sqe.cdw10 >> 16) as u16,
                sqsize: (sqe.cdw11 & 0xffff) as u16,
                cattr: ((sqe.cdw11 >> 16) & 0xff) as u8,
                kato: sqe.cdw12,
            }),
            PROPERTY_GET => FabricsCommand::PropertyGet {
                offset: sqe.cdw11,
                size8,
            },
            AUTH_SEND => FabricsCommand::AuthSend {
                secp,
                spsp0,
                spsp1,
                tl: sqe.cdw11,
            },
            AUTH_RECV => FabricsCommand::AuthReceive {
                secp,
                spsp0,
                spsp1,
                al: sqe.cdw11,
            },
            DISCONNECT => FabricsCommand::Disconnect,
            fctype => FabricsCommand::Other { fctype },
        })
    }

    /// Encodes the command into an [`Sqe`] (command identifier 0, no data pointer).
    pub fn to_sqe(&self) -> Sqe {
        let mut sqe = Sqe {
            opcode: FABRICS,
            nsid: self.fctype().into(),
            ..Default::default()
        };
        match *self {
            FabricsCommand::PropertySet {
                offset,
                size8,
                value,
            } => {
                sqe.cdw10 = size8.into();
                sqe.cdw11 = offset;
                sqe.cdw12 = (value & 0xffff_ffff) as u32;
                sqe.cdw13 = (value >> 32) as u32;
            }
            FabricsCommand::Connect(c) => {
                sqe.cdw10 = u32::from(c.recfmt) | u32::from(c.qid) << 16;
                sqe.cdw11 = u32::from(c.sqsize) | u32::from(c.cattr) << 16;
                sqe.cdw12 = c.kato;
            }
            FabricsCommand::PropertyGet { offset, size8 } => {
                sqe.cdw10 = size8.into();
                sqe.cdw11 = offset;
            }
            FabricsCommand::AuthSend {
                secp,
                spsp0,
                spsp1,
                tl: len,
            }
            | FabricsCommand::AuthReceive {
                secp,
                spsp0,
                spsp1,
                al: len,
            } => {
                sqe.cdw10 = u32::from_le_bytes([0, spsp0, spsp1, secp]);
                sqe.cdw11 = len;
            }
            FabricsCommand::Disconnect | FabricsCommand::Other { .. } => {}
        }
        sqe
    }
}

impl Sqe {
    /// A fabrics Connect for queue `qid` (0: admin) with a 0-based submission queue size, connect attributes
    /// and a keep-alive timeout in milliseconds. The 1024-byte [`ConnectData`] goes in the command's data.
    pub fn fabrics_connect(qid: u16, sqsize_zero_based: u16, cattr: u8, kato_ms: u32) -> Sqe {
        FabricsCommand::Connect(Connect {
            recfmt: 0,
            qid,
            sqsize: sqsize_zero_based,
            cattr,
            kato: kato_ms,
        })
        .to_sqe()
    }

    /// A fabrics Property Get of the register at `offset`, 8 bytes wide if `size8` (CAP, ASQ, ACQ), else 4.
    /// The value comes back in [`Cqe::property_value`].
    pub fn property_get(offset: u32, size8: bool) -> Sqe {
        FabricsCommand::PropertyGet { offset, size8 }.to_sqe()
    }

    /// A fabrics Property Set of the register at `offset` (8 bytes wide if `size8`, else 4) to `value`.
    pub fn property_set(offset: u32, size8: bool, value: u64) -> Sqe {
        FabricsCommand::PropertySet {
            offset,
            size8,
            value,
        }
        .to_sqe()
    }

    /// A fabrics Disconnect of the I/O queue it is sent on.
    pub fn fabrics_disconnect() -> Sqe {
        FabricsCommand::Disconnect.to_sqe()
    }
}

impl Cqe {
    /// The value a Property Get returned: dword 0, and dword 1 as the high half for 8-byte properties.
    pub fn property_value(&self) -> u64 {
        u64::from(self.dw0) | u64::from(self.dw1) << 32
    }

    /// Puts a Property Get's value in dwords 0 and 1.
    pub fn set_property_value(&mut self, value: u64) {
        self.dw0 = (value & 0xffff_ffff) as u32;
        self.dw1 = (value >> 32) as u32;
    }
}

/// The 1024-byte data of a Connect command.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct ConnectData {
    /// Host Identifier (bytes 15:0): the same for every connection of a host.
    pub hostid: [u8; 16],
    /// Controller ID (17:16): [`CNTLID_DYNAMIC`] on the admin queue, the admin queue's granted ID on I/O queues.
    pub cntlid: u16,
    /// NVM Subsystem NQN (511:256).
    pub subnqn: String,
    /// Host NQN (767:512).
    pub hostnqn: String,
}

impl ConnectData {
    /// Encodes the data; an NQN longer than 255 bytes is cut (NQNs are at most 223 bytes).
    pub fn to_bytes(&self) -> [u8; CONNECT_DATA_SIZE] {
        let mut b = [0u8; CONNECT_DATA_SIZE];
        put_bytes(&mut b, 0, &self.hostid);
        put_u16(&mut b, 16, self.cntlid);
        put_str(&mut b, 256, 256, &self.subnqn, Pad::Nul);
        put_str(&mut b, 512, 256, &self.hostnqn, Pad::Nul);
        b
    }

    /// Decodes the first 1024 bytes of `b`. An NQN that is not UTF-8 is an error (a target answers it with
    /// Connect Invalid Parameters, [`InvalidParameter::SUBNQN`] or [`InvalidParameter::HOSTNQN`]).
    pub fn parse(b: &[u8]) -> Result<ConnectData, ParseError> {
        const WHAT: &str = "Connect data";
        need(WHAT, b, CONNECT_DATA_SIZE)?;
        Ok(ConnectData {
            hostid: bytes_at(b, 0),
            cntlid: u16_at(b, 16),
            subnqn: utf8_at(WHAT, "SUBNQN", b, 256, 256)?,
            hostnqn: utf8_at(WHAT, "HOSTNQN", b, 512, 256)?,
        })
    }
}

/// Where the parameter a Connect was rejected for lies (Connect Invalid Parameters).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct InvalidParameter {
    /// Whether it is in the Connect data (IATTR bit 0), rather than in the command.
    pub in_data: bool,
    /// Byte offset of the parameter in the data or the command (IPO).
    pub offset: u16,
}

impl InvalidParameter {
    /// The offending subsystem NQN, in the data.
    pub const SUBNQN: InvalidParameter = InvalidParameter {
        in_data: true,
        offset: 256,
    };
    /// The offending host NQN, in the data.
    pub const HOSTNQN: InvalidParameter = InvalidParameter {
        in_data: true,
        offset: 512,
    };
    /// The offending controller ID, in the data.
    pub const CNTLID: InvalidParameter = InvalidParameter {
        in_data: true,
        offset: 16,
    };
    /// The offending queue ID, in the command.
    pub const QID: InvalidParameter = InvalidParameter {
        in_data: false,
        offset: 42,
    };
    /// The offending queue size, in the command.
    pub const SQSIZE: InvalidParameter = InvalidParameter {
        in_data: false,
        offset: 44,
    };
    /// The offending Connect attributes (CATTR, e.g. [`CATTR_DISABLE_SQFLOW`]), in the command.
    pub const CATTR: InvalidParameter = InvalidParameter {
        in_data: false,
        offset: 46,
    };

    /// The Connect field this points at, in words ("the subsystem NQN"), or `None` for an offset that
    /// starts no field this module knows.
    pub fn field(self) -> Option<&'static str> {
        Some(match self {
            InvalidParameter::SUBNQN => "the subsystem NQN",
            InvalidParameter::HOSTNQN => "the host NQN",
            InvalidParameter::CNTLID => "the controller ID",
            InvalidParameter::QID => "the queue ID",
            InvalidParameter::SQSIZE => "the queue size",
            InvalidParameter::CATTR => "the connect attributes",
            InvalidParameter {
                in_data: true,
                offset: 0,
            } => "the host identifier",
            _ => return None,
        })
    }
}

/// "the subsystem NQN (IATTR 1, IPO 256)", or "byte 300 of the Connect data (IATTR 1, IPO 300)".
impl std::fmt::Display for InvalidParameter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.field() {
            Some(name) => f.write_str(name)?,
            None => {
                let place = if self.in_data { "data" } else { "command" };
                write!(f, "byte {} of the Connect {place}", self.offset)?
            }
        }
        write!(
            f,
            " (IATTR {}, IPO {})",
            u8::from(self.in_data),
            self.offset
        )
    }
}

/// The outcome of a Connect, as its completion carries it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ConnectResponse {
    /// The queue was created.
    Accepted {
        /// Controller ID of the controller the host is now connected to (dword 0 bits 15:0).
        cntlid: u16,
        /// Authentication requirements (dword 0 bits 31:16); non-zero if the host must authenticate first.
        authreq: u16,
    },
    /// The queue was not created.
    Rejected {
        /// Why.
        status: Status,
        /// For Connect Invalid Parameters, which parameter.
        invalid: Option<InvalidParameter>,
    },
}

impl ConnectResponse {
    /// Decodes the completion of a Connect.
    pub fn from_cqe(cqe: &Cqe) -> ConnectResponse {
        let status = cqe.status();
        if status.is_success() {
            ConnectResponse::Accepted {
                cntlid: (cqe.dw0 & 0xffff) as u16,
                authreq: (cqe.dw0 >> 16) as u16,
            }
        } else {
            // Invalid Parameters always points at one; Invalid Host may (Linux nvmet and SPDK point at the
            // host NQN, others leave dword 0 zero).
            let points = status.is(Status::CONNECT_INVALID_PARAMETERS)
                || (status.is(Status::CONNECT_INVALID_HOST) && cqe.dw0 != 0);
            let invalid = points.then_some(InvalidParameter {
                in_data: (cqe.dw0 >> 16) & 1 != 0,
                offset: (cqe.dw0 & 0xffff) as u16,
            });
            ConnectResponse::Rejected { status, invalid }
        }
    }

    /// The completion's dword 0 and status for this outcome (for a target).
    pub fn to_dw0_status(&self) -> (u32, Status) {
        match *self {
            ConnectResponse::Accepted { cntlid, authreq } => (
                u32::from(cntlid) | u32::from(authreq) << 16,
                Status::SUCCESS,
            ),
            ConnectResponse::Rejected { status, invalid } => {
                let dw0 = invalid.map_or(0, |p| u32::from(p.offset) | u32::from(p.in_data) << 16);
                (dw0, status)
            }
        }
    }
}

impl std::fmt::Display for ConnectResponse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnectResponse::Accepted { cntlid, .. } => {
                write!(f, "connected to controller {cntlid}")
            }
            ConnectResponse::Rejected { status, invalid } => {
                write!(f, "{}", status.named_in(CommandKind::Fabrics))?;
                if let Some(p) = invalid {
                    write!(f, ", invalid parameter: {p}")?;
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_sqe_layout() {
        let sqe = Sqe::fabrics_connect(3, 127, CATTR_DISABLE_SQFLOW, 15_000);
        let b = sqe.to_bytes();
        assert_eq!(b[0], 0x7f);
        assert_eq!(b[4], CONNECT);
        assert_eq!(&b[40..42], &[0, 0]); // recfmt
        assert_eq!(&b[42..44], &[3, 0]); // qid
        assert_eq!(&b[44..46], &[127, 0]); // sqsize
        assert_eq!(b[46], 0x04); // cattr
        assert_eq!(&b[48..52], &15_000u32.to_le_bytes()); // kato
        let expect = Connect {
            recfmt: 0,
            qid: 3,
            sqsize: 127,
            cattr: 4,
            kato: 15_000,
        };
        assert_eq!(
            FabricsCommand::from_sqe(&sqe),
            Some(FabricsCommand::Connect(expect))
        );
    }

    #[test]
    fn property_layout() {
        let b = Sqe::property_set(0x14, false, 0x0046_0001).to_bytes();
        assert_eq!((b[0], b[4], b[40]), (0x7f, PROPERTY_SET, 0));
        assert_eq!(&b[44..48], &0x14u32.to_le_bytes());
        assert_eq!(&b[48..56], &0x0046_0001u64.to_le_bytes());
        let b = Sqe::property_get(0, true).to_bytes();
        assert_eq!((b[4], b[40]), (PROPERTY_GET, 1));
        assert_eq!(&b[44..48], &[0; 4]);
        let mut cqe = Cqe::default();
        cqe.set_property_value(0x0040_20e0_0f01_07ff);
        assert_eq!((cqe.dw0, cqe.dw1), (0x0f01_07ff, 0x0040_20e0));
        assert_eq!(cqe.property_value(), 0x0040_20e0_0f01_07ff);
    }

    #[test]
    fn every_command_round_trips() {
        let cmds = [
            FabricsCommand::PropertySet {
                offset: 0x14,
                size8: false,
                value: 0x1234_5678_9abc,
            },
            FabricsCommand::PropertyGet {
                offset: 0x00,
                size8: true,
            },
            FabricsCommand::Connect(Connect {
                recfmt: 0,
                qid: 0,
                sqsize: 31,
                cattr: 0,
                kato: 5000,
            }),
            FabricsCommand::AuthSend {
                secp: AUTH_SECP_NVME,
                spsp0: 1,
                spsp1: 2,
                tl: 300,
            },
            FabricsCommand::AuthReceive {
                secp: AUTH_SECP_NVME,
                spsp0: 1,
                spsp1: 2,
                al: 4096,
            },
            FabricsCommand::Disconnect,
            FabricsCommand::Other { fctype: 0x42 },
        ];
        for c in cmds {
            let sqe = Sqe::from_bytes(&c.to_sqe().to_bytes()).unwrap();
            assert_eq!(FabricsCommand::from_sqe(&sqe), Some(c));
        }
        let b = FabricsCommand::AuthSend {
            secp: 0xe9,
            spsp0: 1,
            spsp1: 2,
            tl: 300,
        }
        .to_sqe()
        .to_bytes();
        assert_eq!(&b[40..48], &[0, 1, 2, 0xe9, 44, 1, 0, 0]);
        assert_eq!(FabricsCommand::from_sqe(&Sqe::keep_alive()), None);
    }

    #[test]
    fn connect_data_layout() {
        let d = ConnectData {
            hostid: [0xab; 16],
            cntlid: CNTLID_DYNAMIC,
            subnqn: DISCOVERY_NQN.into(),
            hostnqn: "nqn.2014-08.org.nvmexpress:uuid:1b4e28ba-2fa1-11d2-883f-0016d3cca427".into(),
        };
        let b = d.to_bytes();
        assert_eq!(&b[..16], &[0xab; 16]);
        assert_eq!(&b[16..18], &[0xff, 0xff]);
        assert!(b[18..256].iter().all(|&x| x == 0));
        assert_eq!(&b[256..256 + DISCOVERY_NQN.len()], DISCOVERY_NQN.as_bytes());
        assert_eq!(b[256 + DISCOVERY_NQN.len()], 0);
        assert_eq!(&b[512..516], b"nqn.");
        assert_eq!(ConnectData::parse(&b), Ok(d));
        assert!(matches!(
            ConnectData::parse(&b[..1023]),
            Err(ParseError::Short { need: 1024, .. })
        ));
    }

    #[test]
    fn connect_responses() {
        let ok = Cqe {
            dw0: 0x0001_0005,
            ..Default::default()
        };
        assert_eq!(
            ConnectResponse::from_cqe(&ok),
            ConnectResponse::Accepted {
                cntlid: 5,
                authreq: 1
            }
        );
        let status = Status::CONNECT_INVALID_PARAMETERS.with_dnr();
        let bad = Cqe {
            dw0: 0x0001_0200,
            status_phase: status.raw() << 1 | 1,
            ..Default::default()
        };
        let r = ConnectResponse::from_cqe(&bad);
        assert_eq!(
            r,
            ConnectResponse::Rejected {
                status,
                invalid: Some(InvalidParameter::HOSTNQN)
            }
        );
        assert_eq!(r.to_dw0_status(), (0x0001_0200, status));
        assert_eq!(
            r.to_string(),
            "Connect Invalid Parameters (sct 0x1 sc 0x82), invalid parameter: the host NQN (IATTR 1, IPO 512)"
        );
        let sqe_param = ConnectResponse::Rejected {
            status,
            invalid: Some(InvalidParameter::QID),
        };
        let (dw0, st) = sqe_param.to_dw0_status();
        let cqe = Cqe {
            dw0,
            status_phase: st.raw() << 1,
            ..Default::default()
        };
        assert_eq!(ConnectResponse::from_cqe(&cqe), sqe_param);
        // Invalid Host: dword 0 may point at the host NQN (nvmet, SPDK, ours) or be zero.
        let mut host = Cqe {
            dw0: 0,
            status_phase: Status::CONNECT_INVALID_HOST.raw() << 1,
            ..Default::default()
        };
        assert_eq!(
            ConnectResponse::from_cqe(&host),
            ConnectResponse::Rejected {
                status: Status::CONNECT_INVALID_HOST,
                invalid: None
            }
        );
        host.dw0 = 0x0001_0200;
        assert_eq!(
            ConnectResponse::from_cqe(&host),
            ConnectResponse::Rejected {
                status: Status::CONNECT_INVALID_HOST,
                invalid: Some(InvalidParameter::HOSTNQN)
            }
        );
    }
}

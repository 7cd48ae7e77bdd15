//! NVMe data structures, as the NVMe Base 2.0, NVM Command Set 1.0 and NVMe over Fabrics 1.1 specifications
//! lay them out.
//!
//! Everything here is plain safe Rust. Wire layouts are encoded and decoded explicitly in little-endian byte
//! order, and parsing never panics on short or garbage input: it returns a [`ParseError`] instead.
//!
//! - commands: [`Sqe`] (with builders such as [`Sqe::read`] and [`Sqe::fabrics_connect`]) and [`Cqe`];
//!   opcodes and identifiers in [`admin`], [`io`], [`fabrics`], [`feature`], [`cns`] and [`log_page`];
//! - completion status: [`Status`], with names and the constants a target sends;
//! - data pointers: [`SglDescriptor`];
//! - Identify pages: [`IdentifyController`], [`IdentifyNamespace`], [`NsIdDescriptor`], [`decode_ns_list`];
//! - controller registers (fabrics properties): [`reg`] (offsets), [`Cap`], [`Vs`], [`Cc`], [`Csts`], [`Aqa`];
//! - log pages: [`SmartLog`], [`DiscoveryLog`], and [`AsyncEvent`] completions;
//! - fabrics Connect: [`ConnectData`], [`ConnectResponse`], [`fabrics::FabricsCommand`].
//!
//! # Example
//! ```
//! use nvpoll_spec::{cns, IdentifyController, Sqe, Status};
//!
//! let sqe = Sqe::identify(cns::CONTROLLER, 0);
//! assert_eq!(sqe.to_bytes()[40], 0x01);
//! // A short buffer is an error, not a panic.
//! assert!(IdentifyController::parse(&[0u8; 100]).is_err());
//! assert_eq!(Status::INVALID_FIELD.to_string(), "Invalid Field in Command (sct 0x0 sc 0x02)");
//! ```
#![forbid(unsafe_code)]
// Wire and parse code, where a silent truncation corrupts a field.
#![deny(clippy::cast_possible_truncation)]

mod cmd;
pub mod fabrics;
mod identify;
mod log;
mod opcodes;
mod regs;
mod sgl;
mod status;
mod wire;

pub use cmd::{Cqe, DsmRange, Sqe, CQE_SIZE, DSM_RANGE_SIZE, SQE_SIZE};
pub use fabrics::{ConnectData, ConnectResponse, InvalidParameter, CONNECT_DATA_SIZE};
pub use identify::{
    decode_ns_list, encode_ns_list, IdentifyController, IdentifyNamespace, LbaFormat,
    NsIdDescriptor, RawPage, IDENTIFY_SIZE, MAX_LBA_FORMATS, NS_LIST_LEN,
};
pub use log::UnknownAnaState;
pub use log::{
    AnaGroupDescriptor, AnaLog, AnaState, AsyncEvent, DiscoveryLog, DiscoveryLogEntry,
    DiscoveryLogHeader, SmartLog, ANA_GROUP_DESCRIPTOR_SIZE, ANA_LOG_HEADER_SIZE, ANA_LSP_RGO,
    DISCOVERY_RECORD_SIZE, SMART_LOG_SIZE,
};
pub use opcodes::{admin, cns, feature, io, log_page};
pub use regs::{reg, Aqa, Cap, Cc, Csts, Vs};
pub use sgl::{subtype as sgl_subtype, SglDescriptor, SglType, SGL_DESCRIPTOR_SIZE};
pub use status::{sct, CommandKind, Status, StatusIn};
pub use wire::ParseError;

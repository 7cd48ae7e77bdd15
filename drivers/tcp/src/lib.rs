//! NVMe/TCP for nvpoll: PDUs, initiator and target.
#![deny(missing_docs)]

pub mod pdu;

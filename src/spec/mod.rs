//! NVMe data structures, as the NVMe Base and NVMe over Fabrics specifications lay them out.
//!
//! Everything here is plain safe Rust. Wire layouts are encoded and decoded explicitly in little-endian byte
//! order, and parsing never panics on short or garbage input.

mod cmd;
mod status;

pub use cmd::{Cqe, Sqe, CQE_SIZE, SQE_SIZE};
pub use status::Status;

/// Identify Controller data (stub).
#[derive(Clone, Debug, Default)]
pub struct IdentifyController {}

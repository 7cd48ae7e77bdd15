//! The target's fixed numbers and well-known names, which the errors, the configuration and the subsystems
//! all name: a leaf module, so that none of them imports another for a constant.

/// The NQN of the well-known discovery subsystem, which every target serves.
pub use nvpoll::spec::fabrics::DISCOVERY_NQN;

/// The longest NQN the spec allows, in bytes (223; the field is 256 bytes with a terminating NUL).
pub use nvpoll::spec::fabrics::MAX_NQN_LEN;

/// The highest controller ID the dynamic controller model hands out (0xFFF0 and up are reserved).
pub use nvpoll::spec::fabrics::MAX_CNTLID;

/// The highest ANA group ID (Identify Controller ANAGRPMAX and NANAGRPID).
pub const ANA_GROUP_MAX: u32 = 32;

/// The highest namespace ID a subsystem hands out (Identify Controller NN).
pub const MAX_NAMESPACES: u32 = 1024;

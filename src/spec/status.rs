//! Completion status codes.

/// The 15-bit status field of a completion (without the phase tag).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Status(u16);

impl Status {
    /// Successful completion.
    pub const SUCCESS: Status = Status(0);

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
        self.0 & 0x4000 != 0
    }

    /// Whether this is a successful completion (SCT 0, SC 0).
    pub const fn is_success(self) -> bool {
        self.sct() == 0 && self.sc() == 0
    }
}

impl std::fmt::Debug for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Status(sct={:#x}, sc={:#04x})", self.sct(), self.sc())
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sct {:#x} sc {:#04x}", self.sct(), self.sc())
    }
}

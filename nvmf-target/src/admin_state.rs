//! The registers and feature values of one controller ([`AdminState`]). They live in the controller's admin
//! connection: only the admin queue reads or changes them, so they need no lock. The admin command handlers
//! ([`crate::admin`]) read and set them; the queue a connection became ([`crate::handler::Queue`]) holds them.

use nvpoll::spec::{Cc, Csts};

use crate::controller::Controller;
use crate::subsystem::Kind;

/// Over-temperature threshold default (Kelvin): 70 °C, as Identify Controller WCTEMP says.
pub(crate) const WCTEMP_K: u16 = 343;

/// The registers and feature values of one controller.
#[derive(Debug)]
pub(crate) struct AdminState {
    pub(crate) kind: Kind,
    pub(crate) cc: Cc,
    pub(crate) csts: Csts,
    pub(crate) arbitration: u32,
    pub(crate) power_management: u32,
    pub(crate) temperature_threshold: [u16; 2],
    pub(crate) error_recovery: u32,
    pub(crate) volatile_write_cache: bool,
    pub(crate) interrupt_coalescing: u32,
    pub(crate) write_atomicity: u32,
    pub(crate) async_event_config: u32,
}

impl AdminState {
    pub(crate) fn new(kind: Kind) -> AdminState {
        AdminState {
            kind,
            cc: Cc(0),
            csts: Csts(0),
            arbitration: 0,
            power_management: 0,
            temperature_threshold: [WCTEMP_K, 0],
            error_recovery: 0,
            volatile_write_cache: true,
            interrupt_coalescing: 0,
            write_atomicity: 0,
            async_event_config: 0,
        }
    }

    /// A write to CC: enable (CSTS.RDY), disable (reset), shutdown (CSTS.SHST complete).
    pub(crate) fn write_cc(&mut self, value: u32, ctrl: &Controller) {
        let old = self.cc;
        let new = Cc(value);
        self.cc = new;
        if new.en() && !old.en() {
            let io_ok = self.kind == Kind::Discovery || (new.iosqes() == 6 && new.iocqes() == 4);
            if io_ok
                && new.mps() == 0
                && new.ams() == 0
                && matches!(new.css(), Cc::CSS_NVM | Cc::CSS_ADMIN_ONLY)
            {
                self.csts.set_rdy(true);
                ctrl.set_ready(true);
            } else {
                self.csts.set_cfs(true);
            }
        }
        if !new.en() && old.en() {
            self.reset(ctrl);
        }
        if new.shn() != Cc::SHN_NONE && old.shn() == Cc::SHN_NONE {
            self.reset(ctrl);
            self.csts.set_shst(Csts::SHST_COMPLETE);
        }
        if new.shn() == Cc::SHN_NONE && old.shn() != Cc::SHN_NONE {
            self.csts.set_shst(Csts::SHST_NORMAL);
        }
    }

    /// Asynchronous Event Configuration as the host set it.
    pub(crate) fn async_event_config(&self) -> u32 {
        self.async_event_config
    }

    /// Back to the disabled state: not ready, no fatal status, CC cleared.
    pub(crate) fn reset(&mut self, ctrl: &Controller) {
        self.csts.set_rdy(false);
        self.csts.set_cfs(false);
        self.cc = Cc(0);
        ctrl.set_ready(false);
    }
}

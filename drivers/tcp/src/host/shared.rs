//! What a controller and its queue pairs (each on its own reactor) share: the connection generation, the
//! controller ID, whether the controller is lost or given up, the Aborts queue pairs ask for, counters (all
//! atomics), and the ANA states (behind a mutex, taken when they change).

use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};

use crossbeam_queue::ArrayQueue;

use super::ana::SharedAna;
use super::options::ConnectOptions;
use crate::{Error, KeyRenewal, RenewBy};

/// Why a controller's commands fail once it is given up: it did not reconnect within `ctrl_loss_tmo`.
pub(super) const GIVEN_UP: Error = Error::Lost("controller given up: ctrl-loss-tmo expired");

/// What a controller and its queue pairs (on other reactors) share: the connection generation, and requests
/// from the queue pairs to the admin queue. Atomics and a lock-free queue, except the ANA view
/// ([`SharedAna`]), which is read under its mutex only when its generation moved.
#[derive(Debug)]
pub(super) struct CtrlShared {
    /// Bumped after every successful (re)connect of the admin queue; queue pairs reconnect when it moves.
    pub(super) generation: AtomicU64,
    /// The controller ID of the current generation.
    pub(super) cntlid: AtomicU16,
    /// `ctrl_loss_tmo` expired: no more reconnects.
    pub(super) dead: AtomicBool,
    /// A queue pair lost its connection: the controller must be reset (reconnected).
    pub(super) reset_requested: AtomicBool,
    /// The admin connection is lost (until the next reconnect): the queue pairs drop their connections too,
    /// at once, instead of waiting for their own sockets to fail (a blackholed path never tells them).
    pub(super) admin_lost: AtomicBool,
    /// Aborts requested by queue pairs: (SQID, CID).
    pub(super) aborts: ArrayQueue<(u16, u16)>,
    /// Counters.
    pub(super) reconnects: AtomicU64,
    pub(super) aborts_sent: AtomicU64,
    /// What the controller reports of ANA, and what queue pairs learn of it from path statuses.
    pub(super) ana: SharedAna,
    /// The target ended a connection at our TLS KeyUpdate: every queue renews its keys by reconnecting.
    pub(super) rekey_by_reconnect: AtomicBool,
}

impl CtrlShared {
    pub(super) fn new(cntlid: u16) -> CtrlShared {
        CtrlShared {
            generation: AtomicU64::new(1),
            cntlid: AtomicU16::new(cntlid),
            dead: AtomicBool::new(false),
            reset_requested: AtomicBool::new(false),
            admin_lost: AtomicBool::new(false),
            aborts: ArrayQueue::new(1024),
            reconnects: AtomicU64::new(0),
            aborts_sent: AtomicU64::new(0),
            ana: SharedAna::default(),
            rekey_by_reconnect: AtomicBool::new(false),
        }
    }

    /// How a new connection of this controller renews its TLS keys: as configured, or by reconnecting once
    /// the target turned out not to take a KeyUpdate.
    pub(super) fn key_renewal(&self, configured: KeyRenewal) -> KeyRenewal {
        if self.rekey_by_reconnect.load(Ordering::Acquire) {
            KeyRenewal {
                method: RenewBy::Reconnect,
                ..configured
            }
        } else {
            configured
        }
    }

    /// A connection of this controller failed with `cause`: if the target ended it at our KeyUpdate, its
    /// queues renew by reconnecting from now on, and the log says so once per controller.
    pub(super) fn note_loss(&self, cause: &Error, opts: &ConnectOptions) {
        let mut e = cause;
        while let Error::QueueFailed { cause, .. } = e {
            e = cause;
        }
        if matches!(e, Error::KeyUpdateRefused { .. })
            && !self.rekey_by_reconnect.swap(true, Ordering::AcqRel)
        {
            log::warn!(
                "{} {}: {e}; this controller's queues renew their TLS keys by reconnecting every {} records \
                 from now on",
                opts.addr,
                opts.subnqn,
                opts.tls_key_renewal.records
            );
        }
    }
}

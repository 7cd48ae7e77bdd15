//! What a controller shares with its queue pairs, which live on other threads: the reset epoch, the
//! controller's state, the reset request flag, and the memory of dropped queue pairs.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Mutex;

use nvpoll::mem::{DmaBuf, DmaPool};

use crate::ring::Failure;

/// Why the controller's epoch last changed: what its queue pairs make of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum CtrlState {
    /// Working, or being reset (the epoch says which).
    Running = 0,
    /// The device is gone, or the kernel wanted it back: it was released.
    Removed = 1,
    /// The controller was shut down.
    Detached = 2,
    /// The controller could not be brought back by a reset.
    Failed = 3,
}

impl CtrlState {
    /// What a queue pair fails its commands with in this state (`None`: it goes on).
    pub(crate) fn failure(self) -> Option<Failure> {
        match self {
            CtrlState::Running => None,
            CtrlState::Removed => Some(Failure::Removed),
            CtrlState::Detached => Some(Failure::Detached),
            CtrlState::Failed => Some(Failure::Lost),
        }
    }
}

/// A [`CtrlState`] shared between threads.
pub(crate) struct AtomicCtrlState(AtomicU8);

impl AtomicCtrlState {
    pub(crate) fn new(state: CtrlState) -> Self {
        AtomicCtrlState(AtomicU8::new(state as u8))
    }

    /// The state, with acquire ordering.
    pub(crate) fn load(&self) -> CtrlState {
        match self.0.load(Ordering::Acquire) {
            0 => CtrlState::Running,
            1 => CtrlState::Removed,
            2 => CtrlState::Detached,
            _ => CtrlState::Failed,
        }
    }

    pub(crate) fn store(&self, state: CtrlState) {
        self.0.store(state as u8, Ordering::Release);
    }
}

/// A queue pair's memory, handed back to the controller when the queue pair is dropped.
pub(crate) struct Retired {
    pub qid: u16,
    pub epoch: u64,
    pub pool: DmaPool,
    /// Buffers of commands that were still outstanding.
    pub held: Vec<DmaBuf>,
}

/// What the controller shares with its queue pairs (which live on other threads).
pub(crate) struct Shared {
    /// Bumped (while the admin queue is held) when a reset begins, and by removal, loss and shutdown: a
    /// queue pair whose queues belong to an older epoch stops touching them.
    pub epoch: AtomicU64,
    /// The epoch whose reset has completed (the controller is enabled and identified again): queue pairs
    /// may re-create their queues once `ready == epoch`.
    pub ready: AtomicU64,
    /// Why the epoch last changed.
    pub state: AtomicCtrlState,
    /// Set by a queue pair whose commands timed out.
    pub reset_requested: AtomicBool,
    /// Queue pairs dropped since the controller last looked.
    pub retired: Mutex<Vec<Retired>>,
}

//! Asymmetric Namespace Access: [`AnaView`], a path's ANA states as the host knows them; `SharedAna`, the
//! part of `CtrlShared` that hands them from the controller, which reads the ANA log (`super::controller`),
//! to its queue pairs, which note the path statuses their commands fail with (`super::qpair`); and the read
//! of the ANA log page (the command, its buffer, the parsing).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use nvpoll::mem::{DmaBuf, DmaPool};
use nvpoll::spec::{self, AnaState, Sqe};

use crate::Error;

/// A path's ANA states as the host knows them: the group of each namespace (from Identify Namespace) and each
/// group's state (from the ANA log, or from a command's path status since). Without ANA reporting every
/// namespace is optimized.
///
/// # Examples
///
/// ```
/// use nvpoll::spec::AnaState;
/// use nvpoll_tcp::host::AnaView;
///
/// let view = AnaView {
///     reported: true,
///     groups: vec![(1, 10), (2, 20)],
///     states: vec![(10, AnaState::Optimized), (20, AnaState::Inaccessible)],
/// };
/// assert_eq!(view.state_of(2), AnaState::Inaccessible);
/// assert_eq!(view.state_of(9), AnaState::Optimized, "a namespace no group lists");
/// assert_eq!(AnaView::default().state_of(2), AnaState::Optimized, "without ANA reporting");
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AnaView {
    /// Whether the controller reports ANA (CMIC bit 3).
    pub reported: bool,
    /// (NSID, ANA group ID) of each active namespace.
    pub groups: Vec<(u32, u32)>,
    /// (ANA group ID, state) as last read or learnt.
    pub states: Vec<(u32, AnaState)>,
}

impl AnaView {
    /// The state of the group of namespace `nsid` on this path: optimized without ANA reporting, or for a
    /// group the log did not list. See [`AnaView`]'s example.
    pub fn state_of(&self, nsid: u32) -> AnaState {
        if !self.reported {
            return AnaState::Optimized;
        }
        let Some(&(_, group)) = self.groups.iter().find(|(n, _)| *n == nsid) else {
            return AnaState::Optimized;
        };
        self.states
            .iter()
            .find(|(g, _)| *g == group)
            .map_or(AnaState::Optimized, |&(_, st)| st)
    }

    fn set(&mut self, group: u32, state: AnaState) {
        match self.states.iter_mut().find(|(g, _)| *g == group) {
            Some(e) => e.1 = state,
            None => self.states.push((group, state)),
        }
    }
}

/// A controller's ANA states as it shares them with its queue pairs (in `CtrlShared`).
#[derive(Debug, Default)]
pub(super) struct SharedAna {
    /// What the controller reports of ANA: the group of each namespace and each group's state on this path.
    pub(super) view: Mutex<AnaView>,
    /// Moves whenever `view` changes; queue pairs compare it with their copy's once per poll.
    pub(super) gen: AtomicU64,
    /// A queue pair saw a path status: read the ANA log again now.
    pub(super) stale: AtomicBool,
    /// Path statuses noted so far
    /// ([`TcpQueuePair::note_path_status`](super::TcpQueuePair::note_path_status)): an ANA log read sent
    /// before the last one may describe the path as it was before that status, and must not undo it.
    pub(super) noted: AtomicU64,
}

impl SharedAna {
    /// Takes the states the controller read (moving `gen` if they changed).
    pub(super) fn set(&self, view: AnaView) {
        let mut a = self.view.lock().unwrap_or_else(|e| e.into_inner());
        if *a != view {
            *a = view;
            self.gen.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// A copy of the states.
    pub(super) fn snapshot(&self) -> AnaView {
        self.view.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// A queue pair's command on namespace `nsid` failed with a path status that names `state`: its group
    /// takes that state on every queue pair at once, and the controller reads the ANA log again.
    pub(super) fn note(&self, nsid: u32, state: AnaState) {
        {
            let mut a = self.view.lock().unwrap_or_else(|e| e.into_inner());
            self.noted.fetch_add(1, Ordering::AcqRel);
            if let Some(&(_, group)) = a.groups.iter().find(|(n, _)| *n == nsid) {
                if a.state_of(nsid) != state {
                    a.set(group, state);
                    self.gen.fetch_add(1, Ordering::AcqRel);
                }
            }
        }
        self.stale.store(true, Ordering::Release);
    }
}

/// Get Log Page for the ANA log, groups only (RGO): the namespaces' groups come from Identify Namespace.
pub(super) fn ana_log_sqe() -> Sqe {
    let mut sqe = Sqe::get_log_page(spec::log_page::ANA, 0, 4096, 0);
    sqe.cdw10 |= u32::from(spec::ANA_LSP_RGO) << 8;
    sqe
}

pub(super) fn alloc_page(pool: &DmaPool) -> Result<DmaBuf, Error> {
    let mut buf = pool
        .alloc(4096)
        .map_err(|e| Error::InvalidArgument(e.to_string()))?;
    buf.set_len(4096)
        .map_err(|e| Error::InvalidArgument(e.to_string()))?;
    Ok(buf)
}

/// The group states of an ANA log page.
pub(super) fn parse_ana_states(page: &[u8]) -> Result<Vec<(u32, AnaState)>, Error> {
    let log = spec::AnaLog::parse(page).map_err(|e| Error::Protocol(e.to_string()))?;
    Ok(log.groups.iter().map(|g| (g.grpid, g.state)).collect())
}

//! Asymmetric Namespace Access: [`AnaView`], a path's ANA states as the host knows them, and the read of the
//! ANA log page (the command, its buffer, the parsing). The controller reads the log (`super::controller`),
//! `CtrlShared` (`super::shared`) hands the states to the queue pairs, and a queue pair notes the path
//! statuses its commands fail with (`super::qpair`).

use nvpoll::mem::{DmaBuf, DmaPool};
use nvpoll::spec::{self, AnaState, Sqe};

use crate::Error;

/// A path's ANA states as the host knows them: the group of each namespace (from Identify Namespace) and each
/// group's state (from the ANA log, or from a command's path status since). Without ANA reporting every
/// namespace is optimized.
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
    /// group the log did not list.
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

    pub(super) fn set(&mut self, group: u32, state: AnaState) {
        match self.states.iter_mut().find(|(g, _)| *g == group) {
            Some(e) => e.1 = state,
            None => self.states.push((group, state)),
        }
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

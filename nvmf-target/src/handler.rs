//! What the command handlers ([`crate::admin`], [`crate::io`]) share with the connection that runs them
//! ([`crate::session`]): the queue a connection became, the context a handler sees, what it decides, and the
//! per-connection counters. The handlers and the session both depend on this module; it depends on neither.

use std::net::SocketAddr;
use std::sync::Arc;

use nvpoll::spec::{fabrics, Status};

use crate::admin_state::AdminState;
use crate::controller::Controller;
use crate::shared::{Listener, TargetShared};
use crate::store::FlushTicket;
use crate::subsystem::{AnaView, Namespace, NsTable, Subsystem};

/// What a handler decided for a command.
#[derive(Debug)]
pub(crate) enum Reply {
    /// Complete now.
    Complete {
        /// Completion status.
        status: Status,
        /// Command specific dword 0.
        dw0: u32,
        /// Command specific dword 1.
        dw1: u32,
    },
    /// Send this data to the host (padded or cut to the command's transfer length), then complete successfully.
    Data(Vec<u8>),
    /// Send `len` bytes read from the namespace at byte offset `off`, then complete.
    Read {
        /// The namespace.
        ns: Arc<Namespace>,
        /// Byte offset.
        off: u64,
        /// Byte count.
        len: u32,
    },
    /// Keep the command outstanding without completing it (Asynchronous Event Request).
    Hold,
    /// Complete with `status` once these flushes are done.
    Flush(Vec<(Arc<Namespace>, FlushTicket)>),
    /// Complete successfully, then close the connection (Disconnect).
    CompleteAndClose,
}

impl Reply {
    /// Completes with `status` and zero result dwords.
    pub fn status(status: Status) -> Reply {
        Reply::Complete {
            status,
            dw0: 0,
            dw1: 0,
        }
    }

    /// Completes successfully with result dword 0.
    pub fn ok(dw0: u32) -> Reply {
        Reply::Complete {
            status: Status::SUCCESS,
            dw0,
            dw1: 0,
        }
    }
}

/// The queue a connection became with Fabrics Connect.
#[derive(Debug)]
pub(crate) struct Queue {
    pub qid: u16,
    /// Submission queue size, 0-based.
    pub sqsize: u16,
    /// Submission queue head, as reported in completions.
    pub sqhd: u16,
    /// The host disabled SQ flow control: SQHD is not reported, and a read may complete with C2HData SUCCESS.
    pub sqflow_disabled: bool,
    pub subsys: Arc<Subsystem>,
    pub ctrl: Arc<Controller>,
    /// The registers and features, on the admin queue only.
    pub admin: Option<AdminState>,
    /// The subsystem's namespaces as this queue sees them, refreshed when the subsystem's generation moves.
    ns: Arc<NsTable>,
    ns_gen: u64,
    /// The ANA states of the controller's path as this queue saw them last, refreshed when the subsystem's
    /// ANA change count moves.
    ana: AnaView,
    ana_gen: u64,
}

impl Queue {
    pub fn new(
        qid: u16,
        sqsize: u16,
        cattr: u8,
        subsys: Arc<Subsystem>,
        ctrl: Arc<Controller>,
    ) -> Queue {
        let admin = (qid == 0).then(|| AdminState::new(subsys.kind));
        let sqflow_disabled = cattr & fabrics::CATTR_DISABLE_SQFLOW != 0;
        let (ns, ns_gen) = subsys.ns_table();
        let (ana, ana_gen) = subsys.ana_view(ctrl.listener);
        Queue {
            qid,
            sqsize,
            sqhd: 0,
            sqflow_disabled,
            subsys,
            ctrl,
            admin,
            ns,
            ns_gen,
            ana,
            ana_gen,
        }
    }

    /// The status a command on `ns` gets on this queue's path because of its ANA group's state; `None` when
    /// it may run.
    #[inline]
    pub fn ana_refusal(&self, ns: &Namespace) -> Option<Status> {
        self.ana.refusal(ns.anagrpid)
    }

    /// The active namespace `nsid` (no lock: the queue's copy of the table).
    pub fn namespace(&self, nsid: u32) -> Option<&Arc<Namespace>> {
        self.ns.get(nsid)
    }

    /// Every active namespace.
    pub fn namespaces(&self) -> impl Iterator<Item = &Arc<Namespace>> {
        self.ns.iter()
    }

    /// Takes the subsystem's namespace table if it changed (one atomic load when it did not).
    /// Also takes the path's ANA states if they changed.
    pub fn refresh_namespaces(&mut self) {
        if self.subsys.ns_gen() != self.ns_gen {
            (self.ns, self.ns_gen) = self.subsys.ns_table();
        }
        if self.subsys.ana_gen() != self.ana_gen {
            (self.ana, self.ana_gen) = self.subsys.ana_view(self.ctrl.listener);
        }
    }

    /// The largest transfer of one command.
    pub fn max_transfer(&self) -> u32 {
        self.subsys.limits.max_transfer()
    }

    /// Most commands outstanding at once.
    pub fn depth(&self) -> usize {
        usize::from(self.sqsize) + 1
    }
}

/// What a command handler sees besides the command.
pub(crate) struct Ctx<'a> {
    pub target: &'a TargetShared,
    pub queue: &'a mut Queue,
    /// The local address the host reached us on (for the discovery log).
    pub local: SocketAddr,
    /// The listener the host came through.
    pub listener: &'a Listener,
    /// Bytes the command's data pointer describes.
    pub xfer_len: u32,
    /// Number of Asynchronous Event Requests held on this queue.
    pub held_aers: usize,
}

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

/// A namespace as one queue holds it. A command in flight keeps its namespace alive through a clone of this,
/// which counts in the queue's own reference count: cloning the shared `Arc<Namespace>` for every command
/// made every reactor write the namespace's count (one cache line) twice per I/O.
#[derive(Clone, Debug)]
pub(crate) struct NsRef(Arc<Held>);

/// The queue's own reference count sits beside the shared one it holds.
#[derive(Debug)]
struct Held(Arc<Namespace>);

impl std::ops::Deref for NsRef {
    type Target = Namespace;

    fn deref(&self) -> &Namespace {
        &self.0 .0
    }
}

/// This queue's references to the namespaces of one table of its subsystem, by NSID - 1.
fn queue_refs(table: &NsTable) -> Vec<Option<NsRef>> {
    let mut refs = Vec::new();
    for ns in table.iter() {
        let index = ns.nsid as usize - 1;
        if refs.len() <= index {
            refs.resize(index + 1, None);
        }
        refs[index] = Some(NsRef(Arc::new(Held(Arc::clone(ns)))));
    }
    refs
}

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
        ns: NsRef,
        /// Byte offset.
        off: u64,
        /// Byte count.
        len: u32,
    },
    /// Keep the command outstanding without completing it (Asynchronous Event Request).
    Hold,
    /// Complete with `status` once these flushes are done.
    Flush(Vec<(NsRef, FlushTicket)>),
    /// Complete successfully, then close the connection (Disconnect).
    CompleteAndClose,
}

impl Reply {
    /// Completes with `status` and zero result dwords.
    pub(crate) fn status(status: Status) -> Reply {
        Reply::Complete {
            status,
            dw0: 0,
            dw1: 0,
        }
    }

    /// Completes successfully with result dword 0.
    pub(crate) fn ok(dw0: u32) -> Reply {
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
    ns: Vec<Option<NsRef>>,
    ns_gen: u64,
    /// The ANA states of the controller's path as this queue saw them last, refreshed when the subsystem's
    /// ANA change count moves.
    ana: AnaView,
    ana_gen: u64,
    /// In-band authentication, for a host with DH-HMAC-CHAP keys on the subsystem: until it succeeds only
    /// Authentication Send and Receive run.
    pub auth: Option<Box<nvpoll_wire::dhchap::controller::ControllerAuth>>,
    /// When the host's next authentication message must have come.
    pub auth_deadline: Option<std::time::Instant>,
    /// The time a host has for each step of a DH-HMAC-CHAP transaction: twice the controller's keep-alive
    /// timeout, and at least the target's `auth_step_timeout`.
    pub auth_step: std::time::Duration,
}

impl Queue {
    pub(crate) fn new(
        qid: u16,
        sqsize: u16,
        cattr: u8,
        subsys: Arc<Subsystem>,
        ctrl: Arc<Controller>,
        auth_step_timeout: std::time::Duration,
    ) -> Queue {
        let admin = (qid == 0).then(|| AdminState::new(subsys.kind));
        let sqflow_disabled = cattr & fabrics::CATTR_DISABLE_SQFLOW != 0;
        let (table, ns_gen) = subsys.ns_table();
        let ns = queue_refs(&table);
        let (ana, ana_gen) = subsys.ana_view(ctrl.listener);
        let auth = subsys.dhchap_policy(&ctrl.hostnqn).map(|p| {
            Box::new(nvpoll_wire::dhchap::controller::ControllerAuth::new(
                &ctrl.hostnqn,
                &subsys.nqn,
                p,
            ))
        });
        let auth_step =
            std::time::Duration::from_millis(2 * u64::from(ctrl.kato_ms())).max(auth_step_timeout);
        let auth_deadline = auth.as_ref().map(|_| std::time::Instant::now() + auth_step);
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
            auth,
            auth_deadline,
            auth_step,
        }
    }

    /// Whether commands other than authentication may run.
    #[inline]
    pub(crate) fn authenticated(&self) -> bool {
        self.auth.as_ref().is_none_or(|a| a.authenticated())
    }

    /// The status a command on `ns` gets on this queue's path because of its ANA group's state; `None` when
    /// it may run.
    #[inline]
    pub(crate) fn ana_refusal(&self, ns: &Namespace) -> Option<Status> {
        self.ana.refusal(ns.anagrpid)
    }

    /// The status a command of this queue's host gets on `ns` because of a reservation (`write`: the write
    /// command group); `None` when it may run. One atomic load while no reservation is held.
    #[inline]
    pub(crate) fn resv_refusal(&self, ns: &Namespace, write: bool) -> Option<Status> {
        ns.resv.access(&self.ctrl.hostid, write)
    }

    /// The active namespace `nsid` (no lock: the queue's copy of the table).
    pub(crate) fn namespace(&self, nsid: u32) -> Option<&NsRef> {
        let index = nsid.checked_sub(1)? as usize;
        self.ns.get(index)?.as_ref()
    }

    /// Every active namespace, by ascending ID.
    pub(crate) fn namespaces(&self) -> impl Iterator<Item = &NsRef> {
        self.ns.iter().flatten()
    }

    /// Takes the subsystem's namespace table if it changed (one atomic load when it did not).
    /// Also takes the path's ANA states if they changed.
    pub(crate) fn refresh_namespaces(&mut self) {
        if self.subsys.ns_gen() != self.ns_gen {
            let (table, gen) = self.subsys.ns_table();
            (self.ns, self.ns_gen) = (queue_refs(&table), gen);
        }
        if self.subsys.ana_gen() != self.ana_gen {
            (self.ana, self.ana_gen) = self.subsys.ana_view(self.ctrl.listener);
        }
    }

    /// The largest transfer of one command.
    pub(crate) fn max_transfer(&self) -> u32 {
        self.subsys.limits.max_transfer()
    }

    /// Most commands outstanding at once.
    pub(crate) fn depth(&self) -> usize {
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

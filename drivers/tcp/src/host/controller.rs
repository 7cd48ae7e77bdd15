//! [`TcpController`], an attached controller: its admin queue (keep-alive, the Aborts queue pairs ask for, the
//! ANA log), reconnects after a loss (each attempt on a thread of its own), I/O queue pairs, re-authentication,
//! shutdown, and [`nvpoll::api::Controller`].

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvpoll::api::ControllerInfo;
use nvpoll::mem::{DmaBuf, DmaPool};
use nvpoll::spec::{self, CommandKind, Cqe, Sqe};

use super::ana::{alloc_page, ana_log_sqe, parse_ana_states, AnaView};
use super::auth::{authenticate, AUTHREQ_ATR};
use super::bringup::{bring_up, property_get, property_set, Attached};
use super::connect::{Background, QueueLink};
use super::options::ConnectOptions;
use super::qpair::TcpQueuePair;
use super::shared::{CtrlShared, GIVEN_UP};
use crate::queue::{DataDir, HostQueue};
use crate::Error;

/// An attached NVMe/TCP controller.
///
/// # Examples
///
/// Attach to a target (ours, started in the hidden lines, which require TLS), look at the controller, and
/// write and read a block through a queue pair:
///
/// ```
/// # mod target { include!("../doctest/target.rs"); }
/// use nvpoll::api::{Controller, IoOp, IoRequest, QueuePair};
/// use nvpoll::mem::DmaPool;
/// use nvpoll_tcp::host::{ConnectOptions, TcpController};
/// use nvpoll_tcp::tls::{ConfiguredKey, IdentityVersion};
///
/// let key = ConfiguredKey::parse("NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:")?;
/// # let keys = [(target::HOSTNQN.to_string(), key.clone())];
/// # let t = target::start_with(|mut c| {
/// #     c.tls = Some(nvpoll_target::TargetTls::with_host_keys(true, &keys, &[target::SUBNQN.to_string()]));
/// #     c
/// # })?;
/// let pool = DmaPool::builder().class(4096, 64).build()?;
/// let opts = ConnectOptions::new(t.addr, target::SUBNQN, target::HOSTNQN).with_tls_key(&key, IdentityVersion::V1);
/// let mut ctrl = TcpController::connect(opts, pool.clone())?;
/// assert!(ctrl.is_live());
/// assert!(ctrl.io_queues_allowed() >= 1);
/// println!("controller {} (NVMe {:?}), CAP {:?}, CQT {:?}", ctrl.cntlid(), ctrl.vs(), ctrl.cap(), ctrl.cqt());
/// assert_eq!(ctrl.options().subnqn, target::SUBNQN);
/// assert!(!ctrl.ana().reported || ctrl.ana().groups.len() == ctrl.namespaces().len());
/// let ns = ctrl.namespace(1).ok_or("no namespace 1")?.clone();
///
/// let mut qp = ctrl.connect_io_queue(32)?; // as Controller::create_queue_pair
/// let mut data = ctrl.pool().alloc(4096)?;
/// data.fill(0x42);
/// let blocks = 4096 / ns.block_size;
/// qp.submit(IoRequest { op: IoOp::Write, nsid: 1, lba: 0, blocks, buf: Some(data), tag: 1 })
///     .map_err(|r| r.error)?;
/// qp.flush()?;
/// while qp.outstanding() > 0 {
///     qp.process_completions(16, |_, c| assert!(c.result.is_ok(), "{:?}", c.result))?;
///     ctrl.poll_admin()?; // keep-alive, reconnects: a few times a second
/// }
/// qp.submit(IoRequest { op: IoOp::Read, nsid: 1, lba: 0, blocks, buf: Some(pool.alloc(4096)?), tag: 2 })
///     .map_err(|r| r.error)?;
/// qp.flush()?;
/// let mut read = None;
/// while read.is_none() {
///     qp.process_completions(16, |_, c| read = Some(c))?;
/// }
/// let read = read.ok_or("no completion")?;
/// read.result?;
/// assert!(read.buf.ok_or("no buffer")?.iter().all(|&b| b == 0x42));
///
/// assert_eq!((ctrl.reconnects(), ctrl.aborts_sent()), (0, 0));
/// drop(qp);
/// ctrl.shutdown()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct TcpController {
    opts: ConnectOptions,
    /// The admin queue and what bring-up learnt, replaced whole on every reconnect.
    att: Attached,
    pool: DmaPool,
    next_qid: u16,
    last_keep_alive: Instant,
    keep_alive_outstanding: bool,
    shared: Arc<CtrlShared>,
    state: CtrlState,
    /// A reconnect running on its own thread (so that no reactor waits on a connect), if any.
    connecting: Option<Background<Attached>>,
    /// A read of the ANA log is outstanding on the admin queue.
    ana_outstanding: bool,
    /// `SharedAna::noted` when that read was sent: a path status noted since is newer than what the
    /// read returns, which is then dropped (and read again).
    ana_noted_at_read: u64,
    /// When the ANA log was last asked for.
    last_ana: Instant,
}

/// Tag of Keep Alive commands on the admin queue.
const KEEP_ALIVE_TAG: u64 = u64::MAX - 1;
/// Tag of Abort commands on the admin queue.
const ABORT_TAG: u64 = u64::MAX - 2;
/// Tag of the ANA log reads on the admin queue.
const ANA_TAG: u64 = u64::MAX - 3;

/// Where the controller's admin connection stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CtrlState {
    Live,
    /// Lost at `since`; the next attempt is due at `next`.
    Reconnecting {
        since: Instant,
        next: Instant,
    },
    /// `ctrl_loss_tmo` expired.
    Dead,
}

impl TcpController {
    /// Connects the admin queue and brings the controller up: ICReq, Fabrics Connect, CAP/VS, CC.EN and
    /// CSTS.RDY, Identify Controller, Number of Queues, and Identify of every active namespace.
    ///
    /// # Examples
    ///
    /// Nothing listening: the connect fails, and says so.
    ///
    /// ```
    /// use std::time::Duration;
    /// use nvpoll::mem::DmaPool;
    /// use nvpoll_tcp::host::{ConnectOptions, TcpController};
    ///
    /// let pool = DmaPool::builder().class(4096, 16).build()?;
    /// let free = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?; // closed again at once
    /// let mut opts = ConnectOptions::new(free, "nqn.2024-01.io.example:sub", "nqn.2024-01.io.example:host");
    /// opts.timeout = Duration::from_secs(1);
    /// let err = TcpController::connect(opts, pool).unwrap_err();
    /// println!("{err}");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// A successful one is [`TcpController`]'s example.
    pub fn connect(mut opts: ConnectOptions, pool: DmaPool) -> Result<TcpController, Error> {
        let a = bring_up(&opts, &pool)?;
        if a.generated_tls.is_some() {
            // I/O queues connect with the generated PSK (a reconnect generates a new one).
            opts.tls.clone_from(&a.generated_tls);
        }
        let shared = Arc::new(CtrlShared::new(a.cntlid));
        shared.ana.set(a.ana.clone());
        Ok(TcpController {
            att: a,
            pool,
            next_qid: 1,
            last_keep_alive: Instant::now(),
            keep_alive_outstanding: false,
            opts,
            shared,
            state: CtrlState::Live,
            connecting: None,
            ana_outstanding: false,
            ana_noted_at_read: 0,
            last_ana: Instant::now(),
        })
    }

    /// Controller ID assigned by the target.
    /// See [`TcpController`]'s example.
    pub fn cntlid(&self) -> u16 {
        self.att.cntlid
    }

    /// The Capabilities register.
    /// See [`TcpController`]'s example.
    pub fn cap(&self) -> spec::Cap {
        self.att.cap
    }

    /// The Version register.
    /// See [`TcpController`]'s example.
    pub fn vs(&self) -> spec::Vs {
        self.att.vs
    }

    /// How many I/O queues the controller granted.
    /// See [`TcpController`]'s example.
    pub fn io_queues_allowed(&self) -> u16 {
        self.att.io_queues_allowed
    }

    /// The DMA pool that buffers for this controller come from.
    /// See [`TcpController`]'s example.
    pub fn pool(&self) -> &DmaPool {
        &self.pool
    }

    /// Services the admin queue; call it from a timed poller (or any loop) several times per KATO. It sends
    /// Keep Alive every KATO/2, sends the Aborts that queue pairs request for timed-out commands, and notices a
    /// lost controller: the admin connection failing, a Keep Alive unanswered for a whole KATO (a target that
    /// stopped answering), or a queue pair that lost its connection. It then reconnects with bounded back-off
    /// (`reconnect_delay`, for up to `ctrl_loss_tmo`); each attempt runs on a thread of its own, so this call
    /// never waits on the network; queue pairs follow on their own reactors. With ANA reporting it reads the
    /// ANA log every `ana_refresh` and whenever a queue pair saw a path status. Returns an error only once the
    /// controller is given up.
    /// See [`TcpController`]'s example.
    pub fn poll_admin(&mut self) -> Result<(), Error> {
        match self.state {
            CtrlState::Dead => return Err(GIVEN_UP),
            CtrlState::Reconnecting { since, next } => {
                if self.connecting.is_some() || Instant::now() >= next {
                    self.try_reconnect(since);
                }
                return Ok(());
            }
            CtrlState::Live => {}
        }
        if let Err(e) = self.service_admin() {
            self.lose(&e);
        }
        Ok(())
    }

    fn service_admin(&mut self) -> Result<(), Error> {
        if self.shared.reset_requested.swap(false, Ordering::AcqRel) {
            return Err(Error::Lost("an I/O queue lost its connection"));
        }
        self.att.admin.poll()?;
        self.att.admin.renew_keys_if_due(Instant::now())?;
        while let Some(d) = self.att.admin.pop_done() {
            if d.tag == KEEP_ALIVE_TAG {
                self.keep_alive_outstanding = false;
                let cqe = d.result?;
                HostQueue::check("Keep Alive", CommandKind::Admin, &cqe)?;
            } else if d.tag == ANA_TAG {
                self.ana_outstanding = false;
                let cqe = d.result?;
                HostQueue::check("Get Log Page (ANA)", CommandKind::Admin, &cqe)?;
                let buf = d.buf.expect("Get Log Page hands its buffer back");
                let states = parse_ana_states(buf.as_slice())?;
                // A path status noted while the read was out is newer than the log, which the target may
                // have read before the change: keep the status (ana.stale is set again: the log is read
                // again at this poll's end) rather than put the path back to what it was.
                if self.shared.ana.noted.load(Ordering::Acquire) == self.ana_noted_at_read {
                    self.att.ana.states = states;
                    self.shared.ana.set(self.att.ana.clone());
                }
            }
            // Abort completions need no action: an aborted command completes on its own queue.
        }
        if !self.opts.kato.is_zero() {
            if self.keep_alive_outstanding && self.last_keep_alive.elapsed() >= self.opts.kato {
                return Err(Error::Timeout(
                    "Keep Alive completion (the target stopped answering)",
                ));
            }
            if !self.keep_alive_outstanding && self.last_keep_alive.elapsed() >= self.opts.kato / 2
            {
                self.att
                    .admin
                    .submit(Sqe::keep_alive(), DataDir::None, None, 0, KEEP_ALIVE_TAG)
                    .map_err(|(e, _)| e)?;
                self.keep_alive_outstanding = true;
                self.last_keep_alive = Instant::now();
            }
        }
        if self.att.ana.reported && !self.ana_outstanding {
            let stale = self.shared.ana.stale.swap(false, Ordering::AcqRel);
            let due = !self.opts.ana_refresh.is_zero()
                && self.last_ana.elapsed() >= self.opts.ana_refresh;
            if stale || due {
                self.att
                    .admin
                    .submit(
                        ana_log_sqe(),
                        DataDir::FromController,
                        Some(alloc_page(&self.pool)?),
                        4096,
                        ANA_TAG,
                    )
                    .map_err(|(e, _)| e)?;
                self.ana_noted_at_read = self.shared.ana.noted.load(Ordering::Acquire);
                self.ana_outstanding = true;
                self.last_ana = Instant::now();
            }
        }
        while self.att.admin.outstanding() + 1 < self.att.admin.depth() {
            let Some((sqid, cid)) = self.shared.aborts.pop() else {
                break;
            };
            self.att
                .admin
                .submit(Sqe::abort(sqid, cid), DataDir::None, None, 0, ABORT_TAG)
                .map_err(|(e, _)| e)?;
            self.shared.aborts_sent.fetch_add(1, Ordering::Relaxed);
        }
        self.att.admin.flush()?;
        Ok(())
    }

    /// The admin connection is gone (or must go): closing it tears the controller down on the target, and
    /// every queue pair will reconnect after the admin queue does.
    fn lose(&mut self, cause: &Error) {
        self.shared.note_loss(cause, &self.opts);
        log::debug!(
            "{}: controller {} lost, reconnecting: {cause}",
            self.opts.addr,
            self.att.cntlid
        );
        self.att.admin.close();
        self.shared.admin_lost.store(true, Ordering::Release);
        let now = Instant::now();
        self.state = CtrlState::Reconnecting {
            since: now,
            next: now,
        };
    }

    /// One reconnect attempt, on its own thread: bring-up waits on the network (a connect to a host that
    /// stopped answering takes the whole step timeout), and this is called from a reactor's poller. The
    /// result is taken by a later call.
    fn try_reconnect(&mut self, since: Instant) {
        let result = match &self.connecting {
            None => {
                let (mut opts, pool) = (self.opts.clone(), self.pool.clone());
                opts.tls_key_renewal = self.shared.key_renewal(opts.tls_key_renewal);
                match Background::spawn(move || bring_up(&opts, &pool)) {
                    Ok(b) => {
                        self.connecting = Some(b);
                        return;
                    }
                    Err(e) => Err(e),
                }
            }
            Some(b) => match b.poll() {
                Some(r) => r,
                None => return,
            },
        };
        self.connecting = None;
        match result {
            Ok(a) => {
                self.att = a;
                if self.att.generated_tls.is_some() {
                    self.opts.tls.clone_from(&self.att.generated_tls);
                }
                self.shared.ana.set(self.att.ana.clone());
                self.ana_outstanding = false;
                self.last_ana = Instant::now();
                self.last_keep_alive = Instant::now();
                self.keep_alive_outstanding = false;
                // Aborts for commands of the old connections are moot.
                while self.shared.aborts.pop().is_some() {}
                self.shared.reset_requested.store(false, Ordering::Release);
                self.shared.admin_lost.store(false, Ordering::Release);
                self.shared.cntlid.store(self.att.cntlid, Ordering::Release);
                self.shared.generation.fetch_add(1, Ordering::AcqRel);
                self.shared.reconnects.fetch_add(1, Ordering::Relaxed);
                self.state = CtrlState::Live;
            }
            Err(_) if since.elapsed() >= self.opts.ctrl_loss_tmo => {
                self.shared.dead.store(true, Ordering::Release);
                self.state = CtrlState::Dead;
            }
            Err(_) => {
                self.state = CtrlState::Reconnecting {
                    since,
                    next: Instant::now() + self.opts.reconnect_delay,
                };
            }
        }
    }

    /// What this controller reports of ANA, as last read.
    /// See [`TcpController`]'s example.
    pub fn ana(&self) -> AnaView {
        self.att.ana.clone()
    }

    /// The Command Quiesce Time it reports (NVMe 2.1), zero if none.
    /// See [`TcpController`]'s example.
    pub fn cqt(&self) -> Duration {
        Duration::from_millis(u64::from(self.att.info.identify.cqt))
    }

    /// The options it was attached with.
    /// See [`TcpController`]'s example.
    pub fn options(&self) -> &ConnectOptions {
        &self.opts
    }

    /// Whether the admin connection is up (not reconnecting, not given up).
    /// See [`TcpController`]'s example.
    pub fn is_live(&self) -> bool {
        self.state == CtrlState::Live
    }

    /// Successful reconnects so far.
    /// See [`TcpController`]'s example.
    pub fn reconnects(&self) -> u64 {
        self.shared.reconnects.load(Ordering::Relaxed)
    }

    /// Abort commands sent for timed-out commands so far.
    /// See [`TcpController`]'s example.
    pub fn aborts_sent(&self) -> u64 {
        self.shared.aborts_sent.load(Ordering::Relaxed)
    }

    /// Shuts the controller down (CC.SHN normal, waiting for CSTS.SHST complete up to the step timeout) and
    /// closes the admin connection.
    /// See [`TcpController`]'s example.
    pub fn shutdown(mut self) -> Result<(), Error> {
        let t = self.opts.timeout;
        let mut cc = spec::Cc(property_get(&mut self.att.admin, spec::reg::CC, false, t)? as u32);
        cc.set_shn(1);
        property_set(
            &mut self.att.admin,
            spec::reg::CC,
            u64::from(cc.0),
            false,
            t,
        )?;
        let deadline = Instant::now() + t;
        loop {
            let csts =
                spec::Csts(property_get(&mut self.att.admin, spec::reg::CSTS, false, t)? as u32);
            if csts.shst() == 2 {
                break;
            }
            if Instant::now() >= deadline {
                self.att.admin.close();
                return Err(Error::Timeout("CSTS.SHST shutdown complete"));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        self.att.admin.close();
        Ok(())
    }
}

impl nvpoll::api::Controller for TcpController {
    type QueuePair = TcpQueuePair;

    fn info(&self) -> &ControllerInfo {
        &self.att.info
    }

    fn admin(&mut self, cmd: Sqe, buf: Option<DmaBuf>) -> nvpoll::Result<(Cqe, Option<DmaBuf>)> {
        let (dir, len) = match &buf {
            Some(b) => (admin_data_dir(cmd.opcode)?, b.len() as u32),
            None => (DataDir::None, 0),
        };
        Ok(self.att.admin.run(cmd, dir, buf, len, self.opts.timeout)?)
    }

    fn io_queues_granted(&self) -> Option<u16> {
        Some(self.att.io_queues_allowed)
    }

    fn create_queue_pair(&mut self, depth: u16) -> nvpoll::Result<TcpQueuePair> {
        Ok(self.connect_io_queue(depth)?)
    }

    fn poll_admin(&mut self) -> nvpoll::Result<()> {
        Ok(TcpController::poll_admin(self)?)
    }

    fn shutdown(self) -> nvpoll::Result<()> {
        Ok(TcpController::shutdown(self)?)
    }
}

impl TcpController {
    /// Authenticates the admin queue again with DH-HMAC-CHAP while the controller stays live (as nvme-cli
    /// does when a new secret is written to sysfs), with new keys if `dhchap` gives them; I/O queues
    /// connected later (and reconnects) use them too. The controller must have asked for authentication,
    /// or at least accept it for this host.
    ///
    /// # Examples
    ///
    /// ```no_run
    /// # fn demo(ctrl: &mut nvpoll_tcp::host::TcpController) -> Result<(), nvpoll_tcp::Error> {
    /// use nvpoll_tcp::dhchap::{host::HostAuth, Secret};
    ///
    /// // Needs a controller that authenticates this host: the new secret is tried on the admin queue now.
    /// let secret = Secret::parse("DHHC-1:01:WulleCBkG4oCs0iIC3Cit9gBDCLWiZ9PNXuhqytWkBIZkvGy:")
    ///     .map_err(|e| nvpoll_tcp::Error::InvalidArgument(e.to_string()))?;
    /// ctrl.reauthenticate(Some(HostAuth::new(secret, None)))?;
    /// # Ok(()) }
    /// ```
    pub fn reauthenticate(
        &mut self,
        dhchap: Option<crate::dhchap::host::HostAuth>,
    ) -> Result<(), Error> {
        if let Some(a) = dhchap {
            self.opts.dhchap = Some(a);
        }
        if self.state != CtrlState::Live {
            return Err(Error::Lost("the controller is reconnecting"));
        }
        // A refusal that nvmet answers by closing the connection comes back as a DH-HMAC-CHAP error
        // (`authenticate`); the controller is then lost and reconnects.
        authenticate(&mut self.att.admin, &self.opts, &self.pool, AUTHREQ_ATR).map(|_| ())
    }

    /// Connects one more I/O queue pair of the given depth.
    /// See [`TcpController`]'s example.
    pub fn connect_io_queue(&mut self, depth: u16) -> Result<TcpQueuePair, Error> {
        if self.next_qid > self.att.io_queues_allowed {
            return Err(Error::InvalidArgument(format!(
                "the controller granted {} I/O queues (of {} asked for) and all are connected; connect another \
                 controller of the subsystem for more",
                self.att.io_queues_allowed, self.opts.io_queues
            )));
        }
        let mqes = u32::from(self.att.cap.mqes()) + 1;
        if depth < 1 || u32::from(depth) > mqes {
            return Err(Error::InvalidArgument(format!(
                "queue depth {depth} is outside 1..={mqes} (CAP.MQES)"
            )));
        }
        if self.state != CtrlState::Live {
            return Err(Error::Lost("the controller is reconnecting or given up"));
        }
        let qid = self.next_qid;
        let mut opts = self.opts.clone();
        opts.tls_key_renewal = self.shared.key_renewal(opts.tls_key_renewal);
        let link = QueueLink {
            opts,
            pool: self.pool.clone(),
            qid,
            depth,
            max_transfer: self.att.info.max_transfer,
            incapsule_max: (self.att.info.identify.ioccsz.max(4) * 16).saturating_sub(64),
            cqt: self.cqt(),
        };
        // The connect (TCP, TLS, ICReq, Connect, and an authentication that may take seconds on a slow target)
        // runs on a thread of its own while this one keeps the admin queue alive.
        let cntlid = self.att.cntlid;
        let job = {
            let link = link.clone();
            Background::spawn(move || link.connect(cntlid))?
        };
        let q = loop {
            if let Some(r) = job.poll() {
                break r?;
            }
            if let Err(e) = self.service_admin() {
                self.lose(&e);
                return Err(e);
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        self.next_qid += 1;
        let gen = self.shared.generation.load(Ordering::Acquire);
        Ok(TcpQueuePair::new(
            q,
            link,
            Arc::clone(&self.shared),
            gen,
            self.att.info.namespaces.clone(),
        ))
    }
}

/// Which way an admin command's data goes, from its opcode's two low bits (NVMe base specification, "Opcodes
/// for Admin Commands": 01b host to controller, 10b controller to host, 11b both). Set Features, Security
/// Send, Firmware Image Download and Namespace Management send their buffer; Identify, Get Log Page and Get
/// Features fill it. A command with a buffer and no direction in its opcode (00b, as some vendor-specific
/// commands are) is taken as controller to host; one that moves data both ways cannot be carried over
/// NVMe/TCP, which moves one command's data one way.
fn admin_data_dir(opcode: u8) -> Result<DataDir, Error> {
    match opcode & 0b11 {
        0b01 => Ok(DataDir::ToController),
        0b11 => Err(Error::InvalidArgument(format!(
            "admin opcode {opcode:#04x} moves data both ways, which NVMe/TCP cannot carry"
        ))),
        _ => Ok(DataDir::FromController),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_admin_command_s_data_goes_the_way_its_opcode_says() {
        use nvpoll::spec::admin as op;
        for (opcode, want) in [
            (op::SET_FEATURES, DataDir::ToController),
            (0x81, DataDir::ToController), // Security Send
            (0x11, DataDir::ToController), // Firmware Image Download
            (op::IDENTIFY, DataDir::FromController),
            (op::GET_LOG_PAGE, DataDir::FromController),
            (op::GET_FEATURES, DataDir::FromController),
            (0xc0, DataDir::FromController), // vendor specific, no direction bits
        ] {
            let got = admin_data_dir(opcode).unwrap();
            assert!(
                std::mem::discriminant(&got) == std::mem::discriminant(&want),
                "opcode {opcode:#04x}: {got:?}"
            );
        }
        assert!(matches!(
            admin_data_dir(0x83),
            Err(Error::InvalidArgument(_))
        ));
    }
}

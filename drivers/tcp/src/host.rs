//! The NVMe/TCP initiator: a controller (admin queue, identify, namespaces, keep-alive) and its I/O queue
//! pairs, which implement [`nvpoll::api::QueuePair`].
//!
//! Attach ([`TcpController::connect`]) and queue creation run off the I/O path: they poll their sockets with
//! deadlines until each step is done. Once created, a [`TcpQueuePair`] is moved to the reactor that owns it and
//! never blocks.
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use nvpoll::api::{Completion, IoOp, IoRequest, Namespace, QueuePair, QueueStats, Rejected};
use nvpoll::mem::{DmaBuf, DmaPool};
use nvpoll::send::SendMode;
use nvpoll::spec::{self, Cqe, IdentifyController, IdentifyNamespace, Sqe};

use crate::queue::{DataDir, HostQueue, QueueParams};
use crate::Error;

/// Largest transfer we issue in one command when the controller sets no limit (MDTS 0).
pub const DEFAULT_MAX_TRANSFER: u32 = 1024 * 1024;

/// How to reach and attach a controller.
#[derive(Clone, Debug)]
pub struct ConnectOptions {
    /// Target address.
    pub addr: SocketAddr,
    /// Subsystem NQN.
    pub subnqn: String,
    /// Host NQN.
    pub hostnqn: String,
    /// Host identifier (16 bytes).
    pub hostid: [u8; 16],
    /// Ask for header digests.
    pub header_digest: bool,
    /// Ask for data digests.
    pub data_digest: bool,
    /// Keep Alive Timeout; zero disables keep-alive.
    pub kato: Duration,
    /// Time allowed for each bring-up step (connect, ICResp, each admin command).
    pub timeout: Duration,
    /// Admin queue depth.
    pub admin_depth: u16,
    /// Largest transfer per command we are willing to issue (further limited by MDTS).
    pub max_transfer: u32,
    /// TLS 1.3 with an external PSK on every queue (admin and I/O), before ICReq; see
    /// [`ConnectOptions::with_tls_key`].
    pub tls: Option<crate::tls::ClientConfig>,
}

impl ConnectOptions {
    /// Options for a `trtype:tcp` transport ID, with the defaults of [`ConnectOptions::new`]. The host NQN is
    /// `hostnqn` if given, else the transport ID's `hostnqn:`, else this machine's (see
    /// [`nvpoll::trid::default_hostnqn`]); the host ID comes from the host NQN's UUID or `/etc/nvme/hostid`.
    pub fn from_trid(
        trid: &nvpoll::trid::TransportId,
        hostnqn: Option<&str>,
    ) -> Result<ConnectOptions, Error> {
        let nvpoll::trid::TransportId::Tcp {
            addr,
            subnqn,
            hostnqn: trid_hostnqn,
        } = trid
        else {
            return Err(Error::InvalidArgument(format!(
                "trtype:{} is not NVMe/TCP",
                trid.trtype()
            )));
        };
        let subnqn = subnqn
            .clone()
            .ok_or_else(|| Error::InvalidArgument("the transport ID needs subnqn:NQN".into()))?;
        let hostnqn = match hostnqn.map(str::to_string).or_else(|| trid_hostnqn.clone()) {
            Some(n) => n,
            None => nvpoll::trid::default_hostnqn()
                .map_err(|e| Error::io("reading the host NQN (give one)", e))?,
        };
        let mut o = ConnectOptions::new(*addr, subnqn, hostnqn);
        o.hostid = nvpoll::trid::hostid_from_hostnqn(&o.hostnqn)
            .or_else(|| nvpoll::trid::default_hostid().ok())
            .unwrap_or_default();
        Ok(o)
    }

    /// Options with defaults: no digests, KATO 10 s, 5 s per step, admin depth 32, 1 MiB transfers.
    pub fn new(addr: SocketAddr, subnqn: impl Into<String>, hostnqn: impl Into<String>) -> Self {
        ConnectOptions {
            addr,
            subnqn: subnqn.into(),
            hostnqn: hostnqn.into(),
            hostid: [0; 16],
            header_digest: false,
            data_digest: false,
            kato: Duration::from_secs(10),
            timeout: Duration::from_secs(5),
            admin_depth: 32,
            max_transfer: DEFAULT_MAX_TRANSFER,
            tls: None,
        }
    }

    /// Turns on TLS with a configured PSK and an identity given directly (for instance one a target expects
    /// verbatim): the TLS PSK is derived from the key's retained PSK with that identity as context.
    pub fn with_tls_identity(mut self, key: &crate::tls::ConfiguredKey, identity: &str) -> Self {
        let retained = key.retained(&self.hostnqn, crate::tls::Derivation::Rfc8446);
        self.tls = Some(crate::tls::ClientConfig::new(
            identity,
            retained.tls_psk(identity),
        ));
        self
    }

    /// Turns on TLS with a configured PSK (`NVMeTLSkey-1:...`): the identity and TLS PSK are derived for this
    /// host and subsystem (RFC 8446 derivation), and every queue uses the same identity.
    pub fn with_tls_key(
        mut self,
        key: &crate::tls::ConfiguredKey,
        version: crate::tls::IdentityVersion,
    ) -> Self {
        let (identity, psk) = key.derive(
            version,
            &self.hostnqn,
            &self.subnqn,
            crate::tls::Derivation::Rfc8446,
        );
        self.tls = Some(crate::tls::ClientConfig::new(identity, psk));
        self
    }
}

/// An attached NVMe/TCP controller.
#[derive(Debug)]
pub struct TcpController {
    opts: ConnectOptions,
    admin: HostQueue,
    pool: DmaPool,
    cntlid: u16,
    cap: spec::Cap,
    vs: spec::Vs,
    id: IdentifyController,
    namespaces: Vec<Namespace>,
    max_transfer: u32,
    io_queues_allowed: u16,
    next_qid: u16,
    last_keep_alive: Instant,
    keep_alive_outstanding: bool,
}

const KEEP_ALIVE_TAG: u64 = u64::MAX - 1;

fn connect_queue(
    opts: &ConnectOptions,
    qid: u16,
    depth: u16,
    max_transfer: u32,
) -> Result<HostQueue, Error> {
    HostQueue::connect(&QueueParams {
        addr: opts.addr,
        qid,
        depth,
        header_digest: opts.header_digest,
        data_digest: opts.data_digest,
        max_transfer,
        connect_timeout: opts.timeout,
        tls: opts.tls.clone(),
    })
}

/// Sends Fabrics Connect on `q` and returns the controller ID.
fn fabrics_connect(
    q: &mut HostQueue,
    opts: &ConnectOptions,
    pool: &DmaPool,
    sqsize: u16,
    cntlid: u16,
) -> Result<u16, Error> {
    let kato_ms = if q.qid() == 0 {
        opts.kato.as_millis().min(u32::MAX as u128) as u32
    } else {
        0
    };
    let sqe = Sqe::fabrics_connect(q.qid(), sqsize, 0, kato_ms);
    let data = spec::ConnectData {
        hostid: opts.hostid,
        cntlid,
        subnqn: opts.subnqn.clone(),
        hostnqn: opts.hostnqn.clone(),
    };
    let mut buf = pool
        .alloc(spec::fabrics::CONNECT_DATA_SIZE)
        .map_err(|e| Error::InvalidArgument(e.to_string()))?;
    buf.as_mut_slice()[..spec::fabrics::CONNECT_DATA_SIZE].copy_from_slice(&data.to_bytes());
    let (cqe, _) = q.run(
        sqe,
        DataDir::ToController,
        Some(buf),
        spec::fabrics::CONNECT_DATA_SIZE as u32,
        opts.timeout,
    )?;
    HostQueue::check("Fabrics Connect", &cqe)?;
    Ok((cqe.dw0 & 0xffff) as u16)
}

impl TcpController {
    /// Connects the admin queue and brings the controller up: ICReq, Fabrics Connect, CAP/VS, CC.EN and
    /// CSTS.RDY, Identify Controller, Number of Queues, and Identify of every active namespace.
    pub fn connect(opts: ConnectOptions, pool: DmaPool) -> Result<TcpController, Error> {
        let mut admin = connect_queue(&opts, 0, opts.admin_depth, opts.max_transfer.max(4096))?;
        let cntlid = fabrics_connect(&mut admin, &opts, &pool, opts.admin_depth - 1, 0xffff)?;
        let t = opts.timeout;
        let cap = spec::Cap(property_get(&mut admin, spec::reg::CAP, true, t)?);
        let vs = spec::Vs(property_get(&mut admin, spec::reg::VS, false, t)? as u32);
        // Enable: 64-byte SQEs, 16-byte CQEs, 4 KiB pages, NVM command set.
        let mut cc = spec::Cc(0);
        cc.set_iosqes(6);
        cc.set_iocqes(4);
        cc.set_en(true);
        property_set(&mut admin, spec::reg::CC, u64::from(cc.0), false, t)?;
        let ready_deadline = Instant::now() + cap.timeout().max(Duration::from_millis(500));
        loop {
            let csts = spec::Csts(property_get(&mut admin, spec::reg::CSTS, false, t)? as u32);
            if csts.cfs() {
                return Err(Error::Protocol(
                    "controller reports a fatal status (CSTS.CFS) during enable".into(),
                ));
            }
            if csts.rdy() {
                break;
            }
            if Instant::now() >= ready_deadline {
                return Err(Error::Timeout("CSTS.RDY after CC.EN"));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let page = identify(&mut admin, &pool, spec::cns::CONTROLLER, 0, t)?;
        let id = IdentifyController::parse(page.as_slice())
            .map_err(|e| Error::Protocol(e.to_string()))?;
        let mut max_transfer = opts.max_transfer;
        if let Some(limit) = id.max_transfer_bytes(cap.min_page_size()) {
            max_transfer = max_transfer.min(limit.min(u64::from(u32::MAX)) as u32);
        }
        let mut ctrl = TcpController {
            admin,
            pool,
            cntlid,
            cap,
            vs,
            id,
            namespaces: Vec::new(),
            max_transfer,
            io_queues_allowed: 0,
            next_qid: 1,
            last_keep_alive: Instant::now(),
            keep_alive_outstanding: false,
            opts,
        };
        // A discovery controller has no I/O queues and no namespaces: it only serves the discovery log.
        if ctrl.id.cntrltype != IdentifyController::CNTRLTYPE_DISCOVERY {
            ctrl.io_queues_allowed = ctrl.set_number_of_queues(64)?;
            ctrl.namespaces = ctrl.scan_namespaces()?;
        }
        Ok(ctrl)
    }

    fn set_number_of_queues(&mut self, want: u16) -> Result<u16, Error> {
        let n = u32::from(want - 1);
        let sqe = Sqe::set_features(spec::feature::NUMBER_OF_QUEUES, n | (n << 16));
        let (cqe, _) = self
            .admin
            .run(sqe, DataDir::None, None, 0, self.opts.timeout)?;
        HostQueue::check("Set Features (Number of Queues)", &cqe)?;
        let nsq = (cqe.dw0 & 0xffff) as u16 + 1;
        let ncq = (cqe.dw0 >> 16) as u16 + 1;
        Ok(nsq.min(ncq).min(want))
    }

    fn scan_namespaces(&mut self) -> Result<Vec<Namespace>, Error> {
        let t = self.opts.timeout;
        let list = identify(&mut self.admin, &self.pool, spec::cns::ACTIVE_NS_LIST, 0, t)?;
        let nsids = spec::decode_ns_list(list.as_slice());
        drop(list);
        let mut out = Vec::with_capacity(nsids.len());
        for nsid in nsids {
            let page = identify(&mut self.admin, &self.pool, spec::cns::NAMESPACE, nsid, t)?;
            let ns = IdentifyNamespace::parse(page.as_slice())
                .map_err(|e| Error::Protocol(e.to_string()))?;
            if ns.nsze == 0 {
                continue;
            }
            let Some(block_size) = ns.block_size() else {
                return Err(Error::Protocol(format!(
                    "namespace {nsid} reports an invalid LBA format"
                )));
            };
            out.push(Namespace {
                nsid,
                block_size,
                blocks: ns.nsze,
            });
        }
        Ok(out)
    }

    /// Controller ID assigned by the target.
    pub fn cntlid(&self) -> u16 {
        self.cntlid
    }

    /// The Capabilities register.
    pub fn cap(&self) -> spec::Cap {
        self.cap
    }

    /// The Version register.
    pub fn vs(&self) -> spec::Vs {
        self.vs
    }

    /// How many I/O queues the controller granted.
    pub fn io_queues_allowed(&self) -> u16 {
        self.io_queues_allowed
    }

    /// The DMA pool that buffers for this controller come from.
    pub fn pool(&self) -> &DmaPool {
        &self.pool
    }

    /// Looks up an active namespace.
    pub fn namespace(&self, nsid: u32) -> Option<&Namespace> {
        self.namespaces.iter().find(|n| n.nsid == nsid)
    }

    /// Services the admin queue: sends Keep Alive every KATO/2 and reaps its completion. Call it from a timed
    /// poller (or any loop) at least a few times per KATO. Returns an error if the admin queue has failed.
    pub fn poll_admin(&mut self) -> Result<(), Error> {
        self.admin.poll()?;
        while let Some(d) = self.admin.pop_done() {
            if d.tag == KEEP_ALIVE_TAG {
                self.keep_alive_outstanding = false;
                let cqe = d.result?;
                HostQueue::check("Keep Alive", &cqe)?;
            }
        }
        if !self.opts.kato.is_zero()
            && !self.keep_alive_outstanding
            && self.last_keep_alive.elapsed() >= self.opts.kato / 2
        {
            self.admin
                .submit(Sqe::keep_alive(), DataDir::None, None, 0, KEEP_ALIVE_TAG)
                .map_err(|(e, _)| e)?;
            self.keep_alive_outstanding = true;
            self.last_keep_alive = Instant::now();
        }
        self.admin.flush()?;
        Ok(())
    }

    /// Shuts the controller down (CC.SHN normal, waiting for CSTS.SHST complete up to the step timeout) and
    /// closes the admin connection.
    pub fn shutdown(mut self) -> Result<(), Error> {
        let t = self.opts.timeout;
        let mut cc = spec::Cc(property_get(&mut self.admin, spec::reg::CC, false, t)? as u32);
        cc.set_shn(1);
        property_set(&mut self.admin, spec::reg::CC, u64::from(cc.0), false, t)?;
        let deadline = Instant::now() + t;
        loop {
            let csts = spec::Csts(property_get(&mut self.admin, spec::reg::CSTS, false, t)? as u32);
            if csts.shst() == 2 {
                break;
            }
            if Instant::now() >= deadline {
                self.admin.close();
                return Err(Error::Timeout("CSTS.SHST shutdown complete"));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        self.admin.close();
        Ok(())
    }
}

fn property_get(q: &mut HostQueue, offset: u32, eight: bool, t: Duration) -> Result<u64, Error> {
    let (cqe, _) = q.run(Sqe::property_get(offset, eight), DataDir::None, None, 0, t)?;
    HostQueue::check("Property Get", &cqe)?;
    Ok(u64::from(cqe.dw0) | (u64::from(cqe.dw1) << 32))
}

fn property_set(
    q: &mut HostQueue,
    offset: u32,
    value: u64,
    eight: bool,
    t: Duration,
) -> Result<(), Error> {
    let (cqe, _) = q.run(
        Sqe::property_set(offset, eight, value),
        DataDir::None,
        None,
        0,
        t,
    )?;
    HostQueue::check("Property Set", &cqe)
}

fn identify(
    q: &mut HostQueue,
    pool: &DmaPool,
    cns: u8,
    nsid: u32,
    t: Duration,
) -> Result<DmaBuf, Error> {
    let buf = pool
        .alloc(4096)
        .map_err(|e| Error::InvalidArgument(e.to_string()))?;
    let (cqe, buf) = q.run(
        Sqe::identify(cns, nsid),
        DataDir::FromController,
        Some(buf),
        4096,
        t,
    )?;
    HostQueue::check("Identify", &cqe)?;
    Ok(buf.expect("identify hands its buffer back"))
}

impl nvpoll::api::Controller for TcpController {
    type QueuePair = TcpQueuePair;

    fn identify(&self) -> &IdentifyController {
        &self.id
    }

    fn namespaces(&self) -> &[Namespace] {
        &self.namespaces
    }

    fn max_transfer(&self) -> Option<u32> {
        Some(self.max_transfer)
    }

    fn admin(&mut self, cmd: Sqe, buf: Option<DmaBuf>) -> nvpoll::Result<(Cqe, Option<DmaBuf>)> {
        let (dir, len) = match &buf {
            Some(b) => (DataDir::FromController, b.len() as u32),
            None => (DataDir::None, 0),
        };
        Ok(self.admin.run(cmd, dir, buf, len, self.opts.timeout)?)
    }

    fn create_queue_pair(&mut self, depth: u16) -> nvpoll::Result<TcpQueuePair> {
        Ok(self.connect_io_queue(depth)?)
    }
}

impl TcpController {
    /// Connects one more I/O queue pair of the given depth.
    pub fn connect_io_queue(&mut self, depth: u16) -> Result<TcpQueuePair, Error> {
        if self.next_qid > self.io_queues_allowed {
            return Err(Error::InvalidArgument(format!(
                "the controller granted {} I/O queues; all are in use",
                self.io_queues_allowed
            )));
        }
        let mqes = u32::from(self.cap.mqes()) + 1;
        if depth < 1 || u32::from(depth) > mqes {
            return Err(Error::InvalidArgument(format!(
                "queue depth {depth} is outside 1..={mqes} (CAP.MQES)"
            )));
        }
        let qid = self.next_qid;
        let mut q = connect_queue(&self.opts, qid, depth, self.max_transfer)?;
        // SQSIZE is 0's based and must be at least 1 (a queue of two entries); a depth-1 queue pair still
        // never has more than one command outstanding, since the host queue has one slot.
        fabrics_connect(
            &mut q,
            &self.opts,
            &self.pool,
            depth.max(2) - 1,
            self.cntlid,
        )?;
        let ioccsz = self.id.ioccsz.max(4) * 16;
        q.set_incapsule_max(ioccsz.saturating_sub(64));
        self.next_qid += 1;
        let block_sizes = self
            .namespaces
            .iter()
            .map(|n| (n.nsid, n.block_size, n.blocks))
            .collect();
        Ok(TcpQueuePair { q, block_sizes })
    }
}

/// An NVMe/TCP I/O queue pair.
#[derive(Debug)]
pub struct TcpQueuePair {
    q: HostQueue,
    block_sizes: Vec<(u32, u32, u64)>,
}

impl TcpQueuePair {
    /// Counters of this queue's connection.
    pub fn conn_stats(&self) -> crate::conn::ConnStats {
        self.q.conn_stats()
    }

    /// Queue ID.
    pub fn qid(&self) -> u16 {
        self.q.qid()
    }

    fn ns(&self, nsid: u32) -> Option<(u32, u64)> {
        self.block_sizes
            .iter()
            .find(|n| n.0 == nsid)
            .map(|n| (n.1, n.2))
    }
}

fn reject(error: impl Into<nvpoll::Error>, request: IoRequest) -> Rejected {
    Rejected {
        error: error.into(),
        request,
    }
}

impl QueuePair for TcpQueuePair {
    fn submit(&mut self, mut req: IoRequest) -> Result<(), Rejected> {
        let Some((bs, nblocks)) = self.ns(req.nsid) else {
            let msg = format!("namespace {} is not active on this controller", req.nsid);
            return Err(reject(nvpoll::Error::InvalidArgument(msg), req));
        };
        if req.op != IoOp::Flush {
            if req.blocks == 0 {
                return Err(reject(
                    nvpoll::Error::InvalidArgument("zero blocks".into()),
                    req,
                ));
            }
            if req
                .lba
                .checked_add(u64::from(req.blocks))
                .is_none_or(|end| end > nblocks)
            {
                let msg = format!(
                    "blocks {}+{} are beyond the namespace's {nblocks}",
                    req.lba, req.blocks
                );
                return Err(reject(nvpoll::Error::InvalidArgument(msg), req));
            }
        }
        let len = u64::from(req.blocks) * u64::from(bs);
        let nlb = req.blocks.wrapping_sub(1) as u16;
        let (sqe, dir) = match req.op {
            IoOp::Read => (Sqe::read(req.nsid, req.lba, nlb), DataDir::FromController),
            IoOp::Write => (Sqe::write(req.nsid, req.lba, nlb), DataDir::ToController),
            IoOp::Flush => (Sqe::flush(req.nsid), DataDir::None),
            IoOp::WriteZeroes => (Sqe::write_zeroes(req.nsid, req.lba, nlb), DataDir::None),
        };
        if dir != DataDir::None && req.blocks > 0x1_0000 {
            let msg = format!(
                "{} blocks exceed the 65536 one command can carry",
                req.blocks
            );
            return Err(reject(nvpoll::Error::InvalidArgument(msg), req));
        }
        let len = if dir == DataDir::None { 0 } else { len as u32 };
        let buf = req.buf.take();
        match self.q.submit(sqe, dir, buf, len, req.tag) {
            Ok(()) => Ok(()),
            Err((e, buf)) => {
                req.buf = buf;
                Err(reject(e, req))
            }
        }
    }

    fn flush(&mut self) -> nvpoll::Result<()> {
        self.q.flush()?;
        Ok(())
    }

    fn poll(&mut self, _max: usize) -> nvpoll::Result<usize> {
        Ok(self.q.poll()?)
    }

    fn pop_completion(&mut self) -> Option<Completion> {
        let d = self.q.pop_done()?;
        let result = match d.result {
            Ok(cqe) if cqe.status().is_success() => Ok(()),
            Ok(cqe) => Err(nvpoll::Error::Nvme(cqe.status())),
            Err(e) => Err(e.into()),
        };
        Some(Completion {
            tag: d.tag,
            buf: d.buf,
            result,
        })
    }

    fn outstanding(&self) -> usize {
        self.q.outstanding()
    }

    fn depth(&self) -> usize {
        self.q.depth()
    }

    fn set_send_mode(&mut self, mode: SendMode) -> nvpoll::Result<()> {
        self.q.set_send_mode(mode);
        Ok(())
    }

    fn stats(&self) -> QueueStats {
        let c = self.q.conn_stats();
        QueueStats {
            commands: self.q.commands(),
            pdus: c.pdus_tx,
            writes: c.writes,
            reads: c.reads,
            records: c.records,
            record_bytes: c.record_bytes,
            flushes: c.flushes,
        }
    }
}

//! Bring-up of a controller on its admin queue, at attach and at every reconnect (`bring_up`: connect, Fabrics
//! Connect, CAP and VS, CC.EN and CSTS.RDY, Identify Controller, Number of Queues, the namespaces, the ANA
//! log), and the admin commands run to completion that it and shutdown use (Property Get and Set, Identify).

use std::time::{Duration, Instant};

use nvpoll::api::{ControllerInfo, Namespace};
use nvpoll::mem::{DmaBuf, DmaPool};
use nvpoll::spec::{self, CommandKind, IdentifyController, Sqe};

use super::ana::{alloc_page, ana_log_sqe, parse_ana_states, AnaView};
use super::connect::{connect_queue, fabrics_connect, fabrics_connect_auth};
use super::options::ConnectOptions;
use crate::queue::{DataDir, HostQueue};
use crate::Error;

/// What a successful bring-up of the admin queue learned.
#[derive(Debug)]
pub(super) struct Attached {
    pub(super) admin: HostQueue,
    pub(super) cntlid: u16,
    pub(super) cap: spec::Cap,
    pub(super) vs: spec::Vs,
    pub(super) info: ControllerInfo,
    pub(super) io_queues_allowed: u16,
    /// The ANA groups and states read at bring-up.
    pub(super) ana: AnaView,
    /// The TLS settings a secure channel concatenation generated at bring-up (every queue then uses them).
    pub(super) generated_tls: Option<crate::tls::ClientConfig>,
}

/// Connects the admin queue and brings the controller up: ICReq, Fabrics Connect, CAP/VS, CC.EN and CSTS.RDY,
/// Identify Controller, Number of Queues, and Identify of every active namespace.
pub(super) fn bring_up(opts: &ConnectOptions, pool: &DmaPool) -> Result<Attached, Error> {
    // SQSIZE is 0's based and a queue of N entries holds N - 1 commands.
    if opts.admin_depth < 2 {
        return Err(Error::InvalidArgument(format!(
            "admin queue depth {}: it must be at least 2 (32 is usual)",
            opts.admin_depth
        )));
    }
    let admin_transfer = opts.max_transfer.max(4096);
    let concat = opts.dhchap.as_ref().is_some_and(|a| a.concat);
    let (mut admin, cntlid, generated_tls) = if concat {
        // Secure channel concatenation: authenticate on an admin queue without TLS, which generates a PSK,
        // then connect the admin queue again over TLS with it (the controller asks no more on that one).
        let plain = ConnectOptions {
            tls: None,
            ..opts.clone()
        };
        let mut q = connect_queue(&plain, 0, opts.admin_depth, admin_transfer)?;
        let (_, tls) = fabrics_connect_auth(&mut q, &plain, pool, opts.admin_depth - 1, 0xffff)?;
        q.close();
        let tls = tls.ok_or_else(|| {
            Error::Auth(
                "secure channel concatenation asked for (--concat), but the controller did not ask to authenticate"
                    .into(),
            )
        })?;
        let secured = ConnectOptions {
            tls: Some(tls.clone()),
            ..opts.clone()
        };
        let mut q = connect_queue(&secured, 0, opts.admin_depth, admin_transfer)?;
        let cntlid = fabrics_connect(&mut q, &secured, pool, opts.admin_depth - 1, 0xffff)?;
        (q, cntlid, Some(tls))
    } else {
        let mut q = connect_queue(opts, 0, opts.admin_depth, admin_transfer)?;
        let cntlid = fabrics_connect(&mut q, opts, pool, opts.admin_depth - 1, 0xffff)?;
        (q, cntlid, None)
    };
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
    let page = identify(&mut admin, pool, spec::cns::CONTROLLER, 0, t)?;
    let id =
        IdentifyController::parse(page.as_slice()).map_err(|e| Error::Protocol(e.to_string()))?;
    let mut max_transfer = opts.max_transfer;
    if let Some(limit) = id.max_transfer_bytes(cap.min_page_size()) {
        max_transfer = max_transfer.min(limit.min(u64::from(u32::MAX)) as u32);
    }
    // A discovery controller has no I/O queues and no namespaces: it only serves the discovery log.
    let (io_queues_allowed, scanned) = if id.cntrltype == IdentifyController::CNTRLTYPE_DISCOVERY {
        (0, Vec::new())
    } else {
        (
            set_number_of_queues(&mut admin, t, opts.io_queues)?,
            scan_namespaces(&mut admin, pool, t)?,
        )
    };
    let mut ana = AnaView {
        reported: id.cmic & IdentifyController::CMIC_ANA != 0,
        groups: scanned.iter().map(|(n, g)| (n.nsid, *g)).collect(),
        states: Vec::new(),
    };
    if ana.reported {
        let (cqe, buf) = admin.run(
            ana_log_sqe(),
            DataDir::FromController,
            Some(alloc_page(pool)?),
            4096,
            t,
        )?;
        HostQueue::check("Get Log Page (ANA)", CommandKind::Admin, &cqe)?;
        let buf = buf.expect("Get Log Page hands its buffer back");
        ana.states = parse_ana_states(buf.as_slice())?;
    }
    let namespaces = scanned.into_iter().map(|(n, _)| n).collect();
    Ok(Attached {
        admin,
        cntlid,
        cap,
        vs,
        info: ControllerInfo {
            identify: id,
            namespaces,
            max_transfer,
        },
        io_queues_allowed,
        ana,
        generated_tls,
    })
}

/// Asks for `want` I/O queues and returns how many the controller granted (never more than asked for).
fn set_number_of_queues(admin: &mut HostQueue, t: Duration, want: u16) -> Result<u16, Error> {
    use spec::feature;
    // 65535 is the most a host may ask for: the 0's based value FFFFh is reserved.
    if want == 0 {
        return Err(Error::InvalidArgument(
            "io_queues 0: ask for 1 to 65535 I/O queues".into(),
        ));
    }
    let sqe = Sqe::set_features(feature::NUMBER_OF_QUEUES, feature::num_queues(want, want));
    let (cqe, _) = admin.run(sqe, DataDir::None, None, 0, t)?;
    HostQueue::check("Set Features (Number of Queues)", CommandKind::Admin, &cqe)?;
    let (nsq, ncq) = feature::num_queues_granted(cqe.dw0);
    Ok(nsq.min(ncq).min(u32::from(want)) as u16)
}

/// Every active namespace, with its ANA group ID (0 when it reports none).
fn scan_namespaces(
    admin: &mut HostQueue,
    pool: &DmaPool,
    t: Duration,
) -> Result<Vec<(Namespace, u32)>, Error> {
    let list = identify(admin, pool, spec::cns::ACTIVE_NS_LIST, 0, t)?;
    let nsids = spec::decode_ns_list(list.as_slice());
    drop(list);
    let mut out = Vec::with_capacity(nsids.len());
    for nsid in nsids {
        let page = identify(admin, pool, spec::cns::NAMESPACE, nsid, t)?;
        if let Some(ns) = Namespace::from_identify(nsid, page.as_slice())
            .map_err(|e| Error::Protocol(e.to_string()))?
        {
            let group = spec::IdentifyNamespace::parse(page.as_slice()).map_or(0, |id| id.anagrpid);
            out.push((ns, group));
        }
    }
    Ok(out)
}

pub(super) fn property_get(
    q: &mut HostQueue,
    offset: u32,
    eight: bool,
    t: Duration,
) -> Result<u64, Error> {
    let (cqe, _) = q.run(Sqe::property_get(offset, eight), DataDir::None, None, 0, t)?;
    HostQueue::check("Property Get", CommandKind::Fabrics, &cqe)?;
    Ok(u64::from(cqe.dw0) | (u64::from(cqe.dw1) << 32))
}

pub(super) fn property_set(
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
    HostQueue::check("Property Set", CommandKind::Fabrics, &cqe)
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
    HostQueue::check("Identify", CommandKind::Admin, &cqe)?;
    Ok(buf.expect("identify hands its buffer back"))
}

//! Fabrics and admin commands: Connect, Property Get/Set with the CC/CSTS state machine, Identify, Get/Set
//! Features, Get Log Page, Keep Alive, Asynchronous Event Request and Abort.
//!
//! The registers and feature values of a controller live in its admin connection's
//! [`crate::admin_state::AdminState`]: only the admin queue reads or changes them, so they need no lock.

use std::sync::Arc;

use nvpoll::spec::{
    admin as op, cns, encode_ns_list, fabrics, feature, log_page, Cap, ConnectData,
    ConnectResponse, IdentifyController, IdentifyNamespace, InvalidParameter, LbaFormat,
    NsIdDescriptor, SmartLog, Sqe, Status, Vs, IDENTIFY_SIZE,
};

use crate::admin_state::{AdminState, WCTEMP_K};
use crate::controller::Controller;
use crate::discovery;
use crate::handler::{Ctx, Queue, Reply};
use crate::shared::{Listener, TargetShared};
use crate::subsystem::{Kind, Subsystem, ANA_GROUP_MAX, MAX_NAMESPACES};
use nvpoll_tls::ParsedIdentity;

/// The version we report: 1.3, so that Linux asks for namespace descriptors but not for the 2.0-only Identify
/// structures.
const VERSION: Vs = Vs::V1_3;
/// Firmware revision reported by Identify Controller and the firmware slot log.
const FIRMWARE: &str = env!("CARGO_PKG_VERSION");
/// Keep-alive timeout a discovery controller uses when the host asks for none (as Linux's target does).
const DISCOVERY_KATO_MS: u32 = 120_000;
/// Identify CNS: I/O Command Set Independent Identify Namespace data structure (NVMe 2.0).
const CNS_CS_INDEPENDENT_NS: u8 = 0x08;
/// Asynchronous Event Request Limit, 0-based (4 outstanding).
const AERL: u8 = 3;
/// The asynchronous events a host may enable: SMART warnings, namespace attribute and ANA change notices.
const AEC_SUPPORTED: u32 =
    feature::AEC_SMART_WARNINGS | feature::AEC_NS_ATTRIBUTE | feature::AEC_ANA_CHANGE;
/// Asynchronous Event Configuration: Namespace Attribute Notices.
pub(crate) const AEC_NS_ATTRIBUTE: u32 = feature::AEC_NS_ATTRIBUTE;
/// Asynchronous Event Configuration: ANA Change Notices.
pub(crate) const AEC_ANA_CHANGE: u32 = feature::AEC_ANA_CHANGE;
/// An AER's dword 0 for Namespace Attribute Changed: type Notice (2), information 0, log page Changed
/// Namespace List (04h).
pub(crate) const NS_ATTRIBUTE_CHANGED_EVENT: u32 = 0x2 | (log_page::CHANGED_NS as u32) << 16;
/// An AER's dword 0 for an ANA change: type Notice (2), information 03h, log page ANA (0Ch).
pub(crate) const ANA_CHANGE_EVENT: u32 =
    0x2 | (nvpoll::spec::AsyncEvent::NOTICE_ANA_CHANGE as u32) << 8 | (log_page::ANA as u32) << 16;
/// An AER's dword 0 for Reservation Log Page Available: type I/O Command Specific (6), information 0, log
/// page Reservation Notification (80h).
pub(crate) const RESERVATION_LOG_EVENT: u32 =
    0x6 | (log_page::RESERVATION_NOTIFICATION as u32) << 16;
/// ANA Transition Time reported, in seconds: the longest a group is in the change state. States change only
/// when an operator (or the control socket) says so, so this bounds what a host waits in a transition.
const ANATT_S: u8 = 10;
/// Command Quiesce Time reported, in milliseconds (NVMe 2.1 CQT). A command runs to completion on the
/// reactor that received it, so once a controller is torn down (its admin connection closed or keep-alive
/// expired) nothing it accepted is still running by the time its queues have closed, which each does on its
/// next poll; a host that lost a path must wait KATO and then this long before it resubmits the path's
/// outstanding commands elsewhere.
pub(crate) const CQT_MS: u16 = 100;
/// ANA capabilities an I/O controller reports: every state; a namespace's group is fixed while it is attached.
const ANACAP: u8 = IdentifyController::ANACAP_OPTIMIZED
    | IdentifyController::ANACAP_NON_OPTIMIZED
    | IdentifyController::ANACAP_INACCESSIBLE
    | IdentifyController::ANACAP_PERSISTENT_LOSS
    | IdentifyController::ANACAP_CHANGE
    | IdentifyController::ANACAP_GRPID_STATIC;
/// Optional NVM commands an I/O controller supports: Write Zeroes, Dataset Management, reservations.
const ONCS: u16 = IdentifyController::ONCS_WRITE_ZEROES
    | IdentifyController::ONCS_DSM
    | IdentifyController::ONCS_RESERVATIONS;
/// Composite temperature reported (Kelvin): 35 °C.
const TEMPERATURE_K: u16 = 308;
/// Critical temperature (Kelvin): 85 °C.
const CCTEMP_K: u16 = 358;

/// CAP: 128 entries per queue, contiguous queues, 7.5 s timeout, NVM command set, 4 KiB pages.
pub(crate) fn cap(queue_entries: u16) -> Cap {
    let mut cap = Cap(0);
    cap.set_mqes(queue_entries - 1);
    cap.set_cqr(true);
    cap.set_to(15);
    cap.set_css(Cap::CSS_NVM);
    cap
}

/// Why a Fabrics Connect was refused: the completion's status and dword 0 (IATTR/IPO), and in words for the log.
#[derive(Debug)]
pub(crate) struct Refusal {
    pub status: Status,
    pub dw0: u32,
    pub reason: String,
    /// What the host asked for, as far as the command and its data could be read.
    pub qid: u16,
    pub subnqn: String,
    pub hostnqn: String,
}

/// Fabrics Connect on a connection that is not a queue yet: makes it the admin queue of a new controller or an
/// I/O queue of an existing one.
///
/// A subsystem that allows any host accepts an empty Host NQN, as SPDK's nvmf_tgt (allow-any-host) and Linux
/// nvmet do: `spdk_nvme_perf` sends one when its transport ID has no `hostnqn:`. The I/O queues of such a
/// controller must then give the same (empty) Host NQN as its admin queue. A subsystem with allowed hosts
/// refuses it (HOSTNQN), as it refuses every host it does not list.
///
/// With TLS, `identity` is the PSK identity the host proved in the handshake. A host is authenticated by that,
/// not by what it claims in Connect: the identity's host and subsystem NQNs must be those of the Connect, on
/// every queue (admin and I/O, discovery included), or the Connect is refused.
/// A queue whose TLS identity is one a secure channel concatenation generated (`NVMe1G...`, found in the
/// subsystem's generated keys, or the handshake would have failed) has proven its host: no in-band
/// authentication on it.
fn proven_by_tls(mut q: Queue, identity: Option<&[u8]>) -> Queue {
    if identity
        .and_then(ParsedIdentity::parse)
        .is_some_and(|p| p.generated)
    {
        q.auth = None;
        q.auth_deadline = None;
    }
    q
}

pub(crate) fn connect(
    target: &TargetShared,
    listener: &Listener,
    sqe: &Sqe,
    data: &[u8],
    identity: Option<&[u8]>,
) -> Result<Queue, Refusal> {
    let mut refusal = Refusal {
        status: Status::COMMAND_SEQUENCE_ERROR.with_dnr(),
        dw0: 0,
        reason: String::new(),
        qid: 0,
        subnqn: String::new(),
        hostnqn: String::new(),
    };
    let refuse = |mut r: Refusal, status: Status, reason: String| {
        r.status = status;
        r.reason = reason;
        Err(r)
    };
    let reject = |mut r: Refusal, status: Status, p: InvalidParameter, reason: String| {
        let (dw0, status) = ConnectResponse::Rejected {
            status,
            invalid: Some(p),
        }
        .to_dw0_status();
        r.status = status.with_dnr();
        r.dw0 = dw0;
        r.reason = reason;
        Err(r)
    };
    let invalid = |r: Refusal, p: InvalidParameter, reason: String| {
        reject(r, Status::CONNECT_INVALID_PARAMETERS, p, reason)
    };
    // Connect Invalid Host for a host the subsystem does not allow (NVMe Base 2.0, Connect: "If the host is
    // not allowed to establish an association to any controller in the NVM subsystem"), pointing at the
    // host NQN as Linux nvmet and SPDK do.
    let not_allowed = |r: Refusal, reason: String| {
        reject(
            r,
            Status::CONNECT_INVALID_HOST,
            InvalidParameter::HOSTNQN,
            reason,
        )
    };
    let Some(fabrics::FabricsCommand::Connect(c)) = fabrics::FabricsCommand::from_sqe(sqe) else {
        let status = Status::COMMAND_SEQUENCE_ERROR.with_dnr();
        return refuse(refusal, status, "not a Fabrics Connect".into());
    };
    refusal.qid = c.qid;
    if c.recfmt != 0 {
        let status = Status::CONNECT_INCOMPATIBLE_FORMAT.with_dnr();
        return refuse(
            refusal,
            status,
            format!("record format {} (only 0 is known)", c.recfmt),
        );
    }
    let Ok(cd) = ConnectData::parse(data) else {
        let status = Status::DATA_SGL_LENGTH_INVALID.with_dnr();
        return refuse(
            refusal,
            status,
            format!("Connect data of {} bytes", data.len()),
        );
    };
    refusal.subnqn.clone_from(&cd.subnqn);
    refusal.hostnqn.clone_from(&cd.hostnqn);
    let Some(subsys) = target.subsystem(&cd.subnqn).filter(|s| !s.is_removed()) else {
        return invalid(
            refusal,
            InvalidParameter::SUBNQN,
            "no such subsystem".into(),
        );
    };
    if !subsys.exported_on(listener.addr) {
        let reason = format!(
            "the subsystem is not exported on listener {}",
            listener.addr
        );
        return invalid(refusal, InvalidParameter::SUBNQN, reason);
    }
    if let Some(id) = identity {
        match ParsedIdentity::parse(id) {
            None => {
                let reason =
                    "the TLS PSK identity is not an NVMe identity, so it proves no host".into();
                return invalid(refusal, InvalidParameter::HOSTNQN, reason);
            }
            Some(p) if p.hostnqn != cd.hostnqn => {
                let reason = format!(
                    "the TLS identity proves host '{}', not the host in Connect",
                    p.hostnqn
                );
                return invalid(refusal, InvalidParameter::HOSTNQN, reason);
            }
            Some(p) if p.subnqn != cd.subnqn => {
                let reason = format!(
                    "the TLS identity is for subsystem '{}', not the subsystem in Connect",
                    p.subnqn
                );
                return invalid(refusal, InvalidParameter::SUBNQN, reason);
            }
            Some(_) => {}
        }
    }
    if !subsys.allows(&cd.hostnqn) {
        let reason = if cd.hostnqn.is_empty() {
            "an empty Host NQN, and the subsystem allows only the hosts it lists".to_string()
        } else {
            "the host is not among the subsystem's allowed hosts".to_string()
        };
        return not_allowed(refusal, reason);
    }
    if c.sqsize == 0 || c.sqsize >= subsys.limits.queue_entries {
        let reason = format!(
            "SQSIZE {} (the queue size less one) must be 1 to {}",
            c.sqsize,
            subsys.limits.queue_entries - 1
        );
        return invalid(refusal, InvalidParameter::SQSIZE, reason);
    }
    // The admin queue makes a new controller, an I/O queue joins a live one.
    let ctrl = if c.qid == 0 {
        let kato = if subsys.kind == Kind::Discovery && c.kato == 0 {
            DISCOVERY_KATO_MS
        } else {
            c.kato
        };
        let max_io = if subsys.kind == Kind::Discovery {
            0
        } else {
            subsys.max_io_queues()
        };
        let now = target.now_ms();
        let make = |cntlid| {
            Controller::new(
                cntlid,
                cd.hostnqn.clone(),
                cd.hostid,
                listener.addr,
                kato,
                now,
                max_io,
            )
        };
        let Some(ctrl) = subsys.add_controller(make) else {
            let reason = "no controller ID is free in the subsystem".into();
            return refuse(refusal, Status::CONNECT_CONTROLLER_BUSY, reason);
        };
        ctrl
    } else {
        let Some(ctrl) = subsys.controller(cd.cntlid).filter(|c| !c.is_dead()) else {
            let reason = format!("no live controller {} in the subsystem", cd.cntlid);
            return invalid(refusal, InvalidParameter::CNTLID, reason);
        };
        if ctrl.hostnqn != cd.hostnqn {
            let reason = format!(
                "controller {} belongs to host '{}', not to this one",
                cd.cntlid, ctrl.hostnqn
            );
            return invalid(refusal, InvalidParameter::HOSTNQN, reason);
        }
        if !ctrl.is_ready() {
            let status = Status::COMMAND_SEQUENCE_ERROR.with_dnr();
            let reason = format!(
                "controller {} is not enabled (CC.EN) or not ready yet",
                cd.cntlid
            );
            return refuse(refusal, status, reason);
        }
        if !ctrl.claim_io_queue(c.qid) {
            let reason = format!(
                "I/O queue {} is in use or beyond the {} I/O queues granted",
                c.qid,
                ctrl.max_io_queues()
            );
            return invalid(refusal, InvalidParameter::QID, reason);
        }
        ctrl
    };
    Ok(proven_by_tls(
        Queue::new(
            c.qid,
            c.sqsize,
            c.cattr,
            subsys,
            ctrl,
            target.limits.auth_step_timeout,
        ),
        identity,
    ))
}

/// A fabrics command on a connected queue.
pub(crate) fn fabrics(ctx: &mut Ctx<'_>, sqe: &Sqe) -> Reply {
    let Some(cmd) = fabrics::FabricsCommand::from_sqe(sqe) else {
        return Reply::status(Status::INVALID_OPCODE.with_dnr());
    };
    let queue = &mut *ctx.queue;
    match (cmd, queue.admin.as_mut()) {
        (fabrics::FabricsCommand::Connect(_), _) => {
            Reply::status(Status::COMMAND_SEQUENCE_ERROR.with_dnr())
        }
        (fabrics::FabricsCommand::PropertyGet { offset, size8 }, Some(admin)) => {
            let value = match (offset, size8) {
                (nvpoll::spec::reg::CAP, true) => cap(queue.subsys.limits.queue_entries).0,
                (nvpoll::spec::reg::VS, false) => u64::from(VERSION.0),
                (nvpoll::spec::reg::CC, false) => u64::from(admin.cc.0),
                (nvpoll::spec::reg::CSTS, false) => u64::from(admin.csts.0),
                (nvpoll::spec::reg::NSSR, false) => 0,
                _ => return Reply::status(Status::INVALID_FIELD.with_dnr()),
            };
            Reply::Complete {
                status: Status::SUCCESS,
                dw0: value as u32,
                dw1: (value >> 32) as u32,
            }
        }
        (
            fabrics::FabricsCommand::PropertySet {
                offset,
                size8,
                value,
            },
            Some(admin),
        ) => {
            match (offset, size8) {
                (nvpoll::spec::reg::CC, false) => admin.write_cc(value as u32, &queue.ctrl),
                _ => return Reply::status(Status::INVALID_FIELD.with_dnr()),
            }
            Reply::ok(0)
        }
        (fabrics::FabricsCommand::Disconnect, None) => Reply::CompleteAndClose,
        (
            fabrics::FabricsCommand::AuthSend { .. } | fabrics::FabricsCommand::AuthReceive { .. },
            _,
        ) => {
            // No in-band authentication: Connect never asks for it, so these come out of sequence.
            Reply::status(Status::COMMAND_SEQUENCE_ERROR.with_dnr())
        }
        _ => Reply::status(Status::INVALID_FIELD.with_dnr()),
    }
}

/// An admin command (the queue is the admin queue).
pub(crate) fn execute(ctx: &mut Ctx<'_>, sqe: &Sqe, data: &[u8]) -> Reply {
    let discovery = ctx.queue.subsys.kind == Kind::Discovery;
    match sqe.opcode {
        op::IDENTIFY => identify(ctx, sqe),
        op::GET_LOG_PAGE => get_log_page(ctx, sqe),
        op::GET_FEATURES => get_features(ctx, sqe),
        op::SET_FEATURES => set_features(ctx, sqe),
        op::KEEP_ALIVE => Reply::ok(0),
        op::ASYNC_EVENT_REQUEST => {
            if ctx.held_aers > usize::from(AERL) {
                Reply::status(Status::ASYNC_EVENT_LIMIT_EXCEEDED)
            } else {
                Reply::Hold
            }
        }
        // Commands run to completion as soon as they arrive, so there is never one to abort: dword 0 bit 0
        // says "not aborted".
        op::ABORT if !discovery => Reply::ok(1),
        _ => {
            let _ = data;
            Reply::status(Status::INVALID_OPCODE.with_dnr())
        }
    }
}

fn identify(ctx: &mut Ctx<'_>, sqe: &Sqe) -> Reply {
    let subsys = &ctx.queue.subsys;
    let cns_value = sqe.cdw10 as u8;
    let csi = (sqe.cdw11 >> 24) as u8;
    if subsys.kind == Kind::Discovery && cns_value != cns::CONTROLLER {
        return Reply::status(Status::INVALID_FIELD.with_dnr());
    }
    let page: Vec<u8> = match cns_value {
        cns::CONTROLLER => identify_controller(ctx.target, subsys, &ctx.queue.ctrl).to_vec(),
        cns::NAMESPACE => match active_ns(ctx.queue, sqe.nsid) {
            Ok(Some(ns)) => identify_namespace(ns).to_vec(),
            Ok(None) => vec![0; IDENTIFY_SIZE],
            Err(r) => return r,
        },
        cns::ACTIVE_NS_LIST | cns::IO_CMD_SET_ACTIVE_NS_LIST => {
            if sqe.nsid >= 0xffff_fffe || (cns_value == cns::IO_CMD_SET_ACTIVE_NS_LIST && csi != 0)
            {
                return Reply::status(Status::INVALID_NAMESPACE.with_dnr());
            }
            let ids: Vec<u32> = ctx
                .queue
                .namespaces()
                .map(|n| n.nsid)
                .filter(|&id| id > sqe.nsid)
                .collect();
            encode_ns_list(&ids).to_vec()
        }
        cns::NS_ID_DESCRIPTORS => match active_ns(ctx.queue, sqe.nsid) {
            Ok(Some(ns)) => NsIdDescriptor::encode_list(&[
                NsIdDescriptor::Nguid(ns.nguid),
                NsIdDescriptor::Uuid(ns.uuid),
                NsIdDescriptor::Csi(0),
            ])
            .to_vec(),
            Ok(None) => return Reply::status(Status::INVALID_NAMESPACE.with_dnr()),
            Err(r) => return r,
        },
        // The I/O command set independent namespace structure (Linux asks for it first): shared, ready.
        CNS_CS_INDEPENDENT_NS => match active_ns(ctx.queue, sqe.nsid) {
            Ok(Some(_)) => {
                let mut page = vec![0u8; IDENTIFY_SIZE];
                page[1] = 1; // NMIC: may be attached to several controllers
                page[14] = 1; // NSTAT: ready
                page
            }
            Ok(None) => vec![0; IDENTIFY_SIZE],
            Err(r) => return r,
        },
        // The NVM command set's own Identify Controller: VSL, WZSL, WUSL, DMRL, DMRSL and DMSL all 0, "no limit
        // reported", which is the truth: Write Zeroes and Dataset Management take whatever the command can
        // say (65536 blocks; 256 ranges of up to 2^32 - 1 blocks each): RAM and files forget any range, and a
        // device namespace hands each range to its SSD as one command.
        cns::IO_CMD_SET_CONTROLLER if csi == 0 => vec![0; IDENTIFY_SIZE],
        cns::IO_CMD_SET_NAMESPACE if csi == 0 => match active_ns(ctx.queue, sqe.nsid) {
            Ok(_) => vec![0; IDENTIFY_SIZE],
            Err(r) => return r,
        },
        _ => return Reply::status(Status::INVALID_FIELD.with_dnr()),
    };
    Reply::Data(page)
}

/// The namespace `nsid` names: `Ok(None)` for a valid but inactive ID, an error reply for an invalid one.
fn active_ns(q: &Queue, nsid: u32) -> Result<Option<&crate::handler::NsRef>, Reply> {
    if nsid == 0 || nsid > MAX_NAMESPACES {
        return Err(Reply::status(Status::INVALID_NAMESPACE.with_dnr()));
    }
    Ok(q.namespace(nsid))
}

fn identify_controller(
    target: &TargetShared,
    subsys: &Subsystem,
    ctrl: &Controller,
) -> [u8; IDENTIFY_SIZE] {
    let discovery = subsys.kind == Kind::Discovery;
    let limits = &subsys.limits;
    let id = IdentifyController {
        serial: subsys.serial.clone(),
        model: subsys.model.clone(),
        firmware: FIRMWARE.to_string(),
        rab: 6,
        // Several ports and controllers (Linux refuses a second controller otherwise), with ANA reporting.
        cmic: if discovery {
            0
        } else {
            IdentifyController::CMIC_MULTI_PORT
                | IdentifyController::CMIC_MULTI_CONTROLLER
                | IdentifyController::CMIC_ANA
        },
        mdts: limits.mdts,
        cntlid: ctrl.cntlid,
        ver: VERSION,
        oaes: if discovery {
            0
        } else {
            feature::AEC_NS_ATTRIBUTE | IdentifyController::OAES_ANA_CHANGE
        },
        // 128-bit host identifier; traffic based keep-alive (any command restarts the timer).
        ctratt: 1 | 1 << 6,
        cntrltype: if discovery {
            IdentifyController::CNTRLTYPE_DISCOVERY
        } else {
            IdentifyController::CNTRLTYPE_IO
        },
        acl: 3,
        aerl: AERL,
        // One firmware slot, read-only.
        frmw: 1 << 1 | 1,
        // Extended data for Get Log Page (bit 2: offsets, 32-bit NUMD), and the Commands Supported and Effects
        // page (bit 1).
        lpa: 1 << 2 | 1 << 1,
        wctemp: WCTEMP_K,
        cctemp: CCTEMP_K,
        // Keep-alive granularity: 100 ms.
        kas: 1,
        anatt: if discovery { 0 } else { ANATT_S },
        anacap: if discovery { 0 } else { ANACAP },
        anagrpmax: if discovery { 0 } else { ANA_GROUP_MAX },
        nanagrpid: if discovery { 0 } else { ANA_GROUP_MAX },
        cqt: if discovery { 0 } else { CQT_MS },
        sqes: 0x66,
        cqes: 0x44,
        maxcmd: limits.queue_entries,
        nn: if discovery { 0 } else { MAX_NAMESPACES },
        // Every namespace may be attached (Linux wants MNAN set, and at most NN, to size its ANA log).
        mnan: if discovery { 0 } else { MAX_NAMESPACES },
        oncs: if discovery { 0 } else { ONCS },
        vwc: u8::from(!discovery),
        // SGLs without alignment rules, offset addressing (in-capsule data), transport data blocks.
        sgls: 1 | 1 << 20 | 1 << 21,
        subnqn: subsys.nqn.clone(),
        ioccsz: (target.limits.incapsule_data + 64) / 16,
        iorcsz: 1,
        icdoff: 0,
        fcatt: 0,
        msdbd: 1,
        // Disconnect supported.
        ofcs: 1,
        ..Default::default()
    };
    id.to_bytes()
}

fn identify_namespace(ns: &crate::subsystem::Namespace) -> [u8; IDENTIFY_SIZE] {
    let id = IdentifyNamespace {
        nsze: ns.blocks,
        ncap: ns.blocks,
        nuse: ns.blocks,
        flbas: 0,
        // May be attached to several controllers at once.
        nmic: 1,
        anagrpid: ns.anagrpid,
        nguid: ns.nguid,
        dlfeat: dlfeat(ns),
        rescap: ns.resv.rescap(),
        lbaf: vec![LbaFormat {
            ms: 0,
            lbads: ns.lbads,
            rp: 0,
        }],
        ..Default::default()
    };
    id.to_bytes()
}

/// Deallocate Logical Block Features: bits 2:0 what a deallocated block reads as (001b zeroes, 000b not
/// reported), bit 3 Write Zeroes may deallocate.
fn dlfeat(ns: &crate::subsystem::Namespace) -> u8 {
    match ns.store.deallocates() {
        Some(true) => 1 << 3 | 1,
        Some(false) | None => 0,
    }
}

/// Get Features: SEL 0 (current), 1 (default), 2 (saved = default: nothing is saveable), 3 (capabilities).
fn get_features(ctx: &mut Ctx<'_>, sqe: &Sqe) -> Reply {
    let fid = sqe.cdw10 as u8;
    let sel = ((sqe.cdw10 >> 8) & 7) as u8;
    let default = AdminState::new(ctx.queue.subsys.kind);
    let admin = ctx.queue.admin.as_ref().expect("admin queue");
    let st = if sel == feature::SEL_CURRENT {
        admin
    } else {
        &default
    };
    if sel > feature::SEL_SUPPORTED_CAPABILITIES {
        return Reply::status(Status::INVALID_FIELD.with_dnr());
    }
    let discovery = ctx.queue.subsys.kind == Kind::Discovery;
    let known = if discovery {
        matches!(fid, feature::ASYNC_EVENT_CONFIG | feature::KEEP_ALIVE_TIMER)
    } else {
        matches!(
            fid,
            feature::ARBITRATION
                | feature::POWER_MANAGEMENT
                | feature::TEMPERATURE_THRESHOLD
                | feature::ERROR_RECOVERY
                | feature::VOLATILE_WRITE_CACHE
                | feature::NUMBER_OF_QUEUES
                | feature::INTERRUPT_COALESCING
                | feature::INTERRUPT_VECTOR_CONFIG
                | feature::WRITE_ATOMICITY
                | feature::ASYNC_EVENT_CONFIG
                | feature::KEEP_ALIVE_TIMER
                | feature::HOST_IDENTIFIER
                | feature::RESERVATION_NOTIFICATION_MASK
                | feature::RESERVATION_PERSISTENCE
        )
    };
    if !known {
        return Reply::status(Status::INVALID_FIELD.with_dnr());
    }
    if sel == feature::SEL_SUPPORTED_CAPABILITIES {
        // Changeable, not saveable, not namespace specific; the host identifier is set by Connect.
        return Reply::ok(if fid == feature::HOST_IDENTIFIER {
            0
        } else {
            1 << 2
        });
    }
    let dw0 = match fid {
        feature::ARBITRATION => st.arbitration,
        feature::POWER_MANAGEMENT => st.power_management,
        feature::TEMPERATURE_THRESHOLD => {
            let (tmpsel, thsel) = ((sqe.cdw11 >> 16) & 0xf, (sqe.cdw11 >> 20) & 3);
            if tmpsel != 0 || thsel > 1 {
                return Reply::status(Status::INVALID_FIELD.with_dnr());
            }
            u32::from(st.temperature_threshold[thsel as usize])
        }
        feature::ERROR_RECOVERY => st.error_recovery,
        feature::VOLATILE_WRITE_CACHE => u32::from(st.volatile_write_cache),
        feature::NUMBER_OF_QUEUES => queues_granted(&ctx.queue.subsys),
        feature::INTERRUPT_COALESCING => st.interrupt_coalescing,
        feature::INTERRUPT_VECTOR_CONFIG => sqe.cdw11 & 0xffff,
        feature::WRITE_ATOMICITY => st.write_atomicity,
        feature::ASYNC_EVENT_CONFIG => st.async_event_config,
        feature::KEEP_ALIVE_TIMER => {
            if sel == feature::SEL_CURRENT {
                ctx.queue.ctrl.kato_ms()
            } else {
                0
            }
        }
        // Namespace specific: the namespace must be active (NSID FFFFFFFFh names all for the mask).
        feature::RESERVATION_NOTIFICATION_MASK => {
            if sqe.nsid != u32::MAX && !matches!(active_ns(ctx.queue, sqe.nsid), Ok(Some(_))) {
                return Reply::status(Status::INVALID_NAMESPACE.with_dnr());
            }
            if sel == feature::SEL_CURRENT {
                ctx.queue.ctrl.resv_mask()
            } else {
                0
            }
        }
        feature::RESERVATION_PERSISTENCE => match active_ns(ctx.queue, sqe.nsid) {
            Ok(Some(ns)) if sel == feature::SEL_CURRENT => u32::from(ns.resv.ptpl()),
            Ok(Some(_)) => 0,
            _ => return Reply::status(Status::INVALID_NAMESPACE.with_dnr()),
        },
        feature::HOST_IDENTIFIER => {
            if sqe.cdw11 & 1 == 0 {
                // Fabrics host identifiers are 128 bits; the 64-bit form does not exist here.
                return Reply::status(Status::HOST_ID_INCONSISTENT_FORMAT.with_dnr());
            }
            return Reply::Data(ctx.queue.ctrl.hostid.to_vec());
        }
        _ => unreachable!("checked above"),
    };
    Reply::ok(dw0)
}

/// Number of Queues as granted: every I/O queue the target allows, as submission and completion counts.
fn queues_granted(subsys: &Subsystem) -> u32 {
    let n = u32::from(subsys.max_io_queues().max(1) - 1);
    n | n << 16
}

fn set_features(ctx: &mut Ctx<'_>, sqe: &Sqe) -> Reply {
    let fid = sqe.cdw10 as u8;
    if sqe.cdw10 & feature::SAVE != 0 {
        return Reply::status(Status::FEATURE_NOT_SAVEABLE.with_dnr());
    }
    let discovery = ctx.queue.subsys.kind == Kind::Discovery;
    if discovery && !matches!(fid, feature::ASYNC_EVENT_CONFIG | feature::KEEP_ALIVE_TIMER) {
        return Reply::status(Status::INVALID_FIELD.with_dnr());
    }
    let v = sqe.cdw11;
    let ctrl = Arc::clone(&ctx.queue.ctrl);
    let admin = ctx.queue.admin.as_mut().expect("admin queue");
    match fid {
        feature::ARBITRATION => admin.arbitration = v,
        feature::POWER_MANAGEMENT => {
            // One power state (NPSS 0).
            if v & 0x1f != 0 {
                return Reply::status(Status::INVALID_FIELD.with_dnr());
            }
            admin.power_management = v;
        }
        feature::TEMPERATURE_THRESHOLD => {
            let (tmpsel, thsel) = ((v >> 16) & 0xf, (v >> 20) & 3);
            if tmpsel != 0 || thsel > 1 {
                return Reply::status(Status::INVALID_FIELD.with_dnr());
            }
            admin.temperature_threshold[thsel as usize] = v as u16;
        }
        feature::ERROR_RECOVERY => admin.error_recovery = v,
        feature::VOLATILE_WRITE_CACHE => admin.volatile_write_cache = v & 1 != 0,
        feature::NUMBER_OF_QUEUES => {
            if v & 0xffff == 0xffff || v >> 16 == 0xffff {
                return Reply::status(Status::INVALID_FIELD.with_dnr());
            }
            return Reply::ok(queues_granted(&ctx.queue.subsys));
        }
        feature::INTERRUPT_COALESCING => admin.interrupt_coalescing = v,
        feature::INTERRUPT_VECTOR_CONFIG => {}
        feature::WRITE_ATOMICITY => admin.write_atomicity = v,
        feature::ASYNC_EVENT_CONFIG => {
            let supported = if discovery { 0 } else { AEC_SUPPORTED };
            if v & !supported != 0 {
                return Reply::status(Status::INVALID_FIELD.with_dnr());
            }
            admin.async_event_config = v;
        }
        feature::KEEP_ALIVE_TIMER => ctrl.set_kato_ms(v),
        // Fabrics hosts give their identifier in Connect.
        feature::HOST_IDENTIFIER => {
            return Reply::status(Status::COMMAND_SEQUENCE_ERROR.with_dnr())
        }
        feature::RESERVATION_NOTIFICATION_MASK => {
            if v & !0xe != 0 {
                return Reply::status(Status::INVALID_FIELD.with_dnr());
            }
            if sqe.nsid != u32::MAX && !matches!(active_ns(ctx.queue, sqe.nsid), Ok(Some(_))) {
                return Reply::status(Status::INVALID_NAMESPACE.with_dnr());
            }
            ctrl.set_resv_mask(v);
        }
        feature::RESERVATION_PERSISTENCE => {
            let Ok(Some(ns)) = active_ns(ctx.queue, sqe.nsid) else {
                return Reply::status(Status::INVALID_NAMESPACE.with_dnr());
            };
            if let Err(status) = ns.resv.set_ptpl(v & 1 != 0) {
                return Reply::status(status);
            }
        }
        _ => return Reply::status(Status::INVALID_FIELD.with_dnr()),
    }
    Reply::ok(0)
}

/// Commands Supported and Effects: Command Supported (CSUPP).
const EFFECT_CSUPP: u32 = 1 << 0;
/// Logical Block Content Change (LBCC).
const EFFECT_LBCC: u32 = 1 << 1;

/// The Commands Supported and Effects log page (4 KiB): one dword per admin opcode (bytes 0-1023), then one per
/// I/O opcode (1024-2047). Exactly the commands [`execute`] and `crate::io::execute` run; only the writes and
/// Dataset Management (deallocate) change logical block content (as nvmet reports them).
fn effects_log() -> [u8; 4096] {
    use nvpoll::spec::io as io_op;
    let mut page = [0u8; 4096];
    let mut set =
        |at: usize, effects: u32| page[at..at + 4].copy_from_slice(&effects.to_le_bytes());
    for admin in [
        op::GET_LOG_PAGE,
        op::IDENTIFY,
        op::ABORT,
        op::SET_FEATURES,
        op::GET_FEATURES,
        op::ASYNC_EVENT_REQUEST,
        op::KEEP_ALIVE,
    ] {
        set(4 * usize::from(admin), EFFECT_CSUPP);
    }
    for plain in [
        io_op::READ,
        io_op::FLUSH,
        io_op::RESERVATION_REGISTER,
        io_op::RESERVATION_REPORT,
        io_op::RESERVATION_ACQUIRE,
        io_op::RESERVATION_RELEASE,
    ] {
        set(4 * usize::from(plain) + 1024, EFFECT_CSUPP);
    }
    for write in [io_op::WRITE, io_op::WRITE_ZEROES, io_op::DSM] {
        set(4 * usize::from(write) + 1024, EFFECT_CSUPP | EFFECT_LBCC);
    }
    page
}

fn get_log_page(ctx: &mut Ctx<'_>, sqe: &Sqe) -> Reply {
    let lid = sqe.cdw10 as u8;
    let numd = (u64::from(sqe.cdw10 >> 16) | u64::from(sqe.cdw11 & 0xffff) << 16) + 1;
    let offset = u64::from(sqe.cdw12) | u64::from(sqe.cdw13) << 32;
    if offset % 4 != 0 {
        return Reply::status(Status::INVALID_FIELD.with_dnr());
    }
    let discovery = ctx.queue.subsys.kind == Kind::Discovery;
    let page: Vec<u8> = match lid {
        log_page::DISCOVERY if discovery => {
            discovery::log_page(ctx.target, ctx.listener, ctx.local, &ctx.queue.ctrl.hostnqn)
        }
        log_page::ERROR => vec![0; 64],
        log_page::SMART if !discovery => smart_log(ctx.target).to_vec(),
        log_page::FIRMWARE_SLOT if !discovery => {
            let mut p = vec![0u8; 512];
            p[0] = 1;
            let fw = FIRMWARE.as_bytes();
            p[8..8 + fw.len().min(8)].copy_from_slice(&fw[..fw.len().min(8)]);
            p[8 + fw.len().min(8)..16].fill(b' ');
            p
        }
        // The IDs added or removed since the host last read it; Retain Asynchronous Event (bit 15) keeps them.
        log_page::CHANGED_NS if !discovery => {
            let clear = sqe.cdw10 & 1 << 15 == 0;
            encode_ns_list(&ctx.queue.ctrl.changed_ns_log(clear)).to_vec()
        }
        // The commands this controller runs, and what each changes (for the NVM command set, CSI 0).
        log_page::COMMANDS_SUPPORTED_AND_EFFECTS if !discovery => {
            if sqe.cdw14 >> 24 != 0 {
                return Reply::status(Status::INVALID_FIELD.with_dnr());
            }
            effects_log().to_vec()
        }
        // The oldest reservation notice of this controller, which the read takes.
        log_page::RESERVATION_NOTIFICATION if !discovery => {
            ctx.queue.ctrl.take_reservation_log().to_vec()
        }
        // The states of this controller's path; LSP bit 0 (RGO) leaves the NSID lists out.
        log_page::ANA if !discovery => {
            let lsp = ((sqe.cdw10 >> 8) & 0xf) as u8;
            let rgo = lsp & nvpoll::spec::ANA_LSP_RGO != 0;
            ctx.queue
                .subsys
                .ana_log(ctx.queue.ctrl.listener, rgo)
                .to_bytes()
        }
        _ => return Reply::status(Status::INVALID_LOG_PAGE.with_dnr()),
    };
    let Ok(start) = usize::try_from(offset) else {
        return Reply::status(Status::INVALID_FIELD.with_dnr());
    };
    if start > page.len() {
        return Reply::status(Status::INVALID_FIELD.with_dnr());
    }
    let len = usize::try_from(numd * 4)
        .unwrap_or(usize::MAX)
        .min(ctx.xfer_len as usize);
    let end = page.len().min(start.saturating_add(len));
    Reply::Data(page[start..end].to_vec())
}

fn smart_log(target: &TargetShared) -> [u8; nvpoll::spec::SMART_LOG_SIZE] {
    let s = target.counters();
    // Data units are thousands of 512-byte units, rounded up.
    let units = |bytes: u64| u128::from(bytes.div_ceil(512_000));
    let log = SmartLog {
        temperature: TEMPERATURE_K,
        available_spare: 100,
        available_spare_threshold: 10,
        data_units_read: units(s.bytes_read),
        data_units_written: units(s.bytes_written),
        host_read_commands: u128::from(s.reads),
        host_write_commands: u128::from(s.writes),
        power_cycles: 1,
        power_on_hours: u128::from(target.now_ms() / 3_600_000),
        ..Default::default()
    };
    log.to_bytes()
}

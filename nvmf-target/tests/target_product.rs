//! The target as a product, through its library API: one process with a plain and a TLS listener, subsystems
//! limited to some listeners, limits per subsystem, host keys per subsystem, and run-time changes (namespaces
//! that come and go with a Namespace Attribute Changed event, a subsystem removed under I/O) that the hosts of
//! other subsystems never notice.

use nvpoll_testkit::target as target_common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use nvpoll::api::{Controller, IoOp, IoRequest, QueuePair};
use nvpoll::spec::{
    cns, fabrics, feature, log_page, reg, ConnectData, ConnectResponse, Cqe, DiscoveryLog,
    IdentifyController, InvalidParameter, Sqe, Status,
};
use nvpoll_target::{
    Backing, HostAccess, HostKey, ListenerConfig, NamespaceConfig, SubsystemConfig,
    SubsystemLimits, TargetConfig, TlsMode, DISCOVERY_NQN,
};
use nvpoll_tcp::host::{ConnectOptions, TcpController};
use nvpoll_tcp::pdu::Digests;
use nvpoll_tcp::tls::{ConfiguredKey, IdentityVersion};
use target_common::{fill_pattern, pool, RawHost, Resp, TestTarget, HOSTNQN};

const PLAIN: &str = "nqn.2024-01.io.nvpoll:plain";
const SECURE: &str = "nqn.2024-01.io.nvpoll:secure";
const KEY: &str = "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:";

/// One process: a plain listener (the first) and a TLS-required one. PLAIN is on both and lets any host in;
/// SECURE is only on the TLS listener and only for HOSTNQN, whose PSK it holds.
fn two_listeners() -> (TestTarget, SocketAddr) {
    let key = ConfiguredKey::parse(KEY).unwrap();
    // Port 0 on the TLS listener: the subsystem names it by address, so bind it first to learn the port.
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let tls_addr = probe.local_addr().unwrap();
    drop(probe);
    let plain = SubsystemConfig::new(PLAIN).namespace(Backing::Ram(16 << 20), 512);
    let mut secure = SubsystemConfig::new(SECURE)
        .namespace(Backing::Ram(16 << 20), 4096)
        .allow_host(HOSTNQN)
        .host_key(HOSTNQN, key);
    secure.listeners = Some(vec![tls_addr]);
    let t = TestTarget::start_with(
        TargetConfig::new("127.0.0.1:0".parse().unwrap())
            .listener(tls_addr, TlsMode::Required)
            .subsystem(plain)
            .subsystem(secure),
    );
    (t, tls_addr)
}

/// Writes 64 KiB of a pattern at LBA 0 of the first namespace and reads them back, on a new queue pair.
fn write_read(ctrl: &mut TcpController, seed: u64) {
    let mut qp = ctrl.create_queue_pair(16).unwrap();
    write_read_on(ctrl, &mut qp, seed);
}

/// The same on an existing queue pair of `ctrl`.
fn write_read_on(ctrl: &TcpController, qp: &mut impl QueuePair, seed: u64) {
    let ns = ctrl.namespaces()[0].clone();
    let pool = ctrl.pool().clone();
    let len = 64 * 1024;
    let mut w = pool.alloc(len).unwrap();
    fill_pattern(w.as_mut_slice(), seed);
    let expect = w.as_slice().to_vec();
    let blocks = (len as u32) / ns.block_size;
    let mut read_back = None;
    for (tag, op, buf) in [
        (1, IoOp::Write, w),
        (2, IoOp::Read, pool.alloc(len).unwrap()),
    ] {
        qp.submit(IoRequest {
            op,
            nsid: ns.nsid,
            lba: 0,
            blocks,
            buf: Some(buf),
            tag,
        })
        .map_err(|r| r.error)
        .unwrap();
        qp.flush().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while qp.outstanding() > 0 {
            qp.process_completions(8, |_, c| {
                c.result.as_ref().expect("I/O succeeds");
                if c.tag == 2 {
                    read_back = c.buf.as_ref().map(|b| b.as_slice().to_vec());
                }
            })
            .unwrap();
            assert!(Instant::now() < deadline, "I/O timed out");
        }
    }
    assert!(read_back.unwrap() == expect, "data read back as written");
}

fn tls_opts(addr: SocketAddr, subnqn: &str) -> ConnectOptions {
    ConnectOptions::new(addr, subnqn, HOSTNQN)
        .with_tls_key(&ConfiguredKey::parse(KEY).unwrap(), IdentityVersion::V1)
}

fn refused_with(r: Result<TcpController, nvpoll_tcp::Error>, what: &str) {
    match r {
        Err(nvpoll_tcp::Error::Refused(r)) => {
            assert!(
                r.status.is(Status::CONNECT_INVALID_PARAMETERS)
                    || r.status.is(Status::CONNECT_INVALID_HOST),
                "{what}: {r:?}"
            )
        }
        Err(e) => panic!("{what}: expected Connect Invalid Parameters, got {e:?}"),
        Ok(_) => panic!("{what}: the Connect was accepted"),
    }
}

/// The subsystem NQNs the discovery log shows at `addr` (plain), and the port IDs it names.
fn discovered(addr: SocketAddr) -> (Vec<String>, Vec<u16>) {
    let mut h = RawHost::connect(addr);
    h.icreq(Digests::NONE);
    let cd = ConnectData {
        hostid: [5; 16],
        cntlid: fabrics::CNTLID_DYNAMIC,
        subnqn: DISCOVERY_NQN.into(),
        hostnqn: HOSTNQN.into(),
    };
    assert!(h.fabrics_connect(0, 31, 0, 0, &cd).status().is_success());
    let (cqe, page) = h.run(
        Sqe::get_log_page(log_page::DISCOVERY, 0, 4096, 0),
        &[],
        4096,
        &[],
    );
    assert!(cqe.status().is_success());
    let log = DiscoveryLog::parse(&page).unwrap();
    let nqns = log.entries.iter().map(|e| e.subnqn.clone()).collect();
    let ports = log.entries.iter().map(|e| e.portid).collect();
    (nqns, ports)
}

#[test]
fn one_process_serves_a_plain_and_a_tls_listener() {
    let (t, tls_addr) = two_listeners();
    let listeners = t.handle.listeners();
    assert_eq!(listeners.len(), 2);
    assert_eq!(listeners[0].tls, TlsMode::Off);
    assert_eq!(
        listeners[1],
        ListenerConfig {
            address: tls_addr,
            tls: TlsMode::Required
        }
    );
    // Plain on the first listener, TLS on the second, both at once.
    let mut plain = TcpController::connect(ConnectOptions::new(t.addr, PLAIN, HOSTNQN), pool())
        .expect("plain host on the plain listener");
    let mut secure = TcpController::connect(tls_opts(tls_addr, SECURE), pool())
        .expect("TLS host on the TLS listener");
    write_read(&mut plain, 1);
    write_read(&mut secure, 2);
    // PLAIN is on the TLS listener too (over TLS, with the key HOSTNQN holds for SECURE: a host proves itself
    // for the subsystem it names, with a key it holds for it; PLAIN has none, so this one is refused).
    assert!(TcpController::connect(tls_opts(tls_addr, PLAIN), pool()).is_err());
    // SECURE is not exported on the plain listener.
    refused_with(
        TcpController::connect(ConnectOptions::new(t.addr, SECURE, HOSTNQN), pool()),
        "SECURE on the plain listener",
    );
    assert!(!t.events_matching("not exported on listener").is_empty());
    // The TLS listener refuses plaintext.
    assert!(TcpController::connect(ConnectOptions::new(tls_addr, PLAIN, HOSTNQN), pool()).is_err());
    // The plain listener's discovery log lists only what is exported there, under its own port ID.
    let (nqns, ports) = discovered(t.addr);
    assert_eq!(nqns, [PLAIN]);
    assert_eq!(ports, [1]);
    drop((plain, secure));
}

#[test]
fn listeners_come_and_go_at_run_time() {
    let (t, _) = two_listeners();
    let extra = t
        .handle
        .add_listener(ListenerConfig {
            address: "127.0.0.1:0".parse().unwrap(),
            tls: TlsMode::Off,
        })
        .unwrap();
    assert_ne!(extra.port(), 0, "the real port is returned");
    // Connections wait in the backlog until the acceptor adopts the socket: no retry is needed.
    let mut c = TcpController::connect(ConnectOptions::new(extra, PLAIN, HOSTNQN), pool())
        .expect("a host on the new listener");
    let mut qp = c.create_queue_pair(16).unwrap();
    write_read_on(&c, &mut qp, 3);
    let (_, ports) = discovered(extra);
    assert_eq!(ports, [3], "the new listener has its own port ID");
    assert!(t
        .handle
        .add_listener(ListenerConfig {
            address: extra,
            tls: TlsMode::Off
        })
        .is_err());
    t.handle.remove_listener(extra).unwrap();
    assert!(t.handle.remove_listener(extra).is_err());
    // The port closes on the acceptor's next poll; the connection made through it stays.
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::net::TcpStream::connect(extra).is_ok() {
        assert!(
            Instant::now() < deadline,
            "the removed listener still accepts"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    write_read_on(&c, &mut qp, 4);
    assert_eq!(t.handle.listeners().len(), 2);
}

#[test]
fn limits_are_per_subsystem() {
    let mut small = SubsystemConfig::new(PLAIN).namespace(Backing::Ram(1 << 20), 512);
    small.limits = SubsystemLimits {
        max_io_queues: Some(4),
        queue_entries: Some(32),
        mdts: Some(5),
    };
    let big = SubsystemConfig::new(SECURE).namespace(Backing::Ram(1 << 20), 512);
    let t = TestTarget::start_with(
        TargetConfig::new("127.0.0.1:0".parse().unwrap())
            .subsystem(small)
            .subsystem(big),
    );
    let (mut h, _) = RawHost::admin_queue(t.addr, PLAIN, 0);
    let (cqe, page) = h.run(Sqe::identify(cns::CONTROLLER, 0), &[], 4096, &[]);
    assert!(cqe.status().is_success());
    let id = IdentifyController::parse(&page).unwrap();
    assert_eq!((id.mdts, id.maxcmd), (5, 32));
    let (cqe, _) = h.run(fabrics_property_get_cap(), &[], 0, &[]);
    assert_eq!(cqe.dw0 & 0xffff, 31, "CAP.MQES");
    let (cqe, _) = h.run(
        Sqe::set_features(feature::NUMBER_OF_QUEUES, 0x00ff_00ff),
        &[],
        0,
        &[],
    );
    assert_eq!(cqe.dw0, 3 | 3 << 16, "4 I/O queues granted");
    // A queue deeper than the subsystem allows is refused (SQSIZE), in the other subsystem it is not.
    let mut q = RawHost::connect(t.addr);
    q.icreq(Digests::NONE);
    let cd = ConnectData {
        hostid: [9; 16],
        cntlid: fabrics::CNTLID_DYNAMIC,
        subnqn: PLAIN.into(),
        hostnqn: HOSTNQN.into(),
    };
    assert_eq!(
        ConnectResponse::from_cqe(&q.fabrics_connect(0, 63, 0, 0, &cd)),
        ConnectResponse::Rejected {
            status: Status::CONNECT_INVALID_PARAMETERS.with_dnr(),
            invalid: Some(InvalidParameter::SQSIZE),
        }
    );
    let (mut h2, _) = RawHost::admin_queue(t.addr, SECURE, 0);
    let (_, page) = h2.run(Sqe::identify(cns::CONTROLLER, 0), &[], 4096, &[]);
    let id = IdentifyController::parse(&page).unwrap();
    assert_eq!((id.mdts, id.maxcmd), (8, 128), "the target's defaults");
}

fn fabrics_property_get_cap() -> Sqe {
    Sqe::property_get(reg::CAP, true)
}

/// An admin queue with namespace notices enabled and one AER outstanding; returns the host and the AER's cid.
fn admin_with_aer(addr: SocketAddr, nqn: &str) -> (RawHost, u16, u16) {
    let (mut h, cntlid) = RawHost::admin_queue(addr, nqn, 0);
    let (cqe, _) = h.run(
        Sqe::set_features(feature::ASYNC_EVENT_CONFIG, feature::AEC_NS_ATTRIBUTE),
        &[],
        0,
        &[],
    );
    assert!(cqe.status().is_success());
    let cid = send_aer(&mut h);
    (h, cntlid, cid)
}

fn send_aer(h: &mut RawHost) -> u16 {
    let mut sqe = Sqe::async_event_request();
    sqe.cid = h.cid();
    h.send_cmd(sqe, &[], 0);
    sqe.cid
}

fn next_cqe(h: &mut RawHost) -> Cqe {
    match h.recv() {
        Some(Resp::Cqe(c)) => c,
        other => panic!("expected a completion, got {other:?}"),
    }
}

fn active_namespaces(h: &mut RawHost) -> Vec<u32> {
    let (cqe, page) = h.run(Sqe::identify(cns::ACTIVE_NS_LIST, 0), &[], 4096, &[]);
    assert!(cqe.status().is_success());
    page.chunks(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .take_while(|&id| id != 0)
        .collect()
}

fn changed_namespaces(h: &mut RawHost) -> Vec<u32> {
    let (cqe, page) = h.run(
        Sqe::get_log_page(log_page::CHANGED_NS, 0, 4096, 0),
        &[],
        4096,
        &[],
    );
    assert!(cqe.status().is_success());
    page.chunks(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .take_while(|&id| id != 0)
        .collect()
}

#[test]
fn namespaces_added_and_removed_raise_namespace_attribute_changed() {
    let (t, _) = two_listeners();
    let (mut h, _, aer) = admin_with_aer(t.addr, PLAIN);
    // Another controller of PLAIN that did not enable namespace notices: it must hear nothing.
    let (mut other, _) = RawHost::admin_queue(t.addr, PLAIN, 0);
    assert_eq!(active_namespaces(&mut h), [1]);
    let ram = |nsid| NamespaceConfig {
        backing: Backing::Ram(4 << 20),
        block_size: 512,
        nsid,
        ana_group: 1,
        uuid: None,
    };
    assert_eq!(t.handle.add_namespace(PLAIN, &ram(Some(7))).unwrap(), 7);
    let cqe = next_cqe(&mut h);
    assert_eq!(cqe.cid, aer);
    assert!(cqe.status().is_success());
    assert_eq!(
        cqe.dw0, 0x0004_0002,
        "Notice, Namespace Attribute Changed, log page 04h"
    );
    assert_eq!(changed_namespaces(&mut h), [7]);
    assert!(changed_namespaces(&mut h).is_empty(), "reading clears it");
    assert_eq!(active_namespaces(&mut h), [1, 7]);
    // A new controller sees it at once.
    let mut c =
        TcpController::connect(ConnectOptions::new(t.addr, PLAIN, HOSTNQN), pool()).unwrap();
    let ids: Vec<u32> = c.namespaces().iter().map(|n| n.nsid).collect();
    assert_eq!(ids, [1, 7]);
    let mut qp = c.create_queue_pair(4).unwrap();
    // A change while no AER is held waits for the next one.
    assert_eq!(t.handle.add_namespace(PLAIN, &ram(None)).unwrap(), 2);
    t.handle.remove_namespace(PLAIN, 7).unwrap();
    let aer = send_aer(&mut h);
    let cqe = next_cqe(&mut h);
    assert_eq!((cqe.cid, cqe.dw0), (aer, 0x0004_0002));
    assert_eq!(changed_namespaces(&mut h), [2, 7]);
    assert_eq!(active_namespaces(&mut h), [1, 2]);
    // I/O to the removed namespace fails cleanly on an I/O queue that was already connected.
    let buf = pool().alloc(4096).unwrap();
    qp.submit(IoRequest {
        op: IoOp::Read,
        nsid: 7,
        lba: 0,
        blocks: 8,
        buf: Some(buf),
        tag: 9,
    })
    .map_err(|r| r.error)
    .unwrap();
    qp.flush().unwrap();
    let mut result = None;
    let deadline = Instant::now() + Duration::from_secs(10);
    while result.is_none() {
        qp.process_completions(1, |_, c| {
            result = Some(
                c.result
                    .as_ref()
                    .map_err(|e| match e {
                        nvpoll::Error::Nvme(s) => nvpoll::Error::Nvme(*s),
                        other => nvpoll::Error::Transport(other.to_string().into()),
                    })
                    .copied(),
            )
        })
        .unwrap();
        assert!(Instant::now() < deadline);
    }
    match result.unwrap() {
        Err(nvpoll::Error::Nvme(status)) => {
            assert!(status.status.is(Status::INVALID_NAMESPACE), "{status:?}")
        }
        other => panic!("expected Invalid Namespace, got {other:?}"),
    }
    // Bad changes are refused and change nothing.
    assert!(t.handle.add_namespace(PLAIN, &ram(Some(1))).is_err());
    assert!(t.handle.remove_namespace(PLAIN, 7).is_err());
    assert!(t.handle.add_namespace("nqn.nope", &ram(None)).is_err());
    assert!(t.handle.add_namespace(DISCOVERY_NQN, &ram(None)).is_err());
    let plain = t
        .handle
        .subsystems()
        .into_iter()
        .find(|s| s.nqn == PLAIN)
        .unwrap();
    let ids: Vec<u32> = plain.namespaces.iter().map(|n| n.nsid).collect();
    assert_eq!(ids, [1, 2]);
    assert!(
        other.still_open_after(Duration::from_millis(50)),
        "no event for a host that did not ask"
    );
}

#[test]
fn a_write_in_flight_finishes_on_a_namespace_removed_under_it() {
    let t = TestTarget::start(|c| c);
    let (_admin, cntlid) = RawHost::admin_queue(t.addr, target_common::NQN, 0);
    let (mut q, cqe) = RawHost::io_queue(t.addr, cntlid, 1, 31, 0, Digests::NONE);
    assert!(cqe.status().is_success());
    // 64 KiB write to namespace 1 (512-byte blocks): the target asks for the data with R2T.
    let mut sqe = Sqe::write(1, 0, 127);
    sqe.cid = q.cid();
    q.send_cmd(sqe, &[], 65536);
    let r2t = match q.recv() {
        Some(Resp::R2T(r)) => r,
        other => panic!("expected R2T, got {other:?}"),
    };
    t.handle.remove_namespace(target_common::NQN, 1).unwrap();
    let data = vec![0x5a; 65536];
    let mut b = Vec::new();
    nvpoll_tcp::pdu::encode_h2c_data(
        &mut b,
        &nvpoll_tcp::pdu::H2CDataHdr {
            cccid: r2t.cccid,
            ttag: r2t.ttag,
            datao: 0,
            datal: 65536,
            last: true,
        },
        &data,
        Digests::NONE,
        0,
    );
    q.send(&b);
    let cqe = next_cqe(&mut q);
    assert_eq!(cqe.cid, sqe.cid);
    assert!(
        cqe.status().is_success(),
        "the write finished: {:?}",
        cqe.status()
    );
    // The next command to it sees it gone.
    let (cqe, _) = q.run(Sqe::read(1, 0, 7), &[], 4096, &[]);
    assert!(cqe.status().is(Status::INVALID_NAMESPACE));
}

#[test]
fn removing_a_subsystem_aborts_what_it_holds_and_no_other_host_notices() {
    let (t, tls_addr) = two_listeners();
    // A host of SECURE doing I/O over TLS all along.
    let mut secure = TcpController::connect(tls_opts(tls_addr, SECURE), pool()).unwrap();
    write_read(&mut secure, 5);
    // On PLAIN: an admin queue holding an AER, and an I/O queue with a write waiting for its data.
    let (mut admin, cntlid, aer) = admin_with_aer(t.addr, PLAIN);
    let mut q = RawHost::connect(t.addr);
    q.icreq(Digests::NONE);
    let cd = ConnectData {
        hostid: [7; 16],
        cntlid,
        subnqn: PLAIN.into(),
        hostnqn: HOSTNQN.into(),
    };
    assert!(q.fabrics_connect(1, 31, 0, 0, &cd).status().is_success());
    let mut sqe = Sqe::write(1, 0, 127);
    sqe.cid = q.cid();
    q.send_cmd(sqe, &[], 65536);
    assert!(matches!(q.recv(), Some(Resp::R2T(_))));

    t.handle.remove_subsystem(PLAIN).unwrap();
    // Each queue answers what it held, then closes.
    let cqe = next_cqe(&mut q);
    assert_eq!(cqe.cid, sqe.cid);
    assert!(
        cqe.status().is(Status::ABORTED_SQ_DELETION),
        "{:?}",
        cqe.status()
    );
    assert_eq!(
        q.expect_close(),
        None,
        "closed without a termination request"
    );
    let cqe = next_cqe(&mut admin);
    assert_eq!(cqe.cid, aer);
    assert!(cqe.status().is(Status::ABORTED_SQ_DELETION));
    assert_eq!(admin.expect_close(), None);
    t.wait_event("subsystem nqn.2024-01.io.nvpoll:plain was removed");
    // It is gone for new hosts, and the other subsystem's host never noticed.
    refused_with(
        TcpController::connect(ConnectOptions::new(t.addr, PLAIN, HOSTNQN), pool()),
        "a removed subsystem",
    );
    assert!(t.handle.remove_subsystem(PLAIN).is_err());
    write_read(&mut secure, 6);
    assert_eq!(discovered(t.addr).0, Vec::<String>::new());
    // It can come back, with another configuration.
    t.handle
        .add_subsystem(&SubsystemConfig::new(PLAIN).namespace(Backing::Ram(1 << 20), 4096))
        .unwrap();
    assert!(t
        .handle
        .add_subsystem(&SubsystemConfig::new(PLAIN))
        .is_err());
    let c = TcpController::connect(ConnectOptions::new(t.addr, PLAIN, HOSTNQN), pool()).unwrap();
    assert_eq!(c.namespaces()[0].block_size, 4096);
}

#[test]
fn hosts_and_keys_change_at_run_time() {
    let (t, tls_addr) = two_listeners();
    const OTHER: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-0000000000aa";
    // PLAIN: any host, then only OTHER, then any host again. Adding a host to a subsystem open to any host
    // is refused rather than silently locking every other host out.
    assert!(t.handle.allow_host(PLAIN, OTHER).is_err());
    t.handle.set_allow_any_host(PLAIN, false).unwrap();
    t.handle.allow_host(PLAIN, OTHER).unwrap();
    refused_with(
        TcpController::connect(ConnectOptions::new(t.addr, PLAIN, HOSTNQN), pool()),
        "HOSTNQN after allow_host(OTHER)",
    );
    TcpController::connect(ConnectOptions::new(t.addr, PLAIN, OTHER), pool()).unwrap();
    assert!(
        t.handle.allow_host(PLAIN, OTHER).is_err(),
        "allowed already"
    );
    t.handle.disallow_host(PLAIN, OTHER).unwrap();
    assert_eq!(
        t.handle
            .subsystems()
            .iter()
            .find(|s| s.nqn == PLAIN)
            .unwrap()
            .hosts,
        HostAccess::Only(vec![])
    );
    t.handle.set_allow_any_host(PLAIN, true).unwrap();
    TcpController::connect(ConnectOptions::new(t.addr, PLAIN, HOSTNQN), pool()).unwrap();
    // SECURE: HOSTNQN's key removed, then another one set.
    t.handle.remove_host_key(SECURE, HOSTNQN).unwrap();
    assert!(TcpController::connect(tls_opts(tls_addr, SECURE), pool()).is_err());
    assert!(t.handle.remove_host_key(SECURE, HOSTNQN).is_err());
    const KEY2: &str = "NVMeTLSkey-1:01:MDAxMTIyMzM0NDU1NjY3Nzg4OTlhYWJiY2NkZGVlZmZwJEiQ:";
    let key2 = ConfiguredKey::parse(KEY2).unwrap();
    t.handle
        .set_host_key(
            SECURE,
            HostKey {
                hostnqn: HOSTNQN.into(),
                key: key2.clone(),
            },
        )
        .unwrap();
    let o = ConnectOptions::new(tls_addr, SECURE, HOSTNQN).with_tls_key(&key2, IdentityVersion::V0);
    let mut c = TcpController::connect(o, pool()).expect("the new key lets the host in");
    write_read(&mut c, 7);
    let info = t.handle.subsystems();
    let s = info.iter().find(|s| s.nqn == SECURE).unwrap();
    assert_eq!(s.hosts_with_keys, [HOSTNQN]);
    let shown = format!("{info:?}");
    assert!(
        !shown.contains("NVMeTLSkey") && !shown.contains("MDAx"),
        "{shown}"
    );
}

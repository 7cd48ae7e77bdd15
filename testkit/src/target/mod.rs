//! What the target tests share: a target on its own reactor, a DMA pool for our initiator, and a raw host that
//! speaks NVMe/TCP PDU by PDU (to script both good and hostile hosts).

pub mod kernel;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nvpoll::mem::DmaPool;
use nvpoll::reactor::{CoreList, Reactors};
use nvpoll::spec::{fabrics, reg, Cc, ConnectData, Cqe, SglDescriptor, Sqe};
use nvpoll_target::{Backing, SubsystemConfig, Target, TargetConfig, TargetCounters, TargetHandle};
use nvpoll_tcp::pdu::{self, Decoded, Digests, Pdu};

/// The subsystem every test target serves.
pub const NQN: &str = "nqn.2024-01.io.nvpoll:test";
/// The host NQN the tests use.
pub const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-00000000cafe";
/// Namespace 1: 64 MiB of RAM in 512-byte blocks.
pub const NS1_BYTES: u64 = 64 << 20;
/// Namespace 2: 32 MiB of RAM in 4096-byte blocks.
pub const NS2_BYTES: u64 = 32 << 20;

/// A target on one reactor, stopped when dropped. Its events are kept as text lines.
pub struct TestTarget {
    /// Where the target listens.
    pub addr: SocketAddr,
    /// The target, to change or count it while it runs.
    pub handle: TargetHandle,
    /// Every event line the target logged, in order.
    pub events: Arc<Mutex<Vec<String>>>,
    reactors: Option<Reactors>,
}

impl TestTarget {
    /// The default test subsystem (two RAM namespaces) with the given tweaks.
    pub fn start(tweak: impl FnOnce(TargetConfig) -> TargetConfig) -> TestTarget {
        Self::start_with(tweak(default_config()))
    }

    /// A target with exactly this configuration (its events are recorded in addition to any callback).
    pub fn start_with(config: TargetConfig) -> TestTarget {
        Self::start_on("0", config)
    }

    /// A target on reactors on `cores` (a core list such as "0,1").
    pub fn start_on(cores: &str, config: TargetConfig) -> TestTarget {
        Self::start_idle(cores, nvpoll::reactor::IdlePolicy::Poll, config)
    }

    /// A target on reactors on `cores` with the given idle policy.
    pub fn start_idle(
        cores: &str,
        idle: nvpoll::reactor::IdlePolicy,
        mut config: TargetConfig,
    ) -> TestTarget {
        let events = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&events);
        let prev = config.events.take();
        config = config.on_event(move |e| {
            sink.lock().unwrap().push(e.to_string());
            if let Some(f) = &prev {
                f(e);
            }
        });
        let target = Target::bind(config).expect("bind the target");
        let addr = target.local_addr();
        let reactors = Reactors::builder()
            .idle(idle)
            .start(&cores.parse::<CoreList>().unwrap())
            .expect("reactors");
        let handle = target.start(&reactors).expect("start the target");
        TestTarget {
            addr,
            handle,
            events,
            reactors: Some(reactors),
        }
    }

    /// The target's counters now.
    pub fn counters(&self) -> TargetCounters {
        self.handle.counters()
    }

    /// The target reactors' counters (pollers registered, CPU time, ...).
    pub fn reactor_stats(&self) -> Vec<nvpoll::reactor::ReactorStats> {
        self.reactors.as_ref().expect("running").stats()
    }

    /// Waits until `f` holds for the counters (they are published by idle sessions).
    pub fn wait_counters(&self, what: &str, f: impl Fn(&TargetCounters) -> bool) -> TargetCounters {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let c = self.counters();
            if f(&c) {
                return c;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; counters: {c}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Waits until some event contains `needle`; returns all that do.
    pub fn wait_event(&self, needle: &str) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let found = self.events_matching(needle);
            if !found.is_empty() {
                return found;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for an event with '{needle}'"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The event lines that contain `needle`.
    pub fn events_matching(&self, needle: &str) -> Vec<String> {
        self.events
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains(needle))
            .cloned()
            .collect()
    }
}

impl Drop for TestTarget {
    fn drop(&mut self) {
        self.handle.stop();
        if let Some(r) = self.reactors.take() {
            r.stop().expect("the reactor stops cleanly (no panic)");
        }
    }
}

/// The default test subsystem (two RAM namespaces) on a listener on a free port.
pub fn default_config() -> TargetConfig {
    let subsys = SubsystemConfig::new(NQN)
        .namespace(Backing::Ram(NS1_BYTES), 512)
        .namespace(Backing::Ram(NS2_BYTES), 4096);
    TargetConfig::new("127.0.0.1:0".parse().unwrap()).subsystem(subsys)
}

/// A DMA pool for the initiator (ordinary pages are fine for TCP).
pub fn pool() -> DmaPool {
    DmaPool::builder()
        .class(4096, 256)
        .class(16384, 256)
        .class(1 << 20, 16)
        .hugepages(nvpoll::mem::HugepageMode::Off)
        .build()
        .expect("DMA pool")
}

/// A deterministic byte pattern.
pub fn fill_pattern(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

/// A host scripted PDU by PDU over a blocking socket with a read timeout.
pub struct RawHost {
    /// The connection.
    pub s: TcpStream,
    /// The digests negotiated (ICReq/ICResp).
    pub digests: Digests,
    rx: Vec<u8>,
    next_cid: u16,
}

/// What [`RawHost::poll_recv`] got.
#[derive(Debug)]
pub enum Polled {
    /// A PDU.
    Pdu(Resp),
    /// The target closed the connection.
    Closed,
    /// Nothing within the wait.
    Nothing,
}

/// A response PDU, decoded (data copied out).
#[derive(Debug)]
pub enum Resp {
    /// The ICResp.
    IcResp(pdu::IcResp),
    /// A termination request: its fatal error status and information.
    TermReq {
        /// Fatal error status.
        fes: u16,
        /// Fatal error information.
        fei: u32,
    },
    /// A completion (CapsuleResp).
    Cqe(Cqe),
    /// A C2HData PDU and its data.
    C2H {
        /// Its header.
        hdr: pdu::C2HDataHdr,
        /// Its data.
        data: Vec<u8>,
    },
    /// An R2T.
    R2T(pdu::R2T),
}

impl RawHost {
    /// Connects a TCP socket to `addr` (no ICReq yet).
    pub fn connect(addr: SocketAddr) -> RawHost {
        let s = TcpStream::connect(addr).expect("TCP connect");
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.set_nodelay(true).unwrap();
        RawHost {
            s,
            digests: Digests::NONE,
            rx: Vec::new(),
            next_cid: 1,
        }
    }

    /// Writes `bytes` as they are.
    pub fn send(&mut self, bytes: &[u8]) {
        self.s.write_all(bytes).expect("send");
    }

    /// ICReq with the given digests; returns the ICResp.
    pub fn icreq(&mut self, digests: Digests) -> pdu::IcResp {
        let mut b = Vec::new();
        pdu::encode_ic_req(
            &mut b,
            &pdu::IcReq {
                pfv: 0,
                hpda: 0,
                digests,
                maxr2t: 0,
            },
        );
        self.send(&b);
        match self.recv() {
            Some(Resp::IcResp(r)) => {
                self.digests = r.digests;
                r
            }
            other => panic!("expected ICResp, got {other:?}"),
        }
    }

    /// Receives one PDU; `None` when the target closed the connection.
    pub fn recv(&mut self) -> Option<Resp> {
        match self.poll_recv(Duration::from_secs(5)) {
            Polled::Pdu(r) => Some(r),
            Polled::Closed => None,
            Polled::Nothing => panic!("receive: nothing from the target for 5 s"),
        }
    }

    /// Receives one PDU if one arrives within `wait` (the bytes of one cut short are kept for the next call).
    pub fn poll_recv(&mut self, wait: Duration) -> Polled {
        let cfg = pdu::DecodeConfig::new(pdu::Direction::ToHost, self.digests, 16 << 20);
        let deadline = Instant::now() + wait;
        loop {
            match pdu::decode(&self.rx, &cfg).expect("the target sends valid PDUs") {
                Decoded::Pdu { pdu, len } => {
                    let r = match pdu {
                        Pdu::IcResp(r) => Resp::IcResp(r),
                        Pdu::C2HTermReq(t) => Resp::TermReq {
                            fes: t.fes,
                            fei: t.fei,
                        },
                        Pdu::CapsuleResp { cqe } => Resp::Cqe(cqe),
                        Pdu::C2HData { hdr, data } => Resp::C2H {
                            hdr,
                            data: data.to_vec(),
                        },
                        Pdu::R2T(r) => Resp::R2T(r),
                        other => panic!("unexpected {} from the target", other.pdu_type()),
                    };
                    self.rx.drain(..len);
                    return Polled::Pdu(r);
                }
                Decoded::Incomplete { .. } => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Polled::Nothing;
                    }
                    // A socket timeout is rounded up to the kernel's tick (4 ms at HZ=250): short waits spin
                    // on a non-blocking read instead.
                    let short = left < Duration::from_millis(10);
                    if short {
                        self.s.set_nonblocking(true).unwrap();
                    } else {
                        self.s.set_read_timeout(Some(left)).unwrap();
                    }
                    let mut chunk = [0u8; 65536];
                    let got = loop {
                        match self.s.read(&mut chunk) {
                            Err(e)
                                if short
                                    && e.kind() == ErrorKind::WouldBlock
                                    && Instant::now() < deadline =>
                            {
                                std::thread::yield_now()
                            }
                            other => break other,
                        }
                    };
                    if short {
                        self.s.set_nonblocking(false).unwrap();
                    }
                    self.s
                        .set_read_timeout(Some(Duration::from_secs(5)))
                        .unwrap();
                    match got {
                        Ok(0) => return Polled::Closed,
                        Ok(n) => self.rx.extend_from_slice(&chunk[..n]),
                        Err(e)
                            if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) =>
                        {
                            return Polled::Nothing
                        }
                        Err(e) if e.kind() == ErrorKind::ConnectionReset => return Polled::Closed,
                        Err(e) => panic!("receive: {e}"),
                    }
                }
            }
        }
    }

    /// Waits for the target to close the connection, skipping PDUs; returns the termination request if one came.
    pub fn expect_close(&mut self) -> Option<(u16, u32)> {
        let mut term = None;
        while let Some(r) = self.recv() {
            if let Resp::TermReq { fes, fei } = r {
                term = Some((fes, fei));
            }
        }
        term
    }

    /// Whether the connection is still open after `wait` (no PDU may arrive meanwhile).
    pub fn still_open_after(&mut self, wait: Duration) -> bool {
        self.s.set_read_timeout(Some(wait)).unwrap();
        let mut b = [0u8; 1];
        let open = match self.s.read(&mut b) {
            Ok(0) => false,
            Ok(_) => panic!("unexpected data from the target"),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => true,
            Err(_) => false,
        };
        self.s
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        open
    }

    /// A fresh command ID.
    pub fn cid(&mut self) -> u16 {
        self.next_cid = self.next_cid.wrapping_add(1);
        self.next_cid
    }

    /// Sends a command capsule: in-capsule data if `data` is not empty, else a transport SGL of `xfer_len`.
    pub fn send_cmd(&mut self, mut sqe: Sqe, data: &[u8], xfer_len: u32) {
        if !data.is_empty() {
            sqe.set_sgl(&SglDescriptor::in_capsule(0, data.len() as u32));
        } else {
            sqe.set_sgl(&SglDescriptor::transport_data_block(xfer_len));
        }
        let mut b = Vec::new();
        pdu::encode_capsule_cmd(&mut b, &sqe, data, self.digests, 0);
        self.send(&b);
    }

    /// Runs a command: answers R2Ts with `h2c` data, collects C2HData, returns the completion and the data.
    pub fn run(&mut self, mut sqe: Sqe, data: &[u8], xfer_len: u32, h2c: &[u8]) -> (Cqe, Vec<u8>) {
        sqe.cid = self.cid();
        self.run_as(sqe, data, xfer_len, h2c)
    }

    /// As [`RawHost::run`], with the command ID already in `sqe` (a host that reuses one, say).
    pub fn run_as(&mut self, sqe: Sqe, data: &[u8], xfer_len: u32, h2c: &[u8]) -> (Cqe, Vec<u8>) {
        self.send_cmd(sqe, data, xfer_len);
        let mut got = Vec::new();
        loop {
            match self.recv() {
                Some(Resp::Cqe(cqe)) => {
                    assert_eq!(cqe.cid, sqe.cid);
                    return (cqe, got);
                }
                Some(Resp::C2H { hdr, data }) => {
                    assert_eq!(hdr.cccid, sqe.cid);
                    assert_eq!(hdr.datao as usize, got.len());
                    got.extend_from_slice(&data);
                    if hdr.success {
                        let cqe = Cqe {
                            cid: sqe.cid,
                            ..Default::default()
                        };
                        return (cqe, got);
                    }
                }
                Some(Resp::R2T(r)) => {
                    let mut b = Vec::new();
                    let chunk = &h2c[r.r2to as usize..(r.r2to + r.r2tl) as usize];
                    let hdr = pdu::H2CDataHdr {
                        cccid: r.cccid,
                        ttag: r.ttag,
                        datao: r.r2to,
                        datal: r.r2tl,
                        last: true,
                    };
                    pdu::encode_h2c_data(&mut b, &hdr, chunk, self.digests, 0);
                    self.send(&b);
                }
                other => panic!("unexpected {other:?} while running a command"),
            }
        }
    }

    /// Fabrics Connect; returns its completion.
    pub fn fabrics_connect(
        &mut self,
        qid: u16,
        sqsize: u16,
        cattr: u8,
        kato_ms: u32,
        cd: &ConnectData,
    ) -> Cqe {
        let sqe = Sqe::fabrics_connect(qid, sqsize, cattr, kato_ms);
        self.run(sqe, &cd.to_bytes(), 0, &[]).0
    }

    /// ICReq, admin Connect to `nqn`, CC.EN=1; returns the controller ID.
    pub fn admin_queue(addr: SocketAddr, nqn: &str, kato_ms: u32) -> (RawHost, u16) {
        RawHost::admin_queue_as(addr, nqn, kato_ms, HOSTNQN, [7; 16])
    }

    /// [`RawHost::admin_queue`] for host `hostnqn` with identifier `hostid`.
    pub fn admin_queue_as(
        addr: SocketAddr,
        nqn: &str,
        kato_ms: u32,
        hostnqn: &str,
        hostid: [u8; 16],
    ) -> (RawHost, u16) {
        let mut h = RawHost::connect(addr);
        h.icreq(Digests::NONE);
        let cd = ConnectData {
            hostid,
            cntlid: fabrics::CNTLID_DYNAMIC,
            subnqn: nqn.into(),
            hostnqn: hostnqn.into(),
        };
        let cqe = h.fabrics_connect(0, 31, 0, kato_ms, &cd);
        assert!(
            cqe.status().is_success(),
            "admin connect: {:?}",
            cqe.status()
        );
        let cntlid = cqe.dw0 as u16;
        h.enable();
        (h, cntlid)
    }

    /// CC.EN=1 with the NVM command set's entry sizes, on an admin queue.
    pub fn enable(&mut self) {
        let mut cc = Cc(0);
        cc.set_en(true);
        cc.set_iosqes(6);
        cc.set_iocqes(4);
        let (cqe, _) = self.run(
            Sqe::property_set(reg::CC, false, u64::from(cc.0)),
            &[],
            0,
            &[],
        );
        assert!(cqe.status().is_success());
    }

    /// ICReq and an I/O queue Connect on controller `cntlid`; returns the host and the Connect completion.
    pub fn io_queue(
        addr: SocketAddr,
        cntlid: u16,
        qid: u16,
        sqsize: u16,
        cattr: u8,
        digests: Digests,
    ) -> (RawHost, Cqe) {
        RawHost::io_queue_as(
            addr, NQN, cntlid, qid, sqsize, cattr, digests, HOSTNQN, [7; 16],
        )
    }

    /// [`RawHost::io_queue`] on subsystem `nqn` for host `hostnqn` with identifier `hostid`.
    #[allow(clippy::too_many_arguments)]
    pub fn io_queue_as(
        addr: SocketAddr,
        nqn: &str,
        cntlid: u16,
        qid: u16,
        sqsize: u16,
        cattr: u8,
        digests: Digests,
        hostnqn: &str,
        hostid: [u8; 16],
    ) -> (RawHost, Cqe) {
        let mut h = RawHost::connect(addr);
        h.icreq(digests);
        let cd = ConnectData {
            hostid,
            cntlid,
            subnqn: nqn.into(),
            hostnqn: hostnqn.into(),
        };
        let cqe = h.fabrics_connect(qid, sqsize, cattr, 0, &cd);
        (h, cqe)
    }
}

/// Polls `qp` until one request completes (20 s at most).
pub fn wait_one(qp: &mut nvpoll_tcp::host::TcpQueuePair) -> nvpoll::api::Completion {
    use nvpoll::api::QueuePair;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        qp.poll(64).expect("poll");
        if let Some(c) = qp.pop_completion() {
            return c;
        }
        assert!(Instant::now() < deadline, "I/O did not complete in 20 s");
    }
}

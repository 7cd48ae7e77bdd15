//! Persistent reservations over the wire: two hosts (two host identifiers, each with its own controller)
//! fence each other on a file namespace, the fenced host hears of it through an Asynchronous Event and the
//! Reservation Notification log page, and the reservation survives a restart of the target (PTPL).

use nvpoll_testkit::target as target_common;

use nvpoll::spec::{
    admin, feature, io as io_op, log_page, IdentifyController, IdentifyNamespace, Sqe, Status,
};
use nvpoll_target::{Backing, SubsystemConfig, TargetConfig};
use nvpoll_tcp::pdu::{self, Digests};
use target_common::{Polled, RawHost, Resp, TestTarget};

const NQN: &str = "nqn.2024-01.io.nvpoll:resv";
const HOST_A: &str = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-0000-0000-0000-000000000001";
const HOST_B: &str = "nqn.2014-08.org.nvmexpress:uuid:bbbbbbbb-0000-0000-0000-000000000002";
const ID_A: [u8; 16] = [0xa1; 16];
const ID_B: [u8; 16] = [0xb2; 16];

/// A Reservation Report: generation, type, and each registrant's host identifier, key and whether it holds.
type Report = (u32, u8, Vec<([u8; 16], u64, bool)>);

struct Host {
    admin: RawHost,
    io: RawHost,
}

impl Host {
    fn connect(t: &TestTarget, hostnqn: &str, hostid: [u8; 16]) -> Host {
        let (admin, cntlid) = RawHost::admin_queue_as(t.addr, NQN, 0, hostnqn, hostid);
        let (io, cqe) = RawHost::io_queue_as(
            t.addr,
            NQN,
            cntlid,
            1,
            31,
            0,
            Digests::NONE,
            hostnqn,
            hostid,
        );
        assert!(cqe.status().is_success(), "{:?}", cqe.status());
        Host { admin, io }
    }

    fn register(&mut self, action: u32, crkey: u64, nrkey: u64, cptpl: u32) -> Status {
        let data = [crkey.to_le_bytes(), nrkey.to_le_bytes()].concat();
        let sqe = Sqe {
            opcode: io_op::RESERVATION_REGISTER,
            nsid: 1,
            cdw10: action | cptpl << 30,
            ..Default::default()
        };
        self.io.run(sqe, &data, 0, &[]).0.status()
    }

    fn acquire(&mut self, action: u32, rtype: u32, crkey: u64, prkey: u64) -> Status {
        let data = [crkey.to_le_bytes(), prkey.to_le_bytes()].concat();
        let sqe = Sqe {
            opcode: io_op::RESERVATION_ACQUIRE,
            nsid: 1,
            cdw10: action | rtype << 8,
            ..Default::default()
        };
        // Through R2T this time: the data of a reservation command may come either way.
        self.io.run(sqe, &[], data.len() as u32, &data).0.status()
    }

    fn release(&mut self, action: u32, rtype: u32, crkey: u64) -> Status {
        let sqe = Sqe {
            opcode: io_op::RESERVATION_RELEASE,
            nsid: 1,
            cdw10: action | rtype << 8,
            ..Default::default()
        };
        self.io.run(sqe, &crkey.to_le_bytes(), 0, &[]).0.status()
    }

    /// (generation, type, registrants as (host identifier, key, holds)).
    fn report(&mut self) -> Report {
        let sqe = Sqe {
            opcode: io_op::RESERVATION_REPORT,
            nsid: 1,
            cdw10: 4096 / 4 - 1,
            cdw11: 1,
            ..Default::default()
        };
        let (cqe, data) = self.io.run(sqe, &[], 4096, &[]);
        assert!(cqe.status().is_success(), "report: {:?}", cqe.status());
        let n = u16::from_le_bytes([data[5], data[6]]) as usize;
        let regs = (0..n)
            .map(|i| {
                let e = &data[64 + 64 * i..128 + 64 * i];
                let mut id = [0u8; 16];
                id.copy_from_slice(&e[16..32]);
                (
                    id,
                    u64::from_le_bytes(e[8..16].try_into().unwrap()),
                    e[2] & 1 == 1,
                )
            })
            .collect();
        (
            u32::from_le_bytes(data[..4].try_into().unwrap()),
            data[4],
            regs,
        )
    }

    fn write(&mut self) -> Status {
        self.io
            .run(Sqe::write(1, 8, 0), &[0x5a; 512], 0, &[])
            .0
            .status()
    }

    fn read(&mut self) -> Status {
        self.io.run(Sqe::read(1, 8, 0), &[], 512, &[]).0.status()
    }
}

fn target(file: &std::path::Path) -> TestTarget {
    TestTarget::start_with(
        TargetConfig::new("127.0.0.1:0".parse().unwrap())
            .subsystem(SubsystemConfig::new(NQN).namespace(Backing::File(file.to_path_buf()), 512)),
    )
}

#[test]
fn two_hosts_fence_each_other_and_the_reservation_survives_a_restart() {
    let dir = std::env::temp_dir().join(format!("nvpoll-resv-wire-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("ns.img");
    std::fs::File::create(&file)
        .unwrap()
        .set_len(4 << 20)
        .unwrap();
    {
        let t = target(&file);
        let mut a = Host::connect(&t, HOST_A, ID_A);
        let mut b = Host::connect(&t, HOST_B, ID_B);
        // Identify says what is there: ONCS reservations, every type, IEKEY, PTPL on a file.
        let (cqe, page) = a.admin.run(Sqe::identify(0x01, 0), &[], 4096, &[]);
        assert!(cqe.status().is_success());
        let oncs = IdentifyController::parse(&page).unwrap().oncs;
        assert_ne!(oncs & IdentifyController::ONCS_RESERVATIONS, 0);
        let (_, page) = a.admin.run(Sqe::identify(0x00, 1), &[], 4096, &[]);
        assert_eq!(IdentifyNamespace::parse(&page).unwrap().rescap, 0xff);
        // A: an AER outstanding, to hear of the fencing later.
        let mut aer = Sqe {
            opcode: admin::ASYNC_EVENT_REQUEST,
            cid: 0x7777,
            ..Default::default()
        };
        aer.set_sgl(&nvpoll::spec::SglDescriptor::transport_data_block(0));
        let mut b_aer = Vec::new();
        pdu::encode_capsule_cmd(&mut b_aer, &aer, &[], Digests::NONE, 0);
        a.admin.send(&b_aer);

        // Both register (A with persistence on); A takes Write Exclusive.
        assert!(a.register(0, 0, 0xaaaa, 3).is_success());
        assert!(b.register(0, 0, 0xbbbb, 0).is_success());
        assert!(b.register(0, 0, 0xbbb0, 0).is(Status::RESERVATION_CONFLICT));
        assert!(a.acquire(0, 1, 0xaaaa, 0).is_success());
        assert!(a.write().is_success());
        assert!(
            b.write().is(Status::RESERVATION_CONFLICT),
            "B is fenced from writing"
        );
        assert!(b.read().is_success(), "B may read under Write Exclusive");
        assert!(b.acquire(0, 1, 0xbbbb, 0).is(Status::RESERVATION_CONFLICT));
        let (gen, rtype, regs) = a.report();
        assert_eq!(rtype, 1);
        assert_eq!(regs, vec![(ID_A, 0xaaaa, true), (ID_B, 0xbbbb, false)]);

        // B preempts A and takes Exclusive Access: A is unregistered, fenced from everything, and told.
        assert!(b.acquire(1, 2, 0xbbbb, 0xaaaa).is_success());
        assert!(a.read().is(Status::RESERVATION_CONFLICT));
        assert!(a.write().is(Status::RESERVATION_CONFLICT));
        assert!(b.write().is_success());
        let cqe = match a.admin.poll_recv(std::time::Duration::from_secs(5)) {
            Polled::Pdu(Resp::Cqe(c)) => c,
            other => panic!("A's AER: {other:?}"),
        };
        assert_eq!(
            (cqe.cid, cqe.dw0 & 7, (cqe.dw0 >> 16) & 0xff),
            (0x7777, 6, 0x80)
        );
        let (cqe, log) = a.admin.run(
            Sqe::get_log_page(log_page::RESERVATION_NOTIFICATION, 0xffff_ffff, 64, 0),
            &[],
            64,
            &[],
        );
        assert!(cqe.status().is_success());
        assert_eq!(log[8], 1, "Registration Preempted");
        assert_eq!(u32::from_le_bytes(log[12..16].try_into().unwrap()), 1);
        let (_, log) = a.admin.run(
            Sqe::get_log_page(log_page::RESERVATION_NOTIFICATION, 0xffff_ffff, 64, 0),
            &[],
            64,
            &[],
        );
        assert_eq!(log[8], 0, "one notice, read once");
        let (gen2, rtype, regs) = b.report();
        assert_eq!((gen2, rtype), (gen + 1, 2));
        assert_eq!(regs, vec![(ID_B, 0xbbbb, true)]);
        // Persistence is a namespace's feature: on here (A asked for it when it registered).
        let mut gf = Sqe::get_features(feature::RESERVATION_PERSISTENCE);
        gf.nsid = 1;
        let (cqe, _) = b.admin.run(gf, &[], 0, &[]);
        assert_eq!(cqe.dw0 & 1, 1);
    }
    // A new target process on the same file finds B's reservation as it was.
    let t = target(&file);
    let mut a = Host::connect(&t, HOST_A, ID_A);
    let mut b = Host::connect(&t, HOST_B, ID_B);
    let (_, rtype, regs) = b.report();
    assert_eq!(rtype, 2);
    assert_eq!(regs, vec![(ID_B, 0xbbbb, true)]);
    assert!(
        a.read().is(Status::RESERVATION_CONFLICT),
        "still fenced after the restart"
    );
    assert!(b.write().is_success());
    // B releases: A may write again; then clears.
    assert!(
        b.release(0, 1, 0xbbbb).is(Status::INVALID_FIELD),
        "the wrong type"
    );
    assert!(b.release(0, 2, 0xbbbb).is_success());
    assert!(a.write().is_success());
    assert!(b.release(1, 0, 0xbbbb).is_success());
    assert!(b.report().2.is_empty());
    drop(t);
    std::fs::remove_dir_all(&dir).unwrap();
}

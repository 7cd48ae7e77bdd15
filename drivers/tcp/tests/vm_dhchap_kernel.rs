//! Our initiator re-authenticating a live controller of the Linux kernel's nvmet after the target's key for the
//! host changed (issue 34), inside the QEMU guest (scripts/vm-test.sh runs these with NVPOLL_VM=1). Outside the
//! guest the test says it skips and why. The every-hash-and-group matrix against nvmet is
//! scripts/vm-tests/26-kernel-dhchap.sh.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nvpoll::api::{IoOp, IoRequest, QueuePair};
use nvpoll::mem::DmaPool;
use nvpoll_tcp::dhchap::host::HostAuth;
use nvpoll_tcp::dhchap::{random, Hash, Secret};
use nvpoll_tcp::host::{ConnectOptions, TcpController, TcpQueuePair};

const NQN: &str = "nqn.2024-01.io.nvpoll:vm-dhchap-reauth";
const PORT: u16 = 4451;
const PORT_ID: &str = "7";
const CFG: &str = "/sys/kernel/config/nvmet";

/// An nvmet subsystem with one namespace on one port, only `hostnqn` allowed; taken down when dropped.
struct Nvmet {
    hostnqn: String,
    image: PathBuf,
}

impl Nvmet {
    fn write(path: impl AsRef<Path>, value: &str) {
        let path = path.as_ref();
        fs::write(path, value)
            .unwrap_or_else(|e| panic!("writing {value:?} to {}: {e}", path.display()));
    }

    fn start(hostnqn: &str, key: &Secret) -> Nvmet {
        let sub = format!("{CFG}/subsystems/{NQN}");
        let image = PathBuf::from("/run/nvpoll-vm-dhchap-reauth.img");
        fs::write(&image, []).unwrap();
        fs::File::options()
            .write(true)
            .open(&image)
            .unwrap()
            .set_len(16 << 20)
            .unwrap();
        fs::create_dir_all(format!("{sub}/namespaces/1")).unwrap();
        Self::write(
            format!("{sub}/namespaces/1/device_path"),
            image.to_str().unwrap(),
        );
        Self::write(format!("{sub}/namespaces/1/buffered_io"), "1");
        Self::write(format!("{sub}/namespaces/1/enable"), "1");
        Self::write(format!("{sub}/attr_allow_any_host"), "0");
        let host = format!("{CFG}/hosts/{hostnqn}");
        fs::create_dir_all(&host).unwrap();
        Self::write(format!("{host}/dhchap_key"), &key.to_dhhc1());
        Self::write(format!("{host}/dhchap_hash"), "hmac(sha256)");
        Self::write(format!("{host}/dhchap_dhgroup"), "ffdhe2048");
        std::os::unix::fs::symlink(&host, format!("{sub}/allowed_hosts/{hostnqn}")).unwrap();
        let port = format!("{CFG}/ports/{PORT_ID}");
        fs::create_dir_all(&port).unwrap();
        Self::write(format!("{port}/addr_trtype"), "tcp");
        Self::write(format!("{port}/addr_adrfam"), "ipv4");
        Self::write(format!("{port}/addr_traddr"), "127.0.0.1");
        Self::write(format!("{port}/addr_trsvcid"), &PORT.to_string());
        std::os::unix::fs::symlink(&sub, format!("{port}/subsystems/{NQN}")).unwrap();
        Nvmet {
            hostnqn: hostnqn.to_string(),
            image,
        }
    }

    fn set_key(&self, key: &Secret) {
        Self::write(
            format!("{CFG}/hosts/{}/dhchap_key", self.hostnqn),
            &key.to_dhhc1(),
        );
    }
}

impl Drop for Nvmet {
    fn drop(&mut self) {
        // Best effort: the guest is thrown away after the run anyway.
        let sub = format!("{CFG}/subsystems/{NQN}");
        let _ = fs::remove_file(format!("{CFG}/ports/{PORT_ID}/subsystems/{NQN}"));
        let _ = fs::remove_dir(format!("{CFG}/ports/{PORT_ID}"));
        let _ = fs::remove_file(format!("{sub}/allowed_hosts/{}", self.hostnqn));
        let _ = fs::remove_dir(format!("{sub}/namespaces/1"));
        let _ = fs::remove_dir(&sub);
        let _ = fs::remove_file(&self.image);
    }
}

fn new_key() -> Secret {
    let mut k = [0u8; 32];
    random(&mut k);
    Secret::from_key(&k, Some(Hash::Sha256)).unwrap()
}

fn write_read(qp: &mut TcpQueuePair, pool: &DmaPool, block_size: u32, seed: u8) {
    let mut w = pool.alloc(4096).unwrap();
    w.as_mut_slice()[..4096].fill(seed);
    for (op, buf) in [(IoOp::Write, w), (IoOp::Read, pool.alloc(4096).unwrap())] {
        let req = IoRequest {
            op,
            nsid: 1,
            lba: u64::from(seed) * u64::from(4096 / block_size),
            blocks: 4096 / block_size,
            buf: Some(buf),
            tag: 0,
        };
        qp.submit(req).map_err(|r| r.error).expect("submit");
        qp.flush().expect("flush");
        let deadline = Instant::now() + Duration::from_secs(30);
        let c = loop {
            qp.poll(16).expect("poll");
            if let Some(c) = qp.pop_completion() {
                break c;
            }
            assert!(Instant::now() < deadline, "I/O did not complete in 30 s");
        };
        assert!(c.result.is_ok(), "{op:?}: {:?}", c.result);
        if op == IoOp::Read {
            assert!(c.buf.unwrap().as_slice()[..4096].iter().all(|&b| b == seed));
        }
    }
}

#[test]
fn vm_dhchap_reauthentication_against_nvmet() {
    if std::env::var_os("NVPOLL_VM").is_none() {
        eprintln!(
            "skipping: needs the QEMU guest with the kernel's nvmet-tcp (run scripts/vm-test.sh)"
        );
        return;
    }
    let hostnqn = std::env::var("VM_HOSTNQN").expect("VM_HOSTNQN is set in the guest");
    let (k1, k2) = (new_key(), new_key());
    let nvmet = Nvmet::start(&hostnqn, &k1);
    let pool = DmaPool::builder().class(4096, 256).build().unwrap();
    let mut o = ConnectOptions::new(
        format!("127.0.0.1:{PORT}").parse().unwrap(),
        NQN,
        hostnqn.clone(),
    );
    o.dhchap = Some(HostAuth::new(k1.clone(), None));
    let mut ctrl = TcpController::connect(o, pool.clone()).expect("authenticated connect to nvmet");
    let mut qp = ctrl.connect_io_queue(8).expect("authenticated I/O queue");
    let bs = {
        use nvpoll::api::Controller;
        ctrl.info().namespaces[0].block_size
    };
    write_read(&mut qp, &pool, bs, 1);

    // nvmet's key changes; the live controller re-authenticates with the new one and goes on.
    nvmet.set_key(&k2);
    ctrl.reauthenticate(Some(HostAuth::new(k2.clone(), None)))
        .expect("re-authentication with nvmet's new key");
    write_read(&mut qp, &pool, bs, 2);

    // The old key no longer passes.
    let e = ctrl
        .reauthenticate(Some(HostAuth::new(k1, None)))
        .expect_err("the old key is refused");
    assert!(e.to_string().contains("refused"), "{e}");
    drop(qp);
    drop(ctrl);
    drop(nvmet);
}

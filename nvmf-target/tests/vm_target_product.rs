//! The Linux kernel's NVMe/TCP host against one target process that serves several subsystems on a plain and a
//! TLS listener, inside the QEMU guest (scripts/vm-test.sh runs the vm_ tests with NVPOLL_VM=1; outside the
//! guest the test says why it skips).
//!
//! `vm_kernel_host_against_a_multi_subsystem_target`:
//! - `nvme discover` on the plain listener lists the subsystems this host may use there, and no other;
//! - `nvme connect` to a subsystem whose allowed hosts do not include this host fails, and the target logs why;
//! - the kernel connects to the open subsystem, fio verifies 4 KiB writes;
//! - a namespace added at run time appears as a block device (the kernel rescans on Namespace Attribute
//!   Changed), takes fio verify, and disappears when it is removed;
//! - with tlshd in the guest (NVPOLL_VM_TLSHD), the kernel also connects over TLS to the subsystem that is only
//!   on the TLS listener, and fio verifies there; without tlshd that part says it skips.

use nvpoll_testkit::target as target_common;

use std::io::Write;
use std::net::SocketAddr;
use std::process::Command;

use nvpoll_target::{Backing, NamespaceConfig, SubsystemConfig, TargetConfig, TlsMode};
use nvpoll_tcp::tls::ConfiguredKey;
use target_common::kernel::{insert_psk, kernel_disk, wait_disk};
use target_common::TestTarget;

const OPEN: &str = "nqn.2024-01.io.nvpoll:vm-open";
const SECURE: &str = "nqn.2024-01.io.nvpoll:vm-secure";
const CLOSED: &str = "nqn.2024-01.io.nvpoll:vm-closed";
/// Test vector of the interchange format (shared/notes/tls-psk.md); a test-only key.
const KEY: &str = "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:";

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set in the guest"))
}

fn run(cmd: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run {cmd}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn must(cmd: &str, args: &[&str]) -> String {
    let (ok, text) = run(cmd, args);
    assert!(ok, "{cmd} {}: {text}", args.join(" "));
    text
}

fn fio_verify(dev: &str) {
    let filename = format!("--filename={dev}");
    let out = must(
        "fio",
        &[
            "--name=verify",
            "--ioengine=psync",
            "--direct=1",
            "--size=8m",
            "--rw=randwrite",
            "--bs=4k",
            "--verify=crc32c",
            "--do_verify=1",
            &filename,
        ],
    );
    assert!(
        !out.contains("verify: bad") && out.contains("err= 0"),
        "fio on {dev}:\n{out}"
    );
}

fn connect_args<'a>(port: &'a str, nqn: &'a str, hostnqn: &'a str) -> Vec<&'a str> {
    vec![
        "connect",
        "-t",
        "tcp",
        "-a",
        "127.0.0.1",
        "-s",
        port,
        "-n",
        nqn,
        "--hostnqn",
        hostnqn,
    ]
}

#[test]
fn vm_kernel_host_against_a_multi_subsystem_target() {
    if std::env::var_os("NVPOLL_VM").is_none() {
        eprintln!("skipping: needs the QEMU guest with the kernel's nvme-tcp host (run scripts/vm-test.sh)");
        return;
    }
    let hostnqn = env("VM_HOSTNQN");
    let hostid = env("VM_HOSTID");
    let key = ConfiguredKey::parse(KEY).unwrap();
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let tls_addr: SocketAddr = probe.local_addr().unwrap();
    drop(probe);
    let open = SubsystemConfig::new(OPEN).namespace(Backing::Ram(64 << 20), 512);
    let mut secure = SubsystemConfig::new(SECURE)
        .namespace(Backing::Ram(64 << 20), 4096)
        .allow_host(hostnqn.clone())
        .host_key(hostnqn.clone(), key);
    secure.listeners = Some(vec![tls_addr]);
    let closed = SubsystemConfig::new(CLOSED)
        .namespace(Backing::Ram(16 << 20), 512)
        .allow_host("nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-0000000000bb");
    let t = TestTarget::start_with(
        TargetConfig::new("127.0.0.1:0".parse().unwrap())
            .listener(tls_addr, TlsMode::Required)
            .subsystem(open)
            .subsystem(secure)
            .subsystem(closed),
    );
    let port = t.addr.port().to_string();

    // Discovery on the plain listener: OPEN only (SECURE is on the TLS listener, CLOSED not for this host).
    let disc = must(
        "nvme",
        &[
            "discover",
            "-t",
            "tcp",
            "-a",
            "127.0.0.1",
            "-s",
            &port,
            "--hostnqn",
            &hostnqn,
        ],
    );
    assert!(disc.contains(OPEN), "discovery lists {OPEN}:\n{disc}");
    assert!(
        !disc.contains(SECURE) && !disc.contains(CLOSED),
        "discovery lists only what this host may use here:\n{disc}"
    );

    // A subsystem that does not allow this host: refused, and the target says why.
    let (ok, text) = run("nvme", &connect_args(&port, CLOSED, &hostnqn));
    assert!(!ok, "the kernel got into {CLOSED}: {text}");
    let refused = t.wait_event("Connect refused");
    assert!(
        refused
            .iter()
            .any(|l| l.contains(CLOSED) && l.contains("not among the subsystem's allowed hosts")),
        "{refused:?}"
    );

    // The open subsystem, then a namespace added and removed under the connected host.
    must("nvme", &connect_args(&port, OPEN, &hostnqn));
    let dev = wait_disk(OPEN, 1, true).unwrap();
    fio_verify(&dev);
    let nsid = t
        .handle
        .add_namespace(
            OPEN,
            &NamespaceConfig {
                backing: Backing::Ram(32 << 20),
                block_size: 512,
                nsid: Some(5),
                ana_group: 1,
                uuid: None,
            },
        )
        .unwrap();
    assert_eq!(nsid, 5);
    let dev5 = wait_disk(OPEN, 5, true).expect("the kernel rescanned on the event");
    fio_verify(&dev5);
    t.handle.remove_namespace(OPEN, 5).unwrap();
    wait_disk(OPEN, 5, false);
    assert!(kernel_disk(OPEN, 1).is_some(), "namespace 1 stays");
    fio_verify(&dev);
    must("nvme", &["disconnect", "-n", OPEN]);

    // TLS: the kernel (tlshd) to SECURE on the TLS listener.
    if std::env::var_os("VM_TLSHD").is_none() {
        eprintln!(
            "skipping the TLS part: the guest runs no tlshd; give scripts/vm-test.sh NVPOLL_VM_TLSHD=/path/to/tlshd"
        );
    } else {
        let serial = insert_psk(KEY, &hostnqn, SECURE);
        let connect = format!(
            "transport=tcp,traddr=127.0.0.1,trsvcid={},nqn={SECURE},hostnqn={hostnqn},hostid={hostid},tls,tls_key={serial}",
            tls_addr.port()
        );
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/nvme-fabrics")
            .and_then(|mut f| f.write_all(connect.as_bytes()))
            .expect("the kernel connects with TLS (see VM_OUT/tlshd.log)");
        let dev = wait_disk(SECURE, 1, true).unwrap();
        fio_verify(&dev);
        must("nvme", &["disconnect", "-n", SECURE]);
    }
    let c = t.counters();
    assert_eq!(
        c.term_reqs, 0,
        "no protocol error with the kernel host: {c}"
    );
    assert_eq!(c.internal_errors, 0, "{c}");
}

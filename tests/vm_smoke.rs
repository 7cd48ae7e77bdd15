//! Plumbing check for the VM integration tests.
//!
//! Tests whose name contains `vm_` are VM tests: `scripts/vm-test.sh` runs them
//! inside the QEMU guest of `scripts/vm.sh` with `NVPOLL_VM=1`. Anywhere else they
//! skip (and pass), so a plain `cargo test` stays green.

use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::path::Path;
use std::time::Duration;

/// True inside the test guest; otherwise prints the skip notice.
fn in_vm() -> bool {
    if std::env::var_os("NVPOLL_VM").is_some() {
        return true;
    }
    println!("skipping: needs the QEMU guest (run scripts/vm-test.sh)");
    false
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!("{name} is not set: NVPOLL_VM=1 outside the scripts/vm.sh guest?")
    })
}

#[test]
fn vm_guest_has_devices() {
    if !in_vm() {
        return;
    }

    // The userspace-driver controller is bound to vfio-pci.
    let bdf = env("VM_VFIO_BDF");
    let link = Path::new("/sys/bus/pci/devices").join(&bdf).join("driver");
    let target = std::fs::read_link(&link)
        .unwrap_or_else(|e| panic!("{}: {e} (is {bdf} bound to a driver?)", link.display()));
    assert_eq!(
        target.file_name().and_then(|n| n.to_str()),
        Some("vfio-pci"),
        "{bdf} is bound to {}, expected vfio-pci",
        target.display()
    );

    // The kernel NVMe/TCP target accepts connections.
    let (Ok(addr), Ok(port)) = (
        std::env::var("VM_NVMET_ADDR"),
        std::env::var("VM_NVMET_PORT"),
    ) else {
        println!("no nvmet-tcp target in this guest (NVPOLL_VM_NVMET=0): TCP check skipped");
        return;
    };
    let sa: SocketAddr = (
        addr.as_str(),
        port.parse::<u16>()
            .expect("VM_NVMET_PORT is not a port number"),
    )
        .to_socket_addrs()
        .expect("VM_NVMET_ADDR does not resolve")
        .next()
        .expect("VM_NVMET_ADDR resolves to nothing");
    TcpStream::connect_timeout(&sa, Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("TCP connect to the nvmet-tcp target at {sa} failed: {e}"));
}

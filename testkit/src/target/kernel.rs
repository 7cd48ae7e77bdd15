//! What the VM tests share: the Linux kernel host's disks and keyring, inside the QEMU guest.

use std::time::{Duration, Instant};

use nvpoll_tcp::tls::ConfiguredKey;

/// The kernel's disk for namespace `nsid` of `nqn`, if it exists now.
pub fn kernel_disk(nqn: &str, nsid: u32) -> Option<String> {
    for class in ["/sys/class/nvme-subsystem", "/sys/class/nvme"] {
        for entry in std::fs::read_dir(class).into_iter().flatten().flatten() {
            let p = entry.path();
            let subnqn = std::fs::read_to_string(p.join("subsysnqn")).unwrap_or_default();
            if subnqn.trim() != nqn {
                continue;
            }
            for c in std::fs::read_dir(&p).into_iter().flatten().flatten() {
                let name = c.file_name().to_string_lossy().into_owned();
                // A disk node nvmeXnY (not a path node nvmeXcYnZ) with that namespace ID.
                let disk = name.strip_prefix("nvme").is_some_and(|rest| {
                    rest.split_once('n').is_some_and(|(a, b)| {
                        !a.is_empty()
                            && a.bytes().all(|x| x.is_ascii_digit())
                            && !b.is_empty()
                            && b.bytes().all(|x| x.is_ascii_digit())
                    })
                });
                let id = std::fs::read_to_string(format!("/sys/block/{name}/nsid"))
                    .ok()
                    .and_then(|s| s.trim().parse::<u32>().ok());
                let dev = format!("/dev/{name}");
                if disk && id == Some(nsid) && std::path::Path::new(&dev).exists() {
                    return Some(dev);
                }
            }
        }
    }
    None
}

/// Waits until the disk of (`nqn`, `nsid`) exists (`present`) or is gone.
pub fn wait_disk(nqn: &str, nsid: u32, present: bool) -> Option<String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let d = kernel_disk(nqn, nsid);
        if d.is_some() == present {
            return d;
        }
        assert!(
            Instant::now() < deadline,
            "namespace {nsid} of {nqn}: still {} after 60 s",
            if present { "absent" } else { "present" }
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Puts the TLS PSK that `key` (an `NVMeTLSkey-1` string) derives for (hostnqn, subnqn) into the .nvme keyring
/// under its v0 identity, as the kernel looks it up; returns the key's serial. The PSK goes to keyctl on stdin,
/// so no key material reaches an argument list or a log.
pub fn insert_psk(key: &str, hostnqn: &str, subnqn: &str) -> String {
    let key = ConfiguredKey::parse(key).unwrap();
    match nvpoll_tcp::keyring::add_kernel_psk(&key, hostnqn, subnqn) {
        Ok(added) => added.serial,
        Err(e) => panic!("{e}"),
    }
}

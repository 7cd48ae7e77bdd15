//! The kernel's side of a TLS PSK: Linux's nvme-tcp (host and nvmet) and tlshd find the retained PSK for a
//! connection in the `.nvme` keyring, under its TLS PSK identity. [`add_kernel_psk`] derives both from a
//! configured key (`NVMeTLSkey-1:01:...:`) and hands the PSK to `keyctl padd` (keyutils) on its standard
//! input, so the secret never appears on a command line. One function for `nvpoll-setup kernel-psk` and the
//! tests that connect the kernel to our target.

use std::io::Write;
use std::process::{Command, ExitStatus, Stdio};

use nvpoll_tls::{ConfiguredKey, Derivation, IdentityVersion};

/// The PSK as the kernel holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelPsk {
    /// The TLS PSK identity it was added under (`NVMe0R01 <hostnqn> <subnqn>`).
    pub identity: String,
    /// The key's serial number in the keyring, as `keyctl` printed it (what `nvme connect --tls_key=` takes).
    pub serial: String,
}

/// Why the PSK did not reach the keyring.
#[derive(Debug, thiserror::Error)]
pub enum KeyringError {
    /// `keyctl` could not be started.
    #[error("cannot run keyctl ({0}): install keyutils (apt-get install keyutils)")]
    Spawn(#[source] std::io::Error),
    /// The PSK could not be written to `keyctl`'s standard input, or its end not awaited.
    #[error("cannot hand the PSK to keyctl: {0}")]
    Handoff(#[source] std::io::Error),
    /// `keyctl` refused.
    #[error(
        "keyctl padd psk '{identity}' %:.nvme failed ({status}): {stderr} (the .nvme keyring exists once the \
         nvme module is loaded with CONFIG_NVME_KEYRING: modprobe nvme-tcp)"
    )]
    Refused {
        /// The identity it was asked to add.
        identity: String,
        /// How `keyctl` exited.
        status: ExitStatus,
        /// What it said.
        stderr: String,
    },
}

/// Derives the retained PSK and its identity for (`hostnqn`, `subnqn`) from `key` (identity version 0, the
/// derivation of RFC 8446's HKDF-Expand-Label, as the kernel's nvme-tcp and tlshd use) and adds it to the
/// `.nvme` keyring with `keyctl padd`.
///
/// ```no_run
/// use nvpoll_tls::ConfiguredKey;
/// let key = ConfiguredKey::parse("NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:").unwrap();
/// let added = nvpoll_wire::keyring::add_kernel_psk(&key, "nqn.2014-08.org.nvmexpress:uuid:host", "nqn.2016-06.io.spdk:cnode1")?;
/// println!("nvme connect ... --tls --tls_key={}", added.serial);
/// # Ok::<(), nvpoll_wire::keyring::KeyringError>(())
/// ```
pub fn add_kernel_psk(
    key: &ConfiguredKey,
    hostnqn: &str,
    subnqn: &str,
) -> Result<KernelPsk, KeyringError> {
    let (identity, psk) = key.derive(IdentityVersion::V0, hostnqn, subnqn, Derivation::Rfc8446);
    let mut child = Command::new("keyctl")
        .args(["padd", "psk", &identity, "%:.nvme"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(KeyringError::Spawn)?;
    // Written and closed before waiting: keyctl reads its standard input to the end.
    let wrote = child
        .stdin
        .take()
        .map(|mut stdin| stdin.write_all(psk.dangerous_as_bytes()));
    let out = child.wait_with_output().map_err(KeyringError::Handoff)?;
    if let Some(Err(e)) = wrote {
        return Err(KeyringError::Handoff(e));
    }
    if !out.status.success() {
        return Err(KeyringError::Refused {
            identity,
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(KernelPsk {
        identity,
        serial: String::from_utf8_lossy(&out.stdout).trim().to_string(),
    })
}

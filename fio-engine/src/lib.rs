//! An external fio ioengine driving nvpoll's initiators: NVMe/TCP (TLS PSK, digests, DH-HMAC-CHAP,
//! multipath) and local PCIe controllers through VFIO.
//!
//! ```text
//! fio --name=w --ioengine=external:target/release/libnvpoll_fio.so --thread=1 \
//!     --filename='trtype=tcp adrfam=IPv4 traddr=127.0.0.1 trsvcid=4420 subnqn=nqn.2016-06.io.spdk\:cnode1 ns=1' \
//!     --rw=randwrite --bs=4k --iodepth=128 --numjobs=8 --time_based --runtime=30
//! ```
//!
//! fio's model, as SPDK's plugin has it: each job (a thread; `thread=1`) connects a queue pair of its own on
//! each file's controller, queues and reaps its I/O itself (completions are polled in fio's getevents), and
//! the jobs of a process share each controller. fio's io_u buffers are one pinned area the engine allocates;
//! each io_u's part goes to the queue pair as a `DmaBuf` (no copy).
//!
//! The bindings are generated at build time from the headers of the fio the engine is loaded into (see
//! build.rs); without them this crate builds empty, with a warning.

// The engine's unsafe code is the C interface (`ffi`); the rest is safe.
#![deny(unsafe_code)]

pub mod error;
pub mod filename;
pub mod job;
pub mod registry;
pub mod settings;

#[cfg(fio_headers)]
#[allow(unsafe_code)]
mod ffi;

pub use error::Error;

/// Whether an engine built against fio `built` (e.g. `fio-3.33`, whose ioengine interface is version
/// `ops_version`) may run in the fio `running`: the error names both versions and how to rebuild.
pub fn check_fio_version(built: &str, ops_version: u32, running: &str) -> Result<(), Error> {
    if built == running {
        return Ok(());
    }
    Err(Error::FioVersion {
        built: built.into(),
        ops_version,
        running: running.into(),
    })
}

/// The fio version the engine was built for (`fio-3.33`), or `None` when it was built without fio's headers.
pub fn built_for() -> Option<&'static str> {
    #[cfg(fio_headers)]
    return Some(ffi::BUILT_FOR);
    #[cfg(not(fio_headers))]
    None
}

#[cfg(test)]
mod tests {
    #[test]
    fn another_fio_version_is_refused_naming_both() {
        assert!(super::check_fio_version("fio-3.33", 31, "fio-3.33").is_ok());
        let e = super::check_fio_version("fio-3.33", 31, "fio-3.38")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("fio-3.33") && e.contains("fio-3.38") && e.contains("version 31"),
            "{e}"
        );
    }
}

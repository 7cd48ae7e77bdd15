//! The NVMe/TCP target: NVM subsystems served to Linux hosts and to our own initiator, polled on nvpoll's
//! reactors.
//!
//! - [`Target::bind`] opens the namespaces and the listening sockets (one or more, each plain, TLS optional or
//!   TLS required); [`Target::start`] registers the acceptor as a poller on reactor 0. Each accepted
//!   connection goes to the next reactor, round robin, and stays there: one owner per queue, no locks on the
//!   I/O path. Until Fabrics Connect succeeds it sits in that reactor's setup set (idle half-open connections
//!   are looked at once per millisecond by a timed poller, and cost nothing in between); then it becomes a
//!   session poller of its own, polled on every iteration.
//! - A session (`session`) speaks NVMe/TCP: TLS 1.3 with a PSK where the listener asks for it, ICReq/ICResp,
//!   Fabrics Connect, and then commands: admin and fabrics ones (`admin`), NVM I/O (`io`), and the discovery
//!   log (`discovery`) for the well-known discovery subsystem, which every target serves.
//! - A controller (`controller`) is created by an admin-queue Connect (dynamic controller IDs) and torn down
//!   with its admin connection, or when its keep-alive timeout passes without a command on any of its queues.
//! - Subsystems (`subsystem`) have their own namespaces (RAM, a file or block device, or another NVMe
//!   namespace: `store`, `device`), limits, allowed hosts and host PSKs, and may be limited to some listeners.
//! - While the target runs, a [`TargetHandle`] adds and removes subsystems, namespaces, listeners, allowed
//!   hosts and keys. A namespace change raises a Namespace Attribute Changed event on every controller of its
//!   subsystem; I/O queues see the new namespace table at their next poll (one atomic load per poll when
//!   nothing changed).
//!
//! Who gets in: a host is authenticated by the TLS identity it proved, not by what it claims in Connect: the
//! identity's host and subsystem NQNs must be those of the Connect. A subsystem lets in any host, or only the
//! hosts it lists.
//!
//! What hosts get: NVMe 1.3 controllers with MDTS 1 MiB, 8 KiB of in-capsule data (IOCCSZ 516), 128-entry
//! queues and 128 I/O queues (per subsystem, by default), SGLs (offset and transport data blocks), header and
//! data digests as asked in ICReq, MAXH2CDATA 128 KiB, one R2T per write at a time (so any MAXR2T is
//! respected), the C2H success optimization when the host disables SQ flow control, keep-alive enforcement
//! (traffic based), Asynchronous Event Requests (Namespace Attribute Changed), and the Identify, feature and
//! log pages the Linux host reads at connect. Not implemented: in-band authentication, reservations, Dataset
//! Management, ANA.
//!
//! Sending follows nvpoll's split of *queue* and *kick*: handlers append PDUs to a connection's send buffer,
//! and the send mode decides when it leaves (at once, or with the reactor's end-of-iteration flush, one `write`
//! per connection). Read data of 16 KiB or more from a RAM namespace is the exception: it leaves at once,
//! behind what is queued, with one `writev` straight from the namespace's memory (or sealed straight from it
//! into TLS records), instead of being copied into the send buffer first.
//!
//! # Example
//! ```no_run
//! use nvpoll::reactor::{CoreList, Reactors};
//! use nvpoll_target::{Backing, SubsystemConfig, Target, TargetConfig};
//!
//! let subsys = SubsystemConfig::new("nqn.2024-01.io.nvpoll:demo").namespace(Backing::Ram(64 << 20), 512);
//! let config = TargetConfig::new("127.0.0.1:4420".parse().unwrap()).subsystem(subsys);
//! let target = Target::bind(config)?;
//! let reactors = Reactors::start(&"0".parse::<CoreList>()?)?;
//! let handle = target.start(&reactors)?;
//! // ... serve until told to stop ...
//! handle.stop();
//! reactors.stop()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
#![forbid(unsafe_code)]

mod admin;
mod admin_state;
pub mod config;
mod controller;
mod device;
mod discovery;
mod error;
mod events;
mod handler;
mod io;
mod limits;
mod options;
mod resv;
pub mod rpc;
mod server;
mod session;
mod shared;
mod store;
mod subsystem;

pub use device::{BlockDevice, QueuePairDevice};
pub use error::{Error, KeyFileFault, NqnFault, Setting};
pub use events::{EventHook, TargetEvent};
pub use options::{ListenerConfig, TargetConfig, TargetTls, TlsMode};
pub use server::{raise_descriptor_limit, NamespaceInfo, SubsystemInfo, Target, TargetHandle};
pub use shared::TargetCounters;
pub use subsystem::{
    AnaSetting, Backing, CntlidRange, DhchapKey, DhchapPolicy, HostAccess, HostKey,
    NamespaceConfig, SubsystemConfig, SubsystemLimits, ANA_GROUP_MAX, DISCOVERY_NQN, MAX_CNTLID,
    MAX_NAMESPACES, MAX_NQN_LEN,
};

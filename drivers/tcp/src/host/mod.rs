//! The NVMe/TCP initiator: a controller (admin queue, identify, namespaces, keep-alive) and its I/O queue
//! pairs, which implement [`nvpoll::api::QueuePair`].
//!
//! Attach ([`TcpController::connect`]) and queue creation run off the I/O path: they poll their sockets with
//! deadlines until each step is done. Once created, a [`TcpQueuePair`] is moved to the reactor that owns it and
//! never blocks.
//!
//! The files, a concern each (as in `nvpoll-pcie`, the controller apart from its queue pairs):
//!
//! - `options.rs`: [`ConnectOptions`] and [`Recovery`], with their defaults;
//! - `connect.rs`: connecting a queue (TCP, TLS, ICReq, Fabrics Connect), how an I/O queue connects again, and
//!   the thread a connect that waits on the network runs on;
//! - `auth.rs`: DH-HMAC-CHAP on a queue (Authentication Send and Receive, secure channel concatenation);
//! - `bringup.rs`: the controller's bring-up on its admin queue, at attach and at each reconnect, and the
//!   admin commands it runs to completion (Property Get and Set, Identify, Number of Queues);
//! - `controller.rs`: [`TcpController`]: admin queue service (keep-alive, Aborts, the ANA log), reconnects,
//!   I/O queue creation, shutdown, [`nvpoll::api::Controller`];
//! - `qpair.rs`: [`TcpQueuePair`]: the I/O path, command timeouts, recovery after a lost connection
//!   ([`RecoveryStats`]), [`nvpoll::api::QueuePair`];
//! - `shared.rs`: what the controller and its queue pairs on other reactors share (generation, loss, Aborts,
//!   counters, and the ANA part from `ana.rs`);
//! - `ana.rs`: [`AnaView`], a path's ANA states, how the controller shares them with its queue pairs, and
//!   the ANA log read.

mod ana;
mod auth;
mod bringup;
mod connect;
mod controller;
mod options;
mod qpair;
mod shared;

pub use self::ana::AnaView;
pub use self::controller::TcpController;
pub use self::options::{ConnectOptions, Recovery, DEFAULT_IO_QUEUES, DEFAULT_MAX_TRANSFER};
pub use self::qpair::{RecoveryStats, TcpQueuePair};

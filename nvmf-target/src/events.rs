//! What happened on the target, for the embedder's log ([`TargetEvent`], [`EventHook`]).

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;

use nvpoll_wire::pdu::Digests;

/// Something that happened on the target, for logging.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub enum TargetEvent<'a> {
    /// A TCP connection was accepted and handed to a reactor.
    Accepted {
        /// The host's address.
        peer: SocketAddr,
        /// The reactor (index) that owns the connection.
        reactor: usize,
    },
    /// A connection became a queue with Fabrics Connect.
    QueueConnected {
        /// The host's address.
        peer: SocketAddr,
        /// The subsystem.
        subnqn: &'a str,
        /// The host NQN.
        hostnqn: &'a str,
        /// The controller.
        cntlid: u16,
        /// Queue ID (0: admin queue).
        qid: u16,
        /// Queue size (entries).
        depth: u32,
        /// Digests negotiated in ICReq/ICResp.
        digests: Digests,
    },
    /// A Fabrics Connect was refused.
    ConnectRefused {
        /// The host's address.
        peer: SocketAddr,
        /// The subsystem NQN the host asked for.
        subnqn: &'a str,
        /// The host NQN it gave (may be empty).
        hostnqn: &'a str,
        /// The queue it asked to connect (0: admin queue).
        qid: u16,
        /// Why, in words (which parameter was wrong, and how).
        reason: &'a str,
    },
    /// A controller's keep-alive timeout passed without a command: it is torn down.
    KeepAliveExpired {
        /// The address of its admin connection's host.
        peer: SocketAddr,
        /// The subsystem.
        subnqn: &'a str,
        /// The controller.
        cntlid: u16,
        /// Its timeout.
        kato_ms: u32,
    },
    /// A queue's host authenticated in band (DH-HMAC-CHAP).
    Authenticated {
        /// The host's address.
        peer: SocketAddr,
        /// The subsystem.
        subnqn: &'a str,
        /// The host NQN.
        hostnqn: &'a str,
        /// The controller.
        cntlid: u16,
        /// Queue ID (0: admin queue).
        qid: u16,
        /// Hash, DH group and direction agreed.
        how: &'a str,
    },
    /// A queue's host failed to authenticate, or sent a command before it had: why (never key material).
    AuthenticationFailed {
        /// The host's address.
        peer: SocketAddr,
        /// The subsystem.
        subnqn: &'a str,
        /// The host NQN.
        hostnqn: &'a str,
        /// The controller.
        cntlid: u16,
        /// Queue ID (0: admin queue).
        qid: u16,
        /// Why.
        reason: &'a str,
    },
    /// A host ended a TLS connection at our KeyUpdate, never having sent one (kernel TLS without
    /// re-keying): from now on its connections are closed after `records` records under one key instead
    /// (the host reconnects with fresh keys). Said once per host.
    KeyUpdateRefused {
        /// The host's address.
        peer: SocketAddr,
        /// The host NQN.
        hostnqn: &'a str,
        /// The count its connections are closed at.
        records: u64,
        /// How the connection ended.
        reason: &'a str,
    },
    /// A connection closed.
    Closed {
        /// The host's address.
        peer: SocketAddr,
        /// Its queue ID, if it got as far as Connect.
        qid: Option<u16>,
        /// Its controller, if it got as far as Connect.
        cntlid: Option<u16>,
        /// Why.
        reason: &'a str,
    },
}

impl fmt::Display for TargetEvent<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            TargetEvent::Accepted { peer, reactor } => {
                write!(f, "{peer}: accepted on reactor {reactor}")
            }
            TargetEvent::QueueConnected {
                peer,
                subnqn,
                hostnqn,
                cntlid,
                qid,
                depth,
                digests,
            } => {
                let kind = if qid == 0 {
                    "admin queue".to_string()
                } else {
                    format!("I/O queue {qid}")
                };
                let dg = match (digests.header, digests.data) {
                    (false, false) => "none",
                    (true, false) => "header",
                    (false, true) => "data",
                    (true, true) => "header+data",
                };
                write!(
                    f,
                    "{peer}: {kind} of controller {cntlid} on {subnqn} for {hostnqn}, depth {depth}, digests {dg}"
                )
            }
            TargetEvent::ConnectRefused {
                peer,
                subnqn,
                hostnqn,
                qid,
                reason,
            } => {
                let hostnqn = if hostnqn.is_empty() {
                    "(empty)"
                } else {
                    hostnqn
                };
                write!(
                    f,
                    "{peer}: Connect refused (queue {qid} of {subnqn} for host {hostnqn}): {reason}"
                )
            }
            TargetEvent::KeepAliveExpired {
                peer,
                subnqn,
                cntlid,
                kato_ms,
            } => {
                write!(f, "{peer}: controller {cntlid} on {subnqn}: no command for {kato_ms} ms, torn down")
            }
            TargetEvent::Authenticated {
                peer,
                subnqn,
                hostnqn,
                cntlid,
                qid,
                how,
            } => write!(
                f,
                "{peer}: queue {qid} of controller {cntlid} on {subnqn}: host {hostnqn} authenticated (DH-HMAC-CHAP, {how})"
            ),
            TargetEvent::AuthenticationFailed {
                peer,
                subnqn,
                hostnqn,
                cntlid,
                qid,
                reason,
            } => write!(
                f,
                "{peer}: queue {qid} of controller {cntlid} on {subnqn}: host {hostnqn} not authenticated: {reason}"
            ),
            TargetEvent::KeyUpdateRefused {
                peer,
                hostnqn,
                records,
                reason,
            } => write!(
                f,
                "{peer}: host {hostnqn} ended the connection at our TLS KeyUpdate ({reason}): it may not take \
                 one; its connections are closed after {records} records under one key from now on"
            ),
            TargetEvent::Closed {
                peer,
                qid,
                cntlid,
                reason,
            } => match (qid, cntlid) {
                (Some(q), Some(c)) => {
                    write!(f, "{peer}: queue {q} of controller {c} closed: {reason}")
                }
                _ => write!(f, "{peer}: closed: {reason}"),
            },
        }
    }
}

/// A callback that hears about [`TargetEvent`]s. It runs on the reactors: keep it short.
pub type EventHook = Arc<dyn Fn(&TargetEvent<'_>) + Send + Sync>;

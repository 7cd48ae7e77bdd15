//! Connecting a queue, admin or I/O: the connection (TCP, TLS, ICReq, in `crate::queue`), Fabrics Connect and
//! the authentication its response may ask for, `QueueLink` (how an I/O queue connects, and connects again
//! after a loss), and `Background`, which runs a step that waits on the network on a thread of its own.

use std::sync::mpsc;
use std::time::Duration;

use nvpoll::mem::DmaPool;
use nvpoll::spec::{self, Sqe};

use super::auth::{authenticate, AUTHREQ_ASCR, AUTHREQ_ATR};
use super::options::{ConnectOptions, Recovery};
use crate::queue::{DataDir, HostQueue, QueueParams};
use crate::Error;

pub(super) fn connect_queue(
    opts: &ConnectOptions,
    qid: u16,
    depth: u16,
    max_transfer: u32,
) -> Result<HostQueue, Error> {
    HostQueue::connect(&QueueParams {
        addr: opts.addr,
        qid,
        depth,
        header_digest: opts.header_digest,
        data_digest: opts.data_digest,
        max_transfer,
        connect_timeout: opts.timeout,
        tls: opts.tls.clone(),
        key_renewal: opts.tls_key_renewal,
        tcp_congestion: opts.tcp_congestion.clone(),
    })
}

/// Sends Fabrics Connect on `q` (and authenticates when the controller asks) and returns the controller ID.
pub(super) fn fabrics_connect(
    q: &mut HostQueue,
    opts: &ConnectOptions,
    pool: &DmaPool,
    sqsize: u16,
    cntlid: u16,
) -> Result<u16, Error> {
    fabrics_connect_auth(q, opts, pool, sqsize, cntlid).map(|(c, _)| c)
}

/// [`fabrics_connect`], also returning the TLS settings a secure channel concatenation generated.
pub(super) fn fabrics_connect_auth(
    q: &mut HostQueue,
    opts: &ConnectOptions,
    pool: &DmaPool,
    sqsize: u16,
    cntlid: u16,
) -> Result<(u16, Option<crate::tls::ClientConfig>), Error> {
    let kato_ms = if q.qid() == 0 {
        opts.kato.as_millis().min(u32::MAX as u128) as u32
    } else {
        0
    };
    // The admin queue keeps SQ flow control: its commands are few, and discovery controllers need not know
    // the bit.
    let cattr = if q.qid() != 0 && !opts.sq_flow_control {
        spec::fabrics::CATTR_DISABLE_SQFLOW
    } else {
        0
    };
    let sqe = Sqe::fabrics_connect(q.qid(), sqsize, cattr, kato_ms);
    let data = spec::ConnectData {
        hostid: opts.hostid,
        cntlid,
        subnqn: opts.subnqn.clone(),
        hostnqn: opts.hostnqn.clone(),
    };
    let mut buf = pool
        .alloc(spec::fabrics::CONNECT_DATA_SIZE)
        .map_err(|e| Error::InvalidArgument(e.to_string()))?;
    buf.as_mut_slice()[..spec::fabrics::CONNECT_DATA_SIZE].copy_from_slice(&data.to_bytes());
    let (cqe, _) = q.run(
        sqe,
        DataDir::ToController,
        Some(buf),
        spec::fabrics::CONNECT_DATA_SIZE as u32,
        opts.timeout,
    )?;
    if !cqe.status().is_success() {
        let spec::ConnectResponse::Rejected { status, invalid } =
            spec::ConnectResponse::from_cqe(&cqe)
        else {
            unreachable!("a completion with an error status is a rejection");
        };
        return Err(Error::Refused(Box::new(crate::ConnectRefusal {
            status,
            invalid,
            qid: q.qid(),
            sqsize,
            subnqn: data.subnqn,
            hostnqn: data.hostnqn,
            cntlid,
        })));
    }
    let authreq = (cqe.dw0 >> 16) as u16;
    let mut generated = None;
    if authreq & (AUTHREQ_ATR | AUTHREQ_ASCR) != 0 {
        generated = authenticate(q, opts, pool, authreq)?;
    }
    Ok(((cqe.dw0 & 0xffff) as u16, generated))
}

/// A step that waits on the network (a reconnect, or an I/O queue's connect), run on a thread of its own; the
/// caller takes its result later and meanwhile goes on polling.
#[derive(Debug)]
pub(super) struct Background<T>(mpsc::Receiver<Result<T, Error>>);

impl<T: Send + 'static> Background<T> {
    pub(super) fn spawn(
        f: impl FnOnce() -> Result<T, Error> + Send + 'static,
    ) -> Result<Background<T>, Error> {
        let (tx, rx) = mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name("nvpoll-connect".into())
            .spawn(move || {
                // The receiver may be gone (its owner dropped): nothing to tell then.
                let _ = tx.send(f());
            })
            .map_err(|e| Error::io("start the connect thread", e))?;
        Ok(Background(rx))
    }

    /// The result once the step is done; `None` while it runs.
    pub(super) fn poll(&self) -> Option<Result<T, Error>> {
        match self.0.try_recv() {
            Ok(r) => Some(r),
            Err(mpsc::TryRecvError::Empty) => None,
            Err(mpsc::TryRecvError::Disconnected) => Some(Err(Error::Internal(
                "the connect thread ended without a result",
            ))),
        }
    }
}

/// How to (re)connect one I/O queue.
#[derive(Clone, Debug)]
pub(super) struct QueueLink {
    pub(super) opts: ConnectOptions,
    pub(super) pool: DmaPool,
    pub(super) qid: u16,
    pub(super) depth: u16,
    pub(super) max_transfer: u32,
    pub(super) incapsule_max: u32,
    /// The controller's Command Quiesce Time.
    pub(super) cqt: Duration,
}

impl QueueLink {
    /// Connects the queue (TCP, TLS, ICReq) and runs Fabrics Connect for controller `cntlid`; again with SQ
    /// flow control kept if the controller refused to disable it.
    pub(super) fn connect(&self, cntlid: u16) -> Result<HostQueue, Error> {
        match self.connect_with(&self.opts, cntlid) {
            Err(Error::Refused(r)) if !self.opts.sq_flow_control && refused_sqflow_off(&r) => {
                log::warn!(
                    "controller {cntlid} refused I/O queue {}'s Connect with SQ flow control disabled ({}): \
                     connecting it again with flow control on",
                    self.qid,
                    r.status
                );
                let kept = ConnectOptions {
                    sq_flow_control: true,
                    ..self.opts.clone()
                };
                self.connect_with(&kept, cntlid)
            }
            r => r,
        }
    }

    fn connect_with(&self, opts: &ConnectOptions, cntlid: u16) -> Result<HostQueue, Error> {
        let mut q = connect_queue(opts, self.qid, self.depth, self.max_transfer)?;
        // The controller's IOCCSZ holds for every command on the queue, the authentication's among them: a
        // DH-HMAC-CHAP Reply with ffdhe8192 (1104 bytes) goes in the capsule, as Linux sends it, since Linux
        // nvmet answers no R2T for it.
        q.set_incapsule_max(self.incapsule_max);
        // SQSIZE is 0's based and must be at least 1 (a queue of two entries); a depth-1 queue pair still
        // never has more than one command outstanding, since the host queue has one slot.
        fabrics_connect(&mut q, opts, &self.pool, self.depth.max(2) - 1, cntlid)?;
        q.set_keep_orphans(opts.recovery == Recovery::Retry);
        Ok(q)
    }
}

/// Whether a refused Connect is about the attributes we sent (SQ flow control disabled): Invalid Field, which
/// names no parameter, or Connect Invalid Parameters naming CATTR.
fn refused_sqflow_off(r: &crate::ConnectRefusal) -> bool {
    r.status.is(spec::Status::INVALID_FIELD)
        || (r.status.is(spec::Status::CONNECT_INVALID_PARAMETERS)
            && r.invalid == Some(spec::fabrics::InvalidParameter::CATTR))
}

#[cfg(test)]
mod tests {
    use super::refused_sqflow_off;
    use nvpoll::spec::fabrics::InvalidParameter;
    use nvpoll::spec::Status;

    fn refusal(status: Status, invalid: Option<InvalidParameter>) -> crate::ConnectRefusal {
        crate::ConnectRefusal {
            status,
            invalid,
            qid: 1,
            sqsize: 127,
            subnqn: "nqn.2024-01.io.example:sub".into(),
            hostnqn: "nqn.2024-01.io.example:host".into(),
            cntlid: 1,
        }
    }

    #[test]
    fn only_a_refusal_of_the_attributes_connects_again_with_flow_control() {
        let params = Status::CONNECT_INVALID_PARAMETERS;
        assert!(refused_sqflow_off(&refusal(Status::INVALID_FIELD, None)));
        assert!(refused_sqflow_off(&refusal(
            params,
            Some(InvalidParameter::CATTR)
        )));
        for other in [
            InvalidParameter::SUBNQN,
            InvalidParameter::HOSTNQN,
            InvalidParameter::CNTLID,
            InvalidParameter::QID,
            InvalidParameter::SQSIZE,
        ] {
            assert!(
                !refused_sqflow_off(&refusal(params, Some(other))),
                "{other}"
            );
        }
        assert!(!refused_sqflow_off(&refusal(params, None)));
        assert!(!refused_sqflow_off(&refusal(
            Status::CONNECT_INVALID_HOST,
            None
        )));
        assert!(!refused_sqflow_off(&refusal(
            Status::CONNECT_CONTROLLER_BUSY,
            None
        )));
    }
}

//! DH-HMAC-CHAP on a queue: Authentication Send and Receive as the transport of the host's exchange
//! (`crate::dhchap::host`), the AUTHREQ bits of Connect's response, and the TLS settings a secure channel
//! concatenation generates.

use std::time::Duration;

use nvpoll::mem::DmaPool;
use nvpoll::spec::{self, CommandKind};

use super::options::ConnectOptions;
use crate::queue::{DataDir, HostQueue};
use crate::Error;

/// The least time a host gives each Authentication Send or Receive: what the Linux host gives each admin
/// command (nvme_core.admin_timeout), and what our target gives a host for each step.
const AUTH_TIMEOUT: Duration = Duration::from_secs(60);

/// Connect's AUTHREQ: authentication transaction required.
pub(super) const AUTHREQ_ATR: u16 = 1 << 1;
/// Connect's AUTHREQ: secure channel concatenation required.
pub(super) const AUTHREQ_ASCR: u16 = 1 << 2;

/// Authentication Send and Receive on a queue, for the DH-HMAC-CHAP exchange.
struct AuthCommands<'a> {
    q: &'a mut HostQueue,
    pool: &'a DmaPool,
    timeout: Duration,
}

impl crate::dhchap::host::Transport for AuthCommands<'_> {
    type Error = Error;

    fn send(&mut self, msg: &[u8]) -> Result<(), Error> {
        let mut buf = self
            .pool
            .alloc(msg.len())
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        buf.as_mut_slice()[..msg.len()].copy_from_slice(msg);
        let sqe = spec::fabrics::FabricsCommand::AuthSend {
            secp: crate::dhchap::SECP,
            spsp0: crate::dhchap::SPSP,
            spsp1: crate::dhchap::SPSP,
            tl: msg.len() as u32,
        }
        .to_sqe();
        let (cqe, _) = self.q.run(
            sqe,
            DataDir::ToController,
            Some(buf),
            msg.len() as u32,
            self.timeout,
        )?;
        HostQueue::check("Authentication Send", CommandKind::Authentication, &cqe)
    }

    fn receive(&mut self) -> Result<Vec<u8>, Error> {
        let len = crate::dhchap::MAX_MESSAGE;
        let buf = self
            .pool
            .alloc(len)
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let sqe = spec::fabrics::FabricsCommand::AuthReceive {
            secp: crate::dhchap::SECP,
            spsp0: crate::dhchap::SPSP,
            spsp1: crate::dhchap::SPSP,
            al: len as u32,
        }
        .to_sqe();
        let (cqe, buf) = self.q.run(
            sqe,
            DataDir::FromController,
            Some(buf),
            len as u32,
            self.timeout,
        )?;
        HostQueue::check("Authentication Receive", CommandKind::Authentication, &cqe)?;
        let buf =
            buf.ok_or_else(|| Error::Protocol("Authentication Receive returned no buffer".into()))?;
        Ok(buf.as_slice()[..len].to_vec())
    }
}

/// Runs DH-HMAC-CHAP on a queue whose Connect asked for it; with secure channel concatenation (on a queue
/// without TLS), returns the TLS settings of the generated PSK.
pub(super) fn authenticate(
    q: &mut HostQueue,
    opts: &ConnectOptions,
    pool: &DmaPool,
    authreq: u16,
) -> Result<Option<crate::tls::ClientConfig>, Error> {
    let qid = q.qid();
    let Some(auth) = &opts.dhchap else {
        return Err(Error::Auth(format!(
            "queue {qid}: the controller requires authentication and no DH-HMAC-CHAP key was given (--dhchap-secret)"
        )));
    };
    // Concatenation runs on a queue without TLS; one that has TLS authenticates plainly.
    let concat = auth.concat && opts.tls.is_none();
    if authreq & AUTHREQ_ASCR != 0 && !concat {
        return Err(Error::Auth(format!(
            "queue {qid}: the controller requires secure channel concatenation (give --concat)"
        )));
    }
    let plain;
    let auth = if auth.concat && !concat {
        plain = crate::dhchap::host::HostAuth {
            concat: false,
            ..auth.clone()
        };
        &plain
    } else {
        auth
    };
    // A controller's FFDHE arithmetic may take seconds (Linux nvmet's ffdhe8192 in an emulated guest took
    // over 5 s for one challenge): the authentication commands get at least AUTH_TIMEOUT.
    let mut t = AuthCommands {
        q,
        pool,
        timeout: opts.timeout.max(AUTH_TIMEOUT),
    };
    let outcome = crate::dhchap::host::authenticate(auth, &opts.hostnqn, &opts.subnqn, qid, &mut t)
        .map_err(|e| match e {
            // Linux nvmet (6.12 in the guest) may tear the controller down as soon as it has refused the host,
            // before our Authentication Receive reads its AUTH_Failure1: the connection closes mid-transaction
            // (vm-tests/26 and vm_dhchap_kernel, CI runs of 2026-12-06). Said as what it most likely is; a
            // reconnect still retries it like any failed attempt.
            crate::dhchap::host::HostAuthError::Transport(Error::Closed) => Error::Auth(format!(
                "queue {qid}: the controller closed the connection during DH-HMAC-CHAP authentication: it \
                 refused the host (Linux nvmet does so without AUTH_Failure1 when it has torn the controller \
                 down) or failed"
            )),
            crate::dhchap::host::HostAuthError::Transport(e) => e,
            e => Error::Auth(format!("queue {qid}: {e}")),
        })?;
    log::debug!(
        "queue {qid}: authenticated with DH-HMAC-CHAP ({}, {}{}{})",
        outcome.hash,
        outcome.group,
        if outcome.bidirectional {
            ", the controller too"
        } else {
            ""
        },
        if concat {
            ", secure channel concatenation"
        } else {
            ""
        }
    );
    let Some(psk) = &outcome.generated_psk else {
        return Ok(None);
    };
    let (identity, tls_psk) =
        crate::dhchap::concat_tls(outcome.hash, psk, &opts.hostnqn, &opts.subnqn).ok_or_else(
            || {
                Error::Auth(format!(
                    "queue {qid}: no TLS PSK can be derived with {}",
                    outcome.hash
                ))
            },
        )?;
    Ok(Some(crate::tls::ClientConfig::new(identity, tls_psk)))
}

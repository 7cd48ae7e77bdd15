//! The set-up phase: TLS detection and handshake, ICReq/ICResp, and Fabrics Connect, which turns the
//! connection into a queue.

use std::time::Instant;

use nvpoll::spec::{Sqe, Status};

use crate::admin;
use crate::events::TargetEvent;
use crate::handler::Queue;
use crate::options::TlsMode;
use nvpoll_wire::pdu;

use super::capsule::Data;
use super::{Connected, Fatal, Progress, Session, State};

/// What a connection that is not a queue yet is waiting for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SetupPhase {
    /// TLS is configured: waiting for the first byte to tell a ClientHello from a plain ICReq.
    Detect,
    /// The TLS handshake is running.
    Tls,
    /// Waiting for the host's first PDU, an ICReq.
    IcReq,
    /// ICResp sent: waiting for a Fabrics Connect (with its data).
    Connect,
}

/// What only the set-up phase needs (TLS detection and handshake, ICReq, Fabrics Connect): dropped when
/// Connect succeeds.
pub(super) struct Setup {
    pub(super) phase: SetupPhase,
    /// The TLS handshake while [`SetupPhase::Tls`] runs, and the bytes it has not consumed yet.
    pub(super) tls_hs: Option<nvpoll_tls::Handshake>,
    pub(super) tls_inb: Vec<u8>,
    /// ICReq and Connect must have come by then.
    pub(super) connect_deadline: Instant,
}

impl Session {
    /// Before ICReq on a TLS-enabled target: tells TLS from plain TCP by the first byte, then runs the
    /// handshake one non-blocking step per poll. The connect deadline bounds both.
    pub(super) fn poll_tls(&mut self) -> Progress {
        let State::Setup(setup) = &mut self.state else {
            unreachable!("TLS runs before Connect")
        };
        if setup.phase == SetupPhase::Detect {
            match self.conn.peek_first_byte() {
                Ok(None) => return Progress::Idle,
                Ok(Some(0x16)) => {
                    setup.tls_hs = Some(nvpoll_tls::Handshake::server(
                        self.target.tls_server.clone(),
                    ));
                    setup.phase = SetupPhase::Tls;
                }
                Ok(Some(_)) if self.listener.tls == TlsMode::Required => {
                    self.close(None, "TLS is required and the host sent plaintext".into());
                    return Progress::Busy;
                }
                Ok(Some(_)) => {
                    setup.phase = SetupPhase::IcReq;
                    return Progress::Busy;
                }
                // Closed before its first byte (a probe, or a host that gave up) is an ordinary close.
                Err(e) => return self.close_on(e),
            }
        }
        match self.conn.tls_step(&mut setup.tls_hs, &mut setup.tls_inb) {
            Ok(true) => {
                setup.phase = SetupPhase::IcReq;
                Progress::Busy
            }
            Ok(false) => Progress::Idle,
            Err(e) => {
                self.close(None, format!("TLS handshake failed: {e}"));
                Progress::Busy
            }
        }
    }

    /// ICReq: the ICResp grants the digests the host asked for; from now on PDUs carry data.
    pub(super) fn on_icreq(&mut self, ic: &pdu::IcReq) {
        let limits = &self.target.limits;
        // Grant exactly the digests the host asked for: Linux refuses an ICResp that differs.
        self.digests = ic.digests;
        self.hpda = ic.hpda;
        let resp = pdu::IcResp {
            pfv: pdu::PFV_1_0,
            cpda: 0,
            digests: ic.digests,
            maxh2cdata: limits.maxh2cdata,
        };
        pdu::encode_ic_resp(self.conn.tx_buf(), &resp);
        self.conn.pdu_queued();
        let max_data = limits.maxh2cdata.max(limits.incapsule_data);
        self.decode = pdu::DecodeConfig::new(pdu::Direction::ToController, ic.digests, max_data);
        if let State::Setup(setup) = &mut self.state {
            setup.phase = SetupPhase::Connect;
        }
    }

    /// Runs a Fabrics Connect with its data (the Connect data: in the capsule, or gathered with R2T).
    pub(super) fn connect(&mut self, sqe: &Sqe, data: Data<'_>) -> Result<(), Fatal> {
        let data = match data {
            Data::Received(range) => &self.conn.rx_data()[range],
            Data::Gathered(buf) => buf,
        };
        let outcome = admin::connect(&self.target, &self.listener, sqe, data, self.tls_identity());
        self.finish_connect(sqe.cid, outcome)
    }

    /// The outcome of a Connect: the connection becomes a queue, or the host hears why not.
    fn finish_connect(
        &mut self,
        cid: u16,
        outcome: Result<Queue, admin::Refusal>,
    ) -> Result<(), Fatal> {
        match outcome {
            Ok(mut q) => {
                q.sqhd = (1 % (u32::from(q.sqsize) + 1)) as u16;
                let cntlid = q.ctrl.cntlid;
                self.target.emit(&TargetEvent::QueueConnected {
                    peer: self.peer,
                    subnqn: &q.subsys.nqn,
                    hostnqn: &q.ctrl.hostnqn,
                    cntlid,
                    qid: q.qid,
                    depth: u32::from(q.sqsize) + 1,
                    digests: self.digests,
                });
                // A host known not to take a KeyUpdate renews by being closed at the count.
                self.conn
                    .set_key_renewal(self.target.key_renewal(Some(&q.ctrl.hostnqn)));
                // The set-up state goes: a connected session carries only its queue.
                self.state = State::Connected(Connected {
                    queue: q,
                    disconnected: None,
                });
                let limits = &self.target.limits;
                let max_data = limits.maxh2cdata.max(limits.incapsule_data);
                self.conn.reserve_rx(max_data as usize + 4096);
                // AUTHREQ (dword 0 bits 31:16): bit 1, an authentication transaction is required.
                // Bit 2: secure channel concatenation required as well.
                let authreq = match self.state.queue().and_then(|q| q.auth.as_ref()) {
                    Some(a) if a.concat_required() => (1u32 << 17) | (1 << 18),
                    Some(_) => 1u32 << 17,
                    None => 0,
                };
                self.complete(cid, Status::SUCCESS, u32::from(cntlid) | authreq, 0)
            }
            Err(r) => {
                self.target
                    .stats
                    .connects_rejected
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.target.emit(&TargetEvent::ConnectRefused {
                    peer: self.peer,
                    subnqn: &r.subnqn,
                    hostnqn: &r.hostnqn,
                    qid: r.qid,
                    reason: &r.reason,
                });
                self.complete(cid, r.status, r.dw0, 0)
            }
        }
    }

    /// Whether the connection waits for Fabrics Connect (ICReq done).
    #[inline]
    pub(super) fn awaiting_connect(&self) -> bool {
        self.state.setup_phase() == Some(SetupPhase::Connect)
    }

    /// The PSK identity the host proved in the TLS handshake, if the connection runs TLS.
    fn tls_identity(&self) -> Option<&[u8]> {
        self.conn.tls_session().map(|s| s.psk_identity())
    }
}

//! In-band authentication (DH-HMAC-CHAP) on a queue: Authentication Send and Receive, the jobs that run the
//! Diffie-Hellman work on threads of their own, and the events a finished or failed transaction emits.

use std::time::Instant;

use nvpoll::spec::{fabrics, Sqe, Status};

use crate::events::TargetEvent;
use crate::handler::Reply;
use nvpoll_wire::dhchap;

use super::slots::SlotState;
use super::{Fatal, Session};

impl Session {
    /// Authentication Send (with its data) or Receive.
    pub(super) fn on_auth(&mut self, sqe: Sqe, data: &[u8]) -> Result<(), Fatal> {
        let Some(send) = auth_request(&sqe, data.len()) else {
            return self.complete(sqe.cid, Status::INVALID_FIELD.with_dnr(), 0, 0);
        };
        if self.auth_jobs > 0 {
            // One authentication command at a time: the previous one is still being computed.
            return self.complete(sqe.cid, Status::COMMAND_SEQUENCE_ERROR, 0, 0);
        }
        let starts = send && data.len() >= 2 && data[0] == 0 && data[1] == 0;
        if let Err(why) = self.auth_step(starts) {
            self.emit_auth_failed(why);
            return self.complete(sqe.cid, Status::INVALID_FIELD.with_dnr(), 0, 0);
        }
        let q = self
            .state
            .queue_mut()
            .expect("a connected session has a queue");
        let Some(auth) = q.auth.as_mut() else {
            let why = "Authentication Receive before any AUTH_Negotiate".to_string();
            self.emit_auth_failed(&why);
            return self.complete(sqe.cid, Status::COMMAND_SEQUENCE_ERROR.with_dnr(), 0, 0);
        };
        if send {
            match auth.on_send(data) {
                dhchap::controller::SendOutcome::Complete => {
                    self.complete(sqe.cid, Status::SUCCESS, 0, 0)?;
                    self.after_auth();
                    Ok(())
                }
                dhchap::controller::SendOutcome::Invalid => {
                    self.complete(sqe.cid, Status::INVALID_FIELD.with_dnr(), 0, 0)
                }
                dhchap::controller::SendOutcome::Compute(job) => self.run_auth_job(sqe, job),
            }
        } else {
            match auth.on_receive() {
                dhchap::controller::ReceiveOutcome::Message(m) => self.auth_message(sqe, m),
                dhchap::controller::ReceiveOutcome::Compute(job) => self.run_auth_job(sqe, job),
            }
        }
    }

    /// Starts a transaction (`starts`: an AUTH_Negotiate, when none is under way) with the keys as they are
    /// now, or restarts the host's time for its next message; refuses a host with no key on the subsystem.
    fn auth_step(&mut self, starts: bool) -> Result<(), &'static str> {
        let q = self
            .state
            .queue_mut()
            .expect("a connected session has a queue");
        if starts && !q.auth.as_ref().is_some_and(|a| a.in_progress()) {
            // AUTH_Negotiate: a new transaction (first, or a re-authentication) with the keys as they are now.
            let Some(policy) = q.subsys.dhchap_policy(&q.ctrl.hostnqn) else {
                return Err(
                    "Authentication Send from a host with no DH-HMAC-CHAP key on this subsystem",
                );
            };
            match &mut q.auth {
                Some(a) => a.restart(policy),
                None => {
                    q.auth = Some(Box::new(dhchap::controller::ControllerAuth::new(
                        &q.ctrl.hostnqn,
                        &q.subsys.nqn,
                        policy,
                    )))
                }
            }
            q.auth_deadline = Some(Instant::now() + q.auth_step);
        } else if q.auth_deadline.is_some() {
            // A step of the transaction under way: the host's time runs afresh from each of its messages, as
            // nvmet's does (its next message comes after arithmetic of its own, which on a slow machine is
            // the long part).
            q.auth_deadline = Some(Instant::now() + q.auth_step);
        }
        Ok(())
    }

    /// Runs an authentication job: at once when it is cheap (no Diffie-Hellman group), else on a thread of
    /// its own while the command waits in a slot, so that the reactor goes on serving its other queues.
    fn run_auth_job(&mut self, sqe: Sqe, job: dhchap::controller::Job) -> Result<(), Fatal> {
        let heavy = self
            .state
            .queue()
            .and_then(|q| q.auth.as_ref())
            .is_some_and(|a| a.uses_dh());
        if !heavy {
            let c = job();
            return self.resume_auth(sqe, c);
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let spawned = std::thread::Builder::new()
            .name("nvpoll-dhchap".into())
            .spawn(move || {
                // The session may be gone (closed) by the time the job ends: nothing to tell then.
                let _ = tx.send(job());
            });
        if spawned.is_err() {
            self.target
                .stats
                .internal_errors
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return self.complete(sqe.cid, Status::INTERNAL_ERROR, 0, 0);
        }
        self.take_slot(sqe, SlotState::Authenticating { job: rx })?;
        self.auth_jobs += 1;
        Ok(())
    }

    /// Completes the authentication commands whose jobs finished.
    pub(super) fn poll_auth_jobs(&mut self) {
        let mut done = Vec::new();
        for (i, slot) in self.slots.iter().enumerate() {
            if let SlotState::Authenticating { job } = &slot.state {
                match job.try_recv() {
                    Ok(c) => done.push((i, Some(c))),
                    Err(std::sync::mpsc::TryRecvError::Empty) => {}
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => done.push((i, None)),
                }
            }
        }
        for (i, c) in done {
            let sqe = self.slots[i].sqe;
            self.slots[i].state = SlotState::Free;
            self.busy_slots -= 1;
            self.auth_jobs -= 1;
            let r = match c {
                Some(c) => self.resume_auth(sqe, c),
                None => {
                    self.target
                        .stats
                        .internal_errors
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    self.complete(sqe.cid, Status::INTERNAL_ERROR, 0, 0)
                }
            };
            if let Err(f) = r {
                self.close(f.term, f.why);
                return;
            }
        }
    }

    fn resume_auth(&mut self, sqe: Sqe, c: dhchap::controller::Computed) -> Result<(), Fatal> {
        let q = self
            .state
            .queue_mut()
            .expect("a connected session has a queue");
        let Some(auth) = q.auth.as_mut() else {
            return self.complete(sqe.cid, Status::INTERNAL_ERROR, 0, 0);
        };
        match auth.resume(c) {
            dhchap::controller::Resumed::SendComplete => {
                self.complete(sqe.cid, Status::SUCCESS, 0, 0)
            }
            dhchap::controller::Resumed::Message(m) => self.auth_message(sqe, m),
        }
    }

    /// Returns an authentication message to an Authentication Receive; after a success or a failure, says so
    /// in the log, and after a failure ends the queue.
    fn auth_message(&mut self, sqe: Sqe, m: Vec<u8>) -> Result<(), Fatal> {
        self.reply(sqe, Reply::Data(m))?;
        self.after_auth();
        Ok(())
    }

    /// After an authentication command: a failed transaction (the host was told) ends the queue; a finished
    /// one is logged.
    fn after_auth(&mut self) {
        let Some(auth) = self.state.queue().and_then(|q| q.auth.as_ref()) else {
            return;
        };
        if let Some(why) = auth.failed() {
            let why = format!("DH-HMAC-CHAP: {why}");
            self.emit_auth_failed(&why);
            self.close(None, why);
        } else if auth.finished() {
            self.note_authenticated();
        }
    }

    /// Logs a finished authentication once.
    fn note_authenticated(&mut self) {
        let Some(q) = self.state.queue_mut() else {
            return;
        };
        if q.auth_deadline.take().is_none() {
            return;
        }
        let Some((hash, group, bidi)) = q.auth.as_ref().and_then(|a| a.outcome()) else {
            return;
        };
        let mut how = format!(
            "{hash}, {group}, {}",
            if bidi { "bidirectional" } else { "host only" }
        );
        if let Some(psk) = q.auth.as_mut().and_then(|a| a.take_generated_psk()) {
            // Secure channel concatenation: the queues that connect with the generated PSK carry commands.
            match q.subsys.add_generated_key(&q.ctrl.hostnqn, hash, &psk) {
                Some(identity) => how.push_str(&format!(
                    ", secure channel concatenation: TLS identity {identity}"
                )),
                None => how.push_str(", secure channel concatenation refused: no TLS suite for it"),
            }
        }
        self.target
            .stats
            .authentications
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.target.emit(&TargetEvent::Authenticated {
            peer: self.peer,
            subnqn: &q.subsys.nqn,
            hostnqn: &q.ctrl.hostnqn,
            cntlid: q.ctrl.cntlid,
            qid: q.qid,
            how: &how,
        });
    }

    pub(super) fn emit_auth_failed(&self, why: &str) {
        let Some(q) = self.state.queue() else { return };
        self.target
            .stats
            .auth_failures
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.target.emit(&TargetEvent::AuthenticationFailed {
            peer: self.peer,
            subnqn: &q.subsys.nqn,
            hostnqn: &q.ctrl.hostnqn,
            cntlid: q.ctrl.cntlid,
            qid: q.qid,
            reason: why,
        });
    }
}

/// Whether an Authentication Send (`Some(true)`) or Receive (`Some(false)`) with `data_len` bytes of data is
/// well formed: DH-HMAC-CHAP's security protocol, and a transfer length that matches its data pointer (and the
/// data sent); `None` when not (Invalid Field).
fn auth_request(sqe: &Sqe, data_len: usize) -> Option<bool> {
    let cmd = fabrics::FabricsCommand::from_sqe(sqe);
    let (secp, spsp0, spsp1, len, send) = match cmd {
        Some(fabrics::FabricsCommand::AuthSend {
            secp,
            spsp0,
            spsp1,
            tl,
        }) => (secp, spsp0, spsp1, tl, true),
        Some(fabrics::FabricsCommand::AuthReceive {
            secp,
            spsp0,
            spsp1,
            al,
        }) => (secp, spsp0, spsp1, al, false),
        _ => return None,
    };
    let sgl_len = sqe.sgl().length;
    let valid = secp == dhchap::SECP
        && spsp0 == dhchap::SPSP
        && spsp1 == dhchap::SPSP
        && len == sgl_len
        && !(send && data_len as u32 != len)
        && len != 0;
    valid.then_some(send)
}

//! The controller's side of DH-HMAC-CHAP on one queue, as a state machine a target drives with the
//! Authentication Send and Receive commands it gets. The Diffie-Hellman work (milliseconds for the large
//! groups) is handed back as a [`Job`] for the caller to run off its reactor; [`ControllerAuth::resume`] takes
//! the result.
//!
//! A wrong message never stops the machine: the command completes, the next Authentication Receive answers
//! AUTH_Failure1 with the reason, and the caller ends the queue ([`ControllerAuth::failed`]).

use std::fmt;

use zeroize::Zeroizing;

use super::{
    random, response, responses_match, usable, Choice, DhGroup, FailureReason, Hash, KeyPair,
    Message, ResponseInput, Role, Secret,
};

/// What the controller accepts and the keys it checks, fixed when a transaction starts.
#[derive(Clone, Debug)]
pub struct Policy {
    /// The host's secret.
    pub secret: Secret,
    /// The controller's secret, for hosts that authenticate the controller; a host that asks without one
    /// being configured is refused.
    pub ctrl_secret: Option<Secret>,
    /// Hashes allowed, strongest preferred (empty: all).
    pub hashes: Vec<Hash>,
    /// DH groups allowed, strongest preferred (empty: all).
    pub groups: Vec<DhGroup>,
    /// Secure channel concatenation required: the transaction must ask for a generated TLS PSK (SC_C 01h),
    /// with an FFDHE group and SHA-256 or SHA-384; one that does not is refused (SC_C mismatch).
    pub concat: bool,
}

/// The first of what the policy allows (`policy`, strongest preferred, or when it names none every one,
/// strongest first; under secure channel concatenation, less the one it cannot use) that the host offers by
/// identifier; else the failure and why.
fn choose<T: Choice>(
    policy: &[T],
    concat: bool,
    offered: &[u8],
) -> Result<T, (FailureReason, String)> {
    let allowed = if policy.is_empty() {
        usable(T::ALL.iter().rev(), concat)
    } else {
        usable(policy, concat)
    };
    allowed
        .iter()
        .copied()
        .find(|x| offered.contains(&x.id()))
        .ok_or_else(|| {
            let (reason, what) = T::UNUSABLE;
            (
                reason,
                format!("the host offers {what} {offered:?}, none of {allowed:?}"),
            )
        })
}

/// Work to run off the reactor; its result goes to [`ControllerAuth::resume`].
pub type Job = Box<dyn FnOnce() -> Computed + Send>;

/// The result of a [`Job`].
pub enum Computed {
    /// A key pair for the challenge.
    KeyPair(Option<KeyPair>),
    /// The check of the host's reply: R2 to send if the host asked and the generated PSK with secure
    /// channel concatenation, or why it failed.
    Verdict(Result<Verified, FailureReason>),
}

impl fmt::Debug for Computed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Computed::KeyPair(k) => write!(f, "KeyPair({})", k.is_some()),
            Computed::Verdict(v) => write!(f, "Verdict({:?})", v.as_ref().map(|r| r.r2.is_some())),
        }
    }
}

/// What a good Reply yields.
pub struct Verified {
    /// R2, when the host asked to authenticate the controller.
    pub r2: Option<Zeroizing<Vec<u8>>>,
    /// The generated PSK, with secure channel concatenation.
    pub generated_psk: Option<Zeroizing<Vec<u8>>>,
}

/// What the caller does with an Authentication Send.
pub enum SendOutcome {
    /// Complete it successfully (a failure, if any, is told by the next Authentication Receive).
    Complete,
    /// Complete it with Invalid Field (a command the machine cannot take at all, e.g. an empty transfer).
    Invalid,
    /// Run the job, then [`ControllerAuth::resume`]; complete the command after.
    Compute(Job),
}

/// What the caller does with an Authentication Receive.
pub enum ReceiveOutcome {
    /// Return this message.
    Message(Vec<u8>),
    /// Run the job, then [`ControllerAuth::resume`], which gives the message.
    Compute(Job),
}

/// The result of [`ControllerAuth::resume`].
#[derive(Debug)]
pub enum Resumed {
    /// The Authentication Send that waited completes successfully.
    SendComplete,
    /// The Authentication Receive that waited returns this message.
    Message(Vec<u8>),
}

enum State {
    /// Waiting for AUTH_Negotiate.
    Negotiate,
    /// Negotiated; the next Authentication Receive gets the challenge.
    Chosen { hash: Hash, group: DhGroup },
    /// A key pair is being made for the challenge.
    MakingKey { hash: Hash, group: DhGroup },
    /// Challenge sent; waiting for the Reply.
    Challenged {
        hash: Hash,
        group: DhGroup,
        seq: u32,
        cval: Vec<u8>,
        kp: Option<KeyPair>,
    },
    /// The reply is being checked.
    Checking { hash: Hash },
    /// The reply was right; the next Authentication Receive gets Success1 (with R2 if asked).
    Verified {
        hash: Hash,
        r2: Option<Zeroizing<Vec<u8>>>,
    },
    /// Success1 with R2 sent; waiting for Success2 or Failure2.
    AwaitSuccess2,
    /// The next Authentication Receive gets AUTH_Failure1 with this reason.
    Failure1(FailureReason),
    /// The host is authenticated.
    Done,
    /// The transaction failed and the host was told: end the queue.
    Failed(String),
}

/// DH-HMAC-CHAP on one queue of a controller.
pub struct ControllerAuth {
    hostnqn: String,
    subnqn: String,
    policy: Policy,
    tid: u16,
    state: State,
    /// Why the transaction failed (for the log; never key material).
    why: Option<String>,
    /// Whether the queue was authenticated before this transaction (a re-authentication).
    was_authenticated: bool,
    outcome: Option<(Hash, DhGroup, bool)>,
    /// SC_C of the transaction.
    sc_c: u8,
    /// The generated PSK of a concatenation transaction, until the caller takes it.
    generated_psk: Option<Zeroizing<Vec<u8>>>,
}

impl fmt::Debug for ControllerAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ControllerAuth({} -> {}, tid {}, {})",
            self.hostnqn,
            self.subnqn,
            self.tid,
            self.state_name()
        )
    }
}

impl ControllerAuth {
    /// A queue of host `hostnqn` on subsystem `subnqn` that must authenticate with `policy`.
    pub fn new(hostnqn: &str, subnqn: &str, policy: Policy) -> ControllerAuth {
        ControllerAuth {
            hostnqn: hostnqn.to_string(),
            subnqn: subnqn.to_string(),
            policy,
            tid: 0,
            state: State::Negotiate,
            why: None,
            was_authenticated: false,
            outcome: None,
            sc_c: 0,
            generated_psk: None,
        }
    }

    /// Takes the generated PSK of a finished secure channel concatenation (key material).
    pub fn take_generated_psk(&mut self) -> Option<Zeroizing<Vec<u8>>> {
        self.generated_psk.take()
    }

    /// Whether the policy requires secure channel concatenation.
    pub fn concat_required(&self) -> bool {
        self.policy.concat
    }

    /// Whether the host is authenticated (commands other than authentication may run).
    pub fn authenticated(&self) -> bool {
        // A concatenation transaction proves the host, but the queue it ran on has no TLS: only the queues
        // that connect again with the generated PSK carry commands.
        (matches!(self.state, State::Done) && self.sc_c == 0) || self.was_authenticated
    }

    /// Whether the last transaction finished (with or without concatenation).
    pub fn finished(&self) -> bool {
        matches!(self.state, State::Done)
    }

    /// Why the transaction failed, once the host was told (the caller ends the queue).
    pub fn failed(&self) -> Option<&str> {
        match &self.state {
            State::Failed(why) => Some(why),
            _ => None,
        }
    }

    /// The hash, group and direction of the last successful transaction.
    pub fn outcome(&self) -> Option<(Hash, DhGroup, bool)> {
        self.outcome
    }

    /// Whether the transaction under way has a Diffie-Hellman group (its jobs take milliseconds: run them
    /// off the reactor).
    pub fn uses_dh(&self) -> bool {
        match &self.state {
            State::Chosen { group, .. }
            | State::MakingKey { group, .. }
            | State::Challenged { group, .. } => *group != DhGroup::Null,
            State::Checking { .. } => self.outcome.is_some_and(|o| o.1 != DhGroup::Null),
            _ => false,
        }
    }

    /// Whether a transaction is under way (started and neither done nor failed).
    pub fn in_progress(&self) -> bool {
        !matches!(
            self.state,
            State::Negotiate | State::Done | State::Failed(_)
        )
    }

    fn state_name(&self) -> &'static str {
        match self.state {
            State::Negotiate => "waiting for Negotiate",
            State::Chosen { .. } | State::MakingKey { .. } => "challenge due",
            State::Challenged { .. } => "waiting for Reply",
            State::Checking { .. } | State::Verified { .. } => "Success1 due",
            State::AwaitSuccess2 => "waiting for Success2",
            State::Failure1(_) => "Failure1 due",
            State::Done => "authenticated",
            State::Failed(_) => "failed",
        }
    }

    fn fail(&mut self, reason: FailureReason, why: String) -> SendOutcome {
        self.why = Some(why);
        self.state = State::Failure1(reason);
        SendOutcome::Complete
    }

    /// Starts a new transaction with a new policy (keys changed since): a re-authentication of a queue that
    /// is authenticated keeps it usable while the transaction runs, as the specification allows.
    pub fn restart(&mut self, policy: Policy) {
        self.was_authenticated = self.authenticated();
        self.policy = policy;
        self.state = State::Negotiate;
        self.why = None;
    }

    /// An Authentication Send carrying `data`.
    pub fn on_send(&mut self, data: &[u8]) -> SendOutcome {
        let msg = match Message::parse(data) {
            Ok(m) => m,
            Err(e) => {
                return self.fail(FailureReason::IncorrectPayload, e.to_string());
            }
        };
        match (msg, &self.state) {
            (
                Message::Negotiate {
                    tid,
                    sc_c,
                    hashes,
                    groups,
                    dhchap,
                },
                State::Negotiate | State::Done,
            ) => {
                self.tid = tid;
                self.sc_c = sc_c;
                if data.len() != 8 + 64 * usize::from(data[7]) {
                    return self.fail(
                        FailureReason::IncorrectPayload,
                        format!("AUTH_Negotiate of {} bytes", data.len()),
                    );
                }
                let want = if self.policy.concat {
                    super::SC_C_NEW_TLS_PSK
                } else {
                    super::SC_C_NONE
                };
                if sc_c != want {
                    return self.fail(
                        FailureReason::SccMismatch,
                        if self.policy.concat {
                            format!("secure channel concatenation is required and SC_C is {sc_c}")
                        } else {
                            format!("secure channel concatenation {sc_c} asked for and not offered")
                        },
                    );
                }
                if !dhchap {
                    return self.fail(
                        FailureReason::ProtocolUnusable,
                        "AUTH_Negotiate offers no DH-HMAC-CHAP".into(),
                    );
                }
                let concat = self.policy.concat;
                let chosen = choose(&self.policy.hashes, concat, &hashes)
                    .and_then(|hash| Ok((hash, choose(&self.policy.groups, concat, &groups)?)));
                let (hash, group) = match chosen {
                    Ok(c) => c,
                    Err((reason, why)) => return self.fail(reason, why),
                };
                self.state = State::Chosen { hash, group };
                SendOutcome::Complete
            }
            (
                Message::Reply {
                    tid,
                    cvalid,
                    seq: seq2,
                    rval,
                    cval: c2,
                    dhv,
                },
                State::Challenged { hash, group, .. },
            ) => {
                let (hash, group) = (*hash, *group);
                if tid != self.tid {
                    return self.fail(
                        FailureReason::IncorrectPayload,
                        format!("Reply for transaction {tid}, expected {}", self.tid),
                    );
                }
                if rval.len() != hash.output_len()
                    || data.len() != 16 + 2 * hash.output_len() + dhv.len()
                {
                    return self.fail(
                        FailureReason::IncorrectPayload,
                        format!("Reply of {} bytes with HL {}", data.len(), rval.len()),
                    );
                }
                if dhv.len() != group.value_len() {
                    return self.fail(
                        FailureReason::IncorrectPayload,
                        format!("Reply with a {}-byte public value for {group}", dhv.len()),
                    );
                }
                if cvalid && seq2 == 0 {
                    return self.fail(
                        FailureReason::IncorrectPayload,
                        "Reply asks for controller authentication with sequence number 0".into(),
                    );
                }
                let ctrl_secret = match (cvalid, &self.policy.ctrl_secret) {
                    (true, None) => {
                        return self.fail(
                            FailureReason::Failed,
                            "the host asks to authenticate the controller, which has no controller key for it"
                                .into(),
                        );
                    }
                    (true, Some(s)) => Some(s.clone()),
                    (false, _) => None,
                };
                let State::Challenged { seq, cval, kp, .. } =
                    std::mem::replace(&mut self.state, State::Checking { hash })
                else {
                    unreachable!("matched above")
                };
                let secret = self.policy.secret.clone();
                let (hostnqn, subnqn, tid) = (self.hostnqn.clone(), self.subnqn.clone(), self.tid);
                let sc_c = self.sc_c;
                SendOutcome::Compute(Box::new(move || {
                    let dh = match &kp {
                        Some(kp) => match kp.shared(&dhv) {
                            Ok(z) => Some(z),
                            Err(_) => {
                                return Computed::Verdict(Err(FailureReason::IncorrectPayload))
                            }
                        },
                        None => None,
                    };
                    let input = ResponseInput {
                        hash,
                        challenge: &cval,
                        dh_secret: dh.as_deref().map(|v| &v[..]),
                        seq,
                        tid,
                        sc_c,
                        hostnqn: &hostnqn,
                        subnqn: &subnqn,
                    };
                    let expected = response(Role::Host, &secret, &input);
                    if !responses_match(&rval, &expected) {
                        return Computed::Verdict(Err(FailureReason::Failed));
                    }
                    let r2 = ctrl_secret.map(|cs| {
                        response(
                            Role::Controller,
                            &cs,
                            &ResponseInput {
                                challenge: &c2,
                                seq: seq2,
                                ..input
                            },
                        )
                    });
                    let generated_psk = match (&dh, sc_c) {
                        (Some(ks), super::SC_C_NEW_TLS_PSK) => {
                            Some(super::generated_psk(hash, ks, &cval, &c2))
                        }
                        _ => None,
                    };
                    Computed::Verdict(Ok(Verified { r2, generated_psk }))
                }))
            }
            (Message::Success2 { tid }, State::AwaitSuccess2) => {
                if tid != self.tid || data.len() != 16 {
                    return self.fail(
                        FailureReason::IncorrectPayload,
                        format!("Success2 for transaction {tid} ({} bytes)", data.len()),
                    );
                }
                self.state = State::Done;
                SendOutcome::Complete
            }
            (
                Message::Failure {
                    tid,
                    second: true,
                    explanation,
                    ..
                },
                State::AwaitSuccess2,
            ) if tid == self.tid => {
                let why = format!(
                    "the host did not accept the controller's response: {}",
                    FailureReason::from_u8(explanation).map_or_else(
                        || format!("explanation {explanation:#04x}"),
                        |r| r.to_string()
                    )
                );
                self.why = Some(why.clone());
                self.state = State::Failed(why);
                SendOutcome::Complete
            }
            (m, _) => {
                let why = format!("{m:?} while {}", self.state_name());
                self.fail(FailureReason::IncorrectProtocolMessage, why)
            }
        }
    }

    /// An Authentication Receive.
    pub fn on_receive(&mut self) -> ReceiveOutcome {
        match std::mem::replace(&mut self.state, State::Negotiate) {
            State::Chosen { hash, group } => {
                self.state = State::MakingKey { hash, group };
                ReceiveOutcome::Compute(Box::new(move || {
                    Computed::KeyPair(KeyPair::generate(group))
                }))
            }
            State::Verified { hash, r2 } => {
                // A hash output is 32, 48 or 64 bytes.
                #[allow(clippy::cast_possible_truncation)]
                let hl = hash.output_len() as u8;
                let msg = Message::Success1 {
                    tid: self.tid,
                    hl,
                    rval: r2.as_ref().map(|r| r.to_vec()),
                };
                self.state = if r2.is_some() {
                    State::AwaitSuccess2
                } else {
                    self.outcome = Some((hash, self.chosen_group(), false));
                    State::Done
                };
                ReceiveOutcome::Message(msg.encode())
            }
            State::Failure1(reason) => self.failure1(reason),
            other => {
                let name = {
                    self.state = other;
                    self.state_name()
                };
                self.why = Some(format!("Authentication Receive while {name}"));
                self.failure1(FailureReason::IncorrectProtocolMessage)
            }
        }
    }

    fn chosen_group(&self) -> DhGroup {
        self.outcome.map_or(DhGroup::Null, |o| o.1)
    }

    fn failure1(&mut self, reason: FailureReason) -> ReceiveOutcome {
        let why = self.why.clone().unwrap_or_else(|| reason.to_string());
        let why = format!("{reason}: {why}");
        self.state = State::Failed(why);
        ReceiveOutcome::Message(
            Message::Failure {
                tid: self.tid,
                second: false,
                code: 1,
                explanation: reason as u8,
            }
            .encode(),
        )
    }

    /// Takes the result of a job.
    pub fn resume(&mut self, c: Computed) -> Resumed {
        match (std::mem::replace(&mut self.state, State::Negotiate), c) {
            (State::MakingKey { hash, group }, Computed::KeyPair(kp)) => {
                let mut cval = vec![0u8; hash.output_len()];
                random(&mut cval);
                let seq = super::next_seq();
                let msg = Message::Challenge {
                    tid: self.tid,
                    hash: hash as u8,
                    group: group as u8,
                    seq,
                    cval: cval.clone(),
                    dhv: kp.as_ref().map_or_else(Vec::new, |k| k.public().to_vec()),
                };
                self.outcome = Some((hash, group, false));
                self.state = State::Challenged {
                    hash,
                    group,
                    seq,
                    cval,
                    kp,
                };
                Resumed::Message(msg.encode())
            }
            (State::Checking { hash }, Computed::Verdict(v)) => {
                match v {
                    Ok(Verified { r2, generated_psk }) => {
                        if let Some(o) = &mut self.outcome {
                            o.2 = r2.is_some();
                        }
                        self.generated_psk = generated_psk;
                        self.state = State::Verified { hash, r2 };
                    }
                    Err(reason) => {
                        self.why = Some(match reason {
                            FailureReason::Failed => {
                                "the host's response does not match its key".to_string()
                            }
                            _ => "the host's public value is not valid for the group".to_string(),
                        });
                        self.state = State::Failure1(reason);
                    }
                }
                Resumed::SendComplete
            }
            (other, c) => {
                // A job result for a state that moved on cannot happen (one command at a time); treat it as a
                // protocol failure rather than trusting it.
                self.state = other;
                self.why = Some(format!(
                    "unexpected job result {c:?} while {}",
                    self.state_name()
                ));
                self.state = State::Failure1(FailureReason::IncorrectProtocolMessage);
                Resumed::SendComplete
            }
        }
    }
}

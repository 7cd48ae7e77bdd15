//! The host's side of one DH-HMAC-CHAP transaction, over any way of sending and receiving messages (the
//! initiator runs it with Authentication Send and Receive on a queue it just connected).

use super::{
    random, response, responses_match, usable, AuthError, DhGroup, FailureReason, Hash, KeyPair,
    Message, ResponseInput, Role, Secret,
};

/// How a host authenticates.
#[derive(Clone, Debug)]
pub struct HostAuth {
    /// The host's secret (nvme-cli's `--dhchap-secret`).
    pub secret: Secret,
    /// The controller's secret, to authenticate the controller too (nvme-cli's `--dhchap-ctrl-secret`).
    pub ctrl_secret: Option<Secret>,
    /// Hashes offered, in order of preference (default: all).
    pub hashes: Vec<Hash>,
    /// DH groups offered, in order of preference (default: all, null last).
    pub groups: Vec<DhGroup>,
    /// Secure channel concatenation (nvme-cli's `--concat`): the admin queue's transaction generates a TLS
    /// PSK, and every queue then runs TLS with it. Only SHA-256 and SHA-384 and the FFDHE groups are offered.
    pub concat: bool,
}

impl HostAuth {
    /// Offers every hash (SHA-512 first) and every group (the strongest first, null last).
    pub fn new(secret: Secret, ctrl_secret: Option<Secret>) -> HostAuth {
        HostAuth {
            secret,
            ctrl_secret,
            hashes: vec![Hash::Sha512, Hash::Sha384, Hash::Sha256],
            groups: vec![
                DhGroup::Ffdhe8192,
                DhGroup::Ffdhe6144,
                DhGroup::Ffdhe4096,
                DhGroup::Ffdhe3072,
                DhGroup::Ffdhe2048,
                DhGroup::Null,
            ],
            concat: false,
        }
    }
}

/// Sends and receives the messages of one transaction.
pub trait Transport {
    /// The transport's own error.
    type Error;
    /// Sends a message (Authentication Send).
    fn send(&mut self, msg: &[u8]) -> Result<(), Self::Error>;
    /// Receives the controller's next message (Authentication Receive).
    fn receive(&mut self) -> Result<Vec<u8>, Self::Error>;
}

/// How a transaction failed.
#[derive(Debug, thiserror::Error)]
pub enum HostAuthError<E> {
    /// The controller refused the host (AUTH_Failure1).
    #[error("the controller refused authentication: {0}")]
    Refused(String),
    /// The controller did not prove the controller key (AUTH_Failure2 was sent).
    #[error("the controller failed to prove its key (controller authentication): {0}")]
    ControllerNotAuthenticated(&'static str),
    /// The controller broke the protocol (AUTH_Failure2 was sent where it could be).
    #[error("{0}")]
    Protocol(AuthError),
    /// Sending or receiving failed.
    #[error("transport: {0}")]
    Transport(E),
}

/// What a successful transaction agreed on.
pub struct Outcome {
    /// The hash.
    pub hash: Hash,
    /// The DH group.
    pub group: DhGroup,
    /// Whether the controller was authenticated too.
    pub bidirectional: bool,
    /// With secure channel concatenation: the generated PSK ([`super::generated_psk`]). Key material.
    pub generated_psk: Option<zeroize::Zeroizing<Vec<u8>>>,
}

impl std::fmt::Debug for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Outcome({}, {}, bidirectional {}, generated PSK {})",
            self.hash,
            self.group,
            self.bidirectional,
            if self.generated_psk.is_some() {
                "<redacted>"
            } else {
                "none"
            }
        )
    }
}

/// Runs one transaction as the host `hostnqn` with subsystem `subnqn`, transaction ID `tid`.
pub fn authenticate<T: Transport>(
    auth: &HostAuth,
    hostnqn: &str,
    subnqn: &str,
    tid: u16,
    t: &mut T,
) -> Result<Outcome, HostAuthError<T::Error>> {
    let sc_c = if auth.concat {
        super::SC_C_NEW_TLS_PSK
    } else {
        super::SC_C_NONE
    };
    let offered_hashes: Vec<Hash> = usable(&auth.hashes, auth.concat);
    let offered_groups: Vec<DhGroup> = usable(&auth.groups, auth.concat);
    let negotiate = Message::Negotiate {
        tid,
        sc_c,
        hashes: offered_hashes.iter().map(|h| *h as u8).collect(),
        groups: offered_groups.iter().map(|g| *g as u8).collect(),
        dhchap: true,
    };
    t.send(&negotiate.encode())
        .map_err(HostAuthError::Transport)?;
    let fail2 = |t: &mut T, reason: FailureReason| {
        let m = Message::Failure {
            tid,
            second: true,
            code: 1,
            explanation: reason as u8,
        };
        // The transaction failed already; the controller hearing why is a courtesy.
        let _ = t.send(&m.encode());
    };
    let proto = |what: String| HostAuthError::Protocol(AuthError::Message(what));

    let msg = Message::parse(&t.receive().map_err(HostAuthError::Transport)?)
        .map_err(HostAuthError::Protocol)?;
    let (hash, group, seq, cval, dhv) = match msg {
        Message::Challenge {
            tid: ctid,
            hash,
            group,
            seq,
            cval,
            dhv,
        } => {
            if ctid != tid {
                return Err(proto(format!(
                    "Challenge for transaction {ctid}, expected {tid}"
                )));
            }
            let hash = Hash::from_id(hash)
                .filter(|h| offered_hashes.contains(h))
                .ok_or_else(|| proto(format!("Challenge with hash {hash} that was not offered")))?;
            let group = DhGroup::from_id(group)
                .filter(|g| offered_groups.contains(g))
                .ok_or_else(|| {
                    proto(format!(
                        "Challenge with DH group {group} that was not offered"
                    ))
                })?;
            if cval.len() != hash.output_len() {
                return Err(proto(format!(
                    "Challenge of {} bytes for {hash} (needs {})",
                    cval.len(),
                    hash.output_len()
                )));
            }
            if dhv.len() != group.value_len() {
                return Err(proto(format!(
                    "Challenge with a {}-byte public value for {group}",
                    dhv.len()
                )));
            }
            (hash, group, seq, cval, dhv)
        }
        Message::Failure {
            code, explanation, ..
        } => return Err(HostAuthError::Refused(failure_text(code, explanation))),
        other => return Err(proto(format!("expected a Challenge, got {other:?}"))),
    };

    let (dh_secret, our_public) = match KeyPair::generate(group) {
        Some(kp) => match kp.shared(&dhv) {
            Ok(z) => (Some(z), kp.public().to_vec()),
            Err(e) => {
                fail2(t, FailureReason::IncorrectPayload);
                return Err(HostAuthError::Protocol(e));
            }
        },
        None => (None, Vec::new()),
    };
    let input = ResponseInput {
        hash,
        challenge: &cval,
        dh_secret: dh_secret.as_deref().map(|v| &v[..]),
        seq,
        tid,
        sc_c,
        hostnqn,
        subnqn,
    };
    let r1 = response(Role::Host, &auth.secret, &input);
    let mut c2 = vec![0u8; hash.output_len()];
    let (seq2, expected_r2) = match &auth.ctrl_secret {
        Some(cs) => {
            random(&mut c2);
            let seq2 = super::next_seq();
            let r2 = response(
                Role::Controller,
                cs,
                &ResponseInput {
                    challenge: &c2,
                    seq: seq2,
                    ..input
                },
            );
            (seq2, Some(r2))
        }
        None => (0, None),
    };
    let generated = match (&dh_secret, auth.concat) {
        (Some(ks), true) => Some(super::generated_psk(hash, ks, &cval, &c2)),
        _ => None,
    };
    let reply = Message::Reply {
        tid,
        cvalid: expected_r2.is_some(),
        seq: seq2,
        rval: r1.to_vec(),
        cval: c2,
        dhv: our_public,
    };
    t.send(&reply.encode()).map_err(HostAuthError::Transport)?;

    let msg = Message::parse(&t.receive().map_err(HostAuthError::Transport)?)
        .map_err(HostAuthError::Protocol)?;
    match msg {
        Message::Success1 {
            tid: stid,
            hl,
            rval,
        } => {
            if stid != tid || usize::from(hl) != hash.output_len() {
                fail2(t, FailureReason::IncorrectPayload);
                return Err(proto(format!(
                    "Success1 for transaction {stid} with HL {hl}, expected {tid} and {}",
                    hash.output_len()
                )));
            }
            if let Some(expected) = expected_r2 {
                let Some(r2) = rval else {
                    fail2(t, FailureReason::Failed);
                    return Err(HostAuthError::ControllerNotAuthenticated(
                        "Success1 carried no response to the host's challenge",
                    ));
                };
                if !responses_match(&r2, &expected) {
                    fail2(t, FailureReason::Failed);
                    return Err(HostAuthError::ControllerNotAuthenticated(
                        "its response does not match the controller key",
                    ));
                }
                t.send(&Message::Success2 { tid }.encode())
                    .map_err(HostAuthError::Transport)?;
            }
            Ok(Outcome {
                hash,
                group,
                bidirectional: auth.ctrl_secret.is_some(),
                generated_psk: generated,
            })
        }
        Message::Failure {
            code, explanation, ..
        } => Err(HostAuthError::Refused(failure_text(code, explanation))),
        other => Err(proto(format!("expected Success1, got {other:?}"))),
    }
}

fn failure_text(code: u8, explanation: u8) -> String {
    match FailureReason::from_u8(explanation) {
        Some(r) if code == 1 => r.to_string(),
        _ => format!("reason code {code:#04x}, explanation {explanation:#04x}"),
    }
}

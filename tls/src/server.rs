//! The server side of the PSK handshake: ClientHello checks, PSK lookup by identity, binder check,
//! group choice (HelloRetryRequest when the client shared none of ours), ServerHello, EncryptedExtensions,
//! Finished. No session tickets are ever sent.

use std::fmt;
use std::sync::Arc;

use super::common::{expect, Core, HandshakeState, Negotiated, AFTER_FINISHED};
use super::error::TlsError;
use super::keys::Psk;
use super::kx::{Group, KeyPair};
use super::msgs::{
    ext, ht, put_ext, put_handshake, put_prefixed, ClientHello, HRR_RANDOM, PSK_DHE_KE, PSK_KE,
    TLS12, TLS13,
};
use super::record::{CipherSuite, Traffic};
use super::schedule::{ct_eq, verify_data, KeySchedule, Secret, Transcript};

/// Looks a PSK up by the identity a client offers (None: unknown). Called once per offered identity, in
/// the client's order, until one is found.
pub type PskLookup = Arc<dyn Fn(&[u8]) -> Option<Psk> + Send + Sync>;

/// Rejected 0-RTT data a server skips at most (bytes of records that fail to decrypt right after the
/// ClientHello offered early_data).
const EARLY_DATA_SKIP: usize = 64 * 1024;

/// Server settings.
#[derive(Clone)]
pub struct ServerConfig {
    /// The PSK of each known identity; the PSK's hash must match a suite the client offers.
    pub psk_lookup: PskLookup,
    /// Groups accepted, most preferred first. A group the client shared is taken before asking for a
    /// preferred one with a HelloRetryRequest.
    pub groups: Vec<Group>,
    /// Accept psk_ke (no (EC)DHE) when the client offers it and no group is common. Off by default.
    pub allow_psk_ke: bool,
}

impl ServerConfig {
    /// x25519 and secp256r1, psk_dhe_ke only.
    pub fn new(psk_lookup: impl Fn(&[u8]) -> Option<Psk> + Send + Sync + 'static) -> ServerConfig {
        ServerConfig {
            psk_lookup: Arc::new(psk_lookup),
            groups: vec![Group::X25519, Group::Secp256r1],
            allow_psk_ke: false,
        }
    }

    /// A server that knows one identity.
    pub fn with_psk(identity: impl Into<Vec<u8>>, psk: Psk) -> ServerConfig {
        let identity = identity.into();
        ServerConfig::new(move |id| (id == identity.as_slice()).then(|| psk.clone()))
    }
}

impl fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerConfig")
            .field("groups", &self.groups)
            .field("allow_psk_ke", &self.allow_psk_ke)
            .finish_non_exhaustive()
    }
}

enum State {
    WaitClientHello,
    WaitSecondClientHello { group: Group },
    WaitFinished,
    Done,
}

pub(crate) struct ServerHs {
    cfg: ServerConfig,
    state: State,
    /// After a HelloRetryRequest: message_hash(ClientHello1) || HelloRetryRequest.
    transcript: Option<Transcript>,
    identity: Option<Vec<u8>>,
    suite: Option<CipherSuite>,
    group: Option<Group>,
    hello_retry: bool,
    sent_ccs: bool,
    client_ap: Option<Secret>,
    expected_finished: Vec<u8>,
}

impl ServerHs {
    pub(crate) fn new(cfg: ServerConfig) -> ServerHs {
        ServerHs {
            cfg,
            state: State::WaitClientHello,
            transcript: None,
            identity: None,
            suite: None,
            group: None,
            hello_retry: false,
            sent_ccs: false,
            client_ap: None,
            expected_finished: Vec::new(),
        }
    }

    pub(crate) fn handle(
        &mut self,
        core: &mut Core,
        typ: u8,
        msg: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<bool, TlsError> {
        match self.state {
            State::WaitClientHello | State::WaitSecondClientHello { .. } => {
                expect(typ, ht::CLIENT_HELLO, "expected ClientHello")?;
                self.client_hello(core, msg, out)
            }
            State::WaitFinished => {
                expect(typ, ht::FINISHED, "expected Finished")?;
                let body = &msg[4..];
                if body.len() != self.expected_finished.len() {
                    return Err(TlsError::Decode("Finished length"));
                }
                if !ct_eq(&self.expected_finished, body) {
                    return Err(TlsError::BadFinished);
                }
                let (Some(suite), Some(client_ap)) = (self.suite, self.client_ap.take()) else {
                    return Err(TlsError::Internal("server key schedule out of order"));
                };
                core.read = Some(Traffic::new(suite, client_ap));
                core.ccs_allowed = false;
                core.early_skip = 0;
                self.state = State::Done;
                Ok(true)
            }
            State::Done => Err(AFTER_FINISHED),
        }
    }

    fn client_hello(
        &mut self,
        core: &mut Core,
        msg: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<bool, TlsError> {
        let ch = ClientHello::decode(msg)?;
        let retry = match self.state {
            State::WaitSecondClientHello { group } => Some(group),
            _ => None,
        };
        if !ch.versions.as_ref().is_some_and(|v| v.contains(&TLS13)) {
            return Err(TlsError::ProtocolVersion);
        }
        if ch.compression != [0] {
            return Err(TlsError::IllegalParameter("compression methods"));
        }
        let Some(psks) = &ch.psk else {
            return Err(TlsError::HandshakeFailure("client offers no PSK"));
        };
        if psks.identities.len() != psks.binders.len() {
            return Err(TlsError::IllegalParameter(
                "PSK identities and binders differ in number",
            ));
        }
        let Some(modes) = ch.psk_modes else {
            return Err(TlsError::MissingExtension("psk_key_exchange_modes"));
        };

        // The PSK: the first known identity whose hash has a suite the client offers.
        let mut known_without_suite = false;
        let mut chosen = None;
        for (i, id) in psks.identities.iter().enumerate() {
            let Some(psk) = (self.cfg.psk_lookup)(id) else {
                continue;
            };
            let suite = CipherSuite::for_hash(psk.hash());
            if !psk.is_empty() && ch.suites.contains(&suite.code()) {
                chosen = Some((i, psk, suite));
                break;
            }
            known_without_suite = true;
        }
        let Some((index, psk, suite)) = chosen else {
            return Err(if known_without_suite {
                TlsError::HandshakeFailure("no offered cipher suite fits the PSK's hash")
            } else {
                TlsError::UnknownIdentity
            });
        };
        if retry.is_some() {
            if self.identity.as_deref() != Some(psks.identities[index]) || self.suite != Some(suite)
            {
                return Err(TlsError::IllegalParameter(
                    "second ClientHello changed the PSK or suite",
                ));
            }
            if ch.early_data {
                return Err(TlsError::IllegalParameter(
                    "early_data after HelloRetryRequest",
                ));
            }
        }

        // The binder, over the transcript up to the truncated ClientHello.
        let hash = suite.hash();
        let mut transcript = self
            .transcript
            .take()
            .unwrap_or_else(|| Transcript::new(hash));
        let early = KeySchedule::early(hash, psk.dangerous_as_bytes());
        let expected = early.ext_binder(&transcript.current_with(&msg[..ch.binders_offset]));
        if !ct_eq(&expected, psks.binders[index]) {
            return Err(TlsError::BadBinder);
        }
        self.identity = Some(psks.identities[index].to_vec());
        self.suite = Some(suite);

        // Key exchange: a group the client shared, else ask for one (once), else psk_ke if allowed.
        let dhe = modes.contains(&PSK_DHE_KE);
        let ke = modes.contains(&PSK_KE) && self.cfg.allow_psk_ke;
        let shares = ch.key_shares.as_deref().unwrap_or(&[]);
        let client_groups = ch.groups.as_deref().unwrap_or(&[]);
        if ch.key_shares.is_some() && ch.groups.is_none() {
            return Err(TlsError::MissingExtension("supported_groups"));
        }
        for (i, (g, _)) in shares.iter().enumerate() {
            if !client_groups.contains(g) {
                return Err(TlsError::IllegalParameter(
                    "key share for a group not in supported_groups",
                ));
            }
            if shares[..i].iter().any(|(h, _)| h == g) {
                return Err(TlsError::IllegalParameter("duplicate key share"));
            }
        }
        if let Some(group) = retry {
            if shares.len() != 1 || shares[0].0 != group.code() {
                return Err(TlsError::IllegalParameter(
                    "second ClientHello lacks the requested key share",
                ));
            }
        }
        let mut kx = None;
        let mut retry_group = None;
        if dhe {
            kx = self.cfg.groups.iter().find_map(|g| {
                shares
                    .iter()
                    .find(|(c, _)| *c == g.code())
                    .map(|(_, k)| (*g, *k))
            });
            retry_group = self
                .cfg
                .groups
                .iter()
                .find(|g| client_groups.contains(&g.code()))
                .copied();
        }
        if kx.is_none() {
            if let (Some(group), None) = (retry_group, retry) {
                transcript.add(msg);
                self.hello_retry_request(core, transcript, &ch, group, suite, out)?;
                return Ok(false);
            }
            if !ke {
                return Err(TlsError::HandshakeFailure(
                    "no common key exchange group or mode",
                ));
            }
        }
        transcript.add(msg);

        let mut sh = Vec::with_capacity(256);
        let mut shared = None;
        let mut random = [0u8; 32];
        aws_lc_rs::rand::fill(&mut random).map_err(|_| TlsError::Internal("RNG failed"))?;
        let kp = match kx {
            Some((group, peer)) => {
                let kp = KeyPair::generate(group)?;
                shared = Some(kp.agree(peer)?);
                self.group = Some(group);
                Some(kp)
            }
            None => None,
        };
        // The identities list is at most 0xffff bytes of at least 7 per identity, so this never fails.
        let index = u16::try_from(index)
            .map_err(|_| TlsError::Decode("more PSK identities than a u16 counts"))?;
        put_server_hello(&mut sh, &random, ch.session_id, suite, |b| {
            if let Some(kp) = &kp {
                put_ext(b, ext::KEY_SHARE, |b| {
                    b.extend_from_slice(&kp.group.code().to_be_bytes());
                    put_prefixed(b, 2, |b| {
                        b.extend_from_slice(&kp.public);
                        Ok(())
                    })
                })?;
            }
            put_ext(b, ext::PRE_SHARED_KEY, |b| {
                b.extend_from_slice(&index.to_be_bytes());
                Ok(())
            })
        })?;
        drop(kp);
        transcript.add(&sh);
        core.write_handshake(&sh, out)?;
        if !ch.session_id.is_empty() && !self.sent_ccs {
            // Middlebox compatibility mode: the client sent a session id.
            core.write_ccs(out);
            self.sent_ccs = true;
        }

        let hs = early.next(shared.as_ref().map(Secret::as_bytes));
        let th = transcript.current();
        let client_hs = hs.traffic(b"c hs traffic", &th);
        let server_hs = hs.traffic(b"s hs traffic", &th);
        core.write = Some(Traffic::new(suite, server_hs.clone()));
        core.read = Some(Traffic::new(suite, client_hs.clone()));

        let mut flight = Vec::with_capacity(64);
        put_handshake(&mut flight, ht::ENCRYPTED_EXTENSIONS, |b| {
            put_prefixed(b, 2, |_| Ok(()))
        })?;
        transcript.add(&flight);
        let fin_at = flight.len();
        put_handshake(&mut flight, ht::FINISHED, |b| {
            b.extend_from_slice(&verify_data(hash, &server_hs, &transcript.current()));
            Ok(())
        })?;
        transcript.add(&flight[fin_at..]);
        core.write_handshake(&flight, out)?;

        let th = transcript.current();
        let master = hs.next(None);
        self.client_ap = Some(master.traffic(b"c ap traffic", &th));
        core.write = Some(Traffic::new(suite, master.traffic(b"s ap traffic", &th)));
        self.expected_finished = verify_data(hash, &client_hs, &th);
        core.ccs_allowed = true;
        core.skip_plain_app = false;
        if ch.early_data {
            core.early_skip = EARLY_DATA_SKIP;
        }
        self.state = State::WaitFinished;
        Ok(true)
    }

    fn hello_retry_request(
        &mut self,
        core: &mut Core,
        transcript: Transcript,
        ch: &ClientHello<'_>,
        group: Group,
        suite: CipherSuite,
        out: &mut Vec<u8>,
    ) -> Result<(), TlsError> {
        let mut transcript = transcript.restart_for_hrr();
        let mut hrr = Vec::with_capacity(64);
        // A HelloRetryRequest is a ServerHello with the fixed random, naming the group it wants.
        put_server_hello(&mut hrr, &HRR_RANDOM, ch.session_id, suite, |b| {
            put_ext(b, ext::KEY_SHARE, |b| {
                b.extend_from_slice(&group.code().to_be_bytes());
                Ok(())
            })
        })?;
        transcript.add(&hrr);
        core.write_handshake(&hrr, out)?;
        if !ch.session_id.is_empty() {
            core.write_ccs(out);
            self.sent_ccs = true;
        }
        self.transcript = Some(transcript);
        self.hello_retry = true;
        core.ccs_allowed = true;
        core.skip_plain_app = ch.early_data;
        self.state = State::WaitSecondClientHello { group };
        Ok(())
    }

    pub(crate) fn state(&self) -> HandshakeState {
        match self.state {
            State::WaitClientHello => HandshakeState::ServerWaitClientHello,
            State::WaitSecondClientHello { .. } => HandshakeState::ServerWaitSecondClientHello,
            State::WaitFinished => HandshakeState::ServerWaitFinished,
            State::Done => HandshakeState::Done,
        }
    }

    pub(crate) fn identity(&self) -> Option<&[u8]> {
        self.identity.as_deref()
    }

    pub(crate) fn negotiated(&self) -> Option<Negotiated> {
        Some(Negotiated {
            suite: self.suite?,
            group: self.group,
            identity: self.identity.clone()?,
            hello_retry: self.hello_retry,
        })
    }
}

/// Appends a ServerHello (or, with the HelloRetryRequest random, an HRR) to `out`: legacy version, `random`, the
/// client's session id echoed, `suite`, no compression, and the extensions: supported_versions (TLS 1.3) first,
/// then what `extensions` appends.
fn put_server_hello(
    out: &mut Vec<u8>,
    random: &[u8; 32],
    session_id: &[u8],
    suite: CipherSuite,
    extensions: impl FnOnce(&mut Vec<u8>) -> Result<(), TlsError>,
) -> Result<(), TlsError> {
    put_handshake(out, ht::SERVER_HELLO, |b| {
        b.extend_from_slice(&TLS12.to_be_bytes());
        b.extend_from_slice(random);
        put_prefixed(b, 1, |b| {
            b.extend_from_slice(session_id);
            Ok(())
        })?;
        b.extend_from_slice(&suite.code().to_be_bytes());
        b.push(0);
        put_prefixed(b, 2, |b| {
            put_ext(b, ext::SUPPORTED_VERSIONS, |b| {
                b.extend_from_slice(&TLS13.to_be_bytes());
                Ok(())
            })?;
            extensions(b)
        })
    })
}

//! The client side of the PSK handshake: ClientHello with one external PSK and its "ext binder",
//! HelloRetryRequest, ServerHello, EncryptedExtensions, Finished.
//!
//! ```text
//! ClientHello(key_share*, psk_key_exchange_modes, pre_shared_key)  ->
//!                          <- HelloRetryRequest(key_share group, cookie?)        (optional, once)
//! ClientHello(key_share for that group, cookie?)                   ->
//!                          <- ServerHello(key_share?, pre_shared_key = 0)
//!                          <- {EncryptedExtensions} {Finished}
//! {Finished}                                                       ->
//! ```

use std::fmt;

use super::common::{expect, Core, HandshakeState, Negotiated, AFTER_FINISHED};
use super::error::TlsError;
use super::keys::Psk;
use super::kx::{Group, KeyPair};
use super::msgs::{
    check_encrypted_extensions, ext, ht, put_ext, put_handshake, put_prefixed, ServerHello,
    ServerShare, PSK_DHE_KE, PSK_KE, TLS12, TLS13,
};
use super::record::{CipherSuite, Traffic};
use super::schedule::{ct_eq, verify_data, KeySchedule, Secret, Transcript};

/// Client settings.
#[derive(Clone)]
pub struct ClientConfig {
    /// The PSK identity (for NVMe, e.g. `NVMe0R01 <hostnqn> <subnqn>`).
    pub identity: Vec<u8>,
    /// The PSK; its hash picks the one cipher suite offered.
    pub psk: Psk,
    /// Supported groups, most preferred first. Empty: offer psk_ke only (needs `allow_psk_ke`).
    pub groups: Vec<Group>,
    /// Groups to send key shares for in the first ClientHello (a subset of `groups`; the server may ask
    /// for another of `groups` with a HelloRetryRequest).
    pub key_shares: Vec<Group>,
    /// Also offer psk_ke (no (EC)DHE, no forward secrecy). Off by default.
    pub allow_psk_ke: bool,
}

impl ClientConfig {
    /// psk_dhe_ke with shares for x25519 and secp256r1, as GnuTLS (tlshd) sends them.
    pub fn new(identity: impl Into<Vec<u8>>, psk: Psk) -> ClientConfig {
        let groups = vec![Group::X25519, Group::Secp256r1];
        ClientConfig {
            identity: identity.into(),
            psk,
            key_shares: groups.clone(),
            groups,
            allow_psk_ke: false,
        }
    }
}

impl fmt::Debug for ClientConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientConfig")
            .field("identity", &String::from_utf8_lossy(&self.identity))
            .field("psk", &self.psk)
            .field("groups", &self.groups)
            .field("key_shares", &self.key_shares)
            .field("allow_psk_ke", &self.allow_psk_ke)
            .finish()
    }
}

enum State {
    WaitServerHello { retried: bool },
    WaitEncryptedExtensions,
    WaitFinished,
    Done,
}

pub(crate) struct ClientHs {
    cfg: ClientConfig,
    suite: CipherSuite,
    state: State,
    random: [u8; 32],
    shares: Vec<KeyPair>,
    transcript: Transcript,
    early: KeySchedule,
    handshake: Option<KeySchedule>,
    client_hs: Option<Secret>,
    server_hs: Option<Secret>,
    group: Option<Group>,
    hello_retry: bool,
}

impl ClientHs {
    /// Checks the configuration and writes the first ClientHello.
    pub(crate) fn start(
        cfg: ClientConfig,
        core: &mut Core,
        out: &mut Vec<u8>,
    ) -> Result<ClientHs, TlsError> {
        if cfg.identity.is_empty() || cfg.identity.len() > 0xffff - 6 {
            return Err(TlsError::InvalidUse(
                "PSK identity must be 1 to 65529 bytes",
            ));
        }
        if cfg.psk.is_empty() {
            return Err(TlsError::InvalidUse("empty PSK"));
        }
        if cfg.groups.is_empty() && !cfg.allow_psk_ke {
            return Err(TlsError::InvalidUse(
                "no groups and psk_ke not allowed: no key exchange mode to offer",
            ));
        }
        for (i, g) in cfg.groups.iter().enumerate() {
            if cfg.groups[..i].contains(g) {
                return Err(TlsError::InvalidUse("duplicate group"));
            }
        }
        // Shares in the order of `groups`, as RFC 8446 §4.2.8 asks.
        let share_groups: Vec<Group> = cfg
            .groups
            .iter()
            .copied()
            .filter(|g| cfg.key_shares.contains(g))
            .collect();
        if cfg.key_shares.iter().any(|g| !cfg.groups.contains(g)) {
            return Err(TlsError::InvalidUse("key share for a group not in groups"));
        }
        let shares = share_groups
            .into_iter()
            .map(KeyPair::generate)
            .collect::<Result<Vec<_>, _>>()?;
        let mut random = [0u8; 32];
        aws_lc_rs::rand::fill(&mut random).map_err(|_| TlsError::Internal("RNG failed"))?;
        let suite = CipherSuite::for_hash(cfg.psk.hash());
        let hash = suite.hash();
        let early = KeySchedule::early(hash, cfg.psk.dangerous_as_bytes());
        let mut hs = ClientHs {
            cfg,
            suite,
            state: State::WaitServerHello { retried: false },
            random,
            shares,
            transcript: Transcript::new(hash),
            early,
            handshake: None,
            client_hs: None,
            server_hs: None,
            group: None,
            hello_retry: false,
        };
        // The identity is the only part of the first ClientHello without a fixed bound.
        let ch = hs.client_hello(None).map_err(|_| {
            TlsError::InvalidUse("PSK identity too long for the ClientHello's extensions")
        })?;
        hs.transcript.add(&ch);
        core.write_handshake_as(&ch, 0x0301, out)?;
        Ok(hs)
    }

    /// A ClientHello with the current key shares, and its binder computed over the truncated message.
    /// Fails with [`PREFIX_OVERFLOW`] if the identity (and the cookie) make the extensions longer than
    /// their 16-bit length holds.
    fn client_hello(&self, cookie: Option<&[u8]>) -> Result<Vec<u8>, TlsError> {
        let cfg = &self.cfg;
        let hash_len = self.suite.hash().output_len();
        let mut m = Vec::with_capacity(512);
        put_handshake(&mut m, ht::CLIENT_HELLO, |b| {
            b.extend_from_slice(&TLS12.to_be_bytes());
            b.extend_from_slice(&self.random);
            b.push(0); // legacy_session_id: empty (no middlebox compatibility mode)
            put_prefixed(b, 2, |b| {
                b.extend_from_slice(&self.suite.code().to_be_bytes());
                Ok(())
            })?;
            b.extend_from_slice(&[1, 0]); // legacy_compression_methods: null
            put_prefixed(b, 2, |b| {
                put_ext(b, ext::SUPPORTED_VERSIONS, |b| {
                    put_prefixed(b, 1, |b| {
                        b.extend_from_slice(&TLS13.to_be_bytes());
                        Ok(())
                    })
                })?;
                if !cfg.groups.is_empty() {
                    put_ext(b, ext::SUPPORTED_GROUPS, |b| {
                        put_prefixed(b, 2, |b| {
                            for g in &cfg.groups {
                                b.extend_from_slice(&g.code().to_be_bytes());
                            }
                            Ok(())
                        })
                    })?;
                    put_ext(b, ext::KEY_SHARE, |b| {
                        put_prefixed(b, 2, |b| {
                            for s in &self.shares {
                                b.extend_from_slice(&s.group.code().to_be_bytes());
                                put_prefixed(b, 2, |b| {
                                    b.extend_from_slice(&s.public);
                                    Ok(())
                                })?;
                            }
                            Ok(())
                        })
                    })?;
                }
                put_ext(b, ext::PSK_KEY_EXCHANGE_MODES, |b| {
                    put_prefixed(b, 1, |b| {
                        if !cfg.groups.is_empty() {
                            b.push(PSK_DHE_KE);
                        }
                        if cfg.allow_psk_ke {
                            b.push(PSK_KE);
                        }
                        Ok(())
                    })
                })?;
                if let Some(c) = cookie {
                    put_ext(b, ext::COOKIE, |b| {
                        put_prefixed(b, 2, |b| {
                            b.extend_from_slice(c);
                            Ok(())
                        })
                    })?;
                }
                // pre_shared_key must be last.
                put_ext(b, ext::PRE_SHARED_KEY, |b| {
                    put_prefixed(b, 2, |b| {
                        put_prefixed(b, 2, |b| {
                            b.extend_from_slice(&cfg.identity);
                            Ok(())
                        })?;
                        b.extend_from_slice(&0u32.to_be_bytes()); // external PSK: age 0
                        Ok(())
                    })?;
                    put_prefixed(b, 2, |b| {
                        put_prefixed(b, 1, |b| {
                            b.resize(b.len() + hash_len, 0);
                            Ok(())
                        })
                    })
                })
            })
        })?;
        let truncated = m.len() - (2 + 1 + hash_len);
        let binder = self
            .early
            .ext_binder(&self.transcript.current_with(&m[..truncated]));
        m[truncated + 3..].copy_from_slice(&binder);
        Ok(m)
    }

    pub(crate) fn handle(
        &mut self,
        core: &mut Core,
        typ: u8,
        msg: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<bool, TlsError> {
        match self.state {
            State::WaitServerHello { retried } => {
                expect(typ, ht::SERVER_HELLO, "expected ServerHello")?;
                self.server_hello(core, msg, retried, out)
            }
            State::WaitEncryptedExtensions => {
                expect(
                    typ,
                    ht::ENCRYPTED_EXTENSIONS,
                    "expected EncryptedExtensions",
                )?;
                check_encrypted_extensions(msg)?;
                self.transcript.add(msg);
                self.state = State::WaitFinished;
                Ok(false)
            }
            State::WaitFinished => {
                // A PSK handshake has no Certificate or CertificateRequest.
                expect(typ, ht::FINISHED, "expected Finished")?;
                self.finished(core, msg, out)?;
                Ok(true)
            }
            State::Done => Err(AFTER_FINISHED),
        }
    }

    fn server_hello(
        &mut self,
        core: &mut Core,
        msg: &[u8],
        retried: bool,
        out: &mut Vec<u8>,
    ) -> Result<bool, TlsError> {
        let sh = ServerHello::decode(msg)?;
        match sh.version {
            None => return Err(TlsError::ProtocolVersion),
            Some(TLS13) => {}
            Some(_) => return Err(TlsError::IllegalParameter("selected version not offered")),
        }
        if !sh.session_id.is_empty() {
            return Err(TlsError::IllegalParameter("session id echo differs"));
        }
        if sh.suite != self.suite.code() {
            return Err(TlsError::IllegalParameter("cipher suite not offered"));
        }
        if sh.compression != 0 {
            return Err(TlsError::IllegalParameter("compression method"));
        }
        if sh.is_hrr {
            if retried {
                return Err(TlsError::UnexpectedMessage("second HelloRetryRequest"));
            }
            let group = match sh.key_share {
                Some(ServerShare::Retry(code)) => {
                    let g = Group::from_code(code)
                        .filter(|g| self.cfg.groups.contains(g))
                        .ok_or(TlsError::IllegalParameter(
                            "HelloRetryRequest group not offered",
                        ))?;
                    if self.shares.iter().any(|s| s.group == g) {
                        return Err(TlsError::IllegalParameter(
                            "HelloRetryRequest for a group already shared",
                        ));
                    }
                    Some(g)
                }
                _ => None,
            };
            if group.is_none() && sh.cookie.is_none() {
                return Err(TlsError::IllegalParameter(
                    "HelloRetryRequest would change nothing",
                ));
            }
            let cookie = sh.cookie.map(<[u8]>::to_vec);
            self.transcript = self.transcript.restart_for_hrr();
            self.transcript.add(msg);
            if let Some(g) = group {
                self.shares = vec![KeyPair::generate(g)?];
            }
            // The first ClientHello fit: the server's cookie (or a larger key share) made this one overflow.
            let ch2 = self.client_hello(cookie.as_deref()).map_err(|_| {
                TlsError::IllegalParameter("HelloRetryRequest makes the ClientHello too long")
            })?;
            self.transcript.add(&ch2);
            core.write_handshake(&ch2, out)?;
            self.hello_retry = true;
            self.state = State::WaitServerHello { retried: true };
            return Ok(false);
        }
        match sh.psk_index {
            Some(0) => {}
            Some(_) => return Err(TlsError::IllegalParameter("selected PSK identity")),
            None => return Err(TlsError::HandshakeFailure("server did not accept the PSK")),
        }
        let shared = match sh.key_share {
            Some(ServerShare::Share(code, key)) => {
                let kp = self
                    .shares
                    .iter()
                    .find(|s| s.group.code() == code)
                    .ok_or(TlsError::IllegalParameter("key share group not offered"))?;
                self.group = Some(kp.group);
                Some(kp.agree(key)?)
            }
            Some(ServerShare::Retry(_)) => unreachable!("decoded only in a HelloRetryRequest"),
            None if self.cfg.allow_psk_ke => None,
            None => return Err(TlsError::MissingExtension("key_share")),
        };
        self.shares.clear();
        self.transcript.add(msg);
        let hs = self.early.next(shared.as_ref().map(Secret::as_bytes));
        let th = self.transcript.current();
        let client_hs = hs.traffic(b"c hs traffic", &th);
        let server_hs = hs.traffic(b"s hs traffic", &th);
        core.read = Some(Traffic::new(self.suite, server_hs.clone()));
        core.write = Some(Traffic::new(self.suite, client_hs.clone()));
        self.client_hs = Some(client_hs);
        self.server_hs = Some(server_hs);
        self.handshake = Some(hs);
        self.state = State::WaitEncryptedExtensions;
        Ok(true)
    }

    fn finished(&mut self, core: &mut Core, msg: &[u8], out: &mut Vec<u8>) -> Result<(), TlsError> {
        let hash = self.suite.hash();
        let body = &msg[4..];
        if body.len() != hash.output_len() {
            return Err(TlsError::Decode("Finished length"));
        }
        let (Some(server_hs), Some(client_hs), Some(hs)) = (
            self.server_hs.take(),
            self.client_hs.take(),
            self.handshake.take(),
        ) else {
            return Err(TlsError::Internal("client key schedule out of order"));
        };
        let expected = verify_data(hash, &server_hs, &self.transcript.current());
        if !ct_eq(&expected, body) {
            return Err(TlsError::BadFinished);
        }
        self.transcript.add(msg);
        let th = self.transcript.current();
        let master = hs.next(None);
        let client_ap = master.traffic(b"c ap traffic", &th);
        let server_ap = master.traffic(b"s ap traffic", &th);
        let mut fin = Vec::with_capacity(4 + hash.output_len());
        put_handshake(&mut fin, ht::FINISHED, |b| {
            b.extend_from_slice(&verify_data(hash, &client_hs, &th));
            Ok(())
        })?;
        core.write_handshake(&fin, out)?;
        core.write = Some(Traffic::new(self.suite, client_ap));
        core.read = Some(Traffic::new(self.suite, server_ap));
        core.ccs_allowed = false;
        self.state = State::Done;
        Ok(())
    }

    pub(crate) fn state(&self) -> HandshakeState {
        match self.state {
            State::WaitServerHello { .. } => HandshakeState::ClientWaitServerHello,
            State::WaitEncryptedExtensions => HandshakeState::ClientWaitEncryptedExtensions,
            State::WaitFinished => HandshakeState::ClientWaitFinished,
            State::Done => HandshakeState::Done,
        }
    }

    pub(crate) fn identity(&self) -> &[u8] {
        &self.cfg.identity
    }

    pub(crate) fn negotiated(&self) -> Negotiated {
        Negotiated {
            suite: self.suite,
            group: self.group,
            identity: self.cfg.identity.clone(),
            hello_retry: self.hello_retry,
        }
    }
}

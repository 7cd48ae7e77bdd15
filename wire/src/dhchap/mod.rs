//! NVMe in-band authentication with DH-HMAC-CHAP (NVMe Base Specification 2.1, section 8.3.4), for both ends:
//! the secrets (`DHHC-1:hh:<base64>:`, as nvme-cli's `gen-dhchap-key` writes them), their transformation, the
//! hash functions and FFDHE groups, the responses each side computes, and the codec of the messages carried
//! by Authentication Send and Receive (SECP E9h, SPSP 01h 01h).
//!
//! The exchange, host to controller:
//!
//! | Step | Command | Message |
//! |---|---|---|
//! | 1 | Authentication Send | AUTH_Negotiate: the host's hashes and DH groups |
//! | 2 | Authentication Receive | DH-HMAC-CHAP_Challenge: hash, group, sequence number S1, challenge C1, public value |
//! | 3 | Authentication Send | DH-HMAC-CHAP_Reply: response R1, the host's public value, and for controller authentication C2 and S2 |
//! | 4 | Authentication Receive | DH-HMAC-CHAP_Success1 (with R2 if asked), or AUTH_Failure1 |
//! | 5 | Authentication Send | DH-HMAC-CHAP_Success2 or AUTH_Failure2 (only with controller authentication) |
//!
//! R1 = HMAC(Kh, Ca1 ‖ S1 ‖ T_ID ‖ SC_C ‖ "HostHost" ‖ hostnqn ‖ 00h ‖ subnqn), R2 = HMAC(Kc, Ca2 ‖ S2 ‖ T_ID ‖
//! SC_C ‖ "Controller" ‖ subnqn ‖ 00h ‖ hostnqn), where Kh and Kc are the host's and the controller's secrets
//! transformed with their NQN, and Cai = HMAC(H(g^xy mod p), Ci) with a DH group, Ci without one.
//!
//! Big numbers come from `crypto-bigint` (constant time); hashes and HMAC from aws-lc-rs. Secrets are zeroized
//! when dropped and their `Debug` shows no key material.

pub mod controller;
pub mod host;
mod primes;

use std::fmt;

use aws_lc_rs::{digest, hmac};
use crypto_bigint::modular::{BoxedMontyForm, BoxedMontyParams};
use crypto_bigint::{BoxedUint, Odd};
use zeroize::{Zeroize, Zeroizing};

/// Security protocol of NVMe in-band authentication.
pub const SECP: u8 = 0xe9;
/// SP Specific 0 and 1 of every DH-HMAC-CHAP command.
pub const SPSP: u8 = 0x01;
/// Authentication type of the common messages (AUTH_Negotiate, AUTH_Failure1/2).
const TYPE_COMMON: u8 = 0x00;
/// Authentication type of the DH-HMAC-CHAP messages.
const TYPE_DHCHAP: u8 = 0x01;
/// Authentication protocol identifier of DH-HMAC-CHAP in a negotiate descriptor.
const AUTHID_DHCHAP: u8 = 0x01;
/// The largest message either side sends (a Reply with ffdhe8192 and SHA-512: 16 + 2 x 64 + 1024 bytes),
/// rounded up; hosts read with this allocation length.
pub const MAX_MESSAGE: usize = 4096;

wire_enum! {
    /// Why an authentication failed, as AUTH_Failure1/2 carry it (reason code 01h, this explanation).
    FailureReason: u8, from_u8;
    /// The response did not match: a wrong key.
    Failed = 0x01,
    /// No authentication protocol both sides know.
    ProtocolUnusable = 0x02,
    /// Secure channel concatenation asked for and not available (or the reverse).
    SccMismatch = 0x03,
    /// No hash function both sides allow.
    HashUnusable = 0x04,
    /// No DH group both sides allow.
    DhGroupUnusable = 0x05,
    /// A message was malformed (length, transaction ID, field values).
    IncorrectPayload = 0x06,
    /// A message came out of order.
    IncorrectProtocolMessage = 0x07,
}

impl fmt::Display for FailureReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FailureReason::Failed => "authentication failed (wrong key)",
            FailureReason::ProtocolUnusable => "no usable authentication protocol",
            FailureReason::SccMismatch => "secure channel concatenation mismatch",
            FailureReason::HashUnusable => "no usable hash function",
            FailureReason::DhGroupUnusable => "no usable DH group",
            FailureReason::IncorrectPayload => "incorrect payload",
            FailureReason::IncorrectProtocolMessage => "message out of order",
        })
    }
}

/// What went wrong with a secret, a message or a public value.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// A secret that is not `DHHC-1:hh:<base64 of 32, 48 or 64 bytes and their CRC-32>:`.
    #[error("DH-HMAC-CHAP secret: {0}")]
    Secret(&'static str),
    /// A message that does not parse.
    #[error("malformed DH-HMAC-CHAP message: {0}")]
    Message(String),
    /// A public value that is not in 2 ..= p - 2, or of the wrong length.
    #[error("DH public value rejected: {0}")]
    PublicValue(&'static str),
    /// An unknown hash function or DH group name.
    #[error("{0}")]
    Name(String),
}

wire_enum! {
    /// A hash function of DH-HMAC-CHAP (HMAC identifiers 01h to 03h).
    #[derive(PartialOrd, Ord)]
    Hash: u8, from_id;
    /// SHA-256 (HMAC identifier 01h).
    Sha256 = 1,
    /// SHA-384 (02h).
    Sha384 = 2,
    /// SHA-512 (03h).
    Sha512 = 3,
}

impl Hash {
    /// Every hash, weakest first.
    pub const ALL: [Hash; 3] = [Hash::Sha256, Hash::Sha384, Hash::Sha512];

    /// From its name: `sha256`, `hmac(sha256)` (nvmet's form), `sha-256` and the like.
    pub fn from_name(name: &str) -> Result<Hash, AuthError> {
        let n = name.trim().to_ascii_lowercase().replace('-', "");
        let n = n
            .strip_prefix("hmac(")
            .and_then(|s| s.strip_suffix(')'))
            .unwrap_or(&n);
        match n {
            "sha256" | "1" => Ok(Hash::Sha256),
            "sha384" | "2" => Ok(Hash::Sha384),
            "sha512" | "3" => Ok(Hash::Sha512),
            _ => Err(AuthError::Name(format!(
                "unknown DH-HMAC-CHAP hash {name:?} (sha256, sha384 or sha512)"
            ))),
        }
    }

    /// Its name (`sha256`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Hash::Sha256 => "sha256",
            Hash::Sha384 => "sha384",
            Hash::Sha512 => "sha512",
        }
    }

    /// Its output length in bytes.
    pub fn output_len(self) -> usize {
        match self {
            Hash::Sha256 => 32,
            Hash::Sha384 => 48,
            Hash::Sha512 => 64,
        }
    }

    fn hmac_algorithm(self) -> hmac::Algorithm {
        match self {
            Hash::Sha256 => hmac::HMAC_SHA256,
            Hash::Sha384 => hmac::HMAC_SHA384,
            Hash::Sha512 => hmac::HMAC_SHA512,
        }
    }

    fn digest_algorithm(self) -> &'static digest::Algorithm {
        match self {
            Hash::Sha256 => &digest::SHA256,
            Hash::Sha384 => &digest::SHA384,
            Hash::Sha512 => &digest::SHA512,
        }
    }

    /// HMAC with `key` over the concatenation of `parts`.
    pub fn hmac(self, key: &[u8], parts: &[&[u8]]) -> Zeroizing<Vec<u8>> {
        let key = hmac::Key::new(self.hmac_algorithm(), key);
        let mut ctx = hmac::Context::with_key(&key);
        for p in parts {
            ctx.update(p);
        }
        Zeroizing::new(ctx.sign().as_ref().to_vec())
    }

    /// The hash of `data`.
    pub fn digest(self, data: &[u8]) -> Zeroizing<Vec<u8>> {
        Zeroizing::new(
            digest::digest(self.digest_algorithm(), data)
                .as_ref()
                .to_vec(),
        )
    }
}

impl fmt::Display for Hash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

wire_enum! {
    /// A Diffie-Hellman group of DH-HMAC-CHAP (identifiers 00h to 05h): none, or an RFC 7919 group.
    #[derive(PartialOrd, Ord)]
    DhGroup: u8, from_id;
    /// No Diffie-Hellman exchange (00h): the challenge is used as it is.
    Null = 0,
    /// ffdhe2048 (01h).
    Ffdhe2048 = 1,
    /// ffdhe3072 (02h).
    Ffdhe3072 = 2,
    /// ffdhe4096 (03h).
    Ffdhe4096 = 3,
    /// ffdhe6144 (04h).
    Ffdhe6144 = 4,
    /// ffdhe8192 (05h).
    Ffdhe8192 = 5,
}

impl DhGroup {
    /// Every group, weakest first.
    pub const ALL: [DhGroup; 6] = [
        DhGroup::Null,
        DhGroup::Ffdhe2048,
        DhGroup::Ffdhe3072,
        DhGroup::Ffdhe4096,
        DhGroup::Ffdhe6144,
        DhGroup::Ffdhe8192,
    ];

    /// From its name: `null`, `ffdhe2048`, ... (nvmet's and SPDK's names), or the number of bits.
    pub fn from_name(name: &str) -> Result<DhGroup, AuthError> {
        let n = name.trim().to_ascii_lowercase();
        let n = n.strip_prefix("ffdhe").unwrap_or(&n);
        Ok(match n {
            "null" | "none" | "0" => DhGroup::Null,
            "2048" => DhGroup::Ffdhe2048,
            "3072" => DhGroup::Ffdhe3072,
            "4096" => DhGroup::Ffdhe4096,
            "6144" => DhGroup::Ffdhe6144,
            "8192" => DhGroup::Ffdhe8192,
            _ => {
                return Err(AuthError::Name(format!(
                    "unknown DH group {name:?} (null, ffdhe2048, ffdhe3072, ffdhe4096, ffdhe6144 or ffdhe8192)"
                )))
            }
        })
    }

    /// Its name (`null`, `ffdhe2048`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DhGroup::Null => "null",
            DhGroup::Ffdhe2048 => "ffdhe2048",
            DhGroup::Ffdhe3072 => "ffdhe3072",
            DhGroup::Ffdhe4096 => "ffdhe4096",
            DhGroup::Ffdhe6144 => "ffdhe6144",
            DhGroup::Ffdhe8192 => "ffdhe8192",
        }
    }

    /// The size of its prime in bits (0 for the null group).
    pub fn bits(self) -> u32 {
        match self {
            DhGroup::Null => 0,
            DhGroup::Ffdhe2048 => 2048,
            DhGroup::Ffdhe3072 => 3072,
            DhGroup::Ffdhe4096 => 4096,
            DhGroup::Ffdhe6144 => 6144,
            DhGroup::Ffdhe8192 => 8192,
        }
    }

    /// The length of a public value and of the shared secret in bytes (0 for the null group).
    pub fn value_len(self) -> usize {
        self.bits() as usize / 8
    }

    /// Bits of the private exponent: twice the group's security strength, as RFC 7919 section 5.2 allows
    /// (225 for ffdhe2048 up to 400 for ffdhe8192), rounded up to 64-bit words.
    fn exponent_bits(self) -> u32 {
        let bits: u32 = match self {
            DhGroup::Null => 0,
            DhGroup::Ffdhe2048 => 225,
            DhGroup::Ffdhe3072 => 275,
            DhGroup::Ffdhe4096 => 325,
            DhGroup::Ffdhe6144 => 375,
            DhGroup::Ffdhe8192 => 400,
        };
        bits.div_ceil(64) * 64
    }

    fn prime_hex(self) -> Option<&'static str> {
        Some(match self {
            DhGroup::Null => return None,
            DhGroup::Ffdhe2048 => primes::FFDHE2048,
            DhGroup::Ffdhe3072 => primes::FFDHE3072,
            DhGroup::Ffdhe4096 => primes::FFDHE4096,
            DhGroup::Ffdhe6144 => primes::FFDHE6144,
            DhGroup::Ffdhe8192 => primes::FFDHE8192,
        })
    }

    fn prime(self) -> Option<BoxedUint> {
        let hex = self.prime_hex()?;
        let bytes: Vec<u8> = (0..hex.len() / 2)
            .map(|i| {
                u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("prime constants are hex")
            })
            .collect();
        Some(
            BoxedUint::from_be_slice(&bytes, self.bits())
                .expect("a prime of the group's size fits its precision"),
        )
    }
}

/// What a negotiation chooses one of: a hash, a DH group.
trait Choice: Copy + PartialEq + fmt::Debug + 'static {
    /// Every one, weakest first.
    const ALL: &'static [Self];
    /// The one that secure channel concatenation cannot use: it needs a hash that TLS pairs with and a DH
    /// exchange (whose secret keys the PSK).
    const CONCAT_UNFIT: Self;
    /// The failure where the host offers none that is allowed, and what its explanation calls them.
    const UNUSABLE: (FailureReason, &'static str);
    /// Its identifier.
    fn id(self) -> u8;
}

impl Choice for Hash {
    const ALL: &'static [Hash] = &Hash::ALL;
    const CONCAT_UNFIT: Hash = Hash::Sha512;
    const UNUSABLE: (FailureReason, &'static str) = (FailureReason::HashUnusable, "hashes");
    fn id(self) -> u8 {
        self as u8
    }
}

impl Choice for DhGroup {
    const ALL: &'static [DhGroup] = &DhGroup::ALL;
    const CONCAT_UNFIT: DhGroup = DhGroup::Null;
    const UNUSABLE: (FailureReason, &'static str) = (FailureReason::DhGroupUnusable, "DH groups");
    fn id(self) -> u8 {
        self as u8
    }
}

/// The ones of `list` that the transaction can use: under secure channel concatenation, all but
/// [`Choice::CONCAT_UNFIT`].
fn usable<'a, T: Choice>(list: impl IntoIterator<Item = &'a T>, concat: bool) -> Vec<T> {
    list.into_iter()
        .copied()
        .filter(|x| !concat || *x != T::CONCAT_UNFIT)
        .collect()
}

impl fmt::Display for DhGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The next sequence number of this process's transactions (S1 on a controller, S2 on a host): one counter
/// from a random start, never 0.
pub(crate) fn next_seq() -> u32 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static SEQ: AtomicU32 = AtomicU32::new(0);
    loop {
        let cur = SEQ.load(Ordering::Relaxed);
        let base = if cur == 0 {
            let mut b = [0u8; 4];
            random(&mut b);
            u32::from_le_bytes(b)
        } else {
            cur
        };
        let next = base.wrapping_add(1).max(1);
        if SEQ
            .compare_exchange(cur, next, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            return next;
        }
    }
}

/// Random bytes from the system (aws-lc-rs).
pub fn random(out: &mut [u8]) {
    aws_lc_rs::rand::fill(out).expect("the system's random source works");
}

/// One side's Diffie-Hellman key pair in a group: a short random exponent x and g^x mod p.
pub struct KeyPair {
    group: DhGroup,
    params: BoxedMontyParams,
    private: BoxedUint,
    public: Vec<u8>,
}

impl fmt::Debug for KeyPair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyPair({}, <redacted>)", self.group)
    }
}

impl Drop for KeyPair {
    fn drop(&mut self) {
        self.private.zeroize();
    }
}

impl KeyPair {
    /// A fresh key pair; `None` for the null group. Milliseconds of work for the large groups (ffdhe8192:
    /// about 11 ms on one core in a release build): keep it off a reactor.
    pub fn generate(group: DhGroup) -> Option<KeyPair> {
        let p = group.prime()?;
        let params = BoxedMontyParams::new(Odd::new(p).expect("the group's prime is odd"));
        let xbits = group.exponent_bits();
        let mut xb = Zeroizing::new(vec![0u8; xbits as usize / 8]);
        random(&mut xb);
        // Never zero (or one): the top byte gets a bit set.
        xb[0] |= 0x80;
        let private =
            BoxedUint::from_be_slice(&xb, xbits).expect("the exponent fits its precision");
        let g = BoxedUint::from_be_slice(&[2], group.bits()).expect("2 fits");
        let public = BoxedMontyForm::new(g, params.clone())
            .pow(&private)
            .retrieve()
            .to_be_bytes()
            .to_vec();
        Some(KeyPair {
            group,
            params,
            private,
            public,
        })
    }

    /// The group.
    pub fn group(&self) -> DhGroup {
        self.group
    }

    /// g^x mod p, big-endian, as long as the prime.
    pub fn public(&self) -> &[u8] {
        &self.public
    }

    /// The shared secret (peer^x mod p, big-endian, padded to the prime's length) with the peer's public
    /// value, which must be as long as the prime and in 2 ..= p - 2.
    pub fn shared(&self, peer: &[u8]) -> Result<Zeroizing<Vec<u8>>, AuthError> {
        if peer.len() != self.group.value_len() {
            return Err(AuthError::PublicValue(
                "its length is not the group's prime's",
            ));
        }
        let bits = self.group.bits();
        let y =
            BoxedUint::from_be_slice(peer, bits).map_err(|_| AuthError::PublicValue("too long"))?;
        let one = BoxedUint::one_with_precision(bits);
        let p_minus_one = self.params.modulus().as_ref().wrapping_sub(&one);
        if bool::from(y.is_zero()) || y == one || y >= p_minus_one {
            return Err(AuthError::PublicValue("not in 2 ..= p - 2"));
        }
        let z = BoxedMontyForm::new(y, self.params.clone())
            .pow(&self.private)
            .retrieve();
        Ok(Zeroizing::new(z.to_be_bytes().to_vec()))
    }
}

/// A DH-HMAC-CHAP secret: `DHHC-1:hh:<base64>:`, hh the hash it is transformed with before use (00 none,
/// 01 SHA-256, 02 SHA-384, 03 SHA-512), the base64 holding 32, 48 or 64 bytes of key and their CRC-32
/// (little-endian). Its `Debug` and `Display` show no key material.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret {
    transform: Option<Hash>,
    key: Zeroizing<Vec<u8>>,
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Secret(DHHC-1:{:02x}, {} bytes, <redacted>)",
            self.transform.map_or(0, |h| h as u8),
            self.key.len()
        )
    }
}

impl Secret {
    /// Parses the `DHHC-1:hh:<base64>:` form (the trailing colon may be missing), checking the key length
    /// and its CRC-32.
    pub fn parse(s: &str) -> Result<Secret, AuthError> {
        use base64::Engine as _;
        let s = s.trim();
        let rest = s
            .strip_prefix("DHHC-1:")
            .ok_or(AuthError::Secret("does not start with DHHC-1:"))?;
        let (hh, b64) = rest
            .split_once(':')
            .ok_or(AuthError::Secret("no ':' after the hash identifier"))?;
        let b64 = b64.strip_suffix(':').unwrap_or(b64);
        let transform = match hh {
            "00" => None,
            "01" => Some(Hash::Sha256),
            "02" => Some(Hash::Sha384),
            "03" => Some(Hash::Sha512),
            _ => return Err(AuthError::Secret("hash identifier is not 00, 01, 02 or 03")),
        };
        let raw = Zeroizing::new(
            base64::engine::general_purpose::STANDARD
                .decode(b64)
                .map_err(|_| AuthError::Secret("the key is not base64"))?,
        );
        if !matches!(raw.len(), 36 | 52 | 68) {
            return Err(AuthError::Secret(
                "the key is not 32, 48 or 64 bytes (and a CRC-32)",
            ));
        }
        let (key, crc) = raw.split_at(raw.len() - 4);
        if crc32fast::hash(key).to_le_bytes() != crc {
            return Err(AuthError::Secret("CRC-32 mismatch (a mistyped key?)"));
        }
        if let Some(h) = transform {
            // The transformed key is the hash's length, and the key must not be shorter than it.
            if key.len() < h.output_len() {
                return Err(AuthError::Secret("the key is shorter than its hash"));
            }
        }
        Ok(Secret {
            transform,
            key: Zeroizing::new(key.to_vec()),
        })
    }

    /// A secret from raw key bytes (32, 48 or 64) with transformation hash `transform`.
    pub fn from_key(key: &[u8], transform: Option<Hash>) -> Result<Secret, AuthError> {
        if !matches!(key.len(), 32 | 48 | 64) {
            return Err(AuthError::Secret("the key is not 32, 48 or 64 bytes"));
        }
        Ok(Secret {
            transform,
            key: Zeroizing::new(key.to_vec()),
        })
    }

    /// What nvme-cli's `gen-dhchap-key --secret KEY --hmac H --nqn NQN` writes: with a hash, the secret holds
    /// HMAC-H(KEY, NQN ‖ "NVMe-over-Fabrics") (truncated to KEY's length), else KEY.
    pub fn generate_like_nvme_cli(
        key: &[u8],
        transform: Option<Hash>,
        nqn: &str,
    ) -> Result<Secret, AuthError> {
        let s = Secret::from_key(key, transform)?;
        match transform {
            None => Ok(s),
            Some(_) => {
                let t = s.transformed(nqn);
                let n = key.len().min(t.len());
                Secret::from_key(&t[..n], transform)
            }
        }
    }

    /// The `DHHC-1:hh:<base64>:` form (key material: never log it).
    pub fn to_dhhc1(&self) -> Zeroizing<String> {
        use base64::Engine as _;
        let mut raw = Zeroizing::new(self.key.to_vec());
        raw.extend_from_slice(&crc32fast::hash(&self.key).to_le_bytes());
        Zeroizing::new(format!(
            "DHHC-1:{:02x}:{}:",
            self.transform.map_or(0, |h| h as u8),
            base64::engine::general_purpose::STANDARD.encode(&raw[..])
        ))
    }

    /// The hash the key is transformed with (`None`: used as it is).
    pub fn transform(&self) -> Option<Hash> {
        self.transform
    }

    /// The key as used in responses: HMAC-hh(key, nqn ‖ "NVMe-over-Fabrics") with a transformation hash,
    /// else the key itself. The host's key is transformed with the host NQN, the controller's with the
    /// subsystem NQN.
    pub fn transformed(&self, nqn: &str) -> Zeroizing<Vec<u8>> {
        match self.transform {
            None => self.key.clone(),
            Some(h) => h.hmac(&self.key, &[nqn.as_bytes(), b"NVMe-over-Fabrics"]),
        }
    }
}

/// Whose response is computed: the host's (R1, "HostHost") or the controller's (R2, "Controller").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The host proves its key.
    Host,
    /// The controller proves its key.
    Controller,
}

/// The inputs of one response.
#[derive(Debug)]
pub struct ResponseInput<'a> {
    /// Negotiated hash.
    pub hash: Hash,
    /// The challenge (C1 or C2), the hash's length.
    pub challenge: &'a [u8],
    /// The DH shared secret (`None` with the null group).
    pub dh_secret: Option<&'a [u8]>,
    /// Sequence number (S1 or S2).
    pub seq: u32,
    /// Transaction ID.
    pub tid: u16,
    /// SC_C of the negotiation.
    pub sc_c: u8,
    /// Host NQN.
    pub hostnqn: &'a str,
    /// Subsystem NQN.
    pub subnqn: &'a str,
}

/// The response of `role` with `secret` to a challenge (see the module documentation).
pub fn response(role: Role, secret: &Secret, i: &ResponseInput<'_>) -> Zeroizing<Vec<u8>> {
    let (label, nqn1, nqn2): (&[u8], &str, &str) = match role {
        Role::Host => (b"HostHost", i.hostnqn, i.subnqn),
        Role::Controller => (b"Controller", i.subnqn, i.hostnqn),
    };
    let key = secret.transformed(nqn1);
    let augmented = match i.dh_secret {
        Some(z) => i.hash.hmac(&i.hash.digest(z), &[i.challenge]),
        None => Zeroizing::new(i.challenge.to_vec()),
    };
    i.hash.hmac(
        &key,
        &[
            &augmented,
            &i.seq.to_le_bytes(),
            &i.tid.to_le_bytes(),
            &[i.sc_c],
            label,
            nqn1.as_bytes(),
            &[0],
            nqn2.as_bytes(),
        ],
    )
}

/// SC_C of an AUTH_Negotiate: no secure channel concatenation.
pub const SC_C_NONE: u8 = 0x00;
/// SC_C: secure channel concatenation, a new TLS PSK generated from this transaction.
pub const SC_C_NEW_TLS_PSK: u8 = 0x01;

/// The PSK secure channel concatenation generates from a transaction: HMAC-H(KS, C1 ‖ C2), KS the DH shared
/// secret (NVMe Base 2.1, "Generated PSK for TLS"); C2 is the host's challenge (zeroes without controller
/// authentication).
pub fn generated_psk(hash: Hash, ks: &[u8], c1: &[u8], c2: &[u8]) -> Zeroizing<Vec<u8>> {
    hash.hmac(ks, &[c1, c2])
}

/// The TLS identity (`NVMe1G<hh> <hostnqn> <subnqn> <digest>`) and TLS PSK of a generated PSK, derived as a
/// retained PSK is (HKDF-Extract, then HKDF-Expand-Label "nvme-tls-psk" with `"<hh> <digest>"`). `None` for
/// SHA-512, which no NVMe/TCP TLS cipher suite pairs with.
pub fn concat_tls(
    hash: Hash,
    generated: &[u8],
    hostnqn: &str,
    subnqn: &str,
) -> Option<(String, nvpoll_tls::Psk)> {
    use nvpoll_tls::{Derivation, HashAlg, IdentityVersion, RetainedKey};
    let alg = match hash {
        Hash::Sha256 => HashAlg::Sha256,
        Hash::Sha384 => HashAlg::Sha384,
        Hash::Sha512 => return None,
    };
    let key = RetainedKey::new(generated, alg, Derivation::Rfc8446);
    let identity = key
        .identity(IdentityVersion::V1, hostnqn, subnqn)
        .replacen("NVMe1R", "NVMe1G", 1);
    let psk = key.tls_psk(&identity);
    Some((identity, psk))
}

/// Compares two responses in constant time.
pub fn responses_match(a: &[u8], b: &[u8]) -> bool {
    aws_lc_rs::constant_time::verify_slices_are_equal(a, b).is_ok()
}

/// One DH-HMAC-CHAP protocol message.
#[derive(Clone, PartialEq, Eq)]
pub enum Message {
    /// AUTH_Negotiate (host): the hashes and DH groups it accepts, in its order of preference.
    Negotiate {
        /// Transaction ID.
        tid: u16,
        /// Secure channel concatenation (0: none).
        sc_c: u8,
        /// Hash identifiers of the DH-HMAC-CHAP descriptor.
        hashes: Vec<u8>,
        /// DH group identifiers of the DH-HMAC-CHAP descriptor.
        groups: Vec<u8>,
        /// Whether a DH-HMAC-CHAP descriptor was present (an AUTH_Negotiate may list only others).
        dhchap: bool,
    },
    /// DH-HMAC-CHAP_Challenge (controller).
    Challenge {
        /// Transaction ID.
        tid: u16,
        /// Hash identifier.
        hash: u8,
        /// DH group identifier.
        group: u8,
        /// Sequence number S1.
        seq: u32,
        /// Challenge C1 (hash length).
        cval: Vec<u8>,
        /// The controller's public value (empty with the null group).
        dhv: Vec<u8>,
    },
    /// DH-HMAC-CHAP_Reply (host).
    Reply {
        /// Transaction ID.
        tid: u16,
        /// Whether the host asks to authenticate the controller (C2 and S2 are valid).
        cvalid: bool,
        /// Sequence number S2 (0 without controller authentication).
        seq: u32,
        /// Response R1.
        rval: Vec<u8>,
        /// Challenge C2 (zeroes without controller authentication).
        cval: Vec<u8>,
        /// The host's public value (empty with the null group).
        dhv: Vec<u8>,
    },
    /// DH-HMAC-CHAP_Success1 (controller).
    Success1 {
        /// Transaction ID.
        tid: u16,
        /// Hash length.
        hl: u8,
        /// Response R2, when the host asked for it.
        rval: Option<Vec<u8>>,
    },
    /// DH-HMAC-CHAP_Success2 (host).
    Success2 {
        /// Transaction ID.
        tid: u16,
    },
    /// AUTH_Failure1 (controller) or AUTH_Failure2 (host).
    Failure {
        /// Transaction ID.
        tid: u16,
        /// AUTH_Failure2 (from the host) rather than AUTH_Failure1.
        second: bool,
        /// Reason code (01h: authentication failure).
        code: u8,
        /// Reason code explanation ([`FailureReason`] where known).
        explanation: u8,
    },
}

impl fmt::Debug for Message {
    // Responses and challenges are not secrets, but a log has no use for them either: lengths only.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Message::Negotiate {
                tid,
                sc_c,
                hashes,
                groups,
                dhchap,
            } => write!(
                f,
                "Negotiate(tid {tid}, sc_c {sc_c}, hashes {hashes:?}, groups {groups:?}, dhchap {dhchap})"
            ),
            Message::Challenge {
                tid,
                hash,
                group,
                seq,
                cval,
                dhv,
            } => write!(
                f,
                "Challenge(tid {tid}, hash {hash}, group {group}, seq {seq}, {} + {} bytes)",
                cval.len(),
                dhv.len()
            ),
            Message::Reply {
                tid,
                cvalid,
                seq,
                rval,
                dhv,
                ..
            } => write!(
                f,
                "Reply(tid {tid}, cvalid {cvalid}, seq {seq}, {} + {} bytes)",
                rval.len(),
                dhv.len()
            ),
            Message::Success1 { tid, hl, rval } => write!(
                f,
                "Success1(tid {tid}, hl {hl}, rvalid {})",
                rval.is_some()
            ),
            Message::Success2 { tid } => write!(f, "Success2(tid {tid})"),
            Message::Failure {
                tid,
                second,
                code,
                explanation,
            } => write!(
                f,
                "Failure{}(tid {tid}, rc {code}, rce {explanation})",
                if *second { 2 } else { 1 }
            ),
        }
    }
}

const NEGOTIATE: u8 = 0x00;
const CHALLENGE: u8 = 0x01;
const REPLY: u8 = 0x02;
const SUCCESS1: u8 = 0x03;
const SUCCESS2: u8 = 0x04;
const FAILURE2: u8 = 0xf0;
const FAILURE1: u8 = 0xf1;
/// Size of a negotiate protocol descriptor: AUTHID, reserved, HALEN, DHLEN, 30 hash and 30 group IDs.
const DESCRIPTOR: usize = 64;

/// The length of `v`, the `what` value of a length field that holds at most `max`: see [`Message::encode`]
/// for why it fits.
fn field_len(v: &[u8], max: usize, what: &str) -> usize {
    debug_assert!(v.len() <= max, "{what} value of {} bytes", v.len());
    v.len()
}

/// The one-byte length field of a hash value.
#[allow(clippy::cast_possible_truncation)]
fn hash_len(v: &[u8]) -> u8 {
    field_len(v, usize::from(u8::MAX), "hash") as u8
}

/// The two-byte length field of a DH value.
#[allow(clippy::cast_possible_truncation)]
fn dh_len(v: &[u8]) -> u16 {
    field_len(v, usize::from(u16::MAX), "DH") as u16
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn bad(what: impl Into<String>) -> AuthError {
    AuthError::Message(what.into())
}

impl Message {
    /// The transaction ID.
    pub fn tid(&self) -> u16 {
        match self {
            Message::Negotiate { tid, .. }
            | Message::Challenge { tid, .. }
            | Message::Reply { tid, .. }
            | Message::Success1 { tid, .. }
            | Message::Success2 { tid }
            | Message::Failure { tid, .. } => *tid,
        }
    }

    /// The wire form. Hash values (cval, rval) must be at most 255 bytes and DH values at most 65535, as
    /// every message this side builds has (hash outputs of 32 to 64 bytes, DH values of at most 1024) and
    /// every parsed one has (its length fields are that wide).
    pub fn encode(&self) -> Vec<u8> {
        let head = |ty: u8, id: u8, tid: u16| {
            let mut v = vec![ty, id, 0, 0];
            v.extend_from_slice(&tid.to_le_bytes());
            v
        };
        match self {
            Message::Negotiate {
                tid,
                sc_c,
                hashes,
                groups,
                dhchap,
            } => {
                let mut v = head(TYPE_COMMON, NEGOTIATE, *tid);
                v.push(*sc_c);
                v.push(u8::from(*dhchap));
                if *dhchap {
                    let mut d = [0u8; DESCRIPTOR];
                    d[0] = AUTHID_DHCHAP;
                    // At most 30 of each fit the descriptor; the rest are dropped.
                    let h = u8::try_from(hashes.len()).unwrap_or(u8::MAX).min(30);
                    let g = u8::try_from(groups.len()).unwrap_or(u8::MAX).min(30);
                    d[2] = h;
                    d[3] = g;
                    let (h, g) = (usize::from(h), usize::from(g));
                    d[4..4 + h].copy_from_slice(&hashes[..h]);
                    d[34..34 + g].copy_from_slice(&groups[..g]);
                    v.extend_from_slice(&d);
                }
                v
            }
            Message::Challenge {
                tid,
                hash,
                group,
                seq,
                cval,
                dhv,
            } => {
                let mut v = head(TYPE_DHCHAP, CHALLENGE, *tid);
                v.extend_from_slice(&[hash_len(cval), 0, *hash, *group]);
                v.extend_from_slice(&dh_len(dhv).to_le_bytes());
                v.extend_from_slice(&seq.to_le_bytes());
                v.extend_from_slice(cval);
                v.extend_from_slice(dhv);
                v
            }
            Message::Reply {
                tid,
                cvalid,
                seq,
                rval,
                cval,
                dhv,
            } => {
                let mut v = head(TYPE_DHCHAP, REPLY, *tid);
                v.extend_from_slice(&[hash_len(rval), 0, u8::from(*cvalid), 0]);
                v.extend_from_slice(&dh_len(dhv).to_le_bytes());
                v.extend_from_slice(&seq.to_le_bytes());
                v.extend_from_slice(rval);
                v.extend_from_slice(cval);
                v.extend_from_slice(dhv);
                v
            }
            Message::Success1 { tid, hl, rval } => {
                let mut v = head(TYPE_DHCHAP, SUCCESS1, *tid);
                v.extend_from_slice(&[*hl, 0, u8::from(rval.is_some())]);
                v.extend_from_slice(&[0; 7]);
                if let Some(r) = rval {
                    v.extend_from_slice(r);
                }
                v
            }
            Message::Success2 { tid } => {
                let mut v = head(TYPE_DHCHAP, SUCCESS2, *tid);
                v.extend_from_slice(&[0; 10]);
                v
            }
            Message::Failure {
                tid,
                second,
                code,
                explanation,
            } => {
                let mut v = head(TYPE_COMMON, if *second { FAILURE2 } else { FAILURE1 }, *tid);
                v.extend_from_slice(&[*code, *explanation]);
                v
            }
        }
    }

    /// Parses one message. The buffer may be longer than the message where the message says its own
    /// length (a host reads into an allocation of [`MAX_MESSAGE`]); lengths that do not add up are errors.
    pub fn parse(b: &[u8]) -> Result<Message, AuthError> {
        if b.len() < 8 {
            return Err(bad(format!("{} bytes: shorter than any message", b.len())));
        }
        let tid = u16_at(b, 4);
        let need = |n: usize, what: &str| -> Result<(), AuthError> {
            if b.len() < n {
                Err(bad(format!("{what}: {} bytes, needs {n}", b.len())))
            } else {
                Ok(())
            }
        };
        match (b[0], b[1]) {
            (TYPE_COMMON, NEGOTIATE) => {
                let sc_c = b[6];
                let napd = usize::from(b[7]);
                need(8 + napd * DESCRIPTOR, "AUTH_Negotiate")?;
                let mut out = Message::Negotiate {
                    tid,
                    sc_c,
                    hashes: Vec::new(),
                    groups: Vec::new(),
                    dhchap: false,
                };
                for i in 0..napd {
                    let d = &b[8 + i * DESCRIPTOR..8 + (i + 1) * DESCRIPTOR];
                    if d[0] != AUTHID_DHCHAP {
                        continue;
                    }
                    let (h, g) = (usize::from(d[2]), usize::from(d[3]));
                    if h > 30 || g > 30 {
                        return Err(bad(format!("descriptor HALEN {h} or DHLEN {g} above 30")));
                    }
                    out = Message::Negotiate {
                        tid,
                        sc_c,
                        hashes: d[4..4 + h].to_vec(),
                        groups: d[34..34 + g].to_vec(),
                        dhchap: true,
                    };
                    break;
                }
                Ok(out)
            }
            (TYPE_COMMON, id @ (FAILURE1 | FAILURE2)) => Ok(Message::Failure {
                tid,
                second: id == FAILURE2,
                code: b[6],
                explanation: b[7],
            }),
            (TYPE_DHCHAP, CHALLENGE) => {
                need(16, "DH-HMAC-CHAP_Challenge")?;
                let hl = usize::from(b[6]);
                let dhvlen = usize::from(u16_at(b, 10));
                need(16 + hl + dhvlen, "DH-HMAC-CHAP_Challenge")?;
                Ok(Message::Challenge {
                    tid,
                    hash: b[8],
                    group: b[9],
                    seq: u32_at(b, 12),
                    cval: b[16..16 + hl].to_vec(),
                    dhv: b[16 + hl..16 + hl + dhvlen].to_vec(),
                })
            }
            (TYPE_DHCHAP, REPLY) => {
                need(16, "DH-HMAC-CHAP_Reply")?;
                let hl = usize::from(b[6]);
                let cvalid = match b[8] {
                    0 => false,
                    1 => true,
                    v => return Err(bad(format!("Reply CVALID {v}"))),
                };
                let dhvlen = usize::from(u16_at(b, 10));
                need(16 + 2 * hl + dhvlen, "DH-HMAC-CHAP_Reply")?;
                Ok(Message::Reply {
                    tid,
                    cvalid,
                    seq: u32_at(b, 12),
                    rval: b[16..16 + hl].to_vec(),
                    cval: b[16 + hl..16 + 2 * hl].to_vec(),
                    dhv: b[16 + 2 * hl..16 + 2 * hl + dhvlen].to_vec(),
                })
            }
            (TYPE_DHCHAP, SUCCESS1) => {
                need(16, "DH-HMAC-CHAP_Success1")?;
                let hl = b[6];
                let rval = match b[8] {
                    0 => None,
                    1 => {
                        need(16 + usize::from(hl), "DH-HMAC-CHAP_Success1")?;
                        Some(b[16..16 + usize::from(hl)].to_vec())
                    }
                    v => return Err(bad(format!("Success1 RVALID {v}"))),
                };
                Ok(Message::Success1 { tid, hl, rval })
            }
            (TYPE_DHCHAP, SUCCESS2) => {
                need(16, "DH-HMAC-CHAP_Success2")?;
                Ok(Message::Success2 { tid })
            }
            (ty, id) => Err(bad(format!(
                "unknown message: AUTH_Type {ty:#04x}, AUTH_Id {id:#04x}"
            ))),
        }
    }

    /// The exact length a sender gives this message (for a receiver that checks the transfer length).
    pub fn encoded_len(&self) -> usize {
        match self {
            Message::Negotiate { dhchap, .. } => 8 + usize::from(*dhchap) * DESCRIPTOR,
            Message::Challenge { cval, dhv, .. } => 16 + cval.len() + dhv.len(),
            Message::Reply {
                rval, cval, dhv, ..
            } => 16 + rval.len() + cval.len() + dhv.len(),
            Message::Success1 { rval, .. } => 16 + rval.as_ref().map_or(0, Vec::len),
            Message::Success2 { .. } => 16,
            Message::Failure { .. } => 8,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY32: [u8; 32] = [
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24,
        25, 26, 27, 28, 29, 30, 31,
    ];

    /// Known answers from nvme-cli 2.3: `nvme gen-dhchap-key -s 000102...1f -l 32 -m M -n NQN`.
    #[test]
    fn secrets_match_nvme_cli() {
        let plain = Secret::generate_like_nvme_cli(&KEY32, None, "nqn.test").unwrap();
        assert_eq!(
            &*plain.to_dhhc1(),
            "DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:"
        );
        let t = Secret::generate_like_nvme_cli(
            &KEY32,
            Some(Hash::Sha256),
            "nqn.2014-08.org.nvmexpress:uuid:test",
        )
        .unwrap();
        assert_eq!(
            &*t.to_dhhc1(),
            "DHHC-1:01:WulleCBkG4oCs0iIC3Cit9gBDCLWiZ9PNXuhqytWkBIZkvGy:"
        );
        let back =
            Secret::parse("DHHC-1:01:WulleCBkG4oCs0iIC3Cit9gBDCLWiZ9PNXuhqytWkBIZkvGy:").unwrap();
        assert_eq!(back, t);
        assert!(!format!("{back:?}").contains("Wulle"));
    }

    #[test]
    fn bad_secrets_are_refused_with_a_reason() {
        for (s, why) in [
            (
                "DHHC-2:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:",
                "DHHC-1",
            ),
            (
                "DHHC-1:04:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:",
                "hash identifier",
            ),
            (
                "DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaS:",
                "CRC-32",
            ),
            ("DHHC-1:00:AAECAwQF:", "32, 48 or 64"),
            ("DHHC-1:00:!!!!:", "base64"),
        ] {
            let e = Secret::parse(s).unwrap_err().to_string();
            assert!(e.contains(why), "{s}: {e}");
        }
    }

    #[test]
    fn messages_round_trip() {
        let msgs = [
            Message::Negotiate {
                tid: 7,
                sc_c: 0,
                hashes: vec![1, 2, 3],
                groups: vec![0, 1, 5],
                dhchap: true,
            },
            Message::Challenge {
                tid: 7,
                hash: 3,
                group: 1,
                seq: 0x1234_5678,
                cval: vec![9; 64],
                dhv: vec![8; 256],
            },
            Message::Reply {
                tid: 7,
                cvalid: true,
                seq: 99,
                rval: vec![1; 48],
                cval: vec![2; 48],
                dhv: vec![],
            },
            Message::Success1 {
                tid: 7,
                hl: 32,
                rval: Some(vec![3; 32]),
            },
            Message::Success1 {
                tid: 7,
                hl: 32,
                rval: None,
            },
            Message::Success2 { tid: 7 },
            Message::Failure {
                tid: 7,
                second: false,
                code: 1,
                explanation: FailureReason::Failed as u8,
            },
        ];
        for m in msgs {
            let b = m.encode();
            assert_eq!(b.len(), m.encoded_len(), "{m:?}");
            assert_eq!(Message::parse(&b).unwrap(), m);
            // Trailing allocation padding is ignored.
            let mut padded = b.clone();
            padded.resize(MAX_MESSAGE, 0);
            assert_eq!(Message::parse(&padded).unwrap(), m);
            // Truncation is an error, never a panic.
            for n in 0..b.len() {
                let r = Message::parse(&b[..n]);
                if let Ok(p) = r {
                    assert!(n >= p.encoded_len() || matches!(p, Message::Negotiate { .. }));
                }
            }
        }
    }

    #[test]
    fn both_sides_derive_one_secret_and_bad_values_are_refused() {
        for g in [DhGroup::Ffdhe2048, DhGroup::Ffdhe3072] {
            let a = KeyPair::generate(g).unwrap();
            let b = KeyPair::generate(g).unwrap();
            assert_eq!(a.public().len(), g.value_len());
            let s1 = a.shared(b.public()).unwrap();
            let s2 = b.shared(a.public()).unwrap();
            assert_eq!(*s1, *s2);
            assert_eq!(s1.len(), g.value_len());
            let mut one = vec![0u8; g.value_len()];
            *one.last_mut().unwrap() = 1;
            assert!(a.shared(&one).is_err());
            assert!(a.shared(&vec![0u8; g.value_len()]).is_err());
            assert!(a.shared(&vec![0xffu8; g.value_len()]).is_err());
            assert!(a.shared(&one[1..]).is_err());
        }
        assert!(KeyPair::generate(DhGroup::Null).is_none());
    }

    #[test]
    fn responses_depend_on_every_input() {
        let s = Secret::from_key(&KEY32, Some(Hash::Sha256)).unwrap();
        let c = [5u8; 48];
        let base = ResponseInput {
            hash: Hash::Sha384,
            challenge: &c,
            dh_secret: None,
            seq: 1,
            tid: 2,
            sc_c: 0,
            hostnqn: "nqn.h",
            subnqn: "nqn.s",
        };
        let r = response(Role::Host, &s, &base);
        assert_eq!(r.len(), 48);
        assert_ne!(*r, *response(Role::Controller, &s, &base));
        assert_ne!(
            *r,
            *response(Role::Host, &s, &ResponseInput { seq: 2, ..base })
        );
        assert_ne!(
            *r,
            *response(Role::Host, &s, &ResponseInput { tid: 3, ..base })
        );
        assert_ne!(
            *r,
            *response(
                Role::Host,
                &s,
                &ResponseInput {
                    dh_secret: Some(&[1; 256]),
                    ..base
                }
            )
        );
        let other = Secret::from_key(&[9; 32], Some(Hash::Sha256)).unwrap();
        assert_ne!(*r, *response(Role::Host, &other, &base));
        assert!(responses_match(&r, &response(Role::Host, &s, &base)));
    }
}

//! NVMe/TCP PSKs: the configured-key interchange format, identities (v0 and v1) and the derivation of the
//! retained PSK and the TLS PSK (NVMe/TCP 1.1 §3.6, TP 8018).
//!
//! ```text
//! configured key  "NVMeTLSkey-1:01:<base64(key || crc32_le(key))>:"
//!   -> retained   = HKDF-Expand-Label(HKDF-Extract(0, configured), "HostNQN", hostnqn, len)   (hh 00: as is)
//!   -> identity   "NVMe0R01 <hostnqn> <subnqn>"  or  "NVMe1R01 <hostnqn> <subnqn> <digest>"
//!   -> TLS PSK    = HKDF-Expand-Label(HKDF-Extract(0, retained), "nvme-tls-psk", ctx, HashLen)
//! ```
//!
//! Every key type here is zeroized on drop and prints as `<redacted>`; the bytes are reachable only
//! through methods whose names start with `dangerous_`.

use std::fmt;
use std::str::FromStr;

use base64::Engine as _;
use zeroize::Zeroizing;

use super::schedule::{expand_label_compat, expand_label_prk, extract, HashAlg, Secret};

/// A pre-shared key for the TLS handshake, with the hash it is used with.
#[derive(Clone, PartialEq, Eq)]
pub struct Psk {
    key: Secret,
    hash: HashAlg,
}

impl Psk {
    /// A PSK from raw bytes; `hash` picks the cipher suite (SHA-256: TLS_AES_128_GCM_SHA256,
    /// SHA-384: TLS_AES_256_GCM_SHA384).
    pub fn new(key: &[u8], hash: HashAlg) -> Psk {
        Psk {
            key: Secret::new(key.to_vec()),
            hash,
        }
    }

    /// The hash (and so the cipher suite) this key is used with.
    pub fn hash(&self) -> HashAlg {
        self.hash
    }

    /// Key length in bytes.
    pub fn len(&self) -> usize {
        self.key.as_bytes().len()
    }

    /// Whether the key is empty (such a key is rejected by the handshake).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The key bytes. Never log them.
    pub fn dangerous_as_bytes(&self) -> &[u8] {
        self.key.as_bytes()
    }
}

impl fmt::Debug for Psk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Psk({:?}, {} bytes, <redacted>)", self.hash, self.len())
    }
}

/// The hash field `hh` of an interchange key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KeyHmac {
    /// `00`: the configured key is used as the retained key, as is (32 or 48 bytes).
    None,
    /// `01`: SHA-256, 32-byte key.
    Sha256,
    /// `02`: SHA-384, 48-byte key.
    Sha384,
}

impl KeyHmac {
    fn field(self) -> &'static str {
        match self {
            KeyHmac::None => "00",
            KeyHmac::Sha256 => "01",
            KeyHmac::Sha384 => "02",
        }
    }
}

/// Why an interchange key was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The string does not start with `NVMeTLSkey-`.
    #[error("PSK interchange key does not start with \"NVMeTLSkey-\"")]
    Prefix,
    /// The version field is not `1`.
    #[error("PSK interchange key has version {0:?}, expected \"1\"")]
    Version(String),
    /// The hash field is not `00`, `01` or `02`.
    #[error("PSK interchange key has hash field {0:?}, expected \"00\", \"01\" or \"02\"")]
    HashField(String),
    /// The key field is not valid base64.
    #[error("PSK interchange key field is not valid base64")]
    Base64,
    /// The decoded key has the wrong length for its hash field.
    #[error("PSK interchange key is {len} bytes, expected {expected} for hash field {hash_field}")]
    Length {
        /// Decoded key length, without the CRC.
        len: usize,
        /// What the hash field allows.
        expected: &'static str,
        /// The hash field.
        hash_field: &'static str,
    },
    /// The CRC-32 after the key does not match it.
    #[error("PSK interchange key CRC mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    Crc {
        /// The CRC in the string.
        stored: u32,
        /// The CRC of the key bytes.
        computed: u32,
    },
    /// The string does not end with `:` right after the key field, or has extra fields.
    #[error("PSK interchange key must end with ':' after the key field")]
    Terminator,
}

/// How the retained key and the TLS PSK are derived.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Derivation {
    /// HKDF-Expand-Label as in RFC 8446 §7.1 (the NVMe/TCP spec, Linux, current libnvme and SPDK).
    #[default]
    Rfc8446,
    /// The pre-standard form of older libnvme (and some storage arrays): the info is
    /// `u16le len || "tls13 " label || ctx`, without length bytes.
    Compat,
}

/// The identity format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IdentityVersion {
    /// `NVMe0R<hh> <hostnqn> <subnqn>`; the TLS PSK context is the whole identity.
    V0,
    /// `NVMe1R<hh> <hostnqn> <subnqn> <digest>`; the context is `"<hh> <digest>"`.
    V1,
}

/// A configured PSK (what `NVMeTLSkey-1:...` holds).
#[derive(Clone, PartialEq, Eq)]
pub struct ConfiguredKey {
    key: Secret,
    hmac: KeyHmac,
}

const PREFIX: &str = "NVMeTLSkey-";

impl ConfiguredKey {
    /// A configured key from its bytes; the length must fit `hmac` (32 for `Sha256`, 48 for `Sha384`,
    /// either for `None`).
    pub fn new(key: &[u8], hmac: KeyHmac) -> Result<ConfiguredKey, KeyError> {
        let (ok, expected) = match hmac {
            KeyHmac::None => (key.len() == 32 || key.len() == 48, "32 or 48"),
            KeyHmac::Sha256 => (key.len() == 32, "32"),
            KeyHmac::Sha384 => (key.len() == 48, "48"),
        };
        if !ok {
            return Err(KeyError::Length {
                len: key.len(),
                expected,
                hash_field: hmac.field(),
            });
        }
        Ok(ConfiguredKey {
            key: Secret::new(key.to_vec()),
            hmac,
        })
    }

    /// Parses `NVMeTLSkey-1:<hh>:<base64(key || crc32_le(key))>:`.
    pub fn parse(s: &str) -> Result<ConfiguredKey, KeyError> {
        let rest = s.strip_prefix(PREFIX).ok_or(KeyError::Prefix)?;
        let mut fields = rest.split(':');
        let version = fields.next().unwrap_or_default();
        if version != "1" {
            return Err(KeyError::Version(printable(version)));
        }
        let hh = fields.next().ok_or(KeyError::Terminator)?;
        let hmac = match hh {
            "00" => KeyHmac::None,
            "01" => KeyHmac::Sha256,
            "02" => KeyHmac::Sha384,
            other => return Err(KeyError::HashField(printable(other))),
        };
        let b64 = fields.next().ok_or(KeyError::Terminator)?;
        // A well-formed key leaves exactly one empty field after the last ':'.
        if fields.next() != Some("") || fields.next().is_some() {
            return Err(KeyError::Terminator);
        }
        let raw = Zeroizing::new(
            base64::engine::general_purpose::STANDARD
                .decode(b64)
                .map_err(|_| KeyError::Base64)?,
        );
        if raw.len() < 4 {
            return Err(KeyError::Length {
                len: 0,
                expected: "32 or 48",
                hash_field: hmac.field(),
            });
        }
        let (key, crc) = raw.split_at(raw.len() - 4);
        // Length before CRC, so that a truncated key says "length" rather than "CRC".
        let key = ConfiguredKey::new(key, hmac)?;
        let stored = u32::from_le_bytes(crc.try_into().expect("4 bytes"));
        let computed = crc32fast::hash(key.key.as_bytes());
        if stored != computed {
            return Err(KeyError::Crc { stored, computed });
        }
        Ok(key)
    }

    /// The interchange string `NVMeTLSkey-1:<hh>:<base64>:`. It holds the key: never log it.
    pub fn to_interchange(&self) -> Zeroizing<String> {
        let mut raw = Zeroizing::new(self.key.as_bytes().to_vec());
        raw.extend_from_slice(&crc32fast::hash(self.key.as_bytes()).to_le_bytes());
        let b64 = Zeroizing::new(base64::engine::general_purpose::STANDARD.encode(&*raw));
        Zeroizing::new(format!("{PREFIX}1:{}:{}:", self.hmac.field(), &*b64))
    }

    /// The hash field.
    pub fn hmac(&self) -> KeyHmac {
        self.hmac
    }

    /// The hash the retained key uses: from the hash field, or from the length for `00`.
    pub fn hash(&self) -> HashAlg {
        match self.hmac {
            KeyHmac::Sha256 => HashAlg::Sha256,
            KeyHmac::Sha384 => HashAlg::Sha384,
            KeyHmac::None => HashAlg::for_len(self.key.as_bytes().len()).expect("checked length"),
        }
    }

    /// The key bytes. Never log them.
    pub fn dangerous_as_bytes(&self) -> &[u8] {
        self.key.as_bytes()
    }

    /// The retained PSK for `hostnqn`: HKDF-Expand-Label(HKDF-Extract(0, key), "HostNQN", hostnqn, len), or
    /// the key itself for hash field `00`.
    pub fn retained(&self, hostnqn: &str, derivation: Derivation) -> RetainedKey {
        let hash = self.hash();
        let key = match self.hmac {
            KeyHmac::None => self.key.clone(),
            _ => {
                let prk = extract(hash, None, self.key.as_bytes());
                let len = self.key.as_bytes().len();
                match derivation {
                    Derivation::Rfc8446 => {
                        expand_label_prk(&prk, b"HostNQN", hostnqn.as_bytes(), len)
                    }
                    Derivation::Compat => {
                        expand_label_compat(&prk, b"HostNQN", hostnqn.as_bytes(), len)
                    }
                }
            }
        };
        RetainedKey {
            key,
            hash,
            derivation,
        }
    }

    /// The identity and TLS PSK for one host/subsystem pair, in one call.
    pub fn derive(
        &self,
        version: IdentityVersion,
        hostnqn: &str,
        subnqn: &str,
        derivation: Derivation,
    ) -> (String, Psk) {
        let retained = self.retained(hostnqn, derivation);
        let identity = retained.identity(version, hostnqn, subnqn);
        let psk = retained.tls_psk(&identity);
        (identity, psk)
    }
}

impl FromStr for ConfiguredKey {
    type Err = KeyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ConfiguredKey::parse(s)
    }
}

impl fmt::Debug for ConfiguredKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ConfiguredKey({:?}, {} bytes, <redacted>)",
            self.hmac,
            self.key.as_bytes().len()
        )
    }
}

/// Error text must never echo key material: only short, printable field values are shown.
fn printable(s: &str) -> String {
    s.chars().take(8).filter(|c| c.is_ascii_graphic()).collect()
}

/// The retained PSK of one host (derived from a configured key and the host NQN).
#[derive(Clone, PartialEq, Eq)]
pub struct RetainedKey {
    key: Secret,
    hash: HashAlg,
    derivation: Derivation,
}

impl RetainedKey {
    /// A retained key from its bytes (for keys stored already derived).
    pub fn new(key: &[u8], hash: HashAlg, derivation: Derivation) -> RetainedKey {
        RetainedKey {
            key: Secret::new(key.to_vec()),
            hash,
            derivation,
        }
    }

    /// The hash used for the identity and the TLS PSK.
    pub fn hash(&self) -> HashAlg {
        self.hash
    }

    /// The key bytes. Never log them.
    pub fn dangerous_as_bytes(&self) -> &[u8] {
        self.key.as_bytes()
    }

    /// The v1 digest: Base64(HMAC-H(retained, hostnqn " " subnqn " NVMe-over-Fabrics")).
    pub fn digest(&self, hostnqn: &str, subnqn: &str) -> String {
        let msg = format!("{hostnqn} {subnqn} NVMe-over-Fabrics");
        let mac = self.hash.hmac_sign(self.key.as_bytes(), msg.as_bytes());
        base64::engine::general_purpose::STANDARD.encode(mac)
    }

    /// The identity `NVMe0R<hh> <hostnqn> <subnqn>` or `NVMe1R<hh> <hostnqn> <subnqn> <digest>`.
    pub fn identity(&self, version: IdentityVersion, hostnqn: &str, subnqn: &str) -> String {
        let hh = hh(self.hash);
        match version {
            IdentityVersion::V0 => format!("NVMe0R{hh} {hostnqn} {subnqn}"),
            IdentityVersion::V1 => {
                format!(
                    "NVMe1R{hh} {hostnqn} {subnqn} {}",
                    self.digest(hostnqn, subnqn)
                )
            }
        }
    }

    /// The TLS PSK for `identity`: HKDF-Expand-Label(HKDF-Extract(0, retained), "nvme-tls-psk", ctx, HashLen),
    /// where ctx is the identity for v0 and `"<hh> <digest>"` for v1. An identity that is neither is used
    /// whole, as for v0.
    pub fn tls_psk(&self, identity: &str) -> Psk {
        let ctx = match ParsedIdentity::parse(identity.as_bytes()) {
            Some(p) if p.version == IdentityVersion::V1 => {
                format!("{} {}", hh(p.hash), p.digest.unwrap_or_default())
            }
            _ => identity.to_string(),
        };
        let prk = extract(self.hash, None, self.key.as_bytes());
        let len = self.hash.output_len();
        let key = match self.derivation {
            Derivation::Rfc8446 => expand_label_prk(&prk, b"nvme-tls-psk", ctx.as_bytes(), len),
            Derivation::Compat => expand_label_compat(&prk, b"nvme-tls-psk", ctx.as_bytes(), len),
        };
        Psk {
            key,
            hash: self.hash,
        }
    }
}

impl fmt::Debug for RetainedKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "RetainedKey({:?}, {:?}, <redacted>)",
            self.hash, self.derivation
        )
    }
}

fn hh(hash: HashAlg) -> &'static str {
    match hash {
        HashAlg::Sha256 => "01",
        HashAlg::Sha384 => "02",
    }
}

/// The fields of an NVMe TLS PSK identity, for a target that looks keys up by identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedIdentity {
    /// v0 or v1.
    pub version: IdentityVersion,
    /// `G`: the key was generated by DH-HMAC-CHAP secure concatenation (else `R`, retained).
    pub generated: bool,
    /// The identity's hash (01 or 02).
    pub hash: HashAlg,
    /// Host NQN.
    pub hostnqn: String,
    /// Subsystem NQN.
    pub subnqn: String,
    /// The v1 digest.
    pub digest: Option<String>,
}

impl ParsedIdentity {
    /// Parses `NVMe<v><R|G><hh> <hostnqn> <subnqn>[ <digest>]`; None if it is not such an identity.
    pub fn parse(identity: &[u8]) -> Option<ParsedIdentity> {
        let s = std::str::from_utf8(identity).ok()?;
        let (head, rest) = s.split_once(' ')?;
        let head = head.as_bytes();
        if head.len() != 8 || &head[..4] != b"NVMe" {
            return None;
        }
        let version = match head[4] {
            b'0' => IdentityVersion::V0,
            b'1' => IdentityVersion::V1,
            _ => return None,
        };
        let generated = match head[5] {
            b'R' => false,
            b'G' => true,
            _ => return None,
        };
        let hash = match &head[6..] {
            b"01" => HashAlg::Sha256,
            b"02" => HashAlg::Sha384,
            _ => return None,
        };
        let mut parts = rest.split(' ');
        let hostnqn = parts.next().filter(|p| !p.is_empty())?.to_string();
        let subnqn = parts.next().filter(|p| !p.is_empty())?.to_string();
        let digest = match version {
            IdentityVersion::V0 => None,
            IdentityVersion::V1 => Some(parts.next().filter(|p| !p.is_empty())?.to_string()),
        };
        if parts.next().is_some() {
            return None;
        }
        Some(ParsedIdentity {
            version,
            generated,
            hash,
            hostnqn,
            subnqn,
            digest,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    const KEY32: &str = "5512DBB6737D0106F65975B773DFB011FFC344BCF442E2DD6D8BC4870B5D5B03";
    const KEY48_TAIL: &str = "FFC344BCF442E2DD6D8BC4870B5D5B03";
    const IK32: &str = "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:";
    const IK48: &str =
        "NVMeTLSkey-1:02:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwP/w0S89ELi3W2LxIcLXVsDn8kXZQ==:";
    const SPDK: &str = "NVMeTLSkey-1:01:MDAxMTIyMzM0NDU1NjY3Nzg4OTlhYWJiY2NkZGVlZmZwJEiQ:";
    const HOST: &str = "nqn.psk-test-host";
    const SUBSYS: &str = "nqn.psk-test-subsys";

    fn key48() -> Vec<u8> {
        let mut k = hex(KEY32);
        k.extend(hex(KEY48_TAIL));
        k
    }

    #[test]
    fn interchange_vectors_round_trip() {
        let k = ConfiguredKey::parse(IK32).unwrap();
        assert_eq!(k.dangerous_as_bytes(), hex(KEY32));
        assert_eq!(crc32fast::hash(&hex(KEY32)), 0xd9baf45f);
        assert_eq!(k.hmac(), KeyHmac::Sha256);
        assert_eq!(&*k.to_interchange(), IK32);
        assert_eq!(IK32.len(), 65);

        let k = ConfiguredKey::parse(IK48).unwrap();
        assert_eq!(k.dangerous_as_bytes(), key48());
        assert_eq!(&*k.to_interchange(), IK48);
        assert_eq!(IK48.len(), 89);

        let k = ConfiguredKey::parse(SPDK).unwrap();
        assert_eq!(k.dangerous_as_bytes(), b"00112233445566778899aabbccddeeff");
        assert_eq!(&*k.to_interchange(), SPDK);

        let k = ConfiguredKey::new(&hex(KEY32), KeyHmac::Sha256).unwrap();
        assert_eq!(&*k.to_interchange(), IK32);
    }

    #[test]
    fn interchange_errors_name_the_field() {
        assert_eq!(
            ConfiguredKey::parse("NVMeTLSKey-1:01:x:"),
            Err(KeyError::Prefix)
        );
        assert!(matches!(
            ConfiguredKey::parse(&IK32.replace("-1:", "-2:")),
            Err(KeyError::Version(v)) if v == "2"
        ));
        assert!(matches!(
            ConfiguredKey::parse(&IK32.replace(":01:", ":03:")),
            Err(KeyError::HashField(h)) if h == "03"
        ));
        assert_eq!(
            ConfiguredKey::parse(&IK32.replace("VRLb", "VR*b")),
            Err(KeyError::Base64)
        );
        // A 32-byte key labelled SHA-384.
        assert!(matches!(
            ConfiguredKey::parse(&IK32.replace(":01:", ":02:")),
            Err(KeyError::Length { len: 32, .. })
        ));
        // One bit flipped in the key.
        assert!(matches!(
            ConfiguredKey::parse(&IK32.replace("VRLb", "VRLc")),
            Err(KeyError::Crc { .. })
        ));
        assert_eq!(
            ConfiguredKey::parse(IK32.trim_end_matches(':')),
            Err(KeyError::Terminator)
        );
        assert_eq!(
            ConfiguredKey::parse(&format!("{IK32}x")),
            Err(KeyError::Terminator)
        );
        // The error text never carries key material.
        let e = ConfiguredKey::parse(&IK32.replace("VRLb", "VRLc")).unwrap_err();
        assert!(!e.to_string().contains("VRL"));
    }

    /// Checks the RFC 8446 derivations of configured key `key` against published vectors: the retained PSK,
    /// and the TLS PSK of the v1 identity (`id1`) and of the v0 one; returns the key, the retained key and the v0
    /// identity for further checks.
    fn check_vectors(
        key: &str,
        retained: &str,
        id1: &str,
        psk1: &str,
        psk0: &str,
    ) -> (ConfiguredKey, RetainedKey, String) {
        let k = ConfiguredKey::parse(key).unwrap();
        let r = k.retained(HOST, Derivation::Rfc8446);
        assert_eq!(r.dangerous_as_bytes(), hex(retained));
        let identity1 = r.identity(IdentityVersion::V1, HOST, SUBSYS);
        assert_eq!(identity1, id1);
        assert_eq!(r.tls_psk(&identity1).dangerous_as_bytes(), hex(psk1));
        let id0 = r.identity(IdentityVersion::V0, HOST, SUBSYS);
        assert_eq!(r.tls_psk(&id0).dangerous_as_bytes(), hex(psk0));
        (k, r, id0)
    }

    #[test]
    fn sha256_derivation_vectors() {
        let (k, r, id0) = check_vectors(
            IK32,
            "073311dec37e219ff3acd43f130130c5bdd443c066e1cc3424e49030234ff7d5",
            "NVMe1R01 nqn.psk-test-host nqn.psk-test-subsys iSbjiStwJ/1TrTvDlt2fjFmzvsytOJelidNnA+X5lEU=",
            "8fc3c0badfd4c0c66fa3ca33aadd0314f85536cc9bc47338b60f3e6e563786ca",
            "05c6503551ad136e6ee32e6eeb3f6d500b69701d84ec71e328f65c7f51566f68",
        );
        assert_eq!(id0, "NVMe0R01 nqn.psk-test-host nqn.psk-test-subsys");
        let (id, psk) = k.derive(IdentityVersion::V0, HOST, SUBSYS, Derivation::Rfc8446);
        assert_eq!(id, id0);
        assert_eq!(psk.hash(), HashAlg::Sha256);
        assert_eq!(psk, r.tls_psk(&id0));
    }

    #[test]
    fn sha384_derivation_vectors() {
        let (_, r, id0) = check_vectors(
            IK48,
            "73973a1b51a9acdde29a0610ac6a3ef852cf45936cca6830a661d18f68502f1a4c7a8ecb37524e0b1f7087cb4d680ad9",
            "NVMe1R02 nqn.psk-test-host nqn.psk-test-subsys QhW2+Rp6RzHlNtCslyRxMnwJ11tKKhz8JCAQpQ+XUD8f9td1VeH5h53yz2wKJG1a",
            "a2b2f943f479fc682555cec89857c80ed004ce92f32a973d5764155bb7e36b17a85368a0666d250afac9282dda2e62ca",
            "f42ba63824cdfe421914c582921f85b5b5b7e2d4df084caeedc9be20b212e8bb0fe8a23e9d59a1c8fc6449da4970a78d",
        );
        assert_eq!(r.tls_psk(&id0).hash(), HashAlg::Sha384);
    }

    #[test]
    fn compat_derivation_digests() {
        let k = ConfiguredKey::parse(IK32).unwrap();
        let r = k.retained(HOST, Derivation::Compat);
        assert_eq!(
            r.digest(HOST, SUBSYS),
            "66GuqV08TsAGII39teWUfwQwizjv06Jy8jOcX3NAAzM="
        );
        let k = ConfiguredKey::parse(IK48).unwrap();
        let r = k.retained(HOST, Derivation::Compat);
        assert_eq!(
            r.digest(HOST, SUBSYS),
            "RsKmYJ3nAn1ApjjMloJFbAkLPivONDAX/xW327YBUsn2eGShXSjCZvBaOxscLqmz"
        );
        // The compat TLS PSK differs from the RFC one.
        let id = r.identity(IdentityVersion::V1, HOST, SUBSYS);
        let rfc = k.retained(HOST, Derivation::Rfc8446);
        assert_ne!(r.tls_psk(&id), rfc.tls_psk(&id));
    }

    /// NQNs may be 223 bytes, so a v0 identity (the context of the TLS PSK's derivation) may pass the 255
    /// bytes HkdfLabel's context length can say: the derivation keeps the length mod 256, as it always has
    /// (a panic in debug builds until 2026-12), and still tells the identities apart.
    #[test]
    fn v0_identity_longer_than_255_bytes() {
        let k = ConfiguredKey::parse(IK32).unwrap();
        let host = format!("nqn.2014-08.org.nvmexpress:uuid:{}", "a".repeat(223 - 32));
        let sub = |c: &str| format!("nqn.2024-01.io.nvpoll:{}", c.repeat(223 - 21));
        let (id, psk) = k.derive(IdentityVersion::V0, &host, &sub("x"), Derivation::Rfc8446);
        assert!(id.len() > 255, "{}", id.len());
        let (_, again) = k.derive(IdentityVersion::V0, &host, &sub("x"), Derivation::Rfc8446);
        assert!(psk == again, "the derivation is deterministic");
        let (_, other) = k.derive(IdentityVersion::V0, &host, &sub("y"), Derivation::Rfc8446);
        assert!(psk != other, "another subsystem, another PSK");
    }

    #[test]
    fn spdk_vector() {
        let host = "nqn.2016-06.io.spdk:host1";
        let sub = "nqn.2016-06.io.spdk:cnode1";
        let k = ConfiguredKey::parse(SPDK).unwrap();
        let r = k.retained(host, Derivation::Rfc8446);
        assert_eq!(
            r.dangerous_as_bytes(),
            hex("1fec2d4b69d3cb88e56214d464f00b168d2a635024b7a893aa6fad2840f49f2a")
        );
        let (id, psk) = k.derive(IdentityVersion::V0, host, sub, Derivation::Rfc8446);
        assert_eq!(id, format!("NVMe0R01 {host} {sub}"));
        assert_eq!(
            psk.dangerous_as_bytes(),
            hex("45956d30221db43e664e8d6e78a79c31a81824cbd12acfdaca0e6032b335bbd9")
        );
    }

    #[test]
    fn hash_00_keeps_the_key() {
        let k = ConfiguredKey::new(&key48(), KeyHmac::None).unwrap();
        assert_eq!(k.hash(), HashAlg::Sha384);
        let r = k.retained(HOST, Derivation::Rfc8446);
        assert_eq!(r.dangerous_as_bytes(), key48());
        let s = k.to_interchange();
        assert!(s.starts_with("NVMeTLSkey-1:00:"));
        assert_eq!(ConfiguredKey::parse(&s).unwrap(), k);
    }

    #[test]
    fn identities_parse() {
        let p = ParsedIdentity::parse(
            b"NVMe1R01 nqn.psk-test-host nqn.psk-test-subsys iSbjiStwJ/1TrTvDlt2fjFmzvsytOJelidNnA+X5lEU=",
        )
        .unwrap();
        assert_eq!(p.version, IdentityVersion::V1);
        assert_eq!(p.hostnqn, HOST);
        assert_eq!(p.subnqn, SUBSYS);
        assert_eq!(p.hash, HashAlg::Sha256);
        let p = ParsedIdentity::parse(b"NVMe0G02 h s").unwrap();
        assert!(p.generated && p.digest.is_none() && p.hash == HashAlg::Sha384);
        assert!(ParsedIdentity::parse(b"NVMe0R03 h s").is_none());
        assert!(ParsedIdentity::parse(b"NVMe0R01 h").is_none());
        assert!(ParsedIdentity::parse(b"NVMe1R01 h s").is_none());
        assert!(ParsedIdentity::parse(b"NVMe0R01 h s extra").is_none());
    }

    #[test]
    fn debug_is_redacted() {
        let k = ConfiguredKey::parse(IK32).unwrap();
        let r = k.retained(HOST, Derivation::Rfc8446);
        let p = r.tls_psk("x");
        for d in [format!("{k:?}"), format!("{r:?}"), format!("{p:?}")] {
            assert!(d.contains("redacted"), "{d}");
            assert!(!d.to_lowercase().contains("55"), "{d}");
        }
    }
}

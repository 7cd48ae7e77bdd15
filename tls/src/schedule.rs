//! HKDF-Expand-Label, Derive-Secret, the transcript hash and the TLS 1.3 key schedule for external PSKs
//! (RFC 8446 §7.1), on top of aws-lc-rs's HKDF, HMAC and digest.
//!
//! Secrets live in [`Secret`], which is zeroized on drop and prints as `<redacted>`.

use std::fmt;

use aws_lc_rs::{constant_time, digest, hkdf, hmac};
use zeroize::Zeroizing;

/// The hash of a PSK, an identity and a cipher suite.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HashAlg {
    /// SHA-256 (identity hash `01`, TLS_AES_128_GCM_SHA256).
    Sha256,
    /// SHA-384 (identity hash `02`, TLS_AES_256_GCM_SHA384).
    Sha384,
}

impl HashAlg {
    /// Output length in bytes (32 or 48).
    pub const fn output_len(self) -> usize {
        match self {
            HashAlg::Sha256 => 32,
            HashAlg::Sha384 => 48,
        }
    }

    /// The hash whose output length is `len` bytes, if any.
    pub const fn for_len(len: usize) -> Option<HashAlg> {
        match len {
            32 => Some(HashAlg::Sha256),
            48 => Some(HashAlg::Sha384),
            _ => None,
        }
    }

    pub(crate) fn hkdf(self) -> hkdf::Algorithm {
        match self {
            HashAlg::Sha256 => hkdf::HKDF_SHA256,
            HashAlg::Sha384 => hkdf::HKDF_SHA384,
        }
    }

    pub(crate) fn hmac(self) -> hmac::Algorithm {
        match self {
            HashAlg::Sha256 => hmac::HMAC_SHA256,
            HashAlg::Sha384 => hmac::HMAC_SHA384,
        }
    }

    pub(crate) fn digest(self) -> &'static digest::Algorithm {
        match self {
            HashAlg::Sha256 => &digest::SHA256,
            HashAlg::Sha384 => &digest::SHA384,
        }
    }

    /// Hash of `data`.
    pub(crate) fn hash(self, data: &[u8]) -> Vec<u8> {
        digest::digest(self.digest(), data).as_ref().to_vec()
    }

    /// HMAC of `data` under `key`.
    pub(crate) fn hmac_sign(self, key: &[u8], data: &[u8]) -> Vec<u8> {
        hmac::sign(&hmac::Key::new(self.hmac(), key), data)
            .as_ref()
            .to_vec()
    }
}

/// Secret bytes: zeroized on drop, redacted in Debug.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Secret(Zeroizing<Vec<u8>>);

impl Secret {
    pub(crate) fn new(bytes: Vec<u8>) -> Secret {
        Secret(Zeroizing::new(bytes))
    }

    pub(crate) fn zeroed(len: usize) -> Secret {
        Secret::new(vec![0; len])
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret({} bytes, <redacted>)", self.0.len())
    }
}

/// An output length for aws-lc-rs's HKDF-Expand.
struct Len(usize);

impl hkdf::KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

/// HKDF-Extract(salt, ikm); a missing salt is HashLen zero bytes.
pub(crate) fn extract(hash: HashAlg, salt: Option<&[u8]>, ikm: &[u8]) -> hkdf::Prk {
    let zeros = [0u8; 48];
    let salt = salt.unwrap_or(&zeros[..hash.output_len()]);
    hkdf::Salt::new(hash.hkdf(), salt).extract(ikm)
}

fn expand(prk: &hkdf::Prk, info: &[&[u8]], len: usize) -> Secret {
    let mut out = Secret::zeroed(len);
    // Only fails for len > 255 * HashLen, which no caller asks for.
    prk.expand(info, Len(len))
        .and_then(|okm| okm.fill(&mut out.0))
        .expect("HKDF-Expand output length within 255 * HashLen");
    out
}

/// HKDF-Expand-Label(prk, label, ctx, len) of RFC 8446 §7.1: the info is
/// `u16be len || u8 len("tls13 " + label) || "tls13 " + label || u8 len(ctx) || ctx`.
pub(crate) fn expand_label_prk(prk: &hkdf::Prk, label: &[u8], ctx: &[u8], len: usize) -> Secret {
    debug_assert!(label.len() + 6 <= 255 && len <= 0xffff);
    // len is at most 255 * HashLen (expand fails beyond), and labels are short constants. A context over
    // 255 bytes (the RFC's context<0..255>) keeps its length mod 256, as it always has: keys derived
    // from such an identity stay what they were.
    #[allow(clippy::cast_possible_truncation)]
    let (out_len, label_len, ctx_len) = (
        (len as u16).to_be_bytes(),
        [(6 + label.len()) as u8],
        [ctx.len() as u8],
    );
    expand(
        prk,
        &[&out_len, &label_len, b"tls13 ", label, &ctx_len, ctx],
        len,
    )
}

/// HKDF-Expand-Label with a secret given as bytes.
pub(crate) fn expand_label(
    hash: HashAlg,
    secret: &[u8],
    label: &[u8],
    ctx: &[u8],
    len: usize,
) -> Secret {
    expand_label_prk(
        &hkdf::Prk::new_less_safe(hash.hkdf(), secret),
        label,
        ctx,
        len,
    )
}

/// The pre-standard variant some libnvme versions use: info is
/// `u16le len || "tls13 " + label || ctx`, with no length bytes for the label or the context.
pub(crate) fn expand_label_compat(prk: &hkdf::Prk, label: &[u8], ctx: &[u8], len: usize) -> Secret {
    // len is at most 255 * HashLen: expand fails beyond.
    #[allow(clippy::cast_possible_truncation)]
    let out_len = (len as u16).to_le_bytes();
    expand(prk, &[&out_len, b"tls13 ", label, ctx], len)
}

/// Derive-Secret(prk, label, messages) with the transcript hash already computed.
pub(crate) fn derive_secret(
    hash: HashAlg,
    prk: &hkdf::Prk,
    label: &[u8],
    transcript_hash: &[u8],
) -> Secret {
    expand_label_prk(prk, label, transcript_hash, hash.output_len())
}

/// The Finished (or binder) value: HMAC(Expand-Label(base_key, "finished", "", HashLen), transcript_hash).
pub(crate) fn verify_data(hash: HashAlg, base_key: &Secret, transcript_hash: &[u8]) -> Vec<u8> {
    let finished_key = expand_label(
        hash,
        base_key.as_bytes(),
        b"finished",
        b"",
        hash.output_len(),
    );
    hash.hmac_sign(finished_key.as_bytes(), transcript_hash)
}

/// Constant-time comparison of a received Finished or binder with the expected one.
pub(crate) fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    constant_time::verify_slices_are_equal(a, b).is_ok()
}

/// The running hash of the handshake messages.
#[derive(Clone)]
pub(crate) struct Transcript {
    hash: HashAlg,
    ctx: digest::Context,
}

impl Transcript {
    pub(crate) fn new(hash: HashAlg) -> Transcript {
        Transcript {
            hash,
            ctx: digest::Context::new(hash.digest()),
        }
    }

    /// The transcript after a HelloRetryRequest starts with `message_hash` standing in for ClientHello1
    /// (RFC 8446 §4.4.1).
    pub(crate) fn restart_for_hrr(&self) -> Transcript {
        let ch1_hash = self.current();
        let mut t = Transcript::new(self.hash);
        // A hash output is 32, 48 or 64 bytes.
        #[allow(clippy::cast_possible_truncation)]
        let len = self.hash.output_len() as u8;
        t.add(&[254, 0, 0, len]);
        t.add(&ch1_hash);
        t
    }

    pub(crate) fn add(&mut self, msg: &[u8]) {
        self.ctx.update(msg);
    }

    pub(crate) fn current(&self) -> Vec<u8> {
        self.ctx.clone().finish().as_ref().to_vec()
    }

    /// Hash of the transcript followed by `extra`, without adding `extra` (for the binder's truncated
    /// ClientHello).
    pub(crate) fn current_with(&self, extra: &[u8]) -> Vec<u8> {
        let mut ctx = self.ctx.clone();
        ctx.update(extra);
        ctx.finish().as_ref().to_vec()
    }
}

/// The key schedule: Early Secret, then Handshake Secret, then Master Secret.
pub(crate) struct KeySchedule {
    hash: HashAlg,
    prk: hkdf::Prk,
}

impl KeySchedule {
    /// Early Secret = HKDF-Extract(0, PSK).
    pub(crate) fn early(hash: HashAlg, psk: &[u8]) -> KeySchedule {
        KeySchedule {
            hash,
            prk: extract(hash, None, psk),
        }
    }

    /// The "ext binder" value over the hash of the truncated ClientHello.
    pub(crate) fn ext_binder(&self, truncated_hash: &[u8]) -> Vec<u8> {
        let empty = self.hash.hash(b"");
        let binder_key = derive_secret(self.hash, &self.prk, b"ext binder", &empty);
        verify_data(self.hash, &binder_key, truncated_hash)
    }

    /// Next stage: HKDF-Extract(Derive-Secret(current, "derived", ""), ikm); a missing ikm is HashLen zeros.
    pub(crate) fn next(&self, ikm: Option<&[u8]>) -> KeySchedule {
        let empty = self.hash.hash(b"");
        let derived = derive_secret(self.hash, &self.prk, b"derived", &empty);
        let zeros = [0u8; 48];
        let ikm = ikm.unwrap_or(&zeros[..self.hash.output_len()]);
        KeySchedule {
            hash: self.hash,
            prk: extract(self.hash, Some(derived.as_bytes()), ikm),
        }
    }

    /// A traffic secret: Derive-Secret(current, label, transcript).
    pub(crate) fn traffic(&self, label: &[u8], transcript_hash: &[u8]) -> Secret {
        derive_secret(self.hash, &self.prk, label, transcript_hash)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn rfc8448_derived_secret() {
        let ks = KeySchedule::early(HashAlg::Sha256, &[0; 32]);
        let d = ks.traffic(b"derived", &HashAlg::Sha256.hash(b""));
        assert_eq!(
            d.as_bytes(),
            hex("6f2615a108c702c5678f54fc9dbab69716c076189c48250cebeac3576c3611ba")
        );
    }

    #[test]
    fn rfc8448_handshake_traffic_keys() {
        // RFC 8448 §3 (simple 1-RTT): server handshake traffic secret to key and iv.
        let s = hex("b67b7d690cc16c4e75e54213cb2d37b4e9c912bcded9105d42befd59d391ad38");
        let key = expand_label(HashAlg::Sha256, &s, b"key", b"", 16);
        let iv = expand_label(HashAlg::Sha256, &s, b"iv", b"", 12);
        assert_eq!(key.as_bytes(), hex("3fce516009c21727d0f2e4e86ee403bc"));
        assert_eq!(iv.as_bytes(), hex("5d313eb2671276ee13000b30"));
    }

    #[test]
    fn secret_debug_is_redacted() {
        let s = Secret::new(vec![0xab; 32]);
        let d = format!("{s:?}");
        assert!(!d.contains("ab") && !d.contains("171"), "{d}");
    }
}

//! The TLS 1.3 record layer (RFC 8446 §5): headers, traffic keys, sequence numbers, and the AEAD seal and
//! open of one record.
//!
//! A protected record is `17 03 03 len_hi len_lo || AEAD(inner plaintext || content type || zero padding)`;
//! the nonce is the IV XOR the 64-bit big-endian sequence number, the AAD is the 5-byte header. Sequence
//! numbers count from 0 per direction and per key.

use aws_lc_rs::aead::{self, Aad, LessSafeKey, Nonce, UnboundKey};
use zeroize::Zeroizing;

use super::error::TlsError;
use super::schedule::{expand_label, HashAlg, Secret};

/// Header length.
pub(crate) const HEADER_LEN: usize = 5;
/// AEAD tag length (both suites).
pub(crate) const TAG_LEN: usize = 16;
/// Most plaintext one record may carry.
pub const MAX_PLAINTEXT: usize = 16384;
/// Most ciphertext (the length field) one protected record may carry.
pub const MAX_CIPHERTEXT: usize = MAX_PLAINTEXT + 256;
/// Wire bytes a full protected record adds to its plaintext: header, content type, tag.
pub const RECORD_OVERHEAD: usize = HEADER_LEN + 1 + TAG_LEN;

/// Record content types.
pub(crate) mod ct {
    pub(crate) const CHANGE_CIPHER_SPEC: u8 = 20;
    pub(crate) const ALERT: u8 = 21;
    pub(crate) const HANDSHAKE: u8 = 22;
    pub(crate) const APPLICATION_DATA: u8 = 23;
}

/// A TLS 1.3 cipher suite.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CipherSuite {
    /// TLS_AES_128_GCM_SHA256 {0x13, 0x01}.
    Aes128GcmSha256,
    /// TLS_AES_256_GCM_SHA384 {0x13, 0x02}.
    Aes256GcmSha384,
}

impl CipherSuite {
    /// The suite NVMe/TCP uses with a PSK of this hash.
    pub fn for_hash(hash: HashAlg) -> CipherSuite {
        match hash {
            HashAlg::Sha256 => CipherSuite::Aes128GcmSha256,
            HashAlg::Sha384 => CipherSuite::Aes256GcmSha384,
        }
    }

    /// The wire code.
    pub fn code(self) -> u16 {
        match self {
            CipherSuite::Aes128GcmSha256 => 0x1301,
            CipherSuite::Aes256GcmSha384 => 0x1302,
        }
    }

    /// The suite's hash.
    pub fn hash(self) -> HashAlg {
        match self {
            CipherSuite::Aes128GcmSha256 => HashAlg::Sha256,
            CipherSuite::Aes256GcmSha384 => HashAlg::Sha384,
        }
    }

    fn aead(self) -> &'static aead::Algorithm {
        match self {
            CipherSuite::Aes128GcmSha256 => &aead::AES_128_GCM,
            CipherSuite::Aes256GcmSha384 => &aead::AES_256_GCM,
        }
    }

    fn key_len(self) -> usize {
        match self {
            CipherSuite::Aes128GcmSha256 => 16,
            CipherSuite::Aes256GcmSha384 => 32,
        }
    }
}

/// A record header: (content type, length field). None if fewer than 5 bytes are there.
pub(crate) fn header(input: &[u8]) -> Option<(u8, usize)> {
    if input.len() < HEADER_LEN {
        return None;
    }
    Some((input[0], usize::from(input[3]) << 8 | usize::from(input[4])))
}

/// Appends a plaintext record (handshake before keys, or an alert before keys).
pub(crate) fn write_plain(typ: u8, legacy_version: u16, body: &[u8], out: &mut Vec<u8>) {
    for chunk in body.chunks(MAX_PLAINTEXT) {
        out.push(typ);
        out.extend_from_slice(&legacy_version.to_be_bytes());
        // A chunk is at most MAX_PLAINTEXT (16384) bytes.
        #[allow(clippy::cast_possible_truncation)]
        let len = chunk.len() as u16;
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(chunk);
    }
}

/// One direction's traffic secret and the AEAD key, IV and sequence number derived from it.
pub(crate) struct Traffic {
    suite: CipherSuite,
    secret: Secret,
    key: LessSafeKey,
    iv: Zeroizing<[u8; 12]>,
    seq: u64,
}

impl Traffic {
    pub(crate) fn new(suite: CipherSuite, secret: Secret) -> Traffic {
        let hash = suite.hash();
        let key = expand_label(hash, secret.as_bytes(), b"key", b"", suite.key_len());
        let iv_bytes = expand_label(hash, secret.as_bytes(), b"iv", b"", 12);
        let mut iv = Zeroizing::new([0u8; 12]);
        iv.copy_from_slice(iv_bytes.as_bytes());
        let key = LessSafeKey::new(
            UnboundKey::new(suite.aead(), key.as_bytes()).expect("key length fits the suite"),
        );
        Traffic {
            suite,
            secret,
            key,
            iv,
            seq: 0,
        }
    }

    /// KeyUpdate: the next secret is HKDF-Expand-Label(secret, "traffic upd", "", HashLen), and the
    /// sequence number starts again at 0.
    pub(crate) fn update(&mut self) {
        let hash = self.suite.hash();
        let next = expand_label(
            hash,
            self.secret.as_bytes(),
            b"traffic upd",
            b"",
            hash.output_len(),
        );
        *self = Traffic::new(self.suite, next);
    }

    /// Records this key has sealed or opened (its next sequence number).
    pub(crate) fn seq(&self) -> u64 {
        self.seq
    }

    /// The nonce for the current sequence number; the caller advances `seq` once the record is sealed or
    /// has opened.
    fn nonce(&self) -> Result<Nonce, TlsError> {
        // RFC 8446 §5.5: never wrap; rekey or close long before.
        if self.seq == u64::MAX {
            return Err(TlsError::Internal("record sequence number exhausted"));
        }
        let mut n = *self.iv;
        for (b, s) in n[4..].iter_mut().zip(self.seq.to_be_bytes()) {
            *b ^= s;
        }
        Ok(Nonce::assume_unique_for_key(n))
    }

    /// Appends one protected record holding `body` followed by the inner content type (see
    /// [`Traffic::seal_into`]).
    pub(crate) fn seal(&mut self, typ: u8, body: &[u8], out: &mut Vec<u8>) -> Result<(), TlsError> {
        let start = out.len();
        out.resize(start + sealed_record_len(body.len()), 0);
        self.seal_into(typ, body, &mut out[start..]).map(|_| ())
    }

    /// Writes one protected record holding `body` (at most [`MAX_PLAINTEXT`] bytes) and the inner content
    /// type at the start of `out`, encrypting from `body` straight into it. Returns the record's length.
    /// `out` must hold [`sealed_record_len`] bytes.
    pub(crate) fn seal_into(
        &mut self,
        typ: u8,
        body: &[u8],
        out: &mut [u8],
    ) -> Result<usize, TlsError> {
        debug_assert!(body.len() <= MAX_PLAINTEXT);
        let len = sealed_record_len(body.len());
        let nonce = self.nonce()?;
        self.seq += 1;
        let hdr = protected_header(body.len())?;
        out[..HEADER_LEN].copy_from_slice(&hdr);
        let (ct, extra) = out[HEADER_LEN..len].split_at_mut(body.len());
        self.key
            .seal_out_of_place_scatter(nonce, Aad::from(hdr), body, ct, &[typ], extra)
            .map_err(|_| TlsError::Internal("AEAD seal failed"))?;
        Ok(len)
    }

    /// Writes one protected record of inner type `typ` whose plaintext is the `len` bytes taken from
    /// `parts` starting at (`idx`, `off`), advancing them, at the start of `out`. The plaintext is copied
    /// into `out` and sealed in place there. `len` is not checked against [`MAX_PLAINTEXT`] (tests use
    /// that). Returns the record's length.
    pub(crate) fn seal_gather_into(
        &mut self,
        typ: u8,
        parts: &[&[u8]],
        idx: &mut usize,
        off: &mut usize,
        len: usize,
        out: &mut [u8],
    ) -> Result<usize, TlsError> {
        let rec_len = sealed_record_len(len);
        let nonce = self.nonce()?;
        self.seq += 1;
        let hdr = protected_header(len)?;
        out[..HEADER_LEN].copy_from_slice(&hdr);
        let mut at = HEADER_LEN;
        while at < HEADER_LEN + len {
            let part = &parts[*idx][*off..];
            let n = part.len().min(HEADER_LEN + len - at);
            out[at..at + n].copy_from_slice(&part[..n]);
            at += n;
            *off += n;
            if *off == parts[*idx].len() {
                *idx += 1;
                *off = 0;
            }
        }
        let (body, extra) = out[HEADER_LEN..rec_len].split_at_mut(len);
        self.key
            .seal_in_place_scatter(nonce, Aad::from(hdr), body, &[typ], extra)
            .map_err(|_| TlsError::Internal("AEAD seal failed"))?;
        Ok(rec_len)
    }

    /// Opens one protected record (`record` is header and payload) and appends its content, without the
    /// content type and padding, to `out`. Returns the inner content type. On failure `out` is left as it
    /// was.
    pub(crate) fn open(&mut self, record: &[u8], out: &mut Vec<u8>) -> Result<u8, TlsError> {
        let start = out.len();
        out.resize(start + record.len().saturating_sub(HEADER_LEN + TAG_LEN), 0);
        match self.open_into(record, &mut out[start..]) {
            Ok((typ, n)) => {
                out.truncate(start + n);
                Ok(typ)
            }
            Err(e) => {
                out.truncate(start);
                Err(e)
            }
        }
    }

    /// Opens one protected record into the start of `out`, which must hold the record's length less
    /// header and tag. Returns the inner content type and the content's length (without type and
    /// padding). If authentication fails the sequence number is unchanged; on any failure `out` holds
    /// garbage.
    pub(crate) fn open_into(
        &mut self,
        record: &[u8],
        out: &mut [u8],
    ) -> Result<(u8, usize), TlsError> {
        let (hdr, payload) = record.split_at(HEADER_LEN);
        if payload.len() > MAX_CIPHERTEXT {
            return Err(TlsError::RecordOverflow);
        }
        if payload.len() < TAG_LEN + 1 {
            return Err(TlsError::BadRecordMac);
        }
        let nonce = self.nonce()?;
        let (ciphertext, tag) = payload.split_at(payload.len() - TAG_LEN);
        let out = &mut out[..ciphertext.len()];
        self.key
            .open_separate_gather(nonce, Aad::from(hdr), ciphertext, tag, out)
            .map_err(|_| TlsError::BadRecordMac)?;
        self.seq += 1;
        // The content type is the last non-zero byte; zeros after it are padding.
        let Some(pos) = out.iter().rposition(|&b| b != 0) else {
            return Err(TlsError::UnexpectedMessage("record has no content type"));
        };
        if pos > MAX_PLAINTEXT {
            return Err(TlsError::RecordOverflow);
        }
        Ok((out[pos], pos))
    }
}

/// Wire length of a protected record carrying `plain_len` bytes of content.
pub(crate) const fn sealed_record_len(plain_len: usize) -> usize {
    plain_len + RECORD_OVERHEAD
}

/// Fails with record_overflow if the record is longer than its 16-bit length field holds.
fn protected_header(plain_len: usize) -> Result<[u8; HEADER_LEN], TlsError> {
    let len = u16::try_from(plain_len + 1 + TAG_LEN)
        .map_err(|_| TlsError::RecordOverflow)?
        .to_be_bytes();
    Ok([ct::APPLICATION_DATA, 3, 3, len[0], len[1]])
}

#[cfg(test)]
// Test data is made by wrapping counters into bytes on purpose.
#[allow(clippy::cast_possible_truncation)]
mod tests {
    use super::*;

    /// One record from `parts`, through `seal_gather_into`.
    fn gather(t: &mut Traffic, typ: u8, parts: &[&[u8]]) -> Vec<u8> {
        let len = parts.iter().map(|p| p.len()).sum();
        let mut out = vec![0; sealed_record_len(len)];
        let (mut i, mut o) = (0, 0);
        let n = t
            .seal_gather_into(typ, parts, &mut i, &mut o, len, &mut out)
            .unwrap();
        assert_eq!((n, i, o), (out.len(), parts.len(), 0));
        out
    }

    fn pair(suite: CipherSuite) -> (Traffic, Traffic) {
        let s = Secret::new(vec![7; suite.hash().output_len()]);
        (Traffic::new(suite, s.clone()), Traffic::new(suite, s))
    }

    #[test]
    fn seal_open_round_trip_and_gather_matches() {
        for suite in [CipherSuite::Aes128GcmSha256, CipherSuite::Aes256GcmSha384] {
            let (mut a, mut b) = pair(suite);
            let (mut c, _) = pair(suite);
            let data: Vec<u8> = (0..5000u32).map(|i| i as u8).collect();
            let mut one = Vec::new();
            a.seal(ct::APPLICATION_DATA, &data, &mut one).unwrap();
            let parts: [&[u8]; 3] = [&data[..10], &data[10..4000], &data[4000..]];
            let two = gather(&mut c, ct::APPLICATION_DATA, &parts);
            assert_eq!(one, two);
            assert_eq!(one.len(), data.len() + RECORD_OVERHEAD);
            let mut plain = vec![9];
            assert_eq!(b.open(&one, &mut plain).unwrap(), ct::APPLICATION_DATA);
            assert_eq!(&plain[1..], &data[..]);
        }
    }

    #[test]
    fn tampering_and_replay_fail() {
        let (mut a, mut b) = pair(CipherSuite::Aes128GcmSha256);
        let mut rec = Vec::new();
        a.seal(ct::APPLICATION_DATA, b"hello", &mut rec).unwrap();
        let mut bad = rec.clone();
        bad[7] ^= 1;
        let mut plain = Vec::new();
        assert_eq!(b.open(&bad, &mut plain), Err(TlsError::BadRecordMac));
        assert!(plain.is_empty());
        // The failed attempt did not use up sequence number 0.
        assert_eq!(b.open(&rec, &mut plain), Ok(ct::APPLICATION_DATA));
        assert_eq!(plain, b"hello");
        // A replay does not open under sequence number 1.
        assert_eq!(b.open(&rec, &mut plain), Err(TlsError::BadRecordMac));
    }

    #[test]
    fn inner_plaintext_over_16k_is_record_overflow() {
        let (mut a, mut b) = pair(CipherSuite::Aes128GcmSha256);
        let big = vec![1u8; MAX_PLAINTEXT + 1];
        let rec = gather(&mut a, ct::APPLICATION_DATA, &[&big]);
        assert!(rec.len() - HEADER_LEN <= MAX_CIPHERTEXT);
        let mut plain = vec![7];
        assert_eq!(b.open(&rec, &mut plain), Err(TlsError::RecordOverflow));
        assert_eq!(plain, [7]);
        // Padding does not count: 16384 bytes of content and 200 of zeros are fine.
        let (mut a, mut b) = pair(CipherSuite::Aes128GcmSha256);
        let mut padded = vec![1u8; MAX_PLAINTEXT];
        padded.push(ct::APPLICATION_DATA);
        padded.resize(MAX_PLAINTEXT + 1 + 200, 0);
        // Sealed with inner type 0 appended: the last non-zero byte is still our type byte.
        let rec = gather(&mut a, 0, &[&padded]);
        assert_eq!(b.open(&rec, &mut plain), Ok(ct::APPLICATION_DATA));
        assert_eq!(plain.len(), 1 + MAX_PLAINTEXT);
    }

    #[test]
    fn key_update_changes_keys() {
        let (mut a, mut b) = pair(CipherSuite::Aes256GcmSha384);
        a.update();
        let mut rec = Vec::new();
        a.seal(ct::HANDSHAKE, b"x", &mut rec).unwrap();
        let mut plain = Vec::new();
        assert!(b.open(&rec, &mut plain).is_err());
        let (_, mut b) = pair(CipherSuite::Aes256GcmSha384);
        b.update();
        assert_eq!(b.open(&rec, &mut plain), Ok(ct::HANDSHAKE));
        assert_eq!(plain, b"x");
    }
}

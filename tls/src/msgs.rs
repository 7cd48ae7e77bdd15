//! Handshake message encoding and strict decoding (RFC 8446 §4): the few messages a PSK handshake uses.
//!
//! Decoders borrow from the message bytes and fail with the alert RFC 8446 names: `decode_error` for
//! bad lengths, `illegal_parameter` for duplicate or misplaced extensions, `unsupported_extension` for a
//! server extension the client never offered.

use super::error::TlsError;

/// Handshake message types.
pub(crate) mod ht {
    pub(crate) const CLIENT_HELLO: u8 = 1;
    pub(crate) const SERVER_HELLO: u8 = 2;
    pub(crate) const NEW_SESSION_TICKET: u8 = 4;
    pub(crate) const ENCRYPTED_EXTENSIONS: u8 = 8;
    pub(crate) const FINISHED: u8 = 20;
    pub(crate) const KEY_UPDATE: u8 = 24;
}

/// Extension types.
pub(crate) mod ext {
    pub(crate) const SERVER_NAME: u16 = 0;
    pub(crate) const SUPPORTED_GROUPS: u16 = 10;
    pub(crate) const PRE_SHARED_KEY: u16 = 41;
    pub(crate) const EARLY_DATA: u16 = 42;
    pub(crate) const SUPPORTED_VERSIONS: u16 = 43;
    pub(crate) const COOKIE: u16 = 44;
    pub(crate) const PSK_KEY_EXCHANGE_MODES: u16 = 45;
    pub(crate) const KEY_SHARE: u16 = 51;

    /// Extensions this implementation knows; a known one in the wrong message is illegal_parameter,
    /// an unknown one from a server is unsupported_extension.
    pub(crate) fn known(t: u16) -> bool {
        matches!(
            t,
            SERVER_NAME
                | SUPPORTED_GROUPS
                | PRE_SHARED_KEY
                | EARLY_DATA
                | SUPPORTED_VERSIONS
                | COOKIE
                | PSK_KEY_EXCHANGE_MODES
                | KEY_SHARE
        )
    }
}

/// psk_key_exchange_modes values.
pub(crate) const PSK_KE: u8 = 0;
pub(crate) const PSK_DHE_KE: u8 = 1;

pub(crate) const TLS13: u16 = 0x0304;
pub(crate) const TLS12: u16 = 0x0303;

/// ServerHello.random of a HelloRetryRequest: SHA-256("HelloRetryRequest").
pub(crate) const HRR_RANDOM: [u8; 32] = [
    0xCF, 0x21, 0xAD, 0x74, 0xE5, 0x9A, 0x61, 0x11, 0xBE, 0x1D, 0x8C, 0x02, 0x1E, 0x65, 0xB8, 0x91,
    0xC2, 0xA2, 0x11, 0x16, 0x7A, 0xBB, 0x8C, 0x5E, 0x07, 0x9E, 0x09, 0xE2, 0xC8, 0xA8, 0x33, 0x9C,
];

/// Largest handshake message accepted (ClientHello, NewSessionTicket, ...).
pub(crate) const MAX_HANDSHAKE_MESSAGE: usize = 1 << 17;

/// A bounds-checked cursor; every read names what it reads, for the decode_error.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf }
    }

    pub(crate) fn bytes(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], TlsError> {
        if self.buf.len() < n {
            return Err(TlsError::Decode(what));
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    pub(crate) fn u8(&mut self, what: &'static str) -> Result<u8, TlsError> {
        Ok(self.bytes(1, what)?[0])
    }

    pub(crate) fn u16(&mut self, what: &'static str) -> Result<u16, TlsError> {
        let b = self.bytes(2, what)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    pub(crate) fn u32(&mut self, what: &'static str) -> Result<u32, TlsError> {
        let b = self.bytes(4, what)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// A vector with a 1-byte length, whose length must lie in `min..=max`.
    pub(crate) fn vec8(
        &mut self,
        min: usize,
        max: usize,
        what: &'static str,
    ) -> Result<&'a [u8], TlsError> {
        let n = usize::from(self.u8(what)?);
        if n < min || n > max {
            return Err(TlsError::Decode(what));
        }
        self.bytes(n, what)
    }

    /// A vector with a 2-byte length, whose length must lie in `min..=max`.
    pub(crate) fn vec16(
        &mut self,
        min: usize,
        max: usize,
        what: &'static str,
    ) -> Result<&'a [u8], TlsError> {
        let n = usize::from(self.u16(what)?);
        if n < min || n > max {
            return Err(TlsError::Decode(what));
        }
        self.bytes(n, what)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    pub(crate) fn rest(&self) -> &'a [u8] {
        self.buf
    }

    /// Fails with decode_error if bytes are left.
    pub(crate) fn end(&self, what: &'static str) -> Result<(), TlsError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(TlsError::Decode(what))
        }
    }
}

/// A list of u16 values (groups, versions) in a vector body.
fn u16_list(body: &[u8], what: &'static str) -> Result<Vec<u16>, TlsError> {
    if body.len() % 2 != 0 {
        return Err(TlsError::Decode(what));
    }
    Ok(body
        .chunks_exact(2)
        .map(|c| u16::from_be_bytes([c[0], c[1]]))
        .collect())
}

/// What [`put_prefixed`] fails with: what `f` wrote does not fit the length prefix.
pub(crate) const PREFIX_OVERFLOW: TlsError =
    TlsError::InvalidUse("a field is longer than its length prefix holds");

/// Appends `value` with a big-endian length prefix of `width` (1 to 4) bytes, filled in by `f`. Fails with
/// [`PREFIX_OVERFLOW`] (what `f` wrote stays in `out`) if the length does not fit in `width` bytes.
pub(crate) fn put_prefixed(
    out: &mut Vec<u8>,
    width: usize,
    f: impl FnOnce(&mut Vec<u8>) -> Result<(), TlsError>,
) -> Result<(), TlsError> {
    let at = out.len();
    out.extend_from_slice(&[0; 4][..width]);
    f(out)?;
    let len = out.len() - at - width;
    let be = u32::try_from(len)
        .ok()
        .filter(|&l| u64::from(l) < 1 << (8 * width))
        .ok_or(PREFIX_OVERFLOW)?
        .to_be_bytes();
    out[at..at + width].copy_from_slice(&be[4 - width..]);
    Ok(())
}

/// Appends a handshake message: `type || u24 length || body`.
pub(crate) fn put_handshake(
    out: &mut Vec<u8>,
    typ: u8,
    f: impl FnOnce(&mut Vec<u8>) -> Result<(), TlsError>,
) -> Result<(), TlsError> {
    out.push(typ);
    put_prefixed(out, 3, f)
}

/// Appends an extension: `type || u16 length || data`.
pub(crate) fn put_ext(
    out: &mut Vec<u8>,
    typ: u16,
    f: impl FnOnce(&mut Vec<u8>) -> Result<(), TlsError>,
) -> Result<(), TlsError> {
    out.extend_from_slice(&typ.to_be_bytes());
    put_prefixed(out, 2, f)
}

/// Splits the first complete handshake message off `buf`: (type, whole message length), or None if
/// incomplete. Fails on a message larger than [`MAX_HANDSHAKE_MESSAGE`].
pub(crate) fn next_message(buf: &[u8]) -> Result<Option<(u8, usize)>, TlsError> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let len = usize::from(buf[1]) << 16 | usize::from(buf[2]) << 8 | usize::from(buf[3]);
    if len > MAX_HANDSHAKE_MESSAGE {
        return Err(TlsError::Decode("handshake message too long"));
    }
    if buf.len() < 4 + len {
        return Ok(None);
    }
    Ok(Some((buf[0], 4 + len)))
}

/// Tracks extension types seen in one message: duplicates are illegal_parameter.
struct Seen(Vec<u16>);

impl Seen {
    fn check(&mut self, t: u16) -> Result<(), TlsError> {
        if self.0.contains(&t) {
            return Err(TlsError::IllegalParameter("duplicate extension"));
        }
        self.0.push(t);
        Ok(())
    }
}

/// The offered PSKs of a ClientHello.
pub(crate) struct OfferedPsks<'a> {
    pub identities: Vec<&'a [u8]>,
    pub binders: Vec<&'a [u8]>,
}

/// A decoded ClientHello.
pub(crate) struct ClientHello<'a> {
    pub session_id: &'a [u8],
    pub suites: Vec<u16>,
    pub compression: &'a [u8],
    pub versions: Option<Vec<u16>>,
    pub groups: Option<Vec<u16>>,
    pub key_shares: Option<Vec<(u16, &'a [u8])>>,
    pub psk_modes: Option<&'a [u8]>,
    pub psk: Option<OfferedPsks<'a>>,
    pub early_data: bool,
    /// Offset in the whole message (header included) where the binders list starts: the binder MAC
    /// covers everything before it.
    pub binders_offset: usize,
}

impl<'a> ClientHello<'a> {
    /// Decodes a whole ClientHello message (with its 4-byte header).
    pub(crate) fn decode(msg: &'a [u8]) -> Result<ClientHello<'a>, TlsError> {
        let mut r = Reader::new(&msg[4..]);
        let _legacy_version = r.u16("ClientHello version")?;
        r.bytes(32, "ClientHello random")?;
        let session_id = r.vec8(0, 32, "ClientHello session id")?;
        let suites = r.vec16(2, 0xfffe, "ClientHello cipher suites")?;
        let suites = u16_list(suites, "ClientHello cipher suites")?;
        let compression = r.vec8(1, 255, "ClientHello compression methods")?;
        let mut ch = ClientHello {
            session_id,
            suites,
            compression,
            versions: None,
            groups: None,
            key_shares: None,
            psk_modes: None,
            psk: None,
            early_data: false,
            binders_offset: 0,
        };
        if r.is_empty() {
            // No extensions at all: a TLS 1.2 (or older) client.
            return Ok(ch);
        }
        let exts = r.vec16(0, 0xffff, "ClientHello extensions")?;
        r.end("bytes after ClientHello extensions")?;
        let mut exts = Reader::new(exts);
        let mut seen = Seen(Vec::new());
        while !exts.is_empty() {
            if ch.psk.is_some() {
                return Err(TlsError::IllegalParameter(
                    "pre_shared_key is not the last extension",
                ));
            }
            let typ = exts.u16("extension type")?;
            let data = exts.vec16(0, 0xffff, "extension")?;
            seen.check(typ)?;
            let mut d = Reader::new(data);
            match typ {
                ext::SUPPORTED_VERSIONS => {
                    let v = d.vec8(2, 254, "supported_versions")?;
                    ch.versions = Some(u16_list(v, "supported_versions")?);
                }
                ext::SUPPORTED_GROUPS => {
                    let g = d.vec16(2, 0xffff, "supported_groups")?;
                    ch.groups = Some(u16_list(g, "supported_groups")?);
                }
                ext::KEY_SHARE => {
                    let mut shares = Vec::new();
                    let mut l = Reader::new(d.vec16(0, 0xffff, "key_share")?);
                    while !l.is_empty() {
                        let group = l.u16("key_share group")?;
                        let key = l.vec16(1, 0xffff, "key_share key")?;
                        shares.push((group, key));
                    }
                    ch.key_shares = Some(shares);
                }
                ext::PSK_KEY_EXCHANGE_MODES => {
                    ch.psk_modes = Some(d.vec8(1, 255, "psk_key_exchange_modes")?);
                }
                ext::EARLY_DATA => ch.early_data = true,
                ext::PRE_SHARED_KEY => {
                    let mut ids = Reader::new(d.vec16(7, 0xffff, "PSK identities")?);
                    let mut identities = Vec::new();
                    while !ids.is_empty() {
                        identities.push(ids.vec16(1, 0xffff, "PSK identity")?);
                        ids.u32("PSK obfuscated ticket age")?;
                    }
                    // The binders list runs to the end of the message (this is the last extension, and
                    // nothing may follow the extensions).
                    let binders_at_end = d.rest().len();
                    let mut bs = Reader::new(d.vec16(33, 0xffff, "PSK binders")?);
                    let mut binders = Vec::new();
                    while !bs.is_empty() {
                        binders.push(bs.vec8(32, 255, "PSK binder")?);
                    }
                    ch.binders_offset = msg.len() - binders_at_end;
                    ch.psk = Some(OfferedPsks {
                        identities,
                        binders,
                    });
                }
                _ => {
                    // Unknown (or not used here, like server_name and signature_algorithms): ignored.
                    continue;
                }
            }
            d.end("extension has trailing bytes")?;
        }
        Ok(ch)
    }
}

/// The key_share of a ServerHello (group and key) or of a HelloRetryRequest (group only).
pub(crate) enum ServerShare<'a> {
    Share(u16, &'a [u8]),
    Retry(u16),
}

/// A decoded ServerHello or HelloRetryRequest.
pub(crate) struct ServerHello<'a> {
    pub is_hrr: bool,
    pub session_id: &'a [u8],
    pub suite: u16,
    pub compression: u8,
    pub version: Option<u16>,
    pub key_share: Option<ServerShare<'a>>,
    pub psk_index: Option<u16>,
    pub cookie: Option<&'a [u8]>,
}

impl<'a> ServerHello<'a> {
    /// Decodes a whole ServerHello message (with its 4-byte header).
    pub(crate) fn decode(msg: &'a [u8]) -> Result<ServerHello<'a>, TlsError> {
        let mut r = Reader::new(&msg[4..]);
        let legacy_version = r.u16("ServerHello version")?;
        let random = r.bytes(32, "ServerHello random")?;
        let session_id = r.vec8(0, 32, "ServerHello session id")?;
        let suite = r.u16("ServerHello cipher suite")?;
        let compression = r.u8("ServerHello compression")?;
        let mut sh = ServerHello {
            is_hrr: random == HRR_RANDOM,
            session_id,
            suite,
            compression,
            version: None,
            key_share: None,
            psk_index: None,
            cookie: None,
        };
        if r.is_empty() {
            // A TLS 1.2 server (no supported_versions).
            return Ok(sh);
        }
        if legacy_version != TLS12 {
            return Err(TlsError::ProtocolVersion);
        }
        let exts = r.vec16(0, 0xffff, "ServerHello extensions")?;
        r.end("bytes after ServerHello extensions")?;
        let mut exts = Reader::new(exts);
        let mut seen = Seen(Vec::new());
        while !exts.is_empty() {
            let typ = exts.u16("extension type")?;
            let data = exts.vec16(0, 0xffff, "extension")?;
            seen.check(typ)?;
            let mut d = Reader::new(data);
            match (typ, sh.is_hrr) {
                (ext::SUPPORTED_VERSIONS, _) => sh.version = Some(d.u16("supported_versions")?),
                (ext::KEY_SHARE, false) => {
                    let group = d.u16("key_share group")?;
                    let key = d.vec16(1, 0xffff, "key_share key")?;
                    sh.key_share = Some(ServerShare::Share(group, key));
                }
                (ext::KEY_SHARE, true) => {
                    sh.key_share = Some(ServerShare::Retry(d.u16("key_share group")?))
                }
                (ext::PRE_SHARED_KEY, false) => sh.psk_index = Some(d.u16("pre_shared_key")?),
                (ext::COOKIE, true) => sh.cookie = Some(d.vec16(1, 0xffff, "cookie")?),
                (t, _) if ext::known(t) => {
                    return Err(TlsError::IllegalParameter(
                        "extension not allowed in ServerHello",
                    ))
                }
                (t, _) => return Err(TlsError::UnsupportedExtension(t)),
            }
            d.end("extension has trailing bytes")?;
        }
        Ok(sh)
    }
}

/// Checks an EncryptedExtensions body: only supported_groups (informational) may appear from what a PSK
/// client offers.
pub(crate) fn check_encrypted_extensions(msg: &[u8]) -> Result<(), TlsError> {
    let mut r = Reader::new(&msg[4..]);
    let exts = r.vec16(0, 0xffff, "EncryptedExtensions")?;
    r.end("bytes after EncryptedExtensions")?;
    let mut exts = Reader::new(exts);
    let mut seen = Seen(Vec::new());
    while !exts.is_empty() {
        let typ = exts.u16("extension type")?;
        exts.vec16(0, 0xffff, "extension")?;
        seen.check(typ)?;
        match typ {
            ext::SUPPORTED_GROUPS => {}
            t if ext::known(t) => {
                return Err(TlsError::IllegalParameter(
                    "extension not allowed in EncryptedExtensions",
                ))
            }
            t => return Err(TlsError::UnsupportedExtension(t)),
        }
    }
    Ok(())
}

/// Checks a NewSessionTicket's structure (its content is ignored: we never resume).
pub(crate) fn check_new_session_ticket(msg: &[u8]) -> Result<(), TlsError> {
    let mut r = Reader::new(&msg[4..]);
    r.u32("ticket lifetime")?;
    r.u32("ticket age add")?;
    r.vec8(0, 255, "ticket nonce")?;
    r.vec16(1, 0xffff, "ticket")?;
    r.vec16(0, 0xfffe, "ticket extensions")?;
    r.end("bytes after NewSessionTicket")
}

/// Decodes a KeyUpdate: true if the peer requests an update of our keys.
pub(crate) fn decode_key_update(msg: &[u8]) -> Result<bool, TlsError> {
    let mut r = Reader::new(&msg[4..]);
    let v = r.u8("KeyUpdate")?;
    r.end("bytes after KeyUpdate")?;
    match v {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(TlsError::IllegalParameter("KeyUpdate request value")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixed_lengths() {
        let mut v = Vec::new();
        put_handshake(&mut v, 8, |b| put_prefixed(b, 2, |_| Ok(()))).unwrap();
        assert_eq!(v, [8, 0, 0, 2, 0, 0]);
        check_encrypted_extensions(&v).unwrap();
    }

    #[test]
    fn encrypted_extensions_strict() {
        let mut v = Vec::new();
        put_handshake(&mut v, 8, |b| {
            put_prefixed(b, 2, |b| {
                put_ext(b, 0x1234, |b| {
                    b.push(1);
                    Ok(())
                })
            })
        })
        .unwrap();
        assert_eq!(
            check_encrypted_extensions(&v),
            Err(TlsError::UnsupportedExtension(0x1234))
        );
        let mut v = Vec::new();
        put_handshake(&mut v, 8, |b| {
            put_prefixed(b, 2, |b| put_ext(b, ext::KEY_SHARE, |_| Ok(())))
        })
        .unwrap();
        assert!(matches!(
            check_encrypted_extensions(&v),
            Err(TlsError::IllegalParameter(_))
        ));
        let mut v = Vec::new();
        put_handshake(&mut v, 8, |b| {
            put_prefixed(b, 2, |b| {
                put_ext(b, ext::SUPPORTED_GROUPS, |_| Ok(()))?;
                put_ext(b, ext::SUPPORTED_GROUPS, |_| Ok(()))
            })
        })
        .unwrap();
        assert!(matches!(
            check_encrypted_extensions(&v),
            Err(TlsError::IllegalParameter("duplicate extension"))
        ));
    }

    #[test]
    fn key_update_values() {
        assert_eq!(decode_key_update(&[24, 0, 0, 1, 1]), Ok(true));
        assert_eq!(decode_key_update(&[24, 0, 0, 1, 0]), Ok(false));
        assert!(decode_key_update(&[24, 0, 0, 1, 2]).is_err());
        assert!(decode_key_update(&[24, 0, 0, 2, 0, 0]).is_err());
    }
}

//! Little-endian field access for fixed wire layouts, and the error a parser returns.
//!
//! The readers return 0 (or an empty string) for a field that lies past the end of the buffer, so a parser that
//! checked the length once up front can read every field without a chance of panicking. The writers ignore a
//! field that does not fit, for the same reason: encoders always write into buffers they sized themselves.

/// Why a wire structure could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ParseError {
    /// The buffer is shorter than the structure.
    #[error("{what}: need {need} bytes, got {got}")]
    Short {
        /// The structure being decoded.
        what: &'static str,
        /// Bytes the structure needs.
        need: usize,
        /// Bytes the buffer has.
        got: usize,
    },
    /// A field holds a value the structure cannot have.
    #[error("{what}: {reason}")]
    Invalid {
        /// The structure being decoded.
        what: &'static str,
        /// What is wrong, naming the field.
        reason: String,
    },
}

/// Checks that `b` holds at least `need` bytes of the structure `what`.
pub(crate) fn need(what: &'static str, b: &[u8], need: usize) -> Result<(), ParseError> {
    if b.len() < need {
        Err(ParseError::Short {
            what,
            need,
            got: b.len(),
        })
    } else {
        Ok(())
    }
}

fn array_at<const N: usize>(b: &[u8], off: usize) -> [u8; N] {
    off.checked_add(N)
        .and_then(|end| b.get(off..end))
        .and_then(|s| s.try_into().ok())
        .unwrap_or([0; N])
}

/// The byte at `off`, or 0 past the end.
pub(crate) fn u8_at(b: &[u8], off: usize) -> u8 {
    b.get(off).copied().unwrap_or(0)
}

/// The little-endian `u16` at `off`, or 0 past the end.
pub(crate) fn u16_at(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes(array_at(b, off))
}

/// The little-endian `u32` at `off`, or 0 past the end.
pub(crate) fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(array_at(b, off))
}

/// The little-endian `u64` at `off`, or 0 past the end.
pub(crate) fn u64_at(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(array_at(b, off))
}

/// The little-endian `u128` at `off`, or 0 past the end.
pub(crate) fn u128_at(b: &[u8], off: usize) -> u128 {
    u128::from_le_bytes(array_at(b, off))
}

/// The `N` bytes at `off`, or zeros past the end.
pub(crate) fn bytes_at<const N: usize>(b: &[u8], off: usize) -> [u8; N] {
    array_at(b, off)
}

/// A text field of `len` bytes at `off`: cut at the first NUL, with surrounding spaces removed.
///
/// Invalid UTF-8 is replaced rather than rejected: these fields are for display and matching.
pub(crate) fn str_at(b: &[u8], off: usize, len: usize) -> String {
    let field = off
        .checked_add(len)
        .and_then(|end| b.get(off..end))
        .unwrap_or(&[]);
    let field = field.split(|&c| c == 0).next().unwrap_or(&[]);
    String::from_utf8_lossy(field).trim_matches(' ').to_string()
}

/// Like [`str_at`], but the field must be valid UTF-8 (NQNs a target checks): `what` and `field` name it in
/// the error.
pub(crate) fn utf8_at(
    what: &'static str,
    field: &str,
    b: &[u8],
    off: usize,
    len: usize,
) -> Result<String, ParseError> {
    let raw = off
        .checked_add(len)
        .and_then(|end| b.get(off..end))
        .unwrap_or(&[]);
    let raw = raw.split(|&c| c == 0).next().unwrap_or(&[]);
    match std::str::from_utf8(raw) {
        Ok(s) => Ok(s.trim_matches(' ').to_string()),
        Err(e) => Err(ParseError::Invalid {
            what,
            reason: format!("{field} is not UTF-8 (byte {})", e.valid_up_to()),
        }),
    }
}

/// Copies `src` into `b` at `off`; does nothing if it does not fit.
pub(crate) fn put_bytes(b: &mut [u8], off: usize, src: &[u8]) {
    if let Some(dst) = off
        .checked_add(src.len())
        .and_then(|end| b.get_mut(off..end))
    {
        dst.copy_from_slice(src);
    }
}

/// Writes a byte at `off`.
pub(crate) fn put_u8(b: &mut [u8], off: usize, v: u8) {
    put_bytes(b, off, &[v]);
}

/// Writes a little-endian `u16` at `off`.
pub(crate) fn put_u16(b: &mut [u8], off: usize, v: u16) {
    put_bytes(b, off, &v.to_le_bytes());
}

/// Writes a little-endian `u32` at `off`.
pub(crate) fn put_u32(b: &mut [u8], off: usize, v: u32) {
    put_bytes(b, off, &v.to_le_bytes());
}

/// Writes a little-endian `u64` at `off`.
pub(crate) fn put_u64(b: &mut [u8], off: usize, v: u64) {
    put_bytes(b, off, &v.to_le_bytes());
}

/// Writes a little-endian `u128` at `off`.
pub(crate) fn put_u128(b: &mut [u8], off: usize, v: u128) {
    put_bytes(b, off, &v.to_le_bytes());
}

/// How a text field is padded on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pad {
    /// ASCII fields of Identify pages (serial, model, firmware): padded with spaces.
    Space,
    /// NQNs and fabrics address strings: NUL-terminated, padded with NULs.
    Nul,
}

/// Writes `s` into the `len`-byte field at `off`, padded as `pad` says.
///
/// A string too long for the field is cut at a character boundary, and trailing spaces are dropped, so that what
/// [`str_at`] reads back encodes to the same bytes; a NUL-padded field always keeps at least one terminating NUL.
pub(crate) fn put_str(b: &mut [u8], off: usize, len: usize, s: &str, pad: Pad) {
    let (fill, room) = match pad {
        Pad::Space => (b' ', len),
        Pad::Nul => (0, len.saturating_sub(1)),
    };
    let mut cut = s.len().min(room);
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    // Trailing spaces are padding to a reader (see `str_at`), so they are not written as text.
    let text = s[..cut].trim_end_matches(' ').as_bytes();
    let mut field = vec![fill; len];
    field[..text.len()].copy_from_slice(text);
    put_bytes(b, off, &field);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readers_return_zero_past_the_end() {
        let b = [1u8, 2, 3];
        assert_eq!(u16_at(&b, 1), 0x0302);
        assert_eq!(u16_at(&b, 2), 0);
        assert_eq!(u32_at(&b, usize::MAX - 1), 0);
        assert_eq!(u8_at(&b, 3), 0);
        assert_eq!(str_at(&b, 2, 10), "");
    }

    #[test]
    fn strict_strings() {
        let b = *b" nqn.a\0\xff";
        assert_eq!(utf8_at("x", "f", &b, 0, 8), Ok("nqn.a".to_string()));
        let err = utf8_at("x", "f", &b, 7, 1).unwrap_err();
        assert_eq!(err.to_string(), "x: f is not UTF-8 (byte 0)");
        assert_eq!(str_at(&b, 7, 1), "\u{fffd}");
    }

    #[test]
    fn strings_trim_and_pad() {
        let mut b = [0xffu8; 8];
        put_str(&mut b, 0, 8, "ab", Pad::Space);
        assert_eq!(&b, b"ab      ");
        assert_eq!(str_at(&b, 0, 8), "ab");
        put_str(&mut b, 0, 4, "abcdef", Pad::Nul);
        assert_eq!(&b[..4], b"abc\0");
        assert_eq!(str_at(&b, 0, 4), "abc");
        // A multi-byte character is not split.
        put_str(&mut b, 0, 2, "é", Pad::Nul);
        assert_eq!(&b[..2], &[0, 0]);
        // A cut that ends in a space leaves no trailing space in a NUL-padded field.
        put_str(&mut b, 0, 4, "ab cd", Pad::Nul);
        assert_eq!(&b[..4], b"ab\0\0");
        let mut once = [0u8; 4];
        put_str(&mut once, 0, 4, &str_at(&b, 0, 4), Pad::Nul);
        assert_eq!(once, b[..4]);
    }

    #[test]
    fn writers_ignore_fields_that_do_not_fit() {
        let mut b = [0u8; 3];
        put_u32(&mut b, 1, 0xffff_ffff);
        assert_eq!(b, [0, 0, 0]);
        put_u16(&mut b, 1, 0x0201);
        assert_eq!(b, [0, 1, 2]);
    }
}

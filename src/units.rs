//! Sizes and durations as users write them on command lines and in configuration files (`4k`, `1G`, `500ms`).

use std::time::Duration;

/// A size or duration that does not parse; the message quotes what was given.
///
/// # Examples
///
/// ```
/// use nvpoll::units::{parse_duration, parse_size, UnitError};
///
/// assert_eq!(parse_size("4x"), Err(UnitError::NotASize("4x".into())));
/// assert_eq!(parse_size("0k"), Err(UnitError::SizeOutOfRange("0k".into())));
/// let err = parse_duration("2 days").unwrap_err();
/// assert_eq!(err.to_string(), "'2 days' is not a duration (e.g. 10s, 500ms, 1m)");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UnitError {
    /// Not a number with an optional K, M, G or T suffix.
    #[error("{0:?} is not a size like 1G, 512M, 4k or 4096")]
    NotASize(String),
    /// Zero, or more than a u64 holds.
    #[error("{0:?} is zero or too large")]
    SizeOutOfRange(String),
    /// Not a number with an optional unit (us, ms, s, m), or more than a day.
    #[error("'{0}' is not a duration (e.g. 10s, 500ms, 1m)")]
    NotADuration(String),
}

/// Parses a size such as `512`, `4k`, `128K`, `1m`, `1G`, `1TiB` (powers of 1024); zero and overflow are
/// errors.
///
/// # Examples
///
/// ```
/// use nvpoll::units::parse_size;
///
/// assert_eq!(parse_size("4k")?, 4096);
/// assert_eq!(parse_size("128K")?, 128 * 1024);
/// assert_eq!(parse_size("1GiB")?, 1 << 30);
/// assert_eq!(parse_size("512")?, 512);
/// assert!(parse_size("0").is_err());
/// assert!(parse_size("99999999T").is_err(), "more than a u64 holds");
/// # Ok::<(), nvpoll::units::UnitError>(())
/// ```
pub fn parse_size(s: &str) -> Result<u64, UnitError> {
    let t = s.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (digits, shift) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 10),
        Some('M' | 'm') => (&t[..t.len() - 1], 20),
        Some('G' | 'g') => (&t[..t.len() - 1], 30),
        Some('T' | 't') => (&t[..t.len() - 1], 40),
        _ => (t, 0),
    };
    let n: u64 = digits
        .trim()
        .parse()
        .map_err(|_| UnitError::NotASize(s.to_string()))?;
    n.checked_shl(shift)
        .filter(|v| v >> shift == n && *v > 0)
        .ok_or_else(|| UnitError::SizeOutOfRange(s.to_string()))
}

/// Parses a duration such as `10s`, `500ms`, `2m`.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use nvpoll::units::parse_duration;
///
/// assert_eq!(parse_duration("500ms")?, Duration::from_millis(500));
/// assert_eq!(parse_duration("2m")?, Duration::from_secs(120));
/// assert_eq!(parse_duration("1.5")?, Duration::from_millis(1500), "seconds without a unit");
/// assert!(parse_duration("25h").is_err(), "more than a day");
/// # Ok::<(), nvpoll::units::UnitError>(())
/// ```
pub fn parse_duration(s: &str) -> Result<Duration, UnitError> {
    let t = s.trim();
    let bad = || UnitError::NotADuration(s.to_string());
    let (num, unit) = t.split_at(t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len()));
    let v: f64 = num.parse().map_err(|_| bad())?;
    let secs = match unit {
        "" | "s" => v,
        "ms" => v / 1000.0,
        "us" => v / 1e6,
        "m" | "min" => v * 60.0,
        _ => return Err(bad()),
    };
    if !(0.0..=86400.0).contains(&secs) {
        return Err(bad());
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("64KiB"), Ok(64 << 10));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("0"), Err(UnitError::SizeOutOfRange("0".into())));
        assert_eq!(
            parse_size("1X").unwrap_err().to_string(),
            "\"1X\" is not a size like 1G, 512M, 4k or 4096"
        );
        assert!(parse_size("1X").is_err());
        assert!(parse_size("99999999T").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert!(parse_duration("ten").is_err());
    }
}

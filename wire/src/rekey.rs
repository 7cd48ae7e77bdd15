//! When a TLS connection renews its traffic keys ([`KeyRenewal`]).
//!
//! RFC 8446 §5.5: an AES-GCM key keeps its safety margin for 2^24.5 full-size records, and an endpoint is to
//! update its keys before that. A busy NVMe/TCP queue seals hundreds of thousands of records a second, so a
//! connection renews both directions' keys on a count of records (and, optionally, on time), by a TLS
//! KeyUpdate that asks the peer to update too. A peer that cannot take a KeyUpdate (kernel TLS without
//! re-keying alerts or closes) is renewed instead by connecting again before the count runs out.

use std::time::Duration;

/// How a TLS connection renews its keys: set with [`crate::conn::Conn::set_key_renewal`], before or after the
/// handshake. The default renews after 2^23 records or an hour, by KeyUpdate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyRenewal {
    /// Records one key may protect (ours sealing, or the peer's that we open) before both keys are renewed.
    /// At twice this many (and never past 2^24) a key that was not renewed ends the connection: nothing is
    /// ever sealed or accepted past that.
    pub records: u64,
    /// Renew also after this long under one sending key, whichever comes first (`None`: on the count only).
    /// Checked when the connection's owner ticks it ([`crate::conn::Conn::renew_keys_if_due`]).
    pub interval: Option<Duration>,
    /// How the keys are renewed.
    pub method: RenewBy,
}

/// How a connection's keys are renewed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RenewBy {
    /// A TLS KeyUpdate asking the peer to update too (`update_requested`), so that both directions renew.
    KeyUpdate,
    /// The peer cannot take a KeyUpdate: at `records` the connection ends with [`crate::Error::Rekey`], and
    /// its owner connects again (a fresh handshake, fresh keys). The host does this through its reconnect
    /// path; the target ends the session, and the host reconnects.
    Reconnect,
}

impl KeyRenewal {
    /// The count the default renews at: 2^23 records (8.4 million), half the hard limit of 2^24.
    pub const DEFAULT_RECORDS: u64 = 1 << 23;

    /// The default's interval: an hour.
    pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(3600);

    /// Renew by KeyUpdate after `records` (0 is refused by the setters that take a count from a user: see
    /// [`KeyRenewal::check`]), with the default interval.
    pub fn after(records: u64) -> KeyRenewal {
        KeyRenewal {
            records,
            ..KeyRenewal::default()
        }
    }

    /// Refuses a count of 0 or above the default's (a count above 2^23 would leave no room below the hard
    /// limit of 2^24) and an interval of zero.
    pub fn check(&self) -> Result<(), &'static str> {
        if self.records == 0 || self.records > KeyRenewal::DEFAULT_RECORDS {
            return Err("a key is renewed after 1 to 8388608 (2^23) records");
        }
        if self.interval == Some(Duration::ZERO) {
            return Err("a key renewal interval must be above zero");
        }
        Ok(())
    }

    /// The TLS session's limits for this renewal.
    pub(crate) fn limits(&self) -> nvpoll_tls::KeyLimits {
        let records = self.records.clamp(1, KeyRenewal::DEFAULT_RECORDS);
        match self.method {
            RenewBy::KeyUpdate => nvpoll_tls::KeyLimits {
                update_after: Some(records),
                hard_limit: Some(records * 2),
            },
            // No KeyUpdate of ours; past `records`, a seal fails and the peer's key is overdue.
            RenewBy::Reconnect => nvpoll_tls::KeyLimits {
                update_after: None,
                hard_limit: Some(records),
            },
        }
    }
}

impl Default for KeyRenewal {
    fn default() -> Self {
        KeyRenewal {
            records: KeyRenewal::DEFAULT_RECORDS,
            interval: Some(KeyRenewal::DEFAULT_INTERVAL),
            method: RenewBy::KeyUpdate,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_follow_the_method() {
        let k = KeyRenewal::after(1000);
        assert_eq!(k.limits().update_after, Some(1000));
        assert_eq!(k.limits().hard_limit, Some(2000));
        let r = KeyRenewal {
            method: RenewBy::Reconnect,
            ..k
        };
        assert_eq!(r.limits().update_after, None);
        assert_eq!(r.limits().hard_limit, Some(1000));
        assert_eq!(
            KeyRenewal::default().limits(),
            nvpoll_tls::KeyLimits::AES_GCM
        );
    }

    #[test]
    fn check_refuses_what_cannot_work() {
        assert!(KeyRenewal::after(0).check().is_err());
        assert!(KeyRenewal::after((1 << 23) + 1).check().is_err());
        assert!(KeyRenewal::after(1).check().is_ok());
        let zero = KeyRenewal {
            interval: Some(Duration::ZERO),
            ..KeyRenewal::default()
        };
        assert!(zero.check().is_err());
    }
}

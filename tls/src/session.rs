//! An established TLS 1.3 session: application data in records of at most 16 KiB, post-handshake
//! messages (NewSessionTicket absorbed, KeyUpdate honoured), close_notify, and fatal alerts.
//!
//! Invariants:
//! - once [`Session::open`] has failed it fails forever, and no plaintext from the failing call is left in
//!   the caller's buffer;
//! - a KeyUpdate we owe the peer goes out before our next application data record;
//! - nothing is read after the peer's close_notify.

use std::fmt;

use super::common::{alert_error, Negotiated, Role};
use super::error::{AlertDescription, TlsError};
use super::kx::Group;
use super::msgs::{check_new_session_ticket, decode_key_update, ht, next_message};
use super::record::CipherSuite;
use super::record::{
    ct, header, Traffic, HEADER_LEN, MAX_CIPHERTEXT, MAX_PLAINTEXT, RECORD_OVERHEAD, TAG_LEN,
};

/// Wire bytes of one KeyUpdate record.
pub const KEY_UPDATE_LEN: usize = RECORD_OVERHEAD + 5;

/// Bytes of the whole records at the start of `input` (what one `open` call can consume at most).
fn complete_records_len(input: &[u8]) -> usize {
    let mut at = 0;
    while let Some((_, len)) = header(&input[at..]) {
        if input.len() - at < HEADER_LEN + len {
            break;
        }
        at += HEADER_LEN + len;
    }
    at
}

/// Counters of one session, cheap enough to keep always.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SessionStats {
    /// Application data records sealed.
    pub records_sealed: u64,
    /// Application data records opened.
    pub records_opened: u64,
    /// Plaintext bytes sealed.
    pub bytes_sealed: u64,
    /// Plaintext bytes opened.
    pub bytes_opened: u64,
    /// KeyUpdates received.
    pub key_updates_received: u64,
    /// KeyUpdates sent.
    pub key_updates_sent: u64,
    /// NewSessionTickets received and ignored.
    pub tickets_ignored: u64,
}

/// How many records one traffic key may protect before the session renews it (RFC 8446 §5.5: AES-GCM keys
/// keep their safety margin for 2^24.5 full-size records, and an endpoint updates its keys before that).
///
/// The session counts the records each key seals and opens (a KeyUpdate starts the count again):
/// - when our sending key has sealed `update_after` records, the next [`Session::seal`] starts with a
///   KeyUpdate asking the peer to update too (`update_requested`), so both directions renew;
/// - when the peer's key has opened `update_after` records and we have not asked since its last KeyUpdate,
///   we ask (a KeyUpdate of ours goes out with the next seal, or with [`Session::write_pending`]);
/// - no sending key seals past `hard_limit`: a seal that would fails with [`TlsError::KeyLimitReached`],
///   sealing nothing, and [`Session::peer_key_overdue`] says when the peer's key has opened that many (a
///   peer that does not renew when asked). Either way the caller closes and connects again. The limit
///   leaves room for the KeyUpdate or close_notify record that may follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyLimits {
    /// Records per key after which the session renews it on its own; `None`: never on its own.
    pub update_after: Option<u64>,
    /// Records no sending key seals past, and after which the peer's key is overdue; `None`: no limit
    /// but the sequence number's.
    pub hard_limit: Option<u64>,
}

impl KeyLimits {
    /// For both AES-GCM suites: renew after 2^23 records (8.4 million), never seal past 2^24 (16.8
    /// million), below RFC 8446's 2^24.5 with room to spare. A session starts with these.
    pub const AES_GCM: KeyLimits = KeyLimits {
        update_after: Some(1 << 23),
        hard_limit: Some(1 << 24),
    };

    /// Never renew on its own and no limit but the sequence number's: for a peer that cannot take a
    /// KeyUpdate, where the caller counts records itself ([`Session::records_under_write_key`]) and
    /// connects again in time.
    pub const NONE: KeyLimits = KeyLimits {
        update_after: None,
        hard_limit: None,
    };

    /// Renew after `records`, with the hard limit at twice that (at most [`KeyLimits::AES_GCM`]'s).
    /// Refuses 0.
    pub fn renew_after(records: u64) -> Result<KeyLimits, TlsError> {
        if records == 0 {
            return Err(TlsError::InvalidUse(
                "a key renews after at least one record",
            ));
        }
        let hard = KeyLimits::AES_GCM.hard_limit.unwrap_or(u64::MAX);
        Ok(KeyLimits {
            update_after: Some(records.min(hard / 2)),
            hard_limit: Some(records.saturating_mul(2).min(hard)),
        })
    }
}

impl Default for KeyLimits {
    fn default() -> Self {
        KeyLimits::AES_GCM
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum KeyUpdate {
    None,
    /// Send KeyUpdate(update_not_requested), then switch our keys.
    Owed,
    /// Send KeyUpdate(update_requested), then switch our keys.
    Requesting,
}

/// An established session. Sans-IO: [`Session::seal`] appends records to send, [`Session::open`] takes
/// received bytes and appends their plaintext.
pub struct Session {
    read: Traffic,
    write: Traffic,
    negotiated: Negotiated,
    role: Role,
    hs_buf: Vec<u8>,
    key_update: KeyUpdate,
    limits: KeyLimits,
    /// We asked the peer to update its key (KeyUpdate with update_requested) and have not received its
    /// KeyUpdate since.
    asked_peer: bool,
    /// A fatal alert not yet handed out by `write_pending`.
    alert: Option<AlertDescription>,
    failed: Option<TlsError>,
    peer_closed: bool,
    we_closed: bool,
    stats: SessionStats,
}

impl Session {
    pub(crate) fn new(
        role: Role,
        negotiated: Negotiated,
        read: Traffic,
        write: Traffic,
    ) -> Session {
        Session {
            read,
            write,
            negotiated,
            role,
            hs_buf: Vec::new(),
            key_update: KeyUpdate::None,
            limits: KeyLimits::default(),
            asked_peer: false,
            alert: None,
            failed: None,
            peer_closed: false,
            we_closed: false,
            stats: SessionStats::default(),
        }
    }

    /// Encrypts the concatenation of `plaintext` into records of at most 16384 plaintext bytes (one AEAD
    /// call each) appended to `out`, preceded by any KeyUpdate owed. Returns the number of application
    /// data records written (0 for empty input). A record whose bytes come from one slice is encrypted
    /// straight from it; one that spans slices is gathered into `out` and encrypted in place. `out` grows by
    /// at most [`Session::sealed_len`] of the total plus [`KEY_UPDATE_LEN`].
    pub fn seal(&mut self, plaintext: &[&[u8]], out: &mut Vec<u8>) -> Result<usize, TlsError> {
        let start = out.len();
        let total: usize = plaintext.iter().map(|p| p.len()).sum();
        self.check_writable()?;
        self.plan_key_update(total)?;
        out.resize(start + self.pending_len() + Session::sealed_len(total), 0);
        match self.seal_to_slice(plaintext, &mut out[start..]) {
            Ok((records, written)) => {
                out.truncate(start + written);
                Ok(records)
            }
            Err(e) => {
                out.truncate(start);
                Err(e)
            }
        }
    }

    /// As [`Session::seal`], into a caller's buffer (say a preallocated send ring) instead of a Vec: no
    /// zero-fill, the records are written straight into `out`. Returns (records, bytes written). Fails with
    /// `InvalidUse`, writing nothing, if `out` is shorter than [`Session::sealed_len`] of the total plus
    /// [`KEY_UPDATE_LEN`] when a KeyUpdate is owed ([`Session::has_pending`]).
    pub fn seal_to_slice(
        &mut self,
        plaintext: &[&[u8]],
        out: &mut [u8],
    ) -> Result<(usize, usize), TlsError> {
        self.check_writable()?;
        let total: usize = plaintext.iter().map(|p| p.len()).sum();
        self.plan_key_update(total)?;
        if out.len() < self.pending_len() + Session::sealed_len(total) {
            return Err(TlsError::InvalidUse(
                "output buffer too small for the records",
            ));
        }
        let mut at = self.write_key_update(out)?;
        let records = total.div_ceil(MAX_PLAINTEXT);
        let (mut idx, mut off) = (0, 0);
        let mut left = total;
        while left > 0 {
            while plaintext[idx].len() == off {
                idx += 1;
                off = 0;
            }
            let n = left.min(MAX_PLAINTEXT);
            let part = &plaintext[idx][off..];
            at += if part.len() >= n {
                off += n;
                self.write
                    .seal_into(ct::APPLICATION_DATA, &part[..n], &mut out[at..])?
            } else {
                self.write.seal_gather_into(
                    ct::APPLICATION_DATA,
                    plaintext,
                    &mut idx,
                    &mut off,
                    n,
                    &mut out[at..],
                )?
            };
            left -= n;
        }
        self.stats.records_sealed += records as u64;
        self.stats.bytes_sealed += total as u64;
        Ok((records, at))
    }

    /// Wire bytes that sealing `plaintext_len` bytes produces: 22 bytes per started 16 KiB.
    pub const fn sealed_len(plaintext_len: usize) -> usize {
        plaintext_len + plaintext_len.div_ceil(MAX_PLAINTEXT) * RECORD_OVERHEAD
    }

    /// Decrypts every whole record at the start of `input`, appending application data to `plaintext`
    /// (records are not PDUs: the caller reassembles), and returns the bytes consumed; a partial record is
    /// left for the next call. Handles NewSessionTicket (ignored, client only) and KeyUpdate (a reply is
    /// queued if asked: see [`Session::write_pending`]).
    ///
    /// After the peer's close_notify: returns what came before it, and [`TlsError::Closed`] from then on
    /// (at once if nothing came before it in this call). On any other error the call appends no plaintext,
    /// the session is dead, and a fatal alert waits in [`Session::write_pending`].
    pub fn open(&mut self, input: &[u8], plaintext: &mut Vec<u8>) -> Result<usize, TlsError> {
        let start = plaintext.len();
        // Content is never longer than the records holding it.
        plaintext.resize(start + complete_records_len(input), 0);
        match self.open_to_slice(input, &mut plaintext[start..]) {
            Ok((consumed, written)) => {
                plaintext.truncate(start + written);
                Ok(consumed)
            }
            Err(e) => {
                plaintext.truncate(start);
                Err(e)
            }
        }
    }

    /// As [`Session::open`], into a caller's buffer instead of a Vec: no zero-fill, records are decrypted
    /// straight into `out`. Returns (bytes of `input` consumed, bytes of `out` written). Stops before a
    /// record whose ciphertext does not fit in what is left of `out` (an `out` of [`MAX_CIPHERTEXT`]
    /// bytes always fits one). On error, whatever was written to `out` in this call must be ignored.
    pub fn open_to_slice(
        &mut self,
        input: &[u8],
        out: &mut [u8],
    ) -> Result<(usize, usize), TlsError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        if self.peer_closed {
            return Err(TlsError::Closed);
        }
        let (mut pos, mut written) = (0, 0);
        match self.open_records(input, &mut pos, out, &mut written) {
            Ok(()) if self.peer_closed && written == 0 => Err(TlsError::Closed),
            Ok(()) => Ok((pos, written)),
            Err(e) => {
                self.alert = e.alert();
                self.failed = Some(e.clone());
                Err(e)
            }
        }
    }

    fn open_records(
        &mut self,
        input: &[u8],
        pos: &mut usize,
        out: &mut [u8],
        written: &mut usize,
    ) -> Result<(), TlsError> {
        while !self.peer_closed {
            let Some((typ, len)) = header(&input[*pos..]) else {
                break;
            };
            if typ != ct::APPLICATION_DATA {
                return Err(TlsError::UnexpectedMessage(
                    "unprotected record after the handshake",
                ));
            }
            if len > MAX_CIPHERTEXT {
                return Err(TlsError::RecordOverflow);
            }
            if input.len() - *pos < HEADER_LEN + len
                || out.len() - *written < len.saturating_sub(TAG_LEN)
            {
                break;
            }
            let record = &input[*pos..*pos + HEADER_LEN + len];
            let (inner, n) = self.read.open_into(record, &mut out[*written..])?;
            *pos += HEADER_LEN + len;
            let content = &out[*written..*written + n];
            match inner {
                ct::APPLICATION_DATA => {
                    if !self.hs_buf.is_empty() {
                        return Err(TlsError::UnexpectedMessage(
                            "application data inside a handshake message",
                        ));
                    }
                    *written += n;
                    self.stats.records_opened += 1;
                    self.stats.bytes_opened += n as u64;
                    self.note_read_key_use();
                }
                ct::HANDSHAKE => {
                    if content.is_empty() {
                        return Err(TlsError::Decode("empty handshake record"));
                    }
                    self.hs_buf.extend_from_slice(content);
                    self.post_handshake()?;
                }
                ct::ALERT => match alert_error(content) {
                    TlsError::PeerAlert(AlertDescription::CloseNotify) => self.peer_closed = true,
                    TlsError::PeerAlert(AlertDescription::UserCanceled) => {}
                    e => return Err(e),
                },
                _ => return Err(TlsError::UnexpectedMessage("unknown inner content type")),
            }
        }
        Ok(())
    }

    fn post_handshake(&mut self) -> Result<(), TlsError> {
        while let Some((typ, len)) = next_message(&self.hs_buf)? {
            let msg: Vec<u8> = self.hs_buf.drain(..len).collect();
            match typ {
                ht::NEW_SESSION_TICKET if self.role == Role::Client => {
                    check_new_session_ticket(&msg)?;
                    self.stats.tickets_ignored += 1;
                }
                ht::KEY_UPDATE => {
                    let requested = decode_key_update(&msg)?;
                    // The new key starts with the next record: nothing may follow in this one.
                    if !self.hs_buf.is_empty() {
                        return Err(TlsError::UnexpectedMessage(
                            "KeyUpdate not at the end of its record",
                        ));
                    }
                    self.read.update();
                    self.asked_peer = false;
                    self.stats.key_updates_received += 1;
                    if requested && self.key_update == KeyUpdate::None {
                        self.key_update = KeyUpdate::Owed;
                    }
                }
                _ => {
                    return Err(TlsError::UnexpectedMessage(
                        "handshake message after the handshake",
                    ))
                }
            }
        }
        Ok(())
    }

    fn check_writable(&self) -> Result<(), TlsError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        if self.we_closed {
            return Err(TlsError::InvalidUse("session closed by us"));
        }
        Ok(())
    }

    /// Sets when keys are renewed and how far they may go ([`KeyLimits`]; a session starts with
    /// [`KeyLimits::AES_GCM`]). Refuses an `update_after` that is not below `hard_limit`. Takes effect
    /// with the next record.
    pub fn set_key_limits(&mut self, limits: KeyLimits) -> Result<(), TlsError> {
        if let (Some(n), Some(h)) = (limits.update_after, limits.hard_limit) {
            if n == 0 || n >= h {
                return Err(TlsError::InvalidUse(
                    "update_after must be at least 1 and below hard_limit",
                ));
            }
        }
        self.limits = limits;
        Ok(())
    }

    /// The limits in force.
    pub fn key_limits(&self) -> KeyLimits {
        self.limits
    }

    /// Records our current sending key has sealed (KeyUpdate and alert records included).
    pub fn records_under_write_key(&self) -> u64 {
        self.write.seq()
    }

    /// Records the peer's current key has protected that we opened.
    pub fn records_under_read_key(&self) -> u64 {
        self.read.seq()
    }

    /// Whether we asked the peer to update its key (`update_requested`) and its KeyUpdate has not come yet.
    /// A connection that ends in this state, with no KeyUpdate ever received, ended at our KeyUpdate: a peer
    /// that cannot take one (kernel TLS without re-keying alerts or closes).
    pub fn peer_update_awaited(&self) -> bool {
        self.asked_peer
    }

    /// Owes a KeyUpdate that asks the peer to update too (for a renewal by time): it goes out in front of
    /// the next records sealed, or with [`Session::write_pending`]. Does nothing after a failure or close.
    pub fn schedule_key_update(&mut self) {
        if self.failed.is_none() && !self.we_closed {
            self.key_update = KeyUpdate::Requesting;
            self.asked_peer = true;
        }
    }

    /// Whether the peer's key has opened [`KeyLimits::hard_limit`] records without the peer renewing it
    /// (we asked at `update_after`): a peer that does not take a KeyUpdate. Close and connect again.
    pub fn peer_key_overdue(&self) -> bool {
        self.limits.hard_limit.is_some_and(|h| self.read.seq() >= h)
    }

    /// Before sealing `plaintext_len` bytes: owes a KeyUpdate (asking the peer too) when they would take
    /// our key past `update_after`, and refuses them when they would take it past `hard_limit`.
    fn plan_key_update(&mut self, plaintext_len: usize) -> Result<(), TlsError> {
        let records = plaintext_len.div_ceil(MAX_PLAINTEXT) as u64;
        if records == 0 {
            return Ok(());
        }
        let used = self.write.seq();
        if self.key_update == KeyUpdate::None
            && self
                .limits
                .update_after
                .is_some_and(|n| used.saturating_add(records) > n)
        {
            self.key_update = KeyUpdate::Requesting;
            self.asked_peer = true;
        }
        let Some(hard) = self.limits.hard_limit else {
            return Ok(());
        };
        // An owed KeyUpdate is sealed under the old key, and the records under the new one.
        let fits = if self.key_update == KeyUpdate::None {
            used.saturating_add(records) <= hard
        } else {
            used < hard && records <= hard
        };
        if fits {
            Ok(())
        } else {
            Err(TlsError::KeyLimitReached)
        }
    }

    /// After a record opened: asks the peer to renew its key once it has protected `update_after` records
    /// (once per peer key: not again until the peer's KeyUpdate comes).
    fn note_read_key_use(&mut self) {
        if !self.asked_peer
            && self.key_update == KeyUpdate::None
            && self
                .limits
                .update_after
                .is_some_and(|n| self.read.seq() >= n)
        {
            self.key_update = KeyUpdate::Requesting;
            self.asked_peer = true;
        }
    }

    /// Bytes the owed KeyUpdate (if any) adds in front of the next records.
    fn pending_len(&self) -> usize {
        if self.key_update == KeyUpdate::None {
            0
        } else {
            KEY_UPDATE_LEN
        }
    }

    /// Writes the owed KeyUpdate (if any) at the start of `out`, then switches our keys; returns its
    /// length (0 if none was owed).
    fn write_key_update(&mut self, out: &mut [u8]) -> Result<usize, TlsError> {
        let requested = match self.key_update {
            KeyUpdate::None => return Ok(0),
            KeyUpdate::Owed => 0,
            KeyUpdate::Requesting => 1,
        };
        let n = self
            .write
            .seal_into(ct::HANDSHAKE, &[ht::KEY_UPDATE, 0, 0, 1, requested], out)?;
        self.write.update();
        self.key_update = KeyUpdate::None;
        self.stats.key_updates_sent += 1;
        Ok(n)
    }

    /// Appends the owed KeyUpdate (if any) to `out`.
    fn append_key_update(&mut self, out: &mut Vec<u8>) -> Result<bool, TlsError> {
        let start = out.len();
        out.resize(start + self.pending_len(), 0);
        let n = self.write_key_update(&mut out[start..])?;
        Ok(n > 0)
    }

    /// Appends what the session owes the peer without application data: a KeyUpdate reply, or after a
    /// failure of [`Session::open`] the fatal alert (once). Returns whether anything was appended. Call it
    /// after `open` when the connection may stay idle for long.
    pub fn write_pending(&mut self, out: &mut Vec<u8>) -> Result<bool, TlsError> {
        if self.failed.is_some() {
            let Some(alert) = self.alert.take() else {
                return Ok(false);
            };
            self.write.seal(ct::ALERT, &[2, alert.code()], out)?;
            return Ok(true);
        }
        if self.we_closed {
            return Ok(false);
        }
        self.append_key_update(out)
    }

    /// Whether [`Session::write_pending`] has something to write.
    pub fn has_pending(&self) -> bool {
        if self.failed.is_some() {
            self.alert.is_some()
        } else {
            !self.we_closed && self.key_update != KeyUpdate::None
        }
    }

    /// Updates our sending keys now (KeyUpdate), asking the peer to update its own if `request_peer`.
    pub fn update_keys(&mut self, request_peer: bool, out: &mut Vec<u8>) -> Result<(), TlsError> {
        self.check_writable()?;
        self.key_update = if request_peer || self.key_update == KeyUpdate::Requesting {
            self.asked_peer = true;
            KeyUpdate::Requesting
        } else {
            KeyUpdate::Owed
        };
        self.append_key_update(out).map(|_| ())
    }

    /// Sends close_notify: nothing more can be sealed. The peer may still send until its own
    /// close_notify.
    pub fn close(&mut self, out: &mut Vec<u8>) -> Result<(), TlsError> {
        self.check_writable()?;
        self.append_key_update(out)?;
        self.write.seal(ct::ALERT, &[1, 0], out)?;
        self.we_closed = true;
        Ok(())
    }

    /// Seals `body` as one record of inner content type `content_type`, with no check at all (not even
    /// the 16 KiB limit). For tests and fuzzing: it lets a test play a misbehaving peer. Sending its output
    /// to a real peer may end the session.
    #[doc(hidden)]
    pub fn dangerous_seal_raw(
        &mut self,
        content_type: u8,
        body: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), TlsError> {
        let (mut idx, mut off) = (0, 0);
        let start = out.len();
        out.resize(start + body.len() + RECORD_OVERHEAD, 0);
        self.write
            .seal_gather_into(
                content_type,
                &[body],
                &mut idx,
                &mut off,
                body.len(),
                &mut out[start..],
            )
            .map(|_| ())
    }

    /// Whether the peer sent close_notify.
    pub fn is_peer_closed(&self) -> bool {
        self.peer_closed
    }

    /// The error that ended the session, if any.
    pub fn error(&self) -> Option<&TlsError> {
        self.failed.as_ref()
    }

    /// Client or server.
    pub fn role(&self) -> Role {
        self.role
    }

    /// The cipher suite.
    pub fn cipher_suite(&self) -> CipherSuite {
        self.negotiated.suite
    }

    /// The (EC)DHE group, None for psk_ke.
    pub fn group(&self) -> Option<Group> {
        self.negotiated.group
    }

    /// The PSK identity the client used (on a target: which host this is).
    pub fn psk_identity(&self) -> &[u8] {
        &self.negotiated.identity
    }

    /// Everything the handshake agreed on.
    pub fn negotiated(&self) -> &Negotiated {
        &self.negotiated
    }

    /// Counters.
    pub fn stats(&self) -> &SessionStats {
        &self.stats
    }
}

impl fmt::Debug for Session {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Session")
            .field("role", &self.role)
            .field("negotiated", &self.negotiated)
            .field("peer_closed", &self.peer_closed)
            .field("we_closed", &self.we_closed)
            .field("failed", &self.failed)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

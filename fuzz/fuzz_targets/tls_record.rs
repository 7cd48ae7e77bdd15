//! The session's record parser and open path: a server session writes a fuzzer-chosen mix of genuine
//! records, raw records of any content type, KeyUpdates and raw bytes, with bits flipped; the client
//! session opens the stream fed in pieces. Both sessions renew their keys on their own after a few
//! records (KeyUpdates inside coalesced records, twice in a row, answered or not), and the fuzzer may
//! change the server's limits midway. Never panic; a failing call leaves the plaintext buffer as it was;
//! once failed, the session stays failed with the same error; no genuine record is sealed past the hard
//! limit.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nvpoll_tls::{
    ClientConfig, Handshake, HashAlg, KeyLimits, Psk, ServerConfig, Session, TlsError,
};

const ID: &str = "NVMe0R01 nqn.fuzz-host nqn.fuzz-subsys";

/// A session pair over psk_ke (no ECDHE: cheaper per input).
fn pair() -> (Session, Session) {
    let psk = Psk::new(&[0x5a; 32], HashAlg::Sha256);
    let mut c = ClientConfig::new(ID, psk.clone());
    c.groups.clear();
    c.key_shares.clear();
    c.allow_psk_ke = true;
    let mut s = ServerConfig::with_psk(ID, psk);
    s.allow_psk_ke = true;
    let (mut c, mut to_s) = Handshake::client(c).unwrap();
    let mut s = Handshake::server(s);
    let mut to_c = Vec::new();
    while !(c.is_done() && s.is_done()) {
        let p = s.read(&to_s, &mut to_c).unwrap();
        to_s.drain(..p.consumed);
        let p = c.read(&to_c, &mut to_s).unwrap();
        to_c.drain(..p.consumed);
    }
    (c.into_session().unwrap(), s.into_session().unwrap())
}

fuzz_target!(|data: &[u8]| {
    let Some((&step, mut data)) = data.split_first() else {
        return;
    };
    let (mut client, mut server) = pair();
    let renew = KeyLimits::renew_after(1 + u64::from(step % 8)).unwrap();
    client.set_key_limits(renew).unwrap();
    server.set_key_limits(renew).unwrap();
    let mut wire = Vec::new();
    while data.len() >= 2 {
        let (op, len) = (data[0], usize::from(data[1]));
        let body = &data[2..(2 + len).min(data.len())];
        data = &data[2 + body.len()..];
        match op % 7 {
            0 => wire.extend_from_slice(body),
            1 => {
                if server.seal(&[body, body], &mut wire).is_ok() && !body.is_empty() {
                    if let Some(hard) = server.key_limits().hard_limit {
                        assert!(server.records_under_write_key() <= hard, "sealed past the limit");
                    }
                }
            }
            2 => {
                if let Some((&t, b)) = body.split_first() {
                    let _ = server.dangerous_seal_raw(t, b, &mut wire);
                }
            }
            3 => {
                if body.len() >= 3 && !wire.is_empty() {
                    let at = (usize::from(body[0]) << 8 | usize::from(body[1])) % wire.len();
                    wire[at] ^= body[2] | 1;
                }
            }
            4 => {
                let _ = server.update_keys(op & 8 != 0, &mut wire);
            }
            5 => {
                let limits = KeyLimits {
                    update_after: body.first().map(|&n| u64::from(n)),
                    hard_limit: body.get(1).map(|&n| u64::from(n)),
                };
                // Refused (and the old limits kept) unless update_after is below hard_limit.
                let before = server.key_limits();
                if server.set_key_limits(limits).is_err() {
                    assert_eq!(server.key_limits(), before);
                }
            }
            _ => {
                // A header claiming any length.
                wire.extend_from_slice(&[23, 3, 3]);
                wire.extend_from_slice(&body.get(..2).unwrap_or(&[0xff, 0xff]));
            }
        }
    }
    let mut plain = Vec::new();
    let mut input = Vec::new();
    let mut failed: Option<TlsError> = None;
    for piece in wire.chunks(usize::from(step).max(1) * 7) {
        input.extend_from_slice(piece);
        let before = plain.len();
        match client.open(&input, &mut plain) {
            Ok(n) => {
                assert!(failed.is_none());
                assert!(n <= input.len());
                input.drain(..n);
            }
            Err(e) => {
                assert_eq!(plain.len(), before);
                if let Some(f) = &failed {
                    assert_eq!(f, &e);
                }
                if e != TlsError::Closed {
                    assert_eq!(client.error(), Some(&e));
                }
                failed = Some(e);
            }
        }
    }
    let _ = client.write_pending(&mut Vec::new());
});
